"""What the DDP hook checks of how it is used: the ranks' settings, the model and optimizer it
serves, the process group, and the torch optimizer steps around it.

Each check fails (or warns once) with one message naming what is wrong and the fix, at the
first point the hook can see it; the Horovod front end's equivalents are
``hvd_topk.rank_checks`` and the optimizer's own. ``hvd_topk.ddp.TopKState`` calls them; none
keeps state of its own but the torch optimizer step counter and the weak sets of states and
optimizers the Adam warning looks at.
"""

import warnings
import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from hvd_topk import agreement
from hvd_topk import ddp_exchange as exchange
from hvd_topk._stack import outside_level
from hvd_topk._torch import ddp_ignored_names, still_written
from hvd_topk.checks import NAMED_PARAMETERS_ERROR
from hvd_topk.optim._common import ADAPTIVE, ADAPTIVE_WHY, UPDATE_CHANGED, adaptive_name, named_few
from hvd_topk.selection import NATIVE_IN_USE, native_in_use

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# every torch optimizer's completed step() (fused ones move parameters without bumping their
# version counters): what TopKState.state_dict() asks to tell "after step()" from "before"
OPTIMIZER_STEPS = [0]

# TopKStates with error feedback and no optimizer=: a torch Adam stepping their parameters is warned
# of once (the hook never sees the optimizer; warn_adaptive_behind_hook)
PLAIN_STATES = weakref.WeakSet()
_ADAPTIVE_CHECKED = weakref.WeakSet()  # the torch Adam-family optimizers already looked at


def _count_optimizer_step(optimizer, args, kwargs):
    OPTIMIZER_STEPS[0] += 1
    if PLAIN_STATES and isinstance(optimizer, ADAPTIVE) and optimizer not in _ADAPTIVE_CHECKED:
        warn_adaptive_behind_hook(optimizer)


register_optimizer_step_post_hook(_count_optimizer_step)


def check_updates_unchanged(state):
    """``optimizer=``'s step pre-hook: warn once where ``p.grad``, the ranks' averaged update DDP
    wrote after backward, was changed before the step (clipped, as a dense AdamW loop does)."""
    if state is None or not state.updates_written:
        return
    written_, state.updates_written = state.updates_written, None
    changed = [p for p, record in written_ if not still_written(record, p.grad)]
    if changed and not state._warned_update_changed:
        state._warned_update_changed = True
        names = named_few(state.names.get(p, f"a {tuple(p.shape)} parameter") for p in changed) if state.names else \
            f"{len(changed)} of the model's parameters"
        warnings.warn(UPDATE_CHANGED.format(front="hvd_topk.ddp", inner=type(state.optimizer).__name__,
                                            names=names, when="backward()"), stacklevel=outside_level())


def warn_adaptive_behind_hook(optimizer):
    """Warn once where ``optimizer`` (torch's Adam family) steps parameters whose gradients a
    ``TopKState`` compresses with error feedback and no ``optimizer=``: Adam behind error
    feedback trains worse (``hvd_topk.optim._common.ADAPTIVE_WHY``). Looked at after its first
    step whose parameters some state has seen in a bucket; looked at again while a state has
    seen none. Tensors that always travel dense (under ``min_numel``) hold nothing back."""
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    states = list(PLAIN_STATES)
    seen = [state for state in states if state.layouts]
    held_back = {id(layout.params[i]) for state in seen for layout in state.layouts.values() for i in layout.sparse}
    if mine & held_back:
        _ADAPTIVE_CHECKED.add(optimizer)
        warnings.warn(
            f"hvd_topk.ddp: the DDP hook compresses with error feedback the gradients that "
            f"{adaptive_name(type(optimizer))} applies, which trains worse than dense ({ADAPTIVE_WHY}). "
            "The recipe: inner = hvd_topk.LocalAdamW(model.parameters(), lr, betas=(0.0, 0.95), weight_decay=...); "
            "state = hvd_topk.ddp.TopKState(density=0.01, fp16_values=True, optimizer=inner, warmup_steps=100, "
            "warmup_density=1.0, exchange=\"allgather\"); "
            "inner.step() (README.md, 'Transformers with AdamW'; docs/ddp.md). (Warned once.)",
            stacklevel=outside_level())
    elif len(seen) == len(states):  # every state has seen its buckets: none serves this optimizer
        _ADAPTIVE_CHECKED.add(optimizer)


