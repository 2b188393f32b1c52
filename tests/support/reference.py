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


def sparse_allreduce(per_rank, density, average=True, value_dtype=None):
    """Sum over ranks of each rank's top-k entries (in float64), divided by ranks if average."""
    total = np.zeros(np.shape(per_rank[0]), dtype=np.float64)
    for g in per_rank:
        sparse, _ = topk_sparse(g, density)
        if value_dtype is not None:
            sparse = sparse.astype(value_dtype)
        total += sparse.astype(np.float64)
    return total / len(per_rank) if average else total


class ErrorFeedbackReference:
    """The error-feedback contract for every rank, in float32 numpy.

    acc = residual + grad (DGC: u = m*u + grad; v = v + u); send top-k of acc; residual = acc
    with the sent entries zeroed (and u's too); result = sum of sent pairs over ranks / ranks.
    With ``decay`` (``residual_decay``): acc = decay * residual + grad.

    With ``leader`` (the sparse allreduce, ScaleCom's CLT-k) every rank sends its own acc at
    the positions of the *leader's* top-k instead of at its own.
    """

    def __init__(self, ranks, momentum=0.0, error_feedback=True, decay=1.0):
        self.ranks, self.momentum, self.error_feedback = ranks, momentum, error_feedback
        self.decay = np.float32(decay)
        self.residual = [dict() for _ in range(ranks)]
        self.u = [dict() for _ in range(ranks)]

    def sparse(self, name, per_rank_grads, density, average=True, leader=None):
        """One tensor's exchanged result (k = density x its size: selection_scope="tensor")."""
        return self.sparse_bucket([name], {name: per_rank_grads}, density, average, leader)[name]

    def sparse_bucket(self, names, grads, density, average=True, leader=None, sent=None):
        """The exchanged results of tensors that share one top-k (selection_scope="bucket"):
        k = density x their total size, taken over their accumulators laid end to end.
        ``grads[name]`` is every rank's raw gradient; returns ``{name: result}``.

        Equal magnitudes at the k-th go to the earlier position (numpy's stable order, as the
        native kernel does). ``sent`` (per rank, a bool per entry: what the implementation sent)
        accepts its own choice among those tied entries instead (torch.topk's, on the torch-ops
        path); everything above the k-th must still be sent, nothing below it, k in all."""
        shapes = {n: grads[n][0].shape for n in names}
        sizes = [grads[n][0].size for n in names]
        edges = np.cumsum([0] + sizes)
        total = np.zeros(edges[-1], dtype=np.float32)
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
        k = k_of(edges[-1], density)
        keeps = {r: _keep(accs[r], k, None if sent is None else sent[r])
                 for r in (range(self.ranks) if leader is None else [leader])}
        for r in range(self.ranks):
            acc, u = accs[r], us[r]
            keep = keeps[r if leader is None else leader]
            sent = np.zeros_like(acc)
            sent[keep] = acc[keep]
            total += sent  # rank order, float32, like the optimizer
            if self.error_feedback:
                acc[keep] = 0
                for i, n in enumerate(names):
                    self.residual[r][n] = acc[edges[i]:edges[i + 1]].copy()
                if self.momentum:
                    u[keep] = 0
                    for i, n in enumerate(names):
                        self.u[r][n] = u[edges[i]:edges[i + 1]].copy()
        if average:
            total /= np.float32(self.ranks)
        return {n: total[edges[i]:edges[i + 1]].reshape(shapes[n]) for i, n in enumerate(names)}


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

