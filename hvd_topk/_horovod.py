"""Everything hvd_topk needs from Horovod beyond its documented API, in one place.

Checked against Horovod 0.28.1 (``CHECKED_VERSION``). Each private detail relied on:

1. ``caller_context`` (one walk up the calling frames serves 1, 2 and 7): reads the parameter
   name from the calling frames of
   ``horovod.torch.optimizer._DistributedOptimizer._allreduce_grad_async(self, p)`` /
   ``_grouped_allreduce_grad_async`` (locals ``self._parameter_names`` and ``p``), or the
   ``name`` argument of ``horovod.torch.mpi_ops.allreduce(_async)``. Horovod's compressor
   interface passes no name, and its ``synchronize()`` starts hook-less parameters in ``set``
   order, which differs between ranks. If the frames change, hvd_topk falls back to call-order
   names, counts it (``count_name_fallback``, ``name_fallbacks``) and warns once.
2. ``OPTIMIZER_MODULE``: ``hvd.broadcast_optimizer_state`` initialises a fresh optimizer's
   state by calling the *inner* ``step()`` only when the optimizer's class lives in Horovod's
   optimizer module; hvd_topk's wrapper class claims that module so no exchange runs there.
   ``caller_context`` reads, from the same frames, the process set the tensor is reduced
   over (``self.process_set`` of Horovod's optimizer, or the ``process_set`` argument of
   ``allreduce``, ``grouped_allreduce`` and their async forms), so that the drop-in exchanges
   its pairs among the same ranks.
3. ``is_horovod_distributed_optimizer``: recognises an optimizer already wrapped by
   ``hvd.DistributedOptimizer`` by its ``_handles`` and ``_compression`` attributes.
4. ``ALLREDUCE_AS``: dtypes Horovod's torch ``allreduce`` lacks ("Tensor type
   torch.BFloat16Tensor is not supported." on the CPU build), with the dtype hvd_topk
   allreduces them in instead (``allreduce_dtype``).
5. ``hvd.broadcast_optimizer_state`` broadcasts every option of every param group from the
   root (how the learning rate reaches the other ranks), but nothing at all for an optimizer
   without state; hvd_topk keeps its step counter there (``hvd_topk.engine.TopKEngine.step``).
6. ``elastic_mode``: ``horovodrun`` sets ``HOROVOD_ELASTIC=1`` in elastic workers (Horovod's own
   optimizer reads it the same way to decide on its hooks).
7. ``caller_context``, from the same frames: which Horovod function compresses the tensor
   (``allreduce``, ``grouped_allreduce``, ``reducescatter``, their async forms, by function name)
   and its ``op`` argument, or Horovod's optimizer's ``self.op``; so that the drop-in refuses a
   reduce-scatter or an op other than Average and Sum with a clear error instead of a failed
   probe check.
8. ``instance_name``: Horovod 0.28.1 gives a removed process set's id to the next set added,
   maybe over other ranks (checked: add ``[0]``, remove it, add ``[1]``: both get id 1), so
   instances are numbered per set id *and* ranks.
9. ``caller_context``, from the same frames: Horovod's optimizer's ``self._synchronized``, True
   from the end of its ``synchronize()`` until ``step()`` returns, and whether the compressing
   call came from that optimizer's own ``synchronize()`` (``_in_synchronize``). Both together:
   the gradient was already exchanged this step: ``step()`` without ``skip_synchronize()`` after
   ``synchronize()`` runs ``synchronize()`` again (Horovod only warns: a second dense average
   changes nothing), and so does a second ``synchronize()``; the drop-in passes such a
   gradient through instead of sending the average through Top-K again. The flag alone is not
   enough: it outlives a step ``GradScaler`` skipped (``opt.step()`` never called), and the next
   step's backward hooks compress fresh gradients while it is still set.
"""

import collections
import copy
import itertools
import os
import sys
import threading
import warnings
from typing import NamedTuple, Optional

import torch

CHECKED_VERSION = "0.28.1"

INSTALL_HINT = (
    "hvd_topk needs Horovod (0.28.1) built with PyTorch support. From a clone of hvd_topk run\n"
    "    bash docker/install.sh\n"
    "which installs OpenMPI and builds Horovod with PyTorch, MPI and Gloo into ./.venv.\n"
    "By hand: apt-get install libopenmpi-dev openmpi-bin cmake g++, install torch first, then\n"
    "    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \\\n"
    "    pip install --no-build-isolation horovod==0.28.1\n"
    "(with PyTorch >= 2.1 the compiler must use -std=c++17: Horovod 0.28.1 asks for -std=c++14;\n"
    "see docs/install.md#installing-into-an-existing-environment for a g++ wrapper that fixes it)."
)


