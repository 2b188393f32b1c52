#!/usr/bin/env python
r"""A small byte-level GPT trained data-parallel with AdamW, Horovod and hvd_topk.

    mpirun -np 2 python examples/pytorch_gpt.py --compression none          # dense baseline
    horovodrun -np 2 --gloo python examples/pytorch_gpt.py --optimizer topk-ef --density 0.01  # plain
        AdamW behind Top-K: the setup the library warns about (the recipe, below, is what to run)

The corpus is this Python's own standard library (the ``.py`` files under
``sysconfig.get_paths()["stdlib"]``, sorted by path, concatenated and cut to ``--corpus-mb``), so it
is on every machine without a download; its size and SHA-256 are printed so runs can be compared.
Every tenth of 100 equal runs of it is held out for validation. The model: token and position embeddings, pre-norm
transformer blocks (causal self-attention + MLP), a final LayerNorm and a linear head. Training:
AdamW (weight decay on matrices only), linear warm-up then cosine decay, gradient clipping
between ``opt.synchronize()`` and ``opt.step()`` under ``opt.skip_synchronize()`` (Horovod's
pattern), optional autocast (``--amp bf16`` on CPU, ``--amp fp16`` on CUDA with a GradScaler).

Top-K before plain AdamW costs quality (Adam normalises error feedback's late bursts away); the
fix is ``--adam local``: ``hvd_topk.LocalAdamW`` runs Adam on each rank's own gradient and the
update is what Top-K with error feedback compresses, after a dense start::

    horovodrun -np 2 --gloo python examples/pytorch_gpt.py --optimizer topk-ef --exchange allgather \
        --density 0.01 --adam local --warmup-steps 100 --warmup-density 1.0 --fp16-values --lr 1e-2

(the recommended scheme, as ``make demo-gpt`` runs it; docs/adamw.md)

(``--adam frozen-variance --freeze-step 100``: 1-bit Adam's frozen variance, good over 300 steps
only.)

The one line that matters is the optimizer wrapping in ``make_optimizer``. Rank 0 prints
progress and validation loss, then bytes sent against a dense fp32 allreduce and, for topk-ef,
the optimizer's statistics; its last line is ``final validation loss: X.XXXX``.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import horovod.torch as hvd
from cli import (HelpFormatter, bytes_report, check_interval, output_path,  # shared by the examples: --help shows the defaults
                 refuse_topk_flags_with_dense_exchange)
import hvd_topk
from hvd_topk.checks import DENSE_EXCHANGES, EXCHANGES
# the model, data and their options, shared with ddp_gpt.py
from gpt_model import (GPT, add_compact_argument, add_training_arguments, add_variance_arguments, batches,
                       check_topk_arguments, check_training_arguments, dense_start_note, evaluate, load_corpus,
                       lr_at, split)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--compression", choices=("none", "fp16", "topk"), default="topk")
    p.add_argument("--density", type=float, default=0.01, help="fraction sent by topk (default 0.01)")
    p.add_argument("--fp16-values", action="store_true",
                   help="topk: values travel as float16 (TopK(fp16_values=True)); topk-ef's dense fallback is then fp16 too")
    add_compact_argument(p, "topk: ", "TopK")
    p.add_argument("--optimizer", choices=("horovod", "topk-ef"), default="horovod",
                   help="hvd.DistributedOptimizer (+ --compression) or hvd_topk.DistributedOptimizer")
    p.add_argument("--no-error-feedback", action="store_true", help="topk-ef without error feedback")
    p.add_argument("--selection-scope", choices=("tensor", "bucket"), default="tensor")
    p.add_argument("--exchange", choices=EXCHANGES, default="auto",
                   help="topk-ef: how buckets travel (default auto: a measured trial picks)")
    p.add_argument("--hierarchical", action="store_true",
                   help="topk-ef: dense inside each host, sparse across hosts (starts Horovod with "
                        "hvd_topk.init(), which adds the host process sets)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="topk-ef: density warm-up steps (DGC's exponential schedule from --warmup-density)")
    p.add_argument("--warmup-density", type=float, default=0.25)
    p.add_argument("--min-numel", type=int, default=1024,
                   help="topk-ef: tensors with fewer elements go dense (e.g. 33000 keeps the embeddings, "
                        "the output head and the attention output projections of the default model dense)")
    p.add_argument("--adam", choices=("adamw", "local", "frozen-variance", "demo"), default="adamw",
                   help="local (topk-ef only): hvd_topk.LocalAdamW, Adam on each rank's own gradient and its "
                        "update exchanged (beta1 0 by default: error feedback carries the past); "
                        "frozen-variance: hvd_topk.FrozenVarianceAdamW, its variance frozen after "
                        "--freeze-step steps; with topk-ef and error feedback its beta1 moves into the "
                        "exchange (momentum_correction=0.9, betas (0, 0.95)), as 1-bit Adam does; "
                        "demo (topk-ef only): hvd_topk.DeMo, decoupled momentum in the residual, the sent "
                        "average normalised (--demo-normalise) after the exchange")
    p.add_argument("--demo-beta", type=float, default=0.999, help="--adam demo: the accumulator's decay")
    p.add_argument("--demo-normalise", choices=hvd_topk.DeMo.NORMALISE, default="sign",
                   help="--adam demo: sign (each sent entry moves by lr) or rms (the tensor's update has RMS lr)")
    p.add_argument("--lr-in-residual", action=argparse.BooleanOptionalAction, default=True,
                   help="--adam local: the residual holds lr x update (default); --no-lr-in-residual: without lr "
                        "(LocalAdamW(lr_in_residual=False), "
                        "the recipe before 2026-11-25)")
    p.add_argument("--global-variance", action=argparse.BooleanOptionalAction, default=True,
                   help="--adam local: normalise by the ranks' average gradient's variance (default); "
                        "--no-global-variance: by each rank's own (LocalAdamW(global_variance=False), "
                        "the recipe before 2026-11-25)")
    add_variance_arguments(p)
    p.add_argument("--residual-decay", type=float, default=1.0,
                   help="topk-ef: residuals decay by this factor each step (default 1.0: none)")
    p.add_argument("--sync-every", type=int, default=1,
                   help="topk-ef with --adam adamw: hvd_topk.LocalSteps, each rank takes this many AdamW steps "
                        "alone, then the model change goes through Top-K with error feedback (DiLoCo / "
                        "SparseLoCo); --density is per synchronisation, --warmup-steps counts steps (the "
                        "outer optimizer gets --warmup-steps / --sync-every synchronisations)")
    p.add_argument("--outer-lr", type=float, default=1.0, help="--sync-every: the outer SGD's learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.0, help="--sync-every: the outer SGD's momentum")
    p.add_argument("--nesterov", action="store_true", help="--sync-every: Nesterov outer momentum (DiLoCo)")
    p.add_argument("--beta1", type=float, default=None,
                   help="Adam's beta1 (default 0.9; 0 with --adam local; with frozen-variance + error feedback it "
                        "is the exchange's momentum_correction and the inner beta1 is 0; not with --adam demo, "
                        "which has no Adam moments)")
    p.add_argument("--beta2", type=float, default=None,
                   help="Adam's beta2, the variance's horizon (default 0.95; not with --adam demo)")
    p.add_argument("--vector-lr-scale", type=float, default=1.0,
                   help="the learning rate of the 1-D parameters (norms, biases: below --min-numel, so sent "
                        "dense every step) as a multiple of --lr")
    p.add_argument("--freeze-step", type=int, default=0, help="with --adam frozen-variance (e.g. = --warmup-steps)")
    add_training_arguments(p)
    add_checkpoint_arguments(p)
    p.add_argument("--clip", type=float, default=None,
                   help="gradient norm clipping of the synchronized gradient (default 1.0; 0: off; off with "
                        "--adam local, whose synchronized 'gradient' is Adam's update)")
    p.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none",
                   help="autocast: bf16 (CPU) or fp16 (CUDA, with torch.amp.GradScaler)")
    args = p.parse_args(argv)
    check_training_arguments(p, args)
    if args.optimizer == "topk-ef" and args.compression != "topk":
        p.error("--optimizer topk-ef always compresses with TopK; use --compression topk")
    topk_ef_only = {"no_error_feedback": False, "selection_scope": "tensor", "exchange": "auto", "warmup_steps": 0,
                    "warmup_density": 0.25, "min_numel": 1024, "residual_decay": 1.0}
    for name, default in topk_ef_only.items():
        if getattr(args, name) != default and args.optimizer != "topk-ef":
            p.error(f"--{name.replace('_', '-')} only applies to --optimizer topk-ef")
    if not args.vector_lr_scale > 0:
        p.error(f"--vector-lr-scale must be > 0, got {args.vector_lr_scale}")
    if args.warmup_steps < 0:
        p.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.warmup_density != 0.25 and not args.warmup_steps:
        p.error("--warmup-density sets where the density warm-up starts: it needs --warmup-steps N > 0 "
                "(the recipe: --warmup-steps 100 --warmup-density 1.0)")
    if not 0 < args.warmup_density <= 1:  # (NaN fails this too)
        p.error(f"--warmup-density must be in (0, 1], got {args.warmup_density}")
    if 0 < args.warmup_steps < args.sync_every:
        p.error(f"--warmup-steps {args.warmup_steps} is shorter than one synchronisation (--sync-every "
                f"{args.sync_every}): the outer optimizer would get no warm-up")
    if (args.adam == "frozen-variance") != (args.freeze_step != 0) or args.freeze_step < 0:
        p.error("--adam frozen-variance needs --freeze-step N > 0, and --freeze-step needs it")
    if (args.adam == "frozen-variance" and args.optimizer == "topk-ef"
            and not (args.warmup_steps >= args.freeze_step and args.warmup_density == 1.0)):
        # the variance of entries Top-K never sent by the freeze is zero for good: their first
        # sends are divided by sqrt(eps) (measured: the loss went from 5 to 13,000 in 5 steps)
        p.error(f"--adam frozen-variance with --optimizer topk-ef needs a dense start up to the freeze: "
                f"--warmup-steps {args.freeze_step} (or more) --warmup-density 1.0")
    if args.min_numel < 0:
        p.error(f"--min-numel must be >= 0, got {args.min_numel}")
    if args.adam in ("local", "demo") and args.optimizer != "topk-ef":
        p.error(f"--adam {args.adam} needs --optimizer topk-ef (it runs inside hvd_topk.DistributedOptimizer)")
    if args.adam == "demo" and args.residual_decay != 1.0:
        p.error("--adam demo: its accumulator decay is --demo-beta, not --residual-decay")
    if args.adam == "demo" and args.no_error_feedback and args.demo_beta != 1.0:
        p.error("--adam demo --no-error-feedback: without error feedback there is no accumulator to decay; "
                "pass --demo-beta 1.0")
    if (args.demo_beta != 0.999 or args.demo_normalise != "sign") and args.adam != "demo":
        p.error("--demo-beta and --demo-normalise only apply to --adam demo")
    if not 0 < args.demo_beta <= 1:
        p.error(f"--demo-beta must be in (0, 1], got {args.demo_beta}")
    local_options_default = (args.lr_in_residual and args.global_variance and args.gv_signal == "mean"
                             and args.variance_sketch == "auto")
    if not local_options_default and args.adam != "local":
        p.error("--no-lr-in-residual, --no-global-variance, --gv-signal and --variance-sketch only apply to --adam local")
    if args.variance_sketch not in ("auto", 0) and not args.global_variance:
        p.error(f"--variance-sketch {args.variance_sketch} needs global variance (no --no-global-variance)")
    if args.sync_every < 1:
        p.error(f"--sync-every must be >= 1, got {args.sync_every}")
    if args.sync_every > 1 and (args.optimizer != "topk-ef" or args.adam != "adamw"):
        p.error("--sync-every H > 1 needs --optimizer topk-ef --adam adamw (hvd_topk.LocalSteps runs plain AdamW)")
    if args.steps % args.sync_every:
        # between synchronisations each rank holds its own replica: ended there, the ranks'
        # models would differ and rank 0's alone be reported
        p.error(f"--steps ({args.steps}) must be a multiple of --sync-every ({args.sync_every}), so that the "
                "run ends on a synchronisation, with the model the ranks share")
    if (args.outer_lr != 1.0 or args.outer_momentum or args.nesterov) and args.sync_every == 1:
        p.error("--outer-lr, --outer-momentum and --nesterov only apply with --sync-every H > 1")
    check_interval(p, "--outer-lr", args.outer_lr, 0, low_open=True)
    check_interval(p, "--outer-momentum", args.outer_momentum, 0, 1)
    if not 0 < args.residual_decay <= 1:  # (NaN fails this too)
        p.error(f"--residual-decay must be in (0, 1], got {args.residual_decay}")
    if args.adam in ("local", "demo") and args.clip:
        p.error(f"--adam {args.adam}: the synchronized gradient is an update; clipping it would shrink steps (use --clip 0)")
    if args.adam in ("local", "demo") and args.amp == "fp16":
        p.error(f"--adam {args.adam} does not support the GradScaler of --amp fp16; use --amp bf16")
    if args.clip is None:
        args.clip = 0.0 if args.adam in ("local", "demo") else 1.0
    if args.adam == "demo" and (args.beta1 is not None or args.beta2 is not None):
        p.error("--beta1 and --beta2 do not apply to --adam demo (DeMo keeps no Adam moments; its accumulator's "
                "decay is --demo-beta)")
    if args.beta1 is not None and not 0 <= args.beta1 < 1:
        p.error("--beta1 must be in [0, 1)")
    if args.beta2 is None:
        args.beta2 = 0.95
    if not 0 <= args.beta2 < 1:
        p.error("--beta2 must be in [0, 1)")
    if args.amp == "fp16" and not torch.cuda.is_available():
        p.error("--amp fp16 needs CUDA (GradScaler); on CPU use --amp bf16")
    if args.compression != "topk" and (args.fp16_values or args.compact or args.density != 0.01):
        p.error("--density, --fp16-values and --compact only apply to --compression topk")
    if args.hierarchical and (args.optimizer != "topk-ef" or args.sync_every > 1 or args.exchange in DENSE_EXCHANGES):
        p.error("--hierarchical applies to --optimizer topk-ef with a sparse --exchange, without --sync-every")
    check_topk_arguments(p, args)  # (a non-default --density without topk was refused above)
    refuse_topk_flags_with_dense_exchange(p, args, {
        "density": 0.01, "fp16_values": False, "compact": False, "no_error_feedback": False,
        "selection_scope": "tensor", "warmup_steps": 0, "residual_decay": 1.0})
    check_checkpoint_arguments(p, args)
    return args


def add_checkpoint_arguments(p):
    p.add_argument("--checkpoint", metavar="PREFIX", type=output_path,
                   help="save each rank's state (model, optimizer with hvd_topk's residuals and step, data "
                        "order, losses so far) to PREFIX-rank<R>.pt every --checkpoint-every steps and at the end")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="steps between checkpoints (0: at the end)")
    p.add_argument("--resume", action="store_true",
                   help="go on from --checkpoint's files, with the flags, ranks and corpus of the run that wrote "
                        "them: with --optimizer topk-ef and the exchange pinned, the same bits as a run that never "
                        "stopped (auto measures again; the drop-in TopK keeps no step count, so where its sample "
                        "decides a fill-up it may pick other entries)")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="end this job after step N of the --steps schedule, checkpointed (a job cut by a time "
                        "limit; go on with --resume)")


def check_checkpoint_arguments(p, args):
    if (args.resume or args.checkpoint_every or args.stop_after is not None) and not args.checkpoint:
        p.error("--resume, --checkpoint-every and --stop-after need --checkpoint PREFIX")
    if args.checkpoint_every < 0:
        p.error(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.stop_after is not None and not 0 < args.stop_after < args.steps:
        p.error(f"--stop-after must be in [1, --steps={args.steps}), got {args.stop_after}")


# flags that may differ between a run and its resumption (the rest must match)
RESUME_MAY_CHANGE = ("checkpoint", "checkpoint_every", "resume", "stop_after", "json", "quiet")


def checkpoint_path(args, rank):
    return Path(f"{args.checkpoint}-rank{rank}.pt")


def run_identity(args, digest):
    """What a resumed run must share with the one that wrote the checkpoint: the flags (but
    RESUME_MAY_CHANGE), the number of ranks and the corpus."""
    return {**{k: v for k, v in vars(args).items() if k not in RESUME_MAY_CHANGE},
            "ranks": hvd.size(), "corpus_sha256": digest}


def save_checkpoint(args, digest, rank, step, model, opt, scaler, gen, history, carried_bytes, topk):
    """This rank's whole state after ``step`` steps, written atomically (a job killed while
    writing keeps the previous file)."""
    path = checkpoint_path(args, rank)
    state = {"flags": run_identity(args, digest), "step": step,
             "model": model.state_dict(), "optimizer": opt.state_dict(),
             "scaler": scaler.state_dict() if scaler else None, "data_order": gen.get_state(),
             "history": history, "bytes": bytes_so_far(args, opt, topk, carried_bytes)}
    temporary = path.with_name(path.name + ".tmp")
    torch.save(state, temporary)
    hvd.barrier()  # every rank's new file written before any replaces its old one
    os.replace(temporary, path)


def load_checkpoint(args, digest, rank, model, opt, scaler, gen):
    """``save_checkpoint``'s state back; returns (its step, history, bytes so far). Every rank
    exits, with one message naming each rank's problem, where a file is missing, was written
    by another run (flags, ranks, corpus) or is already past ``--stop-after``, or where the
    ranks' files hold different steps (a job killed between two ranks' writes): one rank
    refusing alone would leave the others training into a dead job."""
    path = checkpoint_path(args, rank)
    state, problem = None, None
    if not path.exists():
        problem = f"{path} does not exist (run with --checkpoint {args.checkpoint} first)"
    else:
        state = torch.load(path, weights_only=False)
        flags = run_identity(args, digest)
        changed = sorted(k for k in flags.keys() | state["flags"].keys() if flags.get(k) != state["flags"].get(k))
        if changed:
            problem = f"{path} was written with other flags: " + ", ".join(
                f"--{k.replace('_', '-')} {state['flags'].get(k)} (now {flags.get(k)})" for k in changed)
        elif args.stop_after is not None and args.stop_after <= state["step"]:
            problem = f"{path} is at step {state['step']}, already at or past --stop-after {args.stop_after}"
    reports = hvd.allgather_object((problem, None if state is None else state["step"]))
    problems = [p for p, _ in reports if p]
    steps = [step for _, step in reports]
    if not problems and len(set(steps)) > 1:
        problems = ["the ranks' files hold different steps (" + ", ".join(
            f"{checkpoint_path(args, r)}: step {step}" for r, step in enumerate(steps))
            + "): the job stopped between two ranks' writes; resume from files written at one step"]
    if problems:
        sys.exit("--resume: " + "; ".join(problems) if rank == 0 else 1)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if scaler:
        scaler.load_state_dict(state["scaler"])
    gen.set_state(state["data_order"])
    return state["step"], state["history"], state["bytes"]


def bytes_so_far(args, opt, topk, carried):
    """(bytes sent, dense fp32 bytes, steps) over the whole run: the optimizer's statistics (its
    checkpoint carries their counts), or TopK's since this job started plus ``carried`` (the
    jobs before it, from the example's checkpoint)."""
    if args.optimizer == "topk-ef":
        s = opt.compression_stats()
        return s["bytes_sent"], s["bytes_dense"], s["steps"]
    if args.compression == "topk":
        s = topk.stats()
        now = (s["bytes_sent"], s["bytes_dense"], 0)
    else:
        now = (0, 0, 0)
    return tuple(a + b for a, b in zip(carried, now))


