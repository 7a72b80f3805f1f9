// BlockCache: the daemon's read cache of backing-file blocks, with a hard memory budget.
//
// A backing file is cut into fixed blocks of `block_bytes`; a cached block is keyed by
// (FileKey, block index). FileKey holds the identity of one version of the file (device,
// inode, size, mtime), so a file changed on the backing store by anyone is a new key and
// never served stale bytes. The first miss on a key whose (dev, ino) has blocks cached
// under another version drops those old blocks.
//
// Memory. `budget_bytes` is a hard limit on every block buffer the cache holds, ready or
// being read: a miss reserves its buffer before reading, evicting least-recently-used
// ready blocks; when nothing is evictable (all in flight or being copied out) a demand
// read waits for memory, holding nothing that another reader needs, so it cannot
// deadlock. Buffers are freed under the lock before their bytes are released from the
// account, so the account is never below what is allocated.
//
// Single flight. Concurrent reads of a missing block wait for the one backing read in
// flight for it, whether a demand read or a prefetch started it. A failed read (EIO...)
// is returned to every waiter of that flight and not cached; the next read retries.
//
// Prefetch. Prefetch() queues a range for `prefetch_threads` background threads; the
// queue is bounded and a request that does not fit is dropped (prefetch is advisory).
// Demand reads never queue: a demand miss reads on the caller's thread (plus helpers for
// a read of several missing blocks), so a long prefetch queue never delays it. Prefetch
// uses free memory and may evict only blocks not used since its request was made; when
// the least-recently-used block is newer than that, the rest of the request is dropped
// rather than evicting what is in use (or what prefetch itself just brought in).
//
// Reading the backing store. Blocks are read into page-aligned buffers that are kept for
// reuse (within the budget: held buffers plus free ones never exceed it), so a cold load
// does not pay a fresh mmap and page faults per block. With `direct_io`, blocks are read
// with O_DIRECT through a second descriptor reopened from the caller's (the same inode,
// never a path lookup): the bytes go from the device straight into the cache, without
// being copied through, and evicting, the backing store's page cache. A file system that
// refuses O_DIRECT (tmpfs, some FUSE or network file systems) is read buffered instead,
// decided once per device.
//
// Peers. With a `router` (issue 12), a miss first asks the router, which may read the block
// from a peer daemon (the block's owner); when it declines (this node owns the block, no
// plan covers it, the peer failed) the cache reads the backing store as above. The flight is
// the same either way, so local readers and prefetch share it. A Read with route=false (a
// peer's request being served) never asks the router: an owner always reads locally.
//
// Thread-safe. One mutex guards the index; no lock is held during pread or while copying
// bytes out. The destructor drops queued prefetches and joins the prefetch threads; no
// Read() may be in progress or start once it runs.
//
// Freshness is only as good as the FileKey the caller passes: take it from fstat() of
// the very fd being read, and re-take it when the file may have changed (an attribute
// timeout), since an in-place rewrite within one mtime tick keeps size and mtime.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "store/backing_dir.h"

namespace ckptfs::store {

// Identity of one backing file version: a change in any field means new contents.
struct FileKey {
  uint64_t dev = 0, ino = 0, size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileKey&) const = default;
  auto operator<=>(const FileKey&) const = default;
};

// The key of a file as fstat() describes it now.
FileKey FileKeyFromStat(const struct stat& st);

// A second place misses may come from (peer daemons). Thread-safe; must outlive the cache.
class MissRouter {
 public:
  virtual ~MissRouter() = default;
  // Reads up to out.size() bytes at `offset` of the file version `key` from elsewhere and
  // returns the count, or nullopt: the cache reads the backing store itself. Never fails:
  // a peer error is the router's to count and log.
  virtual std::optional<size_t> ReadElsewhere(const FileKey& key, uint64_t offset,
                                              std::span<char> out) = 0;
};

struct BlockCacheOptions {
  uint64_t budget_bytes = 1ull << 30;
  uint64_t block_bytes = 1ull << 20;
  int prefetch_threads = 2;  // 0 disables prefetch
  int read_parallelism = 4;  // backing reads one demand Read() may have in flight
  bool direct_io = false;    // read blocks with O_DIRECT where the file system allows it
  MissRouter* router = nullptr;  // optional, must outlive the cache
};

struct BlockCacheStats {
  uint64_t hits = 0;                // demand block lookups served from a ready block
  uint64_t misses = 0;              // demand block lookups that issued a backing read
  uint64_t dedup_waits = 0;         // demand block lookups that joined a read in flight
  uint64_t backing_bytes_read = 0;  // bytes this cache read from the backing store
  uint64_t bytes_served = 0;        // bytes copied out by Read()
  uint64_t used_bytes = 0;          // block buffers held now, in flight included
  uint64_t budget_bytes = 0;
  uint64_t peak_used_bytes = 0;   // high-water mark of used_bytes
  uint64_t prefetched_bytes = 0;  // bytes read by prefetch threads
  uint64_t prefetch_hits = 0;     // prefetched blocks later used by a demand read
  uint64_t prefetch_dropped = 0;  // prefetch requests dropped (queue full, no memory, stop)
  uint64_t evictions = 0;
  uint64_t read_errors = 0;  // backing reads that failed
  uint64_t direct_bytes_read = 0;  // part of backing_bytes_read read with O_DIRECT
  uint64_t free_buffer_bytes = 0;  // block buffers kept for reuse (within the budget)
  uint64_t routed_bytes_read = 0;  // miss bytes the router brought (not in backing_bytes_read)
};

