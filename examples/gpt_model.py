"""The GPT example's model, corpus, batches, learning-rate schedule and evaluation: shared by
``pytorch_gpt.py`` (Horovod) and ``ddp_gpt.py`` (torchrun + DDP), so both train the same thing."""

import argparse
import hashlib
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from hvd_topk.optim import LocalAdamW
from hvd_topk.checks import check_density

from cli import check_interval, usage_error_from, output_path  # shared by the examples


def load_corpus(limit_bytes):
    """The standard library's .py files, sorted by relative path, concatenated, cut to the limit."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    text = b"".join(chunks)[:int(limit_bytes)]
    if len(text) < 100_000:
        raise SystemExit(f"only {len(text)} bytes of Python sources under {root}: no corpus")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long(), hashlib.sha256(text).hexdigest()


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Byte-level decoder: 256 tokens in, next-byte logits out."""

    def __init__(self, context, width, layers, heads):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 256)
        self.register_buffer("mask", torch.triu(torch.ones(context, context, dtype=torch.bool), 1),
                             persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.norm(x))


def split(data, pieces=100):
    """(train, validation): the corpus cut into ``pieces`` equal runs, every tenth held out, so
    both halves draw from every part of the library, not the last files alone."""
    runs = torch.tensor_split(data, pieces)
    return torch.cat([r for i, r in enumerate(runs) if i % 10 != 9]), torch.cat(runs[9::10])


def batches(data, context, batch_size, generator):
    starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s:s + context] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + context + 1] for s in starts.tolist()])
    return x, y


def lr_warmup_steps(args):
    """How many steps the learning rate ramps up for (--lr-warmup of --steps, at least 1)."""
    return max(1, int(args.lr_warmup * args.steps))


LONG_WARMUP = 500  # steps of learning-rate warm-up from which the recipe's dense start spans it
LONG_WARMUP_SPARSE = (0.001, 300)  # (density, steps): at 0.1% or less, from a 300-step warm-up


def dense_start_note(args):
    """A note when --adam local's dense start (--warmup-steps) ends before a long learning-rate
    warm-up (LONG_WARMUP steps or more), or None. At 10,000 steps (a 1000-step warm-up) a
    100-step start ended 10% behind dense AdamW and the start over the whole warm-up level with
    it; at 5000 steps (500) the 100-step start 5.5% behind, the start over the warm-up 0.7%
    (3 seeds); at 3000 steps (300) the 100-step start did as well at 1%, while at 0.1% the start
    over the warm-up ended +6.0% against dense AdamW instead of +9.9% (3 seeds; docs/adamw.md,
    long runs)."""
    ramp = lr_warmup_steps(args)
    sparse, sparse_from = LONG_WARMUP_SPARSE
    threshold = sparse_from if args.density <= sparse else LONG_WARMUP
    if args.adam != "local" or ramp < threshold or not 0 < args.warmup_steps < ramp:
        return None
    return (f"note: the dense start (--warmup-steps {args.warmup_steps}) ends before the learning-rate warm-up "
            f"({ramp} steps); on long runs the AdamW recipe's start spans it: --warmup-steps {ramp} "
            "(docs/adamw.md, long runs)")


LR_SCHEDULES = ("cosine", "wsd")
WSD_DECAY = 0.2  # --lr-schedule wsd: the linear decay to 0 spans the last 20% of the steps


def wsd_decay_steps(args):
    """How many steps --lr-schedule wsd's linear decay lasts (WSD_DECAY of --steps, at least 1)."""
    return max(1, int(WSD_DECAY * args.steps))


def lr_at(step, args):
    """The learning rate of ``step`` (from 0): a linear warm-up over ``lr_warmup_steps``, then
    ``cosine``: a cosine from --lr to 0 at the last step; ``wsd`` (warm-up, stable, decay): --lr
    until the last WSD_DECAY of the steps, then linearly to 0."""
    warm = lr_warmup_steps(args)
    if step < warm:
        return args.lr * (step + 1) / warm
    if args.lr_schedule == "wsd":
        return args.lr * min(1.0, (args.steps - step) / wsd_decay_steps(args))
    progress = (step - warm) / max(1, args.steps - warm)
    return args.lr * 0.5 * (1 + math.cos(math.pi * progress))


def evaluate(model, val, args, device, autocast):
    """Mean loss over fixed validation batches (the same on every rank)."""
    gen = torch.Generator().manual_seed(1234)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(args.eval_batches):
            x, y = batches(val, args.context, args.batch_size, gen)
            with autocast():
                logits = model(x.to(device))
            total += F.cross_entropy(logits.float().reshape(-1, 256), y.to(device).reshape(-1)).item()
    model.train()
    return total / args.eval_batches


