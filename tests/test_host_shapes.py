"""tests/dist/check_host_shapes.py on hosts emulated by ``horovodrun --gloo`` (every -H name a
spelling of 127.0.0.1: one machine, but Horovod sees separate hosts, with their own local and
cross ranks): hosts of 2 and 1 ranks, and 3 hosts of 2. No root, namespaces or ssh needed; the
hierarchical exchange's numpy contract across real network namespaces is
tests/test_hierarchical_hosts.py's (slow).

As in tests/test_distributed.py, each check is one pytest item, ``<hosts>-<check name>``; each
topology's job runs once, when its first item runs. One more item per topology, ``...-(job)``,
fails when the job hung or crashed, did not report every check, or exited with a status that
disagrees with its checks.
"""

import socket
import subprocess
import sys

import pytest

from mpi import DIST, launch_gloo_hosts, script_env
from results import JOB, item_message, validate_names

SCRIPT = DIST / "check_host_shapes.py"
TOPOLOGIES = ("2,1", "2,2,2")
JOB_TIMEOUT_S = 300
pytestmark = pytest.mark.distributed


def _names(hosts):
    cmd = [sys.executable, str(SCRIPT), "--list"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env=dict(script_env(), HVD_TOPK_HOSTS=hosts))
    if out.returncode != 0:
        return None, f"exit {out.returncode}: {' '.join(cmd)}\n--- stderr\n{out.stderr[-4000:]}"
    return validate_names(out.stdout.splitlines()), None


NAMES = {hosts: _names(hosts) for hosts in TOPOLOGIES}
_JOBS = {}


def job(hosts):
    if hosts not in _JOBS:  # HVD_TOPK_HOSTS: read by the script on every rank
        _JOBS[hosts] = launch_gloo_hosts([int(n) for n in hosts.split(",")], SCRIPT, timeout=JOB_TIMEOUT_S,
                                         env={"HVD_TOPK_HOSTS": hosts})
    return _JOBS[hosts]


def _cases():
    for hosts in TOPOLOGIES:
        for name in [*(NAMES[hosts][0] or []), JOB]:
            yield pytest.param(hosts, name, id=f"{hosts}-{name}")


def _host_name_problem():
    """Horovod 0.28.1's gloo transport resolves the host name it runs on, whatever interface
    horovodrun names; where that fails every rank crashes ("Unable to find address for")."""
    try:
        socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        return (f"this machine's host name {socket.gethostname()!r} does not resolve ({exc}): Horovod's "
                "gloo transport needs it (add it to /etc/hosts)")
    return None


HOST_NAME_PROBLEM = _host_name_problem()


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("hosts, name", list(_cases()))
def test_host_shapes(hosts, name):
    names, error = NAMES[hosts]
    if HOST_NAME_PROBLEM:
        pytest.fail(HOST_NAME_PROBLEM, pytrace=False)
    if names is None:
        pytest.fail(f"check_host_shapes.py --list failed: {error}", pytrace=False)
    result = job(hosts)
    message = item_message(name, names, result.stdout, result.returncode, result.problem(), result.tail())
    if message:
        pytest.fail(message, pytrace=False)
