#!/usr/bin/env bash
# ckptfs demo, from a fresh machine: install packages, build, mount ckptfs over
# a local backing directory, save a real 4-rank PyTorch DCP checkpoint through
# the mount, watch it commit, load it back (verified), unmount cleanly, and
# load it once more straight from the backing directory (no lock-in).
#
# Everything lives under ./.demo (backing/, state/, mnt/, ckptfs.log).
# Environment knobs:
#   CKPTFS_DEMO_DIR    where the demo lives          (default: <repo>/.demo)
#   CKPTFS_BUILD_DIR   build directory               (default: <repo>/build)
#   CKPTFS_DEMO_MB     checkpoint size in MiB        (default: 256)
#   CKPTFS_DEMO_SKIP_SETUP=1 / CKPTFS_DEMO_SKIP_BUILD=1 / CKPTFS_DEMO_SKIP_PEERS=1
#                      skip those steps (peers: the two-node part, step 9)
# Exits non-zero if any step fails; on failure the mount is removed and the
# daemon is killed by the PID it reported in its stats.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
DEMO="${CKPTFS_DEMO_DIR:-$REPO/.demo}"
BUILD="${CKPTFS_BUILD_DIR:-$REPO/build}"
MB="${CKPTFS_DEMO_MB:-256}"
PY=/usr/bin/python3                       # Debian's python3 with python3-torch 1.13
DCP_TOOL="$REPO/tests/e2e/dcp_tool.py"
BACKING="$DEMO/backing" STATE="$DEMO/state" MNT="$DEMO/mnt" LOG="$DEMO/ckptfs.log"
CKPTFS="$BUILD/bin/ckptfs" ADMIN="$BUILD/bin/ckptfs-admin"
CKPT_REL="checkpoints/iter_0000100"
SEED=100
DAEMON_PID=""

if [ -t 1 ]; then B=$'\033[1m' G=$'\033[32m' R=$'\033[31m' N=$'\033[0m'; else B="" G="" R="" N=""; fi
step() { printf '\n%s==> %s%s\n' "$B" "$*" "$N"; }
info() { printf '    %s\n' "$*"; }
die() { printf '%sdemo: %s%s\n' "$R" "$*" "$N" >&2; exit 1; }

