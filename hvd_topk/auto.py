"""``exchange="auto"``: the cost model proposes strategies, a short measured trial picks one.

Bytes alone do not decide which exchange is fastest: the sparse strategies spend CPU (or GPU)
time selecting and decoding that a fast network would not, and a dense fp16 allreduce spends
time casting. So, per job:

1. **Proposal** (``propose``): for each strategy family (dense fp32, dense fp16 where values
   already travel in 16 bits, allgather, sparse allreduce, and with ``hvd_topk.init()``'s host sets the two sparse ones run
   hierarchically: ``hier_allgather``, ``hier_sparse_allreduce``) the engine works out what each bucket would use (a sparse family still
   sends a bucket dense where that moves fewer bytes, as ``dense_fallback`` does) and the
   bytes per step (``hvd_topk.exchange`` cost functions). Families that would do the same as
   another, and sparse families moving at least as many bytes as dense, are dropped:
   they cannot be faster.
2. **Trial** (``Trial``): each remaining family runs ``trial_steps`` real training steps (plus
   one to settle after each switch); the time from one ``synchronize()`` to the next is the
   measure, i.e. the whole step the user runs. The median per family is averaged over the
   ranks (the transport's allreduce, ``agree``: one for the steps some rank could not time,
   one for the medians, more where a family no rank timed runs again), so every rank takes
   the same, fastest, family.
3. The choice holds until the world size changes (Horovod elastic), a checkpoint is loaded
   (or the root's record adopted after ``broadcast_optimizer_state``) or, with
   ``recheck_steps``, that many steps have passed since the decision; then the trial runs
   again.

Every trial step is a correct training step under the family it uses; only the speed differs.
"""

import statistics
import sys
import time
import warnings

import torch

from hvd_topk._stack import outside_level
from hvd_topk.checks import SPARSE_EXCHANGES

HIER = "hier_"  # prefix of the hierarchical families (hvd_topk.hierarchy)
TRIAL_STEPS = 3  # exchange_trial_steps' default, both transports: timed steps per candidate family


# Why ``families(updates=True)`` leaves the sparse allreduce out, said where auto's choice is
# reported. Measured on the GPT example, 4 ranks, 3 seeds (docs/adamw-measurements.md, "At 0.1%,
# and over the sparse allreduce"): LocalAdamW at 1% ended +7.3% against dense AdamW over the
# sparse allreduce and +0.6% over the allgather. The sparse allreduce moves k entries a step
# whatever P, the allgather up to P k, and each rank's update (not its gradient) needs the
# entries; auto picks by speed alone, so it must not be offered a quality loss as an option.
UPDATES_NOTE = ("the sparse allreduce not tried: the inner optimizer exchanges each rank's update, and "
                "over it that was measured to cost quality from 4 ranks on (docs/adamw.md); pin exchange= to use it")


# Why ``families(momentum=True)`` leaves dense out: DeMo's residual (decayed each step by its beta,
# or at beta 1.0 not at all) is its momentum (``optim.momentum_in_residual``; a ``residual_decay``
# added to error feedback is none), and a dense exchange sends it whole and zeroes it, so
# the step under dense has no momentum (and DeMo's sign descent moves every entry). Picking
# dense for speed would change the algorithm; for the same reason such a residual never takes
# the dense fallback below density 1 (at 1, a dense start, Top-K sends everything anyway), and
# a rank alone sends pairs too (``hvd_topk.planner``, the DDP hook's ``ddp_exchange.choose``).
# A step on which a rank sits inside ``hvd.join()`` still goes dense (Horovod's joined ranks
# answer allreduces only).
MOMENTUM_NOTE = ("dense not tried: the residual is DeMo's momentum, "
                 "which a dense exchange would send whole and zero; pin exchange='dense' to use it")


def keeps_momentum(momentum, density=None):
    """Whether the residual is a momentum a dense exchange would wipe (``MOMENTUM_NOTE``): the
    inner optimizer keeps its momentum there (``momentum``: ``optim.momentum_in_residual``,
    DeMo's accumulator, not a decay added to error feedback), and at ``density`` (where given)
    Top-K would not send all of it anyway (at 1, a dense start, it does, so dense's fewer bytes
    may be taken)."""
    return momentum and (density is None or density < 1)


def left_out(updates, momentum):
    """What ``families(updates=..., momentum=...)`` leaves out and why (for ``Trial``), or None."""
    return "; ".join(note for note, on in ((MOMENTUM_NOTE, momentum), (UPDATES_NOTE, updates)) if on) or None


