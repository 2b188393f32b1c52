"""What the inner optimizers share: param groups checked wherever they come from, the base of
the optimizers whose update is what gets exchanged (``transform_local_gradient``), Adam's
state and checks, and what the transports ask of an inner optimizer (``momentum_in_residual``,
``residual_decay_of``)."""

import inspect
import math
import warnings

import torch

from hvd_topk._stack import outside_level
from hvd_topk.checks import check_number, is_number


# torch's adaptive optimizers (and their subclasses): each divides by a running second moment,
# which error feedback's late bursts inflate (LocalAdamW runs Adam before the exchange)
ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax)
ADAPTIVE_WHY = ("Adam normalises error feedback's late bursts away: +10.8% validation loss at 300 steps, +32.7% "
                "at 1000, on docs/adamw.md's GPT")
# p.grad changed between the exchange's writing the ranks' averaged update (LocalAdamW; not DeMo,
# whose normalisation ignores a common factor) and the step that applies it: a dense loop's
# gradient clipping, which here shrinks the agreed step
UPDATE_CHANGED = ("{front} over {inner}: p.grad of {names} was written to between {when} and the step (gradient "
                  "clipping? torch's clip_grad_norm_ multiplies in place even under its limit). Over it p.grad holds "
                  "the ranks' averaged update (its own normalised step), not a gradient, so clipping may alter the "
                  "step every rank agreed on; it needs no clipping (the recipe's results ran without; clipped to "
                  "norm 1.0 it ended +27.1% on docs/adamw.md's GPT). (Warned once.)")


def adaptive_name(cls):
    """``torch.optim.AdamW``, or a subclass as ``MyAdam (a torch.optim.AdamW)``."""
    if cls in ADAPTIVE:
        return f"torch.optim.{cls.__name__}"
    base = next(c for c in cls.__mro__ if c in ADAPTIVE)
    return f"{cls.__name__} (a torch.optim.{base.__name__})"


