#!/usr/bin/env python
"""Data-parallel training on scikit-learn's digits (shipped offline) with Horovod + hvd_topk.

    horovodrun -np 2 python examples/pytorch_digits.py --compression topk --density 0.01
    mpirun -np 2 python examples/pytorch_digits.py --compression topk

The one line that matters is the optimizer wrapping in ``make_optimizer``: stock
``hvd.DistributedOptimizer`` with ``compression=hvd_topk.TopK`` (``--optimizer horovod``, the
default), or ``hvd_topk.DistributedOptimizer`` with error feedback (``--optimizer topk-ef``).
Rank 0 shows progress and, at the end, the test accuracy and the bytes sent compared to a dense
fp32 allreduce (and, for topk-ef, the optimizer's compression statistics).
"""

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

import horovod.torch as hvd
from cli import (HelpFormatter, bytes_report, check_interval, output_path,  # shared by the examples
                 refuse_topk_flags_with_dense_exchange, usage_error_from)
import hvd_topk
from digits_model import DigitsNet, load_digits_split  # shared with lightning_digits.py


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--compression", choices=("none", "fp16", "topk"), default="topk")
    p.add_argument("--density", type=float, default=0.01, help="fraction sent by topk (default 0.01)")
    p.add_argument("--optimizer", choices=("horovod", "topk-ef"), default="horovod",
                   help="hvd.DistributedOptimizer (+ --compression) or hvd_topk.DistributedOptimizer")
    p.add_argument("--no-error-feedback", action="store_true", help="topk-ef without error feedback")
    p.add_argument("--selection-scope", choices=("tensor", "bucket"), default="tensor",
                   help="topk-ef: k per tensor (default) or one top-k per fusion bucket")
    p.add_argument("--exchange", choices=hvd_topk.checks.EXCHANGES, default="auto",
                   help="topk-ef: how buckets travel (default auto: a measured trial picks the "
                        "fastest of dense, allgather and sparse_allreduce)")
    p.add_argument("--hierarchical", action="store_true",
                   help="topk-ef: dense inside each host, sparse across hosts (starts Horovod with "
                        "hvd_topk.init(), which adds the host process sets)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the number of ranks")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json", metavar="PATH", type=output_path,
                   help="write the final metrics here (rank 0)")
    p.add_argument("--quiet", action="store_true", help="only the final summary")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        p.error("--epochs and --batch-size must be positive")
    check_interval(p, "--lr", args.lr, 0, low_open=True)
    check_interval(p, "--momentum", args.momentum, 0, 1)
    if args.optimizer == "topk-ef" and args.compression != "topk":
        p.error("--optimizer topk-ef always compresses with TopK; use --compression topk")
    if args.no_error_feedback and args.optimizer != "topk-ef":
        p.error("--no-error-feedback only applies to --optimizer topk-ef (the drop-in TopK has none)")
    if args.selection_scope != "tensor" and args.optimizer != "topk-ef":
        p.error("--selection-scope only applies to --optimizer topk-ef (the drop-in TopK sees one tensor at a time)")
    if args.hierarchical and args.optimizer != "topk-ef":
        p.error("--hierarchical only applies to --optimizer topk-ef")
    if args.exchange != "auto" and args.optimizer != "topk-ef":
        p.error("--exchange only applies to --optimizer topk-ef (the drop-in TopK is an allgather)")
    if args.hierarchical and args.exchange in ("dense", "dense_fp16"):
        p.error(f"--hierarchical sends sparse pairs across hosts; --exchange {args.exchange} sends every bucket dense")
    if args.compression != "topk" and args.density != 0.01:
        p.error("--density only applies to --compression topk")
    if args.compression == "topk":
        usage_error_from(p, hvd_topk.checks.check_density, args.density, "--density")
    refuse_topk_flags_with_dense_exchange(p, args, {"density": 0.01, "no_error_feedback": False,
                                                    "selection_scope": "tensor"})
    return args


def make_compression(args):
    if args.compression == "topk":
        return hvd_topk.TopK(density=args.density)
    return hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none


