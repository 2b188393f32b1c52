"""examples/pytorch_gpt.py under mpirun -np 2: a short AdamW run learns (validation loss well
below ln 256, an untrained byte model's loss) dense, with error feedback at 1% and with bf16
autocast, and prints the line scripts read; and, at 150 steps, what makes Top-K work with Adam
over a short horizon: at 0.1% hvd_topk.FrozenVarianceAdamW stays near dense, and neither plain
AdamW nor dropping error feedback does (300 steps x 3 seeds: benchmarks/results/convergence-gpt-*;
over 1000 steps the frozen variance stalls, see the README: issue 14 stays open)."""

import json
import math
from pathlib import Path

import pytest

from mpi import run_mpi

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pytorch_gpt.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
UNTRAINED = math.log(256)  # cross-entropy of a uniform guess over bytes


def train(tmp_path, name, *args, steps=60):
    out = tmp_path / f"{name}.json"
    proc = run_mpi(2, EXAMPLE, "--steps", str(steps), "--corpus-mb", "1", "--eval-every", str(steps),
                   "--eval-batches", "4", "--json", out, *args, timeout=400)
    return json.loads(out.read_text()), proc


@pytest.mark.parametrize("name, args", [
    ("dense", ("--compression", "none")),
    ("ef-1%", ("--optimizer", "topk-ef", "--exchange", "allgather", "--density", "0.01")),
    ("ef-1%-bf16", ("--optimizer", "topk-ef", "--exchange", "allgather", "--density", "0.01", "--amp", "bf16")),
])
def test_gpt_learns_and_reports(tmp_path, name, args):
    result, proc = train(tmp_path, name, *args)
    assert result["final_val_loss"] < UNTRAINED - 1.0, result["history"]
    assert result["corpus_bytes"] == 1_000_000 and len(result["corpus_sha256"]) == 64
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1]
    assert last == f"final validation loss: {result['final_val_loss']:.4f}", last
    if name.startswith("ef"):
        assert 0.01 < result["bytes_ratio"] < 0.05, result["bytes_ratio"]  # pairs, plus small tensors dense


SPARSE = ("--optimizer", "topk-ef", "--exchange", "allgather", "--density", "0.001")
FROZEN = ("--adam", "frozen-variance", "--freeze-step", "50", "--warmup-steps", "75", "--warmup-density", "1.0")


def test_frozen_variance_closes_the_adamw_gap_at_0_1_percent(tmp_path):
    """150 steps (the 300-step benchmark's warm-up and freeze halved). Measured on this machine,
    2026-11-24: dense 2.199, frozen variance 2.209 (+0.4%), the same without error feedback
    2.412 (+9.7%), plain AdamW with error feedback 3.035 (+38%). Deterministic for a given
    torch build (fixed seeds), so the margins below only absorb other builds' rounding."""
    loss = {name: train(tmp_path, name, *args, steps=150)[0]["final_val_loss"] for name, args in [
        ("dense", ("--compression", "none")),
        ("frozen", SPARSE + FROZEN),
        ("frozen, no error feedback", SPARSE + FROZEN + ("--no-error-feedback",)),
        ("plain adamw", SPARSE),
    ]}
    assert loss["frozen"] < 1.03 * loss["dense"], loss
    assert loss["frozen, no error feedback"] > 1.05 * loss["frozen"], loss  # the residuals are live
    assert loss["plain adamw"] > 1.10 * loss["frozen"], loss  # the optimizer is what closes it
