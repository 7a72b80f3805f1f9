// Loader: reads of committed files from the backing store, and loading ahead.
//
// A file opened with no write state (a LoadFile, which the opener keeps in its handle)
// reads its backing file through the block cache (when there is one): the one call into
// the cache is here (ReadBacking). The loader decides what to fetch ahead: an open of a
// checkpoint's commit file (`.metadata`, a safetensors index) starts a load, whose
// checkpoint it fetches into the block cache (or, under FUSE passthrough, into the backing
// files' page cache, in PrefetchOrder); reads of a checkpoint that was indexed prefetch the
// whole DCP item they fall in, and record checksums of first full reads
// (store::ReadChecksums). A background worker, owned and joined here, runs those
// checkpoint prefetches and builds the key index of checkpoints as they are committed
// (KeyIndexBuilds, queued by Publication). Every backing-store call goes through BackingDir.
//
// Thread-safe. mu_ guards only the worker's queues and is never held across I/O. It
// takes no lock of its callers.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "store/cache/backing_source.h"
#include "store/cache/block_cache.h"
#include "store/dcp/dcp_metadata.h"
#include "store/dcp/key_index.h"
#include "store/dcp/read_checksums.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store::peer {
class Peers;
}  // namespace ckptfs::store::peer

namespace ckptfs::store {

class RetainedTier;

// One open of a backing file, as the loader reads it: what the open found, and where its
// reads have got to. The opener fills the first fields, hands it to Loader::Opened once,
// then to every read; reads of one open may run at once (atomics). Never moved.
struct LoadFile {
  // The backing file, opened when the file had no write state: the version this open
  // reads. Set at open only.
  std::shared_ptr<const UniqueFd> fd;
  BlockId block;                       // its backing path and version at open (block cache)
  dev_t dev = 0;                       // its identity, from the open's fstat
  ino_t ino = 0;
  std::string ckpt, file;              // checkpoint dir and file name, when in a committed one
  bool indexed = false;                // its checkpoint was indexed when it was opened (Opened)
  std::atomic<uint64_t> prefetched_end{0};  // end of the last item (or read-ahead) prefetched
  std::atomic<uint64_t> read_end{0};        // furthest end of a read (ReadAhead)
};

class Loader final : public KeyIndexBuilds {
 public:
  // `cache` may be null (no block cache: reads go to the backing file); when it is not, it
  // reads its misses through `source`.
  Loader(BackingDir* backing,  // must outlive
         KeyIndex* index,      // must outlive
         std::unique_ptr<BackingSource> source,
         std::shared_ptr<peer::Peers> peers,  // null: this daemon works alone
         std::unique_ptr<BlockCache> cache);
  ~Loader() override;  // Stop()s the worker.
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  void Start();
  // Joins the worker; queued work is dropped (the index is a cache, built lazily later).
  void Stop() EXCLUDES(mu_);

  // `f` was opened (its fd, block, dev, ino, and ckpt and file when it lies in a committed
  // checkpoint, are set): notes whether its checkpoint is indexed, and what the open says
  // of a load. A read-only open of a commit file starts one (its checkpoint is fetched
  // ahead); of a data file, the ranks read (see NoteDataOpen). `f` must outlive its reads.
  void Opened(LoadFile* f, bool writable) EXCLUDES(mu_);

  // Reads the backing file `f->fd`: through the block cache when there is one.
  Result<size_t> ReadBacking(LoadFile* f, char* out, size_t len, uint64_t offset);
  // ReadBacking() without copying: `use` gets iovecs over the cache's blocks (see
  // BlockCache::ReadInPlace) and is called exactly once when this returns a count.
  // nullopt (and `use` not called): read with ReadBacking() instead (no cache, checksums
  // to record, a range the cache cannot pin at once, a lost descriptor).
  Result<std::optional<size_t>> ReadBackingInPlace(LoadFile* f, size_t len, uint64_t offset,
                                                   const BlockCache::InPlaceUse& use);
  // Reads [offset, offset + len) of the window [base, base + size) of the open file `fd`
  // (a tensor-view chunk: a window of a shard file). A window that extends past the end
  // of its file is an error, not a short read.
  Result<size_t> ReadWindow(int fd, uint64_t base, uint64_t size, char* out, size_t len,
                            uint64_t offset);

