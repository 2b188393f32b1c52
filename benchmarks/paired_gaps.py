#!/usr/bin/env python
r"""Seed-by-seed gaps between runs kept in different result files of ``convergence_gpt.py``:
a scheme's runs from one file against dense AdamW's from another, without running anything.

Why: a comparison is only as good as its pairing. Two VMs give different bits for the same run
(dense AdamW's seed 42 over 1000 steps ends at 1.2339 on one, 1.2278 on the other), so a gap
between a scheme run on one machine and a dense run reused from another carries that
difference. This puts any two sets of committed runs side by side, names the machine of each
file's report, and computes the gap per seed (``loss / dense - 1``), its mean and 95% interval,
as ``convergence_gpt.py`` does within one file.

    .venv/bin/python benchmarks/paired_gaps.py \
        --dense benchmarks/results/gpt/convergence-gpt-np4-0.1-sign0.43-lr1.5e-2-2d75b7b-1000.json dense-lr1e-2 \
        --vs benchmarks/results/gpt/convergence-gpt-np4-0.1-1000.json gv-0.1%-lr2e-2-fp16v-decay0.99

The machine is the one its file's report (the ``.md`` beside the ``.json``) names: the machine
that wrote the report, which ran every run of that file not reused from another (a reused run
names its source file in ``made``, where recorded).
"""

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence_gpt import paired_gap  # noqa: E402


def load(path, config):
    """The runs of ``config`` in the result file ``path`` (``SystemExit`` naming what is missing)."""
    runs = [r for r in json.loads(Path(path).read_text())["runs"] if r["config"] == config]
    if not runs:
        raise SystemExit(f"{path}: no runs of config {config!r}")
    seeds = [r["seed"] for r in runs]
    if len(set(seeds)) < len(seeds):  # a screen's patched variants kept under one name: which to pair?
        raise SystemExit(f"{path}: config {config!r} has more than one run of a seed ({sorted(seeds)}); "
                         "its report says which is which")
    return runs


def report_machine(path):
    """``(machine, date)`` named by the report beside ``path`` (``PATH.md``), or ``("?", "?")``."""
    md = Path(path).with_suffix(".md")
    text = md.read_text() if md.exists() else ""
    machine = re.search(r"^Machine: ([^;\n]+)", text, re.M)
    date = re.search(r"^Date \(UTC\): (\S+)", text, re.M)
    return (machine.group(1).strip() if machine else "?", date.group(1) if date else "?")


def gaps_table(dense, others):
    """Markdown lines: each of ``others`` (``(path, config)``) against ``dense`` (``(path, config)``),
    seed by seed, with each file's machine and date."""
    dense_runs = load(*dense)
    dense_machine, dense_date = report_machine(dense[0])
    lines = [f"Against `{dense[1]}` of `{Path(dense[0]).name}` ({dense_machine}, {dense_date}).", "",
             "| configuration | file | its machine, date | per seed | paired mean [95%] |",
             "|---|---|---|---|---:|"]
    for path, config in others:
        runs = [dict(r, config="x") for r in load(path, config)] + [dict(r, config="dense") for r in dense_runs]
        gap = paired_gap(runs, "x", "dense")
        if gap is None:
            raise SystemExit(f"{path}: {config!r} shares no seed with the dense runs")
        seeds = [r["seed"] for r in runs if r["config"] == "x" and r["seed"] in {d["seed"] for d in dense_runs}]
        per_seed = ", ".join(f"{s}: {100 * g:+.2f}%" for s, g in zip(seeds, gap["per_seed"]))
        machine, date = report_machine(path)
        lines.append(f"| `{config}` | `{Path(path).name}` | {machine}, {date} | {per_seed} | "
                     f"**{100 * gap['mean']:+.2f}%** [{100 * gap['low']:+.1f}, {100 * gap['high']:+.1f}] |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dense", nargs=2, required=True, metavar=("JSON", "CONFIG"),
                    help="the runs compared against (dense AdamW)")
    ap.add_argument("--vs", nargs=2, action="append", required=True, metavar=("JSON", "CONFIG"),
                    help="runs to compare (repeat the option for several)")
    args = ap.parse_args(argv)
    print("\n".join(gaps_table(tuple(args.dense), [tuple(v) for v in args.vs])))


if __name__ == "__main__":
    main()
