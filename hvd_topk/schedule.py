"""Density warm-up: DGC's exponential schedule from a high density down to the target."""

from hvd_topk.selection import check_density, check_integer


class DensitySchedule:
    """``density(step)``: ``start * (target / start) ** (step / warmup_steps)`` while warming up.

    DGC (Lin et al., 2018) sends more of the gradient in the first epochs, when it changes
    fastest, and tightens exponentially (25% -> 6.25% -> 1.5625% -> ... per epoch). Here the
    same curve is spread evenly over ``warmup_steps`` optimizer steps; ``warmup_steps=0`` means
    the target density from the first step.
    """

    def __init__(self, target, warmup_steps=0, start=0.25):
        self.target = check_density(target)
        self.warmup_steps = check_integer(warmup_steps, "warmup_steps", 0)
        self.start = max(check_density(start, "warmup_density"), self.target)

    def density(self, step):
        if step >= self.warmup_steps:
            return self.target
        return self.start * (self.target / self.start) ** (step / self.warmup_steps)
