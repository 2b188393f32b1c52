"""hvd_topk.LocalSteps checked step by step against an independent reference.

Run: PYTHONPATH=.:tests/support:tests/dist mpirun -np 2 (or 3) python tests/dist/check_local_steps.py
(``--list`` prints the names of its checks).

The reference simulates every rank: a shadow copy of each rank's parameters stepped by a fresh
torch optimizer of the same class on that rank's gathered gradients (torch.optim is not under
test here), and at each synchronisation the model change through the numpy error-feedback
contract (tests/support/reference.py) and the outer SGD written out in numpy.
"""

import copy
import warnings

import numpy as np
import torch
import torch.nn.functional as F

import horovod.torch as hvd
import harness
import hvd_topk
from harness import assert_same_on_all_ranks, gather, raises, run
from nets import Net, batch
from reference import ErrorFeedbackReference

MIN_NUMEL = 500  # the weights (3840, 960, 960 entries) go sparse, the biases dense


def build(make_inner, sync_every, seed=0, density=0.05, **options):
    options.setdefault("exchange", "allgather")
    torch.manual_seed(seed)
    model = Net()
    opt = hvd_topk.LocalSteps(make_inner(model.parameters()), named_parameters=model.named_parameters(),
                              sync_every=sync_every, compression=hvd_topk.TopK(density=density),
                              min_numel=MIN_NUMEL, **options)
    return model, opt


def train(model, opt, steps, start=0):
    harness.train(model, opt, steps, batch, start)


def sgd(momentum=0.0):
    return lambda params: torch.optim.SGD(params, lr=0.1, momentum=momentum)


def adamw():
    return lambda params: torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)


def check_reference(make_inner, sync_every=3, steps=8, density=0.05, outer_lr=1.0, outer_momentum=0.0,
                    nesterov=False, residual_decay=1.0, exchange="allgather", overflow_at=None):
    """Every step: this rank's parameters equal its simulated replica; after every
    synchronisation every rank holds the same bits, the anchors stepped by the numpy outer SGD
    on the error-feedback contract's average of the ranks' model changes.

    ``overflow_at=(step, rank)``: every rank steps through a ``torch.amp.GradScaler``, and that
    rank's loss is multiplied by inf at that step; its replica skips that step's update (the
    others' do not), and the replicas are fed the gradients divided by each rank's scale."""
    rank, size = hvd.rank(), hvd.size()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if overflow_at else None
    model, opt = build(make_inner, sync_every, density=density, outer_lr=outer_lr, outer_momentum=outer_momentum,
                       nesterov=nesterov, residual_decay=residual_decay, exchange=exchange)
    names = [n for n, _ in model.named_parameters()]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    replicas = [[start[n].clone().requires_grad_(True) for n in names] for _ in range(size)]
    inners = [make_inner(r) for r in replicas]
    anchor = {n: start[n].numpy().astype(np.float32) for n in names}
    buf = {n: np.zeros_like(anchor[n]) for n in names}
    ref = ErrorFeedbackReference(size, decay=residual_decay)
    syncs = 0
    for step in range(steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
        else:
            (scaler.scale(loss) * (float("inf") if (step, rank) == overflow_at else 1.0)).backward()
        grads = {n: gather(p.grad.numpy()) for n, p in model.named_parameters()}
        scales = gather(np.float32(scaler.get_scale() if scaler else 1.0))  # powers of two: exact
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        for r in range(size):
            if (step, r) == overflow_at:
                assert not all(np.isfinite(grads[n][r]).all() for n in names), "the overflow did not happen"
                continue
            for i, n in enumerate(names):
                replicas[r][i].grad = torch.from_numpy(grads[n][r] / scales[r])
            inners[r].step()
        if (step + 1) % sync_every == 0:
            changes = {n: np.stack([anchor[n] - replicas[r][i].detach().numpy() for r in range(size)])
                       for i, n in enumerate(names)}
            big = [n for n in names if changes[n][0].size >= MIN_NUMEL]
            if exchange == "sparse_allreduce":  # one sparse bucket, number 0, in reverse order
                shared = ref.sparse_allreduce_bucket(big[::-1], changes, density, syncs, 0)
            else:
                shared = {n: ref.sparse(n, changes[n], density) for n in big}
            for i, n in enumerate(names):
                change = changes[n]
                avg = shared[n] if n in shared else change.mean(axis=0, dtype=np.float64).astype(np.float32)
                if outer_momentum:
                    buf[n] = np.float32(outer_momentum) * buf[n] + avg
                    avg = avg + np.float32(outer_momentum) * buf[n] if nesterov else buf[n]
                anchor[n] = anchor[n] - np.float32(outer_lr) * avg
                for r in range(size):
                    with torch.no_grad():
                        replicas[r][i].copy_(torch.from_numpy(anchor[n]))
            syncs += 1
            for n, p in model.named_parameters():
                assert_same_on_all_ranks(p.detach().numpy(), f"step {step}: parameter {n} after the synchronisation")
        for i, (n, p) in enumerate(model.named_parameters()):
            np.testing.assert_allclose(p.detach().numpy(), replicas[rank][i].detach().numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step}: parameter {n}")
    assert syncs == steps // sync_every and syncs >= 2, (syncs, steps, sync_every)
    stats = opt.compression_stats()
    dense = sum(p.numel() for p in model.parameters()) * 4
    assert stats["steps"] == steps and stats["syncs"] == syncs, stats
    # bytes against a dense fp32 allreduce at every step (hand-computed: the model's bytes x steps)
    assert stats["bytes_dense"] == dense * steps, (stats["bytes_dense"], dense * steps)
    assert 0 < stats["bytes_ratio"] < 1.0 / sync_every, stats["bytes_ratio"]


def check_drift_between_syncs():
    """Between synchronisations the replicas really are local: with different batches per rank
    the ranks' parameters differ after one step, and agree again at the synchronisation."""
    model, opt = build(sgd(), sync_every=2)
    train(model, opt, 1)
    w = model.fc1.weight.detach().numpy()
    differ = [not np.array_equal(w, other) for other in gather(w)]
    assert sum(differ) == hvd.size() - 1, f"after one local step, ranks equal to this one: {differ}"
    train(model, opt, 1, start=1)
    assert_same_on_all_ranks(model.fc1.weight.detach().numpy(), "after the synchronisation")


def check_broadcast_after_construction():
    """Each rank builds from its own seed, then Horovod's usual broadcasts: the period starts
    from the broadcast weights (the anchors are taken at the first step, not at construction)."""
    def broadcast_run(seed):
        model, opt = build(adamw(), sync_every=2, seed=seed)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)  # (steps a fresh AdamW once, as Horovod does)
        train(model, opt, 4)
        return model
    model = broadcast_run(seed=hvd.rank())
    for n, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"parameter {n}")
    reference = broadcast_run(seed=0)
    for (n, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), f"{n}: the broadcast run differs from the run built from rank 0's seed"


