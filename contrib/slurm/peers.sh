#!/bin/bash
# Writes (or rewrites) the ckptfs peers file of a job on this node, from a Slurm node list:
# one HOST:PORT per node, in the order Slurm lists them, so that every node writes the same
# file and node rank = position in the list (docs/PEERS.md, "Membership").
#
#   contrib/slurm/peers.sh FILE NODELIST [PORT]     (PORT default $CKPTFS_PEERS_PORT or 7470)
#
# The prolog calls it with $SLURM_JOB_NODELIST. When a node of a running job is replaced by
# a spare (the job's launcher or an admin decides it; e.g. `scontrol update` plus a restart
# of the failed ranks), run it again on every node with the new list, keeping the position
# of each surviving node and putting the spare where the failed node was:
#
#   srun --overlap -N "$SLURM_NNODES" --ntasks-per-node=1 \
#     contrib/slurm/peers.sh /var/tmp/ckptfs/$SLURM_JOB_ID/peers "$NEW_NODELIST"
#
# The running daemons notice the new file within a second (or at once on SIGHUP), move the
# replaced rank to its new address and route to it; the spare's daemon, started by the
# prolog with the same list, finds its own rank by its host name. The file is written to a
# temporary name and renamed into place, so a daemon never reads half a file.
set -euo pipefail

FILE=${1:?usage: peers.sh FILE NODELIST [PORT]}
NODELIST=${2:?usage: peers.sh FILE NODELIST [PORT]}
PORT=${3:-${CKPTFS_PEERS_PORT:-7470}}

tmp="$FILE.tmp.$$"
trap 'rm -f "$tmp"' EXIT
{
  echo "# ckptfs peers of job ${SLURM_JOB_ID:-?}, written $(date -u +%FT%TZ) by $(hostname -s)"
  scontrol show hostnames "$NODELIST" | sed "s/\$/:$PORT/"
} >"$tmp"
n=$(grep -vc '^#' "$tmp" || true)
[ "$n" -gt 0 ] || { echo "peers.sh: $NODELIST names no node" >&2; exit 1; }
chmod 0644 "$tmp"
mv -f "$tmp" "$FILE"
trap - EXIT
logger -t ckptfs-peers "job ${SLURM_JOB_ID:-?}: $FILE lists $n nodes" 2>/dev/null || true
