"""Exchange strategies: how one bucket's payload moves between ranks, and what it costs.

Every strategy answers two questions the same way for the optimizer, the benchmarks'
scaling model and the tests:

- ``wire_bytes(world, numel, count, value_bytes, index_bytes, dense_bytes)``: bytes into one
  rank per exchange of a buffer of ``numel`` elements of which ``count`` pairs are sent
  (ring algorithms, the model Horovod's collectives follow);
- ``start(...)`` / ``finish(handle)``: launch the collective asynchronously, wait for it.

Strategies today:

====================  ===========================================  ==========================
``AllgatherPairs``    every rank receives every other rank's pairs  ``(P-1) k (b_v + b_i)``
``DenseAllreduce``    ring allreduce of the whole buffer            ``2 (P-1)/P n b_dense``
====================  ===========================================  ==========================

Sparse pays while ``density < 2 b_dense / (P (b_v + b_i))``: 50% at P=2, 12.5% at P=8, 1.6% at
P=64 for fp32 values and int32 indices (``sparse_break_even``).
"""

from hvd_topk._horovod import allreduce_dtype, hvd


class AllgatherPairs:
    """Allgather of every rank's packed (value, index) message; grows with the number of ranks."""

    name = "allgather"
    sparse = True

    @staticmethod
    def wire_bytes(world, numel, count, value_bytes, index_bytes, dense_bytes):
        return (world - 1) * count * (value_bytes + index_bytes)

    @staticmethod
    def start(message, name, process_set):
        return hvd.allgather_async(message, name=name, process_set=process_set)

    @staticmethod
    def finish(handle):
        """The gathered messages, rank after rank (a uint8 tensor)."""
        return hvd.synchronize(handle)


class DenseAllreduce:
    """In-place ring allreduce of the whole buffer (Horovod's default path).

    A dtype Horovod cannot allreduce (bfloat16 on Horovod 0.28.1) is allreduced as a float32
    copy and cast back into the buffer by ``finish``: exact for every bfloat16 input, summed in
    float32, and one rounding to bfloat16 at the end. (Horovod's own optimizer raises "Tensor
    type torch.BFloat16Tensor is not supported." there.) The buffer is always contiguous, so
    channels_last gradients need nothing: the bucket copies them in and out by shape.
    """

    name = "dense"
    sparse = False

    @staticmethod
    def wire_bytes(world, numel, count, value_bytes, index_bytes, dense_bytes):
        return 2.0 * (world - 1) / world * numel * dense_bytes if world > 1 else 0.0

    @staticmethod
    def start(tensor, name, process_set, op, predivide=1.0):
        """Horovod's split of Average into pre- and post-scaling, as its optimizer does.
        Returns a handle for ``finish``."""
        pre, post = (1.0 / predivide, predivide) if op == hvd.Average else (1.0, 1.0)
        wire = tensor.to(allreduce_dtype(tensor.dtype))  # ``tensor`` itself when supported
        handle = hvd.allreduce_async_(wire, name=name, op=op, prescale_factor=pre,
                                      postscale_factor=post, process_set=process_set)
        return handle, tensor, wire

    @staticmethod
    def finish(handle):
        """The reduced buffer: the tensor given to ``start``, overwritten with the result."""
        handle, tensor, wire = handle
        hvd.synchronize(handle)
        if wire is not tensor:
            tensor.copy_(wire)
        return tensor


STRATEGIES = (DenseAllreduce, AllgatherPairs)  # on a tie, dense: it loses nothing


def cheapest(strategies, world, numel, count, value_bytes, index_bytes, dense_bytes):
    """The strategy moving the fewest bytes into each rank (the first listed on a tie)."""
    return min(strategies, key=lambda s: s.wire_bytes(world, numel, count, value_bytes, index_bytes,
                                                      dense_bytes))


def sparse_break_even(world_size, dense_bytes=4, value_bytes=4, index_bytes=4):
    """The density at which the allgather moves as many bytes as a dense allreduce (derived
    from the two strategies' ``wire_bytes``); 0 for one rank (sparse would only drop data)."""
    if world_size <= 1:
        return 0.0
    per_element_dense = DenseAllreduce.wire_bytes(world_size, 1, 0, value_bytes, index_bytes, dense_bytes)
    per_pair = AllgatherPairs.wire_bytes(world_size, 0, 1, value_bytes, index_bytes, dense_bytes)
    return per_element_dense / per_pair