def make_optimizer(args, model, compression):
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    if args.optimizer == "topk-ef":
        return hvd_topk.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                             compression=compression,
                                             error_feedback=not args.no_error_feedback,
                                             selection_scope=args.selection_scope,
                                             exchange=args.exchange,
                                             hierarchical=True if args.hierarchical else "auto")
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    compression=compression)


def evaluate(model, x, y):
    model.eval()
    with torch.no_grad():
        logits = model(x)
    model.train()
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def bytes_per_step(model, args, compression, opt):
    """(bytes sent, dense fp32 bytes) per step and rank; topk reads its own counters."""
    dense = sum(p.numel() * 4 for p in model.parameters())
    if args.optimizer == "topk-ef":
        s = opt.compression_stats()
        return s["bytes_sent"] / max(1, s["steps"]), s["bytes_dense"] / max(1, s["steps"])
    if args.compression == "topk":
        s = compression.stats()
        if not s["bytes_dense"]:  # one rank: Horovod exchanges nothing and never calls the compressor
            return 0.0, dense
        steps = max(1, s["tensors_sparse"] // sum(1 for _ in model.parameters()))
        return s["bytes_sent"] / steps, s["bytes_dense"] / steps
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

    (x_train, y_train), (x_test, y_test) = load_digits_split()
    x_local, y_local = x_train[rank::size], y_train[rank::size]  # this rank's shard
    model = DigitsNet()
    compression = make_compression(args)
    opt = make_optimizer(args, model, compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    say(f"digits: {len(y_train)} train / {len(y_test)} test, {size} ranks, optimizer={args.optimizer}, "
        f"compression={args.compression}" + (f" density={args.density}" if args.compression == "topk" else "")
        + (" (no error feedback)" if args.no_error_feedback else ""))
    gen = torch.Generator().manual_seed(args.seed + rank)
    steps_per_epoch = (len(y_local) + args.batch_size - 1) // args.batch_size
    # every rank must take the same number of steps
    steps_per_epoch = int(hvd.allreduce(torch.tensor(steps_per_epoch), op=hvd.Min, name="steps"))
    history, t0 = [], time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(y_local), generator=gen)
        total = 0.0
        for step in range(steps_per_epoch):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_local[idx]), y_local[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        train_loss = hvd.allreduce(torch.tensor(total / steps_per_epoch), name="train_loss").item()
        test_loss, test_acc = evaluate(model, x_test, y_test)
        history.append({"epoch": epoch, "train_loss": train_loss, "test_loss": test_loss, "test_acc": test_acc})
        say(f"epoch {epoch:3d}/{args.epochs}  train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
            f"test acc {100 * test_acc:5.1f}%  ({time.perf_counter() - t0:.1f}s)", flush=True)

    sent, dense = bytes_per_step(model, args, compression, opt)
    sent, bytes_line = bytes_report(sent, dense, size)
    result = {"optimizer": args.optimizer, "error_feedback": args.optimizer == "topk-ef" and not args.no_error_feedback,
              "compression": args.compression, "density": args.density if args.compression == "topk" else None,
              "ranks": size, "epochs": args.epochs, "test_acc": history[-1]["test_acc"],
              "bytes_sent_per_step": sent, "bytes_dense_per_step": dense,
              "bytes_ratio": sent / dense, "seconds": time.perf_counter() - t0, "history": history}
    if args.optimizer == "topk-ef":
        result["compression_stats"] = opt.compression_stats()
    if rank == 0:
        print(f"final test accuracy {100 * result['test_acc']:.2f}%  |  {bytes_line}")
        if "compression_stats" in result:
            st = result["compression_stats"]
            print(f"compression_stats: steps {st['steps']}, achieved density {st['density']:.4f}, "
                  f"sparse/dense tensors {st['tensors_sparse']}/{st['tensors_dense']}, "
                  f"selection {st['time_selection_s']:.2f}s, exchange wait {st['time_exchange_s']:.2f}s, "
                  f"non-finite resets {st['nonfinite_resets']}, exchange {st['exchange']} -> "
                  f"{st['exchange_family']}" + (f" ({st['exchange_reason']})" if "exchange_reason" in st else ""))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
