"""The DDP hook's checkpoint: ``TopKState.state_dict()`` and ``load_state_dict()``.

What a ``TopKState`` saves is this rank's residuals by parameter name (which needs
``named_parameters=``), the step, the rank, world size and process group's global ranks it
belongs to, the loss scale the residuals are in, and the statistics' counts (from 2026-12-07;
taken over at the load, so that ``stats()`` covers the whole run, the dense start included).
Residuals are per rank: a state saved by another rank, world size or process group (another
replica's DDP) keeps the step and the statistics and restarts the residuals from zero, with a
warning. Loading is all or nothing: the whole checkpoint is
checked before anything is applied. The Horovod optimizer's section is ``hvd_topk.checkpoint``,
whose name matching (``match_names``: ``torch.compile``'s ``_orig_mod.``) and warnings this
shares.
"""

import warnings

import torch
import torch.distributed as dist

from hvd_topk import checkpoint
from hvd_topk._stack import outside_level
from hvd_topk._torch import still_written
from hvd_topk.ddp_checks import OPTIMIZER_STEPS, group_members, group_rank_and_size
from hvd_topk.loss_scale import is_loss_scale

STATE_VERSION = 1


def save(state):
    """``state.state_dict()``: see ``TopKState.state_dict``."""
    if state.names is None:
        raise ValueError("TopKState.state_dict() needs parameter names: build the state with "
                         "named_parameters=model.named_parameters()")
    if state.exchanged_at and OPTIMIZER_STEPS[0] == state.steps_at_exchange \
            and all(still_written(record, record[0]()) for record in state.exchanged_at):
        warnings.warn("TopKState.state_dict() was called after this step's backward and before optimizer.step(): "
                      "this rank's unsent gradient of the step is already in the residuals, so a run resumed from "
                      "this checkpoint, which does the step again, counts it twice. Save after optimizer.step(). "
                      "(No torch optimizer has stepped and no parameter has changed since the step's exchange; if "
                      "your own update writes parameters through .data, or a GradScaler skipped the step, the "
                      "checkpoint is fine.)", stacklevel=outside_level())
    # (copies: a loss-scale change rescales the pending ones in place before they are placed)
    residuals = {name: t.detach().clone() for name, t in state.pending.items()}
    for layout in state.layouts.values():
        for p, residual in layout.residuals_by_element():
            residuals[state.names[p]] = residual.detach().clone(memory_format=torch.contiguous_format).view(-1)
    rank, world = (state.rank, state.world_size) if state.rank is not None or not dist.is_initialized() \
        else group_rank_and_size(state.process_group)  # before the first step
    members = group_members(state.process_group) if dist.is_initialized() else None
    return {"version": STATE_VERSION, "iteration": state.iteration, "rank": rank,
            "world_size": world, "group_ranks": members, "density": state.density, "residuals": residuals,
            "residual_scale": state.residual_scale.scale, "stats": state._stats.carried(),
            "buckets_by_exchange": dict(state._by_strategy)}


