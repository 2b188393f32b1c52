#!/usr/bin/env python
"""Wall-clock to target for AdamW: GPT-2-small's step time on shaped links, combined with the
steps each scheme needs on the GPT example (benchmarks/convergence_gpt.py's results).

Part 1, measured: the training step of a real GPT-2-small (124,439,808 parameters in 148
tensors: 12 pre-norm blocks of width 768, 50,257-token embedding tied to the output head,
1,024 positions; written out in benchmarks/_models.py) on ``--context`` tokens x ``--batch`` sequences per rank of
synthetic tokens, one rank per emulated host (tools/emulated_hosts.py), one mpirun per (P, rate),
MPI over TCP. A step = ``zero_grad(set_to_none=True)`` + forward + backward (the exchanges start
from the gradient hooks) + ``opt.step()``; median of the slowest rank over ``--steps`` after
``--warmup``. Methods: ``none`` (plain AdamW, no exchange), ``dense`` (hvd.DistributedOptimizer
over AdamW), ``fp16`` (its fp16 compression), ``old`` (hvd_topk.DistributedOptimizer over
LocalAdamW as before 2026-11-25: own variance, lr applied at send time) and ``recipe`` (today's
LocalAdamW: global variance, lr in the residual), both Top-K at ``--density`` with the allgather
(pinned, as the quality runs) and no dense start: the timed steps are the steady state.
``recipe16`` is the recipe with 16-bit values (the recommended scheme); ``compact`` and ``sign``
the schemes at 0.1%'s bytes (compact pairs at 0.25%, sign values at 0.43%, whatever
``--density`` says, ``residual_decay=0.99``).
The other schemes of docs/adamw.md, as their quality runs ran them: ``demo`` (hvd_topk.DeMo,
sign, beta 0.999, Top-K at ``--density``) and ``localsteps`` (hvd_topk.LocalSteps over AdamW,
4 local steps, then the model change at 4 x ``--density`` with 16-bit values). A LocalSteps
step exchanges only every 4th time, so its row is the *mean* over whole cycles (``--steps`` a
multiple of 4), not the median, which would be a step without exchange.

Part 2, modelled (labelled so in the report): time to reach dense AdamW's mean validation loss
at N/2 and at N steps of the example = steps to target (from ``--convergence`` files, mean over
seeds) x the measured step time, plus, for the Top-K schemes, the dense start's extra bytes
counted as that many dense steps' extra time (``--start-dense-steps``: the dense-step
equivalents of DGC's 100-step decay from 100% to 1%, from the runs' own byte counts). Dense
fp32 and fp16 need N steps to reach dense's loss at N by definition (fp16 is assumed to train
as fp32 does: at 300 steps the two are equal to 4 digits, ``convergence-gpt.md``).

    .venv/bin/python benchmarks/adamw_wallclock.py                     # P=2, 1 and 10 Gbit
    .venv/bin/python benchmarks/adamw_wallclock.py --render benchmarks/results/training/adamw-wallclock.json \\
        --convergence benchmarks/results/gpt/convergence-gpt-gv-3000.json      # the model with other runs
    .venv/bin/python benchmarks/adamw_wallclock.py --ranks 2 --rates 1gbit --steps 2 --warmup 1 \\
        --output-name adamw-wallclock-smoke                            # quick check
Results: benchmarks/results/training/<output-name>.{json,md} (default adamw-wallclock).
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as common  # noqa: E402
import _models as models  # noqa: E402  (GPT-2 small itself)
from _models import GPT2_SMALL  # noqa: E402

METHODS = ("none", "dense", "fp16", "old", "recipe", "recipe16", "compact", "sign", "demo", "localsteps")
LABELS = {"none": "no exchange (AdamW)", "dense": "Horovod dense fp32", "fp16": "Horovod fp16",
          "old": "hvd_topk, LocalAdamW as before", "recipe": "hvd_topk, LocalAdamW recipe",
          "recipe16": "hvd_topk, the recommended scheme (the recipe, 16-bit values)",
          "compact": "hvd_topk, 0.1%'s bytes: compact pairs at 0.25%, residual_decay=0.99",
          "sign": "hvd_topk, 0.1%'s bytes: sign values at 0.43%, residual_decay=0.99",
          "demo": "hvd_topk.DeMo (sign, beta 0.999)",
          "localsteps": "hvd_topk.LocalSteps, H=4, 4x the density, 16-bit values (mean of whole cycles)"}
TOPK_METHODS = ("old", "recipe", "recipe16", "compact", "sign", "demo", "localsteps")
SYNC_EVERY = 4  # "localsteps": as its quality run (docs/adamw.md)
# "compact" and "sign" run at their own densities, whatever --density says (docs/adamw.md)
OWN_DENSITY = {"compact": (0.0025, True), "sign": (0.0043, "sign")}  # (density, TopK's compact)
# each Top-K method's runs in the --convergence files: the option naming their config
CONVERGENCE_CONFIG = {"old": "old_config", "recipe": "recipe_config", "recipe16": "recipe_config",
                      "demo": "demo_config", "localsteps": "localsteps_config", "compact": "compact_config",
                      "sign": "sign_config"}


def make(method, model, density, hvd, hvd_topk, torch):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    # names per method: methods must not share Horovod's tensor names (with --interleave its response
    # cache would be invalidated at every switch between fp32 and fp16 tensors of one name)
    named = [(f"{method}.{n}", p) for n, p in model.named_parameters()]
    if method in ("none", "dense", "fp16"):
        inner = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95))
        if method == "none":
            return inner
        comp = hvd.Compression.none if method == "dense" else hvd.Compression.fp16
        return hvd.DistributedOptimizer(inner, named_parameters=named, compression=comp)
    if method == "demo":
        inner = hvd_topk.DeMo(groups, lr=3e-4, beta=0.999, normalise="sign")
        return hvd_topk.DistributedOptimizer(inner, named_parameters=named, exchange="allgather",
                                             compression=hvd_topk.TopK(density=density))
    if method == "localsteps":
        inner = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95))
        return hvd_topk.LocalSteps(inner, named_parameters=named, sync_every=SYNC_EVERY, exchange="allgather",
                                   compression=hvd_topk.TopK(density=SYNC_EVERY * density, fp16_values=True))
    new = method != "old"
    inner = hvd_topk.LocalAdamW(groups, lr=3e-4, betas=(0.0, 0.95), lr_in_residual=new, global_variance=new)
    density, compact = OWN_DENSITY.get(method, (density, False))
    topk = hvd_topk.TopK(density=density, fp16_values=method == "recipe16", compact=compact)
    return hvd_topk.DistributedOptimizer(inner, named_parameters=named, exchange="allgather", compression=topk,
                                         residual_decay=0.99 if compact else 1.0)


def worker(args):
    import torch
    import horovod.torch as hvd
    import hvd_topk

    torch.set_num_threads(args.threads)
    hvd.init()
    rank, size, say, names = common.worker_start(hvd)
    tokens = models.inputs("gpt2-small", torch, args.pool, seed=7 + rank, batch=args.batch, context=args.context)

    def build(method):
        """``method``'s GPT-2-small (the same initial weights for every method) and optimizer."""
        gc.collect()
        torch.manual_seed(0)
        model = models.build("gpt2-small", torch)
        opt = make(method, model, args.density, hvd, hvd_topk, torch)
        if method != "none":
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return {"method": method, "model": model, "opt": opt, "params": list(model.parameters()),
                "times": [], "warmup": args.warmup, "started": time.time()}

    def one_step(m, step):
        """One training step of ``m`` (ranks aligned first); returns its seconds on this rank."""
        batch = tokens[step % len(tokens)]
        hvd.allreduce(torch.zeros(1), name="bench.barrier", op=hvd.Sum)
        t0 = time.perf_counter()
        common.zero_grad(m["opt"], m["params"])
        loss = models.loss("gpt2-small", m["model"], batch)
        loss.backward()
        m["opt"].step()
        dt = time.perf_counter() - t0
        say(f"  [{m['method']}] step {step + 1}/{args.warmup + args.steps} {dt * 1e3:.0f} ms (rank 0), "
            f"loss {loss.item():.3f}")
        return dt

    def finish(m):
        method = m["method"]
        agree = None if method == "none" else len(set(common.rank_sums(hvd, torch, m["params"]))) == 1
        timing = common.slowest_rank_ms(hvd, torch, m["times"])
        if method == "localsteps":  # one exchange in SYNC_EVERY steps: the mean of whole cycles
            timing["median_ms"] = statistics.mean(timing["step_ms_slowest_rank"])
            timing["median_is"] = "the mean of whole cycles"
        row = {"method": method, "label": LABELS[method], "P": size, **timing,
               "params_identical_across_ranks": agree, "wall_s": time.time() - m["started"],
               "parameters": sum(p.numel() for p in m["params"]), "tensors": len(m["params"])}
        if method in TOPK_METHODS:
            row["compression_stats"] = m["opt"].compression_stats()
        say(f"{LABELS[method]:>34}: median {row['median_ms']:8.1f} ms/step")
        return row

    rows = common.time_methods(args.gpt_methods, build, one_step, finish, args.steps,
                               interleave=args.interleave, rounds=args.rounds)
    if rank == 0 and args.out:
        common.save_rows(args.out, names, rows, hvd_topk)


