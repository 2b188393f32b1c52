"""hvd_topk.planner.ExchangePlanner on its own (no Horovod job): strategy choice, the cost
model and the codec plans, against byte counts worked out by hand from the ring formulas in
hvd_topk/exchange.py's docstring (fp32 values and int32 indices: 8 bytes a pair)."""

import threading
from types import SimpleNamespace

import pytest
import torch

from hvd_topk import exchange
from hvd_topk.buckets import make_buckets
from hvd_topk.codec import Codec
from hvd_topk.hierarchy import Topology
from hvd_topk.options import Options
from hvd_topk.planner import ExchangePlanner
from hvd_topk.schedule import DensitySchedule

N = 10_000  # the weight's elements: k = 100 at 1%


def planner(density=0.01, hier=None, codec=None, dtype=torch.float32, updates=False, momentum=False, **options):
    weight = torch.nn.Parameter(torch.zeros(100, 100, dtype=dtype))
    bias = torch.nn.Parameter(torch.zeros(100, dtype=dtype))
    options = Options(**options)
    buckets = make_buckets([weight, bias], {weight: "w", bias: "b"}, options.min_numel, options.fusion_bytes)
    schedule = DensitySchedule(density, options.warmup_steps, options.warmup_density)
    return ExchangePlanner(options, buckets, codec or Codec(), schedule, hier, process_set=None, name="test",
                           updates=updates, momentum=momentum), buckets


def test_pinned_exchange_and_dense_fallback():
    plan, (sparse, dense) = planner(exchange="allgather")
    assert plan.family(0, 2) == "allgather"
    codec_plan = plan.codec_plan(sparse, 0.01, "allgather", 2)
    assert codec_plan.count == 100 and codec_plan.numel == N
    assert plan.strategy("allgather", sparse, codec_plan, 2) is exchange.AllgatherPairs
    assert plan.strategy("allgather", dense, None, 2) is exchange.DenseAllreduce  # the small tensors
    # at 60%, 6000 pairs x 8 bytes = 48,000 > the ring allreduce's 2 (P-1)/P N 4 = 40,000 at P=2
    wide = plan.codec_plan(sparse, 0.6, "allgather", 2)
    assert plan.strategy("allgather", sparse, wide, 2) is exchange.DenseAllreduce
    no_fallback, (sparse2, _) = planner(exchange="allgather", dense_fallback=False)
    assert no_fallback.strategy("allgather", sparse2, wide, 2) is exchange.AllgatherPairs


def test_fp16_values_fall_back_to_a_16_bit_dense_allreduce():
    """TopK(fp16_values=True): 6 bytes a pair (2 + 4), and the dense fallback is the fp16 ring:
    2 (P-1)/P N 2 = 20,000 bytes at P=2, so 40% (4000 pairs, 24,000 bytes) goes dense, in 16
    bits, and 30% (18,000 bytes) stays sparse; the small tensors stay fp32. (With fp32 values
    40% stays sparse: 32,000 bytes against the fp32 ring's 40,000.)"""
    plan, (sparse, dense) = planner(exchange="allgather", codec=Codec(fp16_values=True))
    assert plan.strategy("allgather", sparse, plan.codec_plan(sparse, 0.4, "allgather", 2), 2) is \
        exchange.DenseAllreduceFp16
    assert plan.strategy("allgather", sparse, plan.codec_plan(sparse, 0.3, "allgather", 2), 2) is exchange.AllgatherPairs
    fp32, (sparse32, _) = planner(exchange="allgather")
    assert fp32.strategy("allgather", sparse32, fp32.codec_plan(sparse32, 0.4, "allgather", 2), 2) is exchange.AllgatherPairs
    assert plan.strategy("allgather", dense, None, 2) is exchange.DenseAllreduce


