"""The error-feedback engine: one object holding everything the optimizer does per step.

Think of ``torch.distributed``'s ``PowerSGDState``: the hyper-parameters (``Options``), the
buckets with their flat residual buffers, the density schedule, the statistics and the
checkpointable state live here; ``hvd_topk.DistributedOptimizer`` is a thin wrapper that calls
``on_grad_ready`` from each parameter's hook, ``synchronize`` before the inner step, and
``state_dict``/``load_state_dict``.

One step, per bucket (``hvd_topk.buckets``):

1. at the bucket's first gradient of the step its plan is fixed (``StepPlan``: density, the
   exchange strategy from ``hvd_topk.exchange`` — the one ``exchange=`` names, or under
   ``"auto"`` the one ``hvd_topk.auto``'s trial measured fastest — and the send buffer);
2. each gradient, once its backward passes are done, is folded into the bucket's flat buffer
   (error feedback: ``acc += grad``; a bucket that only stages a copy of its gradients takes them
   all in one call when it is complete); ``p.grad`` keeps this rank's gradient. With tensor scope on
   the native kernel the gradient's top-k is selected right then, in the fold's own pass over
   memory, into its slots of the message, zeroing what it sent; with bucket scope (or torch ops)
   the whole buffer is selected in one call once the bucket is complete. (With the sparse
   allreduce only this step's leader selects; the other ranks only fold.)
3. when the bucket is complete its exchange starts (overlapping the rest of backward);
4. ``synchronize`` finishes every exchange and writes the averaged result into ``p.grad``, the
   same bits on every rank.
"""

import dataclasses
import hashlib
import time
import warnings

import torch

from hvd_topk import auto, exchange, hierarchy
from hvd_topk._horovod import allreduce_dtype, elastic_mode, hvd
from hvd_topk._torch import compiled_autograd_active, copy_all
from hvd_topk.buckets import plan_buckets
from hvd_topk.codec import Codec, Encoded
from hvd_topk.schedule import DensitySchedule
from hvd_topk.selection import check_density, check_flag, check_number, native_ok
from hvd_topk.stats import CompressionStats

STATE_KEY = "hvd_topk"
STEP_KEY = "hvd_topk_step"  # in the optimizer's first param group (see TopKEngine.step)
STATE_FORMAT = 2
SCOPES = ("tensor", "bucket")
COMPILED_AUTOGRAD_ERROR = (
    "hvd_topk.DistributedOptimizer does not support compiled autograd "
    "(torch._dynamo.config.compiled_autograd = True): compiled autograd traces the gradient "
    "hooks that start each exchange, which hvd_topk does not support. Set "
    "torch._dynamo.config.compiled_autograd = False (torch.compile of the model can stay).")


