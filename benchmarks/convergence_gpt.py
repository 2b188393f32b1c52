#!/usr/bin/env python
r"""Convergence on the transformer workload (examples/pytorch_gpt.py, AdamW): dense, Horovod fp16,
hvd_topk 1% and 0.1% with and without error feedback, over several seeds, at a fixed step budget.

Every run is ``mpirun -np 2 python examples/pytorch_gpt.py --quiet --json OUT --steps N --seed S ARGS``;
the ``ddp-*`` configs run ``torchrun --standalone --nproc_per_node 2 examples/ddp_gpt.py ...`` (the
same model, corpus and batches through DistributedDataParallel and a communication hook).

    .venv/bin/python benchmarks/convergence_gpt.py                     # 6 configs x 3 seeds x 300 steps
    .venv/bin/python benchmarks/convergence_gpt.py --configs dense dense-fv fv-1% fv-0.1% fv-noef-0.1% \
        --out-prefix benchmarks/results/gpt/convergence-gpt-frozen-variance   # FrozenVarianceAdamW
    .venv/bin/python benchmarks/convergence_gpt.py --configs dense fv-0.1%-freeze100 fv-noef-0.1%-freeze100 \
        --out-prefix benchmarks/results/gpt/convergence-gpt-frozen-variance-freeze100
    .venv/bin/python benchmarks/convergence_gpt.py --configs dense local-1% local-0.1% local-noef-0.1% \
        --steps 1000 --timeout 1500 --out-prefix benchmarks/results/gpt/convergence-gpt-local-1000   # LocalAdamW
    .venv/bin/python benchmarks/convergence_gpt.py --configs dense ef-1% --seeds 42 --steps 60 \
        --out-prefix /tmp/gpt-smoke                                     # quick check
    .venv/bin/python benchmarks/convergence_gpt.py --configs gv-1%-lr1.5e-2-fp16v-sketch256-hier \
        gv-1%-lr1.5e-2-fp16v-sketch256 --np 8 --ranks-per-host 4 --steps 1000   # 2 emulated hosts of 4 (root)

Writes PREFIX.json (every run with its validation history, command, machine, date), PREFIX.md
(final validation loss: mean, sample std, min-max over seeds; vs dense) and PREFIX.png (the
validation loss curves, mean over seeds, shaded min-max). Default PREFIX:
benchmarks/results/gpt/convergence-gpt.
"""

import argparse
import contextlib
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emulated_hosts, fmt_s, machine_info, run_example, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pytorch_gpt.py"


def code_fingerprint():
    """SHA-256 (16 hex digits) of the code a run's numbers depend on: the ``hvd_topk`` that the
    examples import (``PYTHONPATH`` first, as they find it) and this checkout's examples. A git
    commit does not say it: a tree with uncommitted changes, or runs importing another checkout."""
    import hashlib
    import importlib.util
    spec = importlib.util.find_spec("hvd_topk")
    package = Path(spec.origin).parent if spec and spec.origin else ROOT / "hvd_topk"
    digest = hashlib.sha256()
    for base, pattern in ((package, "**/*.py"), (package / "native", "*.cpp"), (ROOT / "examples", "*.py")):
        for path in sorted(base.glob(pattern)):
            if "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def reusable(run, code):
    """Whether an earlier run stands for one made now: made by the same code (``code_fingerprint``);
    a run recorded before the fingerprint existed only for dense AdamW (Horovod's optimizer, no
    hvd_topk: its runs reproduced bit for bit across hvd_topk's changes, 2026-12-05), since the
    compressed ones changed with the library (ba1194f moved the 1% recipe's losses)."""
    made = run.get("made") or {}
    if made.get("code"):
        return made["code"] == code
    return horovod_adamw(run)


def horovod_adamw(run):
    """Whether ``run`` trained with Horovod's optimizer over torch's AdamW (no hvd_topk in it:
    ``dense-fv`` is Horovod's optimizer over hvd_topk's FrozenVarianceAdamW, which changed)."""
    args = run.get("args_used")
    args = args.split() if args else list(CONFIGS.get(run["config"], ("", ["--adam", "?"]))[1])
    value = lambda flag, default: args[args.index(flag) + 1] if flag in args[:-1] else default
    return (run["config"].startswith("dense") and value("--optimizer", "horovod") == "horovod"
            and value("--adam", "adamw") == "adamw")


def earlier_runs(paths, code):
    """The runs of ``--reuse`` files that ``reusable`` allows, by (config, ARGS, steps, seed,
    ranks), and the names of those it does not. A reusable run is never shadowed by a stale one
    of the same key in a later file (a file holding the old runs of what another re-ran)."""
    earlier = {}
    for path in paths:
        saved = json.loads(Path(path).read_text())
        file_meta = saved.get("meta", {})
        made = {"date": file_meta.get("date"), "git": file_meta.get("machine", {}).get("git"),
                "command": file_meta.get("command"), "file": Path(path).name}
        for r in saved["runs"]:
            # the rank count is part of the key: a 2-rank run must not stand in for a 4-rank one
            key = (r["config"], r.get("args_used"), r["steps"], r["seed"], r.get("ranks"))
            run = dict(r, made={"file": Path(path).name, **(r.get("made") or made)})
            if key not in earlier or reusable(run, code) or not reusable(earlier[key], code):
                earlier[key] = run
    stale = sorted({f"{k[0]} seed {k[3]}" for k, r in earlier.items() if not reusable(r, code)})
    return {k: r for k, r in earlier.items() if reusable(r, code)}, stale


