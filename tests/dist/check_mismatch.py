"""Ranks that build different models get a clear ValueError on every rank, not a hang.

Run: PYTHONPATH=.:tests/support mpirun -np 2 (or 3) python tests/dist/check_mismatch.py
(``--list`` prints the names of its checks).
"""

import warnings

import torch

import horovod.torch as hvd
import hvd_topk
from harness import raises, run
from native_switch import loaded, native_off


def last_rank():
    return hvd.size() - 1


def expect_error(make_model, what):
    model = make_model(hvd.rank())
    with raises(ValueError, match="ranks disagree", what=f"{what} on rank {hvd.rank()}") as caught:
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
    assert f"rank {last_rank()} differs from rank 0 in: the parameters (names, shapes, dtypes, order)" \
        in str(caught.value), caught.value


def expect_setting_named(field, make_optimizer):
    """One setting differing on the last rank: every rank raises, naming that setting (and only
    it), where before several of these trained on silently diverged (the inner optimizer, the
    grad_scaler) or failed later with Horovod's or torch's own message (op, groups)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with raises(ValueError, match="ranks disagree", what=f"{field} on rank {hvd.rank()}") as caught:
        make_optimizer(model, hvd.rank() == last_rank())
    assert str(caught.value).endswith(f"rank {last_rank()} differs from rank 0 in: {field}"), caught.value


def distributed(model, inner=None, **options):
    return hvd_topk.DistributedOptimizer(inner or torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), min_numel=100, **options)


def different_shapes(r):
    return torch.nn.Linear(8, 16 if r == last_rank() else 12)


def different_parameter_count(r):
    return torch.nn.Linear(8, 8, bias=r != last_rank())


def different_names(r):
    """Same shapes, different names."""
    m = torch.nn.Module()
    m.add_module("a" if r != last_rank() else "b", torch.nn.Linear(8, 8))
    return m


def check_density_mismatch():
    """Different settings (density) on one rank are caught the same way, naming the density alone
    (the message named TopK's four options together, as if all four differed)."""
    expect_setting_named("TopK's density", lambda m, odd: distributed(
        m, compression=hvd_topk.TopK(density=0.1 if odd else 0.01)))


def check_options_differ(at_step, option="lr", mine=0.1, odd=0.2, shown=r"\('lr', 0\.[12]\)"):
    """The learning rate differing on the last rank, from the start or set there alone in mid-run:
    every rank raises at that step, where before the ranks applied different updates and drifted
    apart silently (stock Horovod does not check either). An option that is a tensor of several
    entries is compared by its values (its shape alone was, and values differing went through)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = distributed(model, exchange="allgather")
    opt.param_groups[0][option] = mine
    for step in range(at_step + 1):
        if step == at_step and hvd.rank() == last_rank():
            opt.param_groups[0][option] = odd
        opt.zero_grad()
        loss = model(torch.randn(8, 64)).square().mean()
        if step < at_step:
            loss.backward()
            opt.step()
            continue
        with raises(RuntimeError, match=r"the ranks' optimizers have different param-group options this step "
                                        rf"\(rank {last_rank()} differs from rank 0 in: param group 0's '{option}'; "
                                        r"this rank's: \[\[.*" + shown, what=f"{option} differing at step {at_step}"):
            loss.backward()
            opt.step()


def check_local_adamw_option_named():
    """A LocalAdamW option differing on the last rank (``signal``, a param-group entry): every
    rank refuses at the first step, and the message names the option (it printed this rank's
    whole option list, to be compared with the other ranks' logs by eye)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    inner = hvd_topk.LocalAdamW(model.parameters(), lr=1e-3,
                                signal="mean" if hvd.rank() == last_rank() else "mean+lag1")
    opt = distributed(model, inner=inner, exchange="allgather")
    with raises(RuntimeError, match=rf"\(rank {last_rank()} differs from rank 0 in: param group 0's 'signal'; "
                                    r"this rank's: ", what="LocalAdamW's signal differing"):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()


def check_step_again_on_one_rank():
    """step() twice after one backward on the last rank only: it applied the averaged gradient
    twice, the others once, and the ranks drifted apart without an error (a warning on that rank
    only). Now the next step refuses on every rank, naming the repeated step(). Twice on every
    rank: no error, and the ranks keep the same weights (numpy truth: lr x the average, twice)."""
    for everyone in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = distributed(model, exchange="allgather")
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(hvd.rank()))
        for step in range(3):
            opt.zero_grad()
            if step == 2 and not everyone:
                with raises(RuntimeError, match=r"1 step\(\) calls without a new backward" if hvd.rank() == last_rank()
                            else r"the ranks are at different steps", what="step() twice on the last rank, then a step"):
                    model(x).square().mean().backward()  # (the first bucket's launch reads the probe)
                    opt.step()
                break
            model(x).square().mean().backward()
            opt.step()
            if step == 1 and (everyone or hvd.rank() == last_rank()):
                before = [p.detach().clone() for p in model.parameters()]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opt.step()  # no backward: the same average again
                for p, b in zip(model.parameters(), before):
                    torch.testing.assert_close(p.detach(), b - 0.1 * p.grad, rtol=0, atol=1e-7)
        if everyone:
            every = hvd.allgather(torch.cat([p.detach().view(-1) for p in model.parameters()])[None])
            assert (every == every[0]).all(), "step() twice on every rank: the ranks' weights differ"


