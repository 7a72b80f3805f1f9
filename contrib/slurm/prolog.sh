#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/ckptfs-prolog.sh): mounts ckptfs for the
# job on every node it runs on, with a job-local state dir.
#
#   Mount:    $CKPTFS_MOUNT_ROOT/$SLURM_JOB_ID  (default /mnt/ckptfs/<jobid>)
#   Backing:  $CKPTFS_BACKING (default /lustre/ckpt/$SLURM_JOB_USER)
#   State:    /var/tmp/ckptfs/<jobid> (node-local, removed by the epilog)
#
# Jobs find the mount in CKPTFS_MOUNT (TaskProlog exports it; see README). A failing
# prolog drains the node, so errors here are reported, not ignored.
set -euo pipefail

: "${SLURM_JOB_ID:?not run by slurmd}"
MOUNT_ROOT=${CKPTFS_MOUNT_ROOT:-/mnt/ckptfs}
BACKING=${CKPTFS_BACKING:-/lustre/ckpt/${SLURM_JOB_USER:-root}}
STAGING=${CKPTFS_STAGING_MEM:-8G}
MNT="$MOUNT_ROOT/$SLURM_JOB_ID"
STATE="/var/tmp/ckptfs/$SLURM_JOB_ID"

mkdir -p "$MNT" "$STATE" "$BACKING"
if [ -n "${SLURM_JOB_UID:-}" ]; then
  chown "$SLURM_JOB_UID" "$MNT" "$BACKING" 2>/dev/null || true
fi
# Peers (optional): with CKPTFS_PEER_SECRET_FILE set, the daemons of the job's nodes
# cooperate (docs/PEERS.md). The peers file is written from the job's node list; rewriting
# it later (contrib/slurm/peers.sh) moves a replaced node's rank to its spare while the
# daemons run.
PEER_OPTS=""
if [ -n "${CKPTFS_PEER_SECRET_FILE:-}" ]; then
  "$(dirname "$0")/peers.sh" "$STATE/peers" "$SLURM_JOB_NODELIST" "${CKPTFS_PEERS_PORT:-7470}"
  PEER_OPTS=",peers_file=$STATE/peers,peer_secret_file=$CKPTFS_PEER_SECRET_FILE"
fi
# allow_other: the job runs as the user, the daemon as root.
mount -t fuse.ckptfs "$BACKING" "$MNT" \
  -o "allow_other,durability=async,staging_mem=$STAGING,state_dir=$STATE,log_file=$STATE/ckptfs.log$PEER_OPTS"
logger -t ckptfs-prolog "job $SLURM_JOB_ID: mounted $BACKING on $MNT"
