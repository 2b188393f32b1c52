"""Where and when a result was made: one dictionary recorded next to every benchmark result.

``machine_info()`` is the one helper the benchmarks use (it replaces three near-copies that
lived in benchmarks/). Keys (always present; a value is ``None`` where it could not be found):

    cpu, cores, threads_per_core, mem_gib, os, kernel, hostname, python, torch, horovod, mpi,
    git, hvd_topk_file, loadavg, date_utc

``git`` is the short commit of the repository holding this module (``+dirty`` when tracked
files differ from it); ``hvd_topk_file`` says which ``hvd_topk`` this process imports, which
matters when a benchmark measures an older checkout through ``PYTHONPATH``. ``loadavg`` is the
1/5/15-minute load average when the function ran (the project's machines are shared).

``summary(info)`` renders the dictionary as one line for Markdown reports.

``thread_cpu_ns()`` and ``cpu_split()`` say how much CPU time a timed region took on the calling
thread and on the process's other threads (with Horovod, its background thread): on a host
where ranks and their background threads outnumber the cores, that is where wall time goes.
"""

import datetime
import os
import platform
import subprocess
import threading
from pathlib import Path

KEYS = ("cpu", "cores", "threads_per_core", "mem_gib", "os", "kernel", "hostname", "python",
        "torch", "horovod", "mpi", "git", "hvd_topk_file", "loadavg", "date_utc")


def _output(cmd, cwd=None):
    """stdout of ``cmd`` (a list), or None when it cannot run or fails."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def parse_lscpu(text):
    """``{"cpu": model name, "threads_per_core": int}`` from ``lscpu`` output (missing -> None)."""
    out = {"cpu": None, "threads_per_core": None}
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "Model name" and out["cpu"] is None:
            out["cpu"] = value
        elif key == "Thread(s) per core":
            try:
                out["threads_per_core"] = int(value)
            except ValueError:
                pass
    return out


def parse_meminfo(text):
    """Total memory in GiB (one decimal) from /proc/meminfo's ``MemTotal:`` line, or None."""
    for line in (text or "").splitlines():
        parts = line.split()
        if parts[:1] == ["MemTotal:"] and len(parts) >= 2 and parts[1].isdigit():
            return round(int(parts[1]) / 2**20, 1)
    return None


def git_commit(path):
    """Short commit of the git work tree holding ``path`` plus ``+dirty`` when tracked files
    differ from it; None outside a work tree or without git."""
    path = Path(path)
    cwd = path if path.is_dir() else path.parent
    rev = _output(["git", "rev-parse", "--short", "HEAD"], cwd=cwd)
    if not rev:
        return None
    dirty = _output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd)
    return rev.strip() + ("+dirty" if dirty and dirty.strip() else "")


def _version(module):
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:  # noqa: BLE001 - informational only
        return None


def machine_info(repo=None):
    """CPU, cores, memory, OS, library versions, git commit, load and date (UTC), as a dict with
    exactly the keys in ``KEYS``. ``repo``: the work tree whose commit to record (default: the
    one holding this file)."""
    lscpu = parse_lscpu(_output(["lscpu"]))
    cpu = lscpu["cpu"] or platform.processor() or platform.machine() or None
    try:
        mem = parse_meminfo(Path("/proc/meminfo").read_text())
    except OSError:
        mem = None
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    mpi = _output(["mpirun", "--version"])
    try:
        import importlib.util
        spec = importlib.util.find_spec("hvd_topk")
        hvd_topk_file = spec.origin if spec else None
    except (ImportError, ValueError):
        hvd_topk_file = None
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads_per_core": lscpu["threads_per_core"],
        "mem_gib": mem,
        "os": platform.platform(),
        "kernel": platform.release(),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch_version,
        "horovod": _version("horovod"),
        "mpi": mpi.splitlines()[0].strip() if mpi and mpi.strip() else None,
        "git": git_commit(repo if repo is not None else Path(__file__).resolve().parent),
        "hvd_topk_file": hvd_topk_file,
        "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    assert tuple(info) == KEYS
    return info


def summary(info):
    """One line: ``CPU, N cores, M GiB; OS; Python, torch, horovod, MPI; git; load``."""
    get = info.get
    parts = [f"{get('cpu') or get('Model name') or '?'}, {get('cores', '?')} cores"
             + (f", {get('mem_gib')} GiB" if get("mem_gib") else ""),
             get("os") or get("kernel") or "?",
             f"Python {get('python', '?')}, torch {get('torch') or '?'}, horovod {get('horovod') or '?'}"
             + (f", {get('mpi')}" if get("mpi") else ""),
             f"git {get('git') or '?'}"]
    load = get("loadavg") or get("loadavg_at_start")
    if load:
        parts.append(f"load average {load}")
    return "; ".join(parts)


def main_thread_id():
    """The calling thread's id as the kernel knows it (the key of ``thread_cpu_ns``)."""
    return threading.get_native_id()


def thread_cpu_ns(task_dir="/proc/self/task"):
    """``{thread id: CPU nanoseconds so far}`` for this process's threads, from Linux's
    ``schedstat`` (its first field); {} where there is no such file (not Linux)."""
    out = {}
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "schedstat")) as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return out


def cpu_split(before, after, main):
    """``(main thread, other threads)`` CPU seconds between two ``thread_cpu_ns`` readings;
    threads that started or ended in between are left out of the other threads."""
    other = sum(after[t] - before[t] for t in after if t in before and t != main)
    return (after.get(main, 0) - before.get(main, 0)) / 1e9, other / 1e9
