"""Selection speed: hvd_topk's kernels against torch.topk, numpy argpartition and the floor.

The floor is one streaming pass over the tensor (``x.sum()``): no selection can read less.
Every time is a median over ``--repeats`` calls after one warm-up call, on the same normal
data; ratios are taken within this one run (the machine is shared and noisy).

    .venv/bin/python benchmarks/selection.py                  # full table (~3 min on 2 cores)
    .venv/bin/python benchmarks/selection.py --sizes 1e6 --densities 0.01 --threads 1  # quick
    .venv/bin/python benchmarks/selection.py --sizes --threads 1 --out benchmarks/results/selection/selection-models
                                                              # model-shape rows only

Model-shape rows (``--models resnet50 bert-base``, at ``--model-density``, one thread): the
gradients of ResNet-50 (161 tensors, 25,557,032 values) or BERT-base (bert-base-uncased's
BertModel: 199 tensors, 109,482,240 values) laid out back to back in one flat fp32 buffer, and:

    per-tensor select_native (today)   one native call per tensor, k = k_for(tensor, density)
    tensor scope: select_segments      one native call over the buffer, the same per-tensor ks
                                       (only where hvd_topk.selection.select_segments exists)
    bucket scope: select_native        one native call over the whole buffer, k = k_for(total)
    floor: one streaming pass          x.sum() over the same number of elements

Writes benchmarks/results/selection/selection.{json,md} (``--out`` to change), with command, machine
and date. The native kernel is single-threaded; torch ops use ``--threads`` threads.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (model shapes, machine info, report writing)

from hvd_topk import selection  # noqa: E402


def timed(fn, repeats):
    fn()  # warm-up: first-touch allocations, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_shape_rows(model, density, method, repeats):
    """Per-tensor, tensor-scope, bucket-scope selection and the floor over one model's gradients."""
    shapes = common.model_shapes(model)
    sizes = [int(np.prod(s)) for s in shapes]
    n = sum(sizes)
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    segs = [x[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]
    ks = [selection.k_for(size, density) for size in sizes]
    pairs = sum(ks)
    per_idx = [torch.empty(k, dtype=torch.int64) for k in ks]
    per_val = [torch.empty(k) for k in ks]
    idx, val = torch.empty(pairs, dtype=torch.int64), torch.empty(pairs)
    k_all = selection.k_for(n, density)
    all_idx, all_val = torch.empty(k_all, dtype=torch.int64), torch.empty(k_all)

    def per_tensor():
        for seg, k, i, v in zip(segs, ks, per_idx, per_val):
            selection.select_native(seg, k, i, v, method)

    cases = [("floor: one streaming pass (x.sum)", 1, 0, lambda: x.sum()),
             ("per-tensor: select_native per tensor (today)", len(sizes), pairs, per_tensor)]
    if hasattr(selection, "select_segments"):
        b, kt = torch.tensor(bounds, dtype=torch.int64), torch.tensor(ks, dtype=torch.int64)
        cases.append(("tensor scope: select_segments, one call", 1, pairs,
                      lambda: selection.select_segments(x, b, kt, idx, val, method=method)))
    cases.append(("bucket scope: select_native over the whole buffer", 1, k_all,
                  lambda: selection.select_native(x, k_all, all_idx, all_val, method)))
    out = []
    floor = None
    for row, calls, count, fn in cases:
        seconds = timed(fn, repeats)
        floor = floor or seconds
        out.append({"model": model, "tensors": len(sizes), "n": n, "density": density, "method": method,
                    "row": row, "calls": calls, "pairs": count, "median_s": seconds,
                    "x_floor": seconds / floor})
        print(f"{model:>10} ({len(sizes)} tensors, {n:,}) density={density:g} {row:<52} "
              f"{seconds * 1e3:9.2f} ms  {seconds / floor:6.1f}x floor", flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", type=float, default=[1e6, 1e7, 2.5e7],
                        help="flat tensor sizes (none: only model-shape rows)")
    parser.add_argument("--densities", nargs="+", type=float, default=[0.001, 0.01, 0.1])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", nargs="*", default=["resnet50", "bert-base"],
                        choices=list(common.MODELS), help="model-shape rows (none: skip)")
    parser.add_argument("--model-density", type=float, default=0.01)
    parser.add_argument("--model-method", default="sampled", choices=["sampled", "exact"])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "selection" / "selection"))
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

    torch.set_num_threads(1)
    model_rows = [r for name in args.models
                  for r in model_shape_rows(name, args.model_density, args.model_method, args.repeats)]

    for row in rows:
        topk = next(r for r in rows if (r["n"], r["density"], r["threads"], r["method"])
                    == (row["n"], row["density"], row["threads"], "torch.topk"))
        row["speedup_vs_torch_topk"] = topk["median_s"] / row["median_s"]
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": common.machine_info(),
            "hvd_topk": str(Path(selection.__file__).parent),
            "select_segments": hasattr(selection, "select_segments")}
    out = Path(args.out)
    lines = ["# Selection speed", "", f"- command: `{meta['command']}`",
             f"- machine: {common.summary(meta['machine'])}",
             f"- date: {meta['machine']['date_utc']}; hvd_topk from {meta['hvd_topk']}", ""]
    if rows:
        lines += [
             "Median time per call; `x floor` = time / one streaming pass (`x.sum()`) over the same "
             "tensor; `vs topk` = torch.topk's time / this time. The native kernels are "
             "single-threaded.", "",
             "| threads | n | density | method | ms | x floor | vs topk | recall |",
             "|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['n']:,} | {r['density']:g} | {r['method']} | "
                     f"{r['median_s'] * 1e3:.2f} | {r['x_floor']:.1f} | {r['speedup_vs_torch_topk']:.1f} | "
                     f"{r.get('recall', float('nan')):.4f} |".replace("| nan |", "| |"))
    if model_rows:
        lines += ["", "## Model shapes (one thread)", "",
                  "The model's gradients back to back in one flat fp32 buffer. Per-tensor and tensor "
                  "scope send k = k_for(tensor, density) per tensor (every tensor, however small); bucket "
                  "scope sends k = k_for(total, density) from the whole buffer. `x floor` = time / one "
                  "streaming pass (`x.sum()`) over the same number of elements. Median of "
                  f"{args.repeats} calls after one warm-up call.", "",
                  "| model | tensors | values | density | row | calls | pairs | ms | x floor |",
                  "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
        for r in model_rows:
            lines.append(f"| {r['model']} | {r['tensors']} | {r['n']:,} | {r['density']:g} | {r['row']} | "
                         f"{r['calls']} | {r['pairs']:,} | {r['median_s'] * 1e3:.2f} | {r['x_floor']:.1f} |")
        if not meta["select_segments"]:
            lines += ["", "(no tensor-scope row: this hvd_topk has no `selection.select_segments`)"]
    common.write_report(out.with_suffix(""), {"meta": meta, "rows": rows, "model_rows": model_rows},
                        "\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
