"""Shared set-up for scripts run under mpirun: Horovod + mpi4py, named checks reported one by one.

A script ends with ``run(CHECKS)``, ``CHECKS`` an ordered list of ``(name, function)``. Every rank
runs every check; a check that raises fails on that rank without stopping the others. After each
check the ranks agree (mpi4py, on a communicator of the harness's own, never a Horovod
collective) on which ranks failed, and rank 0 prints one result line for it (the format is in
tests/support/results.py). The job exits 1 when a check failed anywhere.

A rank that fails part-way through a collective can leave the other ranks waiting in it for
ever: when not every rank has finished a check ``HVD_TOPK_CHECK_SYNC_TIMEOUT`` seconds (60)
after one rank did, that rank aborts the job (the failing check is already reported by name on
the failing rank; the checks not run yet are reported missing by tests/test_distributed.py).

``python SCRIPT --list`` prints the check names, one a line, without starting MPI or Horovod.

Launched by ``horovodrun --gloo`` on emulated hosts (tests/support/mpi.py's
``launch_gloo_hosts``: ``HVD_TOPK_HARNESS_STORE`` names a tcp:// address) there is no MPI job:
the harness's messages then go over a torch.distributed gloo group of its own, ranked as Horovod
ranks the processes (``HOROVOD_RANK`` / ``HOROVOD_SIZE``, set by horovodrun).
"""

import datetime
import os
import sys
import time

import numpy as np

import horovod.torch as hvd
from check_runner import HARNESS_STORE, listed, run_checks, say as _say
from expect import raises  # noqa: F401  (the checks import it from here)

# MPI.COMM_WORLD, set by run(): importing mpi4py.MPI starts MPI, which --list must not do.
COMM = None


def _check_device():
    """Where the checks that ask for it put their models and inputs: ``HVD_TOPK_CHECK_DEVICE``
    (``cpu`` unless set; ``cuda``: every rank on ``cuda:LOCAL_RANK % device count``, the local
    rank as mpirun or horovodrun set it). Horovod built without NCCL moves CUDA tensors through
    the host (its ``*CudaOnCPU`` operations), so several ranks can share one GPU."""
    import torch

    device = torch.device(os.environ.get("HVD_TOPK_CHECK_DEVICE", "cpu"))
    if device.type == "cuda":
        local = next((int(os.environ[k]) for k in ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
                      if k in os.environ), 0)
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


DEVICE = _check_device()
SYNC_TIMEOUT_S = float(os.environ.get("HVD_TOPK_CHECK_SYNC_TIMEOUT", "60"))


def run(checks, argv=None, init=None):
    """Run every ``(name, function)`` in ``checks`` on every rank (see the module docstring).
    ``init``: what starts Horovod (``hvd.init``; e.g. ``hvd_topk.init``)."""
    checks = list(checks)
    if listed(checks, sys.argv[1:] if argv is None else list(argv)):
        return

    global COMM
    store = os.environ.get(HARNESS_STORE)
    if store:
        COMM = control = TorchComm(store, int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"]))
    else:
        from mpi4py import MPI  # initialise MPI before Horovod so both share it

        COMM = MPI.COMM_WORLD
        control = COMM.Dup()  # the harness's messages never pair with a check's own mpi4py calls
    (init or hvd.init)()
    rank = hvd.rank()
    failed = run_checks(checks, rank, hvd.size(), lambda name: _wait_for_all_ranks(control, name, rank),
                        control.allgather)
    control.Free()
    if failed:
        sys.exit(1)


class TorchComm:
    """What the harness and the checks use of an mpi4py communicator (``allgather``, ``bcast``,
    ``Ibarrier``, ``Abort``, ``Free``), over a torch.distributed gloo group: for jobs that
    horovodrun --gloo starts, which have no MPI world."""

    def __init__(self, address, rank, size):
        import torch.distributed as dist

        self.dist = dist
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=max(SYNC_TIMEOUT_S, 60)))
        self.size = size

    def allgather(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    def bcast(self, obj, root=0):
        box = [obj]
        self.dist.broadcast_object_list(box, src=root)
        return box[0]

    def Ibarrier(self):
        work = self.dist.barrier(async_op=True)
        return type("Request", (), {"Test": lambda _: work.is_completed()})()

    def Abort(self, code):
        os._exit(code)  # horovodrun then ends the other ranks ("Terminating remaining workers")

    def Free(self):
        self.dist.destroy_process_group()


def _wait_for_all_ranks(control, name, rank):
    """Return once every rank has finished check ``name``; abort the job if that takes too long."""
    request = control.Ibarrier()
    deadline = time.monotonic() + SYNC_TIMEOUT_S
    while not request.Test():
        if time.monotonic() > deadline:
            _say(f"[rank {rank}] check {name!r}: finished here, but not on every rank after "
                 f"{SYNC_TIMEOUT_S:g}s (a rank stuck in a collective after another failed?); "
                 f"aborting the job", sys.stderr)
            sys.stdout.flush()
            COMM.Abort(1)
        time.sleep(0.005)


def gather(array):
    """Every rank's numpy array, in rank order, on every rank."""
    return COMM.allgather(np.asarray(array))


def assert_same_on_all_ranks(array, what):
    arrays = gather(array)
    for r, other in enumerate(arrays):
        if not np.array_equal(other, arrays[0]):
            raise AssertionError(f"{what}: rank {r} differs from rank 0 "
                                 f"(max |diff| {np.max(np.abs(other - arrays[0]))})")


def step_and_check_same(opt, model, label):
    """``step()`` after an explicit ``synchronize()``; parameters must be bitwise equal on all ranks."""
    with opt.skip_synchronize():
        opt.step()
    for name, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().cpu().numpy(), f"{label}: parameter {name}")


