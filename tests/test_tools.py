"""tools/ (tests' and benchmarks' tooling, outside the installed package): its pure parts, in one
process (no root, no MPI job, no namespaces made): mpirun command lines, emulated-host
names/addresses/host lists, the choice of leftovers to clean up by name prefix, machine info keys
and the reference models' shapes."""

import importlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools import emulated_hosts as eh_mod
from tools import launch, machine, shapes

REPO = Path(__file__).resolve().parent.parent


# ---- launch.mpirun_command ------------------------------------------------------------------
@pytest.fixture
def fake_mpirun(monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/usr/bin/{name}")


def test_mpirun_command_flags_and_argv(fake_mpirun, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cmd = launch.mpirun_command(3, ["script.py", "--x", 1], python="/py")
    assert cmd[:3] == ["/usr/bin/mpirun", "-np", "3"]
    assert cmd[-4:] == ["/py", "script.py", "--x", "1"]
    for flag in (["--oversubscribe"], ["--bind-to", "none"],
                 ["--mca", "btl_vader_single_copy_mechanism", "none"], ["-x", "OMP_NUM_THREADS=1"]):
        assert any(cmd[i:i + len(flag)] == flag for i in range(len(cmd))), flag
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    assert launch.mpirun_command(1, ["s.py"])[-2] == sys.executable


def test_mpirun_command_forwards_set_variables(fake_mpirun, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    cmd = launch.mpirun_command(2, ["s.py"], env_names=("OMP_NUM_THREADS", "PYTHONPATH"))
    pairs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
    assert pairs == ["OMP_NUM_THREADS", "PYTHONPATH"]


def test_mpirun_command_passes_mca_pairs_before_the_program(fake_mpirun):
    cmd = launch.mpirun_command(2, ["s.py"], python="/py", mca=[("mpi_yield_when_idle", 1), ("btl", "tcp,self")])
    program = cmd.index("/py")
    assert cmd[cmd.index("mpi_yield_when_idle") - 1:cmd.index("mpi_yield_when_idle") + 2] == \
        ["--mca", "mpi_yield_when_idle", "1"]
    assert cmd[cmd.index("tcp,self") - 2:cmd.index("tcp,self") + 1] == ["--mca", "btl", "tcp,self"]
    assert cmd.index("tcp,self") < program
    assert "mpi_yield_when_idle" not in launch.mpirun_command(2, ["s.py"])


@pytest.mark.parametrize("np_", [0, -1, True, 1.5, "2"])
def test_mpirun_command_rejects_bad_np(fake_mpirun, np_):
    with pytest.raises(ValueError):
        launch.mpirun_command(np_, ["s.py"])


def test_mpirun_command_names_the_fix_without_mpirun(monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="install.sh"):
        launch.mpirun_command(2, ["s.py"])


# ---- emulated hosts: names, addresses, commands (nothing is set up) ---------------------------
def test_horovodrun_gloo_command_names_each_host_apart(tmp_path):
    """2 + 1 ranks: two -H names, both resolving to 127.0.0.1 (so horovodrun runs them here)."""
    import socket

    python = tmp_path / "python"
    (tmp_path / "horovodrun").write_text("")
    cmd = launch.horovodrun_gloo_command([2, 1], ["s.py", 3], python=str(python), timeout_s=90)
    assert cmd == [str(tmp_path / "horovodrun"), "--gloo", "-np", "3", "-H", "localhost:2,127.0.0.1:1",
                   "--network-interface", "lo", "--start-timeout", "90", "--gloo-timeout-seconds", "90", str(python), "s.py", "3"]
    assert {socket.gethostbyname(h) for h in launch.LOOPBACK_HOSTS} == {"127.0.0.1"}
    assert len(set(launch.LOOPBACK_HOSTS)) == 4


@pytest.mark.parametrize("counts", [[], [1, 1, 1, 1, 1], [2, 0], [True], [1.5]])
def test_horovodrun_gloo_command_rejects_bad_hosts(counts):
    with pytest.raises(ValueError, match="ranks_per_host"):
        launch.horovodrun_gloo_command(counts, ["s.py"])


def test_emulated_hosts_layout_before_entering():
    eh = eh_mod.EmulatedHosts(3, rate="1gbit", net=123, tag="beef", ssh_port=2345)
    base = f"hvdtk-{os.getpid()}-beef"
    assert eh.base == base and eh.subnet == "10.123.0.0/24"
    assert [h.ns for h in eh.hosts] == [f"{base}-h0", f"{base}-h1", f"{base}-h2"]
    assert [h.ip for h in eh.hosts] == ["10.123.0.11", "10.123.0.12", "10.123.0.13"]
    assert [h.hostname for h in eh.hosts] == ["host0", "host1", "host2"]
    assert eh.launcher.ip == "10.123.0.2" and eh.bridge_ns == f"{base}-br"
    assert eh.hostlist() == "host0:1,host1:1,host2:1"
    assert eh.hostlist(slots=2, count=2) == "host0:2,host1:2"
    # every name made by this object is recognised as this process's
    for ns in [eh.bridge_ns, eh.launcher.ns, *(h.ns for h in eh.hosts)]:
        assert eh_mod.pid_of_name(ns) == os.getpid()


def test_emulated_hosts_refuse_without_root(monkeypatch):
    """Without root, entering says so before making anything (no namespace, no handler)."""
    eh = eh_mod.EmulatedHosts(2, net=103, tag="0c0c")
    made = []
    monkeypatch.setattr(eh, "_setup", lambda: made.append("setup"))
    monkeypatch.setattr(eh_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="emulated hosts need root"):
        with eh:
            pass
    assert made == [] and eh._old_handlers == {}


def test_emulated_hosts_rejects_no_hosts():
    with pytest.raises(ValueError):
        eh_mod.EmulatedHosts(0)


def test_link_burst_is_one_millisecond_of_the_rate():
    # hand-computed: 1 Gbit/s = 125,000,000 B/s -> 125,000 B in 1 ms; 10 Gbit -> 1,250,000 B
    assert eh_mod.rate_bits("1gbit") == 1e9 and eh_mod.rate_bits("100mbit") == 1e8
    assert eh_mod.rate_bits("2.5gbit") == 2.5e9 and eh_mod.rate_bits("500kbit") == 5e5
    assert eh_mod.link_burst("1gbit") == 125_000 and eh_mod.link_burst("10gbit") == 1_250_000
    assert eh_mod.link_burst("100mbit") == 32 * 1024  # 12,500 B: raised to the floor
    for bad in ("1gbps", "fast", "", "1 gbit"):
        with pytest.raises(ValueError, match="rate must look like"):
            eh_mod.rate_bits(bad)
    with pytest.raises(ValueError, match="rate must look like"):  # before anything is made
        eh_mod.EmulatedHosts(2, rate="1gbps")
    # an explicit burst is used as given; an unshaped link has none
    assert eh_mod.EmulatedHosts(2, rate="1gbit", burst="4mb")._burst_for("1gbit") == "4mb"
    assert eh_mod.EmulatedHosts(2, rate="1gbit")._burst_for("1gbit") == "125000b"
    assert eh_mod.EmulatedHosts(2, rate="none")._burst_for("none") is None


def test_emulated_hosts_command_wrappers():
    eh = eh_mod.EmulatedHosts(2, net=101, tag="0a0a")
    cmd = eh.host_cmd(1, ["hostname"])
    assert cmd[:4] == ["ip", "netns", "exec", eh.hosts[1].ns] and cmd[-1] == "hostname"
    assert "hostname host1 && exec \"$@\"" in cmd
    assert eh.launcher_cmd(["ls"], hostname=False) == ["ip", "netns", "exec", eh.launcher.ns, "ls"]
    assert "hostname launcher && exec \"$@\"" in eh.launcher_cmd(["ls"])


def test_emulated_hosts_mpirun_command(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    eh = eh_mod.EmulatedHosts(3, net=102, tag="0b0b")
    eh.ssh_config = Path("/tmp/cfg")
    cmd = eh.mpirun_command(["bench.py", "--worker"], np=2, python="/venv/bin/python",
                            pythonpath="/repo", wdir="/repo")
    assert cmd[:5] == ["mpirun", "-np", "2", "-H", "host0:1,host1:1"]
    assert cmd[-3:] == ["/venv/bin/python", "bench.py", "--worker"]
    assert "ssh -F /tmp/cfg" in cmd
    assert cmd[cmd.index("btl_tcp_if_include") + 1] == "10.102.0.0/24"
    xs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
    assert xs[0].startswith("PATH=/venv/bin:")
    assert {"PYTHONPATH=/repo", "OMP_NUM_THREADS=1", "HOROVOD_CYCLE_TIME"} <= set(xs)
    assert cmd[cmd.index("--wdir") + 1] == "/repo"
    assert eh.mpirun_command(["b.py"])[:3] == ["mpirun", "-np", "3"]
    for bad in (0, 4, True):
        with pytest.raises(ValueError):
            eh.mpirun_command(["b.py"], np=bad)


# ---- clean-up of leftovers by name prefix ----------------------------------------------------
def test_pid_of_name():
    assert eh_mod.pid_of_name("hvdtk-1234-ab12-h0") == 1234
    assert eh_mod.pid_of_name("hvdtk-x-h0") is None
    assert eh_mod.pid_of_name("other-1234-h0") is None


def test_stale_names_choose_only_ours_of_dead_runs():
    names = ["hvdtk-10-aa-h0", "hvdtk-10-aa-br", "hvdtk-20-bb-h0", "hvdtk-odd", "netns-30-cc", "x"]
    alive = {10: False, 20: True}.get
    assert eh_mod.stale_names(names, alive=alive) == ["hvdtk-10-aa-br", "hvdtk-10-aa-h0"]
    assert eh_mod.stale_names(names, all_runs=True, alive=alive) == [
        "hvdtk-10-aa-br", "hvdtk-10-aa-h0", "hvdtk-20-bb-h0", "hvdtk-odd"]


def test_cleanup_stale_removes_dead_runs_leftovers_only(tmp_path):
    etc, tmp = tmp_path / "netns", tmp_path / "tmp"
    for d in (etc / "hvdtk-10-aa-h0", etc / "hvdtk-20-bb-h0", etc / "unrelated",
              tmp / "hvdtk-10-aa-xyz", tmp / "hvdtk-20-bb-xyz", tmp / "other-10-aa"):
        d.mkdir(parents=True)
    removed_ns = []
    removed = eh_mod.cleanup_stale(verbose=False, alive={10: False, 20: True}.get,
                                   namespaces=["hvdtk-10-aa-br", "hvdtk-20-bb-br", "foreign"],
                                   netns_etc=etc, tmp_root=tmp, remove=removed_ns.append)
    assert removed_ns == ["hvdtk-10-aa-br", "hvdtk-10-aa-h0"]
    assert removed == [*removed_ns, str(tmp / "hvdtk-10-aa-xyz")]
    assert sorted(p.name for p in etc.iterdir()) == ["hvdtk-20-bb-h0", "unrelated"]
    assert sorted(p.name for p in tmp.iterdir()) == ["hvdtk-20-bb-xyz", "other-10-aa"]


def test_cleanup_stale_real_process_is_alive(tmp_path):
    """This process is alive: nothing of a name carrying its pid is removed."""
    (tmp_path / f"hvdtk-{os.getpid()}-ab-x").mkdir()
    removed = eh_mod.cleanup_stale(verbose=False, namespaces=[f"hvdtk-{os.getpid()}-ab-h0"],
                                   netns_etc=tmp_path / "none", tmp_root=tmp_path,
                                   remove=lambda ns: pytest.fail(f"removed {ns}"))
    assert removed == []


# ---- machine info ----------------------------------------------------------------------------
def test_machine_info_keys_and_values():
    info = machine.machine_info(repo=REPO)
    assert tuple(info) == machine.KEYS
    assert info["cores"] == os.cpu_count() and info["python"].count(".") == 2
    assert info["date_utc"].endswith("UTC")
    assert info["git"] == machine.git_commit(REPO)  # (git_commit itself: checked by hand below)
    line = machine.summary(info)
    assert f"{info['cores']} cores" in line and "torch" in line


def test_thread_cpu_split_by_hand():
    before = {10: 1_000, 11: 5_000, 12: 7_000}
    after = {10: 3_001_000, 11: 5_500_000, 13: 9_000_000}  # 12 ended, 13 started in between
    assert machine.cpu_split(before, after, main=10) == (0.003, 0.005495)


def test_thread_cpu_reads_schedstat(tmp_path):
    for tid, text in ((7, "123456 99 3\n"), (8, "42 0 1\n"), (9, "")):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "schedstat").write_text(text)
    assert machine.thread_cpu_ns(str(tmp_path)) == {7: 123456, 8: 42}  # 9: unreadable, skipped
    assert machine.thread_cpu_ns(str(tmp_path / "missing")) == {}
    if os.path.isdir("/proc/self/task"):  # Linux: the calling thread is among them
        assert machine.main_thread_id() in machine.thread_cpu_ns()


def test_machine_parsers():
    lscpu = "Architecture: x86_64\nModel name:   AMD EPYC 7B13\nThread(s) per core:  2\n"
    assert machine.parse_lscpu(lscpu) == {"cpu": "AMD EPYC 7B13", "threads_per_core": 2}
    assert machine.parse_lscpu(None) == {"cpu": None, "threads_per_core": None}
    assert machine.parse_meminfo("MemTotal:       25165824 kB\nMemFree: 1 kB\n") == 24.0
    assert machine.parse_meminfo("") is None


def test_git_commit_by_hand(tmp_path, monkeypatch):
    """``git_commit``: None outside a work tree; a fresh repository's short HEAD as git prints
    it; ``+dirty`` once a tracked file changes (an untracked one does not count)."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # tmp_path inside a work tree: not it
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    plain, repo = tmp_path / "plain", tmp_path / "repo"
    plain.mkdir()
    repo.mkdir()
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run([git, *args], cwd=repo, env=env, check=True)
    (repo / "f").write_text("1")
    subprocess.run([git, "add", "f"], cwd=repo, env=env, check=True)
    subprocess.run([git, "commit", "-q", "-m", "f"], cwd=repo, env=env, check=True)
    short = subprocess.run([git, "rev-parse", "--short", "HEAD"], cwd=repo, env=env, check=True,
                           capture_output=True, text=True).stdout.strip()
    assert machine.git_commit(plain) is None
    (repo / "untracked").write_text("u")
    assert machine.git_commit(repo) == short
    (repo / "f").write_text("2")
    assert machine.git_commit(repo / "f") == short + "+dirty"


def test_summary_reads_old_keys():
    """Results saved before the one helper used other key names; their reports still render."""
    assert "AMD X, 2 cores" in machine.summary({"Model name": "AMD X", "cores": 2})


# ---- reference model shapes ------------------------------------------------------------------
def test_resnet50_and_bert_base_shapes():
    r, b = shapes.resnet50_shapes(), shapes.bert_base_shapes()
    assert (len(r), shapes.numel(r)) == (shapes.RESNET50["tensors"], shapes.RESNET50["numel"]) == (161, 25_557_032)
    assert (len(b), shapes.numel(b)) == (shapes.BERT_BASE["tensors"], shapes.BERT_BASE["numel"]) == (199, 109_482_240)
    named = dict(shapes.bert_base_named_shapes())
    assert named["embeddings.word_embeddings.weight"] == (30522, 768)
    assert named["encoder.layer.11.intermediate.dense.weight"] == (3072, 768)
    assert named["encoder.layer.11.output.dense.weight"] == (768, 3072)
    assert shapes.model_shapes("bert-base") == b
    with pytest.raises(ValueError):
        shapes.model_shapes("gpt")


def test_gpt2_small_shapes():
    """GPT-2 small's published size: 124,439,808 parameters (the head tied to the embedding),
    counted by hand: 50,257 x 768 + 1,024 x 768, 12 blocks of (4 x 768 for two LayerNorms, 768 x 2,304
    + 2,304, 768 x 768 + 768, 768 x 3,072 + 3,072, 3,072 x 768 + 768), and the final LayerNorm's 2 x 768."""
    g = shapes.gpt2_small_shapes()
    block = 4 * 768 + (768 * 2304 + 2304) + (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768)
    assert shapes.numel(g) == 50257 * 768 + 1024 * 768 + 12 * block + 2 * 768 == 124_439_808
    assert (len(g), shapes.numel(g)) == (shapes.GPT2_SMALL["tensors"], shapes.GPT2_SMALL["numel"]) == (148, 124_439_808)
    named = dict(shapes.gpt2_small_named_shapes())
    assert named["transformer.wte.weight"] == (50257, 768)
    assert named["transformer.h.11.mlp.c_proj.weight"] == (3072, 768)
    assert shapes.model_shapes("gpt2-small") == g
    with pytest.raises(ValueError):
        shapes.model_shapes("gpt")



def _bench_module(name):
    """``benchmarks/NAME.py`` imported (benchmarks/ on ``sys.path`` only meanwhile)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_real_models_have_the_reference_shapes():
    """benchmarks/_models.py builds the models whose shapes are listed (and counted by hand) above:
    ResNet-50's 161 tensors in order, GPT-2 small's 148 tensors of 124,439,808 parameters (its own
    layout: Linear weights out x in); ResNet-50's loss on its synthetic inputs is a finite scalar
    whose backward reaches every parameter."""
    import torch
    models = _bench_module("_models")
    torch.manual_seed(0)
    r = models.build("resnet50", torch)
    assert [tuple(p.shape) for p in r.parameters()] == [tuple(s) for s in shapes.resnet50_shapes()]
    batch = models.inputs("resnet50", torch, pool=1, seed=0, batch=2, image_size=32)[0]
    assert batch[0].shape == (2, 3, 32, 32) and batch[1].shape == (2,)
    loss = models.loss("resnet50", r, batch)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in r.parameters())
    g = models.build("gpt2-small", torch)
    assert (len(list(g.parameters())), sum(p.numel() for p in g.parameters())) == (148, 124_439_808)
    assert sorted(p.numel() for p in g.parameters()) == sorted(math.prod(s) for s in shapes.gpt2_small_shapes())
    tokens = models.inputs("gpt2-small", torch, pool=2, seed=0, batch=1, context=8)
    assert len(tokens) == 2 and tokens[0].shape == (1, 9)
    with pytest.raises(ValueError, match="no real model for 'bert-base'"):
        models.build("bert-base", torch)


def test_ddp_hooks_trains_a_real_model_unless_told_otherwise(capsys):
    """benchmarks/ddp_hooks.py: the model's own loss by default, refused for a model it cannot
    build (BERT-base: shapes only), and reports saved before the option say their loss was synthetic."""
    ddp_hooks = _bench_module("ddp_hooks")
    with pytest.raises(SystemExit) as exit_:
        ddp_hooks.main(["--model", "bert-base"])
    assert exit_.value.code == 2 and "bert-base only with --loss synthetic" in capsys.readouterr().err
    assert "synthetic" in ddp_hooks.loss_sentence({}, "resnet50")
    real = ddp_hooks.loss_sentence({"loss": "real", "batch": 8, "image_size": 32, "context": 128}, "resnet50")
    assert "8 synthetic 32x32 images a rank" in real and "real forward and backward of resnet50" in real

# ---- every benchmark's command line ------------------------------------------------------------
BENCHMARKS = sorted(p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", BENCHMARKS)
def test_benchmark_help_runs(script):
    """``--help`` prints the usage and exits 0: argparse formats help strings with %, so a bare
    percent sign in one (a density, a byte ratio) crashes it, and only for the user who asks."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: "), out.stdout[:200]


def test_benchmarks_wait_out_autos_longest_trial():
    """The benchmarks time exchange="auto" only after its trial: their allowance must cover the
    longest one auto can run (every family it may try, hierarchical and dense fp16 included)."""
    _common = _bench_module("_common")
    from hvd_topk import auto
    longest = max(len(auto.families(h, False, compact=c, fp16=f)) for h in (False, True)
                  for c in (False, True) for f in (False, True))
    assert longest == 6  # dense, dense fp16, allgather, sparse allreduce, two hierarchical
    assert _common.AUTO_TRIAL_STEPS >= longest * (auto.TRIAL_STEPS + 1)


def _fake_methods(log, alive):
    """``time_methods``' three callbacks over fake methods: each step's "seconds" is its call's
    position in ``log``, so the rows show which calls each method's times came from."""
    def build(method):
        alive.append(method)
        log.append(("build", method, len(alive)))
        return {"method": method, "opt": object(), "warmup": 1, "times": []}

    def one_step(m, step):
        log.append((m["method"], step))
        return float(len(log))

    def finish(m):
        alive.remove(m["method"])
        return {"method": m["method"], "times": list(m["times"])}
    return build, one_step, finish


def test_time_methods_rounds_rotate_the_order_and_pool_times():
    """Three passes over a, b, c start at a, then b, then c; each pass builds the method afresh,
    warms it up (step 0, untimed) and times 2 steps; the times of all passes are pooled, and each
    row is made once (hand-written expectation)."""
    common = _bench_module("_common")
    log, alive = [], []
    build, one_step, finish = _fake_methods(log, alive)
    rows = common.time_methods(["a", "b", "c"], build, one_step, finish, 2, rounds=3)
    builds = [e[1] for e in log if e[0] == "build"]
    assert builds == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [r["method"] for r in rows] == ["a", "b", "c"]
    positions = {m: [i + 1 for i, e in enumerate(log) if e[0] == m and e[1] >= 1] for m in "abc"}
    for r in rows:
        assert r["times"] == [float(p) for p in positions[r["method"]]]
        assert len(r["times"]) == 6


def test_time_methods_interleave_rotates_each_step():
    """Each method warms up alone but for its last warm-up step, which all take in one round
    right before the timed steps (warmed up alone, the first method waited through the others'
    warm-ups and came to its first timed step cold); timed step i starts at a different method
    (hand-written expectation, 3 warm-up steps each)."""
    common = _bench_module("_common")
    log, alive = [], []
    build, one_step, finish = _fake_methods(log, alive)
    common.time_methods(["a", "b", "c"], lambda m: {**build(m), "warmup": 3}, one_step, finish, 3, interleave=True)
    steps = [e for e in log if e[0] != "build"]
    assert steps[:6] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 1)]  # alone
    assert steps[6:9] == [("a", 2), ("b", 2), ("c", 2)]  # the last warm-up step, one round
    assert [m for m, _ in steps[9:]] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [s for _, s in steps[9:]] == [3, 3, 3, 4, 4, 4, 5, 5, 5]


