"""Residuals under loss scaling (``torch.amp.GradScaler``): kept in the current scale's units.

With loss scaling every gradient, and so every residual, is multiplied by the scale of the
step that produced it. The scaler halves the scale after an overflow and doubles it every
``growth_interval`` steps; a residual carried across such a change would be added back at the
wrong scale. So when the scale has changed, the residuals (and DGC's momentum) are multiplied
by new / old: exact for the scaler's powers of two, and a pass over memory only on the rare
steps that change it.
"""


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
