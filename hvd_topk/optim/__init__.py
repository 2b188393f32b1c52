"""Adam for Top-K with error feedback: ``LocalAdamW`` (use this), ``DeMo`` and ``FrozenVarianceAdamW``
(one module each: ``local_adamw``, ``demo``, ``frozen_variance``; what they share, ``_common``).

Why Adam needs care: error feedback sends each entry's gradient late, in bursts, but in full.
With SGD (plain or with momentum) the update is linear in the gradient, so a late burst moves
the parameter as far as the steps it stands for would have. Adam's update ``m / sqrt(v)`` is
not: a burst of ten steps' gradient enlarges ``v`` by its square and is normalised away, and
the steps with nothing sent shrink ``v``, so Top-K before AdamW trains worse than dense and
error feedback buys little (measurements: docs/adamw.md).

``LocalAdamW`` moves Adam before the exchange: each rank runs it on its own full gradient and
Top-K with error feedback compresses the resulting update, which is summed linearly, as error
feedback needs. Its ``beta1`` defaults to 0 (the residual already holds each entry's unsent
past; a momentum on top delays updates once more, which cost quality). By default it normalises
by an estimate of the ranks' *average* gradient's variance (not its own batch's, which holds P
times the noise) and keeps the learning rate inside the residual: over 1000 steps of the GPT
example that took it from +11.5% to +3.0% of dense AdamW at 1% (docs/adamw.md).

``FrozenVarianceAdamW`` follows 1-bit Adam (Tang et al., 2021): AdamW whose second moment is
frozen after a dense warm-up, so that the update is a fixed per-entry scaling of the momentum,
compressed with DGC's momentum correction. It closes the gap on short runs but stalls on long
ones, and refreshing its variance from the ranks' own variances did not help, so the stall is
not the frozen variance alone (docs/adamw.md).

    inner = hvd_topk.LocalAdamW(params, lr=3e-3, betas=(0.0, 0.95), weight_decay=0.1)
    opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopK(density=0.01),
                                        warmup_steps=100, warmup_density=1.0)  # a dense start

FrozenVarianceAdamW tuning: freeze while the exchanges are still (nearly) dense: the variance
must be estimated from them, and freezing it from sparse ones leaves entries never seen with a
zero variance (a warning says so; without a dense start it diverged). Freeze a little before the
dense start ends (docs/adamw.md has the measured settings). Before ``freeze_step`` it is
``torch.optim.AdamW``, except that a parameter's first gradient, if all zeros, is taken for
``hvd.broadcast_optimizer_state``'s probe: that step makes its state and counts nothing (AdamW
would count it and apply the weight decay), so its bias correction runs one step behind.
"""

from hvd_topk.optim._common import momentum_in_residual, residual_decay_of
from hvd_topk.optim.demo import DeMo
from hvd_topk.optim.frozen_variance import FrozenVarianceAdamW
from hvd_topk.optim.local_adamw import LocalAdamW

__all__ = ["LocalAdamW", "DeMo", "FrozenVarianceAdamW", "momentum_in_residual", "residual_decay_of"]
