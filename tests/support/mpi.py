"""Run a script under ``mpirun -np N`` (or ``torchrun --nproc_per_node N``, or ``horovodrun
--gloo`` on emulated hosts) with a hard timeout, for the distributed tests."""

import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from check_runner import HARNESS_STORE
from tools.launch import horovodrun_gloo_command, mpirun_command, torchrun_command

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
DIST = TESTS / "dist"
TIMEOUT_S = int(os.environ.get("HVD_TOPK_MPI_TIMEOUT", "240"))


def script_env():
    """This environment, with the repository, tests/support (the helpers: reference, results)
    and tests/ first on PYTHONPATH (for every rank)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(SUPPORT), str(TESTS), env.get("PYTHONPATH")]))
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    return env


@dataclass
class MpiJob:
    """How an mpirun job ended: ``returncode`` is None when it was killed after ``timeout`` s."""

    cmd: list
    returncode: object
    stdout: str
    stderr: str
    timeout: float

    @property
    def timed_out(self):
        return self.returncode is None

    def problem(self):
        """None when mpirun exited by itself, else a sentence saying it was killed."""
        if self.timed_out:
            return f"timed out after {self.timeout}s (a hang?) and was killed: {' '.join(self.cmd)}"
        return None

    def tail(self, chars=4000):
        return (f"--- stdout (last {chars} characters)\n{self.stdout[-chars:]}\n"
                f"--- stderr (last {chars} characters)\n{self.stderr[-chars:]}")


def launch_mpi(np, script, *args, timeout=TIMEOUT_S, launcher="mpirun", torchrun_options=(), cwd=None):
    """Run ``script`` on ``np`` ranks (in ``cwd``); a hang is killed, with every rank, after
    ``timeout`` seconds. ``launcher``: ``"mpirun"`` (Horovod scripts) or ``"torchrun"``
    (torch.distributed scripts, tools/launch.py's command line, with ``torchrun_options``)."""
    if launcher == "torchrun":
        cmd = torchrun_command(np, [script, *args], options=torchrun_options)
    else:
        cmd = mpirun_command(np, [script, *args], env_names=("OMP_NUM_THREADS", "PYTHONPATH"))
    return _run_killable(cmd, script_env(), timeout, cwd)


def launch_gloo_hosts(ranks_per_host, script, *args, timeout=TIMEOUT_S, env=None):
    """Run a tests/dist/harness.py ``script`` under ``horovodrun --gloo`` on emulated hosts,
    ``ranks_per_host[i]`` ranks on host i (tools/launch.py's ``horovodrun_gloo_command``: every
    host is this machine, each with its own Horovod local and cross ranks). The harness talks
    over a gloo group at a free local port (no MPI world there); a hang is killed after
    ``timeout`` seconds. ``env``: more variables for every rank."""
    env = {**script_env(), **(env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the harness's torch.distributed group, on loopback too
    env[HARNESS_STORE] = f"tcp://127.0.0.1:{free_port()}"
    return _run_killable(horovodrun_gloo_command(ranks_per_host, [script, *args]), env, timeout, None)


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_killable(cmd, env, timeout, cwd):
    # A session of its own, so that a hang is ended with every rank the launcher started.
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True, cwd=cwd) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            return MpiJob(cmd, None, stdout, stderr, timeout)
    return MpiJob(cmd, popen.returncode, stdout, stderr, timeout)


def run_mpi(np, script, *args, timeout=TIMEOUT_S, expect_ok=True):
    """Run and return the completed process; a hang is killed after ``timeout`` seconds.

    A hang raises AssertionError carrying the output; so does, with ``expect_ok``, a non-zero
    exit (any rank failing makes mpirun fail).
    """
    job = launch_mpi(np, script, *args, timeout=timeout)
    if job.timed_out:
        raise AssertionError(f"{job.problem()}\n--- stdout\n{job.stdout}\n--- stderr\n{job.stderr}")
    proc = subprocess.CompletedProcess(job.cmd, job.returncode, job.stdout, job.stderr)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(job.cmd)}\n--- stdout\n{proc.stdout}"
                             f"\n--- stderr\n{proc.stderr}")
    return proc
