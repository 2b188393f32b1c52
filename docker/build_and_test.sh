#!/usr/bin/env bash
# Build the hvd_topk image and run the distributed tests inside it, with one command, on a
# machine without a Docker engine or a registry (Debian 12, root, no stdin needed):
#
#   bash docker/build_and_test.sh
#
# 1. tools:  podman, buildah, debootstrap (apt-get, only if missing)
# 2. base:   a Debian bookworm root made by debootstrap from the apt mirror of this machine,
#            imported as localhost/debian-base:bookworm (skipped when that image exists)
# 3. build:  docker/Dockerfile with BASE_IMAGE=that base, `podman build --isolation=chroot`
#            (layer cache: code changes rebuild only the last layers, not Horovod)
# 4. test:   in a container of the image (buildah from + buildah run --isolation chroot):
#            horovodrun --check-build, pytest (unit + mpirun -np 2 / -np 3 tests), and the ssh
#            set-up: sshd on port 12345, key login works, password login is refused, and an
#            mpirun job launched over that ssh
# 5. clean:  removes the containers and temporary directories it made (also on failure)
#
# Prints the duration of each phase; exits non-zero on any failure.
# Knobs (environment):
#   HVD_TOPK_IMAGE=localhost/hvd_topk:latest       image to build
#   HVD_TOPK_BASE_IMAGE=localhost/debian-base:bookworm
#   DEBIAN_MIRROR=...                              default: from /etc/apt/sources.list(.d)
#   HVD_TOPK_NO_CACHE=1                            build without the layer cache (cold build)
#   HVD_TOPK_WHEELS=/opt/wheels                    local wheels mounted into the build when the
#                                                  directory holds a torch wheel
#   HVD_TOPK_CA_BUNDLE=...                         CA bundle mounted for pip in the build
#                                                  (default: $PIP_CERT, else the system one)
#   HVD_TOPK_PYTEST_ARGS='-m "not slow"'           what pytest runs in the image
#   HVD_TOPK_SKIP_TESTS=1                          build only
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
IMAGE=${HVD_TOPK_IMAGE:-localhost/hvd_topk:latest}
BASE=${HVD_TOPK_BASE_IMAGE:-localhost/debian-base:bookworm}
WHEELS=${HVD_TOPK_WHEELS:-/opt/wheels}
PYTEST_ARGS=${HVD_TOPK_PYTEST_ARGS:-'-m "not slow"'}
SSH_PORT=12345
export DEBIAN_FRONTEND=noninteractive

T_ALL=$(date +%s)
PHASES=()
CTR=""
CURRENT=""
BOOTSTRAP_DIR=""
LOGDIR=$(mktemp -d /tmp/hvd_topk-image.XXXXXX)

log() { printf '[image %4ss] %s\n' "$(( $(date +%s) - T_ALL ))" "$*"; }
die() { printf '[image] ERROR: %s\n' "$*" >&2; exit 1; }

summary() {
  local rc=$1
  echo "----- phase durations -----"
  local p
  for p in "${PHASES[@]}"; do echo "  $p"; done
  echo "  total: $(( $(date +%s) - T_ALL ))s"
  if [ "$rc" = 0 ]; then
    echo "RESULT: OK ($IMAGE)"
  else
    echo "RESULT: FAILED in phase '$CURRENT' (exit $rc)$([ -d "$LOGDIR" ] && echo "; logs in $LOGDIR")"
  fi
}

