#!/usr/bin/env bash
# Runs every ckptfs benchmark and collects their JSON lines and PNG plots: staged
# writes (dd, FUSE ceiling, fio), DCP saves (stall, time to committed) and cold DCP
# loads (own, replicated, reshard, and own with backing reads throttled to 300 MB/s),
# both single_file_per_rank layouts, ckptfs and direct side by side, medians of 3.
# About 10 minutes on a quiet 2-core machine.
#   scripts/bench/run_all.sh [OUT_DIR]        (default: <repo>/build-bench)
# Uses the binaries in $CKPTFS_BIN_DIR (default <repo>/build/bin). Run as root
# so cold-read cases can drop the page cache. Extra arguments for the
# benchmarks can be passed via BENCH_SAVE_ARGS / BENCH_WRITE_ARGS / BENCH_LOAD_ARGS,
# e.g.  BENCH_SAVE_ARGS="--reps 5" scripts/bench/run_all.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
REPO="$(cd "$HERE/../.." && pwd -P)"
OUT="${1:-$REPO/build-bench}"
PY=/usr/bin/python3
export CKPTFS_BIN_DIR="${CKPTFS_BIN_DIR:-$REPO/build/bin}"
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: >"$RESULTS"

for b in "$CKPTFS_BIN_DIR/ckptfs" "$CKPTFS_BIN_DIR/ckptfs-admin"; do
  [ -x "$b" ] || { echo "run_all: missing $b (build first, or set CKPTFS_BIN_DIR)" >&2; exit 2; }
done

status=0
run() {
  local name=$1; shift
  echo "== $name" >&2
  # shellcheck disable=SC2086
  if ! "$PY" "$HERE/$name.py" --out "$OUT" "$@" | tee -a "$RESULTS"; then
    echo "run_all: $name reported a failure" >&2
    status=1
  fi
}
# shellcheck disable=SC2086
run bench_write ${BENCH_WRITE_ARGS:---reps 3}
# shellcheck disable=SC2086
run bench_save ${BENCH_SAVE_ARGS:---reps 3}
# shellcheck disable=SC2086
run bench_load ${BENCH_LOAD_ARGS:-}

echo "== results ($RESULTS)" >&2
"$PY" - "$RESULTS" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
print(f"{'case':28} {'ckptfs_s':>9} {'direct_s':>9} {'ratio':>7}  ok")
for r in rows:
    print(f"{r['case']:28} {fmt(r.get('ckptfs_s')):>9} {fmt(r.get('direct_s')):>9} "
          f"{fmt(r.get('ratio')):>7}  {r.get('ok')}")
PYEOF
ls "$OUT"/*.png >&2
exit "$status"
