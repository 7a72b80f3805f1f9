#!/usr/bin/env bash
# The whole test suite, as CI runs it: install missing packages, build, then every
# unit and end-to-end test through ctest. The e2e tests mount FUSE and a tmpfs, so
# run as root. Extra arguments go to ctest (e.g. scripts/test.sh -R e2e.test_dcp).
#
# Environment: BUILD_DIR (default build), JOBS (default 2), FUZZ_SECONDS (default 20;
# 0 skips the fuzz step), CKPTFS_CRASH_ROUNDS (test_order_crash kills, default 3),
# SANITIZE=1 (also run scripts/sanitize.sh: unit tests under ASan+UBSan and TSan).
#
# The output ends with ctest's summary and the exit code is ctest's. The bounded
# fuzz step (scripts/fuzz.sh, when present) runs before ctest; if it failed while
# ctest passed, the exit code is the fuzz step's, so a fuzz failure never passes CI.
set -uo pipefail

cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
FUZZ_SECONDS=${FUZZ_SECONDS:-20}

scripts/setup.sh || exit $?

cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo || exit $?
cmake --build "$BUILD_DIR" -j"$JOBS" || exit $?
echo "test.sh: setup and build took ${SECONDS}s"

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

san_rc=0
if [ "${SANITIZE:-0}" != 0 ] && [ -x scripts/sanitize.sh ]; then
  # ASan+UBSan over every unit test, TSan over the pipeline tests: two more full builds,
  # so opt-in (SANITIZE=1) to keep the default run well under 20 minutes on 2 cores.
  SANITIZE=1 scripts/sanitize.sh
  san_rc=$?
  [ "$san_rc" -ne 0 ] && echo "test.sh: SANITIZER STEP FAILED (exit $san_rc)" >&2
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