def _checked(state, saved):
    """``saved``'s residuals by this model's parameter names, once the whole checkpoint has been
    checked against ``state`` (a ValueError naming what does not fit, before anything changes);
    residuals that hold inf/nan are left out, with a warning."""
    version = saved.get("version") if isinstance(saved, dict) else None
    if checkpoint.is_count(version) and version > STATE_VERSION:
        raise ValueError(f"this TopKState checkpoint has version {version}, newer than this hvd_topk's "
                         f"({STATE_VERSION}): upgrade hvd_topk to load it; nothing was loaded")
    if version != STATE_VERSION:
        inside = [k for k, v in saved.items() if isinstance(v, dict) and v.get("version") == STATE_VERSION] \
            if isinstance(saved, dict) else []
        hint = (f": it holds one under {inside[0]!r}; pass checkpoint[{inside[0]!r}]" if inside else
                f" (got {type(saved).__name__}" + (f" with keys {sorted(map(str, saved))[:8]})" if isinstance(saved, dict)
                                                   else ")"))
        raise ValueError(f"not a hvd_topk.ddp.TopKState state_dict (version {STATE_VERSION}){hint}; nothing was loaded")
    if state.names is None:
        raise ValueError("TopKState.load_state_dict() needs parameter names: build the state with "
                         "named_parameters=model.named_parameters()")
    missing = [k for k in ("iteration", "rank", "world_size", "residuals") if k not in saved]
    if missing:
        raise ValueError(f"the TopKState checkpoint lacks {missing} (truncated, or written by something "
                         "else); nothing was loaded")
    for key in ("iteration", "rank", "world_size"):
        if not checkpoint.is_count(saved[key], none_ok=key != "iteration"):
            raise ValueError(f"the TopKState checkpoint has {key}={saved[key]!r}, not a count; nothing was loaded")
    members = saved.get("group_ranks")  # (absent before 2026-12-06; None: saved before init_process_group)
    if members is not None and not (isinstance(members, (list, tuple))
                                    and all(checkpoint.is_count(r) for r in members)):
        raise ValueError(f"the TopKState checkpoint has group_ranks={members!r}, not a list of ranks; nothing "
                         "was loaded")
    if not is_loss_scale(saved.get("residual_scale")):
        raise ValueError(f"the TopKState checkpoint has residual_scale={saved['residual_scale']!r}, not a loss "
                         "scale (a finite number > 0, or None); nothing was loaded")
    wrong = checkpoint.stats_problem(saved["stats"]) if "stats" in saved else None
    if wrong:
        raise ValueError(f"the TopKState checkpoint's 'stats' {wrong}; nothing was loaded")
    by_exchange = saved.get("buckets_by_exchange", {})
    if not (isinstance(by_exchange, dict) and all(isinstance(k, str) and checkpoint.is_count(v)
                                                  for k, v in by_exchange.items())):
        raise ValueError("the TopKState checkpoint's 'buckets_by_exchange' is not a dict of counts by exchange; "
                         "nothing was loaded")
    tensors = saved["residuals"]
    if not isinstance(tensors, dict) or not all(isinstance(n, str) and torch.is_tensor(t) and t.is_floating_point()
                                                for n, t in tensors.items()):
        raise ValueError("the TopKState checkpoint's 'residuals' is not a dict of floating-point tensors by "
                         "parameter name; nothing was loaded")
    sizes = {name: p.numel() for p, name in state.names.items()}
    # names as saved, or equal once torch.compile's "_orig_mod." components are removed
    residuals, unknown = checkpoint.match_names(tensors, sizes)
    if unknown:
        raise ValueError(f"the checkpoint holds residuals of parameters this model does not have: {unknown[:5]}")
    wrong = [f"{n} ({t.numel()} elements, the parameter has {sizes[n]})"
             for n, t in residuals.items() if t.numel() != sizes[n]]
    if wrong:
        raise ValueError(f"the checkpoint's residuals do not fit this model's parameters: {wrong[:5]}")
    nonfinite = sorted(n for n, t in residuals.items() if not bool(torch.isfinite(t).all()))
    if nonfinite:  # as the Horovod optimizer does: a residual of an overflow would spread it
        warnings.warn(f"hvd_topk.ddp: the checkpoint's residuals of {nonfinite[:5]} held inf/nan (saved after "
                      "an overflow?): those start from zero")
        residuals = {n: t for n, t in residuals.items() if n not in nonfinite}
    return residuals


def load(state, saved):
    """``state.load_state_dict(saved)``: see ``TopKState.load_state_dict``."""
    residuals = _checked(state, saved)  # (whole, before anything is applied)
    rank, world = group_rank_and_size(state.process_group)
    state.iteration = int(saved["iteration"])
    state.step_params, state.step_buckets = set(), 0  # (a step left open by static_graph: TopKState._position)
    if state.trial is not None:  # auto's trial goes on: the next step is not timed across the load
        state.trial.skip()
    for layout in state.layouts.values():
        layout.clear()
    state.pending = {}
    if "stats" in saved:  # (the run's history, on every rank; absent: saved before 2026-12-07)
        state._stats.carry(saved["stats"])
        state._by_strategy = dict(saved.get("buckets_by_exchange", {}))
    if (saved["rank"], saved["world_size"]) != (rank, world):
        warnings.warn(f"hvd_topk.ddp: this state was saved by rank {saved['rank']} of {saved['world_size']}; "
                      f"this is rank {rank} of {world}: the residuals start from zero (the step and the statistics are kept)")
        return
    members = saved.get("group_ranks")
    if members is not None and list(members) != group_members(state.process_group):
        warnings.warn(f"hvd_topk.ddp: this state was saved in the process group of global ranks "
                      f"{list(members)}; this one's are {group_members(state.process_group)} (another replica's "
                      "DDP): the residuals start from zero (the step and the statistics are kept)")
        return
    state.pending = {name: t.detach().clone() for name, t in residuals.items()}
    for layout in state.layouts.values():
        layout.adopt(state.pending, state.names)
    # in the loss scale they were saved in (None: true units), whatever the set-up now
    state.residual_scale.adopt(saved.get("residual_scale"), [state])
    if state.seen_whole_model:
        state._drop_pending()
