"""hvd_topk.DistributedOptimizer checked step by step against the numpy contract.

Run: PYTHONPATH=.:tests/support mpirun -np 2 (or 3) python tests/dist/check_optimizer.py
(``--list`` prints the names of its checks).
"""

import copy
import os
import re
import warnings

import numpy as np
import torch
import torch.nn.functional as F

import horovod.torch as hvd
import harness
import hvd_topk
from hvd_topk import native
from harness import DEVICE, assert_same_on_all_ranks, gather, raises, raw_then_synchronize, run, step_and_check_same
from nets import Net
from reference import (ErrorFeedbackReference, bfloat16_mean_rounded_once, dgc_density, k_of, nearly_cancelling,
                       part_pieces, rounded_twice_apart, sparse_allreduce)


def batch(step, rank, n=24, part=None):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(n, 40, generator=gen).to(DEVICE), torch.randint(0, 10, (n,), generator=gen).to(DEVICE)
    if part is None:
        return x, y
    half = n // 2
    return x[part * half:(part + 1) * half], y[part * half:(part + 1) * half]


class WithUnused(torch.nn.Module):
    """A layer that forward never uses, in the same sparse bucket as a used one: that bucket
    completes only in ``synchronize()``, never during backward."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(40, 32)
        self.unused = torch.nn.Linear(40, 32)
        self.out = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


def build(density=0.05, lr=0.1, momentum=0.9, seed=0, fp16_values=False, compact=False, **options):
    """The test model and its optimizer; the allgather exchange unless ``exchange`` says
    otherwise (the default, "auto", would try several strategies in the first steps)."""
    options.setdefault("exchange", "allgather")
    torch.manual_seed(seed)
    model = Net().to(DEVICE)
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopK(density=density, fp16_values=fp16_values,
                                                                  compact=compact),
                                        **options)
    return model, opt


# The sparse buckets' numbers (reverse registration order, split where fusion_bytes say), written
# out by hand: the sparse allreduce's part j of a bucket is chosen by rank (j + step + bucket
# number) mod size.
ONE_BUCKET = {"head2.weight": 0, "fc2.weight": 0, "fc1.weight": 0}
BUCKET_PER_TENSOR = {"head2.weight": 0, "fc2.weight": 1, "fc1.weight": 2}  # each > 4096 bytes


def want_sparse(ref, big, grads, density, step, buckets=ONE_BUCKET, exchange="allgather", scope="tensor",
                average=True, sent=None):
    """The reference result of every tensor in ``big`` (registration order): bucket by bucket,
    each bucket's tensors laid out in reverse registration order. ``sent``: per rank, what the
    implementation sent over the bucket (one bucket only), for ties broken by torch.topk."""
    out = {}
    for b in sorted({buckets[n] for n in big}):
        names = [n for n in big[::-1] if buckets[n] == b]
        if exchange == "sparse_allreduce":
            out.update(ref.sparse_allreduce_bucket(names, grads, density, step, b, scope, average, sent))
        elif scope == "bucket":
            out.update(ref.sparse_bucket(names, grads, density, average, sent))
        else:
            out.update({n: ref.sparse(n, grads[n], density, average) for n in names})
    return out


def check_contract(label, steps=4, density=0.05, momentum_correction=0.0, error_feedback=True,
                   warmup_steps=0, op=hvd.Average, drop_head2_on_rank=None, buckets=ONE_BUCKET,
                   ties=(), **options):
    """The contract against ErrorFeedbackReference, step by step. ``ties``: tensors whose
    selected positions are the implementation's choice among equal magnitudes (their result
    and residuals are not compared, only the ranks' parameters)."""
    rank, size = hvd.rank(), hvd.size()
    sparse_allreduce = options.get("exchange") == "sparse_allreduce"
    model, opt = build(density=density, momentum=0.0 if momentum_correction else 0.9, op=op,
                       momentum_correction=momentum_correction, error_feedback=error_feedback,
                       warmup_steps=warmup_steps, min_numel=500, **options)
    # one top-k over several tensors only where they share a bucket (with a bucket per tensor,
    # bucket scope selects exactly what tensor scope does)
    bucket_scope = options.get("selection_scope") == "bucket" and len(set(buckets.values())) == 1
    shadow = copy.deepcopy(model)
    ref = ErrorFeedbackReference(size, momentum=momentum_correction, error_feedback=error_feedback,
                                 decay=options.get("residual_decay", 1.0),
                                 value_dtype=np.float16 if options.get("fp16_values") else None,
                                 compact=options.get("compact", False))
    for step in range(steps):
        use_head2 = rank != drop_head2_on_rank
        x, y = batch(step, rank)
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad()
        F.cross_entropy(shadow(x, use_head2), y).backward()
        raw = {n: (p.grad.cpu().numpy().copy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32))
               for n, p in shadow.named_parameters()}
        opt.zero_grad()
        F.cross_entropy(model(x, use_head2), y).backward()
        opt.synchronize()
        d = dgc_density(step, density, warmup_steps)
        grads = {name: gather(raw[name]) for name, _ in model.named_parameters()}
        big = [name for name, p in model.named_parameters() if p.numel() >= 500]
        sent = None
        if bucket_scope and (native.library() is None or DEVICE.type != "cpu") and error_feedback:
            # one top-k over the one bucket holding every big tensor, laid out in reverse
            # registration order; fc2 and head2 get equal gradients, and equal magnitudes at the
            # k-th go to the earlier position, in the kernel as in numpy; torch.topk (the
            # torch-ops path: HVD_TOPK_NATIVE=0, GPUs) breaks such ties its own way, read from
            # what the residuals lost: a sent entry keeps at most float16's rounding of its
            # accumulator (16-bit values; 0 otherwise), an unsent one all of it
            res = opt.state_dict()["hvd_topk"]["residuals"]
            left = gather(np.concatenate([res[n].cpu().numpy().reshape(-1) for n in big[::-1]]))
            accs = ref._accumulate(big[::-1], grads)[0]
            sent = [np.abs(left[r]) < 0.5 * np.abs(accs[r]) for r in range(size)]
        shared = want_sparse(ref, big, grads, d, step, buckets, options.get("exchange", "allgather"),
                             "bucket" if bucket_scope else "tensor", op == hvd.Average, sent)
        for name, p in model.named_parameters():
            if name in ties:
                continue
            # (the small tensors: their average, or with momentum correction the average of u)
            want = shared[name] if name in big else ref.dense(name, grads[name], op == hvd.Average)
            # the sparse allreduce of 16-bit values sums them in float16 (Horovod's allreduce, one
            # rounding per addition, in its own order), the reference in float32: within float16's
            # rounding of the largest sum; the residuals below, each rank's own, stay exact
            atol = 2.0 ** -10 * np.abs(want).max() if sparse_allreduce and options.get("fp16_values") \
                and name in big else 1e-7
            np.testing.assert_allclose(p.grad.cpu().numpy(), want, rtol=1e-6, atol=atol,
                                       err_msg=f"{label}: step {step} {name}")
        step_and_check_same(opt, model, f"{label}: step {step}")
    residuals = opt.state_dict()["hvd_topk"]["residuals"]
    for name, r in residuals.items():
        if error_feedback and name not in ties:
            np.testing.assert_allclose(r.cpu().numpy().reshape(-1), ref.residual[rank][name].reshape(-1),
                                       rtol=1e-6, atol=1e-7, err_msg=f"{label}: residual {name}")
    stats = opt.compression_stats()
    sizes = [p.numel() for p in model.parameters() if p.numel() >= 500]
    assert stats["steps"] == steps, stats
    if sparse_allreduce:  # k per piece of each bucket's parts
        shapes = dict(model.named_parameters())
        pieces = [b - a for bucket in sorted(set(buckets.values()))
                  for _, a, b in part_pieces(np.cumsum([0] + [shapes[n].numel() for n in list(buckets)
                                                              if buckets[n] == bucket]), size,
                                             options.get("selection_scope", "tensor"))]
        want_selected = sum(k_of(n, dgc_density(s, density, warmup_steps)) for s in range(steps) for n in pieces)
    elif bucket_scope:
        want_selected = sum(k_of(sum(sizes), dgc_density(s, density, warmup_steps)) for s in range(steps))
    else:
        want_selected = sum(k_of(n, dgc_density(s, density, warmup_steps)) for s in range(steps) for n in sizes)
    want_selected += steps * sum(p.numel() for p in model.parameters() if p.numel() < 500)
    assert stats["elements_selected"] == want_selected, (stats, want_selected)
    # one host here: the hierarchical exchange's timers stay at zero
    assert stats["time_host_reduce_s"] == stats["time_cross_s"] == stats["time_host_gather_s"] == 0, stats
    if options.get("dense_fallback", True):
        assert stats["bytes_sent"] < stats["bytes_dense"], stats
    return model


def check_dense_exchange(exchange, fallback=False, scale=1.0):
    """exchange="dense" / "dense_fp16": every tensor is the ranks' average of their
    accumulators (the residual plus this step's gradient); fp32 keeps nothing in the residual,
    fp16 keeps what float16 rounded off each rank's accumulator (numpy: acc - float16(acc)),
    so nothing is lost to the wire format. ``fallback``: the same reached by the allgather's
    dense fallback at 60% with TopK(fp16_values=True), which is 16-bit too. ``scale``: the
    loss times it (1e-6: gradients of 1e-8 to 1e-6, which float16 rounds coarsely or to zero
    and which, before 2026-12-05, a dense fp16 exchange lost step after step)."""
    size, rank = hvd.size(), hvd.rank()
    if fallback:
        model, opt = build(density=0.6, fp16_values=True, min_numel=500, exchange="allgather")
    else:
        model, opt = build(min_numel=500, exchange=exchange)
    shadow = copy.deepcopy(model)
    ref = ErrorFeedbackReference(size, value_dtype=None if exchange == "dense" else np.float16)
    # float16's sum rounds too: by 2^-11 of it, and below its smallest step (6e-8) by up to half that
    tol = dict(rtol=1e-6, atol=1e-7 * scale) if exchange == "dense" else dict(rtol=2e-3, atol=2e-4 * scale + 3e-8)
    raw_total, delivered, moved = {}, {}, {}
    for step in range(3):
        x, y = batch(step, rank)
        raw = raw_then_synchronize(shadow, model, opt, x, y, scale=scale)
        for name, p in model.named_parameters():
            grads = gather(raw[name])
            want = ref.sparse(name, grads, 1.0) if p.numel() >= 500 else ref.dense(name, grads)
            got = p.grad.cpu().numpy()
            np.testing.assert_allclose(got, want, err_msg=f"{exchange}: step {step} {name}", **tol)
            raw_total[name] = raw_total.get(name, 0) + np.sum(grads, axis=0, dtype=np.float64) / size
            delivered[name] = delivered.get(name, 0) + got.astype(np.float64)
            # what the ring's partial sums and its division round: at most sum_r |g_r| and the average
            moved[name] = moved.get(name, 0) + np.sum(np.abs(grads), axis=0, dtype=np.float64) \
                + np.abs(got.astype(np.float64))
        step_and_check_same(opt, model, f"{exchange}: step {step}")
    residuals = opt.state_dict()["hvd_topk"]["residuals"]
    assert sorted(residuals) == sorted(n for n, p in model.named_parameters() if p.numel() >= 500), sorted(residuals)
    for name, r in residuals.items():  # this rank's own: exact (a float32 add, float16's rounding)
        np.testing.assert_array_equal(r.cpu().numpy().reshape(-1), ref.residual[rank][name].reshape(-1),
                                      err_msg=f"{exchange}: residual {name}")
        # conserved: what arrived plus the ranks' average residual is what the ranks computed, up
        # to the float16 ring's own rounding (P - 1 partial sums a step, each by 2^-11 of its
        # size; below float16's smallest normal number its sums are exact, and the division by P
        # is float32's). Before 2026-12-06 Horovod divided the float16 sum in float16, and an
        # average below float16's smallest step (6e-8) arrived as 0 or rounded up, lost for good.
        left = np.sum(gather(r.cpu().numpy()), axis=0, dtype=np.float64).reshape(raw_total[name].shape) / size
        error = np.abs(delivered[name] + left - raw_total[name])
        bound = 2.0 ** -11 * moved[name] + 2.0 ** -20 * np.abs(raw_total[name]) + 1e-15
        assert np.all(error <= bound), (f"{exchange}: {name} not conserved: {np.max(error - bound)} over its bound "
                                        f"at {np.unravel_index(np.argmax(error - bound), error.shape)}")
    stats = opt.compression_stats()
    big = sum(p.numel() for p in model.parameters() if p.numel() >= 500)
    small = sum(p.numel() for p in model.parameters() if p.numel() < 500)
    wire = 4 if exchange == "dense" else 2
    assert stats["bytes_sent"] == 3 * (big * wire + small * 4), stats
    assert stats["bucket_strategies"] == {0: exchange, 1: "dense"}, stats  # small tensors: fp32


