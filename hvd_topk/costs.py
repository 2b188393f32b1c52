"""The exchange cost model: bytes into one rank per exchange of one buffer, for every strategy
and either transport (Horovod's collectives, ``torch.distributed``'s), which follow the same
ring algorithms. No transport is imported here.

Every function has the signature ``(world, numel, count, value_bytes, index_bytes, dense_bytes)``:
a buffer of ``numel`` elements of ``dense_bytes`` each, of which ``count`` (value, index) pairs
are selected. ``hvd_topk.exchange`` says what each strategy moves and when sparse pays.
"""


def dense(world, numel, count, value_bytes, index_bytes, dense_bytes):
    """Ring allreduce of the whole buffer: ``2 (P-1)/P n b_dense``."""
    return 2.0 * (world - 1) / world * numel * dense_bytes if world > 1 else 0.0


def dense_fp16(world, numel, count, value_bytes, index_bytes, dense_bytes):
    """The same in float16: ``2 (P-1)/P n 2``."""
    return dense(world, numel, count, value_bytes, index_bytes, 2)


def allgather(world, numel, count, value_bytes, index_bytes, dense_bytes):
    """Every rank receives every other rank's k pairs: ``(P-1) k (b_v + b_i)``."""
    return (world - 1) * count * (value_bytes + index_bytes)


def sparse_allreduce(world, numel, count, value_bytes, index_bytes, dense_bytes):
    """The k indices allgathered, each rank's part (1/P of them) from it, then a ring allreduce
    of k values and one non-finite flag: ``(P-1)/P k b_i + 2 (P-1)/P (k+1) b_v``."""
    if world <= 1:
        return 0.0
    return (world - 1) / world * (count * index_bytes + 2.0 * (count + 1) * value_bytes)


def cheapest(strategies, world, numel, count, value_bytes, index_bytes, dense_bytes):
    """The strategy (anything with a ``wire_bytes`` of the signature above) moving the fewest
    bytes into each rank (the first listed on a tie)."""
    return min(strategies, key=lambda s: s.wire_bytes(world, numel, count, value_bytes, index_bytes,
                                                      dense_bytes))


def break_even(world_size, strategy_bytes, dense_bytes=4, value_bytes=4, index_bytes=4):
    """The density at which a sparse strategy (its cost function) moves as many bytes as a dense
    allreduce; 0 for one rank (sparse would only drop data)."""
    if world_size <= 1:
        return 0.0
    per_element_dense = dense(world_size, 1, 0, value_bytes, index_bytes, dense_bytes)
    # the sparse cost is affine in the count: its slope is the cost of one pair
    per_pair = (strategy_bytes(world_size, 0, 2, value_bytes, index_bytes, dense_bytes)
                - strategy_bytes(world_size, 0, 1, value_bytes, index_bytes, dense_bytes))
    return per_element_dense / per_pair
