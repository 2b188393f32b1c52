"""Fusion buckets: which parameters travel in one message, and the flat buffer each one keeps.

A bucket's parameters are laid end to end in one contiguous buffer (``acc``). For a sparse
bucket with error feedback it *is* the residual: each gradient is folded in as it arrives
(``acc[tensor] += grad``), selection runs over the whole buffer in one call, and the sent
entries are zeroed there. Without error feedback, and for the dense bucket of small tensors,
it is a staging copy of this step's gradients. With DGC momentum correction a second buffer
(``momentum``) holds ``u``, in every bucket. A residual of 16-bit parameters is float32
(``codec.residual_dtype``). Buffers are allocated on first use and live as long as the
optimizer: the native (CPU) path allocates nothing per step; the torch-ops path (CUDA, float64)
still makes temporaries inside torch calls (the non-finite wipe's mask, a decode's zeroed sum).

Buckets are planned identically on every rank (same order, same members), which is what lets
every rank name and size its messages alike.
"""

import dataclasses
from typing import NamedTuple

import torch

from hvd_topk._horovod import allreduce_dtype
from hvd_topk._torch import copy_all
from hvd_topk.codec import residual_dtype, segments_in, wipe_flagged
from hvd_topk.checks import check_integer
from hvd_topk.selection import native_ok
from hvd_topk.wire import index_dtype_for


class Member(NamedTuple):
    """One parameter's place in its bucket's flat buffer."""
    param: torch.Tensor
    name: str
    offset: int
    numel: int


@dataclasses.dataclass
class BucketStep:
    """One bucket's choices in the current step, fixed at its first fold (``bucket.current``)."""
    plan: object          # codec.Plan (None for a dense-only bucket)
    strategy: type        # exchange strategy (``hvd_topk.exchange``)
    message: object       # send buffer (sparse strategies)
    encode: object        # codec.SegmentEncoder: select each tensor as it is folded in (or None)
    # the plan's segments this rank selects: all (None); its part's (the sparse allreduce); none
    led: range = None
    nonfinite: list = dataclasses.field(default_factory=list)  # selected segments that held inf/nan
    nonfinite_folds: list = dataclasses.field(default_factory=list)  # unselected members that did
    unchecked: bool = False  # a fold that did not check for inf/nan (outside what this rank selects)
    hierarchical: bool = False  # a sparse strategy run hierarchically (hvd_topk.hierarchy)
    carry: bool = False      # hierarchical: the full buffer still holds a flat residual
    repasses: int = 0
    filled: int = 0
    seconds: float = 0.0  # selection time spent in hooks

    @property
    def selects(self):
        return self.led is None or len(self.led) > 0

    def leads(self, member):
        """Whether this rank selects every element of ``member`` (a ``Member``)."""
        if self.led is None:
            return True
        if not self.led:
            return False
        starts = self.plan.starts
        return starts[self.led.start] <= member.offset and member.offset + member.numel <= starts[self.led.stop]

    def led_segments(self, position):
        """The segments of member ``position`` this rank selects (tensor scope)."""
        segments = self.plan.member_segments[position]
        if self.led is None:
            return segments
        return range(max(segments.start, self.led.start), min(segments.stop, self.led.stop))


