"""The examples' command lines: --help with each script's docstring as written and every
option's default, and the library's own checks of a value as usage errors."""

import argparse
import copy


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
    """``check(*args)`` (one of the library's checks, e.g. ``hvd_topk.selection.check_density``),
    its ``ValueError`` turned into ``p.error``: a usage message and exit status 2, not a traceback."""
    try:
        return check(*args)
    except ValueError as exc:
        p.error(str(exc))
