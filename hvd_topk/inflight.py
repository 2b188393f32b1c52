"""One bucket's exchange between its launch and its decode: one class per strategy.

The engine launches a bucket once all its gradients are folded in, by building the in-flight
object of the bucket's strategy (``start``): a sparse one first encodes the bucket's message
(select, zero what was sent, pack), then every one starts its first collective. From then on
the engine only calls two methods, whatever the strategy:

- ``advance()``: wait for the collective in flight, start the next one and return True; False
  (at once) when the one in flight is the last. A strategy with one collective never advances; the
  sparse allreduce advances once (the parts' indices -> every rank's values there), the
  hierarchical exchange up to three times (host reduce-scatter -> across hosts -> host
  allgather). ``stage`` names the collective in flight.
- ``decode_into(bucket)``: wait for the rest and write the averaged result into every
  member's ``p.grad``, the same bits on every rank.

The engine advances the buckets in ``synchronize()`` only, stage by stage over all buckets
(``ADVANCE_STAGES``) before decoding any: every bucket's collectives are in flight before any is
waited for; each bucket's first collective has overlapped the rest of backward. Not earlier:

- not when a poll finds a collective arrived: Horovod names a collective started without
  ``name=`` by how many collectives the process has started (``allreduce.noname.<n>``), so a
  user's ``hvd.allreduce(loss)`` between ``backward()`` and ``step()`` meets its peers only if
  every rank has started as many of ours by then (advanced on a poll, the sparse allreduce's
  values stage started on one rank and not on another, and that allreduce hung);
- not by waiting at later launches inside backward: where a parameter gets no gradient on one
  rank, the ranks launch their buckets in different orders (the bucket holding it at the end of
  backward on one rank, in ``synchronize()`` on another), and each waited for a collective the
  other had not started.
"""

import time
from typing import NamedTuple

import torch

from hvd_topk import exchange, hierarchy
from hvd_topk._horovod import allreduce_dtype, hvd
from hvd_topk.buckets import BucketStep
from hvd_topk.codec import Encoded, set_flag, shard_bounds, spread_flag
from hvd_topk.selection import sample_seed

# the stages at which synchronize() advances every bucket, in this order, before decoding any
ADVANCE_STAGES = ("host", "indices", "cross")


class StepContext(NamedTuple):
    """What an exchange needs from its optimizer for one step."""
    codec: object          # hvd_topk.codec.Codec
    stats: object          # hvd_topk.stats.CompressionStats
    process_set: object    # Horovod process set the buckets are exchanged over
    world: int             # its size this step
    rank: int              # this rank's index in it
    op: object             # hvd.Average or hvd.Sum
    predivide: float       # gradient_predivide_factor (dense allreduce)
    error_feedback: bool
    scope: str             # selection_scope
    step: int              # the step counter (the sparse allreduce's choosing ranks rotate with it)
    topology: object       # hierarchy.Topology while this step is hierarchical, else None

    @property
    def div(self):
        return float(self.world) if self.op == hvd.Average else 1.0


def start(ctx, bucket, strategy, name):
    """The in-flight exchange of ``bucket`` under ``strategy`` (its encode done, its first
    collective started)."""
    if not strategy.sparse:
        return DenseExchange(ctx, bucket, strategy, name)
    if bucket.current.hierarchical:
        return HierarchicalExchange(ctx, bucket, strategy, name)
    if strategy is exchange.SparseAllreduce:
        return SparseAllreduceExchange(ctx, bucket, strategy, name)
    return AllgatherExchange(ctx, bucket, strategy, name)


def payload_bytes(strategy, plan, led, codec):
    """What one rank hands to the network for a sparse bucket: its packed message (compact or
    wide), or for the sparse allreduce the indices of its part (``led``, its segments) plus the
    values and the flag slot, in the dtype they are allreduced in (bfloat16 goes as float32)."""
    layout = plan.layout
    if strategy is exchange.SparseAllreduce:
        lo, hi = plan.slot_range(led)
        return (hi - lo) * layout.index_itemsize + (layout.count + 1) * allreduce_dtype(layout.value_dtype).itemsize
    return codec.message_nbytes(plan)


def count_resets(stats, wiped):
    """Add ``Bucket.wipe``'s count (an int, or a device tensor read only with the statistics)."""
    if torch.is_tensor(wiped):
        stats.add_tensor("nonfinite_resets", wiped)
    elif wiped:
        stats.add(nonfinite_resets=wiped)


