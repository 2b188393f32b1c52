"""hvd_topk.ddp (the DDP communication hook) checked step by step against numpy references.

Run: PYTHONPATH=.:tests/support:tests torchrun --standalone --nproc_per_node 2 (or 3)
tests/dist/check_ddp.py  (``--list`` prints the names of its checks). gloo, on the CPU, or
with ``HVD_TOPK_CHECK_DEVICE=cuda`` the model and its gradients on the GPU (every rank on
``cuda:LOCAL_RANK % device count``; gloo moves CUDA tensors through the host).

Every rank computes its own raw gradient on a copy of the model without DDP; the ranks' raw
gradients are gathered and fed to ``reference.ErrorFeedbackReference`` (numpy), which gives
the averaged result DDP must leave in ``p.grad``; the ranks must hold the same bits.
"""

import contextlib
import copy
import gc
import os
import re
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_topk
import hvd_topk.ddp
from expect import raises
import nets
from nets import Net, sixteen_bit_checks
from native_switch import loaded, native_off
from reference import (ErrorFeedbackReference, bfloat16_mean_rounded_once, dgc_density, expect_16bit_step, k_of,
                       nearly_cancelling)
from torchrun_harness import assert_same_on_all_ranks, gather, run

MIN_NUMEL = 500  # the three weights (3840, 960, 960 elements) sparse; the biases dense
DEVICE = torch.device(os.environ.get("HVD_TOPK_CHECK_DEVICE", "cpu"))
if DEVICE.type == "cuda":
    DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(DEVICE)


def host(tensor):
    """A tensor's values as a numpy array, wherever the tensor lives."""
    return tensor.detach().cpu().numpy()


def batch(step, rank, part=0, n=24):
    return nets.batch(step, rank, part, n, DEVICE)


def build(bucket_cap_mb=25, seed=0, ddp_kwargs=None, names_of=lambda model: model.named_parameters(),
          **state_kwargs):
    torch.manual_seed(seed)
    model = Net().to(DEVICE)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, **(ddp_kwargs or {}))
    state_kwargs.setdefault("min_numel", MIN_NUMEL)
    state_kwargs.setdefault("named_parameters", names_of(model))
    state = hvd_topk.ddp.TopKState(**state_kwargs)
    hvd_topk.ddp.register(ddp, state)
    return model, ddp, state


def buckets_of(state):
    """{parameter name: (DDP bucket index, that bucket's sparse parameters' names)}: which
    tensors DDP put together (its choice, read from the state's layouts)."""
    out = {}
    for index, layout in state.layouts.items():
        members = [state.names[layout.params[i]] for i in layout.sparse]
        for p in layout.params:
            out[state.names[p]] = (index, members)
    return out


def chosen(family, world, sizes, density, decays=False):
    """The cost model written out by hand (fp32 values, int32 indices): how a bucket of sparse
    tensors ``sizes`` travels under ``family`` (None: the fewest bytes of all). Bytes into each
    rank: a ring allreduce 2 (P-1)/P n 4, the allgather (P-1) k 8, the sparse allreduce
    (P-1)/P (k 4 + 2 (k+1) 4); the fewest wins (the sparse ones first on a tie, dense last).
    ``decays`` (the residual is DeMo's momentum, ``state.momentum_in_residual``): never dense unless
    pinned, or at density 1 (everything is sent anyway); a ``residual_decay`` added to error
    feedback is no momentum and takes dense where it moves fewer bytes."""
    if family in ("dense", "dense_fp16"):
        return family
    n, k = sum(sizes), sum(k_of(s, density) for s in sizes)
    cost = {"allgather": (world - 1) * k * 8, "sparse_allreduce": (world - 1) / world * (k * 4 + 2 * (k + 1) * 4)}
    candidates = ["allgather", "sparse_allreduce"] if family is None else [family]
    best = min(candidates, key=lambda name: cost[name])
    return "dense" if 2 * (world - 1) / world * n * 4 < cost[best] and not (decays and density < 1) else best


def check_reference(exchange="allgather", bucket_cap_mb=25, steps=4, density=0.05, warmup_steps=0,
                    warmup_density=0.25, error_feedback=True, residual_decay=1.0, accumulate=1,
                    unused_on_rank=None, unused_at_steps=(), skipping=None, ddp_kwargs=None, amp=False,
                    compiled=False, **state_kwargs):
    """Every step's p.grad against the numpy error-feedback contract; same bits on every rank.
    ``accumulate``: micro-batches per step, all but the last under ``no_sync()``.
    ``unused_on_rank``: that rank skips head2 (find_unused_parameters=True); ``unused_at_steps``:
    every rank skips it at those steps, so DDP leaves its ``p.grad`` unset and what the ranks
    held back of it must still arrive later; ``skipping``: ``{step: ranks}`` that skip it then. A rank that skipped it holds its residual back
    that step (the reference's ``idle``). ``compiled``: the forward runs through
    ``torch.compile(ddp)`` (dynamo splits the graph at DDP's buckets; the hook runs as in eager). Under "auto" the
    family each step used is the state's (the measured trial's choice); what that family does
    with each bucket is the hand-written cost model's. Returns the state and the families."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model, ddp, state = build(bucket_cap_mb, exchange=exchange, density=density, warmup_steps=warmup_steps,
                              warmup_density=warmup_density, error_feedback=error_feedback,
                              residual_decay=residual_decay, ddp_kwargs=ddp_kwargs, **state_kwargs)
    families = []
    # On a GPU, Inductor's fused kernels round differently from the eager shadow's, and Top-K at a
    # near-tie then picks another entry (an H200, 2026-12-04: 2 of 3840 at step 2, 3 ranks): the
    # graph is traced and split as with Inductor, but run by aot_eager, eager's own kernels.
    forward = (torch.compile(ddp, backend="aot_eager" if DEVICE.type == "cuda" else "inductor") if compiled
               else ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shadow = copy.deepcopy(model)
    ref = ErrorFeedbackReference(size, error_feedback=error_feedback, decay=residual_decay,
                                 # float16 on the wire: its rounding stays in the residual
                                 value_dtype=np.float16 if state_kwargs.get("fp16_values") or exchange == "dense_fp16"
                                 else None,
                                 compact=state_kwargs.get("compact", False))
    for step in range(steps):
        skips = [r for r in range(size) if r == unused_on_rank or step in unused_at_steps
                 or r in (skipping or {}).get(step, ())]
        use_head2 = rank not in skips
        idle = [{"head2.weight"} if r in skips else set() for r in range(size)]
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad()
        opt.zero_grad(set_to_none=True)
        for part in range(accumulate):
            x, y = batch(step, rank, part)
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=amp):
                F.cross_entropy(shadow(x, use_head2), y).backward()
            if part < accumulate - 1:
                with ddp.no_sync():
                    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=amp):
                        F.cross_entropy(forward(x, use_head2), y).backward()
            else:
                with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=amp):
                    F.cross_entropy(forward(x, use_head2), y).backward()
        members = buckets_of(state)
        d = dgc_density(step, density, warmup_steps, warmup_density)
        families.append(state.family)
        every = {}
        for name, p in model.named_parameters():
            g = shadow.get_parameter(name).grad
            every[name] = np.stack(gather(host(g if g is not None else torch.zeros_like(p))))
        shared = {}  # the sparse allreduce's results, bucket by bucket
        for name, p in model.named_parameters():
            grads = every[name]
            index, sparse_names = members[name]
            if p.numel() < MIN_NUMEL:
                want = grads.mean(axis=0)
            else:
                sizes = [model.get_parameter(n).numel() for n in sparse_names]
                how = chosen(state.family, size, sizes, d, state.momentum_in_residual) if size > 1 else "allgather"
                if how == "sparse_allreduce":
                    if name not in shared:
                        shared.update(ref.sparse_allreduce_bucket(sparse_names, every, d, step, index, idle=idle))
                    want = shared[name]
                else:
                    want = ref.sparse(name, grads, 1.0 if how.startswith("dense") else d, idle=idle)
            if name.startswith("head2.") and len(skips) == size:  # no rank used it: DDP leaves p.grad unset
                assert p.grad is None, f"step {step} {name}: unused on every rank, yet p.grad was written"
                assert not np.any(want), f"step {step} {name}: the reference sent something of an unused tensor"
                continue
            # summed in float16 (the dense fp16 ring; the sparse allreduce of 16-bit values)
            fp16 = p.numel() >= MIN_NUMEL and (how == "dense_fp16" or (how == "sparse_allreduce" and state.fp16_values))
            np.testing.assert_allclose(host(p.grad), want, rtol=3e-3 if fp16 else 1e-5, atol=1e-4 if fp16 else 1e-6,
                                       err_msg=f"step {step} {name} (bucket {index}, {state.family})")
            assert_same_on_all_ranks(host(p.grad), f"step {step} {name}")
        opt.step()
    assert state.stats()["steps"] == steps
    if error_feedback:  # each rank's own: exact whatever the sum's rounding
        for name, residual in state.state_dict()["residuals"].items():
            np.testing.assert_allclose(host(residual).reshape(-1), ref.residual[rank][name].reshape(-1),
                                       rtol=1e-5, atol=1e-6, err_msg=f"residual {name}")
    return state, families


def check_static_graph_buckets_of_several_dtypes(named=True):
    """``DDP(static_graph=True)`` reduces its first iteration's buckets (one per dtype at least)
    after backward, each reported to the hook as index 0 and none as the last. The hook took each
    for a rebuild of the one before: from the third on residuals were dropped (the first
    bucket's, here at step 1), and the step count lagged by one. Three dtypes, every step
    against the numpy reference of error feedback; the steps counted, every residual in
    ``state_dict()``. Without ``named``, no ``named_parameters=``: that step ends at the next
    one's first bucket."""
    rank, size = dist.get_rank(), dist.get_world_size()
    density, steps = 0.05, 4

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w32 = torch.nn.Parameter(torch.zeros(1024, device=DEVICE))
            self.w64 = torch.nn.Parameter(torch.zeros(1024, dtype=torch.float64, device=DEVICE))
            self.b16 = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16, device=DEVICE))  # dense: averaged

        def forward(self, a, b, c):
            return (self.w32 * a).sum() + (self.w64 * b).sum().float() + (self.b16 * c).sum().float()

    model = Model()
    ddp = DDP(model, static_graph=True)
    state = hvd_topk.ddp.TopKState(density=density, exchange="allgather", min_numel=100,
                                   named_parameters=model.named_parameters() if named else None)
    hvd_topk.ddp.register(ddp, state)
    ref = ErrorFeedbackReference(size)
    gen = torch.Generator().manual_seed(17 + rank)
    for step in range(steps):
        a, b = torch.randn(1024, generator=gen), torch.randn(1024, generator=gen)
        model.zero_grad(set_to_none=True)
        ddp(a.to(DEVICE), b.to(DEVICE, torch.float64),
            torch.full((8,), rank + 1.0, dtype=torch.bfloat16, device=DEVICE)).backward()
        for name, g in (("w32", a), ("w64", b)):
            want = ref.sparse(name, np.stack(gather(host(g))), density)
            got = host(model.get_parameter(name).grad.float())
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"step {step} {name}")
            assert_same_on_all_ranks(got, f"step {step} {name}")
        assert model.b16.grad.float().eq((size + 1) / 2).all(), (step, model.b16.grad.tolist())
        assert state.iteration == step + (named or step > 0), (step, state.iteration)  # (see named)
    assert state.stats()["steps"] == steps and state.iteration == steps, (state.stats()["steps"], state.iteration)
    if not named:
        return
    residuals = state.state_dict()["residuals"]
    assert sorted(residuals) == ["w32", "w64"], sorted(residuals)
    for name, residual in residuals.items():
        np.testing.assert_allclose(host(residual.float()), ref.residual[rank][name].reshape(-1), rtol=1e-5,
                                   atol=1e-6, err_msg=f"residual {name}")


