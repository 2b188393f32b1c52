"""Run a script under ``mpirun -np N`` with a hard timeout, for the distributed tests."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
DIST = TESTS / "dist"
TIMEOUT_S = int(os.environ.get("HVD_TOPK_MPI_TIMEOUT", "240"))


def mpirun_command(np, script, *args):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise RuntimeError("mpirun not found: run `bash docker/install.sh` (installs OpenMPI)")
    cmd = [mpirun, "-np", str(np), "--oversubscribe", "--bind-to", "none",
           "--mca", "btl_vader_single_copy_mechanism", "none",
           "-x", "OMP_NUM_THREADS=1", "-x", "PYTHONPATH"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + [sys.executable, str(script), *map(str, args)]


def run_mpi(np, script, *args, timeout=TIMEOUT_S, expect_ok=True):
    """Run and return the completed process; a hang is killed after ``timeout`` seconds.

    With ``expect_ok`` a non-zero exit (any rank failing makes mpirun fail) raises
    AssertionError carrying the output.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS.parent), str(TESTS), env.get("PYTHONPATH")]))
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    cmd = mpirun_command(np, script, *args)
    # A session of its own, so that a hang is ended with every rank mpirun started.
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            raise AssertionError(f"timed out after {timeout}s (a hang?): {' '.join(cmd)}\n"
                                 f"--- stdout\n{stdout}\n--- stderr\n{stderr}") from None
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n--- stdout\n{proc.stdout}"
                             f"\n--- stderr\n{proc.stderr}")
    return proc
