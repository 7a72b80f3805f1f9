#!/usr/bin/env bash
# The unit tests under sanitizers, as CI runs them:
#   * AddressSanitizer + UndefinedBehaviorSanitizer (build-asan): every unit-test binary
#     (store_tests, fs_tests, gpu_tests, mount_tests, common_tests where they exist);
#   * ThreadSanitizer (build-tsan): the concurrent pipeline tests, FlushPipeline*, Journal*,
#     StagedFile*, StagingPool*, BlockCache* (whichever exist).
# Any sanitizer report fails the run: the runtimes halt on the first error, and the output
# is also scanned for report headers (a report in a death-test child or a thread the test
# framework ignored still counts). Prints one summary line per binary and exits non-zero
# if any build, test or sanitizer failed.
#
# Environment:
#   SANITIZE=0            skip everything (exit 0), for scripts/test.sh
#   SANITIZE_ONLY=asan|tsan   run one half only
#   SAN_JOBS              build parallelism (default 2)
#   SAN_TIMEOUT           seconds per test binary (default 600)
#   ASAN_BUILD_DIR, TSAN_BUILD_DIR   (default <repo>/build-asan, <repo>/build-tsan)
#   TSAN_FILTER           gtest filter for the TSan run (default the pipeline tests above)
#   SAN_GTEST_ARGS        extra arguments for every test binary (e.g. --gtest_repeat=3)
set -uo pipefail

if [[ "${SANITIZE:-1}" == 0 ]]; then
  echo "sanitize.sh: SANITIZE=0, skipped"
  exit 0
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${SAN_JOBS:-2}"
per_binary="${SAN_TIMEOUT:-600}"
only="${SANITIZE_ONLY:-}"
asan_dir="${ASAN_BUILD_DIR:-$root/build-asan}"
tsan_dir="${TSAN_BUILD_DIR:-$root/build-tsan}"
tsan_filter="${TSAN_FILTER:-FlushPipeline*:Journal*:StagedFile*:StagingPool*:BlockCache*}"
# shellcheck disable=SC2206
extra_args=(${SAN_GTEST_ARGS:-})
candidates=(store_tests fs_tests gpu_tests mount_tests common_tests)
report_re='ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:|WARNING: ThreadSanitizer|ThreadSanitizer: (reported|data race|lock-order|heap-use|thread leak)|SUMMARY: (AddressSanitizer|UndefinedBehaviorSanitizer|ThreadSanitizer)'

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

# configure DIR SANITIZERS: a RelWithDebInfo tree with -fsanitize on every target. Test
# discovery is deferred to ctest time so the build never runs an instrumented binary.
configure() {
  local dir=$1 san=$2
  cmake -S "$root" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPTFS_SANITIZE="$san" \
    -DCKPTFS_BUILD_TESTS=ON -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST >"$dir.configure.log" 2>&1
}

