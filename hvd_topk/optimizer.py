"""``hvd_topk.DistributedOptimizer``: Top-K with error feedback, a drop-in for Horovod's.

The result is an instance of a dynamic subclass of the user's optimizer class (as Horovod
does), sharing the user's optimizer's state; it adds Horovod's methods and its
``_parameter_names`` and nothing else, and keeps all of hvd_topk's state in one attribute, the
engine (``hvd_topk.engine.TopKEngine``).
"""

import warnings
import weakref
from contextlib import contextmanager

import torch

from hvd_topk._stack import outside_level
from hvd_topk._horovod import (OPTIMIZER_MODULE, elastic_mode, hvd, instance_name, is_horovod_distributed_optimizer,
                              unshared_for_elastic)
from hvd_topk._torch import AMP_SCALING_ATTRIBUTE, keep_objects, keep_step_unhooked, unscaled_already
from hvd_topk.auto import TRIAL_STEPS
from hvd_topk.compressor import OP_NAMES, TopK, keyword_names, unexpected_options_error
from hvd_topk import checkpoint
from hvd_topk.checkpoint import STATE_KEY
from hvd_topk.engine import STEP_KEY, STEPPED_THE_INNER, TopKEngine
from hvd_topk.loss_scale import check_grad_scaler
from hvd_topk.optim import momentum_in_residual, residual_decay_of
from hvd_topk.optim._common import ADAPTIVE, ADAPTIVE_WHY, UPDATE_CHANGED, adaptive_name, named_few
from hvd_topk.options import Options
from hvd_topk.schedule import DEFAULT_START
from hvd_topk.checks import (DENSE_EXCHANGES, NAMED_PARAMETERS_ERROR, check_integer, check_number, warn_ignored,
                             warn_momentum_sent_whole)

ENGINE = "_hvd_topk"  # the one attribute hvd_topk adds to the user's optimizer
LOCAL = "_hvd_topk_local"  # hvd_topk.LocalSteps' one attribute (local_steps.py), checked here too

ADAM_WARNING = (
    "hvd_topk.DistributedOptimizer: Top-K with error feedback in front of {0} trains "
    "worse than dense (" + ADAPTIVE_WHY + "). The recipe: inner = hvd_topk.LocalAdamW(params, lr, betas=(0.0, 0.95), "
    "weight_decay=...), wrapped as hvd_topk.DistributedOptimizer(inner, named_parameters, "
    "compression=hvd_topk.TopK(density=0.01, fp16_values=True), warmup_steps=100, warmup_density=1.0, "
    "exchange=\"allgather\") "
    "(README.md, 'Transformers with AdamW').")


