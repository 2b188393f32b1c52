"""Top-k selection by magnitude: which k entries of a flat tensor to send.

Methods (``TopK(method=...)``):

- ``"sampled"`` (default): a threshold estimated from a sample, then one pass collecting the
  entries at or above it, trimmed to exactly k. If the estimate was too high (rare) the missing
  entries are the lowest positions not collected, so k distinct real entries always go out.
- ``"exact"``: the same index set as ``torch.topk`` on tie-free data (a too-high threshold
  costs a second pass instead).

Where it runs:

- CPU, float32/float64: the native kernel (``hvd_topk.native``), ~one pass over memory; with
  error feedback the same pass also folds the gradient into the residual.
- Elsewhere (CUDA, half precision, no compiler): torch ops with no host synchronisation.
  ``sampled`` then takes a fixed number of candidates with ``torch.nonzero_static``; if too few
  entries reach the threshold, the missing slots repeat a selected index with value 0 (adding
  0 changes nothing; the index is already sent).
"""

import ctypes
import math

import torch

from hvd_topk import native

METHODS = ("sampled", "exact")
DEFAULT_METHOD = "sampled"

SAMPLE = 65536        # entries the torch-ops path samples to estimate the threshold
SMALL = 2 * SAMPLE    # at or below this size there is nothing to gain: exact selection


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


_NATIVE_FUNCS = {torch.float32: "hvdtk_select_f32", torch.float64: "hvdtk_select_f64"}


def native_ok(tensor):
    """Whether the native kernel can work on this tensor (CPU, fp32/fp64, contiguous)."""
    return (tensor.dtype in _NATIVE_FUNCS and tensor.device.type == "cpu" and tensor.is_contiguous()
            and native.library() is not None)


class NativeResult:
    """What one native call reports: non-finite input seen, passes made, entries filled up."""

    __slots__ = ("flags",)

    def __init__(self):
        self.flags = (ctypes.c_int64 * 3)()

    @property
    def nonfinite(self):
        return bool(self.flags[0])

    @property
    def passes(self):
        return int(self.flags[1])

    @property
    def filled(self):
        return int(self.flags[2])


def select_native(x, k, out_indices, out_values, method=DEFAULT_METHOD, add=None, offset=0,
                  zero_sent=False, seed=0):
    """Native top-k of ``x`` (flat, CPU fp32/fp64) into preallocated outputs, in one call.

    ``out_indices`` (int32 or int64, k entries) gets ascending positions plus ``offset``;
    ``out_values`` (x's dtype) their values. ``add``: fold ``x += add`` into the same pass and
    zero ``add``. ``zero_sent``: zero ``x`` at the selected positions afterwards. Returns a
    ``NativeResult``. The caller checks ``native_ok`` first.
    """
    check_method(method)
    result = NativeResult()
    fn = getattr(native.library(), _NATIVE_FUNCS[x.dtype])
    fn(x.data_ptr(), add.data_ptr() if add is not None else None, x.numel(), k, offset,
       out_indices.data_ptr(), out_indices.element_size(), out_values.data_ptr(),
       int(method == "exact"), int(zero_sent), seed, result.flags)
    return result


def select_exact_torch(flat, k):
    """The k entries of largest |value| (the same index set as ``torch.topk`` on tie-free data)."""
    _, indices = torch.topk(flat.abs(), k, sorted=False)
    return flat[indices], indices


_generators = {}


def _positions(n, device):
    """Fresh random sample positions on every call, drawn on the tensor's device (no host
    sync) from hvd_topk's own generator (the user's RNG stream is left alone). A fixed set of
    positions could keep missing a structured gradient's large values step after step, as the
    native kernel once did."""
    key = str(device)
    gen = _generators.get(key)
    if gen is None:
        gen = _generators[key] = torch.Generator(device=device).manual_seed(0x5EED)
    return torch.randint(n, (SAMPLE,), generator=gen, device=device)


def threshold_rank(n, k, sample=SAMPLE):
    """Rank (from the top) in the sample whose value leaves about k entries plus a margin of
    four standard deviations above it; None when the margin covers the whole sample."""
    expect = k * sample / n
    r = expect + 4.0 * math.sqrt(expect) + 8.0
    return None if r >= sample else int(r)


def select_sampled_torch(flat, k):
    """Sampled top-k with torch ops only: no host synchronisation, fixed-size results."""
    n = flat.numel()
    r = threshold_rank(n, k) if n > SMALL else None
    if r is None:
        return select_exact_torch(flat, k)
    magnitude = flat.abs().nan_to_num_(nan=math.inf)  # NaN counts as largest, as in torch.topk
    sample = magnitude[_positions(n, flat.device)]
    threshold = torch.kthvalue(sample, SAMPLE - r).values  # the r-th largest (1-based)
    capacity = min(n, int(1.5 * r * n / SAMPLE) + 16)  # expected count x 1.5
    candidates = torch.nonzero_static(magnitude >= threshold, size=capacity, fill_value=-1).view(-1)
    valid = candidates >= 0
    candidates = candidates.clamp_(min=0)
    keys = torch.where(valid, magnitude[candidates], -1.0)
    best, chosen = torch.topk(keys, k, sorted=True)
    indices = candidates[chosen]
    real = best >= 0
    indices = torch.where(real, indices, indices[:1])  # short: repeat the largest, value 0
    values = torch.where(real, flat[indices], torch.zeros((), dtype=flat.dtype, device=flat.device))
    return values, indices


def select(flat, k, method=DEFAULT_METHOD):
    """``(values, indices)`` of the k largest |flat| (indices int64; ``flat`` is not changed)."""
    check_method(method)
    if k >= flat.numel():
        indices = torch.arange(flat.numel(), device=flat.device)
        return flat.clone(), indices
    if native_ok(flat):
        flat = flat.contiguous()
        indices = torch.empty(k, dtype=torch.int64)
        values = torch.empty(k, dtype=flat.dtype)
        select_native(flat, k, indices, values, method)
        return values, indices
    if method == "exact":
        return select_exact_torch(flat, k)
    return select_sampled_torch(flat, k)
