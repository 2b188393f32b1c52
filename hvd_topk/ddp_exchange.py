"""The DDP hook's transport (``hvd_topk.ddp``): one DDP bucket as the hook sees it
(``BucketLayout``: which tensors are sparse, where they sit in DDP's flat buffer, their residual)
and how its parts travel over ``torch.distributed``: the small tensors averaged by one allreduce
(``average_dense``), the sparse part by the allgather of fixed-size messages, the sparse
allreduce, or a dense allreduce of the accumulator (``exchange_sparse``, the strategy from
``choose``). Every collective is started here, from the hook, in bucket order; the futures'
callbacks only decode (why: ``hvd_topk.ddp``'s docstring).

The functions take the hook's ``TopKState`` for what it holds (codec, options, world, group,
this step's family, statistics).
"""

import itertools

import torch
import torch.distributed as dist

from hvd_topk import auto, costs
from hvd_topk._torch import copy_all
from hvd_topk.codec import (Codec, Encoded, nonfinite_flags, residual_dtype, rotating_part, set_flag, spread_flag,
                            wipe_flagged)
from hvd_topk.selection import native_ok, sample_seed
from hvd_topk.wire import index_dtype_for


class _Strategy:
    """One way a bucket travels over ``torch.distributed``, and its bytes (``hvd_topk.costs``)."""

    def __init__(self, name, sparse, wire_bytes):
        self.name, self.sparse, self.wire_bytes = name, sparse, staticmethod(wire_bytes)


DENSE = _Strategy("dense", False, costs.dense)
DENSE_FP16 = _Strategy("dense_fp16", False, costs.dense_fp16)
ALLGATHER = _Strategy("allgather", True, costs.allgather)
SPARSE_ALLREDUCE = _Strategy("sparse_allreduce", True, costs.sparse_allreduce)


