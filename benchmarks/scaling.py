#!/usr/bin/env python
"""A MODEL, not a measurement: predicted step time and scaling efficiency of data-parallel
training with Horovod dense allreduce (fp32, fp16) and hvd_topk's exchanges (allgather, sparse
allreduce, and auto = the fastest of what its measured trial tries; 1% and 0.1%, error
feedback), for P = 1, 2, 4, ..., 256 workers at 1/10/25/100 Gbit/s, for ResNet-50 and a
BERT-base-sized model.

    .venv/bin/python benchmarks/scaling.py                 # table + plot under benchmarks/results/scaling/
    .venv/bin/python benchmarks/scaling.py --overlap 0.5   # let wire time hide behind half of compute

Per step and worker (weak scaling: the batch per worker is fixed, so compute time does not
depend on P):

- dense ring allreduce of n elements of b bytes (b = 4 fp32, 2 fp16), in m fusion messages:
      t = 2 (P-1)/P * n b / B  +  2 (P-1) * alpha * m
- hvd_topk allgather: k = density * n (value, index) pairs of b_v + b_i bytes (4 + 4):
      t_wire = (P-1) * k (b_v + b_i) / B  +  (P-1) * alpha * m
      t_cpu  = n * c_sel                       (selection, calibrated, see below)
             + ef_passes * n * c_pass          (error feedback: acc = residual + grad)
             + P k * c_scatter + n * c_pass    (decompression: P k scattered adds + one pass over n)
- hvd_topk sparse allreduce (ScaleCom's CLT-k, each rank choosing one part's indices): the k
  indices ring-allgathered, then an allreduce of k + 1 values:
      t_wire = (P-1)/P (k b_i + 2 (k+1) b_v) / B  +  3 (P-1) * alpha * m
      t_cpu  = as the allgather's, with k scattered adds (one row) instead of P k
- with ``--exchange-json`` (default benchmarks/results/exchange/exchange-strategies.json, measured on
  emulated hosts by benchmarks/exchange.py) t_cpu per element is instead calibrated per
  strategy from the measurement at P=2 and the fastest link there: the measured step minus the
  backward-only step minus the modelled wire time, divided by n.
- auto (``exchange="auto"``) = the fastest of the families its trial measures
  (``hvd_topk.auto.families``): dense fp32 and the two sparse exchanges (dense fp16 too with
  ``value_bytes`` 2, the library's rule since 2026-11-27: fp16 only where the values already
  travel in 16 bits; with hosts of several ranks, also the two hierarchical ones).
- ``--ranks-per-host L`` (default 1: every rank its own host): P = N hosts x L ranks. A ring's
  slowest edge is then a host's network link (B = the link rate, shared by the host's L ranks);
  inside one host (P <= L) every collective runs at ``--host-gbps`` (NVLink class). The
  hierarchical exchange (``hierarchical=True``, ``hvd_topk.hierarchy``) per bucket: a dense
  reduce-scatter inside the host, (L-1)/L n 4 B at host speed; L concurrent sparse exchanges of
  one shard each (n/L elements, k pairs: L x density) among the N hosts, all through the host's link; an
  allgather of the compressed results inside the host; selection over n/L per rank.
- the byte counts are hvd_topk's own cost functions (``hvd_topk.exchange``: ``DenseAllreduce``,
  ``AllgatherPairs`` and ``SparseAllreduce``.wire_bytes), and a forced sparse strategy goes dense
  (fp32 allreduce) exactly where ``hvd_topk.exchange.cheapest`` makes hvd_topk.DistributedOptimizer
  do so (``dense_fallback``): for the allgather at density >= 1/P (fp32, int32 indices), for the
  sparse allreduce at about 67%. That rule counts bytes only, so it can still pick sparse where
  selection makes sparse slower (flagged in the table).
- step = compute + t_cpu + max(0, t_wire - overlap * compute); by default overlap = 0 (no
  overlap of communication with backward). That is the pessimistic bound for each method's
  efficiency, but it favours compression in the comparison: on GPUs a dense allreduce hides much
  of its time behind backward, while hvd_topk's CPU-side selection and decode (t_cpu) are never
  hidden here either. Efficiency = compute / step.
  At P = 1 nothing is exchanged: step = compute.

Selection cost per element c_sel is read from benchmarks/results/selection/selection.json when present
(rows {"n", "density", "threads", "method", "median_s"}: the row of --selection-method and
--selection-threads whose density is closest to the target, at the largest n, gives
median_s / n), else --selection-ns (default 1 ns/element: about what a native sampled kernel
does on the project's CPU, 22 ms for 25M). The streaming floor c_pass likewise comes from a row
whose method names the streaming pass ("stream"/"floor"), else --pass-ns (0.2 ns: 5 ms for 25M).
These are CPU numbers from the project machine; a GPU selects at its own speed: set --selection-ns.

Ignored (state of the model): small tensors that hvd_topk always sends dense (biases, norms,
<1% of the parameters but about 0.22 MB a step for ResNet-50 in fp32: about a tenth of the pairs'
bytes at 1%, as much again as the pairs at 0.1%, so the 0.1% rows under-count hvd_topk's bytes
about 2x), Horovod's negotiation and cycle time, fp16 cast cost, contention
between links, hierarchical/tree algorithms, compute slowing down at larger P, and accuracy.
"""

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import sys
import dataclasses
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import emulated_hosts, write_report  # noqa: E402
from hvd_topk.exchange import AllgatherPairs, DenseAllreduce, SparseAllreduce, cheapest  # noqa: E402  (the optimizer's own)
from hvd_topk import auto  # noqa: E402  (the families auto's trial tries)

