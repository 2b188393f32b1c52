"""Where a warning should point: at the user's own line, the first frame outside hvd_topk,
torch and Horovod, however many of their frames lie between (``opt.step()`` through Horovod's
wrapper, or ``loss.backward()`` for what Horovod's gradient hooks call on CPU; on CUDA autograd
runs those hooks on a thread of its own, with no user frame above them)."""

import os
import sys

import torch


def _folder(path):
    """The folder of ``path``, absolute and normalised, ending in a separator (so that torch's
    folder does not take in ``torchvision``'s)."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), "")


_OURS_AND_TORCH = (_folder(__file__), _folder(torch.__file__))


def _library_folders():
    horovod = sys.modules.get("horovod")  # (never imported here: the DDP hook runs without it)
    where = getattr(horovod, "__file__", None)
    return _OURS_AND_TORCH + ((_folder(where),) if where else ())


def outside_level():
    """``warnings.warn``'s ``stacklevel`` for a warning raised by this function's caller that
    names the first frame outside hvd_topk, torch and Horovod (the outermost frame if there is
    none). Called only when a warning is issued: the walk normalises every frame's path (a
    package imported through ``..`` in ``sys.path`` has such paths in its frames)."""
    frame, level = sys._getframe(1), 1
    library = _library_folders()
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(library):
        frame, level = frame.f_back, level + 1
    return level