def check_momentum_correction_sent_whole(exchange):
    """momentum_correction (inner momentum 0) on what is sent whole: the small tensors' dense
    bucket always, and with ``exchange="dense"`` the big ones too. Each tensor's result is the
    ranks' average of u = 0.9 u + grad (numpy), the same as Horovod's dense optimizer with
    SGD momentum 0.9 trains (to float32 rounding): before, those tensors got no momentum. A
    checkpoint carries the small tensors' momentum: resumed at step 2, bitwise equal at step 5
    (to float32 rounding when a dense exchange sums 3+ ranks)."""
    size = hvd.size()
    model, opt = build(min_numel=500, momentum=0.0, momentum_correction=0.9, exchange=exchange)
    torch.manual_seed(0)
    dense_model = Net().to(DEVICE)
    dense_opt = hvd.DistributedOptimizer(torch.optim.SGD(dense_model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=dense_model.named_parameters())
    shadow = copy.deepcopy(model)
    ref = ErrorFeedbackReference(size, momentum=0.9)
    big = [n for n, p in model.named_parameters() if p.numel() >= 500]
    for step in range(5):
        x, y = batch(step, hvd.rank())
        raw = raw_then_synchronize(shadow, model, opt, x, y)
        grads = {n: gather(raw[n]) for n in raw}
        for name, p in model.named_parameters():
            want = ref.sparse(name, grads[name], 0.05) if name in big and exchange != "dense" \
                else ref.dense(name, grads[name])
            np.testing.assert_allclose(p.grad.cpu().numpy(), want, rtol=1e-6, atol=1e-7,
                                       err_msg=f"momentum correction, {exchange}: step {step} {name}")
        step_and_check_same(opt, model, f"momentum correction, {exchange}: step {step}")
        train(dense_model, dense_opt, 1, start=step)
    if exchange == "dense":
        for (name, a), b in zip(model.named_parameters(), dense_model.parameters()):
            np.testing.assert_allclose(a.detach().cpu().numpy(), b.detach().cpu().numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"against Horovod's dense SGD with momentum: {name}")
    model_b, opt_b = build(min_numel=500, momentum=0.0, momentum_correction=0.9, exchange=exchange)
    train(model_b, opt_b, 2)
    saved = copy.deepcopy({"model": model_b.state_dict(), "opt": opt_b.state_dict()})
    assert set(saved["opt"]["hvd_topk"]["momenta"]) == {n for n, _ in model.named_parameters()}
    model_c, opt_c = build(min_numel=500, momentum=0.0, momentum_correction=0.9, exchange=exchange, seed=7)
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    train(model_c, opt_c, 3, start=2)
    for (name, a), c in zip(model.named_parameters(), model_c.parameters()):
        if exchange == "dense" and size > 2:
            # a dense allreduce of 3+ ranks sums in an order MPI picks by message size, which
            # Horovod's tensor fusion makes timing-dependent (make test once saw fc1.weight part
            # between the two runs): within float32 rounding there
            np.testing.assert_allclose(a.detach().cpu().numpy(), c.detach().cpu().numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=f"resume with momentum correction: {name}")
        else:
            assert torch.equal(a, c), f"resume with momentum correction: {name} differs"
    # a plain torch checkpoint restarts every momentum, the small tensors' too
    plain = {"state": {}, "param_groups": [{k: v for k, v in g.items() if k != "hvd_topk_step"}
                                           for g in saved["opt"]["param_groups"]]}
    opt_c.load_state_dict(plain)
    momenta = opt_c.state_dict()["hvd_topk"]["momenta"]
    assert all(float(u.abs().max()) == 0 for u in momenta.values()), "a plain load kept some momentum"
    # loaded where momentum_correction is off: its momentum means nothing there, and no warning says
    # the saved tensors match no parameter (they do)
    _, opt_d = build(min_numel=500, momentum=0.9, exchange=exchange)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt_d.load_state_dict(copy.deepcopy(saved["opt"]))
    assert not [str(w.message) for w in caught if "match no parameter" in str(w.message)], \
        [str(w.message) for w in caught]


def check_auto(fp16_values=True):
    """exchange="auto": every proposed family runs (one settling step, then the measured ones)
    in the documented order on every rank, all ranks take the same family each step and end
    with the same parameters, and the choice is the fastest of the agreed medians. Dense fp16
    is a candidate only where values travel in 16 bits already (``fp16_values``)."""
    model, opt = build(min_numel=500, exchange="auto", exchange_trial_steps=1, fp16_values=fp16_values)
    candidates = ["dense", "dense_fp16", "allgather", "sparse_allreduce"] if fp16_values else \
        ["dense", "allgather", "sparse_allreduce"]
    tried = 2 * len(candidates)
    seen = []
    for step in range(tried + 2):
        train(model, opt, 1, start=step)
        stats = opt.compression_stats()
        seen.append(stats["exchange_family"])
        families = [str(f) for f in gather(stats["exchange_family"])]
        assert len(set(families)) == 1, f"auto: family at step {step} by rank: {families}"
        for p in model.parameters():
            assert_same_on_all_ranks(p.detach().cpu().numpy(), f"auto: parameters at step {step}")
    # density 5% at any P <= 3: no family is dominated, each runs 2 steps
    assert stats["exchange_candidates"] == candidates, stats
    assert seen[:tried] == [c for c in candidates for _ in range(2)], seen
    medians = stats["exchange_median_step_s"]
    assert sorted(medians) == sorted(candidates) and all(t > 0 for t in medians.values()), stats
    assert stats["exchange_choice"] == min(candidates, key=medians.get), stats
    assert seen[tried:] == [stats["exchange_choice"]] * 2, seen
    assert "measured" in stats["exchange_reason"], stats


def check_auto_one_candidate():
    """A sparse family that would send its buckets dense anyway is not tried. With 16-bit
    values at density 0.35, per element: the allgather moves (P-1) x 0.35 x 6 B, more than
    dense fp16's 2 (P-1)/P x 2 at every P (2.1 against 2.0 at P=2), so its buckets fall back to
    dense fp16 and it is dense fp16 again; the sparse allreduce moves
    (P-1)/P x 0.35 x (4 + 2 x 2), less (1.4 against 2.0 at P=2, 2.1 against 3.0 at P=4)."""
    model, opt = build(min_numel=500, exchange="auto", density=0.35, fp16_values=True)
    train(model, opt, 1)
    stats = opt.compression_stats()
    assert stats["exchange_candidates"] == ["dense", "dense_fp16", "sparse_allreduce"], stats


def check_auto_updates():
    """exchange="auto" over an inner optimizer that exchanges each rank's update (LocalAdamW,
    DeMo): the sparse allreduce, measured to cost such updates quality from 4 ranks on, is no
    candidate (at density 5% the plain SGD of ``check_auto`` has it) and the reason says why;
    pinned, it is used. DeMo's residual, its momentum, leaves dense out too, at beta 1.0 (no
    decay) as at 0.999 (before 2026-12-06 beta 1.0 offered dense, and auto could pick it)."""
    finals = {}
    makers = {"LocalAdamW": hvd_topk.LocalAdamW, "DeMo": hvd_topk.DeMo,
              "DeMo, beta 1": lambda params, lr: hvd_topk.DeMo(params, lr=lr, beta=1.0)}
    for label, make in makers.items():
        for exchange in ("auto", "sparse_allreduce", "allgather"):
            torch.manual_seed(0)
            model = Net().to(DEVICE)
            opt = hvd_topk.DistributedOptimizer(make(model.parameters(), lr=0.01),
                                                named_parameters=model.named_parameters(), min_numel=500,
                                                compression=hvd_topk.TopK(density=0.05, fp16_values=True),
                                                exchange=exchange, exchange_trial_steps=1 if exchange == "auto" else 3)
            train(model, opt, 7)
            stats = opt.compression_stats()
            if exchange == "auto":
                # DeMo's residual (beta 0.999, or 1.0): its momentum, which dense would send whole
                demo = label != "LocalAdamW"
                assert stats["exchange_candidates"] == (["allgather"] if demo else ["dense", "dense_fp16", "allgather"]), stats
                assert "sparse allreduce not tried" in stats["exchange_reason"], stats
                assert ("dense not tried" in stats["exchange_reason"]) == demo, stats
                assert stats["exchange_choice"] in stats["exchange_candidates"], stats
            elif exchange == "sparse_allreduce":
                used = set(stats["bucket_strategies"].values())
                assert used == {"dense", "sparse_allreduce"}, (label, used)
            for p in model.parameters():
                assert_same_on_all_ranks(p.detach().cpu().numpy(), f"{label}, {exchange}: parameters")
            finals[label, exchange] = [p.detach().clone() for p in model.parameters()]
    # DeMo under auto runs what the pinned allgather does, bit for bit (dense would flush its momentum)
    for label in ("DeMo", "DeMo, beta 1"):
        for a, b in zip(finals[label, "auto"], finals[label, "allgather"]):
            assert torch.equal(a, b), f"{label} under exchange='auto' differs from the pinned allgather"


def check_cost_model_goes_dense():
    """At density 1/P or more a ring allreduce moves fewer bytes: the big tensors go dense, and
    each step's gradients are the ranks' average of their raw gradients (numpy; nothing stays
    in the residual), as a dense allreduce's."""
    size, rank = hvd.size(), hvd.rank()
    model, opt = build(density=min(1.0, 1.0 / size + 0.01), min_numel=500)
    shadow = copy.deepcopy(model)
    for step in range(2):
        x, y = batch(step, rank)
        raw = raw_then_synchronize(shadow, model, opt, x, y)
        for name, p in model.named_parameters():
            np.testing.assert_allclose(p.grad.cpu().numpy(), np.mean(gather(raw[name]), axis=0), rtol=1e-6,
                                       atol=1e-7, err_msg=f"step {step} {name}")
        step_and_check_same(opt, model, f"dense fallback: step {step}")
    stats = opt.compression_stats()
    assert stats["tensors_sparse"] == 0 and stats["tensors_dense"] == 2 * 6, stats
    assert stats["bytes_sent"] == stats["bytes_dense"], stats
    for p in model.parameters():
        assert_same_on_all_ranks(p.detach().cpu().numpy(), "dense fallback parameters")


def check_passes_equal_concatenated_batch():
    """backward_passes_per_step=2 over two halves (loss/2) == one pass over the whole batch."""
    rank = hvd.rank()
    model_a, opt_a = build(backward_passes_per_step=2, min_numel=500)
    model_b, opt_b = build(min_numel=500)
    for step in range(3):
        opt_a.zero_grad()
        for part in (0, 1):
            x, y = batch(step, rank, part=part)
            (F.cross_entropy(model_a(x), y) / 2).backward()
        opt_a.step()
        opt_b.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(model_b(x), y).backward()
        opt_b.step()
        for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
            np.testing.assert_allclose(a.detach().cpu().numpy(), b.detach().cpu().numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"passes=2 vs concatenated: step {step} {name}")


def train(model, opt, steps, start=0):
    harness.train(model, opt, steps, batch, start)


def check_checkpoint_resume():
    """Save at step 3 (one state per rank), resume in fresh objects: bitwise equal at step 7, and
    ``compression_stats()``' counts those of the run that never stopped (the checkpoint carries
    them: the whole run's, its density warm-up included)."""
    model, opt = build(min_numel=500, warmup_steps=4)
    train(model, opt, 7)
    model_b, opt_b = build(min_numel=500, warmup_steps=4)
    train(model_b, opt_b, 3)
    saved = copy.deepcopy({"model": model_b.state_dict(), "opt": opt_b.state_dict()})
    assert saved["opt"]["hvd_topk"]["step"] == 3
    model_c, opt_c = build(min_numel=500, warmup_steps=4, seed=123)  # different init on purpose
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    train(model_c, opt_c, 4, start=3)
    for (name, a), c in zip(model.named_parameters(), model_c.parameters()):
        assert torch.equal(a, c), f"resume: {name} differs (max {float((a - c).abs().max())})"
    for name, r in opt.state_dict()["hvd_topk"]["residuals"].items():
        assert torch.equal(r, opt_c.state_dict()["hvd_topk"]["residuals"][name]), name
    whole, resumed = opt.compression_stats(), opt_c.compression_stats()
    for key in ("steps", "bytes_sent", "bytes_dense", "elements_total", "elements_selected", "tensors_sparse"):
        assert resumed[key] == whole[key] > 0, (key, resumed[key], whole[key])
    # A state saved on another rank restarts the residuals from zero, with a warning. (The next
    # rank's real state: this rank's own relabelled would hold this engine's own residuals, which
    # an elastic worker restoring its commit keeps, check_checkpoint.py.)
    other = hvd.allgather_object(opt.state_dict(), name="resume.states")[(hvd.rank() + 1) % hvd.size()]
    assert other["hvd_topk"]["rank"] == (hvd.rank() + 1) % hvd.size()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt_c.load_state_dict(other)
    assert any("residuals start from zero" in str(w.message) for w in caught)
    assert all(float(r.abs().sum()) == 0 for r in opt_c.state_dict()["hvd_topk"]["residuals"].values())


def check_elastic_state():
    model, opt = build(min_numel=500)
    train(model, opt, 2)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)
    state.commit()
    committed = copy.deepcopy(opt.state_dict()["hvd_topk"])
    params = copy.deepcopy(model.state_dict())
    train(model, opt, 2, start=2)
    assert opt.state_dict()["hvd_topk"]["step"] == 4
    state.restore()
    restored = opt.state_dict()["hvd_topk"]
    assert restored["step"] == committed["step"] == 2
    for name, r in committed["residuals"].items():
        assert torch.equal(restored["residuals"][name], r), name
    for name, t in params.items():
        assert torch.equal(model.state_dict()[name], t), name


