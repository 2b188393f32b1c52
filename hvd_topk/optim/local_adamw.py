"""``LocalAdamW``: Adam on each rank's own gradient before the exchange, so that what Top-K
with error feedback compresses is the update (summed linearly); the ranks' average variance
estimated (``global_variance``) or measured (``variance_sketch``). The recipe: docs/adamw.md."""

import math
import warnings

import torch

from hvd_topk import variance_sketch
from hvd_topk._stack import outside_level
from hvd_topk.checks import check_flag, check_integer
from hvd_topk.optim._common import (_ExchangedUpdates, _adam_denominator, _group_of,
                                    _new_adam_state, _check_adam_options)


class LocalAdamW(_ExchangedUpdates):
    """AdamW run by each rank on its own gradient, before the exchange: what Top-K with error
    feedback compresses is Adam's *update*, and the step applies the ranks' average of it.

    Why: error feedback is exact for what is summed linearly, and updates are (a step adds
    them), while Adam's division by ``sqrt(v)`` is not linear in the gradient: Top-K before
    AdamW lets late, bursty gradients inflate ``v`` and be normalised away. Here each rank's
    ``v`` sees every one of its gradients in full precision, and the residual keeps each entry's
    unsent update until Top-K sends it.

    ``beta1`` defaults to 0: the residual already carries each entry's unsent past, and a
    momentum on top of it delays the update once more; measured, both a beta1 of 0.9 and a
    momentum applied after the exchange trained worse (docs/adamw.md).

    Use it only as the inner optimizer of ``hvd_topk.DistributedOptimizer`` (Horovod) or of
    ``hvd_topk.ddp.TopKState(optimizer=...)`` (torchrun + DDP), which hand it each rank's
    gradient through ``transform_local_gradient`` (its hook for this); with
    ``warmup_steps=100, warmup_density=1.0`` it starts (nearly) dense, which helped. After
    ``synchronize()`` (Horovod) or ``backward()`` (DDP), ``p.grad`` holds the averaged update,
    so do not clip it. No GradScaler (fp16 loss scaling would mix scales in the moments; use
    bf16 autocast). Each rank's ``exp_avg_sq`` follows its own gradients, so the moments differ
    between ranks (the parameters do not): they hold one rank's batch noise, not the global
    batch's, which ``global_variance`` corrects for. ``state_dict()`` holds this rank's moments:
    save one file per rank, as the residuals are (a resume that loads rank 0's moments on every
    rank is not the run it continues); ``hvd.broadcast_optimizer_state`` gives every rank rank
    0's (every state entry the options need is made with the state, so a fresh rank takes part
    in every broadcast).

    Args: as ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected moments), but
    ``betas`` defaults to ``(0.0, 0.999)``, and:

        lr_in_residual (True): the update handed to the exchange is already multiplied by this step's
            ``lr`` (``lr * m_hat / (sqrt(v_hat) + eps)``), and ``step()`` applies the exchanged
            result as it is. An entry that waits in the residual is then applied at the
            learning rates of the steps it stands for, not at the (smaller, under a decaying
            schedule) rate of the step that finally sends it (DeMo's and SparseLoCo's
            convention; docs/adamw.md). A param-group option: a checkpoint carries it, and
            one written without it loads as ``False``, matching the units of its residuals.
        global_variance (True): normalise by an estimate of the variance of the *ranks' average*
            gradient instead of this rank's own. Each rank's ``v`` holds its own batch's noise,
            P times that of the average over P ranks, so where noise dominates (most entries,
            late in training) a per-rank Adam step is sqrt(P) times smaller than dense AdamW's
            and the average of P of them is no better than one rank training alone. With
            this option ``v`` is replaced by ``mean^2 + (v - mean^2) / P``, where ``mean`` is an
            EMA of the gradient with ``beta2``'s horizon (the signal) and ``v - mean^2`` the
            noise; P is the number of ranks the exchange averages over (``hvd_topk.DistributedOptimizer``
            or the DDP hook passes it with each gradient). No communication; one more buffer per parameter.
        signal ("mean"): how ``global_variance`` tells signal from noise. ``"mean"``: the signal
            is ``mean^2``, as above. ``"mean+lag1"``: the larger of ``mean^2`` and ``-lag1``,
            with ``lag1`` an EMA (``beta2``) of ``g_t * g_{t-1}``, this rank's gradient times its
            previous one. Why: an entry whose gradient flips sign from step to step on every
            rank alike (an oscillation, which a step too large for it causes) has ``mean`` near
            0, so ``"mean"`` counts it as noise, divides it by P and makes its step up to
            sqrt(P) times *larger*, which feeds the oscillation; a negative ``lag1`` is that
            flip, and counting it as signal keeps such an entry's step at dense AdamW's
            (independent batches' noise has ``lag1`` near 0). It matters from about 8 ranks on
            (sqrt(8) = 2.8; measured there, docs/adamw.md); at 2 ranks the factor is at most
            1.41. One more buffer per parameter (two with ``beta1 > 0``: the previous gradient;
            with ``beta1 = 0`` ``exp_avg`` holds it). A param-group option: a checkpoint carries
            it, and one written without it loads as ``"mean"``.
        variance_sketch ("auto"): with ``global_variance``, B > 0 measures each tensor's variance of
            the ranks' average gradient instead of only estimating it: every rank adds a sketch
            of its gradient (min(B, numel) float32 numbers a tensor, ``hvd_topk.variance_sketch``)
            to the exchange, and the estimate above is rescaled per tensor by the measured total
            (an EMA, ``beta2``, of the sketched ``|mean g|^2``) over the estimate's own total,
            both as of the previous step. Why: the estimate comes from one rank's moments and
            misses the average's total (about half of it at 2 ranks on the GPT example, where
            that is harmless; from about 6 ranks on it costs): on 8 ranks the 1% recipe at lr
            1.5e-2 ended at 1.1707 with the estimate alone, 1.0386 with B = 256, 1.0288 with the
            exact variance of every entry (seed 42; over seeds 42-44 see docs/adamw.md); on 6
            ranks 2.5% lower than the estimate alone at its better rate (seeds 42-44). At 2 and
            4 ranks it changed nothing measurable, at 5 it won on two seeds of three; so
            ``"auto"`` (the default) is B = 256 where the exchange averages 6 ranks or more and
            0 (off) below, decided each step from the ranks the transport passes
            (``AUTO_SKETCH``); 0 turns it off everywhere. Costs: B =
            256 is 1 KB a tensor and step on the wire (small beside the 1% recipe's pairs on
            models of millions of parameters; on the 0.48M-parameter GPT example 1.2 points of
            dense's bytes), one pass over the gradient and one byte a parameter (fixed entry
            signs). The measurement is unbiased; on the tests' gradients it is off by 13-22% a
            step (less after the EMA). The transports
            (``hvd_topk.DistributedOptimizer``, the DDP hook) exchange the sketches; a rank
            without a gradient of a tensor in a step adds zeros, and a step some rank sits out in
            ``hvd.join()`` absorbs none. A param-group option (a checkpoint carries it; one
            written without it, before 2026-12-02, loads as 0, the behaviour it was trained with).
    """

    SIGNALS = ("mean", "mean+lag1")
    # a group saved before these options existed was trained without them (its residuals in
    # the units of lr_in_residual=False)
    LOADED_WITHOUT = {"lr_in_residual": False, "global_variance": False, "signal": "mean", "variance_sketch": 0}
    AUTO_SKETCH = (6, 256)  # variance_sketch="auto": from this many ranks on, this many numbers a tensor

    def __init__(self, params, lr=1e-3, betas=(0.0, 0.999), eps=1e-8, weight_decay=1e-2, lr_in_residual=True,
                 global_variance=True, signal="mean", variance_sketch="auto"):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, lr_in_residual=lr_in_residual,
                        global_variance=global_variance, signal=signal, variance_sketch=variance_sketch)
        self._check_options(defaults)
        super().__init__(params, defaults)
        self._transformed = set()  # parameters whose gradient became an update this step
        self._sketches = {}        # parameter -> this step's sketch of its gradient (variance_sketch)
        self._entry_signs = {}     # parameter -> its entries' fixed signs for the sketch (int8)
        self._lr_in_update = {}    # id(param group) -> the lr this step's updates were multiplied by
        self._lr_warned = False

    @staticmethod
    def _check_options(options):
        _check_adam_options(options)
        for name in ("lr_in_residual", "global_variance"):
            check_flag(options[name], name)
        if options["signal"] not in LocalAdamW.SIGNALS:
            raise ValueError(f"signal must be one of {LocalAdamW.SIGNALS}, got {options['signal']!r}")
        buckets = options.get("variance_sketch", 0)
        if not (isinstance(buckets, str) and buckets == "auto"):
            try:
                check_integer(buckets, "variance_sketch", 0)
            except (TypeError, ValueError) as error:
                raise type(error)(f"variance_sketch must be 'auto' or an integer >= 0 (numbers a tensor; "
                                  f"0: off), got {buckets!r}") from None
        if buckets not in ("auto", 0) and not options["global_variance"]:
            raise ValueError("variance_sketch rescales global_variance's estimate: it needs global_variance=True")

    # State entries kept in float64 whatever the parameter's dtype (the variance sketch's EMA and
    # its estimate's total: sums over a whole tensor of squares, which overflowed float32 after
    # one spiked step and stayed inf, and underflowed to subnormals after long runs of zero
    # gradients): torch's load_state_dict casts state tensors to the parameter's dtype.
    WIDE_STATE = ("sketch_sq", "estimate_sum")

    def _new_state(self, p, group):
        state = _new_adam_state(self.state[p], p)
        _complete_state(state, p, group)
        return state

    def _init_state(self, p):
        self._new_state(p, _group_of(self, p))

    def load_state_dict(self, state_dict):
        """As torch's, except that ``WIDE_STATE`` stays float64 (cast to a bfloat16
        parameter's dtype, the resume was not bitwise) and a state written before an entry was
        made up front gets it (see ``_complete_state``)."""
        saved = state_dict.get("state", {}) if isinstance(state_dict, dict) else {}
        ids = [i for g in state_dict.get("param_groups", ()) for i in g.get("params", ())] \
            if isinstance(state_dict, dict) else []
        kept = {(i, key): value.detach().double().clone() for i in ids for key, value in saved.get(i, {}).items()
                if key in self.WIDE_STATE and torch.is_tensor(value)}
        super().load_state_dict(state_dict)
        for i, p in zip(ids, (p for g in self.param_groups for p in g["params"])):
            state = self.state.get(p)
            if not state:
                continue
            for key in self.WIDE_STATE:
                if (i, key) in kept:
                    state[key] = kept[i, key].to(p.device)
            _complete_state(state, p, _group_of(self, p), fresh=False)

    @torch.no_grad()
    def transform_local_gradient(self, p, grad, ranks=1, finite=None):
        """Replace ``grad`` (this rank's gradient of ``p``) in place by this rank's Adam update
        direction ``m_hat / (sqrt(v_hat) + eps)`` (times ``lr`` with ``lr_in_residual``),
        advancing the moments one step. ``ranks``: how many ranks' updates the exchange
        averages (``global_variance``).

        A gradient holding inf/nan (an overflow, a bad batch) is left as it is, so that the
        exchange carries it to every rank and the step is skipped there (a ``GradScaler``, or
        the user), and the moments are not advanced: they would hold inf/nan for good, and every
        later step would be NaN. That costs one read of the gradient (on a GPU, a wait for it);
        ``finite=True`` says the caller has checked already (the DDP hook checks a bucket at
        once)."""
        if self._exchanged:
            # the last step's exchanged result was never applied (a step skipped by zeroing the
            # model's gradients): what this optimizer noted of that step is over
            self._step_done(stepped=False)
        if finite is None:
            finite = bool(torch.isfinite(grad).all())
        group = _group_of(self, p)
        if not finite:
            self._transformed.add(p)
            buckets = _sketch_buckets(group, ranks)
            if buckets:  # a sketch of nan: the ranks' average is not absorbed on any rank (absorb_sketches)
                self._sketches[p] = torch.full((variance_sketch.length(p.numel(), buckets),), float("nan"),
                                               device=p.device)
            return
        beta1, beta2 = group["betas"]
        state = self.state[p] or self._new_state(p, group)
        if group.get("global_variance", False) != ("grad_mean" in state):
            # which moments are kept is decided when the state is made (an in-place edit of the
            # option was ignored before 2026-12-05, in silence)
            raise RuntimeError(
                f"hvd_topk.LocalAdamW: global_variance is {group.get('global_variance', False)} in a param group "
                "whose state was made with the other value (the option was changed in place): it decides which "
                "moments are kept. Build the optimizer with the value you want, or load a checkpoint saved with it.")
        state["step"] += 1
        step = int(state["step"])
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        lag1 = _advance_lag1(state, group, grad, step) if "grad_mean" in state else None
        buckets = _sketch_buckets(group, ranks) if "grad_mean" in state else 0
        if buckets:
            self._sketches[p] = variance_sketch.sketch(grad, buckets, _sketch_count(state), self._entry_signs_of(p))
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        mean = state.get("grad_mean")  # kept from the first step on, whatever the world size
        if mean is not None:
            mean.lerp_(grad, 1 - beta2)
        if mean is not None and ranks > 1:
            bias2 = 1 - beta2 ** step
            if lag1 is None or step == 1:
                # v / P + (1 - 1/P) mean^2, both bias-corrected: >= 0, as v >= mean^2 (same weights)
                denom = (exp_avg_sq / (bias2 * ranks)).addcmul_(mean, mean, value=(1 - 1 / ranks) / bias2 ** 2)
            else:  # signal="mean+lag1": the signal is max(mean^2, min(-lag1, v)), all bias-corrected
                v_hat = exp_avg_sq / bias2
                flips = torch.minimum(lag1 / -(1 - beta2 ** (step - 1)), v_hat)
                denom = torch.maximum(mean * mean / bias2 ** 2, flips).mul_(1 - 1 / ranks).add_(v_hat, alpha=1 / ranks)
            if buckets:
                _calibrate(state, denom, beta2)
            denom = denom.sqrt_().add_(group["eps"])
        else:
            denom = _adam_denominator(exp_avg_sq, 1 - beta2 ** step, group["eps"])
        torch.div(exp_avg, denom, out=grad).div_(1 - beta1 ** step)
        if group.get("lr_in_residual", False):
            grad.mul_(group["lr"])
            self._lr_in_update.setdefault(id(group), group["lr"])
        self._transformed.add(p)

    def _step_done(self, stepped=False):
        super()._step_done(stepped)
        self._sketches.clear()  # (a step some rank sat out in hvd.join() absorbs none)
        self._lr_in_update.clear()

    def _check_group(self, group):
        """Warn (once) where ``group``'s learning rate changed after this step's updates were
        multiplied by it (``lr_in_residual``: in ``backward()``, as each gradient arrives): the
        step then runs at the old rate, which a loop that sets the rate between ``backward()``
        and ``step()`` does not expect. (A tensor ``lr`` is not compared: that would wait for
        the device.)"""
        used = self._lr_in_update.get(id(group))
        if used is None or self._lr_warned or torch.is_tensor(used) or used == group["lr"]:
            return
        self._lr_warned = True
        warnings.warn(
            f"hvd_topk.LocalAdamW: a param group's learning rate changed between backward() and step() (from "
            f"{used} to {group['lr']}): with lr_in_residual=True each update is multiplied by the rate when its "
            f"gradient arrives, in backward(), so this step's update ran at {used} (its weight decay at {group['lr']}). "
            "Set the rate before backward() (torch's "
            "LR schedulers do: scheduler.step() after optimizer.step()).", stacklevel=outside_level())

    def _entry_signs_of(self, p):
        """``p``'s fixed entry signs for the sketch (made at first use, not checkpointed: the
        same every time)."""
        signs = self._entry_signs.get(p)
        if signs is None or signs.device != p.device:
            signs = self._entry_signs[p] = variance_sketch.entry_signs(p.numel(), p.device)
        return signs

    def sketch_layout(self, ranks):
        """``(parameter, B)`` for each parameter whose gradient ``variance_sketch`` sketches when
        the exchange averages ``ranks`` ranks, in the param groups' order (the same on every
        rank): what the transport passes to ``sketch_rows`` and ``absorb_sketches``."""
        return [(p, buckets) for g in self.param_groups if (buckets := _sketch_buckets(g, ranks))
                for p in g["params"] if p.requires_grad]

    def sketch_rows(self, layout):
        """This step's sketches of the gradients of ``layout``'s parameters (``sketch_layout``),
        one float32 vector (zeros for a parameter this rank had no gradient of): the transport
        averages it over the ranks and hands the average to ``absorb_sketches``."""
        parts = []
        for p, buckets in layout:
            width = variance_sketch.length(p.numel(), buckets)
            mine = self._sketches.get(p)
            parts.append(mine if mine is not None else torch.zeros(width, device=p.device))
        return torch.cat(parts) if parts else torch.zeros(0)

    @torch.no_grad()
    def absorb_sketches(self, layout, averaged):
        """Fold the ranks' average of ``sketch_rows(layout)`` into each parameter's EMA of
        ``|mean g|^2`` (``state["sketch_sq"]``, with ``state["sketches"]`` counting them: the
        next sketch's seed, and the EMA's bias correction). The EMA is kept in float64 and the
        count as an int: a checkpoint loads state tensors in the parameter's dtype, and a count
        in bfloat16 would stop at 256.

        An average that is all zeros (no rank had a gradient of ``p``: a branch left out of the
        forward) or holds inf/nan (an overflow, skipped) is not absorbed, on every rank alike
        (the average is the same everywhere, and so the count and the next seed): ``p``'s
        estimate does not move on such steps either, and an EMA decayed towards zero meanwhile
        made the first update after 400 such steps about 30,000 times too large."""
        edges = [0]
        for p, buckets in layout:
            edges.append(edges[-1] + variance_sketch.length(p.numel(), buckets))
        if edges[-1] != averaged.numel():
            raise ValueError(f"absorb_sketches: {averaged.numel()} numbers for sketches of {edges[-1]}")
        wide = averaged.to(torch.float64)
        # every average's squared norm, read in one host synchronisation: 0 where it is all zeros
        # (a nonzero float32 squares to more than 0 in float64), inf/nan where it held one
        squares = torch.stack([wide[a:b].square().sum() for a, b in zip(edges, edges[1:])]).tolist() \
            if layout else []
        for (p, _), square in zip(layout, squares):
            self._sketches.pop(p, None)
            if not (math.isfinite(square) and square > 0):
                continue
            group = _group_of(self, p)
            state = self.state[p] or self._new_state(p, group)
            total = state.get("sketch_sq")
            total = torch.zeros((), dtype=torch.float64, device=p.device) if total is None else total.double()
            beta2 = group["betas"][1]
            state["sketch_sq"] = total.mul_(beta2).add_(square, alpha=1 - beta2)
            state["sketches"] = _sketch_count(state) + 1

    def _apply(self, p, group):
        """``p -= lr * the exchanged update`` (``p -= the exchanged update`` with
        ``lr_in_residual``, where it holds the rate already), after ``step()``'s decoupled weight
        decay, as in AdamW."""
        p.add_(p.grad, alpha=-1.0 if group.get("lr_in_residual", False) else -group["lr"])


