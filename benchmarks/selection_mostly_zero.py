#!/usr/bin/env python
"""The native selection on a mostly-zero tensor: GPT-2's token embedding (50,257 x 768) when a
few hundred rows were touched, their entries just more than k (1%) of the tensor: the residual
of error feedback a few steps into training on small batches. There the sampled threshold can
land too high (the sample's runs fall in few rows), and the second pass lowers it to zero.

    .venv/bin/python benchmarks/selection_mostly_zero.py
    PYTHONPATH=/tmp/old-tree .venv/bin/python benchmarks/selection_mostly_zero.py   # another tree

Prints, per number of touched rows: 10 calls, each with its own sampling seed (training draws a
fresh one every step): the median and the slowest call (ms), and the most passes any call made.
One thread; selection zeroes nothing here, so every call sees the same tensor.
"""

import argparse
import statistics
import sys
import time

import torch

from hvd_topk import selection

ROWS, WIDTH, DENSITY = 50257, 768, 0.01


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    torch.set_num_threads(1)
    n = ROWS * WIDTH
    k = int(n * DENSITY)
    print(f"hvd_topk from {selection.__file__}; {ROWS} x {WIDTH} fp32, k = {k} (1%)")
    print("| touched rows | non-zero entries | median ms (10 seeds) | slowest ms | most passes |")
    print("|---:|---:|---:|---:|---:|")
    for touched in (128, 480, 505, 510, 520, 550, 600, 1000):
        gen = torch.Generator().manual_seed(touched)
        x = torch.zeros(ROWS, WIDTH)
        x[torch.randperm(ROWS, generator=gen)[:touched]] = torch.randn(touched, WIDTH, generator=gen) * 1e-3
        x = x.view(-1)
        idx, val = torch.empty(k, dtype=torch.int32), torch.empty(k)
        times, passes = [], 0
        for seed in range(10):
            t0 = time.perf_counter()
            result = selection.select_native(x, k, idx, val, seed=seed)
            times.append(time.perf_counter() - t0)
            passes = max(passes, result.passes)
        print(f"| {touched} | {touched * WIDTH:,} | {1e3 * statistics.median(times):.1f} | "
              f"{1e3 * max(times):.1f} | {passes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
