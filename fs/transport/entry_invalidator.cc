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

void EntryInvalidator::Push(uint64_t parent, std::string name) {
  {
    MutexLock lock(&mu_);
    if (stop_ || queue_.size() >= kMaxQueued) return;
    queue_.emplace_back(parent, std::move(name));
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
    auto [parent, name] = std::move(queue_.front());
    queue_.pop_front();
    lock.Unlock();
    const int rc = fuse_lowlevel_notify_inval_entry(session_, parent, name.c_str(), name.size());
    // ENOENT: the kernel had no such entry (it forgot it already).
    if (rc != 0 && rc != -ENOENT) {
      spdlog::debug("fuse: cannot drop entry '{}' of inode {}: {}", name, parent,
                    std::strerror(-rc));
    }
    lock.Lock();
  }
}

}  // namespace ckptfs::fs