class DenseExchange:
    """Horovod's ring allreduce of the whole buffer (in the gradients' dtype, bfloat16 as
    float32; or the fp16 wire of ``dense_fp16``).

    With error feedback a sparse bucket's residual then starts again from zero, except for what
    a wire narrower than the residual could not carry (float16, over a float32 residual):
    ``rounded`` keeps ``acc - float16(acc)`` there (computed before the collective, which then
    works on the float16 copy alone), so a dense start or fallback loses no more than the pairs
    do (their rounding stays in the residual too)."""

    stage = "allreduce"

    def __init__(self, ctx, bucket, strategy, name):
        self.ctx, self.strategy = ctx, strategy
        wire_dtype = strategy.wire_dtype(bucket.grad_dtype)
        ctx.stats.add(tensors_dense=len(bucket.members), elements_selected=bucket.numel,
                      bytes_sent=bucket.numel * wire_dtype.itemsize)
        wire = bucket.scratch("wire", bucket.numel, wire_dtype) if wire_dtype != bucket.dtype else None
        self.residual = bucket.sparse and ctx.error_feedback
        self.rounded = self.residual and wire_dtype.itemsize < bucket.dtype.itemsize
        # where the wire is narrower and the residual keeps its rounding: summed on the wire and
        # divided by P after, in the bucket's dtype (Horovod's Average divides the float16 sum in
        # float16, where a small average underflowed to zero, or rounded up, after the residual
        # had been debited in full; the DDP hook divides after too). A gradient_predivide_factor
        # asks for Horovod's own split of the division (against a float16 sum's overflow): kept
        self.divide = float(ctx.world) if self.rounded and ctx.op == hvd.Average and ctx.predivide == 1.0 else None
        if self.rounded:
            wire.copy_(bucket.acc)
            bucket.acc.sub_(wire)  # what the narrower wire could not carry stays behind
            # an inf/nan, or a value float16 overflowed, went out as inf/nan (a GradScaler skips
            # the step): the bucket's residuals restart from zero, counted, as the sparse
            # allreduce does with one device flag (no host synchronisation)
            bad = ~torch.isfinite(bucket.acc).all()
            count_resets(ctx.stats, bucket.wipe(bad, bucket.bounds.tolist()))
            self.handle = strategy.start(wire, name, ctx.process_set, hvd.Sum if self.divide else ctx.op,
                                         ctx.predivide)
        else:
            self.handle = strategy.start(bucket.acc, name, ctx.process_set, ctx.op, ctx.predivide, wire=wire)

    def advance(self):
        return False

    def decode_into(self, bucket):
        t0 = time.perf_counter()
        result = self.strategy.finish(self.handle)
        if self.divide:
            result = bucket.scratch("average", bucket.numel, bucket.dtype).copy_(result).div_(self.divide)
        bucket.write_grads(result)
        bucket.sent_whole(restart_residual=self.residual and not self.rounded)
        self.ctx.stats.add(time_exchange_s=time.perf_counter() - t0)


class _FlatSparse:
    """A sparse exchange of the whole bucket: encoding its message at launch is shared."""

    def _encode(self, ctx, bucket, current, bytes_sent=None, selected=None):
        """Select (unless the hooks did, segment by segment), zero what was sent, pack; then
        error feedback's after-care: momentum masking, wiping a residual that held inf/nan.
        ``bytes_sent``: what this rank hands to the network, where not its packed pairs;
        ``selected``: the entries it sends, where not every slot of the plan."""
        t0 = time.perf_counter()
        plan, message, ef = current.plan, current.message, ctx.error_feedback
        encoded = Encoded([], 0, 0)
        if current.encode is not None:
            ctx.codec.finish_segments(plan, message, bucket.dtype, bucket.acc if ef else None,
                                      plan.slot_range(current.led))
            encoded = Encoded(current.nonfinite, current.repasses, current.filled)
        elif current.selects:
            encoded = ctx.codec.encode(bucket.acc, plan, message, zero_sent=ef,
                                       seed=sample_seed(ctx.step, bucket.index), segments=current.led)
        if current.selects:
            current.nonfinite = encoded.nonfinite
            if ef:
                lo, hi = plan.slot_range(current.led)
                bucket.forget_sent(plan.layout.views(message)[1][lo:hi])
                count_resets(ctx.stats, bucket.wipe(encoded.nonfinite, plan.starts))
        ctx.stats.add(time_selection_s=time.perf_counter() - t0 + current.seconds,
                      tensors_sparse=len(bucket.members),
                      elements_selected=plan.count if selected is None else selected,
                      bytes_sent=payload_bytes(current.strategy, plan, current.led, ctx.codec)
                      if bytes_sent is None else bytes_sent,
                      selection_repasses=encoded.repasses, selection_filled=encoded.filled)


