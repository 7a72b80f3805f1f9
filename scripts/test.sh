#!/usr/bin/env bash
# The whole test suite, as CI runs it: install missing packages, build, then every
# unit and end-to-end test through ctest. The e2e tests mount FUSE and a tmpfs, so
# run as root. Extra arguments go to ctest (e.g. scripts/test.sh -R e2e.test_dcp).
#
# Environment: BUILD_DIR (default build), JOBS (default 2), FUZZ_SECONDS (default 20;
# 0 skips the fuzz step), CKPTFS_CRASH_ROUNDS (test_order_crash kills, default 3),
# SANITIZE (default 1; 0 leaves the sanitizer runs out), DEBUG_FLAGS (default -g1).
#
# The build is RelWithDebInfo with line tables only (-g1 instead of -g): g++ emits the
# same -O2 code either way, backtraces still have functions, files and lines, and full
# debug info costs about a third more compile time. DEBUG_FLAGS=-g for a debugging session.
#
# Sanitizers: the unit tests are also built with clang under ASan+UBSan in
# <BUILD_DIR>-asan and the pipeline tests under TSan in <BUILD_DIR>-tsan
# (scripts/sanitize.sh build), and run by the ctest entries sanitize.asan and
# sanitize.tsan, so ctest's summary and exit code cover them. When ctest gets arguments
# (a filter) the trees are not built up front; a selected sanitize.* entry builds its own.
#
# The output ends with ctest's summary and the exit code is ctest's. The bounded
# fuzz step (scripts/fuzz.sh, when present) runs before ctest; if it (or the sanitizer
# build) failed while ctest passed, the exit code is that step's, so neither failure
# ever passes CI.
set -uo pipefail

cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
DEBUG_FLAGS=${DEBUG_FLAGS:--g1}

scripts/setup.sh || exit $?

SANITIZE=${SANITIZE:-1}
san_tests=ON
[ "$SANITIZE" = 0 ] && san_tests=OFF

cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 $DEBUG_FLAGS -DNDEBUG" \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 $DEBUG_FLAGS -DNDEBUG" \
  -DCKPTFS_SANITIZER_TESTS="$san_tests" || exit $?
cmake --build "$BUILD_DIR" -j"$JOBS" || exit $?
echo "test.sh: setup and build took ${SECONDS}s"

san_rc=0
if [ "$san_tests" = ON ] && [ $# -eq 0 ]; then
  # The instrumented trees sit next to the build tree, where the ctest entries look.
  build_abs="$(cd "$BUILD_DIR" && pwd)"
  ASAN_BUILD_DIR="$build_abs-asan" TSAN_BUILD_DIR="$build_abs-tsan" SAN_JOBS="$JOBS" \
    scripts/sanitize.sh build
  san_rc=$?
  [ "$san_rc" -ne 0 ] && echo "test.sh: SANITIZER BUILD FAILED (exit $san_rc)" >&2
  echo "test.sh: sanitizer builds done at ${SECONDS}s"
fi

fuzz_rc=0
if [ -x scripts/fuzz.sh ] && [ "$FUZZ_SECONDS" != 0 ]; then
  echo "test.sh: fuzz step, FUZZ_SECONDS=$FUZZ_SECONDS per target"
  FUZZ_SECONDS=$FUZZ_SECONDS timeout --kill-after=30 900 scripts/fuzz.sh
  fuzz_rc=$?
  if [ "$fuzz_rc" -ne 0 ]; then
    echo "test.sh: FUZZ STEP FAILED (exit $fuzz_rc); see above" >&2
  fi
  echo "test.sh: fuzz step done at ${SECONDS}s"
fi

ctest --test-dir "$BUILD_DIR" --output-on-failure "$@"
ctest_rc=$?
if [ "$ctest_rc" -eq 0 ] && [ "$fuzz_rc" -ne 0 ]; then
  exit "$fuzz_rc"
fi
if [ "$ctest_rc" -eq 0 ] && [ "$san_rc" -ne 0 ]; then
  exit "$san_rc"
fi
exit "$ctest_rc"
