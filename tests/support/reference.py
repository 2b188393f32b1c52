"""Independent numpy references for the numerical contract (no hvd_topk code used here)."""

import numpy as np


def k_of(n, density):
    return max(1, int(round(density * n)))


def topk_sparse(g, density):
    """Dense copy of g holding only its k largest-|value| entries (k from the contract)."""
    flat = np.asarray(g).reshape(-1)
    k = k_of(flat.size, density)
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    out = np.zeros_like(flat)
    out[keep] = flat[keep]
    return out.reshape(np.shape(g)), keep


def sparse_allreduce(per_rank, density, average=True, value_dtype=None, round_trip=None):
    """Sum over ranks of each rank's top-k entries (in float64), divided by ranks if average.
    ``round_trip``: what the wire makes of a rank's k values (``sign_round_trip``)."""
    total = np.zeros(np.shape(per_rank[0]), dtype=np.float64)
    for g in per_rank:
        sparse, keep = topk_sparse(g, density)
        if round_trip is not None:
            flat = sparse.reshape(-1)
            flat[keep] = round_trip(flat[keep])
        if value_dtype is not None:
            sparse = sparse.astype(value_dtype)
        total += sparse.astype(np.float64)
    return total / len(per_rank) if average else total


def compact_round_trip(values):
    """What ``TopK(compact=True)`` delivers for one segment's sent values (float32 in and out):
    a sign and a level, 0 for zero, 1..127 spreading |v| log-uniformly over [lo, hi], the
    smallest and largest non-zero magnitude sent (both arrive exactly); numpy, float64 inside."""
    v = np.asarray(values)
    mag = np.abs(v.astype(np.float64))
    nonzero = mag > 0
    if not nonzero.any():
        return np.zeros_like(v)
    lo, hi = mag[nonzero].min(), mag.max()
    if hi == lo:
        level = np.where(nonzero, 1.0, 0.0)
    else:
        with np.errstate(divide="ignore"):
            level = np.where(nonzero, 1 + np.clip(np.round(126 * np.log(mag / lo) / np.log(hi / lo)), 0, 126), 0)
    arrived = np.where(level == 1, lo, np.where(level == 127, hi, lo * (hi / lo) ** ((level - 1) / 126)))
    arrived = np.where(level == 0, 0.0, arrived)
    return (np.where(np.signbit(v), -arrived, arrived)).astype(v.dtype)


def sign_round_trip(values):
    """What ``TopK(compact="sign")`` delivers for one segment's sent values (float32 in and
    out): each non-zero value as its sign times the mean of the segment's non-zero magnitudes
    (float64, rounded to float32 once), zeros as zero; numpy."""
    v = np.asarray(values)
    mag = np.abs(v.astype(np.float64))
    nonzero = mag > 0
    scale = np.float32(mag[nonzero].mean()) if nonzero.any() else np.float32(0)
    return np.where(nonzero, np.where(np.signbit(v), -scale, scale), 0).astype(v.dtype)


def round_bfloat16(x):
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32: numpy has no
    bfloat16. By hand on the bits: add 0x7FFF plus the lowest bit kept, then clear the low 16
    (finite values; inf stays inf)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def nearly_cancelling(rank, size):
    """One value per rank whose sum is small next to its terms: 1 on rank 0, -1 on the last
    rank, 2**-8 on the others (all exact in bfloat16). Added into bfloat16 one rank at a time,
    1 + 2**-8 rounds back to 1 (ties to even) and the sum of three ranks' values reads 0."""
    return 1.0 if rank == 0 else -1.0 if rank == size - 1 else 2.0 ** -8


def rounded_twice_apart(rank, size):
    """One value per rank, exact in bfloat16, whose mean at 3 ranks is -2.03125 rounded to
    bfloat16 once, and -2.046875 when the sum is rounded to bfloat16 first and then divided
    (found by a search over random values; at 2 ranks halving is exact, so the two agree).
    Ranks past the third add 0."""
    return (-3.578125, -1.5546875, -0.98046875)[rank] if rank < 3 else 0.0