def families(hierarchical_available, hierarchical_only, compact=False, fp16=False, updates=False, momentum=False):
    """The families a job may use: dense, the two sparse ones, and those run hierarchically
    where the host sets exist; only the hierarchical ones (and dense) with ``hierarchical=True``.
    With compact pairs (``hvd_topk.compact``: the allgather's alone) dense and the flat
    allgather. Dense fp16 only with ``fp16``: where the values already travel in 16 bits
    (``TopK(fp16_values=True)`` or ``compact=True``, whose dense fallback is fp16 too). For
    fp32 values it would be a silent change of precision: an entry above 65504 arrives as inf. With ``updates`` (``auto``
    over an inner optimizer that exchanges each rank's update: LocalAdamW, DeMo) no sparse
    allreduce, flat or hierarchical (``UPDATES_NOTE``). With ``momentum`` (a decayed residual) no
    dense family (``MOMENTUM_NOTE``)."""
    dense = () if momentum else ("dense", "dense_fp16") if fp16 or compact else ("dense",)
    sparse = ("allgather",) if compact or updates else SPARSE_EXCHANGES
    if compact:
        return dense + sparse
    hier = tuple(HIER + f for f in sparse)
    if not hierarchical_available:
        return dense + sparse
    if hierarchical_only:
        return dense + hier
    return dense + sparse + hier


UNTIMED_NOTE = ("a step is timed only after one every rank took part in (not after a step some rank sat out "
                "in a join), and in the Horovod optimizer only once the inner optimizer's step() ran after the last "
                "synchronize() (not after a GradScaler's skipped step): call optimizer.step() every step, or pin "
                "exchange=")