@pytest.mark.parametrize("family, world, want", [
    ("allgather", 2, 1 * 100 * 8),                        # (P-1) k (b_v + b_i)
    ("allgather", 3, 2 * 100 * 8),
    ("sparse_allreduce", 4, 3 / 4 * 100 * 4 + 2 * 3 / 4 * 101 * 4),  # (P-1)/P (k b_i + 2 (k+1) b_v)
    ("dense", 4, 2 * 3 / 4 * N * 4),                       # 2 (P-1)/P n b_dense
    ("dense_fp16", 4, 2 * 3 / 4 * N * 2),
])
def test_modelled_bytes_match_the_ring_formulas(family, world, want):
    plan, _ = planner()
    assert plan.modelled_bytes(family, 0.01, world) == pytest.approx(want)


@pytest.mark.parametrize("family, world, want", [
    ("allgather", 2, 1 * 100 * (2 + 4)),                  # bfloat16 values allgathered as they are
    ("sparse_allreduce", 4, 3 / 4 * 100 * 4 + 2 * 3 / 4 * 101 * 4),  # the values allreduced in float32
    ("dense", 4, 2 * 3 / 4 * N * 4),                       # Horovod allreduces bfloat16 as float32
])
def test_bfloat16_buckets_are_counted_in_the_dtypes_horovod_moves(family, world, want):
    plan, _ = planner(dtype=torch.bfloat16)
    assert plan.modelled_bytes(family, 0.01, world) == pytest.approx(want)


def test_a_bfloat16_bucket_falls_back_to_dense_against_the_float32_ring():
    """At 40% and P = 2 a bfloat16 bucket's 4000 pairs move 4000 x 6 = 24,000 bytes; its dense
    allreduce runs in float32, 2 (P-1)/P N 4 = 40,000: sparse wins (counted at 2 bytes an
    element, 20,000, the ring would have won); at 70%, 42,000 bytes, dense does."""
    plan, (sparse, _) = planner(exchange="allgather", dtype=torch.bfloat16)
    assert plan.strategy("allgather", sparse, plan.codec_plan(sparse, 0.4, "allgather", 2), 2) is \
        exchange.AllgatherPairs
    assert plan.strategy("allgather", sparse, plan.codec_plan(sparse, 0.7, "allgather", 2), 2) is \
        exchange.DenseAllreduce


def test_auto_during_warm_up_takes_the_fewest_bytes_without_a_trial():
    """At step 0 of the warm-up the density is 25% (k = 2500); at P = 4: dense 60,000 bytes,
    fp16 30,000, allgather 3 x 2500 x 8 = 60,000, sparse allreduce 0.75 x 2500 x 4 + 1.5 x 2501 x 4 = 22,506."""
    plan, _ = planner(exchange="auto", warmup_steps=10, warmup_density=0.25)
    assert plan.family(0, 4) == "sparse_allreduce"
    assert plan.trial is None
    assert plan.family(0, 1) == "dense"  # one rank: nothing to exchange


def test_sparse_allreduce_every_rank_selects_one_part():
    """The weight (10,000 elements) in 3 parts of 3334, 3333, 3333; rank (j + step + bucket)
    mod 3 selects part j, so each step the three ranks select the three parts."""
    plan, (sparse, dense) = planner(exchange="sparse_allreduce")
    for step in range(6):
        chosen = []
        for rank in range(3):
            s = plan.bucket_step(sparse, step, "sparse_allreduce", 3, rank)
            assert s.strategy is exchange.SparseAllreduce and not s.hierarchical
            assert s.plan.sizes == [3334, 3333, 3333] and len(s.led) == 1
            chosen.append(s.led[0])
            assert s.led[0] == (rank - step - sparse.index) % 3
        assert sorted(chosen) == [0, 1, 2]
    d = plan.bucket_step(dense, 0, "sparse_allreduce", 3, 0)
    assert d.strategy is exchange.DenseAllreduce and d.plan is None and not d.selects


