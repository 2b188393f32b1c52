"""Gradient-exchange time and bytes on the wire: Horovod dense / fp16 vs hvd_topk, on shaped links.

P ranks (``--ranks 2 4``), each on its own emulated host (tools/emulated_hosts.py: a network
namespace with a tbf-shaped veth of ``--rates 1gbit 10gbit``, its own hostname and sshd), launched
by one ``mpirun -H host0:1,...`` from a launcher namespace over ssh, MPI over TCP only
(``--mca btl tcp,self``, interfaces restricted to the emulated subnet). Gradients have the shapes
of ResNet-50's 161 parameter tensors (25,557,032 fp32 values).

Methods (``--methods``; the ``topk`` ones run at every ``--densities`` value):
    none     no exchange: only the gradient deposit (the baseline included in every other row)
    dense    hvd.DistributedOptimizer(opt, compression=hvd.Compression.none)
    fp16     hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16)
    topk     hvd.DistributedOptimizer(opt, compression=hvd_topk.TopK(density=d))   (drop-in, no EF)
    topk-ef  hvd_topk.DistributedOptimizer(opt, compression=hvd_topk.TopK(density=d), exchange="allgather")
    topk-sar   the same with exchange="sparse_allreduce" (bytes per rank flat in P)
    topk-auto  the same with exchange="auto" (its default): the trial's steps (up to 4 x 4) are
               added to the warm-up, so the timed steps run the strategy it chose
    topk-ef-hier, topk-sar-hier  allgather / sparse allreduce with hierarchical=True (dense
               reduce-scatter inside a host, sparse across hosts; needs --ranks-per-host > 1 to
               mean anything); the other topk methods run with hierarchical=False

``--ranks-per-host L`` puts L ranks on each emulated host (P/L hosts; the ranks start with
``hvd_topk.init()``); wire bytes are then the host link's (eth0 of the host namespace, which
its L ranks share and all read), i.e. only what crosses between hosts.

One timed step (``--grad-mode realistic``, the default, what a training loop does):
``opt.zero_grad(set_to_none=True)``, then, outside the timer, a forward pass
``loss = sum_p (p * c_p).sum()`` with fixed random ``c_p`` of each parameter's shape (a pool of
``--pool`` sets cycled, so values change every step); timed: ``loss.backward()``, in which autograd
allocates a fresh ``p.grad`` (= c_p) for every parameter and the optimizers' per-parameter hooks
fire in backward order (last parameters first), so Horovod and hvd_topk start their exchanges
there (selection included), then ``opt.synchronize()`` (decompression included). The ``none`` row
is the backward alone.

``--grad-mode pre-zeroed`` is the older step, labelled "pre-zeroed (flatters compression)": the
gradient set is added by ``torch.autograd.backward(params, grad_tensors=G)`` into ``p.grad``
tensors that already exist and were zeroed in place, so no gradient memory is freshly allocated
(and page-faulted) during the timed step, unlike in training. ``--grad-mode set`` copies the
gradients into ``p.grad`` outside the timer and times only ``synchronize()`` (every exchange then
starts inside synchronize(); Horovod starts hook-less parameters in set order, which differs
between ranks, and hvd_topk.TopK pairs them by Horovod's parameter names). Ranks are aligned by an
allreduce of a scalar before each step; a step's time is the slowest rank's; the table shows the
median over ``--steps`` after ``--warmup``.

Bytes on the wire: each rank's eth0 tx/rx byte counters (the namespace's
/sys/class/net/eth0/statistics) read around each timed step, summed and divided by the steps
(TCP/IP headers included; since 2026-12-05 the barrier before each step is not, nor, with
``--interleave``, the other methods' steps; earlier files counted from the first timed step to
the end, barriers included: a few hundred bytes a step more). A peer's bytes that reach this
rank before its own step starts are missed on the rx side; the reports use tx. "payload" is what the method hands to the network per
rank and step (4 B x n for dense fp32, 2 B x n for fp16, hvd_topk's own ``bytes_sent``).

``--interleave`` builds every method at once and interleaves their timed steps (each warmed up
alone first, ``exchange="auto"``'s trial included), so the machine's drift falls on every method
alike; ``--rounds R`` makes R passes over the methods instead (one method alive at a time). Without
either the methods run one after another, as every run before 2026-12-05 did (the first method's
steps ran up to 40% slower in one of them). Each method's tensors have their own Horovod names.

Full run (about 10-15 min):
    .venv/bin/python benchmarks/exchange.py --interleave
Quick smoke run:
    .venv/bin/python benchmarks/exchange.py --ranks 2 --rates 1gbit --methods dense topk-ef \\
        --densities 0.01 --steps 2 --warmup 1 --output-name exchange-smoke
Results: benchmarks/results/exchange/<output-name>.json and .md (default output-name: exchange).
"""

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (RESNET50_PARAMS, TOPK_METHODS, agree, check_order_arguments, common_arguments,  # noqa: E402
                     driver, forward, hvd_topk_line, inner_step, label, launch_line, loss_constants, make_optimizer,
                     method_list, order_arguments, order_line, overhead_versus, rank_sums, resnet50_shapes,
                     run_heading, save_rows, slowest_rank_ms, stats_difference, summary, time_methods,
                     versus, warmup_steps, worker_start, zero_grad)