def check_broadcast_optimizer_state():
    model, opt = build(min_numel=500)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # must not run an exchange or count a step
    assert opt.compression_stats()["step"] == 0
    train(model, opt, 2)
    assert isinstance(opt, torch.optim.SGD)


def check_stateless_checkpoint_on_one_rank_refused():
    """SGD without momentum has no state, so hvd.broadcast_optimizer_state broadcasts nothing, not
    even the step: a checkpoint loaded on rank 0 alone leaves the ranks at different steps of
    the density warm-up. Every rank raises a RuntimeError saying so at the next step, where a
    hang or a message-size error came before; a checkpoint loaded on every rank trains on."""
    model, opt = build(momentum=0.0, min_numel=500, warmup_steps=4, warmup_density=0.5)
    train(model, opt, 2)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    for everywhere in (False, True):
        model, opt = build(momentum=0.0, min_numel=500, warmup_steps=4, warmup_density=0.5, seed=7)
        if everywhere or hvd.rank() == 0:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        if everywhere:
            train(model, opt, 2, start=2)
            assert opt.compression_stats()["step"] == 4
        else:
            with raises(RuntimeError, match="the ranks are at different steps", what="rank 0 at step 2, the rest at 0"):
                train(model, opt, 1, start=2)


def check_checkpoint_mid_run_on_one_rank_refused(exchange):
    """A checkpoint of step 1 loaded on rank 0 alone at step 3, no broadcast: every rank raises at
    the next step that the ranks are at different steps, where before rank 0 raised and the
    others waited for it in the exchange for good (the others read the step probe only at
    rank 0's check). Every bucket sparse, so no rank starts a collective before refusing."""
    model, opt = build(min_numel=1, dense_fallback=False, exchange=exchange)
    train(model, opt, 1)
    saved = copy.deepcopy(opt.state_dict())
    train(model, opt, 2, start=1)
    if hvd.rank() == 0:
        opt.load_state_dict(saved)
    with raises(RuntimeError, match="the ranks are at different steps", what="rank 0 back at step 1, the rest at 3"):
        train(model, opt, 1, start=3)


def check_nonfinite(exchange="allgather", culprit=0, compact=False, value=float("inf")):
    """An inf in one rank's gradient reaches the average on every rank, never the residual.
    ``value``: what is put there instead (1e5: finite, but beyond float16's 65504, so a dense
    fp16 exchange sends it as inf).
    With the sparse allreduce, ``culprit="chooser"`` is the rank that chooses the positions of
    the part holding the inf (it selects the inf itself), ``"other"`` the next rank (it only
    flags it): fc1.weight's entry 7 is entry 1927 of the one sparse bucket (head2, fc2: 960
    each, then fc1), and at step 0 rank j chooses part j. With ``compact`` pairs the pack's
    rounding feedback once refilled the wiped residual (190 of 192 sent entries)."""
    rank, size = hvd.rank(), hvd.size()
    if culprit in ("chooser", "other"):
        part = [j for j, a, b in part_pieces([0, 960, 1920, 5760], size) if a <= 1927 < b][0]
        culprit = part if culprit == "chooser" else (part + 1) % size
    model, opt = build(min_numel=500, exchange=exchange, compact=compact)
    inject = {"on": True}

    def poison(grad):
        if inject["on"] and rank == culprit:
            grad = grad.clone()
            grad.view(-1)[7] = value  # an entry almost surely not among the top-k
        return grad

    model.fc1.weight.register_hook(poison)
    x, y = batch(0, rank)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.synchronize()
    assert not torch.isfinite(model.fc1.weight.grad).all(), "non-finite gradient was lost"
    residuals = opt.state_dict()["hvd_topk"]["residuals"]
    assert all(torch.isfinite(r).all() for r in residuals.values())
    if rank == culprit:
        assert float(residuals["fc1.weight"].abs().sum()) == 0
        assert opt.compression_stats()["nonfinite_resets"] >= 1
    inject["on"] = False
    opt.zero_grad()  # the step is skipped, as GradScaler would
    train(model, opt, 1, start=1)
    for p in model.parameters():
        assert torch.isfinite(p).all()


def check_nonfinite_local_adamw():
    """LocalAdamW: an inf in rank 0's gradient of fc1 at step 0 reaches the average on every
    rank (the step is then skipped, as a GradScaler would), and rank 0's Adam moments do not
    take it in (with inf/nan in them every later step was NaN). Truth: after three finite steps
    more, rank 0's fc1 moments have counted three steps and every other tensor four, all finite,
    and the parameters are finite and the same on every rank."""
    rank = hvd.rank()
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    inner = hvd_topk.LocalAdamW(model.parameters(), lr=0.01, betas=(0.0, 0.95), weight_decay=0.1)
    opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(), exchange="allgather",
                                        compression=hvd_topk.TopK(density=0.05), min_numel=500)
    handle = model.fc1.weight.register_hook(
        lambda g: g.index_fill(1, torch.tensor([3]), float("inf")) if rank == 0 else g)
    x, y = batch(0, rank)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.synchronize()
    handle.remove()
    assert not torch.isfinite(model.fc1.weight.grad).all(), "inf did not reach this rank's result"
    opt.zero_grad()  # skipped
    train(model, opt, 3, start=1)
    for name, p in model.named_parameters():
        state = inner.state[p]
        want = 3 if (rank == 0 and name == "fc1.weight") else 4
        assert int(state["step"]) == want, f"{name}: {int(state['step'])} Adam steps, expected {want}"
        assert all(torch.isfinite(t).all() for t in state.values() if torch.is_tensor(t)), f"{name}: moments"
        assert torch.isfinite(p).all(), name
        assert_same_on_all_ranks(p.detach().cpu().numpy(), f"after the skipped step: {name}")


def check_bad_input():
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, error, text in [
        ({"compression": hvd_topk.TopK(density=0.5), "op": hvd.Adasum}, ValueError, "Adasum"),
        ({"min_numel": -1}, ValueError, "-1"),
        ({"momentum_correction": 1.5}, ValueError, "1.5"),
        ({"warmup_steps": -2}, ValueError, "-2"),
        ({"warmup_density": 0.0, "warmup_steps": 3}, ValueError, "0.0"),
        ({"backward_passes_per_step": 0}, ValueError, "0"),
        ({"fusion_bytes": 0}, ValueError, "0"),
        ({"densty": 0.1}, TypeError, "densty"),
        ({"density": 0.1}, TypeError, "density is an option of the compression: pass "
                                      "compression=hvd_topk.TopK(density=...)"),
        ({"fp16_values": True, "method": "exact"}, TypeError, "fp16_values, method are options of the compression: "
                                                              "pass compression=hvd_topk.TopK(fp16_values=..., method=...)"),
        ({"compression": hvd.Compression.fp16}, TypeError, "compression"),
        ({"named_parameters": [("a", p) for p in model.parameters()]}, ValueError, "duplicates"),
        ({"named_parameters": list(model.named_parameters())[:2]}, ValueError, "not named"),
        ({"compression": hvd_topk.TopK(compact=True), "exchange": "sparse_allreduce"}, ValueError,
         "compact=True packs the allgather's pairs"),
        ({"compression": hvd_topk.TopK(compact=True), "hierarchical": True}, ValueError,
         "compact=True packs the flat allgather's pairs; the hierarchical exchange"),
        ({"compression": hvd_topk.TopK(compact="sign"), "exchange": "allgather", "hierarchical": True}, ValueError,
         "compact='sign' packs the flat allgather's pairs; the hierarchical exchange"),
        ({"compression": hvd_topk.TopK(compact="sign"), "exchange": "sparse_allreduce"}, ValueError,
         "compact='sign' packs the allgather's pairs"),
        ({"compression": hvd_topk.TopK(compact="sign"), "error_feedback": False}, ValueError,
         "compact='sign' sends each value as its sign times the mean magnitude of its top-k"),
    ]:
        with raises(error, match=re.escape(text), what=f"{kwargs}"):
            hvd_topk.DistributedOptimizer(sgd, **kwargs)
    # accepted, with a warning: options a dense exchange or groups= never read, and DeMo's
    # momentum sent whole by a pinned dense exchange (each was accepted in silence)
    for kwargs, text, inner in [
        ({"exchange": "dense", "compression": hvd_topk.TopK(density=0.001)}, "density has no effect with exchange='dense'", None),
        ({"exchange": "dense_fp16", "warmup_steps": 5}, "warmup_steps has no effect with exchange='dense_fp16'", None),
        ({"groups": 2, "fusion_bytes": 1000}, "fusion_bytes has no effect with groups=2", None),
        ({"exchange": "dense"}, "exchange='dense' over DeMo sends its accumulator", hvd_topk.DeMo),
    ]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hvd_topk.DistributedOptimizer(inner(model.parameters(), lr=0.01) if inner else sgd,
                                          named_parameters=model.named_parameters(), **kwargs)
        assert any(text in str(w.message) for w in caught), (kwargs, [str(w.message) for w in caught])
    used_up = model.named_parameters()
    list(used_up)
    w = model.fc1.weight
    for kwargs, error, text in [
        ({"gradient_predivide_factor": float("inf")}, ValueError, "gradient_predivide_factor must be a finite number"),
        ({"process_set": None}, TypeError, "process_set must be a horovod ProcessSet"),
        ({"groups": [[torch.zeros(3)]]}, ValueError, "groups holds a tensor of shape (3,) that is not one of the "
                                                     "optimizer's parameters"),
        ({"groups": [w, model.fc2.weight]}, ValueError, "got a list of Parameter"),
        ({"groups": [[w, w]]}, ValueError, "a parameter appears more than once in groups"),
        # one below min_numel (sent dense) counted too, as Horovod refuses it
        ({"groups": [[model.fc1.bias], [model.fc1.bias, w]]}, ValueError, "a parameter appears more than once in groups"),
        ({"gradient_predivide_factor": "2"}, TypeError, "gradient_predivide_factor must be a number"),
        ({"named_parameters": used_up}, ValueError, "named_parameters is empty (a model.named_parameters() generator"),
    ]:
        with raises(error, match=re.escape(text), what=f"{kwargs}"):
            hvd_topk.DistributedOptimizer(sgd, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "duplicate parameters" warning
        twice = torch.optim.SGD([{"params": [w, model.fc2.weight, w]}], lr=0.1)
    with raises(ValueError, match=re.escape("the optimizer holds a parameter twice (shape (96, 40), position 2"),
                what="a parameter listed twice"):
        hvd_topk.DistributedOptimizer(twice)
    # LBFGS (several closure evaluations a step): named when wrapped (its step once failed with
    # "missing 1 required positional argument: 'closure'" after an exchange had run)
    with raises(TypeError, match="torch.optim.LBFGS is not supported", what="LBFGS"):
        hvd_topk.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), named_parameters=model.named_parameters())
    # hvd.DistributedOptimizer around ours: a clear error (it was an AttributeError on a setter)
    model, opt = build(min_numel=500)
    with raises(TypeError, match="do not wrap it in hvd.DistributedOptimizer", what="hvd's wrapper around ours"):
        hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    # Parameters added after the optimizer was built: a clear error, not silent divergence.
    model, opt = build(min_numel=500)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    with raises(RuntimeError, match="parameters changed", what="parameters added after building"):
        train(model, opt, 1)
    # A hidden layer grown in place after a step (net2net: p.data = torch.cat(...)): named at
    # the next backward, before any gradient is folded into buffers laid out for the old
    # shapes (it failed inside the hooks, with a size mismatch naming neither the parameter
    # nor the cause).
    model, opt = build(min_numel=500)
    train(model, opt, 1)
    with torch.no_grad():
        model.fc1.weight.data = torch.cat([model.fc1.weight.data, torch.zeros(2, 40, device=DEVICE)])
        model.fc1.bias.data = torch.cat([model.fc1.bias.data, torch.zeros(2, device=DEVICE)])
        for head in (model.fc2, model.head2):
            head.weight.data = torch.cat([head.weight.data, torch.zeros(10, 2, device=DEVICE)], 1)
    with raises(RuntimeError, match="parameters changed after hvd_topk.DistributedOptimizer was built .*resized",
                what="a layer grown in place after a step"):
        train(model, opt, 1, start=1)
    # The model moved to float64 after building: its float32 residuals rounded every gradient.
    model, opt = build(min_numel=500)
    model.double()
    with raises(RuntimeError, match=r"moved to another dtype or device, e.g. model.double\(\)",
                what="model.double() after building"):
        opt.synchronize()


