"""Emulated hosts on one machine: one network namespace per host, shaped links, own hostname, sshd.

Layout made by ``EmulatedHosts(n, rate)`` (root needed; iproute2, openssh-server):

    bridge namespace  hvdtk-<pid>-<tag>-br   bridge br0 with one veth per host (tbf-shaped)
    host namespaces   hvdtk-<pid>-<tag>-h0 ... eth0 = 10.<net>.0.<11+i>/24 (tbf-shaped), hostname host<i>
    launcher          hvdtk-<pid>-<tag>-ln   eth0 = 10.<net>.0.2/24, hostname launcher (unshaped)

Both ends of every host's veth get ``tc qdisc ... tbf rate RATE`` (RATE 1gbit, 10gbit, ... or
``none``), so each host has its own link of that speed into the "switch". The token bucket's
``burst`` defaults to what the link carries in 1 ms (at least 32 KiB: ``link_burst``): a larger
one lets every transfer that follows an idle moment through at the veth's own speed until the
bucket is empty (with the former 4 MB, 8 MB after 150 ms idle crossed a "1 Gbit" link in 33.5 ms,
not 64), which flatters methods that move a few MB per step. ``measure_after_idle`` checks it. Every namespace gets
``/etc/netns/NS/hosts`` (names of all hosts) and ``/etc/netns/NS/ssh/ssh_config`` (port, key,
no host-key checks), which ``ip netns exec`` mounts over /etc/hosts and /etc/ssh. With
``sshd=True`` each host runs its own sshd on its address (port ``ssh_port``, key-only login,
``StrictModes no``, keys in a temp dir) under ``unshare --uts`` with its own hostname, so that
``mpirun -H host0:1,host1:1`` and ``horovodrun -H host0:1,host1:1`` start one launcher daemon per
emulated host over ssh, as on a real cluster.

Everything is removed on exit of the ``with`` block: normal exit, exceptions, SIGINT, SIGTERM
(processes still inside the namespaces are killed first). A run that was SIGKILLed leaves
``hvdtk-*`` namespaces behind: ``python -m tools.emulated_hosts cleanup`` removes those
whose creating process is gone (``--all`` removes every ``hvdtk-*`` one).

``EmulatedHosts.mpirun_command(argv)`` is the ``mpirun -H host0:1,...`` line that starts
``argv`` with one rank per emulated host; run it through ``launcher_cmd`` (and ``stream``).

CLI:
    python -m tools.emulated_hosts demo --hosts 2 --rate 1gbit   # set up, measure, tear down
    python -m tools.emulated_hosts shell --hosts 2 --rate 1gbit  # print commands, wait for Ctrl-C
    python -m tools.emulated_hosts list | cleanup [--all]
"""

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

PREFIX = "hvdtk-"
NETNS_ETC = Path("/etc/netns")
RUN_NETNS = Path("/run/netns")
RATES = ("none", "1gbit", "10gbit")


