"""The small model of the distributed checks (tests/dist): two big weights (the sparse path),
small biases (the dense path) and an optional second head, and the inputs the DDP scripts feed
it; no Horovod, no torch.distributed."""

import numpy as np
import torch


class Net(torch.nn.Module):
    """Two big weights (sparse path) and small biases (dense path); head2 is optional."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(40, 96)
        self.fc2 = torch.nn.Linear(96, 10)
        self.head2 = torch.nn.Linear(96, 10)

    def forward(self, x, use_head2=True):
        h = torch.relu(self.fc1(x))
        out = self.fc2(h)
        return out + self.head2(h) if use_head2 else out


def batch(step, rank, part=0, n=24, device=None):
    """Rank ``rank``'s micro-batch ``part`` at ``step`` for ``Net``: the same on every run."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + part)
    x, y = torch.randn(n, 40, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    return (x, y) if device is None else (x.to(device), y.to(device))


def distinct_16bit(gen, shape=(32, 32)):
    """A float32 tensor of ``shape`` (1024 elements) whose magnitudes are the 1024 numbers
    2**e x (1 + m/128), e in -6..1, m in 0..127, in a random order and with random signs: exact
    in bfloat16 and float16, spanning 2**-6 .. 4, and no two alike (no ties for Top-K, which
    torch.topk and the native selection break differently)."""
    assert np.prod(shape) == 1024, shape
    e, m = np.meshgrid(np.arange(-6, 2), np.arange(128), indexing="ij")
    magnitudes = torch.from_numpy((2.0 ** e * (1 + m / 128)).reshape(-1).astype(np.float32))
    signs = torch.randint(0, 2, (1024,), generator=gen) * 2 - 1
    return (magnitudes[torch.randperm(1024, generator=gen)] * signs).reshape(shape)


def sixteen_bit_checks(title, check):
    """CHECKS entries running ``check(dtype, exchange)`` for bf16 and fp16 over the allgather and
    the sparse allreduce, named "<title>: bf16", "<title>: bf16, sparse allreduce", and so on."""
    return [(f"{title}: {label}" + (", sparse allreduce" if exchange == "sparse_allreduce" else ""),
             lambda dtype=dtype, exchange=exchange: check(dtype, exchange))
            for label, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
            for exchange in ("allgather", "sparse_allreduce")]
