"""benchmarks/scaling.py (the scaling simulator) against hand-computed cases. No MPI, fast."""

import importlib.util
import json
import sys
from pathlib import Path

import dataclasses

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "scaling.py"
spec = importlib.util.spec_from_file_location("scaling_model", SCRIPT)
sim = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sim
spec.loader.exec_module(sim)

N = 25.6e6  # ResNet-50


def no_latency(**kw):
    return sim.Costs(alpha_s=0.0, **kw)


def test_dense_ring_allreduce_p2_1gbit():
    # 2 (P-1)/P * 102.4 MB / 125 MB/s
    assert sim.dense_allreduce_s(2, N, 4, 1, no_latency()) == pytest.approx(0.8192)
    # fp16 halves the bytes
    assert sim.dense_allreduce_s(2, N, 2, 1, no_latency()) == pytest.approx(0.4096)
    # latency: 2 (P-1) alpha per fusion message; 102.4 MB is two 64 MiB messages, 51.2 MB one
    c = sim.Costs(alpha_s=1e-3)
    assert sim.dense_allreduce_s(2, N, 4, 1, c) == pytest.approx(0.8192 + 2 * 1 * 1e-3 * 2)
    assert sim.dense_allreduce_s(2, N, 2, 1, c) == pytest.approx(0.4096 + 2 * 1 * 1e-3 * 1)
    # P=8 at 10 Gbit: 2*7/8 * 102.4e6 / 1.25e9
    assert sim.dense_allreduce_s(8, N, 4, 10, no_latency()) == pytest.approx(0.14336)
    assert sim.dense_allreduce_s(1, N, 4, 1, c) == 0.0


def test_sparse_allgather_bytes_and_time():
    # P=4, 1%: k = 256,000 pairs of 8 bytes from each of the 3 other ranks
    assert sim.sparse_bytes_in(4, N, 0.01, no_latency()) == 3 * 256_000 * 8 == 6_144_000
    zero_local = no_latency(selection_s_per_elem=0.0, pass_s_per_elem=0.0, scatter_s_per_elem=0.0)
    wire, local = sim.sparse_times(4, N, 0.01, 1, zero_local)
    assert wire == pytest.approx(6.144e6 / 125e6)  # 49.152 ms
    assert local == 0.0
    # local: selection n*c_sel + EF pass n*c_pass + decompression P*k*c_scatter + n*c_pass
    c = no_latency(selection_s_per_elem=1e-9, pass_s_per_elem=0.2e-9, scatter_s_per_elem=2e-9, ef_passes=1)
    _, local = sim.sparse_times(4, N, 0.01, 1, c)
    assert local == pytest.approx(N * 1e-9 + N * 0.2e-9 + 4 * 256_000 * 2e-9 + N * 0.2e-9)


def test_break_even_switches_hvd_topk_to_dense():
    c = no_latency()
    # hvd_topk's rule for fp32 + int32: sparse while density < 1/P
    assert sim.goes_sparse(64, 0.01, c)       # 1% < 1/64
    assert not sim.goes_sparse(128, 0.01, c)  # 1% >= 1/128
    assert not sim.goes_sparse(1, 0.01, c)    # nothing to exchange: dense (a no-op)
    dense = sim.step("dense fp32", 128, N, 0.1, 1, c)
    topk = sim.step("allgather 1%", 128, N, 0.1, 1, c)
    assert topk["mode"] == "dense fp32" and topk["step_s"] == dense["step_s"]
    assert sim.step("allgather 0.1%", 128, N, 0.1, 1, c)["mode"] == "allgather"
    # the sparse allreduce stays sparse at any P at 1%: its bytes do not grow with P
    assert sim.step("sparse_allreduce 1%", 256, N, 0.1, 1, c)["mode"] == "sparse_allreduce"
    # same numbers as the module the optimizer uses
    from hvd_topk.exchange import sparse_break_even
    assert sparse_break_even(8) == 0.125
    assert sim.goes_sparse(8, 0.124, c)
    assert not sim.goes_sparse(8, 0.125, c)


def test_step_time_and_efficiency():
    c = no_latency()
    r = sim.step("dense fp32", 2, N, 0.1, 1, c)
    assert r["step_s"] == pytest.approx(0.1 + 0.8192)
    assert r["efficiency"] == pytest.approx(0.1 / 0.9192)
    one = sim.step("allgather 1%", 1, N, 0.1, 1, c)
    assert one["step_s"] == 0.1 and one["efficiency"] == 1.0
    # overlap: wire hides behind up to overlap * compute; local work never does
    c_ov = no_latency(overlap=1.0)
    assert sim.step("dense fp32", 2, N, 0.1, 1, c_ov)["step_s"] == pytest.approx(0.8192)
    assert sim.step("dense fp32", 2, N, 0.1, 1000, c_ov)["step_s"] == pytest.approx(0.1)


