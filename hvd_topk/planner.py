"""Which exchange each bucket uses this step: the strategy family, the cost model, the trial.

``ExchangePlanner`` answers three questions for the engine, from nothing but the options, the
buckets, the step counter and the world size, so that every rank answers alike without
talking:

- ``family(step, world)``: this step's strategy family, ``exchange=`` itself or, under
  ``"auto"``, the one ``hvd_topk.auto``'s measured trial found fastest (during the density
  warm-up, before any trial, the family modelled to move the fewest bytes);
- ``strategy(family, bucket, codec_plan, world)``: what one bucket uses under that family (a
  sparse family still sends a bucket dense where a ring allreduce moves fewer bytes:
  ``dense_fallback``);
- ``codec_plan(bucket, density, family, world)``: the codec's ``Plan`` for the bucket, over the whole
  buffer or, for a hierarchical family, over this rank's shard of it.

It knows nothing of Horovod's collectives beyond the trial's one decision allreduce
(``_agree``, handed to ``auto.Trial``); the DDP hook runs the same trial over torch.distributed.
"""

import itertools

from hvd_topk import auto, exchange
from hvd_topk._horovod import allreduce_dtype, hvd
from hvd_topk.buckets import BucketStep
from hvd_topk.codec import shard_bounds


class ExchangePlanner:
    """Strategy choice, cost model and the ``exchange="auto"`` trial of one optimizer.

    Args:
        options: ``hvd_topk.options.Options``.
        buckets: the optimizer's buckets (``hvd_topk.buckets``), the same on every rank.
        codec: the ``hvd_topk.codec.Codec`` (its value dtype decides the bytes per pair).
        schedule: the ``DensitySchedule``.
        hier: this rank's ``hierarchy.Topology`` where the hierarchical families may be used.
        process_set, name: where and under which name the trial's decision is agreed.
        updates: the inner optimizer exchanges each rank's update (LocalAdamW, DeMo): ``auto``
            then leaves the sparse allreduce out (``auto.UPDATES_NOTE``); a pinned one is used.
        momentum: the residual is the inner optimizer's momentum (``optim.momentum_in_residual``:
            DeMo's), so ``auto`` leaves dense out (``auto.MOMENTUM_NOTE``) and no bucket falls
            back to dense below density 1.
    """

    def __init__(self, options, buckets, codec, schedule, hier, process_set, name, updates=False, momentum=False):
        self.options, self.buckets, self.codec, self.schedule = options, buckets, codec, schedule
        self.hier = hier
        self.process_set, self.name = process_set, name
        # only auto's families are narrowed: family() maps a pinned exchange through them too
        narrowed = options.exchange == "auto"
        # a residual that is the inner optimizer's momentum (DeMo) is not sent whole by choice (no
        # dense family, no dense fallback below density 1, a rank alone sends pairs too:
        # auto.MOMENTUM_NOTE); a decay added to error feedback is no momentum (optim.momentum_in_residual)
        self.keeps_residual = auto.keeps_momentum(momentum)
        updates, momentum = updates and narrowed, self.keeps_residual and narrowed
        self.left_out = auto.left_out(updates, momentum)
        self.families = auto.families(hier is not None, options.hierarchical is True, codec.compact,
                                      codec.dense_fp16, updates=updates, momentum=momentum)
        self.trial, self.trial_world = None, None  # exchange="auto": the trial of this world size

    @staticmethod
    def hierarchical(family):
        return family.startswith(auto.HIER)

    def family(self, step, world):
        """This step's strategy family (see the module docstring)."""
        mode = self.options.exchange
        if mode != "auto":
            return auto.HIER + mode if auto.HIER + mode in self.families else mode
        if world <= 1:
            return "allgather" if self.keeps_residual else "dense"
        density = self.schedule.density(step)
        if density != self.schedule.target:  # density warm-up: no trial yet; the fewest bytes
            # among the flat families: the model counts a hierarchical family's bytes across
            # hosts only (not its two stages inside a host), so against a flat one it always
            # looks cheapest, measured or not; the trial times the hierarchical ones. (With
            # hierarchical=True there is no flat sparse family: the hierarchical ones compete.)
            flat = [f for f in self.families if not self.hierarchical(f)]
            pool = flat if self.options.hierarchical is not True else self.families
            return min(pool, key=lambda f: self.modelled_bytes(f, density, world))
        recheck = self.options.exchange_recheck_steps
        # decided_at is the trial's last step: the choice runs ``recheck`` steps after it
        if (self.trial is None or self.trial_world != world
                or (recheck and self.trial.decided_at is not None
                    and step - self.trial.decided_at > recheck)):
            self._start_trial(density, world)
        return self.trial.family()

    def _start_trial(self, density, world):
        assignments = {}
        sparse_buckets = [b for b in self.buckets if b.sparse]
        for f in self.families:
            strategies = self._assign(f, density, world)
            hierarchical = any(s.sparse and self.runs_hierarchically(b, f) for b, s in zip(sparse_buckets, strategies))
            assignments[f] = (hierarchical, tuple(s.name for s in strategies))
        byte_counts = {f: self.modelled_bytes(f, density, world) for f in self.families}
        candidates = auto.propose(assignments, byte_counts)
        self.trial = auto.Trial(candidates, self.options.exchange_trial_steps, self._agree, self.left_out)
        self.trial_world = world
        if self.trial.choice is not None:
            self._announce(world)

    def _announce(self, world):
        """auto's choice, said once, by the first rank of the process set the exchange runs over
        (hvd.rank() 0 may be outside it)."""
        auto.announce(f"exchange={self.trial.choice} for {world} ranks ({self.trial.reason()})",
                      self.process_set.rank())

    def _agree(self, medians):
        """The trial's decision: every rank's medians averaged by one Horovod allreduce."""
        return hvd.allreduce(medians, name=self.name, op=hvd.Average, process_set=self.process_set)

    def step_done(self, step, world):
        """End of a step's ``synchronize()``: the trial counts the step (and may decide)."""
        if self.trial is None or self.options.exchange != "auto" or self.trial_world != world \
                or self.schedule.density(step) != self.schedule.target:
            return
        if self.trial.step_done(step):
            self._announce(world)

    def forget_trial(self):
        """Measure again from here (a restored checkpoint: every rank restarts alike)."""
        self.trial, self.trial_world = None, None

    def timing(self):
        """Whether auto's trial is timing steps now."""
        return self.trial is not None and self.trial.choice is None

    def skip_step(self):
        """A step not to time the next one from: some rank sat it out inside ``hvd.join()`` (it
        is not counted either), or its inner step did not run (``Trial.skip``)."""
        if self.trial is not None:
            self.trial.skip()

    def trial_record(self):
        """The trial's progress as plain values (``auto.Trial.record`` and its world size), or None."""
        return None if self.trial is None else (self.trial_world, *self.trial.record())

    def adopt_trial(self, record):
        """Go on with another rank's trial (``trial_record()``'s output; None: no trial)."""
        if record is None:
            self.forget_trial()
            return
        world, *rest = record
        self.trial = auto.Trial.resume(rest, self.options.exchange_trial_steps, self._agree, self.left_out)
        self.trial_world = world

    def bucket_step(self, bucket, step, family, world, rank):
        """``bucket``'s ``BucketStep`` under ``family``: codec plan, strategy, whether it runs
        hierarchically, and which of the plan's segments this rank selects (all; with the
        sparse allreduce its part's; none for a dense exchange). The engine adds the send
        buffer and the encoder."""
        density = self.schedule.density(step)
        codec_plan = self.codec_plan(bucket, density, family, world) if bucket.sparse else None
        strategy = self.strategy(family, bucket, codec_plan, world)
        hierarchical = strategy.sparse and self.runs_hierarchically(bucket, family)
        led = None  # all: the allgather; hierarchical (the cross stage chooses its own, inflight)
        if not strategy.sparse:
            led = range(0)
        elif strategy is exchange.SparseAllreduce and not hierarchical:
            led = codec_plan.part_segments(exchange.SparseAllreduce.part(rank, step, bucket.index, world))
        return BucketStep(codec_plan, strategy, None, None, led, hierarchical=hierarchical)

    def strategy(self, family, bucket, codec_plan, world):
        """The strategy ``bucket`` uses under ``family``."""
        if not bucket.sparse:
            return exchange.DenseAllreduce
        chosen = exchange.BY_NAME[family.removeprefix(auto.HIER)]
        if not chosen.sparse or not self.options.dense_fallback \
                or auto.keeps_momentum(self.keeps_residual, codec_plan.density):
            return chosen
        # with 16-bit values or compact pairs on the wire the dense fallback is 16-bit too
        dense = exchange.DenseAllreduceFp16 if self.codec.dense_fp16 else exchange.DenseAllreduce
        if self.runs_hierarchically(bucket, family):
            # the sparse part runs across hosts, on one shard; a shard selected whole (a dense
            # start) would cross as pairs, more than its values alone: the bucket goes dense
            if codec_plan.density >= 1:
                return dense
            return chosen if self._sparse_bytes(chosen, bucket, codec_plan, world, family) \
                < self.wire_bytes(dense, world, bucket, codec_plan) else dense
        return min((dense, chosen), key=lambda s: self.wire_bytes(s, world, bucket, codec_plan))

    def wire_bytes(self, strategy, world, bucket, codec_plan):
        """Bytes into one rank for ``bucket`` (its ``codec_plan``: pairs and their sizes) sent by
        ``strategy`` among ``world`` ranks, in the dtypes Horovod moves them in: an allreduce
        of a dtype it cannot reduce (bfloat16, ``allreduce_dtype``) runs in float32, so a
        bfloat16 bucket's dense allreduce and its sparse allreduce's values count 4 bytes an
        element; the allgather's pairs travel as they are. The elements counted are the whole
        bucket's even where ``codec_plan`` is one host shard's: a dense exchange moves the whole
        bucket, and every rank of a host must model the same (tests/test_planner.py)."""
        value_bytes, index_bytes = self.codec.pair_itemsizes(codec_plan)
        if strategy is exchange.SparseAllreduce:
            value_bytes = allreduce_dtype(codec_plan.layout.value_dtype).itemsize
        return strategy.wire_bytes(world, bucket.numel, codec_plan.count, value_bytes, index_bytes,
                                   allreduce_dtype(bucket.grad_dtype).itemsize)

    def runs_hierarchically(self, bucket, family):
        """Whether ``bucket``'s sparse exchange under ``family`` runs in the host and cross-host
        stages: a hierarchical family and a bucket of at least one element per rank of a host.
        A smaller one (only with ``min_numel`` lowered) would leave some rank an empty shard; it
        is exchanged flat, with the family's strategy over the whole job."""
        return self.hierarchical(family) and self.hier is not None and bucket.numel >= self.hier.local_size

    def _shard_plans(self, bucket, codec_plan):
        """The codec plans of every local rank's shard of ``bucket``, at ``codec_plan``'s density
        and parts (``codec_plan``: this rank's)."""
        edges = shard_bounds(bucket.numel, self.hier.local_size)
        return [bucket.plan(self.codec, codec_plan.density, codec_plan.scope, shard=shard, parts=codec_plan.parts)
                for shard in itertools.pairwise(edges)]

    def _sparse_bytes(self, strategy, bucket, codec_plan, world, family):
        """Bytes into one rank for ``bucket`` sent by the sparse ``strategy``. A hierarchical
        family's sparse part runs among the ranks across hosts, on one shard: counted for the
        costliest shard, not this rank's (``codec_plan``), so that every rank of a host takes
        the same decisions from it. Shards differ by an element, their k (rounded per tensor
        piece) by as much as a few pairs; ranks on both sides of break-even would choose
        different collectives and wait on each other."""
        if not self.runs_hierarchically(bucket, family):
            return self.wire_bytes(strategy, world, bucket, codec_plan)
        return max(self.wire_bytes(strategy, self.hier.cross_size, bucket, plan)
                   for plan in self._shard_plans(bucket, codec_plan))

    def _assign(self, family, density, world):
        """The strategy of every sparse bucket under ``family`` at ``density``."""
        return [self.strategy(family, b, self.codec_plan(b, density, family, world), world)
                for b in self.buckets if b.sparse]

    def codec_plan(self, bucket, density, family, world):
        """The codec plan of a sparse bucket: over the bucket, or over this rank's shard of it
        (a hierarchical family, see ``runs_hierarchically``). On its 1/L shard a rank selects
        at L x density, so that it still sends density x n pairs per step, as it would flat: a
        host then sends as many pairs as its L ranks would, taken from the host's sum. Under the sparse allreduce the
        bucket (or shard) is cut into one part per rank taking part (``codec.Plan``'s
        ``parts``)."""
        scope = self.options.selection_scope
        sparse_allreduce = family.removeprefix(auto.HIER) == exchange.SparseAllreduce.name
        if not self.runs_hierarchically(bucket, family):
            return bucket.plan(self.codec, density, scope, parts=world if sparse_allreduce else 1)
        return bucket.plan(self.codec, min(1.0, density * self.hier.local_size), scope,
                           shard=self.shard(bucket), parts=self.hier.cross_size if sparse_allreduce else 1)

    def shard(self, bucket):
        """``(lo, hi)``: this rank's shard of ``bucket`` in the host's reduce-scatter."""
        edges = shard_bounds(bucket.numel, self.hier.local_size)
        return edges[self.hier.local_rank], edges[self.hier.local_rank + 1]

    def modelled_bytes(self, family, density, world):
        """Bytes into one rank per step for the sparse buckets under ``family`` (the cost model)."""
        total = 0.0
        sparse = [b for b in self.buckets if b.sparse]
        for b, strategy in zip(sparse, self._assign(family, density, world)):
            codec_plan = self.codec_plan(b, density, family, world)
            if strategy.sparse:
                total += self._sparse_bytes(strategy, b, codec_plan, world, family)
            else:
                total += self.wire_bytes(strategy, world, b, codec_plan)
        return total

    def describe(self, world, step):
        """The ``exchange_*`` entries of ``compression_stats()`` before ``step``."""
        out = {"exchange": self.options.exchange}
        if self.options.exchange == "auto":
            out["exchange_reason"] = self.trial.reason() if self.trial is not None else (
                ("one rank: the residual is DeMo's momentum, so pairs, as on more ranks" if self.keeps_residual else
                 "one rank: nothing to exchange") if world <= 1 else
                "density warm-up: fewest bytes" if self.schedule.density(step) != self.schedule.target else
                "a trial starts at the next step (none yet, or a checkpoint was loaded)")
            if self.trial is not None:
                out["exchange_candidates"] = self.trial.families
                out["exchange_choice"] = self.trial.choice
                out["exchange_median_step_s"] = dict(self.trial.medians or {})
        return out