def check_16bit_residuals(dtype, exchange):
    """16-bit parameters keep float32 residuals: step by step against the numpy reference of
    error feedback (float32 residual; each sent value rounded to the parameters' dtype, what
    that rounding took kept in the residual), a dense start (step 0 at density 1: DDP's
    allreduce in the parameters' dtype) and then Top-K. The gradients span 2**-6 .. 2**2
    (``nets.distinct_16bit``: no ties, which the native and torch-ops selections break apart), so a
    16-bit residual would round the small ones off as they are added to larger ones. ``p.grad``
    within the 16-bit decode's roundings (a sum, a division), the residual to float32's."""
    rank, size = dist.get_rank(), dist.get_world_size()
    density = 0.05
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32, bias=False).to(DEVICE, dtype)
    ddp = DDP(model)
    state = hvd_topk.ddp.TopKState(density=density, exchange=exchange, warmup_steps=1, warmup_density=1.0,
                                   min_numel=100, named_parameters=model.named_parameters())
    hvd_topk.ddp.register(ddp, state)
    bf16 = dtype == torch.bfloat16
    ref = ErrorFeedbackReference(size, value_dtype="bfloat16" if bf16 else np.float16)
    gen = torch.Generator().manual_seed(31 + rank)
    x = torch.eye(32, device=DEVICE, dtype=dtype)  # the layer's output is weight.T: its gradient is c
    for step in range(6):
        c = nets.distinct_16bit(gen).to(DEVICE, dtype)
        model.zero_grad(set_to_none=True)
        (ddp(x) * c.T).sum().backward()
        every = np.stack(gather(host(c.float())))
        where = f"{dtype} {exchange} step {step}"
        assert model.weight.grad.dtype == dtype, where
        assert_same_on_all_ranks(host(model.weight.grad.float()), where)
        residual = state.state_dict()["residuals"]["weight"]
        assert residual.dtype == torch.float32, f"{where}: the residual is {residual.dtype}"
        expect_16bit_step(ref, rank, exchange, step, density, every, host(model.weight.grad.float()),
                          host(residual.float()), bf16, where)


def check_bf16_values_that_cancel(exchange):
    """A bf16 model whose ranks' gradients nearly cancel (1, 2**-8, -1 at 3 ranks): the small
    tensor (a bias, summed in rank order by the hook, not Top-K), every element, averages to the
    float64 sum rounded to bf16 once (its chunks were summed in bf16 one rank at a time: 1 + 2**-8
    - 1 read 0 at 3 ranks), and so does the sparse tensor's first (selected) entry on the
    allgather. A bucket sent dense is the process group's ring allreduce in bf16, as plain DDP's
    (ddp.md says so): not checked here."""
    rank, size = dist.get_rank(), dist.get_world_size()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16, device=DEVICE))
            self.b = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16, device=DEVICE))

        def forward(self, g):
            return (self.w * g).sum() + (self.b * g[:8]).sum()

    model = Model()
    ddp = DDP(model)
    hvd_topk.ddp.register(ddp, hvd_topk.ddp.TopKState(density=0.01, exchange=exchange,
                                                      named_parameters=model.named_parameters()))
    ddp(torch.full((4096,), nearly_cancelling(rank, size), dtype=torch.bfloat16, device=DEVICE)).backward()
    want = bfloat16_mean_rounded_once([nearly_cancelling(r, size) for r in range(size)])
    assert model.b.grad.float().eq(want).all(), (exchange, model.b.grad.tolist(), want)
    if exchange != "dense":
        assert float(model.w.grad[0]) == want, (exchange, float(model.w.grad[0]), want)
    assert_same_on_all_ranks(host(model.b.grad.float()), "the small tensor's average")