def assert_extra_calls_change_nothing(steps, finish_step, what):
    """Two runs of ``steps`` steps, each step's backward followed by ``finish_step(opt, step,
    extra)``, with ``extra`` False and True: the same bits, and ``steps`` steps counted. Every
    tensor goes sparse, never dense, so both runs' results are allgathered pairs decoded in rank
    order: the same bits whatever the timing. (A dense allreduce at 3 ranks sums in an order MPI
    picks by message size, which Horovod's tensor fusion makes timing-dependent: two runs once
    differed by 7e-9 that way under make test's load.)"""
    runs = []
    for extra in (False, True):
        model, opt = build(min_numel=1, dense_fallback=False, warmup_steps=3, warmup_density=0.5)
        for step in range(steps):
            x, y = batch(step, hvd.rank())
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            finish_step(opt, step, extra)
        runs.append((model, opt))
    for (name, a), b in zip(runs[0][0].named_parameters(), runs[1][0].parameters()):
        assert torch.equal(a, b), f"{name}: {what} changed the result (max {float((a - b).abs().max())})"
    assert runs[1][1].compression_stats()["step"] == steps, runs[1][1].compression_stats()["step"]


def check_second_synchronize_changes_nothing():
    """``synchronize()`` twice before ``step()`` (a clipping helper and the training loop both
    call it): the same bits as calling it once, and one step counted (the density warm-up and
    the sparse allreduce's rotation read the counter). Truth: the run that calls it once."""
    def finish_step(opt, step, twice):
        opt.synchronize()
        if twice:
            opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    assert_extra_calls_change_nothing(4, finish_step, "a second synchronize()")


def check_synchronize_after_step_changes_nothing():
    """A stray ``synchronize()`` after ``step()``, no backward since (to "flush" before an
    evaluation or a checkpoint): as in Horovod, whose second allreduce of the average changes
    nothing, the same bits as the run without it, one step counted a backward. Truth: that run.
    Then ``step()`` again without a backward applies ``p.grad``, the average, once more, as
    Horovod's does (SGD without momentum: by hand, p - lr g). Before 2026-12-06 the call folded
    the applied average into the residuals as a new gradient, to be applied again over the
    next steps (a review: the final weights moved by nearly a whole run's movement)."""
    def finish_step(opt, step, stray):
        opt.step()
        if stray and step in (1, 3):
            opt.synchronize()
    assert_extra_calls_change_nothing(5, finish_step, "synchronize() after step()")
    model, opt = build(min_numel=1, momentum=0.0, dense_fallback=False)
    x, y = batch(0, hvd.rank())
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    want = {n: (p.detach() - 0.1 * p.grad).cpu().numpy() for n, p in model.named_parameters()}
    opt.step()
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.detach().cpu().numpy(), want[n], rtol=1e-6, atol=1e-8,
                                   err_msg=f"{n}: step() again without backward")
        assert_same_on_all_ranks(p.detach().cpu().numpy(), f"{n} after step() again")
    assert opt.compression_stats()["step"] == 1, opt.compression_stats()["step"]


def check_gradients_written_through_data_after_a_step():
    """After a step, gradients written by hand, no hook firing: assigned (``p.grad = g``) or put
    in through ``p.grad.data = g`` (a new storage, no version bump), they are exchanged, the
    numpy reference of what the ranks wrote (the stray-call rule took ``.data = g`` for the last
    result unchanged, and the ranks drifted apart); ``p.grad.data.copy_(g)`` cannot be told from
    no change (PyTorch counts no change), and the no-exchange warns, naming it."""
    for how in ("assigned", "data assigned"):
        # (without error feedback the reference is the plain Top-K average of what was written)
        model, opt = build(min_numel=1, momentum=0.0, dense_fallback=False, error_feedback=False)
        x, y = batch(0, hvd.rank())
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        gen = torch.Generator().manual_seed(21 + hvd.rank())
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen).to(DEVICE)
            if how == "assigned":
                p.grad = g
            else:
                p.grad.data = g
        by_hand = {n: p.grad.cpu().numpy().copy() for n, p in model.named_parameters()}
        opt.synchronize()
        for n, p in model.named_parameters():
            np.testing.assert_allclose(p.grad.cpu().numpy(), sparse_allreduce(gather(by_hand[n]), 0.05),
                                       rtol=1e-5, atol=1e-6, err_msg=f"{how}: {n}")
        step_and_check_same(opt, model, how)
    for p in model.parameters():
        p.grad.data.copy_(torch.randn(p.shape, generator=gen).to(DEVICE))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.synchronize()
    assert any("p.grad.data.copy_" in str(w.message) and "NOT exchanged" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]


def check_skip_synchronize_without_synchronize_refused():
    """``step()`` inside ``skip_synchronize()`` with no ``synchronize()`` before it: p.grad holds
    each rank's own gradient (Horovod steps with it, the ranks drift apart, and its next
    ``zero_grad()`` fails naming neither). Refused on every rank, nothing applied; then
    ``synchronize()`` and the step inside ``skip_synchronize()`` go on as usual, the ranks equal."""
    model, opt = build(min_numel=500)
    x, y = batch(0, hvd.rank())
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with raises(RuntimeError, match=r"skip_synchronize\(\) while this step's gradients are still being exchanged",
                what="step() inside skip_synchronize() before synchronize()"):
        with opt.skip_synchronize():
            opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "the refused step moved a parameter"
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "the step after did nothing"
    for p in model.parameters():
        assert_same_on_all_ranks(p.detach().cpu().numpy(), "parameters after synchronize() and step()")


def check_step_closure():
    """``opt.step(closure)`` with a closure that zeroes, runs forward and backward and returns the
    loss (torch's convention): evaluated once, before the exchange, so every rank holds the same
    bits after every step, equal to the run with ``backward()`` before ``step()``; the closure's
    loss is returned. Inside ``skip_synchronize()`` its gradients could not be exchanged: refused."""
    models = []
    for use_closure in (False, True):
        model, opt = build(min_numel=500)
        for step in range(3):
            x, y = batch(step, hvd.rank())

            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss
            if use_closure:
                loss = opt.step(closure)
                assert torch.is_tensor(loss) and loss.ndim == 0, f"step(closure) returned {loss!r}"
            else:
                closure()
                opt.step()
            assert_same_on_all_ranks(model.fc1.weight.detach().cpu().numpy(), f"step {step}, closure {use_closure}")
        models.append(model)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), f"{name}: step(closure) differs from backward(); step()"
    with raises(RuntimeError, match="inside skip_synchronize", what="step(closure) inside skip_synchronize()"):
        with opt.skip_synchronize():
            opt.step(closure)


def check_empty_parameter():
    """A parameter with no elements and ``min_numel=0`` (which once made it a sparse bucket's
    member and shifted the bucket's segments by one: a ValueError at the first step): at density
    1 without the dense fallback every tensor's result is the numpy mean of the ranks' gradients."""
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    model.empty = torch.nn.Parameter(torch.zeros(0))
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), exchange="allgather",
                                        compression=hvd_topk.TopK(density=1.0), min_numel=0, dense_fallback=False)
    for step in range(2):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        (F.cross_entropy(model(x), y) + model.empty.sum()).backward()
        grads = {n: np.stack(gather(p.grad.cpu().numpy())) for n, p in model.named_parameters()}
        opt.synchronize()
        for n, p in model.named_parameters():
            np.testing.assert_allclose(p.grad.cpu().numpy(), grads[n].mean(axis=0), rtol=1e-6, atol=1e-7,
                                       err_msg=f"step {step} {n}")
        with opt.skip_synchronize():
            opt.step()


def check_plain_adam_warns():
    """Error feedback in front of torch's Adam/AdamW (NAdam, RAdam, Adamax, subclasses) warns once,
    naming the LocalAdamW recipe as the README gives it;
    the recipe itself, SGD, Adam without error feedback and Adam over a pinned dense exchange do not warn."""
    def recipe_warnings(make, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # once per place in the code, Python's default
            for _ in range(2):
                hvd_topk.DistributedOptimizer(make(Net().parameters()), **{"exchange": "allgather", **kwargs})
        return [str(w.message) for w in caught if "LocalAdamW" in str(w.message)]
    class MyAdamW(torch.optim.AdamW):  # a subclass, and torch's other adaptive ones, warn too
        pass

    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax, MyAdamW):
        got = recipe_warnings(cls)
        name = f"torch.optim.{cls.__name__}" if cls is not MyAdamW else "MyAdamW (a torch.optim.AdamW)"
        assert len(got) == 1 and f"in front of {name} trains" in got[0] and "fp16_values=True" in got[0], got
        assert 'exchange="allgather"' in got[0], got
    for make, kwargs in [(hvd_topk.LocalAdamW, {}), (lambda ps: torch.optim.SGD(ps, lr=0.1), {}),
                         (torch.optim.AdamW, {"error_feedback": False}), (torch.optim.AdamW, {"exchange": "dense"})]:
        assert recipe_warnings(make, **kwargs) == [], (make, kwargs)


def check_momentum_twice_warns():
    """momentum_correction with an inner optimizer's own momentum (SGD's momentum, Adam's beta1)
    warns that momentum is applied twice; with LocalAdamW or DeMo (whose residual already
    carries the past) it warns to leave it at 0; with SGD without momentum, or Adam with beta1 0
    (FrozenVarianceAdamW as its docstring says to build it), it is silent."""
    def caught(make):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            hvd_topk.DistributedOptimizer(make(Net().parameters()), exchange="allgather", momentum_correction=0.9)
        return [str(w.message) for w in got if "momentum_correction" in str(w.message)]
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                 lambda ps: hvd_topk.FrozenVarianceAdamW(ps, betas=(0.9, 0.95), freeze_step=5)):
        got = caught(make)
        assert len(got) == 1 and "applied twice" in got[0], got
    for make in (hvd_topk.LocalAdamW, hvd_topk.DeMo):
        got = caught(make)
        assert len(got) == 1 and "leave momentum_correction at 0" in got[0], got
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1),
                 lambda ps: hvd_topk.FrozenVarianceAdamW(ps, betas=(0.0, 0.95), freeze_step=5)):
        assert caught(make) == [], make


def check_horovod_positional_call():
    """A call written for hvd.DistributedOptimizer (0.28.1's order: ..., gradient_predivide_factor,
    num_groups, groups, sparse_as_dense, process_set), positional arguments included, works:
    num_groups=2 is groups=2 (the same buckets) with Horovod's DeprecationWarning."""
    def buckets(opt):
        engine = getattr(opt, hvd_topk.optimizer.ENGINE)
        return [[engine.names[m.param] for m in b.members] for b in engine.buckets]
    model = Net().to(DEVICE)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        old = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                            hvd_topk.TopK, 1, hvd.Average, 1.0, 2, None, False,
                                            hvd.global_process_set, min_numel=500)
    assert any(issubclass(w.category, DeprecationWarning) and "num_groups" in str(w.message) for w in got), got
    new = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                        groups=2, min_numel=500)
    default = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                            min_numel=500)
    assert buckets(old) == buckets(new) != buckets(default), (buckets(old), buckets(new), buckets(default))


