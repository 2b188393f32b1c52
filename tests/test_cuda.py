"""The torch-ops paths a GPU runs (selection, the codec's encode and decode, the DDP hook and the
Horovod optimizer), on every device this machine has: ``cpu`` always, ``cuda`` where a GPU is
present (skipped elsewhere; on the CPU these same tests check the test logic and, with the
native kernel off, the torch paths the CUDA code shares). The truth is numpy: each segment's k largest magnitudes, the error-feedback contract.

On a GPU machine: ``python -m pytest tests/test_cuda.py`` (benchmarks/gpu_check.sh runs it)."""

import numpy as np
import pytest
import torch

from hvd_topk import codec, selection
from mpi import DIST, launch_gloo_hosts, launch_mpi
from samples import sample

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _native_kernel_off(monkeypatch):
    """The torch-ops paths on the CPU too: with the native kernel loaded, fp32 on the CPU would
    take it (tests/test_selection.py and test_codec.py check it) and these cases would test it
    twice, the torch paths never."""
    from hvd_topk import native
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_error", "off in tests/test_cuda.py: the torch-ops paths")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here"))]
SIZES = [3000, 7, 9000, 40_000, 150_000]  # a bucket: a small tensor beside large ones
DENSITY = 0.01


def bucket(dtype, device, seed=0):
    x = torch.cat([sample(d, n, seed=seed + i) for i, (d, n) in
                   enumerate(zip(["normal", "laplace", "t3", "normal", "laplace"], SIZES))])
    return x.to(dtype).to(device)


def check_topk_property(x, values, indices, ks, exact):
    """Per segment: k distinct positions inside it, values equal to x there, and (``exact``)
    no entry left behind larger in magnitude than one sent (the definition of top-k, which
    holds with ties); otherwise (sampled) at least 95% of the true top-k sent."""
    a = np.abs(x.double().cpu().numpy())
    got_i = indices.cpu().numpy().astype(np.int64)
    np.testing.assert_array_equal(values.double().cpu().numpy(), x.double().cpu().numpy()[got_i])
    start = slot = 0
    for n, k in zip(SIZES, ks):
        mine = got_i[slot:slot + k]
        assert np.all((mine >= start) & (mine < start + n)), "a pair outside its segment"
        assert np.unique(mine).size == k, f"segment of {n}: {np.unique(mine).size} distinct of {k}"
        rest = np.delete(a[start:start + n], mine - start)
        if exact:
            assert a[mine].min() >= (rest.max() if rest.size else 0), f"segment of {n}: a larger entry left"
        else:
            truth = np.argpartition(-a[start:start + n], k - 1)[:k] + start
            assert np.isin(truth, mine).mean() >= 0.95, f"segment of {n}: recall below 95%"
        start, slot = start + n, slot + k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("method", ["exact", "sampled"])
