// Prefetcher: the block cache's background readers. It owns a bounded queue of block ranges
// and the threads that work it off; what fetching one block means (reserving memory, single
// flight, reading through the BlockSource) is the cache's, reached through `fetch`.
//
// A request is a range of blocks of one file version. Several threads share a long request,
// each taking its next block. When `fetch` says a block cannot be had without evicting
// blocks in use, the rest of that request is dropped: prefetch is advisory. A request that
// does not fit the queue is dropped at once.
//
// Thread-safe. `fetch` is called with no lock of this class held. The destructor drops the
// queued requests, waits for the fetches in flight and joins the threads.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/cache/block_source.h"

namespace ckptfs::store {

struct PrefetchRequest {
  BlockId id;
  uint64_t next = 0;  // next block index to fetch
  uint64_t last = 0;  // last block index, inclusive
  uint64_t tick = 0;  // the cache's use tick when asked: it may evict only blocks used before
};

class Prefetcher {
 public:
  // Fetches block `index` of `id` into the cache, or finds it there or in flight. False when
  // there is no memory for it without evicting blocks used since `tick`.
  using Fetch = std::function<bool(const BlockId& id, uint64_t index, uint64_t tick)>;

  static Result<std::unique_ptr<Prefetcher>> Create(int threads, size_t max_queued, Fetch fetch);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Queues `request`, at the front when `urgent` (a reader is in that range now); false
  // (and counted as dropped) when the queue is full or stopping.
  bool Enqueue(PrefetchRequest request, bool urgent = false) EXCLUDES(mu_);
  // Requests dropped: queue full, out of memory, or still queued at destruction.
  uint64_t dropped() const EXCLUDES(mu_);

 private:
  Prefetcher(size_t max_queued, Fetch fetch) : max_queued_(max_queued), fetch_(std::move(fetch)) {}
  void Loop() EXCLUDES(mu_);

  const size_t max_queued_;
  const Fetch fetch_;

  mutable Mutex mu_;
  std::condition_variable cv_;  // queue changed or stopping
  std::deque<PrefetchRequest> queue_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  uint64_t dropped_ GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_;  // owned; joined by the destructor
};

}  // namespace ckptfs::store
