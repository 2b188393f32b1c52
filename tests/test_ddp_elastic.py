"""torch.distributed.elastic restarts with the DDP hook: a worker of a 2-process torchrun job
(``--max-restarts 1``) dies before step 4; torchelastic restarts both workers, which load the
last checkpoint (model, optimizer and each rank's TopKState) and finish. The truth is the same
job run without the crash: the final parameters must be equal bit for bit (tests/dist/
ddp_elastic_train.py saves after every step; a residual not restored would change them)."""

import subprocess

import pytest
import torch

from mpi import DIST, script_env
from tools.launch import torchrun_command

pytestmark = pytest.mark.distributed


def train(out, *extra):
    out.mkdir()
    cmd = torchrun_command(2, [DIST / "ddp_elastic_train.py", out, *extra], options=("--max-restarts", "1"))
    proc = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout, torch.load(out / "final.pt")


def test_a_crashed_worker_restarts_from_the_checkpoint_bitwise(tmp_path):
    log, crashed = train(tmp_path / "crashed", "--crash-at", "4")
    assert "crashing before step 4" in log and "attempt 0: 2 ranks, starting at step 0" in log, log
    assert "attempt 1: 2 ranks, starting at step 4" in log, log  # restarted, and resumed
    _, whole = train(tmp_path / "whole")
    assert len(crashed) == len(whole)
    for i, (a, b) in enumerate(zip(crashed, whole)):
        assert torch.equal(a, b), f"parameter {i}: max difference {float((a - b).abs().max())}"
