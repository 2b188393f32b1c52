"""Loading checkpoints that do not fit: refused whole, before anything is applied, on every rank.

Every case builds a trained optimizer, snapshots its whole state (inner optimizer, residuals,
step), tries the bad load, and then checks, independently of the code under test, that the
snapshot is bit for bit what the optimizer holds (nothing half-applied), and that training goes
on with every rank's parameters identical.

Run: PYTHONPATH=.:tests/support mpirun -np 2 (or 3) python tests/dist/check_checkpoint.py
(``--list`` prints the names of its checks).
"""

import copy
import re
import warnings

import torch
import torch.nn.functional as F

import horovod.torch as hvd
import hvd_topk
from harness import assert_same_on_all_ranks, raises, run


class Net(torch.nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def build(hidden=32, seed=0):
    torch.manual_seed(seed)
    model = Net(hidden)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopK(density=0.05), min_numel=300,
                                        exchange="allgather")
    return model, opt


def train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def flat_state(opt):
    """Every tensor and number of ``opt.state_dict()``, keyed by its path (a deep copy)."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)
        else:
            out[prefix] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)

    walk("", opt.state_dict())
    return out


def assert_unchanged(opt, before, what):
    after = flat_state(opt)
    assert after.keys() == before.keys(), f"{what}: state keys changed: {set(after) ^ set(before)}"
    for key, value in before.items():
        same = torch.equal(after[key], value) if torch.is_tensor(value) else after[key] == value
        assert same, f"{what}: {key} changed by the failed load"


def trained(hidden=32, steps=3):
    model, opt = build(hidden)
    train(model, opt, steps)
    return model, opt


def refused(opt, bad, match, what):
    """The load raises on this rank, names what it should, and leaves ``opt`` untouched."""
    before = flat_state(opt)
    with raises(ValueError, match=match, what=what):
        opt.load_state_dict(bad)
    assert_unchanged(opt, before, what)


def trains_on(model, opt, what, start=3):
    train(model, opt, 2, start=start)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), f"{what}: {name} not finite"
        assert_same_on_all_ranks(p.detach().numpy(), f"{what}: parameter {name}")


def check_resized_layer():
    """The issue's case: Linear(64, 32) became Linear(64, 16) under the same names."""
    _, old = trained(hidden=32)
    saved = copy.deepcopy(old.state_dict())
    model, opt = trained(hidden=16)
    refused(opt, saved, r"'fc1\.weight'.*\(32, 64\).*\(16, 64\)", "resized layer")
    trains_on(model, opt, "after the refused load")


def check_residual_shape():
    """The inner state fits, but the hvd_topk section's residual does not."""
    model, opt = trained()
    bad = copy.deepcopy(opt.state_dict())
    bad["hvd_topk"]["residuals"]["fc1.weight"] = torch.zeros(3, 3)
    refused(opt, bad, r"'fc1\.weight'.*residual.*\(3, 3\).*\(32, 64\)", "residual shape")
    trains_on(model, opt, "after the refused load")


def check_truncated_and_foreign_sections():
    model, opt = trained()
    good = opt.state_dict()
    truncated = copy.deepcopy(good)
    del truncated["hvd_topk"]["step"]
    refused(opt, truncated, re.escape("lacks ['step']"), "truncated section")
    foreign = dict(copy.deepcopy(good), hvd_topk="not ours")
    refused(opt, foreign, "not the section", "foreign section")
    newer = copy.deepcopy(good)
    newer["hvd_topk"]["format"] = 99
    refused(opt, newer, "newer than this hvd_topk", "newer format")
    reshaped = copy.deepcopy(newer)  # a later format may rename what this one requires
    reshaped["hvd_topk"]["world"] = reshaped["hvd_topk"].pop("size")
    refused(opt, reshaped, "newer than this hvd_topk", "newer format, other fields")
    refused(opt, {"state": {}}, "not an optimizer state_dict", "no param_groups")
    for scale in (0.0, float("inf"), "1024", True):
        odd = copy.deepcopy(good)
        odd["hvd_topk"]["residual_scale"] = scale
        refused(opt, odd, re.escape(f"residual_scale={scale!r}, not a loss scale"), f"residual_scale={scale!r}")
    damaged = copy.deepcopy(good)
    damaged["hvd_topk"]["stats"]["bytes_sent"] = -8
    refused(opt, damaged, re.escape("'stats' holds ['bytes_sent'], not counts"), "damaged statistics")
    trains_on(model, opt, "after the refused loads")


