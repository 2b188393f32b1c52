"""Horovod features hvd_topk must keep working (issue 13), each checked against an independent
truth: numpy references fed with every rank's data, an uninterrupted run, or another rank.

Run: PYTHONPATH=.:tests/support mpirun -np 2 (or 3) python tests/dist/check_compat.py
(``--list`` prints the names of its checks).
"""

import copy
import re
import warnings
import weakref

import numpy as np
import torch
import torch.nn.functional as F

import horovod.torch as hvd
import hvd_topk
from check_optimizer import Net, batch, build, train
from hvd_topk.optimizer import ENGINE
from nets import distinct_16bit, sixteen_bit_checks
import harness
from harness import assert_same_on_all_ranks, gather, raises, raw_gradients, run, step_and_check_same
from reference import ErrorFeedbackReference, dgc_density, expect_16bit_step, k_of, part_pieces, sparse_allreduce

MIN_NUMEL = 500  # Net's fc1.weight, fc2.weight and head2.weight are sparse, its biases dense


# ---- item 12: options --------------------------------------------------------------------------
def check_options_refused():
    """Every TopK option is checked by type and range on every rank, before any collective."""
    for kwargs, error, text in [
        ({"density": True}, TypeError, "density must be a number, got True"),
        ({"density": "0.01"}, TypeError, "density must be a number, got '0.01'"),
        ({"density": 1.5}, ValueError, "density must be in (0, 1], got 1.5"),
        ({"method": "fast"}, ValueError, "method must be one of"),
        ({"method": None}, TypeError, "method must be a string"),
        ({"fp16_values": "no"}, TypeError, "fp16_values must be True or False, got 'no'"),
    ]:
        with raises(error, match=re.escape(text), what=f"TopK({kwargs})"):
            hvd_topk.TopK(**kwargs)
    model = Net()
    with raises(ValueError, match="op=hvd.Adasum is not supported", what="EF optimizer, Adasum"):
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    # LocalAdamW's exchanged updates summed would step P times as far; DeMo normalises the sum
    with raises(ValueError, match=r"op=hvd.Sum with LocalAdamW: the exchange would sum the ranks' updates",
                what="LocalAdamW with op=hvd.Sum"):
        hvd_topk.DistributedOptimizer(hvd_topk.LocalAdamW(model.parameters(), lr=0.01), op=hvd.Sum)
    hvd_topk.DistributedOptimizer(hvd_topk.DeMo(model.parameters(), lr=0.01), op=hvd.Sum)
    # named by name, not by Horovod's enum number; the model itself given for its named parameters
    with raises(ValueError, match=re.escape("op must be hvd.Average or hvd.Sum, got hvd.Min"), what="op=hvd.Min"):
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Min)
    with raises(TypeError, match=re.escape("named_parameters must be model.named_parameters()"),
                what="named_parameters=model"):
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model)
    # TopK in named_parameters' place (the second argument) used to be named by its metaclass
    for compression in (hvd_topk.TopK, hvd_topk.TopK(density=0.1), hvd.Compression.fp16):
        with raises(TypeError, match=r"named_parameters got a compression \((TopK|FP16Compressor)\): pass it as "
                                     r"compression=\.\.\. \(the third argument", what=f"{compression} second"):
            hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression)
    # a misspelt option is named with the one it resembles (TopK's own with where it goes)
    with raises(TypeError, match=r"warmup_step; did you mean warmup_steps \(not warmup_step\)$", what="warmup_step"):
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), warmup_step=10)
    with raises(TypeError, match=r"densty; did you mean density \(not densty\); density is an option of the "
                                 r"compression: pass compression=hvd_topk\.TopK\(density=", what="densty"):
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), densty=0.1)


# ---- item 11: checkpoint names -----------------------------------------------------------------
def named(model, compiled):
    """``model``'s parameter names, as a ``torch.compile``d wrapper of it would give them."""
    return (torch.compile(model) if compiled else model).named_parameters()


def build_named(compiled, seed=0):
    torch.manual_seed(seed)
    model = Net()
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=named(model, compiled),
                                        compression=hvd_topk.TopK(density=0.05), min_numel=MIN_NUMEL,
                                        exchange="allgather")  # auto's trial restarts on resume
    return model, opt


def check_names_across_compile(save_compiled):
    """Save at step 2 with one naming, resume with the other: bitwise equal to an uninterrupted
    run at step 4 (dropped residuals would change the result), and no warning."""
    model_a, opt_a = build_named(compiled=False)
    train(model_a, opt_a, 4)
    model_b, opt_b = build_named(compiled=save_compiled)
    train(model_b, opt_b, 2)
    saved = copy.deepcopy({"model": model_b.state_dict(), "opt": opt_b.state_dict()})
    assert any(n.startswith("_orig_mod.") for n in saved["opt"]["hvd_topk"]["residuals"]) == save_compiled
    model_c, opt_c = build_named(compiled=not save_compiled, seed=9)
    model_c.load_state_dict(saved["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt_c.load_state_dict(saved["opt"])
    assert not [w for w in caught if "hvd_topk" in str(w.message)], [str(w.message) for w in caught]
    train(model_c, opt_c, 2, start=2)
    for (name, a), c in zip(model_a.named_parameters(), model_c.parameters()):
        assert torch.equal(a, c), f"resume across compile: {name} differs (max {float((a - c).abs().max())})"


def check_unmatched_residual_warns():
    """A saved residual that matches no parameter is dropped with one warning naming it."""
    model, opt = build_named(compiled=False)
    train(model, opt, 1)
    saved = copy.deepcopy(opt.state_dict())
    ghosts = [f"ghost{i}.weight" for i in range(7)]
    for g in ghosts:
        saved["hvd_topk"]["residuals"][g] = torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saved)
    ours = [str(w.message) for w in caught if "match no parameter" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "7 saved error-feedback residual(s)" in ours[0] and "ghost0.weight" in ours[0], ours[0]
    assert "and 2 more" in ours[0], ours[0]  # a few names, not all


# ---- item 7: rank-0 checkpoint + broadcast_optimizer_state --------------------------------------
def check_rank0_checkpoint_broadcast():
    """All ranks train 3 warm-up steps; rank 0 saves. Fresh objects everywhere, rank 0 loads,
    then Horovod's broadcasts: every rank continues at step 3 of the warm-up (rank 0 with its
    residuals, the others from zero), as the numpy reference does, bitwise equal across ranks."""
    rank, size, warmup, density = hvd.rank(), hvd.size(), 6, 0.05
    model, opt = build(density=density, min_numel=MIN_NUMEL, warmup_steps=warmup)
    train(model, opt, 3)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()}) if rank == 0 else None
    model, opt = build(density=density, min_numel=MIN_NUMEL, warmup_steps=warmup, seed=5)
    if rank == 0:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    steps = [int(s) for s in gather(opt.compression_stats()["step"])]  # every rank fails alike
    assert steps == [3] * size, f"steps after broadcast_optimizer_state, by rank: {steps}"
    ref = ErrorFeedbackReference(size)  # rank 0 starts from the residuals it saved, the others from 0
    ref.residual[0] = harness.COMM.bcast(
        {n: r.numpy().reshape(-1).copy() for n, r in saved["opt"]["hvd_topk"]["residuals"].items()}
        if rank == 0 else None, root=0)
    shadow = copy.deepcopy(model)
    for step in range(3, 6):
        x, y = batch(step, rank)
        raw = raw_gradients(shadow, model, x, y)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        d = dgc_density(step, density, warmup)
        for name, p in model.named_parameters():
            grads = gather(raw[name])
            if p.numel() >= MIN_NUMEL:
                want = ref.sparse(name, grads, d)
            else:
                want = np.sum(grads, axis=0) / size
            np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-6, atol=1e-7,
                                       err_msg=f"after broadcast: step {step} {name}")
        step_and_check_same(opt, model, f"after broadcast: step {step}")