def test_hierarchical_plans_cover_this_ranks_shard_at_L_times_the_density():
    """Local rank 1 of 2: shard [5000, 10000) of the weight, selected at 2%: 100 pairs, what the
    rank would send flat, so a host sends as many as its two ranks would."""
    topo = Topology(local=None, cross=None, local_rank=1, local_size=2, cross_rank=0, cross_size=2,
                    local_sizes=(2, 2, 2, 2))
    plan, (sparse, _) = planner(hier=topo, exchange="allgather")
    assert plan.family(0, 4) == "hier_allgather"
    assert plan.shard(sparse) == (5000, 10000)
    codec_plan = plan.codec_plan(sparse, 0.01, "hier_allgather", 2)
    assert codec_plan.numel == 5000 and codec_plan.count == 100
    # the sparse part runs among cross_size = 2 ranks: 1 x 100 x 8 bytes
    assert plan.modelled_bytes("hier_allgather", 0.01, 4) == pytest.approx(800)
    assert plan.bucket_step(sparse, 0, "hier_allgather", 4, 1).hierarchical


def _host_planners(shapes, local_size, cross_size, codec=None, **options):
    """One planner per local rank of a host (``Topology`` ``local_rank`` 0..L-1) over
    parameters of ``shapes``, and each one's buckets."""
    out = []
    for local_rank in range(local_size):
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        opts = Options(**options)
        buckets = make_buckets(params, {p: f"p{i}" for i, p in enumerate(params)}, opts.min_numel, opts.fusion_bytes)
        schedule = DensitySchedule(0.01, opts.warmup_steps, opts.warmup_density)
        topo = Topology(None, None, local_rank, local_size, 0, cross_size, (local_size,) * (local_size * cross_size))
        out.append((ExchangePlanner(opts, buckets, codec or Codec(), schedule, topo, process_set=None, name="t"), buckets))
    return out


def test_a_hosts_ranks_take_the_same_dense_fallback_decision():
    """4 hosts x 2 ranks, one bucket of 3977 elements: local rank 0's shard holds 1989, rank 1's
    1988, so their k differ. By hand (allgather across 4 hosts, 8-byte pairs, against a dense
    ring allreduce of the whole bucket over 8 ranks: 2 x 7/8 x 3977 x 4 = 27839 bytes): shard
    density 0.583 gives k = 1160 and 1159, 3 x 8 x k = 27840 and 27816, on both sides of it.
    Deciding from each rank's own shard split the host (a hang in the collectives); every rank
    must follow the costlier shard, and so must the cost model that ``auto`` decides from."""
    ranks = _host_planners([(41, 97)], local_size=2, cross_size=4, exchange="allgather")
    assert [plan.shard(buckets[0]) for plan, buckets in ranks] == [(0, 1989), (1989, 3977)]
    for density in [0.2915, *(0.28 + 0.0005 * i for i in range(40))]:
        chosen = {plan.strategy("hier_allgather", buckets[0], plan.codec_plan(buckets[0], density, "hier_allgather", 8), 8).name
                  for plan, buckets in ranks}
        assert len(chosen) == 1, (density, chosen)
        assert len({plan.modelled_bytes("hier_allgather", density, 8) for plan, _ in ranks}) == 1, density
    plan, buckets = ranks[1]  # the shorter shard alone would still be sparse at 0.2915
    assert plan.codec_plan(buckets[0], 0.2915, "hier_allgather", 8).count == 1159
    assert plan.strategy("hier_allgather", buckets[0], plan.codec_plan(buckets[0], 0.2915, "hier_allgather", 8), 8) \
        is exchange.DenseAllreduce


def test_hosts_with_16_bit_values_fall_back_to_the_16_bit_dense_allreduce():
    """The layout above with 16-bit values (6-byte pairs): at shard density 0.583 the host's
    pairs cross as 3 x 6 x 1160 = 20,880 bytes, more than the 16-bit dense ring's
    2 x 7/8 x 3977 x 2 = 13,919.75, so the bucket goes dense in 16 bits, as it does flat (it
    stayed sparse, weighed against the float32 ring's 27,839)."""
    for plan, buckets in _host_planners([(41, 97)], local_size=2, cross_size=4, codec=Codec(fp16_values=True),
                                        exchange="allgather"):
        codec_plan = plan.codec_plan(buckets[0], 0.2915, "hier_allgather", 8)
        assert plan.strategy("hier_allgather", buckets[0], codec_plan, 8) is exchange.DenseAllreduceFp16


