#!/usr/bin/env bash
# Fetch (once) and print a Megatron-LM source tree at a pinned release, for the tests and
# benchmarks that drive megatron/core's dist_checkpointing (tests/e2e/test_megatron_dcp.py).
#
#   scripts/megatron_src.sh            prints the directory holding megatron/core
#
# MEGATRON_SRC=DIR: use that checkout (it must hold megatron/core); nothing is downloaded.
# Otherwise the release tarball of MEGATRON_TAG (default core_v0.16.1) is downloaded from
# GitHub, as a user would get it, and megatron/ is extracted into
# $CKPTFS_CACHE/megatron-$MEGATRON_TAG (default /var/cache/ckptfs), published by a rename
# once complete. core_v0.16.1 is the newest release whose `import megatron.core` does not
# need triton (0.17 and later import it at package import: megatron.core ->
# pipeline_parallel -> transformer.moe.paged_stash), and Debian has no triton package.
# MEGATRON_URL overrides the tarball's address (a mirror). MEGATRON_TARBALL=FILE uses that
# tarball instead of downloading (CI has no GitHub; scripts/test.sh passes
# ../shared/third_party/Megatron-LM-core_v0.16.1.tar.gz when it is there): its sha256 must be
# the one pinned here for the tag, else the script fails (exit 1) and downloads nothing.
# Exit 2: it cannot
# be downloaded and nothing is cached (callers skip).
set -euo pipefail

TAG=${MEGATRON_TAG:-core_v0.16.1}
# The sha256 of `git archive` of the tag's megatron/core and LICENSE (the tarball beside
# the project in CI) and of GitHub's release tarball are different files: each is pinned.
declare -A PINNED=(
  [core_v0.16.1]=c7f97b724c92169b837eae6086951474eb98f71ff95ff359153428e82ee8af3b
)
CACHE=${CKPTFS_CACHE:-/var/cache/ckptfs}
log() { echo "megatron_src: $*" >&2; }

if [[ -n "${MEGATRON_SRC:-}" ]]; then
  [[ -f "$MEGATRON_SRC/megatron/core/__init__.py" ]] \
    || { log "MEGATRON_SRC=$MEGATRON_SRC holds no megatron/core"; exit 1; }
  echo "$MEGATRON_SRC"; exit 0
fi
DEST="$CACHE/megatron-$TAG"
if [[ -f "$DEST/.ckptfs-ready" ]]; then echo "$DEST"; exit 0; fi

URL=${MEGATRON_URL:-https://github.com/NVIDIA/Megatron-LM/archive/refs/tags/$TAG.tar.gz}
mkdir -p "$CACHE"
exec 9>"$DEST.lock"
flock 9
if [[ -f "$DEST/.ckptfs-ready" ]]; then echo "$DEST"; exit 0; fi
PART="$DEST.part"
rm -rf "$PART" "$PART.tar.gz"
mkdir -p "$PART"
if [[ -n "${MEGATRON_TARBALL:-}" ]]; then
  [[ -f "$MEGATRON_TARBALL" ]] || { rm -rf "$PART"; log "MEGATRON_TARBALL=$MEGATRON_TARBALL: no such file"; exit 1; }
  want=${PINNED[$TAG]:-}
  [[ -n "$want" ]] || { rm -rf "$PART"; log "no sha256 pinned for $TAG: cannot check $MEGATRON_TARBALL"; exit 1; }
  have=$(sha256sum "$MEGATRON_TARBALL" | cut -d' ' -f1)
  if [[ "$have" != "$want" ]]; then
    rm -rf "$PART"
    log "$MEGATRON_TARBALL: sha256 $have, pinned $want for $TAG: refusing it"; exit 1
  fi
  cp "$MEGATRON_TARBALL" "$PART.tar.gz"
  URL="file://$(realpath "$MEGATRON_TARBALL")"
  log "using $MEGATRON_TARBALL (sha256 $have)"
else
  log "downloading $URL"
  if ! curl -sSfL --retry 3 --max-time 600 -o "$PART.tar.gz" "$URL"; then
    rm -rf "$PART" "$PART.tar.gz"
    log "cannot download $URL"; exit 2
  fi
fi
# `git archive` tarballs have one top folder, as GitHub's do.
tar -xzf "$PART.tar.gz" -C "$PART" --strip-components=1 --wildcards '*/megatron/core/*' \
  '*/LICENSE' || { rm -rf "$PART" "$PART.tar.gz"; log "bad tarball $URL"; exit 1; }
rm -f "$PART.tar.gz"
[[ -f "$PART/megatron/core/__init__.py" ]] || { log "no megatron/core in $URL"; exit 1; }
printf 'tag=%s\nurl=%s\n' "$TAG" "$URL" >"$PART/.ckptfs-ready"
rm -rf "$DEST"
mv "$PART" "$DEST"
log "ready: $DEST"
echo "$DEST"