# ---- item 10: a parameter unfrozen after construction -------------------------------------------
def check_unfrozen_parameter_refused():
    torch.manual_seed(0)
    model = Net()
    model.fc1.weight.requires_grad_(False)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), min_numel=MIN_NUMEL)
    model.fc1.weight.requires_grad_(True)
    x, y = batch(0, hvd.rank())
    with raises(RuntimeError, match=r"parameter 'fc1.weight' had requires_grad=False when "
                r"hvd_topk.DistributedOptimizer was built.*build a new one after unfreezing",
                what="unfrozen after construction"):
        F.cross_entropy(model(x), y).backward()
        opt.step()


def check_frozen_parameter_refused():
    """The other way round: fc1.weight trainable at construction and frozen after two steps (as
    in fine-tuning). Its residual would still be exchanged into p.grad and the optimizer would
    move it (a plain torch optimizer leaves a parameter without a gradient alone): the next step
    refuses, on every rank, naming it."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), min_numel=MIN_NUMEL,
                                        compression=hvd_topk.TopK(density=0.05), exchange="allgather")
    train(model, opt, 2)
    model.fc1.weight.requires_grad_(False)
    with raises(RuntimeError, match=r"parameter 'fc1.weight' was trainable when hvd_topk.DistributedOptimizer was "
                r"built and has requires_grad=False now.*Build a new DistributedOptimizer after freezing",
                what="frozen after construction"):
        train(model, opt, 1, start=2)


def check_rebuilt_after_unfreezing():
    """What the refusal above advises: a new DistributedOptimizer built after unfreezing takes
    the parameters over. The old one, still referenced, no longer hooks them and refuses to
    step (it once kept exchanging through its hooks and raised "Gradients were computed more
    than backward_passes_per_step times"); once dropped, a plain torch optimizer works on the
    model with each rank's own gradient. Truth: the gradient of the same loss without hvd_topk."""
    torch.manual_seed(0)
    model = Net()
    model.fc1.weight.requires_grad_(False)
    trainable = lambda: [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # noqa: E731
    old = hvd_topk.DistributedOptimizer(torch.optim.SGD([p for _, p in trainable()], lr=0.1),
                                        named_parameters=trainable(), min_numel=MIN_NUMEL, exchange="allgather")
    train(model, old, 2)
    model.fc1.weight.requires_grad_(True)
    new = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), min_numel=MIN_NUMEL,
                                        exchange="allgather")
    train(model, new, 2, start=2)
    for name, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"after the rebuild: {name}")
    assert new.compression_stats()["steps"] == 2 and old.compression_stats()["steps"] == 2
    x, y = batch(4, hvd.rank())
    old.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with raises(RuntimeError, match="replaced by a newer one", what="stepping the replaced optimizer"):
        old.step()
    del old, new
    import gc
    gc.collect()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    twin = copy.deepcopy(model)
    plain.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(twin(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), f"{name}: the dropped optimizer still touched the gradient"
    plain.step()


def check_dropped_optimizer_stops_at_once(inner):
    """A DistributedOptimizer over LocalAdamW or DeMo stops exchanging as soon as it is dropped,
    without waiting for the garbage collector (switched off here): the next backward leaves each
    rank's own gradient in ``p.grad``. Its engine held the optimizer's transform strongly, a
    cycle that kept the hooks alive, turning the next optimizer's gradients into Adam updates
    (or starting collectives on whichever ranks had not collected it yet) until a collection
    ran. Truth: the gradient of the same loss on a copy without hvd_topk."""
    import gc

    make = {"LocalAdamW": lambda ps: hvd_topk.LocalAdamW(ps, lr=1e-2),
            "DeMo": lambda ps: hvd_topk.DeMo(ps, lr=1e-2)}[inner]
    torch.manual_seed(0)
    model = Net()
    gc.collect()
    gc.disable()
    try:
        opt = hvd_topk.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                            min_numel=MIN_NUMEL, exchange="allgather")
        train(model, opt, 2)
        engine = weakref.ref(getattr(opt, ENGINE))
        del opt
        assert engine() is None, f"{inner}: the dropped optimizer's engine is still alive"
        x, y = batch(4, hvd.rank())
        twin = copy.deepcopy(model)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        F.cross_entropy(twin(x), y).backward()
    finally:
        gc.enable()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), f"{inner}, {name}: the dropped optimizer still touched the gradient"