def test_hosts_during_a_dense_start_send_dense_and_warm_up_flat():
    """2 hosts x 2 ranks. A dense start (density 1) goes dense, in 16 bits with 16-bit values,
    pinned to a hierarchical family too (its shards crossed as pairs of every entry). During a
    warm-up ``auto`` takes the flat family of fewest bytes (the numbers of the flat test above:
    the sparse allreduce's 22,506 bytes at 25%), not a hierarchical one, which the model counts
    across hosts only (hier_sparse_allreduce: 15,004)."""
    topo = Topology(local=None, cross=None, local_rank=0, local_size=2, cross_rank=0, cross_size=2,
                    local_sizes=(2, 2, 2, 2))
    for codec, dense in [(Codec(), exchange.DenseAllreduce), (Codec(fp16_values=True), exchange.DenseAllreduceFp16)]:
        plan, (sparse, _) = planner(hier=topo, codec=codec, exchange="allgather", warmup_steps=10, warmup_density=1.0)
        assert plan.family(0, 4) == "hier_allgather"
        step = plan.bucket_step(sparse, 0, "hier_allgather", 4, 0)
        assert step.strategy is dense and not step.hierarchical
        assert plan.bucket_step(sparse, 10, "hier_allgather", 4, 0).hierarchical  # after the start
    plan, _ = planner(hier=topo, exchange="auto", warmup_steps=10, warmup_density=0.25)
    assert "hier_sparse_allreduce" in plan.families
    assert plan.modelled_bytes("hier_sparse_allreduce", 0.25, 4) < plan.modelled_bytes("sparse_allreduce", 0.25, 4)
    assert plan.family(0, 4) == "sparse_allreduce"
    assert plan.trial is None
    # hierarchical=True offers no flat sparse family: the hierarchical ones compete (dense
    # alone would send every warm-up step whole)
    plan, _ = planner(hier=topo, exchange="auto", hierarchical=True, warmup_steps=10, warmup_density=0.25)
    assert "sparse_allreduce" not in plan.families
    assert plan.family(0, 4) == "hier_sparse_allreduce"


def test_a_bucket_smaller_than_a_host_is_exchanged_flat():
    """A 1-element bucket on hosts of 2 ranks (``min_numel`` lowered): the reduce-scatter would
    leave local rank 1 an empty shard, so the bucket runs flat, its plan over the whole bucket,
    on every local rank; the 1000-element bucket beside it stays hierarchical."""
    for plan, buckets in _host_planners([(1000,), (1,)], local_size=2, cross_size=2, exchange="allgather",
                                        min_numel=1, fusion_bytes=4, dense_fallback=False):
        small = next(b for b in buckets if b.numel == 1)
        big = next(b for b in buckets if b.numel == 1000)
        step = plan.bucket_step(small, 0, "hier_allgather", 4, 0)
        assert step.strategy is exchange.AllgatherPairs and not step.hierarchical
        assert step.plan.numel == 1 and step.plan.count == 1
        assert plan.bucket_step(big, 0, "hier_allgather", 4, 0).hierarchical
        # 1 pair from each of 4 ranks (3 received) plus bucket `big`'s 10 pairs over 2 hosts
        assert plan.modelled_bytes("hier_allgather", 0.01, 4) == pytest.approx(3 * 8 + 1 * 10 * 8)


def test_describe_says_why_before_any_trial():
    """Before a trial: one rank, the warm-up (steps 0-4 here), or after it a trial still to
    start (a checkpoint loaded past the warm-up: before 2026-12-06 it said "density warm-up")."""
    plan, _ = planner(exchange="auto", warmup_steps=5)
    assert plan.describe(1, 0)["exchange_reason"] == "one rank: nothing to exchange"
    assert plan.describe(2, 4)["exchange_reason"] == "density warm-up: fewest bytes"
    assert plan.describe(2, 5)["exchange_reason"].startswith("a trial starts at the next step")
    assert planner(exchange="dense")[0].describe(2, 0) == {"exchange": "dense"}


