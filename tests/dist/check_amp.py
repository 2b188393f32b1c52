"""Mixed precision: error feedback under torch.amp.GradScaler, checked against numpy in true units.

Run: PYTHONPATH=.:tests/support mpirun -np 2 (or 3) python tests/dist/check_amp.py
(``--list`` prints the names of its checks).

Horovod's documented pattern: ``scaler.scale(loss).backward(); opt.synchronize();
scaler.unscale_(opt); with opt.skip_synchronize(): scaler.step(opt); scaler.update()``. The loss
scale changes between steps (set here with ``scaler.update(new_scale=...)``, as the scaler does
after an overflow or every growth_interval steps). The reference keeps its residuals in true
units and never sees a scale; scales are powers of two, so scaled arithmetic is exact and the
unscaled result must match it as tightly as an unscaled run does.
"""

import copy
import warnings

import numpy as np
import torch
import torch.nn.functional as F

import horovod.torch as hvd
import hvd_topk
from check_optimizer import Net, WithUnused, batch, build
from harness import DEVICE, assert_same_on_all_ranks, gather, raises, raw_gradients, run
from reference import ErrorFeedbackReference, sparse_allreduce

SCALES = [2.0 ** 10, 2.0 ** 11, 2.0 ** 8, 2.0 ** 8, 2.0 ** 14, 2.0 ** 3]


def build_scaled(pass_scaler, momentum_correction=0.0):
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=SCALES[0])
    model, opt = build(momentum=0.0 if momentum_correction else 0.9, min_numel=500,
                       momentum_correction=momentum_correction,
                       grad_scaler=scaler if pass_scaler else None)
    return model, opt, scaler


def train_scaled(model, opt, scaler, steps, expected=None, scaler_steps=True):
    """Horovod's GradScaler pattern; with ``expected(name, every rank's true-unit gradient)``,
    each step's unscaled p.grad is compared with it. Returns the largest deviation.
    ``scaler_steps=False``: ``opt.step()`` directly instead of ``scaler.step(opt)`` (no
    overflow happens here, so the scaler would not skip a step either)."""
    rank = hvd.rank()
    shadow = copy.deepcopy(model)
    worst = 0.0
    for step in range(steps):
        x, y = batch(step, rank)
        raw = raw_gradients(shadow, model, x, y)  # true units
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        for name, p in model.named_parameters():
            if expected is not None:
                want = expected(name, gather(raw[name]))
                worst = max(worst, float(np.max(np.abs(p.grad.cpu().numpy() - want))))
        with opt.skip_synchronize():
            scaler.step(opt) if scaler_steps else opt.step()
        scaler.update(new_scale=SCALES[(step + 1) % len(SCALES)])
        for name, p in model.named_parameters():
            assert_same_on_all_ranks(p.detach().cpu().numpy(), f"amp step {step}: parameter {name}")
    return worst


def error_feedback_expected(ref, model):
    """The error-feedback contract in true units: sparse tensors (>= 500 elements) by ``ref``."""
    big = {n for n, p in model.named_parameters() if p.numel() >= 500}
    return lambda name, grads: ref.sparse(name, grads, 0.05) if name in big else ref.dense(name, grads)


def check_residuals_follow_scale_changes(momentum_correction=0.0):
    model, opt, scaler = build_scaled(pass_scaler=True, momentum_correction=momentum_correction)
    ref = ErrorFeedbackReference(hvd.size(), momentum=momentum_correction)
    worst = train_scaled(model, opt, scaler, len(SCALES), error_feedback_expected(ref, model))
    # Powers of two: exact up to summation order; an unscaled run reaches the same bound.
    assert worst < 1e-6, f"unscaled gradients differ from the true-unit reference by {worst:g}"
    saved = opt.state_dict()["hvd_topk"]
    assert saved["residual_scale"] == SCALES[-1], saved["residual_scale"]


def check_resume_across_scaler_setups(saved_scaled):
    """A checkpoint saved with a GradScaler (residuals in its scale's units, 2^3 at the end)
    loaded into an optimizer without one, or saved without one (true units) and loaded with a
    scaler at 2^10: the resumed run's unscaled gradients still match the true-unit reference,
    which never saw a scale (before, the residuals came back 8 times too large, or 1024 times
    too small)."""
    off = torch.amp.GradScaler(DEVICE.type, enabled=False)  # scale() and step() pass through unchanged
    model, opt, scaler = build_scaled(pass_scaler=saved_scaled)
    ref = ErrorFeedbackReference(hvd.size())
    worst = train_scaled(model, opt, scaler if saved_scaled else off, len(SCALES), error_feedback_expected(ref, model))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    assert saved["opt"]["hvd_topk"]["residual_scale"] == (SCALES[-1] if saved_scaled else None)
    assert any(float(r.abs().max()) > 0 for r in saved["opt"]["hvd_topk"]["residuals"].values())
    model_b, opt_b, scaler_b = build_scaled(pass_scaler=not saved_scaled)
    model_b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    worst = max(worst, train_scaled(model_b, opt_b, off if saved_scaled else scaler_b, len(SCALES),
                                    error_feedback_expected(ref, model_b)))
    assert worst < 1e-6, f"after resuming {'without' if saved_scaled else 'with'} a scaler, unscaled gradients " \
                         f"differ from the true-unit reference by {worst:g}"