def check_stepped_again_without_backward(inner):
    """``step()`` twice without a backward in between, over LocalAdamW or DeMo: refused before
    anything is exchanged, the weights as the first step left them (``p.grad`` still held the
    applied update, which the transform took for a gradient: Adam ran on it and the step was
    applied again, silently). Then a backward and a step train on as before, ranks alike."""
    make = {"LocalAdamW": lambda ps: hvd_topk.LocalAdamW(ps, lr=1e-2),
            "DeMo": lambda ps: hvd_topk.DeMo(ps, lr=1e-2)}[inner]
    torch.manual_seed(0)
    model = Net()
    opt = hvd_topk.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                        min_numel=MIN_NUMEL, exchange="allgather")
    train(model, opt, 2)
    before = copy.deepcopy(model.state_dict())
    with raises(RuntimeError, match="without a new backward", what=f"{inner}: step() again"):
        opt.step()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{inner}: {name} moved in the refused step"
    train(model, opt, 1, start=2)
    assert opt.compression_stats()["steps"] == 3
    for name, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"{inner}, after the refusal: {name}")


def check_step_after_synchronize_without_skip():
    """Horovod's pattern without ``skip_synchronize()``: synchronize, clip, step. Horovod warns
    and averages again, which leaves a dense average as it was; hvd_topk warns and uses p.grad
    as synchronize() left it (a second exchange once sent the clipped average through the
    residual again and undid the clipping). Truth: the clipped gradient, read before step()."""
    model, opt = build(min_numel=MIN_NUMEL)
    for step in range(3):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        clipped = [p.grad.clone() for p in model.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        assert any("skip_synchronize" in str(w.message) for w in caught), [str(w.message) for w in caught]
        for (name, p), want in zip(model.named_parameters(), clipped):
            assert torch.equal(p.grad, want), f"step {step} {name}: step() changed the synchronized gradient"
    assert opt.compression_stats()["steps"] == 3, opt.compression_stats()
    for name, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"synchronize, clip, step: {name}")


def _changed_gradient_run(inner, pattern, exchange="allgather", steps=3):
    """Train ``Net`` ``steps`` steps over SGD or LocalAdamW; ``pattern``: "plain" (backward,
    step), "clip before step" (clip_grad_norm_ between backward() and step()) or "clip after
    synchronize" (Horovod's: synchronize, clip, step inside skip_synchronize). Returns the
    model and the messages of hvd_topk's changed-gradient warnings."""
    torch.manual_seed(0)
    model = Net()
    inner_opt = (hvd_topk.LocalAdamW(model.parameters(), lr=1e-2, betas=(0.0, 0.95)) if inner == "LocalAdamW"
                 else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt = hvd_topk.DistributedOptimizer(inner_opt, named_parameters=model.named_parameters(), min_numel=MIN_NUMEL,
                                        exchange=exchange)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            x, y = batch(step, hvd.rank())
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if pattern == "clip before step":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                opt.step()
            elif pattern == "clip after synchronize":
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
    return model, [str(w.message) for w in caught if "p.grad of" in str(w.message)]


def check_clipping_before_step_warns(inner, exchange):
    """``clip_grad_norm_`` between ``backward()`` and ``step()``, no ``synchronize()`` first (a
    dense loop's habit): the hooks took each rank's gradient in during backward, so the
    clipping never reaches the exchange. Truth: the same run without the clipping, whose
    weights these equal bit for bit (over a dense allreduce to rounding: Horovod's fusion at 3
    ranks sums in an order timing picks), where a clip to 1e-3 would move them far; and one warning on every rank (not one a step), naming a
    parameter and the fix for the inner optimizer."""
    clipped, said = _changed_gradient_run(inner, "clip before step", exchange)
    plain, quiet = _changed_gradient_run(inner, "plain", exchange)
    assert quiet == [], quiet
    assert len(said) == 1, said
    assert "'fc1.weight'" in said[0] and "written to or replaced" in said[0], said[0]
    fix = "do not clip it" if inner == "LocalAdamW" else "opt.skip_synchronize()"
    assert fix in said[0], said[0]
    for (name, p), q in zip(clipped.named_parameters(), plain.parameters()):
        if exchange == "dense":  # at 3 ranks Horovod's fused ring sums in an order timing picks: not bitwise
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-7,
                                       err_msg=f"{inner}, {exchange}: {name} differs from the run without clipping")
        else:
            assert torch.equal(p, q), f"{inner}, {exchange}: {name} differs from the run without clipping"
        assert_same_on_all_ranks(p.detach().numpy(), f"{inner}, {exchange}, clipped before step: {name}")


def check_clipping_an_update_warns():
    """Over ``LocalAdamW`` ``p.grad`` after ``synchronize()`` is the ranks' averaged update:
    clipping it there (Horovod's pattern for gradients) changes the step every rank agreed on,
    and one warning on every rank says so. Over SGD the same pattern clips the averaged
    gradient, as under Horovod, and is not warned of; a plain LocalAdamW loop is not either.
    Truth for the warned run: its weights differ from the unclipped run's (the clipping was
    applied, on every rank alike)."""
    clipped, said = _changed_gradient_run("LocalAdamW", "clip after synchronize")
    plain, quiet = _changed_gradient_run("LocalAdamW", "plain")
    assert quiet == [], quiet
    assert len(said) == 1 and "over LocalAdamW" in said[0] and "'fc1.weight'" in said[0], said
    assert not torch.equal(clipped.fc1.weight, plain.fc1.weight), "the clipping was not applied"
    for name, p in clipped.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"LocalAdamW, clipped after synchronize: {name}")
    _, sgd_said = _changed_gradient_run("SGD", "clip after synchronize")
    assert sgd_said == [], sgd_said


def check_horovod_unfrozen_parameter_diverges():
    """What Horovod does (dense, and the drop-in TopK): the unfrozen parameter is trained on
    local gradients only, so ranks differ. Backs the README's cells for Horovod."""
    for compression in (hvd.Compression.none, hvd_topk.TopK):
        torch.manual_seed(0)
        model = Net()
        model.fc1.weight.requires_grad_(False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=compression)
        model.fc1.weight.requires_grad_(True)
        train(model, opt, 1)
        weights = gather(model.fc1.weight.detach().numpy())
        assert not all(np.array_equal(w, weights[0]) for w in weights), f"{compression}: ranks agree"


# ---- item 5: sparse gradients -----------------------------------------------------------------
class EmbeddingNet(torch.nn.Module):
    """An embedding of 200 x 8 (1600 elements: the sparse path) and a small dense head; with
    ``second``, another embedding of 150 x 8 added in."""

    def __init__(self, sparse=True, second=False):
        super().__init__()
        self.emb = torch.nn.Embedding(200, 8, sparse=sparse)
        self.emb2 = torch.nn.Embedding(150, 8, sparse=sparse) if second else None
        self.head = torch.nn.Linear(8, 5)

    def forward(self, ids):
        h = self.emb(ids).mean(dim=1)
        if self.emb2 is not None:
            h = h + self.emb2(ids % 150).mean(dim=1)
        return self.head(h)