def DistributedOptimizer(optimizer, named_parameters=None, compression=TopK,
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=hvd.global_process_set, *, error_feedback=True,
                         momentum_correction=0.0, warmup_steps=0, warmup_density=DEFAULT_START,
                         min_numel=1024, fusion_bytes=64 * 1024 * 1024, dense_fallback=True,
                         selection_scope="tensor", grad_scaler=None, exchange="auto",
                         exchange_trial_steps=TRIAL_STEPS, exchange_recheck_steps=0, hierarchical="auto",
                         residual_decay=1.0, **unexpected):
    """Wrap ``optimizer`` so that gradients are exchanged as Top-K pairs with error feedback.

    Same signature and behaviour as ``hvd.DistributedOptimizer``: the result is an instance of
    the user's optimizer class; ``synchronize()``, ``skip_synchronize()``, ``zero_grad()`` and
    ``hvd.broadcast_optimizer_state`` work as in Horovod. The inner optimizer's state is kept.
    Between ``backward()`` and ``synchronize()``, ``p.grad`` holds this rank's gradient;
    afterwards the averaged exchanged result.

    Args:
        compression: ``hvd_topk.TopK`` (1%) or ``hvd_topk.TopK(density=..., method=...,
            fp16_values=..., compact=...)``: what each sparse tensor sends per step.
        backward_passes_per_step, op, gradient_predivide_factor, process_set: as in Horovod
            (op is ``hvd.Average`` or ``hvd.Sum``).
        groups: ``None`` (buckets of ``fusion_bytes``), an int (that many buckets) or a list of
            parameter lists (one bucket each): which tensors share one packed message.
        num_groups: Horovod's deprecated spelling of ``groups=int``, kept so that calls (also
            positional ones) written for ``hvd.DistributedOptimizer`` work unchanged; it warns
            as Horovod does (a ``DeprecationWarning``, without Horovod's stale "removed in v0.23.0").
        sparse_as_dense: as in Horovod: a sparse gradient (``nn.Embedding(sparse=True)``) is
            made dense, exchanged (and compressed) like any other, and handed to the inner
            optimizer sparse again. hvd_topk does this for every sparse gradient (Horovod's
            other road, an allgather of the touched rows, is not compressed); without the
            option one warning says so (``hvd_topk.sparse_grads``).

    Keyword-only options (``hvd_topk.options.Options`` is the tuning guide):
        error_feedback (True): carry unsent entries to the next step. Turning it off loses them.
        momentum_correction (0.0): DGC momentum factor; set the inner optimizer's momentum to 0.
        warmup_steps (0), warmup_density (0.25): exponential density warm-up (DGC). With
            ``LocalAdamW``: ``100`` and ``1.0``; on long runs with a learning-rate warm-up of
            500 steps or more, the warm-up's steps (``hvd_topk.options.Options``).
        residual_decay (1.0): each step the residuals are multiplied by this before the new
            gradient is added (a decayed accumulator, as in DeMo; 1.0 keeps everything).
        min_numel (1024): tensors with fewer elements go through a dense allreduce.
        fusion_bytes (64 MiB): dense-equivalent size of a sparse bucket.
        dense_fallback (True): send a bucket dense when a ring allreduce moves no more bytes than
            the sparse exchange (the allgather at density >= 1/P for fp32 gradients); not below
            density 1 where the residual is DeMo's momentum (a ``residual_decay`` added to error
            feedback is no momentum: the 0.1% recipe's dense start takes the fallback).
        exchange ("auto"): how buckets travel. ``"auto"`` times each strategy the cost model
            proposes for ``exchange_trial_steps`` (3) real steps each and keeps the fastest
            (logged once on rank 0; ``compression_stats()["exchange_reason"]``); it may be dense
            where the network is fast (dense fp16 only where values travel in 16 bits already:
            ``TopK(fp16_values=True)`` or ``compact=True``; no sparse allreduce over ``LocalAdamW``
            or ``DeMo``, whose updates it cost quality from 4 ranks on: pin it to use it; no dense
            over ``DeMo``, whose residual is its momentum, which dense would send whole).
            ``"allgather"``: every rank's pairs (bytes grow with the
            ranks). ``"sparse_allreduce"``: each rank's top-k positions in one part of the bucket
            (rotating), every rank's values there allreduced (bytes grow as (P-1)/P). ``"dense"``,
            ``"dense_fp16"``: Horovod's allreduce, fp32 or fp16. ``exchange_recheck_steps`` (0):
            re-run the trial that often (it always re-runs when the world size changes).
        hierarchical ("auto"): dense reduce-scatter inside each host, Top-K with error feedback on
            this rank's shard of the host's sum, the sparse exchange across hosts only, then an
            allgather inside the host. Needs ``hvd_topk.init()`` in place of ``hvd.init()``;
            "auto" turns it on for jobs with several hosts, each with the same number of ranks,
            more than one.
        selection_scope ("tensor"): ``"tensor"``, k = density x n for every tensor, or
            ``"bucket"``, one top-k over each fusion bucket (k = density x the bucket's size).
        grad_scaler (None): with mixed precision, the ``torch.amp.GradScaler`` that scales the
            loss. Pass it: residuals are rescaled when the loss scale changes. Without it they
            would be added back at a stale scale, so ``scaler.step(opt)`` raises a RuntimeError
            naming this option.

    Any other keyword is a TypeError; TopK's own (``density``, ``method``, ``fp16_values``,
    ``compact``) are named as options of ``compression=hvd_topk.TopK(...)``.

    Its collectives are named ``hvd_topk.opt.<set>.<n>.…``, ``n`` counting the optimizers built
    over ``process_set`` before it in this process: ranks may build optimizers over sets that
    others do not use, as long as the ranks of one set build theirs over it in the same order.
    """
    if unexpected:  # (Python's own TypeError would not say where density & co. go)
        raise unexpected_options_error("DistributedOptimizer", unexpected, known=keyword_names(DistributedOptimizer))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if hasattr(optimizer, ENGINE):
        raise ValueError("optimizer is already a hvd_topk.DistributedOptimizer")
    if isinstance(optimizer, torch.optim.LBFGS):
        # (its step(closure) would run after the closure's one evaluation, with none of its own)
        raise TypeError("torch.optim.LBFGS is not supported: it evaluates its closure several times a step, and "
                        "every evaluation's gradients would need an exchange of their own")
    if hasattr(optimizer, LOCAL):
        raise ValueError("optimizer is a hvd_topk.LocalSteps, which exchanges the model itself: use it alone "
                         "(it takes the DistributedOptimizer's options for its exchange)")
    if is_horovod_distributed_optimizer(optimizer):
        raise ValueError("optimizer is already a horovod DistributedOptimizer; wrap the plain "
                         "torch optimizer instead")
    if checkpoint.drop_local_steps_state(optimizer.param_groups):
        # kept, they would go into every checkpoint of this optimizer (which then reads as a
        # LocalSteps one, refused on load)
        warnings.warn("hvd_topk.DistributedOptimizer: the optimizer's param groups held hvd_topk.LocalSteps' entries "
                      "(a LocalSteps checkpoint loaded into it before wrapping, or an earlier LocalSteps over it): "
                      "dropped. The model is taken as it is, one rank's replica if LocalSteps was mid-period: "
                      "hvd.broadcast_parameters(model.state_dict(), root_rank=0) brings the ranks together. "
                      "A LocalSteps checkpoint loads into LocalSteps. " + checkpoint.LOCAL_STEPS_CONVERSION,
                      stacklevel=outside_level())
    if num_groups != 0:  # as Horovod 0.28.1 does
        warnings.warn("Parameter `num_groups` has been replaced by `groups`", DeprecationWarning,
                      stacklevel=outside_level())
        if groups is None:
            groups = num_groups
    residual_decay = residual_decay_of(optimizer, residual_decay, error_feedback)
    options = Options(error_feedback=error_feedback, momentum_correction=momentum_correction,
                      warmup_steps=warmup_steps, warmup_density=warmup_density, min_numel=min_numel,
                      fusion_bytes=fusion_bytes, dense_fallback=dense_fallback,
                      selection_scope=selection_scope, sparse_as_dense=sparse_as_dense,
                      exchange=exchange, exchange_trial_steps=exchange_trial_steps,
                      exchange_recheck_steps=exchange_recheck_steps, hierarchical=hierarchical,
                      residual_decay=residual_decay)
    compression = _resolve_compression(compression)
    warn_ignored(exchange, density=(compression.density, TopK.DEFAULT_DENSITY))
    warn_momentum_sent_whole(exchange, momentum_in_residual(optimizer))
    if groups is not None and fusion_bytes != Options.fusion_bytes:
        warnings.warn(f"fusion_bytes has no effect with groups={groups!r}: groups decides the buckets",
                      stacklevel=outside_level())
    _check_horovod_arguments(op, gradient_predivide_factor, backward_passes_per_step)
    if not isinstance(process_set, hvd.ProcessSet):
        raise TypeError(f"process_set must be a horovod ProcessSet (hvd.global_process_set, hvd.add_process_set(...)), "
                        f"got {type(process_set).__name__}")
    if process_set.size() is None:  # Horovod's "not initialised": never registered, or removed
        raise ValueError(f"process_set {process_set.ranks} is not registered with Horovod: pass it to "
                         "hvd.init(process_sets=[...]) or create it with hvd.add_process_set(ranks)")
    _check_no_duplicates(optimizer.param_groups, named_parameters)
    check_grad_scaler(grad_scaler, optimizer)
    if op == hvd.Sum and hasattr(optimizer, "transform_local_gradient") \
            and not getattr(optimizer, "sum_invariant", False):
        raise ValueError(f"op=hvd.Sum with {type(optimizer).__name__}: the exchange would sum the ranks' updates, "
                         "a step as many times as long as there are ranks (AdamW's own step does not grow when "
                         "gradients are summed, so hvd.DistributedOptimizer(AdamW, op=hvd.Sum) trains as with "
                         "Average). Use op=hvd.Average, the default.")
    if error_feedback and isinstance(optimizer, ADAPTIVE) and exchange not in DENSE_EXCHANGES:  # (dense: nothing held)
        warnings.warn(ADAM_WARNING.format(adaptive_name(type(optimizer))), stacklevel=outside_level())
    if momentum_correction:
        check_single_momentum(optimizer)
    names = _name_parameters(optimizer.param_groups, named_parameters)
    engine = TopKEngine(optimizer.param_groups, names, compression, options, op=op,
                        gradient_predivide_factor=gradient_predivide_factor,
                        backward_passes_per_step=backward_passes_per_step, process_set=process_set,
                        groups=groups, prefix=instance_name("opt", process_set),
                        grad_scaler=grad_scaler, inner=type(optimizer).__qualname__,
                        updates=hasattr(optimizer, "transform_local_gradient"),
                        momentum=momentum_in_residual(optimizer))
    if isinstance(optimizer, torch.optim.SparseAdam):  # it takes sparse gradients only, from the first step
        engine.sparse.always(engine.params)
    engine.sparse.held_sparse(optimizer.state)  # an optimizer that has stepped before
    wrapped = share_as_subclass(optimizer, _DistributedOptimizer)
    setattr(wrapped, ENGINE, engine)
    # An inner optimizer that works on each rank's own gradient before the exchange (LocalAdamW)
    # defines transform_local_gradient(param, grad, ranks): ranks' results will be averaged.
    # The engine holds the optimizer weakly: the optimizer holds the engine, and that cycle kept
    # a dropped optimizer's gradient hooks working on the next one's gradients until Python's
    # garbage collector ran (at different times on different ranks).
    engine.transform = _weakly(getattr(wrapped, "transform_local_gradient", None))
    engine.on_exchanged = _weakly(getattr(wrapped, "exchanged", None))
    # and one that measures the ranks' average gradient (LocalAdamW(variance_sketch=B)) has its
    # sketches averaged after each exchange
    engine.sketcher = weakref.proxy(wrapped) if callable(getattr(wrapped, "sketch_rows", None)) else None
    return wrapped


