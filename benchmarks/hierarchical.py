#!/usr/bin/env python
"""Accuracy with the hierarchical exchange: the digits example on emulated hosts, flat vs
hierarchical (allgather across hosts, 1%, error feedback), several seeds.

Each run: ``mpirun -np H*L -H host0:L,...`` (one network namespace per host, tbf-shaped link,
ranks of a host over its loopback) of ``examples/pytorch_digits.py --optimizer topk-ef
--exchange allgather --density 0.01 --seed S`` with and without ``--hierarchical``.

    .venv/bin/python benchmarks/hierarchical.py                  # 2 hosts x 2 ranks, seeds 42 43 44
    .venv/bin/python benchmarks/hierarchical.py --seeds 42 --epochs 5 --out-prefix /tmp/h  # quick

Writes PREFIX.json and PREFIX.md (default PREFIX: benchmarks/results/hierarchical/hierarchical-digits).
"""

import argparse
import datetime
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import emulated_hosts as eh_mod  # noqa: E402
from _common import machine_info, summary, write_report  # noqa: E402

EXAMPLE = ROOT / "examples" / "pytorch_digits.py"
BASE = ["--optimizer", "topk-ef", "--exchange", "allgather", "--density", "0.01"]
CONFIGS = {"flat": [], "hierarchical": ["--hierarchical"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--ssh-port", type=int, default=2290)
    ap.add_argument("--out-prefix", type=Path, default=ROOT / "benchmarks" / "results" / "hierarchical" / "hierarchical-digits")
    args = ap.parse_args(argv)
    runs, started = [], time.time()
    with eh_mod.EmulatedHosts(args.hosts, rate=args.rate, sshd=True, ssh_port=args.ssh_port) as eh, \
            tempfile.TemporaryDirectory() as tmp:
        for name, extra in CONFIGS.items():
            for seed in args.seeds:
                out = Path(tmp) / f"{name}-{seed}.json"
                cmd = eh.mpirun_command([EXAMPLE, "--quiet", "--json", out, "--epochs", args.epochs, "--seed", seed,
                                         *BASE, *extra], slots=args.ranks_per_host, pythonpath=str(ROOT), wdir=ROOT)
                t0 = time.time()
                rc, output = eh_mod.stream(eh.launcher_cmd(cmd), timeout=args.timeout, keep=True)
                if rc != 0 or not out.exists():
                    raise SystemExit(f"{name} seed {seed}: exit {rc}\n{output[-4000:] if output else ''}")
                result = json.loads(out.read_text())
                runs.append({"config": name, "seed": seed, "test_acc": result["test_acc"],
                             "bytes_sent_per_step": result.get("bytes_sent_per_step"),
                             "hierarchical": result.get("compression_stats", {}).get("hierarchical"),
                             "wall_s": time.time() - t0, "mpirun": shlex.join(map(str, cmd))})
                print(f"{name:>12} seed {seed}: {100 * result['test_acc']:.2f}%  ({time.time() - t0:.0f} s)", flush=True)
    summary_rows = {}
    for name in CONFIGS:
        accs = [100 * r["test_acc"] for r in runs if r["config"] == name]
        summary_rows[name] = {"mean": statistics.mean(accs), "min": min(accs), "max": max(accs),
                              "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                              "hierarchical": sorted({str(r["hierarchical"]) for r in runs if r["config"] == name})}
    info = machine_info()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "benchmarks/hierarchical.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": summary(info), "hosts": args.hosts, "ranks_per_host": args.ranks_per_host,
            "rate": args.rate, "epochs": args.epochs, "seeds": args.seeds, "wall_s": time.time() - started}
    prefix = args.out_prefix
    lines = ["# Digits with the hierarchical exchange (emulated hosts)", "",
             f"- command: `{meta['command']}`", f"- date: {meta['date']}; machine: {meta['machine']}",
             f"- {args.hosts} emulated hosts x {args.ranks_per_host} ranks, {args.rate} links between hosts; "
             f"each run `examples/pytorch_digits.py {' '.join(BASE)} --epochs {args.epochs}` (+ `--hierarchical`)",
             "", "| configuration | test accuracy, mean ± std | min–max | hierarchical reported |", "|---|---|---|---|"]
    for name, r in summary_rows.items():
        lines.append(f"| {name} | {r['mean']:.2f}% ± {r['std']:.2f} | {r['min']:.2f}–{r['max']:.2f}% | "
                     f"{', '.join(r['hierarchical'])} |")
    diff = summary_rows["hierarchical"]["mean"] - summary_rows["flat"]["mean"]
    lines += ["", f"Hierarchical minus flat: {diff:+.2f} points (mean over seeds {args.seeds}).", ""]
    write_report(prefix, {"meta": meta, "runs": runs, "summary": summary_rows}, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