EF = ["--optimizer", "topk-ef", "--exchange", "allgather"]  # the exchange pinned: auto may go dense
GV = [*EF, "--adam", "local"]  # LocalAdamW's defaults since 2026-11-25: lr in the residual, global variance
OLD = ["--no-lr-in-residual", "--no-global-variance"]  # LocalAdamW as it was before (the rows measured then)
START = ["--warmup-steps", "100", "--warmup-density", "1.0"]  # the dense start
GV_DENSE = ["--optimizer", "topk-ef", "--adam", "local", "--exchange", "dense"]  # LocalAdamW, no compression
RECOMMENDED = [*GV, "--density", "0.01", *START, "--lr", "1e-2", "--fp16-values"]  # the 1000-step recommended scheme
CONFIGS = {
    "dense": ("Horovod dense fp32", ["--compression", "none"]),
    "fp16": ("Horovod fp16", ["--compression", "fp16"]),
    "ef-1%": ("hvd_topk 1%, error feedback", [*EF, "--density", "0.01"]),
    "noef-1%": ("hvd_topk 1%, no error feedback", [*EF, "--density", "0.01", "--no-error-feedback"]),
    "ef-0.1%": ("hvd_topk 0.1%, error feedback", [*EF, "--density", "0.001"]),
    "noef-0.1%": ("hvd_topk 0.1%, no error feedback", [*EF, "--density", "0.001", "--no-error-feedback"]),
    "ef-1%-bucket-warm": ("hvd_topk 1%, EF, bucket scope, dense start decaying over 100 steps",
                          [*EF, "--density", "0.01", "--selection-scope", "bucket", "--warmup-steps", "100",
                           "--warmup-density", "1.0"]),
    # hvd_topk.FrozenVarianceAdamW: the variance frozen after a dense start (1-bit Adam's structure)
    "dense-fv": ("Horovod dense fp32, FrozenVarianceAdamW frozen at step 100",
                 ["--compression", "none", "--adam", "frozen-variance", "--freeze-step", "100"]),
    "fv-1%": ("hvd_topk 1%, EF, FrozenVarianceAdamW + momentum correction, dense start and freeze over 100 steps",
              [*EF, "--density", "0.01", "--adam", "frozen-variance", "--freeze-step", "100",
               "--warmup-steps", "100", "--warmup-density", "1.0"]),
    "fv-0.1%": ("hvd_topk 0.1%, EF, FrozenVarianceAdamW + momentum correction, dense start and freeze over 150 steps",
                [*EF, "--density", "0.001", "--adam", "frozen-variance", "--freeze-step", "150",
                 "--warmup-steps", "150", "--warmup-density", "1.0"]),
    "fv-0.1%-freeze100": ("hvd_topk 0.1%, EF, FrozenVarianceAdamW + momentum correction, dense start over 150 steps, "
                          "frozen at step 100",
                          [*EF, "--density", "0.001", "--adam", "frozen-variance", "--freeze-step", "100",
                           "--warmup-steps", "150", "--warmup-density", "1.0"]),
    "fv-noef-0.1%": ("hvd_topk 0.1%, no EF, FrozenVarianceAdamW (momentum inside), the same start and freeze",
                     [*EF, "--density", "0.001", "--no-error-feedback", "--adam", "frozen-variance",
                      "--freeze-step", "150", "--warmup-steps", "150", "--warmup-density", "1.0"]),
    "fv-noef-0.1%-freeze100": ("hvd_topk 0.1%, no EF, FrozenVarianceAdamW (momentum inside), dense start over "
                               "150 steps, frozen at step 100",
                               [*EF, "--density", "0.001", "--no-error-feedback", "--adam", "frozen-variance",
                                "--freeze-step", "100", "--warmup-steps", "150", "--warmup-density", "1.0"]),
    # hvd_topk.LocalAdamW: Adam on each rank's own gradient, its update exchanged (beta1 0 unless said)
    "local-1%": ("hvd_topk 1%, EF, LocalAdamW (beta1 0), dense start decaying over 100 steps",
                 [*EF, "--density", "0.01", "--adam", "local", *OLD, "--warmup-steps", "100", "--warmup-density", "1.0"]),
    "local-0.1%": ("hvd_topk 0.1%, EF, LocalAdamW (beta1 0), dense start decaying over 100 steps",
                   [*EF, "--density", "0.001", "--adam", "local", *OLD, "--warmup-steps", "100", "--warmup-density", "1.0"]),
    "local-noef-0.1%": ("hvd_topk 0.1%, no EF, LocalAdamW (beta1 0), the same start",
                        [*EF, "--density", "0.001", "--no-error-feedback", "--adam", "local", *OLD, "--warmup-steps",
                         "100", "--warmup-density", "1.0"]),
    "local-1%-nostart": ("hvd_topk 1%, EF, LocalAdamW (beta1 0), no dense start",
                         [*EF, "--density", "0.01", "--adam", "local", *OLD]),
    "local-1%-beta1": ("hvd_topk 1%, EF, LocalAdamW with beta1 0.9, no dense start",
                       [*EF, "--density", "0.01", "--adam", "local", *OLD, "--beta1", "0.9"]),
    # the long-run recipe (issue 26): LocalAdamW normalising by the ranks' average's variance,
    # lr inside the residual (docs/adamw.md)
    "local-dense": ("LocalAdamW (beta1 0), dense exchange: no compression",
                    ["--optimizer", "topk-ef", "--adam", "local", *OLD, "--exchange", "dense"]),
    "gv-dense": ("LocalAdamW (beta1 0), global variance, dense exchange: no compression",
                 GV_DENSE),
    "gv-1%": ("hvd_topk 1%, EF, LocalAdamW global variance + lr in residual, dense start over 100 steps",
              [*GV, "--density", "0.01", *START]),
    "gv-0.1%": ("hvd_topk 0.1%, EF, LocalAdamW global variance + lr in residual, dense start over 100 steps",
                [*GV, "--density", "0.001", *START]),
    "gv-1%-lean": ("hvd_topk 1%, the same, the start decaying from 25% instead of 100% (fewer bytes)",
                   [*GV, "--density", "0.01", "--warmup-steps", "100", "--warmup-density", "0.25"]),
    "gv-noef-1%": ("hvd_topk 1%, no EF, LocalAdamW global variance, the same start",
                   [*EF, "--adam", "local", "--no-lr-in-residual", "--no-error-feedback", "--density", "0.01", *START]),
    "gv-1%-fp16v": ("hvd_topk 1%, the gv-1% recipe with 16-bit values (TopK(fp16_values=True); dense fallback in fp16)",
                    [*GV, "--density", "0.01", *START, "--fp16-values"]),
    "demo-1%": ("hvd_topk 1%, DeMo (sign, beta 0.999, lr 3e-3), the same dense start",
                [*EF, "--adam", "demo", "--density", "0.01", *START]),
    "demo-1%-lr1e-2": ("hvd_topk 1%, DeMo (sign, beta 0.999, lr 1e-2), the same dense start",
                       [*EF, "--adam", "demo", "--density", "0.01", *START, "--lr", "1e-2"]),
    "demo-1%-lr3e-2": ("hvd_topk 1%, DeMo (sign, beta 0.999, lr 3e-2), the same dense start",
                       [*EF, "--adam", "demo", "--density", "0.01", *START, "--lr", "3e-2"]),
    "demo-1%-lr3e-2-fp16v": ("hvd_topk 1%, DeMo (sign, beta 0.999, lr 3e-2), 16-bit values, the same dense start",
                             [*EF, "--adam", "demo", "--density", "0.01", *START, "--lr", "3e-2", "--fp16-values"]),
    "demo-0.1%-lr3e-2": ("hvd_topk 0.1%, DeMo (sign, beta 0.999, lr 3e-2), the same dense start",
                         [*EF, "--adam", "demo", "--density", "0.001", *START, "--lr", "3e-2"]),
    "demo-0.1%-lr1e-1": ("hvd_topk 0.1%, DeMo (sign, beta 0.999, lr 1e-1), the same dense start",
                         [*EF, "--adam", "demo", "--density", "0.001", *START, "--lr", "1e-1"]),
    "demo-0.1%-lr3e-2-beta0.99": ("hvd_topk 0.1%, DeMo (sign, beta 0.99, lr 3e-2), the same dense start",
                                  [*EF, "--adam", "demo", "--density", "0.001", *START, "--lr", "3e-2",
                                   "--demo-beta", "0.99"]),
    "demo-noef-1%-lr3e-2": ("hvd_topk 1%, DeMo's sign step without error feedback (no accumulator), lr 3e-2",
                            [*EF, "--adam", "demo", "--density", "0.01", *START, "--lr", "3e-2", "--no-error-feedback",
                             "--demo-beta", "1.0"]),
    "gv-1%-lr1e-2": ("hvd_topk 1%, the gv-1% recipe (LocalAdamW) at lr 1e-2", [*GV, "--density", "0.01", *START,
                                                                                 "--lr", "1e-2"]),
    "gv-1%-lr1e-2-fp16v": ("hvd_topk 1%, the gv-1% recipe (LocalAdamW) at lr 1e-2, 16-bit values",
                           RECOMMENDED),
    # the same without global_variance: each rank normalises by its own batch's variance (the
    # control for global_variance's sqrt(P) argument at more than 2 ranks)
    "gv-1%-lr1e-2-fp16v-rankvar": ("hvd_topk 1%, the recipe at lr 1e-2, 16-bit values, each rank's own variance "
                                   "(global_variance=False)",
                                   [*RECOMMENDED, "--no-global-variance"]),
    "gv-0.1%-lr1e-2": ("hvd_topk 0.1%, the gv recipe (LocalAdamW) at lr 1e-2", [*GV, "--density", "0.001", *START,
                                                                                "--lr", "1e-2"]),
    "gv-noef-1%-lr1e-2": ("hvd_topk 1%, LocalAdamW without error feedback at lr 1e-2",
                          [*EF, "--adam", "local", "--no-lr-in-residual", "--no-error-feedback", "--density", "0.01",
                           *START, "--lr", "1e-2"]),
    "demo-1%-lr1e-1": ("hvd_topk 1%, DeMo (sign, beta 0.999, lr 1e-1), the same dense start",
                       [*EF, "--adam", "demo", "--density", "0.01", *START, "--lr", "1e-1"]),
    "dense-lr2e-2": ("Horovod dense fp32, AdamW at lr 2e-2", ["--compression", "none", "--lr", "2e-2"]),
    "dense-lr6e-3": ("Horovod dense fp32, AdamW at lr 6e-3 (2x the example's)", ["--compression", "none", "--lr", "6e-3"]),
    "dense-lr1e-2": ("Horovod dense fp32, AdamW at lr 1e-2", ["--compression", "none", "--lr", "1e-2"]),
    "dense-lr1e-2-wd0.2": ("Horovod dense fp32, AdamW at lr 1e-2, weight decay 0.2",
                           ["--compression", "none", "--lr", "1e-2", "--weight-decay", "0.2"]),
    "dense-lr1e-2-wd0.4": ("Horovod dense fp32, AdamW at lr 1e-2, weight decay 0.4",
                           ["--compression", "none", "--lr", "1e-2", "--weight-decay", "0.4"]),
    "demo-1%-rms-lr1e-2": ("hvd_topk 1%, DeMo (rms, beta 0.999, lr 1e-2), the same dense start",
                           [*EF, "--adam", "demo", "--demo-normalise", "rms", "--density", "0.01", *START,
                            "--lr", "1e-2"]),
    "demo-1%-rms": ("hvd_topk 1%, DeMo (rms, beta 0.999, lr 3e-3), the same dense start",
                    [*EF, "--adam", "demo", "--demo-normalise", "rms", "--density", "0.01", *START]),
    "gv-1%-lr1e-2-fp16v-bf16": ("hvd_topk 1%, the recommended scheme (recipe at lr 1e-2, 16-bit values) under bf16 autocast",
                                [*RECOMMENDED, "--amp", "bf16"]),
    # the recommended scheme with the exchange `auto` may pick instead of the allgather (the
    # sparse allreduce: each rank chooses the positions in one part of every bucket, fewer
    # entries moved a step, each carrying every rank's work)
    "gv-1%-lr1e-2-fp16v-sar": ("hvd_topk 1%, the recommended scheme (lr 1e-2, 16-bit values) over the sparse allreduce",
                               [*RECOMMENDED, "--exchange", "sparse_allreduce"]),
    # the same at twice the density: at 4 ranks fewer bytes than the allgather's at 1% (a rank
    # receives (P - 1) k pairs from the allgather, (P - 1) / P k indices and about twice as many
    # values from the sparse allreduce)
    "gv-2%-lr1e-2-fp16v-sar": ("hvd_topk 2%, the recommended scheme (lr 1e-2, 16-bit values) over the sparse allreduce",
                               [*GV, "--density", "0.02", *START, "--lr", "1e-2", "--fp16-values",
                                "--exchange", "sparse_allreduce"]),
    # the recommended scheme with the residuals switched off: what error feedback is worth
    "gv-noef-1%-lr1e-2-fp16v": ("hvd_topk 1%, the recommended scheme (lr 1e-2, 16-bit values) without error feedback",
                                [*RECOMMENDED, "--no-error-feedback"]),
    "gv-1%-lr1.5e-2-fp16v": ("hvd_topk 1%, the recipe at lr 1.5e-2, 16-bit values",
                             [*GV, "--density", "0.01", *START, "--lr", "1.5e-2", "--fp16-values"]),
    # long runs: the learning rate that grew with the length (1e-2 at 1000 steps, 1.5e-2 at 3000)
    "gv-1%-lr2e-2-fp16v": ("hvd_topk 1%, the recipe at lr 2e-2, 16-bit values",
                           [*GV, "--density", "0.01", *START, "--lr", "2e-2", "--fp16-values"]),
    # 16 ranks: the recipe's rate above 2e-2 (with -sketch256 below)
    "gv-1%-lr3e-2-fp16v": ("hvd_topk 1%, the recipe at lr 3e-2, 16-bit values",
                           [*GV, "--density", "0.01", *START, "--lr", "3e-2", "--fp16-values"]),
    # long runs: twice the pairs, for a byte budget a 100-step dense start no longer dominates
    "gv-2%-lr1.5e-2-fp16v": ("hvd_topk 2%, the recipe at lr 1.5e-2, 16-bit values",
                             [*GV, "--density", "0.02", *START, "--lr", "1.5e-2", "--fp16-values"]),
    # long runs: the dense start stretched over the learning-rate warm-up (10% of the run: 1000 steps
    # at 10,000), where the 10,000-step gap opened; at 1000 steps this is the recipe's own start
    "gv-1%-lr1.5e-2-fp16v-start1000": ("hvd_topk 1%, the recipe at lr 1.5e-2, 16-bit values, the dense start over "
                                       "1000 steps",
                                       [*GV, "--density", "0.01", "--warmup-steps", "1000", "--warmup-density", "1.0",
                                        "--lr", "1.5e-2", "--fp16-values"]),
    # the same over shorter warm-ups (10% of 5000, 4000 and 3000 steps), where the rule's threshold lies
    **{f"gv-1%-lr1.5e-2-fp16v-start{w}": ("hvd_topk 1%, the recipe at lr 1.5e-2, 16-bit values, the dense start over "
                                          f"{w} steps (the learning-rate warm-up of a {10 * w}-step run)",
                                          [*GV, "--density", "0.01", "--warmup-steps", str(w), "--warmup-density",
                                           "1.0", "--lr", "1.5e-2", "--fp16-values"])
       for w in (500, 400, 300)},
    # long runs: how much of the gap is the optimizer (LocalAdamW) and how much the compression
    "gv-dense-lr1.5e-2": ("LocalAdamW (the recipe's optimizer) at lr 1.5e-2, dense exchange: no compression",
                          [*GV_DENSE, "--lr", "1.5e-2"]),
    "gv-dense-lr1e-2": ("LocalAdamW (the recipe's optimizer) at lr 1e-2, dense exchange: no compression",
                        [*GV_DENSE, "--lr", "1e-2"]),
    "gv-1%-lr7e-3-fp16v": ("hvd_topk 1%, the recipe at lr 7e-3, 16-bit values",
                           [*GV, "--density", "0.01", *START, "--lr", "7e-3", "--fp16-values"]),
    "gv-dense-lr1e-2-rankvar": ("LocalAdamW at lr 1e-2, each rank's own variance (no global_variance), dense exchange",
                                [*GV_DENSE, "--lr", "1e-2", "--no-global-variance"]),
    "gv-1%-lr5e-3-fp16v": ("hvd_topk 1%, the recipe at lr 5e-3, 16-bit values",
                           [*GV, "--density", "0.01", *START, "--lr", "5e-3", "--fp16-values"]),
    "dense-lr1e-2-beta1-0-noclip": ("Horovod dense fp32, AdamW at lr 1e-2 with LocalAdamW's beta1 (0) and no clipping",
                                    ["--compression", "none", "--lr", "1e-2", "--beta1", "0", "--clip", "0"]),
    "gv-dense-lr1e-2-lag1": ("LocalAdamW at lr 1e-2, signal='mean+lag1' (a flipping sign counts as signal), dense exchange",
                             [*GV_DENSE, "--lr", "1e-2", "--gv-signal", "mean+lag1"]),
    "dense-lr1.5e-2": ("Horovod dense fp32, AdamW at lr 1.5e-2", ["--compression", "none", "--lr", "1.5e-2"]),
    # 8 ranks: which of LocalAdamW's two differences from dense AdamW (beta1 0, no clipping) costs what
    "dense-lr2e-2-noclip": ("Horovod dense fp32, AdamW at lr 2e-2, no gradient clipping",
                            ["--compression", "none", "--lr", "2e-2", "--clip", "0"]),
    "dense-lr2e-2-beta1-0": ("Horovod dense fp32, AdamW at lr 2e-2 with beta1 0 (clipping kept)",
                             ["--compression", "none", "--lr", "2e-2", "--beta1", "0"]),
    "dense-lr7e-3": ("Horovod dense fp32, AdamW at lr 7e-3", ["--compression", "none", "--lr", "7e-3"]),
    "ls4-4%-lr1e-2-fp16v": ("hvd_topk.LocalSteps: 4 AdamW steps per rank, then the model change at 4%, 16-bit values, "
                            "outer SGD lr 1.0, dense start over 100 steps, lr 1e-2 (the recipe's bytes)",
                            [*EF, "--sync-every", "4", "--density", "0.04", *START, "--lr", "1e-2", "--fp16-values"]),
    "ls4-4%-nesterov-lr1e-2-fp16v": ("hvd_topk.LocalSteps as ls4-4%, outer Nesterov SGD lr 0.7 momentum 0.9 (DiLoCo)",
                                     [*EF, "--sync-every", "4", "--density", "0.04", *START, "--lr", "1e-2",
                                      "--fp16-values", "--outer-lr", "0.7", "--outer-momentum", "0.9", "--nesterov"]),
    "ls2-2%-lr1e-2-fp16v": ("hvd_topk.LocalSteps: 2 AdamW steps per rank, then the model change at 2%, 16-bit values, "
                            "outer SGD lr 1.0, dense start over 100 steps, lr 1e-2 (the recipe's bytes)",
                            [*EF, "--sync-every", "2", "--density", "0.02", *START, "--lr", "1e-2", "--fp16-values"]),
    "ls8-0.8%-lr1e-2-fp16v": ("hvd_topk.LocalSteps: 8 AdamW steps per rank, then the model change at 0.8%, 16-bit "
                              "values, outer SGD lr 1.0, dense start over 100 steps, lr 1e-2 (0.1%'s bytes)",
                              [*EF, "--sync-every", "8", "--density", "0.008", *START, "--lr", "1e-2", "--fp16-values"]),
    "gv-1%-lr1e-2-fp16v-decay0.995": ("hvd_topk 1%, the recommended scheme with residual_decay=0.995 (old unsent work fades)",
                                      [*RECOMMENDED, "--residual-decay", "0.995"]),
    "gv-0.1%-lr2e-2-fp16v": ("hvd_topk 0.1%, the recipe at lr 2e-2, 16-bit values (each entry arrives ~1000 steps late)",
                             [*GV, "--density", "0.001", *START, "--lr", "2e-2", "--fp16-values"]),
    "gv-0.1%-lr1e-2-fp16v-start300": ("hvd_topk 0.1%, the recipe at lr 1e-2, 16-bit values, the dense start over 300 steps",
                                      [*GV, "--density", "0.001", "--warmup-steps", "300", "--warmup-density", "1.0",
                                       "--lr", "1e-2", "--fp16-values"]),
    "gv-1%-bf16": ("hvd_topk 1%, the gv-1% recipe under bf16 autocast", [*GV, "--density", "0.01", *START,
                                                                         "--amp", "bf16"]),
}
# 0.1% with residual decay at several learning rates (the screen in docs/adamw.md), 16-bit values,
# the recipe's dense start: "gv-0.1%-lr{LR}-fp16v-decay{DECAY}"
for _lr, _decay in (("1e-2", "0.999"), ("1e-2", "0.997"), ("1e-2", "0.995"), ("1e-2", "0.99"),
                    ("1.5e-2", "0.995"), ("2e-2", "0.995"), ("2e-2", "0.99"), ("3e-2", "0.995"),
                    ("3e-2", "0.99"), ("3e-2", "0.98"), ("1.5e-2", "0.99"), ("2e-2", "0.985"), ("2.5e-2", "0.99")):
    CONFIGS[f"gv-0.1%-lr{_lr}-fp16v-decay{_decay}"] = (
        f"hvd_topk 0.1%, the recipe at lr {_lr}, 16-bit values, residual_decay={_decay}",
        [*GV, "--density", "0.001", *START, "--lr", _lr, "--fp16-values", "--residual-decay", _decay])
