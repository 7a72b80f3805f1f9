// FUSE passthrough (Linux 6.9+) on Debian 12's libfuse 3.14, which has no API for it.
//
// The kernel serves read(), mmap and splice of a file opened with FOPEN_PASSTHROUGH straight
// from a backing file the daemon registered (FUSE_DEV_IOC_BACKING_OPEN), with no round trip
// and no copy through the daemon. Three pieces, none of which includes libfuse:
//
//   * InitPatcher: libfuse 3.14 neither offers FUSE_PASSTHROUGH in its INIT reply nor knows
//     max_stack_depth. It sees every request read off /dev/fuse and every reply written to
//     it (fuse_session_custom_io, installed by fs/transport/fuse_server.cc), notes the INIT request
//     and whether this kernel offers passthrough, and patches the INIT reply: FUSE_INIT_EXT,
//     the FUSE_PASSTHROUGH bit of flags2, max_stack_depth 1. It also asks for FUSE over
//     io_uring (FUSE_OVER_IO_URING) when wanted and offered (fs/transport/fuse_uring.h).
//   * BackingDevice: the two ioctls on /dev/fuse (an interface, so tests fake the kernel).
//   * PassthroughTable: the per-inode io mode. The kernel runs an inode either cached
//     (daemon-served opens) or passthrough, never both: a non-passthrough open of an inode
//     with a passthrough open fails with EIO in the kernel (fs/fuse/iomode.c), and so does
//     a passthrough open of an inode with cached opens, or with another backing file
//     (-ETXTBSY, -EBUSY). The table keeps the daemon's view so it never asks for a mix:
//     one backing id per inode while it has passthrough opens, closed with the last one.
//     The daemon's counts are never below the kernel's (a count is taken before the open
//     is replied, and the kernel ends an open's io mode before its RELEASE is sent), so the
//     table errs only towards waiting.
//
// A change of an inode that passthrough readers would not see (a writable open, O_TRUNC,
// truncate) waits for them to close, at most `conflict_wait`: a RELEASE arrives a moment
// after close() returns. A reader still open after that may be the waiter itself (G10):
// the change fails with kBusy (EBUSY) instead of waiting for it, as writing a running
// executable fails with ETXTBSY. docs/SEMANTICS.md, "Reads through the kernel".
//
// Thread-safe; mu_ is a leaf lock, never held across an ioctl or a wait's sleep.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "common/mutex.h"
#include "common/status.h"
#include "fs/fs_stats.h"
#include "fs/transport/fuse_uapi.h"

namespace ckptfs::fs {

// Watches the INIT exchange (see the file comment). Thread-safe.
class InitPatcher {
 public:
  explicit InitPatcher(bool want_passthrough, bool want_uring = false)
      : want_(want_passthrough), want_uring_(want_uring) {}
  // Every request read off /dev/fuse (`n` bytes at `buf`).
  void OnRequest(const void* buf, size_t n);
  // Every reply about to be written: patches the INIT reply in place with what is wanted
  // and the kernel offered. Returns true when this was the INIT reply (patched or not).
  bool OnReply(struct iovec* iov, int count);
  bool offered() const { return offered_.load(); }  // the kernel's INIT had FUSE_PASSTHROUGH
  bool patched() const { return patched_.load(); }  // our INIT reply asked for it
  bool uring_offered() const { return uring_offered_.load(); }  // FUSE_OVER_IO_URING offered
  bool uring_patched() const { return uring_patched_.load(); }  // and our reply asked for it
  uint32_t kernel_minor() const { return minor_.load(); }
  // The largest request or reply payload the INIT reply allows: max(max_write, max_pages
  // pages); 0 before the reply.
  uint32_t max_payload() const { return max_payload_.load(); }

 private:
  const bool want_, want_uring_;
  std::atomic<uint64_t> init_unique_{0};
  std::atomic<bool> offered_{false}, patched_{false};
  std::atomic<bool> uring_offered_{false}, uring_patched_{false};
  std::atomic<uint32_t> minor_{0}, max_payload_{0};
};

// FUSE_DEV_IOC_BACKING_OPEN / _CLOSE. Open returns the backing id (>= 0) or -errno.
class BackingDevice {
 public:
  virtual ~BackingDevice() = default;
  virtual int Open(int fd) = 0;
  virtual int Close(int32_t id) = 0;  // 0 or -errno
};
// The real one, on a /dev/fuse descriptor (borrowed: the session owns it).
std::unique_ptr<BackingDevice> MakeFuseBackingDevice(int dev_fd);

class PassthroughTable {
 public:
  struct Options {
    std::chrono::milliseconds conflict_wait{1000};
  };
  PassthroughTable(Options options, PassthroughStats* stats);  // stats: must outlive
  ~PassthroughTable();  // leaves the ids still registered to the connection's end
  PassthroughTable(const PassthroughTable&) = delete;
  PassthroughTable& operator=(const PassthroughTable&) = delete;

  // Turns passthrough on with `device` (after a successful INIT negotiation), or records
  // why it stays off (`device` null). Before this every AcquireRead returns nullopt.
  void Enable(std::unique_ptr<BackingDevice> device, const std::string& why) EXCLUDES(mu_);
  bool enabled() const { return enabled_.load(); }
  std::string state() const EXCLUDES(mu_);  // "on", or "off: why"

  // A read-only open of inode `ino` that may pass through, reading `fd` (the backing
  // file; `dev`/`inum` its identity, `size` its size for the stats): the backing id to
  // reply with, or -1 to serve it in the daemon (passthrough off or refused; then
  // AcquireOther is needed). kBusy: the inode has passthrough opens of another version.
  Result<int32_t> AcquireRead(uint64_t ino, int fd, dev_t dev, ino_t inum, uint64_t size)
      EXCLUDES(mu_);
  // An open served by the daemon, or a change of the file's bytes (`changes`: a writable
  // open, O_TRUNC, truncate): waits up to conflict_wait while the inode has passthrough
  // opens; kBusy when they remain. A read-only daemon open does not wait: passthrough
  // opens of this inode would make the kernel fail it, so it is kBusy at once only if the
  // inode has passthrough opens (then the caller retries AcquireRead).
  Status AcquireOther(uint64_t ino, bool changes) EXCLUDES(mu_);
  // The end of an open taken with AcquireRead (passthrough) or AcquireOther.
  void Release(uint64_t ino, bool passthrough) EXCLUDES(mu_);

  int64_t passthrough_opens(uint64_t ino) const EXCLUDES(mu_);

 private:
  struct InodeMode {
    int64_t pt_opens = 0, other_opens = 0;
    int32_t backing_id = -1;
    dev_t dev = 0;
    ino_t inum = 0;
  };
  void EraseIfIdleLocked(std::map<uint64_t, InodeMode>::iterator it) REQUIRES(mu_);

  const Options options_;
  PassthroughStats* const stats_;
  std::atomic<bool> enabled_{false};
  mutable Mutex mu_;
  std::condition_variable released_;  // an inode lost its last passthrough open
  std::unique_ptr<BackingDevice> device_ GUARDED_BY(mu_);
  std::string off_reason_ GUARDED_BY(mu_) = "not negotiated yet";
  std::map<uint64_t, InodeMode> inodes_ GUARDED_BY(mu_);
  std::atomic<bool> refusal_logged_{false};
};

}  // namespace ckptfs::fs
