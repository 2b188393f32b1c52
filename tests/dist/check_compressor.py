"""TopK under stock Horovod, checked against a numpy reference built from every rank's data.

Run: PYTHONPATH=.:tests/support mpirun -np 2 (or 3) python tests/dist/check_compressor.py
(``--list`` prints the names of its checks).
"""

import copy
import inspect
import warnings

import numpy as np
import torch

import horovod.torch as hvd
import hvd_topk
from harness import (DEVICE, assert_same_on_all_ranks, check_unnamed_allreduce_between_backward_and_step, gather,
                     raises, run, step_and_check_same)
from hvd_topk._horovod import name_fallbacks
from reference import (bfloat16_mean_rounded_once, k_of, nearly_cancelling, round_bfloat16, sign_round_trip,
                       sparse_allreduce)


def check_allreduce():
    rank = hvd.rank()
    gen = torch.Generator().manual_seed(100 + rank)
    cases = 0
    for density in (0.01, 0.1, 1.0):
        for op in (hvd.Average, hvd.Sum):
            for dtype in (torch.float32, torch.float64):
                for shape in ((1000,), (37, 53)):
                    t = torch.randn(shape, generator=gen, dtype=dtype).to(DEVICE)
                    out = hvd.allreduce(t, op=op, compression=hvd_topk.TopK(density=density),
                                        name=f"ar.{cases}")
                    ref = sparse_allreduce(gather(t.cpu().numpy()), density, average=op == hvd.Average)
                    assert out.shape == t.shape and out.dtype == t.dtype and out.device == t.device
                    # float32 sums of P values round by up to about P eps |x| (the reference is float64)
                    atol = max(1e-7, 2 * np.finfo(np.float32).eps * hvd.size() * float(t.abs().max()))
                    np.testing.assert_allclose(out.cpu().numpy(), ref, rtol=1e-6, atol=atol,
                                               err_msg=f"density={density} op={op} {dtype} {shape}")
                    assert_same_on_all_ranks(out.cpu().numpy(), "allreduce result")
                    cases += 1
    # The class itself is a compressor at 1% density.
    t = torch.randn(5000, generator=gen).to(DEVICE)
    out = hvd.allreduce(t, compression=hvd_topk.TopK, name="ar.class")
    np.testing.assert_allclose(out.cpu().numpy(), sparse_allreduce(gather(t.cpu().numpy()), 0.01), rtol=1e-6, atol=1e-7)
    nonzero = np.count_nonzero(out.cpu().numpy())
    assert nonzero <= hvd.size() * k_of(5000, 0.01), nonzero
    # fp16 values on the wire: the reference rounds each rank's values to float16.
    t = torch.randn(3000, generator=gen).to(DEVICE)
    out = hvd.allreduce(t, compression=hvd_topk.TopK(density=0.02, fp16_values=True), name="ar.fp16")
    ref = sparse_allreduce(gather(t.cpu().numpy()), 0.02, value_dtype=np.float16)
    np.testing.assert_allclose(out.cpu().numpy(), ref, rtol=1e-6, atol=1e-7)
    # bfloat16, which Horovod 0.28.1 cannot allgather itself, travels as bytes.
    # Distinct magnitudes 1..256 are exact in bfloat16, so the top-k set has no ties.
    signs = torch.randint(0, 2, (256,), generator=gen) * 2 - 1
    t = ((torch.randperm(256, generator=gen) + 1) * signs).to(DEVICE, torch.bfloat16)
    out = hvd.allreduce(t, compression=hvd_topk.TopK(density=0.05), op=hvd.Sum, name="ar.bf16")
    ref = sparse_allreduce(gather(t.float().cpu().numpy()), 0.05, average=False)
    # the integer sums (up to 3 x 256) summed exactly and rounded to bfloat16 once: bit for bit
    # (a tolerance of 2% let a sum 0.8% too large through)
    np.testing.assert_array_equal(out.float().cpu().numpy(), round_bfloat16(np.float32(ref)))
    # bf16 values that nearly cancel across ranks: summed in float32 and rounded once, as the
    # dense allreduce does (added into bf16 one rank at a time, 3 ranks' sum read 0).
    t = torch.zeros(2000, dtype=torch.bfloat16, device=DEVICE)
    t[0] = nearly_cancelling(rank, hvd.size())
    out = hvd.allreduce(t, compression=hvd_topk.TopK(density=0.0005), name="ar.bf16.cancel")
    want = bfloat16_mean_rounded_once([nearly_cancelling(r, hvd.size()) for r in range(hvd.size())])
    assert float(out[0]) == want and not out[1:].any(), (float(out[0]), want)
    # fp16_values over bf16: the values stay bf16 (2 bytes either way), so 1e5 does not arrive as inf.
    t = torch.zeros(2000, dtype=torch.bfloat16, device=DEVICE)
    t[0] = 1e5 * (rank + 1)
    out = hvd.allreduce(t, compression=hvd_topk.TopK(density=0.0005, fp16_values=True), name="ar.bf16.fp16v")
    want = bfloat16_mean_rounded_once([float(torch.tensor(1e5 * (r + 1), dtype=torch.bfloat16))
                                       for r in range(hvd.size())])
    assert float(out[0]) == want and not out[1:].any(), (float(out[0]), want)
    # Large tensors go through the native kernel (sampled and exact) straight into the message.
    for method in ("exact", "sampled"):
        t = torch.randn(300_000, generator=gen).to(DEVICE)
        out = hvd.allreduce(t, compression=hvd_topk.TopK(density=0.01, method=method), name=f"ar.big.{method}")
        np.testing.assert_allclose(out.cpu().numpy(), sparse_allreduce(gather(t.cpu().numpy()), 0.01), rtol=1e-6,
                                   atol=1e-7, err_msg=method)
    # A parameter handed to hvd.allreduce is reduced as its values (Horovod's own path does), not
    # refused as Adasum's parameter delta (only Horovod's Adasum optimizer compresses without an op).
    p = torch.nn.Parameter(torch.randn(2000, generator=gen).to(DEVICE))
    before = p.detach().cpu().numpy().copy()
    out = hvd.allreduce(p, compression=hvd_topk.TopK(density=0.02), name="ar.parameter")
    np.testing.assert_allclose(out.detach().cpu().numpy(), sparse_allreduce(gather(before), 0.02), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(p.detach().cpu().numpy(), before)
    # Integer and empty tensors pass through to Horovod's dense allreduce.
    t = torch.arange(10, dtype=torch.int32, device=DEVICE) * (rank + 1)
    out = hvd.allreduce(t, op=hvd.Sum, compression=hvd_topk.TopK, name="ar.int")
    np.testing.assert_array_equal(out.cpu().numpy(), np.sum(gather(t.cpu().numpy()), axis=0))
    out = hvd.allreduce(torch.empty(0, device=DEVICE), compression=hvd_topk.TopK, name="ar.empty")
    assert out.numel() == 0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.body(x)


def raw_grads(model, batches):
    """Gradients of the unwrapped copy, accumulated over the batches (as Horovod does)."""
    model.zero_grad()
    for x, y in batches:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.detach().cpu().numpy().copy() for n, p in model.named_parameters()}


