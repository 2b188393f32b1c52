"""``harness.run`` for scripts launched by ``torchrun`` (torch.distributed, no Horovod, no MPI).

The same contract as tests/dist/harness.py: ``run(CHECKS)`` runs every ``(name, function)`` on
every rank, a check that raises fails on that rank without stopping the others, rank 0 prints
one result line per check (tests/support/results.py) and the job exits 1 when a check failed
anywhere. The ranks agree on the outcome over a gloo group of the harness's own; a rank that
waits more than ``HVD_TOPK_CHECK_SYNC_TIMEOUT`` seconds (60) for the others (one stuck in a
collective after another failed) ends the job. ``python SCRIPT --list`` prints the names
without starting anything.
"""

import datetime
import os
import sys

import numpy as np
import torch.distributed as dist

from check_runner import listed, run_checks, say

SYNC_TIMEOUT_S = float(os.environ.get("HVD_TOPK_CHECK_SYNC_TIMEOUT", "60"))
CONTROL = None  # the harness's own gloo group, set by run()


def run(checks, argv=None):
    global CONTROL
    checks = list(checks)
    if listed(checks, sys.argv[1:] if argv is None else list(argv)):
        return
    dist.init_process_group("gloo")
    CONTROL = dist.new_group(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()

    def wait_for_all(name):
        try:
            dist.monitored_barrier(CONTROL, timeout=datetime.timedelta(seconds=SYNC_TIMEOUT_S))
        except RuntimeError as exc:
            say(f"[rank {rank}] check {name!r}: not every rank finished it within {SYNC_TIMEOUT_S:g}s "
                f"(a rank stuck in a collective after another failed?); ending the job: {exc}", sys.stderr)
            os._exit(1)

    def allgather(error):
        errors = [None] * size
        dist.all_gather_object(errors, error, group=CONTROL)
        return errors

    failed = run_checks(checks, rank, size, wait_for_all, allgather)
    dist.destroy_process_group()
    # os._exit, not sys.exit: with torch 2.13 and gloo, a process that trained through DDP aborts
    # now and then while the interpreter shuts down ("terminate called without an active
    # exception", SIGABRT; 2 of 16 runs of plain DDP without any hook, measured 2026-11-25), after
    # every check has reported. Everything is said and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


def gather(array):
    """Every rank's numpy array, in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, np.asarray(array), group=CONTROL)
    return out


def assert_same_on_all_ranks(array, what):
    arrays = gather(array)
    for r, other in enumerate(arrays):
        if not np.array_equal(other, arrays[0]):
            raise AssertionError(f"{what}: rank {r} differs from rank 0")
