"""The lines a tests/dist script prints about its named checks, and reading them back.

Pure Python (no MPI, no torch), shared by tests/dist/harness.py, which prints the lines on the
ranks, and tests/test_distributed.py, which reads them from the mpirun job's output:

- ``[rank R] running NAME``: every rank, before each check (the last one shows where a hang is);
- ``RANK_FAILURE_PREFIX {json}``: a rank, at once, when a check fails there, so the failure is
  known by name even if the job hangs or is aborted afterwards;
- ``RESULT_PREFIX {json}``: rank 0, once every rank has finished the check: the verdict agreed
  by all ranks, with the failing ranks' tracebacks.
"""

import json
import re

RESULT_PREFIX = "hvd_topk-check-result: "
RANK_FAILURE_PREFIX = "hvd_topk-check-failed-on-rank: "
_RUNNING = re.compile(r"\[rank (\d+)\] running (.+)$")


def validate_names(names):
    """The check names as a list; raises ValueError unless they are unique one-line strings."""
    names = list(names)
    seen = set()
    for name in names:
        if not isinstance(name, str) or not name.strip() or "\n" in name or name != name.strip():
            raise ValueError(f"a check name must be a non-empty one-line string without surrounding "
                             f"spaces, got {name!r}")
        if name in seen:
            raise ValueError(f"check name {name!r} is used twice")
        seen.add(name)
    return names


def running_line(rank, name):
    return f"[rank {rank}] running {name}"


def rank_failure_line(name, rank, error):
    return RANK_FAILURE_PREFIX + json.dumps({"name": name, "rank": rank, "traceback": error})


def result_line(name, errors):
    """Rank 0's line for one check; ``errors[r]`` is rank r's traceback, None where it passed."""
    failed = [r for r, e in enumerate(errors) if e is not None]
    return RESULT_PREFIX + json.dumps({"name": name, "passed": not failed, "ranks": len(errors),
                                       "failed_ranks": failed,
                                       "errors": {str(r): errors[r] for r in failed}})


def _records(text, prefix):
    for line in text.splitlines():
        at = line.find(prefix)  # mpirun may glue another rank's partial output in front
        if at < 0:
            continue
        try:
            record = json.loads(line[at + len(prefix):])
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("name"), str):
            yield record


def parse_results(text):
    """``{name: record}`` for every check rank 0 reported (the last line wins if repeated)."""
    return {r["name"]: r for r in _records(text, RESULT_PREFIX)}


def parse_rank_failures(text):
    """``{name: {rank: traceback}}`` from the lines failing ranks print at once."""
    failures = {}
    for r in _records(text, RANK_FAILURE_PREFIX):
        failures.setdefault(r["name"], {})[int(r.get("rank", -1))] = r.get("traceback") or ""
    return failures


def last_running(text):
    """``{rank: name}``: the last check each rank said it was starting."""
    last = {}
    for line in text.splitlines():
        m = _RUNNING.search(line)
        if m:
            last[int(m.group(1))] = m.group(2)
    return last


def _tracebacks(errors):
    return "\n".join(f"--- rank {rank}\n{tb.rstrip()}" for rank, tb in sorted(errors.items()))


def failure_message(name, stdout, job_problem=None, tail=""):
    """None when check ``name`` passed, else what went wrong, for the pytest item of that check.

    ``job_problem`` says how the job ended when it did not finish normally (a timeout, a crash);
    it explains a check rank 0 never reported. ``tail`` is the end of the job's output.
    """
    result = parse_results(stdout).get(name)
    if result is not None:
        if result.get("passed") is True:
            return None
        errors = {int(r): tb for r, tb in (result.get("errors") or {}).items()}
        return (f"check {name!r} failed on rank(s) {result.get('failed_ranks')} of "
                f"{result.get('ranks')}\n{_tracebacks(errors)}")
    lines = [f"check {name!r} was not reported: {job_problem or 'the job ended without reaching it'}"]
    early = parse_rank_failures(stdout).get(name)
    if early:
        lines.append(f"it had failed on rank(s) {sorted(early)} before the ranks could agree:\n"
                     f"{_tracebacks(early)}")
    running = last_running(stdout)
    if running:
        lines.append("last check started, by rank: "
                     + ", ".join(f"{rank}: {n!r}" for rank, n in sorted(running.items())))
    if tail:
        lines.append(f"--- end of the job's output\n{tail}")
    return "\n".join(lines)


def job_message(names, stdout, returncode, job_problem=None, tail=""):
    """None when the job reported exactly ``names`` and its exit status agrees, else why not."""
    results = parse_results(stdout)
    problems = []
    if job_problem:
        problems.append(job_problem)
    missing = [n for n in names if n not in results]
    if missing:
        problems.append(f"not reported: {missing}")
    unexpected = [n for n in results if n not in names]
    if unexpected:
        problems.append(f"reported but not listed by --list: {unexpected}")
    failed = [n for n, r in results.items() if r.get("passed") is not True]
    if not job_problem and not missing:
        if failed and returncode == 0:
            problems.append(f"exit status 0 although {failed} failed")
        if not failed and returncode != 0:
            problems.append(f"exit status {returncode} although every check passed")
    if not problems:
        return None
    return "\n".join(problems + ([f"--- end of the job's output\n{tail}"] if tail else []))


JOB = "(job)"  # the name of the pytest item for a job as a whole, beside one item per check


def item_message(name, names, stdout, returncode, job_problem=None, tail=""):
    """None when pytest item ``name`` passed, else why not: ``JOB`` (``job_message``: every
    check in ``names`` reported, the exit status agreeing) or one check (``failure_message``)."""
    if name == JOB:
        return job_message(names, stdout, returncode, job_problem, tail)
    ended = job_problem or f"the job ended (exit status {returncode}) before rank 0 reported it"
    return failure_message(name, stdout, ended, tail)


def item_id(script, np, name):
    """The pytest id of one check of one job: ``check_optimizer-np3-contract: sum``."""
    stem = str(script).rsplit("/", 1)[-1]
    stem = stem[:-3] if stem.endswith(".py") else stem
    return f"{stem}-np{np}-{name}"
