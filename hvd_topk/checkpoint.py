"""The optimizer's checkpoint section: this rank's error-feedback state in and out.

``state_dict()`` of ``hvd_topk.DistributedOptimizer`` is the inner optimizer's plus, under
``"hvd_topk"``, what ``save`` returns: each parameter's residual (and DGC momentum) by name,
the step counter and the rank and world size it belongs to. Residuals are per rank: a rank
that loads another rank's section (or one saved by another world size) starts from zero
residuals, with a warning. Names are matched exactly, or after dropping ``torch.compile``'s
``_orig_mod.`` components and DDP's leading ``module.`` (``plain_name``), so a checkpoint of the
plain model loads into a compiled or wrapped one.

Loading is all or nothing: ``check_inner`` and ``check`` read the whole checkpoint (the inner
optimizer's per-parameter state and this section) against the optimizer before anything is
applied, and raise one ``CheckpointMismatch`` naming the parameter, both shapes and the likely
cause, so that a failed load leaves the optimizer exactly as it was (torch's own
``load_state_dict`` replaces the inner state first and fails later, at a copy or at the next
step). Docs: docs/compatibility.md#checkpoints.
"""

import collections
import itertools
import numbers
import warnings
import weakref

import torch

from hvd_topk.loss_scale import is_loss_scale
from hvd_topk.stats import CompressionStats

STATE_KEY = "hvd_topk"  # the optimizer state_dict's entry holding this section
LOCAL_STEPS_KEY = "hvd_topk_local_steps"  # hvd_topk.LocalSteps' section (its outer optimizer)
LOCAL_SHARED_KEY = "hvd_topk_local_shared"  # LocalSteps' param group 0: the shared weights (anchors)
LOCAL_KEY_PREFIX = "hvd_topk_local_"  # every LocalSteps param-group entry (local_steps.py)
STATE_FORMAT = 3  # 3: "residual_scale" always present (format 2 has it only from 5809ec8, 2026-12-04)
COMPILED_MODULE = "_orig_mod"  # the attribute torch.compile's OptimizedModule keeps the model in
WRAPPER_MODULE = "module"      # the attribute DistributedDataParallel (and DataParallel) keeps it in


# Inner-optimizer state entries that hold one value per parameter element (torch's built-in
# optimizers and hvd_topk.optim); their shape must be the parameter's.
PER_ELEMENT_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg",
                     "grad_avg", "acc_delta", "ax", "prev", "step_size", "grad_mean",
                     "grad_lag1", "grad_prev")
REQUIRED = ("format", "step", "rank", "size")
LOCAL_STEPS_CONVERSION = (
    "To go on with hvd_topk.DistributedOptimizer instead, copy the shared weights (state_dict['param_groups'][0]"
    f"[{LOCAL_SHARED_KEY!r}]['anchors'], in the order of the parameters) into the model, then delete "
    f"state_dict[{LOCAL_STEPS_KEY!r}] and every param-group entry whose name starts with {LOCAL_KEY_PREFIX!r}, "
    "load the rest and hvd.broadcast_optimizer_state(opt, root_rank=0) (each rank's inner optimizer ran alone).")
