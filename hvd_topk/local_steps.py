"""``hvd_topk.LocalSteps``: each rank steps alone, and every H steps the model change goes
through Top-K with error feedback (DiLoCo, Douillard et al. 2023; SparseLoCo, 2025).

Between synchronisations every rank runs the user's optimizer (plain ``torch.optim.AdamW``) on
its own gradients: nothing is exchanged and Adam's moments stay local, so they never need to
agree. Every ``sync_every`` steps each rank's model change since the last synchronisation,
``anchor - p`` (the "pseudo-gradient"), is handed to an outer ``hvd_topk.DistributedOptimizer``
over the anchors (the shared weights): Top-K with error feedback (``residual_decay`` below 1 is
SparseLoCo's decayed error buffer), any exchange strategy (allgather, sparse allreduce, auto,
hierarchical), then an outer SGD step on the anchors, after which every rank's model is reset
to them. The anchors change only by the exchanged average, so every rank holds the same bits
after each synchronisation; between two of them the replicas differ.

Bytes: one Top-K exchange per ``sync_every`` steps, so ``compression_stats()["bytes_ratio"]``
(against a dense allreduce every step) is about the density's ratio divided by ``sync_every``.

Tuning (what the papers and our runs say; docs/adamw.md has the measurements):

- ``sync_every`` (H): more steps between synchronisations send fewer bytes and let the replicas
  drift further apart; with small per-rank batches keep it small (4-32).
- ``outer_lr`` 1.0 with ``outer_momentum`` 0 averages the replicas' sent change (plain local
  SGD / SparseLoCo); DiLoCo uses 0.7 with Nesterov momentum 0.9 (``nesterov=True``).
- the density (``compression=hvd_topk.TopK(density=...)``): per synchronisation, so at equal
  bytes it can be H times the per-step recipe's.
- ``warmup_steps`` of the outer optimizer count synchronisations, not steps.
"""

import warnings
import weakref
from contextlib import contextmanager

import torch

from hvd_topk._stack import outside_level
from hvd_topk import agreement, checkpoint
from hvd_topk._horovod import hvd, is_horovod_distributed_optimizer, unshared_for_elastic
from hvd_topk._torch import AMP_SCALING_ATTRIBUTE, keep_objects
from hvd_topk.compressor import TopK, keyword_names, unexpected_options_error
from hvd_topk.engine import STEP_KEY, TRIAL_KEY
from hvd_topk.rank_checks import (check_parameters_unchanged, check_still_frozen, check_still_trainable,
                                  parameter_signature, process_set_size)
from hvd_topk.optimizer import ENGINE, LOCAL, DistributedOptimizer, _name_parameters, share_as_subclass
from hvd_topk.checks import check_flag, check_integer, check_number
from hvd_topk.stats import DENSE_FP32_BYTES

STATE_KEY = checkpoint.LOCAL_STEPS_KEY  # its section of state_dict(): this rank's outer optimizer
PHASE_KEY = "hvd_topk_local_step"   # param group 0: steps since the last synchronisation
SYNCS_KEY = "hvd_topk_local_syncs"  # param group 0: the outer optimizer's step (synchronisations done)
OUTER_TRIAL_KEY = "hvd_topk_local_trial"  # param group 0: the outer exchange="auto"'s trial (engine.TRIAL_KEY)
# param group 0 of state_dict() (never of the live groups): what every rank shares, the anchors and
# the outer SGD's momentum buffers. hvd.broadcast_optimizer_state broadcasts a state_dict()'s
# param-group options from the root and sets them on the live groups, where the next step()
# takes them in (_adopt_shared); load_state_dict takes them in at once. Horovod 0.28.1 broadcasts
# nothing for an optimizer without state (SGD without momentum): the check at each
# synchronisation (_check_shared) then says so.
SHARED_KEY = checkpoint.LOCAL_SHARED_KEY

# The outer DistributedOptimizer's keyword options that make sense here; the others (op,
# backward_passes_per_step, grad_scaler, momentum_correction, ...) act on gradients, which never
# reach the outer optimizer.
OUTER_OPTIONS = frozenset({"error_feedback", "residual_decay", "warmup_steps", "warmup_density", "min_numel",
                           "fusion_bytes", "dense_fallback", "selection_scope", "exchange", "exchange_trial_steps",
                           "exchange_recheck_steps", "hierarchical", "groups"})


