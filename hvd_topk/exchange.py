"""Moving a bucket between ranks: the sparse allgather, the dense grouped allreduce, and the
cost model that chooses between them.

Cost model (bytes into each rank, ring algorithms): a dense allreduce moves
``2 (P-1)/P * n * b_dense``; an allgather of k pairs moves ``(P-1) * k * (b_value + b_index)``.
Sparse is cheaper while ``density < 2 * b_dense / (P * (b_value + b_index))``: 50% at P=2,
12.5% at P=8, 1.6% at P=64 for fp32 values and int32 indices.
"""

import torch

from hvd_topk import native, selection
from hvd_topk._horovod import import_horovod_torch

hvd = import_horovod_torch()


def sparse_break_even(world_size, dense_bytes=4, value_bytes=4, index_bytes=4):
    """The density above which a dense allreduce moves fewer bytes than the sparse allgather."""
    if world_size <= 1:
        return 0.0  # nothing moves either way; sparse would only drop information
    return 2.0 * dense_bytes / (world_size * (value_bytes + index_bytes))


def launch_allgather(message, name, process_set):
    return hvd.allgather_async(message, name=name, process_set=process_set)


def scatter_add_ranks(out, values, indices, offset=0, div=1.0, mul=1.0):
    """``out[indices[r] - offset] += values[r]`` for r = 0, 1, ... in order, then every touched
    entry becomes ``out / div * mul`` (once, even where several ranks sent it).

    ``values``/``indices`` are ``[world, k]`` (views of the allgathered messages). Each rank's
    indices are unique, so one rank's adds never collide and the sums are made in rank order:
    the same bits on every rank, on CUDA as on CPU. CPU fp32/fp64 runs in the native kernel.
    """
    if (selection.native_ok(out) and values.dtype == out.dtype and _rows_alike(values, indices)
            and not torch.is_tensor(mul)):
        fn = getattr(native.library(), _SCATTER[out.dtype])
        fn(out.data_ptr(), indices.data_ptr(), indices.element_size(), values.data_ptr(),
           values.shape[0], values.shape[1], values.stride(0) * values.element_size(), offset,
           float(div), float(mul))
        return out
    local = indices - offset if offset else indices
    for r in range(values.shape[0]):
        out.index_add_(0, local[r], values[r].to(out.dtype))
    scale_by = torch.is_tensor(mul) or mul != 1.0  # a tensor (a CUDA probe) is never read here
    if div != 1.0 or scale_by:
        touched = local.reshape(-1)
        scaled = out[touched] / div
        out[touched] = scaled * mul if scale_by else scaled
    return out


_SCATTER = {torch.float32: "hvdtk_scatter_f32", torch.float64: "hvdtk_scatter_f64"}


def _rows_alike(values, indices):
    """Both [world, k] with unit stride inside a row and the same byte stride between rows."""
    return (values.dim() == 2 and values.shape == indices.shape and values.stride(1) == 1
            and indices.stride(1) == 1 and values.device.type == "cpu"
            and values.stride(0) * values.element_size() == indices.stride(0) * indices.element_size())


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
