"""The main job, end to end under mpirun -np 2: accuracy and bytes on the digits example."""

import json
from pathlib import Path

import pytest

from mpi import run_mpi

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pytorch_digits.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def train(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    run_mpi(2, EXAMPLE, "--quiet", "--json", out, *args, timeout=400)
    return json.loads(out.read_text())


def test_topk_dropin_reaches_90_percent_with_under_3_percent_of_the_bytes(tmp_path):
    result = train(tmp_path, "topk", "--compression", "topk", "--density", "0.01")
    assert result["test_acc"] >= 0.90, result["test_acc"]
    assert result["bytes_ratio"] <= 0.03, result["bytes_ratio"]
    # hand-computed bound: 1% of the elements as 8-byte pairs is 2% of dense fp32, plus small change
    assert result["bytes_ratio"] >= 0.01


def test_error_feedback_keeps_accuracy(tmp_path):
    dense = train(tmp_path, "dense", "--compression", "none")
    ef = ("--optimizer", "topk-ef", "--exchange", "allgather")  # auto may (rightly) go dense here
    ef_1 = train(tmp_path, "ef1", *ef, "--density", "0.01")
    ef_01 = train(tmp_path, "ef01", *ef, "--density", "0.001")
    no_ef_01 = train(tmp_path, "noef01", *ef, "--density", "0.001", "--no-error-feedback")
    summary = {r["optimizer"] + str(r["density"]) + str(r["error_feedback"]): r["test_acc"]
               for r in (dense, ef_1, ef_01, no_ef_01)}
    assert dense["test_acc"] - ef_1["test_acc"] <= 0.01, summary
    assert ef_01["test_acc"] - no_ef_01["test_acc"] >= 0.05, summary
    assert ef_1["compression_stats"]["bytes_ratio"] < 0.03, ef_1["compression_stats"]
