#!/usr/bin/env python
"""Decode speed: every rank's gathered pairs added, in rank order and averaged, into a bucket's
tensors (``hvd_topk.codec.Codec.decode``, what the allgather does after each exchange), with the
native kernel and with torch ops.

A real model's gradient shapes (``--model``) laid out as DDP lays them out (reverse order, buckets
of ``--bucket-mb``), each tensor's top-``--density`` pairs from every one of ``--ranks`` ranks
(distinct ascending positions, normal values), fp32 and 16-bit values (``TopK(fp16_values=True)``).
A step's time is the sum over the buckets; the median of ``--repeats`` steps after one warm-up.

- ``native``: what hvd_topk does on a CPU with its kernel built;
- ``native, then copied out``: the same, each bucket then copied into separate gradient tensors,
  as DDP does after the hook (``gradient_as_bucket_view=False``, its default) and as an
  optimizer's step reads ``p.grad`` after the Horovod optimizer's decode: a decode that leaves
  the bucket in cache makes this copy cheaper, one that writes around the cache (streaming
  stores, buckets from 8 MB since 2026-11-28) does not, so this column is the one to compare;
- ``torch ops``: what it does without the kernel (``HVD_TOPK_NATIVE=0``, no compiler) -- and what
  it did for 16-bit values before 2026-11-26, when the kernel took fp32/fp64 values only.

    .venv/bin/python benchmarks/decode.py                                  # ResNet-50, 2 and 8 ranks
Results: benchmarks/results/selection/decode-<model>.{json,md} (``--out`` to change).
"""

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

from hvd_topk import codec, wire  # noqa: E402
from hvd_topk.selection import k_for  # noqa: E402


def buckets(shapes, bucket_mb):
    """Lists of tensor sizes in DDP's order (last parameter first), cut at ``bucket_mb`` of fp32."""
    out, current, nbytes = [], [], 0
    for shape in reversed(shapes):
        n = int(torch.Size(shape).numel())
        current.append(n)
        nbytes += 4 * n
        if nbytes >= bucket_mb * 2 ** 20:
            out.append(current)
            current, nbytes = [], 0
    return out + ([current] if current else [])


def prepared(sizes, density, world, value_dtype, gen):
    """(gathered message, its layout, the destinations, their bounds) for one bucket."""
    bounds = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    ks = [k_for(n, density) for n in sizes]
    k = sum(ks)
    layout = wire.Layout(k, value_dtype, torch.int32)
    rows = []
    for _ in range(world):
        picks = [torch.randperm(n, generator=gen)[:kn].sort().values + int(b)
                 for n, kn, b in zip(sizes, ks, bounds.tolist())]
        rows.append(layout.pack(torch.randn(k, generator=gen).to(value_dtype), torch.cat(picks).int()))
    dests = list(torch.zeros(int(bounds[-1])).split(sizes))
    return torch.cat(rows), layout, dests, bounds, [torch.empty(n) for n in sizes]


@contextmanager
def torch_ops():
    """The decode as it runs without the native kernel."""
    with mock.patch.object(codec, "native_ok", lambda tensor: False):
        yield


def step_ms(prepared_buckets, world, repeats, copy_out=False):
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        for gathered, layout, dests, bounds, grads in prepared_buckets:
            codec.Codec.decode(gathered, layout, world, dests, bounds, div=world)
            if copy_out:
                torch._foreach_copy_(grads, dests)
        if i:
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50", choices=sorted(common.MODELS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shapes = common.model_shapes(args.model)
    layout_sizes = buckets(shapes, args.bucket_mb)
    rows = []
    for world in args.ranks:
        for value_dtype in (torch.float32, torch.float16):
            gen = torch.Generator().manual_seed(0)
            ready = [prepared(sizes, args.density, world, value_dtype, gen) for sizes in layout_sizes]
            for threads in args.threads:
                torch.set_num_threads(threads)
                native_ms = step_ms(ready, world, args.repeats)
                copied_ms = step_ms(ready, world, args.repeats, copy_out=True)
                with torch_ops():
                    torch_ms = step_ms(ready, world, args.repeats)
                row = {"ranks": world, "values": str(value_dtype).replace("torch.", ""), "threads": threads,
                       "native_ms": native_ms, "native_then_copied_ms": copied_ms, "torch_ops_ms": torch_ms}
                rows.append(row)
                print(row, flush=True)
    prefix = Path(args.out or common.RESULTS / "selection" / f"decode-{args.model}")
    command = " ".join([".venv/bin/python", "benchmarks/decode.py", *(sys.argv[1:] if argv is None else argv)])
    info = common.machine_info()
    report = {"benchmark": "decode", "command": command, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "machine": info, "model": args.model, "buckets": [len(b) for b in layout_sizes],
              "settings": vars(args), "rows": rows}
    lines = ["# Decode speed: gathered pairs into a bucket's tensors (CPU)", "",
             f"Date (UTC): {report['date_utc']}  ", f"Machine: {common.summary(info)}  ", f"Command: `{command}`  ",
             f"Model shapes: {args.model} ({common.numel(shapes):,} values in {len(shapes)} tensors), in "
             f"{len(layout_sizes)} buckets of {args.bucket_mb:g} MB as DDP lays them out; top {args.density:g} "
             f"of each tensor from every rank; a step = every bucket decoded, median of {args.repeats}.", "",
             "| ranks | values | torch threads | native ms | native, then copied out ms | torch ops ms | "
             "torch ops / native |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['values']} | {r['threads']} | {r['native_ms']:.1f} | "
                     f"{r['native_then_copied_ms']:.1f} | {r['torch_ops_ms']:.1f} | "
                     f"{r['torch_ops_ms'] / r['native_ms']:.1f}x |")
    lines += ["", "The native kernel is single-threaded. Before 2026-11-26 16-bit values took the torch-ops "
              "path even with the kernel built (it took fp32/fp64 values only)."]
    common.write_report(prefix, report, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