def check_local_adamw(steps=4, density=0.05, lr=0.01, betas=(0.9, 0.95), eps=1e-3, wd=0.1,
                      lr_in_residual=False, residual_decay=1.0, exchange="allgather", global_variance=False,
                      skip=None, idle=None, signal="mean", variance_sketch=0, compact=False):
    """LocalAdamW: each rank's numpy Adam on its own gradient gives its update; the exchanged
    result is the error-feedback contract applied to those updates; the step is
    p * (1 - lr * wd) - lr * result on every rank. (A large eps: with a tiny one the first
    updates are all +-1, and Top-K among ties would compare rounding, not the method.)
    ``lr_in_residual``: the update is lr_t * Adam's, the step p * (1 - lr * wd) - result; the
    learning rate halves every step, so an entry applied at another step's rate shows.
    ``global_variance``: v is replaced by v/P + (1 - 1/P) mean^2 (bias-corrected EMAs);
    ``signal="mean+lag1"``: mean^2 by max(mean^2, min(-lag1, v)), lag1 the EMA of g_t g_{t-1}.
    ``variance_sketch`` (with global_variance): at least every tensor's size, so that the sketch
    is exact: each tensor's estimate rescaled by the bias-corrected EMA (beta2) of |the ranks'
    average gradient|^2 over the steps before this one (zeros from a rank without a gradient),
    the same on every rank, over the sum of this rank's previous (unrescaled) estimate.
    ``skip``: ``{step: ranks}`` whose forward leaves head2 out at that step: such a rank's
    update of head2 is zero and its moments stay (as a plain optimizer skips a parameter
    without a gradient); the exchanged result is applied all the same. ``idle``: ``{step: ranks}``
    that run no backward at all at that step (every update of theirs zero, the result applied).
    ``compact``: ``TopK(compact=...)``'s wire, rounded as the reference says."""
    rank, size = hvd.rank(), hvd.size()
    skip, idle = skip or {}, idle or {}
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    inner = hvd_topk.LocalAdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                lr_in_residual=lr_in_residual, global_variance=global_variance, signal=signal,
                                variance_sketch=variance_sketch)
    opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(), exchange=exchange,
                                        compression=hvd_topk.TopK(density=density, compact=compact), min_numel=500,
                                        residual_decay=residual_decay)
    if variance_sketch:
        assert all(p.numel() <= variance_sketch for p in model.parameters()), "the reference needs exact sketches"
    shadow = copy.deepcopy(model)
    ref = ErrorFeedbackReference(size, decay=residual_decay, compact=compact)
    moments = {}  # (rank, name) -> (m, v, mean, lag1, previous gradient, steps taken) in float64
    measured = {}  # name -> (EMA of |the ranks' average gradient|^2, sketches absorbed)
    last_sums = {}  # (rank, name) -> the sum of that rank's previous estimate (unrescaled)
    base_lr = lr
    for step in range(steps):
        if lr_in_residual:
            lr = base_lr * 0.5 ** step
            for group in opt.param_groups:
                group["lr"] = lr
        x, y = batch(step, rank)
        skipping = skip.get(step, ())
        use_head2 = rank not in skipping
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad()
        F.cross_entropy(shadow(x, use_head2), y).backward()
        before = {n: p.detach().cpu().numpy().astype(np.float64) for n, p in model.named_parameters()}
        opt.zero_grad()
        if rank not in idle.get(step, ()):
            F.cross_entropy(model(x, use_head2), y).backward()
        opt.synchronize()
        every = {}
        for name, p in model.named_parameters():
            updates = []
            mine = dict(shadow.named_parameters())[name].grad
            mine = np.zeros(p.shape) if mine is None else mine.cpu().numpy().astype(np.float64)
            grads = gather(mine)
            sq, count = measured.get(name, (0.0, 0))
            for r, g in enumerate(grads):
                if (name.startswith("head2.") and r in skipping) or r in idle.get(step, ()):
                    grads[r] = np.zeros(p.shape)  # (the shadow ran it; this rank's sketch is zeros)
                    updates.append(np.zeros(p.shape))  # no gradient on rank r: no Adam step
                    continue
                m, v, mean, lag1, prev, t = moments.get((r, name), (0.0, 0.0, 0.0, 0.0, None, 0))
                m, v = betas[0] * m + (1 - betas[0]) * g, betas[1] * v + (1 - betas[1]) * g * g
                mean = betas[1] * mean + (1 - betas[1]) * g
                if prev is not None:
                    lag1 = betas[1] * lag1 + (1 - betas[1]) * g * prev
                t += 1
                moments[(r, name)] = (m, v, mean, lag1, g, t)
                v_hat, mean_hat = v / (1 - betas[1] ** t), mean / (1 - betas[1] ** t)
                if global_variance and size > 1:
                    signal_hat = mean_hat ** 2
                    if signal == "mean+lag1" and t > 1:
                        signal_hat = np.maximum(signal_hat, np.minimum(-lag1 / (1 - betas[1] ** (t - 1)), v_hat))
                    v_hat = signal_hat + (v_hat - signal_hat) / size
                    if variance_sketch:
                        unscaled_sum = v_hat.sum()
                        if count:
                            v_hat = v_hat * (sq / (1 - betas[1] ** count)) / last_sums[(r, name)]
                        last_sums[(r, name)] = np.float32(unscaled_sum)
                updates.append(m / (1 - betas[0] ** t) / (np.sqrt(v_hat) + eps)
                               * (lr if lr_in_residual else 1.0))
            every[name] = np.stack(updates)
            if variance_sketch and global_variance and size > 1:
                average = np.mean(grads, axis=0)
                measured[name] = (betas[1] * sq + (1 - betas[1]) * np.sum(average ** 2), count + 1)
        big = [n for n, p in model.named_parameters() if p.numel() >= 500]
        shared = want_sparse(ref, big, every, density, step, exchange=exchange)
        for name, p in model.named_parameters():
            want = shared[name] if name in big else every[name].mean(axis=0)
            np.testing.assert_allclose(p.grad.cpu().numpy(), want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"local adamw: step {step} {name}")
        step_and_check_same(opt, model, f"local adamw: step {step}")
        for name, p in model.named_parameters():
            applied = p.grad.cpu().numpy() * (1.0 if lr_in_residual else lr)
            np.testing.assert_allclose(p.detach().cpu().numpy(), before[name] * (1 - lr * wd) - applied,
                                       rtol=1e-5, atol=1e-7, err_msg=f"local adamw: parameter {name}")
    with raises(ValueError, match="does not support loss scaling", what="LocalAdamW with a GradScaler"):
        hvd_topk.DistributedOptimizer(hvd_topk.LocalAdamW(Net().parameters()), grad_scaler=torch.amp.GradScaler("cpu"))
    # a GradScaler stepping it without the option: told to use bf16 (before: told to pass the
    # scaler, which is then refused as above)
    for inner in (hvd_topk.LocalAdamW, hvd_topk.DeMo):
        model = Net()
        opt = hvd_topk.DistributedOptimizer(inner(model.parameters(), lr=1e-3), named_parameters=model.named_parameters(),
                                            min_numel=500, exchange="allgather")
        scaler = torch.amp.GradScaler("cpu")
        x, y = batch(0, hvd.rank())
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        with raises(RuntimeError, match=rf"over {inner.__name__}, which does not support loss scaling.*bf16 autocast",
                    what=f"{inner.__name__} stepped by a GradScaler"):
            scaler.step(opt)
        opt.synchronize()  # (finish the exchange the scaler started, so that the next check starts clean)


def check_local_adamw_gradient_without_its_last_hook(steps=3):
    """A gradient whose last hook never fired goes through LocalAdamW's update as one from a hook
    does: a step after one of ``backward_passes_per_step=2`` passes, and ``p.grad`` set by hand
    from ``torch.autograd.grad``, end where ``backward_passes_per_step=1`` with ``.backward()``
    does (before 2026-12-04 both applied the raw gradient as the update)."""
    rank = hvd.rank()

    def make(passes):
        torch.manual_seed(0)
        model = Net().to(DEVICE)
        inner = hvd_topk.LocalAdamW(model.parameters(), lr=0.01, eps=1e-3, weight_decay=0.1)
        opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(), exchange="allgather",
                                            compression=hvd_topk.TopK(density=0.05), min_numel=500,
                                            backward_passes_per_step=passes)
        return model, opt

    (ref_model, ref_opt), (part_model, part_opt), (hand_model, hand_opt) = make(1), make(2), make(1)
    for step in range(steps):
        x, y = batch(step, rank)
        for model, opt in ((ref_model, ref_opt), (part_model, part_opt)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        hand_opt.zero_grad()
        params = list(hand_model.parameters())
        for p, g in zip(params, torch.autograd.grad(F.cross_entropy(hand_model(x), y), params)):
            p.grad = g
        hand_opt.step()
        for name, want in ref_model.named_parameters():
            for label, model in (("one of two passes", part_model), ("p.grad set by hand", hand_model)):
                np.testing.assert_allclose(model.get_parameter(name).detach().cpu().numpy(), want.detach().cpu().numpy(),
                                           rtol=1e-6, atol=1e-7, err_msg=f"{label}: step {step} {name}")


def check_step_hooks_once_after_load():
    """A registered step pre- and post-hook runs once a step, as on the plain torch optimizer,
    also after ``load_state_dict`` (before 2026-12-04 torch's load wrapped the wrapper's step in
    the hook runner a second time: twice a step), for DistributedOptimizer and LocalSteps."""
    rank = hvd.rank()
    for make in (lambda model: hvd_topk.DistributedOptimizer(
                     torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                     compression=hvd_topk.TopK(density=0.05), exchange="allgather", min_numel=500),
                 lambda model: hvd_topk.LocalSteps(
                     torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                     compression=hvd_topk.TopK(density=0.05), exchange="allgather", min_numel=500, sync_every=2)):
        torch.manual_seed(0)
        model = Net().to(DEVICE)
        opt = make(model)
        calls = []
        opt.register_step_pre_hook(lambda *args: calls.append("pre"))
        opt.register_step_post_hook(lambda *args: calls.append("post"))
        for step in range(4):
            if step == 2:
                opt.load_state_dict(opt.state_dict())
            calls.clear()
            x, y = batch(step, rank)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            assert calls == ["pre", "post"], f"{type(opt).__name__} step {step}: hooks ran {calls}"


def check_scheduler_on_the_inner_optimizer_after_load():
    """An LR scheduler built on the user's optimizer before wrapping, resumed from a checkpoint
    (model, optimizer, scheduler; fresh objects, one state per rank): bitwise equal at step 5
    to the run that never stopped, for DistributedOptimizer and LocalSteps, and the user's
    optimizer holds the loaded state (wrapped again, it goes on from it). Before, the load put
    new param groups and state in the wrapper only: the scheduler went on halving the old
    groups' rate, and the wrapper kept the loaded one, silently."""
    wraps = (lambda inner, model: hvd_topk.DistributedOptimizer(
                 inner, named_parameters=model.named_parameters(), compression=hvd_topk.TopK(density=0.05),
                 exchange="allgather", min_numel=500),
             lambda inner, model: hvd_topk.LocalSteps(
                 inner, named_parameters=model.named_parameters(), compression=hvd_topk.TopK(density=0.05),
                 exchange="allgather", min_numel=500, sync_every=2))

    def build_run(wrap, seed=0):
        torch.manual_seed(seed)
        model = Net().to(DEVICE)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.5 ** s)
        return model, inner, sched, wrap(inner, model)

    def train_scheduled(model, opt, sched, steps, start=0):
        for step in range(start, start + steps):
            train(model, opt, 1, start=step)
            sched.step()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")  # its step-order guess
        for wrap in wraps:
            model, _, sched, opt = build_run(wrap)
            train_scheduled(model, opt, sched, 5)
            model_b, _, sched_b, opt_b = build_run(wrap)
            train_scheduled(model_b, opt_b, sched_b, 2)
            saved = copy.deepcopy({"model": model_b.state_dict(), "opt": opt_b.state_dict(),
                                   "sched": sched_b.state_dict()})
            model_c, inner_c, sched_c, opt_c = build_run(wrap, seed=7)
            model_c.load_state_dict(saved["model"])
            opt_c.load_state_dict(saved["opt"])
            sched_c.load_state_dict(saved["sched"])
            what = "LocalSteps" if hasattr(opt_c, "_hvd_topk_local") else "DistributedOptimizer"
            assert inner_c.param_groups[0]["lr"] == 0.1 * 0.5 ** 2, (what, inner_c.param_groups[0]["lr"])
            for p in model_c.parameters():
                assert torch.equal(inner_c.state[p]["momentum_buffer"], opt_c.state[p]["momentum_buffer"]), what
            train_scheduled(model_c, opt_c, sched_c, 3, start=2)
            for (name, a), c in zip(model.named_parameters(), model_c.parameters()):
                assert torch.equal(a, c), f"{what}: resumed with the scheduler, {name} differs " \
                                          f"(max {float((a - c).abs().max())})"
            assert opt_c.param_groups[0]["lr"] == 0.1 * 0.5 ** 5, (what, opt_c.param_groups[0]["lr"])


def loaded_on_rank_0_and_broadcast(build_one, steps=3):
    """``build_one()``'s model and optimizer trained ``steps`` steps and saved; fresh ones
    (``build_one(seed=5)``) of which rank 0 alone loads that checkpoint, then Horovod's
    broadcasts of the parameters and the optimizer state from rank 0, as a resumed job does.
    Returns ``(saved, model, optimizer)``."""
    model_b, opt_b = build_one()
    train(model_b, opt_b, steps)
    saved = copy.deepcopy({"model": model_b.state_dict(), "opt": opt_b.state_dict()})
    model_c, opt_c = build_one(seed=5)
    if hvd.rank() == 0:
        model_c.load_state_dict(saved["model"])
        opt_c.load_state_dict(saved["opt"])
    hvd.broadcast_parameters(model_c.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt_c, root_rank=0)
    return saved, model_c, opt_c


def rolled_back_on_rank_0(build_one, saved_at=2, rolled_at=8):
    """``build_one()``'s model and optimizer trained to ``rolled_at`` steps, then rolled back in
    mid-run to their checkpoint of step ``saved_at``: rank 0 alone loads it into the same
    objects, then Horovod's broadcasts from rank 0 (its documented pattern). Returns
    ``(model, optimizer, warnings caught on this rank from the first step after)``."""
    model, opt = build_one()
    train(model, opt, saved_at)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, rolled_at - saved_at, start=saved_at)
    if hvd.rank() == 0:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, opt, 1, start=saved_at)
    return model, opt, [str(w.message) for w in caught]