def _groups_of_anchors(groups, param_groups, params, anchors):
    """``groups=[[parameter, ...], ...]`` names the model's parameters; the outer optimizer
    exchanges their anchors. Each trained parameter becomes its anchor, a frozen one is left out
    (it is not exchanged, as with ``DistributedOptimizer``), and anything else is kept, for the
    outer optimizer to refuse by name."""
    anchor_of = {id(p): a for p, a in zip(params, anchors)}
    frozen = {id(p) for g in param_groups for p in g["params"] if not p.requires_grad}
    return [[anchor_of.get(id(p), p) for p in group if id(p) not in frozen] if isinstance(group, (list, tuple))
            else group for group in groups]


def _momentum_buffer(outer, anchor):
    """The outer SGD's momentum buffer of ``anchor`` (a copy), or None (no momentum, or none yet)."""
    buffer = outer.state.get(anchor, {}).get("momentum_buffer")
    return None if buffer is None else buffer.detach().clone()


class LocalStepsState:
    """What ``LocalSteps`` keeps beside the user's optimizer.

    Tune: ``sync_every``. Internal: ``params`` (trained, in the optimizer's order) and their
    ``names``, ``anchors``
    (the shared weights at the last synchronisation, one per parameter, identical on every
    rank), ``outer`` (the ``hvd_topk.DistributedOptimizer`` over the anchors, with SGD at
    ``outer_lr``), ``frozen`` (``{parameter: name}`` of those with ``requires_grad=False`` when
    it was built: they have no anchor), ``param_ids`` and ``param_signature`` (every parameter
    of the optimizer's groups, and the trained ones' shapes, dtypes and devices, when it was
    built: the anchors were made for them). Statistics: ``steps`` taken on this rank (for
    ``compression_stats``; a checkpoint carries them). ``inside`` (in ``step()``) and
    ``steps_elsewhere`` (the user's optimizer stepped outside it since) tell
    ``warn_stepped_elsewhere`` what happened."""

    def __init__(self, params, names, anchors, outer, sync_every, frozen, param_ids):
        self.params, self.names, self.anchors, self.outer = params, names, anchors, outer
        self.sync_every = sync_every
        self.frozen = frozen
        self.param_ids, self.param_signature = param_ids, parameter_signature(params)
        self.steps = 0
        self.inside, self.steps_elsewhere = False, 0


STEPPED_ELSEWHERE = (
    "hvd_topk.LocalSteps: the optimizer passed to it was stepped {n} times without a step() of the optimizer "
    "LocalSteps returned, which is the one that synchronises: these steps stay on this rank, whose model goes its "
    "own way. Step the returned optimizer (opt = hvd_topk.LocalSteps(inner, ...); ...; opt.step()).")
ELSEWHERE_ALLOWED = 2  # hvd.broadcast_optimizer_state steps a fresh optimizer once (twice: called twice)


def warn_stepped_elsewhere(optimizer, local):
    """Register on ``optimizer`` (the returned one: its hooks are the user's optimizer's, shared)
    a step post-hook counting the steps taken outside ``LocalSteps``' own ``step()``. Horovod's
    broadcast of a fresh optimizer's state takes one such step (``hvd.broadcast_optimizer_state``),
    so a warning, once, from the third in a row: the returned optimizer never stepped, nothing is
    synchronised. The hook holds ``local`` weakly and comes off when it is collected (the
    LocalSteps dropped): it would otherwise count, and warn about, the steps of whatever wraps the
    user's optimizer next, and keep the dropped one's shared weights alive."""
    ref = weakref.ref(local)

    def hook(optimizer, args, kwargs):
        local = ref()
        if local is None or local.inside:
            return
        local.steps_elsewhere += 1
        if local.steps_elsewhere == ELSEWHERE_ALLOWED + 1:
            warnings.warn(STEPPED_ELSEWHERE.format(n=local.steps_elsewhere), stacklevel=outside_level())
    weakref.finalize(local, optimizer.register_step_post_hook(hook).remove)


