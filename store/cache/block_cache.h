// BlockCache: the daemon's read cache of backing-file blocks, with a hard memory budget.
//
// A backing file is cut into fixed blocks of `block_bytes`; a cached block is named by the
// node-independent BlockId of its file version (path relative to the backing directory,
// size, mtime; store/cache/block_source.h) and its block index, so a peer daemon can ask for
// the very same block by name. Misses are read through a BlockSource: the backing store
// (BackingSource) on its own, or whatever a caller puts in front of it (a peer). The first
// miss on a version of a path drops the blocks cached under other versions of that path.
//
// Memory. `budget_bytes` is a hard limit on every block buffer the cache holds, ready or
// being read, each counted in whole pages as mapped (a 100-byte file's block holds a 4 KiB
// page: counted by its bytes, a cache of tiny files held up to 40 times its budget); a miss reserves its buffer before reading, evicting least-recently-used
// ready blocks; when nothing is evictable (all in flight or being copied out) a demand
// read waits for memory, holding nothing that another reader needs, so it cannot
// deadlock. Buffers are freed under the lock before their bytes are released from the
// account, so the account is never below what is allocated.
//
// Single flight. Concurrent reads of a missing block wait for the one source read in
// flight for it, whether a demand read, a prefetch or a peer's request (ReadBlock) started
// it. A failed read (EIO, stale...) is returned to every waiter of that flight and not
// cached; the next read retries.
//
// Prefetch. Prefetch() queues a range for the Prefetcher's `prefetch_threads` threads; the
// queue is bounded and a request that does not fit is dropped (prefetch is advisory).
// Demand reads never queue: a demand miss reads on the caller's thread (plus helpers for
// a read of several missing blocks), so a long prefetch queue never delays it. Prefetch
// uses free memory and may evict only blocks not used since its request was made; when
// the least-recently-used block is newer than that, the rest of the request is dropped
// rather than evicting what is in use (or what prefetch itself just brought in).
//
// Buffers. Blocks are read into page-aligned buffers (each its own anonymous mapping, so
// the source may read them with O_DIRECT) of the block size rounded up to kDirectIoAlign;
// freed buffers are kept for reuse within the budget (held buffers plus free ones never
// exceed it), so a cold load does not pay a fresh mmap and page faults per block.
//
// Thread-safe. One mutex guards the index; no lock is held during a source read or while
// copying bytes out. The destructor drops queued prefetches and joins the prefetch
// threads; no Read() may be in progress or start once it runs.
//
// Freshness is only as good as the BlockId the caller passes: take it from fstat() of the
// file being read, and re-take it when the file may have changed (an attribute timeout),
// since an in-place rewrite within one mtime tick keeps size and mtime.
#pragma once

#include <sys/uio.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/cache/backing_source.h"
#include "store/cache/block_source.h"
#include "store/cache/prefetcher.h"

namespace ckptfs::store {

struct BlockCacheOptions {
  uint64_t budget_bytes = 1ull << 30;
  uint64_t block_bytes = 1ull << 20;  // a multiple of kDirectIoAlign
  int prefetch_threads = 2;  // 0 disables prefetch
  int read_parallelism = 4;  // source reads one demand Read() may have in flight
};

struct BlockCacheStats {
  uint64_t hits = 0;                // demand block lookups served from a ready block
  uint64_t misses = 0;              // demand block lookups that issued a source read
  uint64_t dedup_waits = 0;         // demand block lookups that joined a read in flight
  uint64_t backing_bytes_read = 0;  // bytes this cache read from its source
  uint64_t bytes_served = 0;        // bytes copied out by Read()
  uint64_t used_bytes = 0;          // block buffers held now, in flight included (whole pages)
  uint64_t budget_bytes = 0;
  uint64_t peak_used_bytes = 0;   // high-water mark of used_bytes
  uint64_t prefetched_bytes = 0;  // bytes read by prefetch threads
  uint64_t prefetch_hits = 0;     // prefetched blocks later used by a demand read
  uint64_t prefetch_dropped = 0;  // prefetch requests dropped (queue full, no memory, stop)
  uint64_t evictions = 0;
  uint64_t read_errors = 0;        // source reads that failed
  uint64_t free_buffer_bytes = 0;  // block buffers kept for reuse (within the budget)
  // The index's own heap (a few hundred bytes per block, outside the budget; at most
  // budget / 4 KiB blocks, so about a tenth of the budget with 4 KiB blocks).
  uint64_t index_bytes = 0;
};

// The cache is itself a BlockSource: a PeerServer serving through it shares the single
// flight, the budget and the cached blocks with this node's own reads.
class BlockCache final : public BlockSource {
 public:
  static Result<std::unique_ptr<BlockCache>> Create(BlockSource* source,  // must outlive
                                                    const BlockCacheOptions& options);
  ~BlockCache() override;  // Drops queued prefetches, waits for those in flight, joins.
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // Reads [offset, offset+len) of the file version `id`, clamped to id.size. Returns the
  // number of bytes copied into `out`: fewer than asked only at id.size, or where the file
  // turned out shorter than its id says (it changed underneath). A source error (NotFound,
  // Aborted for a stale id, EIO...) is returned as is.
  Result<size_t> Read(const BlockId& id, char* out, size_t len, uint64_t offset) EXCLUDES(mu_);

