"""examples/pytorch_gpt.py under mpirun -np 2: a short AdamW run learns (validation loss well
below ln 256, an untrained byte model's loss) dense, with error feedback at 1% and with bf16
autocast, and prints the line scripts read; and, at 150 steps, what makes Top-K work with Adam:
at 0.1% hvd_topk.LocalAdamW and hvd_topk.FrozenVarianceAdamW stay near dense, and neither plain
AdamW nor dropping error feedback does (300 and 1000 steps x 3 seeds:
benchmarks/results/convergence-gpt-*; over 1000 steps only LocalAdamW holds, see the README)."""

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
START = ("--warmup-steps", "75", "--warmup-density", "1.0")  # the dense start, halved with the run
FROZEN = ("--adam", "frozen-variance", "--freeze-step", "50", *START)
LOCAL = ("--adam", "local", *START)


def test_adam_schemes_close_the_adamw_gap_at_0_1_percent(tmp_path):
    """150 steps (the 300-step benchmark's warm-up and freeze halved). Measured on this machine,
    2026-11-24: dense 2.199; LocalAdamW 2.280 (+3.7%), without error feedback 2.429 (+6.5% on
    it); frozen variance 2.209 (+0.4%), without error feedback 2.412 (+9.7%); plain AdamW with
    error feedback 3.035 (+38%). Deterministic for a given torch build (fixed seeds), so the
    margins below only absorb other builds' rounding."""
    loss = {name: train(tmp_path, name, *args, steps=150)[0]["final_val_loss"] for name, args in [
        ("dense", ("--compression", "none")),
        ("local", SPARSE + LOCAL),
        ("local, no error feedback", SPARSE + LOCAL + ("--no-error-feedback",)),
        ("frozen", SPARSE + FROZEN),
        ("frozen, no error feedback", SPARSE + FROZEN + ("--no-error-feedback",)),
        ("plain adamw", SPARSE),
    ]}
    for scheme in ("local", "frozen"):
        assert loss[scheme] < 1.06 * loss["dense"], (scheme, loss)
        assert loss[f"{scheme}, no error feedback"] > 1.04 * loss[scheme], (scheme, loss)  # the residuals are live
        assert loss["plain adamw"] > 1.10 * loss[scheme], (scheme, loss)  # the optimizer is what closes it