def check_rollback_on_rank_0_auto():
    """exchange="auto" (one timed step per candidate), decided by step 8, rolled back on rank 0
    to its step-2 checkpoint (mid-trial), then Horovod's broadcasts: every rank runs the same
    exchange at every step after, and they stay in step. (Only rank 0's trial restarted: the
    others kept their choice, the ranks ran different exchanges and the job hung.)"""
    model, opt, _ = rolled_back_on_rank_0(lambda: build(min_numel=500, exchange="auto", exchange_trial_steps=1))
    for step in range(3, 12):
        train(model, opt, 1, start=step)
        families = hvd.allgather_object(opt.compression_stats()["exchange_family"])
        assert len(set(families)) == 1, f"step {step}: the ranks ran {families}"
    assert opt.compression_stats()["exchange_choice"] is not None, opt.compression_stats()["exchange_reason"]
    for name, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().cpu().numpy(), f"after the rollback: {name}")


def check_rollback_on_rank_0_residuals():
    """Rolled back on rank 0 to its step-2 checkpoint at step 8, then Horovod's broadcasts: the
    run goes on bitwise as one whose other ranks were fresh (``loaded_on_rank_0_and_broadcast``,
    residuals zero), and those ranks are told, once, that their residuals were dropped. (They
    kept the residuals of steps 2-8, which the checkpoint does not have, and added them back.)"""
    build_one = lambda seed=0: build(min_numel=500, seed=seed)  # noqa: E731
    model, opt, caught = rolled_back_on_rank_0(build_one)
    _, model_ref, opt_ref = loaded_on_rank_0_and_broadcast(build_one, steps=2)
    with warnings.catch_warnings(record=True) as fresh:
        warnings.simplefilter("always")
        train(model_ref, opt_ref, 1, start=2)
    train(model, opt, 3, start=3)
    train(model_ref, opt_ref, 3, start=3)
    for (name, p), q in zip(model.named_parameters(), model_ref.parameters()):
        assert torch.equal(p, q), f"rank {hvd.rank()}: {name} differs from the run with fresh ranks " \
                                  f"(max {float((p - q).abs().max())})"
    dropped = [m for m in caught if "without load_state_dict() on this rank" in m]
    assert len(dropped) == (0 if hvd.rank() == 0 else 1), caught
    assert not [str(w.message) for w in fresh if "without load_state_dict()" in str(w.message)], \
        "a fresh rank (zero residuals) was warned"


def check_local_adamw_broadcast_from_rank_0():
    """LocalAdamW with ``signal="mean+lag1"``, beta1 0.5 and ``variance_sketch=16`` (state
    entries made at first use): a checkpoint loaded on rank 0 alone into fresh objects, then
    Horovod's broadcasts. They finish (a fresh rank lacked entries rank 0 broadcast, and the job
    hung), every rank then holds the same state entries, and training goes on with the ranks'
    parameters equal."""
    def build_local(seed=0):
        torch.manual_seed(seed)
        model = Net().to(DEVICE)
        inner = hvd_topk.LocalAdamW(model.parameters(), lr=0.01, betas=(0.5, 0.95), signal="mean+lag1",
                                    variance_sketch=16)
        return model, hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                                    compression=hvd_topk.TopK(density=0.05), exchange="allgather",
                                                    min_numel=500)
    _, model_c, opt_c = loaded_on_rank_0_and_broadcast(build_local)
    keys = set(opt_c.state[model_c.fc1.weight])  # every rank the same entries: AdamW's, and the options'
    assert keys == {"step", "exp_avg", "exp_avg_sq", "grad_mean", "grad_lag1", "grad_prev", "sketch_sq", "sketches",
                    "estimate_sum"}, sorted(keys)
    train(model_c, opt_c, 2, start=3)
    for name, p in model_c.named_parameters():
        assert torch.isfinite(p).all(), name
        assert_same_on_all_ranks(p.detach().cpu().numpy(), f"after the broadcast: {name}")


def check_frozen_variance_broadcast_from_rank_0():
    """FrozenVarianceAdamW (weight decay 0.1) from a checkpoint loaded on rank 0 alone, then
    Horovod's broadcasts: every rank holds the checkpoint's parameters, bitwise, and trains on
    with the ranks equal. (Horovod's probe step on the fresh ranks applied weight decay once, as
    it does with torch's AdamW, and the ranks' weights parted silently.)"""
    def build_frozen(seed=0):
        torch.manual_seed(seed)
        model = Net().to(DEVICE)
        inner = hvd_topk.FrozenVarianceAdamW(model.parameters(), lr=0.01, betas=(0.0, 0.95), weight_decay=0.1,
                                             freeze_step=5)
        return model, hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                                    compression=hvd_topk.TopK(density=0.05), exchange="allgather",
                                                    min_numel=500, momentum_correction=0.9)
    saved, model_c, opt_c = loaded_on_rank_0_and_broadcast(build_frozen)
    for name, p in model_c.named_parameters():
        assert torch.equal(p.detach(), saved["model"][name]), \
            f"rank {hvd.rank()}: {name} is not the checkpoint's after the broadcast " \
            f"(max {float((p.detach() - saved['model'][name]).abs().max())})"
    assert int(opt_c.state[model_c.fc1.weight]["step"]) == 3
    train(model_c, opt_c, 2, start=3)
    for name, p in model_c.named_parameters():
        assert_same_on_all_ranks(p.detach().cpu().numpy(), f"after the broadcast: {name}")


def check_local_adamw_resume_bf16():
    """LocalAdamW with the variance sketch on bfloat16 parameters: saved after 3 steps, loaded
    into fresh objects, bitwise equal after 6 to the run that never stopped (torch's load cast
    the sketch's float32 scalars to bfloat16, and the resume drifted)."""
    def build_bf16(seed=0):
        torch.manual_seed(seed)
        model = Net().to(DEVICE, torch.bfloat16)
        inner = hvd_topk.LocalAdamW(model.parameters(), lr=0.01, betas=(0.0, 0.95), variance_sketch=16)
        return model, hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                                    compression=hvd_topk.TopK(density=0.05), exchange="allgather",
                                                    min_numel=500)

    def train_bf16(model, opt, steps, start=0):
        for step in range(start, start + steps):
            x, y = batch(step, hvd.rank())
            opt.zero_grad()
            F.cross_entropy(model(x.to(torch.bfloat16)).float(), y).backward()
            opt.step()
    model, opt = build_bf16()
    train_bf16(model, opt, 6)
    model_b, opt_b = build_bf16()
    train_bf16(model_b, opt_b, 3)
    saved = copy.deepcopy({"model": model_b.state_dict(), "opt": opt_b.state_dict()})
    assert saved["opt"]["state"][0]["sketch_sq"].dtype == torch.float64
    model_c, opt_c = build_bf16(seed=5)
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    assert opt_c.state[model_c.fc1.weight]["sketch_sq"].dtype == torch.float64
    train_bf16(model_c, opt_c, 3, start=3)
    for (name, a), c in zip(model.named_parameters(), model_c.parameters()):
        assert torch.equal(a, c), f"bf16 resume: {name} differs (max {float((a.float() - c.float()).abs().max())})"


def check_local_adamw_resume(**options):
    """LocalAdamW's moments and the residuals: ``check_inner_resume``, betas changed before the
    save. ``options``: LocalAdamW's ``lr_in_residual``, ``global_variance``, the optimizer's
    ``residual_decay``."""
    lr_in_residual = options.pop("lr_in_residual", False)
    global_variance = options.pop("global_variance", False)
    signal = options.pop("signal", "mean")
    sketch = options.pop("variance_sketch", 0)
    check_inner_resume(lambda params: hvd_topk.LocalAdamW(params, lr=0.01, betas=(0.0, 0.95), weight_decay=0.1,
                                                          lr_in_residual=lr_in_residual,
                                                          global_variance=global_variance, signal=signal,
                                                          variance_sketch=sketch),
                       {"betas": (0.5, 0.9)}, **options)


def check_local_adamw_sketch_of_a_skipped_step():
    """A step where the last rank's gradient holds inf: the exchange carries it to every rank,
    the step is skipped there, and the ranks' average sketch of that step is absorbed on no
    rank (the docstring's rule). Before, that rank sent zeros for its sketch, the others'
    average stayed finite and was folded into every rank's measure of |mean g|^2 with one rank
    counted as zero. Checked against the state before the step, on every rank."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(40, 30))
    opt = hvd_topk.DistributedOptimizer(
        hvd_topk.LocalAdamW([w], lr=0.01, betas=(0.0, 0.95), global_variance=True, variance_sketch=16),
        named_parameters=[("w", w)], exchange="allgather", min_numel=1, compression=hvd_topk.TopK(density=0.1))
    gen = torch.Generator().manual_seed(10 + rank)
    for step in range(4):
        before = (opt.state[w].get("sketches"), copy.deepcopy(opt.state[w].get("sketch_sq")), w.detach().clone())
        opt.zero_grad()
        grad = torch.randn(40, 30, generator=gen)
        if step == 2 and rank == size - 1:
            grad[3, 4] = float("inf")
        (w * grad).sum().backward()
        opt.step()
        if step == 2:
            assert torch.equal(w.detach(), before[2]), "the step with an inf should be skipped"
            assert opt.state[w]["sketches"] == before[0] and torch.equal(opt.state[w]["sketch_sq"], before[1]), \
                f"rank {rank}: the skipped step's sketch was absorbed ({before[0]} -> {opt.state[w]['sketches']})"
        else:  # one absorbed a step, none at step 2
            assert opt.state[w]["sketches"] == step + (step < 2), (step, opt.state[w]["sketches"])
    assert_same_on_all_ranks(w.detach().numpy(), "parameters after a skipped step")
    assert_same_on_all_ranks(opt.state[w]["sketch_sq"].numpy(), "the sketch's measure")


def check_inner_resume(make_inner, changed, compact=False, **options):
    """The inner optimizer's state and the residuals saved at step 3 (one state per rank) and
    loaded into fresh objects, with param-group settings ``changed`` before the save (which the
    checkpoint must carry): bitwise equal at step 6 to the run that never stopped."""
    def build_inner(seed=0):
        torch.manual_seed(seed)
        model = Net().to(DEVICE)
        return model, hvd_topk.DistributedOptimizer(make_inner(model.parameters()),
                                                    named_parameters=model.named_parameters(),
                                                    exchange="allgather", min_numel=500,
                                                    compression=hvd_topk.TopK(density=0.05, compact=compact),
                                                    **options)

    def change(opt):
        for group in opt.param_groups:
            group.update(changed)  # what a resumed run must keep using
    model, opt = build_inner()
    train(model, opt, 3)
    change(opt)
    train(model, opt, 3, start=3)
    model_b, opt_b = build_inner()
    train(model_b, opt_b, 3)
    change(opt_b)
    saved = copy.deepcopy({"model": model_b.state_dict(), "opt": opt_b.state_dict()})
    model_c, opt_c = build_inner(seed=123)
    train(model_c, opt_c, 1)  # already stepping when it loads the checkpoint
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    train(model_c, opt_c, 3, start=3)
    for (name, a), c in zip(model.named_parameters(), model_c.parameters()):
        assert torch.equal(a, c), f"resume: {name} differs (max {float((a - c).abs().max())})"
    assert_same_on_all_ranks(next(model_c.parameters()).detach().cpu().numpy(), "resumed parameters")



RECIPE_OPTIONS = {"lr_in_residual": True, "global_variance": True, "signal": "mean", "variance_sketch": "auto"}


def dense_adamw_checkpoint():
    """Model and optimizer state of a dense AdamW run (stock Horovod) after 3 steps."""
    torch.manual_seed(0)
    dense_model = Net().to(DEVICE)
    dense = hvd.DistributedOptimizer(torch.optim.AdamW(dense_model.parameters(), lr=0.01, betas=(0.0, 0.95),
                                                       weight_decay=0.1),
                                     named_parameters=dense_model.named_parameters())
    train(dense_model, dense, 3)
    return copy.deepcopy({"model": dense_model.state_dict(), "opt": dense.state_dict()})


def recipe_from(model_state, checkpoint, load=True, broadcast=False):
    """The recipe (LocalAdamW at 5%) built over ``model_state``, ``checkpoint`` loaded where
    ``load`` (this rank), then broadcast from rank 0 if asked, trained 3 steps from step 3:
    model, optimizer and the load's warnings."""
    torch.manual_seed(1)
    model = Net().to(DEVICE)
    model.load_state_dict(model_state)
    opt = hvd_topk.DistributedOptimizer(hvd_topk.LocalAdamW(model.parameters(), lr=0.01, betas=(0.0, 0.95),
                                                            weight_decay=0.1, **RECIPE_OPTIONS),
                                        named_parameters=model.named_parameters(), exchange="allgather",
                                        min_numel=500, compression=hvd_topk.TopK(density=0.05))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if load:
            opt.load_state_dict(copy.deepcopy(checkpoint))
    if broadcast:
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    train(model, opt, 3, start=3)
    return model, opt, [str(w.message) for w in caught]


