"""The native kernel off in this process for a while, as on a host without a C compiler (or
with ``HVD_TOPK_NATIVE=0``): for the checks of ranks with and without it."""

import contextlib

from hvd_topk import native


def loaded():
    """Whether this process has the kernel (with it off everywhere nothing can differ)."""
    return native.library() is not None


@contextlib.contextmanager
def native_off(off=True):
    saved = native._lib, native._error
    if off:
        native._lib, native._error = None, "off for this check"
    try:
        yield
    finally:
        native._lib, native._error = saved