def test_calibration_from_selection_json(tmp_path):
    missing = sim.calibrate(tmp_path / "selection.json")
    assert missing[0] == pytest.approx(1e-9) and missing[1] == pytest.approx(0.2e-9)
    rows = [
        {"n": 25_000_000, "density": 0.01, "threads": 1, "method": "sampled", "median_s": 0.02},
        {"n": 10_000_000, "density": 0.01, "threads": 1, "method": "sampled", "median_s": 0.1},
        {"n": 25_000_000, "density": 0.001, "threads": 1, "method": "sampled", "median_s": 0.05},
        {"n": 25_000_000, "density": 0.01, "threads": 2, "method": "sampled", "median_s": 0.01},
        {"n": 25_000_000, "density": 0.01, "threads": 1, "method": "torch.topk", "median_s": 0.5},
        {"n": 25_000_000, "density": 0.01, "threads": 1, "method": "stream", "median_s": 0.005},
    ]
    path = tmp_path / "selection.json"
    path.write_text(json.dumps(rows))
    sel, pas, note = sim.calibrate(path)
    assert sel == pytest.approx(0.8e-9)   # 0.02 s / 25M, largest n, density 1%, one thread
    assert pas == pytest.approx(0.2e-9)   # 0.005 s / 25M
    assert "selection.json" in note
    path.write_text(json.dumps({"rows": rows}))
    assert sim.calibrate(path, threads=2)[0] == pytest.approx(0.4e-9)


def test_simulate_covers_the_grid():
    rows = sim.simulate({"m": (N, 0.1)}, [1, 10], [1, 2, 4], sim.Costs())
    assert len(rows) == 6
    assert all(set(sim.METHODS) <= set(r) for r in rows)


def test_sparse_allreduce_bytes_and_time_by_hand():
    # P=8, 1%: k = 256,000: 7/8 of the int32 indices (896,000 B) + 2*7/8 * (k+1) fp32 values
    want = 7 / 8 * 256_000 * 4 + 2 * 7 / 8 * 256_001 * 4
    from hvd_topk.exchange import SparseAllreduce
    assert sim.sparse_bytes_in(8, N, 0.01, no_latency(), SparseAllreduce) == pytest.approx(want)
    zero_local = no_latency(selection_s_per_elem=0.0, pass_s_per_elem=0.0, scatter_s_per_elem=0.0)
    wire, local = sim.sparse_times(8, N, 0.01, 10, zero_local, SparseAllreduce)
    assert wire == pytest.approx(want / 1.25e9) and local == 0.0
    # latency: 7 allgather hops + 2 * 7 allreduce hops, per bucket (two 64 MiB buckets)
    wire_lat, _ = sim.sparse_times(8, N, 0.01, 10, sim.Costs(alpha_s=1e-3, selection_s_per_elem=0.0,
                                                              pass_s_per_elem=0.0), SparseAllreduce)
    assert wire_lat - wire == pytest.approx((7 + 14) * 1e-3 * 2)
    # decompression scatters one row of k (not P rows)
    c = no_latency(selection_s_per_elem=0.0, pass_s_per_elem=0.0, scatter_s_per_elem=1e-9)
    assert sim.sparse_times(8, N, 0.01, 10, c, SparseAllreduce)[1] == pytest.approx(256_000 * 1e-9)
    assert sim.sparse_times(8, N, 0.01, 10, c)[1] == pytest.approx(8 * 256_000 * 1e-9)


