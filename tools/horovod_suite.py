"""Run Horovod's own optimizer tests with ``hvd_topk.DistributedOptimizer`` in place of Horovod's.

Horovod's ``test/parallel/test_torch.py`` (v0.28.1) is not part of this repository and is not
in Horovod's PyPI sdist either (the sdist has no ``test/`` folder): give the runner a Horovod
git checkout (or a bare git directory; the two files it needs are read with ``git show``)::

    git clone https://github.com/horovod/horovod /tmp/horovod      # once, anywhere
    python tools/horovod_suite.py --horovod /tmp/horovod             # ref v0.28.1, np 2 and 3

or a folder laid out like Horovod's ``test/`` (``parallel/test_torch.py`` and
``utils/common.py``), or the path of ``test_torch.py`` itself (``../utils/common.py`` beside it).

What it runs: every ``TorchTests`` method whose body calls ``hvd.DistributedOptimizer`` (found by
reading the file, so the selection follows the file), each rank under ``mpirun -np N`` with
pytest, once per mode and world size:

    stock             Horovod's own ``hvd.DistributedOptimizer`` (the baseline)
    auto-default      ``hvd_topk.DistributedOptimizer`` with its defaults (exchange="auto",
                      min_numel=1024: the tests' small tensors go through a dense allreduce)
    allgather, sparse_allreduce, dense, auto
                      ``exchange=`` pinned to that, and ``min_numel=0`` so that every float
                      tensor, however small, is Top-K selected with error feedback

In the hvd_topk modes ``horovod.torch.DistributedOptimizer`` is replaced, in each rank, by a
function that calls ``hvd_topk.DistributedOptimizer`` with the test's own arguments plus the
mode's ``exchange=`` / ``min_numel=`` (unless the test passes them). Horovod's ``common.py``
imports the PyPI ``mock`` package; ``unittest.mock`` stands in for it when it is missing.
``--hide-optimizers Muon`` (the default; ``""`` for none): the tests loop over every
``torch.optim`` optimizer class; ``torch.optim.Muon`` (torch >= 2.9, newer than the tests) takes
2-D parameters only and fails test_broadcast_state, test_broadcast_state_options and
test_force_allreduce in its own constructor, stock Horovod included, ending the loop before
NAdam .. SGD: it is hidden from the loops (its ``__module__`` changed, in the ranks only).
``HOROVOD_DYNAMIC_PROCESS_SETS=1`` is set (unless set already): test_optimizer_process_sets adds
process sets after ``hvd.init()``, which Horovod refuses otherwise.

Options: ``--modes stock,allgather,...`` (default: all), ``--np 2,3``, ``--ref v0.28.1``,
``--tests test_a,test_b`` (a subset), ``--timeout 900`` (seconds per mpirun job; a hung job is
killed and its unfinished tests reported as "hang"), ``--lock FILE`` (each mpirun job holds an
exclusive ``flock`` on FILE, as ``flock FILE cmd`` would; its timeout starts once it has it),
``--out DIR`` (per-rank records and mpirun logs), ``--json FILE`` (the results).
The hvd_topk under test is the one Python imports (set ``PYTHONPATH`` to test another tree).
Exit status 0 when every test that passes in "stock" passes in every hvd_topk mode.

Result per test and job: passed (on every rank, or skipped on some), skipped (on every rank),
failed (on any rank; the first line of the error is kept), hang (not finished by some rank
when the job was killed), not run (the job ended before it).
"""

import argparse
import ast
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = ("stock", "auto-default", "allgather", "sparse_allreduce", "dense", "auto")
TEST_FILE = "test/parallel/test_torch.py"
COMMON_FILE = "test/utils/common.py"
CLASS = "TorchTests"


# ---- the test file -------------------------------------------------------------------------
def materialize(source, ref, workdir):
    """The path of ``test_torch.py`` with ``../utils/common.py`` beside it, from ``source``."""
    source = Path(source)
    if source.is_file():
        return source
    for test in (source / "parallel" / "test_torch.py", source / TEST_FILE):
        if test.is_file() and (test.parent.parent / "utils" / "common.py").is_file():
            if ref is None:
                return test
            break
    git_dir = source
    is_git = subprocess.run(["git", "-C", str(git_dir), "rev-parse", "--git-dir"],
                            capture_output=True).returncode == 0
    if not is_git:
        raise SystemExit(f"{source}: neither test_torch.py, a Horovod test/ folder nor a git checkout")
    ref = ref or "v0.28.1"
    root = Path(workdir) / "horovod-test"
    for path in (TEST_FILE, COMMON_FILE):
        text = subprocess.run(["git", "-C", str(git_dir), "show", f"{ref}:{path}"],
                              capture_output=True, text=True, check=True).stdout
        dest = root / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    return root / TEST_FILE


