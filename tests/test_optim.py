"""hvd_topk.FrozenVarianceAdamW against independent truths: torch.optim.AdamW before the freeze,
a numpy AdamW with a frozen second moment after it; hvd_topk.LocalAdamW's update against
torch.optim.AdamW (single process; tests/dist/check_optimizer.py checks it across ranks)."""

import copy
import warnings

import numpy as np
import pytest
import torch

from hvd_topk import DeMo, FrozenVarianceAdamW, LocalAdamW, variance_sketch

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def grads(steps, shape=(7, 5), seed=0):
    gen = np.random.default_rng(seed)
    return [gen.standard_normal(shape) * (1 + step) for step in range(steps)]


def numpy_adamw(p, gs, freeze, betas=BETAS):
    """AdamW in float64; the second moment and its bias correction stop after step ``freeze``."""
    b1, b2 = betas
    m, v, bc2 = np.zeros_like(p), np.zeros_like(p), 1.0
    for t, g in enumerate(gs, start=1):
        p = p * (1 - LR * WD)
        m = b1 * m + (1 - b1) * g
        if not freeze or t <= freeze:
            v = b2 * v + (1 - b2) * g * g
            bc2 = 1 - b2 ** t
        p = p - LR / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(bc2) + EPS)
    return p


def run(opt_factory, p0, gs):
    p = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    opt = opt_factory([p])
    for g in gs:
        p.grad = torch.tensor(g)
        opt.step()
    return p.detach().numpy(), opt


def test_equals_torch_adamw_until_the_freeze():
    p0, gs = np.random.default_rng(1).standard_normal((7, 5)), grads(6)
    ours, _ = run(lambda ps: FrozenVarianceAdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                  freeze_step=6), p0, gs)
    torch_, _ = run(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), p0, gs)
    np.testing.assert_allclose(ours, torch_, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("betas", [BETAS, (0.0, 0.95)])
def test_variance_frozen_after_freeze_step(betas):
    p0, gs = np.random.default_rng(2).standard_normal((7, 5)), grads(8)  # gradients grow each step
    ours, opt = run(lambda ps: FrozenVarianceAdamW(ps, lr=LR, betas=betas, eps=EPS, weight_decay=WD,
                                                    freeze_step=3), p0, gs)
    np.testing.assert_allclose(ours, numpy_adamw(p0, gs, freeze=3, betas=betas), rtol=1e-12, atol=1e-14)
    # and it is not AdamW any more (the check above could not pass by accident)
    assert not np.allclose(ours, numpy_adamw(p0, gs, freeze=0, betas=betas), rtol=1e-6)
    state = next(iter(opt.state.values()))
    b2 = betas[1]
    want_v = sum((1 - b2) * b2 ** (3 - t) * gs[t - 1] ** 2 for t in (1, 2, 3))
    np.testing.assert_allclose(state["exp_avg_sq"].numpy(), want_v, rtol=1e-12)


def test_state_dict_round_trip_keeps_the_freeze():
    p0, gs = np.random.default_rng(3).standard_normal((4, 4)), grads(6, (4, 4))
    make = lambda ps: FrozenVarianceAdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=2)  # noqa: E731
    whole, _ = run(make, p0, gs)
    first, opt = run(make, p0, gs[:3])
    p = torch.nn.Parameter(torch.tensor(first))
    resumed = make([p])
    resumed.load_state_dict(opt.state_dict())
    for g in gs[3:]:
        p.grad = torch.tensor(g)
        resumed.step()
    np.testing.assert_array_equal(p.detach().numpy(), whole)


def test_freezing_an_unseen_variance_warns():
    p = torch.nn.Parameter(torch.zeros(100))
    opt = FrozenVarianceAdamW([p], freeze_step=1)
    p.grad = torch.zeros(100)
    p.grad[:10] = 1.0  # 90 of 100 entries never see a gradient before the freeze
    with pytest.warns(UserWarning, match=r"90 of 100 entries never having seen a gradient.*warmup_density=1.0"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once


# a value of the wrong type is a TypeError, one out of range a ValueError (as TopK's and the
# optimizer's options; these raised ValueError for both before 2026-12-06)
@pytest.mark.parametrize("kwargs,error,match", [
    ({"freeze_step": -1}, ValueError, "freeze_step"), ({"freeze_step": 2.5}, TypeError, "freeze_step"),
    ({"freeze_step": True}, TypeError, "freeze_step"), ({"betas": (1.0, 0.9)}, ValueError, "betas"),
    ({"betas": (0.9,)}, TypeError, "a pair of numbers"),
    ({"lr": -1e-3}, ValueError, "lr"), ({"lr": float("nan")}, ValueError, "lr"),
    ({"lr": float("inf")}, ValueError, "lr must be a finite number"), ({"lr": "1e-3"}, TypeError, "lr must be a number"),
    ({"eps": -1.0}, ValueError, "eps"), ({"weight_decay": "0.1"}, TypeError, "weight_decay")])
def test_bad_options_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    if "freeze_step" not in kwargs:
        with pytest.raises(error, match=match):
            LocalAdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    # the same in a param group of its own, at construction or added later (a group's options were
    # used unchecked before); a refused group is not added
    for make in (FrozenVarianceAdamW, LocalAdamW):
        if make is LocalAdamW and "freeze_step" in kwargs:
            continue
        with pytest.raises(error, match=match):
            make([{"params": [torch.nn.Parameter(torch.zeros(2))], **kwargs}])
        opt = make([torch.nn.Parameter(torch.zeros(2))])
        with pytest.raises(error, match=match):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], **kwargs})
        assert len(opt.param_groups) == 1
        # nor through a checkpoint: torch's load_state_dict sets the groups without add_param_group
        saved = opt.state_dict()
        saved["param_groups"][0].update(kwargs)
        with pytest.raises(error, match=match):
            opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == opt.defaults["lr"]  # nothing loaded