# variants of the best 0.1% setting (lr 2e-2, decay 0.99): "gv-0.1%-lr2e-2-fp16v-decay0.99-{VARIANT}"
for _variant, _what, _args in (
        ("wd0.05", "weight decay 0.05 (lr x weight decay as dense AdamW's at 1e-2)", ["--weight-decay", "0.05"]),
        ("wd0", "no weight decay", ["--weight-decay", "0"]),
        ("wd0.2", "weight decay 0.2", ["--weight-decay", "0.2"]),
        ("wd0.4", "weight decay 0.4", ["--weight-decay", "0.4"]),
        ("bucket", "the selection over each bucket, not each tensor", ["--selection-scope", "bucket"]),
        # the gap opens as the dense start ends (steps 100-300): longer starts, from lower densities
        ("start0.25x300", "the start from 25% over 300 steps (about the 100-step dense start's bytes)",
         ["--warmup-steps", "300", "--warmup-density", "0.25"]),
        ("start0.1x500", "the start from 10% over 500 steps (fewer bytes than the dense start)",
         ["--warmup-steps", "500", "--warmup-density", "0.1"]),
        ("start1x300", "the dense start over 300 steps (about 3x its bytes)",
         ["--warmup-steps", "300", "--warmup-density", "1.0"]),
        # the dense start as long as the learning rate's warm-up (what closed the 1% gap at 5000 and
        # 10,000 steps), the warm-up lengthened with it at 1000 steps
        ("start1x200-lrwarm0.2", "the dense start and the learning rate's warm-up both over 200 steps",
         ["--warmup-steps", "200", "--warmup-density", "1.0", "--lr-warmup", "0.2"]),
        ("start1x600-lrwarm0.2", "the dense start and the learning rate's warm-up both over 600 steps "
         "(20% of 3000)", ["--warmup-steps", "600", "--warmup-density", "1.0", "--lr-warmup", "0.2"]),
        # lr 2e-2 suits the sparse phase only: reach it later, at dense's 1e-2 when the start ends
        ("lrwarm0.2", "the learning rate's warm-up over 20% of the steps (1e-2 at step 100)",
         ["--lr-warmup", "0.2"]),
        # the sparse allreduce: one rank's positions (rotating), every rank's values there summed,
        # so each sent entry carries both ranks' work; 4 bytes a pair at P = 2 against the allgather's 6
        ("sar", "the sparse allreduce (2/3 of the allgather's bytes at P = 2)", ["--exchange", "sparse_allreduce"]),
        ("sar0.15", "the sparse allreduce at 0.15% (the allgather's bytes at 0.1%, P = 2)",
         ["--exchange", "sparse_allreduce", "--density", "0.0015"]),
        # each rank's own variance: global_variance scales a noisy entry's local update by up to
        # sqrt(P), and at 0.1% the residual's random walk then competes harder with the signal for
        # Top-K's few slots (its steps are up to sqrt(P) smaller without: lr 3e-2 too)
        ("localvar", "each rank's own variance (global_variance=False)", ["--no-global-variance"]),
        ("localvar-lr3e-2", "each rank's own variance, lr 3e-2", ["--no-global-variance", "--lr", "3e-2"]),
        # the variance's horizon: beta2 0.95 averages over ~20 steps, the decayed residual over ~100
        ("beta2-0.99", "Adam's beta2 0.99", ["--beta2", "0.99"]),
        ("beta2-0.9", "Adam's beta2 0.9", ["--beta2", "0.9"]),
        # with the residual decaying, old work fades anyway: the rate applied at send time instead
        ("lr-at-send", "the learning rate applied when an entry is sent (lr_in_residual=False)",
         ["--no-lr-in-residual"]),
        # how much more positions per step would buy (a denser wire format at 0.1%'s bytes)
        ("d0.15", "density 0.15% (1.5x the pairs)", ["--density", "0.0015"]),
        ("d0.2", "density 0.2% (2x the pairs)", ["--density", "0.002"]),
        ("d0.3", "density 0.3% (3x the pairs)", ["--density", "0.003"]),
        # diagnostics, not budgets: where the 0.1% gap sits, by sending some tensors dense
        # (min_numel; this model's sizes: token embedding and head 32768, position embedding and
        # attention output 16384, attention input 49152, MLP 65536 each)
        ("dense33k", "diagnostic: embeddings, head and attention outputs dense (min_numel 33000)",
         ["--min-numel", "33000"]),
        # the 1-D parameters (norms, biases) go dense every step (below min_numel): at lr 2e-2 they
        # step at twice dense AdamW's best rate, which only the sparse matrices' decayed residuals need
        ("vec0.5", "the 1-D parameters (sent dense) at half the rate (1e-2)", ["--vector-lr-scale", "0.5"]),
        ("vec0.5-lr2.5e-2", "lr 2.5e-2, the 1-D parameters at 1.25e-2", ["--lr", "2.5e-2", "--vector-lr-scale", "0.5"]),
        ("dense16k", "diagnostic: position embedding and attention outputs dense (min_numel 16385)",
         ["--min-numel", "16385"]),
        # at 8 ranks beta1 0.5 steadied the steps after the dense start (the 0.1% gap opens there)
        ("beta1-0.5", "beta1 0.5 inside LocalAdamW", ["--beta1", "0.5"]),
        ("beta1-0.7", "beta1 0.7 inside LocalAdamW", ["--beta1", "0.7"]),
        ("beta1-0.8", "beta1 0.8 inside LocalAdamW", ["--beta1", "0.8"]),
        ("start1x300-beta1-0.5", "the dense start over 300 steps, beta1 0.5 inside LocalAdamW",
         ["--warmup-steps", "300", "--warmup-density", "1.0", "--beta1", "0.5"])):
    CONFIGS[f"gv-0.1%-lr2e-2-fp16v-decay0.99-{_variant}"] = (
        f"hvd_topk 0.1%, the recipe at lr 2e-2, 16-bit values, residual_decay=0.99, {_what}",
        [*CONFIGS["gv-0.1%-lr2e-2-fp16v-decay0.99"][1], *_args])
