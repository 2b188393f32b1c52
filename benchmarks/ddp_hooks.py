#!/usr/bin/env python
"""DDP communication hooks on emulated hosts: no hook, PyTorch's fp16 and PowerSGD hooks, and
hvd_topk's, training a real model (or, with ``--loss synthetic``, on its tensor shapes alone),
one rank per host with a shaped link.

One ``torchrun`` per host and method (``--nnodes P --node_rank i``, static rendezvous at host 0,
gloo over the emulated links; tools/emulated_hosts.py), or with ``--interleave`` one per host
running every method, their timed steps interleaved: step i runs each method once, the order
rotating with i, so that the machine's drift over minutes (the ``none`` step has moved between
205 and 415 ms from one job to the next) falls on every method alike. A step =
``zero_grad(set_to_none=True)``, forward, backward, ``opt.step()`` (SGD). With ``--loss real``
(the default since 2026-12-05) the forward and backward are the model's own (benchmarks/_models.py:
ResNet-50 on ``--batch`` synthetic ``--image-size`` images a rank, cross-entropy; GPT-2 small on
``--batch`` sequences of ``--context`` synthetic tokens): DDP reduces its buckets as they fill,
while the rest of the backward runs, as in training. With ``--loss synthetic`` (every result file
before 2026-12-05) the loss is ``sum_p (p * c_p).sum()`` over the model's shapes (any of
tools/shapes.py's, BERT-base too): autograd deposits a fresh ``p.grad`` per parameter, in
reverse order, but there is no model compute for the exchanges to overlap with, which flatters
compression (say so where it is quoted). The median over ``--steps`` of the slowest rank's step, after ``--warmup``
steps plus ``trial_warmup()`` for hvd_topk's trial, every method alike (DDP rebuilds its buckets after the first; PowerSGD
starts compressing at step 2, its minimum). ``none`` is the same step without DDP: what the
others add to it is their exchange overhead. Methods:

- ``none``: no DDP, no exchange; ``ddp``: DDP's default allreduce (fp32, 25 MB buckets);
- ``noop`` (a reference, not a method: no exchange, the ranks drift apart): DDP with a hook that
  hands its bucket back unchanged, so its overhead is what DDP itself adds at these settings
  (the copies into and out of its buckets, the hook's plumbing);
- ``ef-floor`` (a reference, not a method: nothing is sent): DDP with a hook that does only the
  memory work every error-feedback hook must, ``residual += bucket`` and a fresh dense result
  (``bucket.zero_()``; nothing selected), so its overhead is the least a Top-K hook with
  residuals can add here before selecting, encoding, the wire and decoding;
- ``fp16``: PyTorch's ``fp16_compress_hook``;
- ``powersgd-rR``: PowerSGD rank R (``PowerSGDState(matrix_approximation_rank=R,
  start_powerSGD_iter=2)``, one DDP bucket: with several its chained allreduces abort on gloo);
- ``topk``: ``hvd_topk.ddp.TopKState(density=--density)``, DDP's 25 MB buckets; its default
  ``exchange="auto"`` runs its measured trial in extra warm-up steps, so the timed steps use the
  family it chose (named in the table);
- ``topk-fp16v``: the same with ``fp16_values=True`` (the recommended scheme's 16-bit values: 6
  bytes a pair instead of 8);
- ``topk-compact``: the same with ``compact=True`` (about 2.4 bytes a pair: an Elias-Fano index
  and an 8-bit log-scale value, ``hvd_topk.compact``; the allgather or dense);
- ``topk-view``: the same with ``gradient_as_bucket_view=True`` (not DDP's default: the gradients
  are views of the buckets, which saves DDP two copies of the model's gradients per step);
- ``topk-ag``, ``topk-sar``: the hook with its exchange forced (``exchange="allgather"``,
  ``"sparse_allreduce"``) instead of measured.

``--bucket-view`` gives every DDP method ``gradient_as_bucket_view=True`` (DDP's default is
False, and the tables say which was used): the same saving for every hook, so the overheads
compare the hooks' own work.

Each rank's link's bytes (eth0 tx counters over the timed steps) are recorded too: the busiest
link sets the pace.

CPU only: PowerSGD's matrix products cost far less on a GPU. With P = 4 the 4 ranks share this
machine's 2 cores.

    sudo .venv/bin/python benchmarks/ddp_hooks.py                          # P 2 and 4, 1 and 10 Gbit
    sudo .venv/bin/python benchmarks/ddp_hooks.py --ranks 2 --rates 1gbit --steps 3 --warmup 3 \\
        --output-name ddp-hooks-smoke                                      # quick check
    sudo .venv/bin/python benchmarks/ddp_hooks.py --ranks 2 --rates 1gbit --rounds 5 \\
        --methods none fp16 powersgd-r4 topk topk-fp16v                    # the ratios' spread
    sudo .venv/bin/python benchmarks/ddp_hooks.py --ranks 2 --rates 1gbit --rounds 3 --interleave \\
        --methods none fp16 powersgd-r4 topk                               # the same, in one job each
    sudo .venv/bin/python benchmarks/ddp_hooks.py --ranks 2 --rates 1gbit --rounds 3 --interleave \\
        --methods none noop ef-floor fp16 topk                             # against the floor under any hook
Results: benchmarks/results/exchange/<output-name>.{json,md} (default ddp-hooks-MODEL-real, or
ddp-hooks-MODEL with ``--loss synthetic``).
"""

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as common  # noqa: E402
import _models as models  # noqa: E402  (the real models, for --loss real)

