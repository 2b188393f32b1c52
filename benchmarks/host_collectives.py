#!/usr/bin/env python
"""What the hierarchical exchange's dense step inside a host costs on emulated hosts.

The hierarchical exchange (``hvd_topk.hierarchy``) first reduce-scatters every sparse bucket,
dense, among the ranks of a host. On a GPU host that runs over NVLink; on this machine's emulated
hosts (network namespaces sharing the machine's cores, MPI over TCP on each host's loopback) it
costs CPU time that all ranks of all hosts compete for. This measures that cost alone, outside
the optimizer, to read beside ``benchmarks/exchange.py --ranks-per-host`` (whose hierarchical rows
break a step down with ``compression_stats()``'s timers).

``mpirun -np H*L -H host0:L,...`` from ``tools/emulated_hosts.py``; every rank calls
``hvd_topk.init()`` and then, with all hosts at once, each timed ``--reps`` times after a scalar
allreduce aligns the ranks, the three taking turns (median per rank):

    host reduce-scatter   hvd.reducescatter(g, op=Sum, process_set=host) of ResNet-50's
                          25,557,032 fp32 values (what a step's hierarchical exchange starts with)
    host allreduce        hvd.allreduce of the same inside the host (Horovod's dense alternative)
    copy                  g2.copy_(g): one memory pass over the same bytes, for scale

and reports beside them the time the hierarchical allgather's fewer bytes save on the link, from
a results file of ``benchmarks/exchange.py`` (``--exchange-results``, default
``benchmarks/results/exchange/exchange-hierarchical.json``): (flat - hierarchical) wire bytes / rate.

    .venv/bin/python benchmarks/host_collectives.py                 # 2 hosts x 2 ranks, 1gbit
    .venv/bin/python benchmarks/host_collectives.py --reps 3 --output-name host-collectives-smoke

Writes benchmarks/results/hierarchical/<output-name>.{json,md}.
"""

import argparse
import datetime
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NUMEL = 25_557_032  # ResNet-50's parameters (tools/shapes.py)
OPS = ("host reduce-scatter", "host allreduce", "copy")


def worker(args):
    import torch
    import horovod.torch as hvd
    import hvd_topk

    topo = hvd_topk.init()
    torch.set_num_threads(1)
    g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(hvd.rank()))
    g2 = torch.empty_like(g)
    calls = {
        "host reduce-scatter": lambda i: hvd.reducescatter(g, op=hvd.Sum, process_set=topo.local, name=f"rs{i}"),
        "host allreduce": lambda i: hvd.allreduce(g, op=hvd.Sum, process_set=topo.local, name=f"ar{i}"),
        "copy": lambda i: g2.copy_(g),
    }
    times = {op: [] for op in OPS}
    for i in range(args.reps + 1):  # the first round is a warm-up; the ops take turns, so
        for op in OPS:              # the machine's drift hits them alike
            hvd.allreduce(torch.zeros(1), name=f"align.{op}.{i}")
            t0 = time.perf_counter()
            calls[op](i)
            if i:
                times[op].append(time.perf_counter() - t0)
    out = {op: 1e3 * statistics.median(t) for op, t in times.items()}
    mine = torch.tensor([[out[op] for op in OPS]], dtype=torch.float64)
    every = hvd.allgather(mine, name="results").tolist()
    if hvd.rank() == 0:
        places = hvd.allgather_object((topo.cross_rank, topo.local_rank), name="places")
        Path(args.out).write_text(json.dumps({"per_rank_ms": [dict(zip(OPS, r)) for r in every],
                                              "places": places}))
    else:
        hvd.allgather_object((topo.cross_rank, topo.local_rank), name="places")


def link_saving(path, rate):
    """(flat, hierarchical) allgather wire MB per host link and step at ``rate`` from an
    exchange.py results file, or None where it has no such rows."""
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    for run in report.get("runs", []):
        if run.get("rate") != rate:
            continue
        wire = {r["method"].partition("@")[0]: r["wire_tx_bytes_per_step_rank"] for r in run["rows"]}
        if "topk-ef" in wire and "topk-ef-hier" in wire:
            return wire["topk-ef"] / 1e6, wire["topk-ef-hier"] / 1e6
    return None