def optimizer_tests(test_file):
    """``TorchTests`` methods that call ``hvd.DistributedOptimizer``, in file order."""
    tree = ast.parse(Path(test_file).read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == CLASS:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_") and any(
                        isinstance(n, ast.Attribute) and n.attr == "DistributedOptimizer"
                        for n in ast.walk(fn)):
                    names.append(fn.name)
    return names


# ---- one rank (under mpirun) ---------------------------------------------------------------
class _Record:
    """pytest plugin: each test's outcome on this rank, appended as it is known (a hung job
    still leaves the outcomes of the tests before the hang)."""

    def __init__(self, path):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            message = ""
            if report.outcome == "failed":
                text = str(report.longrepr)
                lines = [l for l in text.splitlines() if l.startswith("E ")]
                message = (lines[0][1:].strip() if lines else text.splitlines()[-1])[:300]
            elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                message = str(report.longrepr[2])[:300]
            with open(self.path, "a") as f:
                f.write(json.dumps({"test": report.nodeid.split("::")[-1], "when": report.when,
                                    "outcome": report.outcome, "message": message}) + "\n")

    def pytest_runtest_logstart(self, nodeid, location):
        with open(self.path, "a") as f:
            f.write(json.dumps({"test": nodeid.split("::")[-1], "when": "start"}) + "\n")


def worker(args):
    import unittest.mock
    try:
        import mock  # noqa: F401  (Horovod's common.py imports the PyPI backport)
    except ImportError:
        sys.modules["mock"] = unittest.mock
    import horovod.torch as hvd
    import pytest
    import torch

    if args.mode != "stock":
        import hvd_topk
        extra = {} if args.mode == "auto-default" else {"exchange": args.mode, "min_numel": 0}

        def DistributedOptimizer(optimizer, *a, **kw):
            for key, value in extra.items():
                kw.setdefault(key, value)
            return hvd_topk.DistributedOptimizer(optimizer, *a, **kw)

        hvd.DistributedOptimizer = DistributedOptimizer
    for name in filter(None, args.hide.split(",")):
        # The tests loop over torch.optim.Optimizer.__subclasses__() from module torch.optim*;
        # an optimizer newer than the tests (Muon: 2-D parameters only) fails them at its own
        # constructor, before any DistributedOptimizer, and ends the loop early.
        cls = getattr(torch.optim, name, None)
        if cls is not None:
            cls.__module__ = "hidden_from_horovod_tests"
    hvd.init()
    record = Path(args.record) / f"rank{hvd.rank()}.jsonl"
    ids = [f"{args.test_file}::{CLASS}::{t}" for t in args.tests.split(",")]
    code = pytest.main([*ids, "-q", "-p", "no:cacheprovider", "-W", "default",
                        "--rootdir", str(Path(args.test_file).parent)], plugins=[_Record(record)])
    sys.exit(int(code))


# ---- the driver ----------------------------------------------------------------------------
def combine(record_dir, np, tests, killed):
    """Per test: one outcome over the ranks (see the module docstring)."""
    per_rank = []
    for rank in range(np):
        path = Path(record_dir) / f"rank{rank}.jsonl"
        started, outcomes = set(), {}
        if path.exists():
            for line in path.read_text().splitlines():
                r = json.loads(line)
                if r["when"] == "start":
                    started.add(r["test"])
                elif r["test"] not in outcomes or r["outcome"] == "failed":
                    if r["test"] not in outcomes or outcomes[r["test"]][0] != "failed":
                        outcomes[r["test"]] = (r["outcome"], r["message"])
        per_rank.append((started, outcomes))
    results = {}
    for t in tests:
        got = [o.get(t) for _, o in per_rank]
        failed = [g for g in got if g and g[0] == "failed"]
        if failed:
            results[t] = ("failed", failed[0][1])
        elif any(g is None for g in got):
            hung = killed and any(t in s for s, _ in per_rank)
            results[t] = ("hang" if hung else "not run", "")
        elif all(g[0] == "skipped" for g in got):
            results[t] = ("skipped", got[0][1])
        else:
            results[t] = ("passed", "")
    return results


