"""The Top-K codec, shared by the drop-in ``TopK`` and the error-feedback optimizer.

``encode``: select -> zero what was sent (error feedback) -> flag non-finite -> pack, from one
flat buffer (a gradient, or a fusion bucket's accumulator) into one message.
``decode``: unpack every rank's message -> add in rank order -> scale, into the destination
tensors. The native-or-torch-ops choice is made here and nowhere else:

- CPU fp32: the native kernel selects every segment of the buffer in one call, writing
  the pairs straight into the message (or one segment at a time, ``SegmentEncoder``, folding the
  gradient in during the same pass), and scatters the gathered pairs straight into the
  destination tensors in one call.
- Elsewhere (CUDA, half precision, no compiler): ``selection.select_segments_torch``, one set
  of kernels per buffer, and rank-ordered ``index_add_``.

Compensation (adding the residual) happens where the gradient is folded into the bucket
(``hvd_topk.buckets``); a drop-in gradient has nothing to compensate.
"""

import ctypes
import itertools
from typing import NamedTuple

import torch

from hvd_topk import native, selection
from hvd_topk.compact import CompactPairs, check_compact, value_format
from hvd_topk.selection import k_for, native_ok
from hvd_topk.wire import RANKS_DISAGREE, STEPS_DISAGREE, Layout


class Plan:
    """What one encode moves for a buffer at one density; built once and reused.

    Args:
        sizes: element counts of the buffer's tensors, in buffer order.
        density: fraction of entries to send.
        scope: ``"tensor"`` (k per tensor: the contract) or ``"bucket"`` (one top-k over the
            whole buffer, k = density x its size).
        value_dtype, index_dtype: what travels.
        parts: cut the buffer into this many parts (``shard_bounds``: Horovod's split, the
            first ``n mod parts`` one element longer), each selected on its own: with tensor
            scope the tensors are cut at the parts' edges and each piece sends k = density x
            its size; with bucket scope each part has its own top-k. The sparse allreduce cuts
            a bucket into one part per rank, each rank choosing one part's positions
            (``rotating_part``), so that every rank sends as many indices as any other.
        compact_values: the value format of ``compact()``'s pairs (``"log"`` or ``"sign"``,
            ``hvd_topk.compact``).
    """

    def __init__(self, sizes, density, scope, value_dtype, index_dtype, parts=1, compact_values="log"):
        numel = self.numel = sum(sizes)
        self.parts = parts
        if parts == 1:
            self.sizes = [numel] if scope == "bucket" else list(sizes)
            self.part_first = [0, len(self.sizes)]
        else:
            member_edges = [0, *itertools.accumulate(sizes)]
            self.sizes, self.part_first = [], []
            for lo, hi in itertools.pairwise(shard_bounds(numel, parts)):
                self.part_first.append(len(self.sizes))
                self.sizes += ([hi - lo] if hi > lo else []) if scope == "bucket" else segments_in(member_edges, lo, hi)
            self.part_first.append(len(self.sizes))
        self.ks = [k_for(n, density) for n in self.sizes]
        self.count = sum(self.ks)
        self.density, self.scope = density, scope
        self.layout = Layout(self.count, value_dtype, index_dtype)
        self.starts = [0, *itertools.accumulate(self.sizes)]  # segment s: [starts[s], starts[s+1])
        self.slots = [0, *itertools.accumulate(self.ks)]      # its pairs: message slots [slots[s], ...)
        # segments before s that select (k > 0 and not empty): each makes one pass or more
        self.selecting = [0, *itertools.accumulate(min(k, n) > 0 for k, n in zip(self.ks, self.sizes))]
        # tensor scope: member i's segments (one, or its pieces where part edges cut it)
        self.member_segments = _member_segments(sizes, self.starts) if scope == "tensor" else None
        self.bounds = torch.tensor(self.starts, dtype=torch.int64)
        self.ks_tensor = torch.tensor(self.ks, dtype=torch.int64)
        self.nonfinite = torch.zeros(len(self.sizes), dtype=torch.uint8)
        self.encoders = {}   # Codec.segment_encoder's, by buffer and message
        self._values = None  # scratch for values of another dtype than the message's
        self.compact_values = compact_values  # CompactPairs' value format
        self._compact = None  # CompactPairs, made on first use

    def compact(self):
        """This plan's ``hvd_topk.compact.CompactPairs`` (compact pairs), made once."""
        if self._compact is None:
            self._compact = CompactPairs(self, self.compact_values)
        return self._compact

    def part_segments(self, part):
        """The segments of part ``part``: a ``range`` of segment numbers."""
        return range(self.part_first[part], self.part_first[part + 1])

    def slots_by_rank(self, step, bucket_index):
        """``(first, end)`` message slots of the part each rank chooses (``rotating_part``),
        rank after rank: where each rank's gathered indices belong."""
        return [self.slot_range(self.part_segments(rotating_part(r, step, bucket_index, self.parts)))
                for r in range(self.parts)]

    def slot_range(self, segments=None):
        """``(first, end)`` message slots of a ``range`` of segments (None: all of them)."""
        if segments is None:
            return 0, self.slots[-1]
        return self.slots[segments.start], self.slots[segments.stop]

    def value_scratch(self, dtype, device="cpu"):
        """``count`` values of ``dtype`` on ``device`` (the native paths': the CPU), reused."""
        device = torch.device(device)
        if self._values is None or self._values.dtype != dtype or self._values.device != device:
            self._values = torch.empty(self.count, dtype=dtype, device=device)
        return self._values


