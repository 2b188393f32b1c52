"""A few numbers per tensor from which every rank learns how large the ranks' *average*
gradient is: ``hvd_topk.LocalAdamW(variance_sketch=B)``.

Why: ``LocalAdamW``'s ``global_variance`` estimates, on each rank and without communication, the
variance of the ranks' average gradient (what dense AdamW normalises by) from this rank's own
moments. On 8 ranks that estimate is far off (docs/adamw-measurements.md, "Eight ranks"). The
sketch measures each tensor's ``|mean over ranks of g|^2``, and ``LocalAdamW`` rescales its
estimate so that the tensor's total matches it: the per-entry shape stays the local estimate's,
the tensor's scale becomes the measured one.

How (a count sketch with a cheap hash): a rank's gradient of ``n`` entries, each times a fixed
random sign of its own (``entry_signs``), is laid out as ``rows x L`` (``L = min(B, n)``, the
last row zero-padded) and its rows are summed with random signs drawn afresh each step,
``s = signs @ rows`` (``L`` numbers). The transport averages ``s`` over the ranks, which is the
same signed sum of the ranks' average gradient, and ``|mean s|^2`` estimates ``|mean g|^2``
without bias: the products of two different rows come with a random sign. The entry signs
matter: a weight's gradient is close to low rank (an outer product), so without them every row
of the layout is nearly a multiple of the same pattern and the sum behaves like one random
number, not ``L`` of them (relative error 0.9 against 0.17 on a rank-1 matrix of 65,536
entries, B = 256). With them the error is about ``sqrt(2 / L)`` a step for a gradient spread
evenly (more where a few columns dominate), and the EMA (``beta2``) averages it further; a
tensor of at most ``B`` entries is measured exactly. The row signs come from a seed every rank
has (how many sketches the tensor has absorbed), the entry signs from a fixed one.
"""

import torch
import torch.nn.functional as F


def length(numel, buckets):
    """How many numbers a tensor of ``numel`` entries sketches to."""
    return min(int(buckets), int(numel))


def signs(count, seed, device, dtype=torch.float32):
    """``count`` random signs (+-1) from ``seed``: the same on every rank, whatever its device."""
    gen = torch.Generator().manual_seed(int(seed))
    bits = torch.randint(0, 2, (int(count),), generator=gen, dtype=torch.int8)
    return bits.to(device=device, dtype=dtype).mul_(2).sub_(1)


ENTRY_SEED = 0x5EED


def entry_signs(numel, device):
    """Each entry's fixed random sign (int8, one byte an entry): the same on every rank."""
    return signs(numel, ENTRY_SEED, device, torch.int8)


def sketch(grad, buckets, seed, fixed_signs):
    """The signed sum of the rows of ``min(buckets, numel)`` entries of ``grad`` times
    ``fixed_signs`` (``entry_signs``), in float32."""
    flat = grad.detach().reshape(-1).float() * fixed_signs
    width = length(flat.numel(), buckets)
    if width == 0:  # an empty parameter: nothing to measure
        return flat
    rows = -(-flat.numel() // width)
    if rows * width != flat.numel():
        flat = F.pad(flat, (0, rows * width - flat.numel()))
    return signs(rows, seed, flat.device) @ flat.view(rows, width)
