"""What the distributed optimizer adds to a backward pass, against one streaming pass: the
acceptance measurement of issue 10.

Two ranks on ONE host (``mpirun -np 2`` from tools/launch.py; this script launches itself
as the workers), Horovod's defaults, one torch thread per rank. For each model (ResNet-50's 161
gradient shapes, 25,557,032 fp32 values; BERT-base's 199, 109,482,240), every rank builds, in ONE
process, one parameter set per mode and then steps the modes round-robin, one step of each per
iteration, starting at a different mode each iteration, so allocator state and machine noise hit
all modes alike. A step is what training does (see benchmarks/exchange.py, grad mode
``realistic``): ``zero_grad(set_to_none=True)`` and a forward ``loss = sum_p (p * c_p).sum()``
(fixed random c_p, ``--pool`` sets cycled) outside the timer, then, timed, ``loss.backward()`` --
autograd allocates a fresh ``p.grad`` for every parameter and hooks fire in backward order -- and,
for the distributed modes, ``opt.synchronize()``. Modes:

    baseline       the plain backward, no distributed optimizer
    topk-tensor    hvd_topk.DistributedOptimizer(TopK(density)), selection_scope="tensor"
                   (an hvd_topk without that option: its default, i.e. per-tensor selection)
    topk-bucket    the same with selection_scope="bucket" (skipped where the option is rejected)
    topk-fp16v     topk-tensor with TopK(fp16_values=True): 16-bit values, as the AdamW recipe sends
    horovod-dense  hvd.DistributedOptimizer, no compression (reference)
    stream         one streaming pass ``r += g; g.zero_()`` over a flat pair of fp32 tensors with
                   as many elements as the model, timed with torch ops (one thread)

The topk modes run ``--exchange`` (default ``auto``, hvd_topk's default: its first steps time
the strategies, dense included, and keep the fastest). With ``auto`` each topk mode first steps
alone for its trial (up to _common.AUTO_TRIAL_STEPS steps, before the round-robin): the trial
times one ``synchronize()`` end to the next, which in the round-robin would also hold every
other mode's step. The timed steps then run what it chose (the table names it); a user pays the
trial once per job, not per step.

Ranks are aligned by a scalar allreduce before every timed step; a step's time is the slower
rank's; the table gives the median over ``--steps`` after the warm-up iterations, the added time
(mode - baseline) and that as a multiple of the streaming pass. It also gives the CPU time the
timed step took on each rank's main thread and on its other threads (Horovod's background
thread: the one other thread that runs; from Linux's /proc/self/task/*/schedstat), medians per
rank averaged over the ranks: where the added time goes when ranks and their background threads
share few cores.

    .venv/bin/python benchmarks/overhead.py                                  # both models
    .venv/bin/python benchmarks/overhead.py --models resnet50 --steps 5 --output-name overhead-smoke
    PYTHONPATH=/work/before .venv/bin/python benchmarks/overhead.py --output-name overhead-before
                                                       # measure another checkout's hvd_topk
    .venv/bin/python benchmarks/overhead.py --mca mpi_yield_when_idle=1 --output-name overhead-yield
                                   # OpenMPI told the host is oversubscribed: waiting ranks yield
    .venv/bin/python benchmarks/overhead.py --exchange allgather --output-name overhead-allgather
                                   # every rank selects every bucket (no trial)

Two ranks on two cores, each with Horovod's background thread, oversubscribe the cores; OpenMPI
spins while a rank waits in a collective unless ``mpi_yield_when_idle`` is set (the emulated
hosts of benchmarks/exchange.py set it). Both ways are committed, labelled by their command.

Writes benchmarks/results/overhead/<output-name>.{json,md} (command, machine, date, hvd_topk's file).
"""

import argparse
import datetime
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common  # noqa: E402  (tools, shapes, the realistic step, report writing)

RESULTS = common.RESULTS / "overhead"

MODES = ("baseline", "topk-tensor", "topk-bucket", "topk-fp16v", "horovod-dense", "stream")


def label(mode, density, n):
    return {
        "baseline": "baseline: plain backward, no distributed optimizer",
        "topk-tensor": f"hvd_topk.DistributedOptimizer {density * 100:g}%, selection_scope=\"tensor\"",
        "topk-bucket": f"hvd_topk.DistributedOptimizer {density * 100:g}%, selection_scope=\"bucket\"",
        "topk-fp16v": f"hvd_topk.DistributedOptimizer {density * 100:g}%, TopK(fp16_values=True)",
        "horovod-dense": "Horovod hvd.DistributedOptimizer, dense (reference)",
        "stream": f"streaming pass r += g; g.zero_() over {n:,} fp32 (unit)",
    }[mode]