def test_demos_residual_is_never_sent_whole_by_choice():
    """DeMo's accumulator (``momentum=True``): the residual is its momentum, which a dense exchange
    would send whole and zero each step. So auto offers no dense family (fp16 included) and
    says so, and no bucket takes the dense fallback, even where dense moves fewer bytes (at 50%
    and P = 4 the pairs alone, 3 x 5000 x 6 = 90000 bytes, are more than a ring allreduce of all
    10100 values in fp16, 2 x 3/4 x 10100 x 2 = 30300), under auto or a pinned allgather; a rank
    alone sends pairs too (dense moves nothing there). At density 1 (a dense start) Top-K would
    send everything and zero the residual anyway, so the fallback's fewer bytes are taken. A
    pinned dense exchange is used as given."""
    fp16 = Codec(fp16_values=True)
    demo = {"residual_decay": 0.9, "momentum": True}
    decayed, (weight, _) = planner(warmup_steps=5, warmup_density=0.5, updates=True, codec=fp16, **demo)
    plain, (plain_weight, _) = planner(warmup_steps=5, warmup_density=0.5, codec=fp16)
    pinned_allgather, (pinned_weight, _) = planner(warmup_steps=5, warmup_density=0.5, exchange="allgather",
                                                   codec=fp16, **demo)
    assert plain.families == ("dense", "dense_fp16", "allgather", "sparse_allreduce")
    assert decayed.families == ("allgather",)
    assert "dense not tried" in decayed.left_out and "sparse allreduce not tried" in decayed.left_out
    assert plain.family(0, 4) in ("dense", "dense_fp16")
    assert plain.bucket_step(plain_weight, 0, "allgather", 4, 0).strategy.name == "dense_fp16"  # the fallback
    assert decayed.family(0, 4) == "allgather"
    assert decayed.bucket_step(weight, 0, "allgather", 4, 0).strategy.name == "allgather"
    assert pinned_allgather.bucket_step(pinned_weight, 0, "allgather", 4, 0).strategy.name == "allgather"
    assert plain.family(10, 1) == "dense" and decayed.family(10, 1) == "allgather"
    assert decayed.bucket_step(weight, 10, "allgather", 1, 0).strategy.name == "allgather"
    start, (start_weight, _) = planner(warmup_steps=5, warmup_density=1.0, codec=fp16, **demo)
    assert start.bucket_step(start_weight, 0, start.family(0, 4), 4, 0).strategy.name == "dense_fp16"
    assert start.bucket_step(start_weight, 10, start.family(10, 4), 4, 0).strategy.name == "allgather"
    pinned, _ = planner(exchange="dense", **demo)
    assert pinned.family(10, 4) == "dense" and pinned.left_out is None


def test_a_residual_decay_added_to_error_feedback_takes_the_dense_fallback():
    """The 0.1% recipe: ``residual_decay=0.99`` over LocalAdamW is no momentum (a dense step sends
    all of it, as Top-K at density 1 would), so its dense start takes the fallback where dense
    moves fewer bytes, as in every measurement of that recipe (from 2026-12-04 16:00 to the fix
    it went as pairs). By hand, P = 2, 16-bit values: pairs cost 6 bytes a sent entry, the fp16
    ring 2 (P-1)/P x 2 = 2 bytes an element, so dense wins above density 1/3; the start decays
    from 1 to 0.001 over 100 steps as 0.001^(s/100), above 1/3 for s <= 100 ln 3 / ln 1000 = 15.9:
    steps 0-15 dense, 16 on as pairs. auto offers dense too."""
    fp16 = Codec(fp16_values=True)
    recipe, (weight, _) = planner(density=0.001, exchange="allgather", warmup_steps=100, warmup_density=1.0,
                                  residual_decay=0.99, updates=True, codec=fp16)
    names = [recipe.bucket_step(weight, s, recipe.family(s, 2), 2, 0).strategy.name for s in range(101)]
    assert [s for s, n in enumerate(names) if n != "allgather"] == list(range(16)), names
    auto_recipe, _ = planner(density=0.001, residual_decay=0.99, updates=True, codec=fp16)
    assert "dense" in auto_recipe.families and auto_recipe.left_out is not None  # (the sparse allreduce's note)
    assert "dense not tried" not in auto_recipe.left_out


