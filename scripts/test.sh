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
# Side work of a full run (no arguments) runs beside the build and the tests, not before
# them: on a 2-core machine the suite mostly waits on mounts, sleeps and torch start-up.
#  * The caches the e2e tests need (the torch 2.x Debian roots, Megatron's source) are
#    fetched while the build compiles (network and dpkg, nice 10; <build>/prefetch.log).
#    Each script holds its own lock, so a test that needs one before it is ready waits.
#  * The instrumented trees (scripts/sanitize.sh build), then their unit tests beside the
#    bounded fuzz step (scripts/fuzz.sh), run at nice 19 while ctest runs the unit and e2e
#    tests, holding <build>-side.lock (log: <build>-side.log). The ctest entries
#    sanitize.asan, sanitize.tsan and fuzz.smoke run after every e2e test (DEPENDS), wait
#    for that lock and report those runs: a failed build, a failed test, a sanitizer report
#    or a fuzz crash fails its entry.
# The output ends with ctest's summary and the exit code is ctest's, so no failure of a
# side step ever passes CI. SANITIZE=0 leaves out the sanitizer and fuzz entries.
set -uo pipefail

cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
DEBUG_FLAGS=${DEBUG_FLAGS:--g1}
export FUZZ_SECONDS

# CI cannot reach GitHub: Megatron-LM's source comes from the tarball beside the checkout
# (../shared/third_party), checked against the sha256 scripts/megatron_src.sh pins.
megatron_tarball="$(pwd)/../shared/third_party/Megatron-LM-core_v0.16.1.tar.gz"
if [ -z "${MEGATRON_TARBALL:-}" ] && [ -f "$megatron_tarball" ]; then
  export MEGATRON_TARBALL="$megatron_tarball"
fi

scripts/setup.sh || exit $?

SANITIZE=${SANITIZE:-1}
san_tests=ON
[ "$SANITIZE" = 0 ] && san_tests=OFF

mkdir -p "$BUILD_DIR"
build_abs="$(cd "$BUILD_DIR" && pwd)"
if [ $# -eq 0 ]; then
  (
    nice -n 10 scripts/torch_root.sh trixie
    nice -n 10 scripts/torch_root.sh sid
    scripts/megatron_src.sh
  ) >"$build_abs/prefetch.log" 2>&1 </dev/null &
fi

cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 $DEBUG_FLAGS -DNDEBUG" \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 $DEBUG_FLAGS -DNDEBUG" \
  -DCKPTFS_SANITIZER_TESTS="$san_tests" || exit $?
cmake --build "$BUILD_DIR" -j"$JOBS" || exit $?
echo "test.sh: setup and build took ${SECONDS}s"

side_pid=""
if [ "$san_tests" = ON ] && [ $# -eq 0 ]; then
  rm -f "$build_abs-fuzz.result" "$build_abs-fuzz.result.log" "$build_abs-san".*.result \
    "$build_abs-san".*.result.log
  # Taken here, before ctest starts, so that no entry can miss it; the subshell keeps it
  # until its work is done.
  exec 8>"$build_abs-side.lock"
  flock 8
  (
    ASAN_BUILD_DIR="$build_abs-asan" TSAN_BUILD_DIR="$build_abs-tsan" SAN_JOBS="$JOBS" \
      nice -n 19 scripts/sanitize.sh build
    echo "test.sh side: sanitizer builds exit $? at ${SECONDS}s"
    # The instrumented unit tests run here too, beside the fuzz step (which is bounded by
    # time, not work): the ctest entries sanitize.asan and sanitize.tsan report these runs
    # (SAN_RESULT) instead of running them after the e2e tests, on the suite's critical path.
    (
      # Beside the e2e tests at nice 19 a binary gets a fraction of a core: store_tests
      # under ASan takes 105 s per shard on an idle machine here and ran past 600 s beside
      # them (CI of d15be0d). The time limit per binary is for a hang, not for the load.
      for kind in asan tsan; do
        SAN_TIMEOUT="${SAN_TIMEOUT:-1500}" \
        ASAN_BUILD_DIR="$build_abs-asan" TSAN_BUILD_DIR="$build_abs-tsan" SAN_JOBS="$JOBS" \
          nice -n 19 scripts/sanitize.sh run "$kind" >"$build_abs-san.$kind.result.log" 2>&1
        echo $? >"$build_abs-san.$kind.result"
        echo "test.sh side: $kind tests exit $(cat "$build_abs-san.$kind.result") at ${SECONDS}s"
      done
    ) &
    san_pid=$!
    # Its build and 8 targets took 740 s of the 900 s it had beside the tests (CI of 49a67d1
    # here), and fuzz.smoke failed on CI's machine (d15be0d) without saying why, a timeout
    # the likely cause: the limit is for a hang, not the load.
    if [ "$FUZZ_SECONDS" != 0 ]; then
      FUZZ_BUILD_DIR="$build_abs-fuzz" nice -n 19 timeout --kill-after=30 1800 scripts/fuzz.sh \
        >"$build_abs-fuzz.result.log" 2>&1
      echo $? >"$build_abs-fuzz.result"
      echo "test.sh side: fuzz step exit $(cat "$build_abs-fuzz.result") at ${SECONDS}s"
    fi
    wait "$san_pid"
  ) >"$build_abs-side.log" 2>&1 </dev/null &
  side_pid=$!
  exec 8>&-
  echo "test.sh: sanitizer builds and tests and the fuzz step run beside the tests ($build_abs-side.log)"
fi

ctest --test-dir "$BUILD_DIR" --output-on-failure "$@"
ctest_rc=$?
# A filtered run may not have waited for the side job: stop it.
[ -n "$side_pid" ] && kill -- "$side_pid" 2>/dev/null
exit "$ctest_rc"
