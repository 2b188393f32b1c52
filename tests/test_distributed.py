"""Scripts under tests/dist run as real Horovod jobs: mpirun -np 2 and -np 3 (odd sizes catch bugs)."""

import pytest

from mpi import DIST, run_mpi

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("np_", [2, 3])
def test_topk_compressor_under_stock_horovod(np_):
    out = run_mpi(np_, DIST / "check_compressor.py")
    assert f"OK on {np_} ranks" in out.stdout