def _advance_lag1(state, group, grad, step):
    """``signal="mean+lag1"``: advance ``state["grad_lag1"]``, the EMA (``beta2``) of this
    gradient times the previous one, and return it (None with ``signal="mean"``). Called before
    ``exp_avg`` moves: with ``beta1 = 0`` it holds the previous gradient; otherwise
    ``state["grad_prev"]`` does. The first step has no previous gradient (the EMA starts at the
    second; its bias correction counts one step fewer)."""
    if group.get("signal", "mean") != "mean+lag1":
        return None
    beta1, beta2 = group["betas"]
    if "grad_lag1" not in state:
        state["grad_lag1"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    lag1 = state["grad_lag1"]
    prev = state["exp_avg"] if beta1 == 0 else state.get("grad_prev")
    if step > 1 and prev is not None:
        lag1.mul_(beta2).addcmul_(grad, prev, value=1 - beta2)
    if beta1 != 0:
        if "grad_prev" not in state:
            state["grad_prev"] = torch.empty_like(grad, memory_format=torch.preserve_format)
        state["grad_prev"].copy_(grad)
    return lag1


def _complete_state(state, p, group, fresh=True):
    """Make now, as zeros, every state entry ``group``'s options will need (results are the same
    as making them at first use; ``grad_prev`` only in a ``fresh`` state, at step 0, where its
    first use overwrites it: in a loaded one its first read would differ from its absence).
    Why: ``hvd.broadcast_optimizer_state`` broadcasts each of rank 0's state entries, and a
    fresh rank's state comes from Horovod's zero-gradient probe step, which makes only what
    ``_new_state`` makes; an entry rank 0 has and another rank lacks was a broadcast that rank
    never joined, and the job hung (``signal="mean+lag1"``, ``variance_sketch``; the latter by
    default from 6 ranks on). ``grad_mean`` in a loaded state too: one saved by another optimizer
    (torch.optim.AdamW's, the moments kept) starts its gradient mean from zero here."""
    if not group.get("global_variance", False):
        return
    if "grad_mean" not in state:
        state["grad_mean"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group.get("signal", "mean") == "mean+lag1":
        if "grad_lag1" not in state:
            state["grad_lag1"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if fresh and group["betas"][0] != 0 and "grad_prev" not in state:
            state["grad_prev"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group.get("variance_sketch", 0) != 0:
        for key in LocalAdamW.WIDE_STATE:
            if key not in state:
                state[key] = torch.zeros((), dtype=torch.float64, device=p.device)
        state.setdefault("sketches", 0)


def _calibrate(state, estimate, beta2):
    """``variance_sketch``: rescale ``estimate`` (this step's, per entry) in place by the measured
    total of the average's variance over the estimate's own total, both as they stood after the
    previous step (the sketches of a step are averaged after its exchange). Why the previous
    estimate's total and not this one's: a burst in this step's gradient raises its entries'
    estimate, as it raises dense AdamW's ``v``; divided by a total that holds the burst, the
    rescaling would take that protection away (measured: the 1% recipe on 8 ranks ended at
    1.1039 so, docs/adamw.md). Keeps this step's total for the next (float64). The factor is
    bounded to [1/16, 16] (at 8 ranks on the GPT example the estimate held about half of the
    measured total: a factor near 2, docs/adamw.md) and skipped where either total
    is not finite or not positive: a stale or broken measurement may shrink or grow the
    estimate, never blow an update up."""
    # summed in float64 (in float16 the total overflowed at 65504, in float32 after one spiked
    # step, and the rescaling by measured / inf made every later update NaN)
    total = estimate.sum(dtype=torch.float64)
    previous, count = state.get("estimate_sum"), _sketch_count(state)
    if previous is not None and count:
        measured = state["sketch_sq"].double() / (1 - beta2 ** count)
        previous = previous.double()
        usable = torch.isfinite(measured) & torch.isfinite(previous) & (measured > 0) & (previous > 0)
        factor = torch.where(usable, measured / previous.clamp_min(torch.finfo(torch.float64).tiny), 1.0)
        estimate.mul_(factor.clamp(1 / 16, 16).to(estimate.dtype))
    state["estimate_sum"] = total


def _sketch_buckets(group, ranks):
    """How many numbers a tensor ``group``'s ``variance_sketch`` asks for when the exchange
    averages ``ranks`` ranks (0: no sketch): ``"auto"`` is ``LocalAdamW.AUTO_SKETCH``'s B from its
    rank count on; none without ``global_variance`` or on one rank."""
    buckets = group.get("variance_sketch", 0)
    if buckets == "auto":
        least, auto = LocalAdamW.AUTO_SKETCH
        buckets = auto if ranks >= least else 0
    return buckets if group.get("global_variance", False) and ranks > 1 else 0


def _sketch_count(state):
    """How many averaged sketches a parameter's state has absorbed (``variance_sketch``)."""
    return int(state["sketches"]) if "sketches" in state else 0
