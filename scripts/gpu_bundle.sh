#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs on a GPU machine that has no Debian 12 packages:
# stripped ckptfs, ckptfs-admin, fusermount3 and gpu_tests, with every shared library they
# load that is not glibc's own, into DEST (default .devbundle/ in the checkout, which git
# ignores). The bundle runs on any x86-64 Linux with glibc >= Debian 12's (2.36).
# Usage: scripts/gpu_bundle.sh [BUILD_DIR] [DEST]
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${1:-$REPO/build}"
DEST="${2:-$REPO/.devbundle}"
rm -rf "$DEST"
mkdir -p "$DEST/bin" "$DEST/real" "$DEST/lib"
for b in "$BUILD/bin/ckptfs" "$BUILD/bin/ckptfs-admin" "$BUILD/bin/gpu_tests" \
         "$(command -v fusermount3)"; do
  [ -x "$b" ] || { echo "gpu_bundle: $b missing (build ckptfs ckptfs-admin gpu_tests)" >&2; exit 1; }
  name="$(basename "$b")"
  strip -o "$DEST/real/$name" "$b"
  # The bundled libraries are for these programs alone: a Python with its own UCX (torch's)
  # must not see them, so each program gets them through a wrapper, not the environment.
  # CKPTFS_CUDART_DIR adds the directory of libcudart (dlopened by the staging pool).
  cat >"$DEST/bin/$name" <<WRAP
#!/bin/sh
here="\$(dirname "\$(readlink -f "\$0")")/.."
LD_LIBRARY_PATH="\$here/lib\${CKPTFS_CUDART_DIR:+:\$CKPTFS_CUDART_DIR}" exec "\$here/real/$name" "\$@"
WRAP
  chmod +x "$DEST/bin/$name"
done
# glibc's libraries stay those of the machine it runs on; everything else travels.
ldd "$DEST"/real/* 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux-x86-64)\.so' |
  while read -r lib; do cp -L "$lib" "$DEST/lib/"; done
du -sh "$DEST" | awk '{print "gpu_bundle: " $1 " in '"$DEST"'"}'
