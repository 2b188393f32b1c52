#!/usr/bin/env python
"""Elastic training (Horovod elastic) with hvd_topk's error-feedback optimizer (or, with
``--optimizer topk``, Horovod's optimizer and the drop-in TopK), on one machine.

Two emulated hosts that are both this machine ("localhost" and "127.0.0.1", one slot each); the
discovery script says which are up:

    printf '#!/bin/sh\\necho localhost:1\\necho 127.0.0.1:1\\n' > /tmp/hosts.sh; chmod +x /tmp/hosts.sh
    horovodrun -np 2 --min-np 1 --max-np 2 --network-interface lo --host-discovery-script /tmp/hosts.sh \\
        python examples/pytorch_elastic.py --epochs 4

(``--network-interface lo`` lets Horovod start with one host; without it elastic Gloo may wait
for two, depending on the machine's network interfaces.)

Workers can fail (``--fail-rank R --fail-epoch E``: that rank exits in the middle of a step, after
its backward pass, once: ``--fail-marker`` records it) or come and go (change the discovery script's output while it
runs); training goes on with the workers left, from the last ``state.commit()``.

What hvd_topk does on a reset: buckets still in flight when a worker died are dropped when
``TorchState`` restores the committed state; the world size (averaging, sparse-or-dense choice)
is read again at the next step; residuals are the committed ones of this worker (error feedback
is per worker), and a newly added worker's start at zero. The constructor does not run its
rank-agreement collective in an elastic job (a new worker builds its optimizer alone).

``--epoch-log FILE`` appends one JSON line per finished epoch (rank 0): epoch, size, loss, and the
optimizer's world size (``topk-ef``) or the tensors the drop-in sent dense (``topk``: none unless
a rank is in ``hvd.join()``); the last line rank 0 prints is ``final loss: X.XXXX``.
"""

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

import horovod.torch as hvd
from cli import HelpFormatter, check_interval, usage_error_from, output_path  # shared by the examples
import hvd_topk


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batches-per-epoch", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--optimizer", choices=["topk-ef", "topk", "dense"], default="topk-ef",
                   help="topk-ef: hvd_topk.DistributedOptimizer (error feedback); topk: Horovod's "
                        "DistributedOptimizer with compression=hvd_topk.TopK; dense: Horovod's alone")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--exchange", choices=["auto", "allgather", "sparse_allreduce", "dense"], default="auto",
                   help="topk-ef: hvd_topk.DistributedOptimizer's exchange")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--fail-rank", type=int, default=None, help="this rank exits once, mid-step")
    p.add_argument("--fail-epoch", type=int, default=1, help="with --fail-rank: the epoch it fails in")
    p.add_argument("--fail-marker", default="/tmp/hvd_topk_elastic_failed",
                   help="file recording that the failure happened (so it happens once)")
    p.add_argument("--epoch-log", default=None, type=output_path, help="append one JSON line per epoch (rank 0)")
    p.add_argument("--epoch-wait", type=float, default=0.0,
                   help="seconds to wait before each commit (lets host changes be discovered)")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    for name in ("epochs", "batches_per_epoch", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    check_interval(p, "--lr", args.lr, 0, low_open=True)
    check_interval(p, "--epoch-wait", args.epoch_wait, 0)
    if args.optimizer == "dense" and args.density != 0.01:
        p.error("--density only applies to --optimizer topk-ef or topk")
    if args.optimizer != "topk-ef" and args.exchange != "auto":
        p.error("--exchange only applies to --optimizer topk-ef")
    usage_error_from(p, hvd_topk.checks.check_density, args.density, "--density")
    if args.fail_rank is None and args.fail_epoch != 1:
        p.error("--fail-epoch only applies with --fail-rank")
    if args.fail_rank is not None and not (args.fail_rank >= 0 and 0 <= args.fail_epoch < args.epochs):
        p.error(f"--fail-rank must be >= 0 and --fail-epoch in [0, --epochs={args.epochs}) (epochs count from 0), "
                f"or the failure never happens")
    return args


def digits():
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    return x, torch.tensor(data.target, dtype=torch.long)


def main(args):
    hvd.init()
    if args.fail_rank is not None and args.fail_rank >= hvd.size() and hvd.rank() == 0:
        print(f"note: --fail-rank {args.fail_rank} but the job starts with {hvd.size()} ranks (0-{hvd.size() - 1}): "
              "no rank fails unless the job grows that far", flush=True)
    if args.fail_rank is not None and hvd.rank() == 0 and os.path.exists(args.fail_marker):
        print(f"note: {args.fail_marker} exists (an earlier run failed already): no rank will fail in this "
              "run; delete it to see the failure again", flush=True)
    torch.manual_seed(args.seed)
    x_all, y_all = digits()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    compressor = hvd_topk.TopK(density=args.density) if args.optimizer != "dense" else None
    if args.optimizer == "topk-ef":
        opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                            compression=compressor, min_numel=1000, exchange=args.exchange)
    else:
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                       compression=compressor if args.optimizer == "topk" else
                                       hvd.Compression.none)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        loss = torch.zeros(())
        while state.epoch < args.epochs:
            gen = np.random.default_rng(1000 * state.epoch + hvd.rank())
            for state.batch in range(state.batch, args.batches_per_epoch):
                rows = torch.from_numpy(gen.integers(0, len(x_all), args.batch_size))
                opt.zero_grad()
                loss = F.cross_entropy(model(x_all[rows]), y_all[rows])
                loss.backward()
                if (hvd.rank() == args.fail_rank and state.epoch == args.fail_epoch
                        and not os.path.exists(args.fail_marker)):
                    open(args.fail_marker, "w").close()
                    print(f"rank {hvd.rank()}: failing on purpose in epoch {state.epoch}", flush=True)
                    os._exit(1)  # mid-step: the other workers' buckets are in flight
                opt.step()
            if hvd.rank() == 0:
                line = {"epoch": state.epoch, "size": hvd.size(), "loss": loss.item()}
                if args.optimizer == "topk-ef":  # the size it averages over, the rank it exchanges as
                    stats = opt.compression_stats()
                    line["optimizer_world"], line["optimizer_rank"] = stats["world_size"], stats["rank"]
                if args.optimizer == "topk":  # tensors sent dense (only when a rank has joined)
                    line["tensors_dense"] = compressor.stats()["tensors_dense"]
                print(json.dumps(line), flush=True)
                if args.epoch_log:
                    with open(args.epoch_log, "a") as f:
                        f.write(json.dumps(line) + "\n")
            state.epoch += 1
            state.batch = 0
            time.sleep(args.epoch_wait)
            state.commit()  # also where Horovod applies host changes
        return loss.item()

    final = train(state)
    if hvd.rank() == 0:
        print(f"final loss: {final:.4f}", flush=True)


if __name__ == "__main__":
    main(parse_args())