@pytest.mark.parametrize("make", [FrozenVarianceAdamW, LocalAdamW])
def test_numpy_betas_taken_as_numbers(make):
    """betas of numpy floats (read from a config through numpy) are numbers, as lr's are: they
    step as the same Python floats do (refused as "not a pair of numbers" before 2026-12-06);
    a string among them is still refused."""
    def run(betas):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(50))
        opt = make([p], lr=1e-2, betas=betas)
        for step in range(3):
            p.grad = torch.randn(50, generator=torch.Generator().manual_seed(step))
            if make is LocalAdamW:
                opt.transform_local_gradient(p, p.grad)  # what the engine does in backward()
            opt.step()
        return p.detach().clone()
    np.testing.assert_allclose(run((np.float32(0.5), np.float64(0.95))).numpy(), run((0.5, 0.95)).numpy(),
                               rtol=1e-5, atol=1e-7)
    with pytest.raises(TypeError, match="a pair of numbers"):
        make([torch.nn.Parameter(torch.zeros(2))], betas=(0.5, "0.95"))



def test_another_optimizers_checkpoint_takes_the_missing_options():
    """A checkpoint of torch.optim.AdamW (a dense run moving on) loads into each hvd_topk
    optimizer and steps: options it lacks take the constructor's values (a KeyError at the next
    step before), LocalAdamW's own too (as hvd_topk.DistributedOptimizer fills them, and the DDP
    hook loads it directly: before 2026-12-07 they were taken as an old LocalAdamW checkpoint's,
    all off); the betas come from the checkpoint, and the warning says so. FrozenVarianceAdamW
    that never freezes, resumed from AdamW's state, goes on as AdamW goes on."""
    p0, gs = np.random.default_rng(11).standard_normal((7, 5)), grads(6)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)  # noqa: E731
    whole, _ = run(adamw, p0, gs)
    first, dense = run(adamw, p0, gs[:3])
    p = torch.nn.Parameter(torch.tensor(first))
    frozen = FrozenVarianceAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=0)
    frozen.load_state_dict(dense.state_dict())
    assert frozen.param_groups[0]["freeze_step"] == 0
    for g in gs[3:]:
        p.grad = torch.tensor(g)
        frozen.step()
    np.testing.assert_allclose(p.detach().numpy(), whole, rtol=1e-12, atol=1e-14)
    demo = DeMo([torch.nn.Parameter(torch.tensor(first))], lr=LR, normalise="rms")
    demo.load_state_dict(dense.state_dict())
    assert demo.param_groups[0]["normalise"] == "rms"
    local = LocalAdamW([q := torch.nn.Parameter(torch.tensor(first))], lr=LR, signal="mean+lag1", variance_sketch=0)
    with pytest.warns(UserWarning, match=r"another optimizer's .* lacks lr_in_residual, global_variance, signal, "
                                         r"variance_sketch: they keep the values this LocalAdamW was built with.*"
                                         r"betas \(0\.9, 0\.95\) from the checkpoint, where this LocalAdamW was "
                                         r"built with \(0\.0, 0\.999\)"):
        local.load_state_dict(dense.state_dict())
    group = local.param_groups[0]
    assert (group["lr_in_residual"], group["global_variance"], group["signal"], group["variance_sketch"]) == \
        (True, True, "mean+lag1", 0), group
    assert group["betas"] == BETAS == (0.9, 0.95)
    local.transform_local_gradient(q, torch.tensor(gs[3]), ranks=2)  # the state completed for global_variance
    assert {"grad_mean", "grad_lag1"} <= set(local.state[q]), sorted(local.state[q])


def test_adamws_checkpoint_into_frozen_variance_past_its_freeze():
    """AdamW's state after 3 steps into FrozenVarianceAdamW(freeze_step=2): the variance AdamW
    kept (3 steps of it) is frozen with its own bias correction (a KeyError before: AdamW has no
    'bias_correction2'). Truth: numpy AdamW whose variance stops after step 3."""
    p0, gs = np.random.default_rng(12).standard_normal((7, 5)), grads(6)
    first, dense = run(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), p0, gs[:3])
    p = torch.nn.Parameter(torch.tensor(first))
    frozen = FrozenVarianceAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=2)
    frozen.load_state_dict(dense.state_dict())
    for g in gs[3:]:
        p.grad = torch.tensor(g)
        frozen.step()
    np.testing.assert_allclose(p.detach().numpy(), numpy_adamw(p0, gs, freeze=3), rtol=1e-12, atol=1e-14)


def test_own_checkpoint_with_torch_keys_is_not_taken_for_another_optimizers():
    """A LocalAdamW checkpoint written before variance_sketch existed whose group also holds a
    torch key (``foreach``): its own options (lr_in_residual, ...) say it is LocalAdamW's, so the
    missing option is what it was trained with (0), not the built value ("auto")."""
    p = torch.nn.Parameter(torch.randn(5))
    old = LocalAdamW([p], lr=LR)
    p.grad = torch.randn(5)
    old.transform_local_gradient(p, p.grad, ranks=2)
    old.step()
    saved = old.state_dict()
    for group in saved["param_groups"]:
        del group["variance_sketch"]
        group["foreach"] = None
    loaded = LocalAdamW([torch.nn.Parameter(p.detach().clone())], lr=LR)
    with pytest.warns(UserWarning, match="lack variance_sketch: taken as variance_sketch=0"):
        loaded.load_state_dict(saved)
    assert loaded.param_groups[0]["variance_sketch"] == 0 and "foreach" not in loaded.param_groups[0]


