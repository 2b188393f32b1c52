"""Density warm-up: DGC's exponential schedule from a high density down to the target."""

import warnings

from hvd_topk._stack import outside_level
from hvd_topk.checks import check_density, check_integer


DEFAULT_START = 0.25  # warmup_density's default (DGC's first epoch)


class DensitySchedule:
    """``density(step)``: ``start * (target / start) ** (step / warmup_steps)`` while warming up.

    DGC (Lin et al., 2018) sends more of the gradient in the first epochs, when it changes
    fastest, and tightens exponentially (25% -> 6.25% -> 1.5625% -> ... per epoch). Here the
    same curve is spread evenly over ``warmup_steps`` optimizer steps; ``warmup_steps=0`` means
    the target density from the first step.
    """

    def __init__(self, target, warmup_steps=0, start=DEFAULT_START):
        self.target = check_density(target)
        self.warmup_steps = check_integer(warmup_steps, "warmup_steps", 0)
        start = check_density(start, "warmup_density")
        if not self.warmup_steps and start != DEFAULT_START:
            warnings.warn(f"warmup_density={start!r} has no effect without warmup_steps: the density is "
                          f"{self.target!r} from the first step (a dense start is warmup_steps=N, "
                          "warmup_density=1.0)", stacklevel=outside_level())
        elif self.warmup_steps and start <= self.target:
            warnings.warn(f"warmup_density={start!r} is not above the density {self.target!r}: the warm-up over "
                          f"{self.warmup_steps} steps does nothing (a dense start is warmup_density=1.0)",
                          stacklevel=outside_level())
        self.start = max(start, self.target)

    def density(self, step):
        if step >= self.warmup_steps:
            return self.target
        return self.start * (self.target / self.start) ** (step / self.warmup_steps)