def check_resume(mid_period=True, **options):
    """Saved after 5 steps (H=3: two steps into a period) or 6 (at a synchronisation), loaded
    into fresh objects on every rank: bitwise equal after 10 steps to the run that never stopped."""
    saved_at = 5 if mid_period else 6
    make = lambda seed=0: build(adamw(), sync_every=3, seed=seed, outer_momentum=0.9, nesterov=True, **options)
    model, opt = make()
    train(model, opt, 10)
    model_b, opt_b = make()
    train(model_b, opt_b, saved_at)
    assert opt_b.local_step == saved_at % 3
    saved = copy.deepcopy({"model": model_b.state_dict(), "opt": opt_b.state_dict()})
    model_c, opt_c = make(seed=123)
    train(model_c, opt_c, 1)  # already stepping when it loads the checkpoint
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    assert opt_c.local_step == saved_at % 3
    train(model_c, opt_c, 10 - saved_at, start=saved_at)
    for (name, a), c in zip(model.named_parameters(), model_c.parameters()):
        assert torch.equal(a, c), f"resume: {name} differs (max {float((a - c).abs().max())})"


def check_unfrozen_after_construction():
    """fc2 frozen when LocalSteps is built and unfrozen after a step: it has no shared copy, so
    its changes would never be exchanged; the next step() refuses, on every rank, naming it."""
    torch.manual_seed(0)
    model = Net()
    for p in model.fc2.parameters():
        p.requires_grad_(False)
    opt = hvd_topk.LocalSteps(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                              sync_every=2, compression=hvd_topk.TopK(density=0.05), min_numel=MIN_NUMEL,
                              exchange="allgather")
    train(model, opt, 1)
    for p in model.fc2.parameters():
        p.requires_grad_(True)
    with raises(RuntimeError, match="parameter 'fc2.weight' had requires_grad=False when hvd_topk.LocalSteps was built",
                what="a parameter unfrozen after construction"):
        train(model, opt, 1, start=1)


def check_dropped_leaves_no_hook():
    """A LocalSteps that is dropped takes its step post-hook (which counts the inner optimizer's
    steps taken outside it) off the inner optimizer it shares hooks with: the same inner
    optimizer, wrapped next in hvd_topk.DistributedOptimizer as the refusal of an unfrozen
    parameter advises, trains without a warning that it was "stepped without a step() of the
    optimizer LocalSteps returned" (the old hook counted its steps and kept the dropped
    LocalSteps' anchors and outer optimizer alive)."""
    torch.manual_seed(0)
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: nothing per rank to bring together
    hooks = len(inner._optimizer_step_post_hooks)
    opt = hvd_topk.LocalSteps(inner, named_parameters=model.named_parameters(), sync_every=2,
                              compression=hvd_topk.TopK(density=0.05), min_numel=MIN_NUMEL, exchange="allgather")
    train(model, opt, 2)
    del opt
    assert len(inner._optimizer_step_post_hooks) == hooks, "the dropped LocalSteps' hook is still on the optimizer"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*stepped .* without a step\(\) of the optimizer LocalSteps returned")
        opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(), min_numel=MIN_NUMEL,
                                            exchange="allgather")
        train(model, opt, 4, start=2)
    for name, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"after LocalSteps, the DistributedOptimizer: {name}")


def check_frozen_after_construction():
    """fc1 trainable when LocalSteps is built and frozen after a step: its shared copy would
    still move by the residual of its earlier changes, and each synchronisation resets it to
    that copy; the next step() refuses, on every rank, naming it."""
    model, opt = build(sgd(), sync_every=2)
    train(model, opt, 3)
    for p in model.fc1.parameters():
        p.requires_grad_(False)
    with raises(RuntimeError, match="parameter 'fc1.weight' was trainable when hvd_topk.LocalSteps was built",
                what="a parameter frozen after construction"):
        train(model, opt, 1, start=3)