def check_optimizer(density=0.05, op=hvd.Average, predivide=1.0, groups=None, passes=1, steps=2,
                    dense=False):
    """``dense``: Horovod's optimizer without compression (the README's first column), checked
    against the same reference at density 1 (every entry sent)."""
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    shadow = copy.deepcopy(model)
    compressor = hvd.Compression.none if dense else hvd_topk.TopK(density=density)
    density = 1.0 if dense else density
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), compression=compressor,
                                   op=op, gradient_predivide_factor=predivide, groups=groups,
                                   backward_passes_per_step=passes)
    gen = torch.Generator().manual_seed(7 + hvd.rank())
    label = f"op={op} predivide={predivide} groups={groups} passes={passes}"
    for step in range(steps):
        batches = [(torch.randn(16, 20, generator=gen).to(DEVICE), torch.randint(0, 10, (16,), generator=gen).to(DEVICE))
                   for _ in range(passes)]
        shadow.load_state_dict(model.state_dict())
        want = raw_grads(shadow, batches)
        opt.zero_grad()
        for x, y in batches:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        for name, p in model.named_parameters():
            ref = sparse_allreduce(gather(want[name]), density, average=op == hvd.Average)
            np.testing.assert_allclose(p.grad.cpu().numpy(), ref, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{label} step {step} {name}")
        step_and_check_same(opt, model, f"{label}: step {step}")
    if dense:
        return
    # Statistics, recomputed by hand from the contract: per tensor k pairs of 4+4 bytes
    # (padded to 8) plus the 20-byte probe (five float32); dense bytes are 4 per element.
    sizes = [p.numel() for p in model.parameters()]
    stats = compressor.compression_stats()
    assert compressor.stats() == stats  # the older name, kept as an alias
    assert stats["tensors_sparse"] == steps * len(sizes), stats
    assert "steps" not in stats, stats  # it cannot know them (it was a key stuck at 0)
    assert stats["bytes_dense"] == steps * 4 * sum(sizes), stats
    assert stats["elements_selected"] == steps * sum(k_of(n, density) for n in sizes), stats
    want_sent = steps * sum((k_of(n, density) * 8 + 7) // 8 * 8 + 20 for n in sizes)
    assert stats["bytes_sent"] == want_sent, (stats, want_sent)
    compressor.compression_stats(reset=True)
    assert compressor.compression_stats()["bytes_sent"] == 0


def check_step_after_synchronize():
    """``synchronize()``, then ``step()`` without ``skip_synchronize()``: Horovod's step() runs
    synchronize() again (and warns). What it sends again is already the exchanged result, so it
    passes through: p.grad stays the numpy reference's sparse average, and the parameters equal,
    bitwise, those of Horovod's full pattern. (It was sent through Top-K again: most of the
    average's entries dropped.) A second synchronize() changes nothing either."""
    runs = []
    for pattern in ("skip_synchronize", "step", "synchronize twice"):
        torch.manual_seed(0)
        model = Net().to(DEVICE)
        shadow = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(),
                                       compression=hvd_topk.TopK(density=0.05))
        gen = torch.Generator().manual_seed(11 + hvd.rank())
        for step in range(2):
            x, y = torch.randn(16, 20, generator=gen).to(DEVICE), torch.randint(0, 10, (16,), generator=gen).to(DEVICE)
            shadow.load_state_dict(model.state_dict())
            want = raw_grads(shadow, [(x, y)])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.synchronize()
            if pattern == "step":
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    opt.step()
                assert any("skip_synchronize" in str(w.message) for w in caught), "Horovod's warning"
            else:
                if pattern == "synchronize twice":
                    opt.synchronize()
                with opt.skip_synchronize():
                    opt.step()
            for name, p in model.named_parameters():
                np.testing.assert_allclose(p.grad.cpu().numpy(), sparse_allreduce(gather(want[name]), 0.05),
                                           rtol=1e-5, atol=1e-7, err_msg=f"{pattern}: step {step} {name}")
        runs.append(model)
    for model in runs[1:]:
        for (name, a), b in zip(runs[0].named_parameters(), model.parameters()):
            assert torch.equal(a, b), f"{name} differs from Horovod's full pattern (max {float((a - b).abs().max())})"
    # bfloat16 parameters: the pass-through's one-element placeholder was a bfloat16 tensor, which
    # Horovod cannot allreduce ("Tensor type torch.BFloat16Tensor is not supported"); p.grad keeps
    # the exchanged result, as above
    torch.manual_seed(0)
    model = Net().to(DEVICE).to(torch.bfloat16)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), compression=hvd_topk.TopK(density=0.05))
    x, y = torch.randn(16, 20).to(DEVICE, torch.bfloat16), torch.randint(0, 10, (16,)).to(DEVICE)
    torch.nn.functional.cross_entropy(model(x).float(), y).backward()
    opt.synchronize()
    exchanged = {n: p.grad.clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Horovod's skip_synchronize warning, checked above
        opt.synchronize()  # the second pass (what step() without skip_synchronize() runs)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, exchanged[n]), f"bfloat16, a second synchronize(): {n} changed"


def check_gradients_written_through_data_after_a_step():
    """After a step, gradients written by hand through ``.data`` (no hook fires, and ``.data``
    bumps no version counter), then ``synchronize()``: they are exchanged, the numpy reference of
    what the ranks wrote (from ece24be to the commit after fd8f47a a synchronize() after step()
    passed through a p.grad it took for the last result unchanged, and the ranks drifted apart).
    And no zero_grad() between steps while rank 1's graph skips a layer once: that layer's stale
    p.grad is exchanged from synchronize() on rank 1 while rank 0's hook compresses it (the same
    window passed it through as a placeholder: Horovod refused mismatched shapes)."""
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd_topk.TopK(density=0.05))
    gen = torch.Generator().manual_seed(13 + hvd.rank())
    x, y = torch.randn(16, 20, generator=gen).to(DEVICE), torch.randint(0, 10, (16,), generator=gen).to(DEVICE)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    for p in model.parameters():
        p.grad.data.copy_(torch.randn(p.shape, generator=gen))
    by_hand = {n: p.grad.cpu().numpy().copy() for n, p in model.named_parameters()}
    opt.synchronize()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.cpu().numpy(), sparse_allreduce(gather(by_hand[name]), 0.05),
                                   rtol=1e-6, atol=1e-7, err_msg=f"written through .data: {name}")
    step_and_check_same(opt, model, "written through .data")
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(DEVICE)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=0.01),
                                   named_parameters=layers.named_parameters(), compression=hvd_topk.TopK(density=0.1))
    for step in range(3):
        hidden = layers[0](torch.randn(8, 64, generator=gen).to(DEVICE))
        if not (step == 1 and hvd.rank() == 1):
            hidden = layers[1](hidden)
        hidden.pow(2).mean().backward()
        opt.step()  # no zero_grad(): p.grad keeps the last result where backward does not reach
        for name, p in layers.named_parameters():
            assert_same_on_all_ranks(p.detach().cpu().numpy(), f"no zero_grad, step {step}: {name}")