# compact pairs (TopK(compact=True): an Elias-Fano index of ~10.6 bits and an 8-bit value):
# 0.25% moves 2.5x 0.1%'s pairs in fewer of its bytes (2848 against 2856 bytes a step on this
# model), the dense start in fp16 as before. (compact0.19: the first, 3-byte format of ed97685,
# a 16-bit index, 2832 bytes a step.)
for _density, _what in (("0.19", "1.9x"), ("0.2", "2x"), ("0.25", "2.5x")):
    CONFIGS[f"gv-0.1%-lr2e-2-compact{_density}-decay0.99"] = (
        f"hvd_topk compact pairs at {_density}% ({_what} 0.1%'s pairs), the recipe at lr 2e-2, residual_decay=0.99",
        [*GV, "--density", str(float(_density) / 100), *START, "--lr", "2e-2", "--compact", "--residual-decay", "0.99"])
# sign values (TopK(compact="sign"): the Elias-Fano index and a sign bit, one mean magnitude for
# each tensor): 0.43% moves 4.3x 0.1%'s pairs in fewer of its bytes (2808 against 2856 a step)
CONFIGS["gv-0.1%-lr2e-2-sign0.43-decay0.99"] = (
    "hvd_topk sign values at 0.43% (4.3x 0.1%'s pairs, compact='sign'), the recipe at lr 2e-2, residual_decay=0.99",
    [*GV, "--density", "0.0043", *START, "--lr", "2e-2", "--compact", "sign", "--residual-decay", "0.99"])