def bfloat16_mean_rounded_once(per_rank):
    """The mean of exact bfloat16 values summed in float64, divided in float32 and rounded to
    bfloat16 once: what a 16-bit gradient's average is under the dense and sparse exchanges."""
    mean = np.float32(np.sum(np.asarray(per_rank, dtype=np.float64))) / np.float32(len(per_rank))
    return float(round_bfloat16(np.array([mean], dtype=np.float32))[0])


def to_value_dtype(values, value_dtype):
    """``values`` (float32) as the wire carries them in ``value_dtype`` (a numpy dtype, or
    ``"bfloat16"``), back in float32."""
    if value_dtype == "bfloat16":
        return round_bfloat16(values)
    return values.astype(value_dtype).astype(np.float32)


def expect_16bit_step(ref, rank, exchange, step, density, every, grad, residual, bf16, where):
    """One step of the 16-bit residual checks (check_compat's and check_ddp's) against ``ref``
    (an ``ErrorFeedbackReference`` of one tensor, ``"weight"``, one bucket): step 0 a dense start
    (density 1: everything sent, the rounding kept), then Top-K at ``density`` by the allgather
    or the sparse allreduce. ``every``: every rank's gradient; ``grad``, the exchanged result
    (float32 numpy), within the 16-bit decode's two roundings (a sum, a division); ``residual``,
    this rank's (float32 numpy), to float32's rounding."""
    if exchange == "sparse_allreduce" and step:
        want = ref.sparse_allreduce_bucket(["weight"], {"weight": every}, density, step, 0)["weight"]
    else:
        want = ref.sparse("weight", every, density if step else 1.0)
    rtol = 2 ** -6 if bf16 else 2 ** -8
    np.testing.assert_allclose(grad, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=f"{where}: p.grad")
    np.testing.assert_allclose(residual.reshape(-1), ref.residual[rank]["weight"].reshape(-1), rtol=1e-6, atol=1e-9,
                               err_msg=f"{where}: the residual")