GBIT = 1e9 / 8  # bytes per second in 1 Gbit/s
RESNET50_MEASURED = 25_557_032  # the elements benchmarks/exchange.py exchanges (ResNet-50's 161 tensors)
DEFAULT_SELECTION_NS = 1.0
DEFAULT_PASS_NS = 0.2
SPARSE = {"allgather": AllgatherPairs, "sparse_allreduce": SparseAllreduce}
METHODS = ("dense fp32", "dense fp16", "allgather 1%", "sparse_allreduce 1%", "auto 1%", "auto 0.1%")
DENSITY = {"1%": 0.01, "0.1%": 0.001}


@dataclass
class Costs:
    """Everything the model needs besides the model size, P and the bandwidth."""
    alpha_s: float = 25e-6          # per message and ring hop (TCP between hosts)
    fusion_bytes: float = 64 * 2**20  # Horovod fusion buffer / hvd_topk bucket (dense-equivalent)
    selection_s_per_elem: object = DEFAULT_SELECTION_NS * 1e-9  # a float, or {density: float}
    pass_s_per_elem: float = DEFAULT_PASS_NS * 1e-9
    scatter_s_per_elem: float = 2e-9
    ef_passes: float = 1.0
    overlap: float = 0.0            # fraction of compute that wire time may hide behind
    value_bytes: int = 4
    index_bytes: int = 4
    local_s_per_elem: dict = None   # {strategy name: all local work per element}, measured
    ranks_per_host: int = 1         # L: P = N hosts x L ranks
    host_gbps: float = 1000.0       # bandwidth between the ranks of one host (NVLink class)

    def link_gbps(self, P, gbps):
        """The bandwidth of a ring's slowest edge: the host's network link, or inside one host."""
        return self.host_gbps if 1 < self.ranks_per_host and P <= self.ranks_per_host else gbps

    def selection_cost(self, density):
        """Per element, at the calibrated density nearest ``density`` (on a log scale)."""
        c = self.selection_s_per_elem
        if not isinstance(c, dict):
            return c
        return c[min(c, key=lambda d: abs(math.log(float(d) / density)))]


def messages(n, elem_bytes, fusion_bytes):
    """Fusion messages for n elements of elem_bytes: ceil(n*b / fusion), at least one."""
    return max(1, math.ceil(n * elem_bytes / fusion_bytes))