MISMATCH_HINT = ("Was the checkpoint saved from another model (a layer resized, parameters "
                 "reordered)? Load a checkpoint saved with this model, or leave the optimizer's "
                 "state out of what you load to start it fresh. Nothing was loaded.")


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit this optimizer; nothing of it was applied."""


def check_inner(param_groups, names, state_dict):
    """The inner optimizer's part of ``state_dict`` against ``param_groups``: the same groups
    and sizes (as torch checks), and every per-element state tensor shaped like its parameter."""
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state", {}), dict):
        raise CheckpointMismatch("this is not an optimizer state_dict (a dict with 'state' and "
                                 f"'param_groups'): got {type(state_dict).__name__}. Nothing was loaded.")
    if LOCAL_STEPS_KEY in state_dict:
        # Its model is a per-rank replica and param group 0 carries the shared weights (anchors),
        # which this optimizer would keep, stale, in its param groups and write into its own checkpoints.
        raise CheckpointMismatch("this checkpoint was written by hvd_topk.LocalSteps: load it into a LocalSteps "
                                 "optimizer. " + LOCAL_STEPS_CONVERSION + " Nothing was loaded.")
    sizes, saved_sizes = [len(g["params"]) for g in param_groups], [len(g.get("params", ())) for g in saved_groups]
    if sizes != saved_sizes:
        raise CheckpointMismatch(f"the checkpoint's parameter groups hold {saved_sizes} parameters, this "
                                 f"optimizer's {sizes}. " + MISMATCH_HINT)
    _check_order(param_groups, names, state_dict)
    saved_ids = itertools.chain.from_iterable(g["params"] for g in saved_groups)
    params = itertools.chain.from_iterable(g["params"] for g in param_groups)
    for saved_id, p in zip(saved_ids, params):
        for key, value in state_dict.get("state", {}).get(saved_id, {}).items():
            if key in PER_ELEMENT_STATE and torch.is_tensor(value) and value.dim() > 0 \
                    and value.shape != p.shape:
                raise CheckpointMismatch(
                    f"parameter {names.get(p, '(unnamed)')!r}: the checkpoint's optimizer state "
                    f"{key!r} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}. " + MISMATCH_HINT)


def drop_local_steps_state(param_groups):
    """Remove ``hvd_topk.LocalSteps``' param-group entries (its phase, synchronisation count,
    ``exchange="auto"`` trial, shared weights) from ``param_groups``, where a LocalSteps
    checkpoint loaded into a plain optimizer, or an earlier LocalSteps over it, left them.
    Returns whether there were any."""
    found = False
    for group in param_groups:
        for key in [k for k in group if k.startswith(LOCAL_KEY_PREFIX)]:
            del group[key]
            found = True
    return found


def fill_options(saved_groups, built_groups, options):
    """A plain torch optimizer's checkpoint (no hvd_topk section: another optimizer's, as when a
    dense AdamW run moves to ``LocalAdamW``) has no error-feedback residuals whose units an
    option must match, so the ``options`` its param groups lack take the values this optimizer
    was built with (``built_groups``), rather than the inner optimizer's "trained without it"
    (``LOADED_WITHOUT``). Returns the groups to load and the options taken, in order."""
    if not isinstance(saved_groups, list) or len(saved_groups) != len(built_groups) or \
            not all(isinstance(g, dict) for g in saved_groups):
        return saved_groups, []  # torch's load_state_dict says what is wrong
    taken, filled = [], []
    for saved, built in zip(saved_groups, built_groups):
        missing = [k for k in options if k not in saved and k in built]
        taken += [k for k in missing if k not in taken]
        filled.append({**{k: built[k] for k in missing}, **saved})
    return filled, taken


def parameter_order(param_groups, names):
    """The parameters' names in the order of the optimizer's param groups: the order torch's
    ``load_state_dict`` matches the inner optimizer's state by (position, not name)."""
    return [names.get(p) for g in param_groups for p in g["params"]]


