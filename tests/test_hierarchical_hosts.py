"""The hierarchical exchange across emulated hosts (one network namespace, hostname and sshd per
host; ranks of a host talk over its loopback, hosts over their shaped links): the numpy
reference of tests/dist/check_hierarchical.py on 2 hosts x 2 ranks, 3 x 1 and 1 x 3.

Needs root, iproute2, util-linux (unshare) and openssh-server; skipped otherwise.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from check_results import failure_message, job_message
from test_two_hosts import _missing

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "dist" / "check_hierarchical.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _names():
    out = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}:{REPO / 'tests' / 'dist'}"))
    return out.stdout.split("\n")[:-1]


@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
@pytest.mark.timeout(400)
@pytest.mark.parametrize("hosts, per_host", [(2, 2), (3, 1), (1, 3)], ids=["2x2", "3x1", "1x3"])
def test_hierarchical_matches_numpy_across_emulated_hosts(hosts, per_host, monkeypatch):
    from hvd_topk.testing.emulated_hosts import EmulatedHosts

    monkeypatch.setenv("HVD_TOPK_EXPECT_TOPOLOGY", f"{hosts}x{per_host}")
    with EmulatedHosts(hosts, rate="1gbit", sshd=True, ssh_port=2260 + 10 * hosts + per_host) as eh:
        cmd = eh.mpirun_command([SCRIPT], slots=per_host, wdir=REPO,
                                pythonpath=f"{REPO}:{REPO / 'tests'}:{REPO / 'tests' / 'dist'}",
                                env_names=("OMP_NUM_THREADS", "HVD_TOPK_EXPECT_TOPOLOGY"))
        try:
            proc = subprocess.run(eh.launcher_cmd(cmd), capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{hosts}x{per_host}: timed out\n{(exc.stdout or '')[-4000:]}")
    names, tail = _names(), (proc.stdout + proc.stderr)[-6000:]
    assert names, "check_hierarchical.py --list printed no checks"
    # every check passed on every rank, and the job's exit status agrees
    problems = [m for m in (failure_message(name, proc.stdout, None, tail) for name in names) if m]
    problems += [m for m in [job_message(names, proc.stdout, proc.returncode, None, tail)] if m]
    assert not problems, "\n\n".join(problems)
