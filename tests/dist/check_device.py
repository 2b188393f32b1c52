"""The Horovod paths with the model, its gradients and the tensors on ``HVD_TOPK_CHECK_DEVICE``
(``cuda`` on a GPU machine): a selection of the numpy-checked scenarios of check_compressor.py
(the drop-in ``TopK`` under ``hvd.allreduce`` and ``hvd.DistributedOptimizer``),
check_optimizer.py (hvd_topk's optimizer: the error-feedback contract over each exchange,
checkpoints, non-finite gradients, LocalAdamW, DeMo) and check_amp.py (GradScaler), unchanged:
those scripts put their models and inputs on the harness's ``DEVICE``.

Horovod built without NCCL moves CUDA tensors through the host (``*CudaOnCPU``), so several
ranks can share one GPU; NCCL takes one GPU per rank. On a GPU machine (tests/test_cuda.py runs
it so, under ``horovodrun --gloo`` on one host):

    HVD_TOPK_CHECK_DEVICE=cuda horovodrun --gloo -np 2 python tests/dist/check_device.py

On the CPU it runs the same checks as those scripts do (``--list`` prints the names).
"""

import check_amp
import check_compressor
import check_optimizer
from harness import run

# Names as the three scripts give them; each is looked up, so a renamed check fails here loudly.
CHOSEN = {
    check_compressor: [
        "allreduce",
        "horovod optimizer: default",
        "horovod optimizer: op=Sum",
        "horovod optimizer: passes=2",
        "horovod dense: passes=2",
        "step() after synchronize() without skip_synchronize(): the same result",
    ],
    check_optimizer: [
        "contract: default",
        "contract: sum",
        "contract: momentum correction",
        "contract: warm-up",
        "contract: 16-bit values, small buckets",
        "contract: 16-bit values, bucket scope, momentum correction, decay",
        "contract: 16-bit values, sparse allreduce",
        "contract: compact pairs",
        "contract: bucket scope",
        "contract: residual decay, momentum correction, sparse allreduce",
        "dense exchange",
        "dense fp16 exchange",
        "auto: trial, agreement, choice",
        "checkpoint resume",
        "elastic state",
        "broadcast optimizer state",
        "non-finite gradient",
        "a second synchronize() before step() changes nothing",
        "LocalAdamW: Adam per rank, updates exchanged",
        "LocalAdamW: checkpoint resume",
        "LocalAdamW: bf16 resume with the variance sketch",
        "LocalAdamW: lr in the residual, decay, sparse allreduce",
        "LocalAdamW: global variance",
        "DeMo: sign of the exchanged average",
        "DeMo: rms normalisation, sparse allreduce",
    ],
    check_amp: [
        "residuals follow loss-scale changes",
        "gradient overflow skipped on every rank",
        "drop-in: GradScaler pattern",
        "horovod dense: GradScaler pattern",
    ],
}


def chosen():
    checks = []
    for module, names in CHOSEN.items():
        known = dict(module.CHECKS)
        missing = [n for n in names if n not in known]
        if missing:
            raise KeyError(f"{module.__name__} has no check named {missing}")
        checks += [(f"{module.__name__.removeprefix('check_')}: {n}", known[n]) for n in names]
    return checks


CHECKS = chosen()

if __name__ == "__main__":
    run(CHECKS)