def check_grads_set_by_hand():
    """Horovod's synchronize() starts parameters whose hooks did not fire in ``set`` order,
    which differs between ranks; equal-shaped tensors must still be paired by name."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(40, 40) for _ in range(4)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd_topk.TopK(density=0.05))
    gen = torch.Generator().manual_seed(11 + hvd.rank())
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        want = {n: p.grad.cpu().numpy().copy() for n, p in model.named_parameters()}
        opt.synchronize()
        for name, p in model.named_parameters():
            np.testing.assert_allclose(p.grad.cpu().numpy(), sparse_allreduce(gather(want[name]), 0.05),
                                       rtol=1e-6, atol=1e-7, err_msg=f"step {step} {name}")
        step_and_check_same(opt, model, f"grads set by hand, step {step}")


def check_adasum_rejected():
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd_topk.TopK, op=hvd.Adasum)
    loss = model(torch.randn(4, 20)).sum()
    # Horovod never shows the compressor the op at construction: the first backward refuses,
    # on every rank, with the way out.
    with raises(ValueError, match=r"does not support op=hvd.Adasum.*op=hvd.Average.*at the first "
                "backward pass", what="op=Adasum with TopK"):
        loss.backward()


def check_reductions_refused():
    """The drop-in averages or sums pairs; any other reduction of them is not that reduction of
    the tensors. Each is refused on every rank, naming the reason, where before the probe's
    check blamed the process set (Adasum, Min) or a reduce-scatter scattered the probe."""
    t = torch.randn(2000)
    with raises(ValueError, match=r"does not support op=hvd.Adasum", what="hvd.allreduce op=Adasum"):
        hvd.allreduce(t, compression=hvd_topk.TopK, op=hvd.Adasum, name="refused.adasum")
    for op, label in ((hvd.Min, "hvd.Min"), (hvd.Max, "hvd.Max"), (hvd.Product, "hvd.Product")):
        with raises(ValueError, match=rf"only averages or sums.*refuses op={label}:", what=f"op={label}"):
            hvd.allreduce(t, compression=hvd_topk.TopK(density=0.05), op=op, name=f"refused.{label}")
    with raises(ValueError, match=r"refuses op=hvd.Max:", what="hvd.grouped_allreduce op=Max"):
        hvd.grouped_allreduce([t, t + 1], compression=hvd_topk.TopK, op=hvd.Max, name="refused.grouped")
    with raises(ValueError, match=r"compresses allreduces.*hvd.reducescatter", what="hvd.reducescatter"):
        hvd.reducescatter(torch.randn(6 * hvd.size(), 50), compression=hvd_topk.TopK, name="refused.rs")
    # a TopK of another density on the last rank: every rank refuses, saying to build the same TopK
    odd = hvd.rank() == hvd.size() - 1
    with raises(ValueError, match=r"ranks disagree on the tensor being exchanged or on its TopK \(density, "
                                  r"fp16_values, compact\): build the same TopK", what="densities differ"):
        hvd.allreduce(torch.randn(2000), compression=hvd_topk.TopK(density=0.1 if odd else 0.05), name="refused.density")
    # formats whose messages have the same size (so the allgather cannot tell): every rank refuses,
    # where before they decoded each other's bytes as wrong pairs. Hand-checked sizes: 3 entries
    # of 40 with 8-bit values (8 + 2 + 2 + 3 bytes) or sign values (4 + 2 + 2 + 1) are both 16
    # bytes once padded; 3 pairs of int32 + float32 (24 bytes) against 4 of int32 + float16 (4 x 6)
    # The same TopK on every rank then sums as by hand: rank r sends (1..40) x (r + 1), whose top
    # 3 (38, 39, 40) arrive with sign values as their mean, 39, and whose top 4 are exact in float16.
    ranks_sum = hvd.size() * (hvd.size() + 1) / 2
    sign_sum, fp16_sum = np.zeros(40), np.zeros(40)
    sign_sum[37:] = 39 * ranks_sum
    fp16_sum[36:] = np.arange(37.0, 41.0) * ranks_sum
    for label, mine, last, want in (
            ("compact=True against 'sign'", dict(density=3 / 40, compact=True), dict(density=3 / 40, compact="sign"),
             sign_sum),
            ("fp16_values against float32 values", dict(density=3 / 40), dict(density=4 / 40, fp16_values=True),
             fp16_sum)):
        tensor = torch.arange(1.0, 41.0) * (1 + hvd.rank())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sign values' warning: the rounding is lost here
            with raises(ValueError, match=r"the ranks' TopKs send this tensor in different formats \(fp16_values "
                                          r"or compact differ; this rank's is TopK\(density=", what=label):
                hvd.allreduce(tensor, compression=hvd_topk.TopK(**(last if odd else mine)),
                              name=f"refused.format.{label}")
            same = hvd.allreduce(tensor, compression=hvd_topk.TopK(**last), name=f"after.format.{label}", op=hvd.Sum)
        np.testing.assert_array_equal(same.numpy(), want, err_msg=label)
    # the ops it does take still reduce (every rank took part in nothing above)
    # (density 1: 8 bytes of pairs for each 4-byte entry, which the drop-in sends, warning once per
    # TopK; every rank receives the P - 1 others' pairs, where a ring allreduce moves 2 (P-1)/P n 4)
    every, fewer = hvd_topk.TopK(density=1.0), hvd_topk.TopK(density=0.4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = hvd.allreduce(torch.ones(2000), compression=every, op=hvd.Sum, name="after.sum")
        hvd.allreduce(torch.ones(2000), compression=every, op=hvd.Sum, name="after.sum.again")
        hvd.allreduce(torch.ones(2000), compression=fewer, name="after.fewer")  # (P-1) 6.4 KB against 2 (P-1)/P 8 KB
        hvd.allreduce(torch.ones(1), compression=hvd_topk.TopK(density=0.01), name="after.one")  # k >= 1: 8 B > 4 B
    np.testing.assert_array_equal(out.cpu().numpy(), np.full(2000, float(hvd.size()), dtype=np.float32))
    bytes_warnings = [str(w.message) for w in caught if "costs more than leaving it out saves" in str(w.message)]
    size = hvd.size()

    def told(compressor, message_bytes):
        return (f"{compressor!r} over {size} ranks: each rank receives {(size - 1) * message_bytes} bytes of the "
                f"others' pairs for a tensor a ring allreduce moves in {round(2 * (size - 1) / size * 8000)} bytes: at "
                "this density each entry's index costs more than leaving it out saves (the allgather pays from about "
                "2/P of the entries on), and this drop-in path has no dense fallback. Pass Horovod's "
                "compression=hvd.Compression.none (or fp16), a lower density, or use hvd_topk.DistributedOptimizer, "
                "which sends such tensors dense. (Warned once per TopK.)")
    want = [told(every, 16000)] + ([told(fewer, 6400)] if size >= 3 else [])  # 0.4 > 2/P from 3 ranks on
    assert bytes_warnings == want, bytes_warnings


def check_broadcast_optimizer_state(compression):
    """``hvd.broadcast_optimizer_state`` with Horovod's optimizer: every rank ends with rank 0's
    learning rate and momentum buffers (built by a local step on rank-dependent gradients)."""
    torch.manual_seed(0)
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1 * (1 + hvd.rank()), momentum=0.9)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=compression)
    gen = torch.Generator().manual_seed(3 + hvd.rank())
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    with opt.skip_synchronize():
        opt.step()  # local: momentum buffers differ between ranks
    buffers = [opt.state[p]["momentum_buffer"].cpu().numpy().copy() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == gather(0.1)[0], opt.param_groups[0]["lr"]
    for i, p in enumerate(model.parameters()):
        np.testing.assert_array_equal(opt.state[p]["momentum_buffer"].cpu().numpy(), gather(buffers[i])[0],
                                      err_msg=f"momentum buffer {i}")


def check_adasum_dense():
    """Horovod's own Adasum (dense): trains with ranks equal where the number of ranks is a
    power of two; otherwise Horovod refuses at the first backward pass."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    size = hvd.size()
    if size & (size - 1):
        with raises(NotImplementedError, match="Running Adasum with non-power of 2 ranks is not supported",
                    what=f"Adasum on {size} ranks"):
            torch.nn.functional.cross_entropy(model(torch.randn(4, 20)), torch.zeros(4, dtype=torch.long)).backward()
        return
    gen = torch.Generator().manual_seed(5 + hvd.rank())
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(2):
        opt.zero_grad()
        x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # Adasum's optimizer combines parameter deltas in step()
        for name, p in model.named_parameters():
            assert_same_on_all_ranks(p.detach().cpu().numpy(), f"adasum step {step}: parameter {name}")
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), "nothing trained"