def embedding_batch(step, rank):
    gen = torch.Generator().manual_seed(500 + 10 * step + rank)
    return torch.randint(0, 200, (6, 4), generator=gen), torch.randint(0, 5, (6,), generator=gen)


def raw_dense_grads(model, ids, y):
    model.zero_grad()
    F.cross_entropy(model(ids), y).backward()
    return {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).numpy().copy()
            for n, p in model.named_parameters()}


def check_sparse_as_dense(density=0.05, second=False, as_dense=True):
    """sparse_as_dense=True: the embedding's gradient is exchanged as a dense Top-K tensor with
    error feedback (numpy reference) and handed back sparse to the inner optimizer (``second``:
    two sparse embeddings). ``as_dense=False``: the same result, and one warning (at the first
    sparse gradient) saying that it was done without the option."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = EmbeddingNet(second=second)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                        named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopK(density=density),
                                        sparse_as_dense=as_dense, min_numel=MIN_NUMEL, exchange="allgather")
    shadow, ref = copy.deepcopy(model), ErrorFeedbackReference(size)
    for step in range(3):
        ids, y = embedding_batch(step, rank)
        shadow.load_state_dict(model.state_dict())
        raw = raw_dense_grads(shadow, ids, y)
        opt.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            F.cross_entropy(model(ids), y).backward()
        said = [str(w.message) for w in caught if "sparse gradient" in str(w.message)]
        want_said = 1 if (step == 0 and not as_dense) else 0
        assert len(said) == want_said, (step, said)
        assert not said or "'emb.weight'" in said[0] and "sparse_as_dense=True" in said[0], said
        opt.synchronize()
        for emb in filter(None, (model.emb, model.emb2)):
            assert emb.weight.grad.is_sparse, "the inner optimizer should get a sparse gradient back"
            # row-wise, as nn.Embedding made it (and Horovod hands it back): whole rows
            assert (emb.weight.grad.sparse_dim(), emb.weight.grad.dense_dim()) == (1, 1)
        for name, p in model.named_parameters():
            grads = gather(raw[name])
            want = (ref.sparse(name, grads, density) if p.numel() >= MIN_NUMEL
                    else np.sum(grads, axis=0) / size)
            np.testing.assert_allclose(p.grad.to_dense().numpy(), want, rtol=1e-6, atol=1e-7,
                                       err_msg=f"sparse_as_dense={as_dense}: step {step} {name}")
        step_and_check_same(opt, model, f"sparse_as_dense={as_dense}: step {step}")


def check_horovod_sparse_gradients(density=0.05):
    """Horovod's own optimizer: dense (its sparse allgather, and sparse_as_dense) and the
    drop-in TopK with sparse_as_dense, against numpy. Backs the README's cells."""
    rank = hvd.rank()
    for label, compression, as_dense in [("dense", hvd.Compression.none, False),
                                         ("dense sparse_as_dense", hvd.Compression.none, True),
                                         ("TopK sparse_as_dense", hvd_topk.TopK(density=density), True),
                                         ("TopK sparse", hvd_topk.TopK(density=density), False)]:
        torch.manual_seed(0)
        model = EmbeddingNet()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(),
                                       compression=compression, sparse_as_dense=as_dense)
        ids, y = embedding_batch(0, rank)
        raw = raw_dense_grads(copy.deepcopy(model), ids, y)
        opt.zero_grad()
        F.cross_entropy(model(ids), y).backward()
        opt.synchronize()
        for name, p in model.named_parameters():
            grads = gather(raw[name])
            topk = compression is not hvd.Compression.none and (as_dense or not p.grad.is_sparse)
            want = sparse_allreduce(grads, density) if topk else np.mean(grads, axis=0)
            np.testing.assert_allclose(p.grad.to_dense().numpy(), want, rtol=1e-5, atol=1e-7,
                                       err_msg=f"horovod {label}: {name}")
        step_and_check_same(opt, model, f"horovod {label}")


# ---- item 8: bf16 and channels_last -------------------------------------------------------------
def hand_grads(model, dtype, memory_format=torch.contiguous_format):
    """Set this rank's gradients by hand (as a hook-less step would) and return them as
    float64 numpy arrays: for bfloat16 multiples of 1/8 below 8 (exact in bfloat16), otherwise
    normal (tie-free, for Top-K)."""
    gen = torch.Generator().manual_seed(77 + hvd.rank())
    out = {}
    for name, p in model.named_parameters():
        if dtype == torch.bfloat16:
            g = (torch.randint(-63, 64, p.shape, generator=gen).double() / 8).to(dtype)
        else:
            g = torch.randn(p.shape, generator=gen, dtype=dtype)
        p.grad = g.contiguous(memory_format=memory_format) if g.dim() == 4 else g
        out[name] = g.double().numpy()
    return out