  // KeyIndexBuilds: indexes committed checkpoint `ckpt` in the background (the journal
  // never waits).
  void QueueBuild(const std::string& ckpt) override EXCLUDES(mu_);
  // KeyIndexBuilds: the backing source's descriptors of `path` close.
  void FileGone(const std::string& path) override;
  // Fetches a checkpoint's items into the block cache in file order (a load started).
  // With peers, only this node's share of the plan: the rest is fetched item by item as
  // this node's readers reach it, so no block nobody here reads crosses the network.
  // Does nothing without a block cache.
  void QueuePrefetch(const std::string& ckpt) EXCLUDES(mu_);

  // A reader opened a data file (not a commit file) of committed checkpoint `ckpt`: the
  // ranks read now, and the page-cache prefetch of this load stops. It is for the time
  // the ranks spend between `.metadata` and their reads (planning, allocating the state);
  // once they read, the kernel's own read-ahead keeps the disk busy for them, and the
  // prefetch would only compete with them for the CPU and leave order-0 pages that read
  // slower than the read path's large folios (torch 2.14, whose ranks read at once:
  // 1.04-1.38x the direct load with it, 0.95-1.08x without).
  void NoteDataOpen(const std::string& ckpt) EXCLUDES(mu_);
  // Whether a data file of `ckpt` was opened since its load's prefetch was queued.
  bool RanksReading(const std::string& ckpt) EXCLUDES(mu_);

  // Off: QueuePrefetch does nothing (the kernel passes this node's reads through, and a
  // prefetch into the block cache would read every byte a second time).
  void SetPrefetch(bool on) { prefetch_.store(on); }
  // The checkpoint prefetch reads ahead into the backing files' page cache instead of the
  // block cache (passthrough readers read that cache): files of `min_bytes` or more (the
  // smaller ones are the daemon's to serve), in windows in PrefetchOrder, until the ranks
  // read (NoteDataOpen; none at all when they read within 50 ms of the load's start), at
  // most half the memory available when it starts. Bytes asked for add to `counter`.
  // Once, before the first QueuePrefetch (at INIT).
  void SetPageCachePrefetch(uint64_t min_bytes, std::atomic<uint64_t>* counter) {
    page_cache_min_bytes_ = min_bytes;
    page_cache_counter_ = counter;
    page_cache_.store(true);
  }
  // The retained memory tier (issue 23; must outlive Stop()): a checkpoint it holds
  // committed is served from memory, so a load of it prefetches nothing from the backing
  // store. Call before Start().
  void SetRetainedTier(RetainedTier* tier) { retained_ = tier; }

  BlockCache* cache() const { return cache_.get(); }
  BackingSource* cache_source() const { return source_.get(); }
  peer::Peers* peers() const { return peers_.get(); }
  // Stops serving blocks to peer daemons (before the cache they read goes). Idempotent.
  void StopServingPeers();
  const ReadChecksums& read_sums() const { return *read_sums_; }
  // Reads that waited the whole kPlanWait for their checkpoint's plan (a slow worker, or a
  // plan never finished: each such read was held a second).
  uint64_t plan_wait_timeouts() const { return plan_wait_timeouts_.load(); }