  // Read() without the copy: calls `use` once with iovecs over the cached blocks that hold
  // the bytes Read() would return (none at the end of the file), pinned for the call, and
  // returns their count. For a FUSE reply straight from the cache (fuse_reply_iov). When the
  // range needs more blocks than one batch may pin, returns nullopt without calling `use`
  // (the caller reads with Read() instead). Errors as Read(); `use` is then not called.
  using InPlaceUse = std::function<void(std::span<const struct iovec>)>;
  Result<std::optional<size_t>> ReadInPlace(const BlockId& id, size_t len, uint64_t offset,
                                            const InPlaceUse& use) EXCLUDES(mu_);

  // BlockSource: Read() of out.size() bytes at `offset`; Invalid when offset > id.size.
  Result<BlockRead> ReadBlock(const BlockId& id, uint64_t offset, std::span<char> out) override
      EXCLUDES(mu_);

  // Queues an asynchronous fetch of [offset, offset+len) (clamped to id.size), ahead of
  // the queued ones when `urgent` (a reader is in that range now). Returns at once; never
  // blocks on I/O or memory.
  void Prefetch(const BlockId& id, uint64_t offset, uint64_t len, bool urgent = false)
      EXCLUDES(mu_);

  // Drops every block of `path`, any version. Reads in flight still complete for their
  // callers; their blocks are then freed rather than cached.
  void Invalidate(const std::string& path) EXCLUDES(mu_);

  BlockCacheStats Stats() const EXCLUDES(mu_);
  uint64_t block_bytes() const { return opts_.block_bytes; }

 private:
  struct Block;
  // A block buffer is its own anonymous mapping: page-aligned for O_DIRECT, and given back
  // to the system the moment the cache drops it (malloc would keep a freed 1 MiB chunk in
  // the arena of whichever thread freed it, and RSS would drift past the budget).
  struct UnmapDeleter {
    size_t bytes = 0;
    void operator()(char* p) const;
  };
  using Buffer = std::unique_ptr<char, UnmapDeleter>;
  static Buffer MapBuffer(uint64_t bytes);  // null when out of memory
  // Block `index` of the file version `file`.
  struct BlockKey {
    BlockId file;
    uint64_t index = 0;
  };
  // Orders by (path, size, mtime, index), so the blocks of one path are adjacent and one
  // version's in index order. Transparent, so a lookup needs no copy of the path.
  struct KeyRef {
    const BlockId* file;
    uint64_t index;
  };
  struct KeyLess {
    using is_transparent = void;
    static bool Less(const BlockId& a, uint64_t ai, const BlockId& b, uint64_t bi);
    bool operator()(const BlockKey& a, const BlockKey& b) const {
      return Less(a.file, a.index, b.file, b.index);
    }
    bool operator()(const BlockKey& a, const KeyRef& b) const {
      return Less(a.file, a.index, *b.file, b.index);
    }
    bool operator()(const KeyRef& a, const BlockKey& b) const {
      return Less(*a.file, a.index, b.file, b.index);
    }
  };
  using BlockMap = std::map<BlockKey, std::shared_ptr<Block>, KeyLess>;
  // One block of a demand Read(): pinned until the caller has copied it out.
  struct Pinned {
    uint64_t index;
    std::shared_ptr<Block> block;
    bool load;  // this Read() issues its source read
  };