def check_process_group(process_group):
    """``TopKState(process_group=)``: None, a group, or the sentinel ``dist.new_group`` gives the
    ranks outside it (the first hook says so); anything else is refused, a number with a hint."""
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup) and \
            process_group is not dist.GroupMember.NON_GROUP_MEMBER:
        number = isinstance(process_group, (int, float)) and not isinstance(process_group, bool)
        raise TypeError("process_group must be None (the default group) or a torch.distributed process "
                        f"group (dist.new_group(...), model.process_group), got {process_group!r}"
                        + (" (the density is a keyword argument: TopKState(density=...))" if number else ""))
    return process_group


def check_settings_agree(state, bucket):
    """At the first hook: every rank wraps the same model with the same settings and step (fails
    on every rank with one message naming what differs, where a difference would make the
    exchange hang or fail on a message size; a process group that is not DDP's is caught here
    only where the first buckets differ: ``register`` compares the groups themselves). One
    allgather of a digest per setting."""
    buffer = bucket.buffer()
    if buffer.dtype not in DTYPES:
        raise TypeError(f"hvd_topk.ddp: gradients of dtype {buffer.dtype} are not supported "
                        f"(supported: {', '.join(str(d) for d in DTYPES)})")
    settings = {
        "the first bucket's parameters (a different model, or a TopKState process_group that is not the one "
        "DDP reduces over)": ([tuple(p.shape) for p in bucket.parameters()], str(buffer.dtype)),
        "density": state.density, "method": state.codec.method, "fp16_values": state.fp16_values,
        "compact": state.compact, "error_feedback": state.error_feedback, "residual_decay": state.residual_decay,
        "warmup_steps": state.schedule.warmup_steps, "warmup_density": state.schedule.start,
        "exchange": state.exchange, "exchange_trial_steps": state.exchange_trial_steps,
        "min_numel": state.min_numel,
        "optimizer= (its class and param-group options)": None if state.optimizer is None else
        (type(state.optimizer).__qualname__, agreement.group_options(state.optimizer.param_groups)),
        "grad_scaler (given or not)": state.residual_scale.scaler is not None,
        "the step (a checkpoint loaded on some ranks only?)": state.iteration,
        NATIVE_IN_USE: native_in_use([(exchange.acc_dtype(buffer.dtype, state.error_feedback), buffer.device)]),
    }
    mine = torch.tensor([agreement.digest(v) for v in settings.values()], dtype=torch.int64, device=buffer.device)
    every = torch.empty(state.world_size * len(settings), dtype=torch.int64, device=buffer.device)
    exchange.all_gather(every, mine, state.process_group)
    lines = agreement.disagreement(list(settings), every.view(state.world_size, len(settings)).cpu())
    if lines:
        raise RuntimeError("hvd_topk.ddp: ranks disagree on the model or TopKState's settings, which would make "
                           "the exchange hang or fail; build the same on every rank:\n  " + "\n  ".join(lines))


def check_group_unchanged(state):
    """Once a step: the group's rank and size are read at the first hook; a job that destroyed
    its process group and initialised a smaller or larger one would send messages of the
    old size (gloo: "invalid tensor size")."""
    now = dist.get_rank(state.process_group), dist.get_world_size(state.process_group)  # -1: left out now
    if now != (state.rank, state.world_size):
        raise RuntimeError(f"hvd_topk.ddp: this TopKState was first used as rank {state.rank} of "
                           f"{state.world_size} and its process group is now rank {now[0]} of {now[1]} (a new "
                           "init_process_group?): build a new TopKState for the new group; load_state_dict() "
                           "keeps the step and restarts the residuals from zero, with a warning")


