#include "fs/transport/passthrough.h"

#include <spdlog/spdlog.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

namespace ckptfs::fs {
namespace {

constexpr unsigned kIocMagic = 229;  // FUSE_DEV_IOC_MAGIC
constexpr unsigned long kIocBackingOpen = _IOW(kIocMagic, 1, fuse_uapi::BackingMap);
constexpr unsigned long kIocBackingClose = _IOW(kIocMagic, 2, uint32_t);

class FuseBackingDevice final : public BackingDevice {
 public:
  explicit FuseBackingDevice(int dev_fd) : dev_fd_(dev_fd) {}
  int Open(int fd) override {
    fuse_uapi::BackingMap map{};
    map.fd = fd;
    const int id = ::ioctl(dev_fd_, kIocBackingOpen, &map);
    return id < 0 ? -errno : id;
  }
  int Close(int32_t id) override {
    uint32_t arg = static_cast<uint32_t>(id);
    return ::ioctl(dev_fd_, kIocBackingClose, &arg) != 0 ? -errno : 0;
  }

 private:
  const int dev_fd_;
};

}  // namespace

std::unique_ptr<BackingDevice> MakeFuseBackingDevice(int dev_fd) {
  return std::make_unique<FuseBackingDevice>(dev_fd);
}

// ------------------------------------------------------------------ InitPatcher

void InitPatcher::OnRequest(const void* buf, size_t n) {
  if (init_unique_.load(std::memory_order_relaxed) != 0 || max_payload_.load() != 0) return;
  fuse_uapi::InHeader h;
  if (n < sizeof(h)) return;
  std::memcpy(&h, buf, sizeof(h));
  if (h.opcode != fuse_uapi::kOpInit) return;
  fuse_uapi::InitIn in{};
  std::memcpy(&in, static_cast<const char*>(buf) + sizeof(h),
              std::min(sizeof(in), n - sizeof(h)));
  minor_.store(in.minor);
  // flags2 exists only in an extended INIT (FUSE_INIT_EXT, from 7.36).
  const bool ext = (in.flags & fuse_uapi::kInitExt) != 0 && n >= sizeof(h) + sizeof(in);
  offered_.store(ext && (in.flags2 & fuse_uapi::kFlags2Passthrough) != 0);
  uring_offered_.store(ext && (in.flags2 & fuse_uapi::kFlags2OverIoUring) != 0);
  init_unique_.store(h.unique);
}

bool InitPatcher::OnReply(struct iovec* iov, int count) {
  const uint64_t unique = init_unique_.load(std::memory_order_relaxed);
  if (unique == 0 || count < 1 || iov[0].iov_len < sizeof(fuse_uapi::OutHeader)) return false;
  fuse_uapi::OutHeader h;
  std::memcpy(&h, iov[0].iov_base, sizeof(h));
  if (h.unique != unique) return false;
  init_unique_.store(0);
  // libfuse writes the whole fuse_init_out as the second iovec (the compat sizes are only
  // for protocol minors below 23, which offer neither passthrough nor io_uring).
  if (h.error != 0 || count < 2 || iov[1].iov_len < sizeof(fuse_uapi::InitOut)) return true;
  fuse_uapi::InitOut out;
  std::memcpy(&out, iov[1].iov_base, sizeof(out));
  if (want_ && offered_.load()) {
    out.flags |= fuse_uapi::kInitExt;
    out.flags2 |= fuse_uapi::kFlags2Passthrough;
    // Backing files on a plain file system (stack depth 0). The kernel refuses passthrough
    // together with the writeback cache, which ckptfs never asks for (OpInit).
    out.max_stack_depth = 1;
    patched_.store(true);
  }
  if (want_uring_ && uring_offered_.load()) {
    out.flags |= fuse_uapi::kInitExt;
    out.flags2 |= fuse_uapi::kFlags2OverIoUring;
    uring_patched_.store(true);
  }
  std::memcpy(iov[1].iov_base, &out, sizeof(out));
  // The kernel's own rule (fuse_uring_create): 8 KiB at least, max_pages pages (32 by
  // default), max_write.
  const uint32_t pages = (out.flags & fuse_uapi::kFlagMaxPages) ? out.max_pages : 32;
  const auto page = static_cast<uint32_t>(::sysconf(_SC_PAGESIZE));
  max_payload_.store(std::max({uint32_t{8192}, out.max_write, pages * page}));
  return true;
}

// ------------------------------------------------------------------ PassthroughTable

PassthroughTable::PassthroughTable(Options options, PassthroughStats* stats)
    : options_(options), stats_(stats) {}

// Backing ids still registered go with the FUSE connection (the kernel frees them when the
// session's descriptor closes); the descriptor may be closed already, so no ioctl here.
PassthroughTable::~PassthroughTable() = default;

void PassthroughTable::Enable(std::unique_ptr<BackingDevice> device, const std::string& why) {
  MutexLock lock(&mu_);
  device_ = std::move(device);
  off_reason_ = device_ ? "" : why;
  enabled_.store(device_ != nullptr);
  stats_->SetState(device_ ? "on" : "off: " + why);
}

std::string PassthroughTable::state() const {
  MutexLock lock(&mu_);
  return enabled_.load() ? "on" : "off: " + off_reason_;
}

void PassthroughTable::EraseIfIdleLocked(std::map<uint64_t, InodeMode>::iterator it) {
  if (it->second.pt_opens == 0 && it->second.other_opens == 0 && it->second.backing_id < 0) {
    inodes_.erase(it);
  }
}

Result<int32_t> PassthroughTable::AcquireRead(uint64_t ino, int fd, dev_t dev, ino_t inum,
                                              uint64_t size) {
  if (!enabled_.load()) return -1;
  MutexLock lock(&mu_);
  if (!device_) return -1;
  InodeMode& m = inodes_[ino];
  if (m.other_opens > 0) return -1;  // daemon-served opens (or a change) hold the inode
  if (m.pt_opens > 0) {
    if (m.dev != dev || m.inum != inum) {
      // Replaced on the backing store under readers still open: the kernel keeps one
      // backing file per inode, and serving the new open the old one would be stale.
      return Status(Code::kBusy, "the file was replaced while passthrough readers hold it");
    }
  } else {
    // Registering a backing file is an ioctl that only takes a reference: quick enough to
    // keep under the (leaf) lock, which makes a second open of the inode wait for the id.
    const int id = device_->Open(fd);
    if (id < 0) {
      stats_->refused.fetch_add(1);
      const int err = -id;
      // EPERM: no CAP_SYS_ADMIN, or the kernel did not take passthrough at INIT; ENOTTY:
      // no such ioctl. Anything else (ELOOP: a stacked backing fs; EBADF) is this file's.
      const bool global = err == EPERM || err == ENOTTY || err == EOPNOTSUPP || err == ENOSYS;
      if (global) {
        off_reason_ = std::string("the kernel refused a backing file: ") + std::strerror(err);
        enabled_.store(false);
        device_.reset();
        stats_->SetState("off: " + off_reason_);
      }
      if (!refusal_logged_.exchange(true) || global) {
        spdlog::warn("passthrough: inode {}: the kernel refused its backing file ({}); {}", ino,
                     std::strerror(err),
                     global ? "passthrough is off for this mount" : "served by the daemon");
      }
      auto it = inodes_.find(ino);
      EraseIfIdleLocked(it);
      return -1;
    }
    m.backing_id = id;
    m.dev = dev;
    m.inum = inum;
    stats_->backing_opens.fetch_add(1);
  }
  ++m.pt_opens;
  stats_->opens.fetch_add(1);
  stats_->bytes_opened.fetch_add(size);
  stats_->open_now.fetch_add(1);
  return m.backing_id;
}

Status PassthroughTable::AcquireOther(uint64_t ino, bool changes) {
  MutexLock lock(&mu_);
  auto it = inodes_.find(ino);
  if (it != inodes_.end() && it->second.pt_opens > 0) {
    if (!changes) return Status(Code::kBusy, "the file is open for passthrough reads");
    stats_->conflict_waits.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + options_.conflict_wait;
    while (true) {
      it = inodes_.find(ino);
      if (it == inodes_.end() || it->second.pt_opens == 0) break;
      if (released_.wait_until(lock.native(), deadline) == std::cv_status::timeout) {
        it = inodes_.find(ino);
        if (it != inodes_.end() && it->second.pt_opens > 0) {
          stats_->conflict_busy.fetch_add(1);
          return Status(Code::kBusy,
                        "the file is open for reading through passthrough (" +
                            std::to_string(it->second.pt_opens) + " opens); a change waits " +
                            std::to_string(options_.conflict_wait.count()) +
                            " ms for them to close");
        }
        break;
      }
    }
  }
  ++inodes_[ino].other_opens;
  return Status::Ok();
}

void PassthroughTable::Release(uint64_t ino, bool passthrough) {
  int32_t close_id = -1;
  {
    MutexLock lock(&mu_);
    auto it = inodes_.find(ino);
    if (it == inodes_.end()) return;
    InodeMode& m = it->second;
    if (passthrough) {
      if (m.pt_opens > 0) --m.pt_opens;
      stats_->open_now.fetch_sub(1);
      if (m.pt_opens == 0) {
        close_id = m.backing_id;
        m.backing_id = -1;
      }
    } else if (m.other_opens > 0) {
      --m.other_opens;
    }
    // The id is closed under the lock: an AcquireRead that registers the next one must not
    // run before (the ioctl is quick and never waits for a request).
    if (close_id >= 0 && device_) {
      const int rc = device_->Close(close_id);
      if (rc != 0) {
        spdlog::warn("passthrough: inode {}: closing backing id {}: {}", ino, close_id,
                     std::strerror(-rc));
      }
    }
    EraseIfIdleLocked(it);
  }
  if (close_id >= 0) released_.notify_all();
}

int64_t PassthroughTable::passthrough_opens(uint64_t ino) const {
  MutexLock lock(&mu_);
  auto it = inodes_.find(ino);
  return it == inodes_.end() ? 0 : it->second.pt_opens;
}

}  // namespace ckptfs::fs