def test_adamws_own_options_left_out_of_a_loaded_checkpoint():
    """torch AdamW's options that hvd_topk's optimizers lack (amsgrad, foreach, ...) are not kept
    in their param groups (they went on into every later checkpoint, and
    hvd.broadcast_optimizer_state after a load on rank 0 alone failed on the other ranks);
    amsgrad=True, which they do not do, warns. The advice of the missing-options warning works:
    options written into the checkpoint before loading are taken, and the state is completed."""
    p = torch.nn.Parameter(torch.randn(5))
    dense = torch.optim.AdamW([p], lr=LR, amsgrad=True)
    p.grad = torch.randn(5)
    dense.step()
    saved = dense.state_dict()
    assert "amsgrad" in saved["param_groups"][0] and "foreach" in saved["param_groups"][0]
    for make in (lambda ps: LocalAdamW(ps, lr=LR), lambda ps: DeMo(ps, lr=LR),
                 lambda ps: FrozenVarianceAdamW(ps, lr=LR)):
        opt = make([torch.nn.Parameter(p.detach().clone())])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.load_state_dict(copy.deepcopy(saved))
        assert any("trained with amsgrad=True" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert all(w.filename == __file__ for w in caught), [(w.filename, w.lineno) for w in caught]  # load's line
        assert not {"amsgrad", "foreach", "fused", "maximize", "capturable"} & set(opt.param_groups[0]), \
            opt.param_groups[0]
        assert "amsgrad" not in opt.state_dict()["param_groups"][0]
    written = copy.deepcopy(saved)
    for group in written["param_groups"]:
        group.update(lr_in_residual=True, global_variance=True)
    local = LocalAdamW([q := torch.nn.Parameter(p.detach().clone())], lr=LR)
    local.load_state_dict(written)
    local.transform_local_gradient(q, torch.randn(5), ranks=2)  # refused when set after loading
    assert "grad_mean" in local.state[q]


@pytest.mark.parametrize("make", [lambda ps: LocalAdamW(ps), lambda ps: DeMo(ps), lambda ps: FrozenVarianceAdamW(ps)])
def test_complex_parameters_refused(make):
    """Squaring a complex gradient is not |g|^2: refused, at construction and in a group added later."""
    with pytest.raises(TypeError, match="does not take complex parameters.*view_as_real"):
        make([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    opt = make([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(TypeError, match="does not take complex parameters"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))]})

def test_local_adamw_group_flags_checked():
    for name in ("lr_in_residual", "global_variance"):
        with pytest.raises(TypeError, match=f"{name} must be True or False, got 'yes'"):
            LocalAdamW([{"params": [torch.nn.Parameter(torch.zeros(2))], name: "yes"}])


def test_local_adamw_on_one_rank_is_torch_adamw():
    """One rank, nothing dropped: transforming the gradient, then stepping on the result, is
    exactly AdamW (what the engine does with a density-1 exchange on one rank)."""
    p0, gs = np.random.default_rng(4).standard_normal((7, 5)), grads(6)

    def local(ps):
        opt = LocalAdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        plain_step = opt.step

        def step():
            for p in ps:
                opt.transform_local_gradient(p, p.grad)
            plain_step()
        opt.step = step
        return opt

    ours, opt = run(local, p0, gs)
    torch_, ref = run(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), p0, gs)
    np.testing.assert_allclose(ours, torch_, rtol=1e-12, atol=1e-14)
    ours_state, torch_state = next(iter(opt.state.values())), next(iter(ref.state.values()))
    np.testing.assert_allclose(ours_state["exp_avg_sq"].numpy(), torch_state["exp_avg_sq"].numpy(), rtol=1e-12)


def test_local_adamw_lr_in_residual_on_one_rank_is_torch_adamw():
    """lr_in_residual only moves where lr multiplies: with the whole update exchanged on one
    rank it is still AdamW, under a changing learning rate too."""
    p0, gs = np.random.default_rng(5).standard_normal((7, 5)), grads(6)
    lrs = [LR * 0.5 ** i for i in range(len(gs))]

    def schedule(make):
        def build(ps):
            opt = make(ps)
            inner_step, steps = opt.step, iter(lrs)

            def step():
                for group in opt.param_groups:
                    group["lr"] = next(steps)
                if isinstance(opt, LocalAdamW):
                    for q in ps:
                        opt.transform_local_gradient(q, q.grad)
                inner_step()
            opt.step = step
            return opt
        return build

    ours, _ = run(schedule(lambda ps: LocalAdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                  lr_in_residual=True)), p0, gs)
    torch_, _ = run(schedule(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)), p0, gs)
    np.testing.assert_allclose(ours, torch_, rtol=1e-12, atol=1e-14)
    with pytest.raises(TypeError, match="lr_in_residual must be True or False"):
        LocalAdamW([torch.nn.Parameter(torch.zeros(2))], lr_in_residual=1)


@pytest.mark.parametrize("ranks", [1, 2, 5])
def test_local_adamw_global_variance_matches_numpy(ranks):
    """global_variance: the update is m_hat / (sqrt(v_hat / P + (1 - 1/P) mean_hat^2) + eps),
    written out in numpy with the gradient's EMA ``mean`` (beta2) and bias corrections; one
    rank (P = 1) is plain LocalAdamW. Gradients with a common offset, so the signal term is live."""
    b1, b2 = 0.5, 0.9
    gen = np.random.default_rng(7)
    gs = [gen.standard_normal((4, 3)) * 0.3 + 1.0 for _ in range(6)]
    p = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    opt = LocalAdamW([p], lr=LR, betas=(b1, b2), eps=EPS, weight_decay=0.0, lr_in_residual=False,
                     global_variance=True)
    m, v, mean = np.zeros((4, 3)), np.zeros((4, 3)), np.zeros((4, 3))
    for t, g in enumerate(gs, start=1):
        grad = torch.tensor(g)
        opt.transform_local_gradient(p, grad, ranks)
        m, v, mean = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, b2 * mean + (1 - b2) * g
        v_hat, mean_hat = v / (1 - b2 ** t), mean / (1 - b2 ** t)
        want = m / (1 - b1 ** t) / (np.sqrt(v_hat / ranks + (1 - 1 / ranks) * mean_hat ** 2) + EPS)
        np.testing.assert_allclose(grad.numpy(), want, rtol=1e-12, err_msg=f"step {t}")
        opt._transformed.clear()
    if ranks > 1:  # the noise term shrank: updates larger than one rank's Adam would give
        plain = m / (1 - b1 ** 6) / (np.sqrt(v / (1 - b2 ** 6)) + EPS)
        assert np.all(np.abs(grad.numpy()) > np.abs(plain))


