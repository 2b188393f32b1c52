"""``TopK``: a Horovod ``Compressor`` that really exchanges (value, index) pairs.

Horovod's compressor interface is ``compress(tensor) -> (tensor, ctx)``, then Horovod allreduces
the returned tensor, then ``decompress(output, ctx)``. A dense tensor of zeros would still cost
a full allreduce, so ``compress`` instead starts an ``hvd.allgather_async`` of the packed top-k
pairs and hands Horovod a 5-element float32 *probe* to allreduce. ``decompress`` waits for the
allgather, adds every rank's pairs in rank order and scales the sum the way Horovod's allreduce
scaled the probe, so op=Average / op=Sum / ``gradient_predivide_factor`` all come out right
without the compressor being told which one is in use.

The allgather runs on the process set Horovod reduces the tensor over (read from Horovod's
calling frames, ``hvd_topk._horovod``). The probe holds ``[1, rank, rank**2, f, f**2]`` (ranks within
that set, ``f`` a small integer naming the pairs' format: ``_wire_format``): after the allreduce
its first entry is the scale Horovod applied (1 for Average, the number of ranks for Sum), the
next two tell whether every rank of the set took part, and the last two whether every rank sends
in this format (a message of another format can have the same size and would decode to wrong pairs).

``hvd.join()``: a joined rank answers allreduces with zeros but stops on an allgather
(horovod#3471). So each round of compressions (``_Round``) first learns, by a one-element
allreduce started with its first ``compress``, whether every rank takes part; the round's
allgathers start at its first ``decompress``, which reads it. In a round where a rank has
joined, the others allreduce their gradients dense instead (the result is what Horovod's own
dense path gives: the joined rank counts as zeros).

Why the first ``decompress``, after backward, and not earlier: Horovod names a collective
started without ``name=`` by how many collectives the process has started
(``allreduce.noname.<n>``), so a user's ``hvd.allreduce(loss)`` between ``backward()`` and
``step()`` meets its peers only if every rank has started as many of ours by then. Started when
a poll found the probe arrived, the allgathers made that count depend on timing, and such a
call hung. Waiting for the probe inside backward (at the round's second ``compress``) fixed
that, but deadlocked where a rank's backward reaches a collective of its own first
(``hvd.SyncBatchNorm``) while another rank, whose graph differs, has not started its probe.
The cost: the allgathers no longer overlap backward (measured in
benchmarks/results/training/start-points/).
"""

import difflib
import functools
import inspect
import heapq
import threading
import time
import types
import warnings
from typing import NamedTuple

import torch

from hvd_topk import costs
from hvd_topk._horovod import caller_context, count_name_fallback, hvd, instance_name, set_key
from hvd_topk._stack import outside_level
from hvd_topk._torch import compiled_autograd_active
from hvd_topk.codec import Codec
from hvd_topk.exchange import ActiveRanks, AllgatherPairs, DenseAllreduce
from hvd_topk.checks import check_flag, check_target_density
from hvd_topk.compact import SIGN_ROUNDING, check_compact
from hvd_topk.selection import DEFAULT_METHOD, check_method
from hvd_topk.stats import DENSE_FP32_BYTES, CompressionStats
from hvd_topk.wire import index_dtype_for

from horovod.torch.compression import Compressor  # noqa: E402  (hvd_topk._horovod checked it)

ADASUM_ERROR = (
    "hvd_topk.TopK does not support op=hvd.Adasum: Adasum combines dense parameter deltas, "
    "which Top-K would truncate: use op=hvd.Average (the default) or op=hvd.Sum. (Under "
    "hvd.DistributedOptimizer(..., compression=hvd_topk.TopK) this is raised at the first backward "
    "pass: Horovod does not show a compressor the op when the optimizer is built.)")
OP_ERROR = (
    "hvd_topk.TopK only averages or sums (op=hvd.Average, the default, or op=hvd.Sum) and refuses "
    "op={op}: that reduction of Top-K pairs is not that reduction of the tensors. Compress with "
    "Horovod's own Compression.none or Compression.fp16 for this reduction.")