def test_auto_over_updates_leaves_both_sparse_allreduces_out():
    """An inner optimizer that exchanges updates (LocalAdamW, DeMo): auto is offered neither the
    flat nor the hierarchical sparse allreduce, and in the density warm-up (the fewest bytes)
    takes the allgather where for gradients it takes the sparse allreduce: at 2% and P = 4,
    3 x 200 x 8 = 4800 bytes against 3/4 x 200 x 4 + 2 x 3/4 x 201 x 4 = 1806. A pinned
    exchange is used as given, hierarchically where the host sets exist."""
    topo = Topology(local=None, cross=None, local_rank=0, local_size=2, cross_rank=0, cross_size=2,
                    local_sizes=(2, 2, 2, 2))
    gradients, _ = planner(hier=topo, warmup_steps=5)
    updates, _ = planner(hier=topo, warmup_steps=5, updates=True)
    assert gradients.families == ("dense", "allgather", "sparse_allreduce", "hier_allgather", "hier_sparse_allreduce")
    assert updates.families == ("dense", "allgather", "hier_allgather")
    assert updates.left_out is not None and gradients.left_out is None
    flat_gradients, _ = planner(warmup_steps=5, warmup_density=0.02)
    flat_updates, _ = planner(warmup_steps=5, warmup_density=0.02, updates=True)
    assert flat_gradients.family(0, 4) == "sparse_allreduce"
    assert flat_updates.family(0, 4) == "allgather"
    pinned, _ = planner(hier=topo, exchange="sparse_allreduce", updates=True)
    assert pinned.family(0, 4) == "hier_sparse_allreduce" and pinned.left_out is None


def test_a_step_sat_out_in_join_is_not_timed_into_the_next(monkeypatch):
    """The trial times a step from the previous ``synchronize()``'s end. A step some rank sat out
    inside ``hvd.join()`` is not counted (``skip``), and the next is not timed from it either:
    it held the uncounted step and the wait. Clock by hand: candidate a's one timed step takes 1,
    then a joined step, then a step ending 9 after it; b's two steps take 2 each. Without the
    skip a's times are [1, 9] (median 5) and b wins; with it a's are [1] and a wins."""
    from hvd_topk import auto
    clock = iter([0.0, 1.0, 10.0, 11.0, 13.0, 15.0])
    monkeypatch.setattr(auto.time, "perf_counter", lambda: next(clock))
    trial = auto.Trial(["a", "b"], 2, agree=lambda medians: medians)
    trial.step_done(0)        # a settles
    trial.step_done(1)        # a: 1
    trial.skip()              # a step a rank sat out inside hvd.join(): not counted
    trial.step_done(2)        # not timed (it would read 9)
    trial.step_done(3)        # b settles
    trial.step_done(4)        # b: 2
    assert trial.step_done(5)  # b: 2, decided
    assert trial.times == {"a": [1.0], "b": [2.0, 2.0]}
    assert trial.choice == "a"


