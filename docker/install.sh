#!/usr/bin/env bash
# One script that sets up everything hvd_topk needs, on a fresh Debian 12 machine or in the
# Docker image: Debian packages (OpenMPI, cmake, g++), a virtual environment, torch, numpy,
# mpi4py, pytest, Horovod 0.28.1 (PyTorch + MPI + Gloo, + NCCL ops where CUDA torch and NCCL
# are present) and hvd_topk itself. Idempotent: run it again and it only checks.
#
# Why the C++ wrapper: Horovod 0.28.1's CMake hard-codes -std=c++14, but PyTorch >= 2.1 headers
# need C++17 (horovod issue #3996, fixed upstream after 0.28.1). We rewrite the flag in a tiny
# compiler wrapper instead of patching Horovod's sources.
#
# Environment knobs:
#   VENV=.venv                 where the virtual environment goes ("system" = use the current python)
#   TORCH_SPEC=torch==2.13.0   pip requirement for torch (e.g. a CUDA build on a GPU host); unset,
#                              a torch already in the environment is kept (a later `make test`
#                              does not undo the one you chose)
#   HOROVOD_VERSION=0.28.1
#   HVD_TOPK_CACHE=~/.cache/hvd_topk   built wheels are cached here, outside the clone
#   HVD_TOPK_SKIP_APT=1        do not touch Debian packages (they are already there)
#   HVD_TOPK_EDITABLE=1        install hvd_topk editable (default 1 in a clone)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$REPO/.venv}
TORCH_CHOSEN=${TORCH_SPEC:+1}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
CACHE=${HVD_TOPK_CACHE:-$HOME/.cache/hvd_topk}
EDITABLE=${HVD_TOPK_EDITABLE:-1}
T0=$(date +%s)

log() { printf '[install %3ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }

# ---- 1. Debian packages --------------------------------------------------------------------
# python3-dev: Horovod compiles against Python.h. openssh-server + iproute2: multi-host
# launches and the emulated hosts of tests and benchmarks.
APT_PKGS=(openmpi-bin libopenmpi-dev cmake g++ make python3-venv python3-dev openssh-server iproute2)
if [ "${HVD_TOPK_SKIP_APT:-0}" != 1 ]; then
  missing=()
  for p in "${APT_PKGS[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get: install them by hand"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    log "apt-get install ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    log "Debian packages present"
  fi
fi
command -v mpirun >/dev/null || die "mpirun not found after installing OpenMPI"

# ---- 2. virtual environment ----------------------------------------------------------------
if [ "$VENV" = system ]; then
  PY=$(command -v python3)
else
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV"
    python3 -m venv "$VENV"
  fi
  PY=$VENV/bin/python
fi
PIP=("$PY" -m pip --disable-pip-version-check -q)
# --no-compile: section 6 byte-compiles everything at once, in parallel (pip would, package by
# package, serially).
INSTALL=("${PIP[@]}" install --no-compile)

# ---- 3. Python dependencies ----------------------------------------------------------------
mkdir -p "$CACHE/wheels"
TORCH_REQ=("$TORCH_SPEC")
if [ -z "$TORCH_CHOSEN" ] && TORCH_HAVE=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
  TORCH_REQ=()
  log "torch $TORCH_HAVE present: kept (set TORCH_SPEC to change it)"
fi
log "pip: ${TORCH_REQ[*]} numpy mpi4py pytest scikit-learn matplotlib lightning"
# setuptools 77: pyproject.toml's SPDX license (a fresh venv comes with 65)
"${INSTALL[@]}" "setuptools>=77" wheel packaging
# mpi4py compiles against OpenMPI; --find-links picks the wheel cached by an earlier run.
"${INSTALL[@]}" --find-links "$CACHE/wheels" "${TORCH_REQ[@]}" numpy mpi4py pytest pytest-timeout \
  scikit-learn cloudpickle psutil pyyaml matplotlib "lightning>=2.4,<3"
if ! ls "$CACHE"/wheels/mpi4py-*.whl >/dev/null 2>&1; then
  "${PIP[@]}" wheel --no-deps --find-links "$CACHE/wheels" -w "$CACHE/wheels" mpi4py || true
fi

# ---- 4. Horovod, built once per (horovod, torch build, Python) and cached: the key holds no MPI or
#      NCCL version, so after changing either remove $HVD_TOPK_CACHE/horovod-* (or set HVD_TOPK_CACHE)
TORCH_ID=$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')
HAS_CUDA=$("$PY" -c 'import torch; print(int(torch.version.cuda is not None))')
HVD_CACHE=$CACHE/horovod-$HOROVOD_VERSION-torch-$TORCH_ID
PYTAG=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')  # one wheel per Python in the cache
mkdir -p "$HVD_CACHE"

hvd_ok() {
  "$PY" - "$HOROVOD_VERSION" <<'PY' 2>/dev/null
import sys
import horovod, horovod.torch as hvd
assert horovod.__version__ == sys.argv[1]
assert hvd.mpi_built() and hvd.gloo_built()
PY
}

if hvd_ok; then
  log "Horovod $HOROVOD_VERSION already installed"
else
  WHEEL=$(ls "$HVD_CACHE"/horovod-*-"$PYTAG"-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$WHEEL" ]; then
    log "building Horovod $HOROVOD_VERSION against torch $TORCH_ID (a few minutes, once per machine)"
    WRAP=$(mktemp -d)
    cat > "$WRAP/g++" <<'WRAPPER'
#!/bin/sh
# Horovod 0.28.1 asks for C++14; PyTorch headers need C++17. Only -std=c++14: nvcc hands its
# -std=c++11 to this host compiler too (a CUDA build), and the two must agree.
for a in "$@"; do
  case "$a" in
    -std=c++14) set -- "$@" -std=c++17 ;;
    *) set -- "$@" "$a" ;;
  esac
  shift
