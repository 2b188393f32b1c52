"""Argument checks both transports share (no Horovod and no ``torch.distributed`` here):
numbers, densities, integers, flags, choices, ``named_parameters=``, the ``exchange=`` names and
the options each of them ignores."""

import numbers
import warnings

from hvd_topk._stack import outside_level

# the exchange= names both transports accept ("auto" measures and keeps the fastest)
SPARSE_EXCHANGES = ("allgather", "sparse_allreduce")
DENSE_EXCHANGES = ("dense", "dense_fp16")
EXCHANGES = ("auto", *SPARSE_EXCHANGES, *DENSE_EXCHANGES)


def is_number(value):
    """Whether ``value`` is a real number (numpy's included), not a bool: Python counts
    ``True``/``False`` as integers, and ``density=True`` would silently mean 1.0."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def check_number(value, name):
    """``value`` as a float, or TypeError naming ``name`` when it is not a real number
    (``is_number``: strings too, ``"0.01"`` being a typo for a number here)."""
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def check_density(density, name="density"):
    """Return density as a float in (0, 1]: TypeError for a non-number, ValueError out of range."""
    value = check_number(density, name)
    if not 0.0 < value <= 1.0:  # also rejects nan
        hint = " (a fraction of the entries: 1% is 0.01)" if 1.0 < value <= 100.0 else ""
        raise ValueError(f"{name} must be in (0, 1], got {density!r}{hint}")
    return value


def check_target_density(density):
    """``check_density`` for the density a user asks Top-K for, warning where an integer 1
    (``TopK(1)``) most likely meant 1%: it keeps every entry, so nothing is saved (where pairs
    are sent, each costs an index as well as its value)."""
    value = check_density(density)
    if value == 1.0 and isinstance(density, numbers.Integral):
        warnings.warn("hvd_topk: density=1 keeps every entry, so nothing is compressed; 1% is "
                      "density=0.01 (pass 1.0 to mean every entry and silence this)", stacklevel=outside_level())
    return value


def check_integer(value, name, low):
    """``value`` as an int if it is an integer (not a bool) >= ``low``: TypeError or ValueError
    naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_residual_decay(decay, error_feedback):
    """``residual_decay`` as a float in (0, 1]; a decay other than 1 needs error feedback (without
    it there is no residual)."""
    value = check_number(decay, "residual_decay")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"residual_decay must be in (0, 1], got {decay!r}")
    if value != 1.0 and not error_feedback:
        raise ValueError("residual_decay needs error_feedback=True (without it there is no residual)")
    return value


AUTO_ONLY = ("exchange_trial_steps", "exchange_recheck_steps")  # options of exchange="auto"'s trial
# options of a sparse bucket (the density's and its warm-up's too: a dense exchange sends everything)
SPARSE_ONLY = ("selection_scope", "dense_fallback", "density", "warmup_steps", "warmup_density")


def warn_ignored(exchange_choice, **given):
    """Warn once where options set away from their defaults (``name=(value, default)``) have no
    effect with this ``exchange``: the trial's with a forced exchange, a sparse bucket's with a
    dense one. Both transports' options call it (here: no Horovod import)."""
    ignored = [name for name, (value, default) in given.items() if value != default and (
        (name in AUTO_ONLY and exchange_choice != "auto")
        or (name in SPARSE_ONLY and exchange_choice in DENSE_EXCHANGES))]
    if ignored:
        warnings.warn(f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect with "
                      f"exchange={exchange_choice!r}", stacklevel=outside_level())


def warn_momentum_sent_whole(exchange_choice, momentum):
    """Warn where a pinned dense exchange runs over a residual that is the inner optimizer's
    momentum (``optim.momentum_in_residual``: DeMo's accumulator): allowed, as ``"auto"``'s note
    offers, but it sends the momentum whole and zeroes it every step."""
    if momentum and exchange_choice in DENSE_EXCHANGES:
        warnings.warn(f"exchange={exchange_choice!r} over DeMo sends its accumulator (its momentum, the residual) "
                      "whole every step and zeroes it: DeMo then has no momentum, and its sign step moves every "
                      "entry. Leave exchange='auto' (which does not offer dense over DeMo) or pin 'allgather' for "
                      "DeMo as published.", stacklevel=outside_level())


# both transports' named_parameters= (DistributedOptimizer, LocalSteps, TopKState)
NAMED_PARAMETERS_ERROR = ("named_parameters must be model.named_parameters(): (name, parameter) pairs "
                          "(model.parameters() has no names; of a dict of them, pass its .items())")


def check_flag(value, name):
    """``value`` if it is ``True`` or ``False`` (not merely truthy: ``"no"`` is truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(value, name, choices, spelled=None):
    """``value`` if it is one of ``choices``: ValueError naming ``name`` and the choices."""
    if value not in choices:
        raise ValueError(f"{name} must be {spelled or f'one of {choices}'}, got {value!r}")
    return value
