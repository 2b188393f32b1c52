"""What every rank compares before its first exchange, for both transports (no Horovod here).

Each setting that must be equal on every rank (the model's parameters, the compression, the
options, the step) becomes one 56-bit digest; the ranks allgather one row of them, and a rank
whose row differs from rank 0's is named with the settings that differ. A difference found
later would be a hang, a message-size error or ranks that silently diverge.
"""

import hashlib
import numbers

import torch


def digest(value):
    """A 56-bit digest of ``repr(value)`` (an int64): equal on every rank for equal settings."""
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:7], "big")


def disagreement(fields, every):
    """The lines naming what differs from rank 0, or None when every rank agrees: ``fields``
    names ``every``'s columns (one row of ``digest``s per rank, in rank order)."""
    differ = [r for r in range(every.shape[0]) if not torch.equal(every[r], every[0])]
    if not differ:
        return None
    return [f"rank {r} differs from rank 0 in: "
            + ", ".join(f for f, same in zip(fields, (every[r] == every[0]).tolist()) if not same)
            for r in differ]


def group_options(param_groups, leave_out=None):
    """The param groups' options (learning rate, betas, weight decay, ...) as plain values: what
    every rank must have the same of (the Horovod engine compares them at every step, through
    its step probe; ``LocalSteps`` at each synchronisation, leaving out its own ``hvd_topk_``
    entries; the DDP hook at its first bucket, where a ``variance_sketch`` differing would make
    one rank's sketch exchange wait for the others' forever). Keys starting with ``leave_out``
    are left out.

    A tensor (a tensor learning rate) counts by its values, wherever it lives (its repr names
    its device, which differs by rank); a number, string or None by itself; any other object by
    its repr (a dtype, an enum), or by its type's name where that repr is the default one, which
    names the object's address and so differs by rank."""
    def plain(v):
        if torch.is_tensor(v):
            return v.item() if v.numel() == 1 else tuple(v.flatten().tolist())
        if isinstance(v, (tuple, list)):
            return tuple(plain(x) for x in v)
        if v is None or isinstance(v, (numbers.Number, str)):
            return v
        shown = repr(v)
        return type(v).__name__ if " at 0x" in shown else shown
    return [sorted((k, plain(v)) for k, v in g.items()
                   if k != "params" and not (leave_out and k.startswith(leave_out)))
            for g in param_groups]
