"""hvd_topk/_horovod.py (what hvd_topk needs from Horovod), single process: the message when
Horovod is missing, the dtype bf16 is allreduced in, how instances are numbered."""

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


def test_without_horovod_the_package_can_be_listed():
    """``dir``, ``inspect.getmembers`` and ``help`` on the package without Horovod (a DDP user's
    machine): its names are left out, where listing them made the tools meet their ImportError;
    the inner optimizers, which DDP's ``optimizer=`` takes and which need no Horovod, are listed."""
    code = ("import sys; sys.modules['horovod'] = None; sys.modules['horovod.torch'] = None\n"
            "import inspect, pydoc, hvd_topk\n"
            "names = [n for n, _ in inspect.getmembers(hvd_topk)]\n"
            "pydoc.render_doc(hvd_topk)\n"
            "print('TopK' in names, 'DistributedOptimizer' in names, 'LocalAdamW' in names, 'DeMo' in names)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "True", "True"], proc.stdout


def test_bf16_allreduced_as_float32():
    from hvd_topk._horovod import allreduce_dtype

    assert allreduce_dtype(torch.bfloat16) == torch.float32
    assert allreduce_dtype(torch.float16) == torch.float16 and allreduce_dtype(torch.float32) == torch.float32


def test_instance_names_count_per_kind_set_id_and_ranks():
    """(8) Each kind of instance is numbered per process set, its id *and* ranks (Horovod
    reuses a removed set's id for the next set added): hand-written expected names."""
    from types import SimpleNamespace

    from hvd_topk._horovod import instance_name

    first = SimpleNamespace(process_set_id=907, ranks=[0, 1])
    reused = SimpleNamespace(process_set_id=907, ranks=[1, 2])  # the same id over other ranks
    assert instance_name("opt", first) == "hvd_topk.opt.907.0"
    assert instance_name("opt", first) == "hvd_topk.opt.907.1"
    assert instance_name("TopK", first) == "hvd_topk.TopK.907.0"  # its own count
    assert instance_name("opt", reused) == "hvd_topk.opt.907.0"   # a new set: counted from 0
    assert instance_name("opt", first) == "hvd_topk.opt.907.2"


def test_wrapper_module_is_horovods_after_hvd_distributed_optimizer_is_replaced():
    """``hvd.DistributedOptimizer`` replaced, before hvd_topk's first use, by a function that
    calls hvd_topk's with settings of its own (a whole code base switched in one place, as
    tools/horovod_suite.py does): the wrapper class still claims the module
    ``hvd.broadcast_optimizer_state`` compares with, Horovod's own optimizer module. It took the
    replacement's (``__main__``), the fresh ranks ran a whole exchange inside the broadcast, and
    Horovod's test_broadcast_state hung."""
    code = ("import torch, horovod.torch as hvd, hvd_topk\n"
            "def DistributedOptimizer(optimizer, **kw):\n"
            "    return hvd_topk.DistributedOptimizer(optimizer, exchange='allgather', **kw)\n"
            "hvd.DistributedOptimizer = DistributedOptimizer\n"
            "hvd.init()\n"
            "model = torch.nn.Linear(4, 2)\n"
            "opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),\n"
            "                               named_parameters=model.named_parameters())\n"
            "from horovod.torch.optimizer import DistributedOptimizer  # what functions.py reads\n"
            "print(type(opt).__module__ == DistributedOptimizer.__module__ == 'horovod.torch.optimizer')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "True", proc.stdout


def test_another_horovod_version_is_warned():
    """Horovod's private details were checked with one version: another one is named in a warning
    (the checked version is silent; the installed one is the checked one here)."""
    from hvd_topk import _horovod
    assert _horovod.version_warning(_horovod.CHECKED_VERSION) is None
    said = _horovod.version_warning("0.29.0")
    assert "checked with Horovod 0.28.1" in said and "Horovod 0.29.0" in said and "make test" in said
    import horovod
    assert horovod.__version__ == _horovod.CHECKED_VERSION  # (docker/install.sh pins it)