class Trial:
    """The measured trial of one job shape: which family each step uses, and the decision.

    Args:
        candidates: family names to try, in a fixed order (the same on every rank).
        trial_steps: measured steps per candidate (after one settling step each).
        agree: the transport's one decision collective: a float64 tensor in, the ranks'
            average out (Horovod's allreduce, or torch.distributed's). Called twice, at the
            decision only.
        left_out: what the trial was not offered, and why (``UPDATES_NOTE``), added to ``reason``.

    Steps that would mislead are not timed, on any rank: the step after one a rank sat out
    inside ``hvd.join()`` (it holds the wait), or, in the Horovod optimizer, after one whose
    inner step did not run (a ``GradScaler`` skipped it after an overflow, common in the first
    steps; the DDP hook cannot see the optimizer and times those). Each rank marks
    what it could not time (``skip``), and the decision drops the union of the marks, so a
    rank that joined and does not know it drops that step too. A candidate with no timed step
    on any rank runs again (``RETRIES`` times) rather than being ruled out.
    """

    RETRIES = 2

    def __init__(self, candidates, trial_steps, agree, left_out=None):
        self.candidates = list(candidates)  # one slot of per_candidate steps each; retries appended
        self.left_out = left_out
        self.trial_steps = trial_steps
        self.agree = agree
        self.samples = {}          # trial position -> seconds, this rank's timed steps
        self.untimed = set()       # trial positions this rank could not time (after a ``skip``)
        self.times = None          # {family: [seconds]}, the samples the decision used
        self.position = 0          # steps run since the trial started
        self.last_end = None       # perf_counter at the previous synchronize's end
        self.choice = self.candidates[0] if len(self.candidates) == 1 else None
        self.medians = None        # {family: seconds}, once decided
        self.decided_at = None     # step counter at the decision
        self.adopted = False       # taken over from another rank's record (``resume``)

    def record(self):
        """The trial's progress as plain values, without this rank's timings: what another rank
        needs to go on with it in step (``resume``)."""
        return tuple(self.candidates), self.position, self.choice, self.decided_at

    @classmethod
    def resume(cls, record, trial_steps, agree, left_out=None):
        """A trial at ``record``'s point (another rank's ``record()``). The steps timed before it
        are not this rank's: it has no time for them, and the decision takes the other ranks'
        (a candidate no rank timed runs again)."""
        candidates, position, choice, decided_at = record
        trial = cls(candidates, trial_steps, agree, left_out)
        trial.position, trial.choice, trial.decided_at, trial.adopted = position, choice, decided_at, True
        return trial

    def skip(self):
        """The step just done misleads the next one's timing (a rank sat it out inside
        ``hvd.join()``, or its inner step did not run): the next step is not timed."""
        self.last_end = None

    @property
    def per_candidate(self):
        return self.trial_steps + 1

    @property
    def families(self):
        """The candidates, each once."""
        return list(dict.fromkeys(self.candidates))

    def family(self):
        """The family the current step uses."""
        if self.choice is not None:
            return self.choice
        return self.candidates[min(self.position // self.per_candidate, len(self.candidates) - 1)]

    def step_done(self, step):
        """Call at the end of every ``synchronize()``; returns True when this call decided."""
        now = time.perf_counter()
        last, self.last_end = self.last_end, now
        if self.choice is not None:
            return False
        if self.position % self.per_candidate > 0:  # offset 0 settles after a switch
            if last is None:
                self.untimed.add(self.position)
            else:
                self.samples[self.position] = now - last
        self.position += 1
        if self.position < self.per_candidate * len(self.candidates):
            return False
        return self._decide(step)

    def _decide(self, step):
        """Every rank's medians over the steps no rank marked untimed, averaged over the ranks
        that timed each family; True when decided, False when a family runs again."""
        marks = torch.zeros(self.position, dtype=torch.float64)
        marks[sorted(self.untimed)] = 1.0
        dropped = self.agree(marks) > 0
        families = self.families
        self.times = {f: [] for f in families}
        for position, seconds in sorted(self.samples.items()):
            if not dropped[position]:
                self.times[self.candidates[position // self.per_candidate]].append(seconds)
        mine = [statistics.median(self.times[f]) if self.times[f] else 0.0 for f in families]
        timed = [1.0 if self.times[f] else 0.0 for f in families]
        agreed = self.agree(torch.tensor(mine + timed, dtype=torch.float64)).tolist()
        total, ranks = agreed[:len(families)], agreed[len(families):]
        medians = {f: t / r if r > 0 else float("inf") for f, t, r in zip(families, total, ranks)}
        # the retries counted from the candidates, which the record carries: a rank that took the
        # trial over (``resume``) decides at the same step as the others
        again = [f for f in families
                 if medians[f] == float("inf") and self.candidates.count(f) - 1 < self.RETRIES]
        if again:
            self.candidates.extend(again)
            return False
        self.medians = medians
        self.choice = min(families, key=lambda f: (medians[f], families.index(f)))
        self.decided_at = step
        if all(m == float("inf") for m in medians.values()):
            warnings.warn(f"hvd_topk: exchange='auto' {self.reason()}", stacklevel=outside_level())
        return True

    def reason(self):
        """Why the trial chose (or has not yet chosen), and what it was not offered."""
        if self.medians is None:
            if self.choice is not None and self.adopted:
                why = "taken from the root rank's optimizer state (hvd.broadcast_optimizer_state)"
            elif self.choice is not None:
                why = "the only candidate the cost model left"
            else:
                why = f"trial in progress ({self.position} of {self.per_candidate * len(self.candidates)} steps)"
        elif all(t == float("inf") for t in self.medians.values()):
            why = (f"timed no step of its trial on any rank, so {self.choice}, its first candidate, is "
                   f"kept untimed: {UNTIMED_NOTE}")
        else:
            listed = ", ".join(f"{c} {1e3 * t:.1f}" for c, t in self.medians.items())
            why = f"fastest in the measured trial (median step ms, mean over ranks: {listed})"
        return f"{why}; {self.left_out}" if self.left_out else why


def propose(assignments, byte_counts):
    """The families worth a trial, in the order of ``assignments``.

    ``assignments``: family -> tuple of the strategy names its buckets would use;
    ``byte_counts``: family -> modelled bytes into one rank per step. A family that assigns
    exactly what an earlier one does is dropped, and so is a sparse family moving at least as
    many bytes as the cheapest dense one (more bytes and a selection on top cannot be faster).
    """
    chosen, seen = [], set()
    dense = min((byte_counts[f] for f in ("dense", "dense_fp16") if f in byte_counts), default=None)
    for family in assignments:
        if assignments[family] in seen:
            continue
        if family.removeprefix(HIER) in SPARSE_EXCHANGES and dense is not None and byte_counts[family] >= dense:
            continue
        seen.add(assignments[family])
        chosen.append(family)
    return chosen


def announce(text, rank):
    """One line on stderr from ``rank`` 0 (the first rank of the ranks the choice is for; it
    is made once per job shape)."""
    if rank == 0:
        print(f"hvd_topk: {text}", file=sys.stderr, flush=True)
