"""Everything hvd_topk needs from PyTorch beyond its documented API, in one place.

Checked against torch 2.13 (``CHECKED_VERSION``). Each private detail relied on:

1. ``compiled_autograd_active``: torch 2.13 has no public way to ask whether compiled autograd
   is in use. It is switched on by ``torch._dynamo.config.compiled_autograd = True`` (then
   used for backward passes under ``torch.compile``) or by the context manager behind it, which
   sets ``torch._dynamo.compiled_autograd.compiled_autograd_enabled`` and, while a captured
   backward runs, ``in_compiled_autograd_region``. If these names move, the check returns
   False (as for torch without dynamo) and hvd_topk behaves as before the check existed.
2. ``AMP_SCALING_ATTRIBUTE``: ``torch.amp.GradScaler.step(optimizer)`` reads this attribute of
   the optimizer (fused optimizers set it to unscale by themselves); it is the only read of it
   in torch 2.13 and the only sign an optimizer gets that a scaler steps it. hvd_topk's wrapper
   answers it with the wrapped optimizer's own value, after checking that the scaler was
   passed as ``grad_scaler=`` (see ``hvd_topk.optimizer``). If torch stops reading it, that
   check silently stops firing and the ``grad_scaler`` docs still stand. ``hvd_topk.LocalSteps``
   answers True, and then reads the ``grad_scale`` and ``found_inf`` attributes the scaler sets
   on it for the step (torch 2.13's contract for optimizers that unscale by themselves); if
   torch stops setting them, its local step runs on scaled gradients and its check fails.
3. ``unscaled_already``: whether ``scaler.unscale_(optimizer)`` ran this step, read from
   ``GradScaler._per_optimizer_states[id(optimizer)]["stage"]`` (``OptState.UNSCALED``), torch
   2.13's record of it. If these names move it answers False, and unscaling before the exchange
   is no longer refused (the docs' pattern still stands).
4. ``copy_all``: ``torch._foreach_copy_`` copies a list of tensors in one call (torch.optim's
   foreach paths use the same family). A bucket stages or hands back dozens of small tensors
   per step; a Python loop of ``copy_`` costs a few microseconds each. Where the function is
   missing, the loop is used.
5. ``keep_step_unhooked``: ``Optimizer.load_state_dict`` (through ``__setstate__`` and
   ``_patch_step_function``) wraps ``type(optimizer).step`` in the step-hook runner unless the
   function carries ``hooked = True``. hvd_topk's wrappers are dynamic subclasses whose
   ``step`` calls the inner class's ``step``, which already runs the hooks; wrapped again after
   a load, every registered step hook ran twice a step. Marking the wrapper's ``step`` as hooked
   keeps one run. If torch renames the attribute, the hooks run twice again after a load (as
   before this fix), and ``check_optimizer``'s hook count fails.
6. ``keep_objects``: ``Optimizer.load_state_dict`` puts a new ``state`` dict and new
   param-group dicts in place of the old ones (torch 2.13, ``__setstate__``). hvd_topk's wrapper
   shares those objects with the user's optimizer, so an LR scheduler built on that optimizer
   (before wrapping) went on changing the old groups' learning rate after a load, silently, and
   the user's optimizer wrapped again got its old state. The loaded values are copied back into
   the old objects. If torch starts loading in place, this does nothing.
7. ``backward_running``: whether autograd is running a backward pass now, read from
   ``torch._C._current_graph_task_id()`` (-1 outside one, torch 2.13). DDP under
   ``torch.distributed.algorithms.Join`` runs a joined rank's communication hook outside any
   backward, on zero buckets: the DDP hook's check that ``TopKState(optimizer=...)`` was stepped
   must not count those. If the function goes, the answer is True (the check as before: a
   joined rank may then warn once in vain).
8. ``written``/``still_written``: whether a tensor is still the one a step wrote and unchanged
   since, from a weak reference to it and its ``_version`` counter (bumped by every in-place
   change; torch 2.13, as autograd's saved-tensor checks use it). ``hvd_topk.DistributedOptimizer``
   over ``LocalAdamW``/``DeMo`` refuses a ``step()`` whose ``p.grad`` is still the last step's
   exchanged update (no backward since), which the inner optimizer would take for a gradient;
   ``synchronize()`` in a step no hook fired in does nothing where every ``p.grad`` is still
   what the last one wrote (with a warning). A write through ``.data`` does not bump the
   counter: ``p.grad.data = g`` is seen by its storage (the record keeps the data pointer),
   ``p.grad.data.copy_(g)`` is not (the warning names it). If the counter goes, every tensor
   counts as changed (no refusal: the behaviour before the checks; the warnings of a ``p.grad``
   changed after the exchange took it, or before the step applied it, would then fire once in vain).
9. ``ddp_ignored_names``: the names of the parameters ``DistributedDataParallel`` does not
   reduce (``_set_params_and_buffers_to_ignore_for_model``, ``delay_all_reduce_named_params``),
   read from its ``parameters_to_ignore`` set (torch 2.13). ``hvd_topk.ddp.register`` leaves
   them out of what ``named_parameters=`` and ``optimizer=`` must cover. If the attribute goes,
   the set is empty, and such a parameter is asked for there as any other.
10. ``after_backward``: runs a function once the current backward has finished *and* DDP has
   written ``p.grad``, through ``torch.autograd.Variable._execution_engine.queue_callback``
   (torch 2.13; DDP's and FSDP's Python code use it). DDP's reducer queues its end-of-backward
   work (which copies each bucket's result into ``p.grad``) when the last bucket is ready, after
   the last bucket's hook ran; final callbacks run in order, and one queued while they run comes
   after those queued before, so a callback that queues the function from that hook lands after
   the reducer's (the DDP hook calls it from the step's last bucket: the first may come in a
   nested backward, under reentrant activation checkpointing, whose callbacks run earlier). The DDP hook then records ``p.grad`` as written, to tell a clipping of
   ``LocalAdamW``'s update before its step. If the call goes, nothing is recorded and nothing warned.
"""