# 0.1% at 3000 steps with the dense start over 300: the rate on either side of 2e-2 (the 1%
# recipe's best rate rose with the length, 1e-2 at 1000 steps to 1.5e-2 at 3000)
for _lr in ("1.5e-2", "2.5e-2"):
    _name = f"gv-0.1%-lr{_lr}-fp16v-decay0.99"
    CONFIGS[f"{_name}-start1x300"] = (f"{CONFIGS[_name][0]}, the dense start over 300 steps",
                                      [*CONFIGS[_name][1], "--warmup-steps", "300", "--warmup-density", "1.0"])
# LocalAdamW(signal="mean+lag1"): an oscillation counted as signal (8 ranks)
for _name in ("gv-1%-lr1e-2-fp16v", "gv-1%-lr1.5e-2-fp16v", "gv-1%-lr2e-2-fp16v", "gv-0.1%-lr2e-2-fp16v-decay0.99"):
    CONFIGS[f"{_name}-lag1"] = (f"{CONFIGS[_name][0]}, signal='mean+lag1' (a flipping sign counts as signal)",
                                [*CONFIGS[_name][1], "--gv-signal", "mean+lag1"])
# LocalAdamW(variance_sketch=256): each tensor's variance of the ranks' average gradient measured
# with a 256-number sketch a step (8 ranks). Since 2026-12-02 (after c126d12's results) the
# LocalAdamW configs without a -sketch suffix run the library's default, variance_sketch="auto":
# 256 from 8 ranks on (from 6 since the 6-rank seeds 43-44, 2026-12-02 evening), off below, so
# their 2- and 4-rank runs are as before and their 6- and 8-rank runs are the -sketch256 ones. The 8-rank rows of the estimate alone committed before then are the
# -sketch0 configs now (run them so to reproduce those rows; do not --reuse them for the plain names).
for _name in ("gv-1%-lr1e-2-fp16v", "gv-1%-lr1.5e-2-fp16v", "gv-1%-lr2e-2-fp16v", "gv-1%-lr3e-2-fp16v",
              "gv-1%-lr7e-3-fp16v"):
    for _size, _what in (("256", "variance_sketch=256 (the average's variance measured)"),
                         ("0", "variance_sketch=0 (the estimate alone, the default before 2026-12-02)")):
        CONFIGS[f"{_name}-sketch{_size}"] = (f"{CONFIGS[_name][0]}, {_what}",
                                             [*CONFIGS[_name][1], "--variance-sketch", _size])
for _name in ("gv-1%-lr1e-2-fp16v-lag1", "gv-1%-lr1.5e-2-fp16v-lag1", "gv-1%-lr2e-2-fp16v-lag1"):
    CONFIGS[f"{_name}-sketch0"] = (f"{CONFIGS[_name][0]}, variance_sketch=0",
                                   [*CONFIGS[_name][1], "--variance-sketch", "0"])
