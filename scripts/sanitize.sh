#!/usr/bin/env bash
# The unit tests under sanitizers, part of the default suite (scripts/test.sh):
#   * AddressSanitizer + UndefinedBehaviorSanitizer (build-asan): every unit-test binary
#     (store_tests, fs_tests, gpu_tests, mount_tests, common_tests where they exist);
#   * ThreadSanitizer (build-tsan): pipeline_tests, the concurrent pipeline tests alone
#     (flush pipeline, journal, block cache, staged file, staging pool; the list is in
#     cmake/pipeline_tests.cmake), built with only the library sources they reach.
# Any sanitizer report fails the run: the runtimes halt on the first error, and the output
# is also scanned for report headers (a report in a death-test child or a thread the test
# framework ignored still counts). Prints one summary line per binary and exits non-zero
# if any build, test or sanitizer failed.
#
# Usage: scripts/sanitize.sh [all|build|run] [asan|tsan]
#   build  configure and build the instrumented trees (scripts/test.sh does this before ctest)
#   run    bring the trees up to date (a no-op when nothing changed) and run the tests;
#          the ctest entries sanitize.asan and sanitize.tsan are `run asan` / `run tsan`
#   all    both (default)
#
# The trees are built for checking, not speed: clang at -O0 with line tables only. At -O0
# no access is optimized away, so nothing the sanitizers can see is lost, and clang
# compiles these sources at -O0 with ASan+UBSan in less than half the time g++ needs at
# -O1 (g++'s UBSan instrumentation is the slow part). Assertions stay enabled (no NDEBUG).
# Without clang the trees fall back to g++ at -O1. With clang, C++ is also compiled with
# -Wthread-safety -Werror=thread-safety (the lock annotations are checked).
#
# Environment:
#   SANITIZE=0            skip everything (exit 0)
#   SANITIZE_ONLY=asan|tsan   run one half only (same as the second argument)
#   SAN_JOBS              build parallelism (default 2)
#   SAN_TIMEOUT           seconds per test binary (default 600)
#   SAN_SHARDS            gtest shards run side by side per binary (default SAN_JOBS)
#   SAN_CC, SAN_CXX       compilers (default clang, clang++ when present, else gcc, g++)
#   SAN_OPT               optimization and debug flags (default -O0 -gline-tables-only;
#                         -O1 -g1 with g++)
#   ASAN_BUILD_DIR, TSAN_BUILD_DIR   (default <repo>/build-asan, <repo>/build-tsan)
#   ASAN_FILTER           gtest filter for the ASan run (default all but the two tests
#                         that assert a wall-clock bound, see below)
#   TSAN_FILTER           gtest filter for pipeline_tests (default all of them)
#   CKPTFS_SIDE_LOCK      `run` first waits for the lock on this file (scripts/test.sh
#                         builds the trees and runs their tests beside the e2e tests
#                         while holding it)
#   SAN_RESULT            with CKPTFS_SIDE_LOCK: `run KIND` reports that side run
#                         (SAN_RESULT.KIND.result and .result.log) if there is one
#   SAN_GTEST_ARGS        extra arguments for every test binary (e.g. --gtest_repeat=3)
set -uo pipefail

if [[ "${SANITIZE:-1}" == 0 ]]; then
  echo "sanitize.sh: SANITIZE=0, skipped"
  exit 0
fi

mode=all
only="${SANITIZE_ONLY:-}"
for arg in "$@"; do
  case "$arg" in
    all|build|run) mode=$arg ;;
    asan|tsan) only=$arg ;;
    *) echo "usage: $0 [all|build|run] [asan|tsan]" >&2; exit 2 ;;
  esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A ctest entry (run) under scripts/test.sh: its side job may still be building the trees;
# wait until it is done (CKPTFS_SIDE_LOCK, held by that job) instead of racing it.
if [[ "$mode" == run && -n "${CKPTFS_SIDE_LOCK:-}" && -e "$CKPTFS_SIDE_LOCK" ]]; then
  flock "$CKPTFS_SIDE_LOCK" true
  # That job also ran the tests (SAN_RESULT.<kind>.result holds the exit code, .result.log
  # the output): report its run instead of running them again.
  if [[ -n "${SAN_RESULT:-}" && -n "$only" && -f "$SAN_RESULT.$only.result" ]]; then
    cat "$SAN_RESULT.$only.result.log" 2>/dev/null
    rc=$(cat "$SAN_RESULT.$only.result")
    echo "sanitize.sh: the $only run beside the tests exited $rc"
    exit "$rc"
  fi