def check_resume_shorter_period():
    """Saved 5 steps into a period of 8, loaded with sync_every=4: the next step synchronises
    (every rank the same bits, local_step 0, one synchronisation), and then every 4 steps."""
    model, opt = build(sgd(), sync_every=8)
    train(model, opt, 5)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    model_b, opt_b = build(sgd(), sync_every=4, seed=1)
    model_b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    assert opt_b.local_step == 5
    train(model_b, opt_b, 1, start=5)
    assert opt_b.local_step == 0 and opt_b.compression_stats()["syncs"] == 1, \
        (opt_b.local_step, opt_b.compression_stats()["syncs"])
    assert_same_on_all_ranks(model_b.fc1.weight.detach().numpy(), "after the first step of the shorter period")
    train(model_b, opt_b, 4, start=6)
    assert opt_b.local_step == 0 and opt_b.compression_stats()["syncs"] == 2
    assert_same_on_all_ranks(model_b.fc1.weight.detach().numpy(), "4 steps later")


def check_elastic_state():
    """hvd.elastic: a TorchState commit mid-period restores the model, the phase, the anchors
    and the outer residuals; a worker that joins later (fresh objects, the outer optimizer at
    step 0) and receives TorchState.sync()'s broadcasts follows the others' warm-up schedule and
    holds their bits after the next synchronisation."""
    # (momentum: Horovod's broadcast_optimizer_state skips an optimizer without state)
    model, opt = build(sgd(0.9), sync_every=2, warmup_steps=4, warmup_density=1.0)
    train(model, opt, 3)
    state = hvd.elastic.TorchState(model=model, optimizer=opt)
    state.commit()
    committed = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, 2, start=3)
    state.restore()
    restored = opt.state_dict()
    assert opt.local_step == 1, opt.local_step
    shared = "hvd_topk_local_shared"  # param group 0 of state_dict(): the anchors
    for a, b in zip(restored["param_groups"][0][shared]["anchors"], committed["opt"]["param_groups"][0][shared]["anchors"]):
        assert torch.equal(a, b), "anchors not restored"
    for name, r in committed["opt"]["hvd_topk_local_steps"]["outer"]["hvd_topk"]["residuals"].items():
        assert torch.equal(restored["hvd_topk_local_steps"]["outer"]["hvd_topk"]["residuals"][name], r), name
    for name, t in committed["model"].items():
        assert torch.equal(model.state_dict()[name], t), name
    train(model, opt, 1, start=3)  # to the end of the period: a synchronisation, where commits belong
    assert opt.local_step == 0
    # Every rank builds fresh objects (so that the collectives' names agree, as in new processes);
    # the survivors load what they had, the last rank stays fresh: the replacement worker.
    kept = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    model, opt = build(sgd(0.9), sync_every=2, seed=123, warmup_steps=4, warmup_density=1.0)
    if hvd.rank() != hvd.size() - 1:
        model.load_state_dict(kept["model"])
        opt.load_state_dict(kept["opt"])
    state = hvd.elastic.TorchState(model=model, optimizer=opt)
    state.sync()
    train(model, opt, 4, start=4)
    for n, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"after the new worker's first synchronisations: {n}")


def fresh_then_broadcast(make_inner, saved, **options):
    """Every rank builds fresh objects from its own seed, rank 0 loads ``saved`` (its model and
    optimizer), then Horovod's usual broadcasts from rank 0."""
    model, opt = build(make_inner, sync_every=3, seed=100 + hvd.rank(), **options)
    if hvd.rank() == 0:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return model, opt


def check_broadcast_mid_period():
    """A checkpoint loaded on rank 0 alone, two steps into a period (H=3), then broadcast: the
    other ranks take rank 0's phase, shared weights (anchors) and outer momentum, so after the
    next synchronisation every rank holds the same bits. (The anchors once stayed behind:
    replicas parted for good.)"""
    model, opt = build(adamw(), sync_every=3, outer_momentum=0.9)
    train(model, opt, 5)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    model, opt = fresh_then_broadcast(adamw(), saved, outer_momentum=0.9)
    assert opt.local_step == 2, opt.local_step
    train(model, opt, 4, start=5)  # a synchronisation at step 6 (1 step on), and at 9
    for n, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"after the synchronisations: {n}")


def check_broadcast_at_synchronisation_weight_decay():
    """A checkpoint loaded on rank 0 alone at a synchronisation (H=3, after 6 steps), then
    broadcast, with AdamW's weight decay: the other ranks' fresh AdamW takes one step inside
    hvd.broadcast_optimizer_state, and its decay moves their broadcast model. The period must
    start from the root's shared weights: every rank holds rank 0's bits at once, and after the
    next synchronisation. (The anchors were once taken from the decayed model: the next
    synchronisation raised that the ranks hold different shared weights.)"""
    model, opt = build(adamw(), sync_every=3)
    train(model, opt, 6)
    assert opt.local_step == 0, opt.local_step
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    model, opt = fresh_then_broadcast(adamw(), saved)
    train(model, opt, 1, start=6)  # the period's first step, from the shared weights
    train(model, opt, 2, start=7)  # a synchronisation
    assert opt.local_step == 0, opt.local_step
    for n, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"after the synchronisation: {n}")


