"""Top-k selection by magnitude: which k entries of a flat tensor to send.

Every kernel returns ``(values, indices)``: the signed values and their positions in the flat
tensor, indices unique. Device-agnostic torch ops, no host synchronisation.
"""

import torch

METHODS = ("exact",)


def k_for(numel, density):
    """The contract: k = max(1, round(density * n)) (0 for an empty tensor)."""
    if numel == 0:
        return 0
    return min(numel, max(1, int(round(density * numel))))


def check_density(density, name="density"):
    """Return density as a float, or raise ValueError naming the bad value."""
    try:
        value = float(density)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in (0, 1], got {density!r}") from None
    if not 0.0 < value <= 1.0:  # also rejects nan
        raise ValueError(f"{name} must be in (0, 1], got {density!r}")
    return value


def check_method(method):
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def select_exact(flat, k):
    """The k entries of largest |value| (the same index set as ``torch.topk`` on tie-free data)."""
    _, indices = torch.topk(flat.abs(), k, sorted=False)
    return flat[indices], indices


def select(flat, k, method="exact"):
    if method == "exact":
        return select_exact(flat, k)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
