"""hvd_topk: Top-K gradient compression for PyTorch, under Horovod or as a DDP communication hook.

- ``hvd_topk.TopK``: a Horovod ``Compressor``; ``hvd.DistributedOptimizer(opt,
  compression=hvd_topk.TopK)`` exchanges only the top 1% of each gradient (no error feedback).
- ``hvd_topk.DistributedOptimizer``: same signature as ``hvd.DistributedOptimizer``, with error
  feedback, fused packed exchange, a dense path where sparse does not pay, checkpointable state
  and ``compression_stats()``.
- ``hvd_topk.LocalSteps``: each rank steps alone (plain AdamW) and every ``sync_every`` steps
  the model change goes through Top-K with error feedback (DiLoCo / SparseLoCo).
- ``hvd_topk.LocalAdamW``: the inner optimizer for Top-K with Adam: Adam runs on each rank's
  own gradient and its update is what gets compressed (``hvd_topk.optim``, limits documented);
  ``hvd_topk.DeMo``: DeMo's decoupled momentum (the residual is the momentum, the sent average
  normalised after the exchange); ``hvd_topk.FrozenVarianceAdamW``: 1-bit Adam's frozen variance,
  good over short runs only.
- ``hvd_topk.init()``: ``hvd.init()`` plus the host and cross-host process sets that the
  hierarchical exchange needs (``hierarchical=`` of the optimizer).
- ``hvd_topk.ddp``: the same compression as a PyTorch DDP communication hook for ``torchrun``
  users (``TopKState``, ``register``; no Horovod needed; ``LocalAdamW`` and ``DeMo`` work there).
"""

import importlib as _importlib
import importlib.util as _importlib_util

__version__ = "0.1.0"
__all__ = ["TopK", "DistributedOptimizer", "LocalSteps", "LocalAdamW", "DeMo", "FrozenVarianceAdamW", "init", "__version__"]

# Imported on first use, so that ``hvd_topk.ddp`` (torch.distributed only) works without Horovod;
# the Horovod names raise ``hvd_topk._horovod``'s ImportError, with install steps, when it is missing.
_LAZY = {"TopK": "hvd_topk.compressor", "init": "hvd_topk.hierarchy", "DistributedOptimizer": "hvd_topk.optimizer",
         "LocalSteps": "hvd_topk.local_steps",
         "LocalAdamW": "hvd_topk.optim", "DeMo": "hvd_topk.optim", "FrozenVarianceAdamW": "hvd_topk.optim"}
_NO_HOROVOD = "importing horovod.torch failed"  # hvd_topk._horovod's message


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:  # a submodule (hvd_topk.exchange, ...), as an eager package would have it
        try:
            return _importlib.import_module(f"hvd_topk.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"hvd_topk.{name}":
                raise
            raise AttributeError(f"module 'hvd_topk' has no attribute {name!r}") from None
    try:
        value = getattr(_importlib.import_module(module), name)
    except ImportError as exc:
        if not str(exc).startswith(_NO_HOROVOD):
            raise
        raise ImportError(str(exc)) from None  # the install steps, not importlib's frames
    globals()[name] = value
    return value


def __dir__():
    # without Horovod its names stay out: help(hvd_topk) and inspect.getmembers would meet their ImportError;
    # the inner optimizers (hvd_topk.optim, DDP's optimizer=) need none
    lazy = _LAZY if _importlib_util.find_spec("horovod") is not None else \
        [n for n, module in _LAZY.items() if module == "hvd_topk.optim"]
    return sorted([n for n in [*globals(), *lazy] if not n.startswith("_") or n.startswith("__")])