def check_unnamed_grouped_allreduce():
    """``hvd.grouped_allreduce(..., compression=TopK)`` without ``name=``, rank 1 arriving late:
    Horovod names the group by this process's count of started collectives, which TopK must not
    make depend on when its probe arrives (it started the pairs' allgathers on a rank whose
    probe had arrived during the compressions, and the ranks' names for the group differed)."""
    import time
    gen = torch.Generator().manual_seed(7 + hvd.rank())
    for call in range(3):
        tensors = [torch.randn(500 + 100 * i, generator=gen).to(DEVICE) for i in range(6)]
        if hvd.rank() == 1:
            time.sleep(0.2)
        outs = hvd.grouped_allreduce(tensors, compression=hvd_topk.TopK(density=0.02))
        for i, (t, out) in enumerate(zip(tensors, outs)):
            np.testing.assert_allclose(out.cpu().numpy(), sparse_allreduce(gather(t.cpu().numpy()), 0.02),
                                       rtol=1e-6, atol=1e-7, err_msg=f"call {call}, tensor {i}")


def check_named_grouped_allreduce():
    """``hvd.grouped_allreduce(tensors, name="g", compression=TopK)``: the group's name and each
    tensor's place name its allgathers (it fell back to call order, warning the user, who had
    named the group, that no name was given); the results against numpy, every rank alike."""
    gen = torch.Generator().manual_seed(17 + hvd.rank())
    tensors = [torch.randn(400 + 100 * i, generator=gen).to(DEVICE) for i in range(4)]
    before = name_fallbacks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = hvd.grouped_allreduce(tensors, name="check.named_group", compression=hvd_topk.TopK(density=0.02))
    assert name_fallbacks() == before, (before, name_fallbacks())
    assert not any("found no name" in str(w.message) for w in caught), [str(w.message) for w in caught]
    for i, (t, out) in enumerate(zip(tensors, outs)):
        np.testing.assert_allclose(out.cpu().numpy(), sparse_allreduce(gather(t.cpu().numpy()), 0.02),
                                   rtol=1e-6, atol=1e-7, err_msg=f"tensor {i}")