def _member_segments(sizes, starts):
    """For each member of ``sizes`` (laid end to end), the range of segments (``starts``:
    their offsets, cut from the members) inside it."""
    out, s = [], 0
    for end in itertools.accumulate(sizes):
        first = s
        while s < len(starts) - 1 and starts[s + 1] <= end:
            s += 1
        out.append(range(first, s))
    return out


def shard_bounds(n, parts):
    """Offsets of Horovod's reduce-scatter split of ``n`` elements into ``parts`` (the first
    ``n mod parts`` shards one longer): ``[0, ..., n]``, ``parts + 1`` entries."""
    base, extra = divmod(n, parts)
    out = [0]
    for p in range(parts):
        out.append(out[-1] + base + (1 if p < extra else 0))
    return out


def segments_in(bounds, lo, hi):
    """The members' element counts inside the shard ``[lo, hi)`` of a bucket whose members
    occupy ``[bounds[i], bounds[i+1])`` (members outside it count 0 and are left out)."""
    sizes = []
    for a, b in zip(bounds, bounds[1:]):
        overlap = min(b, hi) - max(a, lo)
        if overlap > 0:
            sizes.append(overlap)
    return sizes


def rotating_part(rank, step, bucket_index, world):
    """The part of a bucket cut into ``world`` parts (``Plan(parts=world)``) whose positions
    ``rank`` chooses this step in the sparse allreduce: rank ``(j + step + bucket) mod P``
    chooses part j, so every rank chooses one part of every bucket and, step by step, each
    part's positions come from every rank in turn (ScaleCom's cyclic choice, spread)."""
    return (rank - step - bucket_index) % world