class Bucket:
    """Parameters that travel in one message.

    ``sparse`` buckets are Top-K candidates (the exchange strategy may still send one dense on
    a step); the others hold small tensors and always go dense. ``residual``: the buffer keeps
    error feedback's residual (a sparse bucket with error feedback): float32 for 16-bit
    parameters (``dtype``, the buffer's; ``grad_dtype``, the parameters' and the values').
    """

    def __init__(self, index, params, names, sparse, residual=False):
        self.index = index
        self.sparse = sparse
        self.members, offset = [], 0
        for p in params:
            self.members.append(Member(p, names[p], offset, p.numel()))
            offset += p.numel()
        self.numel = offset
        first = params[0]
        self.grad_dtype, self.device = first.dtype, first.device
        self.dtype = residual_dtype(first.dtype) if residual else first.dtype
        self.index_dtype = index_dtype_for(self.numel)
        self.bounds = torch.tensor([m.offset for m in self.members] + [self.numel], dtype=torch.int64)
        self.acc = None        # flat buffer: residual (error feedback) or staging copy
        self.momentum = None   # flat buffer: DGC's u, only with momentum correction
        self.shard = None      # hierarchical: this rank's residual on its shard of the host sum
        self.mode = None       # "flat" or "hier": how the residual was kept at the last step
        self.folded = set()    # members folded in this step (by position)
        self.current = None    # this step's BucketStep, from the first fold
        self.inflight = None   # the exchange in flight (``hvd_topk.inflight``), launch to decode
        self._plans = {}       # (density, scope, value dtype) -> codec.Plan
        self._segment_sizes = {}  # segment edges -> their sizes on the device (``wipe``)
        self._message = None   # reused send buffer
        self._acc_views = None  # each member's part of ``acc``, shaped like its parameter
        self._folder = None    # codec.SegmentFolder over ``acc`` (a non-selecting rank's fold)
        self._scratch = {}     # purpose -> reused buffer (scratch)

    # ---- buffers ---------------------------------------------------------------------------
    def buffer(self):
        if self.acc is None:
            self.acc = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return self.acc

    def shard_residual(self, numel):
        """Hierarchical exchange: the residual of this rank's shard (``numel`` elements)."""
        if self.shard is None or self.shard.numel() != numel:
            self.shard = torch.zeros(numel, dtype=self.dtype, device=self.device)
        return self.shard

    def momentum_buffer(self):
        if self.momentum is None:
            self.momentum = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return self.momentum

    def view(self, flat, member):
        """``member``'s part of a flat buffer, shaped like its parameter."""
        return flat[member.offset:member.offset + member.numel].view(member.param.shape)

    def acc_views(self):
        """``view(acc, member)`` of every member, made once: ``acc`` lives as long as the bucket."""
        if self._acc_views is None:
            acc = self.buffer()
            self._acc_views = [self.view(acc, m) for m in self.members]
        return self._acc_views

    def views(self, flat):
        """Every member's part of ``flat``, shaped like its parameter."""
        return self.acc_views() if flat is self.acc else [self.view(flat, m) for m in self.members]

    def segment(self, flat, position):
        m = self.members[position]
        return flat[m.offset:m.offset + m.numel]

    # ---- one step --------------------------------------------------------------------------
    def fold(self, position, grad, accumulate, momentum=0.0):
        """Fold one member's gradient into the buffer (``grad`` None: no gradient this step).

        ``accumulate``: error feedback, ``acc += grad`` (DGC: ``u = m u + grad; acc += u``);
        otherwise the buffer takes a copy of the gradient (zeros when there is none).
        """
        member = self.members[position]
        acc = self.acc_views()[position]
        if accumulate and momentum:
            u = self.view(self.momentum_buffer(), member)
            u.mul_(momentum)
            if grad is not None:
                u.add_(grad)
            acc.add_(u)
        elif accumulate:
            if grad is not None:
                acc.add_(grad)
        elif grad is not None:
            acc.copy_(grad)
        else:
            acc.zero_()
        self.folded.add(position)

    def mark_folded(self, position):
        """The caller folded this member's gradient into ``acc`` itself (the native fused fold),
        or will with ``copy_in`` when the bucket launches."""
        self.buffer()
        self.folded.add(position)

    def copy_in(self):
        """Every member's gradient into ``acc`` (zeros where it has none) in one call: the fold
        of a bucket that only stages this step's gradients (the dense bucket of small tensors,
        no error feedback), done once the bucket is complete instead of one copy per hook."""
        dests, grads = [], []
        for m, view in zip(self.members, self.acc_views()):
            grad = m.param.grad
            if grad is None:
                view.zero_()
            else:
                dests.append(view)
                grads.append(grad)
        if dests:
            copy_all(dests, grads)

    def folder(self, codec):
        """The prepared per-member fold into ``acc`` (``codec.SegmentFolder``), or None where
        the native kernel cannot take the buffer."""
        if self._folder is None and native_ok(self.buffer()):
            self._folder = codec.segment_folder(self.acc, self.bounds.tolist())
        return self._folder

    def complete(self):
        return len(self.folded) == len(self.members)

    def plan(self, codec, density, scope, shard=None, parts=1):
        """The codec's plan for this bucket at ``density`` (cached: it changes only in warm-up).
        ``shard``: ``(lo, hi)``, a plan over that part of the buffer alone (hierarchical), its
        tensors cut at the shard's edges, its indices counted from ``lo``. ``parts``: as in
        ``codec.Plan`` (the sparse allreduce's one part per rank). The values travel in the
        gradients' dtype (or ``TopK(fp16_values=True)``'s float16); the flat sparse allreduce's in
        the dtype Horovod sums them in (bfloat16 as float32, so there is nothing to round; a
        hierarchical shard's result is gathered inside the host in the gradients' dtype)."""
        dtype = allreduce_dtype(self.grad_dtype) if parts > 1 and shard is None else self.grad_dtype
        key = (density, scope, codec.value_dtype(dtype), shard, parts)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:  # a long warm-up: keep memory bounded
                self._plans.clear()
            sizes = [m.numel for m in self.members]
            if shard is not None:
                sizes = segments_in(self.bounds.tolist(), *shard) or [0]
            plan = self._plans[key] = codec.plan(sizes, density, scope, dtype, self.index_dtype, parts)
        return plan

    def message(self, nbytes):
        """The send buffer, reused while its size stays the same (safe: the previous send of
        this bucket finished in the last ``synchronize()``)."""
        if self._message is None or self._message.numel() != nbytes:
            self._message = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._message

    def scratch(self, purpose, numel, dtype):
        """A reusable buffer for ``purpose`` (e.g. the float16 copy a dense fp16 allreduce
        sends), reallocated only when its size or dtype changes."""
        buf = self._scratch.get(purpose)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._scratch[purpose] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf

    def reset(self):
        """Forget this step's progress (a new step, or a state restore)."""
        self.folded.clear()
        self.current = None
        self.inflight = None

    # ---- results ---------------------------------------------------------------------------
    def write_grads(self, flat):
        """Each member's part of the exchanged ``flat`` result (in the bucket's dtype, or a
        float16 wire's) into its ``p.grad``."""
        grads, parts = [], []
        for m, summed in zip(self.members, self.views(flat)):
            if m.param.grad is None:
                m.param.grad = summed.to(m.param.dtype, copy=True)
            else:
                grads.append(m.param.grad)
                parts.append(summed)
        if grads:
            copy_all(grads, parts)

    def decode_grads(self, codec, gathered, layout, rows, div):
        """``rows`` rows of exchanged pairs, added in row order and divided by ``div``, into
        every member's ``p.grad`` (overwritten: zero where no pair points)."""
        dests, copies = [], []
        for m in self.members:
            grad = m.param.grad
            if grad is None:
                grad = m.param.grad = torch.empty_like(m.param, memory_format=torch.contiguous_format)
            if grad.is_contiguous():
                dests.append(grad.view(-1))
            else:  # e.g. channels_last: decode contiguously, then copy into its layout
                dests.append(torch.empty(m.numel, dtype=grad.dtype, device=grad.device))
                copies.append((grad, dests[-1]))
        codec.decode(gathered, layout, rows, dests, self.bounds, div=div)
        for grad, flat in copies:
            grad.copy_(flat.view(grad.shape))

    # ---- the residual (error feedback) -----------------------------------------------------
    def residuals(self):
        """The flat buffers that carry unsent work into later steps: ``acc``, DGC's ``momentum``
        and the hierarchical ``shard``, those that exist."""
        return [f for f in (self.acc, self.momentum, self.shard) if f is not None]

    def rescale(self, factor):
        """Every residual times ``factor`` (the loss scale changed)."""
        for flat in self.residuals():
            flat.mul_(factor)

    def add_momentum(self, factor):
        """DGC momentum for a bucket sent whole without a residual (the dense bucket of small
        tensors): ``u = factor u + staged gradients``, and ``u`` is what goes out. The ranks'
        average of ``u`` is then momentum SGD on the average gradient, as DGC gives the tensors
        it does not compress."""
        u = self.momentum_buffer()
        u.mul_(factor).add_(self.acc)
        self.acc.copy_(u)

    def sent_whole(self, restart_residual):
        """After a dense exchange of the whole buffer: with error feedback the residual starts
        again from zero (``restart_residual``; not where it holds a float16 wire's rounding,
        ``inflight.DenseExchange``). DGC's momentum stays: its masking stops momentum where
        Top-K chose entries, which a bucket sent whole did not do (it trains as momentum SGD);
        only entries holding inf/nan (an overflow, skipped by a GradScaler) restart from zero."""
        if restart_residual and self.acc is not None:
            self.acc.zero_()
        if self.momentum is not None:
            self.momentum.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    def clear(self):
        """The residual and the momentum start again from zero (this rank's state was lost)."""
        for flat in (self.acc, self.momentum):
            if flat is not None:
                flat.zero_()

    def forget_sent(self, indices):
        """DGC's momentum factor masking: momentum stops where the entries were sent."""
        if self.momentum is not None:
            self.momentum.index_fill_(0, indices.long(), 0)

    def unsend(self, plan, message, led=None):
        """Put the entries selected into ``message`` (in the segments ``led``, default all)
        back into ``acc`` (selection zeroed them): the bucket goes dense instead. Exact: the
        values come from the full-precision scratch where the message holds 16-bit values."""
        values, indices = plan.layout.views(message)
        if values.dtype != self.dtype:
            values = plan.value_scratch(self.dtype)
        lo, hi = plan.slot_range(led)
        self.acc.index_copy_(0, indices[lo:hi].long(), values[lo:hi])

    def wipe(self, bad, edges, flats=None):
        """Start ``flats`` (default ``acc`` and ``momentum``) again from zero where they held
        inf/nan (the values still went out, so GradScaler sees them and skips the step).

        ``bad``: the numbers of the segments ``[edges[s], edges[s+1])`` that did; or a bool
        tensor with one flag per segment, or a 0-d one for the whole buffer, which stays on the
        device (no host synchronisation). Returns the number of segments wiped (all members for
        the whole buffer): an int, or a 0-d tensor where only the device knows."""
        flats = [f for f in (flats if flats is not None else (self.acc, self.momentum)) if f is not None]
        if not torch.is_tensor(bad):
            for s in bad:
                for flat in flats:
                    flat[edges[s]:edges[s + 1]].zero_()
            return len(bad)
        return wipe_flagged(flats, bad, self._sizes_on(edges, bad.device), edges[-1] - edges[0])

    def _sizes_on(self, edges, device):
        """The segments' sizes as a tensor on ``device``, made once per set of edges: built from
        a list at each step it was a blocking host-to-device copy inside the backward hook that
        launches the bucket (as ``selection._SegmentConstants`` says of its own)."""
        key = (tuple(edges), device)
        sizes = self._segment_sizes.get(key)
        if sizes is None:
            if len(self._segment_sizes) > 64:  # a long warm-up: keep memory bounded, as the plans
                self._segment_sizes.clear()
            sizes = self._segment_sizes[key] = torch.tensor([b - a for a, b in zip(edges, edges[1:])],
                                                            device=device)
        return sizes

    def hand_over(self, mode, shard=None, decay=1.0):
        """Move the residual between the full buffer and the shard when the step's exchange
        switches between flat (``mode="flat"``) and hierarchical (``"hier"``, e.g. during
        ``exchange="auto"``'s trial), so nothing unsent is lost. Flat -> hierarchical: this
        step's gradients are added to the flat residual, which the host's reduce-scatter then
        carries into the shards (returns True: the buffer carries a residual this step).
        Hierarchical -> flat: this rank's shard residual (``shard``: its ``(lo, hi)``) goes
        back into its part of the full buffer, which staged gradients and so is zeroed first.

        ``decay`` (``Options.residual_decay``): then every residual (``acc``, ``shard``) is
        multiplied by it, before this step's first fold. DGC's ``momentum`` is not unsent work
        and keeps its own factor; where ``acc`` only stages gradients (hierarchical) the fold
        overwrites it anyway."""
        carry = self._hand_over(mode, shard)
        if decay != 1.0:
            for flat in (self.acc, self.shard):
                if flat is not None:
                    flat.mul_(decay)
        return carry

    def _hand_over(self, mode, shard):
        before, self.mode = self.mode, mode
        if mode == "hier":
            return before == "flat" and self.acc is not None
        if before == "hier":
            self.buffer().zero_()
            if self.shard is not None:
                lo, hi = shard
                self.acc[lo:hi].add_(self.shard)
                self.shard.zero_()
        return False


