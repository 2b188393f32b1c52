"""hvd_topk/compact.py: compact pairs, single process, against numpy (``reference.compact_round_trip``)
and hand-made cases: Elias-Fano indices exactly back (the first and last entry, repeated
indices, wide gaps, every density up to 1), values within the band's rounding and the band's
ends exact, the rounding fed back into the residual, zeros and inf/nan, several ranks in one
gather, the message's size; the same for sign values (``compact="sign"``, ``reference.sign_round_trip``)."""

import numpy as np
import pytest
import torch

from hvd_topk import codec, compact, native, wire
from reference import compact_round_trip, sign_round_trip


@pytest.fixture(autouse=True, params=["native", "torch"])
def path(request, monkeypatch):
    """Every test on both paths: the native pack/unpack (CPU float32) and the torch ops (CUDA,
    float64, no compiler)."""
    if request.param == "native":
        if native.library() is None:
            pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    else:
        monkeypatch.setattr(compact, "_native", lambda *args: None)
    return request.param


def _plan(sizes, ks):
    """A codec plan of ``sizes`` whose segments send ``ks`` pairs (density chosen to give them)."""
    plan = codec.Plan(sizes, 1.0, "tensor", torch.float32, wire.index_dtype_for(sum(sizes)))
    plan.ks = list(ks)
    plan.count = sum(ks)
    plan.layout = wire.Layout(plan.count, torch.float32, plan.layout.index_dtype)
    plan.slots = [0, *np.cumsum(ks).tolist()]
    return plan


def _message(plan, values, indices):
    return plan.layout.pack(torch.as_tensor(values, dtype=torch.float32), torch.as_tensor(indices, dtype=torch.int32))


def _spread(rng, n, k):
    return np.sort(rng.choice(n, size=k, replace=False))


