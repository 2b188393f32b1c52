"""The hierarchical exchange across emulated hosts (one network namespace, hostname and sshd per
host; ranks of a host talk over its loopback, hosts over their shaped links): the numpy
reference of tests/dist/check_hierarchical.py on 2 hosts x 2 ranks, 3 x 1 and 1 x 3.

As in tests/test_distributed.py, each check is one pytest item, ``<hosts>x<per host>-<check
name>`` (the names from ``check_hierarchical.py --list``, which starts neither MPI nor Horovod);
each topology's job runs once, when its first item runs, and a failing check does not stop the
others. One more item per topology, ``...-(job)``, fails when the job hung or crashed, did not
report every check, or exited with a status that disagrees with its checks.

Needs root, iproute2, util-linux (unshare) and openssh-server; skipped otherwise.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from results import JOB, item_message, validate_names
from test_two_hosts import _missing

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "dist" / "check_hierarchical.py"
PYTHONPATH = os.pathsep.join(str(p) for p in (REPO, REPO / "tests" / "support", REPO / "tests",
                                              REPO / "tests" / "dist"))
TOPOLOGIES = {"2x2": (2, 2), "3x1": (3, 1), "1x3": (1, 3)}
JOB_TIMEOUT_S = 300
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _names():
    """``(names, None)`` from ``check_hierarchical.py --list``, or ``(None, why not)``."""
    cmd = [sys.executable, str(SCRIPT), "--list"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    except subprocess.TimeoutExpired:
        return None, f"timed out: {' '.join(cmd)}"
    if out.returncode != 0:
        return None, f"exit {out.returncode}: {' '.join(cmd)}\n--- stderr\n{out.stderr[-4000:]}"
    try:
        names = validate_names(out.stdout.splitlines())
    except ValueError as exc:
        return None, f"{' '.join(cmd)}: {exc}"
    return (names, None) if names else (None, "check_hierarchical.py --list printed no checks")


NAMES, LIST_ERROR = _names()


def _cases():
    for topology in TOPOLOGIES:
        for name in [*(NAMES or []), JOB]:
            yield pytest.param(topology, name, id=f"{topology}-{name}")


_JOBS = {}


def job(topology):
    """``(stdout, returncode, problem, tail)`` of the topology's job, run once, on first use."""
    if topology not in _JOBS:
        _JOBS[topology] = _run_job(*TOPOLOGIES[topology])
    return _JOBS[topology]


def _text(data):
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _run_job(hosts, per_host):
    from tools.emulated_hosts import EmulatedHosts

    env = dict(os.environ, HVD_TOPK_EXPECT_TOPOLOGY=f"{hosts}x{per_host}")
    with EmulatedHosts(hosts, rate="1gbit", sshd=True, ssh_port=2260 + 10 * hosts + per_host) as eh:
        cmd = eh.mpirun_command([SCRIPT], slots=per_host, wdir=REPO, pythonpath=PYTHONPATH,
                                env_names=("OMP_NUM_THREADS", "HVD_TOPK_EXPECT_TOPOLOGY"))
        try:
            proc = subprocess.run(eh.launcher_cmd(cmd), capture_output=True, text=True,
                                  timeout=JOB_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired as exc:
            stdout, stderr = _text(exc.stdout), _text(exc.stderr)
            return stdout, None, f"{hosts}x{per_host}: timed out after {JOB_TIMEOUT_S}s (a hang?)", \
                (stdout + stderr)[-6000:]
    return proc.stdout, proc.returncode, None, (proc.stdout + proc.stderr)[-6000:]


@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
@pytest.mark.timeout(400)
@pytest.mark.parametrize("topology, name", list(_cases()))
def test_hierarchical_matches_numpy_across_emulated_hosts(topology, name):
    if NAMES is None:
        pytest.fail(f"check_hierarchical.py --list failed, so its checks are unknown: {LIST_ERROR}",
                    pytrace=False)
    stdout, returncode, problem, tail = job(topology)
    message = item_message(name, NAMES, stdout, returncode, problem, tail)
    if message:
        pytest.fail(message, pytrace=False)
