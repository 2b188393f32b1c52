"""End-to-end training step time of a ResNet-50 on shaped links: dense vs fp16 vs hvd_topk.

The model is a real ResNet-50 (torchvision's architecture written out in benchmarks/_models.py, so torchvision is
not needed: 161 parameter tensors, 25,557,032 parameters, the same as benchmarks/exchange.py)
fed small synthetic images (``--image-size 32`` by default, batch ``--batch`` per rank) so that
compute stays modest on a 2-core machine while the gradient is full-size. One rank per emulated
host (tools/emulated_hosts.py), one mpirun per (P, rate) over ssh, MPI over TCP only.

One timed step = ``zero_grad`` + forward + backward (Horovod / hvd_topk start exchanges from their
hooks) + ``opt.step()`` (which synchronizes, then SGD with momentum). Ranks are aligned by an
allreduce of a scalar before each step; a step's time is the slowest rank's; median over
``--steps`` after ``--warmup``. ``none`` is the same step with the plain optimizer (no exchange).

Methods: none, dense (hvd.DistributedOptimizer, no compression), fp16 (hvd.Compression.fp16),
topk (hvd.DistributedOptimizer + hvd_topk.TopK(density=d), drop-in), and hvd_topk's error-feedback
optimizer with a named exchange, built as benchmarks/exchange.py builds them
(``_common.make_optimizer``): topk-ef (allgather), topk-sar (sparse allreduce), topk-auto
("auto": its trial is added to the warm-up, so the timed steps run its choice), at
``--densities`` (default 1%).

Full run (about 3 min; ``--interleave`` builds every method at once and interleaves their
timed steps, as benchmarks/ddp_hooks.py does, and ``--rounds R`` makes R passes over the methods,
each starting at a different one: one method after another, the first one's steps ran up to 40%
slower in a run of 2026-12-04, which the others' overheads then read against):
    .venv/bin/python benchmarks/training.py
    .venv/bin/python benchmarks/training.py --ranks 2 --interleave --steps 10 --warmup 4
Smoke run:
    .venv/bin/python benchmarks/training.py --ranks 2 --rates 1gbit --methods none dense topk-ef \\
        --steps 2 --warmup 1 --output-name training-smoke
Results: benchmarks/results/training/<output-name>.json and .md (default output-name: training).
"""

import argparse
import gc
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as common  # noqa: E402  (the driver, shapes, methods, report pieces)
import _models as models  # noqa: E402  (ResNet-50 itself)


def worker(args):
    import torch
    import horovod.torch as hvd
    import hvd_topk

    torch.set_num_threads(args.threads)
    hvd.init()
    rank, size, say, names = common.worker_start(hvd)
    batches = models.inputs("resnet50", torch, args.pool, seed=7 + rank, batch=args.batch, image_size=args.image_size)
    say(f"P={size} on hosts {names}; ResNet-50, batch {args.batch}/rank, {args.image_size}x"
        f"{args.image_size} synthetic images, {args.threads} thread(s)/rank")

    def barrier():
        hvd.allreduce(torch.zeros(1), name="bench.barrier", op=hvd.Sum)

    def build(method):
        """``method``'s model (the same initial weights for every method) and optimizer."""
        gc.collect()
        torch.manual_seed(0)
        model = models.build("resnet50", torch)
        name = method.partition("@")[0]
        inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        # names per method: interleaved methods must not share Horovod's tensor names (its response
        # cache would be invalidated at every switch between fp32 and fp16 tensors of one name)
        named = [(f"{method}.{n}", p) for n, p in model.named_parameters()]
        opt, comp = common.make_optimizer(method, inner, named, args.topk_method,
                                          hvd, hvd_topk, fp16_values=args.fp16_values)
        if name != "none":
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return {"method": method, "name": name, "model": model, "opt": opt or inner, "comp": comp,
                "params": list(model.parameters()), "times": [], "losses": [],
                "warmup": common.warmup_steps(method, args.warmup), "started": time.time()}

    def one_step(m, step):
        """One timed training step of ``m`` (ranks aligned first); returns its seconds on this rank."""
        batch = batches[step % len(batches)]
        barrier()
        t0 = time.perf_counter()
        common.zero_grad(m["opt"], m["params"])  # zero_grad(set_to_none=True)
        loss = models.loss("resnet50", m["model"], batch)
        loss.backward()
        m["opt"].step()
        dt = time.perf_counter() - t0
        m["losses"].append(loss.item())
        total = m["warmup"] + args.steps
        say(f"  [{m['method']}] step {step + 1}/{total} {'(warm-up) ' if step < m['warmup'] else ''}"
            f"{dt * 1e3:.0f} ms (rank 0), loss {m['losses'][-1]:.3f}")
        return dt

    def finish(m):
        # parameters must agree across ranks after distributed steps
        name, opt = m["name"], m["opt"]
        agree = None if name == "none" else len(set(common.rank_sums(hvd, torch, m["model"].parameters()))) == 1
        row = {"method": m["method"], "label": common.label(m["method"]), "P": size,
               **common.slowest_rank_ms(hvd, torch, m["times"]),
               "rank0_ms": [1e3 * t for t in m["times"]], "losses_rank0": m["losses"],
               "params_identical_across_ranks": agree, "wall_s": time.time() - m["started"]}
        if name in common.TOPK_METHODS and name != "topk":
            row["compression_stats"] = opt.compression_stats()
        elif name == "topk":
            row["compression_stats"] = m["comp"].stats()
        say(f"{common.label(m['method']):>14}: median {row['median_ms']:8.1f} ms/step"
            f"{'' if agree in (None, True) else '   WARNING: parameters differ across ranks'}")
        return row

    rows = common.time_methods(common.method_list(args.methods, args.densities), build, one_step, finish,
                               args.steps, interleave=args.interleave, rounds=args.rounds)
    if rank == 0 and args.out:
        common.save_rows(args.out, names, rows, hvd_topk)