def test_indices_come_back_exactly():
    # a 300000-entry tensor and a small one after it: the first and last entries, a gap of most
    # of the buffer, neighbours, a repeated index (a fill-up slot)
    plan = _plan([300_000, 1000], [8, 3])
    first = [0, 1, 65535, 65536, 65536, 262144 + 7, 299_000, 299_999]
    second = [300_000, 300_500, 300_999]
    values = np.linspace(1, 2, 11, dtype=np.float32)
    wide = compact.CompactPairs(plan).unpack(plan.compact().pack(_message(plan, values, first + second)), 1)
    got_values, got_indices = plan.layout.unpack(wide, 1)
    assert got_indices[0].tolist() == first + second
    # L = floor(log2(301000 / 11)) = 14 low bits; 11 + (301000 >> 14) + 1 = 30 bitmap bits
    assert plan.compact().low_bits == 14
    assert plan.compact().nbytes == -(-(8 * 2 + 4 + -(-11 * 14 // 8) + 11) // 8) * 8


@pytest.mark.parametrize("n, k", [(1, 1), (7, 7), (100, 37), (4096, 3), (1_000_000, 2000), (2**20 + 3, 1)])
def test_indices_at_every_density(n, k):
    rng = np.random.default_rng(n + k)
    plan = _plan([n], [k])
    indices = _spread(rng, n, k)
    packed = plan.compact().pack(_message(plan, np.ones(k, np.float32), indices))
    _, got = plan.layout.unpack(plan.compact().unpack(packed, 1), 1)
    assert got[0].tolist() == indices.tolist()
    # Elias-Fano: at most 2 + log2(n / k) bits an index and the bitmap's end bit, each part
    # rounded up to bytes; 8 bytes of band, a byte of value a pair, up to 7 bytes of padding
    assert packed.numel() <= 8 + (k * (2 + np.log2(n / k)) + 1) / 8 + 2 + k + 7, packed.numel()


def test_values_match_numpy_and_stay_within_the_band_step():
    rng = np.random.default_rng(3)
    sizes, ks = [70_000, 5000, 40_000], [140, 10, 80]
    plan = _plan(sizes, ks)
    starts = np.cumsum([0] + sizes)
    values = (rng.standard_normal(sum(ks)) * np.exp(rng.uniform(-3, 3, sum(ks)))).astype(np.float32)
    values[5] = 0.0  # a fill-up slot: zero arrives as zero
    indices = np.concatenate([a + _spread(rng, n, k) for a, n, k in zip(starts, sizes, ks)])
    packed = plan.compact().pack(_message(plan, values, indices))
    got, _ = plan.layout.unpack(plan.compact().unpack(packed, 1), 1)
    got = got[0].numpy()
    slots = np.cumsum([0] + ks)
    for a, b in zip(slots, slots[1:]):
        v, g = values[a:b], got[a:b]
        np.testing.assert_allclose(g, compact_round_trip(v), rtol=1e-6)
        mag = np.abs(v[v != 0]).astype(np.float64)
        factor = (mag.max() / mag.min()) ** (1 / 252) * (1 + 1e-6)
        nz = v != 0
        assert np.all(np.sign(g) == np.sign(v))
        assert np.all(np.abs(g[nz]) <= np.abs(v[nz]) * factor) and np.all(np.abs(g[nz]) >= np.abs(v[nz]) / factor)
        # the band's ends arrive exactly
        assert np.abs(g).max() == np.abs(v).max() and np.abs(g[nz]).min() == np.abs(v[nz]).min()
    assert got[5] == 0.0


def test_the_rounding_goes_back_into_the_residual():
    rng = np.random.default_rng(4)
    n, k = 100_000, 200
    acc = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    plan = codec.Plan([n], k / n, "tensor", torch.float32, torch.int32)
    assert plan.count == k
    message = torch.empty(plan.layout.nbytes, dtype=torch.uint8)
    before = acc.clone()
    codec.Codec().encode(acc, plan, message, zero_sent=True)
    packed = plan.compact().pack(message, residual=acc)
    got, idx = plan.layout.unpack(plan.compact().unpack(packed, 1), 1)
    idx = idx[0].long()
    # sent + residual is what the buffer held, at the sent positions (float32 sums) and elsewhere
    np.testing.assert_allclose((acc[idx] + got[0]).numpy(), before[idx].numpy(), rtol=1e-6, atol=0)
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[idx] = False
    assert torch.equal(acc[untouched], before[untouched])
    assert bool((acc[idx] != 0).any())  # the rounding is really kept
    np.testing.assert_array_equal(acc[idx].numpy(), before[idx].numpy() - compact_round_trip(before[idx].numpy()))


@pytest.mark.parametrize("values", ["log", "sign"])
def test_several_ranks_in_one_gather(values):
    rng = np.random.default_rng(5)
    plan = _plan([200_000], [50])
    plan.compact_values = values
    round_trip = compact_round_trip if values == "log" else sign_round_trip
    sent = []
    for r in range(3):
        sent_values = rng.standard_normal(50).astype(np.float32) * (r + 1)
        indices = _spread(rng, 200_000, 50)
        sent.append((sent_values, indices, plan.compact().pack(_message(plan, sent_values, indices), out=False)))
    gathered = torch.cat([p for _, _, p in sent])
    got_values, got_indices = plan.layout.unpack(plan.compact().unpack(gathered, 3), 3)
    for r, (sent_values, indices, _) in enumerate(sent):
        assert got_indices[r].tolist() == indices.tolist()  # (no zeros sent: nothing moved)
        np.testing.assert_allclose(got_values[r].numpy(), round_trip(sent_values), rtol=1e-6)


def test_unsorted_pairs_are_sorted_with_their_values():
    plan = _plan([100_000], [4])
    packed = plan.compact().pack(_message(plan, [4.0, -1.0, 2.0, 3.0], [90_000, 7, 65_536, 3]))
    values, indices = plan.layout.unpack(plan.compact().unpack(packed, 1), 1)
    assert indices[0].tolist() == [3, 7, 65_536, 90_000]
    np.testing.assert_allclose(values[0].numpy(), compact_round_trip(np.array([3.0, -1.0, 2.0, 4.0], np.float32)),
                               rtol=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_segment_with_inf_or_nan_arrives_non_finite_and_the_residual_stays_finite(bad):
    plan = _plan([1000, 1000], [3, 2])
    values = [1.0, bad, -2.0, 0.5, 0.25]
    residual = torch.zeros(2000)
    packed = plan.compact().pack(_message(plan, values, [1, 2, 3, 1500, 1600]), residual=residual)
    got, _ = plan.layout.unpack(plan.compact().unpack(packed, 1), 1)
    assert not torch.isfinite(got[0, 1])
    assert torch.equal(got[0, 3:], torch.tensor([0.5, 0.25]))  # the other segment is untouched
    assert bool(torch.isfinite(residual).all())
    # nothing fed back into the bad segment, whose residual the exchange wipes (before the fix
    # -2.0, arriving as the band's low end 1.0, put -1.0 back into it after the wipe)
    assert int(torch.count_nonzero(residual[:1000])) == 0


def test_float64_beyond_float32s_range():
    """The band's ends travel as float32: a float64 magnitude under 2**-149 is sent as zero and
    stays in the residual (before the fix it made the band's low end 0 and every value of the
    segment arrived as 0, for good); one over float32's largest arrives as that, the rest fed
    back (before: inf, or the others as the band's low end)."""
    plan = codec.Plan([10, 10], 1.0, "tensor", torch.float64, torch.int32)
    plan.ks, plan.count, plan.slots = [2, 2], 4, [0, 2, 4]
    plan.layout = wire.Layout(4, torch.float64, torch.int32)
    big = float(torch.finfo(torch.float32).max)
    values = torch.tensor([1.0, 1e-50, 1e39, 2.0], dtype=torch.float64)
    residual = torch.zeros(20, dtype=torch.float64)
    message = plan.layout.pack(values, torch.tensor([3, 5, 12, 17], dtype=torch.int32))
    packed = plan.compact().pack(message, residual=residual)
    got, _ = plan.layout.unpack(plan.compact().unpack(packed, 1), 1)
    assert got[0].tolist()[:2] == [1.0, 0.0]
    assert got[0, 2] == big and got[0, 3] > 0 and bool(torch.isfinite(got).all())
    assert residual[5] == 1e-50 and residual[12] == 1e39 - big
    assert torch.allclose(got[0] + residual[[3, 5, 12, 17]], values, rtol=1e-12)


def test_an_all_zero_segment_and_a_single_value():
    plan = _plan([10, 10], [2, 1])
    packed = plan.compact().pack(_message(plan, [0.0, 0.0, -0.375], [1, 2, 14]))
    values, _ = plan.layout.unpack(plan.compact().unpack(packed, 1), 1)
    assert values[0].tolist() == [0.0, 0.0, -0.375]


def test_a_segment_with_nothing_finite_and_non_zero_packs_the_same_bytes_on_both_paths(monkeypatch):
    """A band's low end with no finite non-zero value in the segment: float32's largest, on the
    native path as on the torch path (native wrote inf; the values decoded alike)."""
    plan = _plan([10, 10], [2, 1])
    message = _message(plan, [0.0, -0.0, 2.5], [1, 2, 14])
    packed = plan.compact().pack(message, out=False)
    monkeypatch.setattr(compact, "_native", lambda *args: None)
    assert torch.equal(packed, plan.compact().pack(message, out=False))
    band = packed[plan.compact()._parts["band"]].view(torch.float32)
    assert band[0].item() == np.finfo(np.float32).max and band[1].item() == 0.0


@pytest.mark.parametrize("last", [1 << 20, 1500])
def test_an_index_outside_the_bitmap_is_refused_not_written(last):
    """Sorted pairs whose last index's bit lies beyond the bitmap (far beyond the tensor, past
    the message's end; or just past the bitmap, in its last byte's padding): refused on both
    paths (the torch path's IndexError). The native pack wrote the first past the end of the
    message and took the second (a review)."""
    plan = _plan([1000], [3])  # 7 bits of bitmap in 1 byte
    assert plan.compact().high_bits == 7
    with pytest.raises(IndexError):
        plan.compact().pack(_message(plan, [1.0, 2.0, 3.0], [0, 1, last]), out=False)


def test_a_gather_of_the_wrong_size_or_counts_is_refused():
    plan = _plan([100_000], [4])
    packed = plan.compact().pack(_message(plan, [1.0, 2.0, 3.0, 4.0], [1, 2, 3, 4]))
    with pytest.raises(ValueError, match="ranks disagree"):
        plan.compact().unpack(torch.cat([packed, packed[:8]]), 2)
    other = _plan([100_000], [5]).compact()
    with pytest.raises((ValueError, RuntimeError), match="ranks disagree"):
        other.unpack(torch.cat([packed, torch.zeros(other.nbytes - packed.numel(), dtype=torch.uint8)]), 1)


def test_codec_refuses_two_wire_formats_and_counts_compact_bytes():
    with pytest.raises(ValueError, match="choose one"):
        codec.Codec(fp16_values=True, compact=True)
    plan = codec.Plan([1_000_000], 0.002, "tensor", torch.float32, torch.int32)
    c = codec.Codec(compact=True)
    assert c.value_dtype(torch.float32) == torch.float32
    # 2000 pairs of 1M entries: 8 bytes of band; L = 8 low bits; a bitmap of
    # 2000 + (1M >> 8) + 1 = 5907 bits; a byte of value each
    assert plan.compact().low_bits == 8
    assert c.message_nbytes(plan) == -(-(8 + -(-5907 // 8) + 2000 + 2000) // 8) * 8
    assert plan.compact().index_itemsize == (5907 + 2000 * 8) / 2000 / 8
    # the cost model counts 16-bit values' pairs: compact does not change which buckets go dense
    assert c.pair_itemsizes(plan) == (2, 4)


def _sign_plan(sizes, ks):
    plan = _plan(sizes, ks)
    plan.compact_values = "sign"
    return plan


def _arrived(plan, packed, world, n):
    """Each rank's decoded pairs summed into a dense vector of n (what Codec.decode adds up)."""
    values, indices = plan.layout.unpack(plan.compact().unpack(packed, world), world)
    return [torch.zeros(n, dtype=torch.float64).index_add_(0, indices[r].long(), values[r].double()).numpy()
            for r in range(world)]


def test_sign_values_match_numpy_with_zeros_anywhere_in_a_segment():
    """Every non-zero value arrives at its index as its sign times its segment's mean non-zero
    magnitude; zeros arrive as zero, whether at their own index (an exact top-k of a tensor with
    fewer non-zeros than k) or repeating another pair's (a sampled fill-up), first, last or
    between, and in a segment with no non-zero value."""
    rng = np.random.default_rng(11)
    sizes, ks = [70_000, 5000, 40_000, 300], [140, 10, 80, 4]
    plan = _sign_plan(sizes, ks)
    starts = np.cumsum([0] + sizes)
    values = (rng.standard_normal(sum(ks)) * np.exp(rng.uniform(-3, 3, sum(ks)))).astype(np.float32)
    indices = np.concatenate([a + _spread(rng, n, k) for a, n, k in zip(starts, sizes, ks)])
    values[[0, 7, 139]] = 0.0           # zeros at their own indices: the first, one inside, the last
    values[140 + 3] = 0.0
    indices[140 + 4] = indices[140 + 3]  # a fill-up: a zero repeating the next pair's index
    values[140 + 4], values[140 + 3] = values[140 + 3], values[140 + 4]
    values[230:234] = [0.0, -0.0, 0.0, 0.0]  # nothing non-zero in the last segment
    want = np.zeros(sum(sizes))
    slots = np.cumsum([0] + ks)
    for a, b in zip(slots, slots[1:]):
        np.add.at(want, indices[a:b], sign_round_trip(values[a:b]))
    packed = plan.compact().pack(_message(plan, values, indices))
    np.testing.assert_array_equal(_arrived(plan, packed, 1, sum(sizes))[0], want)
    assert np.count_nonzero(want) == sum(ks) - 3 - 1 - 4  # every non-zero value arrived, nothing else


def test_sign_message_size():
    """4 bytes of scale a segment, the Elias-Fano bitmap and low bits, a bit of sign a pair."""
    plan = _sign_plan([300_000, 1000], [8, 3])
    c = plan.compact()
    assert c.low_bits == 14 and c.high_bits == 30
    assert c.nbytes == -(-(4 * 2 + 4 + -(-11 * 14 // 8) + 2) // 8) * 8
    plan = codec.Codec(compact="sign").plan([1_000_000], 0.0043, "tensor", torch.float32, torch.int32)
    # 4300 pairs: L = floor(log2(1M / 4300)) = 7, a bitmap of 4300 + (1M >> 7) + 1 bits
    assert plan.compact().nbytes == -(-(4 + -(-(4300 + 7812 + 1) // 8) + -(-4300 * 7 // 8) + -(-4300 // 8)) // 8) * 8


def test_sign_rounding_goes_back_into_the_residual():
    """Selected from a buffer by the codec (both methods; 30 non-zeros and k = 50: zeros sent),
    what arrives plus the residual is what the buffer held, everywhere."""
    rng = np.random.default_rng(12)
    n, k = 4096, 50
    for method in ("exact", "sampled"):
        acc = torch.zeros(n)
        acc[torch.from_numpy(rng.choice(n, 30, replace=False))] = torch.from_numpy(
            rng.standard_normal(30).astype(np.float32))
        c = codec.Codec(method=method, compact="sign")
        plan = c.plan([n], k / n, "tensor", torch.float32, torch.int32)
        message = torch.empty(plan.layout.nbytes, dtype=torch.uint8)
        before = acc.clone()
        c.encode(acc, plan, message, zero_sent=True)
        packed = plan.compact().pack(message, residual=acc)
        arrived = _arrived(plan, packed, 1, n)[0]
        np.testing.assert_allclose(acc.double().numpy() + arrived, before.double().numpy(), rtol=0, atol=1e-6)
        nz = before.numpy() != 0
        np.testing.assert_allclose(arrived[nz], sign_round_trip(before.numpy()[nz]), rtol=1e-6)
        assert np.count_nonzero(arrived[~nz]) == 0



@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_sign_a_segment_with_inf_or_nan_arrives_non_finite(bad):
    plan = _sign_plan([1000, 1000], [3, 2])
    residual = torch.zeros(2000)
    packed = plan.compact().pack(_message(plan, [1.0, bad, -2.0, 0.5, 0.25], [1, 2, 3, 1500, 1600]),
                                 residual=residual)
    got, _ = plan.layout.unpack(plan.compact().unpack(packed, 1), 1)
    assert not bool(torch.isfinite(got[0, :3]).any())
    assert torch.equal(got[0, 3:], torch.tensor([0.375, 0.375]))  # the other segment: its mean
    assert int(torch.count_nonzero(residual[:1000])) == 0  # nothing fed back into the bad segment
    assert residual[1500] == 0.125 and residual[1600] == -0.125


def test_compact_settings_are_checked():
    for bad in (1, "yes", "Sign", None):
        with pytest.raises(TypeError, match="compact must be True, False or 'sign'"):
            codec.Codec(compact=bad)
    with pytest.raises(ValueError, match="choose one"):
        codec.Codec(fp16_values=True, compact="sign")
    with pytest.raises(ValueError, match="values must be one of"):
        compact.CompactPairs(_plan([10], [1]), values="sign8")


def test_sign_native_and_torch_write_the_same_bytes_and_residual(monkeypatch):
    """The native sign pack against the torch ops' on pairs with zeros at their own indices and
    as fill-ups, an all-zero segment, -0.0 and int64 indices: the same message, the same
    residual, and each path's unpack of it the same pairs."""
    if native.library() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    rng = np.random.default_rng(14)
    sizes, ks = [50_000, 3000, 800, 20_000], [60, 9, 5, 30]
    starts = np.cumsum([0] + sizes)
    values = rng.standard_normal(sum(ks)).astype(np.float32)
    indices = np.concatenate([a + _spread(rng, n, k) for a, n, k in zip(starts, sizes, ks)])
    values[[0, 30, 59, 61]] = 0.0
    values[62] = -0.0
    indices[63] = indices[64]
    values[63] = 0.0  # a fill-up ahead of the pair it repeats
    values[69:74] = 0.0  # the third segment: nothing non-zero
    for index_dtype in (torch.int32, torch.int64):
        plan = _sign_plan(sizes, ks)
        plan.layout = wire.Layout(plan.count, torch.float32, index_dtype)
        message = plan.layout.pack(torch.from_numpy(values), torch.from_numpy(indices).to(index_dtype))
        res_native, res_torch = torch.randn(sum(sizes)), None
        res_torch = res_native.clone()
        native_bytes = plan.compact().pack(message, residual=res_native, out=False)
        native_pairs = plan.compact().unpack(torch.cat([native_bytes] * 2), 2, out=False)
        with monkeypatch.context() as m:
            m.setattr(compact, "_native", lambda *args: None)
            torch_bytes = plan.compact().pack(message, residual=res_torch, out=False)
            torch_pairs = plan.compact().unpack(torch.cat([torch_bytes] * 2), 2, out=False)
        assert torch.equal(native_bytes, torch_bytes), index_dtype
        assert torch.equal(res_native, res_torch), index_dtype
        assert torch.equal(native_pairs, torch_pairs), index_dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("values", ["log", "sign"])
def test_16_bit_values_feed_back_their_rounding_in_the_residuals_dtype(dtype, values):
    """16-bit values on the wire, a float32 residual (the optimizer's and the DDP hook's): what
    arrives plus the residual is what the buffer held, to float32's rounding. The difference of a
    value and its sign-format arrival, taken in 16 bits, lost up to 2**-9 of it (a review)."""
    gen = torch.Generator().manual_seed(15)
    n, k = 40_000, 600
    acc = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2)
    c = codec.Codec(method="exact", compact=True if values == "log" else "sign")
    plan = c.plan([n], k / n, "tensor", dtype, torch.int32)
    message = torch.empty(plan.layout.nbytes, dtype=torch.uint8)
    before = acc.double().clone()
    c.encode(acc, plan, message, zero_sent=True)
    got, idx = plan.layout.unpack(plan.compact().unpack(plan.compact().pack(message, residual=acc), 1), 1)
    arrived = torch.zeros(n, dtype=torch.float64).index_add_(0, idx[0].long(), got[0].double())
    np.testing.assert_allclose((arrived + acc.double()).numpy(), before.numpy(), rtol=2 ** -22, atol=0)


def test_sign_float64_magnitudes_whose_sum_overflows():
    """Finite float64 values near float64's largest: their mean is taken without overflowing,
    arrives as float32's largest and the rest stays in the residual (the sum overflowed, and
    every value arrived as inf with nothing kept: a review)."""
    plan = codec.Codec(method="exact", compact="sign").plan([1000], 0.01, "tensor", torch.float64, torch.int32)
    acc = torch.zeros(1000, dtype=torch.float64)
    acc[:10] = 1e308
    message = torch.empty(plan.layout.nbytes, dtype=torch.uint8)
    codec.Codec(method="exact", compact="sign").encode(acc, plan, message, zero_sent=True)
    got, _ = plan.layout.unpack(plan.compact().unpack(plan.compact().pack(message, residual=acc), 1), 1)
    big = float(torch.finfo(torch.float32).max)
    assert got[0].tolist() == [big] * 10
    assert acc[:10].tolist() == [1e308 - big] * 10


def test_a_numpy_string_sign_is_the_plain_string():
    import hvd_topk
    assert repr(hvd_topk.TopK(compact=np.str_("sign"))) == repr(hvd_topk.TopK(compact="sign"))