# 8 ranks: what is left to dense AdamW once the variance is measured is about beta1 0 (design
# section 8); a momentum inside LocalAdamW, half of dense's, on top of the residual's
# ("gv-1%-lr{LR}-fp16v-sketch256-beta1-{BETA1}"); dense AdamW with beta1 0 at lr 2e-2 is +40% on
# 8 ranks (config dense-lr2e-2-beta1-0), without clipping +1.0%: the momentum is what dense has
for _lr, _beta1 in (("1.5e-2", "0.5"), ("1.5e-2", "0.9"), ("2e-2", "0.5"), ("2e-2", "0.9")):
    _name = f"gv-1%-lr{_lr}-fp16v-sketch256"
    CONFIGS[f"{_name}-beta1-{_beta1}"] = (f"{CONFIGS[_name][0]}, beta1 {_beta1} inside LocalAdamW",
                                         [*CONFIGS[_name][1], "--beta1", _beta1])
# 8 ranks on 2 emulated hosts of 4 (--ranks-per-host 4): the recipe with the hierarchical exchange
# (dense inside a host, Top-K of the host's summed updates across hosts), as a job of 8-GPU hosts runs it
CONFIGS["gv-1%-lr1.5e-2-fp16v-sketch256-hier"] = (
    f"{CONFIGS['gv-1%-lr1.5e-2-fp16v-sketch256'][0]}, hierarchical (dense inside a host, sparse across hosts)",
    [*CONFIGS["gv-1%-lr1.5e-2-fp16v-sketch256"][1], "--hierarchical"])
# the same momentum in the 2-rank 1% recipe
CONFIGS["gv-1%-lr1e-2-fp16v-beta1-0.5"] = (f"{CONFIGS['gv-1%-lr1e-2-fp16v'][0]}, beta1 0.5 inside LocalAdamW",
                                         [*CONFIGS["gv-1%-lr1e-2-fp16v"][1], "--beta1", "0.5"])
# 8 ranks: more pairs a step at the same bytes (compact pairs at 3% move about 1% with 16-bit
# values' bytes), and 2% with 16-bit values (twice the bytes) to tell whether the pairs are the gap
CONFIGS["gv-3%-lr1.5e-2-compact-sketch256"] = (
    "hvd_topk compact pairs at 3% (about 1%'s bytes with 16-bit values), the recipe at lr 1.5e-2, variance_sketch=256",
    [*GV, "--density", "0.03", *START, "--lr", "1.5e-2", "--compact", "--variance-sketch", "256"])
CONFIGS["gv-2%-lr1.5e-2-fp16v-sketch256"] = (
    "hvd_topk 2% (twice the recipe's pairs and bytes), the recipe at lr 1.5e-2, 16-bit values, variance_sketch=256",
    [*GV, "--density", "0.02", *START, "--lr", "1.5e-2", "--fp16-values", "--variance-sketch", "256"])
CONFIGS["gv-1%-lr1.5e-2-fp16v-lag1-beta2-0.99"] = (
    "hvd_topk 1%, the recipe at lr 1.5e-2, 16-bit values, signal='mean+lag1', beta2 0.99 (the estimate over ~100 steps)",
    [*CONFIGS["gv-1%-lr1.5e-2-fp16v-lag1"][1], "--beta2", "0.99"])
# the same at lr 1e-2 (the 1% recipe's rate at 300 and 1000 steps): for short runs, where work
# waiting in the residual has no time to arrive
CONFIGS["gv-0.1%-lr1e-2-compact0.25-decay0.99"] = (
    "hvd_topk compact pairs at 0.25% (2.5x 0.1%'s pairs), the recipe at lr 1e-2, residual_decay=0.99",
    [*GV, "--density", "0.0025", *START, "--lr", "1e-2", "--compact", "--residual-decay", "0.99"])
CONFIGS["gv-0.1%-lr1e-2-sign0.43-decay0.99"] = (
    "hvd_topk sign values at 0.43% (4.3x 0.1%'s pairs, compact='sign'), the recipe at lr 1e-2, residual_decay=0.99",
    [*GV, "--density", "0.0043", *START, "--lr", "1e-2", "--compact", "sign", "--residual-decay", "0.99"])
# 4 ranks: the rate between dense AdamW's best there (1.5e-2) and the 2-rank one (2e-2, +5.4% at 4 ranks)
CONFIGS["gv-0.1%-lr1.5e-2-sign0.43-decay0.99"] = (
    "hvd_topk sign values at 0.43% (4.3x 0.1%'s pairs, compact='sign'), the recipe at lr 1.5e-2, residual_decay=0.99",
    [*GV, "--density", "0.0043", *START, "--lr", "1.5e-2", "--compact", "sign", "--residual-decay", "0.99"])
# 10,000-step runs at 0.1% and at 0.1%'s bytes, the dense start over the learning rate's
# 1000-step warm-up (the long-run rule)
CONFIGS["gv-0.1%-lr2e-2-fp16v-decay0.99-start1x1000"] = (
    "hvd_topk 0.1%, the recipe at lr 2e-2, 16-bit values, residual_decay=0.99, the dense start over 1000 steps",
    [*CONFIGS["gv-0.1%-lr2e-2-fp16v-decay0.99"][1], "--warmup-steps", "1000", "--warmup-density", "1.0"])
CONFIGS["gv-0.1%-lr2e-2-compact0.25-decay0.99-start1x1000"] = (
    "hvd_topk compact pairs at 0.25% (0.1%'s bytes), lr 2e-2, residual_decay=0.99, the dense start over 1000 steps",
    [*CONFIGS["gv-0.1%-lr2e-2-compact0.25-decay0.99"][1], "--warmup-steps", "1000", "--warmup-density", "1.0"])
CONFIGS["gv-0.1%-lr2e-2-sign0.43-decay0.99-start1x1000"] = (
    "hvd_topk sign values at 0.43% (0.1%'s bytes), lr 2e-2, residual_decay=0.99, the dense start over 1000 steps",
    [*CONFIGS["gv-0.1%-lr2e-2-sign0.43-decay0.99"][1], "--warmup-steps", "1000", "--warmup-density", "1.0"])
# the rate the README advises for 0.1%'s bytes (1.5e-2, measured at 1000 and 3000 steps) over 10,000
CONFIGS["gv-0.1%-lr1.5e-2-sign0.43-decay0.99-start1x1000"] = (
    "hvd_topk sign values at 0.43% (0.1%'s bytes), lr 1.5e-2, residual_decay=0.99, the dense start over 1000 steps",
    [*CONFIGS["gv-0.1%-lr1.5e-2-sign0.43-decay0.99"][1], "--warmup-steps", "1000", "--warmup-density", "1.0"])
CONFIGS["gv-0.1%-lr2e-2-compact0.25-decay0.99-start1x300"] = (
    "compact pairs at 0.25% (0.1%'s bytes), the dense start over the 300-step learning-rate warm-up (3000-step runs)",
    [*CONFIGS["gv-0.1%-lr2e-2-compact0.25-decay0.99"][1], "--warmup-steps", "300", "--warmup-density", "1.0"])
CONFIGS["gv-0.1%-lr3e-2-fp16v-decay0.99-lrwarm0.3"] = (
    "hvd_topk 0.1%, the recipe at lr 3e-2, 16-bit values, residual_decay=0.99, the learning rate's warm-up over "
    "30% of the steps (1e-2 at step 100)",
    [*CONFIGS["gv-0.1%-lr3e-2-fp16v-decay0.99"][1], "--lr-warmup", "0.3"])
# the warm-up-stable-decay schedule (--lr-schedule wsd: the rate held until the last 20% of the
# steps, then linear to 0) for dense AdamW, the 1% recipe and 0.1%: "{CONFIG}-wsd"
for _name in ("dense-lr6e-3", "dense-lr1e-2", "dense-lr2e-2", "gv-1%-lr1e-2-fp16v", "gv-1%-lr1.5e-2-fp16v",
              "gv-0.1%-lr2e-2-fp16v-decay0.99", "gv-0.1%-lr1e-2-fp16v-decay0.99"):
    CONFIGS[f"{_name}-wsd"] = (f"{CONFIGS[_name][0]}, the wsd schedule", [*CONFIGS[_name][1], "--lr-schedule", "wsd"])