  BlockCache(BlockSource* source, const BlockCacheOptions& options);

  // Pins blocks `next`.. of `id` (at most up to `last`), issuing source reads for the
  // missing ones (the caller's thread plus helpers), and waits until all are ready or failed.
  // Returns the first error among them in `error`; `batch` holds the pins.
  void PinAndLoad(const BlockId& id, uint64_t next, uint64_t last, bool* dropped_old,
                  std::vector<Pinned>* batch, Status* error) EXCLUDES(mu_);
  void UnpinAll(const std::vector<Pinned>& batch, uint64_t served) EXCLUDES(mu_);

  uint64_t BlockSize(const BlockId& id, uint64_t index) const;
  // What a block of `bytes` takes from the budget: its buffer, in whole pages.
  static uint64_t Charge(uint64_t bytes);
  // The heap the index spends on a block beside its buffer (BlockCacheStats::index_bytes).
  static uint64_t IndexBytes(const BlockKey& key);
  // Reserves `bytes`, evicting LRU blocks. A prefetch (tick != 0) evicts only blocks last
  // used before `tick`. False if that cannot make room now.
  bool TryReserve(uint64_t bytes, uint64_t tick) REQUIRES(mu_);
  // Reserves `bytes` for a demand read, waiting for in-flight reads and copies to end.
  void WaitReserve(MutexLock& lock, uint64_t bytes) REQUIRES(mu_);
  void Release(uint64_t bytes) REQUIRES(mu_);
  // Takes `block` out of the index and LRU; frees it now unless pinned or in flight.
  void Detach(Block* block) REQUIRES(mu_);
  void FreeBuffer(Block* block) REQUIRES(mu_);
  // A kept buffer for a block of `bytes` just reserved, or null (the loader then
  // allocates one, aligned for O_DIRECT and rounded up to the alignment).
  Buffer TakeBuffer(uint64_t bytes) REQUIRES(mu_);
  // Keeps a full-block buffer for reuse while held + free bytes stay within the budget.
  void KeepBuffer(Buffer buffer, uint64_t capacity) REQUIRES(mu_);
  // Frees kept buffers until held + free bytes fit the budget.
  void TrimFreeBuffers() REQUIRES(mu_);
  // Drops the blocks of `path` whose version is not `keep` (all of them when null).
  void DropVersions(const std::string& path, const BlockId* keep) REQUIRES(mu_);
  std::shared_ptr<Block> NewLoadingBlock(const BlockId& file, uint64_t index, uint64_t bytes,
                                         bool prefetch) REQUIRES(mu_);
  // Reads `block` through the source (no lock held) and publishes the outcome.
  void Load(const std::shared_ptr<Block>& block) EXCLUDES(mu_);
  void Unpin(Block* block) REQUIRES(mu_);
  void Touch(Block* block) REQUIRES(mu_);
  // The Prefetcher's fetch of one block (see Prefetcher::Fetch).
  bool PrefetchBlock(const BlockId& id, uint64_t index, uint64_t tick) EXCLUDES(mu_);

  BlockSource* const source_;
  const BlockCacheOptions opts_;

  mutable Mutex mu_;
  std::condition_variable memory_cv_;  // memory may have become available
  BlockMap blocks_ GUARDED_BY(mu_);
  std::list<Block*> lru_ GUARDED_BY(mu_);  // ready blocks, front = newest
  uint64_t used_ GUARDED_BY(mu_) = 0;
  uint64_t index_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t use_tick_ GUARDED_BY(mu_) = 0;
  int memory_waiters_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  BlockCacheStats stats_ GUARDED_BY(mu_);
  std::vector<Buffer> free_buffers_ GUARDED_BY(mu_);  // full-block buffers to reuse
  uint64_t free_bytes_ GUARDED_BY(mu_) = 0;

  // Created last and destroyed first: its threads call PrefetchBlock.
  std::unique_ptr<Prefetcher> prefetcher_;
};

}  // namespace ckptfs::store
