#!/usr/bin/env python
"""What compact pairs (``TopK(compact=True)`` and ``compact="sign"``, ``hvd_topk/compact.py``) cost
per step on the CPU: pack (with the rounding fed back into the residual) and unpack of P ranks'
messages, native and torch ops, against the wide message's size and the decode that follows
either way.

One bucket of a model's sparse tensors (``--model``; ResNet-50: the 76 of its 161 with >= 1024
entries, 25.5M entries, float32; GPT-2-small: 74 of 148, 124.4M), its pairs selected by the
native kernel from a normal residual at each density, as the optimizer selects them. A micro-benchmark of the format's two extra steps,
not a training step (``benchmarks/ddp_hooks.py --methods ... topk-compact`` times those).

    .venv/bin/python benchmarks/compact_pairs.py [--repeat 20] [--model gpt2-small]

Prints a markdown table: median ms of ``--repeat`` calls, one thread.
"""

import argparse
import math
import statistics
import time

import torch

import _common as common
from hvd_topk import codec, compact


def median_ms(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--model", default="resnet50", choices=sorted(common.MODELS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [n for n in (math.prod(s) for s in common.model_shapes(args.model)) if n >= 1024]
    print(common.summary(common.machine_info()))
    print(f"\n{args.model}'s {len(sizes)} sparse tensors in one bucket ({sum(sizes):,} fp32 entries); median of "
          f"{args.repeat} calls, one thread\n")
    print("| values | density | pairs | wide bytes (fp16 values) | compact bytes | path | pack ms | unpack ms, P=2 | "
          "P=8 | decode ms, P=2 (either format) |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    residual = torch.randn(sum(sizes), generator=gen)
    # 8-bit values at 1% and at 0.25% (0.1%'s bytes); sign values at 0.43% (0.1%'s bytes)
    for values, density in (("log", 0.01), ("log", 0.0025), ("sign", 0.0043)):
        plan = codec.Plan(sizes, density, "tensor", torch.float32, torch.int32, compact_values=values)
        wide16 = codec.Plan(sizes, density, "tensor", torch.float16, torch.int32).layout.nbytes
        message = torch.empty(plan.layout.nbytes, dtype=torch.uint8)
        codec.Codec().encode(residual.clone(), plan, message, zero_sent=True)
        pairs = plan.compact()
        packed = pairs.pack(message, out=False)
        dests = [torch.empty(n) for n in sizes]
        decode = median_ms(lambda: codec.Codec.decode(torch.cat([message, message]), plan.layout, 2, dests,
                                                      plan.bounds, div=2), args.repeat)
        for path in ("native", "torch ops"):
            native = compact._native
            if path == "torch ops":
                compact._native = lambda *a: None
            try:
                pack = median_ms(lambda: pairs.pack(message, residual=residual), args.repeat)
                unpack = {p: median_ms(lambda: pairs.unpack(torch.cat([packed] * p), p, out=False), args.repeat)
                          for p in (2, 8)}
            finally:
                compact._native = native
            print(f"| {'8-bit' if values == 'log' else 'sign'} | {density:.2%} | {plan.count:,} | {wide16:,} | {pairs.nbytes:,} | {path} | {pack:.1f} | "
                  f"{unpack[2]:.1f} | {unpack[8]:.1f} | {decode:.1f} |")


if __name__ == "__main__":
    main()
