"""What the benchmarks share, so that each ``benchmarks/NAME.py`` is only its own experiment.

- tooling: this repository's ``tools/`` (``launch``, ``machine``, ``emulated_hosts``, ``shapes``),
  also when a benchmark measures an older hvd_topk through ``PYTHONPATH`` (the repository root is
  on ``sys.path`` only while ``tools`` is imported, so ``import hvd_topk`` still finds that
  checkout first);
- model shapes: ResNet-50's and BERT-base's parameter shapes (``tools.shapes``);
- the realistic step (what training does) and the methods exchange.py and training.py compare:
  ``loss_constants``, ``forward``, ``zero_grad``, ``make_optimizer``, ``method_list``, ``label``,
  ``warmup_steps``, ``stats_difference``;
- launching: ``driver`` (one ``mpirun -H`` per (P, rate) across emulated hosts, for exchange.py
  and training.py, with their shared options ``common_arguments``) and ``run_example`` (one local
  ``mpirun`` of an example, for convergence.py and convergence_gpt.py);
- report writing: ``write_report`` (PREFIX.json and PREFIX.md) and the Markdown pieces the
  reports share (``hvd_topk_line``, ``run_heading``, ``versus``, ``agree``, ``fmt_s``).
"""

import argparse
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"


def _import_tools():
    """This repository's ``tools`` package, without leaving the repository root first on
    ``sys.path`` (an hvd_topk given by ``PYTHONPATH`` must stay the one imported)."""
    if "tools" not in sys.modules:
        sys.path.insert(0, str(REPO))
        try:
            import tools  # noqa: F401
        finally:
            sys.path.remove(str(REPO))
    from tools import emulated_hosts, launch, machine, shapes
    return emulated_hosts, launch, machine, shapes


emulated_hosts, launch, machine, shapes = _import_tools()

# ---- model shapes ------------------------------------------------------------------------------
resnet50_shapes = shapes.resnet50_shapes
model_shapes = shapes.model_shapes
numel = shapes.numel
MODELS = shapes.MODELS
RESNET50_PARAMS = shapes.RESNET50["numel"]


def machine_info():
    """Where and when (``tools.machine.machine_info``), with this repository's git commit."""
    return machine.machine_info(REPO)


def summary(info):
    return machine.summary(info)


# ---- the realistic step and the methods compared -----------------------------------------------
def loss_constants(shapes, pool, seed, torch):
    """``pool`` sets of fixed random tensors c_p, one per shape: the realistic step's
    ``loss = sum_p (p * c_p).sum()`` makes autograd deposit ``p.grad = c_p``."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(pool)]


def forward(params, consts):
    """``sum_p (p * c_p).sum()``: its backward allocates a fresh gradient for every parameter,
    parameters created last first, as a model's backward does."""
    loss = None
    for p, c in zip(params, consts):
        term = (p * c).sum()
        loss = term if loss is None else loss + term
    return loss


def inner_step(opt):
    """After ``opt.synchronize()``, the inner optimizer's step (the benchmarks' SGD at lr 0:
    nothing moves), run outside the timer: ``exchange="auto"`` times a step only after the last
    one's inner step ran, as in training (without it the trial timed nothing and kept dense)."""
    if opt is not None:
        with opt.skip_synchronize():
            opt.step()


def zero_grad(opt, params):
    """``opt.zero_grad(set_to_none=True)``, or the same on bare parameters when there is no optimizer.

    Horovod 0.28.1's ``DistributedOptimizer.zero_grad()`` takes no argument (it calls torch's,
    whose default is ``set_to_none=True``): it is called plainly, and the gradients are then
    dropped here as well, so that every mode starts its backward from ``p.grad is None``."""
    if opt is not None:
        try:
            opt.zero_grad(set_to_none=True)
        except TypeError:
            opt.zero_grad()
    for p in params:
        p.grad = None