# run_binary LABEL LOG CMD...: runs a test binary with the per-binary time limit and
# records ok/FAIL from its exit status and a scan of its output for sanitizer reports.
run_binary() {
  local label=$1 log=$2
  shift 2
  local t0=$SECONDS rc
  timeout --kill-after=30 "$per_binary" "$@" >"$log" 2>&1
  rc=$?
  local took=$((SECONDS - t0))
  local tests_line
  tests_line="$(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test' "$log" | tr '\n' ' ')"
  if grep -qE "$report_re" "$log"; then
    fail "$label: sanitizer report (${took}s, exit $rc) -- see $log"
    echo "!! $label: sanitizer report; first lines:" >&2
    grep -nE -A25 "$report_re" "$log" | head -n 60 >&2
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    fail "$label: timed out after ${per_binary}s -- see $log"
    tail -n 30 "$log" >&2
  elif [[ $rc -ne 0 ]]; then
    fail "$label: exit $rc (${took}s) $tests_line-- see $log"
    grep -E '^\[  FAILED  \]' "$log" | head -n 20 >&2
    tail -n 30 "$log" >&2
  else
    pass "$label (${took}s) $tests_line"
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
  t0=$SECONDS
  echo "== sanitize: AddressSanitizer+UBSan build in $asan_dir"
  if ! configure "$asan_dir" "address,undefined"; then
    tail -n 30 "$asan_dir.configure.log" >&2
    fail "asan: cmake configure (see $asan_dir.configure.log)"
  else
    mapfile -t targets < <(existing_targets "$asan_dir")
    if ! cmake --build "$asan_dir" -j"$jobs" --target "${targets[@]}" >"$asan_dir.build.log" 2>&1; then
      grep -E 'error|Error' "$asan_dir.build.log" | head -n 30 >&2
      fail "asan: build of ${targets[*]} (see $asan_dir.build.log)"
    else
      echo "   built ${targets[*]} in $((SECONDS - t0))s"
      for t in "${targets[@]}"; do
        echo "== asan+ubsan: $t"
        ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:protect_shadow_gap=0:exitcode=86" \
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=87" \
        LSAN_OPTIONS="exitcode=88" \
          run_binary "asan+ubsan $t" "$asan_dir/$t.log" \
          "${norandom[@]}" "$asan_dir/bin/$t" --gtest_color=no "${extra_args[@]}"
      done
    fi
  fi
fi

# ------------------------------------------------------------------ TSan
if [[ -z "$only" || "$only" == tsan ]]; then
  t0=$SECONDS
  echo "== sanitize: ThreadSanitizer build in $tsan_dir (filter $tsan_filter)"
  if ! configure "$tsan_dir" "thread"; then
    tail -n 30 "$tsan_dir.configure.log" >&2
    fail "tsan: cmake configure (see $tsan_dir.configure.log)"
  else
    # Only the binaries that hold tests matching the filter (store, fs, gpu).
    mapfile -t targets < <(existing_targets "$tsan_dir" | grep -vE '^(mount_tests|common_tests)$')
    if ! cmake --build "$tsan_dir" -j"$jobs" --target "${targets[@]}" >"$tsan_dir.build.log" 2>&1; then
      grep -E 'error|Error' "$tsan_dir.build.log" | head -n 30 >&2
      fail "tsan: build of ${targets[*]} (see $tsan_dir.build.log)"
    else
      echo "   built ${targets[*]} in $((SECONDS - t0))s"
      # RocksDB is a system library built without TSan: its write-group commit hands one
      # thread's WriteBatch to the group leader through atomics TSan cannot see, so reads
      # inside librocksdb of batches the caller built are false reports. Only frames
      # inside RocksDB are suppressed; ckptfs's own accesses are all still checked.
      tsan_supp="$tsan_dir/tsan.supp"
      printf '%s\n' 'race:rocksdb::' 'called_from_lib:librocksdb.so' >"$tsan_supp"
      for t in "${targets[@]}"; do
        n="$("${norandom[@]}" "$tsan_dir/bin/$t" --gtest_list_tests --gtest_filter="$tsan_filter" 2>/dev/null \
              | grep -c '^  ')"
        if [[ "$n" == 0 ]]; then
          summary+=("skip  tsan $t: no test matches $tsan_filter")
          continue
        fi
        echo "== tsan: $t ($n tests)"
        TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0:exitcode=66:suppressions=$tsan_supp" \
          run_binary "tsan $t ($n tests)" "$tsan_dir/$t.log" \
          "${norandom[@]}" "$tsan_dir/bin/$t" --gtest_color=no --gtest_filter="$tsan_filter" \
          "${extra_args[@]}"
      done
    fi
  fi
fi

echo "== sanitize summary (${SECONDS}s)"
printf '  %s\n' "${summary[@]}"
if [[ $status -ne 0 ]]; then
  echo "sanitize.sh: FAILED" >&2
else
  echo "sanitize.sh: zero sanitizer reports"
fi
exit $status