def test_time_methods_refuses_to_time_autos_trial():
    common = _bench_module("_common")

    class Opt:
        def compression_stats(self):
            return {"exchange_reason": "trial in progress (5 of 16 steps)"}
    build = lambda method: {"method": method, "opt": Opt(), "warmup": 1, "times": []}  # noqa: E731
    with pytest.raises(SystemExit, match="still in its trial"):
        common.time_methods(["topk-auto@0.01"], build, lambda m, i: 0.1, lambda m: m, 2)


def test_overhead_ratio_by_hand():
    """The README's training table: dense 1159.1 ms, none 255.1, hvd_topk 294.7 a step give an
    overhead ratio of (1159.1 - 255.1) / (294.7 - 255.1) = 22.8; a step below none's is n/a."""
    common = _bench_module("_common")
    ref = {"none": 255.1, "dense": 1159.1, "topk-ef": 294.7, "fp16": 250.0}
    assert common.overhead_versus(ref, {"method": "topk-ef", "median_ms": 294.7}, "dense") == "22.8x"
    assert common.overhead_versus(ref, {"method": "topk-ef", "median_ms": 294.7}, "fp16") == "n/a"
    assert common.overhead(ref, {"method": "fp16", "median_ms": 250.0}) == "-5 ms (below none: noise)"
    assert common.overhead(ref, {"method": "none", "median_ms": 255.1}) == "-"