def check_bf16_dense_path():
    """bfloat16 parameters on the dense path: allreduced as float32, averaged, cast back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    assert opt.compression_stats()["buckets_sparse"] == 0  # everything is small: dense
    for step in range(2):
        grads = hand_grads(model, torch.bfloat16)
        opt.synchronize()
        for name, p in model.named_parameters():
            assert p.grad.dtype == torch.bfloat16
            want = np.mean(gather(grads[name]), axis=0)
            np.testing.assert_allclose(p.grad.double().numpy(), want, rtol=2 ** -8, atol=0,
                                       err_msg=f"bf16 step {step} {name}")
        with opt.skip_synchronize():
            opt.step()
        for name, p in model.named_parameters():  # numpy has no bfloat16: compare as float32
            assert_same_on_all_ranks(p.detach().float().numpy(), f"bf16 step {step}: parameter {name}")


def check_bf16_topk_path(exchange):
    """A bfloat16 weight on the Top-K path, one step from zero residuals: each rank's gradient
    has tie-free magnitudes 1/8 .. 256/8 (exact in bfloat16), so the result is the numpy top-k
    average up to two roundings to bfloat16 (the sum, then the division): within one ulp, 2**-7."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16)).to(torch.bfloat16)  # 256 weights, 16 biases
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), min_numel=100,
                                        compression=hvd_topk.TopK(density=0.05), exchange=exchange)
    gen = torch.Generator().manual_seed(5 + hvd.rank())
    weight, bias = model[0].weight, model[0].bias
    signs = torch.randint(0, 2, (256,), generator=gen) * 2 - 1
    weight.grad = ((torch.randperm(256, generator=gen) + 1) * signs / 8).reshape(16, 16).to(torch.bfloat16)
    bias.grad = (torch.randint(-63, 64, (16,), generator=gen) / 8).to(torch.bfloat16)
    raw = {"weight": weight.grad.double().numpy(), "bias": bias.grad.double().numpy()}
    opt.synchronize()
    assert weight.grad.dtype == torch.bfloat16
    if exchange == "sparse_allreduce":  # part j's positions from rank j (step 0, bucket 0), every rank's values
        every = [g.reshape(-1) for g in gather(raw["weight"])]
        keep = np.concatenate([a + np.argsort(-np.abs(every[j][a:b]), kind="stable")[:k_of(b - a, 0.05)]
                               for j, a, b in part_pieces([0, 256], hvd.size())])
        total = np.sum(every, axis=0)
        want = np.zeros(256)
        want[keep] = total[keep] / hvd.size()
        want = want.reshape(16, 16)
        # bytes: this rank's part's indices (4 bytes each), then every value and the flag slot as
        # float32 (Horovod allreduces bfloat16 as float32), then the biases' dense allreduce
        mine = [k_of(b - a, 0.05) for j, a, b in part_pieces([0, 256], hvd.size()) if j == hvd.rank()]
        sent = 4 * sum(mine) + 4 * (len(keep) + 1) + 16 * 4
        assert opt.compression_stats()["bytes_sent"] == sent, (opt.compression_stats()["bytes_sent"], sent)
    else:
        want = sparse_allreduce(gather(raw["weight"]), 0.05)
    np.testing.assert_allclose(weight.grad.double().numpy(), want, rtol=2 ** -7, atol=0)
    np.testing.assert_allclose(bias.grad.double().numpy(), np.mean(gather(raw["bias"]), axis=0),
                               rtol=2 ** -7, atol=0)
    with opt.skip_synchronize():
        opt.step()
    assert_same_on_all_ranks(weight.detach().float().numpy(), "bf16 Top-K: weight")


def check_16bit_residuals(dtype, exchange):
    """16-bit parameters keep float32 residuals: step by step against the numpy reference of
    error feedback (float32 residual; each sent value rounded to the parameters' dtype, what
    that rounding took kept in the residual), a dense start (step 0 at density 1) and then
    Top-K. The gradients span 2**-6 .. 2**2 (``nets.distinct_16bit``), so a 16-bit residual would round the small ones
    off as they are added to larger ones (a review measured 0.5% of the gradients' sum lost over
    60 steps with bfloat16 residuals). ``p.grad`` is compared within the decode's 16-bit
    roundings, the residual (the checkpoint's) to float32's. What Horovod sums (the dense
    allreduce, the sparse allreduce's values) travels as it sums it: bfloat16 as float32,
    unrounded; float16 as float16."""
    size, density = hvd.size(), 0.05
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32, bias=False).to(dtype)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                        named_parameters=model.named_parameters(), min_numel=100,
                                        compression=hvd_topk.TopK(density=density), exchange=exchange,
                                        warmup_steps=1, warmup_density=1.0)
    bf16 = dtype == torch.bfloat16
    pairs = "bfloat16" if bf16 else np.float16  # the allgather's values
    ref = ErrorFeedbackReference(size)
    gen = torch.Generator().manual_seed(31 + hvd.rank())
    for step in range(8):
        model.weight.grad = distinct_16bit(gen).to(dtype)
        every = np.stack(gather(model.weight.grad.float().numpy()))
        opt.synchronize()
        ref.value_dtype = pairs if exchange == "allgather" and step or not bf16 else None
        where = f"{dtype} {exchange} step {step}"
        assert model.weight.grad.dtype == dtype, where
        residual = opt.state_dict()["hvd_topk"]["residuals"]["weight"]
        assert residual.dtype == torch.float32, f"{where}: the residual is {residual.dtype}"
        expect_16bit_step(ref, hvd.rank(), exchange, step, density, every, model.weight.grad.float().numpy(),
                          residual.float().numpy(), bf16, where)
        with opt.skip_synchronize():
            opt.step()
    stats = opt.compression_stats()
    assert stats["tensors_dense"] >= 1 and stats["tensors_sparse"] >= 7, (where, stats)


def check_channels_last(exchange="allgather"):
    """channels_last conv weights, small (dense path) and big (Top-K with error feedback); with
    the sparse allreduce the one sparse bucket is number 0."""
    size, density = hvd.size(), 0.05
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 32, 3))
    model = model.to(memory_format=torch.channels_last)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopK(density=density), min_numel=MIN_NUMEL,
                                        exchange=exchange)
    ref = ErrorFeedbackReference(size)
    for step in range(3):
        grads = hand_grads(model, torch.float32, torch.channels_last)
        opt.synchronize()
        every = {name: np.stack([g.astype(np.float32) for g in gather(grads[name])]) for name in grads}
        big = [name for name, p in model.named_parameters() if p.numel() >= MIN_NUMEL]
        if exchange == "sparse_allreduce":  # one sparse bucket, number 0, in reverse order
            shared = ref.sparse_allreduce_bucket(big[::-1], every, density, step, 0)
        else:
            shared = {name: ref.sparse(name, every[name], density) for name in big}
        for name, p in model.named_parameters():
            per_rank = every[name]
            want = shared[name] if name in big else np.sum(per_rank, axis=0) / size
            np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-6, atol=1e-7,
                                       err_msg=f"channels_last {exchange} step {step} {name}")
        step_and_check_same(opt, model, f"channels_last step {step}")