def check_one_model(state, params):
    """A bucket's parameters the state has never seen, once it has seen a whole step, belong to
    another model unless ``named_parameters=`` names them. Layouts are per DDP bucket index: a
    second model's buckets would take the first model's places, and its residuals would be
    dropped. Parameters named by ``named_parameters=`` are this model's: it was wrapped again
    (a new DDP after some of its parameters began to require gradients), and residuals follow
    their parameters."""
    unseen = [p for p in params if id(p) not in state.model_params]
    if state.seen_whole_model and unseen and (state.names is None or any(p not in state.names for p in unseen)):
        raise RuntimeError("hvd_topk.ddp: this TopKState already serves another DDP model (a bucket "
                           "holds parameters it has not seen, not among its named_parameters=); build one "
                           "TopKState per DistributedDataParallel model. To carry it over to this model "
                           "re-wrapped (after unfreezing parameters), build the state with "
                           "named_parameters=model.named_parameters(), which names frozen ones too")


def check_retired_taken(state):
    """At a step's last bucket: every trainable parameter of a layout DDP replaced this step
    is in one of the new layouts (its residual moved there). One that is not belongs to
    another DDP model whose buckets this state took for a rebuild (a state shared by two
    models, both named by ``named_parameters=``): its residual would be dropped."""
    if not state.retired:  # (most steps: no layout replaced)
        return
    taken = {id(p) for layout in state.layouts.values() for p in layout.params}
    left = [p for old in state.retired for p in old.params if p.requires_grad and id(p) not in taken]
    if left:
        names = ", ".join(sorted(state.names.get(p, "?") for p in left)[:3]) if state.names else "unnamed"
        raise RuntimeError("hvd_topk.ddp: this TopKState serves two DDP models (this step's buckets left out "
                           f"{len(left)} trainable parameters it had served, e.g. {names}): their residuals "
                           "would be dropped at every turn. Build one TopKState per DistributedDataParallel "
                           "model")


def check_supported(bucket, params, names):
    """Complex parameters (DDP reduces them as their real view, twice the elements the layout
    would cover: half of each gradient would go unaveraged) and sparse gradients
    (``nn.Embedding(sparse=True)``: DDP hands the hook a sparse tensor) are refused here."""
    for i, p in enumerate(params):
        if p.is_complex():
            name = (names or {}).get(p, f"#{i} of its DDP bucket")
            raise TypeError(f"hvd_topk.ddp: parameter {name!r} is complex ({p.dtype}); the hook "
                            "supports real floating-point parameters only (keep such a parameter as "
                            "torch.view_as_real of a real one)")
    if bucket.buffer().layout != torch.strided or any(g.layout != torch.strided for g in bucket.gradients()):
        raise TypeError("hvd_topk.ddp: a DDP bucket holds sparse gradients (nn.Embedding(sparse=True) or "
                        "similar); the hook compresses dense gradients only: use sparse=False")


def check_named(params, names):
    """``named_parameters=`` names what checkpoints hold: one parameter of the model it lacks
    (another model's, or part of this one's) would otherwise fail only at ``state_dict()``."""
    if names is None:
        return
    for i, p in enumerate(params):
        if p not in names:
            raise ValueError(f"hvd_topk.ddp: TopKState(named_parameters=...) does not name parameter #{i} "
                             f"(shape {tuple(p.shape)}) of a DDP bucket: pass the DDP model's own "
                             "model.named_parameters(), all of them")