def worker_start(hvd):
    """``(rank, size, say, hosts)`` once Horovod is initialised: ``say`` prints on rank 0 only,
    ``hosts`` is every rank's host name in rank order (a row's record of where it ran)."""
    rank, size = hvd.rank(), hvd.size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    return rank, size, say, hvd.allgather_object(os.uname().nodename)


def hvd_topk_record(hvd_topk):
    """Which hvd_topk made a result: its version, the file it was imported from (a snapshot or
    the checkout) and the default compressor's settings."""
    return {"version": getattr(hvd_topk, "__version__", None), "file": hvd_topk.__file__,
            "default_topk": repr(hvd_topk.TopK())}


def save_rows(path, hosts, rows, hvd_topk):
    """A timed worker's JSON (rank 0 writes it): the hosts, the rows and ``hvd_topk_record``."""
    Path(path).write_text(json.dumps({"hosts": hosts, "rows": rows, "hvd_topk": hvd_topk_record(hvd_topk)},
                                     indent=1))


def rank_sums(hvd, torch, tensors):
    """Every rank's float64 sum of ``tensors`` (parameters, exchanged gradients), rank order:
    the benchmarks' check that ranks agree after distributed steps."""
    s = torch.tensor([float(sum(t.detach().double().sum() for t in tensors))], dtype=torch.float64)
    return hvd.allgather(s, name="bench.check").tolist()


def slowest_rank_ms(hvd, torch, times):
    """Each timed step's time on its slowest rank (``times``: this rank's, in seconds), with
    their median, min and max, in ms: what a benchmark row reports."""
    step_max = hvd.allgather(torch.tensor([times], dtype=torch.float64), name="bench.times").max(dim=0).values.tolist()
    return {"median_ms": 1e3 * statistics.median(step_max), "min_ms": 1e3 * min(step_max),
            "max_ms": 1e3 * max(step_max), "step_ms_slowest_rank": [1e3 * t for t in step_max]}


TOPK_METHODS = {"topk": None, "topk-ef": "allgather", "topk-sar": "sparse_allreduce", "topk-auto": "auto",
                "topk-ef-hier": "allgather", "topk-sar-hier": "sparse_allreduce"}
# The most steps exchange="auto"'s trial takes: 6 families (dense, dense fp16, the allgather, the
# sparse allreduce and the two hierarchical ones, hvd_topk.auto.families) x (one settling step +
# exchange_trial_steps, 3 by default). A constant, not read from hvd_topk.auto, so that a run
# measuring another checkout (PYTHONPATH) waits as long.
AUTO_TRIAL_STEPS = 6 * (3 + 1)


def warmup_steps(method, warmup):
    """Untimed steps before ``method``'s timed ones: ``exchange="auto"``'s trial is added, so
    the timed steps run the strategy it chose."""
    return warmup + (AUTO_TRIAL_STEPS if method.startswith("topk-auto") else 0)


def trial_finished(m):
    """Refuse to time ``m`` (a benchmark's method record) while ``exchange="auto"``'s trial is
    still running: its timed steps must run the strategy it chose (the trial can retry a family,
    ``hvd_topk.auto.Trial.RETRIES``, and outlast ``AUTO_TRIAL_STEPS``)."""
    stats = getattr(m["opt"], "compression_stats", None)
    trial_over(m["method"], stats() if stats is not None else None)


def trial_over(name, stats):
    """``trial_finished`` for any front end: ``stats``, the method's compression statistics
    (``compression_stats()``, the DDP hook's ``TopKState.stats()``), or None."""
    reason = (stats or {}).get("exchange_reason") or ""
    if reason.startswith("trial in progress"):
        raise SystemExit(f"{name}: exchange='auto' is still in its trial after the warm-up "
                         f"({reason}); pass a larger --warmup")


