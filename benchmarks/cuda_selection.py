"""Selection and the codec on a CUDA GPU: hvd_topk's torch-ops paths against torch.topk per
tensor and the floor, at real models' tensor shapes.

For each model (ResNet-50's 161 tensors, BERT-base's 199), the gradients laid out back to back
in one flat fp32 buffer on the GPU (as a DDP bucket or Horovod's fusion buffer holds them), at
``--density`` (per-tensor k, the contract):

    floor: one streaming pass          x.sum() over the buffer: no selection reads less
    torch.topk per tensor              what a hand-written Top-K hook does: topk(|t|, k) per tensor
    select_segments_torch exact        hvd_topk's exact path (torch.topk per segment, gathered)
    select_segments_torch sampled      hvd_topk's default on CUDA: one batched sample, a threshold
                                       per segment, one fixed-size candidate set; no host sync
    encode (sampled, error feedback)   Codec.encode: select, pack pairs, zero what was sent
    decode of 8 ranks                  Codec.decode: 8 ranks' messages added into the buffer

Times are medians of ``--repeats`` runs after 3 warm-ups, measured with CUDA events; ratios
within this one run. Writes ``OUT.json`` and ``OUT.md`` with the command, the GPU, the versions
and the date. Run on a GPU machine (benchmarks/gpu_check.sh runs it there):

    python benchmarks/cuda_selection.py --out benchmarks/results/gpu/cuda-selection
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (model shapes, report writing)

from hvd_topk import codec, selection  # noqa: E402


def cuda_ms(fn, repeats):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(model, density, repeats, device):
    shapes = common.model_shapes(model)
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    n = sum(sizes)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, generator=gen, device=device)
    ks = [selection.k_for(s, density) for s in sizes]
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    tensors = [x[b:e] for b, e in zip(starts, starts[1:])]
    c = codec.Codec("sampled")
    plan = c.plan(sizes, density, "tensor", x.dtype, torch.int32)
    message = torch.empty(plan.layout.nbytes, dtype=torch.uint8, device=device)
    acc = x.clone()
    world = 8
    c.encode(acc, plan, message, zero_sent=True)  # a real message, gathered from 8 "ranks" below
    gathered = torch.cat([message] * world)
    dests = [torch.empty(s, device=device) for s in sizes]

    def encode():
        acc.copy_(x)  # a fresh accumulator each time (the copy is timed apart below)
        c.encode(acc, plan, message, zero_sent=True)

    rows = {
        "floor: one streaming pass (x.sum())": cuda_ms(lambda: x.sum(), repeats),
        "torch.topk per tensor": cuda_ms(lambda: [torch.topk(t.abs(), k, sorted=False) for t, k in zip(tensors, ks)],
                                         repeats),
        "select_segments_torch exact": cuda_ms(lambda: selection.select_segments_torch(x, sizes, ks, "exact"),
                                               repeats),
        "select_segments_torch sampled": cuda_ms(lambda: selection.select_segments_torch(x, sizes, ks, "sampled"),
                                                 repeats),
    }
    copy_ms = cuda_ms(lambda: acc.copy_(x), repeats)
    rows["encode (sampled, error feedback)"] = max(0.0, cuda_ms(encode, repeats) - copy_ms)
    rows[f"decode of {world} ranks"] = cuda_ms(
        lambda: codec.Codec.decode(gathered, plan.layout, world, dests, plan.bounds, div=float(world)), repeats)
    return {"model": model, "tensors": len(sizes), "numel": n, "density": density, "k": sum(ks), "ms": rows}


def render(report):
    lines = [f"# hvd_topk on a CUDA GPU: selection and codec at model shapes ({report['device']})", "",
             f"- Command: `{report['command']}`",
             f"- GPU: {report['device']}; torch {report['torch']} (CUDA {report['cuda']}); Python {report['python']}",
             f"- hvd_topk git {report['git']}; {report['date_utc']}",
             "- Times: medians of CUDA-event timings after 3 warm-ups; flat fp32 buffer of the model's "
             "gradients, per-tensor k at the density shown. The encode row excludes the copy that "
             "refreshes its accumulator.", ""]
    for row in report["rows"]:
        floor = row["ms"]["floor: one streaming pass (x.sum())"]
        lines += [f"## {row['model']}: {row['tensors']} tensors, {row['numel']:,} values, density "
                  f"{row['density']} (k = {row['k']:,})", "", "| what | ms | x floor |", "|---|---:|---:|"]
        lines += [f"| {name} | {ms:.3f} | {ms / floor:.1f} |" for name, ms in row["ms"].items()]
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["resnet50", "bert-base"])
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(common.RESULTS / "gpu" / "cuda-selection"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("cuda_selection.py needs a CUDA GPU (torch.cuda.is_available() is False here)")
    device = torch.device("cuda")
    rows = []
    for model in args.models:
        rows.append(measure(model, args.density, args.repeats, device))
        print(f"{model}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in rows[-1]["ms"].items()), flush=True)
    report = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
              "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(), "git": os.environ.get("HVD_TOPK_GIT", "?"),
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "rows": rows}
    common.write_report(args.out, report, render(report))


if __name__ == "__main__":
    main()