@pytest.mark.parametrize("b1", [0.0, 0.5])
def test_local_adamw_signal_lag1_matches_numpy(b1):
    """signal="mean+lag1": the signal is max(mean_hat^2, min(-lag1_hat, v_hat)), with lag1 the
    EMA (beta2) of g_t * g_{t-1} from the second step on (bias-corrected over one step fewer),
    written out in numpy. Gradients that flip sign every step (an oscillation) with noise: their
    mean is near 0, so "mean" counts them as noise and takes steps up to sqrt(P) larger than
    one rank's Adam; "mean+lag1" keeps them near one rank's. beta1 0 (the previous gradient read
    from exp_avg) and 0.5 (kept in its own buffer)."""
    b2, ranks = 0.9, 5
    gen = np.random.default_rng(11)
    gs = [(-1.0) ** t + gen.standard_normal((4, 3)) * 0.2 for t in range(8)]
    p = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    opts = {s: LocalAdamW([p], lr=LR, betas=(b1, b2), eps=EPS, weight_decay=0.0, lr_in_residual=False, signal=s)
            for s in LocalAdamW.SIGNALS}
    m, v, mean, lag1, prev = (np.zeros((4, 3)) for _ in range(5))
    for t, g in enumerate(gs, start=1):
        got = {}
        for name, opt in opts.items():
            grad = torch.tensor(g)
            opt.transform_local_gradient(p, grad, ranks)
            got[name] = grad.numpy()
            opt._transformed.clear()
        m, v, mean = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, b2 * mean + (1 - b2) * g
        if t > 1:
            lag1 = b2 * lag1 + (1 - b2) * g * prev
        prev = g
        v_hat, mean_hat = v / (1 - b2 ** t), mean / (1 - b2 ** t)
        signal = mean_hat ** 2
        if t > 1:
            signal = np.maximum(signal, np.minimum(-lag1 / (1 - b2 ** (t - 1)), v_hat))
        want = m / (1 - b1 ** t) / (np.sqrt(signal * (1 - 1 / ranks) + v_hat / ranks) + EPS)
        np.testing.assert_allclose(got["mean+lag1"], want, rtol=1e-12, err_msg=f"step {t}")
    plain = m / (1 - b1 ** 8) / (np.sqrt(v / (1 - b2 ** 8)) + EPS)  # one rank's Adam
    assert np.all(np.abs(got["mean"]) > 1.5 * np.abs(plain))  # the oscillation counted as noise
    np.testing.assert_allclose(got["mean+lag1"], plain, rtol=0.2)  # counted as signal
    # (and variance_sketch="auto"'s entries, made with the state: hvd_topk.optim._complete_state)
    assert set(opts["mean+lag1"].state[p]) == {"step", "exp_avg", "exp_avg_sq", "grad_mean", "grad_lag1",
                                               *(("grad_prev",) if b1 else ()), "sketch_sq", "sketches",
                                               "estimate_sum"}
    with pytest.raises(ValueError, match="signal must be one of"):
        LocalAdamW([torch.nn.Parameter(torch.zeros(2))], signal="lag1")


def test_variance_sketch_is_a_signed_sum_of_rows():
    """The sketch against numpy: the gradient times its entry signs, cut into rows of min(B, n)
    entries (the last zero-padded), summed with the signs of the seed; a tensor of at most B
    entries comes back whole (times signs), so its squared norm is exact."""
    gen = np.random.default_rng(3)
    x = gen.standard_normal(1000) * gen.random(1000) + 0.2
    fixed = variance_sketch.entry_signs(1000, torch.device("cpu"))
    assert set(np.unique(fixed.numpy())) == {-1, 1}
    for buckets in (256, 7):
        rows = -(-1000 // buckets)
        padded = np.concatenate([x * fixed.numpy(), np.zeros(rows * buckets - 1000)]).reshape(rows, buckets)
        sigma = variance_sketch.signs(rows, 5, torch.device("cpu")).numpy()
        assert set(np.unique(sigma)) <= {-1.0, 1.0}
        np.testing.assert_allclose(variance_sketch.sketch(torch.tensor(x), buckets, 5, fixed).numpy(), sigma @ padded,
                                   rtol=1e-5, atol=1e-5)
    got = variance_sketch.sketch(torch.tensor(x[:100]), 256, 9, fixed[:100]).numpy()
    np.testing.assert_allclose(np.abs(got), np.abs(x[:100]), rtol=1e-6)


def test_variance_sketch_of_an_empty_parameter():
    """An empty parameter sketches to nothing (no division by its zero length), and its
    average (nothing: no rank has an entry of it) is not absorbed."""
    p = torch.nn.Parameter(torch.zeros(0))
    opt = LocalAdamW([p], variance_sketch=8)
    opt.transform_local_gradient(p, torch.zeros(0), 2)
    rows = opt.sketch_rows(opt.sketch_layout(2))
    assert rows.numel() == 0
    opt.absorb_sketches([(p, 8)], rows)
    assert float(opt.state[p]["sketch_sq"]) == 0.0 and opt.state[p]["sketches"] == 0


@pytest.mark.parametrize("rank_one", [False, True])
def test_variance_sketch_measures_the_squared_norm(rank_one):
    """Over many steps' seeds the sketch's squared norm averages to the gradient's (within 3%),
    with a spread per step near sqrt(2/B) for independent entries; for a weight gradient of rank
    one (an outer product, which rows of the layout repeat) the entry signs keep the spread
    small (without them it is about 0.9)."""
    gen = np.random.default_rng(4)
    if rank_one:
        x = np.outer(gen.standard_normal(256), gen.standard_normal(64)).ravel()
    else:
        x = gen.standard_normal(256 * 64)
    fixed = variance_sketch.entry_signs(x.size, torch.device("cpu"))
    norms = np.array([float(variance_sketch.sketch(torch.tensor(x), 128, seed, fixed).square().sum())
                      for seed in range(1500)]) / np.sum(x ** 2)
    assert abs(norms.mean() - 1) < 0.03, norms.mean()
    assert norms.std() < (0.35 if rank_one else 0.16), norms.std()


def test_local_adamw_variance_sketch_matches_numpy():
    """variance_sketch: the global-variance estimate rescaled by the bias-corrected EMA (beta2) of
    the averaged sketches' squared norms absorbed before this step over the sum of the previous
    step's (unrescaled) estimate; none absorbed yet, no rescaling. Written out in numpy, with 'averaged sketches' handed in by
    hand (a transport's job) and a tensor small enough to be sketched exactly."""
    b2, ranks = 0.9, 4
    gen = np.random.default_rng(5)
    p = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    opt = LocalAdamW([p], lr=LR, betas=(0.0, b2), eps=EPS, weight_decay=0.0, lr_in_residual=False,
                     variance_sketch=64)
    v, mean, sq, count, last_sum = np.zeros((4, 3)), np.zeros((4, 3)), 0.0, 0, None
    for t in range(1, 7):
        g = gen.standard_normal((4, 3)) * 0.3 + 0.5
        grad = torch.tensor(g)
        opt.transform_local_gradient(p, grad, ranks)
        v, mean = b2 * v + (1 - b2) * g * g, b2 * mean + (1 - b2) * g
        v_hat, mean_hat = v / (1 - b2 ** t), mean / (1 - b2 ** t)
        estimate = mean_hat ** 2 + (v_hat - mean_hat ** 2) / ranks
        unscaled_sum = estimate.sum()
        if count:
            estimate = estimate * (sq / (1 - b2 ** count)) / last_sum
        last_sum = unscaled_sum  # (the totals are kept in float64)
        np.testing.assert_allclose(grad.numpy(), g / (np.sqrt(estimate) + EPS), rtol=1e-6, err_msg=f"step {t}")
        # this rank's sketch is its gradient whole (12 entries <= 64), times one sign
        mine = opt.sketch_rows(opt.sketch_layout(2)).numpy()
        np.testing.assert_allclose(np.abs(mine), np.abs(g.ravel()), rtol=1e-6)
        average = gen.standard_normal(12) * 0.1 + 0.4  # what the ranks' average might be
        opt.absorb_sketches([(p, 64)], torch.tensor(average, dtype=torch.float32))
        sq, count = b2 * sq + (1 - b2) * float(np.sum(average.astype(np.float32) ** 2)), count + 1
        opt._step_done()
    assert int(opt.state[p]["sketches"]) == 6
    np.testing.assert_allclose(float(opt.state[p]["sketch_sq"]), sq, rtol=1e-5)
    # the checkpoint carries the measurement: a fresh optimizer loaded from it computes the same
    fresh = LocalAdamW([p], lr=LR, betas=(0.0, b2), eps=EPS, weight_decay=0.0, lr_in_residual=False,
                       variance_sketch=64)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))  # (as a saved file: nothing shared)
    g = torch.tensor(gen.standard_normal((4, 3)))
    a, b = g.clone(), g.clone()
    opt.transform_local_gradient(p, a, ranks)
    fresh.transform_local_gradient(p, b, ranks)
    assert torch.equal(a, b)


