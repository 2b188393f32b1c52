"""The error-feedback engine: what ``hvd_topk.DistributedOptimizer`` does in each step.

Like ``torch.distributed``'s ``PowerSGDState``, one object holds the per-step machinery of one
optimizer; ``hvd_topk.DistributedOptimizer`` is a thin wrapper that calls ``on_grad_ready``
from each parameter's hook, ``synchronize`` before the inner step, and
``state_dict``/``load_state_dict``. The parts live in their own modules:

- ``hvd_topk.options``: the options and the tuning guide;
- ``hvd_topk.buckets``: the buckets, their flat residual buffers and what is done to them;
- ``hvd_topk.planner``: which strategy each bucket uses this step (cost model, ``auto`` trial);
- ``hvd_topk.inflight``: one bucket's exchange from launch to decode, one class per strategy;
- ``hvd_topk.checkpoint``: the residuals in and out of the optimizer's ``state_dict``.

One step, per bucket:

1. at the bucket's first gradient of the step its ``BucketStep`` is fixed: density, the
   exchange strategy (the planner's), the send buffer;
2. each gradient, once its backward passes are done, is folded into the bucket's flat buffer
   (error feedback: ``acc += grad``; a bucket that only stages a copy of its gradients takes them
   all in one call when it is complete); ``p.grad`` keeps this rank's gradient. With tensor scope on
   the native kernel the gradient's top-k is selected right then, in the fold's own pass over
   memory, into its slots of the message, zeroing what it sent; with bucket scope (or torch ops)
   the whole buffer is selected in one call once the bucket is complete. (With the sparse
   allreduce each rank selects only in its part of the bucket, and elsewhere only folds.)
3. when the bucket is complete its exchange starts (overlapping the rest of backward);
4. ``synchronize`` finishes every exchange and writes the averaged result into ``p.grad``, the
   same bits on every rank.
"""

import time
import warnings
import weakref

import torch

from hvd_topk import agreement, checkpoint, exchange, hierarchy, inflight
from hvd_topk.agreement import group_options
from hvd_topk._horovod import elastic_mode, hvd
from hvd_topk._stack import outside_level
from hvd_topk._torch import still_written, written
from hvd_topk.buckets import make_buckets
from hvd_topk.checks import DENSE_EXCHANGES
from hvd_topk.codec import Codec
from hvd_topk.compact import check_compact_use
from hvd_topk.loss_scale import ResidualScale
from hvd_topk.optim._common import named_few
from hvd_topk.planner import ExchangePlanner
from hvd_topk.rank_checks import (check_parameters_unchanged, check_ranks_agree, check_step_start, differing_options,
                                  parameter_signature, process_set_size)
from hvd_topk.schedule import DensitySchedule
from hvd_topk.selection import native_ok, sample_seed
from hvd_topk.sparse_grads import SparseGradients
from hvd_topk.stats import DENSE_FP32_BYTES, CompressionStats

# Appended to Horovod's two errors about gradients left unexchanged: here the usual cause
STEPPED_THE_INNER = (" If you stepped the optimizer you passed to hvd_topk.DistributedOptimizer rather than "
                     "the one it returned, that applied this rank's own gradient without an exchange: step "
                     "the returned one.")

STEPPED_AGAIN = ("hvd_topk.DistributedOptimizer over {}: step() again without a new backward(): p.grad still "
                 "holds the update the last step applied, which would be taken for a gradient and applied "
                 "again; run zero_grad() and backward() before each step() (gradients written by hand through "
                 "p.grad.data are not seen as changed by PyTorch: write p.grad itself)")
NOTHING_TO_EXCHANGE = (
    "hvd_topk.DistributedOptimizer: synchronize() in a step where no gradient hook fired and every p.grad is "
    "still what the last synchronize() wrote (the ranks' average): nothing is exchanged, as Horovod's second "
    "average of it would change nothing (a synchronize() after step() to flush, or step() again without "
    "backward()). If you wrote gradients by hand through p.grad.data.copy_(...), PyTorch does not count that as "
    "a change and they were NOT exchanged: write p.grad.copy_(...) or assign p.grad instead. (Warned once.)")
GRAD_CHANGED = (
    "hvd_topk.DistributedOptimizer: p.grad of {names} was written to or replaced after backward() handed it to "
    "the exchange and before synchronize() (gradient clipping before step()?): this rank's gradient was already "
    "taken in during backward() (but for a bucket still waiting at synchronize() for a gradient this rank did not "
    "compute), so the change does not reach the exchanged result (as under Horovod, in silence there). {fix} "
    "(Warned once.)")
