"""``FrozenVarianceAdamW``: AdamW whose second moment is frozen after a dense warm-up (1-bit
Adam's scheme), compressed with DGC's momentum correction. Kept for comparison: it stalls on long
runs (docs/adamw.md); ``LocalAdamW`` is the recipe."""

import warnings

import torch

from hvd_topk._stack import outside_level
from hvd_topk.checks import check_integer
from hvd_topk.optim._common import (_CheckedGroups, _adam_denominator, _evaluate, _new_adam_state,
                                    _check_adam_options)


class FrozenVarianceAdamW(_CheckedGroups):
    """AdamW (decoupled weight decay, bias-corrected moments) whose ``exp_avg_sq`` and its bias
    correction are frozen after ``freeze_step`` steps of each parameter.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW``. With
            ``hvd_topk.DistributedOptimizer(..., momentum_correction=beta)`` pass
            ``betas=(0.0, beta2)``: the momentum is then kept before compression, not here.
        freeze_step: the last step whose gradient updates the variance (a param-group option,
            so ``hvd.broadcast_optimizer_state`` and checkpoints carry it). 0 never freezes.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, freeze_step=0):
        # (defaults for every argument: Horovod's optimizer wrappers re-run __init__ with params only)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=freeze_step)
        self._check_options(defaults)
        super().__init__(params, defaults)
        self._warned = False

    @staticmethod
    def _check_options(options):
        _check_adam_options(options)
        check_integer(options["freeze_step"], "freeze_step", 0)


    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        unseen = total = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, freeze = group["lr"], group["eps"], group["freeze_step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FrozenVarianceAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    _new_adam_state(state, p)
                    state["bias_correction2"] = 1.0  # a float: exact, and kept as is by load_state_dict
                    if not p.grad.any():
                        # hvd.broadcast_optimizer_state's probe step on a rank without state (a
                        # checkpoint loaded on rank 0 alone): make the state, leave p alone (its
                        # weight decay would part this rank's weights from rank 0's); a real first
                        # gradient of zeros would only have decayed p
                        continue
                if "bias_correction2" not in state:  # torch AdamW's state: its variance took every step
                    state["bias_correction2"] = 1 - beta2 ** max(int(state["step"]), 1)
                state["step"] += 1
                step = int(state["step"])
                p.mul_(1 - lr * group["weight_decay"])
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(p.grad, 1 - beta1)
                if not freeze or step <= freeze:
                    exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    state["bias_correction2"] = 1 - beta2 ** step
                    if step == freeze:
                        unseen += int((exp_avg_sq == 0).sum())
                        total += exp_avg_sq.numel()
                denom = _adam_denominator(exp_avg_sq, state["bias_correction2"], eps)
                p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
        if total and unseen > total // 2 and not self._warned:
            self._warned = True
            warnings.warn(f"FrozenVarianceAdamW froze its variance with {unseen:,} of {total:,} entries "
                          "never having seen a gradient: they will take steps of lr * momentum / eps. "
                          "Freeze after a dense warm-up (DistributedOptimizer(..., warmup_steps=N, "
                          "warmup_density=1.0) with freeze_step=N).", stacklevel=outside_level())
        return loss
