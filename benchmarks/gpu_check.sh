#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with a CUDA GPU and PyTorch (nothing is downloaded:
# everything comes from this repository; Horovod is not needed):
#   0. the environment, with what building Horovod there would need (nvcc, cmake, g++, CUDA and
#      NCCL headers);
#   1. tests/test_cuda.py: selection, the codec and the DDP hook's 23 numpy-checked scenarios
#      (tests/dist/check_ddp.py, 2 and 3 ranks sharing the GPU over gloo) on the GPU; its two
#      Horovod checks are left out (Horovod is not on the GPU machine, and building it there
#      from source did not fit a session's 15 minutes: the Horovod optimizer's CUDA path runs
#      there only through the codec and selection it shares with the DDP hook);
#   2. benchmarks/cuda_selection.py: selection and codec timings at ResNet-50 / BERT-base shapes;
#      benchmarks/cuda_syncs.py: host synchronisations per step inside each DDP hook;
#   3. examples/ddp_gpt.py on the GPU (NCCL, one rank) with each DDP hook: none, fp16,
#      PowerSGD rank 4, hvd_topk's (the LocalAdamW recipe at 1%), 1000 steps, lr 1e-2; then
#      none and hvd_topk's again under bf16 autocast.
# Run from the repository root:  OUT=DIR HVD_TOPK_GIT=COMMIT bash benchmarks/gpu_check.sh
# Writes DIR/log.txt, DIR/cuda-selection.{json,md}, DIR/cuda-syncs.{json,md}, DIR/gpt-1gpu.{json,txt}.
set -uo pipefail
OUT=${OUT:-/tmp/hvd_topk_gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD:$PWD/tests/support:$PWD/tests" PYTHONUNBUFFERED=1 HVD_TOPK_GIT=${HVD_TOPK_GIT:-?}
LOG="$OUT/log.txt"
STEPS=${GPT_STEPS:-1000}
status=0
step() { echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"; }

step environment
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, platform; print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  $PY -m hvd_topk.native 2>&1 | tail -2
  # what building Horovod there would have (its NCCL operations need nvcc and NCCL's headers)
  for tool in nvcc cmake g++ make mpirun; do echo "$tool: $(command -v $tool || echo absent)"; done
  $PY - <<'EOF2'
import glob, os
try:
    import nvidia
    root = os.path.dirname(list(nvidia.__path__)[0])
    for header in ("cuda_runtime.h", "nccl.h"):
        found = glob.glob(os.path.join(root, "nvidia", "*", "include", header))
        print(header + ":", found[0] if found else "absent from the nvidia wheels")
except ImportError:
    print("no nvidia wheels")
EOF2
} >> "$LOG" 2>&1

step "tests/test_cuda.py"
timeout 240 $PY -m pytest -v -p no:cacheprovider -k "not horovod_checks" tests/test_cuda.py >> "$LOG" 2>&1 || status=1
tail -3 "$LOG"

step "benchmarks/cuda_selection.py"
timeout 120 $PY benchmarks/cuda_selection.py --out "$OUT/cuda-selection" >> "$LOG" 2>&1 || status=1
tail -2 "$LOG"

step "benchmarks/cuda_syncs.py"
timeout 120 $PY benchmarks/cuda_syncs.py --out "$OUT/cuda-syncs" >> "$LOG" 2>&1 || status=1
tail -6 "$LOG"

step "examples/ddp_gpt.py on the GPU, $STEPS steps, each hook"
runs=$(mktemp -d)
summarise() {  # the finished runs into one file, rewritten after each (a call cut off keeps them)
  $PY - "$runs" "$OUT/gpt-1gpu.json" <<'EOF'
import json, sys
from pathlib import Path
runs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*.json"))}
Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
for run, r in runs.items():
    print(f"{run}: final validation loss {r['final_val_loss']:.4f}, {r['seconds']:.1f} s, "
          f"bytes {100 * r['bytes_ratio']:.2f}% of dense")
EOF
}
for run in none fp16 powersgd topk none-bf16 topk-bf16; do
  hook=${run%-bf16}; amp=none; [ "$run" != "$hook" ] && amp=bf16
  timeout 120 $PY -m torch.distributed.run --standalone --local-addr 127.0.0.1 --nproc_per_node 1 \
    examples/ddp_gpt.py --device cuda --hook "$hook" --amp "$amp" --steps "$STEPS" --lr 1e-2 --quiet \
    --json "$runs/$run.json" >> "$LOG" 2>&1 || status=1
  summarise > "$OUT/gpt-1gpu.txt" 2>&1 || status=1
  grep "^$run:" "$OUT/gpt-1gpu.txt" || echo "$run: failed"
done
cat "$OUT/gpt-1gpu.txt" >> "$LOG"
step "done, status $status"
exit $status