REDUCESCATTER_ERROR = (
    "hvd_topk.TopK compresses allreduces (hvd.allreduce, hvd.grouped_allreduce, "
    "hvd.DistributedOptimizer); hvd.{call} would scatter its few-element reply, not the tensor. "
    "Use compression=hvd.Compression.none or hvd.Compression.fp16 there.")
COMPILED_AUTOGRAD_ERROR = (
    "hvd_topk.TopK does not support compiled autograd (torch._dynamo.config.compiled_autograd = "
    "True): Horovod's gradient hooks, which call the compressor, do not run as Horovod expects "
    "under it (Horovod itself then fails with mismatched tensors and shuts down). Set "
    "torch._dynamo.config.compiled_autograd = False (torch.compile of the model can stay) and "
    "build hvd.DistributedOptimizer again (its hook has already counted this backward pass).")


MORE_THAN_DENSE = (
    "{self} over {world} ranks: each rank receives {received} bytes of the others' pairs for a tensor a "
    "ring allreduce moves in {dense} bytes: at this density each entry's index costs more than leaving it "
    "out saves (the allgather pays from about 2/P of the entries on), and this drop-in path has no dense "
    "fallback. Pass Horovod's compression=hvd.Compression.none (or fp16), a lower density, or use "
    "hvd_topk.DistributedOptimizer, which sends such tensors dense. (Warned once per TopK.)")
NOT_DIFFERENTIABLE = (
    "{self}: hvd.allreduce of a tensor that requires grad: with this compressor the result is not "
    "differentiable (Top-K is not; the pairs travel outside autograd), so no gradient flows back to the "
    "input through it. Compress with hvd.Compression.none (or fp16) where it must. (Warned once per TopK.)")


# Held around encoding: a TopK's plans (one per tensor size) share a value scratch, and the native
# kernel releases the GIL, so tensors compressed from two threads at once could mix their values
# (a review saw it in one result of 300 with fp16_values)
_ENCODING = threading.Lock()
OP_NAMES = {hvd.Adasum: "hvd.Adasum", hvd.Min: "hvd.Min", hvd.Max: "hvd.Max", hvd.Product: "hvd.Product"}


def _check_reduction(call, op):
    """Refuse what the probe would only report as a mismatch: a reduce-scatter, or an op whose
    result over pairs is not that over the tensors (anything but Average and Sum)."""
    if call in ("reducescatter", "grouped_reducescatter"):
        raise ValueError(REDUCESCATTER_ERROR.format(call=call))
    if op is not None and op not in (hvd.Average, hvd.Sum):
        raise ValueError(ADASUM_ERROR if op == hvd.Adasum else OP_ERROR.format(op=OP_NAMES.get(op, f"op={op!r}")))


class _OnDefaultInstance:
    """Method descriptor: ``TopK.compress(t)`` on the class runs on a default ``TopK()``.

    Horovod calls ``compression.compress(...)`` on whatever it was given, the class
    (``compression=hvd_topk.TopK``) or an instance (``compression=hvd_topk.TopK(density=...)``).
    """

    def __init__(self, func):
        self.func = func
        functools.update_wrapper(self, func)

    def __get__(self, obj, cls):
        return types.MethodType(self.func, cls.default() if obj is None else obj)


class _NameSlots:
    """Allgather names that repeat every step (so Horovod's response cache hits).

    Slots are taken in ``compress`` and given back in ``decompress``; both run in the same order
    on every rank, so every rank derives the same name for the same tensor.
    """

    def __init__(self, prefix):
        self.prefix, self._free, self._next, self._lock = prefix, [], 0, threading.Lock()

    def take(self):
        with self._lock:
            if self._free:
                slot = heapq.heappop(self._free)
            else:
                slot, self._next = self._next, self._next + 1
        return slot, f"{self.prefix}.{slot}"

    def give_back(self, slot):
        with self._lock:
            heapq.heappush(self._free, slot)


class _Job:
    """One compressed tensor, from ``compress`` to ``decompress``."""

    def __init__(self, message, name, slot, plan, tensor, process_set):
        self.message, self.name, self.slot, self.plan = message, name, slot, plan
        self.tensor, self.shape, self.dtype = tensor, tensor.shape, tensor.dtype
        self.process_set = process_set
        self.handle, self.dense = None, False


