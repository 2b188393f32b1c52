"""Scripts under tests/dist run as real Horovod jobs: mpirun -np 2 and -np 3 (odd sizes catch bugs;
the sparse allreduce's also -np 4); check_ddp.py (the DDP hook, no Horovod) under torchrun
--nproc_per_node 2 and 3 with gloo.

Each script checks every rank against an independent reference (numpy, fed with every rank's
raw data through mpi4py), as a list of named checks (tests/dist/harness.py). Each check is one
pytest item, ``<script>-np<N>-<check name>``; each (script, N) job runs once, when its first item
runs, and a failing check does not stop the others. One more item per job, ``...-(job)``, fails
when the job hung (killed by the timeout in tests/support/mpi.py) or crashed, did not report every
check, or exited with a status that disagrees with its checks. The names come from
``python SCRIPT --list``, which starts neither MPI nor Horovod.
"""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from results import JOB, item_id, item_message, validate_names
from mpi import DIST, launch_mpi, script_env

pytestmark = pytest.mark.distributed

SCRIPTS = ["check_compressor.py", "check_optimizer.py", "check_checkpoint.py", "check_mismatch.py", "check_compat.py",
           "check_amp.py", "check_process_sets.py", "check_join.py", "check_sparse_allreduce.py", "check_ddp.py",
           "check_local_steps.py"]
TORCHRUN = {"check_ddp.py"}  # launched by torchrun (torch.distributed), not mpirun
NPS = (2, 3)
MORE_NPS = {"check_sparse_allreduce.py": (4,)}  # the leader rotates over more ranks
LIST_TIMEOUT_S = 120


def list_checks(script):
    """``(names, None)`` from ``script --list``, or ``(None, why not)``."""
    cmd = [sys.executable, str(DIST / script), "--list"]
    try:
        proc = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=LIST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {LIST_TIMEOUT_S}s: {' '.join(cmd)}"
    if proc.returncode != 0:
        return None, f"exit {proc.returncode}: {' '.join(cmd)}\n--- stderr\n{proc.stderr[-4000:]}"
    try:
        return validate_names(proc.stdout.splitlines()), None
    except ValueError as exc:
        return None, f"{' '.join(cmd)}: {exc}"


# At collection, the three scripts at once (each imports torch and Horovod: a few seconds).
with ThreadPoolExecutor(len(SCRIPTS)) as _pool:
    LISTED = dict(zip(SCRIPTS, _pool.map(list_checks, SCRIPTS)))


def _cases():
    for script in SCRIPTS:
        names, _ = LISTED[script]
        for np_ in NPS + MORE_NPS.get(script, ()):
            for name in [*(names or []), JOB]:
                yield pytest.param(script, np_, name, id=item_id(script, np_, name))


_JOBS = {}


def job(script, np_):
    """The (script, np) job, run once, on first use, with the hard timeout of tests/support/mpi.py."""
    if (script, np_) not in _JOBS:
        launcher = "torchrun" if script in TORCHRUN else "mpirun"
        _JOBS[script, np_] = launch_mpi(np_, DIST / script, launcher=launcher)
    return _JOBS[script, np_]


@pytest.mark.parametrize("script, np_, name", list(_cases()))
def test_check(script, np_, name):
    names, list_error = LISTED[script]
    if names is None:
        pytest.fail(f"{script} --list failed, so its checks are unknown: {list_error}", pytrace=False)
    ran = job(script, np_)
    message = item_message(name, names, ran.stdout, ran.returncode, ran.problem(), ran.tail())
    if message:
        pytest.fail(message, pytrace=False)
