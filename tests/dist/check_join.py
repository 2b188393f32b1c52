"""hvd.join() for uneven data with the error-feedback optimizer and with the drop-in TopK,
checked against numpy.

Run: PYTHONPATH=.:tests/support mpirun -np 2 (or 3) python tests/dist/check_join.py
(``--list`` prints the names of its checks).

Rank r has ``2 + (size - 1 - r)`` batches, then calls ``hvd.join()``: the last rank stops first.
While every rank is active the exchange is the sparse contract; once one has joined, Horovod's
joined ranks answer allreduces with zeros (not allgathers), so the active ranks send their
whole accumulators dense: result = sum over active ranks of (residual + gradient) / size, and
their residuals restart at zero. A joined rank is blocked in ``hvd.join()``, so the reference
cannot gather its data: every rank recomputes every rank's gradient from the shared parameters
and that rank's deterministic batch.
"""

import copy

import numpy as np
import torch
import torch.nn.functional as F

import horovod.torch as hvd
import hvd_topk
from check_optimizer import Net, batch, build
from harness import raw_gradients, run
from reference import ErrorFeedbackReference, k_of, part_pieces, sparse_allreduce

DENSITY = 0.05
MIN_NUMEL = 500


def steps_of(rank):
    return 2 + (hvd.size() - 1 - rank)


def active_gradients(shadow, model, step, steps_of):
    """The ranks still training at ``step`` (``steps_of(r) > step``) and, per parameter, each
    one's raw gradient in rank order, recomputed here from its deterministic batch (a rank
    inside ``hvd.join()`` cannot be asked)."""
    active = [r for r in range(hvd.size()) if steps_of(r) > step]
    grads = {n: [] for n, _ in model.named_parameters()}
    for r in active:
        for n, g in raw_gradients(shadow, model, *batch(step, r)).items():
            grads[n].append(g)
    return active, grads


def expected(ref, grads, active, big, size):
    """The numpy result of one step for every parameter; updates ``ref``'s residuals."""
    if len(active) == size:
        out = {n: ref.sparse(n, grads[n], DENSITY) for n in big}
    else:
        out = {}
        for n in big:
            total = np.zeros_like(grads[n][0])
            for r in active:
                acc = ref.residual[r].get(n, np.zeros(grads[n][0].size, np.float32)).reshape(total.shape)
                total += acc + grads[n][r]
                ref.residual[r][n] = np.zeros(total.size, np.float32)
            out[n] = total / np.float32(size)
    for n in grads:
        if n not in big:
            out[n] = np.sum([grads[n][r] for r in active], axis=0) / np.float32(size)
    return out


def check_uneven_batches_then_join(selection_scope="tensor"):
    rank, size = hvd.rank(), hvd.size()
    model, opt = build(density=DENSITY, min_numel=MIN_NUMEL, selection_scope=selection_scope)
    big = [n for n, p in model.named_parameters() if p.numel() >= MIN_NUMEL]
    ref = ErrorFeedbackReference(size)
    shadow = copy.deepcopy(model)
    for step in range(steps_of(rank)):
        active = [r for r in range(size) if steps_of(r) > step]
        grads = {n: [None] * size for n, _ in model.named_parameters()}
        for r in active:
            for n, g in raw_gradients(shadow, model, *batch(step, r)).items():
                grads[n][r] = g
        if selection_scope == "bucket" and len(active) == size:
            want = ref.sparse_bucket(big[::-1], grads, DENSITY)  # backward order, as bucketed
            want.update({n: np.sum([grads[n][r] for r in active], axis=0) / np.float32(size)
                         for n in grads if n not in big})
        else:
            want = expected(ref, grads, active, big, size)
        opt.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        for n, p in model.named_parameters():
            np.testing.assert_allclose(p.grad.numpy(), want[n], rtol=1e-6, atol=1e-7,
                                       err_msg=f"step {step} ({len(active)} of {size} active) {n}")
        with opt.skip_synchronize():
            opt.step()
    last = hvd.join()
    assert last == 0, f"hvd.join() says rank {last} joined last; rank 0 has the most batches"
    assert opt.compression_stats()["steps"] == steps_of(rank)


