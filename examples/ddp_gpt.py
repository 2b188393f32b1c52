#!/usr/bin/env python
"""The GPT example (``pytorch_gpt.py``'s model and corpus) with torchrun + DistributedDataParallel
instead of Horovod, and a DDP communication hook: none, PyTorch's fp16 or PowerSGD, or hvd_topk's.

    torchrun --nproc_per_node 2 examples/ddp_gpt.py --hook topk --fp16-values --lr 1e-2   # the AdamW recipe
    torchrun --nproc_per_node 8 examples/ddp_gpt.py --hook topk --fp16-values --lr 1.5e-2   # sketches the variance
    torchrun --nproc_per_node 2 examples/ddp_gpt.py --hook none                    # dense baseline
    torchrun --nproc_per_node 2 examples/ddp_gpt.py --hook powersgd --powersgd-rank 4

With ``--hook topk`` the two lines that matter are in ``make_hook``::

    state = hvd_topk.ddp.TopKState(density=0.01, optimizer=inner, warmup_steps=100, warmup_density=1.0,
                                   exchange="allgather", named_parameters=model.named_parameters())
    hvd_topk.ddp.register(model, state)   # model.register_comm_hook(state, hvd_topk.ddp.topk_hook), checked

where ``inner = hvd_topk.LocalAdamW(...)`` (``--adam local``, the default with ``--hook topk``):
Adam runs on each rank's own gradient inside the hook and its update is what Top-K with error
feedback compresses (docs/adamw.md); ``inner.step()`` applies the exchanged update. Rank 0
prints progress and validation loss, bytes per step against a dense fp32 allreduce, and
``final validation loss: X.XXXX``. gloo on CPU; NCCL when run on GPUs (``--device cuda``).
"""

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from cli import (HelpFormatter, bytes_report, check_interval,  # shared by the examples: --help shows the defaults
                 refuse_topk_flags_with_dense_exchange)
import hvd_topk.ddp
from hvd_topk.checks import DENSE_EXCHANGES, EXCHANGES
from gpt_model import (GPT, add_compact_argument, add_training_arguments, add_variance_arguments, batches,
                       check_topk_arguments, check_training_arguments, dense_start_note, evaluate, load_corpus,
                       lr_at, split)
