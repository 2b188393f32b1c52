"""Host synchronisations per training step on a CUDA GPU, by DDP hook: where the host waits for
the GPU inside a step (``.item()``, ``.tolist()``, a blocking copy), it stops queueing work ahead
and backward's overlap with the exchange is lost. PyTorch's sync debug mode
(``torch.cuda.set_sync_debug_mode("warn")``) warns at each; this counts the warnings over the
forward, backward (the hook runs inside it) and optimizer step of a few steps after warm-up.

One process, world size 1 (NCCL), a transformer of the GPT example's kind at 19M parameters
(width 512, 6 layers: several 25 MB DDP buckets), batches of random bytes. hvd_topk's hook runs
as a 2-rank job would at world size 1 (``hvd_topk.ddp``), from the first step sparse
(``warmup_steps=0``). Writes ``OUT.json`` and ``OUT.md``; benchmarks/gpu_check.sh runs it:

    python benchmarks/cuda_syncs.py --out benchmarks/results/gpu/cuda-syncs

On a machine without CUDA it runs the same steps on the CPU with ``--device cpu`` (a check of
the script; the CPU has nothing to count) and says so.
"""

import argparse
import datetime
import os
import platform
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _common as common  # noqa: E402
import hvd_topk  # noqa: E402
import hvd_topk.ddp  # noqa: E402
from gpt_model import GPT  # noqa: E402

HOOKS = {  # name -> (hvd_topk's exchange, LocalAdamW inside the hook); None: not hvd_topk's hook
    "none": None,
    "fp16": None,
    "topk-allgather": ("allgather", False),
    "topk-sparse-allreduce": ("sparse_allreduce", False),
    "topk-localadamw": ("allgather", True),
}


def run(name, device, steps, warmup):
    """Mean synchronisations per step and phase, and the model's parameter count."""
    torch.manual_seed(0)
    model = GPT(64, 512, 6, 8).to(device)
    ddp = DDP(model, bucket_cap_mb=25)
    exchange, local = HOOKS[name] or (None, False)
    if local:
        inner = hvd_topk.LocalAdamW(model.parameters(), lr=1e-3, betas=(0.0, 0.95))
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif exchange is not None:
        state = hvd_topk.ddp.TopKState(density=0.01, warmup_steps=0, exchange=exchange,
                                       named_parameters=model.named_parameters(), optimizer=inner if local else None)
        hvd_topk.ddp.register(ddp, state)
    gen = torch.Generator().manual_seed(1)
    counts = {"forward": [], "backward": [], "optimizer step": []}
    for step in range(warmup + steps):
        x = torch.randint(0, 256, (16, 64), generator=gen).to(device)
        y = torch.randint(0, 256, (16, 64), generator=gen).to(device)
        inner.zero_grad(set_to_none=True)
        counting = step >= warmup and device.type == "cuda"
        for phase in counts:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if counting:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    if phase == "forward":
                        loss = F.cross_entropy(ddp(x).reshape(-1, 256), y.reshape(-1))
                    elif phase == "backward":
                        loss.backward()
                    else:
                        inner.step()
                finally:
                    if counting:
                        torch.cuda.set_sync_debug_mode("default")
            if step >= warmup:
                counts[phase].append(sum("synchroniz" in str(w.message) for w in caught))
        if device.type == "cuda":
            torch.cuda.synchronize()
    return {phase: sum(c) / len(c) for phase, c in counts.items()}, sum(p.numel() for p in model.parameters())


def render(report):
    lines = [f"# Host synchronisations per step on {report['device']}, by DDP hook", "",
             f"- Command: `{report['command']}`",
             f"- {report['device']}; torch {report['torch']} (CUDA {report['cuda']}); Python {report['python']}; "
             f"hvd_topk git {report['git']}; {report['date_utc']}",
             "- One process (world size 1), the GPT example's transformer at width 512, 6 layers "
             f"({report['parameters']:,} parameters), DDP buckets of 25 MB, density 0.01 from the first step; "
             f"mean over {report['steps']} steps after {report['warmup']}. A synchronisation is what "
             "`torch.cuda.set_sync_debug_mode(\"warn\")` warns about.", "",
             "| hook | forward | backward (the hook) | optimizer step |", "|---|---:|---:|---:|"]
    for name, row in report["rows"].items():
        lines.append(f"| {name} | " + " | ".join(f"{v:g}" for v in row.values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hooks", nargs="+", default=list(HOOKS), choices=list(HOOKS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=str(common.RESULTS / "gpu" / "cuda-syncs"))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("cuda_syncs.py counts CUDA synchronisations: no CUDA device here (--device cpu checks the script)")
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            rows = {}
            for name in args.hooks:
                rows[name], parameters = run(name, device, args.steps, args.warmup)
                print(f"{name}: " + ", ".join(f"{k} {v:g}" for k, v in rows[name].items()), flush=True)
        finally:
            dist.destroy_process_group()
    if device.type != "cuda":
        print("(CPU: nothing to count; the script ran)")
        return
    report = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
              "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(), "git": os.environ.get("HVD_TOPK_GIT", "?"),
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "parameters": parameters,
              "steps": args.steps, "warmup": args.warmup, "rows": rows}
    common.write_report(args.out, report, render(report))


if __name__ == "__main__":
    main()
