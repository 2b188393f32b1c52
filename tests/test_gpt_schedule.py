"""examples/gpt_model.py's schedule helpers, by hand: the learning-rate warm-up's length, and the
note that on long runs the AdamW recipe's dense start spans a long warm-up (docs/adamw.md,
long runs)."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
_SPEC = importlib.util.spec_from_file_location("gpt_model", EXAMPLES / "gpt_model.py")
gpt_model = importlib.util.module_from_spec(_SPEC)
sys.path.insert(0, str(EXAMPLES))  # its siblings (cli), as when an example script imports it
try:
    _SPEC.loader.exec_module(gpt_model)
finally:
    sys.path.remove(str(EXAMPLES))


def args(steps, warmup_steps=100, adam="local", lr_warmup=0.1, lr=1.0, density=0.01, lr_schedule="cosine"):
    return argparse.Namespace(steps=steps, warmup_steps=warmup_steps, adam=adam, lr_warmup=lr_warmup, lr=lr,
                              density=density, lr_schedule=lr_schedule)


@pytest.mark.parametrize("steps, lr_warmup, expected", [(10000, 0.1, 1000), (1000, 0.1, 100), (300, 0.1, 30),
                                                         (5, 0.1, 1), (3000, 0.0, 1)])
def test_lr_warmup_steps_is_the_ramp_of_lr_at(steps, lr_warmup, expected):
    a = args(steps, lr_warmup=lr_warmup)
    assert gpt_model.lr_warmup_steps(a) == expected
    # the rate rises by lr / expected a step up to its peak at step expected - 1, then decays
    assert gpt_model.lr_at(expected - 1, a) == pytest.approx(1.0)
    if expected > 1:
        assert gpt_model.lr_at(0, a) == pytest.approx(1.0 / expected)
    assert gpt_model.lr_at(expected, a) == pytest.approx(1.0)  # the cosine starts at its top
    assert gpt_model.lr_at(expected + 1, a) < 1.0


def test_wsd_holds_the_rate_then_decays_linearly_over_the_last_fifth():
    a = args(1000, lr_schedule="wsd", lr=2.0)                # warm-up 100 steps, decay over steps 800-999
    assert gpt_model.lr_at(49, a) == pytest.approx(1.0)      # half-way up the warm-up
    assert [gpt_model.lr_at(s, a) for s in (99, 100, 500, 800)] == pytest.approx([2.0] * 4)
    assert gpt_model.lr_at(900, a) == pytest.approx(1.0)     # 100 of the decay's 200 steps left
    assert gpt_model.lr_at(999, a) == pytest.approx(2.0 / 200)


def test_wsd_refuses_a_warmup_that_runs_into_its_decay():
    p = argparse.ArgumentParser()
    gpt_model.add_training_arguments(p)
    ok = p.parse_args(["--steps", "1000", "--lr-schedule", "wsd", "--lr-warmup", "0.8"])  # 800 + 200 steps
    gpt_model.check_training_arguments(p, ok)
    late = p.parse_args(["--steps", "1000", "--lr-schedule", "wsd", "--lr-warmup", "0.81"])
    with pytest.raises(SystemExit):
        gpt_model.check_training_arguments(p, late)
    cosine = p.parse_args(["--steps", "1000", "--lr-warmup", "0.81"])                  # no decay window to hit
    gpt_model.check_training_arguments(p, cosine)


def test_dense_start_note_names_a_long_warmup_when_the_start_ends_first():
    note = gpt_model.dense_start_note(args(10000, warmup_steps=100))
    assert "(1000 steps)" in note and "--warmup-steps 1000" in note
    note = gpt_model.dense_start_note(args(20000, warmup_steps=1000))
    assert "(2000 steps)" in note and "--warmup-steps 2000" in note
    note = gpt_model.dense_start_note(args(5000, warmup_steps=100))   # a 500-step warm-up: the threshold
    assert "(500 steps)" in note and "--warmup-steps 500" in note
    # at 0.1% the start over a 300-step warm-up measured better (+6.0% against +9.9%, 3 seeds)
    note = gpt_model.dense_start_note(args(3000, warmup_steps=100, density=0.001))
    assert "(300 steps)" in note and "--warmup-steps 300" in note


@pytest.mark.parametrize("a", [
    args(1000, warmup_steps=100),             # as long as the warm-up: the recipe at 1000 steps
    args(300, warmup_steps=100),              # longer than the warm-up (30 steps)
    args(3000, warmup_steps=100),             # a 300-step warm-up at 1%: 100 steps measured better than 300
    args(2990, warmup_steps=100, density=0.001),  # a 299-step warm-up at 0.1%: below its threshold
    args(1000, warmup_steps=100, density=0.001),  # at 0.1% and 1000 steps: 200 of both gained nothing
    args(4990, warmup_steps=100),             # a 499-step warm-up: below the long-run threshold
    args(10000, warmup_steps=1000),           # the long-run recipe
    args(10000, warmup_steps=0),              # no dense start asked for: nothing to stretch
    args(10000, warmup_steps=100, adam="adamw"),  # not the LocalAdamW recipe
])
def test_dense_start_note_is_silent_otherwise(a):
    assert gpt_model.dense_start_note(a) is None