# 16 ranks: dense AdamW's best rate rises with the ranks (3e-2 at 16, between 2e-2 and 4e-2)
for _lr in ("3e-2", "4e-2"):
    CONFIGS[f"dense-lr{_lr}"] = (f"Horovod dense fp32, AdamW at lr {_lr}", ["--compression", "none", "--lr", _lr])
# torchrun + DDP (examples/ddp_gpt.py, the same model and data): no hook, PowerSGD, hvd_topk's hook
DDP_EXAMPLE = ROOT / "examples" / "ddp_gpt.py"
DDP_CONFIGS = {
    "ddp-dense": ("DDP, no hook (dense fp32 AdamW)", ["--hook", "none"]),
    "ddp-fp16": ("DDP, PyTorch's fp16 hook", ["--hook", "fp16"]),
    "ddp-powersgd-r2": ("DDP, PowerSGD rank 2 (dense for the first 100 steps)", ["--hook", "powersgd", "--powersgd-rank", "2"]),
    "ddp-powersgd-r4": ("DDP, PowerSGD rank 4 (dense for the first 100 steps)", ["--hook", "powersgd", "--powersgd-rank", "4"]),
    "ddp-topk-1%": ("DDP, hvd_topk hook 1%, LocalAdamW recipe, dense start over 100 steps",
                    ["--hook", "topk", "--density", "0.01"]),
    "ddp-topk-1%-fp16v": ("DDP, hvd_topk hook 1%, the recipe with 16-bit values",
                          ["--hook", "topk", "--density", "0.01", "--fp16-values"]),
}
# the same at the learning rate the recommended scheme is tuned for (docs/adamw.md): 1e-2
for _name in ("ddp-dense", "ddp-powersgd-r4", "ddp-topk-1%-fp16v"):
    DDP_CONFIGS[f"{_name}-lr1e-2"] = (f"{DDP_CONFIGS[_name][0]}, lr 1e-2", [*DDP_CONFIGS[_name][1], "--lr", "1e-2"])
# 8 ranks (docs/adamw-measurements.md, "Eight ranks"): the rate tuned there and the variance sketch
DDP_CONFIGS["ddp-topk-1%-fp16v-lr1.5e-2-sketch256"] = (
    "DDP, hvd_topk hook 1%, the recipe with 16-bit values, lr 1.5e-2, variance_sketch=256",
    [*DDP_CONFIGS["ddp-topk-1%-fp16v"][1], "--lr", "1.5e-2", "--variance-sketch", "256"])
CONFIGS.update(DDP_CONFIGS)
DEFAULT = ["dense", "fp16", "ef-1%", "noef-1%", "ef-0.1%", "noef-0.1%"]
FROZEN = ["dense", "dense-fv", "fv-1%", "fv-0.1%", "fv-noef-0.1%"]  # --configs for convergence-gpt-frozen-variance

