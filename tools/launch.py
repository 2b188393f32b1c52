"""The ``mpirun``, ``torchrun`` and ``horovodrun`` command lines every local multi-rank job uses
(tests, benchmarks).

One place for the flags this project needs on one machine: ``--oversubscribe`` (more ranks
than cores), ``--bind-to none`` (ranks sharing cores must not be pinned to the same one), no
single-copy mechanism in OpenMPI's shared-memory transport (it needs ptrace rights containers
often lack), one OpenMP thread per rank, and ``--allow-run-as-root`` when running as root.
"""

import os
import shutil
import sys
from pathlib import Path

# Spellings of 127.0.0.1 that every resolver accepts (inet_aton's short forms): to horovodrun
# each is another host, and each is local, so it starts the processes here without ssh.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "127.0.1", "127.1")


def mpirun_command(np, argv, *, env_names=("OMP_NUM_THREADS",), python=None, mca=()):
    """``mpirun -np NP ... PYTHON ARGV...`` as a list.

    Args:
        np: number of ranks.
        argv: the script and its arguments (``[script, arg, ...]``), run with ``python``
            (default: this interpreter).
        env_names: variables forwarded to every rank with ``-x`` (``OMP_NUM_THREADS`` is set to 1
            unless it is already set).
        mca: further OpenMPI parameters, ``(name, value)`` pairs, each passed as ``--mca name value``
            (e.g. ``("mpi_yield_when_idle", "1")``).

    Raises RuntimeError naming the fix when ``mpirun`` is not installed.
    """
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise ValueError(f"np must be an integer >= 1, got {np!r}")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise RuntimeError("mpirun not found: run `bash docker/install.sh` (installs OpenMPI)")
    cmd = [mpirun, "-np", str(np), "--oversubscribe", "--bind-to", "none",
           "--mca", "btl_vader_single_copy_mechanism", "none"]
    for name, value in mca:
        cmd += ["--mca", str(name), str(value)]
    for name in env_names:
        if name == "OMP_NUM_THREADS" and name not in os.environ:
            cmd += ["-x", "OMP_NUM_THREADS=1"]
        else:
            cmd += ["-x", name]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + [python or sys.executable, *map(str, argv)]


def torchrun_command(np, argv, *, python=None, options=()):
    """``python -m torch.distributed.run --standalone ... ARGV...`` as a list: ``np`` processes on
    this machine, a free rendezvous port of their own; ``options``: more of torchrun's own
    (e.g. ``("--max-restarts", "1")``).

    ``--local-addr 127.0.0.1``: without it torchrun hands the workers this machine's host name as
    the store's address, and where that name does not resolve (a container whose name is not in
    /etc/hosts, as in ``make image-test``) every worker retries it until the job is killed.
    """
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise ValueError(f"np must be an integer >= 1, got {np!r}")
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
            "--nproc_per_node", str(np), *map(str, options), *map(str, argv)]


def horovodrun_gloo_command(ranks_per_host, argv, *, python=None, timeout_s=120):
    """``horovodrun --gloo -np N -H localhost:A,127.0.0.1:B,... PYTHON ARGV...`` as a list: hosts
    emulated on this machine, ``ranks_per_host[i]`` ranks on host i (up to 4 hosts; unequal
    counts allowed).

    Every -H name is a spelling of 127.0.0.1 (``LOOPBACK_HOSTS``), so horovodrun starts all the
    processes here, but gives each host's its own ``HOROVOD_HOSTNAME``, local and cross ranks,
    as on separate machines: Horovod's gloo controller then sees that many hosts. The links are
    loopback (unshaped); for real hosts with their own network see tools/emulated_hosts.py.
    ``timeout_s``: horovodrun's start-up and gloo rendezvous timeouts (slow on shared cores).
    """
    counts = list(ranks_per_host)
    if not 1 <= len(counts) <= len(LOOPBACK_HOSTS) or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"ranks_per_host must be 1 to {len(LOOPBACK_HOSTS)} integers >= 1, got {ranks_per_host!r}")
    python = python or sys.executable
    horovodrun = Path(python).parent / "horovodrun"
    if not horovodrun.exists():
        horovodrun = shutil.which("horovodrun")
        if horovodrun is None:
            raise RuntimeError("horovodrun not found: run `make setup` (installs Horovod)")
    hosts = ",".join(f"{name}:{c}" for name, c in zip(LOOPBACK_HOSTS, counts))
    # --network-interface lo: gloo's traffic on loopback. Horovod 0.28.1's gloo still resolves
    # the machine's host name, which must therefore resolve (tests/test_host_shapes.py checks;
    # docker/build_and_test.sh gives its container one)
    return [str(horovodrun), "--gloo", "-np", str(sum(counts)), "-H", hosts, "--network-interface", "lo",
            "--start-timeout", str(timeout_s), "--gloo-timeout-seconds", str(timeout_s), python, *map(str, argv)]
