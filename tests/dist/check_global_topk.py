"""exchange="global_topk" checked step by step against its numpy reference.

Every rank proposes the top ``global_topk_candidates`` x k of its own error-feedback
accumulator over the whole bucket (k: the allgather's); every rank's accumulator is summed at
the union of the proposals; the P x k positions with the largest summed magnitude move, each
by every rank's value there; everything else stays in each rank's residual
(tests/support/reference.py, ``global_topk_bucket``). Run under mpirun -np 2 and 3:
PYTHONPATH=.:tests/support mpirun -np 3 python tests/dist/check_global_topk.py
"""

import horovod.torch as hvd
import hvd_topk
from check_optimizer import (BUCKET_PER_TENSOR, Net, check_checkpoint_resume, check_inner_resume,
                             check_local_adamw, check_nonfinite, contract)
from harness import raises, run

# head2 at half scale: no magnitude of fc2's gradient ties with head2's (the reference picks the
# lowest position among ties, torch.topk its own)
GLOBAL = {"exchange": "global_topk", "head2_scale": 0.5}


def check_compact_refused():
    """Compact pairs are the allgather's format: refused by name (the options' own checks,
    single-process, are in tests/test_options.py)."""
    with raises(ValueError, match="exchange='global_topk' sums values", what="global_topk with compact pairs"):
        hvd_topk.DistributedOptimizer(hvd_topk.LocalAdamW(Net().parameters()),
                                      compression=hvd_topk.TopK(compact=True), exchange="global_topk")


CHECKS = [
    contract("global top-k", steps=5, **GLOBAL),
    contract("global top-k, sum", op=hvd.Sum, **GLOBAL),
    contract("global top-k, no error feedback", error_feedback=False, **GLOBAL),
    contract("global top-k, momentum correction", momentum_correction=0.9, **GLOBAL),
    contract("global top-k, residual decay", residual_decay=0.9, **GLOBAL),
    contract("global top-k, 2 candidates", global_topk_candidates=2, steps=5, **GLOBAL),
    contract("global top-k, 1 candidate, density 2%", global_topk_candidates=1, density=0.02, **GLOBAL),
    contract("global top-k, bucket scope", selection_scope="bucket", **GLOBAL),
    contract("global top-k, bucket per tensor", fusion_bytes=4096, buckets=BUCKET_PER_TENSOR, steps=5, **GLOBAL),
    ("LocalAdamW, global top-k", lambda: check_local_adamw(steps=5, exchange="global_topk", global_variance=True,
                                                          lr_in_residual=True, residual_decay=0.9, head2_scale=0.5)),
    ("non-finite gradient, global top-k, rank 0", lambda: check_nonfinite("global_topk", culprit=0)),
    ("non-finite gradient, global top-k, last rank", lambda: check_nonfinite("global_topk", culprit=hvd.size() - 1)),
    ("checkpoint resume is bitwise, global top-k", lambda: check_checkpoint_resume(**GLOBAL)),
    ("LocalAdamW checkpoint resume is bitwise, global top-k",
     lambda: check_inner_resume(lambda params: hvd_topk.LocalAdamW(params, lr=0.01, betas=(0.0, 0.95)),
                                {"betas": (0.0, 0.9)}, residual_decay=0.99, exchange="global_topk")),
    ("compact pairs refused", lambda: check_compact_refused()),
]


if __name__ == "__main__":
    run(CHECKS)