def test_local_adamw_variance_sketch_auto_is_256_from_6_ranks():
    """The default, variance_sketch="auto": from 6 ranks on every step computes what B = 256
    computes (same updates bit for bit, same sketch layout), below 6 what B = 0 computes (no
    sketch, no rescaling); off without global_variance; a checkpoint written before the option
    existed (no key in its groups) loads as 0 at any rank count."""
    gen = np.random.default_rng(6)
    grads = [torch.tensor(gen.standard_normal((40, 30))) for _ in range(4)]
    averages = [torch.tensor(gen.standard_normal(256), dtype=torch.float32) * 0.01 for _ in grads]

    def run(ranks, **kwargs):
        p = torch.nn.Parameter(torch.zeros(40, 30, dtype=torch.float64))
        opt = LocalAdamW([p], lr=LR, betas=(0.0, 0.95), **kwargs)
        updates, layouts = [], []
        for g, average in zip(grads, averages):
            update = g.clone()
            opt.transform_local_gradient(p, update, ranks)
            layout = opt.sketch_layout(ranks)
            if layout:  # what a transport does after the exchange
                opt.sketch_rows(layout)
                opt.absorb_sketches(layout, average)
            opt._step_done()
            updates.append(update)
            layouts.append([(q is p, b) for q, b in layout])
        return updates, layouts, opt

    for ranks, explicit in ((6, 256), (8, 256), (12, 256), (5, 0), (4, 0), (2, 0)):
        auto, explicit_run = run(ranks), run(ranks, variance_sketch=explicit)
        assert auto[1] == explicit_run[1] == [[(True, 256)] if explicit else []] * len(grads), ranks
        for a, b in zip(auto[0], explicit_run[0]):
            assert torch.equal(a, b), ranks
    # B = 256 does rescale at 8 ranks (the comparison above is not between two unscaled runs)
    assert not torch.equal(run(8)[0][-1], run(8, variance_sketch=0)[0][-1])
    assert run(8, global_variance=False)[1] == [[]] * len(grads)
    old = run(2)[2].state_dict()
    for group in old["param_groups"]:
        del group["variance_sketch"]
    p = torch.nn.Parameter(torch.zeros(40, 30, dtype=torch.float64))
    loaded = LocalAdamW([p], lr=LR, betas=(0.0, 0.95))
    with pytest.warns(UserWarning, match="lack variance_sketch: taken as variance_sketch=0"):
        loaded.load_state_dict(old)
    assert loaded.sketch_layout(8) == []


@pytest.mark.parametrize("kwargs,error,match", [
    ({"variance_sketch": -1}, ValueError, "variance_sketch must be 'auto' or an integer >= 0"),
    ({"variance_sketch": 2.5}, TypeError, "variance_sketch must be 'auto' or an integer"),
    ({"variance_sketch": True}, TypeError, "variance_sketch must be 'auto' or an integer"),
    ({"variance_sketch": "on"}, TypeError, "variance_sketch must be 'auto' or an integer"),
    ({"variance_sketch": 8, "global_variance": False}, ValueError, "it needs global_variance=True")])
def test_local_adamw_variance_sketch_refused(kwargs, error, match):
    """A value of the wrong type is a TypeError, one out of range a ValueError (api.md's rule)."""
    with pytest.raises(error, match=match):
        LocalAdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_local_adamw_variance_sketch_takes_a_numpy_integer():
    p = torch.nn.Parameter(torch.zeros(2))
    assert LocalAdamW([p], variance_sketch=np.int64(16)).param_groups[0]["variance_sketch"] == 16


