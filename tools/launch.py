"""The ``mpirun`` and ``torchrun`` command lines every local multi-rank job uses (tests, benchmarks).

One place for the flags this project needs on one machine: ``--oversubscribe`` (more ranks
than cores), ``--bind-to none`` (ranks sharing cores must not be pinned to the same one), no
single-copy mechanism in OpenMPI's shared-memory transport (it needs ptrace rights containers
often lack), one OpenMP thread per rank, and ``--allow-run-as-root`` when running as root.
"""

import os
import shutil
import sys


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