def time_methods(methods, build, one_step, finish, steps, interleave=False, rounds=1):
    """Build, warm up and time every method; returns ``finish(m)`` of each, in ``methods``' order.

    ``build(method)`` makes a record (a dict: ``"warmup"``, its untimed steps; ``"opt"``;
    ``"times"``, an empty list); ``one_step(m, i)`` runs step ``i`` of ``m`` and returns its
    seconds; ``finish(m)`` makes the method's row once ``m["times"]`` holds every timed step.
    The machine drifts (one method after another, the first one's steps ran up to 40% slower in
    a run of 2026-12-04), so the order must not favour a method:

    - ``interleave``: every method built at once, each warmed up alone (``exchange="auto"``'s
      trial timed without the others' steps in it) but for its last warm-up step, which every
      method takes in one round just before the timed steps (warmed up alone, the methods built
      first waited through the others' warm-ups, 24 steps more for ``auto``'s trial, and their
      first timed step ran up to twice their median: the runs of 2026-12-05, found by a
      review), then timed step i runs each method once, starting at a different one;
    - ``rounds`` > 1 (for models too large to hold several copies, as GPT-2-small): that many
      passes over the methods, each pass starting at a different method; in each pass a method is
      built afresh, warmed up and timed for ``steps`` steps; its times are pooled over the passes
      and its row is made after its last pass (only one method's model is alive at a time; what
      the row reads from the model and optimizer, statistics and agreement, is that pass's);
    - neither: one method after another (the runs published before 2026-12-05 ran so).
    """
    if interleave:
        built = [build(method) for method in methods]
        for m in built:
            for step in range(m["warmup"] - 1):
                one_step(m, step)
        for m in built:
            if m["warmup"]:
                one_step(m, m["warmup"] - 1)
            trial_finished(m)
        for i in range(steps):
            for m in built[i % len(built):] + built[:i % len(built)]:
                m["times"].append(one_step(m, m["warmup"] + i))
        return [finish(m) for m in built]
    times, rows = {method: [] for method in methods}, {}
    for r in range(rounds):
        for method in list(methods[r % len(methods):]) + list(methods[:r % len(methods)]):
            m = build(method)
            for step in range(m["warmup"] + steps):
                if step == m["warmup"]:
                    trial_finished(m)
                dt = one_step(m, step)
                if step >= m["warmup"]:
                    times[method].append(dt)
            if r == rounds - 1:
                m["times"] = times[method]
                rows[method] = finish(m)
            del m
    return [rows[method] for method in methods]


def method_list(methods, densities):
    out = []
    for m in methods:
        if m in TOPK_METHODS:
            out += [f"{m}@{d:g}" for d in densities]
        else:
            out.append(m)
    return out


def label(m):
    name, _, d = m.partition("@")
    return f"{name} {float(d) * 100:g}%" if d else name


def make_optimizer(method, inner, named, topk_method, hvd, hvd_topk, fp16_values=False):
    """``method``'s distributed optimizer around ``inner`` (None for "none") and its TopK (or
    None): the one construction exchange.py and training.py measure. Every hvd_topk method
    names its exchange (``topk-auto``: "auto", whose trial the callers add to the warm-up)."""
    name, _, d = method.partition("@")
    kw = {} if topk_method is None else {"method": topk_method}
    if fp16_values:
        kw["fp16_values"] = True
    if name == "none":
        return None, None
    if name == "dense":
        return hvd.DistributedOptimizer(inner, named_parameters=named, compression=hvd.Compression.none), None
    if name == "fp16":
        return hvd.DistributedOptimizer(inner, named_parameters=named, compression=hvd.Compression.fp16), None
    if name == "topk":
        comp = hvd_topk.TopK(density=float(d), **kw)
        return hvd.DistributedOptimizer(inner, named_parameters=named, compression=comp), comp
    if name in TOPK_METHODS:
        comp = hvd_topk.TopK(density=float(d), **kw)
        return hvd_topk.DistributedOptimizer(inner, named_parameters=named, compression=comp,
                                             exchange=TOPK_METHODS[name],
                                             hierarchical=name.endswith("-hier")), comp
    raise ValueError(f"unknown method {method}")


