"""The named-check harness of tests/dist, single process (no mpirun): the result lines, reading
them back into one verdict per check, the pytest ids, ``raises`` and ``--list``."""

import re
import subprocess
import sys

import pytest

from results import (JOB, failure_message, item_id, item_message, job_message, parse_rank_failures,
                     parse_results, rank_failure_line, result_line, running_line, validate_names)
from mpi import DIST, script_env

sys.path.insert(0, str(DIST))
from harness import raises  # noqa: E402


def job_output(*lines):
    return "\n".join(lines) + "\n"


def test_results_round_trip():
    out = job_output(running_line(0, "a"), running_line(1, "a"),
                     result_line("a", [None, None]),
                     rank_failure_line("b", 1, "Traceback...\nAssertionError: b broke"),
                     "noise from another rank " + result_line("b", [None, "Traceback...\nAssertionError: b broke"]),
                     "OK on 2 ranks")
    results = parse_results(out)
    assert results["a"] == {"name": "a", "passed": True, "ranks": 2, "failed_ranks": [], "errors": {}}
    assert results["b"]["passed"] is False and results["b"]["failed_ranks"] == [1]
    assert parse_rank_failures(out) == {"b": {1: "Traceback...\nAssertionError: b broke"}}
    assert failure_message("a", out) is None
    message = failure_message("b", out)
    assert "'b' failed on rank(s) [1] of 2" in message and "--- rank 1" in message
    assert "AssertionError: b broke" in message


def test_unreported_check_after_a_hang():
    out = job_output(running_line(0, "a"), running_line(1, "a"), result_line("a", [None, None]),
                     running_line(0, "b"), running_line(1, "b"),
                     rank_failure_line("b", 0, "Traceback...\nValueError: half-way"))
    message = failure_message("b", out, "timed out after 240s", tail="TAIL")
    assert message.startswith("check 'b' was not reported: timed out after 240s")
    assert "failed on rank(s) [0] before the ranks could agree" in message and "ValueError: half-way" in message
    assert "last check started, by rank: 0: 'b', 1: 'b'" in message and message.endswith("TAIL")
    message = failure_message("c", out, "timed out after 240s")
    assert "'c' was not reported" in message and "before the ranks could agree" not in message
    assert failure_message("a", out, "timed out after 240s") is None


def test_job_message():
    ok = job_output(result_line("a", [None, None]), result_line("b", [None, None]))
    assert job_message(["a", "b"], ok, 0) is None
    assert "exit status 1 although every check passed" in job_message(["a", "b"], ok, 1)
    assert "not reported: ['c']" in job_message(["a", "b", "c"], ok, 1)
    assert "not listed by --list: ['b']" in job_message(["a"], ok, 0)
    assert "timed out" in job_message(["a", "b"], ok, None, "timed out after 240s")
    failed = job_output(result_line("a", [None, "tb"]), result_line("b", [None, None]))
    assert job_message(["a", "b"], failed, 1) is None  # the failure is the item of check "a"
    assert "exit status 0 although ['a'] failed" in job_message(["a", "b"], failed, 0)


def test_item_message_per_check_and_for_the_job():
    out = job_output(result_line("a", [None, None]))
    assert item_message("a", ["a", "b"], out, 1) is None
    assert item_message("b", ["a", "b"], out, 1).startswith(
        "check 'b' was not reported: the job ended (exit status 1) before rank 0 reported it")
    assert item_message("b", ["a", "b"], out, None, "timed out after 300s").startswith(
        "check 'b' was not reported: timed out after 300s")
    assert item_message(JOB, ["a", "b"], out, 1) == "not reported: ['b']"
    assert item_message(JOB, ["a"], out, 0) is None


def test_item_ids_and_names():
    assert item_id("check_optimizer.py", 3, "contract: sum") == "check_optimizer-np3-contract: sum"
    assert item_id(DIST / "check_mismatch.py", 2, "names") == "check_mismatch-np2-names"
    assert validate_names(iter(["a", "b c"])) == ["a", "b c"]
    for bad in (["a", "a"], [""], ["a\nb"], [" a"], [None]):
        with pytest.raises(ValueError):
            validate_names(bad)


def test_raises():
    with raises(ValueError, match="Adasum") as caught:
        raise ValueError("op=Adasum is not supported")
    assert isinstance(caught.value, ValueError)
    with raises((TypeError, ValueError), match=re.escape("1.5")):
        raise TypeError("momentum 1.5")
    with pytest.raises(AssertionError, match="kwargs x: did not raise ValueError"):
        with raises(ValueError, what="kwargs x"):
            pass
    with pytest.raises(AssertionError, match="does not match"):
        with raises(ValueError, match=re.escape("1.5")):
            raise ValueError("momentum 105")  # "1.5" as a regex would match
    with pytest.raises(KeyError):  # another type goes through unchanged
        with raises(ValueError):
            raise KeyError("x")


def test_list_starts_no_mpi():
    code = ("import sys; import harness; "
            "harness.run([('one', None), ('two', None)], ['--list']); "
            "assert 'mpi4py.MPI' not in sys.modules and harness.COMM is None")
    proc = subprocess.run([sys.executable, "-c", code], cwd=DIST, env=script_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["one", "two"]