def dense_allreduce_s(P, n, elem_bytes, gbps, costs):
    """Ring allreduce: 2(P-1)/P * n*b / B + 2(P-1) * alpha per message."""
    if P <= 1:
        return 0.0
    m = messages(n, elem_bytes, costs.fusion_bytes)
    wire = DenseAllreduce.wire_bytes(P, n, 0, costs.value_bytes, costs.index_bytes, elem_bytes)
    return wire / (costs.link_gbps(P, gbps) * GBIT) + 2 * (P - 1) * costs.alpha_s * m


def sparse_bytes_in(P, n, density, costs, strategy=AllgatherPairs):
    """Bytes into each rank per step for ``strategy`` (the optimizer's own cost function)."""
    k = max(1, round(density * n))
    return strategy.wire_bytes(P, n, k, costs.value_bytes, costs.index_bytes, 4)


def sparse_times(P, n, density, gbps, costs, strategy=AllgatherPairs):
    """(wire seconds, local seconds) of one hvd_topk sparse exchange (P > 1)."""
    k = max(1, round(density * n))
    m = messages(n, 4, costs.fusion_bytes)  # buckets are fusion_bytes of the fp32 gradient
    if strategy is SparseAllreduce:  # a ring allgather, then a ring allreduce, per bucket
        hops, rows = 3 * (P - 1), 1
    else:
        hops, rows = P - 1, P
    wire = (sparse_bytes_in(P, n, density, costs, strategy) / (costs.link_gbps(P, gbps) * GBIT)
            + hops * costs.alpha_s * m)
    selection = n * costs.selection_cost(density)
    ef = costs.ef_passes * n * costs.pass_s_per_elem
    decompress = rows * k * costs.scatter_s_per_elem + n * costs.pass_s_per_elem
    modelled = selection + ef + decompress
    if costs.local_s_per_elem and strategy.name in costs.local_s_per_elem:  # never below the model
        return wire, max(modelled, n * costs.local_s_per_elem[strategy.name])
    return wire, modelled


def goes_sparse(P, density, costs, n=2**24, strategy=AllgatherPairs):
    """hvd_topk.DistributedOptimizer's choice (dense_fallback=True) for a bucket of n fp32
    elements: its own ``cheapest`` over dense and ``strategy`` (one rank: dense, a no-op)."""
    if P <= 1:
        return False
    k = max(1, round(density * n))
    return cheapest((DenseAllreduce, strategy), P, n, k, costs.value_bytes, costs.index_bytes, 4).sparse