from hvd_topk.optim import LocalAdamW


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--hook", choices=("none", "fp16", "powersgd", "topk"), default="topk")
    p.add_argument("--density", type=float, default=0.01, help="--hook topk: fraction sent (default 0.01)")
    p.add_argument("--adam", choices=("local", "adamw"), default=None,
                   help="local: hvd_topk.LocalAdamW inside the hook (default with --hook topk); adamw: "
                        "torch.optim.AdamW after the exchange (default otherwise)")
    p.add_argument("--exchange", choices=EXCHANGES, default="allgather",
                   help="--hook topk: pinned to allgather by default (on one host auto may go dense)")
    p.add_argument("--warmup-steps", type=int, default=100, help="--hook topk: dense start over this many steps")
    p.add_argument("--warmup-density", type=float, default=1.0)
    p.add_argument("--fp16-values", action="store_true", help="--hook topk: 16-bit values")
    add_compact_argument(p, "--hook topk: ", "TopKState")
    add_variance_arguments(p)
    p.add_argument("--powersgd-rank", type=int, default=4, help="--hook powersgd: matrix approximation rank")
    p.add_argument("--powersgd-start", type=int, default=100,
                   help="--hook powersgd: vanilla allreduce for this many steps first (its own dense start)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP's bucket size (default: one bucket for powersgd, which gloo needs; DDP's 25 MB otherwise)")
    add_training_arguments(p)
    p.add_argument("--clip", type=float, default=None, help="gradient norm clipping (default 1.0; off with --adam local)")
    p.add_argument("--amp", choices=("none", "bf16"), default="none", help="bf16 autocast")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    check_training_arguments(p, args)
    if args.adam is None:
        args.adam = "local" if args.hook == "topk" else "adamw"
    if args.adam == "local" and args.hook != "topk":
        p.error("--adam local runs inside hvd_topk's hook: it needs --hook topk")
    if args.clip is None:
        args.clip = 0.0 if args.adam == "local" else 1.0
    if (args.gv_signal != "mean" or args.variance_sketch != "auto") and args.adam != "local":
        p.error("--gv-signal and --variance-sketch only apply to --adam local")
    if args.adam == "local" and args.clip:
        p.error("--adam local: the synchronized gradient is Adam's update; clipping it would shrink steps")
    if args.powersgd_rank < 1 or args.warmup_steps < 0:
        p.error("--powersgd-rank must be positive, --warmup-steps >= 0")
    if args.warmup_density != 1.0 and not args.warmup_steps:
        p.error("--warmup-density sets where the density warm-up starts: it needs --warmup-steps N > 0")
    check_interval(p, "--warmup-density", args.warmup_density, 0, 1, low_open=True, high_open=False)
    if args.bucket_cap_mb is not None:
        check_interval(p, "--bucket-cap-mb", args.bucket_cap_mb, 0, low_open=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False); leave it out for gloo on the CPU")
    if args.powersgd_start < 2:
        p.error("--powersgd-start must be >= 2 (DDP rebuilds its buckets after the first step)")
    topk_only = {"density": 0.01, "exchange": "allgather", "warmup_steps": 100, "warmup_density": 1.0,
                 "fp16_values": False, "compact": False}
    for name, default in topk_only.items():
        if getattr(args, name) != default and args.hook != "topk":
            p.error(f"--{name.replace('_', '-')} only applies to --hook topk")
    if (args.powersgd_rank, args.powersgd_start) != (4, 100) and args.hook != "powersgd":
        p.error("--powersgd-rank and --powersgd-start only apply to --hook powersgd")
    if args.hook == "powersgd" and args.bucket_cap_mb is not None and args.device == "cpu":
        # PowerSGD allreduces its matrices of several buckets at once; gloo then pairs messages of
        # different sizes and aborts ("Is there a distributed collective mismatch")
        p.error("--bucket-cap-mb with --hook powersgd on the CPU: gloo needs PowerSGD's tensors in one DDP "
                "bucket, which this example sets up by default; leave --bucket-cap-mb out")
    check_topk_arguments(p, args)
    refuse_topk_flags_with_dense_exchange(p, args, {"density": 0.01, "fp16_values": False, "compact": False})
    if "RANK" not in os.environ:
        p.error("launch it with torchrun (torchrun --nproc_per_node 2 examples/ddp_gpt.py ...): "
                "torch.distributed reads its rank and world size from torchrun's environment")
    return args


def make_inner(args, model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if args.adam == "local":
        return LocalAdamW(groups, lr=args.lr, betas=(0.0, 0.95), signal=args.gv_signal,
                          variance_sketch=args.variance_sketch)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def make_hook(args, ddp, inner, named_parameters):
    """(state, hook, bytes sent per step or None when the state counts them)."""
    if args.hook == "topk":
        # (the density warm-up only where buckets go sparse, its start density only with a
        # warm-up: elsewhere the library warns that they do nothing)
        schedule = {} if args.exchange in DENSE_EXCHANGES else {
            "warmup_steps": args.warmup_steps, **({"warmup_density": args.warmup_density} if args.warmup_steps else {})}
        state = hvd_topk.ddp.TopKState(density=args.density, optimizer=inner if args.adam == "local" else None,
                                       **schedule, exchange=args.exchange, fp16_values=args.fp16_values,
                                       compact=args.compact,
                                       named_parameters=named_parameters)
        hvd_topk.ddp.register(ddp, state)
        return state
    if args.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                       start_powerSGD_iter=args.powersgd_start)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return None


