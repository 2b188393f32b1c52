"""Process sets: Horovod's own pattern (test_optimizer_process_sets), checked against numpy.

Run: PYTHONPATH=.:tests/support mpirun -np 2 (or 3) python tests/dist/check_process_sets.py
(``--list`` prints the names of its checks).

Every rank builds its optimizer with the same process set, which leaves out the last rank.
Members exchange among themselves (checked against the numpy reference fed with the members'
raw gradients); the rank outside keeps its own gradient, as Horovod's optimizer does.
"""

import contextlib
import copy
import io
import os
import warnings

import numpy as np
import torch

os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"  # read by hvd.init() in harness.run

import horovod.torch as hvd  # noqa: E402
import hvd_topk  # noqa: E402
from hvd_topk._horovod import name_fallbacks  # noqa: E402
from check_optimizer import Net, batch, build  # noqa: E402
from harness import assert_same_on_all_ranks, gather, raises, raw_then_synchronize, run  # noqa: E402
from reference import ErrorFeedbackReference, sparse_allreduce  # noqa: E402

DENSITY = 0.05


def with_process_set(check):
    """Run ``check(process_set, members)`` with a dynamic set of every rank but the last."""
    def wrapped():
        members = list(range(hvd.size() - 1))
        process_set = hvd.add_process_set(members)
        check(process_set, members)  # a failure leaves the set: removing it is a collective
        hvd.remove_process_set(process_set)
    return wrapped


def train_and_check(model, opt, members, expected, steps=3):
    """Each step: every rank's raw gradient (from a shadow copy), then the optimizer's result:
    members get ``expected(name, member_grads)``, the rank outside its own raw gradient."""
    rank = hvd.rank()
    shadow = copy.deepcopy(model)
    for step in range(steps):
        x, y = batch(step, rank)
        raw = raw_then_synchronize(shadow, model, opt, x, y)
        for name, p in model.named_parameters():
            every = gather(raw[name])
            want = expected(name, [every[r] for r in members]) if rank in members else raw[name]
            np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-6, atol=1e-7,
                                       err_msg=f"step {step} {name} on rank {rank}")
        with opt.skip_synchronize():
            opt.step()
    for i, p in enumerate(model.parameters()):
        # equal among members; the rank outside trained on its own gradients
        every = gather(p.detach().numpy())
        for r in members[1:]:
            np.testing.assert_array_equal(every[r], every[members[0]], err_msg=f"parameter {i}")


@with_process_set
def check_error_feedback_optimizer(process_set, members):
    model, opt = build(density=DENSITY, min_numel=500, process_set=process_set)
    ref = ErrorFeedbackReference(len(members))
    big = {n for n, p in model.named_parameters() if p.numel() >= 500}

    def expected(name, grads):
        if name in big and len(grads) > 1:
            return ref.sparse(name, grads, DENSITY)
        # dense tensors, and a set of one rank (nothing to exchange: the cost model sends
        # dense, 0 bytes, so the gradient passes whole)
        return np.sum(grads, axis=0) / len(grads)

    train_and_check(model, opt, members, expected)


def beside_torch(model, opt, reference, plain, members, steps):
    """``model`` trained with ``opt`` (over the set), ``reference`` with the torch optimizer
    ``plain``, on the same batches: the members end equal among themselves, the rank outside
    equal to ``reference`` (it trains on alone, as Horovod leaves it its own gradient)."""
    rank = hvd.rank()
    for step in range(steps):
        x, y = batch(step, rank)
        for m, o in ((model, opt), (reference, plain)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        every = gather(p.detach().numpy())
        if rank in members:
            np.testing.assert_array_equal(every[rank], every[members[0]], err_msg=f"members: {name}")
        else:
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-7,
                                       err_msg=f"the rank outside against torch's {type(plain).__name__}: {name}")


@with_process_set
def check_local_adamw_outside(process_set, members):
    """LocalAdamW under the optimizer with the set: the rank outside takes its own AdamW steps
    (before, its step raised "a gradient that was not turned into an update"), equal to
    torch.optim.AdamW on its own gradients (LocalAdamW over one rank is AdamW); the members
    stay equal among themselves."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    options = dict(lr=0.01, betas=(0.0, 0.95), eps=1e-8, weight_decay=0.1)
    opt = hvd_topk.DistributedOptimizer(hvd_topk.LocalAdamW(model.parameters(), **options),
                                        named_parameters=model.named_parameters(), min_numel=500,
                                        compression=hvd_topk.TopK(density=DENSITY), exchange="allgather",
                                        process_set=process_set)
    beside_torch(model, opt, reference, torch.optim.AdamW(reference.parameters(), **options), members, 3)


@with_process_set
def check_local_steps_outside(process_set, members):
    """LocalSteps over the set (sync_every=2, the outer SGD at lr 1 without momentum): the rank
    outside trains on alone, equal to torch's SGD on its own gradients (its synchronisations
    exchange nothing; before, its first one raised "Rank N is not a member of the provided
    process set"); the members end equal among themselves."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    opt = hvd_topk.LocalSteps(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                              sync_every=2, compression=hvd_topk.TopK(density=DENSITY), exchange="allgather",
                              min_numel=500, process_set=process_set)
    beside_torch(model, opt, reference, torch.optim.SGD(reference.parameters(), lr=0.1), members, 4)