cleanup() {
  local rc=$?
  set +e
  if [ -n "$CTR" ]; then
    # An sshd left by an interrupted ssh check runs as a host process (chroot isolation has no
    # pid namespace): end it by the pid it wrote inside the container.
    local mnt pid
    mnt=$(buildah mount "$CTR" 2>/dev/null)
    if [ -n "$mnt" ] && [ -f "$mnt/tmp/hvd-ssh-check/sshd.pid" ]; then
      pid=$(cat "$mnt/tmp/hvd-ssh-check/sshd.pid")
      [ -n "$pid" ] && grep -q sshd "/proc/$pid/comm" 2>/dev/null && kill "$pid"
    fi
    buildah umount "$CTR" >/dev/null 2>&1
    buildah rm "$CTR" >/dev/null 2>&1 && log "removed container $CTR"
  fi
  if [ -n "$BOOTSTRAP_DIR" ] && [ -d "$BOOTSTRAP_DIR" ]; then
    # debootstrap mounts proc/sys in the target; never delete through a mount
    grep -o " $BOOTSTRAP_DIR[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l
    rm -rf --one-file-system "$BOOTSTRAP_DIR"
  fi
  if [ "$rc" = 0 ] || [ -z "$(ls -A "$LOGDIR" 2>/dev/null)" ]; then rm -rf "$LOGDIR"; fi
  summary "$rc"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# run a phase and record its duration
phase() {
  local name=$1; shift
  local t0=$(date +%s)
  CURRENT=$name
  log "== $name"
  "$@"
  local dt=$(( $(date +%s) - t0 ))
  PHASES+=("$(printf '%-34s %5ss' "$name" "$dt")")
  log "== $name: ${dt}s"
}

# ---- 1. tools ------------------------------------------------------------------------------
tools() {
  local missing=() c
  for c in podman buildah debootstrap; do command -v "$c" >/dev/null || missing+=("$c"); done
  if [ ${#missing[@]} -eq 0 ]; then log "podman, buildah, debootstrap present"; return; fi
  [ "$(id -u)" = 0 ] || die "need root to install ${missing[*]} (and to build with chroot isolation)"
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" > "$LOGDIR/apt.log" 2>&1 \
    || { tail -n 30 "$LOGDIR/apt.log" >&2; die "apt-get install ${missing[*]} failed"; }
}

# ---- 2. base image -------------------------------------------------------------------------
# The Debian mirror this machine's apt uses (one-line or deb822 format), for suite bookworm.
debian_mirror() {
  local m=""
  if [ -f /etc/apt/sources.list ]; then
    m=$(awk '$1 == "deb" && / bookworm( |$)/ {
               for (i = 2; i <= NF; i++) if ($i ~ /^(https?|ftp|file):/) { print $i; exit } }' \
        /etc/apt/sources.list)
  fi
  if [ -z "$m" ] && ls /etc/apt/sources.list.d/*.sources >/dev/null 2>&1; then
    m=$(awk 'function flush() { if (u != "" && s) { print u; done = 1; exit } u = ""; s = 0 }
             FNR == 1 { flush() }
             /^[ \t]*$/ { flush(); next }
             /^URIs:/ { u = $2 }
             /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == "bookworm") s = 1 }
             END { if (!done && u != "" && s) print u }' /etc/apt/sources.list.d/*.sources)
  fi
  echo "${m:-http://deb.debian.org/debian}"
}

base_image() {
  if podman image exists "$BASE"; then log "$BASE exists (cached)"; return; fi
  local mirror=${DEBIAN_MIRROR:-$(debian_mirror)}
  BOOTSTRAP_DIR=$(mktemp -d /var/tmp/hvd_topk-debootstrap.XXXXXX)
  log "debootstrap --variant=minbase bookworm from $mirror"
  debootstrap --variant=minbase bookworm "$BOOTSTRAP_DIR" "$mirror" > "$LOGDIR/debootstrap.log" 2>&1 \
    || { tail -n 30 "$LOGDIR/debootstrap.log" >&2; die "debootstrap failed"; }
  rm -rf "$BOOTSTRAP_DIR"/var/cache/apt/archives/*.deb "$BOOTSTRAP_DIR"/var/lib/apt/lists/*
  tar -C "$BOOTSTRAP_DIR" --numeric-owner -c . \
    | podman import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf --one-file-system "$BOOTSTRAP_DIR"; BOOTSTRAP_DIR=""
  log "imported $BASE"
}

# ---- 3. image ------------------------------------------------------------------------------
build_image() {
  local args=(--isolation chroot --layers --force-rm -f docker/Dockerfile -t "$IMAGE"
              --build-arg "BASE_IMAGE=$BASE")
  [ "${HVD_TOPK_NO_CACHE:-0}" = 1 ] && args+=(--no-cache)
  # This project's machines reach PyPI but not download.pytorch.org, and keep the CPU torch
  # wheel on disk: mount it into the build instead of pulling PyPI's multi-GB CUDA wheel.
  if ls "$WHEELS"/torch-*.whl >/dev/null 2>&1; then
    log "using local wheels from $WHEELS ($(cd "$WHEELS" && ls torch-*.whl | head -n1))"
    args+=(-v "$WHEELS:/wheels:ro" --build-arg WHEELS_DIR=/wheels --build-arg TORCH_INDEX=none)
  fi
  # Machines behind a TLS-intercepting proxy (like this project's) need their CA bundle for pip.
  local ca=${HVD_TOPK_CA_BUNDLE:-${PIP_CERT:-}}
  [ -n "$ca" ] || [ ! -f /etc/ssl/certs/ca-certificates.crt ] || ca=/etc/ssl/certs/ca-certificates.crt
  if [ -n "$ca" ] && [ -f "$ca" ]; then
    args+=(-v "$(dirname "$(readlink -f "$ca")"):/run/host-ca:ro"
           --build-arg "CA_BUNDLE=/run/host-ca/$(basename "$(readlink -f "$ca")")")
  fi
  local old_id
  old_id=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
  log "podman build ${args[*]} ."
  set +e
  podman build "${args[@]}" . 2>&1 | tee "$LOGDIR/build.log" | grep -E --line-buffered \
    '^(STEP|COMMIT|--> Using cache|\[install|torch:|Successfully|Error|error)'
  local st=${PIPESTATUS[0]}
  set -e
  [ "$st" = 0 ] || { tail -n 40 "$LOGDIR/build.log" >&2; die "image build failed (exit $st)"; }
  # the image this build replaced is now untagged: remove it (kept if something still uses it)
  local new_id
  new_id=$(podman image inspect --format '{{.Id}}' "$IMAGE")
  if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
    podman rmi "$old_id" >/dev/null 2>&1 && log "removed the previous image ${old_id:0:12}" || true
  fi
  log "built $IMAGE ($(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}'))"
}

# ---- 4. tests in the image -----------------------------------------------------------------
# --hostname localhost: the chroot keeps this machine's /etc/hosts, where the container's own
# (random) host name is missing, and Horovod's gloo transport resolves the host name it runs on
# (else "Unable to find address for: <name>" and a crash; tests/test_host_shapes.py). A container
# that Docker or podman starts has its name in /etc/hosts.
in_image() {
  timeout --kill-after=30 "${HVD_TOPK_IMAGE_TIMEOUT:-1800}" \
    buildah run --isolation chroot --hostname localhost "$CTR" -- bash -c "$1"
}

new_container() {
  CTR=$(buildah from --pull=never "$IMAGE")
  log "container $CTR"
}

check_build() {
  in_image 'set -e; cd /hvd_topk; command -v python mpirun horovodrun; horovodrun --check-build'
}

pytest_in_image() {
  in_image "set -e; cd /hvd_topk; python -m pytest -v -p no:cacheprovider $PYTEST_ARGS tests"
}

# sshd as configured by the image (port 12345, key-only) and an mpirun launched through it.
ssh_check() {
  in_image 'bash /hvd_topk/docker/ssh_check.sh'
}

phase "tools (apt if missing)" tools
phase "base image (debootstrap + import)" base_image
phase "image build" build_image
if [ "${HVD_TOPK_SKIP_TESTS:-0}" != 1 ]; then
  phase "container" new_container
  phase "check-build in image" check_build
  phase "pytest in image ($PYTEST_ARGS)" pytest_in_image
  phase "ssh + mpirun over ssh in image" ssh_check
fi