def check_alone(steps=3, density=0.05):
    """A rank alone in its process group (world size 1: one GPU, or each rank a DDP of its own):
    the hook still compresses with error feedback, completes each bucket at once, and p.grad is
    the numpy contract for one rank, under each exchange."""
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([r]) for r in range(size)]  # every rank makes every group
    for exchange in ("allgather", "sparse_allreduce", "auto"):
        torch.manual_seed(rank)
        model = Net().to(DEVICE)
        ddp = DDP(model, process_group=groups[rank])
        state = hvd_topk.ddp.TopKState(process_group=groups[rank], density=density, min_numel=MIN_NUMEL,
                                       exchange=exchange)
        hvd_topk.ddp.register(ddp, state)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        shadow = copy.deepcopy(model)
        ref = ErrorFeedbackReference(1)
        for step in range(steps):
            shadow.load_state_dict(model.state_dict())
            shadow.zero_grad()
            x, y = batch(step, rank)
            F.cross_entropy(shadow(x), y).backward()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            for name, p in model.named_parameters():
                g = host(shadow.get_parameter(name).grad)
                want = ref.sparse(name, g[None], density) if p.numel() >= MIN_NUMEL else g
                np.testing.assert_allclose(host(p.grad), want, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{exchange}, step {step}, {name}")
            opt.step()
        got = state.stats()
        assert got["steps"] == steps and got["bytes_ratio"] < 0.2, got


def check_state_of_another_replica_group():
    """DDP on subgroups (each rank its own replica here): a TopKState checkpoint records its
    group's global ranks, and one saved by another group's rank of the same rank and size
    (another replica's model) restarts the residuals from zero with a warning, as one of another
    rank does (it loaded silently: a review). ``state_dict()`` on a rank outside the state's
    group says so (it wrote rank -1, which nothing could load)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([r]) for r in range(size)]
    torch.manual_seed(rank)
    model = Net().to(DEVICE)
    ddp = DDP(model, process_group=groups[rank])
    state = hvd_topk.ddp.TopKState(process_group=groups[rank], density=0.05, min_numel=MIN_NUMEL,
                                   exchange="allgather", named_parameters=model.named_parameters())
    hvd_topk.ddp.register(ddp, state)
    x, y = batch(0, rank)
    F.cross_entropy(ddp(x), y).backward()
    mine = state.state_dict()
    assert mine["group_ranks"] == [rank], mine["group_ranks"]
    assert any(bool(t.any()) for t in mine["residuals"].values())
    with raises(ValueError, match="group_ranks=5, not a list of ranks; nothing was loaded", what="group_ranks=5"):
        state.load_state_dict({**mine, "group_ranks": 5})
    assert all(torch.equal(t, state.state_dict()["residuals"][n]) for n, t in mine["residuals"].items()), \
        "a refused checkpoint changed the residuals"
    other = {**mine, "group_ranks": [(rank + 1) % size]}  # rank 0 of 1 too, in another replica's group
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.load_state_dict(copy.deepcopy(mine))
        assert not caught, [str(w.message) for w in caught]
        state.load_state_dict(other)
    assert any("another replica's DDP" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert not any(bool(t.any()) for t in state.state_dict()["residuals"].values()), "residuals kept"
    outside = hvd_topk.ddp.TopKState(process_group=groups[(rank + 1) % size], named_parameters=model.named_parameters())
    with raises(RuntimeError, match="this rank is not in TopKState's process_group", what="state_dict outside"):
        outside.state_dict()


def check_several_buckets():
    state, _ = check_reference(bucket_cap_mb=0.005, steps=4)
    assert len(state.layouts) >= 2, f"expected several DDP buckets, got {len(state.layouts)}"


class _Shuffled(torch.nn.Module):
    """Four 1024-element weights used in the order 0, 2, 1, 3: their gradients are ready in an
    order DDP's first buckets (reverse registration order) do not follow, so after its first
    step DDP rebuilds them, keeping the first bucket (p.3) and swapping the two in the middle."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(1024)) for _ in range(4)])

    def forward(self, x):
        for i in (0, 2, 1, 3):
            x = torch.tanh(x * self.p[i])
        return x.square().sum()


def check_rebuild_keeps_first_bucket(steps=4, density=0.05):
    """DDP's rebuild that keeps bucket 0 and regroups later ones: every residual follows its
    parameter into its new bucket (each step's p.grad and the residuals against the numpy
    contract; before the fix, the tensor moved out of a replaced bucket restarted from zero)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _Shuffled().to(DEVICE)
    ddp = DDP(model, bucket_cap_mb_list=[0.001] * 4)
    state = hvd_topk.ddp.TopKState(density=density, min_numel=MIN_NUMEL, exchange="allgather", method="exact",
                                   named_parameters=model.named_parameters())
    hvd_topk.ddp.register(ddp, state)
    ref = ErrorFeedbackReference(size)
    orders = []
    for step in range(steps):
        x = torch.randn(1024, generator=torch.Generator().manual_seed(1000 * step + rank)).to(DEVICE)
        shadow = copy.deepcopy(model)
        shadow(x).backward()
        model.zero_grad(set_to_none=True)
        ddp(x).backward()
        orders.append({i: [state.names[p] for p in layout.params] for i, layout in sorted(state.layouts.items())})
        for name, p in model.named_parameters():
            grads = np.stack(gather(host(shadow.get_parameter(name).grad)))
            np.testing.assert_allclose(host(p.grad), ref.sparse(name, grads, density), rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step} {name} (buckets {orders[-1]})")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
    assert orders[0] != orders[-1] and orders[0][0] == orders[-1][0], f"no rebuild of the kind meant: {orders}"
    for name, residual in state.state_dict()["residuals"].items():
        np.testing.assert_allclose(host(residual).reshape(-1), ref.residual[rank][name].reshape(-1),
                                   rtol=1e-5, atol=1e-6, err_msg=f"residual {name}")



def check_rewrap_after_unfreezing(steps=4, density=0.05):
    """Fine-tuning's re-wrap: two steps with fc1 frozen, then fc1 unfrozen and the same model in a
    new DDP with the same TopKState (named_parameters= names fc1): every step's p.grad and the
    residuals against the numpy contract, those of fc2 and head2 carried over (before, refused
    as "another DDP model"). A parameter the state was not given by name is still refused."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    model.fc1.requires_grad_(False)
    state = hvd_topk.ddp.TopKState(density=density, min_numel=MIN_NUMEL, exchange="allgather", method="exact",
                                   named_parameters=model.named_parameters())
    ref = ErrorFeedbackReference(size)
    for step in range(steps):
        if step in (0, steps // 2):
            if step:
                model.fc1.requires_grad_(True)
            ddp = DDP(model)
            hvd_topk.ddp.register(ddp, state)
        x, y = batch(step, rank)
        shadow = copy.deepcopy(model)
        F.cross_entropy(shadow(x), y).backward()
        model.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, name
                continue
            grads = np.stack(gather(host(shadow.get_parameter(name).grad)))
            expected = ref.sparse(name, grads, density) if p.numel() >= MIN_NUMEL else grads.mean(0)
            np.testing.assert_allclose(host(p.grad), expected, rtol=1e-5, atol=1e-6, err_msg=f"step {step} {name}")
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.01 * p.grad
    saved = state.state_dict()["residuals"]
    assert set(saved) == {"fc1.weight", "fc2.weight", "head2.weight"}, sorted(saved)
    for name, residual in saved.items():
        np.testing.assert_allclose(host(residual).reshape(-1), ref.residual[rank][name].reshape(-1),
                                   rtol=1e-5, atol=1e-6, err_msg=f"residual {name}")
    other = Net().to(DEVICE)
    ddp = DDP(other)
    with raises(ValueError, match=r"register: TopKState\(named_parameters=\.\.\.\) does not name 6 of the model's",
                what="a second model, through register"):
        hvd_topk.ddp.register(ddp, state)
    ddp.register_comm_hook(state, hvd_topk.ddp.topk_hook)  # (the hook's own check, at its first bucket)
    x, y = batch(steps, rank)
    with raises(RuntimeError, match=r"already serves another DDP model .*not among its named_parameters=",
                what="a second model"):
        F.cross_entropy(ddp(x), y).backward()

def check_stats():
    """bytes_ratio: the run's message bytes over dense fp32 bytes, counted by hand."""
    state, _ = check_reference(steps=3, density=0.05)
    k = k_of(3840, 0.05) + k_of(960, 0.05) * 2
    sent = 3 * (k * 8 + (96 + 10 + 10) * 4)  # pairs (8 bytes each, a multiple of 8) + dense biases
    dense = 3 * sum(p.numel() for p in Net().parameters()) * 4
    got = state.stats()
    assert got["bytes_sent"] == sent and got["bytes_dense"] == dense, got
    assert abs(got["bytes_ratio"] - sent / dense) < 1e-12, got


def check_auto_trial():
    """exchange="auto": after the warm-up and DDP's rebuild (steps 0-1: the fewest bytes), every
    family the cost model proposes runs one settling and one measured step, the ranks agree on
    the fastest agreed median and keep it; every step matches the reference for the family it
    used."""
    state, families = check_reference("auto", steps=11, bucket_cap_mb=0.005, exchange_trial_steps=1)
    trial = state.trial
    assert families[:2] == [None, None], families
    assert families[2:8] == [c for c in trial.candidates for _ in range(2)], (families, trial.candidates)
    # dense fp16 only where values travel in 16 bits already (fp16_values, compact)
    assert set(trial.candidates) == {"dense", "allgather", "sparse_allreduce"}, trial.candidates
    assert trial.medians is not None and trial.choice == min(trial.medians, key=trial.medians.get), trial.medians
    assert families[8:] == [trial.choice] * 3, families
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (trial.choice, trial.medians))
    assert all(e == every[0] for e in every), every


def check_auto_updates():
    """exchange="auto" with ``optimizer=`` (LocalAdamW: each rank's update is exchanged): the
    sparse allreduce, measured to cost such updates quality from 4 ranks on, is used neither in
    the steps before the trial (the fewest bytes: at 5% the sparse allreduce's, for gradients)
    nor in it, and the reason says why."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    ddp = DDP(model, bucket_cap_mb=0.005)
    inner = hvd_topk.LocalAdamW(model.parameters(), lr=0.01, betas=(0.0, 0.95))
    state = hvd_topk.ddp.TopKState(density=0.05, optimizer=inner, min_numel=MIN_NUMEL, exchange_trial_steps=1)
    hvd_topk.ddp.register(ddp, state)
    for step in range(9):
        x, y = batch(step, rank)
        inner.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        inner.step()
        assert_same_on_all_ranks(host(model.fc1.weight), f"parameters after step {step}")
    stats = state.stats()
    assert state.trial.candidates == ["dense", "allgather"], state.trial.candidates
    assert "sparse_allreduce" not in stats["buckets_by_exchange"], stats
    assert "sparse allreduce not tried" in stats["exchange_reason"], stats


def check_local_adamw(steps=4, density=0.05, lr=0.01, betas=(0.0, 0.95), eps=1e-3, wd=0.1, variance_sketch=0,
                      bucket_cap_mb=25, accumulate=1):
    """The AdamW recipe through DDP: each rank's numpy Adam (global variance: v/P + (1-1/P)
    mean^2, lr inside) on its own gradient, the error-feedback contract on those updates, and
    inner.step() applying p * (1 - lr wd) - result. ``variance_sketch`` (at least every
    tensor's size: exact sketches): each estimate rescaled by the bias-corrected EMA (beta2) of
    |the ranks' average gradient|^2 over the earlier steps, over the sum of the rank's previous
    (unrescaled) estimate. ``accumulate``: micro-batches per step, all but the last under
    ``no_sync()`` (one Adam step on their summed gradient, as the reference takes it)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    inner = hvd_topk.LocalAdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                variance_sketch=variance_sketch)
    state = hvd_topk.ddp.TopKState(density=density, optimizer=inner, min_numel=MIN_NUMEL, exchange="allgather")
    ddp.register_comm_hook(state, hvd_topk.ddp.topk_hook)
    shadow = copy.deepcopy(model)
    ref = ErrorFeedbackReference(size)
    moments, measured, last_sums = {}, {}, {}
    for step in range(steps):
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad()
        before = {n: host(p).astype(np.float64) for n, p in model.named_parameters()}
        inner.zero_grad(set_to_none=True)
        for part in range(accumulate):
            x, y = batch(step, rank, part)
            F.cross_entropy(shadow(x), y).backward()
            with ddp.no_sync() if part < accumulate - 1 else contextlib.nullcontext():
                F.cross_entropy(ddp(x), y).backward()
        for name, p in model.named_parameters():
            updates = []
            grads = gather(host(shadow.get_parameter(name).grad).astype(np.float64))
            sq, count = measured.get(name, (0.0, 0))
            if variance_sketch and size > 1:
                measured[name] = (betas[1] * sq + (1 - betas[1]) * np.sum(np.mean(grads, axis=0) ** 2), count + 1)
            for r, g in enumerate(grads):
                m, v, mean = moments.get((r, name), (0.0, 0.0, 0.0))
                m, v = betas[0] * m + (1 - betas[0]) * g, betas[1] * v + (1 - betas[1]) * g * g
                mean = betas[1] * mean + (1 - betas[1]) * g
                moments[(r, name)] = (m, v, mean)
                t = step + 1
                v_hat, mean_hat = v / (1 - betas[1] ** t), mean / (1 - betas[1] ** t)
                if size > 1:
                    v_hat = mean_hat ** 2 + (v_hat - mean_hat ** 2) / size
                    if variance_sketch:
                        unscaled_sum = v_hat.sum()
                        if count:
                            v_hat = v_hat * (sq / (1 - betas[1] ** count)) / last_sums[(r, name)]
                        last_sums[(r, name)] = np.float32(unscaled_sum)
                updates.append(lr * m / (1 - betas[0] ** t) / (np.sqrt(v_hat) + eps))
            updates = np.stack(updates)
            want = ref.sparse(name, updates, density) if p.numel() >= MIN_NUMEL else updates.mean(axis=0)
            np.testing.assert_allclose(host(p.grad), want, rtol=1e-5, atol=1e-7, err_msg=f"step {step} {name}")
        inner.step()
        for name, p in model.named_parameters():
            np.testing.assert_allclose(host(p), before[name] * (1 - lr * wd) - host(p.grad),
                                       rtol=1e-5, atol=1e-7, err_msg=f"parameter {name}")
            assert_same_on_all_ranks(host(p), f"{name} after step {step}")