class _Round:
    """The tensors compressed on one process set between two moments when none is pending
    (a step's backward under ``hvd.DistributedOptimizer``; one ``hvd.allreduce``).

    Its first ``compress`` starts an ``ActiveRanks`` probe; the allgathers wait until its first
    ``decompress`` reads it (see the module docstring), because an allgather reaching a rank
    inside ``hvd.join()`` stops Horovod there and hangs the others (horovod#3471). Ranks cannot
    join in the middle of a round, so one probe per round is enough.

    A round that never finished (a worker failed mid-step under Horovod elastic, or an exception
    between backward and ``synchronize``) is abandoned when a tensor it already compressed is
    compressed again, decompressed or not: that is the next step, which gets a probe of its own.
    """

    def __init__(self, prefix):
        self.names = _NameSlots(prefix)
        self.active = ActiveRanks(f"{prefix}.active")
        self.jobs = {}      # name -> job: compressed, not yet decompressed
        self.seen = set()   # names compressed in this round, decompressed or not
        self.waiting = []   # jobs whose exchange has not started
        self.count = None   # ranks taking part, once known

    def add(self, job):
        """Returns the jobs of the round this one abandons (their name slots are free)."""
        abandoned = list(self.jobs.values()) if job.name in self.seen and self.jobs else []
        if abandoned or not self.jobs:
            self.active.start(job.process_set)
            self.jobs, self.seen, self.waiting, self.count = {}, set(), [], None
        self.jobs[job.name] = job
        self.seen.add(job.name)
        self.waiting.append(job)
        return abandoned

    def done(self, job):
        if self.jobs.get(job.name) is job:  # (not a job of a round abandoned since)
            del self.jobs[job.name]


FIXED_OPTIONS = ("density", "method", "fp16_values", "compact")  # TopK's, read-only once built


