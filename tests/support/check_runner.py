"""What both distributed harnesses do around a script's named checks, whatever the transport
(tests/dist/harness.py: mpirun + Horovod, mpi4py for the harness's own messages;
tests/dist/torchrun_harness.py: torchrun, a gloo group of its own)."""

import sys
import traceback
import warnings

from results import rank_failure_line, result_line, running_line, validate_names

# tcp:// address of the gloo group tests/dist/harness.py talks over in jobs horovodrun --gloo
# starts (tests/support/mpi.py's launch_gloo_hosts), which have no MPI world
HARNESS_STORE = "HVD_TOPK_HARNESS_STORE"

# hvd_topk's warnings of a p.grad written to after the exchange took it or before the step
# applied it (clipping): every check's ordinary training must not raise them (a false alarm is an
# error); the checks that expect them catch them in their own warnings.catch_warnings()
CHANGED_GRAD_WARNINGS = r".*p\.grad of .* was written to"


def say(text, stream=None):
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()


def listed(checks, argv):
    """True when ``argv`` asks only for the names (``--list``: printed here, one a line, without
    starting anything); exits with the usage for any other argument."""
    names = validate_names(name for name, _ in checks)
    if argv == ["--list"]:
        for name in names:
            print(name)
        return True
    if argv:
        sys.exit(f"usage: {sys.argv[0]} [--list]  (got {argv})")
    return False


def run_checks(checks, rank, size, wait_for_all, allgather):
    """Run every ``(name, function)`` on this rank. A check that raises fails here without
    stopping the others; ``wait_for_all(name)`` returns once every rank has finished it (or ends
    the job), ``allgather(error)`` gives every rank's traceback or None. Rank 0 prints a result
    line per check and a summary. Returns the names of the checks that failed on some rank."""
    failed = []
    warnings.filterwarnings("error", message=CHANGED_GRAD_WARNINGS)
    for name, check in checks:
        say(running_line(rank, name))
        error = None
        try:
            check()
        except KeyboardInterrupt:
            raise
        except BaseException:
            error = traceback.format_exc()
            say(f"[rank {rank}] FAILED {name}\n{error}", sys.stderr)
            say(rank_failure_line(name, rank, error))
        wait_for_all(name)
        errors = allgather(error)
        if any(e is not None for e in errors):
            failed.append(name)
        if rank == 0:
            say(result_line(name, errors))
    if rank == 0:
        say(f"{len(failed)} of {len(checks)} checks FAILED on {size} ranks: {failed}" if failed
            else f"OK on {size} ranks ({len(checks)} checks)")
    return failed