@dataclasses.dataclass(frozen=True)
class Options:
    """The error-feedback optimizer's options (``hvd_topk.DistributedOptimizer`` keywords).

    Tuning, in order of what matters most:

    - Start at density 1% (``TopK(density=0.01)``) with ``error_feedback=True``: on the digits
      example it matches dense accuracy. Error feedback is what keeps accuracy; without it the
      entries not sent are lost.
    - Going to 0.1% saves another ~4x of bytes; add ``warmup_steps`` of about one epoch
      (DGC's exponential warm-up from ``warmup_density``) and move SGD momentum into
      ``momentum_correction`` (with the inner optimizer's momentum set to 0).
    - ``selection_scope="bucket"`` selects one top-k over each fusion bucket (k = density x the
      bucket's size) instead of k per tensor: a layer with large gradients gets more of the
      budget, often better per byte. ``"tensor"`` (default) is the per-tensor contract.
    - Keep ``min_numel`` so that biases and norms stay dense: they are cheap and sensitive.
    - ``exchange`` picks how buckets travel (``hvd_topk.exchange``). ``"auto"`` (default) runs
      ``exchange_trial_steps`` real steps with each strategy the cost model proposes (dense
      fp32, dense fp16, allgather, sparse allreduce) and keeps the fastest: on a fast network
      that may be dense, which is the point (never slower than not compressing). Force one with
      ``"allgather"`` (every rank's pairs; bytes grow with P), ``"sparse_allreduce"`` (a rotating
      leader's positions, values allreduced; bytes independent of P: the one for many ranks),
      ``"dense"`` or ``"dense_fp16"``. ``exchange_recheck_steps`` re-runs the trial that often
      (0: only when the world size changes).
    - ``dense_fallback`` sends a bucket dense when a ring allreduce would move fewer bytes than
      the sparse strategy (the allgather at density >= 1/P for fp32): leave it on.
    - ``hierarchical`` (``hvd_topk.hierarchy``): a dense reduce-scatter inside each host, Top-K
      and error feedback on this rank's shard of the host's sum, the sparse exchange only
      across hosts. ``"auto"``: on when ``hvd_topk.init()`` made the process sets and the job has
      several hosts with several ranks each.
    """

    error_feedback: bool = True
    momentum_correction: float = 0.0
    warmup_steps: int = 0
    warmup_density: float = 0.25
    min_numel: int = 1024
    fusion_bytes: int = 64 * 1024 * 1024
    dense_fallback: bool = True
    selection_scope: str = "tensor"
    sparse_as_dense: bool = False
    exchange: str = "auto"
    exchange_trial_steps: int = 3
    exchange_recheck_steps: int = 0
    hierarchical: object = "auto"

    def __post_init__(self):
        for key in ("error_feedback", "dense_fallback", "sparse_as_dense"):
            check_flag(getattr(self, key), key)
        for key, low in (("warmup_steps", 0), ("min_numel", 0), ("fusion_bytes", 1),
                         ("exchange_trial_steps", 1), ("exchange_recheck_steps", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{key} must be an integer, got {value!r}")
            if value < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
        m = check_number(self.momentum_correction, "momentum_correction")
        if not 0.0 <= m < 1.0:
            raise ValueError(f"momentum_correction must be in [0, 1), got {m!r}")
        if m and not self.error_feedback:
            raise ValueError("momentum_correction needs error_feedback=True")
        check_density(self.warmup_density, "warmup_density")
        if self.selection_scope not in SCOPES:
            raise ValueError(f"selection_scope must be one of {SCOPES}, got {self.selection_scope!r}")
        if self.exchange not in exchange.CHOICES:
            raise ValueError(f"exchange must be one of {exchange.CHOICES}, got {self.exchange!r}")
        if self.hierarchical not in ("auto", True, False) or isinstance(self.hierarchical, int) \
                and not isinstance(self.hierarchical, bool):
            raise ValueError(f"hierarchical must be 'auto', True or False, got {self.hierarchical!r}")


@dataclasses.dataclass
class StepPlan:
    """One bucket's exchange in the current step, fixed at its first fold."""
    plan: object          # codec.Plan (None for a dense-only bucket)
    strategy: type        # exchange strategy
    message: object       # send buffer (sparse strategies)
    encode: object        # codec.SegmentEncoder: select each tensor as it is folded in (or None)
    selects: bool = True  # this rank selects (all do, but the sparse allreduce's leader alone)
    leader: int = None    # the sparse allreduce's leader (index in the process set)
    nonfinite: list = dataclasses.field(default_factory=list)  # segments that held inf/nan
    unchecked: bool = False  # a fold that did not check for inf/nan (sparse allreduce, non-leader)
    hierarchical: bool = False  # a sparse strategy run hierarchically (hvd_topk.hierarchy)
    carry: bool = False      # hierarchical: the full buffer still holds a flat residual
    repasses: int = 0
    filled: int = 0
    seconds: float = 0.0  # selection time spent in hooks


@dataclasses.dataclass
class HierarchicalStep:
    """One bucket's hierarchical exchange in flight (``TopKEngine._hierarchical_stage``)."""
    strategy: type
    name: str
    plan: object
    stage: str             # whose collective is in flight: "host", "indices", "cross", "gather"
    handle: int
    current: StepPlan = None  # sparse allreduce: this rank's role among the ranks across hosts
    residual: object = None   # sparse allreduce: the shard residual its values are taken from
    rows: int = 1             # rows of pairs per shard in the result
    times: dict = dataclasses.field(default_factory=lambda: {"spent": 0.0})  # seconds, for the statistics


class TopKEngine:
    """Buckets, residuals, schedule, statistics and checkpoint state of one optimizer.

    Args:
        param_groups: the optimizer's ``param_groups`` (parameters with ``requires_grad`` are
            exchanged, in the optimizer's order).
        names: ``{param: name}`` (Horovod's naming rules, checked by the caller).
        compression: the ``TopK`` instance (density, method, fp16_values).
        options: ``Options``.
        op, gradient_predivide_factor, backward_passes_per_step, process_set, groups: as in
            ``hvd.DistributedOptimizer``.
        prefix: names this optimizer's collectives apart from any other's.
        grad_scaler: the ``torch.amp.GradScaler`` scaling the loss, or None (see ``_begin_step``).
    """

    def __init__(self, param_groups, names, compression, options, *, op, gradient_predivide_factor,
                 backward_passes_per_step, process_set, groups, prefix, grad_scaler=None):
        self.param_groups = param_groups
        self.param_ids = [id(p) for g in param_groups for p in g["params"]]
        params = [p for g in param_groups for p in g["params"] if p.requires_grad]
        self.options = options
        self.density = compression.density
        self.codec = Codec(compression.method, compression.fp16_values)
        self.op, self.predivide = op, float(gradient_predivide_factor)
        self.passes_per_step = backward_passes_per_step
        self.process_set = process_set
        self.prefix = prefix
        self.params = params
        self.frozen = [p for g in param_groups for p in g["params"] if not p.requires_grad]
        self.names = names
        self.shapes = [p.shape for p in params]
        # As in Horovod: a rank outside the process set exchanges nothing; its gradients stay local.
        self.member = bool(process_set.included())
        self.world = process_set.size()
        self.rank = process_set.rank() if self.member else None
        self.schedule = DensitySchedule(self.density, options.warmup_steps, options.warmup_density)
        # In an elastic job workers join later and run this constructor alone: no collective here.
        if self.member and not elastic_mode():
            self._check_ranks_agree(compression)
        self.buckets = plan_buckets(params, names, options.min_numel, options.fusion_bytes, groups)
        # the host / cross-host process sets when the hierarchical exchange may be used, and the
        # families (exchange strategies, "hier_" ones hierarchical) this job may use
        self.hier = hierarchy.resolve(options.hierarchical, process_set, elastic_mode()) if self.member else None
        self.families = auto.families(self.hier is not None, options.hierarchical is True)
        self.topology = None  # self.hier while this step's family is hierarchical
        if self.hier is not None and options.momentum_correction:
            raise ValueError("momentum_correction is not supported with the hierarchical exchange; pass "
                             "hierarchical=False, or momentum_correction=0.0 with the inner optimizer's momentum")
        # keyed by id(p): a tensor's __hash__ is a Python-level call, and these are read per hook
        self.place = {id(m.param): (b, i) for b in self.buckets for i, m in enumerate(b.members)}
        self.passes = dict.fromkeys(map(id, params), 0)
        self.step = 0
        self.stats = CompressionStats()
        self.synchronized = False
        self.should_synchronize = True
        self.grad_scaler = grad_scaler
        self.residual_scale = None  # the loss scale the residuals are expressed in
        self.step_begun = False    # _begin_step ran this step
        self.active = exchange.ActiveRanks(f"{self.prefix}.active")  # hvd.join() probe
        self.densified = []        # parameters whose sparse gradient was densified this step
        self.family = None         # this step's exchange family (exchange= or auto's choice)
        self.transform = None      # the inner optimizer's transform_local_gradient(p, grad), if any
        self.trial, self.trial_world = None, None  # exchange="auto": the trial of this world size
        self.used = {}             # bucket index -> strategy name of its last exchange
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                      for p in params] if self.member else []

    # ---- per step --------------------------------------------------------------------------
    def _on_grad(self, p):
        """The parameters' hook: what the exchange cannot take is refused (or, for a sparse
        gradient with ``sparse_as_dense``, converted) before ``on_grad_ready`` sees it."""
        if not self.step_begun:
            self._begin_step()
        grad = p.grad
        if grad is not None and grad.layout != torch.strided:
            self._densify(p)
        self.on_grad_ready(p)

    def _densify(self, p):
        """``sparse_as_dense``: exchange a sparse gradient dense; ``synchronize`` gives it back
        sparse, as Horovod does (an optimizer such as SparseAdam wants it so)."""
        if not self.options.sparse_as_dense:
            raise RuntimeError(f"parameter {self.names[p]!r} has a sparse gradient ({p.grad.layout}, "
                               "e.g. nn.Embedding(sparse=True)); hvd_topk exchanges dense gradients. "
                               "Pass sparse_as_dense=True to hvd_topk.DistributedOptimizer (as with "
                               "Horovod) to densify it and compress it as usual, or use a dense "
                               "embedding.")
        if all(q is not p for q in self.densified):  # (``in`` would compare tensors by value)
            self.densified.append(p)
        p.grad = p.grad.to_dense()

    def on_grad_ready(self, p):
        """Hook: after the last backward pass of the step, fold ``p.grad`` into its bucket."""
        key = id(p)
        passes = self.passes[key] + 1
        if passes > self.passes_per_step:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                 "before call to step(). Increase backward_passes_per_step to "
                                 "accumulate gradients locally.")
        self.passes[key] = passes
        if passes == self.passes_per_step:
            grad = p.grad
            if self.transform is not None:
                self.transform(p, grad)
            bucket, position = self.place[key]
            self._fold(bucket, position, grad)
            if bucket.complete():
                self._launch(bucket)

    def _begin_step(self):
        """Once per step, before anything is folded or exchanged (the first hook, or
        ``synchronize`` when none fired): refuse what would make ranks silently diverge, then
        keep the residuals in the units of this step's gradients."""
        self._check_step_start()
        self._follow_world()
        self._follow_loss_scale()
        self.family = self._family()
        self.topology = self.hier if self.family.startswith(auto.HIER) else None
        self.active.forget()
        if self.world > 1:
            # Started before the first fold, read when the first sparse bucket launches (by
            # then it has long arrived).
            self.active.start(self.process_set)
        self.step_begun = True

    def _family(self):
        """This step's strategy family: ``exchange=`` itself, or under ``"auto"`` the trial's.

        Everything here depends only on the step counter, the world size and the options, so
        every rank makes the same choice without talking."""
        mode = self.options.exchange
        if mode != "auto":
            return auto.HIER + mode if auto.HIER + mode in self.families else mode
        if self.world <= 1:
            return "dense"
        density = self.schedule.density(self.step)
        if density != self.density:  # density warm-up: no trial yet; the fewest bytes
            return min(self.families, key=lambda f: self._modelled_bytes(f, density))
        recheck = self.options.exchange_recheck_steps
        if (self.trial is None or self.trial_world != self.world
                or (recheck and self.trial.decided_at is not None
                    and self.step - self.trial.decided_at >= recheck)):
            self._start_trial(density)
        return self.trial.family()

    def _start_trial(self, density):
        assignments = {}
        for f in self.families:
            strategies = self._assign(f, density)
            hierarchical = f.startswith(auto.HIER) and any(s.sparse for s in strategies)
            assignments[f] = (hierarchical, tuple(s.name for s in strategies))
        byte_counts = {f: self._modelled_bytes(f, density) for f in self.families}
        candidates = auto.propose(assignments, byte_counts)
        self.trial = auto.Trial(candidates, self.options.exchange_trial_steps, self.process_set,
                                f"{self.prefix}.exchange_trial")
        self.trial_world = self.world
        if self.trial.choice is not None:
            auto.announce(f"exchange={self.trial.choice} for {self.world} ranks ({self.trial.reason()})")

    def _strategy(self, family, bucket, plan):
        """The strategy ``bucket`` uses under ``family``: a sparse one falls back to the dense
        allreduce where that moves fewer bytes (``dense_fallback``)."""
        if not bucket.sparse:
            return exchange.DenseAllreduce
        chosen = exchange.BY_NAME[family.removeprefix(auto.HIER)]
        if not chosen.sparse or not self.options.dense_fallback:
            return chosen
        if family.startswith(auto.HIER):  # the sparse part runs across hosts, on one shard
            sparse = chosen.wire_bytes(self.hier.cross_size, plan.numel, plan.count,
                                       plan.layout.value_itemsize, plan.layout.index_itemsize,
                                       bucket.element_size)
            dense = exchange.DenseAllreduce.wire_bytes(self.world, bucket.numel, 0, 0, 0, bucket.element_size)
            return chosen if sparse < dense else exchange.DenseAllreduce
        return exchange.cheapest((exchange.DenseAllreduce, chosen), self.world, bucket.numel, plan.count,
                                 plan.layout.value_itemsize, plan.layout.index_itemsize,
                                 bucket.element_size)

    def _assign(self, family, density):
        """The strategy of every sparse bucket under ``family`` at ``density``."""
        return [self._strategy(family, b, self._plan(b, density, family)) for b in self.buckets if b.sparse]

    def _plan(self, bucket, density, family):
        """The codec plan of a sparse bucket: over the bucket, or over this rank's shard of it
        (a hierarchical family). On its 1/L shard a rank selects at L x density, so that it
        still sends density x n pairs per step, as it would flat: a host then sends as many
        pairs as its L ranks would, taken from the host's sum."""
        scope = self.options.selection_scope
        if not family.startswith(auto.HIER):
            return bucket.plan(self.codec, density, scope)
        return bucket.plan(self.codec, min(1.0, density * self.hier.local_size), scope,
                           shard=self._shard(bucket))

    def _shard(self, bucket):
        edges = hierarchy.shard_bounds(bucket.numel, self.hier.local_size)
        return edges[self.hier.local_rank], edges[self.hier.local_rank + 1]

    def _modelled_bytes(self, family, density):
        """Bytes into one rank per step for the sparse buckets under ``family`` (the cost model)."""
        total = 0.0
        for b, strategy in zip([b for b in self.buckets if b.sparse], self._assign(family, density)):
            plan = self._plan(b, density, family)
            if family.startswith(auto.HIER) and strategy.sparse:
                total += strategy.wire_bytes(self.hier.cross_size, plan.numel, plan.count,
                                             plan.layout.value_itemsize, plan.layout.index_itemsize,
                                             b.element_size)
            else:
                total += strategy.wire_bytes(self.world, b.numel, plan.count, plan.layout.value_itemsize,
                                             plan.layout.index_itemsize, b.element_size)
        return total

    def _follow_world(self):
        """Horovod elastic re-forms the job (workers lost or added) between steps: the size
        decides the averaging and the sparse-or-dense choice, so it is read again each step."""
        world = self.process_set.size()
        if world != self.world:
            self.world, self.rank = world, self.process_set.rank()

    def _follow_loss_scale(self):
        """With loss scaling (``torch.amp.GradScaler``) every gradient, and so every residual, is
        multiplied by the scale of the step that produced it. The scaler halves the scale
        after an overflow and doubles it every ``growth_interval`` steps; a residual carried
        across such a change would be added back at the wrong scale. So when the scale has
        changed, the residuals (and DGC's momentum) are multiplied by new / old: exact for the
        scaler's powers of two, and a pass over memory only on the rare steps that change it.
        """
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return
        scale = float(scaler.get_scale())  # on CUDA one host sync per step
        old, self.residual_scale = self.residual_scale, scale
        if old is not None and scale != old:
            for b in self._residual_buckets():
                for flat in (b.acc, b.momentum, b.shard):
                    if flat is not None:
                        flat.mul_(scale / old)

    def _fold(self, bucket, position, grad):
        current = bucket.current or self._begin_bucket(bucket)
        ef, momentum = self._accumulates(bucket, current), self.options.momentum_correction
        if not ef and current.encode is None:
            bucket.mark_folded(position)  # a staging copy: ``copy_in`` when the bucket launches
            current.unchecked |= not current.selects
            return
        # a gradient the native kernels take as it is (in the fold's own pass)
        plain = grad is not None and grad.dtype == bucket.dtype and grad.is_contiguous()
        fused = current.encode is not None and ef and not momentum and plain
        if fused:
            bucket.mark_folded(position)
        elif not current.selects and ef and not momentum and grad is not None:
            # sparse allreduce, not the leader: fold only, noting inf/nan on the way
            folder = bucket.folder(self.codec) if plain else None
            bad = folder(position, grad) if folder is not None else \
                self.codec.fold(bucket.segment(bucket.buffer(), position), grad)
            bucket.mark_folded(position)
            if bad is None:
                current.unchecked = True
            elif bad:
                current.nonfinite.append(position)
        else:
            bucket.fold(position, grad, ef, momentum)
            current.unchecked |= not current.selects
        if current.encode is not None:
            t0 = time.perf_counter()
            bad, repasses, filled = current.encode(position, grad if fused else None)
            if bad:
                current.nonfinite.append(position)
            current.repasses += repasses
            current.filled += filled
            current.seconds += time.perf_counter() - t0

    def _accumulates(self, bucket, current):
        """Whether this step's fold adds into the bucket's residual (error feedback) rather than
        staging a copy of the gradients."""
        ef = bucket.sparse and self.options.error_feedback
        if current.hierarchical:
            # the buffer stages this step's gradients (the residual is the shard's), but on the
            # first hierarchical step after flat ones it still holds the flat residual: add to it
            ef = ef and current.carry
        return ef

    def _begin_bucket(self, bucket):
        """This step's plan for ``bucket``, made at its first fold: density, strategy, message.

        With tensor scope on the native kernel, each segment is selected as soon as its
        gradient arrives, in the fold's own pass; otherwise the whole buffer is selected once
        the bucket is complete."""
        density = self.schedule.density(self.step)
        family = self.family or self._family()
        plan = self._plan(bucket, density, family) if bucket.sparse else None
        strategy = self._strategy(family, bucket, plan)
        hierarchical = strategy.sparse and self.topology is not None
        leader = None
        if strategy is exchange.SparseAllreduce and not hierarchical:
            leader = strategy.leader(self.step, bucket.index, self.world)
        selects = strategy.sparse and leader in (None, self.rank)
        message = bucket.message(plan.layout.nbytes) if strategy.sparse else None
        encode = None
        if selects and plan.scope == "tensor" and native_ok(bucket.buffer()) and not hierarchical:
            encode = self.codec.segment_encoder(bucket.acc, plan, message,
                                                zero_sent=self.options.error_feedback)
        bucket.current = StepPlan(plan, strategy, message, encode, selects, leader,
                                  hierarchical=hierarchical)
        if bucket.sparse and self.options.error_feedback:
            self._hand_over_residual(bucket, "hier" if hierarchical else "flat")
        return bucket.current

    def _hand_over_residual(self, bucket, mode):
        """Between flat and hierarchical steps (exchange="auto"'s trial) the residual moves
        between the full buffer and the shard, so nothing unsent is lost: flat -> hierarchical,
        this step's gradients are added to the flat residual, which the host's reduce-scatter
        then carries into the shards; hierarchical -> flat, this rank's shard residual goes back
        into its part of the (staging, so zeroed) full buffer."""
        before, bucket.mode = bucket.mode, mode
        if mode == "hier":
            bucket.current.carry = before == "flat" and bucket.acc is not None
        elif before == "hier":
            bucket.buffer().zero_()
            if bucket.shard is not None:
                lo, hi = self._shard(bucket)
                bucket.acc[lo:hi].add_(bucket.shard)
                bucket.shard.zero_()

    def _launch(self, bucket):
        self._progress()
        for position, m in enumerate(bucket.members):
            if position not in bucket.folded:  # no gradient this step: contributes zeros
                self._fold(bucket, position, m.param.grad)
        current = bucket.current or self._begin_bucket(bucket)
        if current.encode is None and not self._accumulates(bucket, current):
            bucket.copy_in()  # the staging copy the folds left (see ``_fold``)
        plan, strategy = current.plan, current.strategy
        name = f"{self.prefix}.bucket{bucket.index}.{strategy.name}"
        dense_bytes = bucket.element_size
        self.stats.add(elements_total=bucket.numel, bytes_dense=bucket.numel * dense_bytes)
        if strategy.sparse and self._someone_joined():
            # hvd.join(): Horovod's joined ranks answer allreduces (with zeros), not allgathers.
            if current.encode is not None and self.options.error_feedback:
                self._unsend(bucket, current)
            strategy, plan, name = exchange.DenseAllreduce, None, name + ".joined"
        self.used[bucket.index] = strategy.name
        if strategy.sparse and current.hierarchical:  # (not when hvd.join() sent it dense)
            self._launch_hierarchical(bucket, strategy, plan, name)
            return
        if strategy.sparse:
            t0 = time.perf_counter()
            message = current.message
            ef = self.options.error_feedback
            encoded = Encoded([], 0, 0)
            if current.encode is not None:
                self.codec.finish_segments(plan, message, bucket.dtype)
                encoded = Encoded(current.nonfinite, current.repasses, current.filled)
            elif current.selects:
                encoded = self.codec.encode(bucket.acc, plan, message, zero_sent=ef)
            if current.selects:
                current.nonfinite = encoded.nonfinite
                if ef:
                    self._after_encode(bucket, plan, message, encoded)
            layout = plan.layout
            self.stats.add(time_selection_s=time.perf_counter() - t0 + current.seconds,
                           tensors_sparse=len(bucket.members),
                           elements_selected=plan.count, bytes_sent=_payload_bytes(strategy, layout),
                           selection_repasses=encoded.repasses, selection_filled=encoded.filled)
            if strategy is exchange.SparseAllreduce:
                _, indices = layout.views(message)
                handle = ("indices", strategy.start_indices(indices, current.leader, name, self.process_set))
            else:
                handle = strategy.start(message, name, self.process_set)
        else:
            self.stats.add(tensors_dense=len(bucket.members), elements_selected=bucket.numel,
                           bytes_sent=bucket.numel * strategy.wire_dtype(bucket.dtype).itemsize)
            wire = None
            if strategy.wire_dtype(bucket.dtype) != bucket.dtype:
                wire = bucket.scratch("wire", bucket.numel, strategy.wire_dtype(bucket.dtype))
            handle = strategy.start(bucket.acc, name, self.process_set, self.op, self.predivide, wire=wire)
        bucket.pending = (strategy, handle, plan)

    # ---- hierarchical (hvd_topk.hierarchy) ------------------------------------------------
    def _launch_hierarchical(self, bucket, strategy, plan, name):
        """Start the host's reduce-scatter of this step's gradients; ``_hierarchical_stage``
        takes it on from there."""
        wire_dtype = allreduce_dtype(bucket.dtype)
        staged = bucket.acc
        if wire_dtype != bucket.dtype:
            staged = bucket.scratch("wire", bucket.numel, wire_dtype).copy_(bucket.acc)
        handle = hierarchy.reduce_scatter(staged, self.topology.local, name + ".host")
        self.stats.add(tensors_sparse=len(bucket.members), elements_selected=plan.count,
                       bytes_sent=_payload_bytes(strategy, plan.layout))
        bucket.pending = ("hierarchical", HierarchicalStep(strategy, name, plan, "host", handle), plan)

    def _hierarchical_stage(self, bucket):
        """Wait for the collective of the bucket's current hierarchical stage and start the next:

        - "host": the host's reduce-scatter -> error feedback and Top-K on this rank's shard,
          then the exchange among the ranks with this local rank ("cross"; the sparse
          allreduce first broadcasts its leader's indices, "indices");
        - "cross": its result -> the allgather of the exchanged shards inside the host ("gather");
        - "gather": every shard's pairs -> decoded into ``p.grad``; the bucket is done.

        ``_progress`` calls it as soon as a stage has arrived (buckets launching during
        backward), up to "gather", so the first buckets' later stages overlap the rest of
        backward; the decode into ``p.grad`` runs in ``synchronize()``."""
        h, topo = bucket.pending[1], self.topology
        t0 = time.perf_counter()
        if h.stage == "host":
            shard = hvd.synchronize(h.handle)
            h.times["host"] = time.perf_counter() - t0
            self._select_shard(bucket, h, shard)
        elif h.stage == "indices":
            h.strategy.finish(h.handle)
            h.times["cross"] = time.perf_counter() - t0
            values = self._gather_values(bucket, h.current, h.plan, h.residual)
            h.stage, h.handle = "cross", h.strategy.start_values(values, h.name + ".cross", topo.cross)
        elif h.stage == "cross":
            if h.strategy is exchange.SparseAllreduce:
                result, h.rows = self._sparse_allreduce_result(bucket, h.handle, h.plan, h.current.message), 1
            else:
                result, h.rows = h.strategy.finish(h.handle), topo.cross_size
            h.times["cross"] = h.times.get("cross", 0.0) + time.perf_counter() - t0
            # Inside the host the shards' results travel still compressed, and every rank decodes all.
            h.stage, h.handle = "gather", hvd.allgather_async(result, name=h.name + ".gather", process_set=topo.local)
        else:
            every = hvd.synchronize(h.handle)
            h.times["gather"] = time.perf_counter() - t0
            self._decode_shards(bucket, h, every)
            bucket.reset()
            times = h.times
            spent = times["spent"] + time.perf_counter() - t0
            self.stats.add(time_exchange_s=spent - times["selection"], time_selection_s=times["selection"],
                           time_host_reduce_s=times["host"], time_cross_s=times["cross"],
                           time_host_gather_s=times["gather"])
            return
        h.times["spent"] += time.perf_counter() - t0

    def _select_shard(self, bucket, h, shard):
        """Host sum of this rank's shard -> error feedback and Top-K on it -> start the exchange
        among the ranks with this local rank."""
        topo, ef, plan, strategy = self.topology, self.options.error_feedback, h.plan, h.strategy
        lo, hi = self._shard(bucket)
        residual = bucket.shard_residual(hi - lo)
        if ef:
            residual.add_(shard)
        else:
            residual.copy_(shard)
        message = bucket.message(plan.layout.nbytes)
        t0 = time.perf_counter()
        if strategy is exchange.SparseAllreduce:
            leader = strategy.leader(self.step, bucket.index, topo.cross_size)
            # a non-leader's shard was summed by the reduce-scatter: nothing checked it for inf/nan
            h.current = StepPlan(plan, strategy, message, None, topo.cross_rank == leader, leader,
                                 unchecked=True)
            if h.current.selects:
                encoded = self.codec.encode(residual, plan, message, zero_sent=ef)
                h.current.nonfinite = encoded.nonfinite
                self._wipe_shard(residual, plan, encoded.nonfinite, ef)
            h.residual = residual
            _, indices = plan.layout.views(message)
            h.stage, h.handle = "indices", strategy.start_indices(indices, leader, h.name + ".cross", topo.cross)
        else:
            encoded = self.codec.encode(residual, plan, message, zero_sent=ef)
            self._wipe_shard(residual, plan, encoded.nonfinite, ef)
            h.stage, h.handle = "cross", strategy.start(message, h.name + ".cross", topo.cross)
        h.times["selection"] = time.perf_counter() - t0

    def _decode_shards(self, bucket, h, every):
        """Every shard's exchanged pairs (``rows`` rows each, shard after shard) into ``p.grad``."""
        topo = self.topology
        div = float(self.world) if self.op == hvd.Average else 1.0
        full = bucket.scratch("hierarchical_result", bucket.numel, bucket.dtype)
        edges, offset = hierarchy.shard_bounds(bucket.numel, topo.local_size), 0
        for a, b in zip(edges, edges[1:]):
            part = bucket.plan(self.codec, h.plan.density, self.options.selection_scope, shard=(a, b))
            size = h.rows * part.layout.nbytes
            self.codec.decode(every[offset:offset + size], part.layout, h.rows, [full[a:b]],
                              torch.tensor([0, b - a], dtype=torch.int64), div=div)
            offset += size
        self._write_grads(bucket, full)

    def _wipe_shard(self, residual, plan, nonfinite, ef):
        """A shard segment that held inf/nan (it was sent) starts again from zero."""
        if not ef:
            return
        if isinstance(nonfinite, list):
            for s in nonfinite:
                residual[plan.starts[s]:plan.starts[s + 1]].zero_()
            if nonfinite:
                self.stats.add(nonfinite_resets=len(nonfinite))
        else:
            per_element = nonfinite.repeat_interleave(torch.tensor(plan.sizes, device=nonfinite.device),
                                                      output_size=residual.numel())
            residual.masked_fill_(per_element, 0)

    def _progress(self, wait=False):
        """Start the value allreduce of every sparse-allreduce bucket whose leader's indices
        have arrived (all of them, waiting, with ``wait``), and take every hierarchical bucket
        through the stages that have arrived (never waiting) up to its host allgather: called
        whenever a bucket launches, so the later collectives overlap backward too. The decode
        waits for ``synchronize()``: until then ``p.grad`` holds this rank's own gradient."""
        for bucket in self.buckets:
            while bucket.pending is not None and bucket.pending[0] == "hierarchical" \
                    and bucket.pending[1].stage != "gather" and hvd.poll(bucket.pending[1].handle):
                self._hierarchical_stage(bucket)
            if bucket.pending is None or bucket.pending[0] is not exchange.SparseAllreduce:
                continue
            strategy, (phase, handle), plan = bucket.pending
            if phase == "indices" and (wait or hvd.poll(handle)):
                strategy.finish(handle)
                values = self._gather_values(bucket, bucket.current, plan)
                name = f"{self.prefix}.bucket{bucket.index}.{strategy.name}"
                bucket.pending = (strategy, ("values", strategy.start_values(values, name, self.process_set)),
                                  plan)

    def _gather_values(self, bucket, current, plan, flat=None):
        """The sparse allreduce's second half on this rank: its values at the leader's indices
        (the leader's are in its message already), zeroed in the residual ``flat`` (the bucket's
        buffer, or a hierarchical shard) with error feedback, and a last slot that is NaN when
        this rank's accumulator held inf/nan, 0 otherwise."""
        layout = plan.layout
        sent, indices = layout.views(current.message)
        k = layout.count
        values = bucket.scratch("values", k + 1, allreduce_dtype(layout.value_dtype))
        flat = bucket.acc if flat is None else flat
        if current.selects:
            values[:k].copy_(sent)
            bad = bool(current.nonfinite) if isinstance(current.nonfinite, list) else current.nonfinite.any()
        else:
            bad = bool(current.nonfinite)
            if current.unchecked:
                bad = ~torch.isfinite(flat).all() | bad  # a device tensor: no host sync
            self.codec.take(flat, indices, values[:k], zero=self.options.error_feedback)
            if self.options.error_feedback:
                if bucket.momentum is not None:
                    bucket.momentum.index_fill_(0, indices.long(), 0)
                self._wipe_nonfinite(bucket, current, bad, flat)
        if torch.is_tensor(bad):
            values[k:].copy_(torch.where(bad, float("nan"), 0.0))
        else:
            values[k] = float("nan") if bad else 0.0
        return values

    def _wipe_nonfinite(self, bucket, current, bad, residual):
        """A non-leader's residual that held inf/nan starts again from zero: the segments seen
        by the checking fold, or all of it when only a device flag knows."""
        if current.unchecked:
            for flat in (residual, bucket.momentum):
                if flat is not None:
                    flat.masked_fill_(bad, 0)
            self.stats.add_tensor("nonfinite_resets", bad.to(torch.int64) * len(bucket.members))
            return
        for s in current.nonfinite:
            for flat in (bucket.acc, bucket.momentum):
                if flat is not None:
                    bucket.segment(flat, s).zero_()
        if current.nonfinite:
            self.stats.add(nonfinite_resets=len(current.nonfinite))

    def _someone_joined(self):
        active = self.active.read()
        return active is not None and active < self.world

    def _unsend(self, bucket, current):
        """Put the entries selected into the message back into the residual (they were zeroed
        there as they were selected): the bucket goes dense instead. Exact: the values are
        copied back, from the full-precision scratch where the message holds fp16."""
        values, indices = current.plan.layout.views(current.message)
        if values.dtype != bucket.dtype:
            values = current.plan.value_scratch(bucket.dtype)
        bucket.acc.index_copy_(0, indices.long(), values)

    def _after_encode(self, bucket, plan, message, encoded):
        """Error feedback after selection: DGC momentum factor masking, and wiping a residual
        that held inf/nan (it still went out, so GradScaler sees it and skips the step)."""
        if bucket.momentum is not None:
            _, indices = plan.layout.views(message)
            bucket.momentum.index_fill_(0, indices.long(), 0)
        bad = encoded.nonfinite
        if isinstance(bad, list):
            if not bad:
                return
            whole = plan.scope == "bucket"
            for s in bad:
                for flat in (bucket.acc, bucket.momentum):
                    if flat is not None:
                        (flat if whole else bucket.segment(flat, s)).zero_()
            self.stats.add(nonfinite_resets=len(bucket.members) if whole else len(bad))
        else:  # a device tensor, one flag per segment: wipe without reading it on the host
            per_element = bad.repeat_interleave(torch.tensor(plan.sizes, device=bad.device),
                                                output_size=bucket.numel)
            for flat in (bucket.acc, bucket.momentum):
                if flat is not None:
                    flat.masked_fill_(per_element, 0)
            self.stats.add_tensor("nonfinite_resets", bad.sum())

    def _finish(self, bucket):
        if bucket.pending[0] == "hierarchical":
            while bucket.pending is not None:
                self._hierarchical_stage(bucket)
            return
        if bucket.pending[0] is exchange.SparseAllreduce:
            self._progress(wait=True)
        strategy, handle, plan = bucket.pending
        t0 = time.perf_counter()
        if strategy is exchange.SparseAllreduce:
            result = self._sparse_allreduce_result(bucket, handle[1], plan, bucket.current.message)
            world = 1  # one row of pairs: the leader's indices with the summed values
        else:
            result, world = strategy.finish(handle), self.world
        if strategy.sparse:
            dests, copies = [], []  # decode overwrites every element of its destinations
            for m in bucket.members:
                grad = m.param.grad
                if grad is None:
                    grad = m.param.grad = torch.empty_like(m.param, memory_format=torch.contiguous_format)
                if grad.is_contiguous():
                    dests.append(grad.view(-1))
                else:  # e.g. channels_last: decode contiguously, then copy into its layout
                    dests.append(torch.empty(m.numel, dtype=grad.dtype, device=grad.device))
                    copies.append((grad, dests[-1]))
            div = float(self.world) if self.op == hvd.Average else 1.0
            self.codec.decode(result, plan.layout, world, dests, bucket.bounds, div=div)
            for grad, flat in copies:
                grad.copy_(flat.view(grad.shape))
        else:
            self._write_grads(bucket, result)
            if bucket.sparse and self.options.error_feedback:
                bucket.acc.zero_()  # everything was sent: the residual starts again from zero
                if bucket.momentum is not None:
                    bucket.momentum.zero_()
        bucket.reset()
        self.stats.add(time_exchange_s=time.perf_counter() - t0)

    @staticmethod
    def _write_grads(bucket, flat):
        """Each member's part of the exchanged ``flat`` result into its ``p.grad``."""
        grads, parts = [], []
        for m, summed in zip(bucket.members, bucket.views(flat)):
            if m.param.grad is None:
                m.param.grad = summed.clone()
            else:
                grads.append(m.param.grad)
                parts.append(summed)
        if grads:
            copy_all(grads, parts)

    def _sparse_allreduce_result(self, bucket, handle, plan, message):
        """The summed values, written back into ``message`` beside the leader's indices (a
        one-row message for ``decode``); every value is NaN when a rank flagged inf/nan."""
        exchange.SparseAllreduce.finish(handle)
        k = plan.layout.count
        values = bucket.scratch("values", k + 1, allreduce_dtype(plan.layout.value_dtype))
        values[:k].add_(values[k:] * 0)  # 0 when every rank was finite, NaN otherwise
        sent, _ = plan.layout.views(message)
        sent.copy_(values[:k])
        return message

    def synchronize(self):
        """Finish every exchange of this step; afterwards ``p.grad`` holds the averaged result."""
        if not self.member:  # outside the process set: gradients stay local, as in Horovod
            self.synchronized = True
            return
        self._check_parameters_unchanged()
        if not self.step_begun:
            self._begin_step()
        for bucket in self.buckets:
            if bucket.pending is None:
                self._launch(bucket)
        # hierarchical buckets stage by stage: every bucket's exchange across hosts in flight
        # before any of them is waited for
        for stage in ("host", "indices", "cross"):
            for bucket in self.buckets:
                if bucket.pending is not None and bucket.pending[0] == "hierarchical" \
                        and bucket.pending[1].stage == stage:
                    self._hierarchical_stage(bucket)
        for bucket in self.buckets:
            self._finish(bucket)
        self.active.read()  # (when no sparse bucket read it this step)
        self.passes = dict.fromkeys(self.passes, 0)
        self._resparsify()
        if self.trial is not None and self.options.exchange == "auto" and self.trial_world == self.world \
                and self.schedule.density(self.step) == self.density:
            if self.trial.step_done(self.step):
                auto.announce(f"exchange={self.trial.choice} for {self.world} ranks ({self.trial.reason()})")
        self.step += 1
        self.stats.add(steps=1)
        self.synchronized = True
        self.step_begun = False

    def pending(self):
        return any(b.pending is not None for b in self.buckets)

    @property
    def step(self):
        """Steps done: drives the warm-up density, so it must agree on every rank.

        It lives in the optimizer's first param group (key ``STEP_KEY``) rather than here,
        because ``hvd.broadcast_optimizer_state`` broadcasts every param-group option from the
        root rank (as it does the learning rate): a checkpoint loaded on rank 0 then brings every
        rank to its step. (Horovod returns before broadcasting anything for an optimizer that
        has no state, e.g. SGD without momentum; there, as for the learning rate, load the
        checkpoint on every rank.) Torch saves and loads it with the param groups.
        """
        return self.param_groups[0].get(STEP_KEY, 0)

    @step.setter
    def step(self, value):
        self.param_groups[0][STEP_KEY] = int(value)

    def forget_step(self):
        """Drop this step's progress (folds already in the residual stay: load_state_dict then
        overwrites the residual)."""
        for b in self.buckets:
            b.reset()
        self.passes = dict.fromkeys(self.passes, 0)
        self.synchronized, self.should_synchronize = False, True
        self.step_begun, self.densified = False, []
        self.active.forget()  # a reset Horovod forgot it too

    def _resparsify(self):
        for p in self.densified:
            p.grad = p.grad.to_sparse()
        self.densified = []

    # ---- state -----------------------------------------------------------------------------
    def _residual_buckets(self):
        return [b for b in self.buckets if b.sparse] if self.options.error_feedback else []

    def state_dict(self):
        """This rank's residuals and momentum buffers (per parameter name), the step counter,
        and the rank/world size they belong to."""
        residuals, momenta = {}, {}
        if self.hier is not None:  # per bucket: this rank's shard, or its full buffer after flat steps
            shards = {str(b.index): b.shard.clone() for b in self._residual_buckets()
                      if b.mode == "hier" and b.shard is not None}
            flat = {str(b.index): b.acc.clone() for b in self._residual_buckets()
                    if b.mode == "flat" and b.acc is not None}
            return {"format": STATE_FORMAT, "step": self.step, "rank": self.rank, "size": self.world,
                    "residuals": {}, "momenta": {}, "residual_scale": self.residual_scale,
                    "shards": shards, "flat_buffers": flat, "hierarchy": self._hierarchy_key()}
        for b in self._residual_buckets():
            for m in b.members:
                if b.acc is not None:
                    residuals[m.name] = b.view(b.acc, m).clone()
                if b.momentum is not None:
                    momenta[m.name] = b.view(b.momentum, m).clone()
        return {"format": STATE_FORMAT, "step": self.step, "rank": self.rank, "size": self.world,
                "residuals": residuals, "momenta": momenta, "residual_scale": self.residual_scale}

    def _hierarchy_key(self):
        t = self.hier
        return None if t is None else [t.local_rank, t.local_size, t.cross_rank, t.cross_size,
                                       [b.numel for b in self.buckets]]

    def load_state_dict(self, state, param_groups=None):
        """Restore ``state_dict()``'s output (the caller checked that no exchange is pending).

        ``param_groups``: the optimizer's groups after torch's ``load_state_dict`` replaced
        them (the step counter lives there); with ``state`` None the step is kept.
        """
        self.forget_step()
        # exchange="auto": measure again from here. Every rank restoring (and an elastic job's new
        # worker, whose trial has not started) then starts its trial at the same step.
        self.trial, self.trial_world = None, None
        step = self.step
        if param_groups is not None:
            self.param_groups = param_groups
        self.step = step if state is None else state["step"]
        if state is None:
            return
        self.residual_scale = state.get("residual_scale")
        same_rank = (state["rank"], state["size"]) == (self.rank, self.world)
        if self.hier is not None or state.get("hierarchy") is not None:
            self._load_shards(state, same_rank)
            return
        if same_rank:
            ours = [m.name for b in self._residual_buckets() for m in b.members]
            residuals, dropped = _match_names(state.get("residuals", {}), ours)
            momenta, dropped_momenta = _match_names(state.get("momenta", {}), ours)
            _warn_dropped(dropped + [n for n in dropped_momenta if n not in dropped])
            for b in self._residual_buckets():
                if residuals or b.acc is not None:
                    _restore(b, b.buffer(), residuals)
                if momenta or b.momentum is not None:
                    _restore(b, b.momentum_buffer(), momenta)
            return
        for b in self._residual_buckets():
            for flat in (b.acc, b.momentum):
                if flat is not None:
                    flat.zero_()
        if self.options.error_feedback:
            warnings.warn(f"hvd_topk: this state was saved by rank {state['rank']} of {state['size']} "
                          f"and is loaded on rank {self.rank} of {self.world}: error-feedback "
                          "residuals start from zero. Save and load one state per rank to resume exactly.")

    def _load_shards(self, state, same_rank):
        """Hierarchical residuals come back only into the same place of the same job shape
        (rank, hosts, ranks per host, buckets); anywhere else they start from zero."""
        exact = same_rank and state.get("hierarchy") == self._hierarchy_key()
        shards = state.get("shards", {}) if exact else {}
        flat = state.get("flat_buffers", {}) if exact else {}
        for b in self._residual_buckets():
            key = str(b.index)
            for buf in (b.shard, b.acc):
                if buf is not None:
                    buf.zero_()
            b.mode = None
            if key in shards:
                b.shard_residual(shards[key].numel()).copy_(shards[key])
                b.mode = "hier"
            elif key in flat:
                b.buffer().copy_(flat[key])
                b.mode = "flat"
        if not exact and self.options.error_feedback:
            warnings.warn("hvd_topk: this state was saved at another place in the job or with another "
                          f"exchange layout (rank {state['rank']} of {state['size']}, hierarchy "
                          f"{state.get('hierarchy')}; here rank {self.rank} of {self.world}, hierarchy "
                          f"{self._hierarchy_key()}): error-feedback residuals start from zero.")

    # ---- statistics ------------------------------------------------------------------------
    def compression_stats(self):
        out = self.stats.as_dict()
        out["step"] = self.step
        out["current_density"] = self.schedule.density(self.step)
        out["buckets_sparse"] = sum(b.sparse for b in self.buckets)
        out["buckets_dense"] = sum(not b.sparse for b in self.buckets)
        out["selection_scope"] = self.options.selection_scope
        out["world_size"] = self.world
        out["hierarchical"] = self.topology is not None
        out["exchange"] = self.options.exchange
        out["exchange_family"] = self.family
        if self.options.exchange == "auto":
            out["exchange_reason"] = self.trial.reason() if self.trial is not None else (
                "one rank: nothing to exchange" if self.world <= 1 else "density warm-up: fewest bytes")
            if self.trial is not None:
                out["exchange_candidates"] = list(self.trial.candidates)
                out["exchange_choice"] = self.trial.choice
                out["exchange_median_step_s"] = dict(self.trial.medians or {})
        out["bucket_strategies"] = dict(self.used)
        return out

    # ---- checks ----------------------------------------------------------------------------
    def _check_ranks_agree(self, compression):
        """Every rank must wrap the same model with the same settings: fail on all ranks at once."""
        signature = repr(([(self.names[p], tuple(p.shape), str(p.dtype)) for p in self.params],
                          compression.density, compression.method, compression.fp16_values,
                          self.passes_per_step, dataclasses.astuple(self.options)))
        digest = int.from_bytes(hashlib.sha256(signature.encode()).digest()[:7], "big")
        mine = torch.tensor([[digest, len(self.params), sum(p.numel() for p in self.params)]],
                            dtype=torch.int64)
        every = hvd.allgather(mine, name=f"{self.prefix}.check_ranks", process_set=self.process_set)
        if bool((every != every[0]).any()):
            lines = [f"rank {r}: {n} parameters, {e:,} elements"
                     for r, (_, n, e) in enumerate(every.tolist())]
            differ = [r for r in range(every.shape[0]) if not torch.equal(every[r], every[0])]
            raise ValueError("hvd_topk.DistributedOptimizer: ranks disagree on the model or its "
                             f"settings (parameter names, shapes, dtypes, density, options); ranks "
                             f"{differ} differ from rank 0:\n  " + "\n  ".join(lines))

    def _check_step_start(self):
        """What would make ranks silently diverge (the same on every rank, so every rank raises
        at the same point)."""
        if compiled_autograd_active():
            raise RuntimeError(COMPILED_AUTOGRAD_ERROR)
        for p in self.frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"parameter {self.names[p]!r} had requires_grad=False when "
                    "hvd_topk.DistributedOptimizer was built and is trainable now: its gradient "
                    "would never be exchanged and ranks would silently diverge. Set requires_grad="
                    "True on every parameter to be trained before building the "
                    "DistributedOptimizer, or build a new one after unfreezing.")

    def _check_parameters_unchanged(self):
        ids = [id(p) for g in self.param_groups for p in g["params"]]
        if ids != self.param_ids or any(p.shape != s for p, s in zip(self.params, self.shapes)):
            raise RuntimeError("the optimizer's parameters changed after hvd_topk.DistributedOptimizer "
                               "was built (parameters added, removed, replaced or resized); build "
                               "the DistributedOptimizer after the model and its param_groups are final")


