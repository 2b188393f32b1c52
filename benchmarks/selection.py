"""Selection speed: hvd_topk's kernels against torch.topk, numpy argpartition and the floor.

The floor is one streaming pass over the tensor (``x.sum()``): no selection can read less.
Every time is a median over ``--repeats`` calls after one warm-up call, on the same normal
data; ratios are taken within this one run (the machine is shared and noisy).

    .venv/bin/python benchmarks/selection.py                  # full table (~3 min on 2 cores)
    .venv/bin/python benchmarks/selection.py --sizes 1e6 --densities 0.01 --threads 1  # quick

Writes benchmarks/results/selection.{json,md} (``--out`` to change), with command, machine
and date. The native kernel is single-threaded; torch ops use ``--threads`` threads.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from hvd_topk import selection  # noqa: E402


def timed(fn, repeats):
    fn()  # warm-up: first-touch allocations, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7, 2.5e7])
    parser.add_argument("--densities", nargs="+", type=float, default=[0.001, 0.01, 0.1])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "selection"))
    args = parser.parse_args(argv)
    if selection.native.library() is None:
        sys.exit(f"native kernel unavailable: {selection.native.unavailable_reason()}")

    rows = []
    gen = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in map(int, args.sizes):
            x = torch.randn(n, generator=gen)
            xn = x.numpy()
            floor = timed(lambda: x.sum(), args.repeats)
            for density in args.densities:
                k = selection.k_for(n, density)
                idx = torch.empty(k, dtype=torch.int64)
                val = torch.empty(k)
                truth = torch.topk(x.abs(), k, sorted=False).indices
                methods = {
                    "floor (x.sum)": lambda: x.sum(),
                    "sampled": lambda: selection.select_native(x, k, idx, val, "sampled"),
                    "exact": lambda: selection.select_native(x, k, idx, val, "exact"),
                    "sampled (torch ops)": lambda: selection.select_sampled_torch(x, k),
                    "torch.topk": lambda: torch.topk(x.abs(), k, sorted=False),
                    "numpy argpartition": lambda: np.argpartition(np.abs(xn), n - k)[n - k:],
                }
                for name, fn in methods.items():
                    seconds = floor if name.startswith("floor") else timed(fn, args.repeats)
                    row = {"n": n, "density": density, "k": k, "threads": threads, "method": name,
                           "median_s": seconds, "x_floor": seconds / floor}
                    if name in ("sampled", "exact", "sampled (torch ops)"):
                        got = idx if name != "sampled (torch ops)" else selection.select_sampled_torch(x, k)[1]
                        if name != "sampled (torch ops)":
                            fn()
                        row["recall"] = float(np.isin(got.numpy(), truth.numpy()).mean())
                        row["count"] = int(got.numel())
                    rows.append(row)
                    print(f"threads={threads} n={n:>10,} density={density:<6} {name:<20} "
                          f"{seconds * 1e3:9.2f} ms  {seconds / floor:7.1f}x floor"
                          + (f"  recall {row['recall']:.4f}" if "recall" in row else ""), flush=True)
            del x, xn

    for row in rows:
        topk = next(r for r in rows if (r["n"], r["density"], r["threads"], r["method"])
                    == (row["n"], row["density"], row["threads"], "torch.topk"))
        row["speedup_vs_torch_topk"] = topk["median_s"] / row["median_s"]
    meta = describe(" ".join([Path(sys.executable).name, *sys.argv]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Selection speed", "", *[f"- {k}: {v}" for k, v in meta.items()], "",
             "Median time per call; `x floor` = time / one streaming pass (`x.sum()`) over the same "
             "tensor; `vs topk` = torch.topk's time / this time. The native kernels are "
             "single-threaded.", "",
             "| threads | n | density | method | ms | x floor | vs topk | recall |",
             "|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['n']:,} | {r['density']:g} | {r['method']} | "
                     f"{r['median_s'] * 1e3:.2f} | {r['x_floor']:.1f} | {r['speedup_vs_torch_topk']:.1f} | "
                     f"{r.get('recall', float('nan')):.4f} |".replace("| nan |", "| |"))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
