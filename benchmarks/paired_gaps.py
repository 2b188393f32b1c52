#!/usr/bin/env python
r"""Seed-by-seed gaps between runs kept in different result files of ``convergence_gpt.py``:
a scheme's runs from one file against dense AdamW's from another, without running anything,
with the machine that made each run.

Why: a comparison is only as good as its pairing. Two kinds of VM made these files and give
other bits for the same run (dense AdamW's seed 42 over 1000 steps ends at 1.2339 on an AMD EPYC
VM, 1.2278 on an Intel Xeon one), and a file may hold runs reused from another file, made on the
other machine. This puts two sets of committed runs side by side, seed by seed (``loss / dense -
1``, its mean and 95% interval, as ``convergence_gpt.py`` computes within one file), and says
for every run where it was made.

    .venv/bin/python benchmarks/paired_gaps.py \
        --dense benchmarks/results/gpt/convergence-gpt-np4-0.1-sign0.43-lr1.5e-2-2d75b7b-1000.json dense-lr1e-2 \
        --vs benchmarks/results/gpt/convergence-gpt-np4-0.1-1000.json gv-0.1%-lr2e-2-fp16v-decay0.99

Where a run was made: a run not reused was made by the job that wrote its file, on the machine
its ``meta`` names (the ``.md`` report beside it where ``meta`` lacks it). A reused run made
since 2026-12-07 names its machine in ``made``; one made since 2026-12-05 names its source file
there, which, if it sits beside this one, is followed to the run with the same config, seed,
steps, ranks and loss. Older reused runs say "source not recorded": their machine is unknown,
not the file's.
"""

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence_gpt import paired_gap  # noqa: E402


def read(path):
    """A result file's JSON (``SystemExit`` naming the file if it cannot be read or has no runs)."""
    try:
        saved = json.loads(Path(path).read_text())
        saved["runs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a convergence_gpt.py result file ({type(e).__name__}: {e})") from None
    return saved


def reader():
    """``read``, each file parsed once (a table reads a file per run it names: its meta, a source)."""
    parsed = {}

    def read_once(path):
        key = str(Path(path).resolve())
        if key not in parsed:
            parsed[key] = read(path)
        return parsed[key]
    return read_once


def load(path, config, read_file=read):
    """The runs of ``config`` in the result file ``path``, one per seed."""
    runs = [r for r in read_file(path)["runs"] if r.get("config") == config]
    if not runs:
        raise SystemExit(f"{path}: no runs of config {config!r}")
    seeds = [r["seed"] for r in runs]
    if len(set(seeds)) < len(seeds):  # a screen's patched variants kept under one name: which to pair?
        raise SystemExit(f"{path}: config {config!r} has more than one run of a seed ({sorted(seeds)}); "
                         "its report says which is which")
    return runs


def file_machine(path, read_file=read):
    """``(cpu, date)`` of the job that wrote ``path``: its ``meta``, else the report beside it
    ("?" for what neither says)."""
    meta = read_file(path).get("meta", {})
    cpu, date = meta.get("machine", {}).get("cpu"), meta.get("date")
    if not (cpu and date):
        md = Path(path).with_suffix(".md")
        text = md.read_text() if md.exists() else ""
        found_cpu = re.search(r"^Machine: ([^,;\n]+)", text, re.M)
        found_date = re.search(r"^Date \(UTC\): (\S+)", text, re.M)
        cpu = cpu or (found_cpu.group(1).strip() if found_cpu else "?")
        date = date or (found_date.group(1) if found_date else "?")
    return cpu, date.split()[0]


def made_on(path, run, read_file=read, depth=0):
    """Where ``run`` of the file ``path`` was made (see the module's docstring): ``(cpu, date)``,
    or ``(None, why it is not known)``."""
    if not run.get("reused"):
        return file_machine(path, read_file)
    made = run.get("made") or {}
    if made.get("machine") and made.get("date"):  # recorded by the run itself (since 2026-12-07)
        return made["machine"], made["date"].split()[0]
    source = made.get("file")
    if not source:
        return None, "reused, source not recorded"
    source_path = Path(path).parent / source
    key = lambda r: (r.get("config"), r.get("seed"), r.get("steps"), r.get("ranks"), r.get("final_val_loss"))
    if source_path.exists() and depth < 8:
        for r in read_file(source_path)["runs"]:
            if key(r) == key(run):
                return made_on(source_path, r, read_file, depth + 1)
    when = f", made {made['date'].split()[0]}" if made.get("date") else ""
    return None, f"reused from {source}{when}, not found beside it"


