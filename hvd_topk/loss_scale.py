"""Residuals under loss scaling (``torch.amp.GradScaler``): kept in the current scale's units.

With loss scaling every gradient, and so every residual, is multiplied by the scale of the
step that produced it. The scaler halves the scale after an overflow and doubles it every
``growth_interval`` steps; a residual carried across such a change would be added back at the
wrong scale. So when the scale has changed, the residuals (and DGC's momentum) are multiplied
by new / old: exact for the scaler's powers of two, and a pass over memory only on the rare
steps that change it. A checkpoint says which scale its residuals are in, so a run resumed with
another set-up (a scaler, or none) converts them (``adopt``).
"""

import torch

from hvd_topk.checks import is_number


def check_grad_scaler(grad_scaler, optimizer=None):
    """``grad_scaler=``: None or a ``torch.amp.GradScaler``; refused with an inner optimizer that
    turns each rank's gradient into an update before the exchange (``transform_local_gradient``:
    LocalAdamW, DeMo), whose moments would mix loss scales and absorb overflowed steps."""
    if grad_scaler is None:
        return
    if not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
    if optimizer is not None and hasattr(optimizer, "transform_local_gradient"):
        raise ValueError(f"{type(optimizer).__name__} turns each rank's gradient into an update before the "
                         "exchange and does not support loss scaling (grad_scaler): its state would mix "
                         "loss scales and absorb overflowed steps. Use bf16 autocast, which needs no scaler "
                         "(fp16 with a GradScaler leaves only Adam behind Top-K, which trains clearly worse: "
                         "docs/adamw.md).")


def is_loss_scale(value):
    """A checkpoint's ``residual_scale``: None (true units) or a finite number > 0."""
    return value is None or (is_number(value) and 0 < value < float("inf"))


class ResidualScale:
    """The loss scale the residuals are expressed in (``scale``, saved with the checkpoint)."""

    def __init__(self, scaler):
        self.scaler = scaler  # the torch.amp.GradScaler, or None
        self.scale = None

    def follow(self, buckets):
        """Once per step, before anything is folded: rescale ``buckets``' residuals if the
        scaler's scale changed since the last step."""
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled():
            return
        scale = float(scaler.get_scale())  # on CUDA one host sync per step
        old, self.scale = self.scale, scale
        if old is not None and scale != old:
            for b in buckets:
                b.rescale(scale / old)

    def adopt(self, saved, buckets):
        """After a checkpoint's residuals were put into ``buckets``: ``saved`` is the scale they
        were kept in (None: true units, saved without a scaler). With a scaler the next step's
        ``follow`` brings them to its scale; without one they are divided back to true units
        now. So a run may resume with or without the scaler it saved with."""
        saved = None if saved is None else float(saved)
        if self.scaler is not None and self.scaler.is_enabled():
            self.scale = 1.0 if saved is None else saved
            return
        self.scale = None
        if saved is not None and saved != 1.0:
            for b in buckets:
                b.rescale(1.0 / saved)
