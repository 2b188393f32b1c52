"""Shared set-up for scripts run under mpirun: Horovod + mpi4py, fail-fast on any rank."""

import sys
import traceback

import numpy as np
from mpi4py import MPI  # initialise MPI before Horovod so both share it

import horovod.torch as hvd

COMM = MPI.COMM_WORLD


def run(main):
    """Run ``main()`` on every rank; an exception on one rank aborts the whole job (exit 1)."""
    hvd.init()
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.write(f"rank {hvd.rank()} FAILED\n")
        sys.stderr.flush()
        COMM.Abort(1)
    COMM.Barrier()
    if hvd.rank() == 0:
        print(f"OK on {hvd.size()} ranks")


def gather(array):
    """Every rank's numpy array, in rank order, on every rank."""
    return COMM.allgather(np.asarray(array))


def assert_same_on_all_ranks(array, what):
    arrays = gather(array)
    for r, other in enumerate(arrays):
        if not np.array_equal(other, arrays[0]):
            raise AssertionError(f"{what}: rank {r} differs from rank 0 "
                                 f"(max |diff| {np.max(np.abs(other - arrays[0]))})")


def step_and_check_same(opt, model, label):
    """``step()`` after an explicit ``synchronize()``; parameters must be bitwise equal on all ranks."""
    with opt.skip_synchronize():
        opt.step()
    for name, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"{label}: parameter {name}")
