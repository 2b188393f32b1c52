"""The bytes on the wire: (value, index) pairs of one or more tensors packed into one buffer.

A message is ``[indices][values][padding]`` as ``uint8`` (the part with the wider dtype first),
padded to a multiple of 8 bytes so that after an allgather every rank's block, and the index
and value parts inside it, can be viewed as their real dtypes without a copy. Packing as bytes also lets
dtypes Horovod 0.28.1 cannot allgather (bfloat16) travel unchanged.
"""

import torch

_ALIGN = 8

# Why a received message does not fit: the ranks built different TopKs, or the tensor differs
RANKS_DISAGREE = ("ranks disagree on the tensor being exchanged or on its TopK (density, fp16_values, compact): "
                  "build the same TopK for it on every rank (or the native CPU kernel is in use on some ranks "
                  "only: install a C compiler on every host, or set HVD_TOPK_NATIVE=0 on every rank)")

# ... and where ranks also keep a step counter that decides the messages (the DDP hook: the
# Horovod optimizer checks the ranks' steps itself and refuses first)
STEPS_DISAGREE = (" With the DDP hook the ranks may also be at different steps: TopKState.load_state_dict "
                  "on some ranks only (load each rank's own state on every rank).")


def padded(nbytes):
    """``nbytes`` rounded up to the alignment every message is padded to."""
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def index_dtype_for(numel):
    """int32 while every index fits, int64 beyond 2**31 - 1 elements."""
    return torch.int32 if numel < 2**31 else torch.int64


class Layout:
    """How many pairs of which dtypes one rank's message holds; identical on every rank."""

    def __init__(self, count, value_dtype, index_dtype):
        self.count = int(count)
        self.value_dtype = value_dtype
        self.index_dtype = index_dtype
        self.index_itemsize, self.value_itemsize = _itemsize(index_dtype), _itemsize(value_dtype)
        index_bytes = self.count * self.index_itemsize
        value_bytes = self.count * self.value_itemsize
        used = index_bytes + value_bytes
        self.nbytes = padded(used)
        if _itemsize(value_dtype) > _itemsize(index_dtype):  # keep every part aligned
            self._values, self._indices = slice(0, value_bytes), slice(value_bytes, used)
        else:
            self._indices, self._values = slice(0, index_bytes), slice(index_bytes, used)
        self._padding = slice(used, self.nbytes)

    def pack(self, values, indices, out=None):
        """Write one rank's pairs into ``out`` (a reusable uint8 buffer) or a new one.

        ``values`` and ``indices`` are tensors, or equal-length sequences of tensors (the
        tensors of a fusion bucket), written one after the other without concatenating first.
        """
        values = [values] if torch.is_tensor(values) else list(values)
        indices = [indices] if torch.is_tensor(indices) else list(indices)
        n_values, n_indices = sum(v.numel() for v in values), sum(i.numel() for i in indices)
        if n_values != self.count or n_indices != self.count:
            raise ValueError(f"expected {self.count} pairs, got {n_values} values and {n_indices} indices")
        if out is None:
            out = torch.empty(self.nbytes, dtype=torch.uint8, device=values[0].device)
        for part, dtype, chunks in ((self._values, self.value_dtype, values),
                                    (self._indices, self.index_dtype, indices)):
            dest, start = out[part].view(dtype), 0
            for chunk in chunks:
                dest[start:start + chunk.numel()].copy_(chunk.reshape(-1))
                start += chunk.numel()
        out[self._padding].zero_()
        return out

    def views(self, message):
        """``(values, indices)``: 1-D views of one rank's message, for writing pairs in place."""
        return message[self._values].view(self.value_dtype), message[self._indices].view(self.index_dtype)

    def zero_padding(self, message):
        message[self._padding].zero_()

    def unpack(self, gathered, world_size):
        """Views ``(values[world_size, count], indices[world_size, count])`` of an allgather."""
        if gathered.numel() != world_size * self.nbytes:
            raise ValueError(f"gathered {gathered.numel()} bytes, expected {world_size} ranks x "
                             f"{self.nbytes} bytes: {RANKS_DISAGREE}")
        blocks = gathered.view(world_size, self.nbytes)
        return blocks[:, self._values].view(self.value_dtype), blocks[:, self._indices].view(self.index_dtype)


def _itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()
