"""hvd_topk as a PyTorch DDP communication hook: Top-K with error feedback for ``torchrun`` users.

Spelled as PyTorch's PowerSGD hook is::

    import hvd_topk.ddp
    state = hvd_topk.ddp.TopKState(process_group=None, density=0.01)
    model.register_comm_hook(state, hvd_topk.ddp.topk_hook)
    # or hvd_topk.ddp.register(model, state): the same, after checking the group and the names

No Horovod: the collectives are ``torch.distributed``'s (gloo or NCCL). Everything else is
hvd_topk's own: the codec and native selection kernel (``hvd_topk.codec``), the density warm-up
(``hvd_topk.schedule``), the cost model that chooses each bucket's exchange
(``hvd_topk.costs``), and the inner optimizers that turn each rank's gradient into an update
before the exchange (``hvd_topk.LocalAdamW``, ``hvd_topk.DeMo``; ``optimizer=``).

Per DDP bucket and step (``topk_hook``):

1. with ``optimizer=``, its ``transform_local_gradient`` turns each gradient into this rank's
   update, in place;
2. tensors of at least ``min_numel`` elements are folded into the bucket's residual
   (``acc = decay * residual + grad``), their top-k (k = density x n per tensor) is selected and
   zeroed in ``acc``, which keeps the rest for the next step; smaller tensors (biases, norms)
   are averaged densely;
3. the pairs travel by the bucket's exchange: an allgather of every rank's fixed-size message
   (``all_gather_single``), or the sparse allreduce (each rank's part of the indices
   gathered, then every rank's values there summed), or, where the cost model says a ring allreduce moves
   fewer bytes (a dense start), a dense allreduce of ``acc``;
4. every rank adds the ranks' pairs in rank order and divides by the world size: the bucket
   DDP writes into ``p.grad`` is the same bits on every rank.

Each bucket launches its collectives from the hook itself, in bucket order, and only decodes in
the future's callback: no collective is chained from a callback, so several buckets never
interleave their collectives differently on different ranks (PowerSGD's chained allreduces can,
and abort on gloo with a size mismatch when a model has several buckets). The sparse allreduce
waits for its parts' index gather inside the hook for the same reason.
"""

import inspect
import warnings
import weakref

import torch
import torch.distributed as dist

from hvd_topk._stack import outside_level
from hvd_topk import auto, checkpoint, ddp_checkpoint, ddp_checks
from hvd_topk import ddp_exchange as exchange
from hvd_topk.codec import Codec
from hvd_topk.compact import check_compact, check_compact_use
from hvd_topk._torch import after_backward, backward_running, written
from hvd_topk.loss_scale import ResidualScale, check_grad_scaler
from hvd_topk.optim import momentum_in_residual, residual_decay_of
from hvd_topk.schedule import DEFAULT_START, DensitySchedule
from hvd_topk.stats import DENSE_FP32_BYTES, CompressionStats
from hvd_topk.checks import (DENSE_EXCHANGES, EXCHANGES, check_choice, check_flag, check_integer, check_number,
                             check_residual_decay, check_target_density, warn_ignored, warn_momentum_sent_whole)
from hvd_topk.selection import DEFAULT_METHOD

TRIAL_FROM_STEP = 2  # DDP rebuilds its buckets after its first step: measure from the third

# the CompressionStats fields state.stats() reports (the others are the Horovod engine's)
_STATS = ("steps", "bytes_sent", "bytes_dense", "elements_total", "elements_selected", "nonfinite_resets",
          "bytes_ratio", "density")