def check_parameter_unused_on_one_rank():
    """head2 unused on the last rank: its AdamW has no state for it (gradients stay local), so
    hvd.broadcast_optimizer_state would pair different tensors and hang. At the synchronisation
    every rank gets state for every parameter some rank has state for, without moving it: after
    it the unused weight on the last rank equals the others' (the anchors), every rank holds
    state for all 6 parameters, and the broadcast completes with every rank then equal to rank
    0's optimizer state. Before it, the state made for head2 on the last rank is a fresh one:
    its first step with a gradient equals a new AdamW's (before 2026-12-06 the state's step
    counter was 1, and that update came out 26% short of AdamW's first)."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
                              named_parameters=model.named_parameters(), sync_every=2,
                              compression=hvd_topk.TopK(density=0.05), min_numel=MIN_NUMEL, exchange="allgather")
    use_head2 = hvd.rank() != hvd.size() - 1
    for step in range(2):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        F.cross_entropy(model(x, use_head2), y).backward()
        opt.step()
    assert opt.local_step == 0
    for n, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"after the synchronisation: {n}")
    counts = gather(np.array([len(opt.state_dict()["state"])]))
    assert all(int(c[0]) == 6 for c in counts), f"parameters with optimizer state per rank: {counts}"
    x, y = batch(2, hvd.rank())  # a local step, head2 used on every rank
    opt.zero_grad()
    F.cross_entropy(model(x, True), y).backward()
    head2 = dict(model.named_parameters())["head2.weight"]
    fresh = torch.nn.Parameter(head2.detach().clone())
    fresh.grad = head2.grad.clone()
    torch.optim.AdamW([fresh], lr=0.01, weight_decay=0.1).step()
    opt.step()
    if not use_head2:
        np.testing.assert_allclose(head2.detach().numpy(), fresh.detach().numpy(), rtol=0, atol=1e-7,
                                   err_msg="head2's first step on the rank that had not used it: not a new AdamW's")
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for p in model.parameters():
        assert_same_on_all_ranks(opt.state[p]["exp_avg_sq"].numpy(), "exp_avg_sq after the broadcast")


def check_model_loaded_after_construction_broadcast():
    """Built, then a model-only checkpoint loaded on rank 0 (fine-tuning: every weight 7.0),
    then Horovod's usual broadcasts: the run starts from the loaded weights. A step with zero
    gradients (AdamW without weight decay leaves the model where it is) keeps 7.0 exactly on
    every rank. (The shared weights exported at a period's start were once the copy taken at
    construction, which the first step then wrote back into the model: the random init.)"""
    torch.manual_seed(hvd.rank())
    model = Net()
    opt = hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0),
                              named_parameters=model.named_parameters(), sync_every=4,
                              compression=hvd_topk.TopK(density=0.05), min_numel=MIN_NUMEL, exchange="allgather")
    if hvd.rank() == 0:
        model.load_state_dict({k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()})
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        assert bool((p == 7.0).all()), f"{n}: not the loaded weights after the first step (mean {float(p.mean())})"


def check_heads_used_on_different_ranks():
    """head a trained on even ranks, head b on odd ones: as many parameters with optimizer state
    on every rank, but not the same ones. At the synchronisation every rank gets state for all,
    and the broadcast then gives every rank rank 0's state parameter by parameter (a comparison
    of the counts alone once missed it, and the broadcast paired a's moments with b)."""
    torch.manual_seed(0)
    trunk, a, b = torch.nn.Linear(40, 32), torch.nn.Linear(32, 10), torch.nn.Linear(32, 10)
    params = [*trunk.parameters(), *a.parameters(), *b.parameters()]
    names = [(f"{m}.{n}", p) for m, mod in (("trunk", trunk), ("a", a), ("b", b)) for n, p in mod.named_parameters()]
    opt = hvd_topk.LocalSteps(torch.optim.AdamW(params, lr=0.01), named_parameters=names, sync_every=2,
                              compression=hvd_topk.TopK(density=0.05), min_numel=MIN_NUMEL, exchange="allgather")
    head = a if hvd.rank() % 2 == 0 else b
    for step in range(2):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        F.cross_entropy(head(torch.relu(trunk(x))), y).backward()
        opt.step()
    assert all(opt.state.get(p) for p in params), "a parameter without optimizer state after the synchronisation"
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for name, p in names:
        assert_same_on_all_ranks(opt.state[p]["exp_avg"].numpy(), f"{name}: exp_avg after the broadcast")


def check_statistics_before_the_first_synchronisation():
    """One step of H=2: nothing sent yet, against one dense fp32 allreduce of the model
    (hand-computed: its element count x 4 bytes); after the synchronisation, two."""
    model, opt = build(sgd(), sync_every=2)
    dense = sum(p.numel() for p in model.parameters()) * 4
    train(model, opt, 1)
    stats = opt.compression_stats()
    assert (stats["steps"], stats["syncs"], stats["bytes_sent"]) == (1, 0, 0), stats
    assert stats["bytes_dense"] == dense and stats["bytes_ratio"] == 0.0, stats
    train(model, opt, 1, start=1)
    stats = opt.compression_stats()
    assert stats["bytes_dense"] == 2 * dense and 0 < stats["bytes_ratio"] < 0.5, stats


def check_stateless_broadcast_refused():
    """The same with SGD without momentum, whose state Horovod does not broadcast (nor its
    phase): at the first synchronisation the ranks see that they disagree and every rank raises
    a RuntimeError saying so, where they once went on with different shared weights."""
    model, opt = build(sgd(), sync_every=3)
    train(model, opt, 5)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    model, opt = fresh_then_broadcast(sgd(), saved)
    with raises(RuntimeError, match="the ranks hold different shared weights", what="the first synchronisation"):
        train(model, opt, 3, start=5)


def check_join_then_next_epoch():
    """hvd.join() with uneven batches (rank 0: 4 steps, the others 2; H=3, AdamW), then the usual
    broadcasts from the rank that joined last, then a second epoch: every rank's phase, shared
    weights and model are rank 0's, and after the next synchronisation they hold the same bits."""
    model, opt = build(adamw(), sync_every=3)
    train(model, opt, 4 if hvd.rank() == 0 else 2)
    last = hvd.join()
    assert last == 0, last
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    hvd.broadcast_optimizer_state(opt, root_rank=last)
    assert opt.local_step == 1, opt.local_step
    train(model, opt, 2, start=4)  # rank 0's phase 1 + 2: a synchronisation on every rank
    assert opt.local_step == 0, opt.local_step
    for n, p in model.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"after the second epoch's synchronisation: {n}")