def check_without_the_scaler_residuals_are_stale():
    """The failure the option prevents (so the check above is not vacuous): without
    ``grad_scaler`` the residual is added back at the old scale after the first change.
    (``scaler.step(opt)`` refuses that case, next check; stepping directly bypasses it.)"""
    model, opt, scaler = build_scaled(pass_scaler=False)
    ref = ErrorFeedbackReference(hvd.size())
    worst = train_scaled(model, opt, scaler, len(SCALES), error_feedback_expected(ref, model),
                         scaler_steps=False)
    assert worst > 1e-3, worst


def check_scaler_step_without_the_option_refused():
    model, opt, scaler = build_scaled(pass_scaler=False)
    x, y = batch(0, hvd.rank())
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    with opt.skip_synchronize(), raises(RuntimeError, r"built without it.*grad_scaler=scaler"):
        scaler.step(opt)


def check_rejects_other_objects():
    model = Net().to(DEVICE)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with raises(TypeError, "grad_scaler must be a torch.amp.GradScaler"):
        hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(), grad_scaler=1024.0)


def check_overflow_skipped_everywhere():
    """A gradient overflows (inf) on rank 0 only: the exchange carries it to every rank, so
    ``scaler.step`` skips the step on every rank (parameters unchanged, scale halved
    everywhere), no residual keeps inf/nan, and the next step trains on every rank alike."""
    rank = hvd.rank()
    model, opt, scaler = build_scaled(pass_scaler=True)
    inject = {"on": False}

    def poison(grad):
        if inject["on"] and rank == 0:
            grad = grad.clone()
            grad.view(-1)[7] = float("inf")
        return grad

    model.fc1.weight.register_hook(poison)

    def scaled_step(step):
        x, y = batch(step, rank)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()

    scaled_step(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scale = scaler.get_scale()
    inject["on"] = True
    scaled_step(1)
    inject["on"] = False
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"rank {rank}: {n} changed in the overflow step"
    assert scaler.get_scale() == scale / 2, (scaler.get_scale(), scale)
    residuals = opt.state_dict()["hvd_topk"]["residuals"]
    assert all(torch.isfinite(r).all() for r in residuals.values()), "a residual kept inf/nan"
    scaled_step(2)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p.detach(), before[n]), f"{n} did not train"
        assert_same_on_all_ranks(p.detach().cpu().numpy(), f"after the overflow: {n}")


def check_plain_pytorch_loop():
    """PyTorch's own loop, ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``
    (no synchronize, no unscale_): scaler.step exchanges before it unscales, so every step
    equals Horovod's pattern bit for bit (that pattern is checked against numpy above), through
    the scale changes and an overflow on rank 0 only (skipped on every rank). Unscaling first,
    ``scaler.unscale_(opt)`` before the exchange, is a RuntimeError on every rank: it would
    unscale this rank's own gradients and apply the still-scaled average. (Both once trained
    on gradients 2^10 times too large, silently.)"""
    rank = hvd.rank()

    def run_with(pattern):
        model, opt, scaler = build_scaled(pass_scaler=True)
        for step, scale in enumerate(SCALES):
            x, y = batch(step, rank)
            opt.zero_grad()
            with torch.no_grad():
                if step == 3 and rank == 0:
                    x = x.clone()
                    x[0, 0] = float("inf")  # an overflow on rank 0 only
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            if pattern == "horovod":
                opt.synchronize()
                scaler.unscale_(opt)
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # no "step() after synchronize()" warning either
                    scaler.step(opt)
            scaler.update(new_scale=scale if step != 3 else None)
        return model

    horovod, plain = run_with("horovod"), run_with("plain")
    for (n, a), b in zip(horovod.named_parameters(), plain.parameters()):
        assert torch.isfinite(a).all(), n
        assert torch.equal(a, b), f"{n}: PyTorch's loop differs from Horovod's pattern"
        assert_same_on_all_ranks(b.detach().cpu().numpy(), f"PyTorch's loop: {n}")
    model, opt, scaler = build_scaled(pass_scaler=True)
    x, y = batch(0, rank)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    with raises(RuntimeError, match="scaler.unscale_\\(opt\\) ran before this step's exchange", what="unscale_ first"):
        scaler.step(opt)