class BucketLayout:
    """One DDP bucket as the hook sees it: which parameters are sparse (at least ``min_numel``
    elements; the hook checks the buffer's dtype once, at the first bucket) and where they sit
    in DDP's flat buffer, this bucket's residual (one flat buffer over its sparse parameters),
    and buffers reused every step."""

    def __init__(self, params, grads, buffer, min_numel, error_feedback):
        self.params = list(params)
        self.key = [id(p) for p in self.params]
        base = buffer.storage_offset()
        spans = [(g.storage_offset() - base, g.numel()) for g in grads]
        self.sparse = [i for i, p in enumerate(self.params) if p.numel() >= max(min_numel, 1)]  # (empty: dense)
        self.dense = [i for i, p in enumerate(self.params) if p.numel() < max(min_numel, 1)]
        self.spans = spans
        self.sizes = [spans[i][1] for i in self.sparse]
        self.edges = [0, *itertools.accumulate(self.sizes)]  # each sparse parameter's [a, b) in acc
        self.bounds = torch.tensor(self.edges, dtype=torch.int64)  # the same, for the codec
        self.numel = self.edges[-1]
        self.dense_numel = sum(spans[i][1] for i in self.dense)
        self.grad_dtype = buffer.dtype  # the gradients', what values travel in
        # the residual (error feedback) or a staging copy
        self.acc = torch.zeros(self.numel, dtype=acc_dtype(buffer.dtype, error_feedback), device=buffer.device)
        self.dense_buffer = torch.empty(self.dense_numel, dtype=buffer.dtype, device=buffer.device)
        self._folder = None  # codec.SegmentFolder over acc, made on first use
        self._dense_scratch = {}  # purpose -> buffer for the small tensors' average (average_dense)
        self.error_feedback = error_feedback
        self.plans = {}     # density -> codec plan
        self.messages = {}  # (purpose, bytes) -> reusable uint8 buffer
        # views made once, not at every step (DDP's buffer keeps its address between rebuilds)
        self.acc_views = [self.acc[a:b] for a, b in zip(self.edges, self.edges[1:])]
        self._sizes_on = {}  # device -> the sparse parameters' sizes there (sizes_on)
        self.dense_views = [self.dense_buffer[a:b] for a, b in _edges([spans[i][1] for i in self.dense])]
        self._buffer_views = {}  # id(which) -> (DDP buffer's address and size, its views at ``which``)

    def dense_scratch(self, purpose, numel, dtype=None):
        """A reusable buffer of the small tensors' dtype (or ``dtype``), reallocated when its
        size changes."""
        dtype = dtype or self.dense_buffer.dtype
        buf = self._dense_scratch.get(purpose)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._dense_scratch[purpose] = torch.empty(numel, dtype=dtype, device=self.dense_buffer.device)
        return buf

    def folder(self, codec):
        """The residual's prepared per-tensor fold (``codec.SegmentFolder``, which also reports
        inf/nan), or None where the native kernel cannot take it (a GPU, bf16)."""
        if self._folder is None and native_ok(self.acc):
            self._folder = codec.segment_folder(self.acc, self.edges)
        return self._folder

    def matches(self, params):
        return [id(p) for p in params] == self.key

    def param_views(self, buffer):
        """Each parameter's gradient in DDP's buffer, shaped and strided as the parameter: DDP lays
        a dense parameter out in its own memory order (channels_last too), where
        ``GradBucket.gradients()`` gives contiguous views, so that an optimizer's per-element
        state (``LocalAdamW``'s moments, made like the parameter) would meet other elements."""
        return [_as_param(buffer[start:start + n], p) for p, (start, n) in zip(self.params, self.spans)]

    def segments(self, flat, which):
        """Views of ``flat`` (DDP's buffer) at the parameters ``which`` (``self.sparse`` or
        ``self.dense``), made again only when the buffer moves (the views hold its storage, so
        an address seen again is the same buffer)."""
        where = (flat.data_ptr(), flat.numel(), flat.dtype)
        made = self._buffer_views.get(id(which))
        if made is None or made[0] != where:
            made = self._buffer_views[id(which)] = (
                where, [flat[self.spans[i][0]:self.spans[i][0] + self.spans[i][1]] for i in which])
        return made[1]

    def sizes_on(self, device):
        """The sparse parameters' sizes as an int64 tensor on ``device``, made once (for wiping
        flagged tensors on the device)."""
        sizes = self._sizes_on.get(device)
        if sizes is None:
            sizes = self._sizes_on[device] = torch.tensor(self.sizes, dtype=torch.int64, device=device)
        return sizes

    def residual_segments(self):
        """(parameter, its residual): a flat view of ``acc`` in the order DDP lays the parameter
        out in its buffer (its memory order)."""
        if not self.error_feedback:
            return []
        return [(self.params[i], seg) for i, seg in zip(self.sparse, self.acc_views)]

    def residuals_by_element(self):
        """(parameter, its residual shaped and strided as the parameter): checkpoints hold these
        in element order, so that a channels_last weight's residual loads into the same weight
        in another memory format element for element."""
        return [(p, _as_param(seg, p)) for p, seg in self.residual_segments()]

    def take_residuals_from(self, old):
        """Copy the residuals of parameters ``old`` also held (DDP rebuilt its buckets)."""
        if not self.error_feedback:
            return
        theirs = {id(p): seg for p, seg in old.residual_segments()}
        for p, seg in self.residual_segments():
            if id(p) in theirs:
                seg.copy_(theirs[id(p)])

    def adopt(self, pending, names):
        """Take loaded residuals (by parameter name) for this bucket's parameters."""
        for p, seg in self.residuals_by_element():
            got = pending.pop(names.get(p), None)
            if got is not None:
                if got.numel() != seg.numel():
                    raise ValueError(f"residual of {names.get(p)!r}: {got.numel()} elements, the parameter has "
                                     f"{seg.numel()}")
                seg.copy_(got.reshape(p.shape))

    def clear(self):
        self.acc.zero_()

    def plan(self, codec, density, parts=1):
        """The codec plan at ``density``; ``parts``: as in ``codec.Plan`` (the sparse allreduce's)."""
        plan = self.plans.get((density, parts))
        if plan is None:
            if len(self.plans) > 8:  # a warm-up walks through many densities
                self.plans.clear()
            plan = self.plans[density, parts] = codec.plan(self.sizes, density, "tensor", self.grad_dtype,
                                                          index_dtype_for(self.numel), parts)
        return plan

    def message(self, purpose, nbytes):
        key = (purpose, nbytes)
        out = self.messages.get(key)
        if out is None:
            if len(self.messages) > 8:
                self.messages.clear()
            out = self.messages[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.acc.device)
        return out


