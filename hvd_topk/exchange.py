"""Moving a bucket between ranks: the sparse allgather, the dense grouped allreduce, and the
cost model that chooses between them.

Cost model (bytes into each rank, ring algorithms): a dense allreduce moves
``2 (P-1)/P * n * b_dense``; an allgather of k pairs moves ``(P-1) * k * (b_value + b_index)``.
Sparse is cheaper while ``density < 2 * b_dense / (P * (b_value + b_index))``: 50% at P=2,
12.5% at P=8, 1.6% at P=64 for fp32 values and int32 indices.
"""

from hvd_topk._horovod import import_horovod_torch

hvd = import_horovod_torch()


def sparse_break_even(world_size, dense_bytes=4, value_bytes=4, index_bytes=4):
    """The density above which a dense allreduce moves fewer bytes than the sparse allgather."""
    if world_size <= 1:
        return 0.0  # nothing moves either way; sparse would only drop information
    return 2.0 * dense_bytes / (world_size * (value_bytes + index_bytes))


def launch_allgather(message, name, process_set):
    return hvd.allgather_async(message, name=name, process_set=process_set)


def scatter_add_ranks(out, values, indices):
    """``out[indices[r]] += values[r]`` for r = 0, 1, ... in order.

    Each rank's indices are unique, so a single ``index_add_`` has no colliding writes and the
    sums are made in rank order: the same bits on every rank, on CUDA as on CPU.
    """
    for r in range(values.shape[0]):
        out.index_add_(0, indices[r], values[r].to(out.dtype))
    return out


def launch_dense(tensors, name, op, predivide, process_set):
    """Grouped in-place allreduce, with Horovod's split of Average into pre/post scaling."""
    if op == hvd.Average:
        pre, post = 1.0 / predivide, predivide
    else:
        pre, post = 1.0, 1.0
    return hvd.grouped_allreduce_async_(list(tensors), name=name, op=op, prescale_factor=pre,
                                        postscale_factor=post, process_set=process_set)


def wait(handle):
    return hvd.synchronize(handle)