def LocalSteps(optimizer, named_parameters=None, *, sync_every, compression=TopK, outer_lr=1.0,
               outer_momentum=0.0, nesterov=False, process_set=hvd.global_process_set, **options):
    """Wrap ``optimizer`` so that each rank takes ``sync_every`` steps alone between exchanges.

    The result is an instance of the user's optimizer class (as ``hvd_topk.DistributedOptimizer``
    is), sharing its state: LR schedulers, ``hvd.broadcast_optimizer_state`` and ``zero_grad``
    work as before. ``loss.backward(); opt.step()`` steps locally; every ``sync_every``-th
    ``step()`` also exchanges the model change and resets the model to the shared weights.
    ``synchronize()`` and ``skip_synchronize()`` exist (gradients are local: nothing to wait
    for), so code written for the DistributedOptimizer runs unchanged.

    Args:
        optimizer: a plain torch optimizer (``torch.optim.AdamW``). ``LocalAdamW`` and ``DeMo``
            turn each rank's gradient into an update for an exchange of gradients and are refused
            (``FrozenVarianceAdamW``, a plain optimizer of gradients, may run on each rank).
        named_parameters: as in Horovod; the names the anchors are exchanged under.
        sync_every: steps between synchronisations (H >= 1; 1 exchanges the change every step).
        compression: ``hvd_topk.TopK(density=...)`` for the model change.
        outer_lr, outer_momentum, nesterov: the outer SGD on the anchors.
        process_set: as in Horovod.
        options: the outer ``hvd_topk.DistributedOptimizer``'s keywords that apply to a model
            change: ``error_feedback``, ``residual_decay``, ``warmup_steps`` (in
            synchronisations), ``warmup_density``, ``min_numel``, ``fusion_bytes``,
            ``dense_fallback``, ``selection_scope``, ``exchange``, ``exchange_trial_steps``,
            ``exchange_recheck_steps``, ``hierarchical``, ``groups``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if hasattr(optimizer, ENGINE) or hasattr(optimizer, LOCAL) or is_horovod_distributed_optimizer(optimizer):
        raise ValueError("optimizer is already distributed (hvd_topk or Horovod); wrap the plain torch optimizer")
    if hasattr(optimizer, "transform_local_gradient"):
        raise ValueError(f"{type(optimizer).__name__} turns each rank's gradient into an update for the exchange; "
                         "LocalSteps exchanges no gradients, it runs the optimizer on each rank's own: use "
                         "torch.optim.AdamW (or any plain optimizer)")
    outside = set(options) - OUTER_OPTIONS
    gradient_side = sorted(outside & keyword_names(DistributedOptimizer))
    unknown = sorted(outside - set(gradient_side))
    if unknown:
        raise unexpected_options_error("LocalSteps", unknown, takes=OUTER_OPTIONS, known=keyword_names(LocalSteps))
    if gradient_side:
        raise TypeError(f"LocalSteps got option(s) {', '.join(gradient_side)} that act on gradients, which it does "
                        f"not exchange; it takes {', '.join(sorted(OUTER_OPTIONS))}")
    sync_every = check_integer(sync_every, "sync_every", 1)
    outer_lr, outer_momentum = check_number(outer_lr, "outer_lr"), check_number(outer_momentum, "outer_momentum")
    check_flag(nesterov, "nesterov")
    if not 0 < outer_lr < float("inf"):
        raise ValueError(f"outer_lr must be a finite number > 0, got {outer_lr!r}")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if nesterov and not outer_momentum:
        raise ValueError("nesterov=True needs outer_momentum > 0")
    if checkpoint.drop_local_steps_state(optimizer.param_groups):
        # torch's load_state_dict kept the phase and shared weights in the param groups and dropped
        # the outer optimizer's section: kept, the run went on half way (the outer residuals
        # lost, its phase the checkpoint's), in silence until 2026-12-05
        warnings.warn(
            "hvd_topk.LocalSteps: the optimizer's param groups held LocalSteps' entries (a LocalSteps checkpoint "
            f"loaded into it before wrapping, which drops its outer optimizer, state_dict[{STATE_KEY!r}]; or an "
            "earlier LocalSteps over it): dropped, and a new period starts from the model as it is (at a "
            "synchronisation every rank's is the same; mid-period they differ, and the first synchronisation "
            "says so). To resume a checkpoint, load it into the optimizer LocalSteps returns: "
            "opt = hvd_topk.LocalSteps(inner, ...); opt.load_state_dict(checkpoint)", stacklevel=outside_level())
    names = _name_parameters(optimizer.param_groups, named_parameters)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    # requires_grad so that the outer optimizer exchanges them; they never enter autograd
    anchors = [p.detach().clone().requires_grad_(True) for p in params]
    if isinstance(options.get("groups"), (list, tuple)):
        options["groups"] = _groups_of_anchors(options["groups"], optimizer.param_groups, params, anchors)
    outer = DistributedOptimizer(torch.optim.SGD(anchors, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov),
                                 named_parameters=[(names[p], a) for p, a in zip(params, anchors)],
                                 compression=compression, process_set=process_set, **options)
    frozen = {p: names[p] for g in optimizer.param_groups for p in g["params"] if not p.requires_grad}
    wrapped = share_as_subclass(optimizer, _LocalSteps)
    param_ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    setattr(wrapped, LOCAL, LocalStepsState(params, [names[p] for p in params], anchors, outer, sync_every, frozen,
                                            param_ids))
    # param-group options from the start: hvd.broadcast_optimizer_state broadcasts each rank's own
    # keys, so a fresh elastic worker must have the same ones as the others
    wrapped.param_groups[0].update({PHASE_KEY: 0, SYNCS_KEY: 0, OUTER_TRIAL_KEY: None})
    warn_stepped_elsewhere(wrapped, getattr(wrapped, LOCAL))
    return wrapped


class _LocalSteps(torch.optim.Optimizer):
    """Methods copied into the dynamic subclass of the user's optimizer."""

    @property
    def local_step(self):
        """Steps since the last synchronisation (0 right after one). A param-group option, so
        checkpoints and ``hvd.broadcast_optimizer_state`` carry it."""
        return self.param_groups[0].get(PHASE_KEY, 0)

    @property
    def _parameter_names(self):
        """As Horovod's attribute (``{parameter: name}``, the names the anchors are exchanged under)."""
        local = getattr(self, LOCAL)
        names = local.outer._parameter_names
        return {p: names[a] for p, a in zip(local.params, local.anchors)}

    @_parameter_names.setter
    def _parameter_names(self, value):
        # hvd.DistributedOptimizer sets it on the optimizer it wraps
        raise TypeError("hvd_topk.LocalSteps exchanges the model itself: do not wrap it in hvd.DistributedOptimizer "
                        "(wrap the plain torch optimizer in one or the other)")

    def step(self, closure=None):
        local = getattr(self, LOCAL)
        check_parameters_unchanged(self.param_groups, local.param_ids, local.params, local.param_signature,
                                   "hvd_topk.LocalSteps")
        check_still_frozen(local.frozen.items(), "hvd_topk.LocalSteps",
                           "it has no shared copy, so its changes would never be exchanged")
        check_still_trainable(zip(local.params, local.names), "hvd_topk.LocalSteps",
                              "its shared copy would still move by the residual of its earlier changes, "
                              "and every synchronisation resets it to that copy")
        adopted = self._adopt_shared()
        if self.local_step == 0:
            # A period starts from the shared weights. Taken from the model (identical on every
            # rank here: just reset to the anchors, or broadcast by the user before training,
            # or restored by hvd.elastic), so a broadcast after construction needs nothing more;
            # but where the root's shared weights were just broadcast, from them: a rank without
            # optimizer state took one step of its own inside hvd.broadcast_optimizer_state (zero
            # gradients, but AdamW's weight decay moves the broadcast model).
            with torch.no_grad():
                for a, p in zip(local.anchors, local.params):
                    if adopted:
                        p.copy_(a)
                    else:
                        a.copy_(p)
        local.inside, local.steps_elsewhere = True, 0  # (the state fill at a synchronisation steps too)
        try:
            loss = self._local_step(closure)
            local.steps += 1
            phase = self.local_step + 1
            if phase >= local.sync_every:  # (more: a checkpoint of a longer period, load_state_dict)
                self._synchronise_model()
                self.param_groups[0][SYNCS_KEY] = getattr(local.outer, ENGINE).step
                phase = 0
            self.param_groups[0][PHASE_KEY] = phase
        finally:
            local.inside = False
        return loss

    def _local_step(self, closure):
        """The user's optimizer's step on this rank's gradients; under a ``torch.amp.GradScaler``
        (which sets ``grad_scale`` and ``found_inf`` on this optimizer, see ``hvd_topk._torch``)
        the gradients unscaled first, and the step skipped when this rank's are not finite.

        The scaler would otherwise skip the whole ``step()`` on a rank whose gradients overflowed:
        gradients are not exchanged, so that is one rank only, and its count of steps to the next
        synchronisation would fall behind the others' (which then wait for it in the exchange).
        Skipping only the local step keeps every rank's synchronisations at the same steps."""
        scaled = "found_inf" in self.__dict__
        found_inf, grad_scale = self.__dict__.pop("found_inf", None), self.__dict__.pop("grad_scale", None)
        try:
            if scaled and bool(found_inf.item()):
                return None
            if grad_scale is not None:  # None: the user called scaler.unscale_(opt) already
                inv_scale = grad_scale.double().reciprocal().float()  # as GradScaler.unscale_ does
                for g in self.param_groups:
                    for p in g["params"]:
                        if p.grad is not None:
                            p.grad.mul_(inv_scale.to(p.grad.device))
            return super(self.__class__, self).step(closure)
        finally:
            if scaled:  # the scaler deletes them after step()
                self.__dict__.update(found_inf=found_inf, grad_scale=grad_scale)

    def _synchronise_model(self):
        """The model change through the outer optimizer, then every replica reset to the anchors."""
        local = getattr(self, LOCAL)
        self._check_shared()
        # The shared synchronisation count (the outer warm-up's step) lives in the outer optimizer;
        # kept in this optimizer's param groups too, so that hvd.broadcast_optimizer_state brings
        # a rank that did not take part (a new elastic worker, a rank that loaded nothing) to it.
        getattr(local.outer, ENGINE).step = self.param_groups[0][SYNCS_KEY]
        # and so is the outer exchange="auto"'s trial: a rank that did not load the root's state
        # (a rollback on rank 0, an elastic job's new worker) goes on with the root's
        local.outer.param_groups[0][TRIAL_KEY] = self.param_groups[0].get(OUTER_TRIAL_KEY)
        with torch.no_grad():
            for p, a in zip(local.params, local.anchors):
                if a.grad is None:
                    a.grad = torch.empty_like(a)
                torch.sub(a, p, out=a.grad)  # the pseudo-gradient: how far this rank moved
            local.outer.step()  # Top-K + error feedback, the exchange, SGD on the anchors
            for p, a in zip(local.params, local.anchors):
                p.copy_(a)
        self.param_groups[0][OUTER_TRIAL_KEY] = local.outer.param_groups[0][TRIAL_KEY]

    def synchronize(self):
        """Nothing to wait for: gradients stay on their rank (the model is exchanged in step())."""

    @contextmanager
    def skip_synchronize(self):
        yield

    def state_dict(self):
        """The user's optimizer's state (with the phase in its param groups and, in param group 0,
        what every rank shares: the anchors and the outer SGD's momentum) plus, under
        ``"hvd_topk_local_steps"``, this rank's outer optimizer (its residuals are per rank: save
        one file per rank for a bitwise resume)."""
        local = getattr(self, LOCAL)
        state = super(self.__class__, self).state_dict()
        # At a period's start the model is the shared weights (right after a synchronisation the
        # two are equal): the model, also when it was loaded or set after construction, before
        # any step took the anchors from it (a rank-0 fine-tuning load, then the broadcasts).
        start = self.local_step == 0
        state["param_groups"][0][SHARED_KEY] = {
            "anchors": [(p if start else a).detach().clone() for p, a in zip(local.params, local.anchors)],
            "outer_momentum": [_momentum_buffer(local.outer, a) for a in local.anchors]}
        # (the steps: compression_stats()' dense bytes, as the outer section carries its counts)
        state[STATE_KEY] = {"outer": local.outer.state_dict(), "steps": local.steps}
        return state

    def load_state_dict(self, state_dict):
        """A checkpoint without the local-steps section (a plain optimizer's) starts a new
        period: the anchors are taken from the model at the next ``step()``, and the outer
        optimizer starts afresh (zero residuals, no momentum, no synchronisations). One saved with a
        larger ``sync_every``, further into its period than this one's length, synchronises at
        the next ``step()``. A ``hvd_topk.DistributedOptimizer``'s loads as a plain one, with a
        warning that its residuals are dropped. (Checkpoints written before the anchors moved to
        param group 0 hold them in the local-steps section: read from there.) The outer SGD's
        settings (``outer_lr``, ``outer_momentum``, ``nesterov``) come from the checkpoint, as a
        torch optimizer's param-group options do; ``sync_every`` is this optimizer's.

        Everything is checked before anything is applied: a checkpoint that does not fit (another
        model, the same parameters in another order, a damaged or newer outer section) raises
        ``checkpoint.CheckpointMismatch`` and leaves this optimizer as it was."""
        local = getattr(self, LOCAL)
        state_dict = dict(unshared_for_elastic(state_dict))
        ours = state_dict.pop(STATE_KEY, None)
        if ours is not None and not (isinstance(ours, dict) and isinstance(ours.get("outer"), dict)):
            raise checkpoint.CheckpointMismatch(
                f"the checkpoint's {STATE_KEY!r} entry is not the section hvd_topk.LocalSteps saves (a dict with "
                "the outer optimizer's state under 'outer'). Nothing was loaded.")
        if ours is not None and not checkpoint.is_count(ours.get("steps", 0)):
            raise checkpoint.CheckpointMismatch(f"the checkpoint's {STATE_KEY!r} section has steps={ours['steps']!r}, "
                                                "not a count. Nothing was loaded.")
        # the user's optimizer's state (sizes, shapes; the order where a DistributedOptimizer's section
        # records it), then the outer optimizer's section, then the shared weights
        names = {**dict(zip(local.params, local.names)), **local.frozen}
        checkpoint.check_inner(self.param_groups, names, state_dict)
        outer_loaded = None if ours is None else local.outer._check_loaded(ours["outer"])
        if ours is not None and "anchors" in ours:
            groups = [dict(g) for g in state_dict["param_groups"]]
            groups[0].setdefault(SHARED_KEY, {"anchors": ours["anchors"]})
            state_dict["param_groups"] = groups
        shared = state_dict["param_groups"][0].get(SHARED_KEY) if state_dict.get("param_groups") else None
        if shared is not None:
            section = ours["outer"].get(checkpoint.STATE_KEY) if ours is not None else None
            self._check_shared_shapes(shared, section.get("parameter_order") if isinstance(section, dict) else None)
        if state_dict.pop(checkpoint.STATE_KEY, None) is not None:
            # a hvd_topk.DistributedOptimizer's: its residuals hold unsent gradients (or updates),
            # not model changes, so they cannot seed the outer optimizer's
            warnings.warn("this checkpoint was written by hvd_topk.DistributedOptimizer: its error-feedback "
                          "residuals (unsent gradients) do not carry over to LocalSteps and are dropped; "
                          "the inner optimizer's state is loaded and a new period starts", stacklevel=outside_level())
            state_dict["param_groups"] = [{k: v for k, v in g.items() if k not in (STEP_KEY, TRIAL_KEY)}
                                          for g in state_dict["param_groups"]]
        keep_objects(self, super(self.__class__, self).load_state_dict, state_dict)
        if ours is None:
            self.param_groups[0].pop(SHARED_KEY, None)
            self.param_groups[0][PHASE_KEY] = 0
            self.param_groups[0].setdefault(SYNCS_KEY, 0)
            self.param_groups[0][OUTER_TRIAL_KEY] = None
            self._restart_outer()
            return
        self._adopt_shared()
        local.outer._apply_loaded(*outer_loaded)
        local.steps = ours.get("steps", local.steps)  # (absent: saved before 2026-12-07)
        self.param_groups[0][OUTER_TRIAL_KEY] = None  # the outer optimizer measures again, as after any load

    def _restart_outer(self):
        """After loading a checkpoint without an outer optimizer (a plain one's, or a
        ``DistributedOptimizer``'s): the outer optimizer as built, its residuals zero and no
        momentum, so that the run goes on as a fresh ``LocalSteps`` loaded with it would (the
        residuals and momentum of the run before the load belong to another model change)."""
        outer = getattr(self, LOCAL).outer
        fresh = super(type(outer), outer).state_dict()  # the outer SGD's own: no hvd_topk section,
        fresh["state"] = {}                             # so the engine's residuals start from zero
        # and no step counter, which would read as a checkpoint of ours gone through a plain optimizer
        fresh["param_groups"] = [{k: v for k, v in g.items() if k != STEP_KEY} for g in fresh["param_groups"]]
        outer.load_state_dict(fresh)

    def _check_shared_shapes(self, shared, saved_names=None):
        """``checkpoint.CheckpointMismatch`` naming the first anchor whose saved shape differs, or,
        given the names they were saved under (the outer optimizer's ``parameter_order``), the
        parameters saved in another order: anchors are matched by position (nothing changed yet)."""
        local = getattr(self, LOCAL)
        anchors = shared["anchors"]
        if len(anchors) != len(local.anchors):
            raise checkpoint.CheckpointMismatch(
                f"the checkpoint's local-steps anchors do not match this optimizer's parameters "
                f"({len(anchors)} saved, {len(local.anchors)} here). " + checkpoint.MISMATCH_HINT)
        for name, saved, here in zip(local.names, anchors, local.anchors):
            if tuple(saved.shape) != tuple(here.shape):
                raise checkpoint.CheckpointMismatch(
                    f"the checkpoint's local-steps anchors do not match this optimizer's parameters: {name} was "
                    f"saved with shape {tuple(saved.shape)}, here it is {tuple(here.shape)}. " + checkpoint.MISMATCH_HINT)
        moved = checkpoint.reordered(saved_names, local.names) if isinstance(saved_names, list) else []
        if moved:
            raise checkpoint.reorder_mismatch(moved, "the shared weights and the optimizer's state are matched by "
                                                     "position, so each would get another's")

    def _adopt_shared(self):
        """Copy shared state set on param group 0 (by ``hvd.broadcast_optimizer_state`` or
        ``load_state_dict``) into the anchors and the outer momentum, and take it off the group.
        Returns whether there was any."""
        shared = self.param_groups[0].pop(SHARED_KEY, None)
        if shared is None:
            return False
        local = getattr(self, LOCAL)
        self._check_shared_shapes(shared)
        # (None in the list: the root has no momentum for it, a fresh or restarted outer SGD; a
        # checkpoint written before the momentum was shared has no list: keep what is here)
        momenta = shared.get("outer_momentum")
        with torch.no_grad():
            for i, (a, saved) in enumerate(zip(local.anchors, shared["anchors"])):
                a.copy_(saved)
                momentum = None if momenta is None else momenta[i]
                if momentum is not None:
                    local.outer.state[a]["momentum_buffer"] = momentum.to(a.device, a.dtype, copy=True)
                elif momenta is not None and a in local.outer.state:
                    local.outer.state[a].pop("momentum_buffer", None)
        return True

    def _check_shared(self):
        """Before a synchronisation: every rank at the same synchronisation count with the same
        anchors (a float64 checksum) and settings (``sync_every``, the outer SGD's), or a
        RuntimeError saying how they came apart. A cheap
        allgather every ``sync_every`` steps. A rank inside ``hvd.join()`` answers allreduces but not
        allgathers (horovod#3471): a count of the active ranks first, and no check while one has
        joined (the broadcasts after ``hvd.join()`` bring the ranks together again)."""
        local = getattr(self, LOCAL)
        engine = getattr(local.outer, ENGINE)  # its name and process set name this check's collectives
        if not engine.member:  # outside the process set: nothing to agree on, its model stays its own
            return
        # the set's size now (engine.world is as of the outer's last step; an elastic job may have
        # changed it since)
        size = process_set_size(engine.process_set)
        active = hvd.allreduce(torch.ones(1), name=f"{engine.prefix}.local_steps_active", op=hvd.Sum,
                               process_set=engine.process_set)
        if int(active.item()) < size:
            return
        with torch.no_grad():  # summed in float64 where they lie (no float64 copy), read once
            checksum = float(torch.stack([a.sum(dtype=torch.float64) for a in local.anchors]).sum()) \
                if local.anchors else 0.0
        outer = local.outer.param_groups[0]
        settings = agreement.digest((local.sync_every, outer["lr"], outer["momentum"], outer["nesterov"])) % 2 ** 50
        inner = agreement.digest(agreement.group_options(self.param_groups, leave_out="hvd_topk_")) % 2 ** 50
        stateful = self._has_state()
        which = agreement.digest(tuple(stateful)) % 2 ** 50  # which parameters have optimizer state here
        mine = torch.tensor([[self.param_groups[0][SYNCS_KEY], self.local_step, checksum, settings, which, inner]],
                            dtype=torch.float64)  # (a 50-bit digest is exact in float64)
        rows = hvd.allgather(mine, name=f"{engine.prefix}.local_steps_agree", process_set=engine.process_set)
        if not bool((rows[:, 5] == rows[0, 5]).all()):  # (every rank sees the same rows: all raise)
            raise RuntimeError(
                f"hvd_topk.LocalSteps: the optimizer it wraps has other settings on ranks "
                f"{[r for r, h in enumerate(rows[:, 5].tolist()) if h != rows[0, 5]]} than on rank 0 (a param "
                "group's lr, betas, weight_decay, ... or the number of groups): each rank would take its local "
                "steps differently and the average of their changes would be no rank's. Build it the same on "
                "every rank (and step any LR scheduler on every rank alike)")
        if not bool((rows[:, 4] == rows[0, 4]).all()):
            self._fill_state(stateful, engine)
        rows = rows[:, :4]
        if not bool(rows[:, 2].isfinite().all()):  # (NaN != NaN: the comparison below would blame the ranks)
            raise RuntimeError(
                "hvd_topk.LocalSteps: the shared weights are not finite (inf or NaN) on ranks "
                f"{[r for r, ok in enumerate(rows[:, 2].isfinite().tolist()) if not ok]}: a non-finite "
                "model change was exchanged (a diverged step, too high a learning rate, or a NaN in the data). "
                "Restore the last good checkpoint on every rank.")
        if not bool((rows[:, 3] == rows[0, 3]).all()):
            raise RuntimeError("hvd_topk.LocalSteps: the ranks were built with different settings (sync_every, "
                               "outer_lr, outer_momentum or nesterov; ranks "
                               f"{[r for r, h in enumerate(rows[:, 3].tolist()) if h != rows[0, 3]]} differ from "
                               "rank 0): build it the same on every rank")
        if not bool((rows == rows[0]).all()):
            rows = rows[:, :3]
            raise RuntimeError(
                "hvd_topk.LocalSteps: the ranks hold different shared weights or are at different points of "
                f"their period (synchronisations, step in the period, anchor checksum per rank: {rows.tolist()}). "
                "Load a checkpoint on every rank (or hvd.broadcast_optimizer_state it from one: that carries "
                "the shared weights, except for an inner optimizer without state, such as SGD without "
                "momentum, for which Horovod broadcasts nothing), and broadcast the model with it.")

    def _has_state(self):
        """For each trained parameter, whether the user's optimizer holds state for it here."""
        local = getattr(self, LOCAL)
        return [bool(self.state.get(p)) for p in local.params]

    def _fill_state(self, stateful, engine):
        """Give the user's optimizer state for every parameter some rank has state for.

        Gradients stay on their rank, so a parameter this rank never used (a head, a branch)
        has no state here while others have: ``hvd.broadcast_optimizer_state`` (after
        ``hvd.join()``, from a rank-0 checkpoint, ``hvd.elastic``'s ``sync()``) would then pair
        different tensors on different ranks and hang. The state is made as Horovod makes a fresh
        optimizer's: one step with zero gradients, for those parameters only and without weight
        decay (which would fill SGD's momentum or Adam's moments with it), their values then put
        back, and a step counter it made set back to 0: unlike Horovod's, this state is not
        always overwritten by a broadcast, and it must be a fresh one (Adam's first update at
        its own bias correction, not the second's)."""
        local = getattr(self, LOCAL)
        flags = hvd.allgather(torch.tensor([stateful], dtype=torch.uint8), name=f"{engine.prefix}.local_steps_state",
                              process_set=engine.process_set)
        missing = [p for p, anywhere, here in zip(local.params, flags.any(0).tolist(), stateful) if anywhere and not here]
        if not missing:
            return
        grads = [(p, p.grad) for g in self.param_groups for p in g["params"]]
        values = [p.detach().clone() for p in missing]
        scaling = {k: self.__dict__.pop(k) for k in ("found_inf", "grad_scale") if k in self.__dict__}  # (_local_step)
        decays = [(g, g["weight_decay"]) for g in self.param_groups if "weight_decay" in g]
        try:
            for p, _ in grads:
                p.grad = None
            for p in missing:
                p.grad = torch.zeros_like(p)
            for g, _ in decays:
                g["weight_decay"] = 0.0
            super(self.__class__, self).step()
        finally:
            for g, decay in decays:
                g["weight_decay"] = decay
            with torch.no_grad():
                for p, v in zip(missing, values):
                    p.copy_(v)
                    step = self.state[p].get("step")
                    if torch.is_tensor(step):
                        step.zero_()
                    elif step is not None:
                        self.state[p]["step"] = type(step)(0)
            for p, g in grads:
                p.grad = g
            self.__dict__.update(scaling)

    def compression_stats(self, reset=False):
        """The outer optimizer's statistics, with bytes compared to a dense allreduce at every
        step: ``steps`` (this rank's over the run: since construction or the last reset, or as
        a loaded checkpoint carried them), ``syncs``, ``bytes_dense`` and ``bytes_ratio`` over
        steps."""
        local = getattr(self, LOCAL)
        out = local.outer.compression_stats(reset=reset)
        syncs, steps = out["steps"], local.steps
        # a dense allreduce of every trained parameter in fp32 a step (as the outer optimizer
        # counts it), also before the first synchronisation
        per_step = DENSE_FP32_BYTES * sum(a.numel() for a in local.anchors)
        out.update(syncs=syncs, steps=steps, bytes_dense=per_step * steps)
        out["bytes_ratio"] = out["bytes_sent"] / out["bytes_dense"] if out["bytes_dense"] else 0.0
        if reset:
            local.steps = 0
        return out


# torch.amp.GradScaler.step(opt) then hands this optimizer the scale and this rank's overflow flag
# instead of skipping step() (see _LocalSteps._local_step). A fused inner optimizer sets its own
# value in its __init__; LocalSteps unscales for it, so that value is not needed (setting ignored).
setattr(_LocalSteps, AMP_SCALING_ATTRIBUTE, property(lambda self: True, lambda self, value: None))