def check_join():
    """hvd.join() with uneven batches: rank r takes 2 * (size - r) steps (H=2, SGD), then joins.
    At the first synchronisation every rank is active: the sparse contract on every rank's
    change. At rank 0's last one the others have joined, and Horovod's joined ranks answer
    allreduces with zeros: the exchange goes dense and the anchors move by rank 0's whole
    accumulator over the size (the joined ranks count as no change; with 3 ranks the dense
    exchange of the synchronisation before, rank 2 joined, emptied rank 0's residual)."""
    rank, size = hvd.rank(), hvd.size()
    lr = np.float32(0.1)
    model, opt = build(sgd(), sync_every=2)
    ref = ErrorFeedbackReference(size)
    for step in range(2 * (size - rank)):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        if step % 2 == 0:
            anchor = before
        # this rank's replica after the local SGD step, before the synchronisation resets it
        local = {n: before[n] - lr * p.grad.numpy() for n, p in model.named_parameters()}
        opt.step()
        sync = step // 2
        if step % 2 == 0 or sync not in (0, size - 1):
            continue
        for n, p in model.named_parameters():
            after, sparse = p.detach().numpy(), p.numel() >= MIN_NUMEL
            if sync == 0:
                changes = np.stack(gather(anchor[n] - local[n]))
                want = ref.sparse(n, changes, 0.05) if sparse else changes.mean(axis=0)
            else:
                residual = ref.residual[0][n].reshape(after.shape) if sparse and size == 2 else 0.0
                want = (residual + anchor[n] - local[n]) / size
            np.testing.assert_allclose(after, anchor[n] - want, rtol=1e-4, atol=1e-6,
                                       err_msg=f"synchronisation {sync}: {n}")
    last = hvd.join()
    assert last == 0, f"hvd.join() says rank {last} joined last; rank 0 has the most batches"