def run_job(mode, np, test_file, tests, out, timeout, lock, hide):
    sys.path.append(str(REPO))  # (after PYTHONPATH: the hvd_topk under test may be another tree)
    from tools.launch import mpirun_command

    record = Path(out) / f"{mode}-np{np}"
    shutil.rmtree(record, ignore_errors=True)
    record.mkdir(parents=True)
    cmd = mpirun_command(np, [__file__, "--worker", "--mode", mode, "--test-file", str(test_file),
                              "--record", str(record), "--tests", ",".join(tests),
                              "--hide", hide],
                         env_names=("OMP_NUM_THREADS", "PYTHONPATH"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
    # test_optimizer_process_sets adds process sets after hvd.init(), which Horovod allows only so
    env.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    with _locked(lock):  # the timeout starts once the lock is held
        return _run_locked(cmd, env, record, np, tests, timeout)


@contextlib.contextmanager
def _locked(path):
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # what flock(1) takes: jobs run one at a time
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run_locked(cmd, env, record, np, tests, timeout):
    t0 = time.time()
    with open(record / "mpirun.log", "w") as log, subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True) as popen:
        try:
            popen.wait(timeout=timeout)
            killed = False
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
            killed = True
    return combine(record, np, tests, killed), time.time() - t0, killed


def table(results, tests, columns):
    head = "| test | " + " | ".join(columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for t in tests:
        lines.append(f"| {t} | " + " | ".join(results[c][t][0] for c in columns) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--horovod", help="Horovod checkout / git dir / test folder / test_torch.py")
    parser.add_argument("--ref", default=None, help="git ref to read the tests from (default v0.28.1)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--np", default="2,3")
    parser.add_argument("--tests", default=None, help="comma-separated subset of the optimizer tests")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--lock", default=None, help="hold flock(FILE) during each mpirun job")
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--hide-optimizers", default="Muon",
                        help="torch.optim classes the tests' optimizer loops skip ('' for none)")
    # one rank
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--test-file", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--hide", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if not args.horovod:
        parser.error("--horovod is required (a Horovod checkout; see the docstring)")
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            parser.error(f"unknown mode {m!r}; one of {', '.join(MODES)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="horovod-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    test_file = materialize(args.horovod, args.ref, out).resolve()
    tests = optimizer_tests(test_file)
    if args.tests:
        wanted = args.tests.split(",")
        unknown = set(wanted) - set(tests)
        if unknown:
            parser.error(f"not optimizer tests of {test_file}: {', '.join(sorted(unknown))}")
        tests = [t for t in tests if t in wanted]
    print(f"{len(tests)} optimizer tests from {test_file}; records in {out}", flush=True)
    results, summary = {}, []
    for np in [int(n) for n in args.np.split(",")]:
        for mode in modes:
            column = f"{mode} np{np}"
            res, seconds, killed = run_job(mode, np, test_file, tests, out, args.timeout, args.lock,
                                           args.hide_optimizers)
            results[column] = res
            counts = {k: sum(v[0] == k for v in res.values()) for k in ("passed", "failed", "skipped", "hang", "not run")}
            summary.append((column, counts, seconds, killed))
            print(f"{column}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
                  + f" ({seconds:.0f} s{', killed' if killed else ''})", flush=True)
            for t, (outcome, message) in res.items():
                if outcome in ("failed", "hang"):
                    print(f"    {t}: {outcome} {message}", flush=True)
    columns = list(results)
    print(table(results, tests, columns))
    if args.json:
        Path(args.json).write_text(json.dumps({"test_file": str(test_file), "tests": tests,
                                               "results": results}, indent=1))
    # parity: what stock passes, every hvd_topk mode passes (same world size)
    ok = True
    for column, res in results.items():
        mode, np = column.rsplit(" ", 1)
        stock = results.get(f"stock {np}")
        if mode == "stock" or stock is None:
            continue
        for t in tests:
            if stock[t][0] == "passed" and res[t][0] != "passed":
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