def along_the_run(pairs, by_seed, steps):
    """Markdown lines: the mean over seeds of the gap at each validation step of ``steps`` (from the
    runs' histories; "n/a" where a run has no evaluation at that step)."""
    cells = []
    for step in steps:
        gaps = []
        for r in pairs:
            mine = {h["step"]: h["val_loss"] for h in r.get("history", [])}
            dense = {h["step"]: h["val_loss"] for h in by_seed[r["seed"]].get("history", [])}
            gaps.append(mine[step] / dense[step] - 1 if step in mine and step in dense else None)
        known = [g for g in gaps if g is not None]
        cells.append(f"{100 * sum(known) / len(known):+.1f}%" if len(known) == len(gaps) else "n/a")
    return ["| step | " + " | ".join(str(s) for s in steps) + " |", "|---|" + "---:|" * len(steps),
            "| gap, mean over seeds | " + " | ".join(cells) + " |", ""]


def gaps_table(dense, others, at=()):
    """Markdown lines: each of ``others`` (``(path, config)``) against ``dense`` (``(path, config)``),
    seed by seed, with where each run was made; with ``at``, the gap along the run at those steps."""
    read_file = reader()
    dense_runs = load(*dense, read_file)
    by_seed = {r["seed"]: r for r in dense_runs}
    lines = []
    for path, config in others:
        runs = load(path, config, read_file)
        for r in runs:
            d = by_seed.get(r["seed"])
            if d is not None and (r.get("steps"), r.get("ranks")) != (d.get("steps"), d.get("ranks")):
                raise SystemExit(f"{path}: {config!r} seed {r['seed']} ran {r.get('steps')} steps on {r.get('ranks')} "
                                 f"ranks, the dense run {d.get('steps')} on {d.get('ranks')}: not a pair")
        pairs = [r for r in runs if r["seed"] in by_seed]
        gap = paired_gap([dict(r, config="x") for r in pairs] + [dict(r, config="dense") for r in dense_runs], "x", "dense")
        if gap is None:
            raise SystemExit(f"{path}: {config!r} shares no seed with the dense runs")
        interval = f" [{100 * gap['low']:+.1f}, {100 * gap['high']:+.1f}]" if gap["n"] > 1 else ""
        lines += [f"`{config}` (`{Path(path).name}`) against `{dense[1]}` (`{Path(dense[0]).name}`): "
                  f"**{100 * gap['mean']:+.2f}%**{interval}, {gap['n']} seeds", "",
                  "| seed | loss | made on | dense loss | made on | gap |", "|---:|---:|---|---:|---|---:|"]
        crossed = []
        for r, g in zip(pairs, gap["per_seed"]):
            d = by_seed[r["seed"]]
            (cpu, here), (dense_cpu, there) = made_on(path, r, read_file), made_on(dense[0], d, read_file)
            if cpu is None or cpu != dense_cpu:  # an unknown machine is no match, not even for another unknown
                crossed.append(str(r["seed"]))
            label = lambda cpu, what: what if cpu is None else f"{cpu}, {what}"
            lines.append(f"| {r['seed']} | {r['final_val_loss']:.4f} | {label(cpu, here)} | {d['final_val_loss']:.4f} | "
                         f"{label(dense_cpu, there)} | {100 * g:+.2f}% |")
        lines += ["", f"Seeds whose two runs were not made on the same kind of machine (or not known to be): "
                      f"{', '.join(crossed) or 'none'}.", ""]
        if at:
            lines += along_the_run(pairs, by_seed, at)
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dense", nargs=2, required=True, metavar=("JSON", "CONFIG"),
                    help="the runs compared against (dense AdamW)")
    ap.add_argument("--vs", nargs=2, action="append", required=True, metavar=("JSON", "CONFIG"),
                    help="runs to compare (repeat the option for several)")
    ap.add_argument("--at", type=int, nargs="+", default=[], metavar="STEP",
                    help="also the gap along the run at these validation steps")
    args = ap.parse_args(argv)
    print("\n".join(gaps_table(tuple(args.dense), [tuple(v) for v in args.vs], args.at)))


if __name__ == "__main__":
    main()