def stats_difference(after, before):
    """``after - before`` for the numeric running totals of ``compression_stats()``; other
    entries (current density, bucket counts, lists) as in ``after``."""
    if before is None:
        return dict(after)
    out = {}
    for k, v in after.items():
        b = before.get(k)
        numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
        if numeric and isinstance(b, (int, float)) and not k.startswith(("current_", "buckets_")):
            out[k] = v - b
        else:
            out[k] = v
    return out


# ---- launching ---------------------------------------------------------------------------------
def common_arguments(ap, densities, pool, output_name):
    """The options exchange.py and training.py share (P, links, methods, steps, launch)."""
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"], help="tbf rate per host link, or none")
    ap.add_argument("--methods", nargs="+", default=["none", "dense", "fp16", "topk", "topk-ef"],
                    choices=["none", "dense", "fp16", *TOPK_METHODS])
    ap.add_argument("--densities", type=float, nargs="+", default=densities)
    ap.add_argument("--topk-method", default=None, help="TopK(method=...); default: TopK's default")
    ap.add_argument("--fp16-values", action="store_true", help="TopK(fp16_values=True) for the topk methods")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help="ranks per emulated host (P/L hosts); wire bytes are then per host link")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per method")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--pool", type=int, default=pool, help="pre-generated inputs cycled through")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--ssh-port", type=int, default=2222)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per mpirun")
    ap.add_argument("--output-name", default=output_name)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)


def order_arguments(ap):
    """``--interleave`` and ``--rounds``: how the methods' timed steps are ordered (``time_methods``)."""
    ap.add_argument("--interleave", action="store_true",
                    help="build every method at once and interleave their timed steps (after each one's "
                         "warm-up alone), so that the machine's drift falls on every method alike")
    ap.add_argument("--rounds", type=int, default=1,
                    help="passes over the methods, each starting at a different one, each method built afresh "
                         "and timed for --steps steps in every pass (times pooled): drift falls on all alike "
                         "with one model alive at a time")


def hosts_phrase(settings):
    per_host = settings.get("ranks_per_host") or 1
    return "one emulated host per rank" if per_host == 1 else f"{per_host} ranks per emulated host"


def check_order_arguments(ap, args):
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.interleave and args.rounds > 1:
        ap.error("--interleave and --rounds > 1 are two ways to order the methods: choose one")


def order_line(settings):
    """How a report's methods were ordered, for its header."""
    if settings.get("interleave"):
        return ("the methods built at once, each warmed up alone, their timed steps interleaved (step i runs each "
                "once, the order rotating)")
    rounds = settings.get("rounds") or 1
    if rounds > 1:
        return (f"{rounds} passes over the methods, each starting at a different one, each method built afresh and "
                f"warmed up in every pass; times pooled over the passes")
    return "one method after another (their times drift with the machine between them)"


