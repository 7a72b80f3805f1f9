// FuseServer: mounts a Filesystem with the libfuse3 low-level API and serves it on a
// multithreaded loop (or FUSE over io_uring, fs/transport/fuse_uring.h). Each FUSE op is
// one short function that calls the Filesystem and maps its Status to an errno reply (the
// only place that does): the op table, fs/transport/fuse_ops.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "fs/filesystem.h"
#include "fs/transport/entry_invalidator.h"
#include "fs/transport/fuse_uring.h"
#include "fs/transport/passthrough.h"

struct fuse_session;

namespace ckptfs::fs {

struct FuseTuning {
  // Kernel read-ahead for the mount (its bdi's read_ahead_kb), so that a large read()
  // reaches the daemon as several 1 MiB requests in flight instead of 128 KiB ones one
  // after another. 0 keeps the kernel's default.
  uint64_t read_ahead_bytes = 0;
  // Splice requests off /dev/fuse so a write's payload is copied once, into staging
  // (FUSE_CAP_SPLICE_READ; libfuse falls back to read() where the pipe cannot grow).
  bool splice_writes = true;
  // Write-only opens bypass the page cache (FOPEN_DIRECT_IO): the kernel hands the daemon
  // the writer's own pages instead of first copying them into the file's page cache, so a
  // write payload is copied once in all (into staging) instead of twice, and a 2 GiB save
  // leaves no 2 GiB of the file's pages behind. A write-only descriptor cannot be mmapped,
  // and since Linux 6.6 a direct write invalidates the pages other descriptors cached, so
  // readers stay coherent. kAuto: on from Linux 6.6, off before.
  enum class DirectWrites { kAuto, kOn, kOff };
  DirectWrites direct_writes = DirectWrites::kAuto;
  // The mount's source as df and /proc/mounts show it (the backing dir); empty: "ckptfs".
  std::string fsname;
  // FUSE over io_uring (fs/transport/fuse_uring.h), Linux 6.14+ built with CONFIG_FUSE_IO_URING.
  // kAuto (default): only where the kernel's switch (module parameter fuse.enable_uring)
  // is already on. kOn: also where it is off: a root daemon turns it on for this mount's
  // INIT alone and back off right after, under a lock that daemons starting together take
  // in turn, so no other FUSE server is offered it; a daemon that cannot (not root, a
  // read-only /sys, Linux before 6.14) serves over /dev/fuse. kOff: /dev/fuse only.
  // Not on by default: reads the daemon serves itself (the retained tier, staged files)
  // were slower over io_uring on a 16-CPU machine (docs/BENCHMARKS.md).
  enum class Uring { kAuto, kOn, kOff };
  Uring uring = Uring::kAuto;
  int uring_max_threads = 32;  // over all queues, as --fuse-threads for /dev/fuse
  // The mountpoint holds the dead mount of a killed daemon (DaemonOptions::
  // replaces_dead_mount): detached right before the new mount is made.
  bool replace_dead_mount = false;
};

class FuseServer {
 public:
  // Mounts `fs` (borrowed; must outlive) on `mountpoint`. `options` are -o options.
  static Result<std::unique_ptr<FuseServer>> Mount(Filesystem* fs, const std::string& mountpoint,
                                                   const std::vector<std::string>& options,
                                                   const FuseTuning& tuning = {});
  ~FuseServer();  // Unmounts if still mounted.
  FuseServer(const FuseServer&) = delete;
  FuseServer& operator=(const FuseServer&) = delete;

  // Serves requests until the file system is unmounted or SIGTERM/SIGINT arrives.
  // SIGHUP is left to the program (ckptfs reopens its log file on it).
  Status Run(int max_threads);
  void Unmount();

  // What the FUSE callbacks reach through the session's userdata (internal).
  struct Context {
    Filesystem* fs = nullptr;
    FuseTuning tuning;
    bool direct_writes = false;  // tuning.direct_writes resolved against this kernel
    struct fuse_session* session = nullptr;  // for notifications (attribute invalidation)
    // Queues a kernel entry or inode to drop (EntryInvalidator); handed to the Filesystem
    // at INIT.
    std::function<void(uint64_t ino, const std::string& name)> invalidate;
    // The io mode of each inode under FUSE passthrough: a passthrough open, or the daemon's.
    PassthroughTable* passthrough = nullptr;
    // Watches and patches the INIT exchange for passthrough and io_uring
    // (fs/transport/passthrough.h); null when both are off or custom I/O could not be installed.
    InitPatcher* init = nullptr;
    // FUSE over io_uring, started once the INIT reply asked for it; null when not wanted.
    FuseUring* uring = nullptr;
    // enable_uring was turned on for this mount's INIT (kOn): turned off after the reply.
    bool restore_kernel_uring = false;
    // The lock held from before the mount to the INIT reply (kOn); -1 when not held.
    int uring_lock_fd = -1;
  };

 private:
  FuseServer() = default;
  Context context_;
  std::unique_ptr<PassthroughTable> passthrough_;  // outlives the session and its handles
  std::unique_ptr<InitPatcher> init_;
  std::unique_ptr<FuseUring> uring_;
  // Stopped before the session goes; the Filesystem's copy of its Push is then a no-op.
  std::shared_ptr<EntryInvalidator> invalidator_;
  struct fuse_session* session_ = nullptr;
  bool mounted_ = false;
  bool signals_ = false;
};

}  // namespace ckptfs::fs