@pytest.mark.parametrize("make", [lambda ps, **kw: LocalAdamW(ps, **kw), lambda ps, **kw: FrozenVarianceAdamW(ps, **kw)])
def test_numpy_options_saved_as_python_numbers(make, tmp_path):
    """Options given as numpy scalars (lr, betas; in the constructor or a group added later) are
    kept as Python numbers, so the checkpoint loads with torch.load's default weights_only=True
    (which refuses numpy objects; torch's own AdamW keeps them as given)."""
    opt = make([torch.nn.Parameter(torch.zeros(2))], lr=np.float32(1e-3), betas=(np.float32(0.5), np.float64(0.9)))
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": np.float64(2e-3)})
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    groups = torch.load(tmp_path / "opt.pt")["param_groups"]
    assert [type(g["lr"]) for g in groups] == [float, float] and groups[1]["lr"] == 2e-3
    assert [type(b) for b in groups[0]["betas"]] == [float, float] and groups[0]["betas"] == (0.5, 0.9)


def test_local_adamw_lr_changed_after_backward_warns():
    """lr_in_residual multiplies each update by the rate when its gradient arrives (backward()):
    a loop that changes the rate before step() is told once (before 2026-12-05 the step ran at
    the old rate in silence). The update applied is the one at the old rate, by hand: p = -lr
    x sign(g) while the gradient stays the same (beta1 0, eps 0, no weight decay)."""
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = LocalAdamW([p], lr=0.5, weight_decay=0.0, eps=0.0)
    for step, (lr_backward, lr_step, told) in enumerate([(0.5, 0.5, False), (0.5, 0.25, True), (0.25, 0.125, False)]):
        opt.param_groups[0]["lr"] = lr_backward
        p.grad = torch.tensor([2.0, -3.0, 4.0], dtype=torch.float64)
        opt.transform_local_gradient(p, p.grad)  # what the engine does in backward()
        opt.param_groups[0]["lr"] = lr_step
        before = p.detach().clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        said = [str(w.message) for w in caught if "changed between backward() and step()" in str(w.message)]
        assert said == ([f"hvd_topk.LocalAdamW: a param group's learning rate changed between backward() and step() "
                         f"(from 0.5 to 0.25): with lr_in_residual=True each update is multiplied by the rate when its "
                         f"gradient arrives, in backward(), so this step's update ran at 0.5 (its weight decay at 0.25). "
                         f"Set the rate before backward() "
                         f"(torch's LR schedulers do: scheduler.step() after optimizer.step())."] if told else []), said
        assert all(w.filename == __file__ for w in caught), [(w.filename, w.lineno) for w in caught]  # opt.step()'s line
        # the same gradient every step: m_hat / sqrt(v_hat) = sign(g), applied at backward()'s rate
        np.testing.assert_allclose((p - before).detach().numpy(), -lr_backward * np.sign([2.0, -3.0, 4.0]))


def test_local_adamw_lr_after_a_skipped_step_does_not_warn():
    """A step skipped by zeroing the model's gradients (the exchange done, neither step() nor the
    optimizer's zero_grad() run), then the scheduler's next rate: the next step runs at that
    rate and nothing is said (a review found a false warning, 2026-12-05)."""
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = LocalAdamW([p], lr=0.5, weight_decay=0.0, eps=0.0)
    g = torch.tensor([2.0, -3.0, 4.0], dtype=torch.float64)
    opt.transform_local_gradient(p, g.clone())
    opt.exchanged()  # what the engine says once p.grad holds the exchanged result; then skipped
    opt.param_groups[0]["lr"] = 0.25  # scheduler.step()
    p.grad = g.clone()
    opt.transform_local_gradient(p, p.grad)
    before = p.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert not [str(w.message) for w in caught if "changed between" in str(w.message)]
    np.testing.assert_allclose((p - before).detach().numpy(), -0.25 * np.sign(g.numpy()))


@pytest.mark.parametrize("built_with", [True, False])
def test_local_adamw_global_variance_changed_in_place_refused(built_with):
    """global_variance decides which moments the state keeps: changed in place after the state
    was made, it is refused at the next update (before 2026-12-05 it was ignored in silence)."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = LocalAdamW([p], lr=0.1, global_variance=built_with, variance_sketch=0)
    opt.transform_local_gradient(p, torch.ones(4), ranks=2)
    opt._step_done()
    opt.param_groups[0]["global_variance"] = not built_with
    with pytest.raises(RuntimeError, match=f"global_variance is {not built_with} in a param group whose state was "
                                           "made with the other value"):
        opt.transform_local_gradient(p, torch.ones(4), ranks=2)


def test_local_adamw_variance_sketch_float16_total_finite():
    """variance_sketch with float16 parameters: the estimate's total (about 100,000 x 4 here) is
    beyond float16's 65504; summed in float16 it was inf, and the next update, rescaled by
    measured / inf, was inf. Against a float32 run on the same (float16-representable) values:
    the same total to float32's rounding, finite updates equal to float16's rounding of the
    steps between (at most 0.18% here: a 1% error in the float16 path fails)."""
    gen = torch.Generator().manual_seed(0)
    gs = [(torch.randn(100_000, generator=gen) * 2).half() for _ in range(3)]
    totals, updates = {}, {}
    for dtype in (torch.float16, torch.float32):
        p = torch.nn.Parameter(torch.zeros(100_000, dtype=dtype))
        opt = LocalAdamW([p], lr=1e-3, betas=(0.0, 0.95), variance_sketch=256)
        for g in gs:
            x = g.to(dtype, copy=True)  # (transformed in place)
            opt.transform_local_gradient(p, x, ranks=8)
            layout = opt.sketch_layout(8)
            opt.absorb_sketches(layout, opt.sketch_rows(layout))
            opt._step_done()
        totals[dtype], updates[dtype] = float(opt.state[p]["estimate_sum"]), x.float()
    assert np.isfinite(totals[torch.float16]) and totals[torch.float16] > 65504, totals
    np.testing.assert_allclose(totals[torch.float16], totals[torch.float32], rtol=1e-3)
    assert bool(torch.isfinite(updates[torch.float16]).all())
    np.testing.assert_allclose(updates[torch.float16].numpy(), updates[torch.float32].numpy(), rtol=4e-3, atol=1e-6)


def test_local_adamw_alone_is_refused():
    """Stepping on a raw gradient (no hvd_topk.DistributedOptimizer in between) would be SGD at
    Adam's learning rate: refused. Horovod's broadcast_optimizer_state initialises state with a
    zero gradient and one step: allowed, and it leaves the parameter alone."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = LocalAdamW([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(3)
    opt.step()
    np.testing.assert_array_equal(p.detach().numpy(), np.ones(3))
    # global_variance and variance_sketch="auto" (the defaults; the sketch's entries made with the state)
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq", "grad_mean", "sketch_sq", "sketches", "estimate_sum"}
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="inner optimizer of hvd_topk.DistributedOptimizer, or with DDP.*"
                       r"TopKState\(optimizer=...\)"):
        opt.step()