# Run in this order on every rank; add a check with one line.
def check_native_kernel_on_some_ranks(dtype=torch.float32):
    """The native kernel loaded on every rank but the last (a host without a C compiler): every
    rank refuses by name, where before rank 0's native decode failed at the first exchange on
    the last rank's pairs, in another order. With bfloat16 parameters too: selection runs on
    their float32 residuals, natively where the kernel loads (the check once looked at the
    parameters' dtype and let such ranks through). (With the kernel off everywhere, as under
    HVD_TOPK_NATIVE=0, there is nothing to differ: checked where it loads.)"""
    if not loaded():
        return
    from hvd_topk.selection import NATIVE_IN_USE

    def make(model, odd):
        with native_off(odd):
            return distributed(model.to(dtype))
    expect_setting_named(NATIVE_IN_USE, make)


CHECKS = [
    ("step() twice after one backward, on one rank only: refused at the next step", check_step_again_on_one_rank),
    ("a LocalAdamW option differing on one rank: named", check_local_adamw_option_named),
    ("shapes", lambda: expect_error(different_shapes, "shapes")),
    ("parameter count", lambda: expect_error(different_parameter_count, "parameter count")),
    ("names", lambda: expect_error(different_names, "names")),
    ("density", check_density_mismatch),
    ("the inner optimizer's class", lambda: expect_setting_named("the inner optimizer's class", lambda m, odd: distributed(
        m, torch.optim.AdamW(m.parameters()) if odd else hvd_topk.LocalAdamW(m.parameters())))),
    ("grad_scaler", lambda: expect_setting_named("grad_scaler (given or not)", lambda m, odd: distributed(
        m, grad_scaler=torch.amp.GradScaler("cpu") if odd else None))),
    ("op", lambda: expect_setting_named("op", lambda m, odd: distributed(
        m, op=hvd.Sum if odd else hvd.Average))),
    ("groups", lambda: expect_setting_named("the fusion buckets (groups, fusion_bytes, min_numel)",
                                            lambda m, odd: distributed(m, groups=2 if odd else None))),
    ("residual_decay", lambda: expect_setting_named("residual_decay", lambda m, odd: distributed(
        m, residual_decay=0.99 if odd else 1.0))),
    ("the native kernel on some ranks only", check_native_kernel_on_some_ranks),
    ("the native kernel on some ranks only, bf16 parameters", lambda: check_native_kernel_on_some_ranks(torch.bfloat16)),
    ("the learning rate, from the first step", lambda: check_options_differ(0)),
    ("the learning rate, set on one rank in mid-run", lambda: check_options_differ(2)),
    ("a tensor option of two entries, one differing on one rank", lambda: check_options_differ(
        1, "scale", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), r"\('scale', \(1\.0, [23]\.0\)\)")),
]


if __name__ == "__main__":
    run(CHECKS)
