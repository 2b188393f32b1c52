"""``DeMo``: decoupled momentum (Peng et al. 2024): a decayed per-rank accumulator holding
lr x gradient is the residual, Top-K sends its largest entries, and the ranks' average is
normalised after the exchange (sign or RMS), so every rank applies the same update."""


import torch

from hvd_topk.checks import check_number
from hvd_topk.optim._common import _ExchangedUpdates, _group_of, _check_nonnegative


class DeMo(_ExchangedUpdates):
    """DeMo's decoupled momentum (Peng et al., 2024) on hvd_topk's error feedback: each rank keeps
    a decayed accumulator of ``lr x gradient`` (the engine's residual), Top-K sends its largest
    entries and subtracts them, and every rank applies the *normalised* average of what was sent.

    One step, per rank: ``acc = beta * acc + lr * g`` (the residual, decayed by the engine with
    ``residual_decay = beta``); send the top-k of ``acc``; ``acc -= sent``; then on every rank
    ``p *= 1 - lr * weight_decay`` and ``p -= lr * normalise(average of the sent parts)``. The
    momentum is what stays in the accumulator: it never crosses the wire, so Adam-like
    non-linearity (the normalisation) comes after the exchange, where it is the same on every
    rank, and nothing normalises each rank's bursts apart (docs/adamw.md: why Adam needs care).

    Args:
        params, lr, weight_decay: as ``torch.optim.SGD`` with decoupled weight decay (AdamW's).
        beta (0.999): the accumulator's decay, handed to ``hvd_topk.DistributedOptimizer`` as its
            ``residual_decay`` (leave that at its default; a different value is refused).
        normalise ("sign"): ``"sign"``, each entry of the average moves by ``lr`` (sign descent,
            DeMo's choice; entries not sent this step stay); ``"rms"``, the average divided by
            its root mean square over the whole tensor (so the tensor's update has RMS ``lr``).

    Tuning: with sign descent only the sent entries move, by ``lr`` each; at density d they move
    about once in ``1/d`` steps, so ``lr`` is the step an entry takes when it finally moves, not
    AdamW's per-step rate. The small tensors that ``min_numel`` keeps dense have no residual and
    so no momentum (sign descent on their average gradient). Use it only as the inner optimizer
    of ``hvd_topk.DistributedOptimizer`` with error feedback. Measured on the GPT example:
    docs/adamw.md.
    """

    NORMALISE = ("sign", "rms")

    sum_invariant = True  # sign and RMS normalisation ignore a common factor

    def __init__(self, params, lr=1e-3, beta=0.999, weight_decay=0.0, normalise="sign"):
        if not 0.0 < check_number(beta, "beta") <= 1.0:
            raise ValueError(f"beta must be a number in (0, 1], got {beta!r}")
        defaults = dict(lr=lr, weight_decay=weight_decay, normalise=normalise)
        self._check_options(defaults)
        super().__init__(params, defaults)
        self.residual_decay = float(beta)  # read by hvd_topk.DistributedOptimizer
        self._transformed = set()

    @torch.no_grad()
    def transform_local_gradient(self, p, grad, ranks=1, finite=None):
        """``grad *= lr``: the accumulator holds lr-weighted gradients (an entry that waits is
        applied at the rates of the steps it stands for). No state, so inf/nan harms nothing
        here (``finite`` is ``LocalAdamW``'s argument, unused)."""
        grad.mul_(_group_of(self, p)["lr"])
        self._transformed.add(p)

    @classmethod
    def _check_options(cls, options):
        _check_nonnegative(lr=options["lr"], weight_decay=options["weight_decay"])
        if options["normalise"] not in cls.NORMALISE:
            raise ValueError(f"normalise must be one of {cls.NORMALISE}, got {options['normalise']!r}")

    def _init_state(self, p):
        """No per-parameter state: the momentum is the engine's residual."""

    def _apply(self, p, group):
        """``p -= lr * normalise(exchanged average)``: its sign, or it over its RMS (``step()``
        applies the weight decay first)."""
        lr = group["lr"]
        if group["normalise"] == "sign":
            p.add_(p.grad.sign(), alpha=-lr)
        else:
            rms = _rms(p.grad)
            if rms > 0.0:
                p.add_(p.grad, alpha=-lr / rms)


def _rms(grad):
    """The root mean square over every entry of ``grad`` (a sparse one's absent entries are
    zeros: ``nn.Embedding(sparse=True)``'s exchanged gradient is handed back sparse), in float32
    at least: DeMo's averaged update is lr x gradient, about 1e-6 to 1e-4, whose squares a
    16-bit float flushes to zero (the step was then skipped)."""
    def wide(t):
        return t if t.dtype.itemsize >= 4 else t.float()
    if grad.is_sparse:
        return float((wide(grad.coalesce().values()).square().sum() / grad.numel()).sqrt())
    return float(wide(grad).square().mean().sqrt())
