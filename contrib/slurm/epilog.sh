#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/ckptfs-epilog.sh): waits until every
# checkpoint the job saved is committed on the backing store, unmounts, and drains the
# node when a checkpoint failed or the daemon did not exit cleanly (so an operator looks
# at it before the next job loses data the same way).
#
# Preemption: submit with `sbatch --signal=B:USR1@300` (or `--signal=USR1@300` for the
# steps) and save a checkpoint when the signal arrives; Slurm then gives the job 300 s
# before it kills it, and this epilog waits for that checkpoint to be published before
# the node is handed on. Set KillWait in slurm.conf to at least the publication time.
set -uo pipefail

: "${SLURM_JOB_ID:?not run by slurmd}"
MOUNT_ROOT=${CKPTFS_MOUNT_ROOT:-/mnt/ckptfs}
TIMEOUT=${CKPTFS_EPILOG_TIMEOUT:-1800}
MNT="$MOUNT_ROOT/$SLURM_JOB_ID"
STATE="/var/tmp/ckptfs/$SLURM_JOB_ID"

drain() {
  logger -t ckptfs-epilog "job $SLURM_JOB_ID: $1; draining $(hostname -s)"
  scontrol update nodename="$(hostname -s)" state=drain reason="ckptfs: $1" || true
}

mountpoint -q "$MNT" || exit 0
status=0
# Any checkpoint that failed or was aborted: drain after the unmount.
failed=$(ckptfs-admin checkpoints --json "$MNT" 2>/dev/null |
         python3 -c 'import json,sys; print(" ".join(c["path"] for c in json.load(sys.stdin)
                     if c.get("state") in ("failed", "aborted")))' 2>/dev/null || true)
# unmount drains first: it waits until everything staged is published.
if ! ckptfs-admin unmount --timeout "$TIMEOUT" --json "$MNT" > "$STATE/unmount.json"; then
  status=1
  drain "unmount of $MNT failed: $(cat "$STATE/unmount.json" 2>/dev/null)"
  umount -l "$MNT" 2>/dev/null || true
elif [ -n "$failed" ]; then
  status=1
  drain "checkpoints failed: $failed"
fi
rmdir "$MNT" 2>/dev/null || true
[ "$status" -eq 0 ] && rm -rf "$STATE"
exit 0  # the node is drained on failure; the job's own exit status stands
