"""Host shapes the hierarchical exchange must handle, on hosts emulated by ``horovodrun --gloo``
(tests/test_host_shapes.py): every rank runs here, but Horovod sees ``HVD_TOPK_HOSTS`` hosts.

``HVD_TOPK_HOSTS="2,1"`` (two ranks on one host, one on the other): there is no hierarchy,
since a rank's shard is 1/(ranks per host) of a bucket and the shards exchanged across hosts
would not line up. ``hierarchical=True`` must say so on every rank; the default "auto" must train
flat on every rank (deciding per rank, rank 0 alone went hierarchical and the job hung).

``HVD_TOPK_HOSTS="2,2,2"`` (3 hosts x 2): the dense fallback near break-even. A bucket of 3977
elements is cut into shards of 1989 and 1988; at density 0.4168 (0.8336 on a shard) their k are
1658 and 1657. Worked out by hand from hvd_topk/exchange.py's ring formulas (8-byte pairs,
fp32): the allgather across 3 hosts moves 2 x 8 x k = 26528 and 26512 bytes, the dense
allreduce of the bucket over 6 ranks 2 x 5/6 x 3977 x 4 = 26513.3. Both ranks of a host must
take the same side (dense: the costlier shard decides); one each way hung the job.

Run: ``pytest tests/test_host_shapes.py``, which launches it through tests/support/mpi.py's
``launch_gloo_hosts`` (the horovodrun command line is tools/launch.py's
``horovodrun_gloo_command``; the harness's store address is ``HVD_TOPK_HARNESS_STORE``).
"""

import copy
import os
import warnings

import numpy as np
import torch

import horovod.torch as hvd
import hvd_topk
from check_optimizer import Net, batch
from harness import assert_same_on_all_ranks, gather, raises, raw_then_synchronize, run, step_and_check_same, train
from reference import ErrorFeedbackReference

HOSTS = tuple(int(n) for n in os.environ.get("HVD_TOPK_HOSTS", "2,1").split(","))
MIN_NUMEL = 500
DENSITY = 0.05
# Process sets a user passes to hvd_topk.init(process_sets=...) (Horovod's own example keeps
# such sets): on 3 hosts x 2 ranks (by slot) the first host's ranks and local rank 0's across
# hosts, two of the sets the hierarchy needs. Horovod refuses a duplicate set: init raised
# on every rank before 2026-12-05; now it uses the user's.
USER_SETS = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([0, 2, 4])] if HOSTS == (2, 2, 2) else []


def check_topology():
    """Horovod sees the hosts as launched: each rank's local size is its host's rank count."""
    expected = sorted(n for n in HOSTS for _ in range(n))
    assert sorted(int(s) for s in gather(hvd.local_size())) == expected, (HOSTS, gather(hvd.local_size()))
    assert hvd.size() == sum(HOSTS)


def _optimizer(model, compression=None, inner=None, **options):
    return hvd_topk.DistributedOptimizer(inner or torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression=compression or hvd_topk.TopK(density=DENSITY),
                                         min_numel=MIN_NUMEL, **options)


def check_uneven_true_says_why():
    torch.manual_seed(0)
    with raises(ValueError, match=r"hierarchical=True: the hosts have different numbers of ranks \(2 or 1"):
        _optimizer(Net(), exchange="allgather", hierarchical=True)