class ErrorFeedbackReference:
    """The error-feedback contract for every rank, in float32 numpy.

    acc = residual + grad (DGC: u = m*u + grad; v = v + u); send top-k of acc; residual = acc
    with the sent entries zeroed (and u's too); result = sum of sent pairs over ranks / ranks.
    With ``decay`` (``residual_decay``): acc = decay * residual + grad. With ``value_dtype``
    (``TopK(fp16_values=True)``: numpy.float16; ``"bfloat16"``: the wire of bfloat16 parameters,
    whose residual is float32) each sent value is rounded to it on the wire;
    what that rounding took (float32 acc minus the float16 value, where finite) stays in the
    residual. With ``compact`` (``TopK(compact=True)``) each top-k's values arrive as
    ``compact_round_trip`` gives them (``"sign"``: ``sign_round_trip``), and what that rounding
    took stays in the residual.

    The sparse allreduce (ScaleCom's CLT-k, ``sparse_allreduce_bucket``): every rank sends its
    own acc at positions chosen part by part from one rank's top-k instead of at its own.

    ``idle`` (per rank, the names of tensors that rank did not use this step; the DDP hook):
    that rank's residual of them sits the step out (decayed, nothing of it sent). It selects
    from zeros there (whatever it picks sends zeros); under the sparse allreduce it chooses
    positions from its residual as usual, and sends zeros at every position there.
    """

    def __init__(self, ranks, momentum=0.0, error_feedback=True, decay=1.0, value_dtype=None, compact=False):
        self.ranks, self.momentum, self.error_feedback = ranks, momentum, error_feedback
        self.decay, self.value_dtype, self.compact = np.float32(decay), value_dtype, compact
        self.residual = [dict() for _ in range(ranks)]
        self.u = [dict() for _ in range(ranks)]

    def sparse(self, name, per_rank_grads, density, average=True, idle=None):
        """One tensor's exchanged result (k = density x its size: selection_scope="tensor")."""
        return self.sparse_bucket([name], {name: per_rank_grads}, density, average, idle=idle)[name]

    def dense(self, name, per_rank_grads, average=True):
        """One tensor sent whole in float32 (the dense bucket of small tensors, or a bucket sent
        dense): each rank sends its accumulator (with DGC momentum, u = m*u + grad, then acc =
        decayed residual + u) and keeps nothing of it in the residual (a float16 dense wire
        keeps its rounding: ``sparse`` at density 1 with ``value_dtype=numpy.float16``); u is kept whole (momentum SGD:
        masking zeroes u only where Top-K chose). The sum in rank order, float32."""
        accs, us, _ = self._accumulate([name], {name: per_rank_grads})
        total = np.zeros(accs[0].shape, dtype=np.float32)
        for r in range(self.ranks):
            total += accs[r]
            if self.error_feedback:
                self.residual[r][name] = np.zeros_like(accs[r])
            if self.momentum:
                self.u[r][name] = us[r].copy()
        if average:
            total /= np.float32(self.ranks)
        return total.reshape(np.shape(per_rank_grads[0]))

    def sparse_bucket(self, names, grads, density, average=True, sent=None, idle=None):
        """The exchanged results of tensors that share one top-k (selection_scope="bucket"):
        k = density x their total size, taken over their accumulators laid end to end.
        ``grads[name]`` is every rank's raw gradient; returns ``{name: result}``.

        Equal magnitudes at the k-th go to the earlier position (numpy's stable order, as the
        native kernel does). ``sent`` (per rank, a bool per entry: what the implementation sent)
        accepts its own choice among those tied entries instead (torch.topk's, on the torch-ops
        path); everything above the k-th must still be sent, nothing below it, k in all."""
        accs, us, edges = self._accumulate(names, grads)
        held = self._set_aside(names, accs, edges, idle)
        k = k_of(edges[-1], density)
        keeps = [_keep(accs[r], k, None if sent is None else sent[r]) for r in range(self.ranks)]
        return self._exchange(names, grads, accs, us, edges, keeps, average, held)

    def sparse_allreduce_bucket(self, names, grads, density, step, bucket, scope="tensor", average=True,
                                sent=None, idle=None):
        """The sparse allreduce's results for one bucket holding ``names`` (in their order in
        the bucket): the tensors laid end to end (n elements) are cut into P parts as Horovod's
        reduce-scatter splits n (n // P each, the first n mod P one longer); part j's positions
        come from the accumulator of rank (j + step + bucket) mod P: the top-k of each tensor's
        piece inside the part (``scope="tensor"``, k = max(1, round(density x piece size))), or
        one top-k over the part (``"bucket"``). Every rank sends its own acc at every chosen
        position. ``sent``: as in ``sparse_bucket``, per rank (each piece's ties judged on the
        rank that chose it)."""
        accs, us, edges = self._accumulate(names, grads)
        held = self._set_aside(names, accs, edges, idle, zero=False)
        chosen = []
        for j, a, b in part_pieces(edges, self.ranks, scope):
            owner = (j + step + bucket) % self.ranks
            mask = None if sent is None else sent[owner][a:b]
            chosen.append(a + _keep(accs[owner][a:b], k_of(b - a, density), mask))
        keep = np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)
        return self._exchange(names, grads, accs, us, edges, [keep] * self.ranks, average, held)

    def _set_aside(self, names, accs, edges, idle, zero=True):
        """``idle``'s accumulators (decayed residual, no gradient) kept aside, and with ``zero``
        zeroed in ``accs``; ``{(rank, name): kept}``."""
        held = {}
        for r, unused in enumerate(idle or []):
            for i, n in enumerate(names):
                if n in unused and self.error_feedback:
                    assert not self.momentum, "idle tensors are the DDP hook's: no momentum there"
                    held[r, n] = accs[r][edges[i]:edges[i + 1]].copy()
                    if zero:
                        accs[r][edges[i]:edges[i + 1]] = 0
        return held

    def _accumulate(self, names, grads):
        """Every rank's accumulator over ``names`` laid end to end (and DGC's u), and the edges."""
        sizes = [grads[n][0].size for n in names]
        edges = np.cumsum([0] + sizes)
        accs, us = [], []
        for r in range(self.ranks):
            g = np.concatenate([grads[n][r].reshape(-1).astype(np.float32) for n in names])
            old = lambda table: np.concatenate([table[r].get(n, np.zeros(s, np.float32))
                                                for n, s in zip(names, sizes)])
            u = None
            if not self.error_feedback:
                acc = g.copy()
            elif self.momentum:
                u = old(self.u) * np.float32(self.momentum) + g
                acc = old(self.residual) * self.decay + u
            else:
                acc = old(self.residual) * self.decay + g
            accs.append(acc)
            us.append(u)
        return accs, us, edges

    def _exchange(self, names, grads, accs, us, edges, keeps, average, held=None):
        """Rank r sends its acc at ``keeps[r]``: the sum (rank order, float32), the residuals
        (``held``'s put back)."""
        shapes = {n: grads[n][0].shape for n in names}
        total = np.zeros(edges[-1], dtype=np.float32)
        for r in range(self.ranks):
            acc, u = accs[r], us[r]
            keep = keeps[r]
            sent = np.zeros_like(acc)
            sent[keep] = acc[keep] if self.value_dtype is None else to_value_dtype(acc[keep], self.value_dtype)
            if self.compact:
                sent[keep] = (sign_round_trip if self.compact == "sign" else compact_round_trip)(acc[keep])
            for i, n in enumerate(names):
                if (r, n) in (held or {}):
                    sent[edges[i]:edges[i + 1]] = 0  # an idle tensor: this rank sends nothing of it
            total += sent  # rank order, float32, like the optimizer
            if self.error_feedback:
                if self.compact or self.value_dtype is not None:
                    lost = acc[keep] - sent[keep]
                    acc[keep] = np.where(np.isfinite(lost), lost, np.float32(0))
                else:
                    acc[keep] = 0
                for i, n in enumerate(names):
                    self.residual[r][n] = (held or {}).get((r, n), acc[edges[i]:edges[i + 1]]).copy()
                if self.momentum:
                    u[keep] = 0
                    for i, n in enumerate(names):
                        self.u[r][n] = u[edges[i]:edges[i + 1]].copy()
        if average:
            total /= np.float32(self.ranks)
        return {n: total[edges[i]:edges[i + 1]].reshape(shapes[n]) for i, n in enumerate(names)}


