"""The README's "Without Horovod: torchrun + DDP" file runs as written under
``torchrun --nproc_per_node 2``: it trains, ``exchange="auto"`` ends on one of its families,
and the bytes it reports lie between the hand count of a step sent sparse (1% of each of the
two weight matrices and of the first bias, 1024 elements, not below ``min_numel``, as 8-byte
pairs; the last bias, 10 elements, dense) and a dense fp32 step's: the trial ran dense steps,
so the run's average is above the sparse count (check_ddp.py checks the counts step by step)."""

import re

import pytest

from mpi import launch_mpi
from readme import readme_python_block

pytestmark = pytest.mark.distributed


def torchrun(script, cwd):
    """The job, finished or killed with every worker after 240 s (a hang fails with its output)."""
    job = launch_mpi(2, script, launcher="torchrun", timeout=240, cwd=cwd)
    assert not job.timed_out, job.problem() + "\n" + job.tail()
    return job


def aborted_at_exit(proc):
    """torch 2.13 + gloo: a process that trained through DDP sometimes aborts while the
    interpreter shuts down, after the script finished ("terminate called without an active
    exception"; 2 of 16 runs of the same script without the hook, 2026-11-25)."""
    return "terminate called without an active exception" in proc.stderr and "bytes sent vs dense" in proc.stdout


def test_readme_ddp_lines_run_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_python_block("Without Horovod: torchrun + DDP"))
    proc = torchrun(script, tmp_path)
    if proc.returncode != 0 and aborted_at_exit(proc):
        proc = torchrun(script, tmp_path)  # once more: the abort is torch's, at shutdown, and rare
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    got = re.search(r"exchange: (\w+); bytes sent vs dense fp32: ([0-9.]+)%", proc.stdout)
    assert got, proc.stdout
    assert got.group(1) in ("dense", "dense_fp16", "allgather", "sparse_allreduce"), got.group(0)
    k = round(0.01 * 256 * 1024) + round(0.01 * 1024) + round(0.01 * 1024 * 10)  # k = round(density n) per tensor
    dense_params = 256 * 1024 + 1024 + 1024 * 10 + 10
    sparse_step = (8 * k + 4 * 10) / (4 * dense_params)
    assert sparse_step < float(got.group(2)) / 100 < 1.0, (got.group(0), sparse_step)