def bytes_per_step(args, model, state):
    """(bytes sent per step and rank, dense fp32 bytes): hvd_topk's counted by its state; the
    others from their formats: fp16 half; PowerSGD rank r sends (n + m) r floats per matrix
    (viewed n x m as its hook does) where that is at least 2x smaller, the rest dense, after its
    dense start."""
    dense = sum(p.numel() * 4 for p in model.parameters())
    if state is not None:
        s = state.stats()
        return s["bytes_sent"] / max(1, s["steps"]), s["bytes_dense"] / max(1, s["steps"])
    if args.hook == "fp16":
        return dense / 2, dense
    if args.hook == "powersgd":
        r, compressed = args.powersgd_rank, 0
        for p in model.parameters():
            n, m = p.shape[0], p.numel() // p.shape[0]
            low_rank = p.dim() > 1 and (n + m) * min(r, n, m) * 2 < n * m  # its min_compression_rate, 2
            compressed += ((n + m) * min(r, n, m) if low_rank else p.numel()) * 4
        start = min(args.powersgd_start, args.steps)
        return (start * dense + (args.steps - start) * compressed) / args.steps, dense
    return dense, dense


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    say = print if rank == 0 and not args.quiet else (lambda *a, **k: None)
    note = dense_start_note(args)
    if note:
        say(note, flush=True)
    amp_dtype = torch.bfloat16 if args.amp == "bf16" else None

    def autocast():
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    data, digest = load_corpus(args.corpus_mb * 1e6)
    train, val = split(data)
    model = GPT(args.context, args.width, args.layers, args.heads).to(device)
    cap = args.bucket_cap_mb if args.bucket_cap_mb is not None else (1e4 if args.hook == "powersgd" else 25)
    ddp = DDP(model, bucket_cap_mb=cap)  # broadcasts rank 0's parameters
    inner = make_inner(args, model)
    state = make_hook(args, ddp, inner, model.named_parameters())
    n_params = sum(p.numel() for p in model.parameters())
    say(f"corpus: {len(data):,} bytes, sha256 {digest[:16]}; model {n_params:,} parameters; {size} ranks x batch "
        f"{args.batch_size} x context {args.context}; DDP hook {args.hook}"
        + (f" density={args.density} ({args.adam})" if args.hook == "topk" else "")
        + (f" rank={args.powersgd_rank}" if args.hook == "powersgd" else ""), flush=True)

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    history, t0 = [], time.perf_counter()
    for step in range(args.steps):
        for group in inner.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = batches(train, args.context, args.batch_size, gen)
        inner.zero_grad(set_to_none=True)
        with autocast():
            logits = ddp(x.to(device))
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.to(device).reshape(-1))
        loss.backward()  # the hook exchanges each bucket; p.grad holds the average afterwards
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        inner.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_loss = evaluate(model, val, args, device, autocast)
            train_loss = loss.detach().float().clone()
            dist.all_reduce(train_loss)
            history.append({"step": step + 1, "train_loss": train_loss.item() / size, "val_loss": val_loss})
            say(f"step {step + 1:5d}/{args.steps}  train loss {history[-1]['train_loss']:.4f}  "
                f"validation loss {val_loss:.4f}  ({time.perf_counter() - t0:.0f}s)", flush=True)

    sent, dense = bytes_per_step(args, model, state)
    sent, bytes_line = bytes_report(sent, dense, size)
    result = {"hook": args.hook, "adam": args.adam, "density": args.density if args.hook == "topk" else None,
              "powersgd_rank": args.powersgd_rank if args.hook == "powersgd" else None, "ranks": size,
              "steps": args.steps, "seed": args.seed, "amp": args.amp, "corpus_sha256": digest,
              "parameters": n_params, "final_val_loss": history[-1]["val_loss"], "bytes_sent_per_step": sent,
              "bytes_dense_per_step": dense, "bytes_ratio": sent / dense,
              "seconds": time.perf_counter() - t0, "history": history}
    if state is not None:
        result["topk_stats"] = state.stats()
    if rank == 0:
        print(bytes_line)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        print(f"final validation loss: {result['final_val_loss']:.4f}", flush=True)
    del ddp, state
    gc.collect()  # DDP gone before the group: torch 2.13 + gloo may abort at exit otherwise (docs/ddp.md)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
