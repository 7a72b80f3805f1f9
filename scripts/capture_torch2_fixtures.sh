#!/usr/bin/env bash
# Captures the real torch 2.x and Megatron-core fixtures into tests/fixtures/dcp (and
# tests/fixtures/safetensors) from the cached Debian roots: torch 2.6 (trixie) and the newest
# torch (sid), with Megatron-core from scripts/megatron_src.sh in the sid root. Each
# checkpoint comes with its manifest, read back with the torch that wrote it
# (scripts/capture_torch2_fixtures.py, which lists them). Needs root; run it again after a
# torch or Megatron update and review the diff.
#
#   scripts/capture_torch2_fixtures.sh [OUT]     (default: tests/fixtures)
#
# The ZStandard fixture needs python3-zstandard in the sid root (scripts/torch_root.sh
# installs it; an older root gets it here with apt-get).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
OUT=$(realpath -m "${1:-$REPO/tests/fixtures}")
[[ $(id -u) == 0 ]] || { echo "needs root (chroot, mounts)" >&2; exit 1; }
MEGATRON=$("$HERE/megatron_src.sh") || MEGATRON=""

MOUNTS=()
cleanup() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
    umount "${MOUNTS[i]}" 2>/dev/null || umount -l "${MOUNTS[i]}" 2>/dev/null || true
  done
  MOUNTS=()
  [[ -n "${PROG:-}" ]] && rm -rf "$PROG" "${ROOT:?}/ckpt" "${ROOT:?}/var/tmp/capture-out"
  return 0
}
trap cleanup EXIT
trap 'exit 143' TERM INT

capture() {  # SUITE [--megatron]
  local suite=$1; shift
  ROOT=$("$REPO/scripts/torch_root.sh" "$suite")
  exec 8>"$ROOT.use.lock"; flock 8
  mount -t proc proc "$ROOT/proc"; MOUNTS+=("$ROOT/proc")
  mount --bind /dev "$ROOT/dev"; MOUNTS+=("$ROOT/dev"); mount --make-private "$ROOT/dev"
  mount -t tmpfs -o size=1g,mode=1777 tmpfs "$ROOT/dev/shm"; MOUNTS+=("$ROOT/dev/shm")
  if [[ $suite == sid ]] && ! chroot "$ROOT" python3 -c 'import zstandard' 2>/dev/null; then
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
    chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
      sh -c 'apt-get -o Acquire::Check-Valid-Until=false -q -y update && apt-get -q -y install --no-install-recommends python3-zstandard && apt-get clean' \
      >&2 || echo "capture: no python3-zstandard in the root: no zstd fixture" >&2
  fi
  PROG=$(mktemp -d "$ROOT/var/tmp/capture-XXXXXX")
  cp "$HERE/capture_torch2_fixtures.py" "$REPO/tests/e2e/megatron_clients.py" "$PROG/"
  cp -r "$REPO/tests/e2e/megatron_cpu_shim" "$PROG/"
  local env=() args=()
  if [[ " $* " == *" --megatron "* && -n "$MEGATRON" ]]; then
    cp -r "$MEGATRON/megatron" "$PROG/"
    env=(CKPTFS_MEGATRON_CPU_SHIM=1 "PYTHONPATH=/${PROG#$ROOT/}/megatron_cpu_shim:/${PROG#$ROOT/}")
    args=(--megatron)
  fi
  rm -rf "$ROOT/ckpt" "$ROOT/var/tmp/capture-out"
  chroot "$ROOT" env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 PYTHONWARNINGS=ignore \
    "${env[@]}" python3 "/${PROG#$ROOT/}/capture_torch2_fixtures.py" \
    --out /var/tmp/capture-out "${args[@]}" 2>&1 | grep -E "^captured|^no |Error|error" >&2
  mkdir -p "$OUT/dcp" "$OUT/safetensors"
  local d
  for d in "$ROOT"/var/tmp/capture-out/*; do
    [[ $(basename "$d") == safetensors ]] && continue
    rm -rf "$OUT/dcp/$(basename "$d")"; cp -a "$d" "$OUT/dcp/"
  done
  if [[ -d "$ROOT/var/tmp/capture-out/safetensors" ]]; then
    cp -a "$ROOT"/var/tmp/capture-out/safetensors/. "$OUT/safetensors/"
  fi
  cleanup
  exec 8>&-
}

capture trixie
capture sid --megatron
echo "fixtures in $OUT" >&2