def sketch_size(text):
    """``--variance-sketch``'s value: ``auto`` (LocalAdamW's default, ``LocalAdamW.AUTO_SKETCH``:
    256 numbers a tensor from 6 ranks on, none below) or a count >= 0 (0: off)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"'auto' or an integer >= 0, got {text!r}")
    return value


def add_compact_argument(p, prefix, builds):
    """``--compact`` (``True``: 8-bit log-scale values) or ``--compact sign`` (1-bit values), both
    GPT examples; ``prefix`` says which mode takes it, ``builds`` what it builds."""
    def value(text):
        if text != "sign":
            raise argparse.ArgumentTypeError(f"nothing (8-bit values) or 'sign', got {text!r}")
        return text
    p.add_argument("--compact", nargs="?", const=True, default=False, type=value, metavar="sign",
                   help=f"{prefix}compact pairs, an Elias-Fano index and an 8-bit log-scale value ({builds}(compact=True)): "
                        "about 2.4 bytes a pair against --fp16-values' 6; '--compact sign': the value's sign alone, "
                        f"one mean magnitude for each top-k ({builds}(compact='sign')), about 1.4 bytes a pair, with error "
                        "feedback only; the allgather or dense only")


def add_variance_arguments(p):
    """``--adam local``'s options for the variance of the ranks' average, both GPT examples."""
    p.add_argument("--gv-signal", choices=LocalAdamW.SIGNALS, default="mean",
                   help="--adam local: how the variance of the ranks' average tells signal from noise "
                        "(LocalAdamW(signal=...)); mean+lag1 also counts a gradient whose sign flips every step as "
                        "signal (8 ranks and more)")
    p.add_argument("--variance-sketch", type=sketch_size, default="auto", metavar="B",
                   help="--adam local: measure each tensor's variance of the ranks' average gradient with a "
                        "B-number sketch a tensor and step, averaged by the transport (LocalAdamW(variance_sketch=B); "
                        "auto: 256 from 6 ranks on, 0: off; docs/adamw.md)")


def add_training_arguments(p):
    """The model, corpus, schedule and evaluation options both GPT examples take."""
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-warmup", type=float, default=0.1, help="fraction of --steps for the LR warm-up")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="cosine",
                   help="after the warm-up: a cosine to 0, or wsd: constant, then linear to 0 over the last 20%%")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--corpus-mb", type=float, default=4.0, help="bytes of the corpus used, MB")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json", metavar="PATH", type=output_path,
                   help="write the final metrics here (rank 0)")
    p.add_argument("--quiet", action="store_true", help="only the final summary")


def check_topk_arguments(p, args):
    """Usage errors (``p.error``) for the Top-K flags both launchers take: ``--density``,
    ``--fp16-values``, ``--compact`` and ``--exchange``, before anything is started."""
    if args.compact and args.fp16_values:
        p.error("--fp16-values and --compact are two wire formats: choose one")
    if args.compact and args.exchange == "sparse_allreduce":
        p.error("--compact packs the allgather's pairs: use --exchange allgather or auto")
    if args.compact == "sign" and getattr(args, "no_error_feedback", False):
        p.error("--compact sign rounds each value to its sign times the mean magnitude of its top-k, which only error "
                "feedback makes good: leave --no-error-feedback out, or use --compact")
    usage_error_from(p, check_density, args.density, "--density")


def check_training_arguments(p, args):
    """Usage errors (``p.error``) for the options of ``add_training_arguments``."""
    for name in ("steps", "batch_size", "context", "width", "layers", "heads", "eval_every", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.width % args.heads:
        p.error("--width must be a multiple of --heads")
    if not (0 <= args.lr_warmup < 1 and args.corpus_mb > 0):  # (NaN fails these too)
        p.error("--corpus-mb must be positive, --lr-warmup in [0, 1)")
    check_interval(p, "--lr", args.lr, 0, low_open=True)
    check_interval(p, "--weight-decay", args.weight_decay, 0)
    clip = getattr(args, "clip", None)  # each launcher has its own --clip (its default differs)
    if clip is not None and not 0 <= clip < float("inf"):  # a negative limit flips the gradient
        p.error(f"--clip must be a finite norm >= 0 (0: off), got {clip}")
    if args.lr_schedule == "wsd" and lr_warmup_steps(args) > args.steps - wsd_decay_steps(args):
        p.error(f"--lr-schedule wsd: the warm-up ({lr_warmup_steps(args)} steps) must end before the decay over "
                f"the last {wsd_decay_steps(args)} steps; lower --lr-warmup")