@with_process_set
def check_drop_in_compressor(process_set, members):
    torch.manual_seed(0)
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                   compression=hvd_topk.TopK(density=DENSITY), process_set=process_set)
    train_and_check(model, opt, members,
                    lambda name, grads: sparse_allreduce(grads, DENSITY).astype(np.float32))


@with_process_set
def check_drop_in_grouped_allreduce(process_set, members):
    """``hvd.grouped_allreduce(..., compression=TopK, process_set=...)``: the pairs go among the
    set's ranks (the process set is read from the grouped call too), each tensor's result the
    members' average of their top-k pairs."""
    rank = hvd.rank()
    gen = torch.Generator().manual_seed(11 + rank)
    tensors = [torch.randn(3000, generator=gen), torch.randn(40, 50, generator=gen)]
    every = [gather(t.numpy()) for t in tensors]
    compression = hvd_topk.TopK(density=DENSITY)
    if rank not in members:
        return
    fallbacks = name_fallbacks()
    out = hvd.grouped_allreduce(tensors, compression=compression, process_set=process_set, name="grouped.over.set")
    assert name_fallbacks() == fallbacks, (fallbacks, name_fallbacks())  # named <group>.<i>, not by call order
    for i, (got, all_ranks) in enumerate(zip(out, every)):
        want = sparse_allreduce([all_ranks[r].reshape(-1) for r in members], DENSITY).astype(np.float32)
        np.testing.assert_allclose(got.numpy().reshape(-1), want, rtol=1e-6, atol=1e-7,
                                   err_msg=f"tensor {i} on rank {rank}")


@with_process_set
def check_drop_in_built_on_some_ranks(process_set, members):
    """A TopK built and used only by the set's members, then one built on every rank and used
    over the whole job: the second's collectives are named alike on every rank (instances are
    numbered per process set, at their first use there, not in the order each process built
    them), so the rank that built one instance fewer does not stall Horovod."""
    rank = hvd.rank()
    gen = torch.Generator().manual_seed(21 + rank)
    in_set, in_job = torch.randn(2000, generator=gen), torch.randn(3000, generator=gen)
    every_in_set, every_in_job = gather(in_set.numpy()), gather(in_job.numpy())
    if rank in members:
        got = hvd.allreduce(in_set, compression=hvd_topk.TopK(density=DENSITY), process_set=process_set,
                            name="built.on.members")
        want = sparse_allreduce([every_in_set[r] for r in members], DENSITY).astype(np.float32)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7, err_msg=f"set, rank {rank}")
    got = hvd.allreduce(in_job, compression=hvd_topk.TopK(density=DENSITY), name="built.on.every.rank")
    want = sparse_allreduce(list(every_in_job), DENSITY).astype(np.float32)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7, err_msg=f"job, rank {rank}")


def check_drop_in_over_a_reused_set_id():
    """Horovod gives a removed set's id to the next set added: a set of the first two ranks,
    used by an instance there, removed; then a set of the last two gets its id, and an instance
    used over it is numbered alike on its ranks (the numbering is per id and ranks: on rank 1
    the old set's instance would otherwise have made it the second)."""
    rank, size = hvd.rank(), hvd.size()
    # (at 2 ranks sets of one: a set of every rank would duplicate the global one)
    first, last = ([0, 1], [size - 2, size - 1]) if size > 2 else ([0], [1])
    gen = torch.Generator().manual_seed(31 + rank)
    tensor = torch.randn(2500, generator=gen)
    every = gather(tensor.numpy())
    old = hvd.add_process_set(first)
    reused_id = old.process_set_id
    if rank in first:
        hvd.allreduce(tensor, compression=hvd_topk.TopK(density=DENSITY), process_set=old, name="old.set")
    hvd.remove_process_set(old)
    new = hvd.add_process_set(last)
    # what this check is about (Horovod 0.28.1 does it); if it stops, the check tests nothing
    assert new.process_set_id == reused_id, (new.process_set_id, reused_id)
    if rank in last:
        got = hvd.allreduce(tensor, compression=hvd_topk.TopK(density=DENSITY), process_set=new, name="new.set")
        want = sparse_allreduce([every[r] for r in last], DENSITY).astype(np.float32)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7, err_msg=f"rank {rank}")
    hvd.remove_process_set(new)  # (a failure leaves the set: removing it is a collective)