def worker_args(args):
    out = ["--methods", *args.methods, "--densities", *map(str, args.densities),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--pool", str(args.pool),
           "--threads", str(args.threads), "--batch", str(args.batch),
           "--image-size", str(args.image_size)]
    if args.topk_method:
        out += ["--topk-method", args.topk_method]
    if args.fp16_values:
        out += ["--fp16-values"]
    if args.interleave:
        out += ["--interleave"]
    return out + ["--rounds", str(args.rounds)]


def markdown(report):
    m, s = report["machine"], report["settings"]
    lines = [f"# Training step, ResNet-50 ({report['params']:,} parameters), synthetic "
             f"{s['image_size']}x{s['image_size']} images, batch {s['batch']} per rank", "",
             f"- command: `{report['command']}`",
             f"- date: {report['date_utc']}; machine: {common.summary(m)}; load average at end "
             f"{report.get('loadavg_at_end')}",
             f"- {common.hosts_phrase(s)} (network namespace, tbf-shaped veth), mpirun over ssh, MPI "
             f"over TCP only; step = zero_grad(set_to_none=True) + forward + backward + opt.step() (SGD momentum 0.9); "
             f"{s['warmup']} warm-up + {s['steps']} timed steps, median of the slowest rank; "
             f"{common.order_line(s)}; {s['threads']} torch thread(s) per rank; selection "
             f"`{s.get('topk_method') or 'TopK default'}`{', 16-bit values' if s.get('fp16_values') else ''}",
             common.hvd_topk_line(report), common.launch_line(report),
             "- `none` = the same step without any exchange (plain torch optimizer)", ""]
    for run in report["runs"]:
        ref = {r["method"]: r["median_ms"] for r in run["rows"]}
        lines += [common.run_heading(run), "",
                  "| method | median ms/step | min-max ms | vs dense | vs fp16 | exchange overhead vs none "
                  "| overhead: dense's / this | overhead: fp16's / this | ranks agree |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in run["rows"]:
            chose = (r.get("compression_stats") or {}).get("exchange_family") if "auto" in r["method"] else None
            label = r["label"] + (f" (chose {chose})" if chose else "")
            lines.append(f"| {label} | {r['median_ms']:.1f} | {r['min_ms']:.0f}-{r['max_ms']:.0f} | "
                         f"{common.versus(ref, r, 'dense')} | {common.versus(ref, r, 'fp16')} | "
                         f"{common.overhead(ref, r)} | {common.overhead_versus(ref, r, 'dense')} | "
                         f"{common.overhead_versus(ref, r, 'fp16')} | {common.agree(r['params_identical_across_ranks'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.common_arguments(ap, densities=[0.01], pool=2, output_name="training")
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--image-size", type=int, default=32)
    common.order_arguments(ap)
    args = ap.parse_args(argv)
    common.check_order_arguments(ap, args)
    if args.worker:
        worker(args)
    else:
        common.driver(args, argv, worker_args=worker_args, script=__file__, benchmark="training",
                      render=markdown)


if __name__ == "__main__":
    main()