GRAD_MODES = {
    "realistic": "realistic: zero_grad(set_to_none=True), forward, backward allocates fresh p.grad, "
                 "synchronize()",
    "pre-zeroed": "pre-zeroed (flatters compression): backward adds into existing, zeroed p.grad; "
                  "no fresh gradient memory in the timed step",
    "set": "set: gradients copied into p.grad outside the timer; only synchronize() timed",
}


# ------------------------------------------------------------------------------------------------
# worker: runs under mpirun on every rank
# ------------------------------------------------------------------------------------------------
def _read_counters():
    base = Path("/sys/class/net/eth0/statistics")
    try:
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())
    except OSError:
        return None


# compression_stats() timers reported per rank; the time_host_* / time_cross_s ones are parts of
# time_exchange_s with the hierarchical exchange
PHASES = ("time_selection_s", "time_exchange_s", "time_host_reduce_s", "time_cross_s", "time_host_gather_s")


def worker(args):
    import numpy as np
    import torch
    import horovod.torch as hvd
    import hvd_topk

    torch.set_num_threads(args.threads)
    if getattr(args, "ranks_per_host", 1) > 1:
        hvd_topk.init()  # the host and cross-host process sets of the hierarchical methods
    else:
        hvd.init()
    rank, size, say, names = worker_start(hvd)
    shapes = resnet50_shapes()
    n = sum(int(np.prod(s)) for s in shapes)
    assert len(shapes) == 161 and n == RESNET50_PARAMS, (len(shapes), n)
    say(f"P={size} on hosts {names}; counters {'ok' if _read_counters() else 'missing'}; "
        f"building {args.pool} gradient sets of {n:,} values")
    pool = loss_constants(shapes, args.pool, 1234 + rank, torch)

    def barrier():
        hvd.allreduce(torch.zeros(1), name="bench.barrier", op=hvd.Sum)

    def build(method):
        """``method``'s parameters (ResNet-50's shapes, zero) and optimizer."""
        gc.collect()
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        # names per method: interleaved methods must not share Horovod's tensor names (its response
        # cache would be invalidated at every switch between fp32 and fp16 tensors of one name)
        opt, comp = make_optimizer(method, torch.optim.SGD(params, lr=0.0),
                                   [(f"{method}.p{i}", p) for i, p in enumerate(params)], args.topk_method,
                                   hvd, hvd_topk, fp16_values=getattr(args, "fp16_values", False))
        if args.grad_mode != "realistic":
            for p in params:
                p.grad = torch.zeros_like(p)
        return {"method": method, "opt": opt, "comp": comp, "params": params, "times": [], "check": None,
                "wire": [0, 0], "counted": True, "stats0": None, "warmup": warmup_steps(method, args.warmup),
                "started": time.time()}

    def one_step(m, step):
        """One step of ``m`` (ranks aligned first); returns its seconds on this rank. Its timed
        steps' eth0 bytes are counted around the step alone (the methods' steps may interleave)."""
        params, opt, comp = m["params"], m["opt"], m["comp"]
        grads = pool[step % len(pool)]
        loss = None
        if args.grad_mode == "set":
            for p, gr in zip(params, grads):
                p.grad.copy_(gr)
        elif args.grad_mode == "pre-zeroed":
            for p in params:
                p.grad.zero_()
        else:
            zero_grad(opt, params)
            loss = forward(params, grads)
        barrier()
        timed = step >= m["warmup"]
        if step == m["warmup"]:
            if comp is not None:
                comp.reset_stats()
            # totals at the start of the timed steps (the lead's rewrite may drop the reset)
            m["stats0"] = opt.compression_stats() if hasattr(opt, "compression_stats") else None
        c0 = _read_counters() if timed else None
        t0 = time.perf_counter()
        if args.grad_mode == "pre-zeroed":
            torch.autograd.backward(params, grad_tensors=grads)
        elif loss is not None:
            loss.backward()
        if opt is not None:
            opt.synchronize()
        dt = time.perf_counter() - t0
        inner_step(opt)
        if timed:
            c1 = _read_counters()
            if c0 and c1:
                m["wire"] = [m["wire"][0] + c1[0] - c0[0], m["wire"][1] + c1[1] - c0[1]]
            else:
                m["counted"] = False
        if step == 0 and opt is not None:
            # sanity: every rank holds the same exchanged gradient, and it is finite
            every = rank_sums(hvd, torch, [p.grad for p in params])
            m["check"] = {"identical_across_ranks": len(set(every)) == 1, "finite": all(map(np.isfinite, every))}
            if not m["check"]["identical_across_ranks"] or not m["check"]["finite"]:
                say(f"  WARNING {m['method']}: exchanged gradients differ across ranks: {every}")
        total = m["warmup"] + args.steps
        say(f"  [{m['method']}] step {step + 1}/{total} {'(warm-up) ' if step < m['warmup'] else ''}"
            f"{dt * 1e3:.0f} ms (rank 0)")
        return dt

    def finish(m):
        method, opt, comp = m["method"], m["opt"], m["comp"]
        if m["counted"]:
            wire = torch.tensor([m["wire"][0] / args.steps, m["wire"][1] / args.steps], dtype=torch.float64)
        else:
            wire = torch.tensor([float("nan"), float("nan")], dtype=torch.float64)
        slowest = slowest_rank_ms(hvd, torch, m["times"])
        all_wire = hvd.allgather(wire.view(1, 2), name="bench.wire")
        row = {"method": method, "label": label(method), "P": size, **slowest,
               "rank0_ms": [1e3 * t for t in m["times"]],
               "wire_tx_bytes_per_step_rank": float(all_wire[:, 0].mean()),
               "wire_rx_bytes_per_step_rank": float(all_wire[:, 1].mean()),
               "wire_tx_bytes_per_step_each_rank": all_wire[:, 0].tolist(),  # the busiest link sets the pace
               "check": m["check"], "wall_s": time.time() - m["started"]}
        name = method.partition("@")[0]
        if name == "dense":
            row["payload_bytes_per_step_rank"] = 4 * n
        elif name == "fp16":
            row["payload_bytes_per_step_rank"] = 2 * n
        elif name == "none":
            row["payload_bytes_per_step_rank"] = 0
        if name in TOPK_METHODS and name != "topk":
            st = stats_difference(opt.compression_stats(), m["stats0"])
            row["compression_stats"] = st
            row["payload_bytes_per_step_rank"] = st["bytes_sent"] / max(1, st.get("steps") or args.steps)
            # every rank's timers (ms per timed step): ranks of different hosts can differ a lot
            mine = torch.tensor([[1e3 * st.get(k, 0.0) / args.steps for k in PHASES]], dtype=torch.float64)
            row["phases_ms_per_rank"] = [dict(zip(PHASES, r)) for r in
                                         hvd.allgather(mine, name="bench.phases").tolist()]
        elif name == "topk":
            st = comp.stats()
            row["compression_stats"] = st
            row["payload_bytes_per_step_rank"] = st["bytes_sent"] / args.steps
        say(f"{label(method):>14}: median {row['median_ms']:8.1f} ms/step   "
            f"wire tx {row['wire_tx_bytes_per_step_rank'] / 1e6:8.2f} MB/step/rank")
        return row

    results = time_methods(method_list(args.methods, args.densities), build, one_step, finish, args.steps,
                           interleave=args.interleave, rounds=args.rounds)
    if rank == 0 and args.out:
        save_rows(args.out, names, results, hvd_topk)


