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
# MEGATRON_URL overrides the tarball's address (a mirror). Exit 2: it cannot be downloaded and
# nothing is cached (callers skip).
set -euo pipefail

TAG=${MEGATRON_TAG:-core_v0.16.1}
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
log "downloading $URL"
if ! curl -sSfL --retry 3 --max-time 600 -o "$PART.tar.gz" "$URL"; then
  rm -rf "$PART" "$PART.tar.gz"
  log "cannot download $URL"; exit 2
fi
tar -xzf "$PART.tar.gz" -C "$PART" --strip-components=1 --wildcards '*/megatron/core/*' \
  '*/LICENSE' || { rm -rf "$PART" "$PART.tar.gz"; log "bad tarball $URL"; exit 1; }
rm -f "$PART.tar.gz"
[[ -f "$PART/megatron/core/__init__.py" ]] || { log "no megatron/core in $URL"; exit 1; }
printf 'tag=%s\nurl=%s\n' "$TAG" "$URL" >"$PART/.ckptfs-ready"
rm -rf "$DEST"
mv "$PART" "$DEST"
log "ready: $DEST"
echo "$DEST"