done
exec /usr/bin/g++ "$@"
WRAPPER
    chmod +x "$WRAP/g++"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
           HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    if [ "$HAS_CUDA" = 1 ] && { [ -n "${NCCL_HOME:-}" ] || ldconfig -p | grep -q libnccl; }; then
      log "CUDA torch and NCCL found: building with HOROVOD_GPU_OPERATIONS=NCCL"
      export HOROVOD_GPU_OPERATIONS=NCCL
    fi
    # What newer tools need of Horovod 0.28.1 (each failed its build on the H200's Ubuntu 24.04,
    # 2026-12-04, benchmarks/gpu_check.sh): CMake 4 refuses gloo's old cmake_minimum_required;
    # g++ 13 no longer pulls <string>, <stdexcept>, <cstdint>... in through other headers
    CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    CXXFLAGS="-include cstdint -include string -include stdexcept -include memory -include functional -include limits -include cstring ${CXXFLAGS:-}" \
    CXX=$WRAP/g++ CC=/usr/bin/gcc MAKEFLAGS="-j$(nproc)" \
      "${PIP[@]}" wheel --no-build-isolation --no-deps --no-binary horovod \
      "horovod==$HOROVOD_VERSION" -w "$HVD_CACHE" > "$HVD_CACHE/build.log" 2>&1 \
      || { tail -n 40 "$HVD_CACHE/build.log" >&2; die "Horovod build failed; full log: $HVD_CACHE/build.log"; }
    rm -rf "$WRAP"
    WHEEL=$(ls "$HVD_CACHE"/horovod-*-"$PYTAG"-*.whl | head -n1)
  else
    log "using cached Horovod wheel $WHEEL"
  fi
  "${INSTALL[@]}" --force-reinstall --no-deps "$WHEEL" \
    || { rm -f "$WHEEL"; die "installing the cached Horovod wheel $WHEEL failed; it was removed: run again to build it afresh"; }
  "${INSTALL[@]}" "$WHEEL"  # its light Python dependencies
fi

# ---- 5. hvd_topk itself --------------------------------------------------------------------
if [ -f "$REPO/pyproject.toml" ]; then
  log "installing hvd_topk"
  if [ "$EDITABLE" = 1 ]; then
    "${INSTALL[@]}" --no-deps --no-build-isolation -e "$REPO"
  else
    "${INSTALL[@]}" --no-deps --no-build-isolation "$REPO"
  fi
  log "building the native CPU selection kernel"
  "$PY" -m hvd_topk.native >/dev/null || die "hvd_topk's native kernel cannot be built or loaded (see above)"
fi

# ---- 6. byte-compile ------------------------------------------------------------------------
# pip ran with --no-compile (section 2), so Python compiles each module when it is first imported
# and caches the result, unless PYTHONDONTWRITEBYTECODE is set (it is on the machines this
# project is developed and tested on): then every process compiles torch again (import torch
# 3.3 s instead of 1.5 s), and make test starts several hundred. compileall writes the caches
# whatever that variable says, and skips those already up to date (about 15 s the first time,
# 4 s after). Some packages ship files that are not meant to compile (templates); compileall
# skips them and exits 1, so its status says nothing here.
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
log "byte-compiling $SITE"
"$PY" -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true

# ---- 7. verify -----------------------------------------------------------------------------
BIN=$(dirname "$PY")
CHECK=$("$BIN/horovodrun" --check-build 2>&1) || die "horovodrun --check-build failed: $CHECK"
for want in PyTorch MPI Gloo; do
  echo "$CHECK" | grep -Eq "\[X\] $want" || { echo "$CHECK" >&2; die "Horovod was built without $want"; }
done
"$PY" -c 'import hvd_topk' 2>/dev/null || [ ! -f "$REPO/pyproject.toml" ] || die "import hvd_topk failed"
log "done: Horovod lists PyTorch, MPI and Gloo; python is $PY"