def _run(cmd, check=True, capture=True, **kw):
    """Run a command (a list); raise with its output on failure."""
    p = subprocess.run(cmd, capture_output=capture, text=True, **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {shlex.join(cmd)}\n{p.stdout}{p.stderr}")
    return p


def _ns_exec(ns, *cmd):
    return ["ip", "netns", "exec", ns, *cmd]


def list_namespaces(prefix=PREFIX):
    """Names of the network namespaces starting with ``prefix`` ([] without iproute2)."""
    try:
        out = _run(["ip", "netns", "list"], check=False).stdout
    except OSError:
        return []
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def pid_of_name(name, prefix=PREFIX):
    """The creating process's pid in a name made by EmulatedHosts (``hvdtk-<pid>-...``), else None."""
    m = re.match(re.escape(prefix) + r"(\d+)-", name)
    return int(m.group(1)) if m else None


def stale_names(names, all_runs=False, alive=None, prefix=PREFIX):
    """Which of ``names`` are leftovers: those starting with ``prefix`` whose creating process
    (the pid in the name) is gone (``alive(pid)`` says; default: signal 0), or, with
    ``all_runs``, every one starting with ``prefix``. Other names are never chosen."""
    alive = alive or _alive
    out = []
    for name in sorted(set(names)):
        if not name.startswith(prefix):
            continue
        pid = pid_of_name(name, prefix)
        if all_runs or (pid is not None and not alive(pid)):
            out.append(name)
    return out


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_ns_processes(ns, grace_s=2.0):
    """Kill every process inside namespace ``ns`` (they are ours: we made the namespace)."""
    def pids():
        out = _run(["ip", "netns", "pids", ns], check=False).stdout
        return [int(x) for x in out.split() if x.isdigit()]
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        alive = pids()
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.time() + wait
        while time.time() < deadline and pids():
            time.sleep(0.05)


def remove_namespace(ns):
    """Kill what runs in ``ns``, delete it and its /etc/netns directory (no error if absent)."""
    if (RUN_NETNS / ns).exists():
        _kill_ns_processes(ns)
        _run(["ip", "netns", "delete", ns], check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def cleanup_stale(all_runs=False, verbose=True, *, alive=None, namespaces=None, netns_etc=None,
                  tmp_root=None, remove=None):
    """Remove ``hvdtk-<pid>-*`` namespaces, /etc/netns dirs and temp dirs whose creating process
    is gone (every one with ``all_runs``). Returns what was removed.

    The keyword arguments exist for tests: ``namespaces`` (default: ``ip netns list``),
    ``netns_etc`` (/etc/netns), ``tmp_root`` (the temp directory), ``remove`` (called per
    namespace; default ``remove_namespace``) and ``alive`` (pid -> bool)."""
    netns_etc = Path(netns_etc) if netns_etc is not None else NETNS_ETC
    remove = remove or remove_namespace
    removed = []
    names = set(list_namespaces() if namespaces is None else namespaces)
    if netns_etc.is_dir():
        names |= {p.name for p in netns_etc.iterdir() if p.name.startswith(PREFIX)}
    for ns in stale_names(names, all_runs, alive):
        remove(ns)
        shutil.rmtree(netns_etc / ns, ignore_errors=True)
        removed.append(ns)
    tmp_root = Path(tmp_root) if tmp_root is not None else Path(tempfile.gettempdir())
    dirs = {d.name: d for d in tmp_root.glob(PREFIX + "[0-9]*-*") if d.is_dir()}
    for name in stale_names(dirs, all_runs, alive):
        d = dirs[name]
        for pidfile in d.glob("*.pid"):  # sshds of a killed run (normally gone with their netns)
            with contextlib.suppress(Exception):
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGTERM)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    if verbose:
        print("removed:", ", ".join(removed) if removed else "nothing")
    return removed


class Host:
    def __init__(self, name, ns, ip, hostname):
        self.name, self.ns, self.ip, self.hostname = name, ns, ip, hostname

    def __repr__(self):
        return f"Host({self.hostname}, ns={self.ns}, ip={self.ip})"


class EmulatedHosts:
    """``with EmulatedHosts(2, rate="1gbit") as eh:`` ... ``eh.launcher_cmd([...])``.

    Attributes once entered: ``hosts`` (list of Host), ``launcher`` (Host), ``subnet``
    (``10.N.0.0/24``), ``ssh_port``, ``ssh_key`` (private key path), ``ssh_config`` (path for
    ``ssh -F``), ``tmpdir``.
    """

    def __init__(self, n, rate="1gbit", sshd=True, ssh_port=2222, net=None, tag=None,
                 burst=None, latency="100ms", verbose=False):
        if n < 1:
            raise ValueError("need at least one host")
        self.n, self.rate, self.want_sshd, self.ssh_port = n, rate, sshd, ssh_port
        self.burst, self.latency, self.verbose = burst, latency, verbose
        self._burst_for(rate)  # refuse a rate it cannot size a burst for before making anything
        tag = tag or uuid.uuid4().hex[:4]
        self.base = f"{PREFIX}{os.getpid()}-{tag}"
        net = net if net is not None else 100 + (os.getpid() + int(tag, 16)) % 150
        self.subnet = f"10.{net}.0.0/24"
        self._net = net
        self.bridge_ns = f"{self.base}-br"
        self.hosts = [Host(f"h{i}", f"{self.base}-h{i}", f"10.{net}.0.{11 + i}", f"host{i}")
                      for i in range(n)]
        self.launcher = Host("ln", f"{self.base}-ln", f"10.{net}.0.2", "launcher")
        self.ssh_key = self.ssh_config = None  # made on entry
        self._made = []          # namespaces created, for cleanup
        self._sshd_pids = []
        self.tmpdir = None
        self._old_handlers = {}
        self._entered = False

    # ---- set-up ---------------------------------------------------------------------------
    def __enter__(self):
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            raise PermissionError("emulated hosts need root (network namespaces, tc and sshd): run the "
                                  "benchmark or test as root, e.g. with sudo")
        self._install_signal_handlers()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        self._entered = True
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _log(self, *a):
        if self.verbose:
            print("[emulated_hosts]", *a, file=sys.stderr, flush=True)

    def _install_signal_handlers(self):
        def handler(signum, frame):
            # Turn SIGTERM into an exception so that the with-block unwinds and cleans up;
            # SIGINT already raises KeyboardInterrupt.
            raise SystemExit(128 + signum)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError):  # not in the main thread
                self._old_handlers[sig] = signal.signal(sig, handler)
        with contextlib.suppress(ValueError):
            if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                # e.g. started in the background by a shell, which ignores SIGINT: still clean up
                self._old_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)

    def _restore_signal_handlers(self):
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, old)
        self._old_handlers = {}

    def _add_ns(self, ns):
        _run(["ip", "netns", "add", ns])
        self._made.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _shape(self, ns, dev):
        if self.rate in (None, "none", ""):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            return
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", self.rate,
              "burst", self._burst_for(self.rate), "latency", self.latency])

    def _burst_for(self, rate):
        if self.burst is not None or rate in (None, "none", ""):
            return self.burst
        return f"{link_burst(rate)}b"

    def set_rate(self, rate):
        """Change every host's link speed (both ends) in place: '1gbit', '10gbit' or 'none'."""
        self.rate = rate
        for i, h in enumerate(self.hosts):
            self._shape(h.ns, "eth0")
            self._shape(self.bridge_ns, f"v{h.name}")

    def _setup(self):
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"{self.base}-"))
        self._log("tmpdir", self.tmpdir)
        self._add_ns(self.bridge_ns)
        _run(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
        for h in [*self.hosts, self.launcher]:
            self._add_ns(h.ns)
            peer = f"v{h.name}"
            _run(["ip", "-n", self.bridge_ns, "link", "add", peer, "type", "veth",
                  "peer", "name", "eth0", "netns", h.ns])
            _run(["ip", "-n", self.bridge_ns, "link", "set", peer, "master", "br0", "up"])
            _run(["ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0"])
            _run(["ip", "-n", h.ns, "link", "set", "eth0", "up"])
        self.set_rate(self.rate)
        # names: every namespace resolves every host (and its own name) to 10.x addresses
        hosts_file = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" + "".join(
            f"{h.ip}\t{h.hostname}\n" for h in [*self.hosts, self.launcher])
        self.ssh_key = self.tmpdir / "id_ed25519"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.ssh_key)])
        shutil.copy(f"{self.ssh_key}.pub", self.tmpdir / "authorized_keys")
        self.ssh_config = self.tmpdir / "ssh_config"
        self.ssh_config.write_text(
            "Host *\n"
            f"  Port {self.ssh_port}\n  User root\n  IdentityFile {self.ssh_key}\n"
            "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
            "  GlobalKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n  ConnectTimeout 10\n")
        for h in [*self.hosts, self.launcher]:
            etc = NETNS_ETC / h.ns
            (etc / "ssh").mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            (etc / "hostname").write_text(h.hostname + "\n")
            # plain `ssh hostN` (also from mpirun's daemons) uses our port, key and no host-key checks
            shutil.copy(self.ssh_config, etc / "ssh" / "ssh_config")
        if self.want_sshd:
            self._start_sshds()

    def _start_sshds(self):
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        host_key = self.tmpdir / "ssh_host_ed25519_key"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)])
        for h in self.hosts:
            pidfile = self.tmpdir / f"sshd-{h.name}.pid"
            conf = self.tmpdir / f"sshd_config-{h.name}"
            conf.write_text(
                f"Port {self.ssh_port}\nListenAddress {h.ip}\nHostKey {host_key}\n"
                f"AuthorizedKeysFile {self.tmpdir}/authorized_keys\nPidFile {pidfile}\n"
                "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                "StrictModes no\nUseDNS no\nMaxStartups 100\nMaxSessions 100\nLogLevel ERROR\n"
                "AcceptEnv LANG LC_*\nSubsystem sftp internal-sftp\n")
            cmd = _ns_exec(h.ns, "unshare", "--uts", "sh", "-c",
                           f"hostname {h.hostname} && exec {sshd} -f {conf} -E {self.tmpdir}/sshd-{h.name}.log")
            _run(cmd)  # sshd daemonizes; the pid file says where it went
            self._log("sshd", h.hostname, h.ip, self.ssh_port)
        # wait until every sshd answers
        deadline = time.time() + 15
        for h in self.hosts:
            while True:
                p = _run(self.launcher_cmd(["ssh", "-F", str(self.ssh_config), h.hostname, "hostname"]),
                         check=False)
                if p.returncode == 0 and p.stdout.strip() == h.hostname:
                    break
                if time.time() > deadline:
                    log = (self.tmpdir / f"sshd-{h.name}.log")
                    raise RuntimeError(f"sshd on {h.hostname} not reachable: {p.stdout}{p.stderr}"
                                       f"{log.read_text() if log.exists() else ''}")
                time.sleep(0.2)
            pidfile = self.tmpdir / f"sshd-{h.name}.pid"
            if pidfile.exists():
                self._sshd_pids.append(int(pidfile.read_text().split()[0]))

    # ---- use ------------------------------------------------------------------------------
    def launcher_cmd(self, cmd, hostname=True):
        """``cmd`` run in the launcher namespace (with hostname 'launcher' in its own UTS ns)."""
        if hostname:
            return _ns_exec(self.launcher.ns, "unshare", "--uts", "sh", "-c",
                            f'hostname {self.launcher.hostname} && exec "$@"', "sh", *cmd)
        return _ns_exec(self.launcher.ns, *cmd)

    def host_cmd(self, i, cmd):
        h = self.hosts[i]
        return _ns_exec(h.ns, "unshare", "--uts", "sh", "-c", f'hostname {h.hostname} && exec "$@"',
                        "sh", *cmd)

    def hostlist(self, slots=1, count=None):
        """``host0:1,host1:1,...`` for -H."""
        return ",".join(f"{h.hostname}:{slots}" for h in self.hosts[:count or self.n])

    def mpirun_command(self, argv, *, np=None, python=None, pythonpath=None, wdir=None,
                       env_names=("OMP_NUM_THREADS",), mpirun="mpirun", slots=1):
        """``mpirun -np NP -H host0:S,... [mpirun_args] ... PYTHON ARGV...``: ``slots`` ranks per
        emulated host (the first ``np``, default all of every host), started over ssh from the
        launcher namespace; ranks of one host talk over that host's loopback.

        Every rank gets ``PATH`` with ``python``'s directory first, ``PYTHONPATH`` (when given),
        ``OMP_NUM_THREADS`` (1 unless set here) and every ``HOROVOD_*`` variable set here (a
        user's Horovod tuning reaches all ranks); ``wdir`` is the ranks' working directory."""
        np = self.n * slots if np is None else np
        if isinstance(np, bool) or not isinstance(np, int) or not 1 <= np <= self.n * slots:
            raise ValueError(f"np must be an integer in 1..{self.n * slots}, got {np!r}")
        python = python or sys.executable
        hosts = -(-np // slots)
        cmd = [mpirun, "-np", str(np), "-H", self.hostlist(slots=slots, count=hosts), *self.mpirun_args(),
               "--mca", "plm_rsh_no_tree_spawn", "1",
               "-x", f"PATH={Path(python).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"]
        if pythonpath:
            cmd += ["-x", f"PYTHONPATH={pythonpath}"]
        for name in env_names:
            if name == "OMP_NUM_THREADS" and name not in os.environ:
                cmd += ["-x", "OMP_NUM_THREADS=1"]
            else:
                cmd += ["-x", name]
        cmd += [a for k in sorted(os.environ) if k.startswith("HOROVOD_") for a in ("-x", k)]
        if wdir is not None:
            cmd += ["--wdir", str(wdir)]
        return cmd + [python, *map(str, argv)]

    def mpirun_args(self):
        """mpirun options that launch over ssh from the launcher and keep MPI on TCP over eth0.

        The emulated hosts share this machine's cores, so MPI is told it is oversubscribed
        (``mpi_yield_when_idle``): a rank waiting in a collective yields its core instead of
        spinning, as a rank on a real host of its own could afford to spin."""
        return ["--allow-run-as-root", "--mca", "plm_rsh_agent", f"ssh -F {self.ssh_config}",
                "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", self.subnet,
                "--mca", "oob_tcp_if_include", self.subnet, "--bind-to", "none",
                "--mca", "mpi_yield_when_idle", "1"]

    def counters(self):
        """{hostname: (tx_bytes, rx_bytes)} of each host's eth0."""
        out = {}
        for h in self.hosts:
            vals = []
            for what in ("tx_bytes", "rx_bytes"):
                p = _run(_ns_exec(h.ns, "cat", f"/sys/class/net/eth0/statistics/{what}"))
                vals.append(int(p.stdout.strip()))
            out[h.hostname] = tuple(vals)
        return out

    # ---- tear-down ------------------------------------------------------------------------
    def close(self):
        for pid in self._sshd_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        # hosts first (their processes), the bridge last
        for ns in reversed(self._made):
            remove_namespace(ns)
        for h in [*self.hosts, self.launcher]:
            shutil.rmtree(NETNS_ETC / h.ns, ignore_errors=True)
        self._made = []
        self._sshd_pids = []
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
        self._restore_signal_handlers()


def rate_bits(rate):
    """Bits per second of a tc rate such as ``1gbit``, ``100mbit``, ``500kbit``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(g|m|k|)bit", str(rate).strip().lower())
    if not m:
        raise ValueError(f"rate must look like 1gbit, 100mbit, 500kbit, got {rate!r}")
    return float(m.group(1)) * {"g": 1e9, "m": 1e6, "k": 1e3, "": 1.0}[m.group(2)]


def link_burst(rate, ms=1.0, least=32 * 1024):
    """tbf burst in bytes for ``rate``: what the link carries in ``ms`` milliseconds, at least
    ``least`` (a few full-size packets), so the shaped link sends no faster than its rate after
    an idle moment, as a real link does."""
    return max(least, int(rate_bits(rate) / 8 * ms / 1e3))


def measure_after_idle(eh, nbytes=8_000_000, idle_s=0.15, repeats=5):
    """ms for ``nbytes`` host0 -> host1 (until the receiver's one-byte ack) after ``idle_s`` of
    silence, ``repeats`` times: a step's burst of traffic, which a too large tbf burst lets
    through faster than the link's rate."""
    if eh.n < 2:
        return None
    server = ("import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
              f"s.bind(('{eh.hosts[1].ip}',5998));s.listen(1);c,_=s.accept()\n"
              f"for _ in range({repeats}):\n n=0\n while n<{nbytes}:\n  b=c.recv(1<<20)\n  n+=len(b)\n"
              "  if not b: raise SystemExit(1)\n c.sendall(b'k')\n")
    client = ("import socket,time;s=socket.socket()\nfor _ in range(100):\n try:\n"
              f"  s.connect(('{eh.hosts[1].ip}',5998));break\n except OSError: time.sleep(0.05)\n"
              f"b=bytes({nbytes});ts=[]\nfor _ in range({repeats}):\n time.sleep({idle_s});t=time.perf_counter()\n"
              " s.sendall(b);s.recv(1);ts.append(1e3*(time.perf_counter()-t))\nprint(*ts)")
    srv = subprocess.Popen(_ns_exec(eh.hosts[1].ns, sys.executable, "-c", server))
    try:
        out = _run(_ns_exec(eh.hosts[0].ns, sys.executable, "-c", client)).stdout
    finally:
        srv.wait(timeout=30)
    return [float(t) for t in out.split()]


def measure_link(eh, seconds=2.0):
    """Rough throughput host0 -> host1 over the shaped link, with python sockets (Gbit/s)."""
    if eh.n < 2:
        return None
    server = ("import socket,time;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
              f"s.bind(('{eh.hosts[1].ip}',5999));s.listen(1);c,_=s.accept();n=0;t=None\n"
              "while True:\n b=c.recv(1<<20)\n if not b: break\n"
              " t=t or time.time();n+=len(b)\nprint(n*8/(time.time()-t)/1e9)")
    client = ("import socket,time;s=socket.socket()\nfor _ in range(100):\n try:\n"
              f"  s.connect(('{eh.hosts[1].ip}',5999));break\n except OSError: time.sleep(0.05)\n"
              f"b=bytes(1<<20);t=time.time()\nwhile time.time()-t<{seconds}: s.sendall(b)\ns.close()")
    srv = subprocess.Popen(_ns_exec(eh.hosts[1].ns, sys.executable, "-c", server),
                           stdout=subprocess.PIPE, text=True)
    _run(_ns_exec(eh.hosts[0].ns, sys.executable, "-c", client))
    out, _ = srv.communicate(timeout=30)
    return float(out.strip())


# ---- helpers shared by the benchmarks ------------------------------------------------------------
def stream(cmd, timeout, prefix="  | ", env=None, keep=True):
    """Run ``cmd`` in its own session, echo its output lines (progress) and return (rc, output).
    A run past ``timeout`` seconds is killed with its whole process group."""
    import threading
    lines = []
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, start_new_session=True)
    timer = threading.Timer(timeout, lambda: os.killpg(p.pid, signal.SIGKILL))
    timer.start()
    try:
        for line in p.stdout:
            if keep:
                lines.append(line)
            print(prefix + line.rstrip(), flush=True)
        rc = p.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    finally:
        timer.cancel()
    if not timer.is_alive() and rc == -signal.SIGKILL:
        lines.append(f"[killed after {timeout}s]\n")
    return rc, "".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("demo", "shell"):
        s = sub.add_parser(name)
        s.add_argument("--hosts", type=int, default=2)
        s.add_argument("--rate", default="1gbit")
        s.add_argument("--port", type=int, default=2222)
        s.add_argument("--no-sshd", action="store_true")
    sub.add_parser("list")
    c = sub.add_parser("cleanup")
    c.add_argument("--all", action="store_true", help="also namespaces of runs still alive")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        print("\n".join(list_namespaces()) or "(none)")
        return 0
    if args.cmd == "cleanup":
        cleanup_stale(all_runs=args.all)
        return 0
    with EmulatedHosts(args.hosts, rate=args.rate, sshd=not args.no_sshd, ssh_port=args.port,
                       verbose=True) as eh:
        print("hosts:", eh.hosts, "launcher:", eh.launcher, "subnet:", eh.subnet)
        if args.cmd == "demo":
            before = eh.counters()
            print(f"host0 -> host1 throughput: {measure_link(eh):.2f} Gbit/s at rate {args.rate}")
            if args.rate != "none":
                idle = measure_after_idle(eh)
                print(f"8 MB after 150 ms idle: {', '.join(f'{t:.1f}' for t in idle)} ms "
                      f"(at the rate: {8e6 * 8 / rate_bits(args.rate) * 1e3:.1f} ms)")
            after = eh.counters()
            for hn in after:
                print(f"  {hn}: tx {after[hn][0] - before[hn][0]:,} B, rx {after[hn][1] - before[hn][1]:,} B")
            if not args.no_sshd:
                p = _run(eh.launcher_cmd(["ssh", "-F", str(eh.ssh_config), eh.hosts[-1].hostname,
                                          "hostname; ip -br addr show eth0"]))
                print("ssh to last host:", p.stdout.strip())
        else:
            print(f"launcher shell: {shlex.join(eh.launcher_cmd(['bash']))}")
            print(f"mpirun args:    {shlex.join(eh.mpirun_args())} -H {eh.hostlist()}")
            print("Ctrl-C to tear down")
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
