"""The main job, end to end under mpirun -np 2: accuracy and bytes on the digits example.

Every threshold on a training result below is checked against several seeds, not one run: the
seed sets the model's initialisation and the batches, and another CPU's rounding moves a run
about as much as another seed does (issue 28: a 2-core Xeon got 97.49% vs 94.43% at 0.1%, a gap
of 3.06 points where this machine's seed 42 gave 14.5), so a margin is only safe when it is
wide against the spread over seeds. Each test's comment gives the values measured on the
machine that set it (AMD EPYC, 2 cores, torch 2.13.0+cpu, 2026-11-25; one
`mpirun -np 2 examples/pytorch_digits.py --quiet --json OUT --seed SEED ARGS` per value) and
the margin each bound leaves.
"""

import json
import math
from pathlib import Path

import pytest

from mpi import run_mpi

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pytorch_digits.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SEEDS = (42, 43, 44)
EF = ("--optimizer", "topk-ef", "--exchange", "allgather")  # auto may (rightly) go dense here


def train(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    run_mpi(2, EXAMPLE, "--quiet", "--json", out, *args, timeout=400)
    return json.loads(out.read_text())


def late_train_loss(result):
    """Training loss over the last 5 epochs (each epoch's mean over its batches): how far the
    optimisation got, smoothed over the single epochs' ups and downs."""
    return sum(e["train_loss"] for e in result["history"][-5:]) / 5


def test_topk_dropin_reaches_90_percent_with_under_3_percent_of_the_bytes(tmp_path):
    # 90% is far below what the drop-in reaches: measured 98.89% / 98.33% / 97.21% (seeds 42,
    # the default and `make demo`'s, 43, 44; mean 98.14, sd 0.85), and Top-K 1% without error
    # feedback in hvd_topk's own optimizer 97.77-98.61% (the benchmarks' 3 seeds). One seed is
    # enough: the bound is 9.5 standard deviations under the mean, 7.2 points under the worst
    # seed. The byte bounds are counted, not trained: deterministic (12,280 of 605,224 bytes).
    result = train(tmp_path, "topk", "--compression", "topk", "--density", "0.01")
    assert result["test_acc"] >= 0.90, result["test_acc"]
    assert result["bytes_ratio"] <= 0.03, result["bytes_ratio"]
    # counted by hand: DigitsNet's 8 tensors of 288, 32, 18432, 64, 131072, 128, 1280 and 10 entries
    # (151,306: 605,224 bytes of fp32) send k = max(1, round(0.01 n)) = 3, 1, 184, 1, 1311, 1, 13 and
    # 1 pairs of a 4-byte index and a 4-byte value (1515 x 8 = 12,120 bytes), and each tensor's
    # Horovod allreduce carries TopK's 5-float probe [1, r, r^2, f, f^2] (8 x 20 = 160 bytes; 3 floats,
    # 96 bytes, before the wire-format check of 118970e)
    assert (result["bytes_sent_per_step"], result["bytes_dense_per_step"]) == (1515 * 8 + 8 * 20, 151_306 * 4)


@pytest.mark.timeout(600)  # three runs: 56 s on 2 cores, up to ~40 s each when shared
def test_error_feedback_at_1_percent_stays_within_a_point_of_dense(tmp_path):
    """Measured, 30 epochs, the example's defaults (test accuracy on the 360 held-out digits;
    training loss over the last 5 epochs):
        seed             42      43      44      45      46     mean
        dense fp32      98.61%  99.16%  99.44%  98.33%  99.44%  99.00% (sd 0.50)   loss 4.9e-5 - 7.6e-5
        EF 1%           98.61%  98.61%  98.33%  98.61%  99.16%  98.66% (sd 0.30)   loss 1.8e-5 - 4.5e-5
    One seed cannot carry "within a point": dense - EF 1% is 0.0 to 1.1 points per seed (one
    digit is 0.28 points; seed 44 alone is 1.1). So: the mean over seeds 42-44 (98.52% here) must
    be at least 98.0%, one point under dense's 99.0% mean; the margin, 0.5 points, is 3 standard
    deviations of a 3-seed mean (0.30 / sqrt 3 = 0.17). Dense is not rerun: its mean is the
    measured constant above (the benchmarks' 3 seeds give 99.07% too). And each seed must fit
    the training set as dense does: loss below 1e-3, 20 times over what any run measured."""
    runs = [train(tmp_path, f"ef1-{seed}", *EF, "--density", "0.01", "--seed", str(seed)) for seed in SEEDS]
    summary = {seed: (r["test_acc"], late_train_loss(r)) for seed, r in zip(SEEDS, runs)}
    assert sum(r["test_acc"] for r in runs) / len(runs) >= 0.98, summary
    assert all(late_train_loss(r) < 1e-3 for r in runs), summary
    assert all(r["compression_stats"]["bytes_ratio"] < 0.03 for r in runs), runs[0]["compression_stats"]


# --lr is per rank (x2 with 2 ranks); the example's default 0.05 is too fast for EF at 0.1%.
SLOW_LR = ("--lr", "0.01")


@pytest.mark.timeout(600)  # six runs: 100 s on 2 cores, up to ~40 s each when shared
def test_error_feedback_at_0_1_percent_learns_what_dropping_it_cannot(tmp_path):
    """Top-K 0.1% with and without error feedback, at a learning rate of 0.01 per rank.

    At the example's default (0.05) the comparison is a coin toss per seed: EF at 0.1% overshoots
    when a large residual is released under momentum (seed 46's training loss climbs from 0.05
    back to 0.7), and without EF test accuracy swings from 81.9% to 96.4%; the per-seed gap was
    14.5, 0.8, 5.6, 5.6 and -1.1 points (seeds 42-46). At 0.01, EF's training loss falls
    steadily (to 0.003-0.008) while without it only the top coordinates ever move and training
    stalls near 0.2:
        seed                          42      43      44      45      46
        EF 0.1%, test accuracy       97.77%  98.33%  97.21%  98.05%  98.05%
        no EF 0.1%, test accuracy    94.99%  91.09%  89.42%  92.48%  91.09%
        gap, points                   2.79    7.24    7.80    5.57    6.96   mean 6.07, sd 2.01
        training loss, no EF / EF     50x     77x     22x     74x     34x    log10: mean 1.67, sd 0.23
    Bounds, on the means over seeds 42-44 (measured: 44x and 5.94 points):
    - training loss without EF at least 10x EF's (geometric mean): log10 margin 0.67, 5 standard
      deviations of a 3-seed mean (0.23 / sqrt 3 = 0.13); every single seed clears it too;
    - test accuracy at least 2 points higher with EF: margin 4.1 points, 3.5 standard deviations
      of a 3-seed mean (2.01 / sqrt 3 = 1.16)."""
    ef, no_ef = [], []
    for seed in SEEDS:
        common = (*EF, "--density", "0.001", *SLOW_LR, "--seed", str(seed))
        ef.append(train(tmp_path, f"ef01-{seed}", *common))
        no_ef.append(train(tmp_path, f"noef01-{seed}", *common, "--no-error-feedback"))
    log_ratio = sum(math.log10(late_train_loss(n) / late_train_loss(e)) for e, n in zip(ef, no_ef)) / len(SEEDS)
    acc_gap = sum(e["test_acc"] - n["test_acc"] for e, n in zip(ef, no_ef)) / len(SEEDS)
    summary = {seed: {"ef": (e["test_acc"], late_train_loss(e)), "no ef": (n["test_acc"], late_train_loss(n))}
               for seed, e, n in zip(SEEDS, ef, no_ef)}
    assert log_ratio >= 1.0, (log_ratio, summary)  # the residuals are live: what was not sent still arrives
    assert acc_gap >= 0.02, (acc_gap, summary)