class AllgatherExchange(_FlatSparse):
    """Every rank's packed pairs to every rank; each decodes them all, in rank order."""

    stage = "allgather"

    def __init__(self, ctx, bucket, strategy, name):
        self.ctx, self.strategy = ctx, strategy
        self._encode(ctx, bucket, bucket.current)
        self.plan = bucket.current.plan
        message = bucket.current.message
        if ctx.codec.compact:  # compact pairs; the rounding goes back into the residual
            t0 = time.perf_counter()
            message = self.plan.compact().pack(message, residual=bucket.acc if ctx.error_feedback else None)
            ctx.stats.add(time_selection_s=time.perf_counter() - t0)
        self.handle = strategy.start(message, name, ctx.process_set)

    def advance(self):
        return False

    def decode_into(self, bucket):
        t0 = time.perf_counter()
        gathered = self.strategy.finish(self.handle)
        if self.ctx.codec.compact:
            gathered = self.plan.compact().unpack(gathered, self.ctx.world)
        bucket.decode_grads(self.ctx.codec, gathered, self.plan.layout, self.ctx.world, self.ctx.div)
        self.ctx.stats.add(time_exchange_s=time.perf_counter() - t0)


class JoinedPairsExchange(_FlatSparse):
    """A step in which a rank is inside ``hvd.join()``, where the residual is DeMo's momentum:
    Horovod's joined ranks answer allreduces (with zeros), not allgathers, so this rank's
    chosen pairs are written into a zeroed buffer of the bucket's size, which a dense allreduce
    averages (result = the active ranks' pairs summed / size, as the allgather's decode gives
    with the joined ranks sending nothing). The other entries stay in the momentum; sending it
    whole would move every entry by DeMo's sign step and wipe the momentum."""

    name = "joined_pairs"  # what ``compression_stats()["bucket_strategies"]`` shows
    stage = "allreduce"

    def __init__(self, ctx, bucket, name):
        self.ctx = ctx
        current = bucket.current
        lo, hi = current.plan.slot_range(current.led)  # with the sparse allreduce: the parts it leads
        self._encode(ctx, bucket, current, bytes_sent=bucket.numel * bucket.dtype.itemsize, selected=hi - lo)
        values, indices = current.plan.layout.views(current.message)
        dense = bucket.scratch("joined", bucket.numel, bucket.dtype).zero_()
        dense.index_copy_(0, indices[lo:hi].long(), values[lo:hi].to(bucket.dtype))
        self.handle = exchange.DenseAllreduce.start(dense, name, ctx.process_set, ctx.op, ctx.predivide)

    def advance(self):
        return False

    def decode_into(self, bucket):
        t0 = time.perf_counter()
        bucket.write_grads(exchange.DenseAllreduce.finish(self.handle))
        self.ctx.stats.add(time_exchange_s=time.perf_counter() - t0)


class SparseAllreduceExchange(_FlatSparse):
    """Every rank's part of the indices ("indices"), then every rank's values there summed
    ("values")."""

    def __init__(self, ctx, bucket, strategy, name):
        self.ctx, self.strategy, self.name = ctx, strategy, name
        current = bucket.current
        self._encode(ctx, bucket, current)
        self.bucket, self.current, self.plan = bucket, current, current.plan
        self.indices = self.plan.layout.views(current.message)[1]
        self.stage = "indices"
        part = strategy.part(ctx.rank, ctx.step, bucket.index, ctx.world)
        self.handle = strategy.start_indices(self.indices, self.plan, part, name, ctx.process_set)

    def advance(self):
        if self.stage != "indices":
            return False
        self.strategy.finish_indices(self.handle, self.indices, self.plan, self.ctx.step, self.bucket.index)
        values = gather_values(self.ctx, self.bucket, self.current, self.plan, self.bucket.acc)
        self.stage, self.handle = "values", self.strategy.start_values(values, self.name, self.ctx.process_set)
        return True

    def decode_into(self, bucket):
        self.advance()
        t0 = time.perf_counter()
        result = sparse_allreduce_result(bucket, self.handle, self.plan, self.current.message)
        # one row of pairs: the chosen indices with the summed values
        bucket.decode_grads(self.ctx.codec, result, self.plan.layout, 1, self.ctx.div)
        self.ctx.stats.add(time_exchange_s=time.perf_counter() - t0)