# sign values at 1%'s bytes (4.3%: 1%'s pairs with 16-bit values cost 6 bytes, a sign pair about
# 1.4): screened 2026-12-07 at 1000 steps, seed 42, against the 1% recipe (docs/adamw-measurements.md)
for _lr in ("7e-3", "1e-2", "1.5e-2"):
    CONFIGS[f"gv-1%bytes-lr{_lr}-sign4.3-decay0.99"] = (
        f"hvd_topk sign values at 4.3% (1%'s bytes, compact='sign'), the recipe at lr {_lr}, residual_decay=0.99",
        [*GV, "--density", "0.043", *START, "--lr", _lr, "--compact", "sign", "--residual-decay", "0.99"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT, metavar="NAME")
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=1, metavar="L",
                    help="launch on NP/L emulated hosts of L ranks each (network namespaces joined by 10 Gbit "
                         "links; needs root), as --hierarchical configs need; default 1: one mpirun on this host")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out-prefix", type=Path, default=ROOT / "benchmarks" / "results" / "gpt" / "convergence-gpt")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="validation every N steps (default: the example's 100); finer for steps-to-target")
    ap.add_argument("--reuse", type=Path, nargs="+", default=[], metavar="JSON",
                    help="earlier PREFIX.json files: a run with the same config, ARGS, steps, seed and ranks, made by "
                         "the same code (a fingerprint of hvd_topk and the examples; runs recorded before it "
                         "existed: dense AdamW only), is taken from them instead of being run again; each run keeps "
                         "where it was made ('made': date, git revision, command, code; for runs of files written "
                         "before 2026-12-05, that file's)")
    args = ap.parse_args(argv)
    per_host = args.ranks_per_host
    if per_host < 1 or args.np % per_host:
        ap.error(f"--ranks-per-host must divide --np {args.np}, got {per_host}")
    if per_host > 1 and any(c in DDP_CONFIGS for c in args.configs):
        ap.error("--ranks-per-host launches mpirun: not the ddp-* configs")
    if per_host == 1 and any("--hierarchical" in CONFIGS[c][1] for c in args.configs):
        ap.error("the hierarchical configs need hosts: --ranks-per-host L (L > 1)")
    extra = [] if args.eval_every is None else ["--eval-every", str(args.eval_every)]
    command = shlex.join(["python", "benchmarks/convergence_gpt.py", *(sys.argv[1:] if argv is None else argv)])
    code = code_fingerprint()
    machine = machine_info()
    # each run keeps where it was made, for files that reuse it (two kinds of VM give other bits)
    here = {"date": None, "git": machine.get("git"), "machine": machine.get("cpu"), "command": command, "code": code}
    earlier, stale = earlier_runs(args.reuse, code)
    if stale:
        print(f"not reused (made by other code, or before runs recorded theirs): {', '.join(stale)}", flush=True)
    runs, started = [], time.perf_counter()
    partial = Path(f"{args.out_prefix}.partial.json")
    plan = [(c, s) for c in args.configs for s in args.seeds]
    # emulated hosts (network namespaces, tools/emulated_hosts.py) where ranks must sit on several hosts;
    # quality does not depend on the links' rate, so they are fast (10 Gbit) to keep runs short
    with (emulated_hosts.EmulatedHosts(args.np // per_host, rate="10gbit", sshd=True, ssh_port=2292)
          if per_host > 1 else contextlib.nullcontext()) as hosts:
        for i, (name, seed) in enumerate(plan, 1):
            print(f"[{i:2d}/{len(plan)}] {name:<18s} seed {seed} ... ", end="", flush=True)
            used = " ".join([*CONFIGS[name][1], *extra])
            r = earlier.get((name, used, args.steps, seed, args.np))
            if r is None:
                ddp = name in DDP_CONFIGS
                r = run_example(args.np, ["--steps", str(args.steps), *CONFIGS[name][1], *extra], seed, None,
                                args.timeout, DDP_EXAMPLE if ddp else EXAMPLE, "torchrun" if ddp else "mpirun",
                                hosts=hosts, ranks_per_host=per_host)
                r.update(config=name, seed=seed, args_used=used, ranks_per_host=per_host, made=dict(
                    here, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")))
            else:
                r = dict(r, reused=True)
            runs.append(r)
            # every finished run kept at once: a job stopped part-way loses only the run in progress
            # (pass the file to --reuse to go on from it)
            partial.write_text(json.dumps({"runs": runs}, indent=1, default=str))
            elapsed = time.perf_counter() - started
            print(f"val loss {r['final_val_loss']:.4f}  ({r['wall_s']:.0f}s; ~{fmt_s(elapsed / i * (len(plan) - i))} left)",
                  flush=True)
    rows = []
    for name in args.configs:
        losses = [r["final_val_loss"] for r in runs if r["config"] == name]
        ratio = float(np.mean([r["bytes_ratio"] for r in runs if r["config"] == name]))
        rows.append({"config": name, "label": CONFIGS[name][0], "args": " ".join(CONFIGS[name][1]),
                     "mean": statistics.mean(losses), "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                     "min": min(losses), "max": max(losses), "bytes_ratio": ratio})
    target = target_config(args.configs)
    for row in rows:
        row["paired"] = paired_gap(runs, row["config"], target)
    dense = next((r["mean"] for r in rows if r["config"] == target), None)
    targets = steps_to_target(runs, args.configs, args.steps)
    info = machine_info()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command, "machine": info, "np": args.np, "ranks_per_host": per_host, "steps": args.steps,
            "seeds": args.seeds,
            "total_wall_s": time.perf_counter() - started}
    prefix = args.out_prefix
    lines = ["# Convergence on the transformer workload (examples/pytorch_gpt.py, AdamW)", "",
             f"Date (UTC): {meta['date']}  ",
             f"Machine: {info['cpu']}, {info['cores']} cores; torch {info.get('torch')}, horovod {info.get('horovod')}; "
             f"hvd_topk git {info.get('git')}, code {code} (hvd_topk and the examples, `code_fingerprint`)  ",
             f"Command: `{command}`  ",
             f"Each run: `mpirun -np {args.np} python examples/pytorch_gpt.py --quiet --json OUT --steps {args.steps} "
             f"--seed SEED ARGS`"
             + (f" on {args.np // per_host} emulated hosts of {per_host} ranks (network namespaces, 10 Gbit links)"
                if per_host > 1 else "")
             + (f" (`ddp-*` rows: `torchrun --standalone --nproc_per_node {args.np} examples/ddp_gpt.py ...`)"
                if any(c in DDP_CONFIGS for c in args.configs) else "")
             + f" (the example's defaults otherwise); seeds {', '.join(map(str, args.seeds))}; "
             f"total wall time {fmt_s(meta['total_wall_s'])}.", "",
             "| configuration | ARGS | final validation loss, mean ± std (sample) | min–max | vs dense | "
             "vs dense, seed by seed: mean [95% interval] | bytes vs dense fp32 |",
             "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        vs = f"{100 * (r['mean'] / dense - 1):+.1f}%" if dense and r["config"] != target else ""
        paired = r.get("paired")
        cell = (f"{100 * paired['mean']:+.1f}% [{100 * paired['low']:+.1f}, {100 * paired['high']:+.1f}] "
                f"(n={paired['n']})" if paired else "")
        lines.append(f"| {r['label']} | `{r['args']}` | {r['mean']:.4f} ± {r['std']:.4f} | "
                     f"{r['min']:.4f}–{r['max']:.4f} | {vs} | {cell} | {100 * r['bytes_ratio']:.2f}% |")
    if targets:
        half = targets["half_step"]
        lines += ["", f"Steps to target: the first validation step (every {args.eval_every or 100}) at which a run's "
                  f"loss is at or below dense's mean loss at step {half} ({targets['target_half']:.4f}) and at step "
                  f"{args.steps} ({targets['target_full']:.4f}); mean over seeds, and how many seeds got there.", "",
                  f"| configuration | steps to dense@{half} | steps to dense@{args.steps} |", "|---|---:|---:|"]
        for name in args.configs:
            cells = [fmt_reach(targets[name][key]) for key in ("half", "full")]
            lines.append(f"| {CONFIGS[name][0]} | {cells[0]} | {cells[1]} |")
    reused = sum(bool(r.get("reused")) for r in runs)
    if reused:
        origins = sorted({f"{r['made'].get('file') or '?'} (git {r['made'].get('git') or '?'}, {r['made'].get('date') or '?'})"
                          for r in runs if r.get("reused")})
        lines += ["", f"{reused} of the {len(runs)} runs were taken from `--reuse` files (same ARGS, steps, seed and ranks), "
                  f"made at: {'; '.join(origins)}. Each run's `made` in the JSON says where it came from."]
    lines += ["", f"Plot: `{prefix.name}.png` (validation loss, mean over seeds, shaded min–max).", ""]
    write_report(prefix, {"meta": meta, "runs": runs, "summary": rows}, "\n".join(lines), json_default=str)
    partial.unlink(missing_ok=True)  # the report holds every run now
    plot(runs, args.configs, f"{prefix}.png", meta)
    print("\n".join(lines))
    return 0


# Student's t at 97.5% for 1..10 degrees of freedom (a two-sided 95% interval over a few seeds)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def paired_gap(runs, config, target):
    """``config``'s loss against ``target``'s (dense AdamW) seed by seed, ``loss / dense - 1``:
    mean, 95% t-interval and the per-seed values (None for the target or without seeds in
    common). Paired, since a seed's two runs share their data and initial weights: the seeds'
    own spread (about 1% here) cancels, which the unpaired means hide."""
    if target is None or config == target:
        return None
    dense = {r["seed"]: r["final_val_loss"] for r in runs if r["config"] == target}
    gaps = [r["final_val_loss"] / dense[r["seed"]] - 1 for r in runs if r["config"] == config and r["seed"] in dense]
    if not gaps:
        return None
    mean = statistics.mean(gaps)
    half = T975.get(len(gaps) - 1, 1.96) * statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(gaps), "per_seed": gaps}


def target_config(configs):
    """The config the others are compared with: the first dense AdamW one (``dense``,
    ``dense-lr1e-2``, ...), or None."""
    return next((c for c in configs if c == "dense" or c.startswith("dense-lr")), None)


def steps_to_target(runs, configs, steps):
    """Per config, the first validation step whose loss is <= dense's mean loss at steps/2 and
    at steps, for each seed (None where never); {} without a dense config (``target_config``)."""
    dense = [r for r in runs if r["config"] == target_config(configs)]
    if not dense:
        return {}

    def dense_at(step):
        values = [h["val_loss"] for r in dense for h in r["history"] if h["step"] == step]
        return statistics.mean(values) if len(values) == len(dense) else None
    out = {"target_half": dense_at(steps // 2), "target_full": dense_at(steps), "half_step": steps // 2}
    if out["target_half"] is None:  # no evaluation at steps/2: the nearest one before it, named as such
        out["half_step"] = max(h["step"] for h in dense[0]["history"] if h["step"] <= steps // 2)
        out["target_half"] = dense_at(out["half_step"])
    for name in configs:
        out[name] = {key: [next((h["step"] for h in r["history"] if h["val_loss"] <= out[f"target_{key}"]), None)
                           for r in runs if r["config"] == name] for key in ("half", "full")}
    return out


def fmt_reach(reached):
    got = [s for s in reached if s is not None]
    if not got:
        return f"not reached (0/{len(reached)})"
    return f"{statistics.mean(got):.0f} ({len(got)}/{len(reached)})"


def plot(runs, configs, path, meta):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name in configs:
        mine = [r for r in runs if r["config"] == name]
        n = min(len(r["history"]) for r in mine)
        steps = [h["step"] for h in mine[0]["history"][:n]]
        curves = np.array([[h["val_loss"] for h in r["history"][:n]] for r in mine])
        line, = ax.plot(steps, curves.mean(0), marker="o", label=f"{CONFIGS[name][0]} (n={len(mine)})")
        ax.fill_between(steps, curves.min(0), curves.max(0), color=line.get_color(), alpha=0.15, lw=0)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"byte-level GPT, AdamW, {meta['np']} ranks, seeds {', '.join(map(str, meta['seeds']))}, "
                 f"{meta['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
