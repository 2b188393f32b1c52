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
    """

    def __init__(self, ranks, momentum=0.0, error_feedback=True):
        self.ranks, self.momentum, self.error_feedback = ranks, momentum, error_feedback
        self.residual = [dict() for _ in range(ranks)]
        self.u = [dict() for _ in range(ranks)]

    def sparse(self, name, per_rank_grads, density, average=True):
        total = np.zeros(per_rank_grads[0].size, dtype=np.float32)
        for r, g in enumerate(per_rank_grads):
            g = g.reshape(-1).astype(np.float32)
            if not self.error_feedback:
                acc = g.copy()
            elif self.momentum:
                u = self.u[r].get(name, np.zeros_like(g)) * np.float32(self.momentum) + g
                acc = self.residual[r].get(name, np.zeros_like(g)) + u
            else:
                acc = self.residual[r].get(name, np.zeros_like(g)) + g
            k = k_of(acc.size, density)
            keep = np.argsort(-np.abs(acc), kind="stable")[:k]
            sent = np.zeros_like(acc)
            sent[keep] = acc[keep]
            total += sent  # rank order, float32, like the optimizer
            if self.error_feedback:
                acc[keep] = 0
                self.residual[r][name] = acc
                if self.momentum:
                    u[keep] = 0
                    self.u[r][name] = u
        if average:
            total /= np.float32(self.ranks)
        return total.reshape(per_rank_grads[0].shape)


def dgc_density(step, target, warmup_steps, start=0.25):
    """Exponential warm-up written out independently: start * (target/start)^(step/N)."""
    if step >= warmup_steps:
        return target
    return max(start, target) * (target / max(start, target)) ** (step / warmup_steps)