import sys
import weakref

import torch

CHECKED_VERSION = "2.13"
AMP_SCALING_ATTRIBUTE = "_step_supports_amp_scaling"


def compiled_autograd_active():
    """True when compiled autograd is switched on (see the module docstring).

    Reads only modules already imported: if ``torch._dynamo`` was never imported, compiled
    autograd cannot be on, and importing it here would cost about a second.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    if getattr(getattr(dynamo, "config", None), "compiled_autograd", False) is True:
        return True
    engine = sys.modules.get("torch._dynamo.compiled_autograd")
    return engine is not None and (getattr(engine, "compiled_autograd_enabled", False) is True
                                   or getattr(engine, "in_compiled_autograd_region", False) is True)


def unscaled_already(scaler, optimizer):
    """True when ``scaler.unscale_(optimizer)`` ran since the scaler's last ``update()`` (see
    the module docstring)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    opt_state = getattr(getattr(torch.amp, "grad_scaler", None), "OptState", None)
    if not states or opt_state is None or id(optimizer) not in states:  # (a defaultdict: no lookup)
        return False
    return states[id(optimizer)].get("stage") is getattr(opt_state, "UNSCALED", None)


def copy_all(dests, srcs):
    """``dests[i].copy_(srcs[i])`` for every i, in one call where torch has one."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dests, srcs)
        return
    for d, s in zip(dests, srcs):
        d.copy_(s)


def keep_objects(optimizer, load, state_dict):
    """``load(state_dict)`` (torch's ``load_state_dict``), then the loaded state and param
    groups put back into the objects ``optimizer`` held before (see the module docstring)."""
    groups, state = optimizer.param_groups, optimizer.state
    load(state_dict)
    if optimizer.param_groups is not groups:
        for old, new in zip(groups, optimizer.param_groups):
            if old is not new:
                old.clear()
                old.update(new)
        optimizer.param_groups = groups
    if optimizer.state is not state:
        loaded = optimizer.state
        state.clear()
        state.update(loaded)
        optimizer.state = state


def keep_step_unhooked(cls):
    """Mark ``cls.step`` so that ``load_state_dict`` does not wrap it in the step-hook runner
    again (see the module docstring)."""
    if "step" in vars(cls):
        cls.step.hooked = True


def backward_running():
    """True inside a backward pass (see the module docstring, 7)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return True if current is None else current() != -1


def ddp_ignored_names(model):
    """The names of ``model``'s (a ``DistributedDataParallel``) parameters it does not reduce
    (see the module docstring, 9)."""
    return set(getattr(model, "parameters_to_ignore", ()) or ())


def after_backward(function):
    """Run ``function()`` after this backward's final callbacks, DDP's among them (see the
    module docstring, 10). Only inside a backward; elsewhere (or without the call) nothing."""
    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is not None and backward_running():
        try:
            queue(lambda: queue(function))
        except RuntimeError:  # not inside a backward after all (backward_running's fallback)
            pass


def written(tensor):
    """A record of ``tensor`` as it is now, for ``still_written`` (see the module docstring, 8)."""
    return weakref.ref(tensor), getattr(tensor, "_version", None), _data_ptr(tensor)


def _data_ptr(tensor):
    return tensor.data_ptr() if tensor.layout == torch.strided else None


def still_written(record, tensor):
    """True if ``tensor`` is the one ``record`` (``written``) saw, unchanged in place since
    (False for no record, None)."""
    if record is None:
        return False
    ref, version, pointer = record
    return ref() is tensor and version is not None and getattr(tensor, "_version", None) == version \
        and _data_ptr(tensor) == pointer