def test_convergence_gpt_reuses_only_runs_of_the_same_code(tmp_path, monkeypatch):
    """--reuse takes an earlier run only when the code that made it is the code now (a
    fingerprint of hvd_topk and the examples); a run recorded before fingerprints existed only
    for dense AdamW (hvd_topk's changes moved the compressed runs, ba1194f). The fingerprint
    changes with one byte of hvd_topk and is stable otherwise (hand-made trees)."""
    cg = _bench_module("convergence_gpt")
    assert cg.reusable({"config": "gv-1%", "made": {"code": "abc"}}, "abc")
    assert not cg.reusable({"config": "gv-1%", "made": {"code": "abc"}}, "abd")
    assert not cg.reusable({"config": "dense-lr1e-2", "made": {"code": "abc"}}, "abd")
    assert cg.reusable({"config": "dense-lr1e-2", "made": {"git": "1b01c4a"}}, "abd")
    assert not cg.reusable({"config": "gv-1%-lr1e-2-fp16v", "made": {"git": "1b01c4a"}}, "abd")
    # "dense" in the name is not enough: Horovod's optimizer over hvd_topk's FrozenVarianceAdamW changed
    assert not cg.reusable({"config": "dense-fv", "made": {"git": "1b01c4a"}}, "abd")
    assert not cg.reusable({"config": "dense-lr1e-2", "args_used": "--compression none --adam frozen-variance",
                            "made": {"git": "1b01c4a"}}, "abd")
    assert cg.reusable({"config": "dense-lr1e-2", "args_used": "--compression none --lr 1e-2",
                        "made": {"git": "1b01c4a"}}, "abd")
    for tree in ("a", "b"):
        (tmp_path / tree / "hvd_topk" / "native").mkdir(parents=True)
        (tmp_path / tree / "examples").mkdir()
        (tmp_path / tree / "hvd_topk" / "__init__.py").write_text("x = 1\n")
        (tmp_path / tree / "hvd_topk" / "native" / "topk.cpp").write_text("int f();\n")
        (tmp_path / tree / "examples" / "pytorch_gpt.py").write_text("print(1)\n")
    prints = []
    for tree, change in (("a", None), ("b", None), ("b", "x = 2\n")):
        if change:
            (tmp_path / tree / "hvd_topk" / "__init__.py").write_text(change)
        monkeypatch.setattr(cg, "ROOT", tmp_path / tree)
        monkeypatch.setattr("importlib.util.find_spec", lambda name, tree=tree: type(
            "Spec", (), {"origin": str(tmp_path / tree / "hvd_topk" / "__init__.py")})())
        prints.append(cg.code_fingerprint())
    assert prints[0] == prints[1] != prints[2]