def make_buckets(params, names, min_numel, fusion_bytes, groups=None, error_feedback=False):
    """Buckets in the same order on every rank.

    Sparse buckets hold floating-point tensors of at least ``min_numel`` elements, in reverse
    registration order (roughly the order backward produces gradients), filled up to
    ``fusion_bytes`` each, one dtype/device per bucket. ``groups`` overrides the filling: an int
    (that many buckets, split as Horovod splits them; fewer where there are fewer tensors, more
    where one holds several dtypes) or a list of parameter lists (one bucket each; unlisted parameters are
    bucketed as usual). The small tensors form one dense bucket per dtype/device, last.
    ``error_feedback``: the sparse buckets keep residuals (``Bucket``'s ``residual``).
    """
    # (an empty tensor has nothing to select: it travels with the dense ones whatever min_numel)
    eligible = [p for p in params if p.is_floating_point() and p.numel() >= max(min_numel, 1)]
    chosen = set(map(id, eligible))
    small = [p for p in params if id(p) not in chosen]
    plans = []
    if isinstance(groups, int) and not isinstance(groups, bool):
        check_integer(groups, "groups", 1)
        ordered = list(reversed(eligible))
        # Horovod's split (horovod.common.util.split_list): sizes differ by at most one
        d, r = divmod(len(ordered), groups)
        plans = [ordered[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(groups)]
        plans = [plan for plan in plans if plan]
        ordered = []
    elif groups is not None:
        if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
            got = type(groups).__name__ if not isinstance(groups, (list, tuple)) else \
                f"a {type(groups).__name__} of {', '.join(sorted({type(g).__name__ for g in groups}))}"
            raise ValueError(f"groups must be None, an int or a list of parameter lists, got {got}")
        listed = set()
        for group in groups:
            for p in group:
                if p not in names:  # (a dict keyed by the optimizer's parameters, frozen ones too)
                    what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else repr(p)
                    raise ValueError(f"groups holds {what} that is not one of the optimizer's parameters")
            # every parameter counted, those sent dense (below min_numel) too, as Horovod does
            if any(id(p) in listed for p in group) or len(set(map(id, group))) < len(group):
                raise ValueError("a parameter appears more than once in groups")
            listed.update(map(id, group))
            members = [p for p in group if id(p) in chosen]
            if members:
                plans.append(members)
        ordered = [p for p in reversed(eligible) if id(p) not in listed]
    else:
        ordered = list(reversed(eligible))
    current, current_bytes = [], 0
    for p in ordered:
        nbytes = p.numel() * p.element_size()
        if current and (current_bytes + nbytes > fusion_bytes
                        or (p.dtype, p.device) != (current[0].dtype, current[0].device)):
            plans.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += nbytes
    if current:
        plans.append(current)
    buckets = []
    for plan in plans:
        for same in _split_by_dtype(plan):
            buckets.append(Bucket(len(buckets), same, names, sparse=True, residual=error_feedback))
    for same in _split_by_dtype(small):
        buckets.append(Bucket(len(buckets), same, names, sparse=False))
    return buckets


def _split_by_dtype(params):
    by_key = {}
    for p in params:
        by_key.setdefault((p.dtype, p.device), []).append(p)
    return list(by_key.values())