def distributed_optimizer(model):
    """Plain AdamW, whose state LocalSteps' inner AdamW can take (the warning against it is not under test)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*in front of torch.optim.AdamW")
        return hvd_topk.DistributedOptimizer(adamw()(model.parameters()), named_parameters=model.named_parameters(),
                                             compression=hvd_topk.TopK(density=0.05), min_numel=MIN_NUMEL,
                                             exchange="allgather")


def check_checkpoints_across_optimizers():
    """A hvd_topk.DistributedOptimizer's checkpoint loads into LocalSteps with a warning: the
    run then equals one that loaded the inner AdamW's plain state (the residuals dropped, not
    misread as model changes). A LocalSteps checkpoint into a DistributedOptimizer is refused,
    leaving it as it was (it had kept the stale shared weights in its param groups), and the
    conversion the message gives loads."""
    torch.manual_seed(0)
    model = Net()
    opt = distributed_optimizer(model)
    train(model, opt, 3)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    plain = {"state": saved["state"],
             "param_groups": [{k: v for k, v in g.items() if k != "hvd_topk_step"} for g in saved["param_groups"]]}
    runs = []
    for state in (saved, plain):
        model_l, opt_l = build(adamw(), sync_every=2, seed=7)
        model_l.load_state_dict(saved_model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt_l.load_state_dict(copy.deepcopy(state))
        said = [str(w.message) for w in caught if "do not carry over to LocalSteps" in str(w.message)]
        assert len(said) == (state is saved), f"warnings when loading {'saved' if state is saved else 'plain'}: {said}"
        after = opt_l.state_dict()
        assert "hvd_topk" not in after and "hvd_topk_step" not in after["param_groups"][0], sorted(after)
        train(model_l, opt_l, 4, start=3)
        runs.append([p.detach().clone() for p in model_l.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b), "the DistributedOptimizer checkpoint did not load as the inner optimizer's state"

    model_l, opt_l = build(adamw(), sync_every=2)
    train(model_l, opt_l, 3)
    local_state = copy.deepcopy(opt_l.state_dict())
    torch.manual_seed(0)
    model_d = Net()
    opt_d = distributed_optimizer(model_d)
    train(model_d, opt_d, 1)
    before = copy.deepcopy(opt_d.state_dict())
    with raises(ValueError, match="written by hvd_topk.LocalSteps: load it into a LocalSteps optimizer",
                what="a LocalSteps checkpoint into hvd_topk.DistributedOptimizer"):
        opt_d.load_state_dict(local_state)
    after = opt_d.state_dict()
    assert after["param_groups"] == before["param_groups"], "the refused load changed the param groups"
    for key, value in before["state"].items():
        for name, tensor in value.items():
            assert torch.equal(after["state"][key][name], tensor), f"the refused load changed {name}"
    # the conversion the message gives: the shared weights into the model, the LocalSteps entries removed
    shared = local_state["param_groups"][0]["hvd_topk_local_shared"]
    del local_state["hvd_topk_local_steps"]
    for group in local_state["param_groups"]:
        for key in [k for k in group if k.startswith("hvd_topk_local_")]:
            del group[key]
    with torch.no_grad():
        for p, anchor in zip(model_d.parameters(), shared["anchors"]):
            p.copy_(anchor)
    opt_d.load_state_dict(local_state)
    hvd.broadcast_optimizer_state(opt_d, root_rank=0)  # each rank's AdamW moments were its own
    assert not [k for g in opt_d.param_groups for k in g if k.startswith("hvd_topk_local_")], opt_d.param_groups[0]
    train(model_d, opt_d, 2, start=3)
    for n, p in model_d.named_parameters():
        assert_same_on_all_ranks(p.detach().numpy(), f"after the converted checkpoint: {n}")


def check_plain_checkpoint_restarts_outer():
    """A plain optimizer's checkpoint loaded into a LocalSteps that has already synchronised
    (outer residuals and Nesterov momentum built up): the run then equals a fresh LocalSteps
    loaded with the same checkpoint and model, bitwise (before, the old residuals and momentum
    were kept while the synchronisation count restarted)."""
    make = lambda seed=0: build(adamw(), sync_every=2, seed=seed, outer_momentum=0.9, nesterov=True)
    model, opt = make()
    train(model, opt, 4)  # ends at a synchronisation: the model is the same on every rank
    assert opt.compression_stats()["syncs"] == 2
    state = opt.state_dict()
    plain = {"state": copy.deepcopy(state["state"]),
             "param_groups": [{k: v for k, v in g.items() if not k.startswith("hvd_topk")}
                              for g in state["param_groups"]]}
    weights = copy.deepcopy(model.state_dict())
    runs = []
    for model_x, opt_x in ((model, opt), make(seed=5)):
        model_x.load_state_dict(weights)
        with warnings.catch_warnings(record=True) as caught:  # nothing to warn of
            warnings.simplefilter("always")
            opt_x.load_state_dict(copy.deepcopy(plain))
        assert not [str(w.message) for w in caught if "hvd_topk" in str(w.message)], [str(w.message) for w in caught]
        assert opt_x.local_step == 0 and opt_x.param_groups[0]["hvd_topk_local_syncs"] == 0
        train(model_x, opt_x, 5, start=4)
        runs.append([p.detach().clone() for p in model_x.parameters()])
    for (name, _), a, b in zip(model.named_parameters(), *runs):
        assert torch.equal(a, b), f"{name}: loading a plain checkpoint kept the outer optimizer's old state " \
                                  f"(max difference {float((a - b).abs().max())} from a fresh LocalSteps)"


def check_plain_checkpoint_on_rank_0_broadcast():
    """The same plain checkpoint loaded on rank 0 alone, then Horovod's broadcasts: the
    broadcast says rank 0's outer SGD has no momentum now, and every rank drops its own (it
    kept it, so the ranks' shared weights parted at the next synchronisation, a RuntimeError);
    the ranks hold the same bits after each synchronisation."""
    model, opt = build(adamw(), sync_every=2, outer_momentum=0.9, nesterov=True)
    train(model, opt, 4)
    if hvd.rank() == 0:
        state = opt.state_dict()
        opt.load_state_dict({"state": copy.deepcopy(state["state"]), "param_groups": [
            {k: v for k, v in g.items() if not k.startswith("hvd_topk")} for g in state["param_groups"]]})
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for start in (4, 6):
        train(model, opt, 2, start=start)
        for n, p in model.named_parameters():
            assert_same_on_all_ranks(p.detach().numpy(), f"after the synchronisation at step {start + 2}: {n}")


def check_rollback_on_rank_0_auto():
    """The outer exchange="auto" (one timed step per candidate), decided by the 8th
    synchronisation, rolled back on rank 0 to its checkpoint of the 2nd, then Horovod's
    broadcasts: the outer trial travels in LocalSteps' param group 0 as its step does, so every
    rank runs the same outer exchange at every synchronisation after, and the ranks hold the
    same bits (only rank 0's outer trial restarted, the ranks ran different exchanges and hung)."""
    model, opt = build(sgd(0.9), sync_every=2, exchange="auto", exchange_trial_steps=1)
    outer = getattr(opt, "_hvd_topk_local").outer
    train(model, opt, 4)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, 12, start=4)
    if hvd.rank() == 0:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for start in range(4, 20, 2):
        train(model, opt, 2, start=start)
        families = hvd.allgather_object(outer.compression_stats()["exchange_family"])
        assert len(set(families)) == 1, f"synchronisation at step {start + 2}: the ranks ran {families}"
        for n, p in model.named_parameters():
            assert_same_on_all_ranks(p.detach().numpy(), f"after the synchronisation at step {start + 2}: {n}")


def check_groups():
    """``groups=[[...]]`` lists the model's parameters: their anchors are fused as listed (a
    frozen one left out, as DistributedOptimizer does), and the run equals the one without
    groups bitwise (per-tensor Top-K over the allgather does not depend on the fusion)."""
    runs = []
    for grouped in (False, True):
        torch.manual_seed(0)
        model = Net()
        model.head2.bias.requires_grad_(False)
        groups = [[model.fc2.weight, model.head2.bias], [model.fc1.weight, model.head2.weight]]
        opt = hvd_topk.LocalSteps(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), sync_every=2,
                                  compression=hvd_topk.TopK(density=0.05), min_numel=MIN_NUMEL,
                                  exchange="allgather", **({"groups": groups} if grouped else {}))
        outer = getattr(opt, "_hvd_topk_local").outer
        fused = [[m.name for m in b.members] for b in getattr(outer, "_hvd_topk").buckets if b.sparse]
        if grouped:
            assert fused == [["fc2.weight"], ["fc1.weight", "head2.weight"]], fused
        else:
            assert fused == [["head2.weight", "fc2.weight", "fc1.weight"]], fused
        train(model, opt, 6)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b), "groups changed the numbers"
    model = Net()
    with raises(ValueError, match=r"groups holds a tensor of shape \(3,\) that is not one of the optimizer's",
                what="a tensor outside the optimizer in groups"):
        hvd_topk.LocalSteps(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2,
                            groups=[[model.fc1.weight, torch.zeros(3)]])