@with_process_set
def check_optimizer_built_on_some_ranks(process_set, members):
    """An error-feedback optimizer built and stepped by the set's members only, then one built
    on every rank over the whole job: the second's collectives are named alike on every rank
    (optimizers are numbered per process set, not in the order each process built them), so
    the rank that built one optimizer fewer does not stall Horovod, and the job's optimizer
    gives every rank the numpy reference's result."""
    rank = hvd.rank()
    if rank in members:
        model, opt = build(density=DENSITY, min_numel=500, process_set=process_set)
        x, y = batch(0, rank)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model, opt = build(density=DENSITY, min_numel=500, seed=1)
    everyone = list(range(hvd.size()))
    ref = ErrorFeedbackReference(len(everyone))
    big = {n for n, p in model.named_parameters() if p.numel() >= 500}

    def expected(name, grads):
        return ref.sparse(name, grads, DENSITY) if name in big else np.sum(grads, axis=0) / len(grads)

    train_and_check(model, opt, everyone, expected)


@with_process_set
def check_horovod_dense(process_set, members):
    """Horovod's optimizer alone, for the README's first column."""
    torch.manual_seed(0)
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), process_set=process_set)
    train_and_check(model, opt, members, lambda name, grads: np.sum(grads, axis=0) / len(grads))


def check_global_set_still_whole_job():
    """After the sets are removed, the default (global) exchange involves every rank."""
    torch.manual_seed(0)
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                   compression=hvd_topk.TopK(density=DENSITY))
    train_and_check(model, opt, list(range(hvd.size())),
                    lambda name, grads: sparse_allreduce(grads, DENSITY).astype(np.float32), steps=1)
    for p in model.parameters():
        assert_same_on_all_ranks(p.detach().numpy(), "global set: parameters")


def check_auto_over_a_set_without_rank_0(steps=12):
    """exchange="auto" over the ranks 1..P-1: the set's first rank announces the trial's choice
    (rank 0, outside, says nothing and, asked, says why it exchanges nothing)."""
    members = list(range(1, hvd.size()))
    process_set = hvd.add_process_set(members)
    torch.manual_seed(0)
    model = Net()
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopK(density=DENSITY), process_set=process_set,
                                        exchange="auto", exchange_trial_steps=2)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        for step in range(steps):
            x, y = batch(step, hvd.rank())
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    stats = opt.compression_stats()
    hvd.remove_process_set(process_set)
    if hvd.rank() == 0:
        assert "outside the optimizer's process set" in stats["exchange_reason"], stats["exchange_reason"]
        assert "hvd_topk: exchange=" not in said.getvalue()
    elif hvd.rank() == members[0] and len(members) > 1:  # one rank alone has no trial to announce
        assert stats["exchange_choice"] is not None, stats
        assert f"hvd_topk: exchange={stats['exchange_choice']} for {len(members)} ranks" in said.getvalue(), \
            said.getvalue()



def check_unregistered_and_removed_sets():
    """A ProcessSet never registered is refused when the optimizer is built, and one removed
    after building is named at the next step, for DistributedOptimizer and LocalSteps (both
    failed inside Horovod's bindings or with a comparison against None)."""
    members = list(range(hvd.size() - 1)) or [0]
    with raises(ValueError, match=r"process_set \[.*\] is not registered with Horovod: pass it to hvd.init",
                what="a set never registered"):
        build(density=DENSITY, min_numel=500, process_set=hvd.ProcessSet(members))
    for make in ("DistributedOptimizer", "LocalSteps"):
        process_set = hvd.add_process_set(members)
        if hvd.rank() in members:
            torch.manual_seed(0)
            model = Net()
            inner = torch.optim.SGD(model.parameters(), lr=0.1)
            opt = hvd_topk.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                                compression=hvd_topk.TopK(density=DENSITY), process_set=process_set) \
                if make == "DistributedOptimizer" else \
                hvd_topk.LocalSteps(inner, named_parameters=model.named_parameters(), sync_every=1,
                                    compression=hvd_topk.TopK(density=DENSITY), process_set=process_set)
        hvd.remove_process_set(process_set)
        if hvd.rank() in members:
            x, y = batch(0, hvd.rank())
            with raises(RuntimeError, match=r"its process set \[.*\] was removed \(hvd.remove_process_set\)",
                        what=f"{make} over a removed set"):
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()

CHECKS = [
    ("error-feedback optimizer, rank outside the set", check_error_feedback_optimizer),
    ("LocalAdamW, rank outside the set", check_local_adamw_outside),
    ("LocalSteps, rank outside the set", check_local_steps_outside),
    ("drop-in TopK, rank outside the set", check_drop_in_compressor),
    ("drop-in TopK, grouped allreduce over the set", check_drop_in_grouped_allreduce),
    ("drop-in TopK, instances built on some ranks only", check_drop_in_built_on_some_ranks),
    ("drop-in TopK, a set that reuses a removed set's id", check_drop_in_over_a_reused_set_id),
    ("error-feedback optimizer, built on some ranks only", check_optimizer_built_on_some_ranks),
    ("horovod dense, rank outside the set", check_horovod_dense),
    ("global set after removing it", check_global_set_still_whole_job),
    ("auto over a set without rank 0", check_auto_over_a_set_without_rank_0),
    ("a set never registered, or removed: named", check_unregistered_and_removed_sets),
]


if __name__ == "__main__":
    run(CHECKS)
