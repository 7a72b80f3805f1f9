// Counters of the daemon that the namespace, the write path and the facade add to and the
// control tree reports (stats, metrics). Thread-safe: atomics, and the last error under
// error_mu, a leaf lock.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "common/mutex.h"

namespace ckptfs::fs {

struct FsStats {
  const std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> bytes_published{0};
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> files_published{0};
  // `.metadata` entries a later save into the same directory replaced before they could
  // commit (docs/SEMANTICS.md, "Superseded saves").
  std::atomic<uint64_t> commits_superseded{0};
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
