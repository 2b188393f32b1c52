"""exchange="sparse_allreduce" checked step by step against its numpy reference.

Each sparse bucket is cut into P parts; part j of bucket b at step s is chosen by rank
(j + s + b) mod P (its top-k of each tensor piece there); every rank sends its own
error-feedback accumulator at every chosen position, and what it did not send stays in its
residual (tests/support/reference.py, ``sparse_allreduce_bucket``). Run under mpirun -np 2, 3 and 4:
PYTHONPATH=.:tests/support mpirun -np 4 python tests/dist/check_sparse_allreduce.py
"""

import horovod.torch as hvd
from check_optimizer import BUCKET_PER_TENSOR, check_nonfinite, contract
from harness import run

CHECKS = [
    contract("sparse allreduce", exchange="sparse_allreduce", steps=5),
    contract("sparse allreduce, sum", exchange="sparse_allreduce", op=hvd.Sum),
    contract("sparse allreduce, no error feedback", exchange="sparse_allreduce", error_feedback=False),
    contract("sparse allreduce, momentum correction", exchange="sparse_allreduce", momentum_correction=0.9),
    contract("sparse allreduce, warm-up", exchange="sparse_allreduce", warmup_steps=3, steps=5),
    contract("sparse allreduce, bucket per tensor", exchange="sparse_allreduce", fusion_bytes=4096,
             buckets=BUCKET_PER_TENSOR, steps=5),
    contract("sparse allreduce, no gradient on rank 1", exchange="sparse_allreduce", drop_head2_on_rank=1),
    contract("sparse allreduce, bucket scope", exchange="sparse_allreduce", selection_scope="bucket", steps=5),
    contract("sparse allreduce, bucket scope, bucket per tensor", exchange="sparse_allreduce",
             selection_scope="bucket", fusion_bytes=4096, buckets=BUCKET_PER_TENSOR),
    ("non-finite gradient, sparse allreduce, on the rank choosing its part",
     lambda: check_nonfinite("sparse_allreduce", culprit="chooser")),
    ("non-finite gradient, sparse allreduce, on another rank",
     lambda: check_nonfinite("sparse_allreduce", culprit="other")),
]


if __name__ == "__main__":
    run(CHECKS)