CLIP_AFTER_SYNCHRONIZE = ("To clip the ranks' averaged gradient, as with Horovod: opt.synchronize(); "
                          "torch.nn.utils.clip_grad_norm_(...); with opt.skip_synchronize(): opt.step().")
STEP_KEY = "hvd_topk_step"  # in the optimizer's first param group (see TopKEngine.step)
TRIAL_KEY = "hvd_topk_exchange_trial"  # there too: exchange="auto"'s progress (TopKEngine._follow_root)


_OWNER = {}  # id(parameter) -> (weakref to it, weakref to the engine whose hooks it carries)


def _register_hooks(engine):
    """The parameters' post-accumulate-grad hooks, holding the engine weakly: an optimizer that
    is dropped (its engine collected) or replaced by a new ``DistributedOptimizer`` over the same
    parameters (after unfreezing a layer, say) stops exchanging, instead of living on through its
    hooks and raising, or starting exchanges nobody waits for, at the next backward."""
    ref = weakref.ref(engine)

    def hook(p):
        alive = ref()
        if alive is not None:
            alive._on_grad(p)
    for p in engine.params:
        param_ref, owner_ref = _OWNER.get(id(p), (None, None))
        old = owner_ref() if param_ref is not None and param_ref() is p else None
        if old is not None and old is not engine:
            old.retire()
        if param_ref is None or param_ref() is not p:
            weakref.finalize(p, _OWNER.pop, id(p), None)
        _OWNER[id(p)] = (weakref.ref(p), ref)
    handles = [p.register_post_accumulate_grad_hook(hook) for p in engine.params]
    weakref.finalize(engine, _remove_all, handles)
    return handles


def _remove_all(handles):
    for handle in handles:
        handle.remove()