def exchange_worker_args(args):
    out = ["--methods", *args.methods, "--densities", *map(str, args.densities),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--pool", str(args.pool),
           "--threads", str(args.threads), "--grad-mode", args.grad_mode]
    if args.topk_method:
        out += ["--topk-method", args.topk_method]
    if args.fp16_values:
        out += ["--fp16-values"]
    if args.ranks_per_host > 1:
        out += ["--ranks-per-host", str(args.ranks_per_host)]
    if args.interleave:
        out += ["--interleave"]
    return out + ["--rounds", str(args.rounds)]


def markdown(report):
    m = report["machine"]
    s = report["settings"]
    lines = [f"# Gradient exchange, ResNet-50 shapes ({report['tensors']} tensors, "
             f"{report['params']:,} fp32 values)", "",
             f"- command: `{report['command']}`",
             f"- date: {report['date_utc']}; machine: {summary(m)}; load average at end "
             f"{report.get('loadavg_at_end')}",
             f"- step: {GRAD_MODES.get(s.get('grad_mode'), s.get('grad_mode'))}",
             f"- one emulated host per rank (network namespace, tbf-shaped veth), mpirun over ssh, "
             f"MPI over TCP only; grad mode `{s['grad_mode']}`, {s['warmup']} warm-up + {s['steps']} "
             f"timed steps, median of the slowest rank's step time; selection method "
             f"`{s.get('topk_method') or 'TopK default'}`{', fp16 values' if s.get('fp16_values') else ''}; "
             f"{s['threads']} torch thread(s) per rank",
             hvd_topk_line(report), launch_line(report),
             f"- order: {order_line(s)}",
             "- time = backward (gradient deposit) + exchange (selection, allgather/allreduce, "
             "decompression); `none` = backward only; wire = eth0 tx bytes per rank and step (counters, "
             "read around each timed step: the barrier before it is not counted); "
             "payload = bytes the method hands to the network per rank and step", ""]
    for run in report["runs"]:
        rows = run["rows"]
        ref = {r["method"]: r["median_ms"] for r in rows}
        per_host = run.get("ranks_per_host", 1)
        shape = f" ({run['P'] // per_host} hosts x {per_host} ranks; wire = the host's link)" if per_host > 1 else ""
        lines += [run_heading(run, shape), "",
                  "| method | median ms | min-max ms | vs dense | vs fp16 | overhead vs dense | overhead vs fp16 | "
                  "wire tx MB/step/rank | wire rx MB/step/rank | payload MB/step/rank | ranks agree |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            pay = r.get("payload_bytes_per_step_rank")
            chose = (r.get("compression_stats") or {}).get("exchange_family")
            shown = f"{r['label']} (chose {chose})" if r["method"].startswith("topk-auto") else r["label"]
            lines.append(f"| {shown} | {r['median_ms']:.1f} | {r['min_ms']:.0f}-{r['max_ms']:.0f} | "
                         f"{versus(ref, r, 'dense')} | {versus(ref, r, 'fp16')} | "
                         f"{overhead_versus(ref, r, 'dense')} | {overhead_versus(ref, r, 'fp16')} | "
                         f"{r['wire_tx_bytes_per_step_rank'] / 1e6:.2f} | "
                         f"{r.get('wire_rx_bytes_per_step_rank', float('nan')) / 1e6:.2f} | "
                         f"{'' if pay is None else f'{pay / 1e6:.2f}'} | "
                         f"{agree(None if r['check'] is None else r['check']['identical_across_ranks'])} |")
        lines.append("")
        lines += tx_balance_table(rows)
        lines += phase_table(rows, per_host)
    return "\n".join(lines)


def tx_balance_table(rows):
    """Per rank's link: the median and the busiest rank's tx bytes (the slowest link sets the pace)."""
    each = [(r, r["wire_tx_bytes_per_step_each_rank"]) for r in rows
            if r.get("wire_tx_bytes_per_step_each_rank") and r["method"] != "none"]
    if not each:
        return []
    lines = ["Wire tx per rank (eth0 counters, MB/step): the median rank, the busiest, and their ratio.", "",
             "| method | median rank | busiest rank | busiest / median | every rank |", "|---|---:|---:|---:|---|"]
    for r, tx in each:
        med = statistics.median(tx)
        lines.append(f"| {r['label']} | {med / 1e6:.2f} | {max(tx) / 1e6:.2f} | "
                     f"{max(tx) / med if med else float('nan'):.2f}x | {' '.join(f'{t / 1e6:.2f}' for t in tx)} |")
    return lines + [""]


def phase_table(rows, per_host):
    """Where the hierarchical rows' time went, per rank (``compression_stats()`` timers)."""
    hier = [r for r in rows if r["method"].partition("@")[0].endswith("-hier") and r.get("phases_ms_per_rank")]
    if not hier:
        return []
    lines = ["Hierarchical rows, per rank, ms per timed step (`compression_stats()`): waiting for the "
             "host's dense reduce-scatter in `synchronize()`, selecting on the shard, the sparse "
             "exchange across hosts, the allgather inside the host; `exchange` is all of "
             "`synchronize()` but selection (the three before it, the decode and the flat buckets).", "",
             "| method | rank (host) | host reduce-scatter wait | selection | across hosts | host allgather | exchange |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in hier:
        for rank, ph in enumerate(r["phases_ms_per_rank"]):
            lines.append(f"| {r['label']} | {rank} ({rank // per_host}) | {ph['time_host_reduce_s']:.1f} | "
                         f"{ph['time_selection_s']:.1f} | {ph['time_cross_s']:.1f} | "
                         f"{ph['time_host_gather_s']:.1f} | {ph['time_exchange_s']:.1f} |")
    lines.append("")
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_arguments(ap, densities=[0.01, 0.001], pool=3, output_name="exchange")
    ap.add_argument("--grad-mode", choices=list(GRAD_MODES), default="realistic",
                    help="realistic (default): zero_grad(set_to_none=True) + forward + backward into "
                         "fresh p.grad; pre-zeroed (flatters compression): backward adds into existing "
                         "zeroed p.grad; set: only synchronize() timed")
    order_arguments(ap)
    args = ap.parse_args(argv)
    check_order_arguments(ap, args)
    if args.worker:
        worker(args)
    else:
        driver(args, argv, worker_args=exchange_worker_args, script=__file__, benchmark="exchange",
               render=markdown)


if __name__ == "__main__":
    main()