def check_horovod_scaler(drop_in):
    """Horovod's optimizer, dense or with the drop-in TopK (no residuals), under the same pattern
    and scale changes: the unscaled result is the mean of the true-unit gradients, or of each
    rank's top-k of them (a positive power-of-two scale changes neither the positions nor, after
    unscaling, the values)."""
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    compression = hvd_topk.TopK(density=0.05, method="exact") if drop_in else hvd.Compression.none
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=SCALES[0])
    expected = ((lambda name, grads: sparse_allreduce(grads, 0.05)) if drop_in else
                (lambda name, grads: np.sum(grads, axis=0) / hvd.size()))
    worst = train_scaled(model, opt, scaler, len(SCALES), expected)
    assert worst < 1e-6, f"unscaled gradients differ from the true-unit reference by {worst:g}"


def check_drop_in_skipped_step_then_exchanged():
    """The drop-in TopK under Horovod's optimizer and its GradScaler pattern, rank 0's second
    step overflowing: the scaler skips ``opt.step()``, so Horovod's "synchronized" flag stays set
    into the next step. That step is still exchanged: each unscaled p.grad is the ranks' mean of
    their top-k (numpy) and the weights agree. Before 2026-12-05 the compressor took the stale
    flag for "already exchanged" and passed every gradient of the next step through: each rank
    stepped on its own gradient, in silence."""
    rank = hvd.rank()
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd_topk.TopK(density=0.05, method="exact"))
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=1024.0)
    shadow = copy.deepcopy(model)
    for step in range(4):
        x, y = batch(step, rank)
        if step == 1 and rank == 0:
            x = x.clone()
            x[0, 0] = float("inf")
        raw = raw_gradients(shadow, model, x, y)  # true units
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        if step != 1:
            for name, p in model.named_parameters():
                np.testing.assert_allclose(p.grad.cpu().numpy(), sparse_allreduce(gather(raw[name]), 0.05),
                                           rtol=1e-5, atol=1e-6, err_msg=f"step {step}: {name}")
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        for name, p in model.named_parameters():
            assert_same_on_all_ranks(p.detach().cpu().numpy(), f"drop-in, step {step}: parameter {name}")
    assert scaler.get_scale() == 512.0, scaler.get_scale()  # the one skipped step halved it


def check_skipped_step_then_model_zero_grad(pattern):
    """A step the scaler skipped (inf on rank 0), gradients then zeroed with
    ``model.zero_grad()`` (the optimizer never hears of it): the next step is still exchanged.
    Before the fix the skipped step's "synchronized" flag survived, ``synchronize()`` took it
    for the next step's exchange, each rank applied its own gradient (the ranks' weights
    differed by 0.026) and the step after raised a misleading "computed more than
    backward_passes_per_step times"."""
    rank = hvd.rank()
    torch.manual_seed(0)
    model = WithUnused().to(DEVICE)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=1024.0)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopK(density=0.1), exchange="allgather",
                                        grad_scaler=scaler)
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 40, generator=gen).to(DEVICE), torch.randint(0, 10, (8,), generator=gen).to(DEVICE)
        if step == 1 and rank == 0:
            x[0, 0] = float("inf")
        model.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if pattern == "plain":
            scaler.step(opt)
        else:
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
        scaler.update()
        for name, p in model.named_parameters():
            assert_same_on_all_ranks(p.detach().cpu().numpy(), f"{pattern} loop, step {step}: {name}")
    assert opt.compression_stats()["step"] == 4, opt.compression_stats()["step"]


def check_checkpoint_without_its_loss_scale_warns():
    """A checkpoint written before the loss scale was recorded (no ``residual_scale``), its
    residuals non-zero, loaded with a scaler: the residuals' units are a guess (the next step's
    scale), so the load says so; loaded without a scaler (true units, as such a run kept them)
    it stays quiet."""
    model, opt, scaler = build_scaled(pass_scaler=False)
    off = torch.amp.GradScaler(DEVICE.type, enabled=False)
    train_scaled(model, opt, off, 3)
    saved = copy.deepcopy(opt.state_dict())
    del saved["hvd_topk"]["residual_scale"]
    saved["hvd_topk"]["format"] = 2
    for pass_scaler, warned in ((True, True), (False, False)):
        _, opt_b, _ = build_scaled(pass_scaler=pass_scaler)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt_b.load_state_dict(copy.deepcopy(saved))
        said = any("predates the record of its loss scale" in str(w.message) for w in caught)
        assert said == warned, (pass_scaler, [str(w.message)[:80] for w in caught])