 private:
  void Run() EXCLUDES(mu_);
  // What ReadBacking and ReadBackingInPlace do before the cache: the file's version now
  // (fstat), lent to the cache (Adopt), then the item's prefetch or the read-ahead.
  // `known`: the fstat the caller just took, if any.
  Result<struct stat> BeginRead(LoadFile* f, size_t len, uint64_t offset,
                                const struct stat* known = nullptr);
  void PrefetchCheckpoint(const std::string& ckpt) EXCLUDES(mu_);
  bool HeldInMemory(const std::string& ckpt) const;
  void PrefetchIntoPageCache(const std::string& ckpt) EXCLUDES(mu_);
  bool Stopping() EXCLUDES(mu_);
  // With peers: waits (at most kPlanWait) while `ckpt` is in planning_.
  void WaitForPlan(const std::string& ckpt) EXCLUDES(mu_);
  void PlanDone(const std::string& ckpt) EXCLUDES(mu_);
  // Prefetches the whole DCP item that `offset` falls in, once per item and handle: from the
  // key index when the checkpoint was indexed, else (with peers) from the items of its
  // `.metadata` that PrefetchCheckpoint() kept.
  void PrefetchItem(LoadFile* f, const BlockId& id, uint64_t offset);
  // A file outside any checkpoint read front to back (cp, dd, torch.load of a torch.save
  // file): keeps kReadAheadBytes of blocks fetching past the reader. The kernel's FUSE
  // read-ahead alone left the backing store idle between its requests (cold dd of 2 GiB
  // at half the speed of reading the backing file).
  void ReadAhead(LoadFile* f, const BlockId& id, uint64_t offset, size_t len);
  // The item [offset, end) of `file` of `ckpt` that `at` falls in, from the kept items.
  std::optional<std::pair<uint64_t, uint64_t>> KeptItem(const std::string& ckpt,
                                                        const std::string& file, uint64_t at)
      EXCLUDES(items_mu_);
  // Keeps `md`'s item ranges for KeptItem(); at most kKeptCheckpoints checkpoints.
  void KeepItems(const std::string& ckpt, const DcpMetadata& md) EXCLUDES(items_mu_);
  // Lends an open backing file to the cache's source under its BlockId; drops the blocks
  // cached for another file that had the same name, size and mtime.
  void Adopt(const BlockId& id, std::shared_ptr<const UniqueFd> fd, const struct stat& st);
  Result<std::string> ReadMetadataCached(const std::string& path);  // issue 23

  BackingDir* const backing_;
  KeyIndex* const index_;
  const std::unique_ptr<BackingSource> source_;  // before cache_: outlives it
  // Peer daemons (issue 12): the cache's source when on (peers first, then source_) and
  // the server of this node's blocks. Between source_ and cache_: the cache reads through
  // it and it falls back to source_.
  const std::shared_ptr<peer::Peers> peers_;
  const std::unique_ptr<BlockCache> cache_;
  const std::unique_ptr<ReadChecksums> read_sums_;  // checksums on first full read

  Mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> index_queue_ GUARDED_BY(mu_);
  std::deque<std::string> prefetch_queue_ GUARDED_BY(mu_);
  // With peers: checkpoints whose `.metadata` was opened and whose plan is not made yet.
  // A read of one of their files waits (bounded) for the plan: read before it, a block
  // another node owns would come from the backing store, and be read there twice.
  std::set<std::string> planning_ GUARDED_BY(mu_);
  std::condition_variable planned_cv_;  // a checkpoint left planning_
  bool stop_ GUARDED_BY(mu_) = false;
  // Checkpoints prefetched into the page cache, and when (PrefetchIntoPageCache).
  std::map<std::string, std::chrono::steady_clock::time_point> page_cache_done_ GUARDED_BY(mu_);
  // Per checkpoint: when its load was queued for prefetch (QueuePrefetch) and when a reader
  // last opened one of its data files (NoteDataOpen). Bounded like page_cache_done_.
  std::map<std::string, std::chrono::steady_clock::time_point> queued_at_ GUARDED_BY(mu_);
  std::map<std::string, std::chrono::steady_clock::time_point> data_opened_ GUARDED_BY(mu_);
  std::atomic<bool> prefetch_{true};
  std::atomic<uint64_t> plan_wait_timeouts_{0};
  RetainedTier* retained_ = nullptr;  // SetRetainedTier
  std::atomic<bool> page_cache_{false};  // SetPageCachePrefetch
  uint64_t page_cache_min_bytes_ = 0;
  std::atomic<uint64_t>* page_cache_counter_ = nullptr;
  std::thread worker_;

  // Item ranges by checkpoint, then file, sorted by offset: (offset, end). A leaf lock.
  using FileItems = std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>>;
  static constexpr size_t kKeptCheckpoints = 8;
  static constexpr uint64_t kReadAheadBytes = uint64_t{16} << 20;  // ReadAhead()'s window
  Mutex items_mu_;
  std::map<std::string, FileItems> items_ GUARDED_BY(items_mu_);
  std::deque<std::string> items_order_ GUARDED_BY(items_mu_);  // oldest first
};

}  // namespace ckptfs::store
