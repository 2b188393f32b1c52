"""The examples' command lines: --help with each script's docstring as written and every
option's default, and the library's own checks of a value as usage errors."""

import argparse
import copy
import math
import os
from pathlib import Path

from hvd_topk.checks import DENSE_EXCHANGES


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``RawDescriptionHelpFormatter`` that appends ``(default: X)`` to each option whose help
    does not already name its default in brackets, ``(default ...`` (argparse's own
    ``ArgumentDefaultsHelpFormatter`` skips options without a help string and cannot keep the
    description's layout). A help that only says "by default" still gets the value."""

    def _format_action(self, action):
        default = action.default
        if (action.option_strings and default is not None and default is not False
                and default is not argparse.SUPPRESS and "(default" not in (action.help or "")):
            action = copy.copy(action)
            action.help = f"{action.help or ''} (default: %(default)s)".strip()
        return super()._format_action(action)


def usage_error_from(p, check, *args):
    """``check(*args)`` (one of the library's checks, e.g. ``hvd_topk.checks.check_density``),
    its ``ValueError`` turned into ``p.error``: a usage message and exit status 2, not a traceback."""
    try:
        return check(*args)
    except ValueError as exc:
        p.error(str(exc))


def check_interval(p, flag, value, low, high=math.inf, low_open=False, high_open=True):
    """``p.error`` unless ``value`` lies in the interval from ``low`` to ``high`` (closed at
    ``low`` unless ``low_open``, open at ``high`` unless not ``high_open``): NaN never does, and
    the default upper end keeps inf out (a learning rate of inf trains to NaN in silence)."""
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        p.error(f"{flag} must be in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}, "
                f"got {value}")


def refuse_topk_flags_with_dense_exchange(p, args, flags):
    """A pinned dense exchange sends every bucket whole: ``flags`` (``{dest: default}``, Top-K's
    own flags) would be ignored in silence, so a value other than the default is refused."""
    if args.exchange in DENSE_EXCHANGES:
        given = [f"--{name.replace('_', '-')}" for name, default in flags.items() if getattr(args, name) != default]
        if given:
            p.error(f"--exchange {args.exchange} sends every bucket whole: {', '.join(given)} would do nothing")


def output_path(text):
    """argparse ``type=`` for a file the run writes at its end (``--json``): refused up front
    when it could not be written, not after the training it reports on."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    return str(path)


def bytes_report(sent, dense, ranks):
    """(bytes sent per step and rank, the examples' line saying so). One rank exchanges nothing,
    whatever an optimizer counted as handed to the transport (a local no-op): 0 for every
    example alike."""
    if ranks == 1:
        return 0, "bytes sent per step and rank 0 (one rank: nothing is exchanged)"
    return sent, f"bytes sent per step and rank {sent:,.0f} vs dense fp32 {dense:,.0f} ({100 * sent / dense:.2f}%)"