def check_demo_join(normalise, exchange="allgather", lr=0.05, beta=0.8):
    """DeMo under uneven batches: its residual is its momentum, so on a step where a rank has
    joined each active rank still sends only its top-k, and keeps the rest. Truth, over the
    sparse bucket (the big tensors end to end, in reverse registration order): every active
    rank's accumulator beta * residual + lr * g; the positions it sends: with the allgather its
    top-k of each tensor; with the sparse allreduce, while every rank is active, part j's top-k
    of the accumulator of rank (j + step) mod size (every rank's values there), and once one
    has joined, the top-k of the parts this rank chooses (its own values); the sum over the
    active ranks / size (the joined ranks send nothing), the sent entries zeroed in each
    residual and the rest kept; the parameters move by lr * normalise(result). The step
    counter does not move on steps a rank sat out. Before the fix the active ranks sent their
    whole momentum dense (every entry moved by lr) and it restarted at zero."""
    rank, size = hvd.rank(), hvd.size()
    steps_of_demo = lambda r: 2 + 2 * (size - 1 - r)
    torch.manual_seed(0)
    model = Net()
    opt = hvd_topk.DistributedOptimizer(hvd_topk.DeMo(model.parameters(), lr=lr, beta=beta, normalise=normalise),
                                        named_parameters=model.named_parameters(), exchange=exchange,
                                        compression=hvd_topk.TopK(density=DENSITY), min_numel=MIN_NUMEL)
    params = dict(model.named_parameters())
    names = [n for n, p in params.items() if p.numel() >= MIN_NUMEL][::-1]  # the sparse bucket's order
    edges = np.cumsum([0] + [params[n].numel() for n in names])
    pieces = [(j, a, b) for j, a, b in part_pieces(edges, size)]
    top = lambda acc, a, b: a + np.argsort(-np.abs(acc[a:b]), kind="stable")[:k_of(b - a, DENSITY)]
    residual = [np.zeros(edges[-1], np.float32) for _ in range(size)]
    shadow = copy.deepcopy(model)
    counter = joined_steps = 0
    for step in range(steps_of_demo(rank)):
        active = [r for r in range(size) if steps_of_demo(r) > step]
        everyone = len(active) == size
        grads = {n: [None] * size for n in params}
        for r in active:
            for n, g in raw_gradients(shadow, model, *batch(step, r)).items():
                grads[n][r] = g.reshape(-1).astype(np.float32) * np.float32(lr)
        accs = {r: residual[r] * np.float32(beta) + np.concatenate([grads[n][r] for n in names]) for r in active}
        sends = {}  # every rank's positions first: the sparse allreduce reads the others' accumulators
        for r in active:
            if exchange == "allgather":
                sent = [top(accs[r], a, b) for a, b in zip(edges, edges[1:])]
            elif everyone:
                sent = [top(accs[(j + counter) % size], a, b) for j, a, b in pieces]
            else:
                sent = [top(accs[r], a, b) for j, a, b in pieces if (j + counter) % size == r]
            sends[r] = np.concatenate(sent) if sent else np.zeros(0, np.int64)
        total = np.zeros(edges[-1], np.float32)
        for r, sent in sends.items():
            total[sent] += accs[r][sent]
            accs[r][sent] = 0
            residual[r] = accs[r]
        want = {n: (total[a:b] / np.float32(size)) for n, a, b in zip(names, edges, edges[1:])}
        for n in params:
            if n not in want:  # the small tensors' bucket: plain average, no residual
                want[n] = np.sum([grads[n][r] for r in active], axis=0) / np.float32(size)
            want[n] = want[n].reshape(params[n].shape)
        before = {n: p.detach().numpy().copy() for n, p in params.items()}
        selected = opt.compression_stats()["elements_selected"]  # (buckets go out during backward)
        opt.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        for n, p in params.items():
            np.testing.assert_allclose(p.grad.numpy(), want[n], rtol=1e-5, atol=1e-9,
                                       err_msg=f"demo {normalise} {exchange}: step {step} ({len(active)} of {size} active) {n}")
        # what this rank sent (with a rank joined and the sparse allreduce, the top-k of its own
        # parts), and the small tensors whole
        sent = len(sends[rank]) + sum(p.numel() for p in params.values() if p.numel() < MIN_NUMEL)
        counted = opt.compression_stats()["elements_selected"] - selected
        assert counted == sent, f"step {step}: elements_selected counted {counted}, sent {sent}"
        with opt.skip_synchronize():
            opt.step()
        for n, p in params.items():
            avg = want[n].astype(np.float64)
            rms = np.sqrt(np.mean(avg ** 2))
            move = np.sign(avg) if normalise == "sign" else (avg / rms if rms > 0 else avg)
            np.testing.assert_allclose(p.detach().numpy(), before[n] - lr * move, rtol=1e-5, atol=1e-7,
                                       err_msg=f"demo {normalise} {exchange}: parameter {n}, step {step}")
        counter += everyone
        joined_steps += not everyone
    # the momentum must carry over from one such step to the next
    assert rank != 0 or joined_steps >= 2, f"rank 0 took {joined_steps} steps with a rank joined"
    hvd.join()


