#define FUSE_USE_VERSION 312
#include "fs/transport/entry_invalidator.h"

#include <fuse3/fuse_lowlevel.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>

#include "common/thread_name.h"

namespace ckptfs::fs {

EntryInvalidator::EntryInvalidator(struct fuse_session* session) : session_(session) {
  thread_ = std::thread([this] { Run(); });
}

EntryInvalidator::~EntryInvalidator() { Stop(); }

void EntryInvalidator::Push(uint64_t ino, std::string name) {
  {
    MutexLock lock(&mu_);
    if (stop_) return;
    if (queue_.size() >= kMaxQueued) {
      // Not silent: a dropped inode notification leaves the kernel showing a file's older
      // size and pages until their timeout (a dropped entry only delays a forget).
      if (dropped_++ % 1000 == 0) {
        spdlog::warn("fuse: {} kernel cache notification(s) dropped ({} queued); inode {} "
                     "may show its earlier attributes until they time out", dropped_,
                     kMaxQueued, ino);
      }
      return;
    }
    queue_.emplace_back(ino, std::move(name));
  }
  cv_.notify_one();
}

void EntryInvalidator::Stop() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void EntryInvalidator::Run() {
  NameThisThread("ckptfs-inval");
  MutexLock lock(&mu_);
  while (true) {
    cv_.wait(lock.native(), [this] {
      mu_.AssertHeld();  // the predicate runs under the lock
      return stop_ || !queue_.empty();
    });
    if (queue_.empty()) return;  // stopped, nothing left
    auto [ino, name] = std::move(queue_.front());
    queue_.pop_front();
    lock.Unlock();
    // Offset 0, length 0: the attributes and every cached page.
    const int rc = name.empty()
                       ? fuse_lowlevel_notify_inval_inode(session_, ino, 0, 0)
                       : fuse_lowlevel_notify_inval_entry(session_, ino, name.c_str(), name.size());
    // ENOENT: the kernel had no such entry or inode (it forgot it already).
    if (rc != 0 && rc != -ENOENT) {
      spdlog::debug("fuse: cannot drop {} '{}' of inode {}: {}", name.empty() ? "inode" : "entry",
                    name, ino, std::strerror(-rc));
    }
    lock.Lock();
  }
}

}  // namespace ckptfs::fs
