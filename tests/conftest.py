import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# tests/support (helpers: mpi, reference, results) and the repository root (tools/: launch,
# emulated hosts, machine info, shapes) for every test module; tests/ itself is on the path too
for _path in (TESTS / "support", TESTS.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def pytest_collection_modifyitems(items):
    """Fast tiers first: unit tests, then mpirun jobs, then the training runs."""
    items.sort(key=lambda item: ("distributed" in item.keywords, "slow" in item.keywords))
