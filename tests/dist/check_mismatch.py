"""Ranks that build different models get a clear ValueError on every rank, not a hang.

Run: PYTHONPATH=.:tests/support mpirun -np 2 (or 3) python tests/dist/check_mismatch.py
(``--list`` prints the names of its checks).
"""

import torch

import horovod.torch as hvd
import hvd_topk
from harness import raises, run


def last_rank():
    return hvd.size() - 1


def expect_error(make_model, what):
    model = make_model(hvd.rank())
    with raises(ValueError, match="ranks disagree", what=f"{what} on rank {hvd.rank()}") as caught:
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
    assert "rank 1" in str(caught.value), caught.value


def different_shapes(r):
    return torch.nn.Linear(8, 16 if r == last_rank() else 12)


def different_parameter_count(r):
    return torch.nn.Linear(8, 8, bias=r != last_rank())


def different_names(r):
    """Same shapes, different names."""
    m = torch.nn.Module()
    m.add_module("a" if r != last_rank() else "b", torch.nn.Linear(8, 8))
    return m


def check_density_mismatch():
    """Different settings (density) on one rank are caught the same way."""
    model = torch.nn.Linear(64, 64)
    with raises(ValueError, match="ranks disagree", what="density mismatch"):
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      compression=hvd_topk.TopK(density=0.1 if hvd.rank() == last_rank() else 0.01))


# Run in this order on every rank; add a check with one line.
CHECKS = [
    ("shapes", lambda: expect_error(different_shapes, "shapes")),
    ("parameter count", lambda: expect_error(different_parameter_count, "parameter count")),
    ("names", lambda: expect_error(different_names, "names")),
    ("density", check_density_mismatch),
]


if __name__ == "__main__":
    run(CHECKS)
