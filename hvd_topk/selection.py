"""Top-k selection by magnitude: which k entries of a flat tensor to send.

Methods (``TopK(method=...)``):

- ``"sampled"`` (default): a threshold estimated from a sample, then one pass collecting the
  entries at or above it, trimmed to exactly k. If the estimate was too high (rare) the missing
  entries are the lowest positions not collected, so k distinct real entries always go out.
- ``"exact"``: the same index set as ``torch.topk`` on tie-free data (a too-high threshold
  costs a second pass instead).

Where it runs:

- CPU, float32: the native kernel (``hvd_topk.native``), ~one pass over memory, one
  call per fusion bucket (``select_segments``).
- Elsewhere (CUDA, half precision, no compiler): torch ops with no host synchronisation.
  ``sampled`` then takes a fixed number of candidates with ``torch.nonzero_static``; if too few
  entries reach the threshold, the missing slots repeat a selected index with value 0 (adding
  0 changes nothing; the index is already sent).
"""

import ctypes
import itertools
import math

import torch

from hvd_topk import native
from hvd_topk.wire import RANKS_DISAGREE, index_dtype_for

METHODS = ("sampled", "exact")
DEFAULT_METHOD = "sampled"

SAMPLE = 65536        # entries the torch-ops path samples to estimate the threshold
SMALL = 2 * SAMPLE    # at or below this size there is nothing to gain: exact selection


def k_for(numel, density):
    """The contract: k = max(1, round(density * n)) (0 for an empty tensor)."""
    if numel == 0:
        return 0
    return min(numel, max(1, int(round(density * numel))))


