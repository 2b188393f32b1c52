"""The error-feedback optimizer's options: one frozen dataclass, validated once, and the tuning
guide (``hvd_topk.DistributedOptimizer``'s docstring points here)."""

import dataclasses
import numbers

from hvd_topk import auto
from hvd_topk.checks import (DENSE_EXCHANGES, EXCHANGES, check_choice, check_density, check_flag, check_integer,
                             check_number, check_residual_decay, warn_ignored)
from hvd_topk.schedule import DEFAULT_START

SCOPES = ("tensor", "bucket")
HIERARCHICAL = ("auto", True, False)


@dataclasses.dataclass(frozen=True)
class Options:
    """The error-feedback optimizer's options (``hvd_topk.DistributedOptimizer`` keywords).

    Tuning, in order of what matters most:

    - Start at density 1% (``TopK(density=0.01)``) with ``error_feedback=True``: on the digits
      example it costs about half a point of accuracy (98.5% against 99.1%). Error feedback is what keeps accuracy; without it the
      entries not sent are lost.
    - Going to 0.1% saves another ~4x of bytes and costs accuracy (digits: 97.3% against 98.5%
      at 1%, 3 seeds). DGC's advice for it, not measured here: ``warmup_steps`` of about one
      epoch (its exponential warm-up from ``warmup_density``) and SGD's momentum moved into
      ``momentum_correction`` (the inner optimizer's momentum set to 0). What is sent whole
      (tensors below ``min_numel``, a bucket sent dense) then trains as momentum SGD.
    - AdamW (``hvd_topk.LocalAdamW`` as the inner optimizer): ``warmup_steps=100`` with
      ``warmup_density=1.0``, a dense start; on long runs whose learning rate warms up for 500
      steps or more, ``warmup_steps`` = the warm-up's steps. Measured on the GPT example: at
      10,000 steps the 100-step start ended 10% behind dense AdamW, the start over the warm-up
      0.5% (3 seeds); at 5000 steps (a 500-step warm-up) the 100-step start 5.5% behind, the
      start over the warm-up 1.8% (3 seeds; 1.3% over five); at 3000 steps (a 300-step
      warm-up) 100 steps did as well (docs/adamw.md).
    - ``selection_scope="bucket"`` selects one top-k over each fusion bucket (k = density x the
      bucket's size) instead of k per tensor: a layer with large gradients gets more of the
      budget, often better per byte. ``"tensor"`` (default) is the per-tensor contract.
    - Keep ``min_numel`` so that biases and norms stay dense: they are cheap and sensitive.
    - ``exchange`` picks how buckets travel (``hvd_topk.exchange``). ``"auto"`` (default) runs
      ``exchange_trial_steps`` real steps with each strategy the cost model proposes (dense
      fp32, dense fp16, allgather, sparse allreduce) and keeps the fastest: on a fast network
      that may be dense, which is the point (never slower than not compressing). Over an inner
      optimizer that exchanges each rank's update (``LocalAdamW``, ``DeMo``) it does not try the
      sparse allreduce, which cost those quality from 4 ranks on (``auto.UPDATES_NOTE``). Force one with
      ``"allgather"`` (every rank's pairs; bytes grow with P), ``"sparse_allreduce"`` (each rank
      chooses one part's positions, values allreduced; bytes grow as (P-1)/P: the one for many ranks),
      ``"dense"`` or ``"dense_fp16"``. ``exchange_recheck_steps`` re-runs the trial that often
      (0: only when the world size changes). Pin one for quality experiments on a single
      host, where ``"auto"`` may rightly pick dense and the run then tests no compression.
    - ``dense_fallback`` sends a bucket dense when a ring allreduce would move no more bytes than
      the sparse strategy (the allgather at density >= 1/P for fp32): leave it on.
    - ``hierarchical`` (``hvd_topk.hierarchy``): a dense reduce-scatter inside each host, Top-K
      and error feedback on this rank's shard of the host's sum, the sparse exchange only
      across hosts. ``"auto"``: on when ``hvd_topk.init()`` made the process sets and the job has
      several hosts, each with the same number of ranks, more than one.
    - ``residual_decay`` (1.0: none) multiplies every residual by this factor each step before
      the new gradient is folded in (DeMo's and SparseLoCo's decayed accumulator): an entry
      that waits D steps carries ``sum decay^(D-s) g_s``, so old, stale work fades instead of
      arriving in full long after it was computed. 0.999 forgets little over the ~100 steps an
      entry waits at 1%; 0.99 about two thirds. One extra pass over the residual per step.
      Measured with ``LocalAdamW`` on a small GPT: at 1% no gain; at 0.1% (an entry waits
      ~1000 steps) 0.99 with twice the learning rate cut the gap to dense AdamW fourfold.
    - ``fusion_bytes``: the dense-equivalent size of a sparse bucket. Larger buckets mean fewer
      messages; smaller ones start exchanging earlier in backward.
    """

    error_feedback: bool = True
    momentum_correction: float = 0.0
    warmup_steps: int = 0
    warmup_density: float = DEFAULT_START
    min_numel: int = 1024
    fusion_bytes: int = 64 * 1024 * 1024
    dense_fallback: bool = True
    selection_scope: str = "tensor"
    sparse_as_dense: bool = False
    exchange: str = "auto"
    exchange_trial_steps: int = auto.TRIAL_STEPS
    exchange_recheck_steps: int = 0
    hierarchical: object = "auto"
    residual_decay: float = 1.0

    def __post_init__(self):
        for key in ("error_feedback", "dense_fallback", "sparse_as_dense"):
            check_flag(getattr(self, key), key)
        for key, low in (("warmup_steps", 0), ("min_numel", 0), ("fusion_bytes", 1),
                         ("exchange_trial_steps", 1), ("exchange_recheck_steps", 0)):
            check_integer(getattr(self, key), key, low)
        m = check_number(self.momentum_correction, "momentum_correction")
        if not 0.0 <= m < 1.0:
            raise ValueError(f"momentum_correction must be in [0, 1), got {m!r}")
        if m and not self.error_feedback:
            raise ValueError("momentum_correction needs error_feedback=True")
        check_density(self.warmup_density, "warmup_density")
        check_residual_decay(self.residual_decay, self.error_feedback)
        check_choice(self.selection_scope, "selection_scope", SCOPES)
        check_choice(self.exchange, "exchange", EXCHANGES)
        # True == 1 in Python: an integer 1 or 0 would pass a plain ``in`` test
        if isinstance(self.hierarchical, numbers.Number) and not isinstance(self.hierarchical, bool):
            raise ValueError(f"hierarchical must be 'auto', True or False, got {self.hierarchical!r}")
        check_choice(self.hierarchical, "hierarchical", HIERARCHICAL, "'auto', True or False")
        if self.hierarchical is True and self.exchange in DENSE_EXCHANGES:
            raise ValueError(f"hierarchical=True sends sparse pairs across hosts, exchange={self.exchange!r} every "
                             "bucket dense: pass one or the other")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        warn_ignored(self.exchange, **{name: (getattr(self, name), defaults[name])
                                          for name in ("exchange_trial_steps", "exchange_recheck_steps",
                                                       "selection_scope", "dense_fallback", "warmup_steps",
                                                       "warmup_density")})