def check_drop_in_warnings():
    """Two warnings a drop-in user needs. (1) A density at which the allgather moves more bytes
    into a rank than a ring allreduce of the tensor, (P-1) k 8 > 2 (P-1)/P n 4, i.e. above 2/P:
    0.4 warns from 3 ranks on, not at 2 (it compared one message with the tensor: 0.5 at any P).
    (2) An allreduce of a tensor that requires grad: the result carries no gradient back.
    Each points at the user's call (this file), not at Horovod's or torch's lines."""
    def warned(density, x, name):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = hvd.allreduce(x, compression=hvd_topk.TopK(density=density), name=name)
        assert all(w.filename == __file__ for w in caught), [(w.filename, w.lineno) for w in caught]
        return out, [str(w.message) for w in caught]

    _, said = warned(0.4, torch.randn(1000, device=DEVICE), "check.warn.0.4")
    assert any("costs more than leaving it out saves" in s for s in said) == (hvd.size() >= 3), said
    _, said = warned(0.2, torch.randn(1000, device=DEVICE), "check.warn.0.2")
    assert not any("costs more than leaving it out saves" in s for s in said), said
    x = torch.randn(50, device=DEVICE, requires_grad=True)
    out, said = warned(0.1, x, "check.warn.grad")
    assert any("the result is not differentiable" in s for s in said), said
    assert not out.requires_grad
    _, said = warned(0.1, x.detach(), "check.warn.nograd")
    assert not any("not differentiable" in s for s in said), said


