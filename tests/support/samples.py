"""Test inputs shared by the single-process kernel tests (test_selection.py, test_codec.py):
gradient-like samples, numpy's top-k, and the mark for tests that need the native kernel."""

import numpy as np
import pytest
import torch

from hvd_topk import native


needs_native = pytest.mark.skipif(native.library() is None, reason="native kernel did not build")


def sample(dist, n, seed=0):
    rng = np.random.default_rng(seed)
    data = {"normal": rng.standard_normal, "laplace": rng.laplace,
            "t3": lambda size: rng.standard_t(3, size)}[dist](size=n)
    return torch.from_numpy(data.astype(np.float32))


def true_topk(x, k):
    a = np.abs(x.numpy())
    return np.argpartition(a, a.size - k)[a.size - k:]


def segment_truth(x, bounds, ks):
    """Per segment, the set of positions of its k largest |x| (numpy, independent)."""
    a = np.abs(x.numpy().astype(np.float64))
    a[np.isnan(a)] = np.inf
    out = []
    for b, e, k in zip(bounds, bounds[1:], ks):
        part = a[b:e]
        out.append(set((np.argpartition(-part, k - 1)[:k] + b).tolist()))
    return out