def test_convergence_gpt_reuse_prefers_the_run_of_the_same_code(tmp_path):
    """A run re-made by today's code (file a) is not shadowed by the stale run of the same key
    in a later --reuse file (b, which holds what was re-run): before, the later file's run
    replaced it, was then refused as stale, and the run was made a third time. A key with only
    a stale run is named as not reused; dense AdamW of an older file is reused."""
    cg = _bench_module("convergence_gpt")
    def run(config, seed, made=None):
        return {"config": config, "args_used": "A", "steps": 3000, "seed": seed, "ranks": 2,
                "final_val_loss": 1.0 + seed / 100, **({"made": made} if made else {})}
    (tmp_path / "a.json").write_text(json.dumps({"meta": {}, "runs": [run("gv-0.1%", 42, {"code": "now"})]}))
    (tmp_path / "b.json").write_text(json.dumps({"meta": {"date": "2026-11-28"}, "runs": [
        run("gv-0.1%", 42), run("gv-0.1%", 43), run("dense-lr1e-2", 42)]}))
    earlier, stale = cg.earlier_runs([tmp_path / "a.json", tmp_path / "b.json"], "now")
    assert sorted((k[0], k[3]) for k in earlier) == [("dense-lr1e-2", 42), ("gv-0.1%", 42)]
    assert earlier[("gv-0.1%", "A", 3000, 42, 2)]["made"] == {"file": "a.json", "code": "now"}
    assert stale == ["gv-0.1% seed 43"]