def split_edges(n, parts):
    """The edges of ``n`` elements cut into ``parts`` as Horovod's reduce-scatter splits them:
    n // parts each, the first n mod parts one longer."""
    edges = [0]
    for j in range(parts):
        edges.append(edges[-1] + n // parts + (1 if j < n % parts else 0))
    return edges


def part_pieces(edges, parts, scope="tensor"):
    """``(part, start, end)`` of every piece the sparse allreduce selects in a bucket whose
    tensors lie at ``[edges[i], edges[i+1])``: the bucket cut into ``parts`` as Horovod's
    reduce-scatter splits it (n // parts each, the first n mod parts one longer), and with
    tensor scope each part cut again at the tensors' edges."""
    cuts = split_edges(int(edges[-1]), parts)
    out = []
    for j in range(parts):
        lo, hi = cuts[j], cuts[j + 1]
        if scope == "bucket":
            out += [(j, lo, hi)] if hi > lo else []
        else:
            out += [(j, max(a, lo), min(b, hi)) for a, b in zip(edges, edges[1:]) if min(b, hi) > max(a, lo)]
    return out


def dgc_density(step, target, warmup_steps, start=0.25):
    """Exponential warm-up written out independently: start * (target/start)^(step/N)."""
    if step >= warmup_steps:
        return target
    return max(start, target) * (target / max(start, target)) ** (step / warmup_steps)


def _keep(acc, k, sent=None):
    """Positions of the k largest |acc|: ties at the k-th broken by position (numpy's stable
    order), or, given ``sent``, as the implementation broke them (checked to be a top-k)."""
    a = np.abs(acc)
    order = np.argsort(-a, kind="stable")
    if sent is None:
        return order[:k]
    kth = a[order[k - 1]]
    above, tied = np.flatnonzero(a > kth), np.flatnonzero(a == kth)
    chosen = tied[np.asarray(sent)[tied]]
    if len(above) + len(chosen) != k:
        raise AssertionError(f"not a top-{k}: {len(above)} above the k-th magnitude {kth}, "
                             f"{len(chosen)} of the {len(tied)} tied at it sent")
    return np.concatenate([above, chosen])