try:
    import horovod.torch as hvd
except ImportError as _exc:  # also covers a Horovod built without PyTorch
    raise ImportError(f"importing horovod.torch failed ({_exc}).\n{INSTALL_HINT}") from None

# (2) the module whose optimizers hvd.broadcast_optimizer_state steps with the inner step(): it
# compares with ``horovod.torch.optimizer.DistributedOptimizer.__module__``, read here from that
# module, not from ``hvd.DistributedOptimizer``, which a job may have replaced by
# hvd_topk.DistributedOptimizer before hvd_topk's first use (the fresh ranks then ran a whole
# exchange inside the broadcast, alone, and the job hung).
from horovod.torch import optimizer as _horovod_optimizer  # noqa: E402

OPTIMIZER_MODULE = _horovod_optimizer.DistributedOptimizer.__module__


def version_warning(version):
    """The warning for a Horovod other than ``CHECKED_VERSION`` (None for that one): the private
    details above were checked against it, and some would fail silently if they changed."""
    if version == CHECKED_VERSION:
        return None
    return (f"hvd_topk was checked with Horovod {CHECKED_VERSION}; this is Horovod {version}. It relies on "
            "details of Horovod's internals (listed in hvd_topk/_horovod.py: the parameter names read from "
            "Horovod's frames, the optimizer module broadcast_optimizer_state tests, the wrapped optimizer's "
            "attributes, the reduction op, the synchronized flag) that may differ in this version; run "
            "`make test` here before trusting a run.")


_version_warning = version_warning(getattr(sys.modules.get("horovod"), "__version__", "?"))
if _version_warning:
    warnings.warn(_version_warning, stacklevel=2)


# (4) dtype -> the dtype its dense allreduce runs in: float32 holds every bfloat16 exactly and
# sums in more precision than bfloat16 would.
ALLREDUCE_AS = {torch.bfloat16: torch.float32}


def allreduce_dtype(dtype):
    """The dtype in which Horovod can allreduce a tensor of ``dtype`` (``dtype`` itself if it can)."""
    return ALLREDUCE_AS.get(dtype, dtype)


