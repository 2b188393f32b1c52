"""Compact pairs on the wire: 3 bytes a pair, a 16-bit index and an 8-bit log-scale value
(``TopK(compact=True)``, ``hvd_topk.ddp.TopKState(compact=True)``).

Why: at a fixed byte budget, what decides quality under Top-K is how many entries move per step
(docs/adamw.md, "More pairs"). A pair is otherwise an int32 index and a 16- or 32-bit value,
6 or 8 bytes; at 3 bytes twice as many entries move in the bytes of 16-bit values.

One rank's compact message (``uint8``, padded to 8 bytes), every part at a fixed size known
from the codec plan, so that it can be allgathered as the wide message is:

    [band: float32 (lo, hi) per segment][counts: int32 per 2**16-entry chunk of the buffer]
    [low: int16 per pair][code: uint8 per pair][padding]

- Index: the pairs travel sorted by index (the native kernel writes them so already); each
  carries its index's low 16 bits, and ``counts`` says how many pairs fall into each 2**16-entry
  chunk of the buffer, from which the high bits follow. Selection is unchanged: k per tensor,
  anywhere in it.
- Value: a sign bit and a 7-bit code. Code 0 is zero; codes 1..127 spread the magnitude
  log-uniformly over the segment's band ``[lo, hi]`` (the smallest and largest non-zero
  magnitude it sends), so a value arrives within a factor ``(hi / lo) ** (1 / 252)`` of itself
  (under 2% for a 100x band; Top-K's values lie in a narrow band, above the threshold). The
  band's ends arrive exactly (float32 ends: exactly for float32, float16 and bfloat16 buffers;
  a float64 buffer's ends are rounded to float32 first, and the codes measured against them). A segment holding inf/nan arrives non-finite, so that it still
  reaches the average as it would uncompressed.
- Error feedback: what the rounding took (the value minus what arrives) goes back into the
  residual at the sent positions, so nothing is lost, only sent later.

Used by the flat allgather only: the sparse allreduce sums values on the wire and the
hierarchical exchange runs it, so both keep the wide pairs (and refuse ``compact``).
"""

import torch

CHUNK_BITS = 16
CHUNK = 1 << CHUNK_BITS
LEVELS = 126  # codes 1..127 span the band's log-width in 126 steps
_ALIGN = 8


