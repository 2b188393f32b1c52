"""hvd_topk._stack.outside_level: a warning names the user's line, past hvd_topk's and torch's
frames, whatever the path the package was imported by. Each case counts the frames by hand."""

import os
import warnings

import torch

import hvd_topk
from hvd_topk import FrozenVarianceAdamW
from hvd_topk._stack import outside_level
from hvd_topk.schedule import DensitySchedule

PACKAGE = os.path.dirname(os.path.abspath(hvd_topk.__file__))


def _call_from(filename):
    """``outside_level()`` called by a function whose code says it lies in ``filename``, called
    from here: 1 when that file is the user's, 2 when it is the library's (this frame is next)."""
    namespace = {"outside_level": outside_level}
    exec(compile("def inner():\n    return outside_level()\n", filename, "exec"), namespace)
    return namespace["inner"]()


def test_library_frames_skipped_whatever_the_path():
    """A frame of hvd_topk's is skipped when its path runs through '..' (a package put on
    sys.path as '../x' has such paths in its code objects), and a file beside the package whose
    name begins with the package's is the user's own."""
    detour = os.path.join(PACKAGE, "..", os.path.basename(PACKAGE), "engine.py")
    assert _call_from(os.path.join(PACKAGE, "engine.py")) == 2
    assert _call_from(detour) == 2
    assert _call_from(PACKAGE + "_extra.py") == 1  # /.../hvd_topk_extra.py: not inside hvd_topk/
    assert _call_from(os.path.join(os.path.dirname(torch.__file__), "nn", "x.py")) == 2
    assert _call_from("<string>") == 1


def _names_this_file(build):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    assert caught, "no warning"
    assert all(w.filename == __file__ for w in caught), [(w.filename, w.lineno, str(w.message)) for w in caught]


def test_warnings_name_the_users_line():
    """Warnings raised a few frames deep in hvd_topk or under torch's decorators: a warm-up that
    does nothing, and FrozenVarianceAdamW freezing a variance most entries never fed (its step
    runs under torch's ``no_grad`` wrapper, where a fixed stacklevel named torch's file)."""
    _names_this_file(lambda: DensitySchedule(0.01, warmup_steps=10, start=0.005))
    _names_this_file(lambda: DensitySchedule(0.01, warmup_steps=0, start=0.5))
    p = torch.nn.Parameter(torch.zeros(100))
    opt = FrozenVarianceAdamW([p], lr=1e-3, freeze_step=1)
    p.grad = torch.zeros(100)
    p.grad[0] = 1.0
    _names_this_file(opt.step)