class TopKState:
    """Everything ``topk_hook`` keeps between steps: the options, each bucket's residual, the
    step counter and statistics. Pass it to ``DistributedDataParallel.register_comm_hook``.

    Tune (in order of what matters most):
        density (0.01): fraction of each tensor's entries sent per step (k = density x n).
            1% costs about half a point of accuracy on the digits CNN example; 0.1% needs a warm-up.
        error_feedback (True): keep what was not sent and add it back next step. Without it
            the entries not sent are lost (and training is clearly worse).
        warmup_steps (0), warmup_density (0.25): DGC's exponential density warm-up from
            ``warmup_density`` to ``density`` over that many steps. ``warmup_density=1.0`` over
            100 steps is the dense start of the AdamW recipe, over the learning-rate warm-up on
            long runs whose warm-up lasts 500 steps or more (docs/adamw.md); while the density
            is high the cost model sends buckets dense anyway.
        optimizer (None): an inner optimizer that works on each rank's own gradient before the
            exchange (``hvd_topk.LocalAdamW``: the AdamW recipe; ``hvd_topk.DeMo``). Its
            ``transform_local_gradient`` runs in the hook; call its ``step()`` as usual.
            ``hvd_topk.DeMo``'s ``beta`` becomes ``residual_decay``.
        exchange ("auto"): ``"allgather"`` (every rank's pairs, bytes grow with P),
            ``"sparse_allreduce"`` (each rank chooses the positions in one part of the bucket,
            every rank's values summed there; bytes grow as a dense allreduce's, (P-1)/P: the
            one for many ranks), ``"dense"``,
            ``"dense_fp16"``, or ``"auto"``: once the density warm-up is over (and DDP has
            rebuilt its buckets), each family the cost model proposes runs
            ``exchange_trial_steps`` (3) real steps (plus one to settle), the ranks average
            their median step times with one allreduce and all keep the fastest
            (``hvd_topk.auto``, the Horovod optimizer's trial); on a fast network that may be
            dense, which is the point (dense fp16 only where values travel in 16 bits:
            ``fp16_values`` or ``compact``; no sparse allreduce with ``optimizer=``, whose updates
            it cost quality from 4 ranks on: ``auto.UPDATES_NOTE``; no dense over ``DeMo``, whose
            residual is its momentum, which dense would send whole: ``auto.MOMENTUM_NOTE``). Before that, the family
            moving the fewest bytes (the same limits; such a residual takes no dense fallback either). Pin
            one for quality experiments on one host. A sparse family still sends a bucket
            dense where a ring allreduce moves fewer bytes.
        fp16_values (False): send values as float16 (6 bytes a pair instead of 8); the dense
            fallback then runs in float16 too. float16 holds magnitudes up to 65504, and where
            the ranks' values are summed in float16 before the division by P (the dense fp16
            fallback, the sparse allreduce, and 16-bit parameters) up to 65504 / P: a larger
            value arrives in ``p.grad`` as inf (the allgather sums in float32: 65504 there;
            PyTorch's ``fp16_compress_hook`` divides first), so keep gradients (and, with error
            feedback, residuals) well below that; a ``GradScaler``'s scale settles lower to fit.
            The recommended AdamW scheme sends ``lr x`` normalised updates, far below it. What
            float16 rounds off a sent value stays in its residual.
        compact (False): ``True``: send about 2.4 bytes a pair (``hvd_topk.compact``: an
            Elias-Fano index and an 8-bit log-scale value, the rounding fed back into the
            residual): 2.5x the entries in 16-bit values' bytes, which is what quality at a
            small byte budget depends on. ``"sign"``: the index and the value's sign, one mean
            magnitude a tensor, about 1.4 bytes a pair at 0.43% (4.3x the entries of 16-bit
            values at 0.1%'s bytes); with error feedback only. The allgather's format:
            ``exchange="sparse_allreduce"`` is then refused, ``"auto"`` tries the allgather and
            dense only, and the dense fallback runs in float16.
        min_numel (1024): tensors with fewer elements are averaged densely (biases, norms:
            cheap and sensitive).
        residual_decay (1.0): multiply every residual by this each step before the gradient is
            added (stale work fades; 1.0 keeps everything).
        method ("sampled"): the selection kernel (``"exact"``: exact top-k, slower).
        grad_scaler (None): with fp16 mixed precision, the ``torch.amp.GradScaler`` that scales
            the loss. Pass it: the residuals, kept in the loss scale's units, are rescaled at the
            first bucket of a step whose scale changed (the scaler halves it after an overflow
            and doubles it every ``growth_interval`` steps); without it they would be added back
            at a stale scale, silently (the hook cannot see the scaler). Refused with
            ``optimizer=`` (LocalAdamW, DeMo: use bf16 autocast, which needs no scaler).

    Internal: ``process_group`` (default: the global group), ``world_size``, ``rank``, the
    buckets' layouts and residuals (by DDP bucket index; DDP rebuilds its buckets after the first
    step, and the residuals follow their parameters into the new layout).

    Statistics: ``stats()``: steps, bytes handed to the network against a dense fp32 allreduce
    of the same tensors (totals over the run, so a dense start counts), elements selected,
    buckets per exchange, non-finite resets.

    Checkpoints: ``state_dict()`` holds this rank's residuals by parameter name, which needs
    ``named_parameters=model.named_parameters()``, and the loss scale they are in;
    ``load_state_dict`` restores them (a state saved by another rank, world size or process
    group restarts them from zero, with a warning), converted to this run's set-up with or without a scaler.
    """

    def __init__(self, process_group=None, density=0.01, *, error_feedback=True, warmup_steps=0,
                 warmup_density=DEFAULT_START, optimizer=None, exchange="auto", exchange_trial_steps=auto.TRIAL_STEPS, fp16_values=False,
                 compact=False, min_numel=1024, residual_decay=1.0, method=DEFAULT_METHOD, named_parameters=None,
                 grad_scaler=None):
        # tune
        self.density = check_target_density(density)
        self.error_feedback = check_flag(error_feedback, "error_feedback")
        self.schedule = DensitySchedule(self.density, warmup_steps, warmup_density)
        if optimizer is not None and not callable(getattr(optimizer, "transform_local_gradient", None)):
            raise TypeError("optimizer must define transform_local_gradient(param, grad, ranks) "
                            f"(hvd_topk.LocalAdamW, hvd_topk.DeMo), got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._warned_not_stepped = False
        if self.error_feedback and optimizer is None and exchange not in DENSE_EXCHANGES:
            ddp_checks.PLAIN_STATES.add(self)  # (a pinned dense exchange holds nothing back)
        self.updates_written = None  # [(p, _torch.written(p.grad))] once DDP wrote this step's updates
        self._warned_update_changed = False
        register = getattr(optimizer, "register_step_pre_hook", None)  # (a torch optimizer's)
        if register is not None:  # its step checks that p.grad is still the update DDP wrote
            state = weakref.ref(self)
            handle = register(lambda opt, args, kwargs: ddp_checks.check_updates_unchanged(state()))
            weakref.finalize(self, handle.remove)
        # LocalAdamW's finite= (the hook checks a bucket at once); an optimizer of the user's own
        # may define transform_local_gradient(param, grad, ranks) only
        self._pass_finite = optimizer is not None and "finite" in inspect.signature(
            optimizer.transform_local_gradient).parameters
        self.exchange = check_choice(exchange, "exchange", EXCHANGES)
        self.exchange_trial_steps = check_integer(exchange_trial_steps, "exchange_trial_steps", 1)
        warn_ignored(exchange, exchange_trial_steps=(self.exchange_trial_steps, auto.TRIAL_STEPS),
                     density=(self.density, 0.01), warmup_steps=(warmup_steps, 0),
                     warmup_density=(warmup_density, DEFAULT_START))
        self.fp16_values = check_flag(fp16_values, "fp16_values")
        self.compact = check_compact(compact)
        check_compact_use(self.compact, self.exchange, self.error_feedback)
        self.min_numel = check_integer(min_numel, "min_numel", 0)
        self.residual_decay = check_residual_decay(
            residual_decay_of(optimizer, check_number(residual_decay, "residual_decay"), self.error_feedback),
            self.error_feedback)
        self.momentum_in_residual = momentum_in_residual(optimizer)  # DeMo's: never sent whole
        warn_momentum_sent_whole(exchange, self.momentum_in_residual)
        self.codec = Codec(method, fp16_values, self.compact)
        check_grad_scaler(grad_scaler, optimizer)
        self.residual_scale = ResidualScale(grad_scaler)  # the loss scale the residuals are kept in
        # internal
        self.process_group = ddp_checks.check_process_group(process_group)
        self.world_size = self.rank = None       # read at the first hook (the group exists by then)
        self.device = None                      # the gradients' device, read at the first hook
        self.names = ddp_checks.names_of(named_parameters) if named_parameters is not None else None
        self.iteration = 0
        self.layouts = {}                       # DDP bucket index -> ddp_exchange.BucketLayout
        self.retired = []                       # layouts DDP replaced this step (their residuals move)
        self.step_params = set()                # ids of the parameters of this step's buckets so far (_position)
        self.step_buckets = 0                   # this step's buckets so far
        self.pending = {}                       # name -> residual loaded before its bucket was seen
        self.model_params = set()               # ids of the parameters of the model it serves
        self.seen_whole_model = False           # a step's last bucket has been seen
        self.exchanged_at = []                  # _torch.written(p) for every parameter at the last step's last bucket
        self.steps_at_exchange = 0              # torch optimizers' steps (ddp_checks.OPTIMIZER_STEPS) then
        self.steps_here = 0                     # steps this object has served (a loaded one: since the load)
        self.checked = False
        self.family = None                      # this step's exchange family (see _begin_step)
        self.trial = None                       # exchange="auto": hvd_topk.auto.Trial, once started
        # statistics
        self._stats = CompressionStats()  # of its fields: _STATS
        self._by_strategy = {}

    # ---- statistics --------------------------------------------------------------------
    def stats(self):
        """Totals since the start of the run: ``bytes_ratio`` is bytes handed to the network over a
        dense fp32 allreduce's, averaged over the whole run (``load_state_dict`` takes over the
        counts a checkpoint carries, the dense start's included)."""
        out = {k: v for k, v in self._stats.as_dict().items() if k in _STATS}
        out["current_density"] = self.schedule.density(self.iteration)
        out["buckets_by_exchange"] = dict(self._by_strategy)
        out["world_size"] = self.world_size
        out["exchange"], out["exchange_family"] = self.exchange, self.family
        if self.trial is not None:
            out["exchange_reason"] = self.trial.reason()
        return out

    def _count(self, strategy, **amounts):
        self._stats.add(**amounts)
        self._by_strategy[strategy.name] = self._by_strategy.get(strategy.name, 0) + 1

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self):
        """This rank's residuals by parameter name, the step, the rank, world size and process
        group's global ranks, the loss scale the residuals are in, and the statistics' counts
        (``hvd_topk.ddp_checkpoint``).

        Call it after ``optimizer.step()`` (or before this step's ``backward()``). In between,
        this step's unsent gradient is already in the residuals, and a run resumed from the
        checkpoint, which does this step again, counts it twice: that warns (no torch optimizer
        has stepped, ``ddp_checks.OPTIMIZER_STEPS``, and no parameter has changed since the step's last
        bucket). It is not refused, as the Horovod optimizer refuses it, because the hook does
        not know the user's optimizer: a step a ``GradScaler`` skipped changes nothing either."""
        return ddp_checkpoint.save(self)

    def load_state_dict(self, state):
        """Restore ``state_dict()``'s output: the step always; the residuals when the state was
        saved by this rank in a job of this size and in this process group (otherwise they
        restart from zero, with a warning: each rank's residual is its own unsent work)."""
        ddp_checkpoint.load(self, state)

    def rescale(self, factor):
        """Multiply every residual by ``factor`` (``hvd_topk.loss_scale.ResidualScale``): the
        buckets', those of layouts DDP replaced this step, and those loaded but not yet placed."""
        if not self.error_feedback:
            return
        for layout in [*self.layouts.values(), *self.retired]:
            layout.acc.mul_(factor)
        for t in self.pending.values():
            t.mul_(factor)

    def _drop_pending(self):
        """Loaded residuals that no bucket took once every bucket has been seen: their parameters
        are dense here (a larger ``min_numel``) or have no error feedback. Dropped, with a warning,
        as the Horovod optimizer does: kept, ``state_dict()`` would save them again, stale."""
        checkpoint.warn_dropped(sorted(self.pending), owner="this TopKState")
        self.pending = {}

    # ---- per bucket ----------------------------------------------------------------------
    def _sketched(self, params):
        """``(parameter, B)`` for the bucket's parameters whose gradients the optimizer sketches
        (``LocalAdamW(variance_sketch=...)``), in the bucket's order (the same on every rank)."""
        if self.optimizer is None or not callable(getattr(self.optimizer, "sketch_rows", None)):
            return []
        mine = dict(self.optimizer.sketch_layout(self.world_size))
        return [(p, mine[p]) for p in params if p in mine]

    def _position(self, bucket):
        """``(index, first, last)``: the bucket's place in this step. DDP's own, except in the first
        iteration of a ``static_graph=True`` model with buckets of several dtypes: DDP reduces them
        after backward, each reported as index 0 and none as the last (torch 2.13's
        ``Reducer::delay_all_reduce``). Taken as they came, each took the one before for a
        rebuild, and from the third on residuals were dropped. So a bucket reported as the first
        whose parameters this step has not had is the step's next bucket; such a step ends when
        it has had every trainable parameter named by ``named_parameters=`` (without them, at the
        next step's first bucket: nothing reads the step in between but ``state_dict()``, which
        needs the names)."""
        params = bucket.parameters()
        index, last, again = bucket.index(), bucket.is_last(), False
        if index == 0 and self.step_buckets:
            if any(id(p) in self.step_params for p in params):
                self._end_step(self.step_buckets - 1)  # a new step; the one before never had its last bucket
            else:
                index, again = self.step_buckets, True
        self.step_params.update(id(p) for p in params)
        self.step_buckets += 1
        if again and not last and self.names is not None:
            last = all(id(p) in self.step_params for p in self.names if p.requires_grad)
        return index, index == 0, last

    def _end_step(self, last_index):
        """What a step's last bucket (``last_index``: its place) closes: the model seen whole, the
        layouts DDP replaced dropped (their residuals checked moved), the step counted."""
        ddp_checks.check_optimizer_serves_model(self.optimizer, self.model_params)
        self.seen_whole_model = True
        # (what state_dict() compares: a parameter changed since means the step was applied)
        self.exchanged_at = [written(p) for layout in self.layouts.values() for p in layout.params]
        self.steps_at_exchange = ddp_checks.OPTIMIZER_STEPS[0]
        if self.pending:
            self._drop_pending()
        self.iteration += 1
        self.steps_here += 1
        self._stats.add(steps=1)
        ddp_checks.check_retired_taken(self)
        self.retired = []
        for index in [i for i in self.layouts if i > last_index]:
            del self.layouts[index]  # DDP rebuilt into fewer buckets: their residuals moved
        self.step_params, self.step_buckets = set(), 0

    def _layout(self, bucket, index, first):
        """The bucket's ``BucketLayout`` (made at its first step, and again when DDP rebuilt it; the
        residuals move with their parameters); ``index``, ``first``: its place (``_position``)."""
        params = bucket.parameters()
        layout = self.layouts.get(index)
        if layout is not None and layout.matches(params):
            return layout
        ddp_checks.check_one_model(self, params)
        self.model_params |= {id(p) for p in params}
        ddp_checks.check_supported(bucket, params, self.names)
        ddp_checks.check_named(params, self.names)
        ddp_checks.check_optimizer_owns(self.optimizer, params, self.names)
        fresh = exchange.BucketLayout(params, bucket.gradients(), bucket.buffer(), self.min_numel,
                                      self.error_feedback)
        sources = [*self.retired, *self.layouts.values()]
        if first:
            # a step's first bucket with a new layout: DDP rebuilt all of them (after its first
            # step; with static_graph=True after its second); the old ones stay until the step
            # ends, the later buckets take from them too
            self.retired, self.layouts = list(self.layouts.values()), {}
        elif index in self.layouts:
            # DDP rebuilt its buckets but kept the first one (a rebuild that regroups only later
            # buckets, e.g. by dtype): the layout replaced here keeps residuals that later
            # buckets take (a parameter moved from this bucket to a later one)
            self.retired.append(self.layouts.pop(index))
        for old in sources:
            fresh.take_residuals_from(old)
        if self.names is not None and self.pending:
            fresh.adopt(self.pending, self.names)
        self.layouts[index] = fresh
        return fresh

    def _note_updates_written(self):
        """After this backward, once DDP has written the step's updates into ``p.grad``: a record
        of each, for the optimizer's step to tell whether it was changed since (clipped)."""
        self.updates_written = [(p, written(p.grad)) for layout in self.layouts.values() for p in layout.params
                                if p.grad is not None]

    def _not_stepped(self):
        """A new step's first bucket while ``optimizer=`` still holds the last step's updates
        (LocalAdamW, DeMo: neither its ``step()`` nor its ``zero_grad()`` ran since): another
        optimizer was stepped, which takes the updates in ``p.grad`` for gradients, or the step
        was skipped and the gradients zeroed through the model. Said once; then forgotten."""
        if not self._warned_not_stepped:
            self._warned_not_stepped = True
            warnings.warn(f"hvd_topk.ddp: TopKState(optimizer=...)'s {type(self.optimizer).__name__} was not stepped "
                          "after the last exchange: p.grad holds its updates, which only its own step() applies "
                          "(another optimizer's step() takes them for gradients). Step that optimizer; to skip a "
                          "step, call its zero_grad()", stacklevel=outside_level())
        self.optimizer._step_done(stepped=False)

    def _begin_step(self, step):
        """At a step's first bucket: this step's exchange family. Under ``"auto"`` the measured
        trial counts the step before (its time is first bucket to first bucket) and may decide
        (one blocking allreduce, here, before any of this step's collectives: every rank
        reaches it at the same step)."""
        if self.exchange != "auto":
            self.family = self.exchange
            return
        density = self.schedule.density(step)
        # (not before this state has seen a whole step: the trial proposes families from every
        # bucket's layout, and a state loaded from a checkpoint has seen none of them yet; nor
        # before DDP rebuilt its buckets, after its first step: counted from this process's
        # first step, not the checkpoint's, or a resumed job would propose from bucket 0 alone;
        # nor in a step whose first bucket came rebuilt (its old layouts retired), when this
        # bucket's is the only layout: with static_graph=True DDP rebuilds after its second step)
        if self.world_size <= 1 or density != self.schedule.target or step < TRIAL_FROM_STEP or \
                self.steps_here < TRIAL_FROM_STEP or not self.seen_whole_model or self.retired:
            self.family = None  # the fewest bytes, bucket by bucket
            return
        if self.trial is None:
            self._start_trial(density)
        elif self._timed(self.trial).step_done(step) and self.rank == 0:
            auto.announce(f"exchange={self.trial.choice} for {self.world_size} ranks ({self.trial.reason()})", 0)
        self.family = self.trial.family()

    def _start_trial(self, density):
        momentum = auto.keeps_momentum(self.momentum_in_residual)  # (auto only: a pinned exchange starts no trial)
        families = auto.families(False, False, self.compact, self.codec.dense_fp16, updates=self.sends_updates,
                                 momentum=momentum)
        assignments, byte_counts = {}, {}
        for family in families:
            chosen = [exchange.choose(self, layout, layout.plan(self.codec, density), self.world_size, family)
                      for layout in self.layouts.values() if layout.sparse]
            assignments[family] = tuple(s.name for s, _ in chosen)
            byte_counts[family] = sum(cost for _, cost in chosen)
        self.trial = auto.Trial(auto.propose(assignments, byte_counts), self.exchange_trial_steps, self._agree,
                                auto.left_out(self.sends_updates, momentum))

    @property
    def sends_updates(self):
        """Whether ``optimizer=`` turns each gradient into an update: ``exchange="auto"`` then
        leaves the sparse allreduce out (``auto.UPDATES_NOTE``)."""
        return self.optimizer is not None

    def _timed(self, trial):
        """The trial, once a CUDA step's kernels have finished: the hook runs as soon as backward
        has queued them, so without a synchronisation while the trial times steps, host time
        would measure the queueing, not the step. Never after the trial."""
        if trial.choice is None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return trial

    def _agree(self, medians):
        """The ranks' mean of each family's median, over the group's own device (NCCL takes no
        CPU tensors)."""
        medians = medians.to(self.device)
        dist.all_reduce(medians, group=self.process_group)
        return medians.cpu() / self.world_size

    def _first_hook(self, bucket):
        """Once: the group, the gradients' device, and the check that every rank has the same
        settings (``ddp_checks.check_settings_agree``)."""
        if not dist.is_initialized():
            raise RuntimeError("hvd_topk.ddp: torch.distributed is not initialised")
        self.rank, self.world_size = ddp_checks.group_rank_and_size(self.process_group)
        self.device = bucket.buffer().device
        ddp_checks.check_settings_agree(self, bucket)
        self.checked = True