def named_few(names):
    """``'a', 'b', 'c' and 2 more``: a warning's list of parameters."""
    names = list(names)
    return ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class _CheckedGroups(torch.optim.Optimizer):
    """An optimizer whose ``_check_options(options)`` checks one param group's options: every
    group is checked as the constructor checks the defaults, whether it comes with the
    constructor, ``add_param_group`` or ``load_state_dict`` (a group's own ``betas`` or
    ``normalise`` would otherwise be used unchecked; a key a group lacks takes the default)."""

    # An option a loaded group lacks: the value it was trained with where the group was written
    # before the option existed (subclasses name those), else the constructor's.
    LOADED_WITHOUT = {}

    def __init__(self, params, defaults):
        # the options this optimizer defines: torch adds keys of its own to ``defaults`` later
        # ("differentiable", on every load_state_dict), which no group should be given
        self._options = tuple(defaults)
        super().__init__(params, _python_numbers(defaults))

    def add_param_group(self, param_group):
        if isinstance(param_group, dict):
            self._check_options({**self.defaults, **param_group})
            param_group = _python_numbers(param_group)
            params = param_group.get("params")
            for p in [params] if torch.is_tensor(params) else params if isinstance(params, (list, tuple)) else ():
                if torch.is_tensor(p) and p.is_complex():
                    # (squaring a complex gradient is not |g|^2: the moments would be wrong)
                    raise TypeError(f"hvd_topk.{type(self).__name__} does not take complex parameters "
                                    f"(got {p.dtype}, shape {tuple(p.shape)}); nor do Horovod's collectives "
                                    "or the DDP hook: train torch.view_as_real of them")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict):
        """As torch's, with the saved groups checked first (nothing loaded if one fails). An
        option a loaded group lacks is filled in (every option present afterwards: a group saved
        by another optimizer, or before an option existed, failed at the next step with a
        KeyError): from ``LOADED_WITHOUT``, what a checkpoint of this optimizer written before the
        option existed was trained with, or, where the checkpoint is another optimizer's (torch
        options this one does not have in its groups, ``amsgrad``, ``foreach``, ..., and none of
        this one's own beyond Adam's: a dense AdamW run moving to the recipe, which has no
        residuals whose units an option must match), the value this optimizer was built with, as
        ``hvd_topk.DistributedOptimizer`` does for it (``checkpoint.fill_options``); the DDP hook
        loads it directly."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        for group in groups if isinstance(groups, list) else ():
            if isinstance(group, dict):
                self._check_options({**self.defaults, **group})
        built = [dict(g) for g in self.param_groups]  # (torch matches the groups by position)
        own = [k for k in self._options if k not in _ADAM_OPTIONS]  # (LocalAdamW's lr_in_residual, ...)
        saved_own = any(isinstance(g, dict) and any(k in g for k in own) for g in groups or ())
        super().load_state_dict(state_dict)
        foreign = self._drop_adams_options() - {"differentiable"}  # (torch may add that one itself)
        foreign = set() if saved_own else foreign  # (this optimizer's own, with foreach= given, say)
        without, kept = [], []
        for group, was in zip(self.param_groups, built):
            for key in self._options:
                if key in group:
                    continue
                if foreign:
                    group[key] = was.get(key, self.defaults[key])
                    kept += [key] if key not in kept else []
                else:
                    group[key] = self.LOADED_WITHOUT.get(key, self.defaults[key])
                    without += [key] if key in self.LOADED_WITHOUT and key not in without else []
        name = type(self).__name__
        if kept:
            betas = [(g["betas"], was["betas"]) for g, was in zip(self.param_groups, built)
                     if "betas" in was and tuple(g["betas"]) != tuple(was["betas"])]
            warnings.warn(f"hvd_topk.{name}: the checkpoint is another optimizer's (its param groups hold torch "
                          f"options {name} does not have: {', '.join(sorted(foreign))}) and lacks {', '.join(kept)}: "
                          f"they keep the values this {name} was built with. The options it holds (lr, weight "
                          "decay, ...) come from it, as torch's load_state_dict does: set them in param_groups after "
                          "loading to change them" + (f" (betas {tuple(betas[0][0])} from the checkpoint, where this "
                                                      f"{name} was built with {tuple(betas[0][1])})" if betas else "")
                          + ".", stacklevel=outside_level())
        if without:
            warnings.warn(f"hvd_topk.{name}: the checkpoint's param groups lack "
                          f"{', '.join(without)}: taken as {', '.join(f'{k}={self.LOADED_WITHOUT[k]!r}' for k in without)}, "
                          "what a checkpoint written before these options existed was trained with. If it is "
                          "another optimizer's, write them into the checkpoint's param_groups before loading (set "
                          "after, they are refused: the state was made without them).",
                          stacklevel=outside_level())

    def _drop_adams_options(self):
        """Take out of the loaded groups torch's Adam/AdamW options this optimizer does not have
        (``amsgrad``, ``foreach``, ``fused``, ...: a dense AdamW run's checkpoint moving to the
        recipe), and return the names found. Left in, they travel on in later checkpoints, and
        ``hvd.broadcast_optimizer_state`` after a load on rank 0 alone failed on the other ranks
        (``KeyError: 'amsgrad.0'``). ``amsgrad`` or ``maximize`` on asked for what this optimizer
        does not do: warned (the others choose torch's kernels)."""
        asked, found = set(), set()
        for group in self.param_groups:
            for key in [k for k in group if k in _ADAM_OPTIONS and k not in self._options]:
                found.add(key)
                if group.pop(key) and key in ("amsgrad", "maximize"):
                    asked.add(key)
        if asked:
            warnings.warn(f"hvd_topk.{type(self).__name__}: the checkpoint was trained with "
                          f"{' and '.join(f'{k}=True' for k in sorted(asked))}; {type(self).__name__} has no "
                          "such option and goes on without it", stacklevel=outside_level())
        return found


def _python_numbers(options):
    """``options`` with numpy scalars (an ``lr`` or ``betas`` computed with numpy) as Python
    numbers, inside tuples too: a checkpoint holding numpy objects is refused by ``torch.load``'s
    default ``weights_only=True``."""
    def plain(value):
        if isinstance(value, tuple):
            return tuple(plain(v) for v in value)
        if is_number(value) and type(value) not in (int, float) and hasattr(value, "item"):  # (np.float64 is a float)
            return value.item()
        return value
    return {key: plain(value) for key, value in options.items()}


def _adam_denominator(exp_avg_sq, bias_correction2, eps):
    """``sqrt(v / bias_correction2) + eps``, in the order of operations torch's AdamW uses (so
    FrozenVarianceAdamW before its freeze, and LocalAdamW on one rank, are torch's AdamW bit for
    bit)."""
    return (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)


# the options of torch's Adam and AdamW (``_CheckedGroups._drop_adams_options``)
_ADAM_OPTIONS = frozenset(name for cls in (torch.optim.Adam, torch.optim.AdamW)
                          for name in inspect.signature(cls).parameters if name != "params")


class _ExchangedUpdates(_CheckedGroups):
    """An inner optimizer whose ``transform_local_gradient`` turns each gradient into an update
    before the exchange; ``_transformed`` holds the parameters it did this step, ``_exchanged``
    says that hvd_topk's exchange has written this step's ``p.grad``."""

    _exchanged = False
    _stepped = False  # step() ran, and no gradient has been transformed since (a second step())
    # Whether step() moves the same for the ranks' summed updates as for their average (DeMo's
    # normalises what was exchanged). Where it does not, op=hvd.Sum is refused: it would step P
    # times as far, where AdamW under hvd.DistributedOptimizer(op=hvd.Sum) steps as with Average.
    sum_invariant = False

    def exchanged(self):
        """Called by ``hvd_topk.DistributedOptimizer`` once the exchange has written ``p.grad``:
        a gradient this rank did not transform (it ran no backward this step, or took a branch
        without that parameter) holds the ranks' average, applied as the others are."""
        self._exchanged = True

    def _step_done(self, stepped=False):
        """``stepped``: this step applied exchanged updates (a second ``step()`` would apply them again)."""
        self._transformed.clear()
        self._exchanged = False
        self._stepped = stepped

    def zero_grad(self, set_to_none=True):
        """As torch's; also forgets which gradients were transformed (a step skipped by a
        ``GradScaler`` leaves them marked otherwise)."""
        self._step_done(stepped=self._stepped)
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Apply this step's exchanged updates (``p.grad`` after the exchange): AdamW's decoupled
        weight decay, ``p *= 1 - lr * weight_decay``, then the optimizer's own move (``_apply``).
        Skipped on every rank where the updates hold inf/nan (``_skipped_for_nonfinite``)."""
        loss = _evaluate(closure)
        if self._skipped_for_nonfinite():
            return loss
        applied = False
        for group in self.param_groups:
            self._check_group(group)
            for p in group["params"]:
                if p.grad is None or not _check_transformed(self, p):
                    continue
                applied = True
                p.mul_(1 - group["lr"] * group["weight_decay"])
                self._apply(p, group)
        self._step_done(stepped=applied)
        return loss

    def _check_group(self, group):
        """Called for each param group before its updates are applied."""

    def _apply(self, p, group):
        """Move ``p`` by its exchanged update ``p.grad`` (weight decay already applied)."""
        raise NotImplementedError

    def _skipped_for_nonfinite(self):
        """Whether this step's exchanged updates hold inf/nan (a gradient overflowed on some
        rank), and so the step is skipped, with a warning, as a ``GradScaler`` skips one (these
        optimizers take none: their state would mix loss scales). Every rank holds the same
        ``p.grad`` after the exchange, so every rank skips alike; the moments and the residuals
        did not take the inf/nan in. Applied, it made every parameter NaN for good (LocalAdamW,
        DeMo's rms) or moved entries by the sign of inf (DeMo's sign), in silence."""
        flags = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:  # (a sparse one, nn.Embedding(sparse=True)'s: its values)
                    values = p.grad.coalesce().values() if p.grad.is_sparse else p.grad
                    flags.setdefault(p.grad.device, []).append(torch.isfinite(values).all())
        if all(bool(torch.stack(f).all()) for f in flags.values()):
            return False
        warnings.warn(f"hvd_topk.{type(self).__name__}: this step's exchanged update holds inf/nan (a gradient "
                      "overflowed on some rank): the step is skipped on every rank, as a GradScaler skips one",
                      stacklevel=outside_level())
        self._step_done(stepped=False)
        return True


def _group_of(optimizer, p):
    """``p``'s param group, from a table kept on the optimizer and rebuilt when ``load_state_dict``
    replaced the groups or ``add_param_group`` added one. (Read through the instance each time:
    ``hvd_topk.DistributedOptimizer``'s wrapper shares the optimizer's ``__dict__`` but gets its
    own ``param_groups`` when a checkpoint is loaded.)"""
    groups = optimizer.param_groups
    cached, count, table = optimizer.__dict__.get("_group_table", (None, 0, None))
    if cached is not groups or count != len(groups):  # (the list itself, not its id: ids are reused)
        table = {q: g for g in groups for q in g["params"]}
        optimizer.__dict__["_group_table"] = (groups, len(groups), table)
    return table[p]


def _check_transformed(optimizer, p):
    """True if ``p.grad`` is an exchanged update that ``transform_local_gradient`` made this step.
    A gradient that skipped it means the optimizer runs outside ``hvd_topk.DistributedOptimizer``
    (RuntimeError); an all-zero one with no state is ``hvd.broadcast_optimizer_state``'s probe
    step (state initialised, False)."""
    if p in optimizer._transformed:
        return True
    if optimizer._transformed or optimizer._exchanged:
        # a step of hvd_topk's in which this rank had no gradient of p (a branch it did not
        # take, or no backward at all): the exchange still wrote the ranks' average into
        # p.grad, applied as it is
        if not optimizer.state[p]:
            optimizer._init_state(p)
        return True
    if optimizer.state[p] or p.grad.any():
        name = type(optimizer).__name__
        if optimizer._stepped:
            raise RuntimeError(f"{name}.step() was called again without a new backward(): p.grad still holds the "
                               "update the last step applied (each exchanged update is applied once); run "
                               "backward() before each step()")
        raise RuntimeError(f"{name} got a gradient that was not turned into an update before the exchange: "
                           "use it only as the inner optimizer of hvd_topk.DistributedOptimizer, or with DDP "
                           "pass it to the hook, hvd_topk.ddp.TopKState(optimizer=...) (not alone, not with "
                           "hvd.DistributedOptimizer or a DDP model without that hook)")
    optimizer._init_state(p)
    return False


def momentum_in_residual(optimizer):
    """Whether the residual is the inner optimizer's momentum: ``hvd_topk.DeMo``'s accumulator,
    whose decay it owns (its ``beta``; at 1.0 an undecayed sum, still its momentum). Only such a
    residual is never sent whole by choice (``auto.MOMENTUM_NOTE``); a decay the user adds to
    error feedback (the 0.1% recipe's, or LocalSteps') only fades unsent work, and a dense step,
    which sends all of it, is then exact."""
    return getattr(optimizer, "residual_decay", None) is not None


def residual_decay_of(optimizer, residual_decay, error_feedback=True):
    """The residual decay to use: an inner optimizer that owns it (``hvd_topk.DeMo``'s ``beta``,
    its attribute ``residual_decay``) sets it unless the argument says otherwise."""
    owned = getattr(optimizer, "residual_decay", None)
    if owned is not None and owned != 1.0 and not error_feedback:
        raise ValueError(f"{type(optimizer).__name__} keeps its momentum in the residual (beta={owned!r}), which "
                         "error_feedback=False leaves out: pass error_feedback=True, or beta=1.0")
    if owned is None or residual_decay == owned:
        return residual_decay
    if residual_decay != 1.0:
        raise ValueError(f"residual_decay={residual_decay!r} but {type(optimizer).__name__} sets the residual "
                         f"decay itself (beta={owned!r}); pass only one of them")
    return owned


def _evaluate(closure):
    """The loss of an optimizer step's closure (torch's convention), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _new_adam_state(state, p):
    """Adam's per-parameter state, as torch.optim.AdamW lays it out (``step`` a float tensor)."""
    state["step"] = torch.zeros((), dtype=torch.float32)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _check_nonnegative(**values):
    """TypeError for a value that is not a number, ValueError for one outside [0, inf)."""
    for name, value in values.items():
        if not 0.0 <= check_number(value, name) < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_adam_options(options):
    lr, betas, eps, weight_decay = (options[k] for k in ("lr", "betas", "eps", "weight_decay"))
    _check_nonnegative(lr=lr, eps=eps, weight_decay=weight_decay)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or \
            not all(is_number(b) for b in betas):
        raise TypeError(f"betas must be a pair of numbers (beta1, beta2), got {betas!r}")
    if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"betas must be in [0, 1), got {betas}")