# ------------------------------------------------------------------------------------------------
# worker: every rank, under mpirun
# ------------------------------------------------------------------------------------------------
def build_mode(mode, shapes, density, hvd, hvd_topk, torch, exchange_name="auto"):
    """(params, optimizer or None, note) for one mode; None when the mode is not available.
    ``exchange_name`` other than "auto" (the library's default, so not passed) is forced."""
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    inner = torch.optim.SGD(params, lr=0.0)
    if mode == "baseline":
        return params, None, None
    if mode == "horovod-dense":
        named = [(f"dense.p{i}", p) for i, p in enumerate(params)]
        return params, hvd.DistributedOptimizer(inner, named_parameters=named,
                                                compression=hvd.Compression.none), None
    fp16_values = mode == "topk-fp16v"
    scope = "tensor" if fp16_values else mode.split("-")[1]
    named = [(f"{'fp16v' if fp16_values else scope}.p{i}", p) for i, p in enumerate(params)]
    comp = hvd_topk.TopK(density=density, fp16_values=True) if fp16_values else hvd_topk.TopK(density=density)
    forced = {} if exchange_name == "auto" else {"exchange": exchange_name}
    try:
        opt = hvd_topk.DistributedOptimizer(inner, named_parameters=named, compression=comp,
                                            selection_scope=scope, **forced)
        return params, opt, None
    except TypeError as e:  # an hvd_topk without the option (every rank fails alike)
        if scope == "bucket":
            return None, None, f"skipped: selection_scope rejected ({e})"
        opt = hvd_topk.DistributedOptimizer(inner, named_parameters=named, compression=comp)
        return params, opt, f"selection_scope rejected ({str(e)[:80]}...): the library's default (per tensor)"


def trial_steps(args):
    """Steps each topk mode takes alone before the round-robin: exchange="auto"'s trial."""
    auto = args.exchange == "auto" and any(m.startswith("topk") for m in args.modes)
    return common.AUTO_TRIAL_STEPS if auto else 0


def stats_snapshot(opt):
    return dict(opt.compression_stats()) if hasattr(opt, "compression_stats") else None