def train_overflowing_first(model, opt, scaler, steps):
    """PyTorch's GradScaler loop whose first two steps overflow (inf on rank 0), until auto has
    decided or ``steps`` have run; the ranks' parameters checked equal after each step."""
    rank = hvd.rank()
    for step in range(steps):
        x, y = batch(step, rank)
        if step < 2 and rank == 0:
            x = x.clone()
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        for name, p in model.named_parameters():
            assert_same_on_all_ranks(p.detach().cpu().numpy(), f"auto under overflows, step {step}: {name}")
        trial = opt._hvd_topk.planner.trial
        if trial is not None and trial.choice is not None:
            return


def check_auto_trial_after_skipped_steps():
    """``exchange="auto"`` under a GradScaler whose first two steps overflow (inf on rank 0):
    the step after a skipped one lacks the inner step, so it is not timed, on any rank; a
    family left with no timed step runs again instead of being ruled out (or, before the fix,
    judged by a step without the inner step's time: dense came out 10x faster than it is)."""
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=SCALES[0])
    model, opt = build(min_numel=500, exchange="auto", exchange_trial_steps=1, grad_scaler=scaler)
    train_overflowing_first(model, opt, scaler, 30)
    trial = opt._hvd_topk.planner.trial
    assert trial.choice is not None, "auto never decided"
    assert 1 in trial.untimed, trial.untimed  # position 1 followed the first skipped step
    first = trial.families[0]
    if len(trial.families) > 1:
        assert trial.candidates.count(first) == 2, trial.candidates  # run again: no rank timed it
        assert trial.medians[first] < float("inf"), trial.medians
    choice = torch.tensor([trial.families.index(trial.choice)], dtype=torch.float64)
    assert_same_on_all_ranks(choice.numpy(), "auto's choice")


def check_auto_trial_after_skipped_steps_fused():
    """The same with a fused inner optimizer (``Adam(fused=True)``): GradScaler steps it even after
    an overflow and it skips inside its kernel, so the optimizer's step() ran; the scaler's
    found_inf says the step was skipped, and the next step is not timed either (it was)."""
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=SCALES[0])
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Adam behind error feedback: warned, the point here is the trial
        opt = hvd_topk.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3, fused=True),
                                            named_parameters=model.named_parameters(), min_numel=500,
                                            exchange="auto", exchange_trial_steps=1, grad_scaler=scaler)
    train_overflowing_first(model, opt, scaler, 6)
    assert 1 in opt._hvd_topk.planner.trial.untimed, opt._hvd_topk.planner.trial.untimed


CHECKS = [
    ("residuals follow loss-scale changes", check_residuals_follow_scale_changes),
    ("residuals follow loss-scale changes, momentum correction",
     lambda: check_residuals_follow_scale_changes(momentum_correction=0.9)),
    ("saved with a GradScaler, resumed without one", lambda: check_resume_across_scaler_setups(saved_scaled=True)),
    ("saved without a GradScaler, resumed with one", lambda: check_resume_across_scaler_setups(saved_scaled=False)),
    ("without grad_scaler the residuals are stale", check_without_the_scaler_residuals_are_stale),
    ("GradScaler.step without grad_scaler refused", check_scaler_step_without_the_option_refused),
    ("grad_scaler type checked", check_rejects_other_objects),
    ("gradient overflow skipped on every rank", check_overflow_skipped_everywhere),
    ("PyTorch's plain GradScaler loop equals Horovod's pattern; unscale_ first refused", check_plain_pytorch_loop),
    ("drop-in: GradScaler pattern", lambda: check_horovod_scaler(drop_in=True)),
    ("horovod dense: GradScaler pattern", lambda: check_horovod_scaler(drop_in=False)),
    ("drop-in: a step the scaler skipped, then the next is exchanged", check_drop_in_skipped_step_then_exchanged),
    ("a skipped step, then model.zero_grad(): the next step is exchanged (PyTorch's loop)",
     lambda: check_skipped_step_then_model_zero_grad("plain")),
    ("a skipped step, then model.zero_grad(): the next step is exchanged (Horovod's pattern)",
     lambda: check_skipped_step_then_model_zero_grad("horovod")),
    ("a checkpoint without its loss scale, loaded with a scaler: told", check_checkpoint_without_its_loss_scale_warns),
    ("auto's trial does not time the step after a skipped one", check_auto_trial_after_skipped_steps),
    ("auto's trial does not time the step after a skipped one, fused Adam", check_auto_trial_after_skipped_steps_fused),
]


if __name__ == "__main__":
    run(CHECKS)
