"""Selection kernels and the native scatter against numpy: recall, counts, fused error feedback."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hvd_topk import codec, native, selection, wire

needs_native = pytest.mark.skipif(native.library() is None, reason="native kernel did not build")


def sample(dist, n, seed=0):
    rng = np.random.default_rng(seed)
    data = {"normal": rng.standard_normal, "laplace": rng.laplace,
            "t3": lambda size: rng.standard_t(3, size)}[dist](size=n)
    return torch.from_numpy(data.astype(np.float32))


def true_topk(x, k):
    a = np.abs(x.numpy())
    return np.argpartition(a, a.size - k)[a.size - k:]


@pytest.mark.parametrize("dist", ["normal", "laplace", "t3"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("kernel", ["sampled", "exact", "sampled-torch"])
def test_recall_and_count_at_1m(dist, density, kernel):
    n = 1_000_000
    x = sample(dist, n, seed=int(density * 1e4))
    k = selection.k_for(n, density)
    if kernel == "sampled-torch":  # the CUDA path's ops, run here on CPU
        values, indices = selection.select_sampled_torch(x, k)
    else:
        if selection.native.library() is None:
            pytest.skip("native kernel did not build")
        values, indices = selection.select(x, k, kernel)
    got = indices.numpy()
    truth = true_topk(x, k)
    assert 0.9 * k <= np.unique(got).size <= 1.1 * k
    recall = np.isin(truth, got).mean()
    assert recall >= 0.95, recall
    if kernel == "exact":
        assert set(got.tolist()) == set(truth.tolist())
    np.testing.assert_array_equal(values.numpy(), x.numpy()[got])


@needs_native
def test_native_indices_ascending_with_offset_and_int32():
    x = sample("normal", 300_000, seed=3)
    k = 3000
    idx = torch.empty(k, dtype=torch.int32)
    val = torch.empty(k)
    selection.select_native(x, k, idx, val, "exact", offset=1000)
    got = idx.numpy().astype(np.int64) - 1000
    assert np.all(np.diff(got) > 0)
    assert set(got.tolist()) == set(true_topk(x, k).tolist())
    np.testing.assert_array_equal(val.numpy(), x.numpy()[got])


@needs_native
@pytest.mark.parametrize("n", [5000, 40_000, 400_000])
def test_zero_sent_matches_numpy(n):
    """Select the top-k of an accumulator, then zero what was sent: checked by hand."""
    acc = sample("laplace", n, seed=1) + sample("normal", n, seed=2)
    before = acc.numpy().copy()
    k = selection.k_for(n, 0.01)
    idx = torch.empty(k, dtype=torch.int64)
    val = torch.empty(k)
    result = selection.select_native(acc, k, idx, val, "exact", zero_sent=True)
    truth = np.sort(true_topk(torch.from_numpy(before), k))
    np.testing.assert_array_equal(idx.numpy(), truth)
    np.testing.assert_array_equal(val.numpy(), before[truth])
    want = before.copy()
    want[truth] = 0
    np.testing.assert_array_equal(acc.numpy(), want)
    assert not result.nonfinite and result.passes == 1


@needs_native
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [3000, 100_000, 400_000, 2_000_000])
def test_fold_then_select_matches_numpy(n, dtype):
    """``fold=g``: acc += g in the selection's own pass (sizes below, in and beyond the range
    where the kernel folds first): the numpy sum, its top-k, and the residual after zeroing."""
    rng = np.random.default_rng(n)
    acc_np = rng.laplace(size=n).astype(dtype)
    g_np = rng.standard_normal(n).astype(dtype)
    total = acc_np + g_np  # one IEEE add per entry, as the kernel does
    k = selection.k_for(n, 0.01)
    acc, g = torch.from_numpy(acc_np.copy()), torch.from_numpy(g_np)
    idx = torch.empty(k, dtype=torch.int32)
    val = torch.empty(k, dtype=acc.dtype)
    result = selection.select_native(acc, k, idx, val, "exact", zero_sent=True, fold=g, offset=7)
    a = np.abs(total)
    truth = np.sort(np.argpartition(a, n - k)[n - k:])
    np.testing.assert_array_equal(idx.numpy().astype(np.int64) - 7, truth)
    np.testing.assert_array_equal(val.numpy(), total[truth])
    want = total.copy()
    want[truth] = 0
    np.testing.assert_array_equal(acc.numpy(), want)
    assert not result.nonfinite


@needs_native
def test_fold_with_clustered_values_and_nonfinite():
    """Large values clustered in one block and a NaN arriving with the gradient: still the
    exact top-k of the sum, NaN sent and reported."""
    n, k = 1_000_000, 3000
    acc_np = np.full(n, 1e-3, dtype=np.float32)
    g_np = np.zeros(n, dtype=np.float32)
    g_np[-4000:] = np.linspace(1.0, 2.0, 4000, dtype=np.float32)
    g_np[10] = np.nan
    total = acc_np + g_np
    acc = torch.from_numpy(acc_np.copy())
    idx = torch.empty(k, dtype=torch.int64)
    val = torch.empty(k)
    result = selection.select_native(acc, k, idx, val, "exact", zero_sent=True, fold=torch.from_numpy(g_np))
    assert result.nonfinite
    key = np.where(np.isnan(total), np.inf, np.abs(total))
    truth = np.sort(np.argpartition(key, n - k)[n - k:])
    np.testing.assert_array_equal(idx.numpy(), truth)
    assert 10 in set(idx.tolist())
    want = total.copy()
    want[truth] = 0
    np.testing.assert_array_equal(acc.numpy(), want)


def test_fold_must_match_the_buffer():
    x = torch.zeros(100)
    with pytest.raises(ValueError, match="fold"):
        selection.select_native(x, 1, torch.empty(1, dtype=torch.int64), torch.empty(1), fold=torch.zeros(99))


@needs_native
@pytest.mark.parametrize("method", ["sampled", "exact"])
def test_nonfinite_is_reported_and_sent(method):
    x = sample("normal", 200_000, seed=4)
    x[123] = float("nan")
    x[456] = float("inf")
    idx = torch.empty(100, dtype=torch.int64)
    val = torch.empty(100)
    result = selection.select_native(x, 100, idx, val, method)
    assert result.nonfinite
    assert {123, 456} <= set(idx.tolist())
    clean = sample("normal", 200_000, seed=4)
    assert not selection.select_native(clean, 100, idx, val, method).nonfinite


def test_torch_sampled_path_sends_nan_and_inf():
    """The CUDA path's ops (run on CPU): NaN counts as the largest magnitude, as in torch.topk
    and the native kernel, so it reaches the average instead of vanishing."""
    x = sample("normal", 200_000, seed=4)
    x[123] = float("nan")
    x[456] = float("inf")
    values, indices = selection.select_sampled_torch(x, 100)
    assert {123, 456} <= set(indices.tolist())
    assert torch.isnan(values).any() and torch.isinf(values).any()


@needs_native
@pytest.mark.parametrize("method", ["sampled", "exact"])
def test_mostly_zeros_gives_k_distinct_entries(method):
    """Fewer non-zeros than k (an embedding's gradient): all of them, then zeros, no repeats."""
    n, k = 500_000, 5000
    x = torch.zeros(n)
    where = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:1000]
    x[where] = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    idx = torch.empty(k, dtype=torch.int64)
    val = torch.empty(k)
    selection.select_native(x, k, idx, val, method)
    assert np.unique(idx.numpy()).size == k
    assert set(where.tolist()) <= set(idx.tolist())


