// EarlySyncs: threads that fsync a publish's temp file as soon as its journal entry is
// appended (the file is complete and frozen then). A publish is applied only after its
// file is fsynced, by the one publisher thread, in journal order; so that fsyncs of many
// files do not run one after another, these run ahead, and the publisher's own fsync,
// which is what the guarantee rests on, then finds little or nothing left to write. An
// early sync's failure is the publisher's to act on: its own Sync() of the target returns
// the same failure (a failed fsync marks the target lost).
//
// Thread-safe. Its lock is never held together with the journal's, nor during an fsync.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "store/flush/flush_pipeline.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {

class EarlySyncs {
 public:
  // `threads` 0: none (Submit does nothing). `dir` must outlive it.
  EarlySyncs(BackingDir* dir, int threads);
  ~EarlySyncs();  // drops what is queued, joins
  EarlySyncs(const EarlySyncs&) = delete;
  EarlySyncs& operator=(const EarlySyncs&) = delete;

  // Queues `target`'s fsync.
  void Submit(std::shared_ptr<FlushTarget> target) EXCLUDES(mu_);
  // Early syncs that succeeded.
  uint64_t done() const { return done_.load(std::memory_order_relaxed); }

 private:
  void Run() EXCLUDES(mu_);  // one thread

  BackingDir* const dir_;
  Mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<FlushTarget>> queue_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> done_{0};
  std::vector<std::thread> threads_;
};

}  // namespace ckptfs::store