def _check_state(state):
    if not isinstance(state, TopKState):
        what = "the class TopKState itself" if state is TopKState else f"a {type(state).__name__}"
        raise TypeError(f"hvd_topk.ddp's hook needs a hvd_topk.ddp.TopKState as its state, got {what}: build one, "
                        "state = TopKState(density=0.01, ...), and pass it")


def register(model, state, hook=None):
    """``model.register_comm_hook(state, hook or topk_hook)``, after checking that ``state``
    reduces over the process group ``model`` (a ``DistributedDataParallel``) uses, and that its
    ``named_parameters=`` and ``optimizer=`` cover the model's trainable parameters (named by the
    model here; the hook alone sees a DDP bucket's, by position). ``hook``: another hook taking
    a ``TopKState`` (``topk_hook`` by default)."""
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.parallel.DistributedDataParallel):
        raise TypeError("hvd_topk.ddp.register takes the DistributedDataParallel model, got what torch.compile "
                        "made of it: register the hook first, then compile (register(ddp_model, state); "
                        "torch.compile(ddp_model))")
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"hvd_topk.ddp.register takes the DistributedDataParallel model, got a "
                        f"{type(model).__name__}: wrap it first, DistributedDataParallel(model)")
    _check_state(state)
    theirs = getattr(model, "process_group", None)
    if theirs is not None:
        mine, theirs = ddp_checks.group_members(state.process_group), ddp_checks.group_members(theirs)
        if mine != theirs:
            raise ValueError(f"TopKState's process group (ranks {mine}) is not the one DistributedDataParallel "
                             f"reduces over (ranks {theirs}): pass TopKState(process_group=model.process_group)")
    ddp_checks.check_covers(model, state)
    model.register_comm_hook(state, hook or topk_hook)
    return state