def _payload_bytes(strategy, layout):
    """What one rank hands to the network for a sparse bucket: its packed message, or for the
    sparse allreduce the indices plus the values and the flag slot."""
    if strategy is exchange.SparseAllreduce:
        return layout.count * layout.index_itemsize + (layout.count + 1) * layout.value_itemsize
    return layout.nbytes


def _restore(bucket, flat, saved):
    """Copy each member's saved tensor into its part of ``flat``; zeros where none was saved."""
    for m in bucket.members:
        view = bucket.view(flat, m)
        if m.name in saved:
            view.copy_(saved[m.name])
        else:
            view.zero_()


COMPILED_MODULE = "_orig_mod"  # the attribute torch.compile's OptimizedModule keeps the model in


def _plain_name(name):
    """``name`` without ``torch.compile``'s ``_orig_mod`` components: a compiled model's
    ``_orig_mod.fc.weight`` (or ``block._orig_mod.fc.weight``) is the plain model's ``fc.weight``."""
    return ".".join(part for part in name.split(".") if part != COMPILED_MODULE)


def _match_names(saved, ours):
    """``saved`` re-keyed by the names in ``ours`` (exact name first, else equal once the
    ``_orig_mod`` prefixes are removed), and the saved names that matched none."""
    by_plain = {_plain_name(n): n for n in ours}
    ours = set(ours)
    matched, dropped = {}, []
    for name, tensor in saved.items():
        target = name if name in ours else by_plain.get(_plain_name(name))
        if target is None:
            dropped.append(name)
        else:
            matched[target] = tensor
    return matched, dropped


def _warn_dropped(names, shown=5):
    """One warning per load for saved residuals that belong to no parameter here."""
    if not names:
        return
    listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
    warnings.warn(f"hvd_topk: {len(names)} saved error-feedback residual(s) match no parameter that "
                  f"this optimizer exchanges with error feedback and were dropped: {listed}. Were "
                  "they saved from a different model, or with other named_parameters, min_numel or "
                  "error_feedback? (torch.compile's '_orig_mod.' prefix is mapped automatically.)")