def check_uneven_auto_trains_flat(steps=3):
    """hierarchical="auto" (the default) with the allgather pinned: every step's averaged
    gradients are the flat contract's (numpy: per-rank error feedback and Top-K of each tensor)."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = _optimizer(model, exchange="allgather")
    shadow = copy.deepcopy(model)
    ref = ErrorFeedbackReference(size)
    for step in range(steps):
        raw = raw_then_synchronize(shadow, model, opt, *batch(step, rank))
        for name, p in model.named_parameters():
            every = gather(raw[name])
            want = ref.sparse(name, every, DENSITY) if p.numel() >= MIN_NUMEL else np.mean(every, axis=0)
            np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=f"step {step} {name}")
        step_and_check_same(opt, model, f"uneven hosts, step {step}")
    assert not opt.compression_stats()["hierarchical"]
    assert any("hierarchical exchange is off: the hosts have different" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]


def check_uneven_auto_exchange_trains():
    """exchange="auto" and hierarchical="auto", both defaults: through the trial and past it
    (8 steps), every rank takes the same family each step and ends bit for bit alike."""
    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = _optimizer(model, exchange_trial_steps=2)
    for step in range(8):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        families = gather(np.frombuffer(opt._hvd_topk.family.encode().ljust(32), dtype=np.uint8))
        assert all(np.array_equal(f, families[0]) for f in families), f"step {step}: families differ"
        step_and_check_same(opt, model, f"uneven hosts, auto, step {step}")


def check_users_process_sets_serve_the_hierarchy():
    """The sets passed to init are the topology's own where their ranks match, and still the
    user's: an allreduce over local rank 0's set sums ranks 0 + 2 + 4."""
    rank = hvd.rank()
    places = gather(np.array([hvd.cross_rank(), hvd.local_rank()]))
    assert [tuple(p) for p in places] == [(r // 2, r % 2) for r in range(6)], places  # by slot
    topo = hvd_topk.hierarchy._topology
    assert (topo.local is USER_SETS[0]) == (rank in (0, 1)), rank
    assert (topo.cross is USER_SETS[1]) == (rank in (0, 2, 4)), rank
    if rank in (0, 2, 4):
        total = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=USER_SETS[1], name="user.set")
        assert total.item() == 6.0, total


def check_auto_steps_aside_where_nothing_runs_hierarchically():
    """hierarchical="auto" (the default) on 3 hosts x 2 with momentum_correction (which the
    hierarchical exchange does not support), with compact pairs, with exchange="dense" or
    "dense_fp16" (which it did not step aside for before 2026-12-05), and over LocalAdamW or DeMo
    (whose updates it costs quality: hierarchy.UPDATES_COST; used before 2026-12-08): it steps
    aside, so the job trains as on one host (momentum_correction raised before 2026-12-05);
    hierarchical=True still refuses momentum_correction, and over LocalAdamW warns once."""
    for options in [dict(momentum_correction=0.9, exchange="allgather"),
                    dict(exchange="allgather", compression=hvd_topk.TopK(density=DENSITY, compact=True)),
                    dict(exchange="dense"), dict(exchange="dense_fp16"),
                    dict(exchange="allgather", inner=hvd_topk.LocalAdamW), dict(exchange="auto", inner=hvd_topk.DeMo)]:
        torch.manual_seed(0)
        model = Net()
        if "inner" in options:
            options = dict(options, inner=options["inner"](model.parameters(), lr=1e-3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = _optimizer(model, **options)
        assert not [w for w in caught if "hierarch" in str(w.message)], [str(w.message) for w in caught]
        train(model, opt, 2, batch)
        assert not opt.compression_stats()["hierarchical"], options
        # nor does its checkpoint say it was (a resume at another layout would drop its residuals)
        assert "hierarchy" not in opt.state_dict()["hvd_topk"], options
        for name, p in model.named_parameters():
            assert_same_on_all_ranks(p.detach().numpy(), f"{options}: parameter {name}")
    with raises(ValueError, match="momentum_correction is not supported with the hierarchical exchange"):
        _optimizer(Net(), exchange="allgather", hierarchical=True, momentum_correction=0.9)
    model = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = _optimizer(model, inner=hvd_topk.LocalAdamW(model.parameters(), lr=1e-3), exchange="allgather",
                         hierarchical=True)
    said = [str(w.message) for w in caught if "hierarchical=True over an inner optimizer" in str(w.message)]
    assert len(said) == 1 and "6.2% above the flat exchange" in said[0], [str(w.message) for w in caught]
    train(model, opt, 1, batch)
    assert opt.compression_stats()["hierarchical"]  # (warned, not refused)


def check_dense_fallback_agreed_by_a_host(steps=2):
    """The bucket of 3977 elements at density 0.4168 (the module docstring): every rank sends it
    dense, so every step's result is the exact average of the ranks' gradients."""
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(41, 97, bias=False)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopK(density=0.4168), exchange="allgather",
                                        hierarchical=True)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 41, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        raw = model.weight.grad.numpy().copy()
        opt.synchronize()
        np.testing.assert_allclose(model.weight.grad.numpy(), np.mean(gather(raw), axis=0), rtol=1e-5, atol=1e-7,
                                   err_msg=f"step {step}")
        with opt.skip_synchronize():
            opt.step()
        assert_same = gather(model.weight.detach().numpy())
        assert all(np.array_equal(a, assert_same[0]) for a in assert_same), f"step {step}: ranks differ"
    stats = opt.compression_stats()
    assert stats["hierarchical"] and stats["bucket_strategies"] == {0: "dense"}, stats


UNEVEN = [
    ("topology as launched", check_topology),
    ("uneven hosts: hierarchical=True says why", check_uneven_true_says_why),
    ("uneven hosts: hierarchical auto trains flat", check_uneven_auto_trains_flat),
    ("uneven hosts: exchange auto trains", check_uneven_auto_exchange_trains),
]
EVEN = [
    ("topology as launched", check_topology),
    ("the user's process sets serve the hierarchy", check_users_process_sets_serve_the_hierarchy),
    ("hierarchical auto steps aside where nothing runs hierarchically", check_auto_steps_aside_where_nothing_runs_hierarchically),
    ("dense fallback agreed by a host", check_dense_fallback_agreed_by_a_host),
]
CHECKS = UNEVEN if len(set(HOSTS)) > 1 else EVEN


if __name__ == "__main__":
    run(CHECKS, init=lambda: hvd_topk.init(process_sets=USER_SETS))
