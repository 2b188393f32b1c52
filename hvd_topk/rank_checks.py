"""What would make the ranks of one Horovod optimizer silently diverge, hang or train on stale
buffers, refused on every rank at once (each check sees the same on every rank, so every rank
raises at the same point): the ranks' settings compared once, the process set still
registered, frozen and trainable parameters as they were, the parameters unchanged since the
buffers were built. ``hvd_topk.DistributedOptimizer``'s engine and ``LocalSteps`` call them."""

import dataclasses

import torch

from hvd_topk import agreement
from hvd_topk._horovod import hvd
from hvd_topk._torch import compiled_autograd_active
from hvd_topk.selection import NATIVE_IN_USE, native_in_use

COMPILED_AUTOGRAD_ERROR = (
    "hvd_topk.DistributedOptimizer does not support compiled autograd "
    "(torch._dynamo.config.compiled_autograd = True): compiled autograd traces the gradient "
    "hooks that start each exchange, which hvd_topk does not support. Set "
    "torch._dynamo.config.compiled_autograd = False (torch.compile of the model can stay).")


def process_set_size(process_set):
    """The optimizer's process set's size now; a clear error where it was removed
    (``hvd.remove_process_set``: Horovod's ``size()`` is None then, and the next collective over
    it fails with a binding error)."""
    size = process_set.size()
    if size is None:
        raise RuntimeError(f"hvd_topk.DistributedOptimizer: its process set {process_set.ranks} was removed "
                           "(hvd.remove_process_set): build a new optimizer over a registered one")
    return size


def check_ranks_agree(engine, compression, inner=None, grad_scaler=False):
    """Every rank must wrap the same model with the same settings: fail on all ranks at once,
    naming what differs (one digest per setting, allgathered once)."""
    o = engine.options
    settings = {
        "the parameters (names, shapes, dtypes, order)":
            [(engine.names[p], tuple(p.shape), str(p.dtype)) for p in engine.params],
        # one entry per option, so that the message names the one that differs
        **{f"TopK's {name}": getattr(compression, name) for name in ("density", "method", "fp16_values", "compact")},
        "the inner optimizer's class": inner,
        "grad_scaler (given or not)": grad_scaler,
        "op": str(engine.op),
        "gradient_predivide_factor": engine.predivide,
        "backward_passes_per_step": engine.passes_per_step,
        "the fusion buckets (groups, fusion_bytes, min_numel)": [[m.name for m in b.members] for b in engine.buckets],
        **{name: getattr(o, name) for name in (f.name for f in dataclasses.fields(o))},
        NATIVE_IN_USE: native_in_use([(b.dtype, b.device) for b in engine.buckets]),  # (16-bit: float32 residuals)
    }
    mine = torch.tensor([[agreement.digest(v) for v in settings.values()]], dtype=torch.int64)
    every = hvd.allgather(mine, name=f"{engine.prefix}.check_ranks", process_set=engine.process_set)
    lines = agreement.disagreement(list(settings), every)
    if lines:
        raise ValueError("hvd_topk.DistributedOptimizer: ranks disagree on the model or its settings, which would "
                         "make them hang or silently diverge; build it with the same model and settings on every "
                         "rank:\n  " + "\n  ".join(lines))


def differing_options(engine, mine):
    """Which param-group options (``mine``: this rank's ``agreement.group_options``) differ from
    rank 0's, as ``disagreement`` lines naming them; asked on the step probe's error path, where
    every rank of the process set is (the probe's sums are the same on every rank) and none is
    inside ``hvd.join()`` (the caller makes sure: a joined rank answers no allgather). First the
    groups' option names, then, where they agree, one digest per option."""
    keys = torch.tensor([[agreement.digest([[k for k, _ in group] for group in mine])]], dtype=torch.int64)
    every = hvd.allgather(keys, name=f"{engine.prefix}.option_names", process_set=engine.process_set)
    if not bool((every == every[0]).all()):
        return ["the number of param groups or their options' names"]
    names = [f"param group {g}'s {k!r}" for g, group in enumerate(mine) for k, _ in group]
    values = torch.tensor([[agreement.digest(v) for group in mine for _, v in group]], dtype=torch.int64)
    every = hvd.allgather(values, name=f"{engine.prefix}.option_values", process_set=engine.process_set)
    return agreement.disagreement(names, every) or []


def check_step_start(engine):
    """What would make ranks silently diverge (the same on every rank, so every rank raises
    at the same point)."""
    if compiled_autograd_active():
        raise RuntimeError(COMPILED_AUTOGRAD_ERROR)
    check_still_frozen(((p, engine.names[p]) for p in engine.frozen), "hvd_topk.DistributedOptimizer",
                       "its gradient would never be exchanged")
    check_still_trainable(((p, engine.names[p]) for p in engine.params), "hvd_topk.DistributedOptimizer",
                          "the exchange would still write its unsent residual into p.grad, and the optimizer "
                          "would move it")


def check_still_frozen(frozen, owner, because):
    """``frozen``: (parameter, name) pairs that had ``requires_grad=False`` when ``owner`` was
    built, and so are not exchanged (``because`` says how); one trainable now is refused."""
    for p, name in frozen:
        if p.requires_grad:
            raise RuntimeError(
                f"parameter {name!r} had requires_grad=False when {owner} was built and is trainable "
                f"now: {because} and ranks would silently diverge. Set requires_grad=True on every "
                f"parameter to be trained before building the {owner.split('.')[-1]}, or build a new "
                "one after unfreezing.")


def check_still_trainable(trainable, owner, because):
    """``trainable``: (parameter, name) pairs that had ``requires_grad=True`` when ``owner`` was
    built; one frozen since is refused (a plain torch optimizer would leave it alone: it gets no
    gradient)."""
    for p, name in trainable:
        if not p.requires_grad:
            raise RuntimeError(
                f"parameter {name!r} was trainable when {owner} was built and has requires_grad=False "
                f"now: {because}. Build a new {owner.split('.')[-1]} after freezing (a plain torch "
                "optimizer over the trainable parameters, wrapped again).")


def parameter_signature(params):
    """What the buffers built over ``params`` depend on: each one's shape, dtype and device."""
    return [(p.shape, p.dtype, p.device) for p in params]


def check_parameters_unchanged(param_groups, param_ids, params, signature, owner):
    """RuntimeError if ``param_groups`` no longer hold the parameters ``owner`` was built over
    (``param_ids``, every parameter's id in order) or a trained one (``params``) changed its
    shape, dtype or device since (``signature``): its buffers (residuals, shared copies) were made
    for them, and a parameter they miss would silently train on one rank only."""
    ids = [id(p) for g in param_groups for p in g["params"]]
    if ids != param_ids or parameter_signature(params) != signature:
        raise RuntimeError(f"the optimizer's parameters changed after {owner} was built (parameters added, "
                           "removed, replaced or resized, or moved to another dtype or device, e.g. "
                           f"model.double() or .cuda()); build the {owner.split('.')[-1]} after the model "
                           "(its dtype and device included) and its param_groups are final")