def check_local_adamw_channels_last():
    """Convolutions in channels_last (DDP lays each weight out in its memory order): LocalAdamW
    with beta1 = 0 keeps exp_avg = this rank's own gradient after one step, element for element
    (the gradient views handed to it are strided as the parameters), against the gradient of a
    copy of the model without DDP."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3)).to(
        DEVICE, memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous() and model[0].weight.is_contiguous(memory_format=torch.channels_last)
    shadow = copy.deepcopy(model)
    ddp = DDP(model)
    inner = hvd_topk.LocalAdamW(model.parameters(), lr=0.01, betas=(0.0, 0.95))
    hvd_topk.ddp.register(ddp, hvd_topk.ddp.TopKState(density=0.05, optimizer=inner, min_numel=100,
                                                      exchange="allgather"))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 3, 9, 9, generator=gen).to(DEVICE, memory_format=torch.channels_last)
    shadow(x).square().mean().backward()
    ddp(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), shadow.parameters()):
        np.testing.assert_allclose(host(inner.state[p]["exp_avg"]), host(q.grad), rtol=1e-6, atol=1e-8,
                                   err_msg=f"{name}: LocalAdamW's first moment is not this rank's gradient")


def local_adamw_recipe():
    """Net under DDP with the hook and ``optimizer=LocalAdamW`` (5%, the allgather)."""
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    ddp = DDP(model)
    inner = hvd_topk.LocalAdamW(model.parameters(), lr=0.01, betas=(0.0, 0.95))
    hvd_topk.ddp.register(ddp, hvd_topk.ddp.TopKState(density=0.05, optimizer=inner, min_numel=MIN_NUMEL,
                                                      exchange="allgather"))
    return model, ddp, inner


def check_local_adamw_misstepped():
    """The recipe stepped wrongly. (a) step() twice after one backward: the second raises that it
    came without a new backward (it once said to pass the optimizer to the hook, which the user
    had done). (b) another optimizer stepped in its place (it takes LocalAdamW's updates in
    p.grad for gradients): the next backward warns once, naming TopKState(optimizer=...); the
    LocalAdamW's parameters then moved only by the other optimizer (hand-checked: plain SGD at
    lr 1 moves each parameter by exactly p.grad, the exchanged update)."""
    rank = dist.get_rank()
    model, ddp, inner = local_adamw_recipe()
    x, y = batch(0, rank)
    inner.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    inner.step()
    with raises(RuntimeError, "called again without a new backward", what="a second step()"):
        inner.step()
    other = torch.optim.SGD(model.parameters(), lr=1.0)
    for step in (1, 2):
        x, y = batch(step, rank)
        other.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            F.cross_entropy(ddp(x), y).backward()
        said = [str(w.message) for w in caught if "was not stepped after the last exchange" in str(w.message)]
        assert len(said) == (1 if step == 2 else 0), (step, said)
        before = {n: host(p).copy() for n, p in model.named_parameters()}
        other.step()
        for n, p in model.named_parameters():
            np.testing.assert_array_equal(host(p), (before[n] - host(p.grad)), err_msg=n)


def check_residuals_channels_last():
    """A checkpoint holds each residual in its parameter's element order, whatever the memory
    format: after one step (exact top-5%) a channels_last weight's saved residual is, entry for
    entry, this rank's own gradient (a copy of the model without DDP) where it was not sent and
    zero where it was; loaded into the same model in either format and saved again, it is the
    same tensor."""
    rank = dist.get_rank()

    def conv(memory_format):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
        model = model.to(DEVICE, memory_format=memory_format)
        ddp = DDP(model)
        state = hvd_topk.ddp.TopKState(density=0.05, method="exact", min_numel=100, exchange="allgather",
                                       named_parameters=model.named_parameters())
        hvd_topk.ddp.register(ddp, state)
        return model, ddp, state
    model, ddp, state = conv(torch.channels_last)
    shadow = copy.deepcopy(model)
    x = torch.randn(4, 3, 9, 9, generator=torch.Generator().manual_seed(rank)).to(
        DEVICE, memory_format=torch.channels_last)
    shadow(x).square().mean().backward()
    ddp(x).square().mean().backward()
    saved = copy.deepcopy(state.state_dict())
    for name in ("0.weight", "2.weight"):
        residual, grad = host(saved["residuals"][name]), host(shadow.get_parameter(name).grad).reshape(-1)
        sent = residual == 0
        assert sent.sum() == k_of(grad.size, 0.05), f"{name}: {sent.sum()} zeros"
        np.testing.assert_array_equal(residual[~sent], grad[~sent], err_msg=f"{name}: residual not in element order")
    for memory_format in (torch.contiguous_format, torch.channels_last):
        _, ddp_b, state_b = conv(memory_format)
        ddp_b(x).square().mean().backward()  # its buckets' layouts exist: the load goes into them
        state_b.load_state_dict(saved)
        again = state_b.state_dict()["residuals"]
        for name in ("0.weight", "2.weight"):
            np.testing.assert_array_equal(host(again[name]), host(saved["residuals"][name]),
                                          err_msg=f"{name} loaded into {memory_format} and saved again")


def check_demo(steps=4, density=0.05, lr=0.05, beta=0.8, wd=0.1, exchange="allgather"):
    """DeMo through the hook: the accumulator is beta * residual + lr * g (TopKState takes DeMo's
    beta as its residual decay), and inner.step() applies p * (1 - lr wd) - lr * sign(result).
    Under ``exchange="auto"`` at a density where a dense allreduce moves fewer bytes, the
    accumulator (DeMo's momentum) is still never sent whole: the same pairs as the allgather's."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    ddp = DDP(model)
    inner = hvd_topk.DeMo(model.parameters(), lr=lr, beta=beta, weight_decay=wd)
    state = hvd_topk.ddp.TopKState(density=density, optimizer=inner, min_numel=MIN_NUMEL, exchange=exchange)
    assert state.residual_decay == beta
    ddp.register_comm_hook(state, hvd_topk.ddp.topk_hook)
    shadow = copy.deepcopy(model)
    ref = ErrorFeedbackReference(size, decay=beta)
    for step in range(steps):
        x, y = batch(step, rank)
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad()
        F.cross_entropy(shadow(x), y).backward()
        before = {n: host(p).copy() for n, p in model.named_parameters()}
        inner.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        for name, p in model.named_parameters():
            fed = np.stack(gather(host(shadow.get_parameter(name).grad))) * np.float32(lr)
            want = ref.sparse(name, fed, density) if p.numel() >= MIN_NUMEL else fed.mean(axis=0)
            np.testing.assert_allclose(host(p.grad), want, rtol=1e-5, atol=1e-9, err_msg=f"step {step} {name}")
        inner.step()
        for name, p in model.named_parameters():
            np.testing.assert_allclose(host(p), before[name] * (1 - lr * wd) - lr * np.sign(host(p.grad)),
                                       rtol=1e-5, atol=1e-7, err_msg=f"parameter {name}")
        assert_same_on_all_ranks(host(torch.cat([q.detach().reshape(-1) for q in model.parameters()])),
                                 f"parameters after step {step}")


def check_auto_after_a_static_graph_rebuild():
    """``DDP(static_graph=True)`` rebuilds its buckets after its second step, not its first:
    ``exchange="auto"``'s trial still proposes from every bucket's layout. The model: the head
    (2570 entries, under ``min_numel=4096``, averaged dense) fills bucket 0 alone after the
    rebuild; the two large weights (8192 and 65536 entries) are sparse. By hand at density 1%,
    P ranks, fp32: the allgather moves (P-1) x 737 x 8 bytes and the sparse allreduce under
    (P-1)/P x 737 x 12, far below a ring allreduce's 2 (P-1)/P x 73728 x 4, so the trial tries
    dense and both sparse families, with a static graph as without. Before 2026-12-06 it
    started at the rebuild with bucket 0's layout alone, no sparse tensor: dense was the only
    candidate, and the job sent dense for good."""
    rank = dist.get_rank()
    for static in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(DEVICE)
        ddp = DDP(model, static_graph=static, bucket_cap_mb=0.01)
        state = hvd_topk.ddp.TopKState(density=0.01, min_numel=4096)
        hvd_topk.ddp.register(ddp, state)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        for step in range(6):
            opt.zero_grad(set_to_none=True)
            x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
            F.cross_entropy(ddp(x.to(DEVICE)), y.to(DEVICE)).backward()
            opt.step()
        assert state.trial is not None, f"static_graph={static}: no trial after 6 steps"
        assert set(state.trial.families) == {"dense", "allgather", "sparse_allreduce"}, \
            f"static_graph={static}: the trial proposed {state.trial.families}"
        del ddp
        gc.collect()


def train(ddp, opt, steps, start=0):
    rank = dist.get_rank()
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()


SCALES = [2.0 ** 10, 2.0 ** 11, 2.0 ** 8, 2.0 ** 8, 2.0 ** 14, 2.0 ** 3]  # the loss scale at each step


def check_grad_scaler(steps=len(SCALES), density=0.05):
    """GradScaler's loop (``scale(loss).backward()``, ``unscale_``, ``step``, ``update``) with
    ``TopKState(grad_scaler=scaler)`` and the scale changing every step (powers of two: exact):
    every step's unscaled p.grad equals the numpy contract fed the true-unit gradients; the
    checkpoint's residuals are in the last step's scale and say so, and a state without a scaler
    loads them in true units. (The residuals were added back at a stale scale, silently: a
    difference as large as the gradient from the second step.) With LocalAdamW it is refused."""
    rank, size = dist.get_rank(), dist.get_world_size()
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=SCALES[0])
    model, ddp, state = build(exchange="allgather", density=density, grad_scaler=scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shadow = copy.deepcopy(model)
    ref = ErrorFeedbackReference(size)
    for step in range(steps):
        x, y = batch(step, rank)
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad()
        F.cross_entropy(shadow(x), y).backward()  # true units
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.cross_entropy(ddp(x), y)).backward()
        scaler.unscale_(opt)
        for name, p in model.named_parameters():
            grads = np.stack(gather(host(shadow.get_parameter(name).grad)))
            want = ref.sparse(name, grads, density) if p.numel() >= MIN_NUMEL else grads.mean(axis=0)
            np.testing.assert_allclose(host(p.grad), want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step} (scale {SCALES[step]:g}) {name}")
        scaler.step(opt)
        scaler.update(new_scale=SCALES[(step + 1) % len(SCALES)])
    saved = copy.deepcopy(state.state_dict())
    assert saved["residual_scale"] == SCALES[steps - 1], saved["residual_scale"]
    for name, r in saved["residuals"].items():
        np.testing.assert_allclose(host(r), ref.residual[rank][name].reshape(-1) * SCALES[steps - 1], rtol=1e-5,
                                   atol=1e-6, err_msg=f"saved residual {name}")
    _, _, plain = build(exchange="allgather", density=density)
    plain.load_state_dict(saved)
    loaded = plain.state_dict()
    assert loaded["residual_scale"] is None, loaded["residual_scale"]
    for name, r in loaded["residuals"].items():
        np.testing.assert_allclose(host(r), ref.residual[rank][name].reshape(-1), rtol=1e-5, atol=1e-7,
                                   err_msg=f"residual {name} loaded without a scaler")
    # that state_dict() was taken before the first step, the residuals still waiting to be placed: a
    # loss-scale change (what the scaler's next step does to them) must not reach into it
    plain.rescale(4.0)
    for name, r in loaded["residuals"].items():
        np.testing.assert_allclose(host(r), ref.residual[rank][name].reshape(-1), rtol=1e-5, atol=1e-7,
                                   err_msg=f"the kept state_dict's residual {name} after a rescale")
    with raises(ValueError, "does not support loss scaling", what="LocalAdamW with a GradScaler"):
        hvd_topk.ddp.TopKState(optimizer=hvd_topk.LocalAdamW(model.parameters()), grad_scaler=scaler)
    with raises(TypeError, "grad_scaler must be a torch.amp.GradScaler", what="another object"):
        hvd_topk.ddp.TopKState(grad_scaler=object())


def check_auto_trial_after_resume(find_unused=True):
    """exchange="auto" loaded from a checkpoint into a fresh DDP, the first bucket holding no
    sparse tensor (min_numel 1000 leaves only fc1.weight sparse): the trial proposes what the
    run that never stopped proposed. With find_unused_parameters=True DDP keeps its first
    buckets (the trial was once proposed at the first resumed step, from the one bucket seen by
    then, and left dense alone: compression off for the rest of the run); without, it rebuilds
    them after this process's first step (the trial once started at the resumed run's second
    step, while the layouts of the buckets after 0 had just been dropped)."""
    options = dict(bucket_cap_mb=0.005, exchange="auto", exchange_trial_steps=1, min_numel=1000,
                   ddp_kwargs={"find_unused_parameters": find_unused})
    model, ddp, state = build(**options)
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 8)
    want = state.trial.candidates
    assert "allgather" in want, want
    model_b, ddp_b, state_b = build(**options)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
    train(ddp_b, opt_b, 3)
    saved = copy.deepcopy({"model": model_b.state_dict(), "opt": opt_b.state_dict(), "topk": state_b.state_dict()})
    model_c, ddp_c, state_c = build(**options)
    opt_c = torch.optim.SGD(model_c.parameters(), lr=0.1)
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    state_c.load_state_dict(saved["topk"])
    train(ddp_c, opt_c, 10, start=3)  # (the trial starts at this process's third step and runs 6)
    assert state_c.trial is not None and state_c.trial.candidates == want, (state_c.trial.candidates, want)
    assert state_c.trial.choice in want and state_c.stats()["bytes_ratio"] < 1, state_c.stats()


