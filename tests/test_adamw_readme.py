"""The README's "Transformers with AdamW" file, the recommended scheme, runs as written under
``mpirun -np 2``. Checked against truths outside the code under test: after training, both ranks
hold the same parameters bit for bit (every rank's hash, gathered), the model fits its
task far better than guessing zero (its error is the task's output power, computed from
the task alone), and the bytes it reports lie between one dense fp16 step in 300 (the dense
start sends at least that) and a dense fp32 run's."""

import re

import pytest

from mpi import REPO, run_mpi
from readme import readme_python_block

pytestmark = pytest.mark.distributed

STEPS = 300

# appended to the README's file: every rank's parameters hashed (gathered by Horovod, printed
# by rank 0: one line, not two ranks' output interleaved), and the trained model's loss against
# the zero guess's on one fixed batch
CHECK = """
import hashlib
probe = torch.randn(512, 64, generator=torch.Generator().manual_seed(123))
with torch.no_grad():
    trained = torch.nn.functional.mse_loss(model(probe), task(probe)).item()
    zero = task(probe).pow(2).mean().item()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
digests = hvd.allgather_object(digest)
if hvd.rank() == 0:
    print(f"parameter hashes {' '.join(digests)} trained {trained:.6f} zero {zero:.6f}", flush=True)
"""


def test_readme_adamw_block_is_make_demo_gpts_scheme():
    """The README's AdamW file and ``make demo-gpt`` show the same scheme (issue 26: both use
    the winner): its density, 16-bit values, dense start, learning rate and exchange."""
    makefile = (REPO / "Makefile").read_text()
    demo = makefile.split("\ndemo-gpt:", 1)[1].split("\n\n", 1)[0]
    flag = lambda name: re.search(rf"--{name} (\S+)", demo).group(1)  # noqa: E731
    assert "--adam local" in demo and "--fp16-values" in demo, demo
    block = readme_python_block("Transformers with AdamW")
    for piece in ("hvd_topk.LocalAdamW(", f"lr={flag('lr')}", "betas=(0.0, 0.95)",
                  f"TopK(density={flag('density')}, fp16_values=True)",
                  f"warmup_steps={flag('warmup-steps')}, warmup_density={flag('warmup-density')}",
                  f'exchange="{flag("exchange")}"'):
        assert piece in block, piece


def test_readme_adamw_lines_run_under_mpirun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_python_block("Transformers with AdamW") + CHECK)
    proc = run_mpi(2, str(script), timeout=240)
    check = re.search(r"parameter hashes (\w+) (\w+) trained ([0-9.]+) zero ([0-9.]+)", proc.stdout)
    assert check, proc.stdout
    assert check.group(1) == check.group(2), "the ranks' parameters differ"
    trained, zero = float(check.group(3)), float(check.group(4))
    # an untrained model is worse than zero (its own output adds to the error); 300 steps of the
    # scheme fit this task to 1-11% of zero's error
    assert trained < 0.25 * zero, (trained, zero)
    got = re.search(r"loss [0-9.]+; bytes sent vs dense fp32: ([0-9.]+)%", proc.stdout)
    assert got, proc.stdout
    assert 0.5 / STEPS < float(got.group(1)) / 100 < 1.0, got.group(0)


QUICKSTART_CHECK = """
gen = torch.Generator().manual_seed(7 + hvd.rank())
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 1000, generator=gen)).square().mean().backward()
    opt.step()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
digests = hvd.allgather_object(digest)
if hvd.rank() == 0:
    print(f"parameter hashes {' '.join(digests)}", flush=True)
"""


def test_readme_quickstart_runs_under_mpirun(tmp_path):
    """The Quickstart runs as written, with three training steps appended (each rank its own
    batches): the ranks end with the same parameters, bit for bit (every rank's hash, gathered),
    and its print names a strategy and a share of dense's bytes."""
    script = tmp_path / "train.py"
    script.write_text("import hashlib\n" + readme_python_block("Quickstart") + QUICKSTART_CHECK)
    proc = run_mpi(2, str(script), timeout=240)
    check = re.search(r"parameter hashes (\w+) (\w+)", proc.stdout)
    assert check, proc.stdout
    assert check.group(1) == check.group(2), "the ranks' parameters differ"
    # its own print: the exchange auto chose, one of the strategies, and bytes between none and
    # a dense fp32 run's (the trial's dense steps included)
    said = re.search(r"(\w+) ([0-9.]+)% of dense's bytes", proc.stdout)
    assert said, proc.stdout
    assert said.group(1) in ("dense", "dense_fp16", "allgather", "sparse_allreduce"), said.group(0)
    assert 0 < float(said.group(2)) <= 100, said.group(0)
