"""A small DDP job with hvd_topk's hook that checkpoints and, under torchrun --max-restarts,
survives a worker's crash (tests/test_ddp_elastic.py runs it).

    torchrun --nproc_per_node 2 --max-restarts 1 tests/dist/ddp_elastic_train.py DIR [--crash-at STEP]

Trains ``STEPS`` steps of tests/support/nets.Net with SGD + momentum through
``hvd_topk.ddp.TopKState`` (allgather, 5%, a dense start over 2 steps), saving model,
optimizer and TopKState to DIR/checkpoint.pt after every step (rank 0 writes, then every rank
waits). At start it resumes from the checkpoint when there is one. With ``--crash-at S``, on the
first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) the last rank exits hard after finishing step
S - 1's checkpoint, as a lost worker would; torchelastic restarts every worker, and they go on
from the checkpoint. Rank 0 writes the final parameters to DIR/final.pt and prints one line per
attempt saying where it started."""

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_topk.ddp
from nets import Net, batch

STEPS = 6


def init_process_group(attempt):
    """torchrun's env:// set-up with this attempt's keys kept apart. With torch 2.13's default,
    workers restarted by torchrun read the store keys the attempt before them wrote, and gloo
    connects to the dead workers' addresses ("Connection refused"; even a script of two
    allreduces fails so; pytorch#167288 reports the like for NCCL)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{attempt}/", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--crash-at", type=int, default=None)
    args = ap.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group(attempt)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.005)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd_topk.ddp.TopKState(density=0.05, min_numel=500, exchange="allgather", warmup_steps=2,
                                   warmup_density=0.5, named_parameters=model.named_parameters())
    hvd_topk.ddp.register(ddp, state)
    path = args.dir / "checkpoint.pt"
    start = 0
    if path.exists():
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["topk"][rank])
        start = saved["step"]
    if rank == 0:
        print(f"attempt {attempt}: {size} ranks, starting at step {start}", flush=True)
    for step in range(start, STEPS):
        if args.crash_at is not None and attempt == 0 and step == args.crash_at and rank == size - 1:
            print(f"rank {rank}: crashing before step {step}", flush=True)
            os._exit(17)
        x, y = batch(step, rank)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        states = [None] * size  # every rank's residuals (they differ), saved together by rank 0
        dist.all_gather_object(states, state.state_dict())
        if rank == 0:
            tmp = path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "topk": states, "step": step + 1}, tmp)
            os.replace(tmp, path)
        dist.barrier()
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], args.dir / "final.pt")
        print(f"done at step {STEPS}, residuals restored: {state.stats()}", flush=True)
    del ddp, state
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 + gloo may abort at interpreter exit (docs/ddp.md)


if __name__ == "__main__":
    main()