class SegmentEncoder:
    """``encode`` for one segment of a tensor-scope plan at a time (CPU fp32, native), as
    its gradient arrives: ``encoder(s, grad)`` compensates first, ``x[segment s] += grad``, in
    the same pass over memory that selects, and writes segment s's pairs into its own slots of
    the message. The optimizer calls it from each gradient's hook, instead of folding every
    gradient in and selecting over the whole buffer once the bucket is complete (two more
    trips through memory). Pointers and sizes are worked out once per (buffer, message), so a
    hook costs one native call, not a dozen tensor views: a ResNet-50 step runs ~140 of them.
    Returns ``(nonfinite, extra passes, filled)``; ``Codec.finish_segments`` completes the
    message."""

    def __init__(self, x, plan, message, method, zero_sent):
        values, indices = plan.layout.views(message)
        out = values if values.dtype == x.dtype else plan.value_scratch(x.dtype)
        self._keep = (x, message, out)  # the pointers below stay valid while these live
        self._dtype = x.dtype
        self._fn = selection.native_select_function(x.dtype)
        xs, isz, vsz = x.element_size(), indices.element_size(), out.element_size()
        self._calls = [(x.data_ptr() + start * xs, end - start, b - a, start,
                        indices.data_ptr() + a * isz, isz, out.data_ptr() + a * vsz)
                       for start, end, a, b in zip(plan.starts, plan.starts[1:], plan.slots, plan.slots[1:])]
        self._exact, self._zero_sent = int(method == "exact"), int(zero_sent)
        self._flags = (ctypes.c_int64 * 3)()
        self.seed = 0  # this step's (``selection.sample_seed``): set by ``Codec.segment_encoder``

    def __call__(self, s, grad=None):
        x_at, n, k, start, idx_at, isz, val_at = self._calls[s]
        fold = None
        if grad is not None:
            fold = _segment_grad_pointer(s, grad, n, self._dtype)
        flags = self._flags
        # segment s samples with seed + s, as selection.select_segments has it
        self._fn(x_at, fold, n, k, start, idx_at, isz, val_at, self._exact, self._zero_sent,
                 (self.seed + s) % 2 ** 64, flags)
        return bool(flags[0]), max(0, flags[1] - 1), flags[2]


class SegmentFolder:
    """``Codec.fold`` for one segment of a flat buffer at a time (CPU fp32, native), with
    pointers and sizes worked out once: what a rank that does not select this step (the sparse
    allreduce) runs in each gradient's hook. ``folder(s, grad)`` adds ``grad`` into segment
    ``s`` and returns whether the segment now holds inf/nan."""

    def __init__(self, x, bounds):
        self._keep = x  # the pointers below stay valid while it lives
        self._dtype = x.dtype
        self._fn = selection.native_fold_function(x.dtype)
        xs = x.element_size()
        self._calls = [(x.data_ptr() + start * xs, end - start) for start, end in zip(bounds, bounds[1:])]

    def __call__(self, s, grad):
        at, n = self._calls[s]
        return bool(self._fn(at, _segment_grad_pointer(s, grad, n, self._dtype), n))


def _segment_grad_pointer(s, grad, n, dtype):
    """The data pointer of segment ``s``'s gradient, refused unless it is what the native
    kernels read through it: contiguous, on the CPU, ``n`` elements of ``dtype`` (another dtype's
    bytes would be misread)."""
    if grad.numel() != n or not grad.is_contiguous() or grad.dtype != dtype or grad.is_cuda:
        raise ValueError(f"segment {s}: expected a contiguous CPU {dtype} gradient of {n} "
                         f"elements, got {grad.dtype} {tuple(grad.shape)} on {grad.device}")
    return grad.data_ptr()


class Encoded(NamedTuple):
    """What ``encode`` reports: the segments that held inf/nan (a list of segment numbers on
    CPU, a bool tensor per segment elsewhere; empty list when none), and native statistics."""
    nonfinite: object
    repasses: int
    filled: int


def residual_dtype(grad_dtype):
    """The dtype error feedback keeps the residual of ``grad_dtype`` gradients in: float32 for
    16-bit ones. In their own dtype a small gradient added to a larger residual entry would be
    rounded off, not kept (bfloat16 keeps 8 bits: measured, 0.5% of the gradients' sum lost over
    60 steps at 1%). The values still travel in the gradients' dtype; what that rounding takes
    stays in the residual (``Codec.feed_back``), as ``TopK(fp16_values=True)``'s does. It costs
    4 bytes a parameter instead of 2."""
    return torch.float32 if grad_dtype in (torch.float16, torch.bfloat16) else grad_dtype