def run_model(model, args, hvd, hvd_topk, torch, say):
    machine = common.machine
    shapes = common.model_shapes(model)
    n = common.numel(shapes)
    rank = hvd.rank()
    consts = common.loss_constants(shapes, args.pool, 1234 + rank, torch)
    modes, notes = {}, {}
    for mode in args.modes:
        if mode == "stream":
            modes[mode] = (torch.randn(n), torch.randn(n))
            continue
        params, opt, note = build_mode(mode, shapes, args.density, hvd, hvd_topk, torch, args.exchange)
        if note:
            notes[mode] = note
            say(f"  [{model}] {mode}: {note}")
        if params is not None:
            modes[mode] = (params, opt)
    names = list(modes)
    times = {m: [] for m in names}
    cpu = {m: [] for m in names}  # (main thread, other threads) seconds per timed step
    main_thread = machine.main_thread_id()
    checks, stats0 = {}, {}

    def barrier():
        hvd.allreduce(torch.zeros(1), name="overhead.barrier", op=hvd.Sum)

    for mode in names:  # auto's trial, each topk mode alone (see the module docstring)
        if not mode.startswith("topk"):
            continue
        params, opt = modes[mode]
        for it in range(trial_steps(args)):
            common.zero_grad(opt, params)
            common.forward(params, consts[it % len(consts)]).backward()
            opt.synchronize()
            common.inner_step(opt)
        common.trial_finished({"opt": opt, "method": mode})
        say(f"  [{model}] {mode}: {trial_steps(args)} steps alone for exchange={args.exchange!r}'s trial")
    warmup = args.warmup
    total = warmup + args.steps
    started = time.time()
    for it in range(total):
        order = names[it % len(names):] + names[:it % len(names)]
        if it == warmup:
            stats0 = {m: stats_snapshot(modes[m][1]) for m in names
                      if m.startswith("topk") and modes[m][1] is not None}
        for mode in order:
            if mode == "stream":
                r, g = modes[mode]
                barrier()
                c0 = machine.thread_cpu_ns()
                t0 = time.perf_counter()
                r.add_(g)
                g.zero_()
                dt = time.perf_counter() - t0
                c1 = machine.thread_cpu_ns()
            else:
                params, opt = modes[mode]
                common.zero_grad(opt, params)
                loss = common.forward(params, consts[it % len(consts)])
                barrier()
                c0 = machine.thread_cpu_ns()
                t0 = time.perf_counter()
                loss.backward()
                if opt is not None:
                    opt.synchronize()
                dt = time.perf_counter() - t0
                c1 = machine.thread_cpu_ns()
                common.inner_step(opt)
                del loss
                if it == 0 and opt is not None:
                    s = torch.tensor([float(sum(p.grad.double().sum() for p in params))], dtype=torch.float64)
                    every = hvd.allgather(s, name=f"overhead.check.{mode}").tolist()
                    checks[mode] = len(set(every)) == 1
            if it >= warmup:
                times[mode].append(dt)
                cpu[mode].append(machine.cpu_split(c0, c1, main_thread))
        say(f"  [{model}] iteration {it + 1}/{total}: "
            + ("warm-up" if it < warmup else
               ", ".join(f"{m} {1e3 * times[m][-1]:.0f} ms" for m in names)) + " (rank 0)")
    rows = []
    for mode in names:
        every = hvd.allgather(torch.tensor([times[mode]], dtype=torch.float64), name=f"overhead.times.{mode}")
        slowest = every.max(dim=0).values.tolist()
        own = torch.tensor([[statistics.median(c[0] for c in cpu[mode]), statistics.median(c[1] for c in cpu[mode])]],
                           dtype=torch.float64)
        cpu_ms = (1e3 * hvd.allgather(own, name=f"overhead.cpu.{mode}").mean(dim=0)).tolist()
        row = {"mode": mode, "label": label(mode, args.density, n), "median_ms": 1e3 * statistics.median(slowest),
               "min_ms": 1e3 * min(slowest), "max_ms": 1e3 * max(slowest),
               "step_ms_slower_rank": [1e3 * t for t in slowest],
               "cpu_ms_main_thread": cpu_ms[0], "cpu_ms_other_threads": cpu_ms[1],
               "ranks_agree": checks.get(mode), "note": notes.get(mode)}
        opt = modes[mode][1] if mode != "stream" else None
        if mode in stats0 and stats0[mode] is not None:
            row["compression_stats_timed_steps"] = common.stats_difference(stats_snapshot(opt), stats0[mode])
            chose = row["compression_stats_timed_steps"].get("exchange_family")
            if chose:
                row["label"] += f", exchange={args.exchange!r}" + (f" (chose {chose})" if args.exchange == "auto" else "")
        rows.append(row)
    for mode in args.modes:
        if mode not in modes:
            rows.append({"mode": mode, "label": label(mode, args.density, n), "median_ms": None,
                         "note": notes.get(mode)})
    rows.sort(key=lambda r: MODES.index(r["mode"]))
    ref = {r["mode"]: r["median_ms"] for r in rows}
    for r in rows:
        if r["median_ms"] is not None and r["mode"] not in ("baseline", "stream") and "baseline" in ref:
            r["added_ms"] = r["median_ms"] - ref["baseline"]
            if ref.get("stream"):
                r["added_x_stream"] = r["added_ms"] / ref["stream"]
    del modes, consts
    gc.collect()
    return {"model": model, "tensors": len(shapes), "numel": n, "rows": rows,
            "wall_s": time.time() - started}


