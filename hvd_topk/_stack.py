"""Where a warning should point: at the user's own line, the first frame outside hvd_topk,
torch and Horovod, however many of their frames lie between (``opt.step()`` through Horovod's
wrapper, or ``loss.backward()`` for what Horovod's gradient hooks call)."""

import os
import sys

import torch

_OURS_AND_TORCH = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(torch.__file__))


def _library_dirs():
    horovod = sys.modules.get("horovod")  # (never imported here: the DDP hook runs without it)
    where = getattr(horovod, "__file__", None)
    return _OURS_AND_TORCH + ((os.path.dirname(where),) if where else ())


def outside_level():
    """``warnings.warn``'s ``stacklevel`` for a warning raised by this function's caller that
    names the first frame outside hvd_topk, torch and Horovod (the outermost frame if there is
    none: a hook run on autograd's own thread)."""
    frame, level = sys._getframe(1), 1
    library = _library_dirs()
    while frame.f_back is not None and frame.f_code.co_filename.startswith(library):
        frame, level = frame.f_back, level + 1
    return level
