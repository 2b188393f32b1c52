"""A real two-host Horovod run on one machine: horovodrun -H and mpirun -H across emulated hosts.

Sets up two emulated hosts (tools/emulated_hosts.py: a network namespace each, eth0 shaped
to ``--rate`` (1 Gbit by default) on both ends, own hostname host0/host1, own sshd on port
``--ssh-port`` with a fresh key) plus a launcher namespace, then from the launcher runs the digits
example with the error-feedback optimizer:

    horovodrun -np 2 -H host0:1,host1:1 -p PORT --ssh-identity-file KEY --gloo \\
        --network-interface eth0 python examples/pytorch_digits.py --optimizer topk-ef --density 0.01 ...
    mpirun -np 2 -H host0:1,host1:1 --mca plm_rsh_agent "ssh -F CONFIG" --mca btl tcp,self \\
        --mca btl_tcp_if_include 10.N.0.0/24 --mca oob_tcp_if_include 10.N.0.0/24 ... python ...

Each rank first prints ``RANKINFO rank=R size=S hostname=H`` (this script's ``--rank-info`` mode,
which then execs the example), so the output shows where every rank ran. Everything is removed
afterwards (also on Ctrl-C / SIGTERM). Exit status 0 only if both launchers ran 2 ranks on 2
different hosts, traffic crossed the emulated links, and the final test accuracy is >=
``--min-accuracy``.

    .venv/bin/python benchmarks/two_hosts.py                      # both launchers, 10 epochs
    .venv/bin/python benchmarks/two_hosts.py --launchers mpirun --epochs 5 --json /tmp/two.json
"""

import argparse
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EXAMPLE = REPO / "examples" / "pytorch_digits.py"


def rank_info_and_exec(cmd):
    """Print where this rank runs, then become ``cmd``."""
    rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    size = os.environ.get("HOROVOD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "?"))
    print(f"RANKINFO rank={rank} size={size} hostname={os.uname().nodename}", flush=True)
    os.execv(cmd[0], cmd)


def run_two_hosts(launchers=("horovodrun", "mpirun"), epochs=10, rate="1gbit", ssh_port=2222,
                  timeout=240, min_accuracy=0.90, extra=()):
    sys.path.insert(0, str(HERE))
    from _common import emulated_hosts as eh_mod

    python = sys.executable
    venv_bin = str(Path(python).parent)
    path = f"{venv_bin}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
    example_args = ["--optimizer", "topk-ef", "--density", "0.01", "--epochs", str(epochs), "--quiet",
                    *extra]
    results = []
    started = time.time()
    with eh_mod.EmulatedHosts(2, rate=rate, sshd=True, ssh_port=ssh_port) as eh:
        setup_s = time.time() - started
        print(f"emulated hosts up in {setup_s:.1f} s: {eh.hosts} (link {rate}), launcher {eh.launcher}",
              flush=True)
        for launcher in launchers:
            out_json = eh.tmpdir / f"{launcher}.json"
            prog = [python, str(Path(__file__).resolve()), "--rank-info", "--", python, str(EXAMPLE),
                    *example_args, "--json", str(out_json)]
            if launcher == "horovodrun":
                cmd = [f"{venv_bin}/horovodrun", "-np", "2", "-H", eh.hostlist(), "-p", str(ssh_port),
                       "--ssh-identity-file", str(eh.ssh_key), "--gloo", "--network-interface", "eth0",
                       "--start-timeout", "60", *prog]
            elif launcher == "mpirun":
                cmd = eh.mpirun_command(prog[1:], np=2, python=python, pythonpath=str(REPO),
                                        wdir=REPO)
            else:
                raise ValueError(launcher)
            env = dict(os.environ, PATH=path, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
            print(f"\n== {launcher}: {shlex.join(cmd)}", flush=True)
            before = eh.counters()
            t0 = time.time()
            rc, output = eh_mod.stream(eh.launcher_cmd(cmd), timeout=timeout, env=env)
            wall = time.time() - t0
            after = eh.counters()
            ranks = {}
            for m in re.finditer(r"RANKINFO rank=(\S+) size=(\S+) hostname=(\S+)", output):
                ranks[m.group(1)] = m.group(3)
            metrics = json.loads(out_json.read_text()) if out_json.exists() else None
            wire = {h: {"tx": after[h][0] - before[h][0], "rx": after[h][1] - before[h][1]} for h in after}
            acc = metrics.get("test_acc") if metrics else None
            ok = (rc == 0 and len(ranks) == 2 and len(set(ranks.values())) == 2
                  and set(ranks.values()) <= {h.hostname for h in eh.hosts}
                  and acc is not None and acc >= min_accuracy
                  and all(w["tx"] > 100_000 and w["rx"] > 100_000 for w in wire.values()))
            res = {"launcher": launcher, "ok": ok, "exit": rc, "wall_s": round(wall, 1),
                   "ranks": ranks, "test_acc": acc, "wire_bytes": wire, "command": shlex.join(cmd),
                   "metrics": metrics}
            if not ok:
                res["output_tail"] = output[-4000:]
            results.append(res)
            print(f"-> {launcher}: {'OK' if ok else 'FAILED'} in {wall:.1f} s, ranks on {ranks}, test "
                  f"accuracy {acc if acc is None else f'{100 * acc:.2f}%'}, wire "
                  + ", ".join(f"{h} tx {w['tx'] / 1e6:.1f} MB rx {w['rx'] / 1e6:.1f} MB" for h, w in wire.items()),
                  flush=True)
    return {"rate": rate, "epochs": epochs, "setup_s": round(setup_s, 1),
            "total_s": round(time.time() - started, 1), "runs": results,
            "ok": all(r["ok"] for r in results)}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-info"]:
        rest = argv[1:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        rank_info_and_exec(rest)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launchers", nargs="+", default=["horovodrun", "mpirun"], choices=["horovodrun", "mpirun"])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--ssh-port", type=int, default=2222)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per launcher run")
    ap.add_argument("--min-accuracy", type=float, default=0.90)
    ap.add_argument("--json", metavar="PATH", help="write the summary here")
    args = ap.parse_args(argv)
    summary = run_two_hosts(args.launchers, args.epochs, args.rate, args.ssh_port, args.timeout,
                            args.min_accuracy)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"\ntwo-host run {'PASSED' if summary['ok'] else 'FAILED'}: set-up {summary['setup_s']} s, "
          + ", ".join(f"{r['launcher']} {r['wall_s']} s ({'ok' if r['ok'] else 'failed'})" for r in summary["runs"])
          + f"; total {summary['total_s']} s")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