def gather_values(ctx, bucket, current, plan, residual):
    """The sparse allreduce's second half on this rank: its values at every part's indices
    (those of the part it chose are in its message already; the others are taken out of
    ``residual``, the bucket's buffer or a hierarchical shard, with error feedback), and a last
    slot that is NaN when this rank's accumulator held inf/nan, 0 otherwise."""
    layout = plan.layout
    sent, indices = layout.views(current.message)
    k = layout.count
    values = bucket.scratch("values", k + 1, allreduce_dtype(layout.value_dtype))
    mine = plan.slot_range(current.led)
    values[mine[0]:mine[1]].copy_(sent[mine[0]:mine[1]])
    chosen = current.nonfinite
    bad = bool(chosen) if isinstance(chosen, list) else chosen.any()
    bad = bad | bool(current.nonfinite_folds)
    if current.unchecked:
        bad = ~torch.isfinite(residual).all() | bad  # a device tensor: no host sync
    for lo, hi in ((0, mine[0]), (mine[1], k)):  # the other ranks' parts
        if hi > lo:
            ctx.codec.take(residual, indices[lo:hi], values[lo:hi], zero=ctx.error_feedback)
            if ctx.error_feedback:
                bucket.forget_sent(indices[lo:hi])
    if ctx.error_feedback:
        # checking folds noted the members that held inf/nan; otherwise one device flag
        wipe = bad if current.unchecked else current.nonfinite_folds
        flats = (residual, bucket.momentum) if current.unchecked else None
        count_resets(ctx.stats, bucket.wipe(wipe, bucket.bounds.tolist(), flats))
    set_flag(values[k:], bad)
    return values


def sparse_allreduce_result(bucket, handle, plan, message):
    """The summed values, written back into ``message`` beside the chosen indices (a one-row
    message for ``decode``); every value is NaN when a rank flagged inf/nan."""
    exchange.SparseAllreduce.finish(handle)
    k = plan.layout.count
    values = bucket.scratch("values", k + 1, allreduce_dtype(plan.layout.value_dtype))
    spread_flag(values[:k], values[k:])
    sent, _ = plan.layout.views(message)
    sent.copy_(values[:k])
    return message


