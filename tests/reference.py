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