def train(model, opt, steps, batch, start=0):
    """Plain training steps ``start`` .. ``start + steps - 1`` on this rank's ``batch(step, rank)``:
    zero_grad, cross-entropy backward, ``opt.step()``."""
    import torch.nn.functional as F
    for step in range(start, start + steps):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def check_unnamed_allreduce_between_backward_and_step(build, steps=4, wait_s=30.0):
    """An unnamed ``hvd.allreduce`` between ``backward()`` and ``step()`` (as many Horovod scripts
    average their loss) with the ranks out of step: rank 1 pauses inside backward on even steps,
    rank 0 after it on odd ones. Horovod names an unnamed collective by how many collectives the
    process has started (``allreduce.noname.<n>``), so the ranks' calls meet only if hvd_topk
    has started as many of its own on each by then, whatever the timing. The allreduce must come
    back within ``wait_s`` (a mismatch stalls Horovod for good) with the mean of the ranks'
    losses, and the parameters must stay equal. ``build(model)``: the optimizer under test. Run it
    where every rank has started as many collectives as the others (not after an ``hvd.join()``
    that ranks reached after different numbers of steps: Horovod's own names differ then)."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).to(DEVICE)
    opt = build(model)
    gen = torch.Generator().manual_seed(5 + hvd.rank())
    for step in range(steps):
        hidden = model[:3](torch.randn(8, 64, generator=gen).to(DEVICE))
        if hvd.rank() == 1 and step % 2 == 0:
            hidden.register_hook(lambda g: time.sleep(0.2))  # after the last three layers' gradients
        loss = model[3:](hidden).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if hvd.rank() == 0 and step % 2 == 1:
            time.sleep(0.2)
        handle = hvd.allreduce_async(loss.detach())
        deadline = time.monotonic() + wait_s
        while not hvd.poll(handle):
            if time.monotonic() > deadline:
                raise AssertionError(f"step {step}: an unnamed hvd.allreduce between backward() and step() did not "
                                     f"come back in {wait_s:.0f} s (the ranks gave it different names)")
            time.sleep(0.01)
        mean = float(hvd.synchronize(handle))
        want = float(np.mean(gather(float(loss.detach()))))
        assert abs(mean - want) <= 1e-6 * abs(want), f"step {step}: unnamed allreduce gave {mean}, the mean is {want}"
        opt.step()
        for name, p in model.named_parameters():
            assert_same_on_all_ranks(p.detach().cpu().numpy(), f"step {step}: parameter {name}")


def raw_gradients(shadow, model, x, y, scale=1.0):
    """Plain cross-entropy gradients (of the loss times ``scale``) at ``model``'s current
    parameters, computed on ``shadow`` (a deep copy with no optimizer attached): what the numpy
    references are fed."""
    import torch.nn.functional as F
    shadow.load_state_dict(model.state_dict())
    shadow.zero_grad()
    (F.cross_entropy(shadow(x), y) * scale).backward()
    return {n: p.grad.cpu().numpy().copy() for n, p in shadow.named_parameters()}


def raw_then_synchronize(shadow, model, opt, x, y, scale=1.0):
    """One step's plain gradients (``raw_gradients``), then the same batch through ``model``
    and ``opt`` up to ``synchronize()``: the raw gradients, for a reference to compare with."""
    import torch.nn.functional as F
    raw = raw_gradients(shadow, model, x, y, scale)
    opt.zero_grad()
    (F.cross_entropy(model(x), y) * scale).backward()
    opt.synchronize()
    return raw
