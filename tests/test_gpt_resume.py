"""examples/pytorch_gpt.py's checkpoints under mpirun -np 2: a run cut with --stop-after and
continued with --resume ends with the same bits as one that never stopped (every validation
loss, the bytes over the whole run), for the AdamW recipe and for local steps cut mid-period;
a resume with other flags is refused, naming them. (The library's own resume checks:
tests/dist/check_checkpoint.py, check_local_steps.py.)"""

import json
from pathlib import Path

import pytest

from mpi import run_mpi

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pytorch_gpt.py"
pytestmark = pytest.mark.distributed
TINY = ("--steps", "12", "--corpus-mb", "1", "--eval-every", "4", "--eval-batches", "2", "--batch-size", "4",
        "--context", "32", "--width", "32", "--layers", "1", "--heads", "2", "--lr", "1e-2", "--quiet")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, args, stop", [
    ("recipe", ("--optimizer", "topk-ef", "--exchange", "allgather", "--density", "0.01", "--adam", "local",
                "--warmup-steps", "4", "--warmup-density", "1.0", "--fp16-values"), 6),
    ("local steps, cut mid-period", ("--optimizer", "topk-ef", "--exchange", "allgather", "--density", "0.04",
                                     "--sync-every", "4", "--fp16-values"), 6),
])
def test_stop_and_resume_is_the_uninterrupted_run(tmp_path, name, args, stop):
    full, resumed = tmp_path / "full.json", tmp_path / "resumed.json"
    run_mpi(2, EXAMPLE, *TINY, *args, "--json", full, timeout=300)
    prefix = tmp_path / "ckpt"
    proc = run_mpi(2, EXAMPLE, *TINY, *args, "--checkpoint", prefix, "--stop-after", str(stop), timeout=300)
    assert f"stopped after step {stop} of 12" in proc.stdout, proc.stdout[-2000:]
    run_mpi(2, EXAMPLE, *TINY, *args, "--checkpoint", prefix, "--resume", "--json", resumed, timeout=300)
    want, got = json.loads(full.read_text()), json.loads(resumed.read_text())
    # the resumed job went on from the checkpoint (a job that ignored it and trained from step 0
    # would end with the same bits), and the optimizer's statistics, whose counts the checkpoint
    # carries, cover the whole run as the uninterrupted run's do
    assert (want["first_step"], got["first_step"]) == (0, stop), (want["first_step"], got["first_step"])
    for key in ("steps", "bytes_sent", "bytes_dense", "elements_selected"):
        assert got["compression_stats"][key] == want["compression_stats"][key] > 0, key
    assert got["history"] == want["history"], (want["history"], got["history"])
    assert got["bytes_sent_per_step"] == want["bytes_sent_per_step"] > 0
    assert got["bytes_ratio"] == want["bytes_ratio"]


@pytest.mark.timeout(300)
def test_resume_with_other_flags_is_refused(tmp_path):
    prefix = tmp_path / "ckpt"
    run_mpi(2, EXAMPLE, *TINY, "--optimizer", "topk-ef", "--exchange", "allgather", "--checkpoint", prefix,
            "--stop-after", "4", timeout=300)
    proc = run_mpi(2, EXAMPLE, *TINY, "--optimizer", "topk-ef", "--exchange", "allgather", "--lr", "2e-2",
                   "--checkpoint", prefix, "--resume", timeout=300, expect_ok=False)
    assert proc.returncode != 0
    assert "was written with other flags: --lr 0.01 (now 0.02)" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    # on another number of ranks (the residuals are per rank): refused too
    proc = run_mpi(1, EXAMPLE, *TINY, "--optimizer", "topk-ef", "--exchange", "allgather", "--checkpoint", prefix,
                   "--resume", timeout=300, expect_ok=False)
    assert proc.returncode != 0
    assert "--ranks 2 (now 1)" in proc.stdout + proc.stderr, proc.stderr[-2000:]


@pytest.mark.timeout(600)
def test_resume_from_files_at_different_steps_or_missing_is_refused_on_every_rank(tmp_path):
    """A job killed between two ranks' writes leaves one rank's file a step set behind the
    other's; before, each rank checked only its own file: rank 0 trained on, printed a final
    loss and wrote --json for a run whose ranks had loaded different steps, and rank 1 died.
    Truth: no final line, no JSON, one message naming each file's step (and a missing one)."""
    prefix, out = tmp_path / "ckpt", tmp_path / "out.json"
    dense = ("--compression", "none")
    run_mpi(2, EXAMPLE, *TINY, *dense, "--checkpoint", prefix, "--stop-after", "4", timeout=300)
    behind = (tmp_path / "ckpt-rank1.pt").read_bytes()
    run_mpi(2, EXAMPLE, *TINY, *dense, "--checkpoint", prefix, "--stop-after", "8", "--resume", timeout=300)
    (tmp_path / "ckpt-rank1.pt").write_bytes(behind)  # rank 0's file at step 8, rank 1's at step 4
    proc = run_mpi(2, EXAMPLE, *TINY, *dense, "--checkpoint", prefix, "--resume", "--json", out,
                   timeout=300, expect_ok=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not out.exists(), said[-2000:]
    assert "final validation loss" not in said, said[-2000:]
    assert f"{prefix}-rank0.pt: step 8, {prefix}-rank1.pt: step 4" in said, said[-2000:]
    (tmp_path / "ckpt-rank1.pt").unlink()
    proc = run_mpi(2, EXAMPLE, *TINY, *dense, "--checkpoint", prefix, "--resume", "--json", out,
                   timeout=300, expect_ok=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not out.exists() and "final validation loss" not in said, said[-2000:]
    assert f"{prefix}-rank1.pt does not exist" in said, said[-2000:]