def _weakly(method):
    """A bound ``method`` (or None) held through a ``weakref.WeakMethod``: its object can be
    collected while the returned function lives (which then does nothing)."""
    if method is None:
        return None
    ref = weakref.WeakMethod(method)

    def call(*args):
        alive = ref()
        return None if alive is None else alive(*args)
    return call


def check_single_momentum(optimizer):
    """``momentum_correction`` keeps DGC's momentum before compression; warn where the inner
    optimizer has one of its own (SGD's ``momentum``, Adam's beta1), which would apply momentum
    twice, or where its residual already is one (``transform_local_gradient``: LocalAdamW, DeMo)."""
    name = type(optimizer).__name__
    if hasattr(optimizer, "transform_local_gradient"):
        warnings.warn(f"momentum_correction with {name}: it exchanges each rank's update, whose residual already "
                      "carries the past (a momentum on top of error feedback's measured to hurt, docs/adamw.md); "
                      "leave momentum_correction at 0", stacklevel=outside_level())
    elif any(g.get("momentum", 0) or g.get("betas", (0.0,))[0] for g in optimizer.param_groups):
        warnings.warn(f"momentum_correction applies momentum before compression; {name}'s own momentum (SGD's "
                      "momentum, Adam's beta1) should be 0 (DGC), or momentum is applied twice",
                      stacklevel=outside_level())


