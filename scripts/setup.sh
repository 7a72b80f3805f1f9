#!/usr/bin/env bash
# Installs every package ckptfs needs to build, test, demo and benchmark, from
# Debian 12's archive. Safe to run again: it installs only what is missing.
set -euo pipefail

PACKAGES=(
  build-essential g++ cmake pkg-config ninja-build clang libclang-rt-14-dev
  libfuse3-dev fuse3
  librocksdb-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev
  nlohmann-json3-dev libcli11-dev libxxhash-dev
  libucx-dev libssl-dev
  python3-torch python3-numpy python3-matplotlib
  util-linux e2fsprogs xfsprogs coreutils procps psmisc attr
  libcpp-httplib-dev libsystemd-dev libmount-dev
  help2man dpkg-dev debootstrap curl python3-prometheus-client
  fio  # scripts/bench/bench_write.py: 4 KiB and 1 MiB write ratios
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all packages present"
fi

# FUSE needs the device node; containers sometimes lack it.
if [ ! -e /dev/fuse ]; then
  echo "setup: /dev/fuse is missing; ckptfs cannot mount on this machine" >&2
  exit 1
fi

# Pipes large enough for a whole FUSE request, so ckptfs splices write payloads
# (contrib/sysctl/90-ckptfs.conf; the package installs it to /usr/lib/sysctl.d). Only
# raised, never lowered; where the sysctl is read-only ckptfs copies twice and says so.
want_pipe=$(sed -n 's/^fs.pipe-max-size *= *//p' "$(dirname "$0")/../contrib/sysctl/90-ckptfs.conf")
have_pipe=$(cat /proc/sys/fs/pipe-max-size 2>/dev/null || echo 0)
if [ "$have_pipe" -lt "$want_pipe" ]; then
  if [ "$(id -u)" -eq 0 ] && echo "$want_pipe" > /proc/sys/fs/pipe-max-size 2>/dev/null; then
    echo "setup: fs.pipe-max-size $have_pipe -> $want_pipe (ckptfs splices FUSE writes)"
  else
    echo "setup: fs.pipe-max-size is $have_pipe (< $want_pipe): ckptfs will copy write payloads twice"
  fi
fi
