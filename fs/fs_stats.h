// Counters of the daemon that the namespace, the write path and the facade add to and the
// control tree reports (stats, metrics). Thread-safe: atomics, and the last error under
// error_mu, a leaf lock.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "common/mutex.h"

namespace ckptfs::fs {

// A line of text one thread sets and the stats read (a leaf lock).
class StateText {
 public:
  explicit StateText(std::string initial) : text_(std::move(initial)) {}
  void Set(const std::string& s) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    text_ = s;
  }
  std::string Get() const EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return text_;
  }

 private:
  mutable Mutex mu_;
  std::string text_ GUARDED_BY(mu_);
};

// FUSE passthrough (fs/transport/passthrough.h). The kernel serves those reads: the daemon
// never sees them, so their bytes are estimated by the sizes of the files opened.
struct PassthroughStats {
  std::atomic<uint64_t> opens{0};           // opens replied with FOPEN_PASSTHROUGH
  std::atomic<uint64_t> bytes_opened{0};    // sizes of those files (an upper bound of
                                            // the bytes the kernel read for them)
  std::atomic<uint64_t> backing_opens{0};   // backing ids registered
  std::atomic<uint64_t> refused{0};         // opens the kernel refused to pass through
  std::atomic<uint64_t> conflict_waits{0};  // changes that waited for readers to close
  std::atomic<uint64_t> conflict_busy{0};   // changes failed with EBUSY after the wait
  std::atomic<int64_t> open_now{0};         // passthrough opens now
  // Bytes of checkpoint files the daemon asked the kernel to read ahead into the backing
  // files' page cache (a load began: the loader's page-cache prefetch).
  std::atomic<uint64_t> page_cache_prefetched{0};

  void SetState(const std::string& s) { state_.Set(s); }
  std::string state() const { return state_.Get(); }

 private:
  StateText state_{"off: not negotiated yet"};
};

// How requests reach the daemon (fs/transport/fuse_uring.h): over /dev/fuse, or FUSE over io_uring.
struct FuseTransportStats {
  std::atomic<uint64_t> uring_requests{0};    // requests served from a ring entry
  std::atomic<uint64_t> uring_threads{0};     // ring threads started (all queues)
  std::atomic<uint64_t> uring_queues{0};      // queues started (one per possible CPU)
  std::atomic<uint64_t> uring_errors{0};      // requests answered EIO, entries refused

  void SetState(const std::string& s) { state_.Set(s); }
  std::string state() const { return state_.Get(); }

 private:
  StateText state_{"/dev/fuse"};
};

struct FsStats {
  PassthroughStats passthrough;
  FuseTransportStats fuse;
  const std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> bytes_published{0};
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> files_published{0};
  // `.metadata` entries a later save into the same directory replaced before they could
  // commit (docs/SEMANTICS.md, "Superseded saves").
  std::atomic<uint64_t> commits_superseded{0};
  // Checkpoint directories another node removed, let go of (fs/namespace/gone_dirs.h).
  std::atomic<uint64_t> gone_dirs_evicted{0};
  std::atomic<uint64_t> errors{0};

  // Counts an error and keeps it as the last one (stats' last_error).
  void NoteError(const std::string& msg) EXCLUDES(error_mu) {
    errors.fetch_add(1);
    MutexLock lock(&error_mu);
    last_error_ = msg;
  }
  std::string last_error() const EXCLUDES(error_mu) {
    MutexLock lock(&error_mu);
    return last_error_;
  }

  mutable Mutex error_mu;

 private:
  std::string last_error_ GUARDED_BY(error_mu);
};

}  // namespace ckptfs::fs