@pytest.mark.parametrize("make", [lambda ps: LocalAdamW(ps, lr=0.1), lambda ps: DeMo(ps, lr=0.1)])
def test_second_step_without_backward_is_named(make):
    """One update, transformed as the exchange would (one rank), applied by step(); a second
    step() on the same p.grad would apply it again: refused, saying so (it once said to use the
    optimizer inside DistributedOptimizer or the DDP hook, which the user had done). After a new
    transform the step goes through."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = make([p])
    p.grad = torch.full((3,), 0.5)
    opt.transform_local_gradient(p, p.grad, 1)
    opt.step()
    with pytest.raises(RuntimeError, match=r"step\(\) was called again without a new backward\(\)"):
        opt.step()
    p.grad = torch.full((3,), 0.5)
    opt.transform_local_gradient(p, p.grad, 1)
    opt.step()


def test_demo_on_one_rank_matches_numpy():
    """hvd_topk.DeMo by itself (one rank, everything sent): p * (1 - lr wd) - lr * sign(lr g),
    or with "rms" lr * g / rms(g), in float64 numpy."""
    gs = grads(4)
    for normalise in ("sign", "rms"):
        p = torch.nn.Parameter(torch.tensor(np.ones((7, 5)), dtype=torch.float64))
        opt = DeMo([p], lr=LR, weight_decay=WD, normalise=normalise)
        want = np.ones((7, 5))
        for g in gs:
            p.grad = torch.tensor(g)
            opt.transform_local_gradient(p, p.grad)  # what DistributedOptimizer's hook does
            opt.step()
            move = np.sign(g) if normalise == "sign" else g / np.sqrt(np.mean(g ** 2))
            want = want * (1 - LR * WD) - LR * move
        np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-12, err_msg=normalise)


def test_demo_rms_of_a_sparse_gradient():
    """nn.Embedding(sparse=True): the exchanged gradient comes back sparse; "rms" divides by the
    root mean square over every entry, the absent ones zeros (numpy on the dense equivalent)."""
    g = np.zeros((6, 4))
    g[[1, 4]] = np.arange(1.0, 9.0).reshape(2, 4)
    p = torch.nn.Parameter(torch.ones(6, 4, dtype=torch.float64))
    opt = DeMo([p], lr=LR, weight_decay=WD, normalise="rms")
    dense = torch.tensor(g)
    opt.transform_local_gradient(p, dense)
    p.grad = dense.to_sparse()
    opt.step()
    want = np.ones((6, 4)) * (1 - LR * WD) - LR * (LR * g) / np.sqrt(np.mean((LR * g) ** 2))
    np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_demo_rms_moves_16_bit_parameters(dtype):
    """DeMo's "rms" with 16-bit parameters: the averaged update lr x g (1e-4 here) squared
    underflowed float16 to a zero root mean square, and the step was skipped. Each entry moves by
    lr x g / rms(g) (float64 numpy), to the parameter dtype's rounding (bfloat16 has float32's
    range and was right before)."""
    g = np.linspace(-1.0, 1.0, 64).reshape(8, 8)
    g[g == 0] = 0.5
    p = torch.nn.Parameter(torch.zeros(8, 8, dtype=dtype))
    opt = DeMo([p], lr=1e-4, weight_decay=0.0, normalise="rms")
    update = torch.tensor(g, dtype=dtype)
    opt.transform_local_gradient(p, update)  # the accumulator: lr x g, about 1e-4
    p.grad = update
    opt.step()
    scaled = 1e-4 * g
    want = -1e-4 * scaled / np.sqrt(np.mean(scaled ** 2))
    # (float16 holds the smallest moves, 3e-6, as subnormals: 6e-8 apart)
    np.testing.assert_allclose(p.detach().double().numpy(), want, rtol=4 * torch.finfo(dtype).eps, atol=1e-7)


@pytest.mark.parametrize("kwargs,match", [({"beta": 0.0}, "beta must be a number in \\(0, 1\\]"),
                                          ({"beta": 1.5}, "beta must be"),
                                          ({"normalise": "l2"}, "normalise"), ({"lr": -1.0}, "lr"),
                                          ({"lr": float("inf")}, "lr must be a finite number"),
                                          ({"weight_decay": float("nan")}, "weight_decay")])
def test_demo_bad_options_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeMo([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    if "beta" not in kwargs:  # (the accumulator's decay is the optimizer's, not a group's)
        with pytest.raises(ValueError, match=match):
            DeMo([{"params": [torch.nn.Parameter(torch.zeros(2))], **kwargs}])
        opt = DeMo([torch.nn.Parameter(torch.zeros(2))])
        saved = opt.state_dict()
        saved["param_groups"][0].update(kwargs)
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(saved)


@pytest.mark.parametrize("kwargs", [{"beta": True}, {"beta": "0.9"}, {"lr": "1e-3"}])
def test_demo_options_of_the_wrong_type_refused(kwargs):
    with pytest.raises(TypeError, match=f"{next(iter(kwargs))} must be a number"):
        DeMo([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_demo_beta_one_accepted():
    """(0, 1], as documented: 1.0 keeps the whole accumulator (the engine's default decay)."""
    assert DeMo([torch.nn.Parameter(torch.zeros(2))], beta=1.0).residual_decay == 1.0


def test_demo_without_error_feedback_names_its_beta():
    """DeMo's momentum lives in the residual: error_feedback=False is refused naming DeMo's beta
    (the user never passed residual_decay), through the DDP hook's state as through the engine's
    helper; with beta=1.0 (no decay) it is accepted."""
    import hvd_topk.ddp
    from hvd_topk.optim import residual_decay_of
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"DeMo keeps its momentum in the residual \(beta=0.9\).*error_feedback=True"):
        hvd_topk.ddp.TopKState(optimizer=DeMo(params, beta=0.9), error_feedback=False)
    with pytest.raises(ValueError, match=r"beta=0.5"):
        residual_decay_of(DeMo(params, beta=0.5), 1.0, error_feedback=False)
    assert residual_decay_of(DeMo(params, beta=1.0), 1.0, error_feedback=False) == 1.0