def share_as_subclass(optimizer, methods):
    """An instance of a dynamic subclass of ``optimizer``'s class with ``methods``' attributes
    (a class body) added, sharing ``optimizer``'s state, as Horovod's DistributedOptimizer is."""
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(methods.__dict__))
    # hvd.broadcast_optimizer_state initialises a fresh optimizer's state by calling the *inner*
    # step() when the optimizer's module is Horovod's; otherwise it would run a whole exchange.
    cls.__module__ = OPTIMIZER_MODULE
    # the inner class's step runs the step hooks; load_state_dict must not add a second run
    keep_step_unhooked(cls)
    wrapped = cls.__new__(cls)
    # Share the user's optimizer (param_groups, state, hooks, defaults) instead of re-creating
    # it; an instance-level ``step`` (an LR scheduler's wrapper) would bypass ours.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    return wrapped


class _EngineSetting:
    """One of the engine's settings read under Horovod's attribute name. Not a property: a
    non-data descriptor, so an attribute of the same name that the user's optimizer sets on
    itself (``self.op = ...`` in its ``__init__`` or its ``step()``) stays its own."""

    def __init__(self, read):
        self.read = read

    def __get__(self, optimizer, owner=None):
        return self if optimizer is None else self.read(getattr(optimizer, ENGINE))


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods copied into the dynamic subclass of the user's optimizer (as Horovod does)."""

    # Horovod's optimizer keeps its arguments as attributes, and code written for it reads them
    backward_passes_per_step = _EngineSetting(lambda engine: engine.passes_per_step)
    op = _EngineSetting(lambda engine: engine.op)
    gradient_predivide_factor = _EngineSetting(lambda engine: engine.predivide)
    process_set = _EngineSetting(lambda engine: engine.process_set)
    sparse_as_dense = _EngineSetting(lambda engine: engine.options.sparse_as_dense)

    def set_backward_passes_per_step(self, passes):
        """As Horovod's: how many ``backward()`` calls make one step from now on (gradient
        accumulation). Between steps only, and alike on every rank (as in Horovod, the ranks are
        not compared here: a rank that accumulates otherwise waits at the next exchange)."""
        engine = getattr(self, ENGINE)
        check_integer(passes, "backward_passes_per_step", 1)
        if engine.mid_step():
            raise RuntimeError("set_backward_passes_per_step() was called between backward() and step(): "
                               "call it between steps")
        engine.passes_per_step = passes

    @property
    def _parameter_names(self):
        """As Horovod's attribute: ``{parameter: name}``, the name each parameter's gradient is
        exchanged under (``named_parameters``' names, else ``allreduce.noname.<i>``; unique and
        the same on every rank). Horovod's own tests and tools read it."""
        return getattr(self, ENGINE).names

    @_parameter_names.setter
    def _parameter_names(self, value):
        # hvd.DistributedOptimizer sets it on the optimizer it wraps
        raise TypeError("hvd_topk.DistributedOptimizer exchanges the gradients itself: do not wrap it in "
                        "hvd.DistributedOptimizer (wrap the plain torch optimizer in one or the other)")

    def synchronize(self):
        """Finish every exchange of this step; afterwards ``p.grad`` holds the averaged result.
        Called again before ``step()`` with no new backward, it does nothing: Horovod averages
        again, which changes nothing for a dense average, but a second Top-K exchange would send
        the average through the residuals again."""
        engine = getattr(self, ENGINE)
        if not engine.holds_result():
            scaler = engine.residual_scale.scaler
            if scaler is not None and unscaled_already(scaler, self):
                raise RuntimeError(
                    "scaler.unscale_(opt) ran before this step's exchange: it unscaled this rank's own "
                    "gradients, which the exchange replaces with the still-scaled average. Exchange first: "
                    "opt.synchronize(); scaler.unscale_(opt); (clip); with opt.skip_synchronize(): "
                    "scaler.step(opt) (Horovod's pattern), or scaler.step(opt) without unscale_.")
            engine.synchronize()

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` so that ``step()`` does not exchange again."""
        engine = getattr(self, ENGINE)
        engine.should_synchronize = False
        try:
            yield
        finally:
            engine.should_synchronize = True

    def step(self, closure=None):
        """Exchange (unless ``synchronize()`` did, or inside ``skip_synchronize()``), then the
        inner optimizer's step. A ``closure`` is evaluated once, first, as torch's optimizers do,
        so that its backward is the one exchanged (an optimizer that evaluates it several times
        in one step, LBFGS, is not supported: it gets no closure)."""
        engine = getattr(self, ENGINE)
        loss = None
        if closure is not None:
            if not engine.should_synchronize:
                raise RuntimeError("step(closure) inside skip_synchronize(): the closure's gradients would "
                                   "never be exchanged. Call step(closure) alone, or run the closure's "
                                   "backward before synchronize()")
            with torch.enable_grad():
                loss = closure()
        if not engine.should_synchronize and engine.mid_step():
            # Horovod steps on, each rank with its own gradient, and its next zero_grad() fails
            # naming neither; here that gradient is in the residual as well, to be sent later
            raise RuntimeError("optimizer.step() inside optimizer.skip_synchronize() while this step's gradients are "
                               "still being exchanged (a backward() after synchronize() starts a new exchange): "
                               "p.grad holds this rank's own gradient, so the ranks would "
                               "apply different updates. Call optimizer.synchronize() first (then clip, then "
                               "step() inside skip_synchronize()), or step() alone")
        if engine.should_synchronize:
            if engine.holds_result() and not engine.synchronized_for_scaler:
                # Horovod warns and averages again, which changes nothing for a dense average;
                # a second Top-K exchange would send the (clipped) average through the residual
                # again, so p.grad is used as synchronize() left it
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code. (hvd_topk: p.grad already "
                              "holds the exchanged result and is used as it is.)")
            else:
                self.synchronize()  # (nothing left to do after scaler.step's exchange)
                engine.count_repeat()
        # (not DeMo: its normalisation ignores a common factor, such as clipping's)
        if engine.transform is not None and not engine.warned_update_changed \
                and not getattr(self, "sum_invariant", False):
            _warn_update_changed(engine)
        # a fused inner optimizer is stepped by GradScaler even after an overflow and skips inside
        # its kernel: the scaler's found_inf says so (read only while auto's trial times steps)
        found_inf = self.__dict__.get("found_inf")
        skipped = found_inf is not None and engine.planner.timing() and bool(found_inf)
        engine.synchronized = engine.synchronized_for_scaler = False
        engine.awaiting_inner_step = skipped
        inner = super(self.__class__, self).step()
        return loss if closure is not None else inner

    def zero_grad(self, set_to_none=True):
        engine = getattr(self, ENGINE)
        # taken_in: a bucket not yet launched holds this step's folded gradients too (Horovod has a
        # handle per tensor from its first hook, and refuses as soon as any exists)
        if engine.mid_step():
            # in an elastic job, most likely a reset that restored a state without this optimizer:
            # the failed step's exchanges are still pending (TorchState's restore drops them)
            elastic = (" In an elastic job after a reset: put this optimizer in hvd.elastic.TorchState(model=..., "
                       "optimizer=opt), whose restore() drops the exchanges a failed worker left in flight."
                       if elastic_mode() and engine.pending() else "")
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited "
                                 "as it can cause a race condition." + elastic + STEPPED_THE_INNER)
        engine.synchronized = False  # gradients of a synchronized but skipped step are dropped
        engine.synchronized_for_scaler = False
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """The inner optimizer's state plus, under ``"hvd_topk"``, this rank's residuals,
        momentum buffers and step counter. Residuals are per rank: save one file per rank
        for an exact resume (a rank loading another rank's file starts from zero residuals).

        The step counter is also a param-group option (``"hvd_topk_step"``), so that
        ``hvd.broadcast_optimizer_state`` brings every rank to the root's step after a
        checkpoint was loaded on the root only; the other ranks' residuals then start at zero.

        Call it after ``step()`` (or before this step's ``backward()``): in between, this
        rank's gradient is already in the residual, and a resume would count it twice
        (RuntimeError). Between ``synchronize()`` and ``step()`` it is allowed: the resumed run
        goes on without that step's exchanged result (as after a step a ``GradScaler`` skipped;
        ``LocalAdamW``'s moments already hold the step's gradient)."""
        engine = getattr(self, ENGINE)
        if engine.taken_in():
            raise RuntimeError(
                "optimizer.state_dict() was called after loss.backward() and before optimizer.step(): this "
                "rank's gradient is already folded into the error-feedback residual (and LocalAdamW's moments), "
                "so a run resumed from it would count this step's gradient twice. Save after optimizer.step().")
        state = super(self.__class__, self).state_dict()
        state[STATE_KEY] = engine.state_dict()
        return state

    def load_state_dict(self, state_dict):
        self._apply_loaded(*self._check_loaded(state_dict))

    def _check_loaded(self, state_dict):
        """``load_state_dict``'s first half: everything checked, nothing applied (a checkpoint
        that does not fit raises ``checkpoint.CheckpointMismatch`` and leaves this optimizer as
        it was). ``LocalSteps`` checks its outer optimizer's section with it before it loads its
        own part. Returns what ``_apply_loaded`` takes."""
        engine = getattr(self, ENGINE)
        # Horovod elastic restores the committed state after a failure, typically with buckets
        # still in flight: they died with the old job and are dropped. Elsewhere it is a misuse.
        if engine.pending() and not elastic_mode():
            raise AssertionError("load_state_dict() was called while gradients were being exchanged")
        checkpoint.check_inner(self.param_groups, engine.names, state_dict)
        state_dict = dict(unshared_for_elastic(state_dict))
        ours = state_dict.pop(STATE_KEY, None)
        return state_dict, ours, checkpoint.check(engine, ours)

    def _apply_loaded(self, state_dict, ours, nonfinite):
        engine = getattr(self, ENGINE)
        step = engine.step  # kept where the checkpoint is a plain torch optimizer's
        carried = (state_dict.get("param_groups") or [{}])[0].get(STEP_KEY) if ours is None else None
        if checkpoint.is_count(carried) and carried:
            # ours, gone through a plain torch optimizer (an export, a conversion): its step in
            # the param groups, its residuals lost
            warnings.warn(f"hvd_topk: this checkpoint has no 'hvd_topk' section but its param groups hold "
                          f"hvd_topk's step counter ({carried}): it was saved through a plain torch optimizer. "
                          f"The run goes on from step {carried} (the density warm-up too); the error-feedback "
                          "residuals start from zero.", stacklevel=outside_level())
            step = carried
        if ours is None and "param_groups" in state_dict:
            groups, taken = checkpoint.fill_options(state_dict["param_groups"], self.param_groups, self.defaults)
            if taken:
                warnings.warn(f"hvd_topk: this checkpoint's param groups lack {', '.join(taken)} (saved by another "
                              f"optimizer, such as torch.optim.AdamW): they keep the values this "
                              f"{type(self).__name__} was built with. Its other options (lr, betas, weight decay, "
                              "...) come from the checkpoint, as torch's load_state_dict does: set them in "
                              "param_groups after loading to change them.", stacklevel=outside_level())
                state_dict = {**state_dict, "param_groups": groups}
        # into the objects the user's optimizer shares (an LR scheduler built on it goes on working)
        keep_objects(self, super(self.__class__, self).load_state_dict, state_dict)
        engine.sparse.held_sparse(self.state)
        engine.load_state_dict(ours, self.param_groups, nonfinite, step_before=step)

    def _amp_scaling_read(self):
        """``torch.amp.GradScaler.step(opt)`` reads ``_step_supports_amp_scaling`` (see
        ``hvd_topk._torch``): a scaler steps this optimizer. Without ``grad_scaler=`` the
        residuals would silently be added back at a stale scale after its next change."""
        engine = getattr(self, ENGINE)
        if hasattr(self, "transform_local_gradient"):  # LocalAdamW, DeMo: no scaler at all
            raise RuntimeError(f"a torch.amp.GradScaler is stepping this hvd_topk.DistributedOptimizer over "
                               f"{type(self).__name__}, which does not support loss scaling (its state would mix "
                               "loss scales and absorb overflowed steps): use bf16 autocast, which needs no scaler")
        if engine.residual_scale.scaler is None and engine.options.error_feedback:
            raise RuntimeError(
                "a torch.amp.GradScaler is stepping this hvd_topk.DistributedOptimizer, which was "
                "built without it: error-feedback residuals hold scaled gradients and would be "
                "added back at a stale scale after the scaler changes its scale. Pass it: "
                "hvd_topk.DistributedOptimizer(optimizer, ..., grad_scaler=scaler).")
        if engine.should_synchronize and not engine.holds_result():
            # GradScaler.step reads this before it unscales and looks for inf/nan: exchange now,
            # so that it unscales the exchanged average (the same on every rank, so an overflow
            # skips the step on every rank), not this rank's own gradients, which step() would
            # then replace with the still-scaled average. (PyTorch's plain loop:
            # scaler.scale(loss).backward(); scaler.step(opt); scaler.update().)
            self.synchronize()
            engine.synchronized_for_scaler = True
        return self.__dict__.get(AMP_SCALING_ATTRIBUTE, False)

    def _amp_scaling_set(self, value):  # fused optimizers set it in their __init__
        self.__dict__[AMP_SCALING_ATTRIBUTE] = value

    def compression_stats(self, reset=False):
        """Totals on this rank over the run: since construction or the last
        ``compression_stats(reset=True)``, and ``load_state_dict`` takes over the counts a
        checkpoint carries (not the times), so that a resumed run's cover the whole run, its dense
        start included; an elastic ``restore()`` takes the commit's back, as it does the model.
        Bytes sent vs dense, achieved density, tensors sparse/dense, selection and exchange time,
        non-finite resets, the step and current density."""
        engine = getattr(self, ENGINE)
        out = engine.compression_stats()
        if reset:
            engine.stats.reset()
        return out


setattr(_DistributedOptimizer, AMP_SCALING_ATTRIBUTE,
        property(_DistributedOptimizer._amp_scaling_read, _DistributedOptimizer._amp_scaling_set))


def _resolve_compression(compression):
    if compression is None or compression is TopK:
        return TopK.default()
    if isinstance(compression, TopK):
        return compression
    if isinstance(compression, type) and issubclass(compression, TopK):
        return compression.default()
    raise TypeError(f"compression must be hvd_topk.TopK or hvd_topk.TopK(...), got {compression!r}; "
                    "for Horovod's own compressors use hvd.DistributedOptimizer")


def _check_horovod_arguments(op, gradient_predivide_factor, passes):
    if op == hvd.Adasum:
        raise ValueError("op=hvd.Adasum is not supported by hvd_topk: Adasum combines dense "
                         "deltas; use op=hvd.Average or op=hvd.Sum")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {OP_NAMES.get(op, repr(op))}")
    f = check_number(gradient_predivide_factor, "gradient_predivide_factor")  # numpy's floats too
    if not 0 < f < float("inf"):
        raise ValueError(f"gradient_predivide_factor must be a finite number > 0, got {gradient_predivide_factor!r}")
    if f != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    check_integer(passes, "backward_passes_per_step", 1)


def _check_no_duplicates(param_groups, named_parameters):
    """A parameter listed twice in the param groups (torch only warns) would get two gradient
    hooks, and its first backward would fail with Horovod's "computed more than
    backward_passes_per_step times", which names neither."""
    seen = set()
    for i, p in enumerate(p for g in param_groups for p in g["params"]):
        if id(p) in seen:
            raise ValueError(f"the optimizer holds a parameter twice (shape {tuple(p.shape)}, position {i} in its "
                             "param_groups): list each parameter once, in one param group")
        seen.add(id(p))


def _warn_update_changed(engine):
    """Over ``LocalAdamW`` or ``DeMo``: warn once where ``p.grad``, the ranks' averaged update
    after ``synchronize()``, was changed before the inner step (clipped, as a dense AdamW loop
    does): that shrinks or bends the step every rank agreed on."""
    changed = engine.update_changed()
    if changed:
        engine.warned_update_changed = True
        warnings.warn(UPDATE_CHANGED.format(front="hvd_topk.DistributedOptimizer", inner=engine.inner_name,
                                            names=named_few(changed), when="synchronize()"),
                      stacklevel=outside_level())


def _name_parameters(param_groups, named_parameters):
    """Horovod's naming rules and errors, with unique names for unnamed parameters."""
    if named_parameters is not None:
        if callable(getattr(named_parameters, "compress", None)):  # a compressor, one argument early
            shown = getattr(named_parameters, "__name__", type(named_parameters).__name__)
            raise TypeError(f"named_parameters got a compression ({shown}): pass it as compression=... (the "
                            "third argument, as in hvd.DistributedOptimizer(optimizer, named_parameters, "
                            "compression)), and model.named_parameters() as named_parameters")
        try:
            named_parameters = list(named_parameters)
        except TypeError:
            raise TypeError(NAMED_PARAMETERS_ERROR + f", got {type(named_parameters).__name__}") from None
        if not named_parameters and any(g["params"] for g in param_groups):
            raise ValueError("named_parameters is empty (a model.named_parameters() generator that was "
                             "already used up? pass list(model.named_parameters()) to reuse it)")
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
