// EntryInvalidator: tells the kernel to drop directory entries the daemon lets go of (a
// checkpoint directory another node removed from the backing store; fs/namespace/
// gone_dirs.h), so that it forgets their inodes and the node table can free them, and the
// attributes and pages of files other nodes wrote again (fs/namespace/kernel_cache.h).
//
// fuse_lowlevel_notify_inval_entry takes the parent directory's lock in the kernel. A FUSE
// request that holds that lock (a create in the directory) may wait for the daemon's own
// locks or for publication, so the call is made only on a thread of its own that holds
// none: Push() queues and never blocks.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <string>
#include <thread>
#include <utility>

#include "common/mutex.h"

struct fuse_session;

namespace ckptfs::fs {

class EntryInvalidator {
 public:
  // At most this many entries wait; more are dropped (the kernel keeps them until its
  // own memory pressure, as before).
  static constexpr size_t kMaxQueued = 4096;

  explicit EntryInvalidator(struct fuse_session* session);
  ~EntryInvalidator();  // Stop()
  EntryInvalidator(const EntryInvalidator&) = delete;
  EntryInvalidator& operator=(const EntryInvalidator&) = delete;

  // The entry `name` in directory inode `ino`, or (name empty) inode `ino`'s attributes
  // and cached pages; from any thread; nothing once stopped.
  void Push(uint64_t ino, std::string name) EXCLUDES(mu_);
  // Sends what is queued, then ends the thread.
  void Stop() EXCLUDES(mu_);

 private:
  void Run() EXCLUDES(mu_);

  struct fuse_session* const session_;
  Mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<uint64_t, std::string>> queue_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  uint64_t dropped_ GUARDED_BY(mu_) = 0;  // notifications refused with the queue full
  std::thread thread_;
};

}  // namespace ckptfs::fs