def test_demo_alone_is_refused():
    """A raw gradient stepped without the exchange's transform is refused (as for LocalAdamW);
    broadcast_optimizer_state's zero-gradient probe step leaves the parameter alone."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = DeMo([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(3)
    opt.step()
    np.testing.assert_array_equal(p.detach().numpy(), np.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="DeMo got a gradient"):
        opt.step()


def _sketched_steps(opt, p, grads, ranks=6):
    """Drive ``LocalAdamW`` with ``variance_sketch`` as a transport would, every rank alike: each
    step this rank's update of ``grads[t]`` (None: no rank had a gradient), its sketch
    "averaged" (every rank sends the same), absorbed. Returns the updates."""
    updates = []
    for g in grads:
        if g is not None:
            grad = g.clone()
            opt.transform_local_gradient(p, grad, ranks)
            updates.append(grad)
        opt.absorb_sketches(opt.sketch_layout(ranks), opt.sketch_rows(opt.sketch_layout(ranks)))
        opt._step_done()
    return updates


def test_variance_sketch_a_branch_left_out_for_many_steps_changes_nothing():
    """A parameter no rank had a gradient of for 400 steps (a branch left out of the forward)
    takes, when it is used again, the update it would take had those steps not happened. Truth:
    the same run without the gap. Before, the all-zero averages decayed the measured total
    towards zero while the estimate stood still, and the first update after the gap was about
    30,000 times too large."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(64, 8, generator=gen) * 0.1 + 0.05 for _ in range(30)]
    runs = []
    for gap in (0, 400):
        p = torch.nn.Parameter(torch.zeros(64, 8))
        opt = LocalAdamW([p], lr=1e-2, betas=(0.0, 0.95), variance_sketch=16)
        runs.append(_sketched_steps(opt, p, grads[:20] + [None] * gap + grads[20:]))
    for t, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"update {t}: {float(a.abs().max())} against {float(b.abs().max())} without the gap"


@pytest.mark.parametrize("what", ["a spike of 1e20", "2500 steps of zero gradients"])
def test_variance_sketch_survives_a_spike_and_long_zeros(what):
    """The sketch's totals are float64 and its rescaling bounded to [1/16, 16]: one gradient
    spiked by 1e20 (whose squared total overflowed float32 and made every later update NaN) or
    2500 steps of exactly zero gradients (the totals became subnormal and the first update
    after them was about 1000 times too large) leave every later update finite and within the
    bound's reach of the same run's without the sketch. Truth: that run."""
    gen = torch.Generator().manual_seed(4)
    base = [torch.randn(64, 8, generator=gen) * 0.1 + 0.05 for _ in range(60)]
    if what.startswith("a spike"):
        grads = base[:20] + [base[20] * 1e20] + base[21:]
    else:
        grads = base[:20] + [torch.zeros(64, 8)] * 2500 + base[20:]
    updates = {}
    for sketch in (0, 16):
        p = torch.nn.Parameter(torch.zeros(64, 8))
        opt = LocalAdamW([p], lr=1e-2, betas=(0.0, 0.95), variance_sketch=sketch)
        updates[sketch] = _sketched_steps(opt, p, grads)
    for t, (plain, sketched) in enumerate(zip(updates[0], updates[16])):
        assert bool(torch.isfinite(sketched).all()), f"{what}: update {t} not finite"
    # the bound: the estimate scaled by at most 16 either way, so the update by at most 4
    late = [float(s.abs().max() / u.abs().max()) for u, s in zip(updates[0][20:], updates[16][20:])
            if bool(u.any())]  # (an update of zero gradients is zero in both)
    assert len(late) >= 39 and all(1 / 4.01 <= r <= 4.01 for r in late), f"{what}: update ratios {late[:8]}"


@pytest.mark.parametrize("make", [lambda ps: LocalAdamW(ps, lr=1e-2), lambda ps: DeMo(ps, lr=1e-2, normalise="rms"),
                                  lambda ps: DeMo(ps, lr=1e-2, normalise="sign")], ids=["LocalAdamW", "DeMo rms", "DeMo sign"])
def test_an_update_holding_inf_is_skipped_with_a_warning(make):
    """An exchanged update holding inf/nan (a rank's gradient overflowed: after the exchange
    every rank holds it) is not applied: the parameters stay as they were, and the next finite
    step moves them, finite. Before, LocalAdamW and DeMo's rms turned every parameter NaN for
    good, and DeMo's sign moved the inf entries by lr, in silence. Truth: the parameters before
    the bad step, and after the next."""
    def run(bad):
        torch.manual_seed(0)
        a, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))
        opt = make([a, b])
        for t in range(3):
            grads = [torch.full((6, 4), 0.1 * (t + 1)), torch.full((5,), -0.2)]
            if bad and t == 1:
                grads[0][2, 3] = float("inf")
            before = [a.detach().clone(), b.detach().clone()]
            for p, g in zip((a, b), grads):
                opt.transform_local_gradient(p, g, 2)
                p.grad = g
            opt.exchanged()
            if bad and t == 1:
                with pytest.warns(UserWarning, match="holds inf/nan .* the step is skipped on every rank"):
                    opt.step()
                assert all(torch.equal(x, y) for x, y in zip((a, b), before)), "the bad step moved the parameters"
            else:
                opt.step()
                if t == 2:
                    assert all(bool(torch.isfinite(x).all()) and not torch.equal(x, y)
                               for x, y in zip((a, b), before)), "the step after the bad one"
            opt.zero_grad()
    run(bad=True)
