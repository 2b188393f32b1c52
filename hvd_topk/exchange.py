"""Exchange strategies: how one bucket's payload moves between ranks, and what it costs.

Every strategy answers the cost question the same way for the optimizer, the benchmarks'
scaling model, the DDP hook and the tests: ``wire_bytes(world, numel, count, value_bytes,
index_bytes, dense_bytes)`` (``hvd_topk.costs``) is the bytes into one rank per exchange of a
buffer of ``numel`` elements of which ``count`` pairs are selected (ring algorithms, the model
Horovod's collectives follow).
The collectives themselves are started and finished by ``hvd_topk.inflight`` (one bucket's
exchange in flight) through the strategies' ``start``/``finish`` helpers.

======================  ======================================================  ==============================
strategy                what moves                                              bytes into one rank
======================  ======================================================  ==============================
``DenseAllreduce``      ring allreduce of the whole buffer                      ``2 (P-1)/P n b_dense``
``DenseAllreduceFp16``  the same in float16 (Horovod's ``Compression.fp16``)    ``2 (P-1)/P n 2``
``AllgatherPairs``      every rank receives every other rank's k pairs          ``(P-1) k (b_v + b_i)``
``SparseAllreduce``     each rank's part of the k indices allgathered, then an  ``(P-1)/P k b_i + 2 (P-1)/P (k+1) b_v``
                        allreduce of every rank's values at those indices
======================  ======================================================  ==============================

``SparseAllreduce`` is ScaleCom's cyclic local top-k (CLT-k, Chen et al., NeurIPS 2020), with
the choosing spread over the ranks: each bucket is cut into P equal parts (``codec.Plan``'s
``parts``), and rank ``(j + step + bucket) mod P`` chooses part j's positions, the top-k of
its own error-feedback accumulator there (k per tensor piece, or per part with bucket scope);
the parts' indices are allgathered, every rank sends its accumulator's values at all of them,
and the sum is exact for those positions. Every rank sends as many bytes as any other (one
choosing rank per bucket broadcasting all k indices made it the busiest link: 1.82x the median
rank's bytes at P=8, issue 27), and they stay below ``k (b_i + 2 b_v)`` whatever P is (the
allgather's grow as P-1), at the price of a second, dependent collective and of one rank's
choice of positions per part (error feedback keeps what each rank did not send; on correlated
gradients one rank's top-k is close to everyone's, and each part's choosing rank rotates).

Sparse pays while ``density < 2 b_dense / (P (b_v + b_i))`` for the allgather (50% at P=2,
12.5% at P=8, 1.6% at P=64 for fp32 values and int32 indices; ``sparse_break_even``), and up
to about ``b_dense / (b_i / 2 + b_v)`` = 67% for the sparse allreduce at any P.
"""

import torch

from hvd_topk import costs
from hvd_topk._horovod import allreduce_dtype, hvd
from hvd_topk.codec import rotating_part
from hvd_topk.costs import cheapest  # noqa: F401  (re-exported: the benchmarks' name for it)


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
    def wire_dtype(dtype):
        return allreduce_dtype(dtype)

    wire_bytes = staticmethod(costs.dense)

    @classmethod
    def start(cls, tensor, name, process_set, op, predivide=1.0, wire=None):
        """Horovod's split of Average into pre- and post-scaling, as its optimizer does.
        ``wire``: a reusable buffer of ``wire_dtype`` when that differs from the tensor's.
        Returns a handle for ``finish``."""
        pre, post = (1.0 / predivide, predivide) if op == hvd.Average else (1.0, 1.0)
        if cls.wire_dtype(tensor.dtype) == tensor.dtype:
            wire = tensor
        else:
            wire = (wire if wire is not None else torch.empty(
                tensor.numel(), dtype=cls.wire_dtype(tensor.dtype), device=tensor.device)).copy_(tensor)
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


class DenseAllreduceFp16(DenseAllreduce):
    """``DenseAllreduce`` in float16, as Horovod's ``Compression.fp16`` does: half the bytes,
    values rounded to float16 (and summed in it). With error feedback the cast's rounding stays
    in the residual, as the pairs' float16 values keep theirs (``inflight.DenseExchange``, which
    then hands ``start`` the float16 copy itself); the sum's own rounding is not kept."""

    name = "dense_fp16"

    @staticmethod
    def wire_dtype(dtype):
        return torch.float16

    wire_bytes = staticmethod(costs.dense_fp16)


