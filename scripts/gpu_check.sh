#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU and CUDA-enabled torch 2.x but no Debian 12
# packages (the `device` machine lent to some sessions). Run from the checkout root after
# scripts/gpu_bundle.sh packed .devbundle/ on the build machine:
#   scripts/gpu_check.sh [OUT_DIR]
# 1. gpu_tests with CKPTFS_EXPECT_GPU=1: the "cuda" staging backend must work, device memory
#    copied into staging chunks arrives intact, and the chunks are pinned (faster than pageable).
# 2. A ckptfs mount stages in CUDA-pinned memory ("auto" picks it), a file round-trips.
# 3. scripts/bench/gpu_dcp.py: torch DCP saves/loads of CUDA tensors through ckptfs (async and
#    strict mounts) against a plain directory (dcp.save and dcp.async_save), tensors exact.
# Writes logs and JSON/PNG to OUT_DIR; exits non-zero if any step fails.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-${OUT:-/tmp/ckptfs-gpu-check}}"
B="$REPO/.devbundle"
mkdir -p "$OUT"
fail=0
step() { echo "=== $*"; }

[ -x "$B/bin/ckptfs" ] || { echo "no bundle at $B: run scripts/gpu_bundle.sh first" >&2; exit 2; }
cudart="$(ls /usr/local/cuda/lib64/libcudart.so.1[0-9]* 2>/dev/null | head -1)"
[ -n "$cudart" ] || cudart="$(python3 -c 'import glob,os,nvidia; print(next(iter(sorted(glob.glob(os.path.join(os.path.dirname(nvidia.__path__[0]),"nvidia","**","libcudart.so.1*"),recursive=True))),""))' 2>/dev/null)"
export PATH="$B/bin:$PATH"
export CKPTFS_CUDART_DIR="${cudart:+$(dirname "$cudart")}"  # read by the bundle's wrappers
export CKPTFS_BIN_DIR="$B/bin"

step "machine"
{ uname -r; nvidia-smi -L 2>&1; ldd --version | head -1; echo "cudart: ${cudart:-none}"
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
  ls -l /dev/fuse 2>&1; nproc; free -g | sed -n 2p; } 2>&1 | tee "$OUT/machine.txt"

step "1. gpu_tests (CKPTFS_EXPECT_GPU=1)"
CKPTFS_EXPECT_GPU=1 timeout 300 gpu_tests 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
[ "${PIPESTATUS[0]}" = 0 ] || { echo "gpu_tests FAILED"; fail=1; }

if [ ! -c /dev/fuse ]; then
  mknod /dev/fuse c 10 229 2>/dev/null && chmod 666 /dev/fuse
fi
if [ ! -c /dev/fuse ]; then
  echo "no /dev/fuse on this machine: ckptfs cannot mount here; mount checks skipped"
  exit $(( fail ? 1 : 0 ))
fi

step "2. mount with auto staging: CUDA-pinned?"
M=/var/tmp/ckptfs-gpu-mount
rm -rf "$M" && mkdir -p "$M/backing" "$M/mnt" "$M/state"
ckptfs -f --staging-mem 1G --state-dir "$M/state" --log-file "$M/ckptfs.log" "$M/backing" "$M/mnt" &
pid=$!
for _ in $(seq 100); do [ -r "$M/mnt/.ckptfs/stats" ] && break; sleep 0.1; done
if [ -r "$M/mnt/.ckptfs/stats" ]; then
  head -c $((64 << 20)) /dev/urandom >"$M/src" && cp "$M/src" "$M/mnt/f" && sync "$M/mnt/f"
  ckptfs-admin wait "$M/mnt/f" --timeout 60 >/dev/null
  python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print("staging_backend", s["staging_backend"]); sys.exit(s["staging_backend"]!="cuda-pinned")' "$M/mnt/.ckptfs/stats" \
    || { echo "mount did not stage in CUDA-pinned memory"; fail=1; }
  cmp "$M/src" "$M/backing/f" && cmp "$M/src" "$M/mnt/f" && echo "64 MiB round-trip exact" || fail=1
  fusermount3 -u "$M/mnt"
else
  echo "ckptfs did not mount"; fail=1
fi
wait "$pid" 2>/dev/null; echo "daemon exit $?"
tail -5 "$M/ckptfs.log"; cp "$M/ckptfs.log" "$OUT/mount.log" 2>/dev/null

step "3. torch DCP of CUDA tensors: ckptfs against a plain directory"
PYTHONUNBUFFERED=1 timeout "${GPU_DCP_TIMEOUT:-300}" python3 "$REPO/scripts/bench/gpu_dcp.py" \
  --device "${GPU_DCP_DEVICE:-cuda}" --ranks "${GPU_DCP_RANKS:-4}" --mib "${GPU_DCP_MIB:-512}" --rounds "${GPU_DCP_ROUNDS:-3}" ${GPU_DCP_ARGS:-} \
  --out "$OUT/gpu_dcp.json" --png "$OUT/gpu_dcp.png" 2>&1 | tee "$OUT/gpu_dcp.log" | tail -30
[ "${PIPESTATUS[0]}" = 0 ] || { echo "gpu_dcp FAILED"; fail=1; }
for d in /var/tmp/ckptfs-gpu-dcp/*/mnt "$M/mnt"; do
  awk -v m="$d" '$5 == m {f=1} END {exit !f}' /proc/self/mountinfo && fusermount3 -u -z "$d"
done
echo "gpu_check: $([ $fail = 0 ] && echo PASSED || echo FAILED)"
exit $fail
