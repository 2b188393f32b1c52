"""examples/pytorch_gpt.py under mpirun -np 2: a short AdamW run learns (validation loss well
below ln 256, an untrained byte model's loss) dense, with error feedback at 1% and with bf16
autocast, and prints the line scripts read; and, at 150 steps, what makes Top-K work with Adam:
at 0.1% hvd_topk.LocalAdamW and hvd_topk.FrozenVarianceAdamW stay near dense, and neither plain
AdamW nor dropping error feedback does (300 and 1000 steps x 3 seeds:
benchmarks/results/gpt/convergence-gpt-*; over 1000 steps only LocalAdamW holds, see the README)."""

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
    # 60 steps, seed 42, this machine (2026-11-25): dense 2.380, EF 1% 2.975, with bf16 2.975;
    # the bound (4.545) is 1.6 nats above the worst, where seeds differ by about 0.01-0.02
    # (the 150-step runs below; the benchmarks' 300-step runs): one seed is enough.
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


@pytest.mark.timeout(900)  # six runs: 229 s on 2 shared cores, close to the default 300
def test_adam_schemes_close_the_adamw_gap_at_0_1_percent(tmp_path):
    """150 steps (the 300-step benchmark's warm-up and freeze halved), final validation loss.
    Measured on this machine (AMD EPYC, 2 cores, torch 2.13.0+cpu; LocalAdamW rows with its
    defaults since 2026-11-25, global variance and lr in the residual, on 2026-11-25; the others
    on 2026-11-24/25 with `--seed`), and the ratios the bounds below are on:
        seed                              42      43      44      ratio: mean, sd over seeds
        dense                            2.199   2.1948  2.2051
        LocalAdamW                       2.2089  2.2112  2.2073  / dense        1.004, 0.003
          without error feedback         2.3957  2.3914  2.3798  / LocalAdamW   1.081, 0.003
        FrozenVarianceAdamW              2.209   2.2185  2.2350  / dense        1.010, 0.005
          without error feedback         2.412   2.4102  2.4123  / frozen       1.086, 0.006
        plain AdamW, error feedback      3.035   2.9985  3.0122  / LocalAdamW   1.365, 0.009
                                                                 / frozen       1.358, 0.014
    Another CPU's rounding moves a run about as much as another seed does, so each bound sits
    at least 5 standard deviations of that spread from the 3-seed mean, and one seed (42, the
    default) is run: LocalAdamW within 3% of dense (7.9 sd), frozen variance within 6% (11 sd),
    each at least 4% worse without error feedback (13 and 7 sd) and plain AdamW at least 10%
    worse than each (29 and 18 sd). (LocalAdamW before global variance: 2.280 / 2.266 / 2.2517,
    1.030 of dense, so its bound was 7%.)"""
    loss = {name: train(tmp_path, name, *args, steps=150)[0]["final_val_loss"] for name, args in [
        ("dense", ("--compression", "none")),
        ("local", SPARSE + LOCAL),
        ("local, no error feedback", SPARSE + LOCAL + ("--no-error-feedback",)),
        ("frozen", SPARSE + FROZEN),
        ("frozen, no error feedback", SPARSE + FROZEN + ("--no-error-feedback",)),
        ("plain adamw", SPARSE),
    ]}
    for scheme, near_dense in (("local", 1.03), ("frozen", 1.06)):
        assert loss[scheme] < near_dense * loss["dense"], (scheme, loss)
        assert loss[f"{scheme}, no error feedback"] > 1.04 * loss[scheme], (scheme, loss)  # the residuals are live
        assert loss["plain adamw"] > 1.10 * loss[scheme], (scheme, loss)  # the optimizer is what closes it