@needs_native
def test_cluster_of_large_values_at_the_end():
    """All the large values in one block (the sample sees few of them): sampled still returns
    k distinct entries with their real values; exact returns exactly that block's top."""
    n, k = 1_000_000, 2000
    x = torch.full((n,), 1e-3)
    x[-5000:] = torch.linspace(1.0, 2.0, 5000)  # large values the sample may barely see
    idx = torch.empty(k, dtype=torch.int64)
    val = torch.empty(k)
    selection.select_native(x, k, idx, val, "sampled")
    assert np.unique(idx.numpy()).size == k
    np.testing.assert_array_equal(val.numpy(), x.numpy()[idx.numpy()])
    selection.select_native(x, k, idx, val, "exact")
    assert set(idx.tolist()) == set(range(n - k, n))


@needs_native
def test_sampled_on_a_structured_gradient():
    """A layer whose large gradients sit in a few rows (dead units elsewhere), as in a real
    network: the sample must not keep missing them. 20 calls, each >= 95% recall, k distinct."""
    rows, cols, k = 1024, 128, 131
    gen = torch.Generator().manual_seed(9)
    for call in range(20):
        x = torch.randn(rows, cols, generator=gen) * 1e-4
        hot = torch.randperm(rows, generator=gen)[:2]
        x[hot] = torch.randn(2, cols, generator=gen)
        x = x.view(-1)
        idx = torch.empty(k, dtype=torch.int64)
        val = torch.empty(k)
        selection.select_native(x, k, idx, val, "sampled")
        assert np.unique(idx.numpy()).size == k
        assert np.isin(true_topk(x, k), idx.numpy()).mean() >= 0.95, call