class HierarchicalExchange:
    """Dense inside each host, sparse across hosts (``hvd_topk.hierarchy``), stage by stage:

    - "host": the host's reduce-scatter of this step's gradients -> error feedback and Top-K on
      this rank's shard of the host's sum, then the exchange among the ranks with this local
      rank ("cross"; the sparse allreduce first allgathers the parts' indices, "indices");
    - "cross": its result -> the allgather of the exchanged shards inside the host ("gather");
    - "gather": every shard's pairs, decoded into ``p.grad`` by ``decode_into``.
    """

    def __init__(self, ctx, bucket, strategy, name):
        self.ctx, self.strategy, self.name = ctx, strategy, name
        self.bucket, self.plan = bucket, bucket.current.plan
        self.current = None    # sparse allreduce: this rank's role among the ranks across hosts
        self.residual = None   # sparse allreduce: the shard residual its values are taken from
        self.rows = 1          # rows of pairs per shard in the result
        self.times = {"spent": 0.0, "selection": 0.0, "cross": 0.0}  # seconds, for the statistics
        led = self.plan.part_segments(strategy.part(ctx.topology.cross_rank, ctx.step, bucket.index,
                                                    ctx.topology.cross_size)) \
            if strategy is exchange.SparseAllreduce else None
        ctx.stats.add(tensors_sparse=len(bucket.members), elements_selected=self.plan.count,
                      bytes_sent=payload_bytes(strategy, self.plan, led, ctx.codec))
        # the host's reduce-scatter of this step's gradients in their own dtype; in the buffer's
        # (float32 for 16-bit ones) on a step whose buffer still carries a flat residual
        wire_dtype = allreduce_dtype(bucket.dtype if bucket.current.carry else bucket.grad_dtype)
        staged = bucket.acc
        if wire_dtype != bucket.dtype:
            staged = bucket.scratch("wire", bucket.numel, wire_dtype).copy_(bucket.acc)
        self.stage = "host"
        host_bytes = staged.numel() * staged.element_size()
        ctx.stats.add(bytes_sent=host_bytes, bytes_host=host_bytes)
        self.handle = hierarchy.reduce_scatter(staged, ctx.topology.local, name + ".host")

    def advance(self):
        if self.stage == "gather":
            return False
        t0 = time.perf_counter()
        topo = self.ctx.topology
        if self.stage == "host":
            shard = hvd.synchronize(self.handle)
            self.times["host"] = time.perf_counter() - t0
            self._select_shard(shard)
        elif self.stage == "indices":
            self.strategy.finish_indices(self.handle, self.indices, self.plan, self.ctx.step,
                                         self.bucket.index)
            self.times["cross"] += time.perf_counter() - t0
            values = gather_values(self.ctx, self.bucket, self.current, self.plan, self.residual)
            self.stage, self.handle = "cross", self.strategy.start_values(values, self.name + ".cross", topo.cross)
        else:  # "cross"
            if self.strategy is exchange.SparseAllreduce:
                result = sparse_allreduce_result(self.bucket, self.handle, self.plan, self.current.message)
            else:
                result, self.rows = self.strategy.finish(self.handle), topo.cross_size
            self.times["cross"] += time.perf_counter() - t0
            # inside the host the shards' results travel still compressed, and every rank decodes all
            host_bytes = result.numel() * result.element_size()
            self.ctx.stats.add(bytes_sent=host_bytes, bytes_host=host_bytes)
            self.stage, self.handle = "gather", hvd.allgather_async(result, name=self.name + ".gather",
                                                                    process_set=topo.local)
        self.times["spent"] += time.perf_counter() - t0
        return True

    def _select_shard(self, shard):
        """Host sum of this rank's shard -> error feedback and Top-K on it -> start the exchange
        among the ranks with this local rank."""
        ctx, bucket, plan, strategy = self.ctx, self.bucket, self.plan, self.strategy
        topo, ef = ctx.topology, ctx.error_feedback
        residual = bucket.shard_residual(shard.numel())
        if ef:
            residual.add_(shard)
        else:
            residual.copy_(shard)
        message = bucket.message(plan.layout.nbytes)
        t0 = time.perf_counter()
        if strategy is exchange.SparseAllreduce:
            part = strategy.part(topo.cross_rank, ctx.step, bucket.index, topo.cross_size)
            # the shard was summed by the reduce-scatter: nothing checked the other parts for inf/nan
            self.current = BucketStep(plan, strategy, message, None, plan.part_segments(part), unchecked=True)
            encoded = ctx.codec.encode(residual, plan, message, zero_sent=ef,
                                       seed=sample_seed(ctx.step, bucket.index), segments=self.current.led)
            self.current.nonfinite = encoded.nonfinite
            self._wipe_shard(residual, encoded.nonfinite)
            self.residual = residual
            self.indices = plan.layout.views(message)[1]
            self.stage = "indices"
            self.handle = strategy.start_indices(self.indices, plan, part, self.name + ".cross", topo.cross)
        else:
            encoded = ctx.codec.encode(residual, plan, message, zero_sent=ef,
                                       seed=sample_seed(ctx.step, bucket.index))
            self._wipe_shard(residual, encoded.nonfinite)
            self.stage, self.handle = "cross", strategy.start(message, self.name + ".cross", topo.cross)
        self.times["selection"] = time.perf_counter() - t0

    def _wipe_shard(self, residual, nonfinite):
        if self.ctx.error_feedback:
            count_resets(self.ctx.stats, self.bucket.wipe(nonfinite, self.plan.starts, (residual,)))

    def decode_into(self, bucket):
        """Every shard's exchanged pairs (``rows`` rows each, shard after shard) into ``p.grad``."""
        while self.advance():
            pass
        t0 = time.perf_counter()
        every = hvd.synchronize(self.handle)
        self.times["gather"] = time.perf_counter() - t0
        ctx = self.ctx
        full = bucket.scratch("hierarchical_result", bucket.numel, bucket.dtype)
        edges, offset = shard_bounds(bucket.numel, ctx.topology.local_size), 0
        for a, b in zip(edges, edges[1:]):
            part = bucket.plan(ctx.codec, self.plan.density, ctx.scope, shard=(a, b), parts=self.plan.parts)
            size = self.rows * part.layout.nbytes
            ctx.codec.decode(every[offset:offset + size], part.layout, self.rows, [full[a:b]],
                             torch.tensor([0, b - a], dtype=torch.int64), div=ctx.div)
            offset += size
        bucket.write_grads(full)
        times = self.times
        spent = times["spent"] + time.perf_counter() - t0
        ctx.stats.add(time_exchange_s=spent - times["selection"], time_selection_s=times["selection"],
                      time_host_reduce_s=times["host"], time_cross_s=times["cross"],
                      time_host_gather_s=times["gather"])