def check_optimizer_owns(optimizer, params, names):
    """``optimizer=`` transforms every gradient of the model: one it does not hold (a second
    optimizer's parameter) would otherwise fail deep in it, naming nothing."""
    if optimizer is None:
        return
    owned = {id(q) for g in optimizer.param_groups for q in g["params"]}
    for i, p in enumerate(params):
        if id(p) not in owned:
            name = (names or {}).get(p, f"#{i} of its DDP bucket")
            raise ValueError(f"hvd_topk.ddp: TopKState(optimizer=...) transforms every gradient of the model, and "
                             f"parameter {name!r} (shape {tuple(p.shape)}) is not in that optimizer: give "
                             f"{type(optimizer).__name__} every parameter of the DDP model (one param group "
                             "each, with their own lr or weight_decay, where they need other settings)")


def check_optimizer_serves_model(optimizer, model_params):
    """At each step's last bucket: ``optimizer=`` applies an exchanged update to each of its
    parameters, and one outside the DDP model's buckets (``model_params``: their ids; a
    learnable temperature kept apart, a parameter DDP ignores, one added by ``add_param_group``
    or unfrozen after DDP was built) would have its own raw gradient applied as one, at no
    learning rate, each rank its own (before 2026-12-05 in silence; after the first step until
    2026-12-06)."""
    if optimizer is None:
        return
    for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"]):
        if p.requires_grad and id(p) not in model_params:
            raise ValueError(
                f"hvd_topk.ddp: TopKState(optimizer=...)'s {type(optimizer).__name__} holds parameter #{i} "
                f"(shape {tuple(p.shape)}), which is not in the DDP model's buckets: its step() would apply that "
                "parameter's own gradient as if it were the exchanged update. Give it only the DDP model's "
                "parameters (another optimizer for the others); a parameter unfrozen after DDP was built is "
                "not in them either: wrap the model in DDP again (the state carries over with named_parameters=)")


def check_covers(model, state):
    """``register``'s check that ``named_parameters=`` names, and ``optimizer=`` holds, every
    trainable parameter of ``model``, naming the first few it lacks."""
    ignored = ddp_ignored_names(model)  # (DDP does not reduce them: the hook never sees them)
    trainable = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad and n not in ignored]
    lacking = {}
    if state.names is not None:
        lacking["TopKState(named_parameters=...) does not name"] = [n for n, p in trainable if p not in state.names]
    if state.optimizer is not None:
        held = {id(q) for g in state.optimizer.param_groups for q in g["params"]}
        lacking["TopKState(optimizer=...) does not hold"] = [n for n, p in trainable if id(p) not in held]
    for what, names in lacking.items():
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ValueError(f"hvd_topk.ddp.register: {what} {len(names)} of the model's trainable parameters "
                             f"({shown}): pass it the whole model's, named_parameters=model.named_parameters() or "
                             "LocalAdamW(model.parameters()), built from the model DDP wraps")


def names_of(named_parameters):
    """``{parameter: name}`` from ``model.named_parameters()``, or a clear error."""
    try:
        pairs = list(named_parameters)
    except TypeError:
        pairs = None
    if pairs is None or not all(isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
               and isinstance(pair[1], torch.Tensor) for pair in pairs):
        raise TypeError(NAMED_PARAMETERS_ERROR)
    holders = {}  # name -> the parameters under it: checkpoints key the residuals by name
    for n, p in pairs:
        holders.setdefault(n, {})[id(p)] = p
    clashes = sorted(n for n, held in holders.items() if len(held) > 1)
    if clashes:
        raise ValueError("named_parameters gives one name to different parameters (their residuals would "
                         f"overwrite each other in a checkpoint): {', '.join(clashes)}; pass "
                         "model.named_parameters() of the whole model, whose names are unique")
    return {p: n for n, p in pairs}


def group_rank_and_size(group):
    """This rank's rank in ``group`` and the group's size; RuntimeError on a rank outside it."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError("hvd_topk.ddp: this rank is not in TopKState's process_group; pass "
                           "the group DDP uses (process_group= of DistributedDataParallel)")
    return rank, dist.get_world_size(group)


def group_members(group):
    """The global ranks of ``group`` (the default group's: every rank), in group-rank order: which
    replica a state belongs to where DDP runs on subgroups."""
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
