"""Two emulated hosts (own network namespace, 1 Gbit shaped link, hostname and sshd each):
horovodrun -H and mpirun -H run the digits example across them with the error-feedback optimizer.

Needs root, iproute2 (ip, tc), util-linux (unshare) and openssh-server; skipped otherwise.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tools.emulated_hosts import list_namespaces, pid_of_name

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "two_hosts.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _missing():
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare", "ssh", "ssh-keygen", "mpirun"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists():
        return "sshd not found (openssh-server)"
    return None


@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
@pytest.mark.timeout(300)
def test_horovodrun_and_mpirun_across_two_emulated_hosts(tmp_path):
    summary_path = tmp_path / "two_hosts.json"
    cmd = [sys.executable, str(SCRIPT), "--epochs", "10", "--rate", "1gbit", "--timeout", "120",
           "--json", str(summary_path)]
    # own session: a hang is ended with everything it started; SIGTERM first so that the
    # script removes its namespaces and sshds
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            output, _ = proc.communicate(timeout=280)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                output, _ = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
            pytest.fail(f"two-host run timed out:\n{output[-6000:]}")
    assert summary_path.exists(), output[-6000:]
    summary = json.loads(summary_path.read_text())
    launchers = {r["launcher"]: r for r in summary["runs"]}
    assert set(launchers) == {"horovodrun", "mpirun"}, output[-6000:]
    for name, run in launchers.items():
        detail = f"{name}: {json.dumps({k: v for k, v in run.items() if k != 'metrics'}, indent=1)}"
        assert run["exit"] == 0, detail
        # two ranks, on the two different emulated hosts
        assert sorted(run["ranks"]) == ["0", "1"], detail
        assert sorted(run["ranks"].values()) == ["host0", "host1"], detail
        # the digits example trained across them: rank 0's final test accuracy. 90% is far under
        # what this run reaches: the same example (EF 1%, 10 epochs, 2 ranks on one host) gave
        # 97.49/98.89/96.94% with exchange="auto" and 96.66/98.05/97.77% pinned to allgather
        # (seeds 42/43/44, 2026-11-25): mean 97.6, sd 0.8, the bound 6.7 points under the worst
        # run and ~9 sd under the mean, so another CPU's rounding cannot decide it.
        assert run["test_acc"] is not None and run["test_acc"] > 0.90, detail
        assert run["metrics"]["optimizer"] == "topk-ef" and run["metrics"]["ranks"] == 2, detail
        # gradients really went over the shaped links (sparse: ~14 kB per step, 2 ranks)
        for host, wire in run["wire_bytes"].items():
            assert wire["tx"] > 100_000 and wire["rx"] > 100_000, detail
    assert "final test accuracy" in output
    assert summary["ok"], output[-6000:]
    # nothing left behind by this run
    leftover = list_namespaces()
    assert not [ns for ns in leftover if pid_of_name(ns) == proc.pid], leftover