def check_drop_in_sign_values():
    """``TopK(compact="sign")`` in Horovod's path: each rank's top-k arrive as its sign times
    the mean magnitude it sends (numpy), averaged; a warning, once per instance, that the
    rounding is lost here (no residual), pointing at the user's line: the ``hvd.allreduce``
    call, and through Horovod's optimizer the ``loss.backward()`` whose hooks compress."""
    gen = torch.Generator().manual_seed(300 + hvd.rank())
    c = hvd_topk.TopK(density=0.02, compact="sign")
    for i in range(2):
        t = torch.randn(3000, generator=gen).to(DEVICE)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = hvd.allreduce(t, compression=c, name=f"check.sign.{i}")
        said = [str(w.message) for w in caught if "compact='sign'" in str(w.message)]
        assert len(said) == (i == 0), said
        assert all(w.filename == __file__ for w in caught), [(w.filename, w.lineno) for w in caught]
        np.testing.assert_allclose(out.cpu().numpy(), sparse_allreduce(gather(t.cpu().numpy()), 0.02,
                                                                       round_trip=sign_round_trip),
                                   rtol=1e-6, atol=1e-7)
        assert_same_on_all_ranks(out.cpu().numpy(), "sign values")
    model = torch.nn.Linear(64, 32).to(DEVICE)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compression=hvd_topk.TopK(density=0.02, compact="sign"))
    loss = model(torch.randn(8, 64, device=DEVICE)).square().sum()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # the next line, which the warning should name
        loss.backward()
        opt.synchronize()
    where = [(w.filename, w.lineno) for w in caught if "compact='sign'" in str(w.message)]
    assert where == [(__file__, line)], where
    with opt.skip_synchronize():
        opt.step()


