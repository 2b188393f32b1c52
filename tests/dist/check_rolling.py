"""exchange="rolling" (the rolling mask) checked step by step against its numpy reference.

At step s, bucket b sends every entry i (the bucket's tensors laid end to end) with
i mod stride == (s + b) mod stride, stride = round(1/density); every rank sends its own
error-feedback accumulator there and keeps the rest in its residual
(tests/support/reference.py, ``rolling_bucket``). Run under mpirun -np 2 and 3:
PYTHONPATH=.:tests/support mpirun -np 3 python tests/dist/check_rolling.py
"""

import horovod.torch as hvd
from check_optimizer import (BUCKET_PER_TENSOR, check_checkpoint_resume, check_local_adamw,
                             check_local_adamw_resume, check_nonfinite, contract)
from harness import raises, run

import hvd_topk
from nets import Net


def check_refused():
    """Hierarchical is refused with the rolling mask, naming both."""
    with raises(ValueError, match="rolling", what="rolling with hierarchical=True"):
        hvd_topk.DistributedOptimizer(hvd_topk.LocalAdamW(Net().parameters()), exchange="rolling",
                                      hierarchical=True)


CHECKS = [
    contract("rolling", exchange="rolling", steps=5),
    contract("rolling, sum", exchange="rolling", op=hvd.Sum),
    contract("rolling, no error feedback", exchange="rolling", error_feedback=False),
    contract("rolling, momentum correction", exchange="rolling", momentum_correction=0.9),
    contract("rolling, warm-up (stride 4, 3, 2, ... as the density falls)", exchange="rolling",
             warmup_steps=3, steps=5),
    contract("rolling, bucket per tensor (phases spread by bucket)", exchange="rolling", fusion_bytes=4096,
             buckets=BUCKET_PER_TENSOR, steps=5),
    contract("rolling, no gradient on rank 1", exchange="rolling", drop_head2_on_rank=1),
    contract("rolling, residual decay", exchange="rolling", residual_decay=0.8, steps=5),
    ("rolling: non-finite gradient on an entry not sent", lambda: check_nonfinite("rolling")),
    ("rolling: checkpoint resume", lambda: check_checkpoint_resume(exchange="rolling")),
    ("rolling: LocalAdamW, lr in the residual, global variance", lambda: check_local_adamw(
        steps=5, lr_in_residual=True, global_variance=True, exchange="rolling")),
    ("rolling: LocalAdamW checkpoint resume", lambda: check_local_adamw_resume(
        lr_in_residual=True, global_variance=True, exchange="rolling")),
    ("rolling: hierarchical refused", check_refused),
]


if __name__ == "__main__":
    run(CHECKS)