fi
jobs="${SAN_JOBS:-2}"
per_binary="${SAN_TIMEOUT:-600}"
shards="${SAN_SHARDS:-$jobs}"
asan_dir="${ASAN_BUILD_DIR:-$root/build-asan}"
tsan_dir="${TSAN_BUILD_DIR:-$root/build-tsan}"
tsan_filter="${TSAN_FILTER:-*}"
# Tests whose pass condition is a wall-clock bound measure the build, not the code: an -O0
# instrumented build parses 100,000 chunks some 40x slower than release. Their parsing and
# indexing code still runs under ASan+UBSan in every other DcpMetadata/KeyIndex test, and
# the parsers in the fuzz step too (scripts/fuzz.sh, libFuzzer with ASan+UBSan).
asan_filter="${ASAN_FILTER:--KeyIndexBench.*:DcpMetadata.HundredThousandChunksParseQuickly}"
# The journal crash model (store_tests) runs 2,000 random crash schedules in the release
# build, 8 s there and 62 s under ASan -O0 on an idle 2-core machine, several times that
# beside the e2e tests: under ASan a few hundred schedules walk the same code (every
# outcome: crashed, completed, faulty) for memory errors.
asan_crash_schedules="${CKPTFS_CRASH_SCHEDULES:-300}"
# shellcheck disable=SC2206
extra_args=(${SAN_GTEST_ARGS:-})
candidates=(store_tests fs_tests gpu_tests mount_tests common_tests)
report_re='ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:|WARNING: ThreadSanitizer|ThreadSanitizer: (reported|data race|lock-order|heap-use|thread leak)|SUMMARY: (AddressSanitizer|UndefinedBehaviorSanitizer|ThreadSanitizer)'

if [[ -n "${SAN_CXX:-}" ]]; then
  cc="${SAN_CC:-cc}" cxx="$SAN_CXX"
elif command -v clang++ >/dev/null && command -v clang >/dev/null; then
  cc=clang cxx=clang++
else
  cc=gcc cxx=g++
fi
if [[ -n "${SAN_OPT:-}" ]]; then
  opt="$SAN_OPT"
elif [[ "$cxx" == *clang* ]]; then
  opt="-O0 -gline-tables-only"
else
  opt="-O1 -g1"
fi
# clang's thread-safety analysis over the GUARDED_BY/REQUIRES annotations (common/mutex.h,
# common/thread_annotations.h): a guarded member touched without its lock fails the build.
# Code that still uses unannotated std::mutex is not checked (nothing to check against).
cxx_checks=""
if [[ "$cxx" == *clang* ]]; then
  cxx_checks="-Wthread-safety -Werror=thread-safety"
fi

summary=()
status=0
fail() { status=1; summary+=("FAIL  $*"); }
pass() { summary+=("ok    $*"); }

# Lists the unit-test targets the build tree defines (tests/<folder> with *_test.cc).
existing_targets() {
  local dir=$1 help
  help="$(cmake --build "$dir" --target help 2>/dev/null)"
  for t in "${candidates[@]}"; do
    grep -qE "(^|[ .:])$t(:|$| )" <<<"$help" && echo "$t"
  done
}