def check_horovod_bf16_channels_last():
    """Horovod's dense optimizer raises its raw errors; the drop-in TopK works (numpy)."""
    for label, dtype, fmt, error in [("bf16", torch.bfloat16, torch.contiguous_format,
                                      "Tensor type torch.BFloat16Tensor is not supported."),
                                     ("channels_last", torch.float32, torch.channels_last,
                                      "Tensor is required to be contiguous.")]:
        for compression in (hvd.Compression.none, hvd_topk.TopK(density=1.0)):
            torch.manual_seed(0)
            # no bias: Horovod would start the bias's allreduce before failing on the weight
            model = torch.nn.Conv2d(3, 4, 3, bias=False).to(dtype=dtype, memory_format=fmt)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression=compression)
            grads = hand_grads(model, dtype, fmt)
            if compression is hvd.Compression.none:
                with raises(ValueError, match=re.escape(error), what=f"horovod dense {label}"):
                    opt.synchronize()
                continue
            opt.synchronize()
            for name, p in model.named_parameters():
                want = np.mean(gather(grads[name]), axis=0)
                np.testing.assert_allclose(p.grad.double().numpy(), want, rtol=2 ** -8, atol=1e-6,
                                           err_msg=f"drop-in TopK {label} {name}")


def check_broadcast_before_converting():
    """compatibility.md's way round Horovod's broadcasts, which refuse bf16 and channels_last
    tensors (their raw errors: ``check_horovod_bf16_channels_last``; a refused broadcast leaves
    its other tensors' broadcasts in flight): ``broadcast_parameters`` of the float32 model, then
    convert. Each rank starts from its own random weights; after the broadcast and three steps
    of the optimizer over the allgather every rank holds the same bits. channels_last keeps
    ``broadcast_optimizer_state``; for bf16 Horovod refuses it (not called here: a refused
    broadcast leaves the others it started in flight under the same names)."""
    for label in ("bf16", "channels_last"):
        torch.manual_seed(hvd.rank())  # different weights on every rank until the broadcast
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(288, 4))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        model = model.bfloat16() if label == "bf16" else model.to(memory_format=torch.channels_last)
        opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                            named_parameters=model.named_parameters(),
                                            compression=hvd_topk.TopK(density=0.1), exchange="allgather")
        if label == "channels_last":
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(100 * hvd.rank() + step))
            model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
            opt.step()
        assert_same_on_all_ranks(torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).numpy(),
                                 f"{label}: parameters after broadcasting before converting")


# ---- item 9: compiled autograd ------------------------------------------------------------------
def check_compiled_model_trains_as_eager():
    """``torch.compile(model)`` with compiled autograd off (the compat table's advice): AOTAutograd's
    compiled backward still accumulates into ``p.grad`` through the hooks the optimizer
    registered, so the exchange runs as in eager. Six steps (a dense start, then sparse)
    end bit for bit where the eager run (checked against numpy in check_optimizer) ends;
    backend ``aot_eager``, as inductor's fused kernels round the forward differently."""
    eager, opt = build(min_numel=500, warmup_steps=2)
    train(eager, opt, 6)
    model, opt = build(min_numel=500, warmup_steps=2)
    train(torch.compile(model, backend="aot_eager"), opt, 6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), f"{name}: compiled {p.view(-1)[:3].tolist()} eager {q.view(-1)[:3].tolist()}"
    assert opt.compression_stats()["steps"] == 6
    assert_same_on_all_ranks(model.fc1.weight.detach().numpy(), "compiled model")