def check_bad_input():
    model = Net()
    with raises(ValueError, match="sync_every must be an integer >= 1", what="sync_every=0"):
        hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters()), sync_every=0)
    with raises(TypeError, match="sync_every must be an integer", what="sync_every=2.5"):
        hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters()), sync_every=2.5)
    for inner in (hvd_topk.LocalAdamW, hvd_topk.DeMo):
        with raises(ValueError, match="turns each rank's gradient into an update", what=f"{inner.__name__} inside"):
            hvd_topk.LocalSteps(inner(model.parameters()), sync_every=4)
    with raises(TypeError, match="act on gradients", what="op="):
        hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters()), sync_every=4, op=hvd.Sum)
    with raises(TypeError, match="unexpected keyword argument.s. warmup_step;", what="a misspelt warmup_steps"):
        hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters()), sync_every=4, warmup_step=25)
    with raises(TypeError, match=r"density is an option of the compression: pass compression=hvd_topk\.TopK\(density=",
                what="density as LocalSteps' own"):
        hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters()), sync_every=4, density=0.04)
    # FrozenVarianceAdamW is a plain optimizer of gradients: each rank may run it alone
    hvd_topk.LocalSteps(hvd_topk.FrozenVarianceAdamW(model.parameters(), freeze_step=5), sync_every=4)
    with raises(ValueError, match="nesterov=True needs outer_momentum", what="nesterov without momentum"):
        hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters()), sync_every=4, nesterov=True)
    for bad in (0.0, float("inf"), float("nan")):
        with raises(ValueError, match="outer_lr must be a finite number > 0", what=f"outer_lr={bad}"):
            hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters()), sync_every=4, outer_lr=bad)
    with raises(ValueError, match="already distributed", what="wrapping twice"):
        hvd_topk.LocalSteps(hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters()), sync_every=2), sync_every=2)
    with raises(ValueError, match="is a hvd_topk.LocalSteps, which exchanges the model itself",
                what="LocalSteps inside hvd_topk.DistributedOptimizer"):
        hvd_topk.DistributedOptimizer(hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters()), sync_every=2))
    with raises(TypeError, match="do not wrap it in hvd.DistributedOptimizer",
                what="LocalSteps inside hvd.DistributedOptimizer"):
        hvd.DistributedOptimizer(hvd_topk.LocalSteps(torch.optim.AdamW(model.parameters()), sync_every=2),
                                 named_parameters=model.named_parameters())
    _, opt = build(sgd(), sync_every=2)
    state = opt.state_dict()
    shared = state["param_groups"][0]["hvd_topk_local_shared"]
    shared["anchors"] = shared["anchors"][:-1]
    with raises(ValueError, match="anchors do not match", what="a checkpoint of another model"):
        opt.load_state_dict(state)
    state = opt.state_dict()
    state["param_groups"][0]["hvd_topk_local_shared"]["anchors"][0] = torch.zeros(3, 5)
    with raises(ValueError, match=r"fc1.weight was saved with shape \(3, 5\), here it is \(96, 40\)",
                what="a resized layer"):
        opt.load_state_dict(state)
    # Parameters added, or the model moved to another dtype, after building: the anchors were made
    # for the old ones; a clear error at the next step, where a new parameter trained on each rank
    # alone (never exchanged nor reset) and float64 weights were rounded to float32 at each sync.
    model, opt = build(sgd(), sync_every=2)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    with raises(RuntimeError, match="parameters changed after hvd_topk.LocalSteps was built",
                what="a parameter group added after building"):
        train(model, opt, 1)
    model, opt = build(sgd(), sync_every=2)
    model.double()
    with raises(RuntimeError, match=r"moved to another dtype or device, e.g. model.double\(\)",
                what="model.double() after building"):
        opt.step()
    # sync_every or the outer SGD differing on the last rank: named at the first synchronisation (the
    # message blamed checkpoints before, and for the outer settings only one period after the ranks parted)
    last = hvd.size() - 1
    for what, kwargs in (("sync_every", {"sync_every": 3}), ("outer_lr", {"outer_lr": 0.5}),
                         ("nesterov", {"outer_momentum": 0.5, "nesterov": hvd.rank() == last})):
        odd = hvd.rank() == last
        model, opt = build(sgd(), **{"sync_every": 2, **(kwargs if odd or what == "nesterov" else {})})
        with raises(RuntimeError, match=rf"built with different settings \(sync_every, outer_lr, outer_momentum or "
                                        rf"nesterov; ranks \[{last}\] differ from rank 0\)", what=f"{what} on rank {last}"):
            train(model, opt, 3)
    # The wrapped optimizer's own settings differing on the last rank (here AdamW's weight decay; a
    # tensor lr, whose repr names its device, compared by value): named at the first synchronisation,
    # where before each rank stepped its own way and nothing was said
    odd = hvd.rank() == last
    model, opt = build(lambda params: torch.optim.AdamW(params, lr=torch.tensor(0.01), weight_decay=0.2 if odd else 0.1),
                       sync_every=2)
    train(model, opt, 1)
    with raises(RuntimeError, match=rf"the optimizer it wraps has other settings on ranks \[{last}\] than on rank 0",
                what=f"AdamW's weight decay on rank {last}"):
        train(model, opt, 1, start=1)
    model, opt = build(lambda params: torch.optim.AdamW(params, lr=torch.tensor(0.01)), sync_every=2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(4):  # an LR scheduler stepped alike on every rank: the same settings
        train(model, opt, 1, start=step)
        scheduler.step()
    # An object kept in a param group (a training script's tag): compared by its type, as the
    # Horovod engine does; its default repr names its address, which differs by rank, and the
    # synchronisation refused it as the ranks' settings differing
    model, opt = build(sgd(), sync_every=2)
    opt.param_groups[0]["tag"] = type("Tag", (), {})()
    train(model, opt, 4)
    # ... but an object whose repr is its value (a dtype) by that value: a rank holding another
    # one disagrees (compared by type name, bfloat16 and float32 were taken to agree)
    model, opt = build(sgd(), sync_every=2)
    opt.param_groups[0]["state_dtype"] = torch.float32 if hvd.rank() == last else torch.bfloat16
    with raises(RuntimeError, match=rf"the optimizer it wraps has other settings on ranks \[{last}\] than on rank 0",
                what=f"a dtype option differing on rank {last}"):
        train(model, opt, 2)
    # The optimizer passed to LocalSteps stepped instead of the returned one: nothing synchronises,
    # a warning says so (before, silence and ranks that went apart); a fresh optimizer's broadcast
    # (one step of the inner class, taken by Horovod) and training through the returned one do not warn
    for wrong in (False, True):
        torch.manual_seed(0)
        model = Net()
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        opt = hvd_topk.LocalSteps(inner, named_parameters=model.named_parameters(), sync_every=2,
                                  compression=hvd_topk.TopK(density=0.05), min_numel=MIN_NUMEL, exchange="allgather")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            train(model, inner if wrong else opt, 5)
        stepped = [str(w.message) for w in caught if "without a step() of the optimizer LocalSteps returned" in str(w.message)]
        assert stepped == (["hvd_topk.LocalSteps: the optimizer passed to it was stepped 3 times without a step() of the "
                            "optimizer LocalSteps returned, which is the one that synchronises: these steps stay on this "
                            "rank, whose model goes its own way. Step the returned optimizer (opt = "
                            "hvd_topk.LocalSteps(inner, ...); ...; opt.step())."] if wrong else []), (wrong, stepped)
        assert opt.compression_stats()["syncs"] == (0 if wrong else 2), opt.compression_stats()["syncs"]
    # A model gone non-finite is said to be so, not blamed on the ranks disagreeing (NaN != NaN).
    model, opt = build(sgd(), sync_every=2)
    train(model, opt, 1)
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")
    train(model, opt, 1, start=1)  # the first synchronisation exchanges it into the shared weights
    with raises(RuntimeError, match=r"the shared weights are not finite \(inf or NaN\) on ranks \[0, 1",
                what="a NaN model change"):
        train(model, opt, 2, start=2)


CHECKS = [
    ("a dropped LocalSteps leaves no step hook behind", check_dropped_leaves_no_hook),
    ("a rollback on rank 0, broadcast: one outer exchange on every rank (auto)", check_rollback_on_rank_0_auto),
    ("SGD inside, H=3, allgather", lambda: check_reference(sgd())),
    ("AdamW inside, H=2, Nesterov outer, residual decay, sparse allreduce", lambda: check_reference(
        adamw(), sync_every=2, steps=6, outer_lr=0.7, outer_momentum=0.9, nesterov=True, residual_decay=0.9,
        exchange="sparse_allreduce")),
    ("AdamW inside, H=1, outer momentum", lambda: check_reference(adamw(), sync_every=1, steps=4, outer_momentum=0.5)),
    ("GradScaler, an overflow on one rank skips only its local step", lambda: check_reference(
        adamw(), sync_every=2, steps=6, overflow_at=(2, hvd.size() - 1))),
    ("replicas drift between synchronisations", check_drift_between_syncs),
    ("broadcast after construction", check_broadcast_after_construction),
    ("checkpoint resume mid-period", check_resume),
    ("checkpoint resume at a synchronisation, sparse allreduce", lambda: check_resume(
        mid_period=False, exchange="sparse_allreduce")),
    ("checkpoint of a longer period loaded with a shorter sync_every", check_resume_shorter_period),
    ("a parameter unfrozen after construction is refused", check_unfrozen_after_construction),
    ("a parameter frozen after construction is refused", check_frozen_after_construction),
    ("hvd.elastic: commit, restore, a new worker", check_elastic_state),
    ("hvd.join with uneven batches", check_join),
    ("a checkpoint on rank 0 alone, broadcast mid-period", check_broadcast_mid_period),
    ("the same with a stateless inner optimizer: the ranks' disagreement is an error", check_stateless_broadcast_refused),
    ("a checkpoint on rank 0 alone, broadcast at a synchronisation, AdamW's weight decay",
     check_broadcast_at_synchronisation_weight_decay),
    ("a parameter unused on one rank: state everywhere, the broadcast completes", check_parameter_unused_on_one_rank),
    ("statistics before the first synchronisation", check_statistics_before_the_first_synchronisation),
    ("a model loaded after construction on rank 0, broadcast: kept", check_model_loaded_after_construction_broadcast),
    ("heads used on different ranks: state everywhere, broadcast parameter by parameter",
     check_heads_used_on_different_ranks),
    ("hvd.join, broadcasts from the last rank, a second epoch", check_join_then_next_epoch),
    ("checkpoints across LocalSteps and DistributedOptimizer", check_checkpoints_across_optimizers),
    ("a plain checkpoint restarts the outer optimizer", check_plain_checkpoint_restarts_outer),
    ("a plain checkpoint on rank 0, broadcast", check_plain_checkpoint_on_rank_0_broadcast),
    ("groups of the model's parameters", check_groups),
    ("bad input", check_bad_input),
]

if __name__ == "__main__":
    run(CHECKS)