def test_a_trial_goes_on_from_another_ranks_record():
    """``trial_record()`` / ``adopt_trial``: a planner that takes another's record (as
    hvd.broadcast_optimizer_state carries it to a rank that did not load, or to an elastic job's
    new worker) runs the same family at every later step and decides at the same step, on the
    same medians: for the candidates timed before it the root's alone (the joiner has no times
    for them, and the decision averages over the ranks that timed each); a record of None
    forgets the trial."""
    root, _ = planner(exchange="auto", exchange_trial_steps=1)
    for step in range(3):
        root.family(step, 4)
        root.step_done(step, 4)
    joiner, _ = planner(exchange="auto", exchange_trial_steps=1)
    joiner.adopt_trial(root.trial_record())
    assert joiner.trial_record() == root.trial_record()
    # no Horovod here: the two run in threads and "allreduce" through a barrier; neither is rank 0 (silent)
    barrier, parts, families = threading.Barrier(2, timeout=30), {}, {}

    def run(name, one):
        def average(medians):
            parts[name] = medians
            barrier.wait()
            out = (parts["root"] + parts["joiner"]) / 2
            barrier.wait()
            return out
        one.trial.agree, one.process_set = average, SimpleNamespace(rank=lambda: 1)
        families[name] = []
        for step in range(3, 3 + 2 * len(root.trial.candidates)):
            families[name].append(one.family(step, 4))
            one.step_done(step, 4)

    threads = [threading.Thread(target=run, args=pair) for pair in (("root", root), ("joiner", joiner))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert families["root"] == families["joiner"], families
    assert root.trial.choice is not None and joiner.trial.decided_at == root.trial.decided_at
    timed_before = root.trial.candidates[0]  # the first candidate's steps were the root's alone
    assert joiner.trial.times[timed_before] == [] and root.trial.times[timed_before]
    assert joiner.trial.medians == root.trial.medians, (joiner.trial.medians, root.trial.medians)
    assert root.trial.medians[timed_before] == root.trial.times[timed_before][0]  # one step each: the median
    assert joiner.trial.choice == root.trial.choice
    assert "taken from the root rank" not in joiner.trial.reason()
    joiner.adopt_trial(None)
    assert joiner.trial is None and joiner.trial_record() is None


def _fake_ranks(n, run_one):
    """``n`` trials on threads whose ``agree`` averages over them (no Horovod: a barrier)."""
    barrier, parts, out = threading.Barrier(n, timeout=30), {}, {}

    def average_for(r):
        def average(values):
            parts[r] = values
            barrier.wait()
            mean = sum(parts[i] for i in range(n)) / n
            barrier.wait()
            return mean
        return average

    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, run_one(r, average_for(r)))) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_step_one_rank_could_not_time_is_dropped_on_every_rank():
    """Rank 1 sat a step out inside ``hvd.join()`` without knowing it (the joined rank times
    its next step across the wait, 50 s here); rank 0 marks that step untimed (``skip``). The
    decision drops it on both, so the wait does not count: a's median is its other step's
    (1 s), not the mean of 1 and 50 on rank 1. One timed step a candidate: rank 0 has no
    time for a at all, and the ranks that timed it decide (before, rank 0's inf ruled a out)."""
    from hvd_topk import auto
    durations = {0: [1.0, None, 2.0, 2.0], 1: [1.0, 50.0, 2.0, 2.0]}  # per timed position; None: skip

    def run_one(rank, agree):
        trial = auto.Trial(["a", "b"], 2, agree)
        now = [0.0]
        for slot in range(2):
            trial.last_end = now[0]
            trial.position = slot * 3 + 1  # after the settling step
            for d in durations[rank][2 * slot:2 * slot + 2]:
                if d is None:
                    trial.skip()
                    d = 1.0
                now[0] += d
                with _clock(now[0]):
                    decided = trial.step_done(0)
        return trial, decided

    out = _fake_ranks(2, run_one)
    for rank, (trial, decided) in out.items():
        assert decided and trial.medians == {"a": 1.0, "b": 2.0}, (rank, trial.times, trial.medians)
        assert trial.choice == "a"


def test_a_family_no_rank_timed_runs_again():
    """Every step of a's slot untimed on every rank (``exchange_trial_steps=1`` and a step the
    scaler skipped, say): a is run once more instead of being ruled out, then decided on."""
    from hvd_topk import auto
    trial = auto.Trial(["a", "b"], 1, agree=lambda values: values)
    with _clock(0.0):
        trial.step_done(0)  # a settles
    trial.skip()
    with _clock(5.0):
        trial.step_done(1)  # a: not timed
    with _clock(6.0):
        trial.step_done(2)  # b settles
    with _clock(9.0):
        assert not trial.step_done(3)  # b: 3; a has no time anywhere: run again
    assert trial.candidates == ["a", "b", "a"] and trial.family() == "a" and trial.choice is None
    with _clock(10.0):
        trial.step_done(4)  # a settles
    with _clock(11.0):
        assert trial.step_done(5)  # a: 1
    assert trial.medians == {"a": 1.0, "b": 3.0} and trial.choice == "a"
    assert trial.families == ["a", "b"]


