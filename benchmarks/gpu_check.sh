#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with a CUDA GPU and PyTorch (nothing is downloaded:
# everything comes from this repository, and Horovod from a carried source distribution):
#   0. the environment, with what building Horovod there needs (nvcc, cmake, g++);
#   1. with HVD_SDIST=PATH (Horovod 0.28.1's sdist, e.g. from `pip download --no-deps
#      --no-binary :all: horovod==0.28.1`): Horovod built there in the background (PyTorch + Gloo,
#      CUDA for the torch ops, no NCCL: several ranks then share the one GPU, CUDA tensors moving
#      through the host), installed into $HVD_SITE; its log is horovod-build.log;
#   2. tests/test_cuda.py: selection, the codec and the DDP hook's numpy-checked scenarios
#      (tests/dist/check_ddp.py, 2 and 3 ranks sharing the GPU over gloo) on the GPU; then, once
#      Horovod is built, its Horovod tests: tests/dist/check_device.py (the drop-in TopK,
#      hvd_topk's optimizer, GradScaler; 34 checks against numpy) under horovodrun --gloo with
#      2 and 3 ranks on the GPU (the two CPU-only Horovod checks are left out);
#   3. benchmarks/cuda_selection.py: selection and codec timings at ResNet-50 / BERT-base shapes;
#      benchmarks/cuda_syncs.py: host synchronisations per step inside each DDP hook;
#   4. examples/ddp_gpt.py on the GPU (NCCL, one rank) with each DDP hook of GPT_RUNS (default:
#      none, fp16, PowerSGD rank 4, hvd_topk's LocalAdamW recipe at 1%, then none and hvd_topk's
#      under bf16 autocast), GPT_STEPS steps (1000), lr 1e-2.
# A stage is skipped when fewer than its seconds are left of GPU_CHECK_BUDGET_S (540): a call
# cut off at its limit returns nothing, one that ends in time returns what ran. GPU_CHECK_STAGES
# (default "torch horovod bench gpt") picks stages 2 (torch: TORCH_TESTS_K, pytest's -k for the
# torch paths, default "not horovod"; horovod: the build and its tests), 3 and 4.
# HVD_BUILD_WHEELS=DIR: wheels installed into $HVD_SITE before the build (Horovod's setup.py
# needs cffi, which that machine lacks and cannot download): `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
# -d DIR cffi pycparser` here. The run of 2026-12-04: HVD_SDIST=.hvd/horovod-0.28.1.tar.gz
# HVD_BUILD_WHEELS=.whl, both folders ignored by git and carried to the machine.
# Run from the repository root:  OUT=DIR HVD_TOPK_GIT=COMMIT [HVD_SDIST=...] bash benchmarks/gpu_check.sh
# Writes DIR/log.txt, DIR/horovod-build.log, DIR/cuda-selection.{json,md}, DIR/cuda-syncs.{json,md},
# DIR/gpt-1gpu.{json,txt}.
set -uo pipefail
OUT=${OUT:-/tmp/hvd_topk_gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD:$PWD/tests/support:$PWD/tests" PYTHONUNBUFFERED=1 HVD_TOPK_GIT=${HVD_TOPK_GIT:-?}
LOG="$OUT/log.txt"
STEPS=${GPT_STEPS:-1000}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
HVD_SITE=${HVD_SITE:-/tmp/hvd_site}
STAGES=" ${GPU_CHECK_STAGES:-torch horovod bench gpt} "
stage() { [[ "$STAGES" == *" $1 "* ]]; }
status=0
step() { echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS} s in)" | tee -a "$LOG"; }
# room NEED NAME: true when NEED seconds are left of the budget, else says the stage is skipped
room() { [ $((SECONDS + $1)) -le "$BUDGET" ] && return 0; step "skipped, too little time left: $2"; status=1; return 1; }

build_horovod() {  # Horovod from $HVD_SDIST into $HVD_SITE (see the header)
  local wrap wheels gxx
  wrap=$(mktemp -d) wheels=$(mktemp -d) gxx=$(command -v g++)
  # Horovod 0.28.1 asks for C++14, PyTorch's headers need C++17 (horovod issue #3996). Only
  # -std=c++14 is rewritten: nvcc hands its -std=c++11 to this host compiler too, and the two
  # must agree (cudafe++ fails on C++17 preprocessed output).
  cat > "$wrap/g++" <<WRAPPER
#!/bin/sh
for a in "\$@"; do
  case "\$a" in -std=c++14) set -- "\$@" -std=c++17 ;; *) set -- "\$@" "\$a" ;; esac
  shift