is_mounted() { awk -v m="$1" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo; }
pid_alive() { [ -n "$1" ] && [ -e "/proc/$1" ] && ! grep -q '^State:.*[ZX]' "/proc/$1/status" 2>/dev/null; }
json_get() { "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(d'"$1"')'; }

on_exit() {
  local rc=$?
  trap - EXIT
  if [ "$rc" -ne 0 ]; then
    printf '\n%sdemo: FAILED (exit %s); cleaning up%s\n' "$R" "$rc" "$N" >&2
    if is_mounted "$MNT"; then
      timeout 120 "$ADMIN" unmount "$MNT" >/dev/null 2>&1 || fusermount3 -u -z "$MNT" 2>/dev/null || true
    fi
    if pid_alive "$DAEMON_PID"; then
      for _ in $(seq 50); do pid_alive "$DAEMON_PID" || break; sleep 0.2; done
      if pid_alive "$DAEMON_PID"; then
        echo "demo: killing ckptfs pid $DAEMON_PID" >&2
        kill -KILL "$DAEMON_PID" 2>/dev/null || true
      fi
    fi
    is_mounted "$MNT" && fusermount3 -u -z "$MNT" 2>/dev/null || true
    if [ -s "$LOG" ]; then
      echo "--- last lines of $LOG ---" >&2
      tail -n 20 "$LOG" >&2
    fi
  fi
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------------------
step "1/9 Packages (scripts/setup.sh)"
if [ "${CKPTFS_DEMO_SKIP_SETUP:-0}" != 1 ]; then
  "$REPO/scripts/setup.sh" | sed 's/^/    /'
else
  info "skipped (CKPTFS_DEMO_SKIP_SETUP=1)"
fi

step "2/9 Build ckptfs and ckptfs-admin in ${BUILD#"$REPO"/}/"
mkdir -p "$DEMO"
if [ "${CKPTFS_DEMO_SKIP_BUILD:-0}" != 1 ]; then
  if ! { cmake -S "$REPO" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo &&
         cmake --build "$BUILD" -j2 --target ckptfs ckptfs-admin; } >"$DEMO/build.log" 2>&1; then
    tail -n 30 "$DEMO/build.log" >&2
    die "build failed (full log: $DEMO/build.log)"
  fi
  info "built $(basename "$CKPTFS") and $(basename "$ADMIN") (log: ${DEMO#"$REPO"/}/build.log)"
else
  info "skipped (CKPTFS_DEMO_SKIP_BUILD=1)"
fi
[ -x "$CKPTFS" ] && [ -x "$ADMIN" ] || die "missing $CKPTFS or $ADMIN"

step "3/9 Mount ckptfs: ${BACKING#"$REPO"/} -> ${MNT#"$REPO"/}"
if is_mounted "$MNT"; then
  info "a previous demo mount is still there; unmounting it"
  timeout 120 "$ADMIN" unmount "$MNT" >/dev/null 2>&1 || fusermount3 -u -z "$MNT"
fi
is_mounted "$MNT" && die "$MNT is still mounted"
rm -rf "$BACKING" "$STATE" "$LOG"
mkdir -p "$BACKING" "$STATE" "$MNT"
"$CKPTFS" --durability async --staging-mem 1G --state-dir "$STATE" --log-file "$LOG" \
  "$BACKING" "$MNT"
DAEMON_PID="$("$ADMIN" stats "$MNT" --json | json_get '["pid"]')"
info "daemon pid $DAEMON_PID, async durability, 1 GiB staging, log ${LOG#"$REPO"/}"

step "4/9 Save a 4-rank torch DCP checkpoint ($MB MiB) into the mount"
mkdir -p "$MNT/checkpoints"
t0=$(date +%s.%N)
save_json="$("$PY" "$DCP_TOOL" save --dir "$MNT/$CKPT_REL" --ranks 4 --mb "$MB" \
  --single-file-per-rank 1 --seed "$SEED")"
t_saved=$(date +%s.%N)
[ "$(json_get '["ok"]' <<<"$save_json")" = True ] || die "save failed: $save_json"
info "save_state_dict stall (max over ranks): $(json_get '["save_s_max"]' <<<"$save_json") s"
echo "$SEED" >"$MNT/checkpoints/latest_checkpointed_iteration.txt"
info "tracker written: checkpoints/latest_checkpointed_iteration.txt"

step "5/9 Live state: ckptfs-admin stats / checkpoints"
"$ADMIN" stats "$MNT" | sed 's/^/    /'
echo
"$ADMIN" checkpoints "$MNT" | sed 's/^/    /'

step "6/9 Wait until the checkpoint is committed (ckptfs-admin wait)"
"$ADMIN" wait "$MNT/$CKPT_REL" --timeout 600
t_done=$(date +%s.%N)
"$ADMIN" wait "$MNT/checkpoints/latest_checkpointed_iteration.txt" --timeout 120
info "committed $(awk -v a="$t_saved" -v b="$t_done" 'BEGIN { printf "%.2f", b - a }') s after the" \
     "save returned (4 rank processes ran $(awk -v a="$t0" -v b="$t_saved" 'BEGIN { printf "%.1f", b - a }') s, startup included)"
state="$(getfattr -n user.ckptfs.state --only-values "$MNT/$CKPT_REL" 2>/dev/null || true)"
info "user.ckptfs.state of the checkpoint dir: ${state:-?}"
info "on the backing store, as plain files:"
ls -la "$BACKING/$CKPT_REL" | sed 's/^/      /'
[ -f "$BACKING/$CKPT_REL/.metadata" ] || die ".metadata is not on the backing store after wait"

step "7/9 Load it back through the mount (every value checked)"
load_json="$("$PY" "$DCP_TOOL" load --dir "$MNT/$CKPT_REL" --ranks 4 --mode own --seed "$SEED")"
[ "$(json_get '["ok"]' <<<"$load_json")" = True ] || die "load failed: $load_json"
info "load_state_dict (max over ranks): $(json_get '["load_s_max"]' <<<"$load_json") s," \
     "$(json_get '["bytes_verified"]' <<<"$load_json") bytes verified"
"$ADMIN" stats "$MNT" | sed 's/^/    /'

step "8/9 Unmount (ckptfs-admin unmount), then load straight from the backing dir"
"$ADMIN" unmount "$MNT"
for _ in $(seq 300); do pid_alive "$DAEMON_PID" || break; sleep 0.2; done
pid_alive "$DAEMON_PID" && die "daemon $DAEMON_PID still running 60 s after unmount"
is_mounted "$MNT" && die "$MNT is still mounted"
info "unmounted; daemon $DAEMON_PID exited"
leftover="$(find "$BACKING" -name '.ckptfs-tmp.*' | head -n 3)"
[ -z "$leftover" ] || die "temporary files left on the backing store: $leftover"
load_json="$("$PY" "$DCP_TOOL" load --dir "$BACKING/$CKPT_REL" --ranks 4 --mode reshard \
  --seed "$SEED")"
[ "$(json_get '["ok"]' <<<"$load_json")" = True ] || die "direct load failed: $load_json"
info "loaded without ckptfs (resharded to 2 shards): $(json_get '["bytes_verified"]' <<<"$load_json") bytes verified"

step "9/9 Two nodes: daemons in their own network namespaces share the backing dir (UCX peers)"
if [ "${CKPTFS_DEMO_SKIP_PEERS:-0}" != 1 ]; then
  # tests/e2e/netns.py makes the namespaces, veths and bridge, starts the daemons under
  # nsenter --net (the mounts stay visible here), and removes all of it again, also on failure.
  CKPTFS_BIN_DIR="$BUILD/bin" PYTHONDONTWRITEBYTECODE=1 "$PY" - "$REPO" "$BACKING" "$CKPT_REL" \
    "$SEED" "$DEMO" <<'PYEOF' || die "two-node load failed"
import os, sys, threading
repo, backing, rel, seed, demo = sys.argv[1:6]
sys.path.insert(0, os.path.join(repo, "tests", "e2e"))
import dcp_tool
from netns import Cluster
c = Cluster(2, root=os.path.join(demo, "peers"), backing=backing)
try:
    c.setup().start()
    assert c.wait_connected(), "the peers did not connect"
    print(f"    node 0 {c.nodes[0].address}, node 1 {c.nodes[1].address}: connected and authenticated")
    before = [n.stats()["backing_bytes_read"] for n in c.nodes]
    out = {}
    def load(n):
        out[n.index] = dcp_tool.load(os.path.join(n.mnt, rel), ranks=1, mode="replicated",
                                     seed=int(seed))
    ts = [threading.Thread(target=load, args=(n,)) for n in c.nodes]
    [t.start() for t in ts]
    [t.join() for t in ts]
    size = sum(os.path.getsize(os.path.join(backing, rel, f))
               for f in os.listdir(os.path.join(backing, rel)) if f.endswith(".distcp"))
    total = 0
    for n in c.nodes:
        if n.index not in out:
            raise SystemExit(f"node {n.index}: load failed")
        s = n.stats()
        b = s["backing_bytes_read"] - before[n.index]
        total += b
        print(f"    node {n.index}: loaded the whole checkpoint (verified) in "
              f"{out[n.index]['load_s_max']:.2f} s; {b / 2**20:.1f} MiB from the backing store, "
              f"{s['peer_bytes_read'] / 2**20:.1f} MiB from its peer, "
              f"served {s['peer_bytes_served'] / 2**20:.1f} MiB to its peer, "
              f"{s['peer_fallbacks']} fallbacks")
    print(f"    backing store read {total / size:.2f}x the checkpoint for 2 nodes (2.00x without peers)")
finally:
    c.cleanup()
PYEOF
else
  info "skipped (CKPTFS_DEMO_SKIP_PEERS=1)"
fi

printf '\n%sdemo: OK%s\n' "$G" "$N"