def check_resume(bucket_cap_mb=0.005, compiled_names=False, **state_kwargs):
    """Model, optimizer and TopKState saved at step 3 and loaded into fresh objects (a new DDP,
    which starts from its initial buckets again): bitwise equal at step 7 to the run that never
    stopped; residuals restored by name (``compiled_names``: the new state named after
    ``torch.compile(model)``'s parameters, "_orig_mod.fc1.weight", the saved one after the
    model's own)."""
    def fresh(seed=0, names_of=lambda model: model.named_parameters()):
        model, ddp, state = build(bucket_cap_mb, seed=seed, density=0.05, warmup_steps=2, warmup_density=0.5,
                                  exchange="allgather", names_of=names_of, **state_kwargs)
        return model, ddp, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state
    model, ddp, opt, state = fresh()
    train(ddp, opt, 7)
    model_b, ddp_b, opt_b, state_b = fresh()
    train(ddp_b, opt_b, 3)
    saved = copy.deepcopy({"model": model_b.state_dict(), "opt": opt_b.state_dict(), "topk": state_b.state_dict()})
    assert saved["topk"]["iteration"] == 3 and any(float(r.abs().sum()) for r in saved["topk"]["residuals"].values())
    compiled = lambda model: torch.compile(model).named_parameters()  # names only: nothing is compiled
    model_c, ddp_c, opt_c, state_c = fresh(123, *([compiled] if compiled_names else []))
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    state_c.load_state_dict(saved["topk"])
    train(ddp_c, opt_c, 4, start=3)
    for (name, a), c in zip(model.named_parameters(), model_c.parameters()):
        assert torch.equal(a, c), f"resume: {name} differs (max {float((a - c).abs().max())})"
    # the counts carried: the whole run's (not the buckets per exchange: the new DDP exchanges its
    # initial buckets, as many as DDP's first layout has, until its rebuild)
    whole, resumed = state.stats(), state_c.stats()
    for key in ("steps", "bytes_sent", "bytes_dense", "elements_total", "elements_selected"):
        assert resumed[key] == whole[key] > 0, (key, resumed[key], whole[key])
    mine, theirs = state.state_dict()["residuals"], state_c.state_dict()["residuals"]
    if compiled_names:
        assert sorted(theirs) == sorted(f"_orig_mod.{n}" for n in mine), sorted(theirs)
        theirs = {n.replace("_orig_mod.", ""): t for n, t in theirs.items()}
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
    # saved on another rank: residuals restart from zero, with a warning; the step is kept
    other = copy.deepcopy(saved["topk"])
    other["rank"] = (dist.get_rank() + 1) % dist.get_world_size()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state_c.load_state_dict(other)
    assert any("residuals start from zero" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert state_c.iteration == 3 and all(float(r.abs().sum()) == 0 for r in state_c.state_dict()["residuals"].values())


def check_resume_local_adamw():
    """The AdamW recipe through the hook (``LocalAdamW``, 16-bit values, a dense start over 2
    steps, a cosine learning rate), saved after step 3's ``step()`` as docs/ddp.md says (the
    model, the inner optimizer, its scheduler and the state, one file per rank) and loaded into
    fresh objects (a new DDP, back at its initial buckets): bitwise equal at step 7 to the run
    that never stopped, on every rank (truth: that run). The moments are each rank's own (they
    differ between the ranks: rank 0's file loaded everywhere would not continue the run)."""
    rank = dist.get_rank()

    def fresh(seed=0):
        torch.manual_seed(seed)
        model = Net().to(DEVICE)
        ddp = DDP(model, bucket_cap_mb=0.005)
        inner = hvd_topk.LocalAdamW(model.parameters(), lr=1e-2, betas=(0.0, 0.95), weight_decay=0.1)
        state = hvd_topk.ddp.TopKState(density=0.05, fp16_values=True, optimizer=inner, warmup_steps=2,
                                       warmup_density=1.0, exchange="allgather", min_numel=MIN_NUMEL,
                                       named_parameters=model.named_parameters())
        hvd_topk.ddp.register(ddp, state)
        return model, ddp, inner, torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=7), state

    def train_scheduled(ddp, inner, schedule, steps, start=0):
        for step in range(start, start + steps):
            x, y = batch(step, rank)
            inner.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            inner.step()
            schedule.step()

    model, ddp, inner, schedule, state = fresh()
    train_scheduled(ddp, inner, schedule, 7)
    model_b, ddp_b, inner_b, schedule_b, state_b = fresh()
    train_scheduled(ddp_b, inner_b, schedule_b, 3)
    saved = copy.deepcopy({"model": model_b.state_dict(), "opt": inner_b.state_dict(),
                           "schedule": schedule_b.state_dict(), "topk": state_b.state_dict()})
    moments = [float(m) for m in gather(float(saved["opt"]["state"][0]["exp_avg_sq"].double().sum()))]
    assert len(set(moments)) == dist.get_world_size(), f"the ranks' moments are alike: {moments}"
    model_c, ddp_c, inner_c, schedule_c, state_c = fresh(123)
    model_c.load_state_dict(saved["model"])
    inner_c.load_state_dict(saved["opt"])
    schedule_c.load_state_dict(saved["schedule"])
    state_c.load_state_dict(saved["topk"])
    train_scheduled(ddp_c, inner_c, schedule_c, 4, start=3)
    for (name, a), c in zip(model.named_parameters(), model_c.parameters()):
        assert torch.equal(a, c), f"LocalAdamW resume: {name} differs (max {float((a - c).abs().max())})"
        assert torch.equal(inner.state[a]["exp_avg_sq"], inner_c.state[c]["exp_avg_sq"]), f"{name}'s moments"


def check_save_between_backward_and_step_warns():
    """``TopKState.state_dict()`` after a step's backward and before ``optimizer.step()``: the
    step's unsent gradient is in the residuals already, and a resume that does the step again
    counts it twice (a run resumed from there ends elsewhere than one that never stopped, by
    4e-4 in a review's trial). It warns; before the first step and after ``step()`` it does not."""
    model, ddp, state = build(0.005, density=0.05, exchange="allgather")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def saved_warnings():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state.state_dict()
        return [str(w.message) for w in caught if "counts it twice" in str(w.message)]

    assert not saved_warnings(), "before the first step"
    train(ddp, opt, 2)
    assert not saved_warnings(), "after step()"
    x, y = batch(2, dist.get_rank())
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(ddp(x), y).backward()
    assert saved_warnings(), "between backward() and step(): no warning"
    opt.step()
    assert not saved_warnings(), "after that step()"
    # a fused AdamW moves the parameters without bumping their version counters: its step counts
    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = batch(3, dist.get_rank())
    fused.zero_grad(set_to_none=True)
    F.cross_entropy(ddp(x), y).backward()
    fused.step()
    assert not saved_warnings(), "after a fused AdamW's step()"