done
exec $gxx "\$@"
WRAPPER
  chmod +x "$wrap/g++"
  echo "g++: $gxx ($($gxx -dumpfullversion)); nvcc: $(command -v nvcc); cmake: $(cmake --version | head -1)"
  if [ -n "${HVD_BUILD_WHEELS:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --target "$HVD_SITE" "$HVD_BUILD_WHEELS"/*.whl || return 1
  fi
  export PYTHONPATH="$HVD_SITE${PYTHONPATH:+:$PYTHONPATH}"
  # What that machine's newer tools need of Horovod 0.28.1 (each failed the build there on
  # 2026-12-04, without touching Horovod's sources): CMake 4 refuses gloo's
  # cmake_minimum_required below 3.5 unless CMAKE_POLICY_VERSION_MINIMUM is set; g++ 13 no
  # longer brings <string>, <stdexcept>, <cstdint>... in through other headers, which Horovod's
  # relied on, so they are force-included (C++ only: nvcc's host pass does not see CXXFLAGS)
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
  HOROVOD_WITHOUT_MXNET=1 HOROVOD_BUILD_CUDA_CC_LIST=${HVD_CUDA_CC:-90} CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  HOROVOD_CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")") \
  CPATH=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")${CPATH:+:$CPATH} \
  CXXFLAGS="-include cstdint -include string -include stdexcept -include memory -include functional -include limits -include cstring ${CXXFLAGS:-}" CXX="$wrap/g++" CC=$(command -v gcc) MAKEFLAGS="-j$(nproc)" \
    $PY -m pip wheel -v --no-index --no-build-isolation --no-deps -w "$wheels" "$HVD_SDIST" || return 1
  $PY -m pip install -q --no-index --no-deps --upgrade --target "$HVD_SITE" "$wheels"/horovod-*.whl
}

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
  # Horovod's gloo resolves this machine's host name
  getent hosts "$(hostname)" >/dev/null || echo "127.0.0.1 $(hostname)" >> /etc/hosts
} >> "$LOG" 2>&1

if [ -n "${HVD_SDIST:-}" ] && stage horovod; then
  step "building Horovod from $HVD_SDIST in the background"
  ( started=$SECONDS; timeout 330 bash -c "$(declare -f build_horovod); PY=$PY HVD_SITE=$HVD_SITE HVD_SDIST=$HVD_SDIST HVD_BUILD_WHEELS=${HVD_BUILD_WHEELS:-} build_horovod"
    echo "build exit $? after $((SECONDS - started)) s" ) > "$OUT/horovod-build.log" 2>&1 &
  build=$!
fi

if stage torch; then
  step "tests/test_cuda.py, the torch paths"
  timeout 240 $PY -m pytest -v -p no:cacheprovider -k "${TORCH_TESTS_K:-not horovod}" tests/test_cuda.py >> "$LOG" 2>&1 || status=1
  tail -3 "$LOG"
fi

if [ -n "${HVD_SDIST:-}" ] && stage horovod; then
  step "waiting for the Horovod build"
  wait "$build"
  tail -n 3 "$OUT/horovod-build.log" | tee -a "$LOG"
  export PYTHONPATH="$HVD_SITE:$PYTHONPATH" PATH="$HVD_SITE/bin:$PATH"
  if ! $PY -c "import horovod.torch" >> "$LOG" 2>&1; then
    step "Horovod did not build or import: its GPU checks not run"; status=1
  elif room 100 "Horovod on the GPU"; then
    horovodrun --check-build >> "$LOG" 2>&1
    step "tests/test_cuda.py, Horovod on the GPU (check_device.py, horovodrun --gloo, 2 and 3 ranks)"
    HVD_TOPK_MPI_TIMEOUT=180 timeout 400 $PY -m pytest -v -p no:cacheprovider -k "${HOROVOD_TESTS_K:-horovod_paths}" \
      tests/test_cuda.py >> "$LOG" 2>&1 || status=1
    tail -3 "$LOG"
  fi
fi

stage bench && room 60 "benchmarks/cuda_selection.py" && step "benchmarks/cuda_selection.py" &&
timeout 120 $PY benchmarks/cuda_selection.py --out "$OUT/cuda-selection" >> "$LOG" 2>&1 || status=1
tail -2 "$LOG"

stage bench && room 60 "benchmarks/cuda_syncs.py" && step "benchmarks/cuda_syncs.py" &&
timeout 120 $PY benchmarks/cuda_syncs.py --out "$OUT/cuda-syncs" >> "$LOG" 2>&1 || status=1
tail -6 "$LOG"

stage gpt && step "examples/ddp_gpt.py on the GPU, $STEPS steps, each hook"
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
stage gpt || GPT_RUNS=" "
for run in ${GPT_RUNS:-none fp16 powersgd topk none-bf16 topk-bf16}; do
  room 45 "examples/ddp_gpt.py, $run" || continue
  hook=${run%-bf16}; amp=none; [ "$run" != "$hook" ] && amp=bf16
  timeout 120 $PY -m torch.distributed.run --standalone --local-addr 127.0.0.1 --nproc_per_node 1 \
    examples/ddp_gpt.py --device cuda --hook "$hook" --amp "$amp" --steps "$STEPS" --lr 1e-2 --quiet \
    --json "$runs/$run.json" >> "$LOG" 2>&1 || status=1
  summarise > "$OUT/gpt-1gpu.txt" 2>&1 || status=1
  grep "^$run:" "$OUT/gpt-1gpu.txt" || echo "$run: failed"
done
[ -f "$OUT/gpt-1gpu.txt" ] && cat "$OUT/gpt-1gpu.txt" >> "$LOG"
step "done, status $status"
exit $status