def check_join_every_epoch(exchange, epochs=3, **options):
    """Horovod's multi-epoch pattern: uneven batches, ``hvd.join()`` at every epoch's end, with
    a density warm-up spanning the epochs. The steps a rank sat out do not count on the others
    either, so when the ranks meet again their step counters (which set the density, the sparse
    allreduce's rotation and auto's trial) agree: once they differed, and the next epoch failed
    on mismatched messages or hung. Truth: every rank's counter after each epoch is the number
    of steps every rank took, and training goes on (finite). The ranks that stepped on alone
    hold other parameters, as with Horovod's own optimizer: the last to join broadcasts its
    parameters and optimizer state, as a user does."""
    rank, size = hvd.rank(), hvd.size()
    model, opt = build(density=DENSITY, min_numel=MIN_NUMEL, exchange=exchange, warmup_steps=5,
                       warmup_density=0.5, **options)
    for epoch in range(epochs):
        for step in range(steps_of(rank)):
            opt.zero_grad()
            x, y = batch(10 * epoch + step, rank)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        last = hvd.join()
        counters = hvd.allgather_object(opt.compression_stats()["step"])
        assert counters == [(epoch + 1) * steps_of(size - 1)] * size, f"epoch {epoch}: step counters {counters}"
        hvd.broadcast_parameters(model.state_dict(), root_rank=last)
        hvd.broadcast_optimizer_state(opt, root_rank=last)
        for n, p in model.named_parameters():
            assert bool(torch.isfinite(p).all()), f"epoch {epoch}: {n}"


def check_horovod_uneven_batches_then_join(drop_in):
    """Horovod's own optimizer, with ``compression=TopK`` (``drop_in``, no error feedback) or
    without: while every rank is active each tensor is the sum of every rank's top-k (or
    gradient) / size; once one has joined, Horovod's dense result: the sum over the active ranks
    / size (the joined rank counts as zeros)."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = Net()
    compression = hvd_topk.TopK(density=DENSITY, method="exact") if drop_in else hvd.Compression.none
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression)
    shadow = copy.deepcopy(model)
    for step in range(steps_of(rank)):
        active, grads = active_gradients(shadow, model, step, steps_of)
        opt.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        for n, p in model.named_parameters():
            if len(active) == size and drop_in:
                want = sparse_allreduce(grads[n], DENSITY)
            else:
                want = np.sum(grads[n], axis=0) / np.float32(size)
            np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-5, atol=1e-7,
                                       err_msg=f"step {step} ({len(active)} of {size} active) {n}")
        with opt.skip_synchronize():
            opt.step()
    last = hvd.join()
    assert last == 0, f"hvd.join() says rank {last} joined last; rank 0 has the most batches"


CHECKS = [
    ("uneven batches then join", check_uneven_batches_then_join),
    ("uneven batches then join, bucket scope", lambda: check_uneven_batches_then_join("bucket")),
    ("DeMo, sign: uneven batches then join, only the top-k move", lambda: check_demo_join("sign")),
    ("DeMo, rms: uneven batches then join, only the top-k move", lambda: check_demo_join("rms")),
    # beta 1.0: an undecayed accumulator is still DeMo's momentum (before 2026-12-06 sent dense)
    ("DeMo, sign, beta 1: uneven batches then join, only the top-k move", lambda: check_demo_join("sign", beta=1.0)),
    ("DeMo, sign, sparse allreduce: uneven batches then join, only the top-k move",
     lambda: check_demo_join("sign", "sparse_allreduce")),
    ("join at every epoch's end, warm-up, allgather", lambda: check_join_every_epoch("allgather")),
    ("join at every epoch's end, warm-up, sparse allreduce", lambda: check_join_every_epoch("sparse_allreduce")),
    ("join at every epoch's end, auto's trial", lambda: check_join_every_epoch("auto", exchange_trial_steps=1)),
    ("drop-in TopK: uneven batches then join", lambda: check_horovod_uneven_batches_then_join(True)),
    ("horovod: uneven batches then join", lambda: check_horovod_uneven_batches_then_join(False)),
]


if __name__ == "__main__":
    run(CHECKS)
