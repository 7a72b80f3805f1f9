#!/usr/bin/env bash
# Installs every package ckptfs needs to build, test, demo and benchmark, from
# Debian 12's archive. Safe to run again: it installs only what is missing.
set -euo pipefail

PACKAGES=(
  # Build: the daemon, ckptfs-admin, the unit tests; clang for scripts/sanitize.sh and
  # scripts/fuzz.sh (libFuzzer and the sanitizer runtimes: libclang-rt-14-dev); git for
  # the commit that --version reports (CMakeLists.txt); clang-format for the include
  # order check (scripts/check_includes.py, ctest style.includes).
  build-essential g++ cmake pkg-config ninja-build clang libclang-rt-14-dev git clang-format
  libfuse3-dev fuse3
  librocksdb-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev
  nlohmann-json3-dev libcli11-dev libxxhash-dev
  libucx-dev libssl-dev
  libcpp-httplib-dev libsystemd-dev libmount-dev
  # Python: tests/e2e, scripts/bench (numpy, torch DCP, matplotlib plots, Prometheus
  # text format in test_metrics_http).
  python3 python3-torch python3-numpy python3-matplotlib python3-prometheus-client
  # Programs the scripts and the e2e tests run:
  #   util-linux: setpriv (test_multiuser, test_unprivileged), nsenter (netns.py),
  #     prlimit (test_exhaustion), setarch (sanitize.sh), mountpoint; mount: mount, umount
  #   iproute2: ip (netns.py: test_peers, test_multinode_dcp, demo.sh step 9)
  #   procps: pgrep (test_mount_helper); psmisc; attr: getfattr (demo.sh, test_file_io)
  #   xfsprogs: mkfs.xfs (test_attr_stability); e2fsprogs; diffutils: cmp (bench, tests)
  #   curl (test_deb_install, test_metrics_http); debootstrap (test_deb_install)
  #   dpkg-dev: dpkg-shlibdeps; file: CPack's DEB generator (package.sh, test_deb_install);
  #   help2man: the man pages (package.sh)
  #   strace: scripts/bench/profile_ops.py; fio: scripts/bench/bench_write.py
  #   util-linux-extra: fincore (bench_reads.py: checkpoint bytes in the page cache)
  util-linux-extra util-linux mount iproute2 coreutils procps psmisc attr e2fsprogs xfsprogs diffutils
  curl debootstrap dpkg-dev file help2man strace fio
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

# The programs that scripts/ and tests/e2e run, by name: a package that is installed but
# lacks one (renamed, diverted, a PATH without /usr/sbin) is reported here rather than
# as a skipped or failed test later.
TOOLS=(cmake cpack ctest c++ clang++ clang-format git python3 fusermount3 mount umount setpriv nsenter
       prlimit setarch mountpoint ip pgrep getfattr mkfs.xfs cmp curl debootstrap chroot
       dpkg-deb dpkg-shlibdeps file help2man strace fio fincore)
absent=()
for t in "${TOOLS[@]}"; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$t" > /dev/null || absent+=("$t")
done
if ((${#absent[@]})); then
  echo "setup: installed, yet not found on PATH: ${absent[*]}" >&2
  exit 1
fi

# FUSE needs the device node; containers sometimes lack it.
if [ ! -e /dev/fuse ]; then
  echo "setup: /dev/fuse is missing; ckptfs cannot mount on this machine" >&2
  exit 1
fi

# fusermount3 -u run by a user (not root) checks the mount in /etc/mtab. A booted Debian
# links it to /proc/self/mounts (systemd-tmpfiles); bare roots (debootstrap, containers)
# have none, and every unprivileged unmount fails there.
if [ ! -e /etc/mtab ] && [ ! -L /etc/mtab ]; then
  if [ "$(id -u)" -eq 0 ]; then
    ln -s ../proc/self/mounts /etc/mtab
    echo "setup: /etc/mtab -> ../proc/self/mounts (fusermount3 -u as a user needs it)"
  else
    echo "setup: /etc/mtab is missing: users cannot unmount with fusermount3 -u" >&2
  fi
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

# Megatron-LM's megatron/core at a pinned release, for tests/e2e/test_megatron_dcp.py
# (the release tarball from GitHub into /var/cache/ckptfs; MEGATRON_SRC=DIR uses a checkout
# instead). Not fatal: without network the test skips and says why.
if [ "$(id -u)" -eq 0 ]; then
  "$(dirname "$0")/megatron_src.sh" >/dev/null \
    || echo "setup: Megatron-LM source not fetched (test_megatron_dcp will skip)" >&2
fi