def acc_dtype(grad_dtype, error_feedback):
    """The dtype of a layout's flat buffer (``BucketLayout.acc``), which selection works on: the
    residual's with error feedback (``codec.residual_dtype``: float32 for 16-bit gradients), else
    the gradients' own (a staging copy)."""
    return residual_dtype(grad_dtype) if error_feedback else grad_dtype


def _as_param(flat, p):
    """``flat`` (``p.numel()`` elements as DDP lays ``p`` out) viewed with ``p``'s shape and
    strides: a dense parameter (channels_last too) in its memory order, any other as
    ``view(p.shape)``, as DDP's own bucket views do."""
    return flat.as_strided(p.shape, p.stride()) if _non_overlapping_dense(p) else flat.view(p.shape)


def _non_overlapping_dense(t):
    """Whether ``t``'s elements fill its memory without gaps or overlaps, in some order of its
    dimensions (torch's "non-overlapping and dense", which DDP lays out by memory order)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def average_dense(state, layout, buffer):
    """Start averaging the bucket's small tensors over the ranks (``finish`` divides and writes
    them back); a future of the collective in flight.

    Summed in rank order rather than by an allreduce: a ring allreduce sums each element in an
    order set by where it sits in the buffer, and DDP lays its buckets out again after the first
    step (and a resumed job starts from the first layout), so at 3 ranks and more the same
    gradients could average to results a bit apart, and resume would not be bitwise.
    Two ranks gather each other's tensors: the bytes of an allreduce. With more, a gather would
    bring in P-1 copies, so each rank sums one chunk of every rank's tensors, in rank order (an
    all-to-all, waited for here so that the next collective, too, starts from the hook in bucket
    order), and the summed chunks are gathered: 2 (P-1)/P of their bytes, as an allreduce.
    16-bit tensors' chunks are summed, gathered and divided in float32 and rounded once in
    ``finish`` (added in bf16 one rank at a time, 1 + 2**-8 - 1 read 0 at 3 ranks); at two ranks
    the one bf16 addition already rounds the exact sum once, and the division by 2 is exact."""
    copy_all(layout.dense_views, layout.segments(buffer, layout.dense))
    state._stats.add(bytes_sent=layout.dense_numel * buffer.element_size(), elements_selected=layout.dense_numel)
    world, group, n = state.world_size, state.process_group, layout.dense_numel
    if world == 1:
        done = torch.futures.Future()
        done.set_result(layout.dense_buffer)
        return done
    if world == 2:
        gathered = layout.dense_scratch("gathered", world * n)
        return all_gather(gathered, layout.dense_buffer, group, async_op=True).get_future()
    chunk = _chunk(n, world)
    send = layout.dense_scratch("send", world * chunk)
    send[:n].copy_(layout.dense_buffer)
    send[n:].zero_()
    received = layout.dense_scratch("received", world * chunk)
    dist.all_to_all_single(received, send, group=group)
    rows = received.view(world, chunk)  # every rank's copy of this rank's chunk, in rank order
    wide = residual_dtype(received.dtype)  # float32 for 16-bit tensors
    mine = layout.dense_scratch("chunk", chunk, wide).copy_(rows[0])
    for row in rows[1:]:
        mine.add_(row)
    gathered = layout.dense_scratch("gathered", world * chunk, wide)
    return all_gather(gathered, mine, group, async_op=True).get_future()


def average_sketches(state, optimizer, layout, device):
    """Start averaging this bucket's gradient sketches (``LocalAdamW(variance_sketch=B)``) over
    the ranks; a future that hands the average to ``optimizer.absorb_sketches``. Gathered and
    summed in rank order, as ``average_dense`` is, so that a resumed job sums them as before."""
    rows = optimizer.sketch_rows(layout).to(device)
    state._stats.add(bytes_sent=rows.numel() * rows.element_size())
    world = state.world_size
    gathered = rows.new_empty(world * rows.numel())
    fut = all_gather(gathered, rows, state.process_group, async_op=True).get_future()

    def absorb(_):
        optimizer.absorb_sketches(layout, gathered.view(world, -1).sum(0).div_(world))
    return after(fut, absorb, device)


def _chunk(n, world):
    """The elements each rank sums at 3+ ranks: n split in world chunks, the last zero-padded."""
    return -(-n // world)


def finish(buffer, layout, world):
    """The bucket's result: the small tensors' sum (``average_dense``) divided and written
    back; the sparse part was decoded in place by its own callback."""
    if layout.dense:
        total, n = layout.dense_buffer, layout.dense_numel  # one rank: already its own average
        if world == 2:
            rows = layout.dense_scratch("gathered", world * n).view(world, n)
            total.copy_(rows[0]).add_(rows[1])
            total.div_(world)
        elif world > 2:  # the summed chunks, gathered (float32 for 16-bit tensors: rounded once here)
            summed = layout.dense_scratch("gathered", world * _chunk(n, world), residual_dtype(total.dtype))[:n]
            total.copy_(summed.div_(world))
        copy_all(layout.segments(buffer, layout.dense), layout.dense_views)  # (total is dense_buffer)
    return buffer


def held_members(state, layout, idle):
    """The sparse members (indices into ``layout.sparse``) whose parameters this rank did not
    use this step (``idle``: indices into ``layout.params``, from ``unused_here``); none
    without error feedback, where nothing is kept for later."""
    return [s for s, i in enumerate(layout.sparse) if i in idle] if state.error_feedback else []


def set_aside(state, layout, held, zero=True):
    """Residuals of parameters this rank did not use this step (``held``: their sparse members,
    ``held_members``) sit the step out: with ``zero``, zeroed before the fold and selection,
    so that this rank sends nothing of them (zeros where a fixed-size message needs pairs);
    without (the sparse allreduce, where the positions a rank chooses are sent by every rank,
    so they come from its residual as usual), this rank's values there are zeroed by the
    caller (``held_slots``). Either way they are put back, decayed as every residual is, once
    the exchange no longer reads ``acc``. Returns that put-back (a no-op where nothing sits out).

    Why: with ``find_unused_parameters=True`` DDP leaves ``p.grad`` alone for a parameter no
    rank used this step, and the exchanged result for it goes nowhere; entries selected from
    its residual would be lost. A rank that did not use the parameter sends nothing of it, so
    nothing is lost whether the others used it or not (DDP writes their average into ``p.grad``
    then). Which parameters a rank did not use is ``unused_here``."""
    if not held:
        return _nothing
    segments = layout.acc_views
    kept = [(segments[s], segments[s].clone()) for s in held]
    for segment, _ in kept:
        if zero:
            segment.zero_()

    def put_back():
        for segment, saved in kept:
            segment.copy_(saved)
            if state.residual_decay != 1.0:
                segment.mul_(state.residual_decay)
    return put_back


def _nothing():
    pass


def held_slots(plan, held):
    """The message slots of the sparse allreduce's plan that belong to the members ``held``
    (their pieces in every part): this rank sends zeros there (``set_aside``)."""
    return [(plan.slots[j], plan.slots[j + 1]) for s in held for j in plan.member_segments[s]]


def unused_here(params):
    """The parameters (indices) this rank's backward gave no gradient: ``p.grad`` is None when
    the hook runs. DDP (torch 2.13, checked with and without ``gradient_as_bucket_view``,
    ``find_unused_parameters`` and ``static_graph``) fills an unused parameter's slot of the
    bucket with zeros and leaves its ``.grad`` unset, while a used parameter's ``.grad`` is
    set (its own tensor, or the bucket's view) by the time the bucket is ready. After
    ``zero_grad(set_to_none=False)`` an unused parameter keeps a zero ``.grad`` and is not
    seen here (docs/ddp.md says so)."""
    return {i for i, p in enumerate(params) if p.grad is None}


def _fold(state, layout, buffer, plan=None, message=None, seed=None):
    """``acc = decay * residual + grad`` over the sparse parameters (a staging copy without
    error feedback). With ``plan`` and ``message`` (the allgather's send buffer) on the CPU
    native path, each gradient is folded in and its top-k selected into the message in the same
    pass over memory (``hvd_topk.codec.SegmentEncoder``, as the Horovod optimizer's hooks do);
    returns the ``Encoded`` report then (sampling with ``seed``), None otherwise."""
    grads = layout.segments(buffer, layout.sparse)
    if state.error_feedback and state.residual_decay != 1.0:
        layout.acc.mul_(state.residual_decay)
    if plan is not None and state.error_feedback and native_ok(layout.acc) and buffer.dtype == layout.acc.dtype:
        encoder = state.codec.segment_encoder(layout.acc, plan, message, seed, zero_sent=True)
        bad, repasses, filled = [], 0, 0
        for s, grad in enumerate(grads):
            nonfinite, extra, fill = encoder(s, grad)
            if nonfinite:
                bad.append(s)
            repasses, filled = repasses + extra, filled + fill
        Codec.finish_segments(plan, message, layout.acc.dtype, layout.acc)
        return Encoded(bad, repasses, filled)
    accs = layout.acc_views
    if not state.error_feedback:
        copy_all(accs, grads)
    else:
        torch._foreach_add_(accs, grads)
    return None


def _fold_checked(state, layout, buffer):
    """``_fold`` without selecting, for the sparse allreduce: on the CPU native path each
    gradient is added by ``codec.SegmentFolder``, which reports in the same pass whether the
    segment now holds inf/nan. Returns those segments' numbers, or None where nothing was
    checked (then ``_nonfinite_segments`` reads the residual once more)."""
    folder = layout.folder(state.codec) if state.error_feedback and buffer.dtype == layout.acc.dtype else None
    if folder is None:
        _fold(state, layout, buffer)
        return None
    if state.residual_decay != 1.0:
        layout.acc.mul_(state.residual_decay)
    return [s for s, grad in enumerate(layout.segments(buffer, layout.sparse)) if folder(s, grad)]


def choose(state, layout, plan, world, family):
    """``(strategy, its bytes into one rank)`` for the bucket's sparse part under ``family``
    (None: the fewest bytes of all); a sparse family goes dense where that moves fewer bytes,
    except where the residual is DeMo's momentum (``optim.momentum_in_residual``)."""
    sizes = (world, layout.numel, plan.count, *state.codec.pair_itemsizes(plan), layout.grad_dtype.itemsize)
    keeps = auto.keeps_momentum(state.momentum_in_residual, plan.density)  # DeMo's: no dense then, unless pinned
    fallback = () if keeps else (DENSE_FP16,) if state.codec.dense_fp16 else (DENSE,)
    if family is None:  # auto before its trial: the sparse strategies its families allow, or dense
        allowed = auto.families(False, False, state.compact, updates=state.sends_updates, momentum=keeps)
        options = (*(s for s in (ALLGATHER, SPARSE_ALLREDUCE) if s.name in allowed), *fallback)
    else:
        options = {"dense": (DENSE,), "dense_fp16": (DENSE_FP16,), "allgather": (ALLGATHER, *fallback),
                   "sparse_allreduce": (SPARSE_ALLREDUCE, *fallback)}[family]
    strategy = costs.cheapest(options, *sizes)
    return strategy, strategy.wire_bytes(*sizes)


def exchange_sparse(state, layout, index, step, buffer, idle=()):
    """Start the sparse part's exchange; a future that decodes it into ``buffer``. ``idle``:
    the bucket's parameters (indices into ``layout.params``) this rank did not use this step,
    whose residuals sit out the step (``set_aside``)."""
    world, group = state.world_size, state.process_group
    plan = layout.plan(state.codec, state.schedule.density(step))
    # a rank alone (world 1) does what the smallest job would: dense during a dense start,
    # sparse after (a decaying residual too: ``choose``), so that a one-GPU run trains, and
    # counts bytes, as a 2-rank job does
    strategy = choose(state, layout, plan, max(world, 2), state.family)[0]
    held = held_members(state, layout, idle)
    put_back = set_aside(state, layout, held, zero=strategy is not SPARSE_ALLREDUCE)
    dests = layout.segments(buffer, layout.sparse)
    if strategy is ALLGATHER:
        return _allgather(state, layout, plan, dests, buffer, sample_seed(step, index), put_back)
    if strategy is SPARSE_ALLREDUCE:
        folded_bad = _fold_checked(state, layout, buffer)
        parts = layout.plan(state.codec, plan.density, world)
        return _sparse_allreduce(state, layout, parts, index, step, dests, folded_bad, put_back,
                                 held_slots(parts, held))
    _fold(state, layout, buffer)
    # DENSE or DENSE_FP16: the whole accumulator goes (a dense start): nothing stays behind
    # but, with error feedback, what a narrower wire could not carry (float16, or 16-bit
    # gradients' own dtype over their float32 residual), as the pairs keep their rounding
    wire_dtype = torch.float16 if strategy is DENSE_FP16 else layout.grad_dtype
    wire = layout.acc if wire_dtype == layout.acc.dtype else layout.acc.to(wire_dtype)
    rounded = state.error_feedback and wire is not layout.acc
    if rounded:  # a tensor holding inf/nan, or a value float16 overflowed, restarts from zero
        layout.acc.sub_(wire)
        _wipe(state, layout, _nonfinite_segments(layout))
    state._count(strategy, bytes_sent=wire.numel() * wire.element_size(), elements_selected=layout.numel)
    fut = _allreduce(wire, group)

    def dense_done(f):
        total = f.value()[0] if isinstance(f.value(), list) else f.value()
        copy_all(dests, [total[a:b].to(buffer.dtype).div_(world) for a, b in zip(layout.edges, layout.edges[1:])])
        if not rounded:
            layout.acc.zero_()
        put_back()  # after the collective has read acc
    return after(fut, dense_done, layout.acc.device)


def _allgather(state, layout, plan, dests, buffer, seed, put_back):
    """Every rank's fixed-size message of pairs, gathered; decoded in rank order."""
    world, group = state.world_size, state.process_group
    message = layout.message("send", plan.layout.nbytes)
    encoded = _fold(state, layout, buffer, plan, message, seed)
    if encoded is None:
        encoded = state.codec.encode(layout.acc, plan, message, zero_sent=state.error_feedback, seed=seed)
    _wipe(state, layout, encoded.nonfinite)
    compact = plan.compact() if state.compact else None
    if compact is not None:  # compact pairs; the rounding goes back into the residual
        message = compact.pack(message, residual=layout.acc if state.error_feedback else None)
    put_back()
    gathered = layout.message("gathered", message.numel() * world)
    state._count(ALLGATHER, bytes_sent=message.numel(), elements_selected=plan.count)
    if world == 1:
        gathered.copy_(message)
        fut = torch.futures.Future()
        fut.set_result(gathered)
    else:
        fut = all_gather(gathered, message, group, async_op=True).get_future()

    def gathered_done(f):
        wide = gathered if compact is None else compact.unpack(gathered, world)
        Codec.decode(wide, plan.layout, world, dests, layout.bounds, div=world)
    return after(fut, gathered_done, layout.acc.device)


def _sparse_allreduce(state, layout, plan, index, step, dests, folded_bad, put_back, held=()):
    """ScaleCom's cyclic local top-k over torch.distributed, spread (``hvd_topk.exchange``'s
    ``SparseAllreduce``): this rank chooses the positions in its part of the bucket
    (``plan``: one part per rank), the parts' indices are gathered (waited for here, so that no
    collective is started from a callback), and every rank's ``acc`` there is summed with one
    more slot flagging inf/nan anywhere (``codec.set_flag``). Gloo gathers equal sizes only:
    each part travels padded to the longest (the parts differ by a few pairs: their element
    counts by at most one, their tensor pieces' rounding of k). ``folded_bad``: the tensors
    the native fold found inf/nan in, or None where it did not look."""
    world, group = state.world_size, state.process_group
    message = layout.message("send", plan.layout.nbytes)
    values, indices = plan.layout.views(message)
    sums = layout.message("values", (plan.count + 1) * values.element_size()).view(values.dtype)
    led = plan.part_segments(rotating_part(state.rank, step, index, world))
    # the tensors holding inf/nan, looked for before the encode zeroes what it sends
    bad = folded_bad if folded_bad is not None else _nonfinite_segments(layout)
    state.codec.encode(layout.acc, plan, message, zero_sent=state.error_feedback,
                       seed=sample_seed(step, index), segments=led)
    mine = plan.slot_range(led)
    slots = plan.slots_by_rank(step, index)
    longest = max(hi - lo for lo, hi in slots)
    itemsize = indices.element_size()
    send = layout.message("indices", longest * itemsize).view(indices.dtype)
    send[:mine[1] - mine[0]].copy_(indices[mine[0]:mine[1]])
    send[mine[1] - mine[0]:].zero_()
    gathered = layout.message("indices_gathered", world * longest * itemsize).view(indices.dtype)
    all_gather(gathered, send, group)
    for r, (lo, hi) in enumerate(slots):
        if r != state.rank:
            indices[lo:hi].copy_(gathered[r * longest:r * longest + hi - lo])
    out = values if values.dtype == layout.acc.dtype else plan.value_scratch(layout.acc.dtype, layout.acc.device)
    for lo, hi in ((0, mine[0]), (mine[1], plan.count)):  # the other ranks' parts
        if hi > lo:
            Codec.take(layout.acc, indices[lo:hi], out[lo:hi], zero=state.error_feedback)
            if out is not values:
                values[lo:hi].copy_(out[lo:hi])
                if state.error_feedback:
                    Codec.feed_back(layout.acc, indices[lo:hi], out[lo:hi], values[lo:hi])
    _wipe(state, layout, bad)
    sums[:-1].copy_(values)
    for lo, hi in held:
        sums[lo:hi].zero_()
    put_back()
    set_flag(sums[-1:], bad)
    state._count(SPARSE_ALLREDUCE, elements_selected=plan.count,
                 bytes_sent=longest * itemsize + (plan.count + 1) * values.element_size())
    fut = _allreduce(sums, group)

    def summed_done(f):
        spread_flag(values.copy_(sums[:-1]), sums[-1:])  # inf/nan on some rank: every rank's result shows it
        Codec.decode(message, plan.layout, 1, dests, layout.bounds, div=world)
    return after(fut, summed_done, layout.acc.device)


HOST_READS_FREE = ("cpu",)  # devices whose tensors the host reads without waiting for other work


def _nonfinite_segments(layout):
    """The residual's tensors that hold inf/nan: on the CPU their numbers (a read costs nothing
    there, and the usual answer, none, then wipes nothing); elsewhere one flag per tensor on
    the device (``codec.nonfinite_flags``), never read on the host: a GPU would wait there."""
    if layout.acc.device.type not in HOST_READS_FREE:
        return nonfinite_flags(layout.acc, layout.edges)
    if bool(torch.isfinite(layout.acc).all()):
        return []
    return [s for s, seg in enumerate(layout.acc_views) if not bool(torch.isfinite(seg).all())]


def _wipe(state, layout, bad):
    """The residual's tensors that held inf/nan (``bad``: their numbers, or one flag per tensor
    on the device, the torch-ops encode's or ``_nonfinite_segments``', wiped there without a
    host read) start again from zero (the values still went out)."""
    if not state.error_feedback:
        return
    if torch.is_tensor(bad):
        wiped = wipe_flagged([layout.acc], bad, layout.sizes_on(bad.device), layout.acc.numel())
        state._stats.add_tensor("nonfinite_resets", wiped)
        return
    segments = layout.acc_views
    for s in bad:
        segments[s].zero_()
    state._stats.add(nonfinite_resets=len(bad))


def after(fut, callback, device):
    """A future of ``callback(fut)``, run once the collective behind ``fut`` is done.

    On the CPU: ``fut.then(callback)``, run when the collective ends while backward goes on.
    On a GPU the hook waits for the collective and runs the callback itself, on the stream
    backward uses (NCCL: the wait is a stream dependency, the host does not block; gloo: the
    host waits). A collective's callbacks run on other threads and, for CUDA futures, on
    streams of torch's pool: run that way on an H200 (2026-11-26, gloo), the sparse part of a
    bucket now and then reached DDP before its decode had (cause not pinned down), so on a GPU
    nothing of the hook runs outside its own stream (then 2 and 3 ranks passed every check on an
    H100, 2026-11-27, five runs each)."""
    if device.type != "cuda":
        return fut.then(callback)
    fut.wait()
    done = torch.futures.Future(devices=[device])
    done.set_result(callback(fut))
    return done


def all_gather(out, tensor, group, async_op=False):
    """``all_gather_single`` (torch >= 2.13; ``all_gather_into_tensor`` before, now deprecated)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, tensor, group=group, async_op=async_op)


def _allreduce(tensor, group):
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def _edges(sizes):
    start = 0
    for n in sizes:
        yield start, start + n
        start += n