# configure DIR SANITIZERS [CMAKE ARGS...]: an instrumented tree. Test discovery is
# deferred to ctest time so the build never runs an instrumented binary. A tree that
# already has these settings is left alone (the build re-runs cmake when a CMakeLists
# changed), so `run` on an up-to-date tree costs nothing.
configure() {
  local dir=$1 san=$2
  shift 2
  local args=(-DCMAKE_BUILD_TYPE=Sanitize -DCMAKE_C_FLAGS_SANITIZE="$opt"
    -DCMAKE_CXX_FLAGS_SANITIZE="$opt${cxx_checks:+ $cxx_checks}" -DCKPTFS_SANITIZE="$san" -DCKPTFS_BUILD_TESTS=ON
    -DCKPTFS_SANITIZER_TESTS=OFF -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST "$@")
  local stamp="$dir/.ckptfs-sanitize-config"
  local want="$cc $cxx ${args[*]}"
  if [[ -f "$dir/CMakeCache.txt" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    return 0
  fi
  # The compiler of an existing tree cannot change; start it again when it would.
  if [[ -f "$dir/CMakeCache.txt" ]] && ! grep -qx "CMAKE_CXX_COMPILER:[A-Z]*=.*$(basename "$cxx")" \
      "$dir/CMakeCache.txt" 2>/dev/null; then
    rm -rf "$dir"
  fi
  mkdir -p "$dir"
  CC="$cc" CXX="$cxx" cmake -S "$root" -B "$dir" "${args[@]}" >"$dir.configure.log" 2>&1 || return 1
  echo "$want" >"$stamp"
}

# build LABEL DIR TARGETS...: builds, with the log in DIR.build.log.
build() {
  local label=$1 dir=$2 t0=$SECONDS
  shift 2
  if ! cmake --build "$dir" -j"$jobs" --target "$@" >"$dir.build.log" 2>&1; then
    grep -E 'error|Error' "$dir.build.log" | head -n 30 >&2
    fail "$label: build of $* (see $dir.build.log)"
    return 1
  fi
  if grep -qE '(Building|Linking) ' "$dir.build.log"; then
    echo "   $label: built $* in $((SECONDS - t0))s ($cxx $opt)"
  fi
}

# run_binary LABEL LOG CMD...: runs a test binary as SAN_SHARDS gtest shards side by side
# (the instrumented tests are single-threaded for the most part; shards keep both cores
# busy), each with the per-binary time limit, and records ok/FAIL from the exit statuses
# and a scan of the output for sanitizer reports. LOG gets every shard's output in turn.
run_binary() {
  local label=$1 log=$2
  shift 2
  local t0=$SECONDS rc=0 i pids=() r
  for ((i = 0; i < shards; i++)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
      timeout --kill-after=30 "$per_binary" "$@" >"$log.$i" 2>&1 &
    pids+=($!)
  done
  : >"$log"
  for ((i = 0; i < shards; i++)); do
    wait "${pids[$i]}"
    r=$?
    { echo "===== shard $i of $shards: exit $r"; cat "$log.$i"; } >>"$log"
    rm -f "$log.$i"
    # A timeout outranks any other failure in the verdict.
    if [[ $r -eq 124 || $r -eq 137 ]]; then rc=$r; elif [[ $rc -eq 0 ]]; then rc=$r; fi
  done
  local took=$((SECONDS - t0))
  local passed failed tests_line
  passed=$(grep -hoE '^\[  PASSED  \] [0-9]+' "$log" | awk '{s += $NF} END {print s + 0}')
  failed=$(grep -hoE '^\[  FAILED  \] [0-9]+ test' "$log" | awk '{s += $(NF-1)} END {print s + 0}')
  tests_line="$passed passed, $failed failed"
  if grep -qE "$report_re" "$log"; then
    fail "$label: sanitizer report (${took}s, exit $rc) -- see $log"
    echo "!! $label: sanitizer report; first lines:" >&2
    grep -nE -A25 "$report_re" "$log" | head -n 60 >&2
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    fail "$label: timed out after ${per_binary}s -- see $log"
    tail -n 30 "$log" >&2
  elif [[ $rc -ne 0 ]]; then
    fail "$label: exit $rc (${took}s, $tests_line) -- see $log"
    grep -E '^\[  FAILED  \] [A-Za-z]' "$log" | sort -u | head -n 20 >&2
    # What each failed expectation said (CI keeps only this output, not the log).
    echo "-- the failed expectations:" >&2
    grep -E -A7 ': Failure$' "$log" | grep -vE '^\[20[0-9]{2}-' | head -n 80 >&2
    tail -n 30 "$log" >&2
  elif [[ $passed -eq 0 ]]; then
    fail "$label: no test ran (${took}s) -- see $log"
  else
    pass "$label (${took}s, $tests_line)"
  fi
}

# On kernels with high mmap entropy the sanitizer runtimes of older compilers can fail to
# map their shadow; running without ASLR avoids that and costs nothing here.
norandom=()
if command -v setarch >/dev/null && setarch "$(uname -m)" -R true 2>/dev/null; then
  norandom=(setarch "$(uname -m)" -R)
fi

# ------------------------------------------------------------------ ASan + UBSan
if [[ -z "$only" || "$only" == asan ]]; then
  [[ "$mode" == build ]] && echo "== sanitize: AddressSanitizer+UBSan tree $asan_dir"
  if ! configure "$asan_dir" "address,undefined"; then
    tail -n 30 "$asan_dir.configure.log" >&2
    fail "asan: cmake configure (see $asan_dir.configure.log)"
  else
    mapfile -t targets < <(existing_targets "$asan_dir")
    if build asan "$asan_dir" "${targets[@]}" && [[ "$mode" != build ]]; then
      for t in "${targets[@]}"; do
        echo "== asan+ubsan: $t"
        ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:protect_shadow_gap=0:exitcode=86" \
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=86" \
        LSAN_OPTIONS="exitcode=86" \
        CKPTFS_CRASH_SCHEDULES="$asan_crash_schedules" \
          run_binary "asan+ubsan $t" "$asan_dir/$t.log" \
          "${norandom[@]}" "$asan_dir/bin/$t" --gtest_color=no --gtest_filter="$asan_filter" \
          "${extra_args[@]}"
      done
    fi
  fi
fi

# ------------------------------------------------------------------ TSan
if [[ -z "$only" || "$only" == tsan ]]; then
  [[ "$mode" == build ]] && echo "== sanitize: ThreadSanitizer tree $tsan_dir (pipeline_tests)"
  if ! configure "$tsan_dir" "thread" -DCKPTFS_PIPELINE_TESTS_ONLY=ON; then
    tail -n 30 "$tsan_dir.configure.log" >&2
    fail "tsan: cmake configure (see $tsan_dir.configure.log)"
  elif build tsan "$tsan_dir" pipeline_tests && [[ "$mode" != build ]]; then
    # RocksDB is a system library built without TSan: its own loads and stores are
    # invisible, and so are the atomics that order them (the memtable's lock-free
    # skiplist, the write-group handoff). The memcpy/memcmp it calls do go through TSan's
    # interceptors, so without a suppression TSan pairs, say, the journal thread's
    # iterator memcmp of a key with the writer's MemTable::Add memcpy of it and sees no
    # happens-before (27 reports in one run, each with one side an interceptor called
    # from librocksdb). `called_from_lib` makes interceptors called from librocksdb ignore
    # their accesses: the usual model of an uninstrumented library. Deliberately no
    # `race:` pattern: a race between two accesses made by ckptfs or test code is
    # reported whatever else is on the stacks, code RocksDB calls back included. Not
    # covered: a ckptfs access racing with one inside RocksDB; that would take an
    # instrumented RocksDB.
    tsan_supp="$tsan_dir/tsan.supp"
    printf '%s\n' 'called_from_lib:librocksdb.so' >"$tsan_supp"
    echo "== tsan: pipeline_tests (filter $tsan_filter)"
    TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0:exitcode=66:suppressions=$tsan_supp" \
      run_binary "tsan pipeline_tests" "$tsan_dir/pipeline_tests.log" \
      "${norandom[@]}" "$tsan_dir/bin/pipeline_tests" --gtest_color=no --gtest_filter="$tsan_filter" \
      "${extra_args[@]}"
  fi
fi

if [[ "$mode" == build ]]; then
  ((status == 0)) && echo "sanitize.sh: instrumented trees built (${SECONDS}s)"
  ((status != 0)) && printf '  %s\n' "${summary[@]}" && echo "sanitize.sh: BUILD FAILED" >&2
  exit $status
fi
echo "== sanitize summary (${SECONDS}s)"
printf '  %s\n' "${summary[@]}"
if [[ $status -ne 0 ]]; then
  echo "sanitize.sh: FAILED" >&2
else
  echo "sanitize.sh: zero sanitizer reports"
fi
exit $status