def topk_hook(state, bucket):
    """DDP communication hook: Top-K with error feedback for one bucket (``TopKState``).

    Returns a future of the bucket's averaged result, which DDP writes into ``p.grad``."""
    _check_state(state)  # (DDP takes any object as the hook's state)
    # torch's Join: a rank whose inputs ran out has its DDP run the hook on zero buckets, outside
    # any backward, to match the others' collectives; it contributes zeros (and its residual)
    joined = not backward_running()
    started = state.checked
    if not started:
        state._first_hook(bucket)
    index, first, last = state._position(bucket)
    if first and started:
        ddp_checks.check_group_unchanged(state)
    if first:  # before this step folds anything: residuals into its loss scale
        state.residual_scale.follow([state])
        if state.optimizer is not None and getattr(state.optimizer, "_transformed", None) and not joined:
            state._not_stepped()
        state.updates_written = None
    if last and state.optimizer is not None and not joined and not state._warned_update_changed \
            and not getattr(state.optimizer, "sum_invariant", False):  # (DeMo: a common factor changes nothing)
        # from the last bucket: the reducer queues its write of p.grad in this same call, into the
        # same backward's callbacks (the first bucket may come in a nested backward: reentrant
        # activation checkpointing), and after_backward lands after it
        after_backward(state._note_updates_written)
    buffer = bucket.buffer()
    world = state.world_size
    params = bucket.parameters()
    # this rank's backward left them out (find_unused_parameters); a joined rank ran none, and its
    # gradients may be None (zero_grad after step), yet its residual sends (Join's zero buckets)
    idle = set() if joined else exchange.unused_here(params)
    layout = state._layout(bucket, index, first)
    if state.optimizer is not None and not joined:
        # (a joined rank's optimizer is left alone, as torch's AdamW under plain DDP: its
        # transform of a zero gradient advanced LocalAdamW's moments, and with beta1 > 0 sent
        # updates made of no data, until 2026-12-06)
        # one check of the bucket instead of one per tensor (on a GPU, one wait instead of many)
        checked = {"finite": True if bool(torch.isfinite(buffer).all()) else None} if state._pass_finite else {}
        for i, (p, g) in enumerate(zip(params, layout.param_views(buffer))):
            if i not in idle:  # as a plain optimizer skips a parameter without a gradient
                state.optimizer.transform_local_gradient(p, g, world, **checked)
    step = state.iteration
    if first:
        state._begin_step(step)
    if last:
        state._end_step(index)
    state._stats.add(bytes_dense=buffer.numel() * DENSE_FP32_BYTES, elements_total=buffer.numel())
    futures = []
    if layout.dense:  # the small tensors: a plain average
        futures.append(exchange.average_dense(state, layout, buffer))
    if layout.sparse:
        futures.append(exchange.exchange_sparse(state, layout, index, step, buffer, idle))
    sketched = state._sketched(params) if world > 1 else []
    if sketched:  # LocalAdamW(variance_sketch=B): the ranks' average of its gradient sketches
        futures.append(exchange.average_sketches(state, state.optimizer, sketched, buffer.device))
    # On the CPU the bucket finishes when its last exchange does, on that exchange's thread, while
    # backward goes on. On a GPU every exchange has been waited for in the hook already
    # (exchange.after says why): the bucket finishes here, on backward's stream, and its future
    # is device-aware so that DDP's stream waits for that work.
    on_gpu = buffer.device.type == "cuda"
    out = torch.futures.Future(devices=[buffer.device] if on_gpu else None)
    if world == 1 or not futures or on_gpu:  # nothing left in flight (a GPU: see exchange.after)
        for f in futures:
            f.wait()
        out.set_result(exchange.finish(buffer, layout, world))
        return out

    def done(collected):
        try:
            for f in collected.value():
                f.wait()  # raises what the exchange raised
            out.set_result(exchange.finish(buffer, layout, world))
        except Exception as error:  # noqa: BLE001  (DDP raises it from its wait)
            out.set_exception(error)
    torch.futures.collect_all(futures).add_done_callback(done)
    return out


__all__ = ["TopKState", "topk_hook", "register"]
