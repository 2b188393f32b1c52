"""Scripts under tests/dist run as real Horovod jobs: mpirun -np 2 and -np 3 (odd sizes catch bugs).

Each script checks every rank against an independent reference (numpy, fed with every rank's
raw data through mpi4py); a failure on any rank aborts the job, and a hang is killed by the
timeout in tests/mpi.py.
"""

import pytest

from mpi import DIST, run_mpi

pytestmark = pytest.mark.distributed

SCRIPTS = ["check_compressor.py", "check_optimizer.py", "check_mismatch.py"]


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("script", SCRIPTS)
def test_distributed(script, np_):
    out = run_mpi(np_, DIST / script)
    assert f"OK on {np_} ranks" in out.stdout, out.stdout