def check_state_dict_mid_step_refused():
    """``state_dict()`` after ``backward()`` and before ``step()``: the gradient is already in the
    residual, so a resume would count it twice; refused (RuntimeError), changing nothing: the run
    then equals one that never asked, bitwise. After ``synchronize()`` it is allowed."""
    runs = []
    for ask in (False, True):
        model, opt = trained()
        gen = torch.Generator().manual_seed(1000 * 3 + hvd.rank())
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if ask:
            with raises(RuntimeError, match=r"called after loss.backward\(\) and before optimizer.step\(\).*twice",
                        what="state_dict() between backward() and step()"):
                opt.state_dict()
        opt.synchronize()
        if ask:
            assert "hvd_topk" in opt.state_dict()
        with opt.skip_synchronize():
            opt.step()
        train(model, opt, 2, start=4)
        runs.append(flat_state(opt))
    assert runs[0].keys() == runs[1].keys()
    for key, value in runs[0].items():
        same = torch.equal(runs[1][key], value) if torch.is_tensor(value) else runs[1][key] == value
        assert same, f"{key} differs after the refused state_dict()"


def check_nonfinite_residual_wiped():
    """A residual holding inf loads as zeros, with a warning naming it; the others load as saved."""
    model, opt = trained()
    saved = copy.deepcopy(opt.state_dict())
    saved["hvd_topk"]["residuals"]["fc1.weight"][0, 0] = float("inf")
    model_b, opt_b = build(seed=7)
    model_b.load_state_dict(model.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt_b.load_state_dict(saved)
    assert any("fc1.weight" in str(w.message) and "inf/nan" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    loaded = opt_b.state_dict()["hvd_topk"]["residuals"]
    assert float(loaded["fc1.weight"].abs().sum()) == 0
    assert torch.equal(loaded["fc2.weight"], saved["hvd_topk"]["residuals"]["fc2.weight"])
    trains_on(model_b, opt_b, "after the wiped load")


def load_telling(opt, state):
    """``opt.load_state_dict(state)``; the warnings it gave, as text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(state)
    return [str(w.message) for w in caught]


def check_own_state_from_another_size_keeps_residuals():
    """An elastic worker restores its own last commit after the job resized (Horovod's commit
    raises HostsUpdatedInterrupt after saving, so a commit can carry the old size): the state
    this optimizer saved, marked as saved at another size, brings its residuals back bit for bit
    and without a warning (they started from zero before 2026-12-05); loaded into another
    optimizer, whose rank and size it does not match, they start from zero, with the warning."""
    model, opt = trained()
    saved = copy.deepcopy(opt.state_dict())
    saved["hvd_topk"]["size"] = hvd.size() + 1  # as committed before one worker left
    residuals = saved["hvd_topk"]["residuals"]
    assert sum(float(t.abs().sum()) for t in residuals.values()) > 0
    train(model, opt, 1, start=3)  # the residuals move on
    said = load_telling(opt, saved)
    assert not [m for m in said if "start from zero" in m], said
    loaded = opt.state_dict()["hvd_topk"]["residuals"]
    assert loaded.keys() == residuals.keys()
    for name, saved_residual in residuals.items():
        assert torch.equal(loaded[name], saved_residual), name
    # into another optimizer; and rank 0's state of this same step on the others (which saved
    # theirs at this step too): neither is theirs
    root = hvd.broadcast_object(copy.deepcopy(opt.state_dict()), root_rank=0, name="ckpt.root_state")
    for into, state in [(build(seed=7)[1], saved)] + ([(opt, root)] if hvd.rank() != 0 else []):
        said = load_telling(into, state)
        assert any("error-feedback residuals start from zero" in m for m in said), said
        assert all(float(t.abs().sum()) == 0 for t in into.state_dict()["hvd_topk"]["residuals"].values())
    trains_on(model, opt, "after its own state came back", start=4)


def check_loaded_then_wrapped_is_told():
    """A checkpoint loaded into the user's optimizer, which is then wrapped: torch's load leaves
    out the 'hvd_topk' section, so the new wrapper starts at step 0 with zero residuals, and it
    says so, naming the fix (it did so silently). Wrapping a fresh optimizer says nothing."""
    model, opt = trained()
    saved = copy.deepcopy(opt.state_dict())
    model_b = build(seed=7)[0]
    model_b.load_state_dict(model.state_dict())
    for inner, want in ((torch.optim.SGD(Net().parameters(), lr=0.1, momentum=0.9), 0),
                        (torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9), 1)):
        if want:
            inner.load_state_dict(saved)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = hvd_topk.DistributedOptimizer(inner, named_parameters=model_b.named_parameters()
                                                    if want else None,
                                                    compression=hvd_topk.TopK(density=0.05), min_numel=300,
                                                    exchange="allgather")
        told = [str(w.message) for w in caught if "load the checkpoint into the hvd_topk.DistributedOptimizer"
                in str(w.message)]
        assert len(told) == want, [str(w.message) for w in caught]
        if want:
            assert "(3)" in told[0], told[0]
            section = wrapped.state_dict()["hvd_topk"]
            assert section["step"] == 0
            assert all(float(r.abs().sum()) == 0 for r in section["residuals"].values())
    trains_on(model_b, wrapped, "after wrapping the loaded optimizer", start=0)


def check_plain_torch_state_loads():
    """A plain torch optimizer's state_dict (no hvd_topk section, no step in its param groups):
    loads, residuals start at zero, the step counter (3) is kept."""
    model, opt = trained()
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saved = copy.deepcopy(opt.state_dict())
    plain.load_state_dict({"state": saved["state"], "param_groups": [
        {k: v for k, v in g.items() if k != "hvd_topk_step"} for g in saved["param_groups"]]})
    assert "hvd_topk_step" not in plain.state_dict()["param_groups"][0]
    opt.load_state_dict(plain.state_dict())
    after = opt.state_dict()["hvd_topk"]
    assert after["step"] == 3, f"the step counter was not kept: {after['step']}"
    residuals = after["residuals"]
    assert residuals and all(float(r.abs().sum()) == 0 for r in residuals.values())
    trains_on(model, opt, "after the plain load")


def check_through_a_plain_optimizer():
    """Saved at step 3, loaded into a plain SGD (an export), saved again and loaded into a new
    wrapper: the param groups carry hvd_topk's step, so the run goes on from step 3 (the density
    warm-up too: 1.0 -> 0.05 over 10 steps, hand-computed 0.05 ** 0.3 at step 3), with a warning
    that the residuals start from zero; before, it went back to step 0 in silence."""
    torch.manual_seed(0)
    model = Net()
    make = lambda: hvd_topk.DistributedOptimizer(  # noqa: E731
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters(),
        compression=hvd_topk.TopK(density=0.05), min_numel=300, exchange="allgather", warmup_steps=10,
        warmup_density=1.0)
    opt = make()
    train(model, opt, 3)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict({k: v for k, v in copy.deepcopy(opt.state_dict()).items() if k != "hvd_topk"})
    again = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.load_state_dict(plain.state_dict())
    said = [str(w.message) for w in caught if "saved through a plain torch optimizer" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    stats = again.compression_stats()
    assert stats["step"] == 3 and abs(stats["current_density"] - 0.05 ** 0.3) < 1e-12, stats
    residuals = again.state_dict()["hvd_topk"]["residuals"]
    assert all(float(r.abs().sum()) == 0 for r in residuals.values())
    trains_on(model, again, "after the round trip")


class Twins(torch.nn.Module):
    """Two same-shaped layers (as attention's q and k), defined in the order given."""

    def __init__(self, first="a", second="b"):
        super().__init__()
        for name in (first, second):
            setattr(self, name, torch.nn.Linear(64, 64))
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def build_twins(order, momentum=0.9):
    torch.manual_seed(0)
    model = Twins(*order)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    return model, hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                                compression=hvd_topk.TopK(density=0.05), min_numel=300,
                                                exchange="allgather")


def check_reordered_twins_refused():
    """The same parameters defined in another order (a before b, then b before a): every shape
    fits torch's positional check, and its load would give a's momentum to b and b's to a while
    the residuals, matched by name, went where they belong. Refused, naming the order; nothing
    applied. The same order loads (the saved momentum of a.weight is then a.weight's, by hand),
    and so does the other order without per-parameter state."""
    model, opt = build_twins("ab")
    train(model, opt, 3)
    saved = copy.deepcopy(opt.state_dict())
    model2, opt2 = build_twins("ba")
    assert [n for n, _ in model2.named_parameters()][:2] == ["b.weight", "b.bias"]
    refused(opt2, saved, "same but in another order.*'a.weight' saved at position 0, here at 2",
            "reordered twins")
    model3, opt3 = build_twins("ab")
    opt3.load_state_dict(copy.deepcopy(saved))
    assert torch.equal(opt3.state[model3.a.weight]["momentum_buffer"], opt.state[model.a.weight]["momentum_buffer"])
    # without per-parameter state (SGD without momentum) nothing goes astray: it loads
    model4, opt4 = build_twins("ab", momentum=0.0)
    train(model4, opt4, 3)
    _, opt5 = build_twins("ba", momentum=0.0)
    opt5.load_state_dict(copy.deepcopy(opt4.state_dict()))


def local_steps(model, inner=None):
    inner = inner or torch.optim.AdamW(model.parameters(), lr=0.01)
    return hvd_topk.LocalSteps(inner, named_parameters=model.named_parameters(), sync_every=2,
                               compression=hvd_topk.TopK(density=0.05), min_numel=300, exchange="allgather")


def check_local_steps_refusals():
    """LocalSteps loads all or nothing too. Before 2026-12-05 it loaded the user's optimizer and
    the shared weights and only then checked the outer optimizer's section (a newer one was
    refused with "Nothing was loaded" after both had been replaced), matched the shared weights
    and moments of same-shaped layers by position whatever their names (each layer took the
    other's at the next synchronisation), and took a resized model's plain checkpoint (failing
    at the next step). Saved mid-period (3 steps, H = 2), so the shared weights differ from the model."""
    torch.manual_seed(0)
    model = Net()
    opt = local_steps(model)
    train(model, opt, 3)
    good = opt.state_dict()
    newer = copy.deepcopy(good)
    newer["hvd_topk_local_steps"]["outer"]["hvd_topk"]["format"] = 99
    refused(opt, newer, "newer than this hvd_topk", "LocalSteps: a newer outer section")
    truncated = copy.deepcopy(good)
    del truncated["hvd_topk_local_steps"]["outer"]["hvd_topk"]["step"]
    refused(opt, truncated, re.escape("lacks ['step']"), "LocalSteps: a truncated outer section")
    foreign = dict(copy.deepcopy(good), hvd_topk_local_steps="not ours")
    refused(opt, foreign, "not the section hvd_topk.LocalSteps saves", "LocalSteps: a foreign section")
    train(model, opt, 1, start=3)  # to the synchronisation: the ranks agree again
    for name, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"LocalSteps after the refused loads: {name}")

    torch.manual_seed(0)
    model = Twins("a", "b")
    opt = local_steps(model)
    train(model, opt, 3)
    saved = copy.deepcopy(opt.state_dict())
    torch.manual_seed(0)
    model2 = Twins("b", "a")
    opt2 = local_steps(model2)
    train(model2, opt2, 1)
    refused(opt2, saved, "same but in another order.*'a.weight' saved at position 0, here at 2",
            "LocalSteps: reordered twins")

    torch.manual_seed(0)
    model = Net(hidden=32)
    plain = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, plain, 2)
    model2 = Net(hidden=16)
    opt2 = local_steps(model2)
    train(model2, opt2, 1)
    refused(opt2, copy.deepcopy(plain.state_dict()), r"'fc1\.weight'.*'exp_avg'.*\(32, 64\).*\(16, 64\)",
            "LocalSteps: a resized model's plain checkpoint")

    # loaded into the user's optimizer, which is then wrapped: torch's load dropped the outer
    # optimizer and kept LocalSteps' phase and shared weights in the param groups, and the run went
    # on half way in silence (LocalSteps), or carried them into every later checkpoint
    # (DistributedOptimizer): now said, and dropped (a new period; plain param groups)
    for wrap, said in ((local_steps, "hvd_topk.LocalSteps: the optimizer's param groups held LocalSteps' entries"),
                       (lambda m, inner: hvd_topk.DistributedOptimizer(inner, named_parameters=m.named_parameters()),
                        "hvd_topk.DistributedOptimizer: the optimizer's param groups held hvd_topk.LocalSteps' entries")):
        model = Net()
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        inner.load_state_dict(copy.deepcopy(good))
        assert good["param_groups"][0]["hvd_topk_local_step"] == 1  # mid-period
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = wrap(model, inner)
        assert [str(w.message).startswith(said) for w in caught].count(True) == 1, [str(w.message) for w in caught]
        local = {k: v for k, v in opt.param_groups[0].items() if k.startswith("hvd_topk_local_")}
        assert local == ({"hvd_topk_local_step": 0, "hvd_topk_local_syncs": 0, "hvd_topk_local_trial": None}
                         if wrap is local_steps else {}), local


CHECKS = [
    ("resized layer refused, named, nothing applied", check_resized_layer),
    ("same-shaped parameters in another order refused", check_reordered_twins_refused),
    ("residual of another shape refused", check_residual_shape),
    ("truncated or foreign section refused", check_truncated_and_foreign_sections),
    ("non-finite residual wiped with a warning", check_nonfinite_residual_wiped),
    ("its own state saved at another size keeps its residuals (elastic)", check_own_state_from_another_size_keeps_residuals),
    ("plain torch optimizer state loads", check_plain_torch_state_loads),
    ("our checkpoint through a plain optimizer keeps its step", check_through_a_plain_optimizer),
    ("a checkpoint loaded into the inner optimizer, then wrapped: told", check_loaded_then_wrapped_is_told),
    ("state_dict() between backward() and step() refused", check_state_dict_mid_step_refused),
    ("LocalSteps: checkpoints that do not fit refused, nothing applied", check_local_steps_refusals),
]


if __name__ == "__main__":
    run(CHECKS)