def worker(args):
    import torch
    import horovod.torch as hvd
    import hvd_topk

    torch.set_num_threads(1)
    hvd.init()
    say = (lambda *a: print(*a, flush=True)) if hvd.rank() == 0 else (lambda *a: None)
    say(f"hvd_topk from {hvd_topk.__file__}; {hvd.size()} ranks; torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)/rank; modes {args.modes}")
    models = [run_model(m, args, hvd, hvd_topk, torch, say) for m in args.models]
    if hvd.rank() == 0:
        Path(args.out).write_text(json.dumps({
            "models": models, "size": hvd.size(),
            "hvd_topk": common.hvd_topk_record(hvd_topk),
            "horovod_env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}}, indent=1))


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
def markdown(report):
    s = report["settings"]
    trial = (f" after {s['trial_iterations']} steps of each topk mode alone for exchange=\"auto\"'s trial"
             if s.get("trial_iterations") else "")
    lines = ["# Overhead of the distributed optimizer on backward, vs one streaming pass", "",
             f"- command: `{report['command']}`",
             f"- date: {report['date_utc']}; machine: {common.summary(report['machine'])}",
             f"- hvd_topk: `{report['hvd_topk']['default_topk']}` from `{report['hvd_topk']['file']}` "
             f"(git {report['hvd_topk'].get('git') or '?'})",
             f"- {report['size']} ranks on one host (`{report['mpirun']}`), Horovod defaults"
             f"{' + ' + str(report['horovod_env']) if report['horovod_env'] else ''}, one torch thread per "
             f"rank; modes stepped round-robin in one process per rank; {s['warmup']} warm-up"
             f"{trial} + {s['steps']} timed iterations; median of the slower rank's step",
             "- step: zero_grad(set_to_none=True) + forward `sum_p (p * c_p).sum()` untimed; timed: "
             "backward (fresh p.grad, hooks fire) + synchronize(); added = mode - baseline; "
             "x stream = added / the streaming pass's median",
             "- CPU ms: the timed step's CPU time on each rank's main thread / its other threads "
             "(Horovod's background thread), medians per rank, mean of the ranks", ""]
    for m in report["models"]:
        lines += [f"## {m['model']}: {m['tensors']} tensors, {m['numel']:,} fp32 values "
                  f"({m['wall_s']:.0f} s)", "",
                  "| mode | median ms | min-max ms | added ms | added / streaming pass | CPU ms main / background | ranks agree |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for r in m["rows"]:
            if r["median_ms"] is None:
                lines.append(f"| {r['label']} | - | - | - | - | - | skipped (note below) |")
                continue
            added = f"{r['added_ms']:+.1f}" if "added_ms" in r else "-"
            ratio = f"{r['added_x_stream']:.1f}x" if "added_x_stream" in r else "-"
            cpu = (f"{r['cpu_ms_main_thread']:.1f} / {r['cpu_ms_other_threads']:.1f}"
                   if "cpu_ms_main_thread" in r else "-")
            lines.append(f"| {r['label']} | {r['median_ms']:.1f} | {r['min_ms']:.0f}-{r['max_ms']:.0f} | "
                         f"{added} | {ratio} | {cpu} | {common.agree(r.get('ranks_agree'))} |")
        notes = [f"{r['mode']}: {r['note']}" for r in m["rows"] if r.get("note")]
        lines += [""] + [f"Note: {x}  " for x in notes] + ([""] if notes else [])
    return "\n".join(lines)


def driver(args, argv):
    launch, machine = common.launch, common.machine
    stream = common.emulated_hosts.stream
    info = common.machine_info()
    env_names = ("OMP_NUM_THREADS", "PYTHONPATH") if os.environ.get("PYTHONPATH") else ("OMP_NUM_THREADS",)
    with tempfile.TemporaryDirectory(prefix="hvd-topk-overhead-") as tmp:
        out = Path(tmp) / "result.json"
        worker_argv = [Path(__file__).resolve(), "--worker", "--out", out, "--models", *args.models,
                       "--modes", *args.modes, "--density", args.density, "--steps", args.steps,
                       "--warmup", args.warmup, "--pool", args.pool, "--exchange", args.exchange]
        cmd = launch.mpirun_command(args.np, worker_argv, env_names=env_names, mca=args.mca)
        print(f"overhead benchmark: {shlex.join(map(str, cmd))}", flush=True)
        started = time.time()
        rc, _ = stream(cmd, timeout=args.timeout, keep=False)
        if rc != 0 or not out.exists():
            raise SystemExit(f"mpirun failed (exit {rc})")
        res = json.loads(out.read_text())
    res["hvd_topk"]["git"] = machine.git_commit(Path(res["hvd_topk"]["file"]).parent)
    pythonpath = os.environ.get("PYTHONPATH")
    report = {"benchmark": "overhead",
              "command": shlex.join([*([f"PYTHONPATH={pythonpath}"] if pythonpath else []),
                                     *[f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("HOROVOD_")],
                                     ".venv/bin/python", "benchmarks/overhead.py", *argv]),
              "mpirun": shlex.join(map(str, cmd)),  # as run (launch.py adds its own --mca settings)
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": info, "settings": {**{k: v for k, v in vars(args).items() if k not in ("worker", "out")},
                                            "trial_iterations": trial_steps(args)},
              "wall_s": time.time() - started, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
              **res}
    md = markdown(report)
    print("\n" + md)
    common.write_report(RESULTS / args.output_name, report, md)
    print(f"saved {RESULTS / (args.output_name + '.json')} and .md ({report['wall_s']:.0f} s)")
    return report


def mca_pair(text):
    """``--mca NAME=VALUE`` -> (NAME, VALUE)."""
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. mpi_yield_when_idle=1), got {text!r}")
    return name, value


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["resnet50", "bert-base"], choices=["resnet50", "bert-base"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--exchange", default="auto", choices=["auto", "allgather", "sparse_allreduce"],
                    help="the topk modes' exchange (auto: its trial is added to the warm-up)")
    ap.add_argument("--steps", type=int, default=12, help="timed iterations (each steps every mode once)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pool", type=int, default=2, help="sets of loss constants cycled")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--mca", action="append", default=[], metavar="NAME=VALUE", type=mca_pair,
                    help="an OpenMPI parameter for mpirun (repeatable), e.g. mpi_yield_when_idle=1: "
                         "waiting ranks yield their core instead of spinning (see the README)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds for the whole mpirun")
    ap.add_argument("--output-name", default="overhead")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if "baseline" not in args.modes:
        ap.error("--modes must include baseline (added time is measured against it)")
    if args.worker:
        worker(args)
    else:
        driver(args, argv)


if __name__ == "__main__":
    main()
