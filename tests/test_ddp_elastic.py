"""torch.distributed.elastic restarts with the DDP hook: a worker of a 2-process torchrun job
(``--max-restarts 1``) dies before step 4; torchelastic restarts both workers, which load the
last checkpoint (model, optimizer and each rank's TopKState) and finish. The truth is the same
job run without the crash: the final parameters must be equal bit for bit (tests/dist/
ddp_elastic_train.py saves after every step; a residual not restored would change them)."""

import pytest
import torch

from mpi import DIST, launch_mpi

pytestmark = pytest.mark.distributed


def train(out, *extra):
    out.mkdir()
    job = launch_mpi(2, DIST / "ddp_elastic_train.py", out, *extra, launcher="torchrun",
                     torchrun_options=("--max-restarts", "1"))
    assert job.returncode == 0, job.problem() or job.tail()
    return job.stdout, torch.load(out / "final.pt")


def test_a_crashed_worker_restarts_from_the_checkpoint_bitwise(tmp_path):
    log, crashed = train(tmp_path / "crashed", "--crash-at", "4")
    assert "crashing before step 4" in log and "attempt 0: 2 ranks, starting at step 0" in log, log
    assert "attempt 1: 2 ranks, starting at step 4" in log, log  # restarted, and resumed
    _, whole = train(tmp_path / "whole")
    assert len(crashed) == len(whole)
    for i, (a, b) in enumerate(zip(crashed, whole)):
        assert torch.equal(a, b), f"parameter {i}: max difference {float((a - b).abs().max())}"