class _AllreduceInBackward(torch.autograd.Function):
    """The identity, whose backward allreduces (a stand-in for ``hvd.SyncBatchNorm``, which is
    GPU-only)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        total = hvd.allreduce(g.sum().reshape(1), name="check.in_backward", op=hvd.Sum)
        return g + 0 * total


def check_collective_in_backward_with_a_branch():
    """A collective inside backward (as ``hvd.SyncBatchNorm``'s) while rank 1's graph skips the
    head: rank 1 compresses nothing before that collective. TopK must not wait inside backward
    for its round's probe, which rank 1 has not started (from ece24be to the next commit it
    waited at the round's second tensor, and the job hung). p.grad: the numpy reference."""
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(32, 32).to(DEVICE), torch.nn.Linear(32, 32).to(DEVICE)
    named = [(f"trunk.{n}", p) for n, p in trunk.named_parameters()] + \
            [(f"head.{n}", p) for n, p in head.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.01), named_parameters=named,
                                   compression=hvd_topk.TopK(density=0.1))
    gen = torch.Generator().manual_seed(3 + hvd.rank())
    for step in range(3):
        opt.zero_grad()
        hidden = _AllreduceInBackward.apply(trunk(torch.randn(4, 32, generator=gen).to(DEVICE)))
        loss = head(hidden).pow(2).mean() if hvd.rank() != 1 else hidden.pow(2).mean()
        loss.backward()
        raw = {n: (p.grad.cpu().numpy().copy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32))
               for n, p in named}
        opt.synchronize()
        for n, p in named:
            np.testing.assert_allclose(p.grad.cpu().numpy(), sparse_allreduce(gather(raw[n]), 0.1),
                                       rtol=1e-5, atol=1e-7, err_msg=f"step {step}: {n}")
        step_and_check_same(opt, torch.nn.ModuleDict({"trunk": trunk, "head": head}), f"step {step}")


