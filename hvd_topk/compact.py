"""Compact pairs on the wire: an Elias-Fano index and either an 8-bit log-scale value (about
2.4 bytes a pair at 0.25%: ``TopK(compact=True)``, ``hvd_topk.ddp.TopKState(compact=True)``)
or the value's sign alone, one magnitude a segment (about 1.4 bytes a pair at 0.43%:
``compact="sign"``).

Why: at a fixed byte budget, what decides quality under Top-K is how many entries move per step
(docs/adamw-measurements.md, "More pairs"). A pair is otherwise an int32 index and a 16- or 32-bit value,
6 or 8 bytes; here 2.5x as many entries move in the bytes of 16-bit values.

One rank's compact message (``uint8``, padded to 8 bytes), every part of a size fixed by the
codec plan (n entries in the buffer, k pairs), so that it is allgathered as the wide one is:

    [band: float32 (lo, hi) per segment][high: k + (n >> L) + 1 bits][low: k x L bits]
    [code: uint8 per pair][padding]

and with ``compact="sign"``

    [scale: float32 per segment][high][low][sign: 1 bit per pair][padding]

- Index (Elias-Fano, for the k sorted indices in [0, n)): each index's low L = floor(log2(n/k))
  bits travel as they are; its high part ``h_i = index_i >> L`` as a set bit at position
  ``h_i + i`` of a bitmap, which the receiver reads back as ``position - i``. About
  ``L + 2`` bits an index (11 at 0.2%), exact, whatever the indices. Selection is unchanged:
  k per tensor, anywhere in it; the pairs travel sorted (the native kernel writes them so).
- Value: a sign bit and a 7-bit level. Level 0 is zero; levels 1..127 spread the magnitude
  log-uniformly over the segment's band ``[lo, hi]`` (the smallest and largest non-zero
  magnitude it sends), so a value arrives within a factor ``(hi / lo) ** (1 / 252)`` of itself
  (under 2% for a 100x band; Top-K's values lie in a narrow band, above the threshold). The
  band's ends arrive exactly (float32 ends: exactly for float32, float16 and bfloat16 buffers;
  a float64 buffer's ends are rounded to float32 first, and the levels measured against them).
  A segment holding inf/nan arrives non-finite, so that it still reaches the average, and
  feeds nothing back (the exchange wipes its residual). Float64 magnitudes outside float32's
  range: under 2**-149 sent as zero (kept in the residual), over its largest sent as that.
- Value, ``compact="sign"``: the sign bit alone; every non-zero value of a segment arrives as
  its sign times the segment's ``scale``, the mean of its non-zero magnitudes (the one number
  that minimises the squared rounding of a sign code). Why so coarse: the recommended AdamW
  scheme sends ``lr x`` normalised updates, whose top-k lie in a narrow band, and error
  feedback returns each value's rounding to its residual; the 7 bits a value saved carry
  1.7x the entries in the same bytes, which on the GPT example gained more than the rounding
  cost (docs/adamw-measurements.md, "Sign values"). A zero value (a slot a segment with fewer
  non-zeros than k fills up) must arrive as zero, which one bit cannot say: the pack moves it
  onto the index of its segment's first non-zero pair, ahead of it, and the receiver reads
  every slot whose index repeats in the next slot as zero. A segment with no non-zero value
  has scale 0. inf/nan make the scale non-finite: the segment arrives non-finite, as above.
- Error feedback: what the rounding took (the value minus what arrives) goes back into the
  residual at the sent positions, so nothing is lost, only sent later.

Used by the flat allgather only: the sparse allreduce sums values on the wire and the
hierarchical exchange runs it, so both keep the wide pairs (and refuse ``compact``).
"""

import torch

from hvd_topk import native
from hvd_topk.wire import RANKS_DISAGREE, padded

VALUES = ("log", "sign")  # compact=True is "log"
SIGN_ROUNDING = ("compact='sign' sends each value as its sign times the mean magnitude of its top-k, and only error "
                 "feedback (hvd_topk.DistributedOptimizer or the DDP hook, error_feedback=True) keeps what that "
                 "rounding takes, in the residual")
LEVELS = 126  # codes 1..127 span the band's log-width in 126 steps
FLOAT32_SMALLEST = 2.0 ** -149  # the band's ends travel as float32
FLOAT32_LARGEST = torch.finfo(torch.float32).max


