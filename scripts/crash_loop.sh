#!/usr/bin/env bash
# The real crash loop, for many rounds by hand: runs tests/e2e/test_order_crash.py (a 4-rank
# torch DCP save / tracker / delete-N-2 loop through a real mount, the daemon SIGKILLed at a
# random moment each round, then restarted; every round is checked from the backing
# directory alone) in batches, each batch with a fresh random seed, and prints how many
# rounds passed.
#
#   scripts/crash_loop.sh                 # ROUNDS=50 kills per mode, both modes
#   ROUNDS=300 MODE=async scripts/crash_loop.sh
#
# Environment:
#   ROUNDS      kills per mode in total (default 50)
#   BATCH       kills per test run (default 10); a failed batch does not stop the loop
#               unless STOP_ON_FAIL=1, and its seed is printed to replay it
#   MODE        async, strict or both (default both; "both" when the test has one mode
#               runs that one)
#   MB          checkpoint size in MiB (CKPTFS_CRASH_MB, default 16)
#   SEED        first batch's seed (default random); batch i uses SEED+i
#   BATCH_TIMEOUT  seconds per batch (default 60 per kill + 300)
#   LOG_DIR     where each batch's output is kept (default /tmp/ckptfs-crash-loop.<time>)
#   CKPTFS_BIN_DIR  the binaries (default <repo>/build/bin; built there if missing)
# Exit status 0 only if every round passed. Needs root (FUSE).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${ROUNDS:-50}"
batch="${BATCH:-10}"
mode="${MODE:-both}"
mb="${MB:-16}"
seed="${SEED:-$((RANDOM * 32768 + RANDOM))}"
batch_timeout="${BATCH_TIMEOUT:-$((batch * 60 + 300))}"
log_dir="${LOG_DIR:-/tmp/ckptfs-crash-loop.$(date +%Y%m%d-%H%M%S)}"
bin_dir="${CKPTFS_BIN_DIR:-$root/build/bin}"
test_dir="$root/tests/e2e"

if [[ ! -x "$bin_dir/ckptfs" || ! -x "$bin_dir/ckptfs-admin" ]]; then
  echo "crash_loop: building ckptfs and ckptfs-admin in $root/build"
  cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null || exit 2
  cmake --build "$root/build" -j"${JOBS:-2}" --target ckptfs ckptfs-admin >/dev/null || exit 2
  bin_dir="$root/build/bin"
fi
mkdir -p "$log_dir" || exit 2

# The test's methods: one per durability mode (test_async_*, test_strict_*), or a single one.
mapfile -t methods < <(grep -oE '^    def (test_[a-z0-9_]+)' "$test_dir/test_order_crash.py" \
                       | awk '{print $2}')
selected=()
for m in "${methods[@]}"; do
  case "$mode" in
    both) selected+=("$m") ;;
    async|strict) [[ "$m" == *"_${mode}_"* || "$m" == "test_${mode}_"* ]] && selected+=("$m") ;;
    *) echo "crash_loop: MODE must be async, strict or both" >&2; exit 2 ;;
  esac
done
if [[ ${#selected[@]} -eq 0 ]]; then
  if [[ ${#methods[@]} -eq 1 && "$mode" == async ]]; then
    selected=("${methods[0]}")    # an older test with one (async) method
  else
    echo "crash_loop: no test method in test_order_crash.py for MODE=$mode (${methods[*]})" >&2
    exit 2
  fi
fi

echo "crash_loop: ${selected[*]}"
echo "crash_loop: $rounds rounds per mode in batches of $batch, ${mb} MiB checkpoints, first seed $seed, logs in $log_dir"

total_pass=0
total_run=0
failed_batches=()
i=0
for method in "${selected[@]}"; do
  mode_pass=0
  done_rounds=0
  t_mode=$SECONDS
  while [[ $done_rounds -lt $rounds ]]; do
    n=$((rounds - done_rounds < batch ? rounds - done_rounds : batch))
    s=$((seed + i))
    log="$log_dir/${method}.batch$i.seed$s.log"
    t0=$SECONDS
    (cd "$test_dir" && CKPTFS_BIN_DIR="$bin_dir" PYTHONDONTWRITEBYTECODE=1 \
       CKPTFS_CRASH_ROUNDS="$n" CKPTFS_CRASH_SEED="$s" CKPTFS_CRASH_MB="$mb" \
       timeout --kill-after=60 "$batch_timeout" \
       /usr/bin/python3 -m unittest -v "test_order_crash.OrderCrash.$method") >"$log" 2>&1
    rc=$?
    # The test prints "round R: ..." after each kill, before checking it; a batch that fails
    # fails on its last printed round (or on the restart after it).
    kills="$(grep -cE '^round [0-9]+: ' "$log")"
    if [[ $rc -eq 0 ]]; then
      passed=$kills
      verdict="ok"
    else
      passed=$((kills > 0 ? kills - 1 : 0))
      verdict="FAILED (exit $rc)"
      failed_batches+=("$method seed=$s rounds=$n log=$log")
    fi
    mode_pass=$((mode_pass + passed))
    total_pass=$((total_pass + passed))
    total_run=$((total_run + (rc == 0 ? kills : passed + 1)))
    done_rounds=$((done_rounds + n))
    printf 'crash_loop: %-60s batch %d seed %d: %d/%d rounds passed, %s, %ds\n' \
      "$method" "$i" "$s" "$passed" "$n" "$verdict" "$((SECONDS - t0))"
    if [[ $rc -ne 0 ]]; then
      grep -E 'AssertionError|Error:|FAIL:|ERROR:' "$log" | head -n 8 | sed 's/^/    /'
      if [[ "${STOP_ON_FAIL:-0}" == 1 ]]; then
        break 2
      fi
    fi
    i=$((i + 1))
  done
  echo "crash_loop: $method: $mode_pass rounds passed in $((SECONDS - t_mode))s"
done

echo "crash_loop: ROUNDS PASSED $total_pass of $total_run run (${SECONDS}s)"
if [[ ${#failed_batches[@]} -gt 0 ]]; then
  echo "crash_loop: failed batches (replay with CKPTFS_CRASH_SEED and CKPTFS_CRASH_ROUNDS):"
  printf '  %s\n' "${failed_batches[@]}"
  exit 1
fi
exit 0