def driver(args, argv, *, worker_args, script, benchmark, render, model=None):
    """Set up P emulated hosts per ``--ranks``, run ``script --worker`` under one mpirun per rate,
    save ``results/<benchmark>/<output-name>.{json,md}`` (after every configuration, marked
    partial until the last). ``model``: ``(parameters, tensors)`` of what is measured (default
    ResNet-50's)."""
    script = Path(script).resolve()
    started = time.time()
    info = machine_info()
    runs = []

    def save(partial):
        return _save_report(args, argv, script, benchmark, render, info, started, runs, partial, model)

    print(f"{benchmark} benchmark: ranks {args.ranks}, rates {args.rates}, methods "
          f"{[label(m) for m in method_list(args.methods, args.densities)]}, {args.warmup} warm-up + "
          f"{args.steps} timed steps", flush=True)
    per_host = getattr(args, "ranks_per_host", 1)
    for P in args.ranks:
        if P % per_host:
            raise SystemExit(f"P={P} is not a multiple of --ranks-per-host {per_host}")
        with emulated_hosts.EmulatedHosts(P // per_host, rate=args.rates[0], sshd=True,
                                          ssh_port=args.ssh_port) as eh:
            for rate in args.rates:
                eh.set_rate(rate)
                out = eh.tmpdir / f"result-{P}-{rate}.json"
                # PYTHONPATH set here (e.g. an older checkout to measure) goes first
                pythonpath = ":".join(x for x in (os.environ.get("PYTHONPATH"), str(REPO)) if x)
                os.environ["OMP_NUM_THREADS"] = str(args.threads)
                # Horovod tuning set by the user (e.g. HOROVOD_CYCLE_TIME) reaches every rank
                cmd = eh.mpirun_command([script, "--worker", *worker_args(args), "--out", out],
                                        pythonpath=pythonpath, wdir=REPO, np=P, slots=per_host)
                print(f"\n== P={P}, rate {rate}: {shlex.join(cmd)}", flush=True)
                t0 = time.time()
                rc, output = emulated_hosts.stream(eh.launcher_cmd(cmd), timeout=args.timeout)
                if rc != 0 or not out.exists():
                    raise SystemExit(f"mpirun failed (exit {rc}) for P={P} rate {rate}")
                res = json.loads(out.read_text())
                for row in res["rows"]:
                    row["rate"] = rate
                runs.append({"P": P, "rate": rate, "ranks_per_host": per_host, "hosts": res["hosts"], "rows": res["rows"],
                             "wall_s": time.time() - t0, "mpirun": shlex.join(cmd),
                             **{k: v for k, v in res.items() if k not in ("rows", "hosts")}})
                save(partial=True)  # keep what is done if a later configuration fails
    return save(partial=False)


def _save_report(args, argv, script, benchmark, render, info, started, runs, partial, model=None):
    params, tensors = model or (RESNET50_PARAMS, len(resnet50_shapes()))
    report = {"benchmark": benchmark, "partial": partial,
              # the environment the driver reads: Horovod's tuning, and PYTHONPATH (an older checkout measured)
              "command": shlex.join([*[f"{k}={os.environ[k]}" for k in sorted(os.environ)
                                       if k.startswith("HOROVOD_") or k == "PYTHONPATH"],
                                     ".venv/bin/python", str(script.relative_to(REPO)), *argv]),
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": info, "params": params, "tensors": tensors,
              "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
              "wall_s": time.time() - started, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
              "runs": runs}
    md = render(report)
    if partial:
        md = "(partial: the run has not finished)\n\n" + md
    else:
        print("\n" + md)
    prefix = RESULTS / benchmark / args.output_name  # results/exchange/ or results/training/
    write_report(prefix, report, md)
    print(f"saved {prefix}.json and .md ({report['wall_s']:.0f} s"
          f"{', partial' if partial else ''})", flush=True)
    return report


