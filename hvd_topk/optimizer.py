"""``hvd_topk.DistributedOptimizer``: Top-K with error feedback, a drop-in for Horovod's.

Data flow of one step (DESIGN.md): each parameter's post-accumulate-grad hook marks it ready;
when every parameter of a fusion bucket is ready the bucket is compensated (error feedback),
selected, packed into one message and its allgather started, so communication overlaps the rest
of backward. ``synchronize()`` starts whatever is left, waits for each bucket in order, adds every
rank's pairs in rank order into the gradients (bit-identical on every rank) and averages.
Tensors below ``min_numel`` and buckets for which the cost model says a dense allreduce is
cheaper go through a grouped dense allreduce instead.
"""

import hashlib
import itertools
import math
import time
import warnings
from contextlib import contextmanager

import torch

from hvd_topk import exchange
from hvd_topk._horovod import import_horovod_torch
from hvd_topk.compressor import TopK
from hvd_topk.memory import ErrorFeedback
from hvd_topk.schedule import DensitySchedule
from hvd_topk import selection
from hvd_topk.selection import k_for
from hvd_topk.stats import CompressionStats
from hvd_topk.wire import Layout, index_dtype_for

hvd = import_horovod_torch()

STATE_KEY = "hvd_topk"
DEFAULT_OPTIONS = {
    "error_feedback": True,        # keep what was not sent and add it back next step
    "momentum_correction": 0.0,    # DGC momentum (use with an inner optimizer without momentum)
    "warmup_steps": 0,             # steps of exponential density warm-up
    "warmup_density": 0.25,        # density at step 0 of the warm-up
    "min_numel": 1024,             # smaller tensors always go dense
    "fusion_bytes": 64 * 1024 * 1024,  # dense-equivalent bytes per sparse bucket
    "dense_fallback": True,        # use the cost model to go dense where sparse cannot win
}