def worker_args(args):
    return ["--gpt-methods", *args.gpt_methods, "--density", str(args.density), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--pool", str(args.pool), "--threads", str(args.threads),
            "--batch", str(args.batch), "--context", str(args.context), "--rounds", str(args.rounds),
            *(["--interleave"] if args.interleave else [])]


def to_target(report, args):
    """The modelled part: seconds to dense's loss at N/2 and N per (P, rate, method)."""
    out = []
    for path in args.convergence:
        conv = json.loads(Path(path).read_text())
        steps = conv["meta"]["steps"]
        dense_rows = [r for r in conv["runs"] if r["config"] == args.dense_config]
        if not dense_rows:
            continue

        def dense_at(step):
            return statistics.mean(h["val_loss"] for r in dense_rows for h in r["history"] if h["step"] == step)
        targets = {"N/2": dense_at(steps // 2), "N": dense_at(steps)}
        reach = {}
        for method, option in CONVERGENCE_CONFIG.items():
            runs = [r for r in conv["runs"] if r["config"] == getattr(args, option)]
            for key, target in targets.items():
                got = [next((h["step"] for h in r["history"] if h["val_loss"] <= target), None) for r in runs]
                reach[(method, key)] = (statistics.mean(got) if runs and None not in got else None, len(runs),
                                        sum(x is not None for x in got))
        for key in targets:
            n = steps // 2 if key == "N/2" else steps
            reach[("dense", key)] = reach[("fp16", key)] = (n, len(dense_rows), len(dense_rows))
        out.append({"file": str(path), "steps": steps, "targets": targets,
                    "reach": {f"{m} {k}": v for (m, k), v in reach.items()}})
    return out


def markdown(report):
    s, m = report["settings"], report["machine"]
    lines = [f"# Wall-clock to target for AdamW: GPT-2-small ({report['params']:,} parameters, "
             f"{report['tensors']} tensors), {s['batch']} x {s['context']} tokens per rank", "",
             f"- command: `{report['command']}`",
             f"- date: {report['date_utc']}; machine: {common.summary(m)}; load average at end {report.get('loadavg_at_end')}",
             f"- {common.hosts_phrase(s)} (network namespace, tbf-shaped veth, burst 1 ms of the rate), mpirun over "
             "ssh, MPI over TCP only; step = zero_grad(set_to_none=True) + forward + backward + opt.step(); "
             f"{s['warmup']} warm-up + {s['steps']} timed steps, median of the slowest rank; {common.order_line(s)}; "
             f"{s['threads']} torch thread(s) per rank; Top-K at {s['density'] * 100:g}% with the allgather, steady "
             "state (no dense start)", common.launch_line(report),
             "- CPU only: compute is far slower than on a GPU, so the exchange is a smaller share of the step "
             "than it would be there"]
    if report.get("rendered_command"):
        lines.append(f"- modelled part re-rendered from the measured steps above: `{report['rendered_command']}`")
    lines.append("")
    for run in report["runs"]:
        ref = {r["method"]: r["median_ms"] for r in run["rows"]}
        lines += [common.run_heading(run), "", "| method | median ms/step | min-max ms | exchange overhead vs none "
                  "| vs dense | vs fp16 | overhead: dense's / this | overhead: fp16's / this | ranks agree "
                  "| bytes vs dense fp32 |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for r in run["rows"]:
            ratio = r.get("compression_stats", {}).get("bytes_ratio")
            lines.append(f"| {r['label']} | {r['median_ms']:.0f} | {r['min_ms']:.0f}-{r['max_ms']:.0f} | "
                         f"{common.overhead(ref, r)} | {common.versus(ref, r, 'dense')} | {common.versus(ref, r, 'fp16')} | "
                         f"{common.overhead_versus(ref, r, 'dense')} | {common.overhead_versus(ref, r, 'fp16')} | "
                         f"{common.agree(r['params_identical_across_ranks'])} | "
                         f"{'-' if ratio is None else f'{100 * ratio:.2f}%'} |")
        lines.append("")
    targets = report.get("to_target") or []
    start = report["settings"]["start_dense_steps"]
    for t in targets:
        lines += [f"## Modelled: time to dense AdamW's loss, {t['steps']}-step schedule (`{Path(t['file']).name}`)", "",
                  f"Target config `{report['settings'].get('dense_config', 'dense')}`, Top-K rows from "
                  f"`{report['settings'].get('recipe_config', 'gv-1%')}` (the step time measured above for the "
                  f"recipe), DeMo's from `{report['settings'].get('demo_config', '-')}`, LocalSteps' from "
                  f"`{report['settings'].get('localsteps_config', '-')}`, compact pairs' from "
                  f"`{report['settings'].get('compact_config', '-')}`, sign values' from "
                  f"`{report['settings'].get('sign_config', '-')}`, where the file has them. "
                  f"Steps to target: mean over seeds of the first validation step at or below dense's mean loss at "
                  f"step {t['steps'] // 2} ({t['targets']['N/2']:.4f}) and {t['steps']} ({t['targets']['N']:.4f}). "
                  f"Time = steps x the measured median step, plus {start:g} dense steps' extra time for the Top-K "
                  "schemes' dense start. Not measured end to end: a model.", ""]
        for run in report["runs"]:
            ms = {r["method"]: r["median_ms"] for r in run["rows"]}
            lines += [f"P={run['P']}, {run['rate']}:", "", "| method | to dense@N/2 | vs dense fp32 | vs fp16 | "
                      "to dense@N | vs dense fp32 | vs fp16 |", "|---|---:|---:|---:|---:|---:|---:|"]
            seconds, cells = {}, {}
            for method in ("dense", "fp16", *TOPK_METHODS):
                for key in ("N/2", "N"):
                    steps, n, got = t["reach"].get(f"{method} {key}", (None, 0, 0))
                    if steps is None or method not in ms:
                        missing = n == 0 or method not in ms
                        seconds[(method, key)] = None
                        cells[(method, key)] = "-" if missing else f"not reached by every seed ({got}/{n})"
                        continue
                    sec = steps * ms[method] / 1e3
                    if method in TOPK_METHODS:  # the dense start: fp16 with 16-bit values or compact pairs
                        start_method = "fp16" if method in ("recipe16", "localsteps", "compact", "sign") else "dense"
                        if start_method not in ms:
                            seconds[(method, key)] = None
                            cells[(method, key)] = f"needs {start_method}'s step (the dense start)"
                            continue
                        # LocalSteps' start is the same decay over a quarter of the exchanges
                        exchanges = start / SYNC_EVERY if method == "localsteps" else start
                        sec += exchanges * (ms[start_method] - ms[method]) / 1e3
                    seconds[(method, key)], cells[(method, key)] = sec, f"{sec / 60:.1f} min ({steps:.0f} steps)"
            for method in ("dense", "fp16", *TOPK_METHODS):
                if cells[(method, "N/2")] == "-" and cells[(method, "N")] == "-":
                    continue  # not measured in this run
                row = []
                for key in ("N/2", "N"):
                    row.append(cells[(method, key)])
                    row += [f"{seconds[(method, key)] / seconds[(base, key)]:.2f}x"
                            if seconds[(method, key)] and seconds[(base, key)] else "-" for base in ("dense", "fp16")]
                lines.append(f"| {LABELS[method]} | " + " | ".join(row) + " |")
            lines.append("")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.common_arguments(ap, densities=[0.01], pool=2, output_name="adamw-wallclock")
    ap.set_defaults(ranks=[2], steps=4, warmup=2)
    ap.add_argument("--gpt-methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank")
    ap.add_argument("--context", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--convergence", nargs="*", default=[], help="convergence_gpt.py JSON files (steps to target)")
    ap.add_argument("--dense-config", default="dense",
                    help="the --convergence files' config that sets the target (e.g. dense-lr1e-2)")
    ap.add_argument("--old-config", default="local-1%")
    ap.add_argument("--recipe-config", default="gv-1%")
    ap.add_argument("--demo-config", default="demo-1%-lr3e-2", help="the --convergence files' DeMo runs")
    ap.add_argument("--localsteps-config", default="ls4-4%-lr1e-2-fp16v", help="the --convergence files' LocalSteps runs")
    ap.add_argument("--compact-config", default="gv-0.1%-lr2e-2-compact0.25-decay0.99",
                    help="the --convergence files' compact-pairs runs")
    ap.add_argument("--sign-config", default="gv-0.1%-lr2e-2-sign0.43-decay0.99",
                    help="the --convergence files' sign-values runs")
    ap.add_argument("--start-dense-steps", type=float, default=35.5,
                    help="dense-step equivalents of the dense start (bytes of the 1000-step runs: "
                         "(6.24%% x 1000 - 2.79%% x 1000) / (100%% - 2.79%%))")
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="only redo the report of an earlier run (its measured part) with these --convergence files")
    ap.add_argument("--render-to", type=Path, metavar="PREFIX",
                    help="with --render: write PREFIX.{json,md} instead of overwriting the earlier run's files")
    common.order_arguments(ap)
    args = ap.parse_args(argv)
    common.check_order_arguments(ap, args)
    unused = [flag for flag, given in (("--methods", args.methods != ap.get_default("methods")),
                                       ("--densities", args.densities != ap.get_default("densities")),
                                       ("--topk-method", args.topk_method is not None),
                                       ("--fp16-values", args.fp16_values)) if given]
    if unused:
        ap.error(f"{', '.join(unused)}: not used here; the methods are --gpt-methods (recipe16 has 16-bit "
                 "values) at --density")
    if "localsteps" in args.gpt_methods and args.steps % SYNC_EVERY:
        ap.error(f"localsteps exchanges every {SYNC_EVERY} steps: --steps must be a multiple of {SYNC_EVERY}")
    if args.worker:
        worker(args)
        return
    if args.render:
        report = json.loads(args.render.read_text())
        report["settings"]["start_dense_steps"] = args.start_dense_steps
        report["to_target"] = to_target(report, args)
        report["rendered_with"] = args.convergence
        report["rendered_command"] = "python benchmarks/adamw_wallclock.py " + " ".join(argv)
        report["settings"].update(dense_config=args.dense_config,
                                  **{option: getattr(args, option) for option in CONVERGENCE_CONFIG.values()})
        common.write_report(args.render_to or args.render.with_suffix(""), report, markdown(report))
        print(markdown(report))
        return
    n = GPT2_SMALL
    params = n["vocab"] * n["width"] + n["positions"] * n["width"] + 2 * n["width"] + \
        n["layers"] * (12 * n["width"] ** 2 + 13 * n["width"])
    tensors = 2 + 2 + n["layers"] * 12

    def render(report):
        report["to_target"] = to_target(report, args)
        return markdown(report)
    common.driver(args, argv, worker_args=worker_args, script=__file__, benchmark="training", render=render,
                  model=(params, tensors))


if __name__ == "__main__":
    main()
