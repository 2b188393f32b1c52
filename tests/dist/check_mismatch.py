"""Ranks that build different models get a clear ValueError on every rank, not a hang.

Run: mpirun -np 2 (or 3) python tests/dist/check_mismatch.py
"""

import torch

import horovod.torch as hvd
import hvd_topk
from harness import run


def expect_error(make_model, what):
    model = make_model(hvd.rank())
    try:
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
    except ValueError as exc:
        assert "ranks disagree" in str(exc) and "rank 1" in str(exc), exc
    else:
        raise AssertionError(f"{what}: no error on rank {hvd.rank()}")


def main():
    last = hvd.size() - 1
    expect_error(lambda r: torch.nn.Linear(8, 16 if r == last else 12), "shapes")
    expect_error(lambda r: torch.nn.Linear(8, 8, bias=r != last), "parameter count")
    # Same shapes, different names.
    def named(r):
        m = torch.nn.Module()
        m.add_module("a" if r != last else "b", torch.nn.Linear(8, 8))
        return m
    expect_error(named, "names")
    # Different settings (density) on one rank are caught the same way.
    model = torch.nn.Linear(64, 64)
    try:
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      compression=hvd_topk.TopK(density=0.1 if hvd.rank() == last else 0.01))
    except ValueError as exc:
        assert "ranks disagree" in str(exc), exc
    else:
        raise AssertionError("density mismatch not detected")


if __name__ == "__main__":
    run(main)