def run_example(np_, extra, seed, epochs, timeout, example, launcher="mpirun", hosts=None, ranks_per_host=1):
    """One local ``mpirun`` (or ``torchrun --standalone``) of ``example`` (``--epochs`` unless None)
    and its JSON result, with ``wall_s``. ``hosts``: an open ``emulated_hosts.EmulatedHosts``, to
    launch ``mpirun`` over them instead, ``ranks_per_host`` on each."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        length = [] if epochs is None else ["--epochs", str(epochs)]
        argv = [str(example), "--quiet", "--json", str(out), *length, "--seed", str(seed), *extra]
        t0 = time.perf_counter()
        if hosts is not None:  # (the ranks write out through the shared file system: one machine)
            cmd = hosts.launcher_cmd(hosts.mpirun_command(argv, np=np_, slots=ranks_per_host, pythonpath=str(REPO),
                                                          wdir=REPO))
            # (its output streamed as progress; a run past timeout is killed there)
            rc, output = emulated_hosts.stream(cmd, timeout=timeout, prefix="    | ")
            failure = f"exit {rc}: {shlex.join(map(str, cmd))}\n{output[-4000:]}"
        else:
            cmd = launch.torchrun_command(np_, argv) if launcher == "torchrun" else launch.mpirun_command(np_, argv)
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True) as proc:
                try:
                    stdout, stderr = proc.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
                    raise RuntimeError(f"timed out after {timeout}s: {shlex.join(cmd)}") from None
            rc = proc.returncode
            failure = f"exit {rc}: {shlex.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        wall = time.perf_counter() - t0
        if rc != 0 or not out.exists():
            raise RuntimeError(failure)
        result = json.loads(out.read_text())
    result["wall_s"] = wall
    return result


# ---- report writing ----------------------------------------------------------------------------
def write_report(prefix, data, md, json_default=None):
    """``PREFIX.json`` (``data``, indented) and ``PREFIX.md`` (``md``), the folder made first."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.json").write_text(json.dumps(data, indent=1, default=json_default) + "\n")
    Path(f"{prefix}.md").write_text(md)


def fmt_s(s):
    """Seconds as ``12.3s`` or ``4m05.0s``."""
    return f"{int(s // 60)}m{s % 60:04.1f}s" if s >= 60 else f"{s:.1f}s"


def hvd_topk_line(report):
    """``- hvd_topk: `TopK(...)` (TopK() defaults) from FILE``, from the first run's record."""
    first = (report["runs"][0].get("hvd_topk") or {}) if report["runs"] else None
    return (f"- hvd_topk: `{first.get('default_topk') if first is not None else '?'}` "
            f"(TopK() defaults) from {first.get('file') if first is not None else '?'}")


def run_heading(run, shape=""):
    """``## P=4 (shape), 1gbit per host (12 s wall)``: one (P, rate) section of a report."""
    return f"## P={run['P']}{shape}, {run['rate']} per host ({run['wall_s']:.0f} s wall)"


def versus(ref, row, base):
    """``base``'s median / ``row``'s as ``1.23x`` (``-`` for the ``none`` row or without ``base``)."""
    return f"{ref[base] / row['median_ms']:.2f}x" if base in ref and row["method"] != "none" else "-"


def overhead(ref, row):
    """The exchange's overhead: ``row``'s median minus ``none``'s (``-`` without ``none``); a
    step faster than ``none``'s is flagged (noise: the overhead cannot be negative)."""
    if "none" not in ref or row["method"] == "none":
        return "-"
    ov = row["median_ms"] - ref["none"]
    return f"{ov:+.0f} ms" + (" (below none: noise)" if ov < 0 else "")


def overhead_versus(ref, row, base):
    """``base``'s overhead / ``row``'s (``12.5x``): the ratio that matters once compute is
    taken out; ``n/a`` where either overhead is not above ``none``'s step."""
    if "none" not in ref or base not in ref or row["method"] in ("none", base):
        return "-"
    mine, theirs = row["median_ms"] - ref["none"], ref[base] - ref["none"]
    return f"{theirs / mine:.1f}x" if mine > 0 and theirs > 0 else "n/a"


def launch_line(report):
    """The launch settings that change timings, from the first run's mpirun command."""
    cmd = report["runs"][0].get("mpirun", "") if report["runs"] else ""
    yields = "mpi_yield_when_idle 1" in cmd
    return ("- MPI: " + ("`--mca mpi_yield_when_idle 1` (the emulated hosts share this machine's cores: a rank "
                         "waiting in a collective yields its core instead of spinning)" if yields
                         else "`mpi_yield_when_idle` not set"))


def agree(flag):
    """A "ranks agree" cell: ``-`` (not checked), ``yes`` or ``NO``."""
    return "-" if flag is None else ("yes" if flag else "NO")
