"""hvd_topk/_horovod.py (what hvd_topk needs from Horovod), single process: the message when
Horovod is missing, the dtype bf16 is allreduced in."""

import subprocess
import sys

import torch


def test_missing_horovod_gives_install_instructions():
    """``import hvd_topk`` works without Horovod (``hvd_topk.ddp`` needs only torch.distributed);
    the first Horovod name used raises the install steps."""
    code = ("import sys; sys.modules['horovod'] = None; sys.modules['horovod.torch'] = None\n"
            "import hvd_topk, hvd_topk.optim, hvd_topk.ddp  # the DDP hook needs no Horovod\n"
            "hvd_topk.DistributedOptimizer\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()
    assert any(line.startswith("ImportError: importing horovod.torch failed") for line in last), proc.stderr
    assert "docker/install.sh" in proc.stderr
    # a short message, not a deep traceback
    assert proc.stderr.count('File "') <= 3, proc.stderr


def test_bf16_allreduced_as_float32():
    from hvd_topk._horovod import allreduce_dtype

    assert allreduce_dtype(torch.bfloat16) == torch.float32
    assert allreduce_dtype(torch.float16) == torch.float16 and allreduce_dtype(torch.float32) == torch.float32