class TopKEngine:
    """Buckets, residuals, schedule, statistics and checkpoint state of one optimizer.

    Args:
        param_groups: the optimizer's ``param_groups`` (parameters with ``requires_grad`` are
            exchanged, in the optimizer's order).
        names: ``{param: name}`` (Horovod's naming rules, checked by the caller).
        compression: the ``TopK`` instance (density, method, fp16_values, compact).
        options: ``hvd_topk.options.Options``.
        op, gradient_predivide_factor, backward_passes_per_step, process_set, groups: as in
            ``hvd.DistributedOptimizer``.
        prefix: names this optimizer's collectives apart from any other's.
        grad_scaler: the ``torch.amp.GradScaler`` scaling the loss, or None (``hvd_topk.loss_scale``).
        inner: the inner optimizer's class name (compared between ranks: ``LocalAdamW`` sends
            updates where a plain optimizer sends gradients).
        updates: whether that optimizer sends updates (``transform_local_gradient``), which
            narrows ``exchange="auto"`` (``hvd_topk.planner``).
        momentum: whether the residual is that optimizer's momentum (``optim.momentum_in_residual``),
            never sent whole by choice (``hvd_topk.planner``).
    """

    def __init__(self, param_groups, names, compression, options, *, op, gradient_predivide_factor,
                 backward_passes_per_step, process_set, groups, prefix, grad_scaler=None, inner=None,
                 updates=False, momentum=False):
        self.param_groups = param_groups
        self.param_ids = [id(p) for g in param_groups for p in g["params"]]
        self.params = [p for g in param_groups for p in g["params"] if p.requires_grad]
        self.frozen = [p for g in param_groups for p in g["params"] if not p.requires_grad]
        self.param_signature = parameter_signature(self.params)
        self.names = names
        self.options = options
        self.density = compression.density
        self.codec = Codec(compression.method, compression.fp16_values, compression.compact)
        check_compact_use(compression.compact, options.exchange, options.error_feedback, options.hierarchical)
        self.op, self.predivide = op, float(gradient_predivide_factor)
        self.passes_per_step = backward_passes_per_step
        self.process_set = process_set
        self.prefix = prefix
        # As in Horovod: a rank outside the process set exchanges nothing; its gradients stay local.
        self.member = bool(process_set.included())
        self.world = process_set.size()
        self.rank = process_set.rank() if self.member else None
        self.schedule = DensitySchedule(self.density, options.warmup_steps, options.warmup_density)
        self.buckets = make_buckets(self.params, names, options.min_numel, options.fusion_bytes, groups,
                                    options.error_feedback)
        # In an elastic job workers join later and run this constructor alone: no collective here.
        if self.member and not elastic_mode():
            check_ranks_agree(self, compression, inner, grad_scaler is not None)
        # the host / cross-host process sets when the hierarchical exchange may be used
        setting = options.hierarchical
        if setting == "auto" and (options.momentum_correction or compression.compact
                                  or options.exchange in DENSE_EXCHANGES or updates):
            # nothing would run hierarchically (a dense exchange; compact pairs, the flat
            # allgather's alone), or momentum_correction, which it does not support, or an
            # inner optimizer's updates, which it costs quality (hierarchy.UPDATES_COST): "auto"
            # steps aside (the checkpoint keeps the flat format too)
            setting = False
        elif setting is True and updates and self.member:
            warnings.warn(hierarchy.UPDATES_COST, stacklevel=outside_level())
        self.hier = hierarchy.resolve(setting, process_set, elastic_mode()) if self.member else None
        if self.hier is not None and options.momentum_correction:
            raise ValueError("momentum_correction is not supported with the hierarchical exchange; pass "
                             "hierarchical=False, or momentum_correction=0.0 with the inner optimizer's momentum")
        self.planner = ExchangePlanner(options, self.buckets, self.codec, self.schedule, self.hier,
                                       process_set, f"{prefix}.exchange_trial", updates=updates,
                                       momentum=momentum)
        # keyed by id(p): a tensor's __hash__ is a Python-level call, and these are read per hook
        self.place = {id(m.param): (b, i) for b in self.buckets for i, m in enumerate(b.members)}
        self.passes = dict.fromkeys(map(id, self.params), 0)
        carried = self.step
        if carried:
            warnings.warn(
                f"hvd_topk.DistributedOptimizer: the optimizer's param groups already hold hvd_topk's step counter "
                f"({carried}): a checkpoint loaded into the optimizer before wrapping it, or an earlier wrapper. "
                "A new wrapper starts at step 0 with zero error-feedback residuals (torch's load_state_dict "
                "ignores the checkpoint's 'hvd_topk' section). To resume, load the checkpoint into the "
                "hvd_topk.DistributedOptimizer itself.", stacklevel=outside_level())
        # param-group options from the start: hvd.broadcast_optimizer_state expects the same keys everywhere
        self.step = 0
        self.expected_step = 0  # where this rank's counter should be: it moved otherwise if not (_follow_root)
        self._publish_trial()
        self.stats = CompressionStats()
        self.synchronized = False
        self.synchronized_for_scaler = False  # GradScaler.step(opt) exchanged before unscaling (optimizer.py)
        self.awaiting_inner_step = False  # synchronized, and the inner step has not run since (optimizer.step)
        self.should_synchronize = True
        self.residual_scale = ResidualScale(grad_scaler)  # the loss scale residuals are kept in
        self.ctx = None            # this step's inflight.StepContext, from _begin_step
        self.family = None         # this step's exchange family (exchange= or auto's choice)
        self.active = exchange.ActiveRanks(f"{self.prefix}.active")  # hvd.join() probe
        self._warned_hierarchical_join = False
        self.sparse = SparseGradients(names, options.sparse_as_dense)
        self.transform = None      # the inner optimizer's transform_local_gradient(p, grad, ranks), if any
        self.results = {}          # id(p) -> _torch.written(p.grad) at the last synchronize
        self.taken = {}            # id(p) -> _torch.written(p.grad) as this step's hook took it in
        self.warned_grad_changed = False  # GRAD_CHANGED was said (once)
        self.warned_update_changed = False  # and the optimizer's warning of an update changed after synchronize
        self.warned_nothing_to_exchange = False
        self.nothing_exchanged = False  # this step's synchronize() found p.grad holding the last result
        self.steps_repeated = 0         # step() calls that applied a result already applied (the probe carries it)
        self.inner_name = inner  # the inner optimizer's class name, for messages
        self.on_exchanged = None   # and its exchanged(), told when p.grad holds the step's result
        self.sketcher = None       # and the optimizer itself if it sketches gradients (sketch_rows)
        self.used = {}             # bucket index -> strategy name of its last exchange
        self.verify_step = True    # the next step's first launch checks that the ranks' steps agree
        self.retired = False
        self.hooks = _register_hooks(self) if self.member else []

    def retire(self):
        """Stop exchanging: this engine's gradient hooks come off the parameters (a newer
        engine took them over, or this one is being collected)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks, self.retired = [], True

    # ---- per step --------------------------------------------------------------------------
    def _on_grad(self, p):
        """The parameters' hook: a sparse gradient is densified first (``hvd_topk.sparse_grads``)."""
        if self.ctx is None:
            self._begin_step()
        grad = p.grad
        if grad is not None and grad.layout != torch.strided:
            self.sparse.densify(p)
        self.on_grad_ready(p)

    def on_grad_ready(self, p):
        """Hook: after the last backward pass of the step, fold ``p.grad`` into its bucket."""
        key = id(p)
        passes = self.passes[key] + 1
        if passes > self.passes_per_step:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                 "before call to step(). Increase backward_passes_per_step to "
                                 "accumulate gradients locally." + STEPPED_THE_INNER)
        self.passes[key] = passes
        if passes == self.passes_per_step:
            grad = p.grad
            if self.transform is not None:
                self.transform(p, grad, self.world)
            bucket, position = self.place[key]
            self._fold(bucket, position, grad)
            if not self.warned_grad_changed:
                self.taken[key] = written(grad)
            if bucket.complete():
                self._launch(bucket)

    def _begin_step(self):
        """Once per step, before anything is folded or exchanged (the first hook, or
        ``synchronize`` when none fired): refuse what would make ranks silently diverge, then
        keep the residuals in the units of this step's gradients, and fix this step's family."""
        # before the first fold: a parameter resized in place (p.data = ...) would otherwise
        # fail inside the hooks, against buffers laid out for its old shape
        check_parameters_unchanged(self.param_groups, self.param_ids, self.params, self.param_signature,
                                   "hvd_topk.DistributedOptimizer")
        check_step_start(self)
        # p.grad no longer holds the last step's result (it may never have been stepped: a
        # GradScaler skipped it, and the loop zeroed gradients with model.zero_grad(), which
        # the optimizer does not see): without this, a step whose buckets did not all launch
        # during backward would take the stale flag for its own exchange and skip it
        self.synchronized = self.synchronized_for_scaler = self.nothing_exchanged = False
        self.taken = {}
        if self.awaiting_inner_step:  # the last step's inner step did not run: auto must not time this one
            self.planner.skip_step()
            self.awaiting_inner_step = False
        # Horovod elastic re-forms the job between steps, and may renumber the ranks at the same
        # size (a worker replaced by a new host): the size decides the averaging and the
        # sparse-or-dense choice, the rank the sparse allreduce's parts, so both are read each step
        self.world, self.rank = process_set_size(self.process_set), self.process_set.rank()
        self.residual_scale.follow(checkpoint.momentum_buckets(self))
        self._follow_root()
        self.family = self.planner.family(self.step, self.world)
        self._publish_trial()
        topology = self.hier if self.planner.hierarchical(self.family) else None
        o = self.options
        self.ctx = inflight.StepContext(self.codec, self.stats, self.process_set, self.world, self.rank, self.op,
                                        self.predivide, o.error_feedback, o.selection_scope, self.step,
                                        topology)
        self.active.forget()
        if self.world > 1:
            # Started before the first fold, read when the first sparse bucket launches (by
            # then it has long arrived).
            self.active.start(self.process_set, self.step + self.steps_repeated,
                              agreement.digest(group_options(self.param_groups)))

    def _fold(self, bucket, position, grad):
        current = bucket.current or self._begin_bucket(bucket)
        ef, momentum = self._accumulates(bucket, current), self.options.momentum_correction
        # whether this rank selects all of the member (the sparse allreduce: only in its part)
        selected = current.leads(bucket.members[position])
        if not ef and current.encode is None:
            bucket.mark_folded(position)  # a staging copy: ``copy_in`` when the bucket launches
            current.unchecked |= not selected
            return
        # a gradient the native kernels take as it is (in the fold's own pass)
        plain = grad is not None and grad.dtype == bucket.dtype and grad.is_contiguous()
        fused = current.encode is not None and ef and not momentum and plain and selected
        if fused:
            bucket.mark_folded(position)
        elif not selected and ef and not momentum and grad is not None:
            # (partly) outside this rank's part of a sparse allreduce: fold, noting inf/nan
            folder = bucket.folder(self.codec) if plain else None
            bad = folder(position, grad) if folder is not None else \
                self.codec.fold(bucket.segment(bucket.buffer(), position), grad)
            bucket.mark_folded(position)
            if bad is None:
                current.unchecked = True
            elif bad:
                current.nonfinite_folds.append(position)
        else:
            bucket.fold(position, grad, ef, momentum)
            current.unchecked |= not selected
        if current.encode is not None:
            t0 = time.perf_counter()
            for s in current.led_segments(position):  # its one segment, or its piece in this rank's part
                bad, repasses, filled = current.encode(s, grad if fused else None)
                if bad:
                    current.nonfinite.append(s)
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
        """This step's ``BucketStep`` for ``bucket``, made at its first fold: the planner's
        choice, the send buffer, and with tensor scope on the native kernel an encoder that
        selects each segment as soon as its gradient arrives, in the fold's own pass
        (otherwise the whole buffer is selected once the bucket is complete)."""
        current = bucket.current = self.planner.bucket_step(bucket, self.step, self.family, self.world, self.rank)
        if current.strategy.sparse:
            current.message = bucket.message(current.plan.layout.nbytes)
            if current.selects and current.plan.scope == "tensor" and native_ok(bucket.buffer()) \
                    and not current.hierarchical:
                current.encode = self.codec.segment_encoder(bucket.acc, current.plan, current.message,
                                                            sample_seed(self.step, bucket.index),
                                                            zero_sent=self.options.error_feedback)
        if bucket.sparse and self.options.error_feedback:
            shard = self.planner.shard(bucket) if self.hier is not None else None
            current.carry = bucket.hand_over("hier" if current.hierarchical else "flat", shard, self.options.residual_decay)
        return current

    def _launch(self, bucket):
        for position, m in enumerate(bucket.members):
            if position not in bucket.folded:  # no gradient this step: contributes zeros
                if m.param.grad is not None and m.param.grad.layout != torch.strided:
                    self.sparse.densify(m.param)  # (zero_grad(set_to_none=False) left a sparse zero)
                grad = m.param.grad
                if grad is not None and self.transform is not None:
                    # a gradient whose last hook never fired (a step after fewer than
                    # backward_passes_per_step passes, or p.grad set by hand): the inner
                    # optimizer's transform (LocalAdamW's update) applies to it as to the others
                    # (a step with no backward at all, every p.grad still the last result, is
                    # refused before: ``_holds_last_result``)
                    self.transform(m.param, grad, self.world)
                self._fold(bucket, position, grad)
        current = bucket.current or self._begin_bucket(bucket)
        if current.encode is None and not self._accumulates(bucket, current):
            bucket.copy_in()  # the staging copy the folds left (see ``_fold``)
            if self.options.momentum_correction and not bucket.sparse:
                bucket.add_momentum(self.options.momentum_correction)
        strategy = current.strategy
        name = f"{self.prefix}.bucket{bucket.index}.{strategy.name}"
        self.stats.add(elements_total=bucket.numel, bytes_dense=bucket.numel * DENSE_FP32_BYTES)
        if self.verify_step:
            self._check_steps_agree()
        if strategy.sparse and self._someone_joined():
            # hvd.join(): Horovod's joined ranks answer allreduces (with zeros), not allgathers.
            if self.planner.keeps_residual and not current.hierarchical:
                # DeMo's residual is its momentum, never sent whole: the chosen pairs still move
                self.used[bucket.index] = inflight.JoinedPairsExchange.name
                bucket.inflight = inflight.JoinedPairsExchange(self.ctx, bucket, name + ".joined")
                return
            if self.planner.keeps_residual and not self._warned_hierarchical_join:
                self._warned_hierarchical_join = True
                warnings.warn("hvd_topk.DistributedOptimizer: a rank is inside hvd.join() and the hierarchical "
                              "exchange cannot run, so this step's DeMo update goes dense (every entry moves by "
                              "its sign; the momentum in the shards is kept). Use hierarchical=False to keep "
                              "DeMo's Top-K on such steps.")
            if current.encode is not None and self.options.error_feedback:
                bucket.unsend(current.plan, current.message, current.led)
            strategy, name = exchange.DenseAllreduce, name + ".joined"
        self.used[bucket.index] = strategy.name
        bucket.inflight = inflight.start(self.ctx, bucket, strategy, name)

    def _follow_root(self):
        """Catch up with what ``hvd.broadcast_optimizer_state`` wrote into the first param group
        since the last step (it writes the root rank's options there and calls nothing of
        ours): the step counter and ``exchange="auto"``'s trial. A rank that did not load the
        root's checkpoint in mid-run (a rollback), or an elastic job's new worker, then goes on
        with the root's trial (where they differed, the ranks would run different exchanges
        and hang), and its residuals, if its counter moved, start from zero: they hold work of
        steps the root's checkpoint does not have (a new rank's are zero already)."""
        if self.step != self.expected_step:
            live = [b for b in checkpoint.momentum_buckets(self) if any(bool(f.any()) for f in b.residuals())]
            for b in live:
                for flat in b.residuals():
                    flat.zero_()
            if live and self.options.error_feedback:
                warnings.warn(f"hvd_topk.DistributedOptimizer: the step counter moved from {self.expected_step} to "
                              f"{self.step} without load_state_dict() on this rank (hvd.broadcast_optimizer_state "
                              "after another rank loaded a checkpoint?): this rank's error-feedback residuals belong "
                              "to other steps and start from zero, as a rank's that did not load.")
            self.expected_step = self.step
        record = self.param_groups[0].get(TRIAL_KEY)
        if record != self.planner.trial_record():
            self.planner.adopt_trial(record)

    def _publish_trial(self):
        """Mirror auto's trial into the first param group, where ``_follow_root`` reads it back
        after a broadcast (and checkpoints carry it, though a load measures again)."""
        self.param_groups[0][TRIAL_KEY] = self.planner.trial_record()

    def _someone_joined(self):
        """Whether a rank is inside ``hvd.join()`` this step, from the probe (checked as it is read)."""
        active = self._read_probe()
        return active is not None and active < self.world

    def _read_probe(self):
        """The step's probe (waited for if need be): the count of ranks not inside ``hvd.join()``,
        after refusing where the ranks' steps or param-group options differ. Every reader checks:
        a checkpoint loaded on one rank in mid-run makes that rank refuse at its first launch
        (``_check_steps_agree``), and the others must refuse as well rather than wait for it in
        the exchange."""
        active = self.active.read()
        if not self.active.steps_agree:
            self._refuse_different_steps()
        if not self.active.settings_agree:
            self._refuse_different_options()
        return active

    def _check_steps_agree(self):
        """At the first launch after construction or ``load_state_dict`` (a checkpoint loaded on
        one rank only is where steps part), before any collective of the step: a RuntimeError
        where the ranks are at different steps (their warm-up densities, strategies and messages
        would differ, and the exchange would hang). It waits for the step's ``hvd.join()`` probe
        (started at the first gradient, carrying the step) on that step only; on the others the
        probe is read where a sparse bucket needs it, by then long arrived."""
        self.verify_step = False
        self._read_probe()

    def _refuse_different_options(self):
        mine = group_options(self.param_groups)
        # which option: asked of every rank, unless one is inside hvd.join() (it answers no allgather)
        named = "; ".join(differing_options(self, mine)) if self.active.count == self.world else ""
        raise RuntimeError(
            "hvd_topk.DistributedOptimizer: the ranks' optimizers have different param-group options this step "
            f"({named + '; ' if named else ''}this rank's: {mine}), so the ranks would apply different updates and "
            "silently drift apart: build the optimizer (and any learning-rate schedule) the same on every rank, "
            "feed a schedule driven by a metric (ReduceLROnPlateau) the ranks' average of it (hvd.allreduce), "
            "and hvd.broadcast_optimizer_state(opt, root_rank=0) after loading a checkpoint on one rank.")

    def _holds_last_result(self):
        """In a step no hook fired in: whether every ``p.grad`` is still what the last
        ``synchronize()`` wrote (the same tensor, unchanged in place: no backward since). Only
        that exact case: a parameter some step's backward did not reach, or gradients set by
        hand, are exchanged as before."""
        held = [(self.results.get(id(p)), p.grad) for p in self.params if p.grad is not None]
        return bool(held) and all(still_written(record, grad) for record, grad in held)

    def _refuse_different_steps(self):
        raise RuntimeError(
            f"hvd_topk.DistributedOptimizer: the ranks are at different steps (this rank: {self.step}, and "
            f"{self.steps_repeated} step() calls without a new backward, each applying the last result again), so "
            "their densities and messages would not match, or one rank applied an update the others did not "
            "(step() twice after one backward: on every rank alike it only repeats the update). After loading a "
            "checkpoint on one rank, "
            "hvd.broadcast_optimizer_state carries its step to the others, except for an optimizer "
            "without state (such as SGD without momentum), for which Horovod broadcasts nothing: load "
            "the checkpoint on every rank (and load it on all of them, or none, in mid-run).")

    def synchronize(self):
        """Finish every exchange of this step; afterwards ``p.grad`` holds the averaged result."""
        if not self.member:  # outside the process set: gradients stay local, as in Horovod
            if self.transform is not None:
                # LocalAdamW, DeMo: this rank's own update (over one rank), which its step applies
                for p in self.params:
                    if p.grad is not None:
                        self.transform(p, p.grad, 1)
            self.synchronized = True
            if self.on_exchanged is not None:
                self.on_exchanged()
            return
        if self.retired:
            raise RuntimeError("this hvd_topk.DistributedOptimizer was replaced by a newer one over the same "
                               "parameters, which now exchanges their gradients: step the new one")
        check_parameters_unchanged(self.param_groups, self.param_ids, self.params, self.param_signature,
                                   "hvd_topk.DistributedOptimizer")
        if self.ctx is None:  # no hook fired this step
            if self._holds_last_result():
                if self.transform is not None:
                    # LocalAdamW, DeMo: p.grad is the update the last step applied; the launch
                    # would take it for a gradient and apply it again (their own check cannot
                    # see it, the transform having run)
                    raise RuntimeError(STEPPED_AGAIN.format(self.inner_name))
                # p.grad is already the ranks' average, as after Horovod's synchronize(), whose
                # second allreduce of it changes nothing (a stray call after step(), or step()
                # again without backward, which then applies it again, as Horovod's does); an
                # exchange would fold it into the residuals as a new gradient
                if not (self.warned_nothing_to_exchange or self.synchronized_for_scaler):
                    # (not step()'s own call after GradScaler's exchange: that one is expected)
                    self.warned_nothing_to_exchange = True
                    warnings.warn(NOTHING_TO_EXCHANGE, stacklevel=outside_level())
                self.nothing_exchanged = not self.synchronized_for_scaler
                self.synchronized = True
                return
            self._begin_step()
        self._check_grads_as_taken()
        for bucket in self.buckets:
            if bucket.inflight is None:
                self._launch(bucket)
        # every bucket's later collectives in flight before any bucket is waited for to the end
        for stage in inflight.ADVANCE_STAGES:
            for bucket in self.buckets:
                if bucket.inflight.stage == stage:
                    bucket.inflight.advance()
        for bucket in self.buckets:
            bucket.inflight.decode_into(bucket)
            bucket.reset()
        joined = self._someone_joined()  # (read here when no sparse bucket read it this step)
        if self.sketcher is not None and self.world > 1 and not joined:
            self._exchange_sketches()
        self.passes = dict.fromkeys(self.passes, 0)
        self.sparse.restore()
        if not joined:
            # A step some rank sat out inside hvd.join() does not count: the joined rank's
            # counter did not move, and the warm-up, the sparse allreduce's rotation and
            # auto's trial all read the counter, which must agree when the ranks meet again
            # (Horovod's multi-epoch pattern: uneven batches, hvd.join() at each epoch's end).
            self.planner.step_done(self.step, self.world)
            self.step += 1
            self._publish_trial()
        else:
            self.planner.skip_step()
        self.expected_step = self.step
        self.stats.add(steps=1)
        self.synchronized = self.awaiting_inner_step = True
        self.ctx = None
        self.results = {id(p): written(p.grad) for p in self.params if p.grad is not None}
        if self.on_exchanged is not None:
            self.on_exchanged()

    def _check_grads_as_taken(self):
        """Warn once where a ``p.grad`` the hooks took in this step was changed since (clipped,
        scaled, zeroed or replaced before ``step()``): the exchange already holds the gradient
        as backward() left it. PyTorch counts in-place changes in ``_version``."""
        taken, self.taken = self.taken, {}
        if self.warned_grad_changed:
            return
        changed = [p for p in self.params if id(p) in taken and not still_written(taken[id(p)], p.grad)]
        if changed:
            self.warned_grad_changed = True
            names = named_few(self.names[p] for p in changed)
            fix = (f"Over {self.inner_name}, p.grad after synchronize() holds the ranks' averaged update, not a "
                   "gradient: do not clip it." if self.transform is not None else CLIP_AFTER_SYNCHRONIZE)
            warnings.warn(GRAD_CHANGED.format(names=names, fix=fix), stacklevel=outside_level())

    def update_changed(self):
        """After ``synchronize()`` over an optimizer whose exchanged result is an update
        (``LocalAdamW``, ``DeMo``): the names of the parameters whose ``p.grad`` was changed
        since (clipped?), for the optimizer's warning."""
        return [self.names[p] for p in self.params
                if id(p) in self.results and not still_written(self.results[id(p)], p.grad)]

    def _exchange_sketches(self):
        """``LocalAdamW(variance_sketch=B)``: average the step's gradient sketches over the ranks
        (one small allreduce) and hand the average back. Not on a step some rank sat out inside
        ``hvd.join()``: its zeros would shrink the average."""
        layout = self.sketcher.sketch_layout(self.world)
        if not layout:
            return
        rows = self.sketcher.sketch_rows(layout)
        self.stats.add(bytes_sent=rows.numel() * rows.element_size())
        averaged = hvd.allreduce(rows, op=hvd.Average, name=f"{self.prefix}.variance_sketch",
                                 process_set=self.process_set)
        self.sketcher.absorb_sketches(layout, averaged)

    def pending(self):
        return any(b.inflight is not None for b in self.buckets)

    def accumulating(self):
        """Whether a backward pass of this step has run and fewer than ``backward_passes_per_step``
        of them for some parameter (its gradient still accumulates in ``p.grad``)."""
        return any(self.passes.values())

    def mid_step(self):
        """Whether this step's gradients are on their way (accumulating, taken into a bucket, or
        being exchanged): between ``backward()`` and ``step()`` / ``synchronize()``."""
        return self.pending() or self.taken_in() or self.accumulating()

    def taken_in(self):
        """Whether a gradient of this step is already in a bucket (folded into its residual or
        staged, after the inner optimizer's transform) and the exchange has not finished."""
        return any(b.current is not None for b in self.buckets)

    def count_repeat(self):
        """After ``step()``'s own ``synchronize()``: where it exchanged nothing (``p.grad`` still
        held the last result, which the inner step now applies again), count the repeat; the
        next step's probe carries the count with the step, so a rank that repeated alone is
        refused on every rank."""
        if self.nothing_exchanged:
            self.steps_repeated += 1
            self.nothing_exchanged = False

    def holds_result(self):
        """``p.grad`` holds this step's exchanged result and no backward has started another."""
        return self.synchronized and not self.pending()

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
        self.ctx = None
        self.active.forget()  # a reset Horovod forgot it too

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self):
        """This rank's section of the optimizer's checkpoint (``hvd_topk.checkpoint``)."""
        return checkpoint.save(self)

    def load_state_dict(self, state, param_groups=None, nonfinite=(), step_before=None):
        """Restore ``state_dict()``'s output, checked by ``checkpoint.check`` (the caller also
        checked that no exchange is pending; ``nonfinite`` is what ``check`` returned).

        ``param_groups``: the optimizer's groups after torch's ``load_state_dict`` (the step
        counter lives there); with ``state`` None (a plain torch optimizer's state) the step is
        kept, ``step_before`` (read before torch's load wrote the groups), and the residuals
        start from zero.
        """
        self.forget_step()
        self.verify_step = True
        self.steps_repeated = 0  # the weights come from the checkpoint: what a repeat applied is gone
        # exchange="auto": measure again from here. Every rank restoring (and an elastic job's new
        # worker, whose trial has not started) then starts its trial at the same step.
        self.planner.forget_trial()
        step = self.step if step_before is None else step_before
        if param_groups is not None:
            self.param_groups = param_groups
        self.step = self.expected_step = step if state is None else state["step"]
        self._publish_trial()  # None (forgotten above): the checkpoint's is of the run that saved it
        checkpoint.load(self, state, nonfinite)

    # ---- statistics ------------------------------------------------------------------------
    def compression_stats(self):
        out = self.stats.as_dict()
        out.update(step=self.step, current_density=self.schedule.density(self.step),
                   buckets_sparse=sum(b.sparse for b in self.buckets),
                   buckets_dense=sum(not b.sparse for b in self.buckets),
                   selection_scope=self.options.selection_scope, world_size=self.world, rank=self.rank,
                   hierarchical=self.hier is not None and self.planner.hierarchical(self.family or ""),
                   exchange_family=self.family)
        out.update(self.planner.describe(self.world, self.step))
        if not self.member:
            out["exchange_reason"] = ("this rank is outside the optimizer's process set: it exchanges "
                                      "nothing, its gradients stay local (as in Horovod)")
        out["bucket_strategies"] = dict(self.used)
        return out