class CompactPairs:
    """The compact form of one codec ``Plan``'s messages; built once per plan and reused.

    ``pack`` turns a wide message (``plan.layout``: int32/int64 indices and values of the
    buffer's dtype) into a compact one, feeding the rounding back into a residual; ``unpack``
    turns the allgather of compact messages back into wide ones, which ``Codec.decode`` reads.
    ``value_itemsize``/``index_itemsize`` (1, 2) are what the cost model counts per pair.
    """

    value_itemsize, index_itemsize = 1, 2

    def __init__(self, plan):
        self.wide = plan.layout
        self.count = plan.count
        self.segments = len(plan.sizes)
        self.chunks = max(1, -(-plan.numel // CHUNK))
        ks = torch.tensor(plan.ks, dtype=torch.int64)
        self.segment_of_slot = torch.repeat_interleave(torch.arange(self.segments), ks)
        edges, offset = {}, 0
        for name, nbytes in (("band", 8 * self.segments), ("counts", 4 * self.chunks),
                             ("low", 2 * self.count), ("code", self.count)):
            edges[name] = slice(offset, offset + nbytes)
            offset += nbytes
        self._parts, self._used = edges, offset
        self.nbytes = (offset + _ALIGN - 1) // _ALIGN * _ALIGN
        self._send = self._wide = None  # reusable buffers (one exchange of this plan at a time)
        self._device = torch.device("cpu")

    def _on(self, device):
        if device != self._device:
            self.segment_of_slot, self._device = self.segment_of_slot.to(device), device
        return self.segment_of_slot

    def _views(self, rows):
        """(band[rows, segments, 2], counts[rows, chunks], low[rows, count], code[rows, count])."""
        p = self._parts
        return (rows[:, p["band"]].view(torch.float32).view(rows.shape[0], self.segments, 2),
                rows[:, p["counts"]].view(torch.int32), rows[:, p["low"]].view(torch.int16), rows[:, p["code"]])

    def pack(self, message, residual=None, out=None):
        """The compact form of the wide ``message`` (into ``out``, a new buffer with
        ``out=False``, or this plan's reusable one). ``residual`` (flat, the buffer the pairs were
        selected from, their entries already zeroed): receives value - what arrives."""
        values, indices = self.wide.views(message)
        index = indices.long()
        if self.count > 1 and not bool((index[1:] >= index[:-1]).all()):
            index, order = torch.sort(index, stable=True)  # the torch-ops selection's order
            values = values[order]
        if out is None:
            if self._send is None or self._send.device != message.device:
                self._send = torch.empty(self.nbytes, dtype=torch.uint8, device=message.device)
            out = self._send
        elif out is False:
            out = torch.empty(self.nbytes, dtype=torch.uint8, device=message.device)
        band, counts, low, code = self._views(out.view(1, -1))
        segment = self._on(message.device)
        magnitude = values.double().abs()
        finite = torch.isfinite(magnitude)
        sent = magnitude > 0
        hi = torch.zeros(self.segments, dtype=torch.float64, device=message.device)
        hi.scatter_reduce_(0, segment, magnitude, "amax")  # nan and inf win: the band turns non-finite
        lo = torch.full_like(hi, float("inf")).scatter_reduce_(0, segment, torch.where(sent & finite, magnitude, float("inf")), "amin")
        band[0, :, 0], band[0, :, 1] = lo, hi
        lo, hi = band[0, :, 0].double(), band[0, :, 1].double()  # what the receivers will read
        log_lo, width = torch.log(lo)[segment], torch.log(hi / lo)[segment]
        step = torch.round((torch.log(magnitude) - log_lo) / width * LEVELS).clamp_(0, LEVELS) + 1
        step = torch.nan_to_num_(torch.where(width == 0, 1.0, step), nan=1.0)
        level = torch.where(finite, torch.where(sent, step, 0.0), float(LEVELS + 1)).to(torch.uint8)
        code[0].copy_(level | (torch.signbit(values).to(torch.uint8) << 7))
        low[0].copy_(((index & (CHUNK - 1)) - (CHUNK // 2)).to(torch.int16))
        counts[0].copy_(torch.bincount(index >> CHUNK_BITS, minlength=self.chunks)[:self.chunks].to(torch.int32))
        out[self._used:].zero_()
        if residual is not None and self.count:
            arrives = self._dequantise(code, band, segment.unsqueeze(0))[0].to(values.dtype)
            lost = values - arrives
            residual.index_add_(0, index, torch.where(torch.isfinite(lost), lost, 0).to(residual.dtype))
        return out

    def unpack(self, gathered, world, out=None):
        """Wide messages (``plan.layout``, ``world`` rows) from the allgather of compact ones,
        into ``out``, a new buffer with ``out=False``, or this plan's reusable one."""
        if gathered.numel() != world * self.nbytes:
            raise ValueError(f"gathered {gathered.numel()} bytes, expected {world} ranks x {self.nbytes} "
                             "bytes: ranks disagree on the tensor being exchanged")
        band, counts, low, code = self._views(gathered.view(world, self.nbytes))
        if bool((counts.sum(dim=1) != self.count).any()) or bool((counts < 0).any()):
            raise RuntimeError("received chunk counts do not add up to the pairs sent: ranks disagree on the "
                               "tensors being exchanged")
        device = gathered.device
        if out is None:
            if self._wide is None or self._wide.numel() != world * self.wide.nbytes or self._wide.device != device:
                self._wide = torch.zeros(world * self.wide.nbytes, dtype=torch.uint8, device=device)
            out = self._wide
        elif out is False:
            out = torch.zeros(world * self.wide.nbytes, dtype=torch.uint8, device=device)
        values, indices = self.wide.unpack(out, world)
        chunk = torch.arange(self.chunks, device=device).repeat(world)
        high = torch.repeat_interleave(chunk, counts.reshape(-1).long()).view(world, self.count)
        indices.copy_((high << CHUNK_BITS) + low.long() + CHUNK // 2)
        values.copy_(self._dequantise(code, band, self._on(device).unsqueeze(0)))
        return out

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