def check_dense_adamw_checkpoint_on_rank_0_broadcast():
    """The dense AdamW checkpoint loaded into the recipe on rank 0 alone, then
    ``hvd.broadcast_optimizer_state`` (Horovod's pattern): torch AdamW's own group options
    (``amsgrad``, ``foreach``, ...) are left out at the load, so the broadcast finds the same
    keys on every rank (the others raised ``KeyError: 'amsgrad.0'``). Truth: the same checkpoint
    loaded on every rank, bitwise after 3 steps."""
    saved = dense_adamw_checkpoint()
    model, opt, _ = recipe_from(saved["model"], saved["opt"], load=hvd.rank() == 0, broadcast=True)
    assert not any(k in g for g in opt.param_groups for k in ("amsgrad", "foreach", "fused")), opt.param_groups[0]
    want, _, _ = recipe_from(saved["model"], saved["opt"])
    for (name, a), b in zip(model.named_parameters(), want.parameters()):
        assert torch.equal(a, b), f"{name} differs from the run that loaded on every rank"


def check_dense_adamw_checkpoint_into_the_recipe():
    """A dense AdamW run (stock Horovod) checkpointed at step 3 and continued with the recipe:
    LocalAdamW's options that checkpoint lacks keep the values the recipe was built with (they
    were read as off before, in silence: lr_in_residual, global_variance), with a warning naming
    them. Truth: the same checkpoint with those options written into its param groups by hand,
    loaded into the same recipe, bitwise at step 6."""
    saved = dense_adamw_checkpoint()
    model, opt, said = recipe_from(saved["model"], saved["opt"])
    assert any(re.search(r"lack lr_in_residual, global_variance, signal, variance_sketch .*keep the values", s)
               for s in said), said
    assert all(opt.param_groups[0][k] == v for k, v in RECIPE_OPTIONS.items()), opt.param_groups[0]
    by_hand = {**saved["opt"], "param_groups": [{**g, **RECIPE_OPTIONS} for g in saved["opt"]["param_groups"]]}
    want, _, said_by_hand = recipe_from(saved["model"], by_hand)
    assert not any("lack" in s for s in said_by_hand), said_by_hand
    for (name, a), b in zip(model.named_parameters(), want.parameters()):
        assert torch.equal(a, b), f"{name} differs from the hand-completed checkpoint's run"
    assert_same_on_all_ranks(next(model.parameters()).detach().cpu().numpy(), "parameters")


def check_demo(normalise="sign", exchange="allgather", steps=5, density=0.05, lr=0.05, beta=0.8, wd=0.1):
    """DeMo: each rank's accumulator is beta * residual + lr_t * g (the error-feedback contract
    with decay beta, fed lr-weighted gradients; the small tensors' average is plain), and every
    rank applies p * (1 - lr_t * wd) - lr_t * normalise(result). The learning rate halves every
    step, so an accumulator fed at another step's rate shows."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    inner = hvd_topk.DeMo(model.parameters(), lr=lr, beta=beta, weight_decay=wd, normalise=normalise)
    opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(), exchange=exchange,
                                        compression=hvd_topk.TopK(density=density), min_numel=500)
    assert opt._hvd_topk.options.residual_decay == beta
    shadow = copy.deepcopy(model)
    ref = ErrorFeedbackReference(size, decay=beta)
    for step in range(steps):
        lr_t = lr * 0.5 ** step
        for group in opt.param_groups:
            group["lr"] = lr_t
        x, y = batch(step, rank)
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad()
        F.cross_entropy(shadow(x), y).backward()
        before = {n: p.detach().cpu().numpy().astype(np.float32) for n, p in model.named_parameters()}
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        fed = {name: np.stack(gather(dict(shadow.named_parameters())[name].grad.cpu().numpy())) * np.float32(lr_t)
               for name, _ in model.named_parameters()}
        big = [n for n, p in model.named_parameters() if p.numel() >= 500]
        want = want_sparse(ref, big, fed, density, step, exchange=exchange)
        for name, p in model.named_parameters():
            if name not in big:
                want[name] = fed[name].mean(axis=0)
            np.testing.assert_allclose(p.grad.cpu().numpy(), want[name], rtol=1e-5, atol=1e-9,
                                       err_msg=f"demo: step {step} {name}")
        step_and_check_same(opt, model, f"demo: step {step}")
        for name, p in model.named_parameters():
            avg = p.grad.cpu().numpy().astype(np.float64)
            if normalise == "sign":
                move = np.sign(avg)
            else:
                rms = np.sqrt(np.mean(avg ** 2))
                move = avg / rms if rms > 0 else avg
            np.testing.assert_allclose(p.detach().cpu().numpy(), before[name] * (1 - lr_t * wd) - lr_t * move,
                                       rtol=1e-5, atol=1e-7, err_msg=f"demo: parameter {name}")
    with raises(ValueError, match="sets the residual decay itself", what="DeMo with another residual_decay"):
        hvd_topk.DistributedOptimizer(hvd_topk.DeMo(Net().parameters(), beta=0.9), residual_decay=0.5)


def contract(label, **options):
    """The named check of the contract with these options: one line in CHECKS."""
    return f"contract: {label}", lambda: check_contract(label, **options)


# Run in this order on every rank; add a check with one line.


def _after_one_backward(make_model):
    """A ``make_model()`` under the optimizer (SGD, 10%, the allgather), one backward taken."""
    torch.manual_seed(0)
    model = make_model().to(DEVICE)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopK(density=0.1), exchange="allgather")
    x, y = batch(0, hvd.rank(), n=8)
    F.cross_entropy(model(x), y).backward()
    return model, opt


def check_zero_grad_with_a_bucket_not_launched_refused():
    """``opt.zero_grad()`` after backward, before step, is Horovod's AssertionError also when a
    bucket has not launched yet (an unused layer in it): its gradients are already folded into
    the residual. Before the fix it was accepted, the fold stayed, and the next backward raised
    a misleading "computed more than backward_passes_per_step times"."""
    model, opt = _after_one_backward(WithUnused)
    assert opt._hvd_topk.taken_in() and not opt._hvd_topk.pending()
    with raises(AssertionError, match=r"zero_grad\(\) was called after loss\.backward\(\)", what="zero_grad"):
        opt.zero_grad()
    opt.step()  # the step goes on as if zero_grad had not been called
    for name, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().cpu().numpy(), f"after the refused zero_grad: {name}")


def check_zero_grad_in_flight_in_an_elastic_worker_names_torch_state():
    """In an elastic worker (``HOROVOD_ELASTIC=1``, set here after construction) a zero_grad with
    exchanges in flight is most likely a reset whose restore left this optimizer out of
    ``TorchState``: the refusal says so (it only spoke of a race condition; a review). Outside
    elastic jobs the message has no such hint."""
    _, opt = _after_one_backward(Net)
    assert opt._hvd_topk.pending()
    os.environ["HOROVOD_ELASTIC"] = "1"
    try:
        with raises(AssertionError, match=r"put this optimizer in hvd\.elastic\.TorchState", what="elastic zero_grad"):
            opt.zero_grad()
    finally:
        del os.environ["HOROVOD_ELASTIC"]
    with raises(AssertionError, match=r"race condition\. If you stepped", what="zero_grad"):
        opt.zero_grad()
    opt.step()


def check_stepping_the_wrapped_optimizer_is_named():
    """Stepping the optimizer passed in (the DDP hook's pattern) instead of the one returned
    applies this rank's own gradient with no exchange; the next backward meets Horovod's error,
    which now names that cause (a user was sent to ``backward_passes_per_step``)."""
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(), exchange="allgather")
    x, y = batch(0, hvd.rank())
    F.cross_entropy(model(x), y).backward()
    inner.step()  # where opt.step() was meant
    model.zero_grad()
    with raises(AssertionError, match="step the returned one", what="a second backward after inner.step()"):
        F.cross_entropy(model(x), y).backward()
    # the first step's exchange, still in flight, finished: the next check starts clean. The
    # gradients the hooks took in were zeroed through the model since: said once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.synchronize()
    assert [w for w in caught if "was written to or replaced after backward()" in str(w.message)], \
        [str(w.message) for w in caught]


def check_bf16_model_counted_against_dense_fp32():
    """A bf16 model: "vs dense fp32" is 4 bytes an element, whatever the parameters' dtype (a bf16
    dense allreduce travels as fp32 through Horovod). Pinned dense, sent == dense fp32 (the ratio
    read 2.0, against bf16's 2 bytes an element, and the DDP hook's 0.5 disagreed)."""
    torch.manual_seed(0)
    model = Net().to(DEVICE).to(torch.bfloat16)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), exchange="dense")
    n = sum(p.numel() for p in model.parameters())
    for step in range(2):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        F.cross_entropy(model(x.to(torch.bfloat16)).float(), y).backward()
        opt.step()
    stats = opt.compression_stats()
    assert stats["bytes_dense"] == 2 * 4 * n and stats["bytes_sent"] == stats["bytes_dense"], (n, stats)


def check_bf16_gradients_that_cancel(exchange):
    """bf16 gradients whose ranks' values nearly cancel: the average is summed in float32 and
    rounded to bf16 once, on every exchange (the allgather's decode added each rank's values into
    the bf16 gradient in turn: at 3 ranks 1 + 2**-8 - 1 read 0 where the mean is 2**-8 / 3). And
    values whose sum is not exact in bf16: the sparse allreduce rounded the sum to bf16, then
    divided it (at 3 ranks -2.046875 where the mean rounded once is -2.03125)."""
    for value_of in (nearly_cancelling, rounded_twice_apart):
        p = torch.nn.Parameter(torch.zeros(2000, dtype=torch.bfloat16, device=DEVICE))
        opt = hvd_topk.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("w", p)],
                                            compression=hvd_topk.TopK(density=0.0005), exchange=exchange,
                                            hierarchical=False, min_numel=1)
        g = torch.zeros(2000, device=DEVICE)
        g[0] = value_of(hvd.rank(), hvd.size())
        opt.zero_grad()
        (p.float() * g).sum().backward()
        opt.step()
        want = bfloat16_mean_rounded_once([value_of(r, hvd.size()) for r in range(hvd.size())])
        assert float(p.grad[0]) == want and not p.grad[1:].any(), \
            (exchange, value_of.__name__, float(p.grad[0]), want)


def check_bf16_gradients_with_fp16_values(exchange):
    """``TopK(fp16_values=True)`` over bf16 gradients: the allgather's values travel as bf16
    (already 2 bytes), so one beyond float16's 65504 arrives as the ranks' mean, not inf (they
    went as float16). The sparse allreduce's are summed by Horovod, which has no bfloat16: they
    still go as float16 (2 bytes, not float32's 4), as api.md says."""
    p = torch.nn.Parameter(torch.zeros(2000, dtype=torch.bfloat16, device=DEVICE))
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("w", p)],
                                        compression=hvd_topk.TopK(density=0.0005, fp16_values=True),
                                        exchange=exchange, hierarchical=False, min_numel=1)
    sent = [float(torch.tensor(1e5 * (r + 1), dtype=torch.bfloat16)) for r in range(hvd.size())]
    g = torch.zeros(2000, device=DEVICE)
    g[0] = sent[hvd.rank()]
    opt.zero_grad()
    (p.float() * g).sum().backward()
    opt.step()
    want = bfloat16_mean_rounded_once(sent)
    assert float(p.grad[0]) == want and not p.grad[1:].any(), (exchange, float(p.grad[0]), want)


def check_elastic_second_restore_without_a_commit():
    """Horovod elastic: a failure, ``state.restore()``, more steps, a second failure before the
    next commit and ``state.restore()`` again: the optimizer's state is the commit's, bitwise
    (SGD's momentum, LocalAdamW's moments and step). Before the fix the first restore loaded the
    commit's own tensors and training changed them in place, so the second brought back later
    moments with the committed model (also with Horovod's own optimizer: upstream's doing)."""
    import os
    saved_env = os.environ.get("HOROVOD_ELASTIC")
    os.environ["HOROVOD_ELASTIC"] = "1"  # what horovodrun sets in an elastic job's workers
    try:
        for make in (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                     lambda ps: hvd_topk.LocalAdamW(ps, lr=1e-2, betas=(0.0, 0.95))):
            torch.manual_seed(0)
            model = Net().to(DEVICE)
            opt = hvd_topk.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                                exchange="allgather", min_numel=500)
            train(model, opt, 2)
            state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)
            state.commit()
            committed = copy.deepcopy(opt.state_dict())
            for start in (2, 4):
                train(model, opt, 2, start=start)
                state.restore()
            now = opt.state_dict()
            for pid, entries in committed["state"].items():
                for key, value in entries.items():
                    if torch.is_tensor(value):
                        assert torch.equal(value, now["state"][pid][key]), f"{type(opt).__name__}: state {pid} {key}"
    finally:
        if saved_env is None:
            os.environ.pop("HOROVOD_ELASTIC", None)
        else:
            os.environ["HOROVOD_ELASTIC"] = saved_env