class BlockCache {
 public:
  static Result<std::unique_ptr<BlockCache>> Create(BackingDir* dir,  // must outlive
                                                    const BlockCacheOptions& options);
  ~BlockCache();  // Drops queued prefetches, waits for those in flight, joins.
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // Reads [offset, offset+len) of the file version `key`, clamped to key.size, from the
  // open file `fd` (shared so a prefetch may outlive the caller's handle). Returns the
  // number of bytes copied into `out`: fewer than asked only at key.size, or where the
  // file turned out shorter than its key says (it changed underneath).
  // `route`: a miss may ask the router (false: this read serves a peer; read locally).
  Result<size_t> Read(const FileKey& key, std::shared_ptr<const UniqueFd> fd, char* out, size_t len,
                      uint64_t offset, bool route = true);

  // Queues an asynchronous fetch of [offset, offset+len) (clamped to key.size). Returns
  // at once; never blocks on I/O or memory.
  void Prefetch(const FileKey& key, std::shared_ptr<const UniqueFd> fd, uint64_t offset,
                uint64_t len);

  // Drops every block of that file, any version. Reads in flight still complete for
  // their callers; their blocks are then freed rather than cached.
  void Invalidate(uint64_t dev, uint64_t ino);

  BlockCacheStats Stats() const;
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
  struct BlockId {
    FileKey key;
    uint64_t index = 0;
    auto operator<=>(const BlockId&) const = default;
  };
  struct PrefetchRequest {
    FileKey key;
    std::shared_ptr<const UniqueFd> fd;
    uint64_t next = 0;  // next block index to fetch
    uint64_t last = 0;  // last block index, inclusive
    uint64_t tick = 0;  // use_tick_ when queued: it may evict only blocks used before
  };
  // One block of a demand Read(): pinned until the caller has copied it out.
  struct Pinned {
    uint64_t index;
    std::shared_ptr<Block> block;
    bool load;  // this Read() issues its backing read
  };
  using Lock = std::unique_lock<std::mutex>;

  BlockCache(BackingDir* dir, const BlockCacheOptions& options);

  uint64_t BlockSize(const FileKey& key, uint64_t index) const;
  // Reserves `bytes`, evicting LRU blocks. A prefetch (tick != 0) evicts only blocks last
  // used before `tick`. False if that cannot make room now.
  bool TryReserve(Lock& lock, uint64_t bytes, uint64_t tick);
  // Reserves `bytes` for a demand read, waiting for in-flight reads and copies to end.
  void WaitReserve(Lock& lock, uint64_t bytes);
  void Release(Lock& lock, uint64_t bytes);
  // Takes `block` out of the index and LRU; frees it now unless pinned or in flight.
  void Detach(Lock& lock, Block* block);
  void FreeBuffer(Lock& lock, Block* block);
  // A kept buffer for a block of `bytes` just reserved, or null (the loader then
  // allocates one, aligned for O_DIRECT and rounded up to the alignment).
  Buffer TakeBuffer(Lock& lock, uint64_t bytes);
  // Keeps a full-block buffer for reuse while held + free bytes stay within the budget.
  void KeepBuffer(Lock& lock, Buffer buffer, uint64_t capacity);
  // Frees kept buffers until held + free bytes fit the budget.
  void TrimFreeBuffers(Lock& lock);
  // The O_DIRECT descriptor for the file behind `fd` (opened once per inode and kept), or
  // null when the file's device does not take O_DIRECT.
  std::shared_ptr<const UniqueFd> DirectFd(const FileKey& key, const UniqueFd& fd);
  void NoDirectIo(uint64_t dev);
  // Drops blocks of key's (dev, ino) cached under another version.
  void DropOtherVersions(Lock& lock, const FileKey& key);
  std::shared_ptr<Block> NewLoadingBlock(Lock& lock, const BlockId& id, uint64_t bytes,
                                         bool prefetch, bool route = true);
  // Reads `block` from the backing store (no lock held) and publishes the outcome.
  void Load(const std::shared_ptr<Block>& block, const UniqueFd& fd);
  void Unpin(Lock& lock, Block* block);
  void Touch(Lock& lock, Block* block);
  void PrefetchLoop();

  BackingDir* const dir_;
  const BlockCacheOptions opts_;

  mutable std::mutex mu_;
  std::condition_variable memory_cv_;                 // memory may have become available
  std::condition_variable queue_cv_;                  // prefetch queue changed or stopping
  std::map<BlockId, std::shared_ptr<Block>> blocks_;  // GUARDED_BY(mu_)
  std::list<Block*> lru_;                 // GUARDED_BY(mu_): ready blocks, front = newest
  uint64_t used_ = 0;                     // GUARDED_BY(mu_)
  uint64_t use_tick_ = 0;                 // GUARDED_BY(mu_)
  int memory_waiters_ = 0;                // GUARDED_BY(mu_)
  std::deque<PrefetchRequest> queue_;     // GUARDED_BY(mu_)
  bool stop_ = false;                     // GUARDED_BY(mu_)
  BlockCacheStats stats_;                 // GUARDED_BY(mu_)
  std::vector<std::thread> prefetchers_;  // owned; joined by the destructor
  std::vector<Buffer> free_buffers_;      // GUARDED_BY(mu_): full-block buffers to reuse
  uint64_t free_bytes_ = 0;               // GUARDED_BY(mu_)

  // O_DIRECT descriptors by (dev, ino), least recently used first out.
  std::mutex direct_mu_;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<const UniqueFd>> direct_fds_;
  std::list<std::pair<uint64_t, uint64_t>> direct_lru_;  // GUARDED_BY(direct_mu_), front = newest
  std::vector<uint64_t> no_direct_devs_;                 // GUARDED_BY(direct_mu_)
};

}  // namespace ckptfs::store
