#!/usr/bin/env bash
# Builds the libFuzzer targets (pickle_fuzz, metadata_fuzz, zip_fuzz, safetensors_fuzz,
# rank_metadata_fuzz, peers_fuzz, control_fuzz, wire_fuzz) with clang in build-fuzz and runs each for
# FUZZ_SECONDS (default 30), seeded from real captures: tests/fixtures/dcp (the pickles and
# zips; rank_metadata_fuzz: each no_dist save's __{rank}.metadata files joined as the target
# splits them), tests/fixtures/safetensors, tests/fixtures/peers (peers files as a
# scheduler's prolog writes them) and tests/fixtures/control (/.ckptfs/stats, checkpoints
# and progress xattrs read from real mounts); wire_fuzz (the peer protocol) from the
# messages of a two-node save made by the daemon's own encoders (WIRE_FUZZ_SEEDS).
# Exits non-zero if any target crashes, leaks, times out or runs out of memory; the
# reproducer is kept under build-fuzz/fuzz-work/.
#
# Environment: FUZZ_SECONDS (per target), FUZZ_JOBS (build parallelism, default 2),
# FUZZ_BUILD_DIR (default <repo>/build-fuzz). FUZZ_SECONDS=0 skips (exit 77).
# FUZZ_RESULT and CKPTFS_SIDE_LOCK: report the run scripts/test.sh made beside the tests.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${FUZZ_BUILD_DIR:-$root/build-fuzz}"
seconds="${FUZZ_SECONDS:-30}"
jobs="${FUZZ_JOBS:-2}"
fixtures="$root/tests/fixtures/dcp"
targets=(pickle_fuzz metadata_fuzz zip_fuzz safetensors_fuzz rank_metadata_fuzz peers_fuzz
         control_fuzz wire_fuzz)
# FUZZ_TARGETS: a subset, space-separated (e.g. FUZZ_TARGETS="peers_fuzz control_fuzz").
if [[ -n "${FUZZ_TARGETS:-}" ]]; then read -r -a targets <<<"$FUZZ_TARGETS"; fi

if [[ "$seconds" == 0 ]]; then
  echo "fuzz.sh: FUZZ_SECONDS=0, skipped"; exit 77
fi
# ctest's fuzz.smoke under scripts/test.sh, which runs this step beside the tests holding
# CKPTFS_SIDE_LOCK and leaves its exit code in FUZZ_RESULT (its output in FUZZ_RESULT.log):
# wait for it and report that run instead of fuzzing again.
if [[ -n "${FUZZ_RESULT:-}" && -n "${CKPTFS_SIDE_LOCK:-}" && -e "$CKPTFS_SIDE_LOCK" ]]; then
  flock "$CKPTFS_SIDE_LOCK" true
  if [[ -f "$FUZZ_RESULT" ]]; then
    cat "$FUZZ_RESULT.log" 2>/dev/null
    rc=$(cat "$FUZZ_RESULT")
    echo "fuzz.sh: the run beside the tests exited $rc"
    exit "$rc"
  fi
fi

CC=clang CXX=clang++ cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCKPTFS_FUZZ=ON -DCKPTFS_BUILD_TESTS=ON >/dev/null
cmake --build "$build" -j"$jobs" --target "${targets[@]}"

work="$build/fuzz-work"
rm -rf "$work"
mkdir -p "$work/seeds-pickle" "$work/seeds-zip" "$work/seeds-safetensors" "$work/seeds-ranks" \
  "$work/seeds-peers" "$work/seeds-control"
# Pickle seeds: every .metadata (protocols 2 to 5). Zip seeds: every .distcp; per-item
# checkpoints hold exactly one torch.save archive per file.
n=0
while IFS= read -r -d '' f; do
  cp "$f" "$work/seeds-pickle/seed$((n++))"
done < <(find "$fixtures" \( -name .metadata -o -name '*.metadata.p[0-9]' \) -print0)
while IFS= read -r -d '' f; do
  cp "$f" "$work/seeds-zip/seed$((n++))"
done < <(find "$fixtures" -name '*.distcp' -print0)
# Safetensors seeds: every captured safetensors file (small) and index JSON.
while IFS= read -r -d '' f; do
  cp "$f" "$work/seeds-safetensors/seed$((n++))"
done < <(find "$root/tests/fixtures/safetensors" \( -name '*.safetensors' -o -name '*.index.json' \) \
         -print0)

# No_dist seeds: every directory's __{rank}.metadata files, in rank order, joined by the
# separator line rank_metadata_fuzz splits at; and each file alone.
while IFS= read -r -d '' d; do
  out="$work/seeds-ranks/seed$((n++))"
  first=1
  for f in $(ls "$d" | grep -E '^__[0-9]+\.metadata$' | sort -t_ -k3 -n); do
    [[ $first == 1 ]] || printf '\n@@RANK@@\n' >>"$out"
    cat "$d/$f" >>"$out"
    cp "$d/$f" "$work/seeds-ranks/seed$((n++))"
    first=0
  done
done < <(find "$fixtures" -name '__0.metadata' -printf '%h\0')
cp "$root"/tests/fixtures/peers/* "$work/seeds-peers/"
cp "$root"/tests/fixtures/control/* "$work/seeds-control/"

status=0
for target in "${targets[@]}"; do
  seeds="$work/seeds-pickle"
  [[ "$target" == zip_fuzz ]] && seeds="$work/seeds-zip"
  [[ "$target" == safetensors_fuzz ]] && seeds="$work/seeds-safetensors"
  [[ "$target" == rank_metadata_fuzz ]] && seeds="$work/seeds-ranks"
  [[ "$target" == peers_fuzz ]] && seeds="$work/seeds-peers"
  [[ "$target" == control_fuzz ]] && seeds="$work/seeds-control"
  if [[ "$target" == wire_fuzz ]]; then
    # The messages of a two-node save, written by the daemon's own encoders (wire_fuzz.cc).
    seeds="$work/seeds-wire"
    mkdir -p "$seeds"
    WIRE_FUZZ_SEEDS="$seeds" "$build/bin/$target" >/dev/null 2>&1
  fi
  corpus="$work/corpus-$target"
  mkdir -p "$corpus"
  echo "== $target for ${seconds}s"
  if ! "$build/bin/$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -max_len=16384 -print_final_stats=1 -artifact_prefix="$work/$target-" \
      "$corpus" "$seeds" >"$work/$target.log" 2>&1; then
    echo "!! $target failed; see $work/$target.log and $work/$target-*" >&2
    tail -n 40 "$work/$target.log" >&2
    status=1
  else
    grep -E '^stat::number_of_executed_units|^Done' "$work/$target.log" || true
  fi
done
exit "$status"