def _check_order(param_groups, names, state_dict):
    """Same-shaped parameters defined in another order (q, k and v projections swapped) pass
    torch's checks, and its load would give each the other's optimizer state (moments) while the
    residuals, matched by name, go where they belong: refused where a moved parameter has saved
    state. Only where both orders are known and name the same parameters (a checkpoint without
    the record, or saved with other names, is matched by position as torch does)."""
    section = state_dict.get(STATE_KEY)
    saved = section.get("parameter_order") if isinstance(section, dict) else None
    if not isinstance(saved, list):
        return
    saved_ids = list(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
    states = state_dict.get("state", {})
    moved = [(i, n, j) for i, n, j in reordered(saved, parameter_order(param_groups, names))
             if i < len(saved_ids) and states.get(saved_ids[i])]
    if moved:  # (none where no per-parameter state would go astray: SGD without momentum, say)
        raise reorder_mismatch(moved, "torch matches the inner optimizer's state by position, so each would get "
                                      "another's moments")


def reordered(saved, here):
    """``[(position saved, name, position here)]`` of the parameters that moved, where the names
    ``saved`` and ``here`` (in order; ``torch.compile``'s prefix ignored) are the same parameters
    in another order; ``[]`` where the order is the same or the names differ (a checkpoint saved
    with other names is matched by position, as torch does)."""
    saved_plain, here_plain = [plain_name(n) if isinstance(n, str) else n for n in saved], \
        [plain_name(n) if isinstance(n, str) else n for n in here]
    if saved_plain == here_plain or sorted(map(str, saved_plain)) != sorted(map(str, here_plain)):
        return []
    return [(i, n, here_plain.index(n)) for i, n in enumerate(saved_plain) if here_plain[i] != n]


def reorder_mismatch(moved, consequence):
    """The ``CheckpointMismatch`` for parameters saved in another order (``reordered``'s list)."""
    return CheckpointMismatch(
        "the checkpoint's parameters are the same but in another order ("
        + "; ".join(f"{n!r} saved at position {i}, here at {j}" for i, n, j in moved[:3])
        + f"): {consequence}. Build the optimizer with the parameters in the order they were saved in. "
        "Nothing was loaded.")


def is_count(value, none_ok=False):
    """Whether a checkpoint's ``value`` is a count (an integer >= 0, not a bool), or None where
    ``none_ok`` (a rank saved outside any process group)."""
    if value is None:
        return none_ok
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 0


def stats_problem(counts):
    """Why a checkpoint's statistics (``CompressionStats.carried``'s output) cannot be taken over,
    or None. Names this version does not count (a later version's) are not checked: ``carry``
    leaves them out."""
    if not isinstance(counts, dict):
        return f"is not a dict of counts (got {type(counts).__name__})"
    bad = [k for k, v in CompressionStats.known(counts).items() if not is_count(v)]
    return f"holds {bad[:3]}, not counts" if bad else None


def check(engine, state):
    """This section against the engine, before anything is applied: raises
    ``CheckpointMismatch`` for what cannot be loaded, returns the names of residuals that hold
    inf/nan (``load`` starts those from zero, with a warning)."""
    if state is None:
        return []
    if not isinstance(state, dict):
        raise CheckpointMismatch(f"the checkpoint's {STATE_KEY!r} entry is a {type(state).__name__}, not "
                                 "the section hvd_topk.DistributedOptimizer saves. Nothing was loaded.")
    if is_count(state.get("format")) and state["format"] > STATE_FORMAT:  # first: its other fields may differ
        raise CheckpointMismatch(f"the checkpoint's {STATE_KEY!r} section has format {state['format']}, "
                                 f"newer than this hvd_topk's ({STATE_FORMAT}): upgrade hvd_topk to load it. "
                                 "Nothing was loaded.")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise CheckpointMismatch(f"the checkpoint's {STATE_KEY!r} section lacks {missing} (truncated, or "
                                 "written by something else). Nothing was loaded.")
    for key in ("step", "rank", "size", "format"):
        if not is_count(state[key], none_ok=key == "rank"):
            raise CheckpointMismatch(f"the checkpoint's {STATE_KEY!r} section has {key}={state[key]!r}, not a "
                                     "count. Nothing was loaded.")
    scale = state.get("residual_scale")
    if not is_loss_scale(scale):
        raise CheckpointMismatch(f"the checkpoint's {STATE_KEY!r} section has residual_scale={scale!r}, not a "
                                 "loss scale (a finite number > 0, or None). Nothing was loaded.")
    wrong = stats_problem(state["stats"]) if "stats" in state else None
    if wrong:
        raise CheckpointMismatch(f"the checkpoint's {STATE_KEY!r} section's 'stats' {wrong}. Nothing was loaded.")
    nonfinite = []
    for kind, buckets in (("residuals", residual_buckets(engine)), ("momenta", momentum_buckets(engine))):
        members = {m.name: m for b in buckets for m in b.members}
        saved = state.get(kind, {})
        if not isinstance(saved, dict) or not all(torch.is_tensor(t) for t in saved.values()):
            raise CheckpointMismatch(f"the checkpoint's {STATE_KEY!r} section: {kind!r} is not a dict of "
                                     "tensors by parameter name. Nothing was loaded.")
        matched, _ = match_names(saved, list(members))
        for name, tensor in matched.items():
            shape = members[name].param.shape
            if tensor.shape != shape:
                raise CheckpointMismatch(
                    f"parameter {name!r}: the checkpoint's error-feedback {kind[:-1]} has shape "
                    f"{tuple(tensor.shape)}, the parameter {tuple(shape)}. " + MISMATCH_HINT)
            if not tensor.is_floating_point():
                raise CheckpointMismatch(f"parameter {name!r}: the checkpoint's {kind[:-1]} is {tensor.dtype}, "
                                         "not floating point. Nothing was loaded.")
            if not bool(torch.isfinite(tensor).all()):
                nonfinite.append(name)
    return nonfinite + _check_hierarchical(engine, state)


def _check_hierarchical(engine, state):
    """Shards and full buffers of a hierarchical job: sized as this job's, where they load.
    Returns the labels (``bucket_label``) of those holding inf/nan."""
    if engine.hier is None or state.get("hierarchy") != hierarchy_key(engine):
        return []
    nonfinite = []
    for b in residual_buckets(engine):
        lo, hi = engine.planner.shard(b)
        for kind, want in (("shards", hi - lo), ("flat_buffers", b.numel)):
            tensor = state.get(kind, {}).get(str(b.index))
            if tensor is not None and (not torch.is_tensor(tensor) or tensor.numel() != want):
                raise CheckpointMismatch(f"bucket {b.index}: the checkpoint's {kind} entry does not hold "
                                         f"{want} elements. " + MISMATCH_HINT)
            if tensor is not None and not bool(torch.isfinite(tensor).all()):
                nonfinite.append(bucket_label(kind, b.index))
    return nonfinite


def bucket_label(kind, index):
    """How a hierarchical job's residual of bucket ``index`` is named in ``check``'s list."""
    return f"bucket {index} ({kind})"


def residual_buckets(engine):
    """The buckets whose buffers carry residuals across steps (none without error feedback)."""
    return [b for b in engine.buckets if b.sparse] if engine.options.error_feedback else []


def momentum_buckets(engine):
    """The buckets whose buffers carry residuals or DGC momentum across steps: with
    ``momentum_correction`` every bucket (the dense one's momentum too), else the residual ones."""
    return list(engine.buckets) if engine.options.momentum_correction else residual_buckets(engine)


def hierarchy_key(engine):
    """Where hierarchical residuals belong: this rank's place and the buckets' sizes."""
    t = engine.hier
    return None if t is None else [t.local_rank, t.local_size, t.cross_rank, t.cross_size,
                                   [b.numel for b in engine.buckets]]


# The fingerprints of the last few states each engine saved (``own_state``).
_SAVED = weakref.WeakKeyDictionary()


def _fingerprint(state):
    """A state's step and the tensors it holds (residuals, momenta, hierarchical shards: each
    one's sum and sum of magnitudes, in float64), not its place (an elastic commit's size is the
    one before the job changed): another rank's state differs in them (where all are zero,
    loading them is starting from zero). Nothing is added to the state, so the same run saves
    the same bits."""
    def sums(t):  # over the finite entries, and how many are not (nan != nan: a sum holding one
        finite = torch.isfinite(t)  # would never match itself)
        t = t.masked_fill(~finite, 0)
        return (float(torch.sum(t, dtype=torch.float64)), float(torch.linalg.vector_norm(t, 1, dtype=torch.float64)),
                int((~finite).sum()))

    return state["step"], tuple((kind, name, *sums(t)) for kind in ("residuals", "momenta", "shards", "flat_buffers")
                                if isinstance(state.get(kind), dict)
                                for name, t in sorted(state[kind].items()) if torch.is_tensor(t) and t.is_floating_point())


def own_state(engine, state):
    """Whether ``state`` is one of the last few this engine saved. A Horovod elastic worker
    restores its own last commit, which can carry another size or rank than the job has now
    (``commit()`` saves, then raises ``HostsUpdatedInterrupt``; survivors may be renumbered):
    its residuals are still this worker's unsent work, and fit any size."""
    saved = _SAVED.get(engine)
    return bool(saved) and isinstance(state.get("residuals"), dict) and _fingerprint(state) in saved


def save(engine):
    """This rank's residuals and momentum buffers (per parameter name), the step counter, and
    the rank/world size they belong to. With the hierarchical exchange: per bucket, this rank's
    shard residual, or its full buffer after flat steps. ``"stats"``: the statistics' counts
    (``CompressionStats.carried``; from 2026-12-07), which ``load`` takes over."""
    out = {"format": STATE_FORMAT, "step": engine.step, "rank": engine.rank, "size": engine.world,
           "residuals": {}, "momenta": {}, "residual_scale": engine.residual_scale.scale,
           "parameter_order": parameter_order(engine.param_groups, engine.names),
           "stats": engine.stats.carried()}
    buckets = residual_buckets(engine)
    if engine.hier is not None:
        out["shards"] = {str(b.index): b.shard.clone() for b in buckets
                         if b.mode == "hier" and b.shard is not None}
        out["flat_buffers"] = {str(b.index): b.acc.clone() for b in buckets
                               if b.mode == "flat" and b.acc is not None}
        out["hierarchy"] = hierarchy_key(engine)
    else:
        for b in buckets:
            for m in b.members:
                if b.acc is not None:
                    out["residuals"][m.name] = b.view(b.acc, m).clone()
        for b in momentum_buckets(engine):
            for m in b.members:
                if b.momentum is not None:
                    out["momenta"][m.name] = b.view(b.momentum, m).clone()
    _SAVED.setdefault(engine, collections.deque(maxlen=4)).append(_fingerprint(out))
    return out


def load(engine, state, nonfinite=()):
    """Put ``save``'s output, checked by ``check``, back into the engine's buckets (the step
    counter is the caller's). ``state`` None (a plain torch optimizer's state_dict): residuals
    start from zero. ``nonfinite``: names whose residual held inf/nan, started from zero. The
    statistics' counts are taken over on every rank (they are the run's history, not unsent
    work: ``compression_stats()`` then covers the whole run); a section written before they were
    saved leaves them as they are."""
    if state is None:
        for b in momentum_buckets(engine):
            for flat in b.residuals():
                flat.zero_()
        return
    if "stats" in state:
        engine.stats.carry(state["stats"])
    _load_residuals(engine, state, nonfinite)
    if "residual_scale" in state:
        # in the units of the loss scale they were saved in (None: true units), whatever the set-up now
        engine.residual_scale.adopt(state["residual_scale"], momentum_buckets(engine))
    else:  # written before the scale was saved: taken as in the scale of the next step, as then
        engine.residual_scale.scale = None
        scaler = engine.residual_scale.scaler
        if scaler is not None and scaler.is_enabled() and any(
                bool(flat.any()) for b in momentum_buckets(engine) for flat in b.residuals()):
            warnings.warn("hvd_topk: this checkpoint predates the record of its loss scale (format "
                          f"{state.get('format')}): its error-feedback residuals are taken to be in the "
                          "GradScaler's scale of the next step, which holds if it was saved with this same "
                          "scaler (its state loaded too); saved without a scaler, they are 1/scale too small. "
                          "A checkpoint written now records the scale.")


def _load_residuals(engine, state, nonfinite):
    """``load``'s work on the buckets, residuals left in the saved loss scale's units."""
    # this rank's residuals: saved at this rank and size, or by this very engine (an elastic
    # worker restoring its own commit after the job resized or renumbered: its own unsent work)
    same_rank = (state["rank"], state["size"]) == (engine.rank, engine.world) or own_state(engine, state)
    buckets = residual_buckets(engine)
    if engine.hier is not None or state.get("hierarchy") is not None:
        _load_shards(engine, state, same_rank, nonfinite)
        return
    if not same_rank:
        for b in momentum_buckets(engine):
            b.clear()
        if engine.options.error_feedback:
            advice = ("Save and load one state per rank to resume exactly." if state["size"] == engine.world else
                      "The job's size changed, so no rank's residuals fit (each holds that rank's unsent work); "
                      "with DeMo the momentum, which lives in them, starts afresh too.")
            warnings.warn(f"hvd_topk: this state was saved by rank {state['rank']} of {state['size']} "
                          f"and is loaded on rank {engine.rank} of {engine.world}: error-feedback "
                          f"residuals start from zero. {advice}")
        return
    with_momentum = momentum_buckets(engine)
    residuals, dropped = match_names(state.get("residuals", {}), [m.name for b in buckets for m in b.members])
    # a momentum saved with momentum_correction means nothing without it: not loaded, not warned of
    saved_momenta = state.get("momenta", {}) if engine.options.momentum_correction else {}
    momenta, dropped_momenta = match_names(saved_momenta, [m.name for b in with_momentum for m in b.members])
    warn_dropped(dropped + [n for n in dropped_momenta if n not in dropped])
    if nonfinite:
        warnings.warn(f"hvd_topk: the checkpoint's error-feedback state of {sorted(set(nonfinite))} held "
                      "inf/nan (saved after an overflow?): those residuals start from zero.")
        residuals = {n: t for n, t in residuals.items() if n not in nonfinite}
        momenta = {n: t for n, t in momenta.items() if n not in nonfinite}
    for b in buckets:
        if residuals or b.acc is not None:
            _restore(b, b.buffer(), residuals)
    for b in with_momentum:
        if momenta or b.momentum is not None:
            _restore(b, b.momentum_buffer(), momenta)


def _load_shards(engine, state, same_rank, nonfinite=()):
    """Hierarchical residuals come back only into the same place of the same job shape
    (rank, hosts, ranks per host, buckets); anywhere else they start from zero, as do those
    holding inf/nan (``nonfinite``, with a warning)."""
    exact = same_rank and state.get("hierarchy") == hierarchy_key(engine)
    shards = state.get("shards", {}) if exact else {}
    flat = state.get("flat_buffers", {}) if exact else {}
    if exact and nonfinite:
        warnings.warn(f"hvd_topk: the checkpoint's error-feedback state of {sorted(set(nonfinite))} held "
                      "inf/nan (saved after an overflow?): those residuals start from zero.")
        shards = {k: t for k, t in shards.items() if bucket_label("shards", k) not in nonfinite}
        flat = {k: t for k, t in flat.items() if bucket_label("flat_buffers", k) not in nonfinite}
    for b in residual_buckets(engine):
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
    if not exact and engine.options.error_feedback:
        warnings.warn("hvd_topk: this state was saved at another place in the job or with another "
                      f"exchange layout (rank {state['rank']} of {state['size']}, hierarchy "
                      f"{state.get('hierarchy')}; here rank {engine.rank} of {engine.world}, hierarchy "
                      f"{hierarchy_key(engine)}): error-feedback residuals start from zero.")


def _restore(bucket, flat, saved):
    """Copy each member's saved tensor into its part of ``flat``; zeros where none was saved."""
    for m in bucket.members:
        view = bucket.view(flat, m)
        if m.name in saved:
            view.copy_(saved[m.name])
        else:
            view.zero_()


def plain_name(name):
    """``name`` without ``torch.compile``'s ``_orig_mod`` components and without the leading
    ``module.`` that wrapping in ``DistributedDataParallel`` adds: a compiled model's
    ``_orig_mod.fc.weight`` (or ``block._orig_mod.fc.weight``) and ``ddp_model.named_parameters()``'s
    ``module.fc.weight`` are the plain model's ``fc.weight``."""
    parts = name.split(".")
    while len(parts) > 1 and parts[0] in (WRAPPER_MODULE, COMPILED_MODULE):
        parts = parts[1:]
    return ".".join(part for part in parts if part != COMPILED_MODULE)


def match_names(saved, ours):
    """``saved`` re-keyed by the names in ``ours`` (exact name first, else equal once the
    wrappers' prefixes are removed, ``plain_name``), and the saved names that matched none."""
    by_plain = {plain_name(n): n for n in ours}
    ours = set(ours)
    matched, dropped = {}, []
    for name, tensor in saved.items():
        target = name if name in ours else by_plain.get(plain_name(name))
        if target is None:
            dropped.append(name)
        else:
            matched[target] = tensor
    return matched, dropped


def warn_dropped(names, shown=5, owner="this optimizer"):
    """One warning per load for saved residuals that belong to no parameter here."""
    if not names:
        return
    listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
    warnings.warn(f"hvd_topk: {len(names)} saved error-feedback residual(s) match no parameter that "
                  f"{owner} exchanges with error feedback and were dropped: {listed}. Were "
                  "they saved from a different model, or with other named_parameters, min_numel or "
                  "error_feedback? (torch.compile's '_orig_mod.' and DistributedDataParallel's leading 'module.' "
                  "are mapped automatically.)")
