"""``python -m hvd_topk.native``: build the native kernel now (set-up runs this), load it, and
print its path; exit status 1, with the reason, when it cannot be used (``HVD_TOPK_NATIVE=0``,
turning it off on purpose, is not a failure: it is built and not loaded)."""

import os
import sys

from hvd_topk.native import _library_path, build, library, unavailable_reason

try:
    build(verbose=True)
except RuntimeError as exc:
    sys.exit(f"hvd_topk: the native kernel cannot be used: {exc}")
if os.environ.get("HVD_TOPK_NATIVE", "1") == "0":
    print(f"{_library_path()} (built; not used: HVD_TOPK_NATIVE=0)")
    sys.exit(0)
if library() is None:
    sys.exit(f"hvd_topk: the native kernel cannot be used: {unavailable_reason()}")
print(_library_path())