def test_segment_selection_against_numpy(device, dtype, method):
    x = bucket(dtype, device)
    ks = [selection.k_for(n, DENSITY) for n in SIZES]
    values, indices, bad = selection.select_segments_torch(x, SIZES, ks, method)
    assert values.device == x.device and indices.device == x.device
    assert not bool(bad.any())
    # 16-bit values tie, so "recall against numpy's set" is ill-defined there; the sampled path
    # ranks every candidate above its threshold, which holds the whole top-k unless a segment
    # ran short of candidates (rare, and then recall would be the measure)
    check_topk_property(x, values, indices, ks, exact=method == "exact" or dtype != torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_select_one_tensor_sampled_against_numpy(device):
    """One large tensor through ``select`` (the sampled path: one sample, a threshold, a fixed
    number of candidates): recall against numpy, values where they came from."""
    x = sample("t3", 1_000_000, seed=7).to(device)
    k = selection.k_for(x.numel(), DENSITY)
    values, indices = selection.select(x, k, "sampled")
    truth = np.argpartition(-np.abs(x.cpu().numpy()), k - 1)[:k]
    got = indices.cpu().numpy()
    assert np.unique(got).size >= 0.99 * k
    assert np.isin(truth, got).mean() >= 0.95
    np.testing.assert_array_equal(values.cpu().numpy(), x.cpu().numpy()[got])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_encode_then_decode_of_three_ranks_is_the_numpy_average(device, dtype):
    """The allgather's codec on the device: three ranks' buffers encoded with error feedback
    (sent entries zeroed, the rest kept), their messages concatenated in rank order and
    decoded with div=3 into the bucket's tensors: numpy's average of each rank's per-segment
    top-k, and each rank's residual numpy's buffer minus what it sent."""
    c = codec.Codec("exact")
    world = 3
    xs = [bucket(dtype, device, seed=10 * r) for r in range(world)]
    originals = [x.double().cpu().numpy() for x in xs]
    plan = c.plan(SIZES, DENSITY, "tensor", dtype, torch.int32)
    messages = []
    for x in xs:
        message = torch.empty(plan.layout.nbytes, dtype=torch.uint8, device=device)
        encoded = c.encode(x, plan, message, zero_sent=True)
        flagged = encoded.nonfinite  # a list (native) or a bool tensor per segment (torch ops)
        assert not (bool(flagged.any()) if torch.is_tensor(flagged) else flagged)
        messages.append(message)
    dests = [torch.full((n,), float("nan"), dtype=dtype, device=device) for n in SIZES]
    codec.Codec.decode(torch.cat(messages), plan.layout, world, dests, plan.bounds, div=float(world))
    want = np.zeros(sum(SIZES))
    for r, original in enumerate(originals):
        residual = xs[r].double().cpu().numpy()
        went = original - residual  # what rank r sent (its residual lost exactly that)
        for b, e, k in zip(plan.starts, plan.starts[1:], plan.ks):
            part = np.abs(original[b:e])
            kth = np.sort(part)[-k]  # the k-th largest magnitude
            sent = went[b:e] != 0
            assert sent.sum() == k, f"rank {r}, segment [{b}, {e}): {sent.sum()} sent, not {k}"
            assert np.all(sent[part > kth]), f"rank {r}, segment [{b}, {e}): a larger entry kept"
            assert np.all(part[sent] >= kth), f"rank {r}, segment [{b}, {e}): a smaller entry sent"
            np.testing.assert_array_equal(went[b:e][sent], original[b:e][sent])  # sent whole, zeroed
            np.testing.assert_array_equal(residual[b:e][~sent], original[b:e][~sent])  # the rest kept
        want += went
    got = torch.cat(dests).double().cpu().numpy()
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    np.testing.assert_allclose(got, want / world, rtol=tol, atol=tol)
    assert np.count_nonzero(want) >= max(plan.ks)  # something was sent


@pytest.mark.distributed
@pytest.mark.parametrize("np_", [2, 3])
def test_ddp_hook_checks_on_the_torch_ops_path(np_, monkeypatch):
    """tests/dist/check_ddp.py with the native kernel off (``HVD_TOPK_NATIVE=0``): the selection,
    encode, take and decode a GPU runs, here on the CPU, against the same numpy checks. (It found
    what the first GPU run found, and more: +inf left unflagged, layout-dependent sums.)"""
    monkeypatch.setenv("HVD_TOPK_NATIVE", "0")
    job = launch_mpi(np_, DIST / "check_ddp.py", launcher="torchrun")
    assert job.returncode == 0 and f"OK on {np_} ranks" in job.stdout, job.tail()


@pytest.mark.distributed
@pytest.mark.parametrize("script", ["check_optimizer.py", "check_sparse_allreduce.py"])
def test_horovod_checks_on_the_torch_ops_path(script, monkeypatch):
    """The Horovod optimizer's contract checks (mpirun -np 3) with the native kernel off: the
    torch-ops selection, encode and decode its GPU path runs, against the same numpy truth."""
    monkeypatch.setenv("HVD_TOPK_NATIVE", "0")
    job = launch_mpi(3, DIST / script)
    assert job.returncode == 0 and "OK on 3 ranks" in job.stdout, job.tail()


@pytest.mark.distributed
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")
@pytest.mark.parametrize("np_", [2, 3])
def test_ddp_hook_checks_on_cuda(np_, monkeypatch):
    """tests/dist/check_ddp.py (every check against numpy: 36 on 2026-12-04) with the model and
    its gradients on the GPU, every rank on the one device, over gloo (NCCL takes one rank per GPU)."""
    monkeypatch.setenv("HVD_TOPK_CHECK_DEVICE", "cuda")
    job = launch_mpi(np_, DIST / "check_ddp.py", launcher="torchrun")
    assert job.returncode == 0 and f"OK on {np_} ranks" in job.stdout, job.tail()


def test_check_device_names_exist():
    """check_device.py picks its checks from three scripts by name: each name must still exist
    there (``--list`` fails otherwise), and every pick is a distinct check."""
    import subprocess
    import sys

    from mpi import script_env
    listed = subprocess.run([sys.executable, str(DIST / "check_device.py"), "--list"], env=script_env(),
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    names = listed.stdout.split("\n")[:-1]
    assert len(names) == len(set(names)) == 35, names
    assert {n.split(":")[0] for n in names} == {"compressor", "optimizer", "amp"}, names


@pytest.mark.distributed
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")
@pytest.mark.parametrize("np_", [2, 3])
def test_horovod_paths_on_cuda(np_):
    """tests/dist/check_device.py: the drop-in TopK, hvd_topk's optimizer (each exchange,
    checkpoints, non-finite gradients, LocalAdamW, DeMo) and GradScaler, every check against
    numpy, with the model and its gradients on the GPU; ``horovodrun --gloo`` on one host, every
    rank on the one device (Horovod without NCCL moves CUDA tensors through the host)."""
    pytest.importorskip("horovod.torch", reason="Horovod is not installed here")
    job = launch_gloo_hosts([np_], DIST / "check_device.py", env={"HVD_TOPK_CHECK_DEVICE": "cuda"})
    assert job.returncode == 0 and f"OK on {np_} ranks" in job.stdout, job.tail()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_encode_flags_the_segments_holding_inf_or_nan(device, dtype):
    """Segments holding +inf, -inf or NaN are flagged (their residuals are
    wiped by the caller), the finite ones are not; the non-finite entries are sent. (The torch
    path once turned +inf into the largest finite value before looking for it, so a segment of
    infinities went unflagged: on the CPU in bf16, and on every GPU.)"""
    c = codec.Codec("sampled")
    x = bucket(dtype, device)
    starts = [0, *np.cumsum(SIZES)]
    where = {"+inf": int(starts[1]) + 5, "-inf": int(starts[2]) + 9, "nan": int(starts[4]) + 100}
    x[where["+inf"]], x[where["-inf"]], x[where["nan"]] = float("inf"), -float("inf"), float("nan")
    plan = c.plan(SIZES, DENSITY, "tensor", dtype, torch.int32)
    message = torch.empty(plan.layout.nbytes, dtype=torch.uint8, device=device)
    flagged = c.encode(x, plan, message, zero_sent=True).nonfinite
    flagged = flagged.nonzero().view(-1).tolist() if torch.is_tensor(flagged) else sorted(flagged)
    assert flagged == [1, 2, 4], flagged
    values, indices = plan.layout.views(message)
    sent = dict(zip(indices.cpu().tolist(), values.double().cpu().tolist()))
    assert sent[where["+inf"]] == float("inf") and sent[where["-inf"]] == -float("inf")
    assert np.isnan(sent[where["nan"]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_sampled_selection_past_a_cluster_of_equal_magnitudes(device, dtype):
    """A cluster of equal magnitudes at the sampled threshold (fp16's few subnormal values, a
    saturated layer) before the true top-k: every larger entry is still sent, in one tensor and
    in a bucket whose first tensor holds the cluster, and a NaN behind it is sent and flagged.
    (The candidates ">= threshold" were kept by position in one room: the cluster filled it, 0 of
    the true top-k were sent and the later tensors sent nothing.) The truth is numpy's sort."""
    gen = torch.Generator().manual_seed(5)
    n, k = 1_000_000, 10_000
    x = torch.rand(n, generator=gen) * 0.1
    x[:600_000], x[-k:] = 0.5, 2.0
    values, indices = selection.select_sampled_torch(x.to(dtype).to(device), k)
    assert np.isin(np.arange(n - k, n), indices.cpu().numpy()).all(), "an entry of 2.0 was left out"
    np.testing.assert_array_equal(values.float().cpu().numpy(), np.full(k, 2.0, np.float32))

    sizes = [400_000, 300_000, 300_000]
    ks = [selection.k_for(m, DENSITY) for m in sizes]
    x = torch.randn(sum(sizes), generator=gen)
    x[:400_000] = torch.rand(400_000, generator=gen) * 0.1
    x[:240_000] = 0.5
    x[500_000] = float("nan")
    x = x.to(dtype).to(device)
    values, indices, bad = selection.select_segments_torch(x, sizes, ks, "sampled")
    assert bad.cpu().tolist() == [False, True, False]
    a = np.abs(x.float().cpu().numpy())
    a[np.isnan(a)] = np.inf
    got, start, slot = indices.cpu().numpy(), 0, 0
    for m, kk in zip(sizes, ks):
        mine = got[slot:slot + kk]
        assert np.unique(mine).size == kk and ((mine >= start) & (mine < start + m)).all()
        want = -np.sort(-a[start:start + m])[:kk]
        np.testing.assert_array_equal(np.sort(a[mine])[::-1], want, err_msg=f"segment at {start}")
        start, slot = start + m, slot + kk
    assert 500_000 in got.tolist()
