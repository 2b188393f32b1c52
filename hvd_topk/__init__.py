"""hvd_topk: Top-K gradient compression for Horovod + PyTorch.

- ``hvd_topk.TopK``: a Horovod ``Compressor``; ``hvd.DistributedOptimizer(opt,
  compression=hvd_topk.TopK)`` exchanges only the top 1% of each gradient (no error feedback).
- ``hvd_topk.DistributedOptimizer``: same signature as ``hvd.DistributedOptimizer``, with error
  feedback, fused packed exchange, a dense path where sparse does not pay, checkpointable state
  and ``compression_stats()``.
- ``hvd_topk.LocalAdamW``: the inner optimizer for Top-K with Adam: Adam runs on each rank's
  own gradient and its update is what gets compressed (``hvd_topk.optim``, limits documented);
  ``hvd_topk.DeMo``: DeMo's decoupled momentum (the residual is the momentum, the sent average
  normalised after the exchange); ``hvd_topk.FrozenVarianceAdamW``: 1-bit Adam's frozen variance,
  good over short runs only.
- ``hvd_topk.init()``: ``hvd.init()`` plus the host and cross-host process sets that the
  hierarchical exchange needs (``hierarchical=`` of the optimizer).
"""

import hvd_topk._horovod  # noqa: F401  a clear ImportError with install steps when Horovod is missing

from hvd_topk.compressor import TopK  # noqa: E402
from hvd_topk.hierarchy import init  # noqa: E402
from hvd_topk.optim import DeMo, FrozenVarianceAdamW, LocalAdamW  # noqa: E402
from hvd_topk.optimizer import DistributedOptimizer  # noqa: E402

__version__ = "0.1.0"
__all__ = ["TopK", "DistributedOptimizer", "LocalAdamW", "DeMo", "FrozenVarianceAdamW", "init", "__version__"]