def test_auto_is_the_fastest_prediction_of_what_its_trial_tries():
    """auto = the fastest of dense fp32 and the two sparse exchanges; dense fp16 counts only with
    16-bit values (the library tries it only then, hvd_topk.auto.families): at P=2, 100 Gbit
    dense fp16 is the fastest of the four, and auto must not pick it for fp32 values."""
    c = no_latency()
    for P, gbps in [(2, 100), (64, 10), (8, 1)]:
        options = {m: sim.step(m, P, N, 0.1, gbps, c)["step_s"] for m in
                   ("dense fp32", "dense fp16", "allgather 1%", "sparse_allreduce 1%")}
        auto = sim.step("auto 1%", P, N, 0.1, gbps, c)
        assert auto["step_s"] == min(v for m, v in options.items() if m != "dense fp16")
        auto16 = sim.step("auto 1%", P, N, 0.1, gbps, dataclasses.replace(c, value_bytes=2))
        options16 = [sim.step(m, P, N, 0.1, gbps, dataclasses.replace(c, value_bytes=2))["step_s"] for m in options]
        assert auto16["step_s"] == min(options16)
    fp16_first = {m: sim.step(m, 2, N, 0.1, 100, c)["step_s"] for m in ("dense fp32", "dense fp16", "allgather 1%",
                                                                          "sparse_allreduce 1%")}
    assert min(fp16_first, key=fp16_first.get) == "dense fp16"  # the case the rule is about
    assert sim.step("auto 1%", 2, N, 0.1, 100, c)["mode"] != "dense fp16"


def test_local_work_calibrated_from_a_measurement(tmp_path):
    """(method - backward-only - modelled wire) / n at P=2, the largest over the link rates;
    the prediction never goes below the selection model's local work."""
    fast = [{"method": "none", "median_ms": 50.0}, {"method": "topk-ef@0.01", "median_ms": 110.0},
            {"method": "topk-sar@0.01", "median_ms": 120.0}]
    slow = [{"method": "none", "median_ms": 50.0}, {"method": "topk-ef@0.01", "median_ms": 80.0}]
    path = tmp_path / "exchange.json"
    path.write_text(json.dumps({"runs": [{"P": 2, "rate": "10gbit", "rows": fast},
                                         {"P": 2, "rate": "1gbit", "rows": slow},
                                         {"P": 4, "rate": "1gbit", "rows": fast}]}))
    c = no_latency(selection_s_per_elem=0.0, pass_s_per_elem=0.0, scatter_s_per_elem=0.0)
    n = 25_557_032
    local, note = sim.calibrate_local(path, n, c)
    from hvd_topk.exchange import AllgatherPairs, SparseAllreduce
    k = round(0.01 * n)
    ag = AllgatherPairs.wire_bytes(2, n, k, 4, 4, 4)
    sar_wire = SparseAllreduce.wire_bytes(2, n, k, 4, 4, 4) / 1.25e9
    # allgather: 60 ms - wire at 10 Gbit, or 30 ms - wire at 1 Gbit: the larger
    assert local["allgather"] == pytest.approx(max(0.060 - ag / 1.25e9, 0.030 - ag / 0.125e9) / n)
    assert local["sparse_allreduce"] == pytest.approx((0.070 - sar_wire) / n)
    assert "10gbit" in note
    assert sim.calibrate_local(tmp_path / "missing.json", n, c)[0] == {}
    # used in predictions, but never below the model's own local work
    measured = sim.Costs(alpha_s=0.0, local_s_per_elem=local)
    _, got = sim.sparse_times(8, N, 0.01, 10, measured, SparseAllreduce)
    _, modelled = sim.sparse_times(8, N, 0.01, 10, sim.Costs(alpha_s=0.0), SparseAllreduce)
    assert got == pytest.approx(max(modelled, N * local["sparse_allreduce"]))


def test_hierarchical_by_hand():
    """2 hosts x 4 ranks, 1%, no latency, host link 10 Gbit, inside the host 1000 Gbit."""
    from hvd_topk.exchange import AllgatherPairs
    c = no_latency(selection_s_per_elem=0.0, pass_s_per_elem=0.0, scatter_s_per_elem=0.0,
                   ranks_per_host=4, host_gbps=1000.0)
    k = 256_000
    wire, local = sim.hierarchical_times(8, N, 0.01, 10, c, AllgatherPairs)
    reduce_scatter = 3 / 4 * N * 4 / 125e9
    cross = 4 * (2 - 1) * k * 8 / 1.25e9   # 4 shards' allgathers (k pairs each: 4 x 1%) through one host link
    gather = 3 * 2 * k * 8 / 125e9          # 2 hosts' pairs per shard, to 3 other local ranks
    assert wire == pytest.approx(reduce_scatter + cross + gather)
    assert local == 0.0
    # flat, the same 8 ranks: the ring's host-crossing edge carries (P-1) k 8 at 10 Gbit
    flat_wire, _ = sim.sparse_times(8, N, 0.01, 10, c, AllgatherPairs)
    assert flat_wire == pytest.approx(7 * k * 8 / 1.25e9)
    # inside one host everything runs at the host's speed
    assert sim.dense_allreduce_s(4, N, 4, 10, c) == pytest.approx(2 * 3 / 4 * N * 4 / 125e9)
