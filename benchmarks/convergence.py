#!/usr/bin/env python
"""Convergence on the digits example: dense Horovod vs hvd_topk at 1% and 0.1% density, each with
and without error feedback, over several seeds.

Every run is ``mpirun -np 2 python examples/pytorch_digits.py --quiet --json ... ARGS --seed S``;
the example's JSON carries, per epoch, the training loss (mean over the epoch's steps, averaged
over ranks) and the test accuracy, and at the end the bytes sent per step and rank.

    .venv/bin/python benchmarks/convergence.py                      # 5 configs x 3 seeds x 30 epochs
    .venv/bin/python benchmarks/convergence.py --seeds 42 --epochs 3 --configs dense ef-1% \\
        --out-prefix /tmp/conv-smoke                                 # quick check
    .venv/bin/python benchmarks/convergence.py --replot              # table + plot from saved JSON

Writes ``PREFIX.json`` (every run, with its per-epoch history, plus command, machine and date),
``PREFIX.md`` (the accuracy table) and ``PREFIX.png`` (loss and accuracy curves: mean over seeds,
shaded min-max). Default PREFIX: benchmarks/results/convergence/convergence.
"""

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_s, machine_info, run_example, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pytorch_digits.py"
DEFAULT_PREFIX = ROOT / "benchmarks" / "results" / "convergence" / "convergence"