def elastic_mode():
    """(6) True in a worker of an elastic job (``horovodrun --min-np/--max-np/--host-discovery-script``)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def unshared_for_elastic(state_dict):
    """The optimizer state to load, copied in an elastic job: ``TorchState.restore()`` (0.28.1)
    hands in its commit itself, torch's ``load_state_dict`` keeps tensors whose dtype and device
    fit, and training then changed the commit in place (a second failure before the next commit
    brought back the model of the commit with the momentum and Adam moments of later steps)."""
    return copy.deepcopy(state_dict) if elastic_mode() else state_dict


def is_horovod_distributed_optimizer(optimizer):
    """(3) True for an optimizer already wrapped by ``hvd.DistributedOptimizer``."""
    return hasattr(optimizer, "_handles") and hasattr(optimizer, "_compression")


_fallbacks = {"count": 0, "warned": False}
_fallback_lock = threading.Lock()


# Horovod's functions that call a compressor (for the tensor's name, the single-tensor ones; a
# grouped call's ``name`` names the group, and its i-th tensor is named ``<name>.<i>`` here)
_ALLREDUCES = ("allreduce", "allreduce_async")
_GROUPED_ALLREDUCE = "grouped_allreduce"
_COMPRESSING_CALLS = (*_ALLREDUCES, "grouped_allreduce", "grouped_allreduce_async", "reducescatter",
                      "grouped_reducescatter")


class CallerContext(NamedTuple):
    """What the calling frames say about the tensor being compressed (``caller_context``)."""
    name: Optional[str]  # (1) the name Horovod gave it, or None
    process_set: object  # (2) the process set it is reduced over
    call: Optional[str]  # (7) the Horovod function compressing it ("optimizer" for Horovod's optimizer)
    op: object  # (7) that function's ``op`` (None: its default, Average, or the frames do not say)
    exchanged: bool = False  # (9) Horovod's optimizer already exchanged this gradient this step


def caller_context(max_depth=6, tensor=None):
    """(1, 2, 7) Name, process set and reduction of ``tensor``, being compressed, read in one walk
    over up to ``max_depth`` frames above the compressor's caller (frame 2 from here is
    ``compress``'s caller).

    - The name: Horovod's optimizer (``self._parameter_names`` and the parameter ``p``),
      ``hvd.allreduce(..., name=...)``, or ``hvd.grouped_allreduce(tensors, name=...)``'s name
      and ``tensor``'s place among ``tensors``; None when none is found (the caller then names
      the tensor by call order and calls ``count_name_fallback``).
    - The process set: Horovod's optimizer's ``self.process_set`` or the ``process_set`` argument
      of the compressing call; the global set when the frames do not say.
    - The reduction: ``("optimizer", self.op)``, ``(call, op)`` for the compressing call, or
      ``(None, None)``.
    - Whether the gradient was already exchanged this step (9): Horovod's optimizer's
      ``self._synchronized``.
    Each is taken from the first frame that has it, as separate walks would.
    """
    name = process_set = reduction = None
    exchanged = False
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None or (name is not None and process_set is not None and reduction is not None):
            break
        call, local = frame.f_code.co_name, frame.f_locals
        owner = local.get("self")
        # Horovod's optimizer (not a user's object that happens to keep a _parameter_names dict)
        if isinstance(getattr(owner, "_parameter_names", None), dict) and is_horovod_distributed_optimizer(owner):
            param = local.get("p")
            if name is None and param is not None and param in owner._parameter_names:
                name = str(owner._parameter_names[param])
            if process_set is None and hasattr(owner, "process_set"):
                process_set = owner.process_set
            if reduction is None and hasattr(owner, "op"):
                reduction = ("optimizer", owner.op)
                # only a synchronize() after the step's own exchange sends it again: the flag
                # alone outlives a step that GradScaler skipped (opt.step() not called), and the
                # next step's backward hooks would have passed every gradient through unexchanged
                exchanged = getattr(owner, "_synchronized", False) is True and _in_synchronize(frame, owner)
        if name is None and call in _ALLREDUCES and isinstance(local.get("name"), str):
            name = local["name"]
        if name is None and call == _GROUPED_ALLREDUCE and isinstance(local.get("name"), str):
            place = next((i for i, t in enumerate(local.get("tensors") or ()) if t is tensor), None)
            if place is not None:
                name = f"{local['name']}.{place}"
        if call in _COMPRESSING_CALLS:
            if process_set is None and "process_set" in local:
                process_set = local["process_set"]
            if reduction is None and "op" in local:
                reduction = (call, local["op"])
        frame = frame.f_back
    return CallerContext(name, hvd.global_process_set if process_set is None else process_set,
                         *(reduction or (None, None)), exchanged)


def _in_synchronize(frame, owner, depth=3):
    """(9) Whether ``frame`` (in Horovod's optimizer ``owner``) was called from ``owner``'s own
    ``synchronize()``, within ``depth`` frames: Horovod 0.28.1 sends a gradient again there
    (``missing_p``) when ``step()`` runs without ``skip_synchronize()`` after ``synchronize()``."""
    for _ in range(depth):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code.co_name == "synchronize" and frame.f_locals.get("self") is owner:
            return True
    return False


def count_name_fallback():
    """(1) Count a tensor named by call order because the frames gave no name; warn the first time."""
    with _fallback_lock:
        _fallbacks["count"] += 1
        warn = not _fallbacks["warned"]
        _fallbacks["warned"] = True
    if warn:
        warnings.warn("hvd_topk.TopK found no name for a tensor: hvd.allreduce(...) called without name=, or "
                      "a Horovod whose internals differ (this is "
                      f"{getattr(sys.modules.get('horovod'), '__version__', '?')}, checked with "
                      f"{CHECKED_VERSION}); naming its allgather by call order instead. That is "
                      "right as long as every rank compresses its tensors in the same order "
                      "(pass hvd.allreduce(..., name=...) to be safe).")


def name_fallbacks():
    """How many tensors were named by call order because no Horovod name was found."""
    return _fallbacks["count"]


# (8) per kind of instance and process set (id and ranks): how many this process has numbered
_instances = collections.defaultdict(itertools.count)
_instances_lock = threading.Lock()


def set_key(process_set):
    """(8) What tells process sets apart: the id *and* the ranks (an id alone may be reused)."""
    return process_set.process_set_id, tuple(process_set.ranks or ())


def instance_name(kind, process_set):
    """(8) ``hvd_topk.<kind>.<set id>.<n>``, the prefix of a new instance's collectives over
    ``process_set``: ``n`` counts the ``kind`` instances this process numbered over that set
    before it. Ranks may build instances over sets the others do not use (a rank outside a set,
    a rank's own evaluation); the names agree on every rank of a set as long as its ranks number
    their instances over it in the same order, as the same training code does."""
    key = (kind, *set_key(process_set))
    with _instances_lock:
        number = next(_instances[key])
    return f"hvd_topk.{kind}.{process_set.process_set_id}.{number}"