def wipe_flagged(flats, flags, sizes, numel):
    """Zero, in each flat buffer of ``flats`` (``numel`` entries), the segments whose flag is set:
    ``flags`` a bool tensor with one flag per segment (the torch-ops encode's ``nonfinite``), or
    a 0-d one for the whole buffer; ``sizes`` the segments' sizes, an int64 tensor on the flags'
    device. On the device: the flags are never read on the host (a GPU would wait there for the
    selection to finish). Returns how many segments were wiped, a 0-d tensor."""
    if flags.dim() == 0:
        mask, count = flags, flags.to(torch.int64) * sizes.numel()
    else:
        mask, count = flags.repeat_interleave(sizes, output_size=numel), flags.sum()
    for flat in flats:
        flat.masked_fill_(mask, 0)
    return count


def nonfinite_flags(flat, edges):
    """One flag per segment ``[edges[i], edges[i+1])`` of ``flat``: whether it holds inf/nan, a
    bool tensor on ``flat``'s device, never read on the host (a GPU would wait there for the
    work before it)."""
    bad = ~torch.isfinite(flat)
    return torch.stack([bad[a:b].any() for a, b in zip(edges, edges[1:])])


def set_flag(slot, bad):
    """The sparse allreduce's flag: NaN into the one-value ``slot`` where ``bad`` (a bool, the
    numbers of the tensors that held inf/nan, or a bool tensor of flags on the device, not read
    on the host) says something held inf/nan, 0 otherwise. Summed over the ranks and added to
    every value times 0 (``spread_flag``), it makes every rank's result NaN, so that a
    GradScaler skips the step on every rank, even where the inf lay outside what was chosen."""
    if torch.is_tensor(bad):
        slot.copy_(torch.where(bad.any(), float("nan"), 0.0))
    else:
        slot.fill_(float("nan") if bad else 0.0)


def spread_flag(values, slot):
    """``values`` NaN where the summed ``slot`` (``set_flag``) is, unchanged where it is 0."""
    values.add_(slot * 0)