def check_unnamed_allreduce(exchange):
    """``harness.check_unnamed_allreduce_between_backward_and_step`` over 4 buckets of ``exchange``."""
    harness.check_unnamed_allreduce_between_backward_and_step(
        lambda model: hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                                    named_parameters=model.named_parameters(),
                                                    exchange=exchange, min_numel=0, groups=4))


CHECKS = [
    contract("default"),
    contract("sum", op=hvd.Sum),
    contract("no error feedback", error_feedback=False),
    contract("momentum correction", momentum_correction=0.9),
    # (the fallback off: at 0.25 the allgather costs as much as dense from 4 ranks on, and the
    # reference here is Top-K's; the fallback has checks of its own)
    contract("warm-up", warmup_steps=3, steps=5, dense_fallback=False),
    contract("small buckets", fusion_bytes=4096),
    contract("16-bit values, small buckets", fp16_values=True, fusion_bytes=4096),
    # fp16's rounding of each sent value stays in the residual on every path that sends one:
    # the hooks' segment encoder (above), the whole-buffer encode, the sparse allreduce's take
    contract("16-bit values, bucket scope, momentum correction, decay", fp16_values=True, selection_scope="bucket",
             momentum_correction=0.9, residual_decay=0.9),
    contract("16-bit values, sparse allreduce", fp16_values=True, exchange="sparse_allreduce"),
    contract("compact pairs", compact=True),
    contract("compact pairs, small buckets, momentum correction", compact=True, fusion_bytes=4096,
             momentum_correction=0.9),
    contract("compact pairs, bucket scope, residual decay", compact=True, selection_scope="bucket",
             residual_decay=0.9),
    contract("sign values", compact="sign"),
    contract("sign values, small buckets, momentum correction", compact="sign", fusion_bytes=4096,
             momentum_correction=0.9),
    contract("sign values, bucket scope, residual decay", compact="sign", selection_scope="bucket",
             residual_decay=0.9),
    contract("groups=2", groups=2),
    contract("predivide=2.0 (a numpy float32)", gradient_predivide_factor=np.float32(2.0)),
    contract("no gradient on rank 1", drop_head2_on_rank=1),
    # the ranks launch their buckets in different orders (head2's at the end of backward on rank
    # 0, in synchronize() on rank 1): no rank may wait inside backward for another's collective
    # (from ece24be to the next commit each did, on a collective the other had not started)
    # (head2.weight: rank 1's accumulator there is all zeros, so the positions it chooses in its
    # part are ties, which the kernel and numpy break one way and torch.topk, HVD_TOPK_NATIVE=0,
    # another; the ranks' parameters are still compared)
    contract("no gradient on rank 1, sparse allreduce, a bucket per tensor", drop_head2_on_rank=1,
             exchange="sparse_allreduce", fusion_bytes=4096, buckets=BUCKET_PER_TENSOR, ties=("head2.weight",)),
    contract("fp32 dense fallback off", dense_fallback=False, density=0.6),
    contract("bucket scope", selection_scope="bucket"),
    contract("bucket scope, momentum correction", selection_scope="bucket", momentum_correction=0.9),
    contract("bucket scope, no gradient on rank 1", selection_scope="bucket", drop_head2_on_rank=1),
    contract("bucket scope, warm-up, sum", selection_scope="bucket", warmup_steps=3, steps=5, op=hvd.Sum,
             dense_fallback=False),
    ("dense exchange", lambda: check_dense_exchange("dense")),
    ("momentum correction: the small tensors' momentum", lambda: check_momentum_correction_sent_whole("allgather")),
    ("momentum correction: a dense exchange is momentum SGD", lambda: check_momentum_correction_sent_whole("dense")),
    ("dense fp16 exchange", lambda: check_dense_exchange("dense_fp16")),
    ("dense fp16 exchange, gradients of 1e-8 to 1e-6: their rounding kept",
     lambda: check_dense_exchange("dense_fp16", scale=1e-6)),
    ("fp16 values: the dense fallback is fp16", lambda: check_dense_exchange("dense_fp16", fallback=True)),
    ("auto: trial, agreement, choice", check_auto),
    ("auto: dominated strategies not tried", check_auto_one_candidate),
    ("auto, fp32 values: no dense fp16 candidate", lambda: check_auto(fp16_values=False)),
    ("auto over LocalAdamW and DeMo: no sparse allreduce unless pinned", check_auto_updates),
    ("cost model goes dense", check_cost_model_goes_dense),
    ("passes equal concatenated batch", check_passes_equal_concatenated_batch),
    ("checkpoint resume", check_checkpoint_resume),
    ("elastic state", check_elastic_state),
    ("broadcast optimizer state", check_broadcast_optimizer_state),
    ("a stateless optimizer's checkpoint on one rank: the ranks' steps differ, an error",
     check_stateless_checkpoint_on_one_rank_refused),
    ("a checkpoint loaded on rank 0 alone in mid-run: every rank refuses (allgather)",
     lambda: check_checkpoint_mid_run_on_one_rank_refused("allgather")),
    ("the same with the sparse allreduce", lambda: check_checkpoint_mid_run_on_one_rank_refused("sparse_allreduce")),
    ("non-finite gradient", check_nonfinite),
    ("non-finite gradient, compact pairs", lambda: check_nonfinite(compact=True)),
    ("non-finite gradient, sign values", lambda: check_nonfinite(compact="sign")),
    # the float16 wire's rounding stays in the residual, but not an inf, nor what float16 overflowed
    ("non-finite gradient, dense fp16 exchange", lambda: check_nonfinite(exchange="dense_fp16")),
    ("a gradient beyond float16's range, dense fp16 exchange", lambda: check_nonfinite(exchange="dense_fp16", value=1e5)),
    ("bad input", check_bad_input),
    ("zero_grad with a bucket not launched refused", check_zero_grad_with_a_bucket_not_launched_refused),
    ("zero_grad with exchanges in flight in an elastic worker: names TorchState",
     check_zero_grad_in_flight_in_an_elastic_worker_names_torch_state),
    ("stepping the wrapped optimizer: the error names it", check_stepping_the_wrapped_optimizer_is_named),
    ("a bf16 model is counted against dense fp32", check_bf16_model_counted_against_dense_fp32),
    ("bf16 gradients that nearly cancel: summed in float32, rounded once (allgather)",
     lambda: check_bf16_gradients_that_cancel("allgather")),
    ("bf16 gradients that nearly cancel, sparse allreduce", lambda: check_bf16_gradients_that_cancel("sparse_allreduce")),
    ("bf16 gradients with fp16_values: beyond float16's range, not inf (allgather)",
     lambda: check_bf16_gradients_with_fp16_values("allgather")),
    ("elastic: a second restore without a commit brings back the commit's state",
     check_elastic_second_restore_without_a_commit),
    ("a second synchronize() before step() changes nothing", check_second_synchronize_changes_nothing),
    ("synchronize() after step(), no backward since, changes nothing", check_synchronize_after_step_changes_nothing),
    ("step() inside skip_synchronize() before synchronize(): refused", check_skip_synchronize_without_synchronize_refused),
    ("gradients written by hand after a step: assigned or through .data, exchanged; .data.copy_ warned",
     check_gradients_written_through_data_after_a_step),
    ("step(closure): evaluated once, before the exchange", check_step_closure),
    ("a parameter with no elements, min_numel=0", check_empty_parameter),
    ("plain Adam/AdamW warns, naming the recipe", check_plain_adam_warns),
    ("momentum_correction over the inner optimizer's own momentum warns", check_momentum_twice_warns),
    ("a positional call written for hvd.DistributedOptimizer, num_groups", check_horovod_positional_call),
    ("LocalAdamW: Adam per rank, updates exchanged", check_local_adamw),
    ("LocalAdamW: checkpoint resume", check_local_adamw_resume),
    ("a dense AdamW checkpoint into the recipe: LocalAdamW's options as built", check_dense_adamw_checkpoint_into_the_recipe),
    ("a dense AdamW checkpoint into the recipe on rank 0, then broadcast", check_dense_adamw_checkpoint_on_rank_0_broadcast),
    ("an LR scheduler on the user's optimizer after a load", check_scheduler_on_the_inner_optimizer_after_load),
    ("LocalAdamW: a checkpoint on rank 0 alone, broadcast (lag1, sketch)", check_local_adamw_broadcast_from_rank_0),
    ("LocalAdamW: bf16 resume with the variance sketch", check_local_adamw_resume_bf16),
    ("FrozenVarianceAdamW: a checkpoint on rank 0 alone, broadcast", check_frozen_variance_broadcast_from_rank_0),
    ("a rollback on rank 0, broadcast: one exchange on every rank (auto)", check_rollback_on_rank_0_auto),
    ("a rollback on rank 0, broadcast: the other ranks' residuals start from zero", check_rollback_on_rank_0_residuals),
    ("LocalAdamW: a gradient whose last hook never fired", check_local_adamw_gradient_without_its_last_hook),
    ("step hooks run once a step, also after load_state_dict", check_step_hooks_once_after_load),
    ("LocalAdamW: lr in the residual, residual decay", lambda: check_local_adamw(
        steps=5, lr_in_residual=True, residual_decay=0.9)),
    ("LocalAdamW: lr in the residual, decay, sparse allreduce", lambda: check_local_adamw(
        steps=5, lr_in_residual=True, residual_decay=0.9, exchange="sparse_allreduce")),
    ("LocalAdamW: lr in the residual, decay, checkpoint resume", lambda: check_local_adamw_resume(
        lr_in_residual=True, residual_decay=0.9)),
    ("LocalAdamW: global variance", lambda: check_local_adamw(steps=5, global_variance=True)),
    ("LocalAdamW: sign values, global variance, lr in the residual, decay", lambda: check_local_adamw(
        steps=5, global_variance=True, lr_in_residual=True, residual_decay=0.9, compact="sign")),
    ("LocalAdamW: sign values, decay, checkpoint resume", lambda: check_local_adamw_resume(
        lr_in_residual=True, global_variance=True, residual_decay=0.99, compact="sign")),
    ("LocalAdamW: an inf in one rank's gradient leaves its moments finite", check_nonfinite_local_adamw),
    ("LocalAdamW: a layer rank 0 leaves out at step 1, every rank at step 2", lambda: check_local_adamw(
        steps=4, global_variance=True, lr_in_residual=True, skip={1: {0}, 2: set(range(hvd.size()))})),
    ("LocalAdamW: a rank that runs no backward at step 1, every rank at step 2", lambda: check_local_adamw(
        steps=4, global_variance=True, lr_in_residual=True, idle={1: {hvd.size() - 1}, 2: set(range(hvd.size()))})),
    ("LocalAdamW: global variance, lr in the residual, checkpoint resume", lambda: check_local_adamw_resume(
        lr_in_residual=True, global_variance=True)),
    ("LocalAdamW: signal mean+lag1, a layer left out at step 2", lambda: check_local_adamw(
        steps=5, global_variance=True, lr_in_residual=True, signal="mean+lag1", skip={2: {0}})),
    ("LocalAdamW: signal mean+lag1, beta1 0 then 0.5, checkpoint resume", lambda: check_local_adamw_resume(
        lr_in_residual=True, global_variance=True, signal="mean+lag1")),
    ("LocalAdamW: variance_sketch (exact sizes), a layer left out at step 2, a rank idle at 3",
     lambda: check_local_adamw(steps=5, global_variance=True, lr_in_residual=True, variance_sketch=4096,
                               skip={2: {0}}, idle={3: {1}})),
    ("LocalAdamW: variance_sketch 16 (random rows), beta1 0 then 0.5, checkpoint resume",
     lambda: check_local_adamw_resume(lr_in_residual=True, global_variance=True, variance_sketch=16)),
    ("LocalAdamW: variance_sketch, a rank's gradient inf: the skipped step's sketch absorbed nowhere",
     check_local_adamw_sketch_of_a_skipped_step),
    ("DeMo: sign of the exchanged average", check_demo),
    ("DeMo: rms normalisation, sparse allreduce", lambda: check_demo("rms", "sparse_allreduce")),
    ("DeMo: checkpoint resume", lambda: check_inner_resume(
        lambda params: hvd_topk.DeMo(params, lr=0.01, beta=0.9, weight_decay=0.1), {"lr": 0.005})),
    contract("residual decay", residual_decay=0.8, steps=5),
    contract("residual decay, momentum correction, sparse allreduce", residual_decay=0.8,
             momentum_correction=0.9, exchange="sparse_allreduce"),
    # last: a failure here leaves Horovod stalled for the checks after it
    ("an unnamed allreduce between backward() and step(), allgather, 4 buckets",
     lambda: check_unnamed_allreduce("allgather")),
    ("an unnamed allreduce between backward() and step(), sparse_allreduce, 4 buckets",
     lambda: check_unnamed_allreduce("sparse_allreduce")),
]


if __name__ == "__main__":
    run(CHECKS)