def test_a_trial_that_timed_nothing_says_so():
    """No step timed on any rank, retries included (a loop that calls synchronize() but never
    the inner step(), which the Horovod optimizer needs before it times a step): the first
    candidate is kept, and the reason and a warning say it was never timed and why."""
    import warnings

    from hvd_topk import auto
    trial = auto.Trial(["dense", "allgather"], 1, agree=lambda values: values)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(12):
            trial.skip()
            with _clock(float(step)):
                if trial.step_done(step):
                    break
    assert trial.choice == "dense" and trial.candidates.count("allgather") == 1 + auto.Trial.RETRIES
    assert "timed no step of its trial on any rank" in trial.reason() and "optimizer.step()" in trial.reason()
    assert [str(w.message) for w in caught if "timed no step" in str(w.message)], caught


class _clock:
    """``auto.time.perf_counter`` reads ``t`` inside the block."""

    def __init__(self, t):
        self.t = t

    def __enter__(self):
        from hvd_topk import auto
        self.saved, auto.time = auto.time, SimpleNamespace(perf_counter=lambda: self.t)

    def __exit__(self, *exc):
        from hvd_topk import auto
        auto.time = self.saved


def test_a_trial_taken_over_decides_with_the_others_after_retries():
    """Every step untimed (the scaler skipped them all): families run again, twice at most, then
    the trial decides. A rank that took the trial over halfway (an elastic replacement: the
    record) must decide at the same step; it counted no retries of its own and went on
    appending candidates, so the ranks ran different families (the job died in the param-group
    check). The retries are read from the candidates now, which the record carries."""
    from hvd_topk import auto

    def run(trial, start, steps):
        out = []
        for step in range(start, start + steps):
            family = trial.family()
            trial.skip()
            out.append((family, trial.step_done(step)))
        return out

    old = auto.Trial(["allgather", "dense"], 1, agree=lambda values: values.clone())
    first = run(old, 0, 8)
    assert not any(decided for _, decided in first) and old.candidates.count("dense") == 3, old.candidates
    new = auto.Trial.resume(old.record(), 1, agree=lambda values: values.clone())
    assert run(new, 8, 4) == run(old, 8, 4)
    assert new.choice == old.choice == "allgather" and new.decided_at == old.decided_at == 11


@pytest.mark.parametrize("recheck", [1, 3])
def test_a_recheck_comes_after_n_steps_with_the_choice(recheck):
    """``exchange_recheck_steps=N``: after each decision the chosen family runs N steps, then
    the trial runs again (api.md: "every N steps plus the trial's own length"). Counted step by
    step: each trial is a new ``Trial``, and between two of them N steps use the choice. Before
    2026-12-06 the step that decided counted as one of the N: N - 1 steps, and with N = 1 the
    chosen family never ran (trial after trial)."""
    plan, _ = planner(exchange="auto", exchange_recheck_steps=recheck, exchange_trial_steps=1)
    plan._agree = lambda medians: medians  # one rank: its own medians (no Horovod job)
    plan._announce = lambda world: None
    trials, after_choice = [], []
    for step in range(60):
        plan.family(step, 2)
        if not trials or plan.trial is not trials[-1]:
            trials.append(plan.trial)
            after_choice.append(0)
        elif plan.trial.choice is not None:
            after_choice[-1] += 1
        plan.step_done(step, 2)
    length = 2 * len(trials[0].candidates)  # one settling and one timed step per candidate
    assert len(trials[0].candidates) >= 2, trials[0].candidates
    assert len(trials) >= 60 // (length + recheck), len(trials)
    assert after_choice[:-1] == [recheck] * (len(trials) - 1), after_choice