class Codec:
    """Top-K selection and its wire format; ``method``, ``fp16_values`` and ``compact`` as in
    ``TopK``. With ``compact`` the plans' messages hold the buffer's own dtype (the compact form
    is made from them, ``hvd_topk.compact``, and its rounding fed back from full precision)."""

    def __init__(self, method=selection.DEFAULT_METHOD, fp16_values=False, compact=False):
        self.method = selection.check_method(method)
        compact = check_compact(compact)
        if fp16_values and compact:
            raise ValueError("fp16_values and compact are two wire formats: choose one (compact sends "
                             "about 2.4 bytes a pair, fp16_values 6)")
        self.fp16_values, self.compact = fp16_values, compact
        # a bucket a sparse family sends dense anyway goes in float16 with either small format
        self.dense_fp16 = bool(fp16_values or compact)

    def value_dtype(self, dtype):
        """What a pair's value of a ``dtype`` gradient travels in: float16 with ``fp16_values``
        for wider gradients; 16-bit gradients keep their own dtype, already 2 bytes (float16
        would only narrow bfloat16's range to 65504)."""
        return torch.float16 if self.fp16_values and dtype.itemsize > 2 else dtype

    def pair_itemsizes(self, plan):
        """``(value, index)`` bytes a pair counts for in the cost model (whether a bucket goes
        dense, which family moves fewest bytes). With compact pairs those of 16-bit values:
        compact changes how a sparse bucket travels, not whether it travels sparse. Costed at
        its own ~2.4 bytes, a pair would be cheaper than a dense fp16 ring at every density,
        and the recipe's dense start (``warmup_density=1.0``) would run sparse; measured on
        the GPT example, that cost quality early and in one seed of three at the end
        (docs/adamw-measurements.md, "Compact pairs")."""
        if self.compact:
            return 2, plan.layout.index_itemsize
        return plan.layout.value_itemsize, plan.layout.index_itemsize

    def message_nbytes(self, plan):
        """Bytes of one rank's allgathered message for ``plan``."""
        return plan.compact().nbytes if self.compact else plan.layout.nbytes

    def plan(self, sizes, density, scope, dtype, index_dtype, parts=1):
        return Plan(sizes, density, scope, self.value_dtype(dtype), index_dtype, parts, value_format(self.compact))

    def encode(self, x, plan, message, zero_sent=False, seed=None, segments=None):
        """Select ``plan``'s pairs of the flat buffer ``x`` into ``message`` (uint8,
        ``plan.layout.nbytes``). ``zero_sent``: zero the sent entries of ``x`` (error feedback).
        Inf/nan always count as the largest magnitudes, so they are sent and reach the average;
        the segments holding them are reported (numbered in the whole plan), and what they hold
        afterwards is for the caller to wipe. ``seed`` (``selection.sample_seed``): the sample's
        positions (None: fresh ones, not repeatable). ``segments``: a ``range`` of the plan's
        segments, the only ones selected (their slots of the message; the others are left as
        they are)."""
        values, indices = plan.layout.views(message)
        whole = segments is None or len(segments) == len(plan.sizes)
        lo, hi = (0, len(plan.sizes)) if segments is None else (segments.start, segments.stop)
        a, b = plan.slots[lo], plan.slots[hi]
        if native_ok(x):
            out = values if values.dtype == x.dtype else plan.value_scratch(x.dtype)
            result = selection.select_segments(x, plan.bounds[lo:hi + 1], plan.ks_tensor[lo:hi], indices[a:b],
                                               out[a:b], self.method, zero_sent=zero_sent,
                                               nonfinite=plan.nonfinite[lo:hi],
                                               seed=None if seed is None else seed + lo)  # segment s: seed + s
            if out is not values:
                values[a:b].copy_(out[a:b])
                if zero_sent:
                    self.feed_back(x, indices[a:b], out[a:b], values[a:b])
            bad = (plan.nonfinite[lo:hi].nonzero().view(-1) + lo).tolist() if result.nonfinite else []
            encoded = Encoded(bad, result.passes - (plan.selecting[hi] - plan.selecting[lo]), result.filled)
        elif lo == hi:
            encoded = Encoded([], 0, 0)
        else:
            first = plan.starts[lo]
            got_values, got_indices, bad = selection.select_segments_torch(
                x if whole else x[first:plan.starts[hi]], plan.sizes[lo:hi], plan.ks[lo:hi], self.method, seed)
            if first:
                got_indices += first
            values[a:b].copy_(got_values)
            indices[a:b].copy_(got_indices)
            if zero_sent:  # x - x == 0 exactly; repeated fill-up slots subtract 0
                x.index_put_((got_indices,), -got_values, accumulate=True)
                self.feed_back(x, got_indices, got_values, values[a:b])
            if not whole:  # one flag per segment of the plan
                bad = torch.zeros(len(plan.sizes), dtype=torch.bool, device=x.device).index_copy_(
                    0, torch.arange(lo, hi, device=x.device), bad)
            encoded = Encoded(bad, 0, 0)
        plan.layout.zero_padding(message)
        return encoded

    def segment_encoder(self, x, plan, message, seed, zero_sent=False):
        """A ``SegmentEncoder`` of ``plan``'s segments of ``x`` into ``message`` (CPU fp32,
        native), kept on the plan while the buffer and the message stay the same; it samples
        with ``seed`` (``selection.sample_seed``, this step's)."""
        key = (x.data_ptr(), message.data_ptr(), x.dtype, zero_sent, self.method)
        encoder = plan.encoders.get(key)
        if encoder is None:
            if len(plan.encoders) > 4:  # buffers replaced (a new message size): drop stale ones
                plan.encoders.clear()
            encoder = plan.encoders[key] = SegmentEncoder(x, plan, message, self.method, zero_sent)
        encoder.seed = seed
        return encoder

    @staticmethod
    def segment_folder(x, bounds):
        """A ``SegmentFolder`` of the segments ``[bounds[i], bounds[i+1])`` of ``x`` (flat, CPU
        fp32; the caller checks ``native_ok``)."""
        return SegmentFolder(x, bounds)

    @staticmethod
    def fold(x, grad):
        """Error feedback's fold alone, ``x += grad`` (flat ``x``, ``grad`` of its size), for a
        rank that does not select this step. Returns whether ``x`` now holds inf/nan, from the
        same native pass; None where torch ops folded and nothing was checked."""
        grad = grad.reshape(-1)
        if native_ok(x) and native_ok(grad) and grad.dtype == x.dtype:
            return selection.fold_native(x, grad)
        x.add_(grad)
        return None

    @staticmethod
    def take(x, indices, out, zero=False):
        """``out = x[indices]`` and, with ``zero``, ``x[indices] = 0`` (flat ``x``; what rounding
        to a narrower ``out`` took stays in ``x``): what a rank that did not select sends at the
        selecting rank's positions, a position listed twice once. Native on CPU fp32 (one
        visit per position; the native selection never repeats a position), torch ops elsewhere."""
        if native_ok(x) and out.dtype == x.dtype and out.is_contiguous() and indices.is_contiguous():
            return selection.take_native(x, indices, out, zero)
        where = indices.long()
        full = x.index_select(0, where)
        if where.numel() > 1:
            # a position listed again (the torch-ops selection's spare slots of a short segment
            # repeat one, with value 0 from the rank that chose it) sends its value once, at the
            # first slot, or the sum would count it again at every repeat
            # (a mask, not a list of positions: a boolean index would read its count on the host)
            ordered, order = torch.sort(where, stable=True)
            again = torch.zeros_like(where, dtype=torch.bool)
            again[order[1:]] = ordered[1:] == ordered[:-1]
            full.masked_fill_(again, 0)
        if zero:
            x.index_fill_(0, where, 0)
        out.copy_(full)
        if zero:
            Codec.feed_back(x, where, full, out)
        return out

    @classmethod
    def finish_segments(cls, plan, message, dtype, residual=None, slots=None):
        """After a ``SegmentEncoder`` call for every segment of a ``dtype`` buffer (or for those
        whose slots are ``slots``, ``(lo, hi)``): values converted to the wire dtype (their
        rounding fed back into ``residual``, the buffer they were selected from with error
        feedback), padding zeroed."""
        values, indices = plan.layout.views(message)
        if values.dtype != dtype:
            full = plan.value_scratch(dtype)
            values.copy_(full)
            if residual is not None:
                lo, hi = slots or (0, len(values))
                cls.feed_back(residual, indices[lo:hi], full[lo:hi], values[lo:hi])
        plan.layout.zero_padding(message)

    @staticmethod
    def feed_back(residual, indices, full, wire):
        """Error feedback of a narrower wire dtype (``TopK(fp16_values=True)``):
        ``residual[indices] += full - wire``, what rounding the sent values ``full`` (their
        entries of the flat ``residual`` zeroed already; a scratch of ``residual``'s dtype,
        overwritten here) to ``wire`` took, so that it is sent later rather than lost, as
        compact pairs do with their coarser rounding. Where that is not finite (a value beyond
        float16's 65504 arrives as inf; inf/nan sent) nothing is added: the caller wipes such
        residuals."""
        if wire.dtype == full.dtype or wire.element_size() > full.element_size() or not wire.numel():
            return  # nothing rounded off: the same dtype, or a wider one (float32 holds every bfloat16)
        lost = torch.nan_to_num_(full.sub_(wire), nan=0.0, posinf=0.0, neginf=0.0)
        residual.index_add_(0, indices, lost)

    @staticmethod
    def decode(gathered, layout, world, dests, bounds, div=1.0, mul=1.0):
        """Overwrite ``dests`` (flat tensors holding positions ``[bounds[i], bounds[i+1])`` of
        the buffer) with every rank's values times ``mul / div``, added in rank order where
        touched, and zero elsewhere. Same bits on every rank. ``mul`` may be a 0-d tensor (a
        CUDA probe, never read on the host).

        Native (fp32 values into tensors of their dtype, or 16-bit values of
        ``TopK(fp16_values=True)`` into fp32 tensors, each widened exactly as it is added): one
        sequential write over the destinations, chunk by chunk (each rank's ascending pairs
        added into a zeroed chunk in L1, each value scaled as it is added), no separate zeroing
        pass. Torch ops: zero, ``index_add_`` rank after rank (into float32 for 16-bit tensors,
        rounded once at the end), then each touched sum scaled once (``scatter_add_ranks`` says
        why)."""
        values, indices = layout.unpack(gathered, world)
        kernel = _SCATTER.get((values.dtype, dests[0].dtype))
        if (kernel is not None and not torch.is_tensor(mul) and _rows_alike(values, indices)
                and all(native_ok(d) and d.dtype == dests[0].dtype for d in dests)):
            fn = getattr(native.library(), kernel)
            pointers = (ctypes.c_void_p * len(dests))(*[d.data_ptr() for d in dests])
            outside = fn(pointers, bounds.data_ptr(), len(dests), indices.data_ptr(), indices.element_size(),
                         values.data_ptr(), values.shape[0], values.shape[1],
                         values.stride(0) * values.element_size(), float(div), float(mul))
            if outside:
                raise RuntimeError(f"{outside} received pairs point outside the buffer or out of order: "
                                   f"{RANKS_DISAGREE}.{STEPS_DISAGREE}")
            return
        # 16-bit tensors take several ranks' values summed in float32 and rounded once, as the
        # sparse allreduce and the dense exchange do: added into bf16 one rank at a time,
        # 1 + 2**-8 - 1 over three ranks rounds to 0 where the average is 2**-8 / 3. So is a
        # single row that is then scaled (the sparse allreduce's float32 sums): rounded to bf16
        # as a sum and then divided, its mean was a unit in the last place off at 3 ranks
        scaled = div != 1.0 or torch.is_tensor(mul) or mul != 1.0
        total = residual_dtype(dests[0].dtype) if values.shape[0] > 1 or scaled else dests[0].dtype
        if len(dests) == 1 and total == dests[0].dtype:
            flat = dests[0].zero_()
        else:
            flat = torch.zeros(int(bounds[-1]), dtype=total, device=dests[0].device)
        scatter_add_ranks(flat, values, indices, div=div, mul=mul)
        if flat is not dests[0]:
            edges = bounds.tolist()
            for d, b, e in zip(dests, edges, edges[1:]):
                d.copy_(flat[b:e])