class AllgatherPairs:
    """Allgather of every rank's packed (value, index) message; grows with the number of ranks."""

    name = "allgather"
    sparse = True

    wire_bytes = staticmethod(costs.allgather)

    @staticmethod
    def start(message, name, process_set):
        return hvd.allgather_async(message, name=name, process_set=process_set)

    @staticmethod
    def finish(handle):
        """The gathered messages, rank after rank (a uint8 tensor)."""
        return hvd.synchronize(handle)


class SparseAllreduce:
    """ScaleCom's cyclic local top-k, spread: each rank's part of the indices, then an
    allreduce of every rank's values there.

    Two dependent collectives per bucket: ``start_indices`` allgathers the parts' indices
    (each rank chose one part's, ``part``); once they have arrived every rank gathers its
    accumulator's values there and ``start_values`` allreduces them (summed; the engine divides
    when it decodes, as for the allgather). One extra value slot carries a non-finite flag, so
    an inf/nan on any rank reaches every rank's result (GradScaler then skips the step
    everywhere) even where it lies outside the positions chosen.
    """

    name = "sparse_allreduce"
    sparse = True

    part = staticmethod(rotating_part)  # (rank, step, bucket_index, world) -> the part it chooses

    wire_bytes = staticmethod(costs.sparse_allreduce)

    @staticmethod
    def start_indices(indices, plan, part, name, process_set):
        """Start gathering every rank's part of ``indices`` (this rank's is ``part``'s slots)."""
        lo, hi = plan.slot_range(plan.part_segments(part))
        return hvd.allgather_async(indices[lo:hi], name=name + ".indices", process_set=process_set)

    @staticmethod
    def finish_indices(handle, indices, plan, step, bucket_index):
        """Write every rank's part, gathered in rank order, into its slots of ``indices``."""
        gathered, offset = hvd.synchronize(handle), 0
        for lo, hi in plan.slots_by_rank(step, bucket_index):
            indices[lo:hi].copy_(gathered[offset:offset + hi - lo])
            offset += hi - lo

    @staticmethod
    def start_values(values, name, process_set):
        """Sum every rank's values (in place) into ``values``."""
        return hvd.allreduce_async_(values, name=name + ".values", op=hvd.Sum, process_set=process_set)

    @staticmethod
    def finish(handle):
        hvd.synchronize(handle)


class ActiveRanks:
    """How many ranks of a process set take part in this round.

    ``start`` allreduces 1 from this rank (fire and forget); ``read`` gives the sum (waiting if
    need be). A rank inside ``hvd.join()`` answers allreduces with zeros but not allgathers or
    broadcasts (its background loop stops: horovod#3471), so a sum below the set's size means a
    rank has joined and only allreduces may follow in this round.
    """

    MODULUS = 2 ** 20  # values compared modulo this: n x the sum of squares stays exact in float64

    def __init__(self, name):
        self.name = name
        self.one = torch.ones(1)
        self.forget()

    def start(self, process_set, step=None, settings=0):
        """With ``step``, the probe also carries it and ``settings`` (an integer digest of what
        must be equal on every rank), each as ``v, v^2`` with ``v`` modulo ``MODULUS``, in
        float64: ``steps_agree`` and ``settings_agree`` then say whether every rank taking part
        has the same (n x sum(v^2) == sum(v)^2 only when all are equal; a joined rank's zeros
        count for nothing)."""
        probe = self.one
        if step is not None:
            s, h = float(step % self.MODULUS), float(settings % self.MODULUS)
            probe = torch.tensor([1.0, s, s * s, h, h * h], dtype=torch.float64)
        self.forget()
        self.handle = hvd.allreduce_async(probe, name=self.name, op=hvd.Sum, process_set=process_set)

    def read(self):
        """The ranks taking part (None when not started this round)."""
        if self.handle is not None:
            sums = hvd.synchronize(self.handle)
            self.count, self.handle = int(sums[0]), None
            if sums.numel() == 5:
                self.steps_agree = bool(sums[0] * sums[2] == sums[1] * sums[1])
                self.settings_agree = bool(sums[0] * sums[4] == sums[3] * sums[3])
        return self.count

    def forget(self):
        self.handle, self.count, self.steps_agree, self.settings_agree = None, None, True, True


BY_NAME = {s.name: s for s in (DenseAllreduce, DenseAllreduceFp16, AllgatherPairs, SparseAllreduce)}


def sparse_break_even(world_size, dense_bytes=4, value_bytes=4, index_bytes=4, strategy=AllgatherPairs):
    """The density at which ``strategy`` moves as many bytes as a dense allreduce
    (``hvd_topk.costs.break_even``); 0 for one rank (sparse would only drop data)."""
    return costs.break_even(world_size, strategy.wire_bytes, dense_bytes, value_bytes, index_bytes)