def _ranked_pairs(world, k, n, dtype, seed=5):
    """Each rank's k distinct indices (ascending, as the kernel sends them) and values."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(n, generator=gen)[:k].sort().values for _ in range(world)]).int()
    return torch.randn(world, k, generator=gen).to(dtype), indices


_DECODE_PATHS = [pytest.param("native", d, marks=needs_native, id=f"native-{d}".replace("torch.", ""))
                 for d in (torch.float32, torch.float64)]  # the native kernel takes fp32/fp64 only
_DECODE_PATHS += [pytest.param("torch", d, id=f"torch-{d}".replace("torch.", ""))
                  for d in (torch.float32, torch.float64, torch.float16)]


@pytest.mark.parametrize("world", [1, 3, 11])
@pytest.mark.parametrize("path,dtype", _DECODE_PATHS)
@pytest.mark.parametrize("div,mul", [(1.0, 1.0), (3.0, 1.0), (3.0, 3.0)])
def test_decode_adds_ranks_in_order_into_each_tensor(path, dtype, div, mul, world):
    """Rank-ordered adds of overlapping index sets into three tensors of one bucket (sizes
    around the native kernel's 4096-entry chunk), scaled by mul / div: against numpy."""
    k, sizes = 3000, [150, 7, 9000]
    n = sum(sizes)
    values, indices = _ranked_pairs(world, k, n, dtype)
    layout = wire.Layout(k, dtype, torch.int32)
    gathered = torch.cat([layout.pack(values[r], indices[r]) for r in range(world)])
    dests = [torch.full((s,), float("nan"), dtype=dtype) for s in sizes]  # decode overwrites all
    bounds = torch.tensor([0, 150, 157, 9157])
    scale = mul if path == "native" else torch.tensor(mul, dtype=dtype)  # a tensor forces torch ops
    codec.Codec.decode(gathered, layout, world, dests, bounds, div=div, mul=scale)
    want = np.zeros(n, dtype=np.float64)
    for r in range(world):
        np.add.at(want, indices[r].numpy(), values[r].double().numpy())
    want *= mul / div
    tol = 1e-2 if dtype == torch.float16 else 1e-6
    np.testing.assert_allclose(torch.cat(dests).double().numpy(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_of_16_bit_values_that_nearly_cancel_keeps_their_sum(dtype):
    """Three ranks' values whose sum is small beside each of them, averaged (div=3): every
    partial sum is exact in 16 bits, so one rounding (of the average) is all a decode may add.
    Scaling each value before the sum rounds every term: 10 / 3 and -9.875 / 3 in bf16 leave
    0.0312 where the average is 0.0417."""
    values = torch.tensor([[10.0, -31.75], [-9.875, 10.5], [0.0, 10.0]], dtype=dtype)
    indices = torch.tensor([[2, 5]] * 3, dtype=torch.int32)
    layout = wire.Layout(2, dtype, torch.int32)
    gathered = torch.cat([layout.pack(values[r], indices[r]) for r in range(3)])
    dest = torch.full((8,), float("nan"), dtype=dtype)
    codec.Codec.decode(gathered, layout, 3, [dest], torch.tensor([0, 8]), div=3.0)
    want = np.zeros(8)
    want[2], want[5] = 0.125 / 3, -11.25 / 3
    np.testing.assert_allclose(dest.double().numpy(), want, rtol=2 ** -8, atol=0)


@needs_native
@pytest.mark.parametrize("bad", [[3, 10_000], [7, 3], [-1, 3], [5000, 10]])  # [5000, 10]: across chunks
def test_decode_refuses_pairs_outside_the_bucket_or_out_of_order(bad):
    layout = wire.Layout(2, torch.float32, torch.int32)
    gathered = layout.pack(torch.ones(2), torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="ranks disagree"):
        codec.Codec.decode(gathered, layout, 1, [torch.zeros(10_000)], torch.tensor([0, 10_000]))


def _segment_truth(x, bounds, ks):
    """Per segment, the set of positions of its k largest |x| (numpy, independent)."""
    a = np.abs(x.numpy().astype(np.float64))
    a[np.isnan(a)] = np.inf
    out = []
    for b, e, k in zip(bounds, bounds[1:], ks):
        part = a[b:e]
        out.append(set((np.argpartition(-part, k - 1)[:k] + b).tolist()))
    return out


SEGMENT_SIZES = [5000, 300_000, 70_000, 1_200_000, 100, 1]


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("kernel", ["native-sampled", "native-exact", "torch-sampled", "torch-exact"])
def test_select_segments_takes_k_of_each_segment(kernel, density):
    """One call over a bucket of six tensors (1 to 1.2M entries): each segment gets exactly its
    own k, from its own range; exact = numpy's top-k; sampled >= 95% of it and k distinct."""
    path, method = kernel.split("-")
    if path == "native" and native.library() is None:
        pytest.skip("native kernel did not build")
    x = sample("t3", sum(SEGMENT_SIZES), seed=int(density * 1e4))
    bounds = [0, *np.cumsum(SEGMENT_SIZES).tolist()]
    ks = [selection.k_for(n, density) for n in SEGMENT_SIZES]
    if path == "native":
        idx = torch.empty(sum(ks), dtype=torch.int32)
        val = torch.empty(sum(ks))
        flags = torch.ones(len(ks), dtype=torch.uint8)
        result = selection.select_segments(x, torch.tensor(bounds), torch.tensor(ks), idx, val, method,
                                           nonfinite=flags)
        assert not result.nonfinite and not flags.any()
        idx = idx.long()
    else:
        val, idx, bad = selection.select_segments_torch(x, SEGMENT_SIZES, ks, method)
        assert not bad.any()
    np.testing.assert_array_equal(val.numpy(), x.numpy()[idx.numpy()])
    start = 0
    for s, (truth, k) in enumerate(zip(_segment_truth(x, bounds, ks), ks)):
        got = idx[start:start + k].numpy()
        start += k
        assert ((got >= bounds[s]) & (got < bounds[s + 1])).all(), s
        if method == "exact":
            assert set(got.tolist()) == truth, s
        else:
            assert len(set(got.tolist())) == k, s
            assert len(truth & set(got.tolist())) >= 0.95 * k, s


@pytest.mark.parametrize("path", ["native", "torch"])
def test_encode_zeroes_what_it_sent_and_flags_the_segment_with_nan(path):
    """Error feedback in the codec: the sent entries of the buffer become 0, the rest stay;
    a NaN is sent and flags its own segment only."""
    if path == "native" and native.library() is None:
        pytest.skip("native kernel did not build")
    sizes = [3000, 500_000, 20_000]
    x = sample("laplace", sum(sizes), seed=7)
    x[3000 + 1234] = float("nan")
    if path == "torch":  # a strided view is not native-eligible: the codec must use torch ops
        x = torch.zeros(2 * x.numel())[::2].copy_(x)
        assert not selection.native_ok(x)
    before = x.clone()
    plan = codec.Codec("exact").plan(sizes, 0.01, "tensor", x.dtype, torch.int32)
    message = torch.empty(plan.layout.nbytes, dtype=torch.uint8)
    encoded = codec.Codec("exact").encode(x, plan, message, zero_sent=True)
    values, indices = plan.layout.unpack(message, 1)
    sent = indices[0].long().numpy()
    bad = encoded.nonfinite if isinstance(encoded.nonfinite, list) else encoded.nonfinite.nonzero().view(-1).tolist()
    assert bad == [1]
    assert 3000 + 1234 in sent.tolist()
    want = before.numpy().copy()
    want[sent] = 0
    clean = np.r_[0:3000, 503_000:523_000]  # a flagged segment is wiped by the engine instead
    np.testing.assert_array_equal(x.numpy()[clean], want[clean])
    np.testing.assert_array_equal(values[0].numpy(), before.numpy()[sent])


@needs_native
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16])
def test_segment_encoder_folds_and_selects_each_segment_into_its_slots(value_dtype):
    """The optimizer's per-gradient path: segment by segment, in any order, residual + gradient
    is folded into the buffer, each segment's exact top-k of the sum lands in its own slots
    of the message, and the buffer keeps the sum minus what was sent (numpy reference)."""
    sizes = [20_000, 300_000, 5_000]  # in cache, folded first; out of cache, fused; all candidates
    bounds = np.r_[0, np.cumsum(sizes)]
    residual = sample("normal", sum(sizes), seed=3)
    grads = [sample("laplace", n, seed=10 + i).view(n // 100, 100) for i, n in enumerate(sizes)]
    x = residual.clone()
    cod = codec.Codec("exact", fp16_values=value_dtype == torch.float16)
    plan = cod.plan(sizes, 0.01, "tensor", x.dtype, torch.int32)
    message = torch.empty(plan.layout.nbytes, dtype=torch.uint8)
    encoder = cod.segment_encoder(x, plan, message, zero_sent=True)
    assert cod.segment_encoder(x, plan, message, zero_sent=True) is encoder  # prepared once
    for s in (2, 0, 1):
        assert encoder(s, grads[s]) == (False, 0, 0)
    cod.finish_segments(plan, message, x.dtype)
    values, indices = plan.layout.unpack(message, 1)
    total = residual.numpy() + torch.cat([g.reshape(-1) for g in grads]).numpy()
    truth = _segment_truth(torch.from_numpy(total), list(bounds), plan.ks)
    for s in range(3):
        got = indices[0, plan.slots[s]:plan.slots[s + 1]].long().numpy()
        assert set(got.tolist()) == truth[s], s
        assert np.all(np.diff(got) > 0) and bounds[s] <= got.min() and got.max() < bounds[s + 1]
    sent = indices[0].long().numpy()
    np.testing.assert_allclose(values[0].float().numpy(), total[sent], rtol=1e-3 if value_dtype == torch.float16 else 0)
    want = total.copy()
    want[sent] = 0
    np.testing.assert_array_equal(x.numpy(), want)
    with pytest.raises(ValueError, match="segment 1: expected a contiguous CPU torch.float32 gradient of 300000"):
        encoder(1, torch.zeros(10))
    with pytest.raises(ValueError, match="got torch.float64"):  # the kernel would read 8-byte values as 4
        encoder(0, torch.zeros(sizes[0], dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        encoder(0, torch.zeros(2 * sizes[0])[::2])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segment_folder_adds_each_segment_and_flags_nonfinite(dtype):
    """A non-selecting rank's fold, one prepared segment at a time: x[segment] += g (numpy),
    the flag set only for the segment whose sum is inf/nan, bad gradients refused."""
    sizes = [5, 300_001, 17]
    bounds = [0, 5, 300_006, 300_023]
    x = sample("normal", sum(sizes), seed=8).to(dtype)
    grads = [sample("laplace", n, seed=9 + i).to(dtype) for i, n in enumerate(sizes)]
    grads[2][3] = float("inf")
    want = x.numpy().copy() + np.concatenate([g.numpy() for g in grads])
    folder = codec.Codec.segment_folder(x, bounds)
    assert [folder(s, g) for s, g in enumerate(grads)] == [False, False, True]
    np.testing.assert_array_equal(x.numpy(), want)
    with pytest.raises(ValueError, match="segment 1: expected a contiguous CPU"):
        folder(1, torch.zeros(10, dtype=dtype))
    with pytest.raises(ValueError, match="contiguous"):
        folder(0, torch.zeros(10, dtype=dtype)[::2])
    other = torch.float64 if dtype == torch.float32 else torch.float32
    with pytest.raises(ValueError, match=f"got {other}"):  # the kernel would misread its bytes
        folder(0, torch.zeros(5, dtype=other))


@pytest.mark.parametrize("path", [pytest.param("native", marks=needs_native), "torch"])
@pytest.mark.parametrize("dtype,index_dtype", [(torch.float32, torch.int32), (torch.float64, torch.int64)])
@pytest.mark.parametrize("zero", [True, False])
def test_take_gathers_and_zeroes_the_positions(path, dtype, index_dtype, zero):
    """What a non-selecting rank sends in the sparse allreduce: its residual at the leader's
    positions, then (error feedback) those positions zeroed; numpy reference."""
    x = sample("normal", 1_000_003, seed=4).to(dtype)
    if path == "torch":  # strided: not native-eligible
        x = torch.zeros(2 * x.numel(), dtype=dtype)[::2].copy_(x)
    before = x.numpy().copy()
    where = np.sort(np.random.default_rng(5).choice(x.numel(), 5000, replace=False))
    out = torch.empty(5000, dtype=dtype)
    codec.Codec.take(x, torch.from_numpy(where).to(index_dtype), out, zero=zero)
    np.testing.assert_array_equal(out.numpy(), before[where])
    want = before.copy()
    if zero:
        want[where] = 0
    np.testing.assert_array_equal(x.numpy(), want)


@needs_native
def test_take_refuses_positions_outside_the_buffer():
    x = torch.ones(100)
    with pytest.raises(IndexError, match="1 of 3 positions lie outside the 100 entries"):
        selection.take_native(x, torch.tensor([3, 50, 100], dtype=torch.int32), torch.empty(3), zero=True)


def test_bucket_scope_gives_one_k_for_the_whole_buffer():
    """selection_scope="bucket": k = density x the bucket's size, spent where |x| is largest
    (here all in the loud second tensor)."""
    sizes = [10_000, 10_000]
    x = torch.cat([sample("normal", 10_000, seed=1) * 1e-3, sample("normal", 10_000, seed=2)])
    plan = codec.Codec("exact").plan(sizes, 0.01, "bucket", torch.float32, torch.int32)
    assert plan.count == 200 and plan.sizes == [20_000]
    message = torch.empty(plan.layout.nbytes, dtype=torch.uint8)
    codec.Codec("exact").encode(x, plan, message)
    _, indices = plan.layout.unpack(message, 1)
    assert (indices >= 10_000).all()
    assert set(indices[0].tolist()) == _segment_truth(x, [0, 20_000], [200])[0]


def test_without_native_kernel_falls_back_with_a_warning(tmp_path):
    """No working compiler and no built library: one clear warning, then torch ops."""
    code = ("import warnings, torch\nwarnings.simplefilter('error')\n"
            "from hvd_topk import selection\n"
            "x = torch.randn(200_000)\n"
            "try:\n    selection.select(x, 100)\nexcept UserWarning as w:\n    print('WARNED', w)\n"
            "warnings.simplefilter('ignore')\n"
            "v, i = selection.select(x, 100, 'exact')\n"
            "print('SAME', set(i.tolist()) == set(torch.topk(x.abs(), 100).indices.tolist()))\n")
    env = {**os.environ, "CXX": "/bin/false", "HVD_TOPK_NATIVE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "WARNED" in out.stdout and "python -m hvd_topk.native" in out.stdout
    assert "SAME True" in out.stdout