def check_compact(value):
    """``TopK``'s and ``TopKState``'s ``compact``: ``False``, ``True`` (8-bit log-scale values)
    or ``"sign"`` (1-bit values)."""
    if value is not True and value is not False and value != "sign":  # not merely truthy
        raise TypeError(f"compact must be True, False or 'sign', got {value!r}")
    return "sign" if value == "sign" else value  # (a numpy string as the plain one: ranks compare reprs)


def check_compact_use(compact, exchange, error_feedback, hierarchical=None):
    """Refuse what a ``compact`` setting cannot do: the sparse allreduce sums values on the wire,
    so it keeps wide pairs, and the hierarchical exchange is not built for them; only error feedback keeps
    what sign values round off. ``hierarchical``: the optimizer's option (``None`` where there
    is no such option, the DDP hook)."""
    if compact and exchange == "sparse_allreduce":
        without = ", without hierarchical=True" if hierarchical is not None else ""
        raise ValueError(f"compact={compact!r} packs the allgather's pairs; the sparse allreduce sums values on the "
                         f"wire and keeps wide pairs: use exchange='allgather' or 'auto' (which then tries the "
                         f"allgather and dense only){without}")
    if compact and hierarchical is True:
        raise ValueError(f"compact={compact!r} packs the flat allgather's pairs; the hierarchical exchange (dense "
                         f"inside a host, then an allgather or the sparse allreduce across hosts) keeps wide pairs: "
                         f"pass hierarchical='auto' (which steps aside for compact pairs) or False")
    if compact == "sign" and not error_feedback:
        raise ValueError(f"{SIGN_ROUNDING}: with error_feedback=False use compact=True")


def value_format(compact):
    """The ``CompactPairs`` value format of a ``compact`` setting (``True``: ``"log"``)."""
    return "sign" if compact == "sign" else "log"


