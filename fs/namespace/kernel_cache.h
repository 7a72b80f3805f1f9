// KernelCache: how the namespace tells the kernel to drop what it caches of the mount.
//
// The kernel keeps entries, attributes and pages of the mount for their timeouts (long for
// a committed checkpoint's files: they do not change through this mount). What changes
// behind its back has to be dropped by a notification: a checkpoint directory another node
// removed (GoneDirs), and the files of a checkpoint saved again through other nodes, whose
// old sizes and pages the kernel would otherwise go on serving (JournalEvents).
//
// The notifications go through the transport's EntryInvalidator, a thread of its own: the
// kernel takes the parent directory's lock (or the inode's pages' locks) to apply one, and
// a FUSE request holding it may be waiting for the daemon. Until the mount's INIT (and
// after its stop) nothing is sent. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "common/mutex.h"

namespace ckptfs::fs {

class KernelCache {
 public:
  // (ino, name): drop the entry `name` of directory `ino`; (ino, ""): drop inode `ino`'s
  // attributes and cached pages. Never blocks.
  using Invalidate = std::function<void(uint64_t ino, const std::string& name)>;

  void Set(Invalidate f) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    invalidate_ = std::move(f);
  }
  void DropEntry(uint64_t parent, const std::string& name) EXCLUDES(mu_) {
    if (!name.empty()) Send(parent, name);
  }
  void DropInode(uint64_t ino) EXCLUDES(mu_) { Send(ino, std::string()); }

 private:
  void Send(uint64_t ino, const std::string& name) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (invalidate_) invalidate_(ino, name);
  }

  Mutex mu_;
  Invalidate invalidate_ GUARDED_BY(mu_);
};

}  // namespace ckptfs::fs