def beta1_and_momentum_correction(args):
    """(the inner Adam's beta1, the exchange's momentum_correction). With frozen-variance and
    error feedback beta1's momentum is kept before compression (DGC's momentum correction, as
    1-bit Adam does), so the inner optimizer has none: one momentum, never two."""
    beta1 = args.beta1 if args.beta1 is not None else 0.0 if args.adam == "local" else 0.9
    if args.adam == "frozen-variance" and args.optimizer == "topk-ef" and not args.no_error_feedback:
        return 0.0, beta1
    return beta1, 0.0


def make_optimizer(args, model, scaler):
    """(the distributed optimizer, the TopK instance it compresses with, or None)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0, "lr_scale": args.vector_lr_scale}]
    beta1, momentum_correction = beta1_and_momentum_correction(args)
    if args.adam == "frozen-variance":
        inner = hvd_topk.FrozenVarianceAdamW(groups, lr=args.lr, betas=(beta1, args.beta2), freeze_step=args.freeze_step)
    elif args.adam == "local":
        inner = hvd_topk.LocalAdamW(groups, lr=args.lr, betas=(beta1, args.beta2), lr_in_residual=args.lr_in_residual,
                                    global_variance=args.global_variance, signal=args.gv_signal,
                                    variance_sketch=args.variance_sketch)
    elif args.adam == "demo":
        inner = hvd_topk.DeMo(groups, lr=args.lr, beta=args.demo_beta, normalise=args.demo_normalise)
    else:
        inner = torch.optim.AdamW(groups, lr=args.lr, betas=(beta1, args.beta2))
    topk = hvd_topk.TopK(density=args.density, fp16_values=args.fp16_values,
                         compact=args.compact) if args.compression == "topk" else None
    if args.sync_every > 1:
        opt = hvd_topk.LocalSteps(inner, named_parameters=model.named_parameters(), sync_every=args.sync_every,
                                  compression=topk, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                                  nesterov=args.nesterov, error_feedback=not args.no_error_feedback,
                                  selection_scope=args.selection_scope, exchange=args.exchange,
                                  warmup_steps=args.warmup_steps // args.sync_every,
                                  warmup_density=args.warmup_density, min_numel=args.min_numel,
                                  residual_decay=args.residual_decay)
        return opt, topk
    if args.optimizer == "topk-ef":
        # (a pinned dense exchange reads no density warm-up: the library would warn it does nothing)
        schedule = {} if args.exchange in DENSE_EXCHANGES else {"warmup_steps": args.warmup_steps,
                                                                "warmup_density": args.warmup_density}
        opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=topk,
                                            error_feedback=not args.no_error_feedback,
                                            selection_scope=args.selection_scope, exchange=args.exchange, **schedule,
                                            min_numel=args.min_numel, grad_scaler=scaler,
                                            residual_decay=args.residual_decay,
                                            momentum_correction=momentum_correction,
                                            hierarchical=True if args.hierarchical else "auto")
        return opt, topk
    compression = topk or {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[args.compression]
    return hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=compression), topk


def bytes_per_step(model, args, opt, topk, carried=(0, 0, 0)):
    """(bytes sent, dense fp32 bytes) per step and rank, over the whole run (``carried``: the
    jobs before a resume)."""
    dense = sum(p.numel() * 4 for p in model.parameters())
    sent, dense_counted, steps = bytes_so_far(args, opt, topk, carried)
    if args.optimizer == "topk-ef":
        return sent / max(1, steps), dense_counted / max(1, steps)
    if args.compression == "topk":
        if not dense_counted:  # one rank: Horovod exchanges nothing and never calls the compressor
            return 0.0, dense
        return sent / args.steps, dense_counted / args.steps
    return (dense // 2 if args.compression == "fp16" else dense), dense


def main(argv=None):
    args = parse_args(argv)
    if args.hierarchical:
        hvd_topk.init()  # hvd.init() plus the host and cross-host process sets
    else:
        hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    say = print if rank == 0 and not args.quiet else (lambda *a, **k: None)
    device = torch.device("cuda", hvd.local_rank()) if args.amp == "fp16" else torch.device("cpu")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)

    def autocast():
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    data, digest = load_corpus(args.corpus_mb * 1e6)
    train, val = split(data)
    model = GPT(args.context, args.width, args.layers, args.heads).to(device)
    scaler = torch.amp.GradScaler("cuda") if args.amp == "fp16" else None
    opt, topk = make_optimizer(args, model, scaler)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"corpus: {len(data):,} bytes of the standard library's sources, sha256 {digest[:16]}; "
        f"model {n_params:,} parameters; {size} ranks x batch {args.batch_size} x context {args.context}; "
        f"optimizer={args.optimizer} compression={args.compression}"
        + (f" density={args.density}" if args.compression == "topk" else "")
        + (" (no error feedback)" if args.no_error_feedback else ""), flush=True)

    note = dense_start_note(args)
    if note:
        say(note, flush=True)
    if args.eval_every % args.sync_every:
        say(f"note: --eval-every {args.eval_every} is not a multiple of --sync-every {args.sync_every}: "
            "validation between synchronisations is of rank 0's own replica", flush=True)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    history, t0, first, carried = [], time.perf_counter(), 0, (0, 0, 0)
    if args.resume:
        first, history, carried = load_checkpoint(args, digest, rank, model, opt, scaler, gen)
        say(f"resumed from {args.checkpoint}-rank<R>.pt after step {first}", flush=True)
    last = args.stop_after or args.steps
    for step in range(first, last):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args) * group.get("lr_scale", 1.0)
        x, y = batches(train, args.context, args.batch_size, gen)
        opt.zero_grad()  # torch >= 2.0: sets the gradients to None (Horovod 0.28.1 takes no argument)
        with autocast():
            logits = model(x.to(device))
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.to(device).reshape(-1))
        (scaler.scale(loss) if scaler else loss).backward()
        opt.synchronize()
        if scaler:
            scaler.unscale_(opt)
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        with opt.skip_synchronize():
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_loss = evaluate(model, val, args, device, autocast)
            train_loss = hvd.allreduce(loss.detach().float().cpu(), name="train_loss").item()
            history.append({"step": step + 1, "train_loss": train_loss, "val_loss": val_loss})
            say(f"step {step + 1:5d}/{args.steps}  train loss {train_loss:.4f}  validation loss {val_loss:.4f}  "
                f"({time.perf_counter() - t0:.0f}s)", flush=True)
        if args.checkpoint and (step + 1 == last or (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0)):
            save_checkpoint(args, digest, rank, step + 1, model, opt, scaler, gen, history, carried, topk)
    if last < args.steps:
        if rank == 0:  # (--quiet too: the job did not finish)
            print(f"stopped after step {last} of {args.steps}, checkpointed: go on with the same flags and --resume",
                  flush=True)
        return {"stopped_after": last}

    sent, dense = bytes_per_step(model, args, opt, topk, carried)
    sent, bytes_line = bytes_report(sent, dense, size)
    result = {"optimizer": args.optimizer, "compression": args.compression,
              "density": args.density if args.compression == "topk" else None,
              "error_feedback": args.optimizer == "topk-ef" and not args.no_error_feedback,
              "ranks": size, "steps": args.steps, "seed": args.seed, "amp": args.amp,
              "corpus_bytes": len(data), "corpus_sha256": digest, "parameters": n_params,
              "final_val_loss": history[-1]["val_loss"], "bytes_sent_per_step": sent,
              "bytes_dense_per_step": dense, "bytes_ratio": sent / dense,
              "seconds": time.perf_counter() - t0, "history": history, "first_step": first,
              "flags": vars(args)}  # every option as this run used it (--adam, --lr, --exchange, ...)
    if args.optimizer == "topk-ef":
        result["compression_stats"] = opt.compression_stats()
    if rank == 0:
        print(bytes_line)
        if "compression_stats" in result:
            st = result["compression_stats"]
            print(f"compression_stats{' (the times: this job, since --resume)' if args.resume else ''}: steps {st['steps']}, "
                  f"achieved density {st['density']:.4f}, "
                  f"selection {st['time_selection_s']:.2f}s, exchange wait {st['time_exchange_s']:.2f}s, "
                  f"non-finite resets {st['nonfinite_resets']}, exchange {st['exchange']} -> {st['exchange_family']}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        print(f"final validation loss: {result['final_val_loss']:.4f}", flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