# (values' dtype, the tensors' dtype): the native decode; 16-bit values are widened as added
_SCATTER = {(torch.float32, torch.float32): "hvdtk_scatter_segments_f32",
            (torch.float16, torch.float32): "hvdtk_scatter_segments_f16_f32"}


def scatter_add_ranks(out, values, indices, div=1.0, mul=1.0):
    """``out[indices[r]] += values[r]`` for r = 0, 1, ... in order (torch ops), then every
    touched entry becomes ``out / div * mul`` once, even where several ranks sent it.

    Summing first and scaling once matters for 16-bit gradients: scaling each value before the
    sum rounds every term, and where ranks' values nearly cancel (bf16 at P=3) that error is
    as large as the result. The native fp32 decode scales as it adds (one multiply per
    value); the two differ by rounding at the last bit of the largest term, and every rank of
    one job takes the same path, so ranks still agree bit for bit."""
    for r in range(values.shape[0]):
        out.index_add_(0, indices[r].long(), values[r].to(out.dtype))
    scale_by = torch.is_tensor(mul) or mul != 1.0  # a tensor (a CUDA probe) is never read here
    if div != 1.0 or scale_by:
        touched = indices.reshape(-1).long()
        scaled = out[touched] / div
        out[touched] = scaled * mul if scale_by else scaled
    return out


def _rows_alike(values, indices):
    """Both [world, k] on CPU, unit stride inside a row, the same byte stride between rows."""
    return (values.dim() == 2 and values.shape == indices.shape and values.stride(1) == 1
            and indices.stride(1) == 1 and values.device.type == "cpu"
            and values.stride(0) * values.element_size() == indices.stride(0) * indices.element_size())