def test_convergence_gpt_paired_gap_by_hand():
    """Seed by seed against dense: losses 1.02/1.00, 0.99/1.00, 1.03/1.00 are +2%, -1%, +3%:
    mean +1.333%, sample sd 2.0817%, 95% half-width 4.303 x 2.0817% / sqrt(3) = 5.172%."""
    cg = _bench_module("convergence_gpt")
    runs = [{"config": c, "seed": s, "final_val_loss": v} for c, s, v in (
        ("dense-lr1e-2", 1, 1.0), ("dense-lr1e-2", 2, 1.0), ("dense-lr1e-2", 3, 1.0),
        ("x", 1, 1.02), ("x", 2, 0.99), ("x", 3, 1.03), ("x", 4, 5.0))]  # seed 4: no dense run to pair with
    gap = cg.paired_gap(runs, "x", "dense-lr1e-2")
    assert gap["n"] == 3 and gap["mean"] == pytest.approx(0.013333, abs=1e-6)
    assert gap["high"] - gap["mean"] == pytest.approx(0.05172, abs=1e-5)
    assert cg.paired_gap(runs, "dense-lr1e-2", "dense-lr1e-2") is None


def test_paired_gaps_across_files_by_hand(tmp_path):
    """A scheme's runs in one file against dense AdamW's in another, paired by seed, not by
    position: seed 1 1.05 / 1.00 (+5%), seed 2 0.931 / 0.95 (-2%); seed 3 has no dense run and is
    left out; mean +1.5%, sample sd 4.950%, 95% half-width 12.706 x 4.950% / sqrt(2) = 44.47%.
    Where each run was made: its file's meta; a reused run is followed to its source file."""
    pg = _bench_module("paired_gaps")
    dense, scheme, source = tmp_path / "dense.json", tmp_path / "scheme.json", tmp_path / "source.json"
    meta = lambda cpu, date: {"machine": {"cpu": cpu}, "date": date}
    run = lambda c, s, v, **kw: {"config": c, "seed": s, "final_val_loss": v, "steps": 1000, "ranks": 2, **kw}
    source.write_text(json.dumps({"meta": meta("Box B", "2026-11-27 10:00 UTC"), "runs": [run("dense-lr1e-2", 2, 0.95)]}))
    dense.write_text(json.dumps({"meta": meta("Box A", "2026-12-07 08:48 UTC"), "runs": [
        run("dense-lr1e-2", 1, 1.0), run("dense-lr1e-2", 2, 0.95, reused=True, made={"file": "source.json"})]}))
    scheme.write_text(json.dumps({"meta": meta("Box A", "2026-11-29 16:12 UTC"), "runs": [
        run("x", 2, 0.931), run("x", 1, 1.05, reused=True), run("x", 3, 9.0)]}))
    lines = pg.gaps_table((dense, "dense-lr1e-2"), [(scheme, "x")])
    assert "**+1.50%** [-43.0, +46.0], 2 seeds" in lines[0]
    rows = [line for line in lines if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert rows == ["| 2 | 0.9310 | Box A, 2026-11-29 | 0.9500 | Box B, 2026-11-27 | -2.00% |",
                    "| 1 | 1.0500 | reused, source not recorded | 1.0000 | Box A, 2026-12-07 | +5.00% |"]
    assert any(line.endswith("machine (or not known to be): 2, 1.") for line in lines)
    # along the run: at step 10 seed 1 is 1.10 / 1.00 (+10%), seed 2 0.60 / 0.50 (+20%): the mean
    # of the seeds' gaps is +15.0% (the gap of the means, 1.70 / 1.50, would be +13.3%); at step
    # 20 seed 2 has no evaluation, so no mean
    history = lambda *points: [{"step": s, "val_loss": v} for s, v in points]
    dense.write_text(json.dumps({"runs": [run("dense-lr1e-2", 1, 1.0, history=history((10, 1.0), (20, 1.0))),
                                          run("dense-lr1e-2", 2, 1.0, history=history((10, 0.5), (20, 1.0)))]}))
    scheme.write_text(json.dumps({"runs": [run("x", 1, 1.0, history=history((10, 1.10), (20, 1.3))),
                                           run("x", 2, 1.0, history=history((10, 0.60)))]}))
    along = pg.gaps_table((dense, "dense-lr1e-2"), [(scheme, "x")], at=(10, 20))
    assert "| gap, mean over seeds | +15.0% | n/a |" in along
    scheme.write_text(json.dumps({"runs": [run("x", 2, 0.95, reused=True)]}))
    source.write_text(json.dumps({"runs": [run("dense-lr1e-2", 2, 0.95, reused=True)]}))
    unknown_both = pg.gaps_table((source, "dense-lr1e-2"), [(scheme, "x")])  # two unknowns are no match
    assert any(line.endswith("machine (or not known to be): 2.") for line in unknown_both)
    with pytest.raises(SystemExit, match="no runs of config 'y'"):
        pg.gaps_table((dense, "dense-lr1e-2"), [(scheme, "y")])
    with pytest.raises(SystemExit, match="not a convergence_gpt.py result file"):
        pg.gaps_table((tmp_path / "missing.json", "dense-lr1e-2"), [(scheme, "x")])
    scheme.write_text(json.dumps({"runs": [run("x", 1, 1.0, steps=3000)]}))
    with pytest.raises(SystemExit, match="ran 3000 steps on 2 ranks, the dense run 1000 on 2: not a pair"):
        pg.gaps_table((dense, "dense-lr1e-2"), [(scheme, "x")])
    scheme.write_text(json.dumps({"runs": [run("x", 1, v) for v in (1.0, 1.1)]}))
    with pytest.raises(SystemExit, match="more than one run of a seed"):
        pg.gaps_table((dense, "dense-lr1e-2"), [(scheme, "x")])