METHODS = ("none", "noop", "ef-floor", "ddp", "fp16", "powersgd-r1", "powersgd-r2", "powersgd-r4", "topk", "topk-fp16v",
           "topk-compact", "topk-view", "topk-ag", "topk-sar")
FORCED = {"topk-ag": "allgather", "topk-sar": "sparse_allreduce"}
REFERENCES = ("noop", "ef-floor")  # DDP with a hook that exchanges nothing: what the others are measured against
PORT = 29511


# ---- one rank ----------------------------------------------------------------------------------
def trial_warmup():
    """The warm-up steps every method takes beyond ``--warmup``: hvd_topk's ``exchange="auto"``
    measures its trial there (after DDP's rebuild, up to 4 families x (1 + 3) steps, and one to
    decide), so that the timed steps use the family it chose. Every method warms up as long:
    PowerSGD's first compressed steps were its slowest (with 4 warm-up steps against our 23,
    one of them fell in its timed steps, until 2026-12-05)."""
    import hvd_topk.ddp
    return hvd_topk.ddp.TRIAL_FROM_STEP + 4 * 4 + 1


class Method:
    """One method's model (its own copy: the real model, or a parameter per shape), DDP wrapper,
    hook state and optimizer; every method starts from the same weights."""

    def __init__(self, method, args, shapes, torch):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        from torch.nn.parallel import DistributedDataParallel as DDP

        import hvd_topk.ddp

        class Shapes(torch.nn.Module):
            def __init__(self):
                super().__init__()
                gen = torch.Generator().manual_seed(0)
                self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=gen) * 0.01)
                                                     for s in shapes)

            def forward(self, cs):
                return common.forward(list(self.params), cs)

        self.method, self.state, self.loss = method, None, args.loss
        if args.loss == "real":
            torch.manual_seed(0)
            self.model = models.build(args.model, torch)
        else:
            self.model = Shapes()
        self.runner = self.model
        if method != "none":
            one_bucket = method.startswith("powersgd")
            self.runner = DDP(self.model, bucket_cap_mb=1e5 if one_bucket else 25,
                              gradient_as_bucket_view=args.bucket_view or method.endswith("-view"))
            if method == "fp16":
                self.runner.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif method in REFERENCES:
                self.runner.register_comm_hook({}, floor_hook if method == "ef-floor" else noop_hook)
            elif one_bucket:
                self.state = powersgd.PowerSGDState(process_group=None,
                                                    matrix_approximation_rank=int(method.split("-r")[1]),
                                                    start_powerSGD_iter=2)
                self.runner.register_comm_hook(self.state, powersgd.powerSGD_hook)
            elif method.startswith("topk"):
                self.state = hvd_topk.ddp.TopKState(density=args.density, exchange=FORCED.get(method, "auto"),
                                                    fp16_values=method == "topk-fp16v",
                                                    compact=method == "topk-compact")
                hvd_topk.ddp.register(self.runner, self.state)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.warmup = args.warmup + trial_warmup()
        self.model_name = args.model
        self.steps_done, self.times, self.tx = 0, [], 0

    def step(self, batch):
        """One training step on ``batch`` (the real model's inputs, or the synthetic loss's
        constants); its seconds."""
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = models.loss(self.model_name, self.runner, batch) if self.loss == "real" else self.runner(batch)
        loss.backward()
        self.opt.step()
        self.steps_done += 1
        return time.perf_counter() - t0


