#!/usr/bin/env bash
# Builds the ckptfs Debian package with CPack:
#   scripts/package.sh [OUT_DIR]        (default: dist/)
# It configures its own tree (build-pkg/, or $BUILD_DIR) for /usr without the tests,
# builds the programs and their man pages (help2man), and writes
# OUT_DIR/ckptfs_<version>_<arch>.deb. Dependencies come from dpkg-shlibdeps.
# CUDA: CKPTFS_WITH_CUDA (AUTO by default) decides, as for any build.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-$here/dist}")
build=${BUILD_DIR:-$here/build-pkg}
jobs=${JOBS:-2}

for tool in cmake cpack dpkg-shlibdeps help2man; do
  command -v "$tool" > /dev/null || { echo "package.sh: $tool is missing (scripts/setup.sh)" >&2; exit 1; }
done

export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$here} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
launcher=()
if command -v ccache > /dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
  -DCMAKE_INSTALL_PREFIX=/usr -DCKPTFS_BUILD_TESTS=OFF -DCKPTFS_SANITIZER_TESTS=OFF \
  -DCKPTFS_WITH_CUDA="${CKPTFS_WITH_CUDA:-AUTO}" "${launcher[@]}" > "$build.configure.log"
cmake --build "$build" -j"$jobs" --target ckptfs ckptfs-admin ckptfs_man
mkdir -p "$out"
(cd "$build" && cpack -G DEB -B "$out" > "$build.cpack.log") || {
  cat "$build.cpack.log" >&2
  exit 1
}
rm -rf "$out/_CPack_Packages"
deb=$(ls -t "$out"/ckptfs_*.deb | head -1)
echo "package.sh: $deb"
dpkg-deb --info "$deb" | sed -n '/Package:/,/Description:/p'