def hierarchical_times(P, n, density, gbps, costs, strategy):
    """(wire seconds, local seconds) of the hierarchical exchange with L = costs.ranks_per_host."""
    L = costs.ranks_per_host
    N = max(1, P // L)
    k = max(1, round(density * n))
    m = messages(n, 4, costs.fusion_bytes)
    host = costs.host_gbps * GBIT
    reduce_scatter = (L - 1) / L * n * 4 / host + (L - 1) * costs.alpha_s * m
    across = dataclasses.replace(costs, ranks_per_host=1)  # one rank per host in the cross exchange
    shard_density = min(1.0, density * L)  # each rank still sends k = density x n pairs
    cross, cross_local = sparse_times(N, n / L, shard_density, gbps, across, strategy) if N > 1 else (0.0, None)
    cross *= L if N > 1 else 0  # the L shards' exchanges share the host's link
    pairs = N if strategy is AllgatherPairs else 1
    gather = (L - 1) * pairs * k * (costs.value_bytes + costs.index_bytes) / host + (L - 1) * costs.alpha_s * m
    if cross_local is None:  # one host: the shard is only selected and decoded
        cross_local = (n / L) * (costs.selection_cost(shard_density) + costs.pass_s_per_elem)
    local = cross_local + n * costs.pass_s_per_elem  # + the full decode of every shard
    return reduce_scatter + cross + gather, local


def step(method, P, n, compute_s, gbps, costs):
    """One prediction: dict with step_s, efficiency, and the parts. ``method``: "dense fp32",
    "dense fp16", or "<allgather|sparse_allreduce|auto> <density>" ("1%", "0.1%")."""
    if method.startswith("auto "):
        density = method.split()[1]
        # what the library's trial tries (hvd_topk.auto.families): dense fp16 only where the values
        # already travel in 16 bits, the hierarchical families where hosts hold several ranks
        hier = costs.ranks_per_host > 1 and P > costs.ranks_per_host
        names = [{"dense": "dense fp32", "dense_fp16": "dense fp16"}.get(f) or
                 (f"hier {f[len(auto.HIER):]} {density}" if f.startswith(auto.HIER) else f"{f} {density}")
                 for f in auto.families(hier, False, fp16=costs.value_bytes == 2)]
        options = [step(m, P, n, compute_s, gbps, costs) for m in names]
        return dict(min(options, key=lambda r: r["step_s"]))
    if method.startswith("hier "):
        _, name, density = method.split()
        wire, local = hierarchical_times(P, n, DENSITY[density], gbps, costs, SPARSE[name])
        if P <= 1:
            wire, local = 0.0, 0.0
        step_s = compute_s + local + max(0.0, wire - costs.overlap * compute_s)
        return {"step_s": step_s, "efficiency": compute_s / step_s, "wire_s": wire, "local_s": local,
                "mode": f"hier {name}"}
    wire, local, mode = 0.0, 0.0, "dense fp32"
    if method == "dense fp32":
        wire = dense_allreduce_s(P, n, 4, gbps, costs)
    elif method == "dense fp16":
        wire, mode = dense_allreduce_s(P, n, 2, gbps, costs), "dense fp16"
    else:
        name, density = method.split()
        strategy = SPARSE[name]
        if goes_sparse(P, DENSITY[density], costs, n, strategy):
            mode = name
            wire, local = sparse_times(P, n, DENSITY[density], gbps, costs, strategy)
        else:
            wire = dense_allreduce_s(P, n, 4, gbps, costs)
    if P <= 1:
        wire, local = 0.0, 0.0
    step_s = compute_s + local + max(0.0, wire - costs.overlap * compute_s)
    return {"step_s": step_s, "efficiency": compute_s / step_s, "wire_s": wire, "local_s": local,
            "mode": mode}


def calibrate_local(path, n_measured, costs):
    """{strategy: local seconds per element} from a benchmarks/exchange.py JSON: for every P=2
    run (each link rate), (method's median step - the backward-only step - the modelled wire
    time) / n, and the largest of these (the machine is noisy; the largest never flatters
    hvd_topk). Returns ({}, note) when the file or the rows are missing."""
    path = Path(path)
    if not path.exists():
        return {}, f"{path.name} not found: local work from the selection calibration"
    runs = [r for r in json.loads(path.read_text()).get("runs", []) if r.get("P") == 2 and r.get("rows")]
    out, notes = {}, []
    for method, name in (("topk-ef", "allgather"), ("topk-sar", "sparse_allreduce")):
        estimates = []
        for run in runs:
            rows = {r["method"].partition("@")[0]: r for r in run["rows"]}
            if method not in rows or "none" not in rows:
                continue
            gbps = emulated_hosts.rate_bits(run["rate"]) / 1e9
            density = float(rows[method]["method"].partition("@")[2])
            wire, _ = sparse_times(2, n_measured, density, gbps, dataclasses.replace(costs, local_s_per_elem=None),
                                   SPARSE[name])
            estimates.append(((rows[method]["median_ms"] - rows["none"]["median_ms"]) / 1e3 - wire, run["rate"]))
        if estimates:
            local, rate = max(estimates)
            out[name] = max(0.0, local) / n_measured
            notes.append(f"{name} {1e3 * local:.1f} ms at {rate} ({out[name] * 1e9:.2f} ns/element; "
                         f"estimates " + ", ".join(f"{1e3 * e:.1f} ms at {r}" for e, r in estimates) + ")")
    if not out:
        return {}, f"no usable P=2 rows in {path.name}: local work from the selection calibration"
    return out, (f"local work per step measured in {path.name} (P=2, this machine's CPU, two ranks sharing its "
                 f"2 cores; the largest estimate over link rates): " + "; ".join(notes))


def calibrate(path, method="sampled", threads=1, density=0.01):
    """(selection s/element, streaming pass s/element, note) from a selection.json, or defaults.

    Accepts a list of rows or {"rows": [...]} / {"results": [...]}.
    """
    sel, pas = DEFAULT_SELECTION_NS * 1e-9, DEFAULT_PASS_NS * 1e-9
    notes = []
    path = Path(path)
    if not path.exists():
        return sel, pas, (f"{path.name} not found: default selection {DEFAULT_SELECTION_NS} ns/element, "
                          f"pass {DEFAULT_PASS_NS} ns/element")
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = data.get("rows") or data.get("results") or []
    rows = [r for r in data if isinstance(r, dict) and {"n", "method", "median_s"} <= set(r)
            and r.get("threads", threads) == threads and r["n"] > 0]

    def pick(candidates, target_density):
        if not candidates:
            return None
        if target_density is not None:
            with_d = [r for r in candidates if r.get("density")]
            if with_d:
                best = min(abs(math.log(r["density"] / target_density)) for r in with_d)
                candidates = [r for r in with_d if abs(math.log(r["density"] / target_density)) == best]
        n_max = max(r["n"] for r in candidates)
        r = [r for r in candidates if r["n"] == n_max][0]
        return r["median_s"] / r["n"], r

    got = pick([r for r in rows if str(r["method"]).lower() == method.lower()], density)
    if got:
        sel = got[0]
        notes.append(f"selection {sel * 1e9:.3g} ns/element from {path.name} (method {got[1]['method']}, "
                     f"n {got[1]['n']:,}, density {got[1].get('density')}, threads {threads})")
    else:
        notes.append(f"no '{method}' row with threads={threads} in {path.name}: default selection "
                     f"{DEFAULT_SELECTION_NS} ns/element")
    got = pick([r for r in rows if any(w in str(r["method"]).lower() for w in ("stream", "floor"))], None)
    if got:
        pas = got[0]
        notes.append(f"streaming pass {pas * 1e9:.3g} ns/element from {path.name} (method {got[1]['method']}, "
                     f"n {got[1]['n']:,})")
    else:
        notes.append(f"streaming pass: default {DEFAULT_PASS_NS} ns/element")
    return sel, pas, "; ".join(notes)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--resnet-params", type=float, default=25.6e6, help="ResNet-50 parameters (25.6M)")
    a("--resnet-compute-s", type=float, default=0.10,
      help="ResNet-50 forward+backward per step, batch 32 per worker, V100-class GPU, fp32 (0.10 s)")
    a("--bert-params", type=float, default=110e6, help="BERT-base parameters (110M)")
    a("--bert-compute-s", type=float, default=0.20,
      help="BERT-base forward+backward per step, batch 32 x 128 tokens per worker, V100-class GPU (0.20 s)")
    a("--gbps", type=float, nargs="+", default=[1, 10, 25, 100], help="link rates in Gbit/s (1 10 25 100)")
    a("--max-p", type=int, default=256, help="largest P, powers of two from 1 (256)")
    a("--alpha-us", type=float, default=25.0, help="latency per message and ring hop, microseconds (25)")
    a("--fusion-mb", type=float, default=64.0, help="fusion buffer / bucket size, MiB (64)")
    a("--selection-json", type=Path, default=RESULTS / "selection" / "selection.json",
      help="measured selection times (benchmarks/results/selection/selection.json)")
    a("--selection-method", default="sampled", help="which method's rows to use (sampled)")
    a("--selection-threads", type=int, default=1, help="which thread count's rows to use (1)")
    a("--selection-ns", type=float, default=None,
      help=f"override: selection cost per element, ns (default: from the JSON, else {DEFAULT_SELECTION_NS})")
    a("--pass-ns", type=float, default=None,
      help=f"override: one streaming pass per element, ns (default: from the JSON, else {DEFAULT_PASS_NS})")
    a("--scatter-ns", type=float, default=2.0, help="one scattered add during decompression, ns (2)")
    a("--ef-passes", type=float, default=1.0, help="streaming passes for error feedback (1)")
    a("--ranks-per-host", type=int, default=1,
      help="ranks (GPUs) per host; P = hosts x this (1: every rank its own host)")
    a("--host-gbps", type=float, default=1000.0,
      help="bandwidth between the ranks of one host, Gbit/s (1000: NVLink class)")
    a("--overlap", type=float, default=0.0,
      help="fraction of compute that wire time can hide behind (0: no overlap; 1: all of it)")
    a("--exchange-json", type=Path, default=RESULTS / "exchange" / "exchange-strategies.json",
      help="measured exchanges on emulated hosts (benchmarks/exchange.py) calibrating hvd_topk's local work per "
           "strategy; a missing file falls back to the selection calibration")
    a("--out-prefix", type=Path, default=RESULTS / "scaling" / "scaling", help="PREFIX.json/.md/.png (benchmarks/results/scaling/scaling)")
    a("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if not 0.0 <= args.overlap <= 1.0:
        p.error("--overlap must be in [0, 1]")
    return args


def methods_for(costs):
    """The table's columns: with hosts of several ranks, the hierarchical exchanges too."""
    if costs.ranks_per_host > 1:
        return METHODS[:4] + ("hier allgather 1%", "hier sparse_allreduce 1%") + METHODS[4:]
    return METHODS


def simulate(models, gbps_list, Ps, costs):
    rows = []
    for model, (n, compute_s) in models.items():
        for gbps in gbps_list:
            for P in Ps:
                row = {"model": model, "params": n, "compute_s": compute_s, "gbps": gbps, "P": P}
                for method in methods_for(costs):
                    row[method] = step(method, P, n, compute_s, gbps, costs)
                rows.append(row)
    return rows


SHORT = {"dense fp32": "fp32", "dense fp16": "fp16", "allgather": "ag", "sparse_allreduce": "sar",
         "hier allgather": "h-ag", "hier sparse_allreduce": "h-sar"}


def fmt_cell(r, method):
    c = r[method]
    cell = f"{100 * c['efficiency']:.0f}% ({1000 * c['step_s']:.0f})"
    if method.startswith("auto") and r["P"] > 1:
        cell += f" {SHORT[c['mode']]}"
    elif not method.startswith("dense") and r["P"] > 1:
        if c["mode"] == "dense fp32":
            cell += " D"
        elif c["step_s"] > min(r["dense fp32"]["step_s"], r["dense fp16"]["step_s"]):
            cell += " !"
    return cell


def markdown(meta, rows):
    lines = [
        "# Scaling model: predicted, NOT measured",
        "",
        "Output of a cost model (`benchmarks/scaling.py`), not a measurement on a cluster.  ",
        f"Date (UTC): {meta['date']}; made on {meta['machine']}.  ",
        f"Command: `{meta['command']}`  ",
        f"Assumptions: {meta['assumptions']}  ",
        f"Calibration: {meta['calibration']}",
        "",
        "Cells: scaling efficiency = compute / step time, and (step time in ms). "
        "`D`: the forced strategy fell back to dense fp32 at this P (``dense_fallback``: it would move "
        "more bytes). `!`: sparse but predicted slower than the faster of Horovod dense fp32 / fp16 "
        "(selection and decompression cost, or fp16 halving the dense bytes: the byte-only rule sees "
        "neither). auto cells name what the trial would pick (fp32, fp16, ag = allgather, "
        "sar = sparse allreduce).",
    ]
    methods = meta["methods"]
    for model in meta["models"]:
        mrows = [r for r in rows if r["model"] == model]
        n, comp = meta["models"][model]
        lines += ["", f"## {model}: {n / 1e6:.1f}M parameters, compute {1000 * comp:.0f} ms per step", "",
                  "| Gbit/s | P | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
        for r in mrows:
            lines.append(f"| {r['gbps']:g} | {r['P']} | " + " | ".join(fmt_cell(r, m) for m in methods) + " |")
    lines.append("")
    return "\n".join(lines)


def summary_lines(meta, rows):
    """A few headline numbers: efficiency at P=8, 64, 256 per model and bandwidth."""
    out = []
    for model in meta["models"]:
        for gbps in meta["gbps"]:
            parts = []
            for P in (8, 64, 256):
                r = next((r for r in rows if r["model"] == model and r["gbps"] == gbps and r["P"] == P), None)
                if r:
                    parts.append(f"P={P}: " + ", ".join(
                        f"{m.replace('dense ', '')} {100 * r[m]['efficiency']:.0f}%"
                        + (f"({SHORT[r[m]['mode']]})" if m.startswith("auto") else "") for m in meta["methods"]))
            out.append(f"{model} @ {gbps:g} Gbit/s  " + " | ".join(parts))
    for model in meta["models"]:
        for m in meta["methods"][2:]:
            slow = []
            for gbps in meta["gbps"]:
                mine = [r for r in rows if r["model"] == model and r["gbps"] == gbps and r["P"] > 1]
                bad = [r["P"] for r in mine
                       if r[m]["step_s"] * 0.95 > min(r["dense fp32"]["step_s"], r["dense fp16"]["step_s"])]
                if bad:
                    tail = [r["P"] for r in mine if r["P"] >= bad[0]]
                    slow.append(f"{gbps:g} Gbit/s " + (f"P >= {bad[0]}" if bad == tail else
                                                      "P = " + ", ".join(map(str, bad))))
            out.append(f"{model}, {m}: slower than 0.95x the faster dense option (fp32/fp16) at "
                       + ("; ".join(slow) or "no P and bandwidth"))
    return out


def plot(meta, rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    colors = dict(zip(meta["gbps"], ["tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple",
                                     "tab:brown"]))
    styles = {"dense fp32": ("-", "o"), "dense fp16": ("--", "s"), "allgather 1%": (":", "^"),
              "sparse_allreduce 1%": ("-.", "v"), "auto 1%": ((0, (1, 1)), "*"), "auto 0.1%": ((0, (3, 1, 1, 1)), "x"),
              "hier allgather 1%": ((0, (5, 2)), "<"), "hier sparse_allreduce 1%": ((0, (2, 2)), ">")}
    models = list(meta["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for gbps in meta["gbps"]:
            sel = [r for r in rows if r["model"] == model and r["gbps"] == gbps]
            Ps = [r["P"] for r in sel]
            for m in meta["methods"]:
                ls, mk = styles[m]
                ax.plot(Ps, [100 * r[m]["efficiency"] for r in sel], ls=ls, marker=mk, ms=3.5,
                        color=colors.get(gbps), lw=1.3)
        n, comp = meta["models"][model]
        ax.set_xscale("log", base=2)
        ax.set_xticks(meta["P"], [str(P) for P in meta["P"]])
        ax.set_xlabel("workers P")
        ax.set_ylabel("scaling efficiency = compute / step (%)")
        ax.set_ylim(0, 105)
        ax.set_title(f"{model}: {n / 1e6:.1f}M params, compute {1000 * comp:.0f} ms/step")
        ax.grid(True, alpha=0.3, which="both")
        ax.text(0.5, 0.45, "MODEL, not a measurement", transform=ax.transAxes, fontsize=26, color="gray",
                alpha=0.18, weight="bold", ha="center", va="center", rotation=15, zorder=0)
    handles = [Line2D([], [], color=colors[g], lw=2, label=f"{g:g} Gbit/s") for g in meta["gbps"]]
    handles += [Line2D([], [], color="black", ls=styles[m][0], marker=styles[m][1], label=m) for m in meta["methods"]]
    fig.legend(handles=handles, fontsize=9, loc="lower center", ncol=len(handles), frameon=False)
    ov = "no overlap" if meta["overlap"] == 0 else f"overlap {meta['overlap']:g} of compute"
    fig.suptitle(f"MODEL, NOT A MEASUREMENT. Predicted scaling efficiency (cost model, {ov}; forced strategies go "
                 f"dense where their byte rule says so; auto = the fastest prediction)\n{meta['calibration'][:160]}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    sel, notes = {}, []
    for density in sorted(set(DENSITY.values()), reverse=True):
        sel[density], pas, note = calibrate(args.selection_json, args.selection_method, args.selection_threads,
                                            density)
        notes.append(f"at density {density:g}: " + note.split("; ")[0])
    notes.append(note.split("; ")[-1])
    if not Path(args.selection_json).exists():
        notes = [f"{Path(args.selection_json).name} not found: default selection {DEFAULT_SELECTION_NS} ns/element",
                 f"streaming pass: default {DEFAULT_PASS_NS} ns/element"]
    if args.selection_ns is not None:
        sel = {d: args.selection_ns * 1e-9 for d in sel}
        notes = [f"selection {args.selection_ns:g} ns/element (--selection-ns)", notes[-1]]
    if args.pass_ns is not None:
        pas = args.pass_ns * 1e-9
        notes[-1] = f"streaming pass {args.pass_ns:g} ns/element (--pass-ns)"
    note = "; ".join(notes)
    costs = Costs(alpha_s=args.alpha_us * 1e-6, fusion_bytes=args.fusion_mb * 2**20, selection_s_per_elem=sel,
                  pass_s_per_elem=pas, scatter_s_per_elem=args.scatter_ns * 1e-9, ef_passes=args.ef_passes,
                  overlap=args.overlap, ranks_per_host=args.ranks_per_host, host_gbps=args.host_gbps)
    local, local_note = calibrate_local(args.exchange_json, RESNET50_MEASURED, costs)
    if local:
        costs = dataclasses.replace(costs, local_s_per_elem=local)
        note = local_note + "; otherwise " + note
    else:
        note = note + "; " + local_note
    models = {"ResNet-50": (args.resnet_params, args.resnet_compute_s),
              "BERT-base": (args.bert_params, args.bert_compute_s)}
    Ps = [2**i for i in range(int(math.log2(args.max_p)) + 1)]
    rows = simulate(models, args.gbps, Ps, costs)

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    meta = {
        "kind": "model prediction, not a measurement",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu}, {os.cpu_count()} cores (only the calibration's selection numbers come from a machine)",
        "command": shlex.join(["python", "benchmarks/scaling.py", *(sys.argv[1:] if argv is None else argv)]),
        "models": models, "gbps": args.gbps, "P": Ps, "overlap": args.overlap,
        "methods": list(methods_for(costs)), "ranks_per_host": args.ranks_per_host, "host_gbps": args.host_gbps,
        "selection_ns": {str(d): c * 1e9 for d, c in sel.items()}, "pass_ns": pas * 1e9, "calibration": note,
        "costs": vars(costs),
        "assumptions": ((f"{args.ranks_per_host} ranks per host: a ring's slowest edge is the host's link (B), "
                         f"inside one host {args.host_gbps:g} Gbit/s; hierarchical = reduce-scatter inside the host, "
                         f"the L shard exchanges across hosts sharing the host's link, compressed allgather inside; "
                         if args.ranks_per_host > 1 else "one rank per host; ") +
                        f"ring allreduce 2(P-1)/P·n·b/B + 2(P-1)·α per message, ring allgather (P-1)·k·8/B + "
                        f"(P-1)·α per message; α = {args.alpha_us:g} µs, fusion/bucket {args.fusion_mb:g} MiB; "
                        f"compute per step fixed (weak scaling, batch per worker fixed): ResNet-50 "
                        f"{1000 * args.resnet_compute_s:.0f} ms, BERT-base {1000 * args.bert_compute_s:.0f} ms "
                        f"(V100-class GPU, batch 32); sparse allreduce: ring allgather of the parts' indices "
                        f"((P-1) hops) + ring allreduce of the values; "
                        f"hvd_topk: fp32 values + int32 indices, error feedback "
                        f"({args.ef_passes:g} pass), decompression P·k scattered adds at {args.scatter_ns:g} ns + "
                        f"one pass over n; forced strategies dense where hvd_topk.exchange.cheapest says so; "
                        + ("no overlap of communication with compute" if args.overlap == 0 else
                           f"wire time overlaps up to {args.overlap:g} of compute; selection and "
                           f"decompression never overlap")),
    }
    prefix = args.out_prefix.resolve()
    md = markdown(meta, rows)
    summ = summary_lines(meta, rows)
    md += "\n## Summary (efficiency)\n\n" + "\n".join(f"- {s}" for s in summ) + "\n"
    write_report(prefix, {"meta": meta, "rows": rows}, md)
    if not args.no_plot:
        plot(meta, rows, f"{prefix}.png")
    print(md)
    print(f"wrote {prefix}.json, {prefix}.md" + ("" if args.no_plot else f", {prefix}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
