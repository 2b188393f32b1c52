import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(items):
    """Fast tiers first: unit tests, then mpirun jobs, then the training runs."""
    items.sort(key=lambda item: ("distributed" in item.keywords, "slow" in item.keywords))