def markdown(report):
    lines = [f"# Dense collectives inside an emulated host ({report['hosts']} hosts x "
             f"{report['ranks_per_host']} ranks, {report['rate']} between hosts)", "",
             f"- command: `{report['command']}`",
             f"- date: {report['date_utc']}; machine: {report['machine']}",
             f"- {NUMEL:,} fp32 values (ResNet-50's gradient, {4 * NUMEL / 1e6:.1f} MB), all hosts at once, "
             f"median of {report['reps']} calls per rank after one warm-up; MPI over TCP, ranks of a host "
             "over its loopback (the emulated hosts' settings)", "",
             "| rank (host, local rank) | " + " | ".join(f"{op} ms" for op in OPS) + " |",
             "|---|" + "---:|" * len(OPS)]
    for rank, (row, (host, local)) in enumerate(zip(report["per_rank_ms"], report["places"])):
        lines.append(f"| {rank} ({host}, {local}) | " + " | ".join(f"{row[op]:.1f}" for op in OPS) + " |")
    lines.append("")
    saving = report.get("link_saving")
    if saving:
        lines.append(f"The hierarchical allgather's fewer bytes on each host's link "
                     f"({saving['flat_mb']:.2f} -> {saving['hier_mb']:.2f} MB per step, "
                     f"`{saving['source']}`) save {saving['ms']:.1f} ms per step at {report['rate']}; "
                     f"the host reduce-scatter above costs a median {report['median_rs_ms']:.1f} ms.")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="tbf rate of each host's link")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--exchange-results", type=Path,
                    default=ROOT / "benchmarks" / "results" / "exchange" / "exchange-hierarchical.json")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--ssh-port", type=int, default=2292)
    ap.add_argument("--output-name", default="host-collectives")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.hosts < 1 or args.ranks_per_host < 2:
        raise SystemExit("--reps and --hosts must be >= 1 and --ranks-per-host >= 2 (a host set of one rank has nothing to reduce)")
    if args.worker:
        return worker(args)

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import emulated_hosts as eh_mod
    from _common import machine_info, summary, write_report

    eh_mod.rate_bits(args.rate)  # refuse a bad rate before building namespaces
    started = time.time()
    with eh_mod.EmulatedHosts(args.hosts, rate=args.rate, sshd=True, ssh_port=args.ssh_port) as eh, \
            tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = eh.mpirun_command([Path(__file__).resolve(), "--worker", "--reps", args.reps, "--out", out],
                                slots=args.ranks_per_host, pythonpath=str(ROOT), wdir=ROOT)
        print(f"host collectives: {args.hosts} hosts x {args.ranks_per_host} ranks at {args.rate}, "
              f"{args.reps} reps", flush=True)
        rc, output = eh_mod.stream(eh.launcher_cmd(cmd), timeout=args.timeout, keep=True)
        if rc != 0 or not out.exists():
            raise SystemExit(f"mpirun exit {rc}\n{output[-4000:] if output else ''}")
        result = json.loads(out.read_text())
    report = {"command": shlex.join([".venv/bin/python", "benchmarks/host_collectives.py", *argv]),
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": summary(machine_info()), "hosts": args.hosts,
              "ranks_per_host": args.ranks_per_host, "rate": args.rate, "reps": args.reps, **result,
              "median_rs_ms": statistics.median(r["host reduce-scatter"] for r in result["per_rank_ms"]),
              "wall_s": time.time() - started}
    wire = link_saving(args.exchange_results, args.rate)
    if wire:
        flat, hier = wire
        report["link_saving"] = {"flat_mb": flat, "hier_mb": hier, "ms": 1e3 * (flat - hier) * 8e6 / eh_mod.rate_bits(args.rate),
                                 "source": str(args.exchange_results.relative_to(ROOT)
                                               if args.exchange_results.is_relative_to(ROOT) else args.exchange_results)}
    md = markdown(report)
    write_report(ROOT / "benchmarks" / "results" / "hierarchical" / args.output_name, report, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