def check_compiled_autograd_refused():
    """With compiled autograd on, the first gradient hook refuses (eager backward and a
    torch.compile'd training step), on every rank, before anything is exchanged."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), min_numel=MIN_NUMEL)
    x, y = batch(0, hvd.rank())
    compiled = torch.compile(lambda: F.cross_entropy(model(x), y).backward(), backend="eager")
    torch._dynamo.config.compiled_autograd = True
    try:
        for label, backward in (("eager backward", lambda: F.cross_entropy(model(x), y).backward()),
                                ("compiled step", compiled)):
            with raises(RuntimeError, match=r"does not support compiled autograd.*Set "
                        r"torch._dynamo.config.compiled_autograd = False", what=label):
                backward()
            assert not opt._hvd_topk.pending(), label
            opt.zero_grad()
    finally:
        torch._dynamo.config.compiled_autograd = False
    train(model, opt, 1)  # switched off again: training goes on
    assert_same_on_all_ranks(model.fc1.weight.detach().numpy(), "after compiled autograd off")


def check_drop_in_compiled_autograd_refused():
    """Horovod's optimizer with the drop-in TopK: the first gradient hook's ``compress`` refuses,
    on every rank, before anything is enqueued (eager backward and a torch.compile'd step, each
    on a fresh optimizer: Horovod's hook has counted the pass before calling the compressor), so
    Horovod stays up and a new optimizer trains once compiled autograd is off."""
    def fresh():
        torch.manual_seed(0)
        model = Net()
        return model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               named_parameters=model.named_parameters(),
                                               compression=hvd_topk.TopK)
    x, y = batch(0, hvd.rank())
    torch._dynamo.config.compiled_autograd = True
    try:
        model, _ = fresh()
        eager = lambda: F.cross_entropy(model(x), y).backward()  # noqa: E731
        with raises(RuntimeError, match=r"hvd_topk.TopK does not support compiled autograd.*Set "
                    r"torch._dynamo.config.compiled_autograd = False", what="eager backward"):
            eager()
        model, _ = fresh()
        compiled = torch.compile(lambda: F.cross_entropy(model(x), y).backward(), backend="eager")
        with raises(RuntimeError, match=r"hvd_topk.TopK does not support compiled autograd",
                    what="compiled step"):
            compiled()
    finally:
        torch._dynamo.config.compiled_autograd = False
    model, opt = fresh()
    train(model, opt, 1)
    assert_same_on_all_ranks(model.fc1.weight.detach().numpy(), "after compiled autograd off")


# Run in this order on every rank; add a check with one line.
# ---- item 6: gradients readable between backward and synchronize ---------------------------
def check_grads_readable_before_synchronize():
    """Between ``backward()`` and ``synchronize()`` each ``p.grad`` holds this rank's own
    gradient (gradient-norm logging, GAN loops read it there), as with Horovod; afterwards
    the exchanged result, which for the sparse tensors is not the raw gradient."""
    model, opt = build(min_numel=MIN_NUMEL)
    shadow = copy.deepcopy(model)
    x, y = batch(0, hvd.rank())
    F.cross_entropy(shadow(x), y).backward()
    raw = {n: p.grad.numpy().copy() for n, p in shadow.named_parameters()}
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.grad.numpy(), raw[name], err_msg=f"{name} before synchronize")
    opt.synchronize()
    changed = [n for n, p in model.named_parameters()
               if p.numel() >= MIN_NUMEL and not np.array_equal(p.grad.numpy(), raw[n])]
    assert changed, "synchronize() left every sparse gradient as it was"
    with opt.skip_synchronize():
        opt.step()


def check_parameter_names_attribute():
    """Horovod's ``_parameter_names`` (its own tests and tools read it): ``{param: name}`` with the
    names given, or unique generated ones that every rank spells alike."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    named = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters())
    assert named._parameter_names == {p: n for n, p in model.named_parameters()}
    unnamed = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    names = [unnamed._parameter_names[p] for p in model.parameters()]
    assert len(set(names)) == len(names) == 4, names
    every = harness.COMM.allgather(names)
    assert all(other == names for other in every), every


def check_set_backward_passes_per_step():
    """Horovod's ``set_backward_passes_per_step()`` and its arguments as attributes (code written
    for hvd.DistributedOptimizer calls and reads them; before 2026-12-05 an AttributeError).
    Against Horovod's own optimizer on a copy of the model (density 1 and the dense path: the
    same average): one step of one pass, then the count set to 2 and a step of two half-batches;
    the weights agree. ``zero_grad()`` between the two passes is refused as Horovod refuses it
    (before, the next step failed with a misleading "more than backward_passes_per_step")."""
    rank = hvd.rank()
    torch.manual_seed(0)
    ours_model = Net()
    theirs_model = copy.deepcopy(ours_model)
    ours = hvd_topk.DistributedOptimizer(torch.optim.SGD(ours_model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=ours_model.named_parameters(),
                                         compression=hvd_topk.TopK(density=1.0), min_numel=10 ** 9)
    theirs = hvd.DistributedOptimizer(torch.optim.SGD(theirs_model.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=theirs_model.named_parameters())
    assert (ours.backward_passes_per_step, ours.op, ours.gradient_predivide_factor, ours.sparse_as_dense) == \
        (theirs.backward_passes_per_step, theirs.op, theirs.gradient_predivide_factor, theirs.sparse_as_dense) == \
        (1, hvd.Average, 1.0, False)
    assert ours.process_set is theirs.process_set
    for step, passes in enumerate((1, 2)):
        for model, opt in ((ours_model, ours), (theirs_model, theirs)):
            opt.set_backward_passes_per_step(passes)
            opt.zero_grad()
            for part in range(passes):
                x, y = batch(step, rank, part=part)
                (F.cross_entropy(model(x), y) / passes).backward()
            opt.step()
        assert ours.backward_passes_per_step == theirs.backward_passes_per_step == passes
        for (name, a), b in zip(ours_model.named_parameters(), theirs_model.parameters()):
            np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=f"step {step} ({passes} passes): {name}")
    x, y = batch(2, rank)
    F.cross_entropy(ours_model(x), y).backward()  # one pass of two
    with raises(AssertionError, match="zero_grad\\(\\) was called after loss.backward\\(\\) but before",
                what="zero_grad between accumulation passes"):
        ours.zero_grad()
    with raises(RuntimeError, match="between backward\\(\\) and step\\(\\): call it between steps",
                what="set_backward_passes_per_step between passes"):
        ours.set_backward_passes_per_step(1)
    # an attribute of the same name that the user's optimizer sets on itself stays its own
    class SignSGD(torch.optim.SGD):
        def __init__(self, params, lr):
            super().__init__(params, lr=lr)
            self.op = "sign"
    own = hvd_topk.DistributedOptimizer(SignSGD(Net().parameters(), lr=0.1))
    assert own.op == "sign" and own.backward_passes_per_step == 1, own.op
    own.process_set = "its own"  # assignable, as on Horovod's optimizer
    assert own.process_set == "its own"
    with raises(ValueError, match="backward_passes_per_step", what="0 passes"):
        fresh = hvd_topk.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1))
        fresh.set_backward_passes_per_step(0)


def check_embedding_untouched_on_one_rank(inner, resumed=False):
    """An embedding the last rank does not touch in a step (its gradient None there, its hook
    silent): the exchanged gradient is still handed back sparse on every rank, with the ranks'
    average in it (density 1: exactly their mean). Before, that rank alone got it dense, and
    SparseAdam (or SGD's sparse momentum) raised there and killed the job. With SparseAdam the
    last rank skips the embedding from the very first step, before it has seen a sparse gradient.
    ``resumed``: a new optimizer loads step 0's checkpoint before that step; SGD's momentum
    buffer in it is sparse, and the new optimizer had not yet seen a sparse gradient (it handed
    the last rank a dense one, which the buffer refused: "add(sparse, dense) is not supported")."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = EmbeddingNet()

    def build_opt():
        if inner == "sparseadam":
            opt_inner, named = torch.optim.SparseAdam([model.emb.weight], lr=0.1), [("emb.weight", model.emb.weight)]
            head = torch.optim.SGD(model.head.parameters(), lr=0.1)
        else:
            opt_inner, named, head = (torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                      model.named_parameters(), None)
        return hvd_topk.DistributedOptimizer(opt_inner, named_parameters=named, compression=hvd_topk.TopK(density=1.0),
                                             sparse_as_dense=True, min_numel=MIN_NUMEL, exchange="allgather"), head

    opt, head = build_opt()
    skip = 0 if inner == "sparseadam" else 1  # the step the last rank leaves the embedding out
    for step in range(3):
        if resumed and step == skip:
            saved = copy.deepcopy(opt.state_dict())
            opt, head = build_opt()
            opt.load_state_dict(saved)
        ids, y = embedding_batch(step, rank)
        use = not (rank == size - 1 and step == skip)
        shadow = copy.deepcopy(model)
        h = shadow.emb(ids).mean(dim=1) if use else torch.zeros(ids.shape[0], 8)
        F.cross_entropy(shadow.head(h), y).backward()
        mine = shadow.emb.weight.grad.to_dense() if shadow.emb.weight.grad is not None else torch.zeros(200, 8)
        opt.zero_grad()
        if head is not None:
            head.zero_grad()
        h = model.emb(ids).mean(dim=1) if use else torch.zeros(ids.shape[0], 8)
        F.cross_entropy(model.head(h), y).backward()
        opt.synchronize()
        assert model.emb.weight.grad.is_sparse, f"rank {rank} step {step}: handed back dense"
        assert model.emb.weight.grad.sparse_dim() == 1, f"rank {rank} step {step}: not row-wise"
        np.testing.assert_allclose(model.emb.weight.grad.to_dense().numpy(), np.mean(gather(mine.numpy()), axis=0),
                                   rtol=1e-6, atol=1e-7, err_msg=f"{inner}: step {step}")
        with opt.skip_synchronize():
            opt.step()
        if head is not None:
            head.step()
        assert_same_on_all_ranks(model.emb.weight.detach().numpy(), f"{inner}: step {step} embedding")


def check_sparse_zero_gradient_left_by_zero_grad():
    """``zero_grad(set_to_none=False)`` leaves an embedding's gradient a sparse zero; on a step
    this rank does not use the embedding its hook does not fire, and the exchange takes that
    gradient as it is: densified now (it failed with "reshape is not implemented for sparse
    tensors"). The ranks' mean against numpy, every rank alike."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = EmbeddingNet()
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                        named_parameters=model.named_parameters(), compression=hvd_topk.TopK(density=1.0),
                                        sparse_as_dense=True, min_numel=MIN_NUMEL, exchange="allgather")
    for step in range(3):
        ids, y = embedding_batch(step, rank)
        use = step != 1
        shadow = copy.deepcopy(model)
        h = shadow.emb(ids).mean(dim=1) if use else torch.zeros(ids.shape[0], 8)
        F.cross_entropy(shadow.head(h), y).backward()
        mine = shadow.emb.weight.grad.to_dense() if shadow.emb.weight.grad is not None else torch.zeros(200, 8)
        opt.zero_grad(set_to_none=False)
        h = model.emb(ids).mean(dim=1) if use else torch.zeros(ids.shape[0], 8)
        F.cross_entropy(model.head(h), y).backward()
        opt.synchronize()
        np.testing.assert_allclose(model.emb.weight.grad.to_dense().numpy(), np.mean(gather(mine.numpy()), axis=0),
                                   rtol=1e-6, atol=1e-7, err_msg=f"step {step}")
        with opt.skip_synchronize():
            opt.step()
        assert_same_on_all_ranks(model.emb.weight.detach().numpy(), f"step {step} embedding")