def _messages_of_steps(forward, opt, steps, clip=None):
    """The warnings' messages of ``steps`` training steps (``forward`` the model or its DDP
    wrapper, ``opt`` stepped); ``clip``: parameters to ``clip_grad_norm_`` to 1e-3 between
    backward() and the step."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            x, y = batch(step, dist.get_rank())
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(forward(x), y).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(clip, 1e-3)
            opt.step()
    return [str(w.message) for w in caught]


def check_plain_adam_behind_hook_warns():
    """torch's Adam family stepping parameters the hook compresses with error feedback and no
    ``optimizer=`` (the configuration that ends +32.7% on docs/adamw.md's GPT): one warning on
    every rank, after its first step, naming the LocalAdamW recipe (the hook never sees the
    optimizer; Horovod's front end warns at construction). SGD, Adam without error feedback,
    and an Adam over a model the hook does not serve are not warned of."""
    def warned(make_opt, **state_kwargs):
        model, ddp, state = build(**{"density": 0.05, "exchange": "allgather", **state_kwargs})
        opt = make_opt(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(ddp, opt, 3)
        return [str(w.message) for w in caught if "the DDP hook compresses" in str(w.message)]

    class MyAdam(torch.optim.Adam):
        pass

    got = warned(lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert len(got) == 1 and "gradients that torch.optim.AdamW applies" in got[0] and "optimizer=inner" in got[0], got
    got = warned(lambda model: MyAdam(model.parameters(), lr=1e-3))
    assert len(got) == 1 and "MyAdam (a torch.optim.Adam)" in got[0], got
    assert warned(lambda model: torch.optim.SGD(model.parameters(), lr=0.1)) == []
    assert warned(lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3), error_feedback=False) == []
    assert warned(lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3), exchange="dense") == []
    served, ddp, state = build(density=0.05, exchange="allgather")  # a state that has seen its buckets,
    train(ddp, torch.optim.SGD(served.parameters(), lr=0.1), 1)      # alive while an unrelated Adam steps
    assert state.layouts
    other = Net()  # not behind the hook: its own gradients, no DDP
    said = _messages_of_steps(other, torch.optim.AdamW(other.parameters(), lr=1e-3), 2)
    assert not [m for m in said if "the DDP hook compresses" in m], "an Adam the hook does not serve"


def _local_adamw_clipped(clip, view):
    """Three steps of the LocalAdamW recipe through the hook, ``clip``: ``clip_grad_norm_``
    between backward() and the step; ``view``: DDP's ``gradient_as_bucket_view``. The model and
    the messages of the changed-update warning."""
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    ddp = DDP(model, bucket_cap_mb=0.005, gradient_as_bucket_view=view)
    inner = hvd_topk.LocalAdamW(model.parameters(), lr=1e-2, betas=(0.0, 0.95))
    state = hvd_topk.ddp.TopKState(density=0.05, optimizer=inner, exchange="allgather", min_numel=MIN_NUMEL,
                                   named_parameters=model.named_parameters())
    hvd_topk.ddp.register(ddp, state)
    said = _messages_of_steps(ddp, inner, 3, clip=list(model.parameters()) if clip else None)
    return model, [m for m in said if "was written to between backward()" in m]


def check_clipping_local_adamw_update_warns(view):
    """Over LocalAdamW, after backward ``p.grad`` holds the ranks' averaged update, which DDP
    wrote there (a copy, or the bucket itself with ``gradient_as_bucket_view``): a dense loop's
    ``clip_grad_norm_`` before the step alters the step every rank agreed on. One warning on every
    rank, naming a parameter; the plain loop is not warned of. Truth for the clipped run: its
    weights differ from the plain run's (the clipping was applied), alike on every rank."""
    clipped, said = _local_adamw_clipped(True, view)
    plain, quiet = _local_adamw_clipped(False, view)
    assert quiet == [], quiet
    assert len(said) == 1 and "over LocalAdamW" in said[0] and "'fc1.weight'" in said[0], said
    assert not torch.equal(clipped.fc1.weight, plain.fc1.weight), "the clipping was not applied"
    for name, p in clipped.named_parameters():
        assert_same_on_all_ranks(p.detach().cpu().numpy(), f"clipped LocalAdamW update: {name}")


def check_resume_fewer_sparse():
    """A checkpoint loaded with a larger min_numel (1000: fc2 and head2, 960 elements each, go
    dense): their saved residuals are dropped with a warning naming them, at the end of the first
    step when loaded before it, at once when loaded later; fc1's is kept, and ``state_dict()``
    saves only it from then on."""
    def fresh(min_numel):
        model, ddp, state = build(0.005, min_numel=min_numel, density=0.05, exchange="allgather")
        return model, ddp, torch.optim.SGD(model.parameters(), lr=0.1), state
    _, ddp, opt, state = fresh(MIN_NUMEL)
    train(ddp, opt, 3)
    saved = copy.deepcopy(state.state_dict())
    assert sorted(saved["residuals"]) == ["fc1.weight", "fc2.weight", "head2.weight"], sorted(saved["residuals"])
    dropped = "2 saved error-feedback residual(s) match no parameter that this TopKState exchanges"
    for loaded_after_steps in (0, 1):
        _, ddp_b, opt_b, state_b = fresh(1000)
        train(ddp_b, opt_b, loaded_after_steps)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state_b.load_state_dict(saved)
            train(ddp_b, opt_b, 1, start=3)
        said = [str(w.message) for w in caught if "saved error-feedback" in str(w.message)]
        assert len(said) == 1 and dropped in said[0] and "fc2.weight, head2.weight" in said[0], said
        assert state_b.pending == {} and sorted(state_b.state_dict()["residuals"]) == ["fc1.weight"]


def check_nonfinite(host_reads=True):
    """An inf in one rank's gradient reaches every rank's result (GradScaler would skip the step
    everywhere), that rank's residual is reset, and the next step is finite again. With the
    sparse allreduce the culprit is not the leader: its flag slot carries the news. With the
    dense fp16 exchange (whose residual keeps float16's rounding) an inf, and 1e5, which float16
    cannot hold, reset the tensor's residual all the same. ``host_reads=False``: the residual's
    inf/nan looked for as on a GPU, flags on the device that the host never reads."""
    rank, size = dist.get_rank(), dist.get_world_size()
    saved = hvd_topk.ddp_exchange.HOST_READS_FREE
    hvd_topk.ddp_exchange.HOST_READS_FREE = saved if host_reads else ()
    try:
        _check_nonfinite(rank, size)
    finally:
        hvd_topk.ddp_exchange.HOST_READS_FREE = saved


def _check_nonfinite(rank, size):
    for exchange, culprit, value in (("allgather", 0, float("inf")), ("sparse_allreduce", size - 1, float("inf")),
                                     ("dense_fp16", 0, float("inf")), ("dense_fp16", size - 1, 1e5)):
        model, ddp, state = build(exchange=exchange, density=0.05)
        x, y = batch(0, rank)
        handle = model.fc1.weight.register_hook(
            lambda g: g.index_fill(1, torch.tensor([3], device=g.device), value) if rank == culprit else g)
        F.cross_entropy(ddp(x), y).backward()
        handle.remove()
        assert not bool(torch.isfinite(model.fc1.weight.grad).all()), f"{exchange}: inf did not reach rank {rank}"
        residual = state.state_dict()["residuals"]["fc1.weight"]
        assert bool(torch.isfinite(residual).all()), f"{exchange}: residual kept inf"
        if rank == culprit:
            assert not bool(residual.any()), f"{exchange}, {value}: the culprit's residual was not reset"
        assert state.stats()["nonfinite_resets"] == (1 if rank == culprit else 0), state.stats()
        model.zero_grad(set_to_none=True)
        x, y = batch(1, rank)
        F.cross_entropy(ddp(x), y).backward()
        assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()), f"{exchange}: step after"


def check_nonfinite_local_adamw():
    """The AdamW recipe through the hook: an inf in rank 0's gradient reaches every rank (the
    step is skipped, as a GradScaler would) and rank 0's LocalAdamW moments do not take it in
    (they held inf for good, and every later step was NaN). Truth: after three finite steps
    more, rank 0's fc1 moments have counted three Adam steps, every other tensor four, all
    finite, and the parameters are the same on every rank."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    inner = hvd_topk.LocalAdamW(model.parameters(), lr=0.01, betas=(0.0, 0.95), weight_decay=0.1)
    ddp = DDP(model)
    state = hvd_topk.ddp.TopKState(density=0.05, min_numel=MIN_NUMEL, optimizer=inner, exchange="allgather",
                                   named_parameters=model.named_parameters())
    hvd_topk.ddp.register(ddp, state)
    handle = model.fc1.weight.register_hook(
        lambda g: g.index_fill(1, torch.tensor([3], device=g.device), float("inf")) if rank == 0 else g)
    x, y = batch(0, rank)
    F.cross_entropy(ddp(x), y).backward()
    handle.remove()
    assert not bool(torch.isfinite(model.fc1.weight.grad).all()), "inf did not reach this rank's result"
    inner.zero_grad(set_to_none=True)  # skipped
    train(ddp, inner, 3, start=1)
    for name, p in model.named_parameters():
        moments = inner.state[p]
        want = 3 if (rank == 0 and name == "fc1.weight") else 4
        assert int(moments["step"]) == want, f"{name}: {int(moments['step'])} Adam steps, expected {want}"
        assert all(bool(torch.isfinite(t).all()) for t in moments.values() if torch.is_tensor(t)), name
        assert_same_on_all_ranks(host(p), f"after the skipped step: {name}")


def check_join_local_adamw_no_false_warning():
    """Join with ``optimizer=LocalAdamW``, rank r running 2 + 2r steps: a joined rank's hook runs
    on zero buckets outside any backward and marks its updates as made; no rank was told its
    optimizer was not stepped (the joined one once was, and it must not step)."""
    from torch.distributed.algorithms.join import Join
    rank = dist.get_rank()
    model, ddp, inner = local_adamw_recipe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Join([ddp]):
            train(ddp, inner, 2 + 2 * rank)
    said = [str(w.message) for w in caught if "was not stepped after the last exchange" in str(w.message)]
    assert not said, said


def check_join_local_adamw_leaves_the_joined_optimizer_alone(steps_of=lambda r: 2 + 2 * r):
    """Join with ``optimizer=LocalAdamW`` at beta1 0.9 (so that a zero gradient's update is not
    zero), rank r running 2 + 2r steps. A joined rank contributes zeros and its optimizer is left
    alone, as torch's AdamW under plain DDP: its moments and step count stay as its last step
    left them (found by a review, 2026-12-06: its hook ran LocalAdamW on the zero buckets,
    advancing them, and sent updates made of no data). The truth for the last rank: every rank's
    LocalAdamW simulated here on a model without DDP, at density 1 (the exchange then only
    averages): each step the sum of the active ranks' updates over the group's size."""
    from torch.distributed.algorithms.join import Join
    rank, size = dist.get_rank(), dist.get_world_size()
    options = dict(lr=0.01, betas=(0.9, 0.95))
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    copies = [copy.deepcopy(model) for _ in range(size)]  # the reference: one model per rank
    ddp = DDP(model)
    inner = hvd_topk.LocalAdamW(model.parameters(), **options)
    hvd_topk.ddp.register(ddp, hvd_topk.ddp.TopKState(density=1.0, optimizer=inner, min_numel=MIN_NUMEL,
                                                      exchange="allgather"))
    with Join([ddp]):
        train(ddp, inner, steps_of(rank))
        left = copy.deepcopy(inner.state_dict()["state"])  # as its last step left it
    for index, state in inner.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(left[index][key])), (
                f"rank {rank}: LocalAdamW's {key} of parameter {index} changed after this rank joined")
    refs = [hvd_topk.LocalAdamW(c.parameters(), **options) for c in copies]
    for step in range(steps_of(size - 1)):
        active = [r for r in range(size) if step < steps_of(r)]
        updates = []
        for r in active:
            x, y = batch(step, r)
            grads = torch.autograd.grad(F.cross_entropy(copies[r](x), y), list(copies[r].parameters()))
            for p, g in zip(copies[r].parameters(), grads):
                refs[r].transform_local_gradient(p, g, size)
            updates.append(grads)
        for r in active:
            for i, p in enumerate(copies[r].parameters()):
                p.grad = sum(u[i] for u in updates) / size
            refs[r].step()
    if rank == size - 1:
        for (name, p), q in zip(model.named_parameters(), copies[rank].parameters()):
            np.testing.assert_allclose(host(p), host(q), rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name}: the last rank after Join, against its reference")


def check_join(zero_after_step=False):
    """Uneven inputs under DDP's ``Join``: rank r runs 3 + r steps; a joined rank's DDP runs the
    hook on zero buckets (its residual still sends). The truth: the same job with even inputs,
    where the ranks that have run out take steps of zero loss instead (zero gradients through
    the same hook, in the same order). The last rank to join ends bitwise where that run ends,
    and Join leaves every rank with its parameters. ``zero_after_step``: the loop calls
    ``zero_grad(set_to_none=True)`` after ``step()``, so a joined rank's gradients are None; its
    residual still sends (it was held back as if the rank had left those parameters out)."""
    from torch.distributed.algorithms.join import Join
    rank, size = dist.get_rank(), dist.get_world_size()
    last = 3 + size - 1

    def run(joined):
        model, ddp, state = build(exchange="allgather", bucket_cap_mb=0.005)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mine = 3 + rank
        if joined and zero_after_step:
            with Join([ddp]):
                for step in range(mine):
                    x, y = batch(step, rank)
                    F.cross_entropy(ddp(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        elif joined:
            with Join([ddp]):
                train(ddp, opt, mine)
        else:
            for step in range(last):
                x, y = batch(step, rank)
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(ddp(x), y)
                (loss if step < mine else loss * 0.0).backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()]
    uneven, even = run(True), run(False)
    assert_same_on_all_ranks(host(torch.cat([p.reshape(-1) for p in uneven])), "parameters after Join")
    if rank == size - 1:
        for a, b in zip(uneven, even):
            assert torch.equal(a, b), f"Join differs from zero-gradient steps (max {float((a - b).abs().max())})"


def check_bad_input():
    P = hvd_topk.ddp.TopKState
    for kwargs, error, match in [({"density": 0.0}, ValueError, "density"), ({"density": 1.5}, ValueError, "density"),
                                 ({"density": "0.01"}, TypeError, "density"),
                                 ({"exchange": "ring"}, ValueError, "exchange must be one of"),
                                 ({"optimizer": torch.optim.SGD(Net().parameters(), lr=0.1)}, TypeError,
                                  "transform_local_gradient"),
                                 ({"residual_decay": 0.0}, ValueError, "residual_decay"),
                                 ({"residual_decay": 0.9, "error_feedback": False}, ValueError, "needs error_feedback"),
                                 ({"warmup_steps": -1}, ValueError, "warmup_steps"),
                                 ({"compact": 1}, TypeError, "compact must be True, False or 'sign'"),
                                 ({"compact": "sign", "error_feedback": False}, ValueError,
                                  "compact='sign' sends each value as its sign"),
                                 ({"compact": True, "fp16_values": True}, ValueError, "choose one"),
                                 ({"compact": True, "exchange": "sparse_allreduce"}, ValueError,
                                  "compact=True packs the allgather's pairs"),
                                 ({"named_parameters": Net().parameters()}, TypeError,
                                  "named_parameters must be model.named_parameters"),
                                 ({"named_parameters": 5}, TypeError, "named_parameters must be model.named_parameters"),
                                 # a dict iterates over its names: the message says what to pass
                                 ({"named_parameters": dict(Net().named_parameters())}, TypeError,
                                  r"of a dict of them, pass its \.items\(\)"),
                                 # each submodule's own named_parameters(): 'weight' and 'bias' twice
                                 # (their residuals overwrote each other in checkpoints, in silence)
                                 ({"named_parameters": [*Net().fc1.named_parameters(), *Net().fc2.named_parameters()]},
                                  ValueError, "named_parameters gives one name to different parameters .*: bias, weight"),
                                 ({"process_group": "world"}, TypeError, "process_group must be None")]:
        with raises(error, match=match, what=str(kwargs)):
            P(**kwargs)
    tied = Net()
    P(named_parameters=[*tied.named_parameters(), ("alias.weight", tied.fc1.weight)])  # one parameter, two names: fine
    with raises(TypeError, match=re.escape("the density is a keyword argument: TopKState(density=...)"),
                what="TopKState(0.01)"):
        P(0.01)
    # a process group that is not DDP's
    solo = dist.new_group([0])
    model = Net().to(DEVICE)
    ddp = DDP(model)
    with raises(ValueError, match="process group", what="register with another group"):
        hvd_topk.ddp.register(ddp, P(process_group=solo))
    # one that splits DDP's group into parts holding whole replicas (a group per rank here, per
    # node in a job): each part agrees with itself at the first bucket, so only register() tells
    parts = [dist.new_group([r]) for r in range(dist.get_world_size())]
    with raises(ValueError, match="process group", what="register with a group per rank"):
        hvd_topk.ddp.register(ddp, P(process_group=parts[dist.get_rank()]))
    with raises(TypeError, match=r"takes the DistributedDataParallel model, got a Net: wrap it first",
                what="register on the plain model"):
        hvd_topk.ddp.register(Net(), P())
    with raises(TypeError, match=r"got what torch.compile made of it: register the hook first, then compile",
                what="register on the compiled DDP model"):  # (before: told to wrap what was wrapped)
        hvd_topk.ddp.register(torch.compile(DDP(Net().to(DEVICE))), P())
    # no state, or the class where an instance belongs: said so (before: AttributeErrors, at the first backward)
    with raises(TypeError, match="hook needs a hvd_topk.ddp.TopKState as its state, got a NoneType: build one",
                what="register(ddp, None)"):
        hvd_topk.ddp.register(DDP(Net().to(DEVICE)), None)
    with raises(TypeError, match="got the class TopKState itself", what="register(ddp, TopKState)"):
        hvd_topk.ddp.register(DDP(Net().to(DEVICE)), P)
    classed = DDP(Net().to(DEVICE))
    classed.register_comm_hook(P, hvd_topk.ddp.topk_hook)
    x, y = batch(0, dist.get_rank())
    with raises((TypeError, RuntimeError), match="got the class TopKState itself", what="the class as the hook's state"):
        F.cross_entropy(classed(x), y).backward()
    # one state shared by two DDP models: refused at the second model's first bucket
    shared = P(min_numel=MIN_NUMEL)
    first, second = DDP(Net().to(DEVICE)), DDP(Net().to(DEVICE))
    first.register_comm_hook(shared, hvd_topk.ddp.topk_hook)
    second.register_comm_hook(shared, hvd_topk.ddp.topk_hook)
    x, y = batch(0, dist.get_rank())
    F.cross_entropy(first(x), y).backward()
    with raises(RuntimeError, match="already serves another DDP model", what="a state shared by two models"):
        F.cross_entropy(second(x), y).backward()
    # the same with named_parameters= naming both (a GAN's two networks in one container): refused
    # at the second model's first step (before 2026-12-06 each model's first bucket took the
    # other's layouts for a rebuild, and their residuals were dropped at every turn)
    both = torch.nn.ModuleDict({"gen": Net(), "disc": Net()}).to(DEVICE)
    named = P(min_numel=MIN_NUMEL, named_parameters=both.named_parameters())
    first, second = DDP(both["gen"]), DDP(both["disc"])
    first.register_comm_hook(named, hvd_topk.ddp.topk_hook)
    second.register_comm_hook(named, hvd_topk.ddp.topk_hook)
    F.cross_entropy(first(x), y).backward()
    with raises(RuntimeError, match=r"serves two DDP models .*e\.g\. gen\.", what="a named state shared by two models"):
        F.cross_entropy(second(x), y).backward()
    # a complex parameter (DDP reduces its real view: twice the elements) and sparse gradients
    class Complex(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(1024, dtype=torch.complex64))

        def forward(self, x):
            return (x * self.w).abs().sum()

    class SparseEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(1000, 16, sparse=True)

        def forward(self, x):
            return self.emb(x).sum()

    for module, inputs, match in [(Complex(), torch.randn(1024), "parameter 'w' is complex"),
                             (SparseEmbedding(), torch.randint(0, 1000, (8,)), "sparse gradients")]:
        module = module.to(DEVICE)
        ddp = DDP(module)
        hvd_topk.ddp.register(ddp, P(min_numel=MIN_NUMEL, named_parameters=module.named_parameters()))
        with raises(TypeError, match=match, what=type(module).__name__):
            ddp(inputs.to(DEVICE)).backward()
    # an optimizer= that holds only some of the model's parameters
    model = Net().to(DEVICE)
    ddp = DDP(model)
    ddp.register_comm_hook(P(min_numel=MIN_NUMEL, named_parameters=model.named_parameters(),
                             optimizer=hvd_topk.LocalAdamW(model.fc1.parameters())), hvd_topk.ddp.topk_hook)
    with raises(ValueError, match=r"parameter '(fc2|head2)\.\w+' .* is not in that optimizer", what="optimizer of part"):
        F.cross_entropy(ddp(x), y).backward()
    # the reverse: an optimizer= that holds a parameter outside the DDP model (a learnable temperature
    # kept apart) had its raw gradient applied as an exchanged update, in silence
    model = Net().to(DEVICE)
    temperature = torch.nn.Parameter(torch.ones(()))
    ddp = DDP(model)
    ddp.register_comm_hook(P(min_numel=MIN_NUMEL, named_parameters=model.named_parameters(),
                             optimizer=hvd_topk.LocalAdamW([*model.parameters(), temperature])),
                           hvd_topk.ddp.topk_hook)
    with raises(ValueError, match=r"holds parameter #6 \(shape \(\)\), which is not in the DDP model's buckets",
                what="an optimizer parameter outside the model"):
        (F.cross_entropy(ddp(x), y) * temperature).backward()
    # the same parameter added after the first step (add_param_group), and a layer unfrozen after DDP
    # was built: refused at that step's end too (before 2026-12-06 only the first step was checked,
    # and each rank applied its own raw gradient of it, the ranks drifting apart)
    model = Net().to(DEVICE)
    temperature = torch.nn.Parameter(torch.ones(()))
    inner = hvd_topk.LocalAdamW(model.parameters())
    ddp = DDP(model)
    hvd_topk.ddp.register(ddp, P(min_numel=MIN_NUMEL, named_parameters=model.named_parameters(), optimizer=inner))
    F.cross_entropy(ddp(x), y).backward()
    inner.step()
    inner.add_param_group({"params": [temperature]})
    inner.zero_grad()
    with raises(ValueError, match=r"holds parameter #6 \(shape \(\)\), which is not in the DDP model's buckets",
                what="an optimizer parameter added after the first step"):
        (F.cross_entropy(ddp(x), y) * temperature).backward()
    model = Net().to(DEVICE)
    model.head2.weight.requires_grad_(False)
    inner = hvd_topk.LocalAdamW(model.parameters())
    ddp = DDP(model)
    hvd_topk.ddp.register(ddp, P(min_numel=MIN_NUMEL, named_parameters=model.named_parameters(), optimizer=inner))
    F.cross_entropy(ddp(x), y).backward()
    inner.step()
    model.head2.weight.requires_grad_(True)
    inner.zero_grad()
    with raises(ValueError, match=r"not in the DDP model's buckets.*wrap the model in DDP again",
                what="a layer unfrozen after DDP was built"):
        F.cross_entropy(ddp(x), y).backward()
    # the same through hvd_topk.ddp.register, which has the model: refused there, naming what is missing
    model = Net().to(DEVICE)
    with raises(ValueError, match=r"register: TopKState\(named_parameters=\.\.\.\) does not name \d+ of the model's "
                                  r"trainable parameters \(fc2\.weight, ", what="register: part of the model's names"):
        hvd_topk.ddp.register(DDP(model), P(min_numel=MIN_NUMEL, named_parameters=model.fc1.named_parameters()))
    model = Net().to(DEVICE)
    with raises(ValueError, match=r"register: TopKState\(optimizer=\.\.\.\) does not hold 2 of the model's trainable "
                                  r"parameters \(fc1\.weight, fc1\.bias\)", what="register: an optimizer without fc1"):
        hvd_topk.ddp.register(DDP(model), P(min_numel=MIN_NUMEL, optimizer=hvd_topk.LocalAdamW(
            [p for n, p in model.named_parameters() if not n.startswith("fc1.")])))
    # parameters DDP does not reduce (told to ignore them) need neither a name nor a place in optimizer=
    model = Net().to(DEVICE)
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["head2.weight", "head2.bias"])
    hvd_topk.ddp.register(DDP(model), P(min_numel=MIN_NUMEL, named_parameters=[
        (n, p) for n, p in model.named_parameters() if not n.startswith("head2.")], optimizer=hvd_topk.LocalAdamW(
        [p for n, p in model.named_parameters() if not n.startswith("head2.")])))
    # named_parameters= of another model, or of part of this one: refused at the first bucket, where
    # training ran and state_dict() failed later with a bare KeyError
    for label, named in (("another model's", lambda m: Net().named_parameters()),
                         ("part of the model's", lambda m: m.fc1.named_parameters())):
        model = Net().to(DEVICE)
        ddp = DDP(model)
        ddp.register_comm_hook(P(min_numel=MIN_NUMEL, named_parameters=named(model)), hvd_topk.ddp.topk_hook)
        with raises(ValueError, match=r"does not name parameter #\d+ \(shape .*model.named_parameters\(\), all of them",
                    what=f"named_parameters of {label}"):
            F.cross_entropy(ddp(x), y).backward()
    # a setting or the step differing on the last rank: every rank refuses at the first bucket, naming it,
    # where before the exchange hung until gloo's timeout, aborted in gloo or failed on a message size
    last = dist.get_world_size() - 1
    odd = dist.get_rank() == last
    for field, kwargs in (("density", {"density": 0.1 if odd else 0.05}),
                          ("exchange", {"exchange": "dense" if odd else "allgather"}),
                          ("warmup_steps", {"warmup_steps": 4 if odd else 0, "warmup_density": 1.0}),
                          ("optimizer= (its class and param-group options)", {"class": True}),
                          ("optimizer= (its class and param-group options)", {"variance_sketch": 64 if odd else 0}),
                          ("the step (a checkpoint loaded on some ranks only?)", {})):
        model = Net().to(DEVICE)
        if "class" in kwargs:  # LocalAdamW on the last rank only
            kwargs = {"optimizer": hvd_topk.LocalAdamW(model.parameters())} if odd else {}
        elif "variance_sketch" in kwargs:  # the sketch on the last rank only: its exchange hung, or gloo aborted
            kwargs = {"optimizer": hvd_topk.LocalAdamW(model.parameters(), variance_sketch=kwargs["variance_sketch"])}
        state = P(min_numel=MIN_NUMEL, named_parameters=model.named_parameters(), **kwargs)
        if field.startswith("the step") and odd:
            state.load_state_dict({**P(named_parameters=model.named_parameters()).state_dict(), "iteration": 5})
        ddp = DDP(model)
        ddp.register_comm_hook(state, hvd_topk.ddp.topk_hook)
        with raises(RuntimeError, match=rf"ranks disagree on the model or TopKState's settings.*\n  rank {last} "
                                        rf"differs from rank 0 in: {re.escape(field)}$", what=f"{field} on rank {last}"):
            F.cross_entropy(ddp(x), y).backward()
    # the native kernel on some ranks only (a host without a C compiler): refused by name, where
    # before rank 0's native decode failed on the last rank's pairs, in another order; with a
    # bfloat16 model too (its residuals, which selection works on, are float32)
    for dtype in (torch.float32, torch.bfloat16) if DEVICE.type == "cpu" and loaded() else ():
        from hvd_topk.selection import NATIVE_IN_USE
        with native_off(odd):
            model = Net().to(DEVICE, dtype)
            ddp = DDP(model)
            ddp.register_comm_hook(P(min_numel=MIN_NUMEL, named_parameters=model.named_parameters(),
                                     exchange="allgather"), hvd_topk.ddp.topk_hook)
            with raises(RuntimeError, match=rf"ranks disagree on the model or TopKState's settings.*\n  rank {last} "
                                            rf"differs from rank 0 in: {re.escape(NATIVE_IN_USE)}$",
                        what=f"native kernel off on rank {last}, {dtype}"):
                F.cross_entropy(ddp(x.to(dtype)), y).backward()
    # the group changed size after the state's first step (a new init_process_group)
    model, ddp, state = build(exchange="allgather")
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    state.world_size += 1
    with raises(RuntimeError, match="first used as rank .* build a new TopKState", what="group changed"):
        train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    # checkpointing without names
    with raises(ValueError, match="named_parameters", what="state_dict without names"):
        P().state_dict()
    # an unsupported dtype
    with raises(TypeError, match="not supported", what="integer bucket"):
        P()._first_hook(_FakeBucket(torch.zeros(4, dtype=torch.int32)))
    # checkpoints that do not fit: a parameter this model lacks, a residual of another size
    model, ddp, state = build(exchange="allgather")
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    saved = state.state_dict()
    with raises(ValueError, match="does not have", what="unknown parameter"):
        state.load_state_dict({**saved, "residuals": {**saved["residuals"], "fc9.weight": torch.zeros(3)}})
    with raises(ValueError, match="do not fit", what="residual of another size"):
        state.load_state_dict({**saved, "residuals": {**saved["residuals"], "fc1.weight": torch.zeros(3)}})
    # malformed ones: a clear ValueError where a KeyError, an AttributeError or, at the first
    # stats(), a ZeroDivisionError came before
    fc1 = saved["residuals"]["fc1.weight"]
    for bad, text in (({k: v for k, v in saved.items() if k != "residuals"}, r"lacks \['residuals'\]"),
                      ({**saved, "residuals": list(saved["residuals"].values())}, "not a dict of floating-point"),
                      ({**saved, "residuals": {0: fc1}}, "not a dict of floating-point tensors by parameter name"),
                      ({**saved, "residuals": {**saved["residuals"], "fc1.weight": fc1.to(torch.int64)}},
                       "not a dict of floating-point"),
                      ({**saved, "iteration": -5}, r"iteration=-5, not a count"),
                      ({**saved, "world_size": 2.5}, r"world_size=2.5, not a count")):
        with raises(ValueError, match=text, what=f"malformed checkpoint: {text}"):
            state.load_state_dict(bad)
    after = state.state_dict()  # refused whole: nothing applied
    assert after["iteration"] == saved["iteration"] == 1
    assert all(torch.equal(after["residuals"][n], saved["residuals"][n]) for n in saved["residuals"])
    # a residual holding inf/nan (saved after an overflow) starts from zero, with a warning, as in the
    # Horovod optimizer; before, it was loaded and the next step's gradients went non-finite
    poisoned = fc1.clone()
    poisoned[0] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.load_state_dict({**saved, "residuals": {**saved["residuals"], "fc1.weight": poisoned}})
    assert any("['fc1.weight'] held inf/nan" in str(w.message) for w in caught), [str(w.message) for w in caught]
    after = state.state_dict()
    assert torch.count_nonzero(after["residuals"]["fc1.weight"]) == 0
    assert all(torch.equal(after["residuals"][n], saved["residuals"][n]) for n in saved["residuals"]
               if n != "fc1.weight")


class _FakeBucket:
    """What ``TopKState._first_hook`` reads of a DDP bucket."""

    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer

    def parameters(self):
        return [self._buffer]


CHECKS = [
    ("allgather, one bucket", check_reference),
    ("allgather, several buckets", check_several_buckets),
    ("DDP rebuilds later buckets, keeps the first: residuals follow", check_rebuild_keeps_first_bucket),
    ("re-wrapped after unfreezing a layer: residuals carry over", check_rewrap_after_unfreezing),
    ("sparse allreduce, several buckets", lambda: check_reference("sparse_allreduce", bucket_cap_mb=0.005)),
    ("auto, dense start (warm-up from 1.0)", lambda: check_reference("auto", steps=5, warmup_steps=4,
                                                                     warmup_density=1.0)),
    ("auto: measured trial, agreement, choice", check_auto_trial),
    ("auto resumed into a DDP that keeps its first buckets: the whole model's proposal", check_auto_trial_after_resume),
    ("auto resumed into a DDP that rebuilds its buckets: the whole model's proposal",
     lambda: check_auto_trial_after_resume(find_unused=False)),
    ("auto with optimizer=LocalAdamW: no sparse allreduce", check_auto_updates),
    ("dense_fp16 exchange", lambda: check_reference("dense_fp16", steps=3)),
    ("allgather, 16-bit values, several buckets", lambda: check_reference(bucket_cap_mb=0.005, fp16_values=True)),
    ("sparse allreduce, 16-bit values, several buckets, decay", lambda: check_reference(
        "sparse_allreduce", bucket_cap_mb=0.005, fp16_values=True, residual_decay=0.8)),
    ("allgather, compact pairs, several buckets, decay", lambda: check_reference(
        bucket_cap_mb=0.005, compact=True, residual_decay=0.8)),
    ("allgather, sign values, several buckets, decay", lambda: check_reference(
        bucket_cap_mb=0.005, compact="sign", residual_decay=0.8)),
    ("no error feedback", lambda: check_reference(error_feedback=False)),
    ("residual decay", lambda: check_reference(residual_decay=0.8)),
    # at 90% a ring allreduce moves fewer bytes than either sparse exchange: a residual_decay added to
    # error feedback (no momentum: DeMo's is, through optimizer=) goes dense there, as the 0.1% recipe measured
    ("residual decay under auto: dense where it moves fewer bytes", lambda: check_reference(
        exchange="auto", residual_decay=0.8, warmup_steps=3, warmup_density=0.9, steps=7, exchange_trial_steps=1)),
    ("no_sync accumulation", lambda: check_reference(accumulate=2)),
    ("find_unused_parameters, rank 1 skips a layer", lambda: check_reference(
        unused_on_rank=1, ddp_kwargs={"find_unused_parameters": True})),
    ("find_unused_parameters, a layer no rank uses at steps 1 and 2", lambda: check_reference(
        steps=5, unused_at_steps=(1, 2), ddp_kwargs={"find_unused_parameters": True})),
    # (a rank that never used the layer would choose its part's positions among zeros, where
    # torch.topk and the reference break ties differently: each skips it only now and then)
    ("find_unused_parameters, sparse allreduce, one rank skips a layer at steps 1 and 3, all at 2", lambda: check_reference(
        "sparse_allreduce", bucket_cap_mb=0.005, steps=5, unused_at_steps=(2,), skipping={1: {0}, 3: {1}},
        ddp_kwargs={"find_unused_parameters": True})),
    # the trial's first step of each family (dense ones included) follows a sparse step or
    # another family's, so residuals held back are live there
    ("find_unused_parameters, auto's trial, a layer no rank uses at its steps 2, 4, 6, 8", lambda: check_reference(
        "auto", steps=10, bucket_cap_mb=0.005, exchange_trial_steps=1, unused_at_steps=(2, 4, 6, 8),
        residual_decay=0.8, ddp_kwargs={"find_unused_parameters": True})),
    ("auto after static_graph's late rebuild: every bucket proposed", check_auto_after_a_static_graph_rebuild),
    ("static_graph: the first iteration's buckets of three dtypes", check_static_graph_buckets_of_several_dtypes),
    ("static_graph: the same without named_parameters", lambda: check_static_graph_buckets_of_several_dtypes(False)),
    ("static_graph, gradient_as_bucket_view", lambda: check_reference(
        bucket_cap_mb=0.005, ddp_kwargs={"static_graph": True, "gradient_as_bucket_view": True})),
    ("bf16 autocast", lambda: check_reference(amp=True)),
    ("bf16 values that nearly cancel: the small tensors too, rounded once (allgather)",
     lambda: check_bf16_values_that_cancel("allgather")),
    ("bf16 values that nearly cancel, dense exchange", lambda: check_bf16_values_that_cancel("dense")),
    *sixteen_bit_checks("16-bit residuals are float32", check_16bit_residuals),
    ("GradScaler: residuals follow loss-scale changes, resume without a scaler", check_grad_scaler),
    ("torch.compile of the DDP model", lambda: check_reference(compiled=True)),
    ("statistics: bytes over the run", check_stats),
    ("LocalAdamW recipe", check_local_adamw),
    ("LocalAdamW recipe, variance_sketch (exact sizes), several buckets",
     lambda: check_local_adamw(steps=5, variance_sketch=4096, bucket_cap_mb=0.005)),
    ("LocalAdamW recipe, no_sync accumulation over 3 micro-batches", lambda: check_local_adamw(accumulate=3)),
    ("LocalAdamW recipe, channels_last convolutions", check_local_adamw_channels_last),
    ("LocalAdamW stepped twice, or another optimizer stepped: said", check_local_adamw_misstepped),
    ("checkpoint of channels_last weights: residuals in element order", check_residuals_channels_last),
    ("DeMo through optimizer=", check_demo),
    # at 60% the pairs (8 bytes each) move more bytes than a ring allreduce: plain error feedback would go dense
    ("DeMo through optimizer=, auto at 60%: never sent whole", lambda: check_demo(density=0.6, exchange="auto")),
    # beta 1.0 (no decay): still DeMo's momentum (before 2026-12-06 auto took dense, every entry moved)
    ("DeMo through optimizer=, beta 1, auto at 60%: never sent whole",
     lambda: check_demo(density=0.6, exchange="auto", beta=1.0)),
    ("checkpoint resume, several buckets", check_resume),
    ("checkpoint resume, one bucket, decay", lambda: check_resume(bucket_cap_mb=25, residual_decay=0.9)),
    ("checkpoint resume into torch.compile's parameter names", lambda: check_resume(compiled_names=True)),
    ("checkpoint resume of the LocalAdamW recipe (16-bit values, dense start, cosine), one file per rank",
     check_resume_local_adamw),
    ("checkpoint loaded with a larger min_numel: residuals of now-dense tensors dropped", check_resume_fewer_sparse),
    ("a checkpoint saved between backward() and step() warns", check_save_between_backward_and_step_warns),
    ("torch's Adam behind the hook with error feedback warns once", check_plain_adam_behind_hook_warns),
    ("clip_grad_norm_ of LocalAdamW's update before its step warns once",
     lambda: check_clipping_local_adamw_update_warns(view=False)),
    ("clip_grad_norm_ of LocalAdamW's update before its step warns once, gradient_as_bucket_view",
     lambda: check_clipping_local_adamw_update_warns(view=True)),
    ("non-finite gradient", check_nonfinite),
    ("non-finite gradient, flags kept on the device as on a GPU", lambda: check_nonfinite(host_reads=False)),
    ("non-finite gradient, LocalAdamW's moments stay finite", check_nonfinite_local_adamw),
    ("Join: uneven inputs", check_join),
    ("Join: uneven inputs, zero_grad after step", lambda: check_join(zero_after_step=True)),
    ("Join with LocalAdamW: no false warning of a not-stepped optimizer", check_join_local_adamw_no_false_warning),
    ("Join with LocalAdamW: the joined rank's optimizer left alone", check_join_local_adamw_leaves_the_joined_optimizer_alone),
    ("bad input", check_bad_input),
    ("a rank alone in its group (world size 1)", check_alone),
    ("a checkpoint of another replica's group: residuals restart, warned; a rank outside refused",
     check_state_of_another_replica_group),
]


if __name__ == "__main__":
    run(CHECKS)
