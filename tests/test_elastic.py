"""Horovod elastic: examples/pytorch_elastic.py under ``horovodrun --min-np/--max-np
--host-discovery-script``, two hosts that are both this machine ("localhost" and "127.0.0.1",
one slot each, Gloo over ``lo``), with each way of training: the error-feedback optimizer
(``topk-ef``), Horovod's optimizer with the drop-in TopK (``topk``) and Horovod's alone (``dense``).

Each scenario reads the example's per-epoch log (rank 0): the job's size after each epoch; for
``topk-ef`` the size the optimizer averages over (``compression_stats()["world_size"]``), which
must follow it; for ``topk`` the tensors sent dense, which must stay 0 (the drop-in sends dense
only when a rank is in ``hvd.join()``; a step left unfinished by a failed worker must not make it
think so). Every run is bounded by a timeout, so a hang fails the test instead of CI.
"""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # trains for ~20 s per scenario

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "pytorch_elastic.py"
TIMEOUT_S = 240


def discovery_script(tmp_path, log, before, after):
    """Hosts ``before`` until the epoch log has a line, ``after`` from then on."""
    script = tmp_path / "hosts.sh"
    echo = lambda hosts: "; ".join(f"echo {h}" for h in hosts)
    script.write_text("#!/bin/sh\n"
                      f"if [ -f {log} ] && [ \"$(wc -l < {log})\" -ge 1 ]; then {echo(after)}; "
                      f"else {echo(before)}; fi\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


OPTIMIZERS = ["topk-ef", "topk", "dense"]


def run_elastic(tmp_path, optimizer, np_, before, after, *example_args):
    log = tmp_path / "epochs.jsonl"
    script = discovery_script(tmp_path, log, before, after)
    horovodrun = Path(sys.executable).with_name("horovodrun")
    cmd = [str(horovodrun), "-np", str(np_), "--min-np", "1", "--max-np", "2",
           "--network-interface", "lo", "--host-discovery-script", str(script),
           sys.executable, str(EXAMPLE), "--epochs", "4", "--epoch-wait", "2",
           "--epoch-log", str(log), "--optimizer", optimizer, *example_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: no end after {TIMEOUT_S} s: {' '.join(cmd)}\n{(e.stdout or '')[-3000:]}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(cmd)}\n{output[-4000:]}"
    assert "final loss:" in output, output[-3000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [0, 1, 2, 3], lines
    for line in lines:
        if optimizer == "topk-ef":
            assert line["optimizer_world"] == line["size"], f"optimizer averages over a stale size: {lines}"
        if optimizer == "topk":
            assert line["tensors_dense"] == 0, f"the drop-in sent tensors dense: {lines}"
    return lines


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_worker_failure_restores_and_goes_on(tmp_path, optimizer):
    """Rank 1 exits mid-step in epoch 1 (rank 0's buckets in flight): rank 0 restores the last
    commit (pending buckets dropped) and finishes alone."""
    both = ["localhost:1", "127.0.0.1:1"]
    lines = run_elastic(tmp_path, optimizer, 2, both, both, "--fail-rank", "1", "--fail-epoch", "1",
                        "--fail-marker", str(tmp_path / "failed"))
    assert (tmp_path / "failed").exists()
    assert lines[0]["size"] == 2 and lines[-1]["size"] == 1, lines


def test_ranks_renumbered_at_the_same_size(tmp_path):
    """Rank 0 (host localhost) exits mid-step in epoch 1 and a new host replaces it: the job stays
    at 2, and Horovod makes the survivor (127.0.0.1, rank 1 until then) rank 0. The optimizer
    exchanges as rank 0 from then on: with the sparse allreduce both ranks chose the same parts
    of each bucket, and the decode stopped ("received pairs point outside the buffer"; 16-bit
    values went on silently with half of each bucket unsent)."""
    before, after = ["localhost:1", "127.0.0.1:1"], ["localhost:1", "127.0.0.1:1", "127.0.1:1"]
    lines = run_elastic(tmp_path, "topk-ef", 2, before, after, "--fail-rank", "0", "--fail-epoch", "1",
                        "--fail-marker", str(tmp_path / "failed"), "--exchange", "sparse_allreduce")
    assert (tmp_path / "failed").exists()
    assert [line["size"] for line in lines] == [2, 2, 2, 2], lines
    assert [line["optimizer_rank"] for line in lines] == [0, 0, 0, 0], lines  # rank 0 writes the log


def test_host_replaced_at_the_same_size_under_auto(tmp_path):
    """The host of rank 1 leaves and another takes its place at once, no worker failing: the job
    stays at 2 ranks, and the new worker, whose optimizer is built alone, takes over the
    survivor's ``exchange="auto"`` trial through ``hvd.broadcast_optimizer_state`` (it travels in
    the first param group), so both ranks run the same exchange to the end (the survivor kept its
    trial, the new worker started one of its own, and they ran different exchanges)."""
    lines = run_elastic(tmp_path, "topk-ef", 2, ["localhost:1", "127.0.0.1:1"], ["localhost:1", "127.0.1:1"])
    assert [line["size"] for line in lines] == [2, 2, 2, 2], lines


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_worker_added(tmp_path, optimizer):
    """1 -> 2: the new worker builds its optimizer alone (no constructor collective) and joins."""
    lines = run_elastic(tmp_path, optimizer, 1, ["localhost:1"], ["localhost:1", "127.0.0.1:1"])
    assert lines[0]["size"] == 1 and lines[-1]["size"] == 2, lines


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_worker_removed(tmp_path, optimizer):
    """2 -> 1: the host of rank 1 leaves; the optimizer averages over 1 from then on."""
    lines = run_elastic(tmp_path, optimizer, 2, ["localhost:1", "127.0.0.1:1"], ["localhost:1"])
    assert lines[0]["size"] == 2 and lines[-1]["size"] == 1, lines