# name -> (label, extra arguments of the example)
EF = ["--optimizer", "topk-ef", "--exchange", "allgather"]  # the exchange pinned: auto may go dense
CONFIGS = {
    "dense": ("Horovod dense fp32", ["--compression", "none"]),
    "ef-1%": ("hvd_topk 1%, error feedback", [*EF, "--density", "0.01"]),
    "noef-1%": ("hvd_topk 1%, no error feedback", [*EF, "--density", "0.01", "--no-error-feedback"]),
    "ef-0.1%": ("hvd_topk 0.1%, error feedback", [*EF, "--density", "0.001"]),
    "noef-0.1%": ("hvd_topk 0.1%, no error feedback", [*EF, "--density", "0.001", "--no-error-feedback"]),
    "ef-1%-bucket": ("hvd_topk 1%, error feedback, bucket scope",
                     [*EF, "--density", "0.01", "--selection-scope", "bucket"]),
    "ef-0.1%-bucket": ("hvd_topk 0.1%, error feedback, bucket scope",
                       [*EF, "--density", "0.001", "--selection-scope", "bucket"]),
    "ef-1%-sar": ("hvd_topk 1%, error feedback, sparse allreduce",
                  ["--optimizer", "topk-ef", "--exchange", "sparse_allreduce", "--density", "0.01"]),
    "ef-0.1%-sar": ("hvd_topk 0.1%, error feedback, sparse allreduce",
                    ["--optimizer", "topk-ef", "--exchange", "sparse_allreduce", "--density", "0.001"]),
}
STYLE = {"dense": ("black", "-"), "ef-1%": ("tab:blue", "-"), "noef-1%": ("tab:blue", "--"),
         "ef-0.1%": ("tab:red", "-"), "noef-0.1%": ("tab:red", "--"),
         "ef-1%-bucket": ("tab:green", "-."), "ef-0.1%-bucket": ("tab:orange", "-."),
         "ef-1%-sar": ("tab:purple", ":"), "ef-0.1%-sar": ("tab:brown", ":")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44], help="default: 42 43 44")
    p.add_argument("--epochs", type=int, default=30, help="default: 30 (the example's default)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                   metavar="NAME", help=f"subset of: {' '.join(CONFIGS)} (default: all)".replace("%", "%%"))
    p.add_argument("--np", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--out-prefix", type=Path, default=DEFAULT_PREFIX,
                   help="write PREFIX.json/.md/.png (default: benchmarks/results/convergence/convergence)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run before it is killed (600)")
    p.add_argument("--replot", action="store_true",
                   help="run nothing: rebuild the table and plot from PREFIX.json")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.np < 1:
        p.error("--epochs and --np must be positive")
    return args


def summarise(data):
    """Per config: accuracy mean/std/min/max over seeds, bytes, final loss."""
    rows = []
    dense_bytes = None
    for name in data["configs"]:
        runs = [r for r in data["runs"] if r["config"] == name]
        if not runs:
            continue
        acc = np.array([r["test_acc"] for r in runs]) * 100
        loss = np.array([r["history"][-1]["train_loss"] for r in runs])
        sent = float(np.mean([r["bytes_sent_per_step"] for r in runs]))
        dense = float(np.mean([r["bytes_dense_per_step"] for r in runs]))
        dense_bytes = dense_bytes or dense
        rows.append({
            "config": name, "label": CONFIGS[name][0], "args": " ".join(CONFIGS[name][1]), "seeds": len(runs),
            "acc_mean": float(acc.mean()), "acc_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
            "acc_min": float(acc.min()), "acc_max": float(acc.max()),
            "final_train_loss_mean": float(loss.mean()),
            "bytes_sent_per_step": sent, "bytes_dense_per_step": dense, "bytes_ratio": sent / dense,
            "wall_s_mean": float(np.mean([r["wall_s"] for r in runs])),
        })
    return rows


def markdown(data, rows):
    m = data["meta"]
    lines = [
        "# Convergence on the digits example",
        "",
        f"Date (UTC): {m['date']}  ",
        f"Machine: {m['machine']['cpu']}, {m['machine']['cores']} cores; {m['machine']['os']}; "
        f"Python {m['machine']['python']}, torch {m['machine'].get('torch') or '?'}, "
        f"horovod {m['machine'].get('horovod') or '?'}; hvd_topk git {m['machine'].get('git') or '?'}  ",
        f"Command: `{m['command']}`  ",
        f"Each run: `{m['run_command']}` with ARGS below; {m['np']} ranks, {m['epochs']} epochs, "
        f"batch 32 per rank, SGD lr 0.05·P momentum 0.9; seeds {', '.join(map(str, m['seeds']))} "
        f"(the seed sets model initialisation and shuffling; the train/test split is fixed).  ",
        f"Total wall time: {fmt_s(m['total_wall_s'])} (the 2-core machine is shared: per-run times, "
        "`wall_s` in the JSON, are not a speed measurement).  ",
        *[f"Note: {note}  " for note in m.get("notes", [])],
        "",
        "Test accuracy after the last epoch: mean ± sample std over seeds (min–max). Bytes: sent per step "
        "and rank, as counted by the example (dense fp32 allreduce payload for Horovod dense).",
        "",
        "| configuration | ARGS | test accuracy | min–max | final train loss | bytes/step/rank | vs dense |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['label']} | `{r['args']}` | {r['acc_mean']:.2f}% ± {r['acc_std']:.2f} | "
                     f"{r['acc_min']:.2f}–{r['acc_max']:.2f}% | {r['final_train_loss_mean']:.3g} | "
                     f"{r['bytes_sent_per_step']:,.0f} | {100 * r['bytes_ratio']:.2f}% |")
    lines += ["", f"Plot: `{Path(m['prefix']).name}.png` (training loss per epoch, mean over seeds, "
              "shaded min–max; right: test accuracy).", ""]
    return "\n".join(lines)


def plot(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = data["meta"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in data["configs"]:
        runs = [r for r in data["runs"] if r["config"] == name]
        if not runs:
            continue
        color, ls = STYLE.get(name, (None, "-"))
        n_ep = min(len(r["history"]) for r in runs)
        epochs = np.arange(1, n_ep + 1)
        for ax, key, scale in ((ax_loss, "train_loss", 1.0), (ax_acc, "test_acc", 100.0)):
            curves = np.array([[h[key] * scale for h in r["history"][:n_ep]] for r in runs])
            ax.plot(epochs, curves.mean(0), color=color, ls=ls, label=f"{CONFIGS[name][0]} (n={len(runs)})")
            ax.fill_between(epochs, curves.min(0), curves.max(0), color=color, alpha=0.15, lw=0)
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("training loss (mean over epoch, ranks)")
    ax_loss.set_title("training loss: mean over seeds, shaded min–max")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("test accuracy (%)")
    ax_acc.set_title("test accuracy")
    lo = min(min(h["test_acc"] for h in r["history"]) for r in data["runs"]) * 100
    ax_acc.set_ylim(max(lo - 2, 0), 100)
    for ax in (ax_loss, ax_acc):
        ax.grid(True, alpha=0.3)
    ax_loss.legend(fontsize=8)
    fig.suptitle(f"digits, {m['np']} ranks, seeds {', '.join(map(str, m['seeds']))}; {m['machine']['cpu']} "
                 f"({m['machine']['cores']} cores), {m['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(data, prefix):
    rows = summarise(data)
    data["summary"] = rows
    md = markdown(data, rows)
    write_report(prefix, data, md)
    plot(data, f"{prefix}.png")
    print()
    print(md)
    print(f"wrote {prefix}.json, {prefix}.md, {prefix}.png")


def main(argv=None):
    args = parse_args(argv)
    prefix = args.out_prefix.resolve()
    if args.replot:
        data = json.loads(Path(f"{prefix}.json").read_text())
        write_outputs(data, prefix)
        return 0

    command = shlex.join([os.path.relpath(sys.executable, Path.cwd()),
                          os.path.relpath(__file__, Path.cwd()), *(sys.argv[1:] if argv is None else argv)])
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command, "machine": machine_info(), "np": args.np, "epochs": args.epochs,
            "seeds": args.seeds, "prefix": str(prefix),
            "run_command": f"mpirun -np {args.np} --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "
                           f"python examples/pytorch_digits.py --quiet --json OUT --epochs {args.epochs} "
                           f"--seed SEED ARGS"}
    data = {"meta": meta, "configs": args.configs, "runs": []}
    plan = [(c, s) for c in args.configs for s in args.seeds]
    print(f"{len(plan)} runs: configs {', '.join(args.configs)} x seeds {' '.join(map(str, args.seeds))}, "
          f"{args.epochs} epochs, {args.np} ranks", flush=True)
    t_start = time.perf_counter()
    for i, (name, seed) in enumerate(plan, 1):
        print(f"[{i:2d}/{len(plan)}] {name:<10s} seed {seed} ... ", end="", flush=True)
        r = run_example(args.np, CONFIGS[name][1], seed, args.epochs, args.timeout, EXAMPLE)
        r.update(config=name, seed=seed)
        data["runs"].append(r)
        elapsed = time.perf_counter() - t_start
        eta = elapsed / i * (len(plan) - i)
        print(f"acc {100 * r['test_acc']:6.2f}%  loss {r['history'][-1]['train_loss']:.4f}  "
              f"({r['wall_s']:.1f}s; elapsed {fmt_s(elapsed)}, ~{fmt_s(eta)} left)", flush=True)
    meta["total_wall_s"] = time.perf_counter() - t_start
    write_outputs(data, prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
