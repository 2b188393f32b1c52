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
import traceback

import numpy as np
import torch.distributed as dist

from results import rank_failure_line, result_line, running_line, validate_names

SYNC_TIMEOUT_S = float(os.environ.get("HVD_TOPK_CHECK_SYNC_TIMEOUT", "60"))
CONTROL = None  # the harness's own gloo group, set by run()


def _say(text, stream=None):
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()


def run(checks, argv=None):
    global CONTROL
    checks = list(checks)
    names = validate_names(name for name, _ in checks)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--list"]:
        for name in names:
            print(name)
        return
    if argv:
        sys.exit(f"usage: {sys.argv[0]} [--list]  (got {argv})")
    dist.init_process_group("gloo")
    CONTROL = dist.new_group(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    failed = []
    for name, check in checks:
        _say(running_line(rank, name))
        error = None
        try:
            check()
        except KeyboardInterrupt:
            raise
        except BaseException:
            error = traceback.format_exc()
            _say(f"[rank {rank}] FAILED {name}\n{error}", sys.stderr)
            _say(rank_failure_line(name, rank, error))
        try:
            dist.monitored_barrier(CONTROL, timeout=datetime.timedelta(seconds=SYNC_TIMEOUT_S))
        except RuntimeError as exc:
            _say(f"[rank {rank}] check {name!r}: not every rank finished it within {SYNC_TIMEOUT_S:g}s "
                 f"(a rank stuck in a collective after another failed?); ending the job: {exc}", sys.stderr)
            os._exit(1)
        errors = [None] * size
        dist.all_gather_object(errors, error, group=CONTROL)
        if any(e is not None for e in errors):
            failed.append(name)
        if rank == 0:
            _say(result_line(name, errors))
    if rank == 0:
        _say(f"{len(failed)} of {len(checks)} checks FAILED on {size} ranks: {failed}" if failed
             else f"OK on {size} ranks ({len(checks)} checks)")
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