def keyword_names(function):
    """The names ``function`` takes as keywords (its ``*args`` and ``**kwargs`` aside)."""
    return {name for name, p in inspect.signature(function).parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def unexpected_options_error(caller, names, takes=None, known=()):
    """The TypeError for keywords ``caller`` does not take: where one is TopK's own (``density``,
    ...), it says that it belongs to the compression, as ``compression=hvd_topk.TopK(density=...)``;
    a misspelling of one of ``takes``, ``known`` (the caller's keywords) or TopK's is named."""
    names = sorted(names)
    message = f"{caller}() got unexpected keyword argument(s) {', '.join(names)}"
    spellings = [*(takes or ()), *known, *FIXED_OPTIONS]
    near = {n: difflib.get_close_matches(n, spellings, n=1) for n in names if n not in FIXED_OPTIONS}
    near = {n: m[0] for n, m in near.items() if m}
    if near:
        message += "; did you mean " + ", ".join(f"{m} (not {n})" for n, m in near.items())
    ours = sorted({n for n in names if n in FIXED_OPTIONS} | {m for m in near.values() if m in FIXED_OPTIONS})
    if ours:
        message += (f"; {', '.join(ours)} {'is an option' if len(ours) == 1 else 'are options'} of the compression: "
                    f"pass compression=hvd_topk.TopK({', '.join(f'{n}=...' for n in ours)})")
    if takes:
        message += f"; besides its own it takes {', '.join(sorted(takes))}"
    return TypeError(message)


class _Exchanged(NamedTuple):
    """``compress``'s context for a gradient Horovod's optimizer had already exchanged this step."""
    tensor: torch.Tensor


class _FixedOptions(type):
    """TopK's options cannot be set on the class either (that would replace them on every instance,
    built or not, whose codec was made from the old ones)."""

    def __setattr__(cls, name, value):
        if name in FIXED_OPTIONS:
            raise AttributeError(f"TopK's {name} is fixed when it is built: build a TopK({name}=...) and pass it")
        super().__setattr__(name, value)


def _wire_format(fp16_values, compact):
    """A small integer (1..6) naming the pairs' format on the wire, which the drop-in's probe
    carries so that ranks with different ones refuse instead of decoding each other's bytes."""
    return 1 + (0 if compact is False else 1 if compact is True else 2) + 3 * fp16_values


class TopK(Compressor, metaclass=_FixedOptions):
    """Send only the ``k = max(1, round(density * n))`` largest-magnitude entries of a gradient.

    Use as ``hvd.DistributedOptimizer(opt, compression=hvd_topk.TopK)`` (1% density) or
    ``compression=hvd_topk.TopK(density=0.001)``. Each rank's pairs are allgathered (indices
    int32 below 2**31 elements) and summed, then averaged for op=Average.

    This drop-in path has **no error feedback**: Horovod's compressor interface does not say
    which parameter a tensor belongs to, so what is not sent is lost. For error feedback (the
    entries not sent are carried to the next step, which is what keeps accuracy) use
    ``hvd_topk.DistributedOptimizer``.

    Non-floating and empty tensors pass through to Horovod unchanged. The pairs are allgathered
    among the ranks of the process set Horovod reduces the tensor over (``process_set=`` of
    ``hvd.DistributedOptimizer``, ``hvd.allreduce`` or ``hvd.grouped_allreduce``).

    Each instance names its collectives over a process set ``hvd_topk.TopK.<set>.<n>.…``, ``n``
    counting the instances that compressed over that set (its id and ranks) before it, in this
    process: ranks may build instances the others do not (ranks outside a set, a rank's own
    evaluation), as long as the instances used over one set first compress there in the same
    order on each of its ranks, as the same training code does. Otherwise the ranks' names
    differ and Horovod stalls, its stall warning listing names that start with ``hvd_topk.TopK.``.

    Other reductions are refused with a ``ValueError`` naming why: ``op=hvd.Min``, ``Max``,
    ``Product`` (that reduction of pairs is not that of the tensors) and ``hvd.reducescatter``.

    ``op=hvd.Adasum`` is refused, at the first step rather than when the optimizer is built:
    ``hvd.DistributedOptimizer`` only stores its compressor and never shows it the ``op``, so
    the first thing TopK sees is the first ``compress`` call, which under Adasum receives a
    parameter delta (Horovod's Adasum optimizer compresses ``p``, not ``p.grad``). The error
    (``ADASUM_ERROR``) then names the fix. ``hvd_topk.DistributedOptimizer`` refuses Adasum
    when it is built.

    Args (read-only attributes afterwards: build another ``TopK`` for other settings):
        density: fraction of entries to send, in (0, 1]. A pair costs two entries' bytes (an
            index beside the value), and every rank receives the P - 1 others' pairs: from about
            2/P on (0.5 at 2 ranks, 0.25 at 8) this drop-in moves more bytes than a ring
            allreduce of the tensor and warns once.
        method: ``"sampled"`` (default: threshold from a sample, one pass, exactly k entries,
            >= 95% of the true top-k) or ``"exact"`` (the same set as ``torch.topk``); see
            ``hvd_topk.selection``.
        fp16_values: send values as float16 (halves the value bytes; float16 and bfloat16
            gradients' pairs already carry their own 2 bytes and are left so, except in the
            sparse allreduce's sum, which Horovod cannot do in bfloat16); in
            ``hvd_topk.DistributedOptimizer`` a bucket sent dense is then sent in float16 too.
            float16 holds magnitudes up to 65504: a larger value arrives as inf. With error
            feedback what float16 rounds off a sent value stays in its residual.
        compact: ``True``: send about 2.4 bytes a pair (an Elias-Fano index of about 2 +
            log2(1/density) bits and a sign + 7-bit log-scale value, ``hvd_topk.compact``)
            instead of 8 (or 6 with ``fp16_values``): 2.5x the entries in 16-bit values' bytes
            at 0.25%. Each value arrives within a factor (largest / smallest sent magnitude of
            its tensor) ** (1/252) of itself. ``"sign"``: the index and the value's sign alone,
            about 1.4 bytes a pair at 0.43% (4.3x the entries in 16-bit values' bytes at 0.1%);
            every non-zero value of a tensor arrives as its sign times the mean magnitude the
            tensor sends (of the bucket, with ``selection_scope="bucket"``): for error feedback only (``hvd_topk.DistributedOptimizer``, the DDP
            hook), which puts that rounding back into the residual. This drop-in path loses
            the rounding of either format. The allgather's format only: the optimizer
            then refuses ``exchange="sparse_allreduce"`` and ``hierarchical=True``, ``"auto"``
            tries the allgather and dense, and a bucket sent dense (the dense fallback, a dense
            start) goes in float16 as with ``fp16_values``; which buckets go dense is decided
            as with ``fp16_values``.
    """

    DEFAULT_DENSITY = 0.01

    def __init__(self, density=DEFAULT_DENSITY, method=DEFAULT_METHOD, fp16_values=False, compact=False):
        object.__setattr__(self, "_options", {"density": check_target_density(density), "method": check_method(method),
                                              "fp16_values": check_flag(fp16_values, "fp16_values"),
                                              "compact": check_compact(compact)})
        self._codec = Codec(self.method, self.fp16_values, self.compact)
        self._plans = {}  # (numel, dtype) -> codec.Plan, the same every step
        self._stats = CompressionStats()
        self._probe_checked = set()
        self._rounds = {}  # (process set id, ranks) -> _Round (and the names this instance uses there)
        self._lock = threading.Lock()
        self._warned_bytes = False
        self._warned_grad = False
        self._warned_sign = False
        self._probes = {}  # (rank, device) -> the probe, cloned for each tensor
        self._format = _wire_format(self.fp16_values, self.compact)

    # Fixed once built: the codec and the per-shape plans are made from them, and
    # hvd_topk.DistributedOptimizer copies them when it is built; a change would apply to some
    # tensors and not others, or not at all.
    density = property(lambda self: self._options["density"])
    method = property(lambda self: self._options["method"])
    fp16_values = property(lambda self: self._options["fp16_values"])
    compact = property(lambda self: self._options["compact"])

    def __setattr__(self, name, value):
        if name in FIXED_OPTIONS:
            raise AttributeError(f"TopK's {name} is fixed when it is built (its plans and any optimizer built "
                                 f"with it use it): build a new TopK({name}=...) instead")
        object.__setattr__(self, name, value)

    def __repr__(self):
        compact = f", compact={self.compact!r}" if self.compact else ""
        return f"TopK(density={self.density}, method={self.method!r}, fp16_values={self.fp16_values}{compact})"

    @classmethod
    def default(cls):
        """The instance that class-level calls (``compression=TopK``) use: density 1%."""
        if "_default" not in cls.__dict__:
            cls._default = cls()
        return cls.__dict__["_default"]

    @_OnDefaultInstance
    def compress(self, tensor):
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return tensor, None
        caller = caller_context(tensor=tensor)
        if tensor.requires_grad and torch.is_grad_enabled() and not self._warned_grad:
            self._warned_grad = True
            warnings.warn(NOT_DIFFERENTIABLE.format(self=self), stacklevel=outside_level())
        if self.compact == "sign" and not self._warned_sign:
            self._warned_sign = True
            warnings.warn(f"{SIGN_ROUNDING}; here (Horovod's own optimizer, hvd.allreduce) it is lost: use compact=True, or "
                          "hvd_topk.DistributedOptimizer", stacklevel=outside_level())
        if isinstance(tensor, torch.nn.Parameter):
            # Horovod's Adasum optimizer compresses the parameter itself, with no op in sight; a
            # parameter handed to hvd.allreduce (a call in the frames) is a tensor like any other
            if caller.call is None:
                raise ValueError(ADASUM_ERROR)
            tensor = tensor.detach()
        _check_reduction(caller.call, caller.op)
        if caller.exchanged:
            # Horovod's step() without skip_synchronize() after synchronize() (or a second
            # synchronize()) sends every gradient again: p.grad already holds the exchanged
            # result (clipped, maybe, since). It passes through, and Horovod's allreduce gets a
            # one-element placeholder; Top-K of the average would drop most of it.
            # (float32 whatever the gradient's dtype: Horovod does not reduce bfloat16.)
            # A synchronize() after step(), with the flag down, is not told apart from one
            # after gradients written by hand (through .data, unseen by a version counter):
            # it sends p.grad through Top-K again, which changes p.grad, not the step applied.
            return torch.zeros(1, device=tensor.device), _Exchanged(tensor)
        if compiled_autograd_active():
            raise RuntimeError(COMPILED_AUTOGRAD_ERROR)
        t0 = time.perf_counter()
        numel = tensor.numel()
        plan = self._plan(numel, tensor.dtype)
        message = torch.empty(plan.layout.nbytes, dtype=torch.uint8, device=tensor.device)
        with _ENCODING:  # a plan's value scratch is shared, and the native kernel lets go of the GIL
            self._codec.encode(tensor.reshape(-1), plan, message)
        if self.compact:  # a buffer per tensor: several are in flight at once
            message = plan.compact().pack(message, out=False)
        t1 = time.perf_counter()
        process_set = caller.process_set
        world = process_set.size()
        # the cost model's bytes into a rank, at this message's bytes a pair and by the density, not
        # this tensor's k (k >= 1 makes a pair cost more than a tensor of one or two entries)
        pair_bytes = message.numel() / plan.count
        if not self._warned_bytes and world > 1:
            dense = costs.dense(world, numel, 0, 0, 0, tensor.element_size())
            if costs.allgather(world, numel, self.density * numel, pair_bytes, 0, 0) > dense:
                self._warned_bytes = True
                warnings.warn(MORE_THAN_DENSE.format(self=self, world=world, received=(world - 1) * message.numel(),
                                                     dense=round(dense)), stacklevel=outside_level())
        with self._lock:
            rnd = self._round_of(process_set)
            if caller.name:
                slot, name = None, f"{rnd.names.prefix}.{caller.name}"
            else:
                count_name_fallback()
                slot, name = rnd.names.take()
            job = _Job(message, name, slot, plan, tensor, process_set)
            for stale in rnd.add(job):
                if stale.slot is not None:
                    rnd.names.give_back(stale.slot)
        probe = self._probe(process_set.rank(), tensor.device)
        self._stats.add(elements_total=numel, bytes_dense=numel * DENSE_FP32_BYTES,
                        bytes_sent=probe.numel() * probe.element_size(), time_selection_s=t1 - t0)
        return probe, (job, rnd)

    def _probe(self, rank, device):
        """A fresh ``[1, rank, rank**2, f, f**2]`` (``f`` this TopK's ``_wire_format``) for Horovod
        to reduce in place, cloned from one made once per rank and device (made from a list at
        every call, on a GPU it was a blocking host-to-device copy inside each backward hook)."""
        made = self._probes.get((rank, device))
        if made is None:
            f = self._format
            made = self._probes[(rank, device)] = torch.tensor([1.0, rank, rank * rank, f, f * f],
                                                               dtype=torch.float32, device=device)
        return made.clone()

    def _plan(self, numel, dtype):
        plan = self._plans.get((numel, dtype))
        if plan is None:
            plan = self._plans[(numel, dtype)] = self._codec.plan([numel], self.density, "tensor", dtype,
                                                                  index_dtype_for(numel))
        return plan

    def _round_of(self, process_set):
        """This instance's round over ``process_set``; at its first use there, its number among
        the instances used over that set (what its collectives are named by)."""
        key = set_key(process_set)
        if key not in self._rounds:
            self._rounds[key] = _Round(instance_name("TopK", process_set))
        return self._rounds[key]

    def _start_waiting(self, rnd):
        """Start the round's waiting exchanges, reading (waiting for) the probe first: the
        pairs' allgather when every rank of the set takes part, else (a rank is in
        ``hvd.join()``, which answers allreduces only) a dense allreduce of the gradient itself."""
        if rnd.count is None:
            rnd.count = rnd.active.read()
        for job in rnd.waiting:
            if rnd.count == job.process_set.size():
                job.handle = AllgatherPairs.start(job.message, job.name, job.process_set)
                self._stats.add(tensors_sparse=1, elements_selected=job.plan.count,
                                bytes_sent=self._codec.message_nbytes(job.plan))
            else:
                dense = job.tensor.detach().clone(memory_format=torch.contiguous_format).view(-1)
                job.handle = DenseAllreduce.start(dense, job.name + ".joined", job.process_set, hvd.Sum)
                job.dense = True
                self._stats.add(tensors_dense=1, elements_selected=dense.numel(),
                                bytes_sent=dense.numel() * dense.element_size())
            job.tensor = job.message = None  # (no longer needed: let them go)
        rnd.waiting.clear()

    @_OnDefaultInstance
    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        if isinstance(ctx, _Exchanged):
            return ctx.tensor
        job, rnd = ctx
        with self._lock:
            self._start_waiting(rnd)
            count = rnd.count
            rnd.done(job)
        if count == job.process_set.size():
            # (with a rank in hvd.join() the probe is reduced over the others only)
            self._check_probe(tensor, count)
        t0 = time.perf_counter()
        # The probe's first entry is the scale Horovod applied to a sum of ``count`` ranks' ones
        # (count for Sum, 1 for Average with every rank there): the result is the sum of what
        # was sent times that scale / count. On CPU reading it costs nothing; on CUDA it stays
        # a tensor (no host sync).
        scale = float(tensor[0]) if tensor.device.type == "cpu" else tensor[0].to(job.dtype)
        if job.dense:
            out = DenseAllreduce.finish(job.handle).mul_(scale).div_(count)
        else:
            gathered = AllgatherPairs.finish(job.handle)
            if self.compact:
                gathered = job.plan.compact().unpack(gathered, count, out=False)
            out = torch.empty(job.shape.numel(), dtype=job.dtype, device=gathered.device)  # decode overwrites it
            self._codec.decode(gathered, job.plan.layout, count, [out], job.plan.bounds, div=count, mul=scale)
        if job.slot is not None:
            rnd.names.give_back(job.slot)
        self._stats.add(time_exchange_s=time.perf_counter() - t0)
        return out.view(job.shape)

    def _check_probe(self, probe, size):
        """Fail loudly if the probe shows a process set smaller than the job, or ranks whose
        TopKs send in different formats (once per device)."""
        if probe.device.type != "cpu" and probe.device in self._probe_checked:
            return  # reading a CUDA probe costs a host sync; once is enough
        self._probe_checked.add(probe.device)
        _, mean_rank, mean_square, mean_format, mean_format_square = (probe.double() / probe[0].double()).tolist()
        want_rank = (size - 1) / 2.0
        want_square = (size - 1) * (2 * size - 1) / 6.0
        ok = (abs(mean_rank - want_rank) <= 1e-3 * max(1.0, want_rank)
              and abs(mean_square - want_square) <= 1e-3 * max(1.0, want_square))
        if not ok:
            raise RuntimeError(
                "hvd_topk.TopK exchanged this tensor's pairs over other ranks than Horovod reduced "
                "it over (or ranks disagree on the tensors being reduced). Pass the process set "
                "to hvd.DistributedOptimizer(process_set=...) or hvd.allreduce(process_set=...), "
                "or use hvd_topk.DistributedOptimizer.")
        # every rank's format is this one only if their mean is and their spread is 0: then every
        # rank fails, where a message of one format can have another's size and decode to wrong
        # pairs (compact=True and "sign" for four pairs or fewer). The sums are of small integers,
        # exact in float32; 1e-6 leaves room for the scaling's rounding and sees one rank in 1000.
        f = self._format
        if abs(mean_format - f) > 1e-6 * f or abs(mean_format_square - f * f) > 1e-6 * f * f:
            raise ValueError(f"hvd_topk.TopK: the ranks' TopKs send this tensor in different formats (fp16_values or "
                             f"compact differ; this rank's is {self!r}): build the same TopK for it on every rank")

    @_OnDefaultInstance
    def compression_stats(self, reset=False):
        """Totals on this rank since construction or the last ``reset=True``: bytes sent vs the
        dense bytes replaced, density, timings. The same call as the error-feedback
        optimizer's ``compression_stats``, without its ``steps``: Horovod hands the drop-in one
        tensor at a time and never says where a step ends (count ``tensors_sparse`` +
        ``tensors_dense`` per step yourself, or divide by the steps your loop ran)."""
        out = self._stats.as_dict()
        del out["steps"]
        if reset:
            self._stats.reset()
        return out

    @_OnDefaultInstance
    def stats(self):
        """Alias of ``compression_stats()`` (kept: earlier releases documented it)."""
        return self.compression_stats()

    @_OnDefaultInstance
    def reset_stats(self):
        """Alias of ``compression_stats(reset=True)``, without the return value."""
        self.compression_stats(reset=True)