def optimizer(label, **options):
    """The named check of Horovod's DistributedOptimizer with TopK and these options."""
    return f"horovod optimizer: {label}", lambda: check_optimizer(**options)


# Run in this order on every rank; add a check with one line.
CHECKS = [
    ("allreduce", check_allreduce),
    optimizer("default"),
    optimizer("op=Sum", op=hvd.Sum),
    optimizer("predivide=2.0", predivide=2.0),
    optimizer("groups=2", groups=2),
    optimizer("passes=2", passes=2),
    optimizer("density=1.0", density=1.0),
    ("step() after synchronize() without skip_synchronize(): the same result", check_step_after_synchronize),
    ("gradients written through .data after a step, a layer skipped on one rank: exchanged",
     check_gradients_written_through_data_after_a_step),
    ("grads set by hand", check_grads_set_by_hand),
    ("adasum rejected", check_adasum_rejected),
    ("reductions refused", check_reductions_refused),
    ("broadcast_optimizer_state", lambda: check_broadcast_optimizer_state(hvd_topk.TopK)),
    # Horovod's optimizer alone, for the README's Compatibility table
    ("horovod dense: groups=2", lambda: check_optimizer(dense=True, groups=2)),
    ("horovod dense: passes=2", lambda: check_optimizer(dense=True, passes=2)),
    ("horovod dense: predivide=2.0", lambda: check_optimizer(dense=True, predivide=2.0)),
    ("horovod dense: broadcast_optimizer_state", lambda: check_broadcast_optimizer_state(hvd.Compression.none)),
    ("horovod dense: adasum", check_adasum_dense),
    # last: a failure here leaves Horovod stalled for the checks after it
    ("a collective inside backward, rank 1's graph without the head", check_collective_in_backward_with_a_branch),
    ("an unnamed grouped_allreduce, one rank late", check_unnamed_grouped_allreduce),
    ("a named grouped_allreduce names each tensor", check_named_grouped_allreduce),
    ("drop-in warnings: density above 2/P, a tensor that requires grad", check_drop_in_warnings),
    ("drop-in sign values: averaged as numpy says, a warning once", check_drop_in_sign_values),
    ("horovod optimizer: an unnamed allreduce between backward() and step()",
     lambda: check_unnamed_allreduce_between_backward_and_step(
         lambda model: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                                named_parameters=model.named_parameters(),
                                                compression=hvd_topk.TopK))),
]


if __name__ == "__main__":
    run(CHECKS)
