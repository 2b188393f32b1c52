"""What every rank compares before its first exchange, for both transports (no Horovod here).

Each setting that must be equal on every rank (the model's parameters, the compression, the
options, the step) becomes one 56-bit digest; the ranks allgather one row of them, and a rank
whose row differs from rank 0's is named with the settings that differ. A difference found
later would be a hang, a message-size error or ranks that silently diverge.
"""

import hashlib

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
