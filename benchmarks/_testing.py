"""``hvd_topk.testing`` for the benchmarks, also when they measure an older hvd_topk.

A benchmark run with ``PYTHONPATH=/path/to/old/checkout`` imports that checkout's ``hvd_topk``;
checkouts from before the tooling moved into ``hvd_topk/testing`` lack it. Then the modules are
loaded from this repository's ``hvd_topk/testing/`` by path (they need nothing from the library).
"""

import importlib
import importlib.util
import sys
from pathlib import Path

TESTING_DIR = Path(__file__).resolve().parent.parent / "hvd_topk" / "testing"


def load(name):
    """``hvd_topk.testing.<name>``, or the same file of this repository when the imported
    hvd_topk has no such module."""
    try:
        return importlib.import_module(f"hvd_topk.testing.{name}")
    except ModuleNotFoundError:
        key = f"_hvd_topk_testing_{name}"
        if key not in sys.modules:
            spec = importlib.util.spec_from_file_location(key, TESTING_DIR / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            spec.loader.exec_module(module)
        return sys.modules[key]
