#!/usr/bin/env bash
# Build (once) and print a cached Debian root with PyTorch 2.x and PyTorch's own DCP tests.
#
#   scripts/torch_root.sh [trixie|sid]      (default trixie: torch 2.6; sid: the newest)
#
# The root is made with `debootstrap --variant=minbase SUITE` under the same cache
# directory tests/e2e/test_deb_install.py uses for its bookworm root (/var/cache/ckptfs,
# override with CKPTFS_CACHE), then python3-torch and the test dependencies are installed
# inside it from the Debian archive. The release's source tarball (pool/main/p/pytorch,
# the orig.tar.xz of the installed python3-torch's upstream version) is downloaded next to
# the root, and its test/distributed/checkpoint/ is extracted into ROOT/opt/torch-tests.
# A root is only published (renamed into place) once complete, so an interrupted run
# leaves nothing half-made behind and a second call is instant. Prints the root's path on
# stdout (progress goes to stderr). Exit 2: the archive cannot be reached (callers skip).
#
# Needs root, debootstrap (scripts/setup.sh), curl, xz. Every mount made while building
# (proc inside the root) is undone on exit, failure included.
set -euo pipefail

SUITE=${1:-trixie}
case "$SUITE" in trixie|sid) ;; *) echo "usage: $0 [trixie|sid]" >&2; exit 64;; esac
CACHE=${CKPTFS_CACHE:-/var/cache/ckptfs}
MIRROR=${CKPTFS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOT="$CACHE/torchroot-$SUITE"
READY="$ROOT/.ckptfs-torch-ready"

if [[ -f "$READY" ]]; then echo "$ROOT"; exit 0; fi

log() { echo "torch_root[$SUITE]: $*" >&2; }
[[ $(id -u) == 0 ]] || { log "needs root (debootstrap, chroot)"; exit 1; }
command -v debootstrap >/dev/null || { log "debootstrap is not installed (scripts/setup.sh)"; exit 1; }
if ! curl -sSfI --max-time 15 "$MIRROR/dists/$SUITE/Release" >/dev/null; then
  log "Debian archive $MIRROR unreachable"; exit 2
fi

mkdir -p "$CACHE"
# One builder per suite at a time; a waiter finds the root ready afterwards.
exec 9>"$CACHE/torchroot-$SUITE.lock"
flock 9
if [[ -f "$READY" ]]; then echo "$ROOT"; exit 0; fi

PART="$CACHE/torchroot-$SUITE.part"
MOUNTS=()
cleanup() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
    umount "${MOUNTS[i]}" 2>/dev/null || umount -l "${MOUNTS[i]}" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'exit 143' TERM INT  # so that the EXIT trap undoes the mounts

# A leftover .part from an interrupted run: start over (debootstrap refuses half-made roots).
if [[ -d "$PART" && ! -f "$PART/.ckptfs-debootstrap-done" ]]; then
  for m in proc sys dev; do umount -l "$PART/$m" 2>/dev/null || true; done
  rm -rf --one-file-system "$PART"
fi
if [[ ! -d "$PART" ]]; then
  log "debootstrap --variant=minbase $SUITE (a few minutes)"
  debootstrap --variant=minbase "$SUITE" "$PART" "$MIRROR" >"$CACHE/torchroot-$SUITE.debootstrap.log" 2>&1 \
    || { log "debootstrap failed, see $CACHE/torchroot-$SUITE.debootstrap.log"; exit 1; }
  touch "$PART/.ckptfs-debootstrap-done"
fi

cp /etc/resolv.conf "$PART/etc/resolv.conf"
mount -t proc proc "$PART/proc"; MOUNTS+=("$PART/proc")
in_root() {
  chroot "$PART" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 "$@"
}
APT=(apt-get -o Acquire::Check-Valid-Until=false -o Acquire::Retries=3 -q -y)
APTLOG="$CACHE/torchroot-$SUITE.apt.log"
: >"$APTLOG"
# deb-src too: `apt-get source --print-uris` names the release's source tarball.
echo "deb-src $MIRROR $SUITE main" >"$PART/etc/apt/sources.list.d/ckptfs-src.list"
log "apt-get update (log: $APTLOG)"
in_root "${APT[@]}" update >>"$APTLOG" 2>&1 || { log "apt-get update failed, see $APTLOG"; exit 1; }
PKGS=(python3-torch python3-safetensors python3-setuptools python3-psutil python3-numpy python3-zstandard
      python3-pytest python3-expecttest python3-hypothesis)
# Install what the archive has of these (python3-expecttest etc. are not in every suite).
HAVE=()
for p in "${PKGS[@]}"; do
  if in_root apt-cache show "$p" >/dev/null 2>&1; then HAVE+=("$p"); else log "not in $SUITE: $p"; fi
done
log "apt-get install ${HAVE[*]}"
in_root "${APT[@]}" install --no-install-recommends "${HAVE[@]}" >>"$APTLOG" 2>&1 \
  || { log "apt-get install failed, see $APTLOG"; exit 1; }
in_root apt-get clean

# PyTorch's own tests, from the release's source tarball in the pool.
VER=$(in_root dpkg-query -W -f='${Version}' python3-torch)
# The orig tarball of the source version the installed binary was built from, as apt
# names it (URI, file name, size, SHA256): e.g. pytorch_2.6.0+dfsg.orig.tar.xz.
URIS=$(in_root apt-get source --print-uris -q "pytorch=${VER%%+b*}" 2>>"$APTLOG" \
       || in_root apt-get source --print-uris -q pytorch 2>>"$APTLOG" || true)
ORIG=$(grep -E "\.orig\.tar\.(xz|gz|bz2)' " <<<"$URIS" | head -n1 || true)
if [[ -n "$ORIG" ]]; then
  read -r URL NAME _ SUM <<<"$ORIG"
  URL=${URL//\'/}; SUM=${SUM#SHA256:}
else  # no deb-src answer: the pool path, '+' escaped as apt does
  UP=${VER#*:}; UP=${UP%-*}
  NAME="pytorch_$UP.orig.tar.xz"; SUM=""
  URL="$MIRROR/pool/main/p/pytorch/${NAME//+/%2b}"
fi
TARBALL="$CACHE/$NAME"
if [[ ! -s "$TARBALL" ]]; then
  log "downloading $NAME"
  if curl -sSf --retry 3 --max-time 900 -o "$TARBALL.part" "$URL"; then
    if [[ -n "$SUM" ]] && ! sha256sum "$TARBALL.part" | grep -q "^$SUM "; then
      log "$NAME: SHA256 mismatch"; rm -f "$TARBALL.part"; exit 1
    fi
    mv "$TARBALL.part" "$TARBALL"
  else
    # A mirror may lag behind sid's source pool: then the newest release's tests this
    # cache already holds (e.g. trixie's 2.6 ones) are used, and the ready file says so.
    rm -f "$TARBALL.part"
    OTHER=$(ls -1 "$CACHE"/pytorch_*.orig.tar.* 2>/dev/null | sort -V | tail -n1 || true)
    [[ -n "$OTHER" ]] || { log "download of $URL failed and no other release's tests are cached (run $0 trixie first)"; exit 1; }
    log "download of $URL failed: using the tests of $(basename "$OTHER")"
    TARBALL=$OTHER
  fi
fi
rm -rf "$PART/opt/torch-tests"; mkdir -p "$PART/opt/torch-tests"
tar -xaf "$TARBALL" -C "$PART/opt/torch-tests" --strip-components=1 --wildcards \
  '*/test/distributed/checkpoint/*'
[[ -d "$PART/opt/torch-tests/test/distributed/checkpoint" ]] \
  || { log "test/distributed/checkpoint not found in $TARBALL"; exit 1; }
TORCH=$(in_root python3 -c 'import torch; print(torch.__version__)')
# The tests' helpers come with the installed torch (torch.testing._internal): check one.
in_root python3 -c 'import torch.testing._internal.common_utils, torch.testing._internal.distributed._tensor.common_dtensor' >&2 \
  || { log "torch.testing._internal is incomplete in $SUITE's python3-torch"; exit 1; }

cleanup; MOUNTS=()
printf 'suite=%s\ntorch=%s\ndeb=%s\ntests=%s\n' "$SUITE" "$TORCH" "$VER" "$(basename "$TARBALL")" \
  >"$PART/.ckptfs-torch-ready"
rm -rf --one-file-system "$ROOT"
mv "$PART" "$ROOT"
log "ready: torch $TORCH"
echo "$ROOT"