CHECKS = [
    ("set_backward_passes_per_step and Horovod's attributes", check_set_backward_passes_per_step),
    ("Horovod's _parameter_names", check_parameter_names_attribute),
    ("options refused", check_options_refused),
    ("checkpoint names: compiled to plain", lambda: check_names_across_compile(save_compiled=True)),
    ("checkpoint names: plain to compiled", lambda: check_names_across_compile(save_compiled=False)),
    ("checkpoint names: unmatched residual warns", check_unmatched_residual_warns),
    ("torch.compile of the model: the eager result", check_compiled_model_trains_as_eager),
    ("rank-0 checkpoint + broadcast_optimizer_state", check_rank0_checkpoint_broadcast),
    ("unfrozen parameter refused", check_unfrozen_parameter_refused),
    ("parameter frozen after construction refused", check_frozen_parameter_refused),
    ("horovod: unfrozen parameter diverges", check_horovod_unfrozen_parameter_diverges),
    ("a new optimizer after unfreezing takes over", check_rebuilt_after_unfreezing),
    ("a dropped optimizer over LocalAdamW stops at once", lambda: check_dropped_optimizer_stops_at_once("LocalAdamW")),
    ("a dropped optimizer over DeMo stops at once", lambda: check_dropped_optimizer_stops_at_once("DeMo")),
    ("step() again without a backward, LocalAdamW: refused", lambda: check_stepped_again_without_backward("LocalAdamW")),
    ("step() again without a backward, DeMo: refused", lambda: check_stepped_again_without_backward("DeMo")),
    ("step() after synchronize() without skip_synchronize", check_step_after_synchronize_without_skip),
    ("clip_grad_norm_ before step(), SGD, allgather: no effect, warned once",
     lambda: check_clipping_before_step_warns("SGD", "allgather")),
    ("clip_grad_norm_ before step(), SGD, sparse allreduce: no effect, warned once",
     lambda: check_clipping_before_step_warns("SGD", "sparse_allreduce")),
    ("clip_grad_norm_ before step(), SGD, dense: no effect, warned once",
     lambda: check_clipping_before_step_warns("SGD", "dense")),
    ("clip_grad_norm_ before step(), LocalAdamW, allgather: no effect, warned once",
     lambda: check_clipping_before_step_warns("LocalAdamW", "allgather")),
    ("clip_grad_norm_ of LocalAdamW's update after synchronize(): warned once", check_clipping_an_update_warns),
    ("sparse_as_dense", check_sparse_as_dense),
    ("sparse_as_dense, two sparse embeddings", lambda: check_sparse_as_dense(second=True)),
    ("sparse gradient without sparse_as_dense: densified, one warning",
     lambda: check_sparse_as_dense(as_dense=False)),
    ("horovod: sparse gradients", check_horovod_sparse_gradients),
    ("an embedding one rank does not touch: handed back sparse (SGD, momentum)",
     lambda: check_embedding_untouched_on_one_rank("sgd")),
    ("an embedding one rank does not touch: handed back sparse (SparseAdam, from the first step)",
     lambda: check_embedding_untouched_on_one_rank("sparseadam")),
    ("an embedding one rank does not touch after a resume: handed back sparse (SGD's sparse momentum loaded)",
     lambda: check_embedding_untouched_on_one_rank("sgd", resumed=True)),
    ("a sparse zero gradient left by zero_grad(set_to_none=False), the embedding unused",
     check_sparse_zero_gradient_left_by_zero_grad),
    ("bf16 dense path", check_bf16_dense_path),
    ("bf16 top-k path", lambda: check_bf16_topk_path("allgather")),
    ("bf16 top-k path, sparse allreduce", lambda: check_bf16_topk_path("sparse_allreduce")),
    *sixteen_bit_checks("16-bit residuals are float32", check_16bit_residuals),
    ("channels_last", check_channels_last),
    ("channels_last, sparse allreduce", lambda: check_channels_last("sparse_allreduce")),
    ("horovod: bf16 and channels_last", check_horovod_bf16_channels_last),
    ("broadcast before converting to bf16 or channels_last", check_broadcast_before_converting),
    ("compiled autograd refused", check_compiled_autograd_refused),
    ("drop-in: compiled autograd refused", check_drop_in_compiled_autograd_refused),
    ("gradients readable before synchronize", check_grads_readable_before_synchronize),
]


if __name__ == "__main__":
    run(CHECKS)