def noop_hook(residuals, bucket):
    """``noop``: the bucket back unchanged (no exchange)."""
    import torch
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def floor_hook(residuals, bucket):
    """``ef-floor``: error feedback's own memory passes and nothing else: the bucket is added
    into this bucket's residual (read both, write the residual) and DDP is handed a dense result
    (the bucket, zeroed: nothing selected, nothing sent)."""
    import torch
    buffer = bucket.buffer()
    residual = residuals.get(bucket.index())
    if residual is None or residual.numel() != buffer.numel():
        residual = residuals[bucket.index()] = torch.zeros_like(buffer)
    residual.add_(buffer)
    buffer.zero_()
    return noop_hook(residuals, bucket)  # the bucket, zeroed


def worker(args):
    """Every method of ``--method`` (comma-separated) on this rank: each warmed up alone, then,
    with several, their timed steps interleaved (step i runs every method once, the order
    rotating with i, a barrier before each), so that the machine's drift over minutes falls on
    every method alike; each method's link bytes are counted around its own timed steps."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    shapes = common.model_shapes(args.model)
    if args.loss == "real":
        consts = models.inputs(args.model, torch, args.pool, seed=7 + rank, batch=args.batch,
                               image_size=args.image_size, context=args.context)
    else:
        consts = common.loss_constants(shapes, args.pool, seed=rank, torch=torch)
    methods = [Method(m, args, shapes, torch) for m in args.method.split(",")]
    for m in methods:
        for _ in range(m.warmup):
            m.step(consts[m.steps_done % args.pool])
        if m.method.startswith("topk"):
            common.trial_over(m.method, m.state.stats())
            m.state.bytes_before_timing = m.state.stats()["bytes_sent"]
    counted = link_tx_bytes() is not None
    for i in range(args.steps):
        for m in methods[i % len(methods):] + methods[:i % len(methods)]:
            dist.barrier()
            tx = link_tx_bytes()
            m.times.append(m.step(consts[m.steps_done % args.pool]))
            if counted:
                m.tx += link_tx_bytes() - tx
    rows = []
    for m in methods:
        every = [None] * size
        wire = m.tx / args.steps if counted else None
        dist.all_gather_object(every, (m.times, float(sum(p.detach().double().sum() for p in m.model.parameters())),
                                       wire))
        if rank != 0:
            continue
        slowest = [max(t[i] for t, _, _ in every) for i in range(args.steps)]
        sums = [s for _, s, _ in every]
        row = {"method": m.method, "median_ms": 1e3 * statistics.median(slowest), "min_ms": 1e3 * min(slowest),
               "max_ms": 1e3 * max(slowest), "step_ms_slowest_rank": [1e3 * t for t in slowest],
               "ranks_agree": None if m.method in ("none", "noop") else all(s == sums[0] for s in sums),
               "mb_per_rank_step": bytes_sent(m.method, shapes, m.state, args.steps) / 1e6,
               "wire_tx_mb_each_rank": [None if w is None else w / 1e6 for _, _, w in every]}
        if m.method.startswith("topk"):
            st = m.state.stats()
            row["exchange"] = st["exchange_family"]
            row["exchange_reason"] = st.get("exchange_reason")
        rows.append(row)
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def link_tx_bytes():
    """This host's link's tx byte counter (eth0 of the emulated host), or None."""
    try:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


def bytes_sent(method, shapes, state, steps):
    """Bytes each rank hands to the network per step: DDP fp32 / fp16 the whole model; PowerSGD
    rank r (n + m) r floats per matrix it compresses (viewed n x m, at least 2x smaller: its
    ``min_compression_rate``), the rest dense; hvd_topk's own count over the timed steps."""
    n = common.numel(shapes)
    if method == "none" or method in REFERENCES:
        return 0
    if method == "ddp":
        return 4 * n
    if method == "fp16":
        return 2 * n
    if method.startswith("powersgd"):
        r, total = int(method.split("-r")[1]), 0
        for s in shapes:
            rows = s[0]
            cols = max(1, math.prod(s) // rows)
            size = rows * cols
            low = len(s) > 1 and (rows + cols) * min(r, rows, cols) * 2 < size
            total += 4 * ((rows + cols) * min(r, rows, cols) if low else size)
        return total
    return (state.stats()["bytes_sent"] - state.bytes_before_timing) / steps


# ---- the driver --------------------------------------------------------------------------------
def run_methods(eh, P, method, args, out):
    """One torchrun per emulated host; all of them together are one job, running ``method``
    (one, or several comma-separated: interleaved). Returns its rows and the command."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), GLOO_SOCKET_IFNAME="eth0",
               PYTHONPATH=":".join(x for x in (os.environ.get("PYTHONPATH"), str(common.REPO)) if x))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(P), "--nproc_per_node", "1",
            "--master_addr", eh.hosts[0].ip, "--master_port", str(PORT)]
    worker_argv = [str(Path(__file__).resolve()), "--worker", "--method", method, "--model", args.model,
                   "--density", str(args.density), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--pool", str(args.pool), "--threads", str(args.threads), "--out", str(out),
                   "--loss", args.loss, "--batch", str(args.batch), "--image-size", str(args.image_size),
                   "--context", str(args.context),
                   *(["--bucket-view"] if args.bucket_view else [])]
    procs = [subprocess.Popen(eh.host_cmd(i, [*argv, "--node_rank", str(i), *worker_argv]), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=common.REPO)
             for i in range(P)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=args.timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"{method} at P={P} timed out after {args.timeout}s")
    if not out.exists():
        raise SystemExit(f"{method} at P={P} failed:\n" + "\n".join(o[-3000:] for o in outputs))
    return json.loads(out.read_text()), shlex.join([*argv, "--node_rank", "I", *worker_argv])


def wire_cell(each):
    """The median rank's and the busiest rank's link tx MB per step, and their ratio."""
    if not each or any(w is None for w in each):
        return "-"
    median, busiest = statistics.median(each), max(each)
    return f"{median:.2f}, {busiest:.2f} ({busiest / median:.2f}x)" if median >= 0.01 else f"{median:.2f}, {busiest:.2f}"


def render(report):
    lines = ["# DDP communication hooks on emulated hosts (CPU only)", "",
             f"Date (UTC): {report['date_utc']}  ",
             f"Machine: {common.summary(report['machine'])}  ",
             f"Command: `{report['command']}`  ",
             f"Model shapes: {report['model']} ({report['params']:,} parameters in {report['tensors']} tensors); "
             f"{report['settings']['warmup']} + {trial_warmup()} warm-up steps (the second for auto's trial, every method) + "
             f"{report['settings']['steps']} timed steps, median of the "
             "slowest rank; one rank per emulated host (tbf-shaped link, burst 1 ms of the rate); "
             "torch.distributed gloo; PowerSGD in one DDP bucket, the others in DDP's 25 MB buckets"
             + ("; every DDP method with `gradient_as_bucket_view=True` (`--bucket-view`; DDP's default is "
                "False)" if report["settings"].get("bucket_view") else "")
             + ("; the methods in one job, their timed steps interleaved (`--interleave`: step i runs every "
                "method once, the order rotating with i, a barrier before each)."
                if report["settings"].get("interleave") else "; one job per method, run in turn."),
             "", "Overhead = step - the `none` step (the same forward, backward and SGD step without DDP). "
             + loss_sentence(report["settings"], report["model"])
             + "CPU only: PowerSGD's matrix products are far cheaper on a GPU.", ""]
    for run in report["runs"]:
        rows = {r["method"]: r for r in run["rows"]}
        base = rows.get("none", {}).get("median_ms")
        lines += [f"## P = {run['P']}, {run['rate']}" + (" (4 ranks share 2 cores)" if run["P"] > 2 else "")
                  + (f", round {run['round']}" if report["settings"].get("rounds", 1) > 1 else ""), "",
                  "| method | step ms (median, min-max) | overhead ms | MB per rank and step | "
                  "wire tx MB/step: median rank, busiest (ratio) | ranks agree |",
                  "|---|---:|---:|---:|---:|---|"]
        for m, r in rows.items():
            over = "" if base is None or m == "none" else f"{r['median_ms'] - base:+.1f}"
            name = f"{m} (auto chose {r['exchange']})" if r.get("exchange") else m
            lines.append(f"| {name} | {r['median_ms']:.1f} ({r['min_ms']:.0f}-{r['max_ms']:.0f}) | {over} | "
                         f"{r['mb_per_rank_step']:.2f} | {wire_cell(r.get('wire_tx_mb_each_rank'))} | "
                         f"{agree_cell(r['method'], r['ranks_agree'])} |")
        reasons = [f"{m}: {r['exchange_reason']}" for m, r in rows.items() if r.get("exchange_reason")]
        if reasons:
            lines += ["", "auto's trial: " + "; ".join(reasons)]
        for mine, peer, theirs, ours in overhead_ratios(rows):
            lines += ["", f"Overhead ratio {peer} / {mine}: {theirs:.1f} / {ours:.1f} ms = {ratio(theirs, ours):.1f}x"]
        if base is not None and "fp16" in rows and "ef-floor" in rows:
            budget, floor = (rows["fp16"]["median_ms"] - base) / 8, rows["ef-floor"]["median_ms"] - base
            lines += ["", f"8x below the fp16 hook's overhead leaves {budget:.1f} ms; error feedback's memory "
                          f"passes under DDP (`ef-floor`) take {floor:.1f} ms"
                      + (f" (DDP's own part, `noop`: {rows['noop']['median_ms'] - base:.1f} ms)" if "noop" in rows else "")
                      + f": {budget - floor:+.1f} ms left for selection, encoding, the wire and decoding"]
        lines.append("")
    rounds = {}
    for run in report["runs"]:
        for mine, peer, theirs, ours in overhead_ratios({r["method"]: r for r in run["rows"]}):
            rounds.setdefault((run["P"], run["rate"], peer, mine), []).append(ratio(theirs, ours))
    if any(len(v) > 1 for v in rounds.values()):
        lines += ["## Overhead ratios over the rounds", "",
                  "| P, link | ratio | each round | median | lowest |", "|---|---|---|---:|---:|"]
        for (P, rate, peer, mine), values in rounds.items():
            lines.append(f"| {P}, {rate} | {peer} / {mine} | {', '.join(f'{v:.1f}x' for v in values)} | "
                         f"{statistics.median(values):.1f}x | {min(values):.1f}x |")
        lines.append("")
    return "\n".join(lines) + "\n"


def loss_sentence(settings, model):
    """What the step computed: the model's own loss, or the synthetic one (every report before
    2026-12-05, whose settings have no ``loss``)."""
    if settings.get("loss", "synthetic") == "synthetic":
        return ("The loss is synthetic, `sum_p (p * c_p).sum()` over the shapes: its backward deposits a fresh "
                "gradient per parameter, in a model's order, but holds no model compute for DDP to overlap its "
                "exchanges with, which flatters compression. ")
    data = (f"{settings['batch']} synthetic {settings['image_size']}x{settings['image_size']} images a rank"
            if model == "resnet50" else f"{settings['batch']} sequence{'s' if settings['batch'] != 1 else ''} of {settings['context']} "
            "synthetic tokens a rank")
    return (f"The loss is the model's own: a real forward and backward of {model} (benchmarks/_models.py) on {data}, "
            "cross-entropy; DDP reduces its buckets while the rest of the backward runs, as in training. ")


def agree_cell(method, agree):
    """``ranks agree``: yes / NO, or why it does not apply (no DDP; a hook that exchanges nothing)."""
    if method == "none":
        return "n/a (no DDP)"
    if method == "noop":
        return "n/a (nothing exchanged)"
    return "yes" if agree else "NO"


def overhead_ratios(rows):
    """``(ours, peer, peer's overhead ms, ours ms)`` for each hvd_topk method against the fp16
    hook and PowerSGD rank 4, where the run has them and the ``none`` step."""
    base = rows.get("none", {}).get("median_ms")
    if base is None:
        return []
    return [(mine, peer, rows[peer]["median_ms"] - base, rows[mine]["median_ms"] - base)
            for mine in rows if mine.startswith("topk") for peer in ("fp16", "powersgd-r4") if peer in rows]


def ratio(theirs, ours):
    return theirs / ours if ours > 0 else float("inf")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--model", default="resnet50", choices=sorted(common.MODELS))
    ap.add_argument("--loss", default="real", choices=("real", "synthetic"),
                    help="real: the model's own forward and backward (resnet50, gpt2-small); synthetic: "
                         "sum_p (p * c_p).sum() over its shapes, no model compute to overlap (every result "
                         "before 2026-12-05)")
    ap.add_argument("--batch", type=int, default=None,
                    help="--loss real: images (resnet50, default 8) or sequences (gpt2-small, default 1) a rank")
    ap.add_argument("--image-size", type=int, default=32, help="--loss real, resnet50: pixels a side")
    ap.add_argument("--context", type=int, default=128, help="--loss real, gpt2-small: tokens a sequence")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--pool", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the methods this many times in turn at each P and rate (the machine's noise, "
                         "as the spread of the overhead ratios over the rounds)")
    ap.add_argument("--bucket-view", action="store_true",
                    help="gradient_as_bucket_view=True for every DDP method (DDP's default is False: it copies "
                         "the gradients into its buckets and back, for every hook alike)")
    ap.add_argument("--interleave", action="store_true",
                    help="run the methods in one job per P, rate and round, their timed steps interleaved (each "
                         "step runs every method once, in rotating order), so that the machine's drift over "
                         "minutes falls on every method alike, not on whichever ran during it")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--output-name", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.loss == "real" and args.model not in models.NAMES:
        ap.error(f"--loss real trains {' or '.join(models.NAMES)}; {args.model} only with --loss synthetic")
    if args.batch is None:
        args.batch = 8 if args.model == "resnet50" else 1
    if min(args.batch, args.image_size, args.context) < 1:
        ap.error("--batch, --image-size and --context must be >= 1")
    if args.worker:
        return worker(args)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.warmup < 3:
        ap.error("--warmup must be >= 3 (DDP rebuilds its buckets after step 1; PowerSGD compresses from step 2)")
    name = args.output_name or f"ddp-hooks-{args.model}" + ("-real" if args.loss == "real" else "")
    info, started, runs = common.machine_info(), time.time(), []
    shapes = common.model_shapes(args.model)
    report = {}
    for P in args.ranks:
        with common.emulated_hosts.EmulatedHosts(P, rate=args.rates[0], sshd=False) as eh:
            for rate in args.rates:
                eh.set_rate(rate)
                for round_ in range(1, args.rounds + 1):
                    rows = []
                    for method in ([",".join(args.methods)] if args.interleave else args.methods):
                        print(f"P={P} {rate} {method}" + (f" round {round_}" if args.rounds > 1 else "") + " ... ",
                              end="", flush=True)
                        got, cmd = run_methods(eh, P, method, args,
                                               eh.tmpdir / f"{P}-{rate}-{method.replace(',', '+')}-{round_}.json")
                        for row in got:
                            row["torchrun"] = cmd
                        rows += got
                        print(", ".join(f"{r['method']} {r['median_ms']:.1f} ms" for r in got), flush=True)
                    runs.append({"P": P, "rate": rate, "round": round_, "rows": rows})
                report = {"benchmark": "ddp_hooks", "command": shlex.join([".venv/bin/python", "benchmarks/ddp_hooks.py",
                                                                           *(sys.argv[1:] if argv is None else argv)]),
                          "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "machine": info,
                          "model": args.model, "params": common.numel(shapes), "tensors": len(shapes),
                          "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "method")},
                          "wall_s": time.time() - started, "runs": runs}
                common.write_report(common.RESULTS / "exchange" / name, report, render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