class CompactPairs:
    """The compact form of one codec ``Plan``'s messages; built once per plan and reused.

    ``pack`` turns a wide message (``plan.layout``: int32/int64 indices and values of the
    buffer's dtype) into a compact one, feeding the rounding back into a residual; ``unpack``
    turns the allgather of compact messages back into wide ones, which ``Codec.decode`` reads.
    ``index_itemsize`` is an index's bytes on average in the compact message (a value takes
    one byte, a sign-only one an eighth); the cost model does not use it: it counts a compact
    pair as a pair with 16-bit values (``Codec.pair_itemsizes`` says why). ``values``: ``"log"``
    (8-bit log-scale values) or ``"sign"`` (the sign and one scale a segment).
    """

    def __init__(self, plan, values="log"):
        if values not in VALUES:
            raise ValueError(f"values must be one of {VALUES}, got {values!r}")
        self.values = values
        sign = values == "sign"
        self.wide = plan.layout
        self.count = k = plan.count
        self.segments = len(plan.sizes)
        self.low_bits = low_bits(plan.numel, k)
        self.high_bits = k + (plan.numel >> self.low_bits) + 1
        self.index_itemsize = (self.high_bits + k * self.low_bits) / max(k, 1) / 8
        ks = torch.tensor(plan.ks, dtype=torch.int64)
        self.segment_of_slot = torch.repeat_interleave(torch.arange(self.segments), ks)
        edges, offset = {}, 0
        for name, nbytes in (("band", (4 if sign else 8) * self.segments), ("high", -(-self.high_bits // 8)),
                             ("low", -(-k * self.low_bits // 8)), ("code", -(-k // 8) if sign else k)):
            edges[name] = slice(offset, offset + nbytes)
            offset += nbytes
        self._parts, self._used = edges, offset
        self.nbytes = padded(offset)
        self._send = self._wide = None  # reusable buffers (one exchange of this plan at a time)
        self._device = torch.device("cpu")
        self._slots = torch.tensor(plan.slots, dtype=torch.int64)  # each segment's pairs (native)

    def _on(self, device):
        if device != self._device:
            self.segment_of_slot, self._device = self.segment_of_slot.to(device), device
        return self.segment_of_slot

    def _views(self, rows):
        """(band[rows, segments, 2], high[rows, bytes], low[rows, bytes], code[rows, count]);
        sign values: (scale[rows, segments], high, low, sign bits[rows, ceil(count / 8)])."""
        p = self._parts
        band = rows[:, p["band"]].view(torch.float32).view(rows.shape[0], self.segments, -1)
        return (band[:, :, 0] if self.values == "sign" else band,
                rows[:, p["high"]], rows[:, p["low"]], rows[:, p["code"]])

    def pack(self, message, residual=None, out=None):
        """The compact form of the wide ``message`` (into ``out``, a new buffer with
        ``out=False``, or this plan's reusable one). ``residual`` (flat, the buffer the pairs were
        selected from, their entries already zeroed): receives value - what arrives."""
        values, indices = self.wide.views(message)
        if out is None:
            if self._send is None or self._send.device != message.device:
                self._send = torch.empty(self.nbytes, dtype=torch.uint8, device=message.device)
            out = self._send
        elif out is False:
            out = torch.empty(self.nbytes, dtype=torch.uint8, device=message.device)
        lib = _native(values, residual)
        if lib is not None and self._pack_native(lib, values, indices, out, residual):
            return out
        # in position order (the torch-ops selection's are by segment, then magnitude); sorted
        # whatever they are, as asking whether they are would read the answer on the host
        index, order = torch.sort(indices.long(), stable=True)
        values = values[order]
        segment = self._on(message.device)
        if self.values == "sign":
            return self._pack_sign(values, index, segment, out, residual)
        band, high, low, code = self._views(out.view(1, -1))
        magnitude = values.double().abs()
        finite = torch.isfinite(magnitude)
        # A float64 magnitude below float32's smallest (2**-149) would make a band end of 0: it
        # is sent as zero (the residual keeps it); one above float32's largest arrives as that
        sent = magnitude >= FLOAT32_SMALLEST
        hi = torch.zeros(self.segments, dtype=torch.float64, device=message.device)
        hi.scatter_reduce_(0, segment, magnitude, "amax")  # nan and inf win: the band turns non-finite
        smallest = torch.where(sent & finite, magnitude, float("inf"))  # zeros and inf/nan left out
        lo = torch.full_like(hi, float("inf")).scatter_reduce_(0, segment, smallest, "amin")
        band[0, :, 0] = lo.clamp(max=FLOAT32_LARGEST)
        band[0, :, 1] = torch.where(torch.isfinite(hi), hi.clamp(max=FLOAT32_LARGEST), hi)
        lo, hi = band[0, :, 0].double(), band[0, :, 1].double()  # what the receivers will read
        log_lo, width = torch.log(lo)[segment], torch.log(hi / lo)[segment]
        step = torch.round((torch.log(magnitude) - log_lo) / width * LEVELS).clamp_(0, LEVELS) + 1
        step = torch.nan_to_num_(torch.where(width == 0, 1.0, step), nan=1.0)
        level = torch.where(finite, torch.where(sent, step, 0.0), float(LEVELS + 1)).to(torch.uint8)
        code[0].copy_(level | (torch.signbit(values).to(torch.uint8) << 7))
        self._pack_index(index, high, low)
        out[self._used:].zero_()
        if residual is not None and self.count:
            arrives = self._dequantise(code, band, segment.unsqueeze(0))[0].to(values.dtype)
            lost = _lost(values, arrives, residual)
            # not in a segment holding inf/nan: its residual was just wiped, and its finite values
            # all arrive as the band's low end, so nearly all of each would come back
            keep = torch.isfinite(lost) & torch.isfinite(hi)[segment]
            residual.index_add_(0, index, torch.where(keep, lost, 0))
        return out

    def _pack_sign(self, values, index, segment, out, residual):
        """``pack``'s sign format, from pairs sorted by index."""
        scale, high, low, signs = self._views(out.view(1, -1))
        device = out.device
        magnitude = values.double().abs()
        zero = magnitude == 0
        nonzero = (~zero).double()
        total = torch.zeros(self.segments, dtype=torch.float64, device=device).index_add_(0, segment, magnitude)
        count = torch.zeros(self.segments, dtype=torch.float64, device=device).index_add_(0, segment, nonzero)
        mean = total / count.clamp(min=1)
        # float64 magnitudes whose sum overflows (each finite): averaged a term at a time instead
        shares = torch.zeros_like(total).index_add_(0, segment, magnitude / count.clamp(min=1)[segment])
        mean = torch.where(torch.isinf(total) & torch.isfinite(shares), shares, mean)
        scale[0] = torch.where(torch.isfinite(mean), mean.clamp(max=FLOAT32_LARGEST), mean)
        # zeros onto their segment's first non-zero index, ahead of it (read back as zero there)
        none = torch.iinfo(torch.int64).max
        first = torch.full((self.segments,), none, dtype=torch.int64, device=device)
        first.scatter_reduce_(0, segment, torch.where(zero, none, index), "amin")
        moved = torch.where(zero & (count[segment] > 0), first[segment], index)
        order = torch.argsort(moved * 2 + (~zero).long(), stable=True)  # indices < 2**62
        index, values = moved[order], values[order]
        signs.copy_(pack_bits(torch.signbit(values).view(1, -1)))
        self._pack_index(index, high, low)
        out[self._used:].zero_()
        if residual is not None and self.count:
            arrives = self._dequantise_sign(signs, scale, segment.unsqueeze(0), index.unsqueeze(0))[0]
            lost = _lost(values, arrives, residual)
            keep = torch.isfinite(lost) & torch.isfinite(scale[0].double())[segment]
            residual.index_add_(0, index, torch.where(keep, lost, 0))
        return out

    def _pack_index(self, index, high, low):
        """Elias-Fano: the sorted ``index``'s high parts as a bitmap, the low bits as they are."""
        device = index.device
        slots = torch.arange(self.count, device=device)
        bitmap = torch.zeros(1, self.high_bits, dtype=torch.bool, device=device)
        bitmap[0, (index >> self.low_bits) + slots] = True
        high.copy_(pack_bits(bitmap))
        if self.low_bits:
            shifts = torch.arange(self.low_bits, device=device)
            low.copy_(pack_bits(((index.unsqueeze(1) >> shifts) & 1).bool().view(1, -1)))

    def unpack(self, gathered, world, out=None):
        """Wide messages (``plan.layout``, ``world`` rows) from the allgather of compact ones,
        into ``out``, a new buffer with ``out=False``, or this plan's reusable one."""
        if gathered.numel() != world * self.nbytes:
            raise ValueError(f"gathered {gathered.numel()} bytes, expected {world} ranks x {self.nbytes} "
                             f"bytes: {RANKS_DISAGREE}")
        device = gathered.device
        if out is None:
            if self._wide is None or self._wide.numel() != world * self.wide.nbytes or self._wide.device != device:
                self._wide = torch.zeros(world * self.wide.nbytes, dtype=torch.uint8, device=device)
            out = self._wide
        elif out is False:
            out = torch.zeros(world * self.wide.nbytes, dtype=torch.uint8, device=device)
        values, indices = self.wide.unpack(out, world)
        lib = _native(values)
        if lib is not None:
            self._unpack_native(lib, gathered, world, values, indices)
            return out
        band, high, low, code = self._views(gathered.view(world, self.nbytes))
        bitmap = unpack_bits(high, self.high_bits)
        if bool((bitmap.sum(dim=1) != self.count).any()):
            raise RuntimeError(f"received index bitmaps do not hold the pairs sent: {RANKS_DISAGREE}")
        position = bitmap.nonzero()[:, 1].view(world, self.count)  # row-major: each row in order
        index = (position - torch.arange(self.count, device=device)) << self.low_bits
        if self.low_bits:
            bits = unpack_bits(low, self.count * self.low_bits).view(world, self.count, self.low_bits)
            index |= (bits.long() << torch.arange(self.low_bits, device=device)).sum(dim=2)
        indices.copy_(index)
        segment = self._on(device).unsqueeze(0)
        if self.values == "sign":
            values.copy_(self._dequantise_sign(code, band, segment, index))
        else:
            values.copy_(self._dequantise(code, band, segment))
        return out

    def _pack_native(self, lib, values, indices, out, residual):
        """The native pack (CPU float32); False when the pairs are not sorted (nothing written)."""
        p = self._parts
        base = out.data_ptr()
        done = lib.hvdtk_compact_pack_f32(
            values.data_ptr(), indices.data_ptr(), indices.element_size(), self.count, self._slots.data_ptr(),
            self.segments, self.low_bits, base + p["band"].start, base + p["high"].start,
            p["high"].stop - p["high"].start, self.high_bits, base + p["low"].start, p["low"].stop - p["low"].start,
            base + p["code"].start, residual.data_ptr() if residual is not None else None, self.values == "sign")
        if done < 0:
            return False
        out[self._used:].zero_()
        return True

    def _unpack_native(self, lib, gathered, world, values, indices):
        p = self._parts
        bad = lib.hvdtk_compact_unpack_f32(
            gathered.data_ptr(), world, self.nbytes, p["band"].start, p["high"].start, self.high_bits,
            p["low"].start, p["code"].start, self.count, self._slots.data_ptr(), self.segments, self.low_bits,
            values.data_ptr(), indices.data_ptr(), indices.element_size(), values.stride(0) * 4, self.values == "sign")
        if bad:
            raise RuntimeError(f"rank {bad - 1}'s index bitmap does not hold the pairs sent: {RANKS_DISAGREE}")

    @staticmethod
    def _dequantise(code, band, segment):
        """What arrives (float64) for ``code[rows, count]`` given each row's ``band[rows,
        segments, 2]`` (the ends exactly)."""
        lo = torch.gather(band[:, :, 0].double(), 1, segment.expand(code.shape[0], -1))
        hi = torch.gather(band[:, :, 1].double(), 1, segment.expand(code.shape[0], -1))
        level = (code & 127).double()
        magnitude = torch.exp(torch.log(lo) + (level - 1) / LEVELS * torch.log(hi / lo))
        magnitude = torch.where(level == 1, lo, torch.where(level == LEVELS + 1, hi, magnitude))
        magnitude = torch.where(level == 0, 0.0, magnitude)
        return torch.where(code >= 128, -magnitude, magnitude)

    def _dequantise_sign(self, signs, scale, segment, index):
        """What arrives (float64) for ``signs[rows, ceil(count / 8)]`` given each row's
        ``scale[rows, segments]`` and decoded ``index[rows, count]``: a slot whose index repeats
        in the next slot is zero."""
        magnitude = torch.gather(scale.double(), 1, segment.expand(signs.shape[0], -1))
        repeated = torch.zeros_like(index, dtype=torch.bool)
        repeated[:, :-1] = index[:, :-1] == index[:, 1:]
        magnitude = torch.where(repeated, 0.0, magnitude)
        return torch.where(unpack_bits(signs, self.count), -magnitude, magnitude)


def _lost(values, arrives, residual):
    """What the wire took from each sent value: the value minus what arrives (as the receivers
    read it, in the values' dtype), in the residual's dtype. A 16-bit value's difference from a
    sign value's arrival, far from it, would round in 16 bits (a review: 2**-9 of it lost)."""
    return values.to(residual.dtype) - arrives.to(values.dtype).to(residual.dtype)


def _native(values, residual=None):
    """The native library where it handles these pairs (CPU, float32 values and residual)."""
    if values.device.type != "cpu" or values.dtype != torch.float32 or values.stride(-1) != 1:
        return None
    if residual is not None and (residual.dtype != torch.float32 or residual.device.type != "cpu"
                                 or not residual.is_contiguous()):
        return None
    return native.library()


def low_bits(n, k):
    """Elias-Fano's split for k indices in [0, n): floor(log2(n / k)) low bits sent as they are."""
    return max(0, (n // k).bit_length() - 1) if k else 0


def pack_bits(bits):
    """``bits`` (bool, [rows, m]) as bytes, [rows, ceil(m / 8)], bit j of byte b being
    ``bits[:, 8 b + j]``."""
    pad = -bits.shape[1] % 8
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad))
    weights = 1 << torch.arange(8, dtype=torch.int32, device=bits.device)  # made there: no copy to it
    return (bits.view(bits.shape[0], -1, 8).to(torch.int32) * weights).sum(dim=2).to(torch.uint8)


def unpack_bits(packed, m):
    """The first ``m`` bits of each row of ``packed`` (uint8, [rows, bytes]) as bool, [rows, m]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(2) >> shifts) & 1).view(packed.shape[0], -1)[:, :m].bool()