def DistributedOptimizer(optimizer, named_parameters=None, compression=TopK,
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, groups=None,
                         process_set=hvd.global_process_set, **options):
    """Wrap ``optimizer`` so that gradients are exchanged as Top-K pairs with error feedback.

    Same signature and behaviour as ``hvd.DistributedOptimizer``: the result is an instance of
    the user's optimizer class; ``synchronize()``, ``skip_synchronize()``, ``zero_grad()`` and
    ``hvd.broadcast_optimizer_state`` work as in Horovod. The inner optimizer's state is kept.

    Args:
        compression: ``hvd_topk.TopK`` (1%) or ``hvd_topk.TopK(density=..., method=...,
            fp16_values=...)``: what each sparse tensor sends per step.
        backward_passes_per_step, op, gradient_predivide_factor, process_set: as in Horovod
            (op is ``hvd.Average`` or ``hvd.Sum``).
        groups: ``None`` (buckets of ``fusion_bytes``), an int (that many buckets) or a list of
            parameter lists (one bucket each): which tensors share one packed message.

    Options (keyword only):
        error_feedback (True): carry unsent entries to the next step. Turning it off loses them.
        momentum_correction (0.0): DGC momentum factor; set the inner optimizer's momentum to 0.
        warmup_steps (0), warmup_density (0.25): exponential density warm-up (DGC).
        min_numel (1024): tensors with fewer elements go through a dense allreduce.
        fusion_bytes (64 MiB): dense-equivalent size of a sparse bucket.
        dense_fallback (True): send a bucket dense when, at the current world size and density,
            a ring allreduce moves fewer bytes than the allgather (density >= 2*4/(P*8) = 1/P
            for fp32 gradients); with False every large tensor is always sparse.

    Tuning: density 1% with error feedback usually keeps accuracy; below 0.1% add
    ``warmup_steps`` (about an epoch) and ``momentum_correction`` matching your SGD momentum.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if hasattr(optimizer, "_topk"):
        raise ValueError("optimizer is already a hvd_topk.DistributedOptimizer")
    if hasattr(optimizer, "_handles") and hasattr(optimizer, "_compression"):
        raise ValueError("optimizer is already a horovod DistributedOptimizer; wrap the plain "
                         "torch optimizer instead")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_TopKDistributedOptimizer.__dict__))
    # hvd.broadcast_optimizer_state initialises a fresh optimizer's state by calling the *inner*
    # step() when the optimizer's module is Horovod's; otherwise it would run a whole exchange.
    cls.__module__ = _HOROVOD_OPTIMIZER_MODULE
    wrapped = cls.__new__(cls)
    # Share the user's optimizer (param_groups, state, hooks, defaults) instead of re-creating
    # it; an instance-level ``step`` (an LR scheduler's wrapper) would bypass ours.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    wrapped._topk_init(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor, groups, process_set, options)
    return wrapped


_HOROVOD_OPTIMIZER_MODULE = hvd.DistributedOptimizer.__module__
# Optimizers are built in the same order on every rank, so this numbering names their
# collectives alike everywhere and keeps two optimizers' messages apart.
_optimizer_ids = itertools.count()


class _Bucket:
    """Parameters that travel in one message; ``sparse`` buckets may still go dense on a step."""

    def __init__(self, index, members, sparse):
        self.index = index
        self.members = members  # [(param, name, offset in the bucket's flat space)]
        self.sparse = sparse
        self.numel = sum(p.numel() for p, _, _ in members)
        first = members[0][0]
        self.dtype, self.device = first.dtype, first.device
        self.index_dtype = index_dtype_for(self.numel)
        self.ready = 0
        self.pending = None  # (kind, handle, layout) between launch and finish
        self.send = None     # (layout, reused message buffer)

    def send_buffer(self, count, value_dtype):
        """Layout and message buffer for ``count`` pairs, reused while the count stays the same
        (it changes only during warm-up). Safe: the previous send finished in synchronize()."""
        if self.send is None or self.send[0].count != count or self.send[0].value_dtype != value_dtype:
            layout = Layout(count, value_dtype, self.index_dtype)
            self.send = (layout, torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device))
        return self.send



class _TopKDistributedOptimizer(torch.optim.Optimizer):
    """Methods copied into the dynamic subclass of the user's optimizer (as Horovod does)."""

    def _topk_init(self, named_parameters, compression, passes, op, gradient_predivide_factor, groups,
                   process_set, options):
        unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; valid options: "
                            f"{', '.join(DEFAULT_OPTIONS)}")
        opts = {**DEFAULT_OPTIONS, **options}
        self._topk = _resolve_compression(compression)
        if op == hvd.Adasum:
            raise ValueError("op=hvd.Adasum is not supported by hvd_topk: Adasum combines dense "
                             "deltas; use op=hvd.Average or op=hvd.Sum")
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
        if not isinstance(gradient_predivide_factor, (int, float)) or not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor!r}")
        if gradient_predivide_factor != 1.0 and op != hvd.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        for key in ("min_numel", "fusion_bytes"):
            value = opts[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "min_numel" else 1):
                raise ValueError(f"{key} must be an integer >= {0 if key == 'min_numel' else 1}, got {value!r}")
        self.op, self.gradient_predivide_factor = op, float(gradient_predivide_factor)
        self.backward_passes_per_step = passes
        self.process_set = process_set
        self._options = opts
        self._schedule = DensitySchedule(self._topk.density, opts["warmup_steps"], opts["warmup_density"])
        self._memory = ErrorFeedback(opts["momentum_correction"]) if opts["error_feedback"] else None
        if opts["momentum_correction"] and not opts["error_feedback"]:
            raise ValueError("momentum_correction needs error_feedback=True")
        if opts["momentum_correction"] and any(g.get("momentum", 0) for g in self.param_groups):
            warnings.warn("momentum_correction applies momentum before compression; the inner "
                          "optimizer's own momentum should be 0 (DGC), or momentum is applied twice")

        self._prefix = f"hvd_topk.opt{next(_optimizer_ids)}"
        self._names = _parameter_names(self.param_groups, named_parameters)
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._param_ids = [id(p) for g in self.param_groups for p in g["params"]]
        self._shapes = [p.shape for p in self._params]
        self._world = process_set.size()
        self._rank = process_set.rank()
        self._check_ranks_agree()
        self._buckets = _make_buckets(self._params, self._names, opts, groups)
        self._bucket_of = {p: b for b in self._buckets for p, _, _ in b.members}
        self._passes = {p: 0 for p in self._params}
        self._step = 0
        self._stats = CompressionStats()
        self._synchronized = False
        self._should_synchronize = True
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                              for p in self._params]

    # ---- per step --------------------------------------------------------------------------
    def _on_grad_ready(self, p):
        if self._passes[p] >= self.backward_passes_per_step:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                 "before call to step(). Increase backward_passes_per_step to "
                                 "accumulate gradients locally.")
        self._passes[p] += 1
        if self._passes[p] == self.backward_passes_per_step:
            bucket = self._bucket_of[p]
            bucket.ready += 1
            if bucket.ready == len(bucket.members):
                self._launch(bucket)

    def _bucket_is_sparse_now(self, bucket, density):
        if not bucket.sparse:
            return False
        if not self._options["dense_fallback"]:
            return True
        value_bytes = 2 if self._topk.fp16_values else bucket.flat_itemsize
        index_bytes = 4 if bucket.index_dtype == torch.int32 else 8
        return density < exchange.sparse_break_even(self._world, bucket.flat_itemsize, value_bytes, index_bytes)

    def _launch(self, bucket):
        density = self._schedule.density(self._step)
        name = f"{self._prefix}.bucket{bucket.index}"
        for p, _, _ in bucket.members:
            if p.grad is None:  # no gradient here this step: contribute zeros, as Horovod does
                p.grad = torch.zeros_like(p)
        if self._bucket_is_sparse_now(bucket, density):
            t0 = time.perf_counter()
            counts = [k_for(p.numel(), density) for p, _, _ in bucket.members]
            value_dtype = torch.float16 if self._topk.fp16_values else bucket.dtype
            layout, message = bucket.send_buffer(sum(counts), value_dtype)
            value_slots, index_slots = layout.views(message)
            start = 0
            for (p, pname, offset), k in zip(bucket.members, counts):
                self._select_into(p, pname, offset, k, value_slots[start:start + k],
                                  index_slots[start:start + k])
                start += k
            layout.zero_padding(message)
            self._stats.add(time_selection_s=time.perf_counter() - t0, tensors_sparse=len(bucket.members),
                            elements_selected=start, bytes_sent=layout.nbytes)
            bucket.pending = ("sparse", exchange.launch_allgather(message, name, self.process_set),
                              (layout, counts))
        else:
            grads = []
            for p, pname, _ in bucket.members:
                if self._memory and pname in self._memory.residuals:
                    p.grad.add_(self._memory.residuals[pname])  # everything goes out this step
                    self._memory.flush(pname)
                grads.append(p.grad)
            self._stats.add(tensors_dense=len(bucket.members), elements_selected=bucket.numel,
                            bytes_sent=bucket.numel * bucket.flat_itemsize)
            bucket.pending = ("dense", exchange.launch_dense(grads, name, self.op,
                                                             self.gradient_predivide_factor,
                                                             self.process_set), None)
        self._stats.add(elements_total=bucket.numel, bytes_dense=bucket.numel * bucket.flat_itemsize)

    def _select_into(self, p, pname, offset, k, value_slots, index_slots):
        """Compensate, select and write one parameter's k pairs into its slots of the message;
        ``p.grad`` is left zeroed, ready to receive the exchanged sum.

        CPU fp32/fp64: one native call folds the gradient into the residual, selects, writes the
        pairs in place and zeroes what was sent and the gradient, in about one pass. Elsewhere
        the same with torch ops.
        """
        grad = p.grad
        memory = self._memory
        direct = value_slots.dtype == grad.dtype
        if selection.native_ok(grad):
            values = value_slots if direct else torch.empty(k, dtype=grad.dtype)
            if memory is not None and not memory.momentum:
                acc = memory.accumulator(pname, grad)
                result = selection.select_native(acc.view(-1), k, index_slots, values, self._topk.method,
                                                 add=grad.view(-1), offset=offset, zero_sent=True)
            else:
                acc = memory.compensate(pname, grad) if memory is not None else grad
                result = selection.select_native(acc.view(-1), k, index_slots, values, self._topk.method,
                                                 offset=offset, zero_sent=memory is not None)
                grad.zero_()
            if memory is not None:
                local = index_slots.long() - offset if memory.momentum else None
                memory.sent_native(pname, local, result.nonfinite)
            if result.passes > 1 or result.filled:
                self._stats.add(selection_repasses=result.passes - 1, selection_filled=result.filled)
            if result.nonfinite:  # an inf/nan must reach the averaged gradient (GradScaler)
                values[:1] = math.nan
            if not direct:
                value_slots.copy_(values)
            return
        flat = memory.compensate(pname, grad).view(-1) if memory else grad.reshape(-1)
        values, indices = selection.select(flat, k, self._topk.method)
        bad = memory.sent(pname, indices) if memory else ~torch.isfinite(flat).all()
        values[:1].masked_fill_(bad, math.nan)
        value_slots.copy_(values)
        index_slots.copy_(indices + offset)
        grad.zero_()

    def _finish(self, bucket):
        kind, handle, extra = bucket.pending
        t0 = time.perf_counter()
        result = exchange.wait(handle)
        if kind == "sparse":
            layout, counts = extra
            values, indices = layout.unpack(result, self._world)
            div = float(self._world) if self.op == hvd.Average else 1.0
            start = 0
            for (p, _, offset), k in zip(bucket.members, counts):
                # p.grad was zeroed at launch: add every rank's pairs in rank order (the same
                # bits on every rank), then average the touched entries only.
                dest = p.grad.view(-1) if p.grad.is_contiguous() else torch.zeros(p.numel(), dtype=p.dtype,
                                                                                  device=p.device)
                exchange.scatter_add_ranks(dest, values[:, start:start + k], indices[:, start:start + k],
                                           offset=offset, div=div)
                if not p.grad.is_contiguous():
                    p.grad.copy_(dest.view_as(p.grad))
                start += k
        bucket.pending = None
        bucket.ready = 0
        self._stats.add(time_exchange_s=time.perf_counter() - t0)

    def synchronize(self):
        """Finish every exchange of this step; afterwards ``p.grad`` holds the averaged result."""
        self._check_parameters_unchanged()
        for bucket in self._buckets:
            if bucket.pending is None:
                self._launch(bucket)
        for bucket in self._buckets:
            self._finish(bucket)
        for p in self._passes:
            self._passes[p] = 0
        self._step += 1
        self._stats.add(steps=1)
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` so that ``step()`` does not exchange again."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none=True):
        if any(b.pending is not None for b in self._buckets):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited "
                                 "as it can cause a race condition.")
        self._synchronized = False  # gradients of a synchronized but skipped step are dropped
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self):
        """The inner optimizer's state plus, under ``"hvd_topk"``, this rank's residuals,
        momentum buffers and step counter. Residuals are per rank: save one file per rank
        for an exact resume (a rank loading another rank's file starts from zero residuals)."""
        state = super(self.__class__, self).state_dict()
        ours = {"format": 1, "step": self._step, "rank": self._rank, "size": self._world}
        ours.update(self._memory.state_dict() if self._memory else {"residuals": {}, "momenta": {}})
        state[STATE_KEY] = ours
        return state

    def load_state_dict(self, state_dict):
        if any(b.pending is not None for b in self._buckets):
            raise AssertionError("load_state_dict() was called while gradients were being exchanged")
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        super(self.__class__, self).load_state_dict(state_dict)
        for b in self._buckets:
            b.ready = 0
        for p in self._passes:
            self._passes[p] = 0
        self._synchronized, self._should_synchronize = False, True
        if ours is None:
            return
        self._step = int(ours["step"])
        if self._memory is None:
            return
        if (ours["rank"], ours["size"]) == (self._rank, self._world):
            devices = {name: p.device for p, name in self._names.items()}
            self._memory.load_state_dict(ours, lambda n: devices.get(n, "cpu"))
        else:
            self._memory.clear()
            warnings.warn(f"hvd_topk: this state was saved by rank {ours['rank']} of {ours['size']} "
                          f"and is loaded on rank {self._rank} of {self._world}: error-feedback "
                          "residuals start from zero. Save and load one state per rank to resume exactly.")

    # ---- statistics ------------------------------------------------------------------------
    def compression_stats(self):
        """Totals since construction (or ``reset_compression_stats``) on this rank."""
        out = self._stats.as_dict()
        out["nonfinite_resets"] = self._memory.nonfinite_resets() if self._memory else 0
        out["step"] = self._step
        out["current_density"] = self._schedule.density(self._step)
        out["buckets_sparse"] = sum(b.sparse for b in self._buckets)
        out["buckets_dense"] = sum(not b.sparse for b in self._buckets)
        return out

    def reset_compression_stats(self):
        self._stats.reset()

    # ---- checks ----------------------------------------------------------------------------
    def _check_ranks_agree(self):
        """Every rank must wrap the same model with the same settings: fail on all ranks at once."""
        signature = repr(([(self._names[p], tuple(p.shape), str(p.dtype)) for p in self._params],
                          self._topk.density, self._topk.method, self._topk.fp16_values,
                          self.backward_passes_per_step, sorted(self._options.items())))
        digest = int.from_bytes(hashlib.sha256(signature.encode()).digest()[:7], "big")
        mine = torch.tensor([[digest, len(self._params), sum(p.numel() for p in self._params)]],
                            dtype=torch.int64)
        every = hvd.allgather(mine, name="hvd_topk.check_ranks", process_set=self.process_set)
        if bool((every != every[0]).any()):
            lines = [f"rank {r}: {n} parameters, {e:,} elements"
                     for r, (_, n, e) in enumerate(every.tolist())]
            differ = [r for r in range(every.shape[0]) if not torch.equal(every[r], every[0])]
            raise ValueError("hvd_topk.DistributedOptimizer: ranks disagree on the model or its "
                             f"settings (parameter names, shapes, dtypes, density, options); ranks "
                             f"{differ} differ from rank 0:\n  " + "\n  ".join(lines))

    def _check_parameters_unchanged(self):
        ids = [id(p) for g in self.param_groups for p in g["params"]]
        if ids != self._param_ids or any(p.shape != s for p, s in zip(self._params, self._shapes)):
            raise RuntimeError("the optimizer's parameters changed after hvd_topk.DistributedOptimizer "
                               "was built (parameters added, removed, replaced or resized); build "
                               "the DistributedOptimizer after the model and its param_groups are final")


def _resolve_compression(compression):
    if compression is None or compression is TopK:
        return TopK.default()
    if isinstance(compression, TopK):
        return compression
    if isinstance(compression, type) and issubclass(compression, TopK):
        return compression.default()
    raise TypeError(f"compression must be hvd_topk.TopK or hvd_topk.TopK(...), got {compression!r}; "
                    "for Horovod's own compressors use hvd.DistributedOptimizer")


def _parameter_names(param_groups, named_parameters):
    """Horovod's naming rules and errors, with unique names for unnamed parameters."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}", p) for i, p in
                            enumerate(p for g in param_groups for p in g["params"])]
    if any(not isinstance(item, tuple) for item in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named_parameters:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(sorted(dups)))
    named_ids = {id(p) for _, p in named_parameters}
    unnamed = [id(p) for g in param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were "
                         "not named. Python object ids: " + ", ".join(map(str, unnamed)))
    return {p: name for name, p in named_parameters}


def _make_buckets(params, names, opts, groups):
    """Static buckets, identical on every rank: sparse ones in reverse registration order
    (roughly the order backward produces gradients), and one dense bucket per dtype/device."""
    eligible = [p for p in params if p.is_floating_point() and p.numel() >= opts["min_numel"]]
    small = [p for p in params if p not in set(eligible)]
    chosen = set(map(id, eligible))
    plans = []  # lists of params, each one sparse bucket
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        ordered = list(reversed(eligible))
        per = math.ceil(len(ordered) / groups) if ordered else 1
        plans = [ordered[i:i + per] for i in range(0, len(ordered), per)]
        ordered = []
    elif groups is not None:
        if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
            raise ValueError(f"groups must be None, an int or a list of parameter lists, got {groups!r}")
        listed = set()
        for group in groups:
            members = [p for p in group if id(p) in chosen]
            if any(id(p) in listed for p in members):
                raise ValueError("a parameter appears in more than one of groups")
            listed.update(map(id, members))
            if members:
                plans.append(members)
        ordered = [p for p in reversed(eligible) if id(p) not in listed]
    else:
        ordered = list(reversed(eligible))
    current, current_bytes = [], 0
    for p in ordered:  # fill fusion buckets, one dtype/device each
        nbytes = p.numel() * p.element_size()
        if current and (current_bytes + nbytes > opts["fusion_bytes"]
                        or (p.dtype, p.device) != (current[0].dtype, current[0].device)):
            plans.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += nbytes
    if current:
        plans.append(current)
    buckets = []
    for plan in plans:
        for key_members in _split_by_dtype(plan):
            buckets.append(_bucket(len(buckets), key_members, names, sparse=True))
    for key_members in _split_by_dtype(small):
        buckets.append(_bucket(len(buckets), key_members, names, sparse=False))
    return buckets


def _split_by_dtype(params):
    by_key = {}
    for p in params:
        by_key.setdefault((p.dtype, p.device), []).append(p)
    return list(by_key.values())


def _bucket(index, params, names, sparse):
    members, offset = [], 0
    for p in params:
        members.append((p, names[p], offset))
        offset += p.numel()
    bucket = _Bucket(index, members, sparse)
    bucket.flat_itemsize = params[0].element_size()
    return bucket