def check_method(method):
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, one of {METHODS}, got {method!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


# float32 only: the kernel ranks by float32 keys, so float64 magnitudes outside float32's range,
# or apart by less than float32 resolves, would tie (a review found 0 of 100 right on
# randn * 1e-50); float64 takes the torch ops, end to end (the native decode expects the
# native selection's ascending pairs). The kernel has no float64 entry points since.
_NATIVE_FUNCS = {torch.float32: "hvdtk_select_f32"}


def _kernel_kind(dtype, device):
    """Whether the native kernel has entry points for tensors of this dtype on this device (CPU
    fp32; ``_NATIVE_FUNCS`` says why not fp64), their layout aside."""
    return dtype in _NATIVE_FUNCS and torch.device(device).type == "cpu"


def native_ok(tensor):
    """Whether the native kernel can work on this tensor (``_kernel_kind``, contiguous, the
    kernel loaded)."""
    return _kernel_kind(tensor.dtype, tensor.device) and tensor.is_contiguous() and native.library() is not None


NATIVE_IN_USE = ("the native CPU kernel (in use on some ranks only: their decode needs the ascending pairs only "
                 "the kernel's selection makes; install a C compiler on every host, or set HVD_TOPK_NATIVE=0 on "
                 "every rank)")


def native_in_use(buffers):
    """Whether any of ``buffers`` (the ``(dtype, device)`` of each buffer selection works on: a
    16-bit job's float32 residuals too) takes the native kernel here (``_kernel_kind``, the
    kernel loaded); every rank must agree (``NATIVE_IN_USE`` names the setting where they do
    not). A GPU job never loads it for this."""
    return any(_kernel_kind(dtype, device) for dtype, device in buffers) and native.library() is not None


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


def select_native(x, k, out_indices, out_values, method=DEFAULT_METHOD, offset=0, zero_sent=False,
                  seed=None, fold=None):
    """Native top-k of ``x`` (flat, CPU fp32) into preallocated outputs, in one call.

    ``out_indices`` (int32 or int64, k entries) gets ascending positions plus ``offset``;
    ``out_values`` (x's dtype) their values. ``zero_sent``: zero ``x`` at the selected
    positions afterwards. ``fold`` (a contiguous tensor like ``x``, or None): first
    ``x += fold`` (error feedback's fold), in the same pass over memory that selects.
    ``seed``: the sample's positions (``sample_seed``; None: fresh ones, ``fresh_seed``).
    Returns a ``NativeResult``. The caller checks ``native_ok`` first.
    """
    check_method(method)
    if fold is not None and (fold.dtype != x.dtype or fold.numel() != x.numel() or not fold.is_contiguous()
                             or fold.device != x.device):
        raise ValueError("fold must be a contiguous tensor of x's dtype, size and device")
    if out_indices.dtype == torch.int32 and index_dtype_for(offset + x.numel()) != torch.int32:
        raise ValueError(f"int32 indices cannot hold positions up to offset + n = {offset + x.numel()}: use int64")
    result = NativeResult()
    fn = native_select_function(x.dtype)
    fn(x.data_ptr(), None if fold is None else fold.data_ptr(), x.numel(), k, offset,
       out_indices.data_ptr(), out_indices.element_size(), out_values.data_ptr(),
       int(method == "exact"), int(zero_sent), fresh_seed() if seed is None else seed, result.flags)
    return result


def native_select_function(dtype):
    """The native kernel's single-buffer entry point for ``dtype`` (its arguments: see
    ``select_native``), for callers that prepare the arguments once and call it per step."""
    return getattr(native.library(), _NATIVE_FUNCS[dtype])


_FOLD_FUNCS = {torch.float32: "hvdtk_fold_f32"}


def native_fold_function(dtype):
    """The native fold for ``dtype``: ``fn(x pointer, g pointer, n)``, non-zero when a sum is
    inf/nan (for callers that prepare the pointers once and call it per step)."""
    return getattr(native.library(), _FOLD_FUNCS[dtype])


def fold_native(x, g):
    """``x += g`` (flat, CPU fp32, same dtype and size, contiguous) in one native pass;
    returns whether the result holds inf/nan. The caller checks ``native_ok`` for both."""
    if g.dtype != x.dtype or g.numel() != x.numel() or not g.is_contiguous():
        raise ValueError("g must be a contiguous tensor of x's dtype and size")
    return bool(native_fold_function(x.dtype)(x.data_ptr(), g.data_ptr(), x.numel()))


_TAKE_FUNCS = {torch.float32: "hvdtk_take_f32"}


def take_native(x, indices, out, zero=False):
    """``out = x[indices]``, then ``x[indices] = 0`` with ``zero``, in one native visit per
    position (flat CPU fp32 ``x`` and ``out`` of its dtype, int32/int64 ``indices``, all
    contiguous; the caller checks ``native_ok``). Positions outside ``x`` raise, as
    ``index_select`` does."""
    if out.dtype != x.dtype or out.numel() != indices.numel() or not (out.is_contiguous() and indices.is_contiguous()):
        raise ValueError("out must be a contiguous tensor of x's dtype with one entry per index")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be int32 or int64, got {indices.dtype}")
    outside = getattr(native.library(), _TAKE_FUNCS[x.dtype])(
        x.data_ptr(), x.numel(), indices.data_ptr(), indices.element_size(), indices.numel(),
        out.data_ptr(), int(zero))
    if outside:
        raise IndexError(f"{outside} of {indices.numel()} positions lie outside the {x.numel()} "
                         f"entries of the buffer: {RANKS_DISAGREE}")
    return out


_SEGMENT_FUNCS = {torch.float32: "hvdtk_select_segments_f32"}


def select_segments(x, bounds, ks, out_indices, out_values, method=DEFAULT_METHOD, zero_sent=False,
                    nonfinite=None, seed=None):
    """Native top-k of every segment of ``x`` (flat, CPU fp32) in one call.

    Segment ``s`` is ``x[bounds[s]:bounds[s+1]]``; its ``ks[s]`` largest-|value| entries are
    written, segment after segment, into ``out_indices`` (int32 or int64; positions in ``x``,
    ascending inside each segment) and ``out_values``. ``bounds`` and ``ks`` are CPU int64
    tensors (built once per bucket and density). ``zero_sent`` zeroes the sent entries of ``x``;
    ``nonfinite`` (uint8, one per segment) is set where a segment held inf/nan. Returns a
    ``NativeResult`` (``nonfinite``: any segment had inf/nan; passes and fill-ups summed).
    ``seed`` as in ``select_native`` (segment s samples with ``seed + s``).
    """
    check_method(method)
    result = NativeResult()
    fn = getattr(native.library(), _SEGMENT_FUNCS[x.dtype])
    fn(x.data_ptr(), ks.numel(), bounds.data_ptr(), ks.data_ptr(), out_indices.data_ptr(),
       out_indices.element_size(), out_values.data_ptr(), int(method == "exact"), int(zero_sent),
       fresh_seed() if seed is None else seed, result.flags,
       nonfinite.data_ptr() if nonfinite is not None else None)
    return result


def select_exact_torch(flat, k):
    """The k entries of largest |value| (the same index set as ``torch.topk`` on tie-free data)."""
    _, indices = torch.topk(flat.abs(), k, sorted=False)
    return flat[indices], indices


_generators = {}


def _generator(device, seed=None):
    """hvd_topk's own random generator on ``device`` (the user's RNG stream is left alone),
    restarted from ``seed`` when one is given."""
    key = str(device)
    gen = _generators.get(key)
    if gen is None:
        gen = _generators[key] = torch.Generator(device=device).manual_seed(0x5EED)
    if seed is not None:
        gen.manual_seed((0x5EED + seed) % 2 ** 63)
    return gen


def sample_seed(step, bucket_index):
    """The sampled selection's seed for one bucket at one step (both the native kernel and the
    torch ops): fresh positions every step, yet the same ones in a run resumed from a checkpoint
    (its step counter is saved), so that resume stays bitwise where the sample decides (a
    segment short of candidates takes the lowest positions not collected; on the torch ops
    also a segment over its candidate capacity)."""
    return step * 65_537 + bucket_index


_fresh_seeds = itertools.count(1)


def fresh_seed():
    """A new seed on every call, for a caller with no step counter (the drop-in ``TopK``,
    which keeps no state between steps): fresh sample positions each time."""
    return next(_fresh_seeds) * 0x9E3779B97F4A7C15 % 2 ** 64


def _positions(n, device, seed=None):
    """Random sample positions, drawn on the tensor's device (no host sync): fresh on every call,
    or from ``seed``. A fixed set of positions could keep missing a structured gradient's large
    values step after step, as the native kernel once did."""
    return torch.randint(n, (SAMPLE,), generator=_generator(device, seed), device=device)


def threshold_rank(n, k, sample=SAMPLE):
    """Rank (from the top) in the sample whose value leaves about k entries plus a margin of
    four standard deviations above it; None when the margin covers the whole sample."""
    expect = k * sample / n
    r = expect + 4.0 * math.sqrt(expect) + 8.0
    return None if r >= sample else int(r)


def candidate_capacity(n, r, sample):
    """Room for the entries at or above the sample's r-th largest of n. Their count is about
    ``r * n / sample`` with a spread of ``sqrt(r) * n / sample`` (the r-th of ``sample`` uniform
    draws), so the room is the larger of 1.5x and six spreads above it. With 1.5x alone a small
    k (r about 8-15) overflowed in about one call in ten, and the candidates past the room, kept
    by position, were dropped: 4 calls in 60 missed the largest entry at k = 1 on 2M entries."""
    return min(n, int((r + max(0.5 * r, 6.0 * math.sqrt(r))) * n / sample) + 16)


def has_nonzero_static(device):
    """Whether ``torch.nonzero_static`` has a kernel for ``device``: CPU always, CUDA from
    torch 2.6 on (pytorch/pytorch#141838); the declared floor is 2.3."""
    return device.type == "cpu" or torch.__version__ >= "2.6"


def nonzero_static(mask, size):
    """The positions of the first ``size`` true entries of the 1-D ``mask``, in order, padded
    with -1 (``torch.nonzero_static(mask, size=size, fill_value=-1)`` flattened): a fixed size,
    so no host sync. Where that op has no kernel for the device (CUDA before torch 2.6),
    ``torch.nonzero`` cut or padded to ``size``, which reads the count on the host: one sync."""
    if has_nonzero_static(mask.device):
        return torch.nonzero_static(mask, size=size, fill_value=-1).view(-1)
    found = torch.nonzero(mask).view(-1)[:size]
    return torch.cat([found, found.new_full((size - found.numel(),), -1)])


def select_sampled_torch(flat, k, seed=None):
    """Sampled top-k with torch ops only: no host synchronisation, fixed-size results."""
    n = flat.numel()
    r = threshold_rank(n, k) if n > SMALL else None
    if r is None:
        return select_exact_torch(flat, k)
    magnitude = flat.abs().nan_to_num_(nan=math.inf, posinf=math.inf)  # NaN counts as largest, as in torch.topk
    sample = magnitude[_positions(n, flat.device, seed)]
    threshold = _above_zero(torch.kthvalue(sample, SAMPLE - r).values)  # the r-th largest (1-based)
    # Two tiers: the entries strictly above the threshold (their count is bounded as the room
    # assumes), then up to k equal to it. One room for ">=" let a cluster of equal magnitudes at
    # the threshold (fp16's few subnormal values, a saturated layer) fill it by position and
    # push out larger entries behind it: 0 of the true top 10,000 sent in a review's case.
    above = nonzero_static(magnitude > threshold, candidate_capacity(n, r, SAMPLE))
    ties = nonzero_static(magnitude == threshold, k)
    candidates = torch.cat([above, ties])
    valid = candidates >= 0
    candidates = candidates.clamp_(min=0)
    keys = torch.where(valid, magnitude[candidates], -1.0)
    best, chosen = torch.topk(keys, k, sorted=True)
    indices = candidates[chosen]
    real = best >= 0
    indices = torch.where(real, indices, indices[:1])  # short: repeat the largest, value 0
    values = torch.where(real, flat[indices], torch.zeros((), dtype=flat.dtype, device=flat.device))
    return values, indices


def _above_zero(threshold):
    """A sampled threshold of 0 raised to the smallest positive value of its dtype. A gradient
    that is mostly zeros (an embedding's, dead units') samples 0: every entry would then be a
    candidate, the fixed-size candidate list would keep the first ones by position (mostly
    zeros), and the non-zeros after them would not be sent. Zeros are worth nothing to send; a
    tensor with fewer non-zeros than k fills its slots as a short one does (value 0)."""
    finfo = torch.finfo(threshold.dtype)
    return threshold.clamp_min(finfo.tiny * finfo.eps)  # the smallest subnormal


class _SegmentConstants:
    """What ``select_segments_torch`` derives from a bucket's static ``sizes`` and ``ks``, on
    its device: computed once per bucket, not at every step. Building these from Python lists
    at each call cost one blocking host-to-device copy apiece (ten a call: the H100 profile of
    2026-11-27), and the autograd thread that runs a DDP hook waited at each."""

    def __init__(self, sizes, ks, device):
        nseg = len(sizes)
        starts = [0, *itertools.accumulate(sizes)]
        out_starts = [0, *itertools.accumulate(ks)]
        self.starts, self.total_k = starts, out_starts[-1]
        long = dict(dtype=torch.int64, device=device)
        self.start_t = torch.tensor(starts[:-1], **long)
        self.bounds = torch.tensor(starts[1:], **long)
        self.out_start = torch.tensor(out_starts, **long)
        self.k_t = torch.tensor([*ks, 0], **long)
        self.slot_seg = torch.repeat_interleave(torch.arange(nseg, device=device), self.k_t[:nseg],
                                                output_size=out_starts[-1])
        # sampled: ``per`` sample entries per segment; the sample rank that sets each segment's
        # threshold; candidate capacity. A segment whose capacity is all of it takes every entry.
        self.per = per = max(1024, SAMPLE // nseg)
        ranks, caps = [], []
        for n, k in zip(sizes, ks):
            r = threshold_rank(n, k, per) if n > 2 * per else None
            ranks.append(per if r is None else r)
            caps.append(n if r is None else candidate_capacity(n, r, per))
        self.capacity = sum(caps)
        # room for entries equal to a segment's threshold: up to k of each thresholded segment,
        # after every segment's entries strictly above (see select_sampled_torch)
        tie_room = sum(k for k, c, n in zip(ks, caps, sizes) if c != n)
        self.size_f64 = torch.tensor(sizes, dtype=torch.float64, device=device)
        self.last = (self.size_f64.long() - 1)[:, None]
        self.rank_index = torch.tensor(ranks, **long)[:, None] - 1
        # (segment, begin, end) of the segments compared against a threshold; the others are
        # taken whole
        self.thresholded = [(s, starts[s], starts[s + 1], ks[s]) for s, (c, n) in enumerate(zip(caps, sizes))
                            if c != n]
        self.candidate_rank = torch.arange(self.capacity + tie_room, **long)
        self.run_values = torch.arange(nseg + 2, **long)
        # exact: each selected index's segment start, added to topk's positions inside it
        self.offsets = self.start_t[self.slot_seg]


_segment_constants = {}


def segment_constants(sizes, ks, device):
    """The bucket's ``_SegmentConstants``, made on first use (the cache is emptied when it holds
    64 layouts, as after buckets were rebuilt many times)."""
    key = (tuple(sizes), tuple(ks), str(device))
    constants = _segment_constants.get(key)
    if constants is None:
        if len(_segment_constants) >= 64:
            _segment_constants.clear()
        constants = _segment_constants[key] = _SegmentConstants(sizes, ks, device)
    return constants


def select_segments_torch(x, sizes, ks, method=DEFAULT_METHOD, seed=None):
    """Top-k of every segment of ``x`` with torch ops: ``(values, indices, nonfinite)``.

    ``sizes``/``ks`` are Python lists (static per bucket): segment ``s`` holds the next
    ``sizes[s]`` entries and sends ``ks[s]`` of them. Outputs have ``sum(ks)`` entries, segment
    after segment (indices int64, positions in ``x``); ``nonfinite`` is a bool tensor, one per
    segment. No host synchronisation: ``sampled`` estimates every segment's threshold from one
    batched sample, collects a fixed number of candidates for the whole buffer, and ranks them
    inside their segments with two stable sorts, so a bucket costs one set of kernels plus one
    comparison per large tensor. A segment that gets fewer than k candidates (rare) repeats its
    largest entry with value 0 (adding 0 changes nothing). ``exact`` runs ``torch.topk`` per
    segment. ``seed``: draw the sample from it (``sample_seed``) rather than from where the
    generator stands.
    """
    check_method(method)
    device, nseg = x.device, len(sizes)
    if nseg == 1:
        values, indices = select(x, ks[0], method, seed)
        return values, indices, (~torch.isfinite(values)).any().view(1)
    c = segment_constants(sizes, ks, device)
    if method == "exact":
        indices = torch.cat([select_exact_torch(x[b:b + n], k)[1] for b, n, k in zip(c.starts, sizes, ks)])
        indices += c.offsets
        values = x[indices]
        return values, indices, _any_per_run(~torch.isfinite(values), c.out_start)
    magnitude = x.abs().nan_to_num_(nan=math.inf, posinf=math.inf)  # NaN counts as largest, as in torch.topk
    gen = _generator(device, seed)
    pos = (torch.rand(nseg, c.per, generator=gen, device=device, dtype=torch.float64) * c.size_f64[:, None]).long()
    pos = torch.minimum(pos, c.last) + c.start_t[:, None]
    ordered = magnitude[pos].sort(dim=1, descending=True).values
    threshold = _above_zero(ordered.gather(1, c.rank_index).view(-1)).unbind()
    # Candidates: every entry of a segment taken whole, the rest strictly above their threshold
    # (one comparison per such segment: cheaper on a GPU than spreading the thresholds over the
    # buffer, which cost ~4 ms at BERT-base's 110M entries on an H100), then each segment's own
    # room for entries equal to its threshold: with one shared room for ">=", a cluster of equal
    # magnitudes in one tensor took every slot and the tensors after it sent nothing, an inf or
    # NaN among them included (select_sampled_torch says more)
    mask = torch.ones(x.numel(), dtype=torch.bool, device=device)
    ties = []
    for s, b, e, k in c.thresholded:
        torch.gt(magnitude[b:e], threshold[s], out=mask[b:e])
        at = nonzero_static(magnitude[b:e] == threshold[s], k)
        ties.append(torch.where(at >= 0, at + b, at))
    cand = torch.cat([nonzero_static(mask, c.capacity), *ties])
    valid = cand >= 0
    cand = cand.clamp_(min=0)
    seg = torch.where(valid, torch.searchsorted(c.bounds, cand, right=True), nseg)
    key = torch.where(valid, magnitude[cand], -1.0)
    order = key.argsort(descending=True, stable=True)
    order = order[seg[order].argsort(stable=True)]  # by segment, largest first inside each
    cand, seg, key = cand[order], seg[order], key[order]
    # segment s's candidates are run [edges[s], edges[s + 1]) of the sorted list (s = nseg: the
    # unused slots); a binary search, not bincount, whose atomics on ~200 counters serialise
    edges = torch.searchsorted(seg, c.run_values)
    counts, run_start = edges[1:] - edges[:-1], edges[:-1]
    rank = c.candidate_rank - run_start[seg]
    keep = rank < c.k_t[seg]
    slot = torch.where(keep, c.out_start[seg] + rank, c.out_start[-1])  # dropped: one spare slot
    # Unfilled slots repeat their segment's largest candidate (rank 0) with value 0.
    first = run_start[:nseg].clamp(max=max(cand.numel() - 1, 0))
    has = counts[:nseg] > 0
    fallback = torch.where(has, cand[first], c.start_t)
    indices = torch.cat([fallback[c.slot_seg], fallback.new_zeros(1)])
    indices = indices.index_put_((slot,), cand)[:-1]
    filled = torch.zeros(c.total_k + 1, dtype=torch.bool, device=device).index_put_(
        (slot,), torch.ones_like(keep))[:-1]
    values = torch.where(filled, x[indices], torch.zeros((), dtype=x.dtype, device=device))
    # A segment holds inf or NaN when its largest candidate is inf (NaN's magnitude is inf here).
    bad = has & (key[first] == math.inf)
    return values, indices, bad


def _any_per_run(flags, run_starts):
    """Per run ``[run_starts[i], run_starts[i + 1])`` of ``flags``: whether any is set (one
    cumulative sum, not one reduction per run)."""
    total = torch.cat([flags.new_zeros(1, dtype=torch.int64), flags.cumsum(0)])
    return total[run_starts[1:]] > total[run_starts[:-1]]


def select(flat, k, method=DEFAULT_METHOD, seed=None):
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
    return select_sampled_torch(flat, k, seed)
