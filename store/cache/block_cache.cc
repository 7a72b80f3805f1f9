#include "store/cache/block_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <system_error>
#include <utility>

namespace ckptfs::store {
namespace {

// Prefetch requests waiting for a thread; more are dropped. A request is one range (a
// DCP item, say), so this bounds the queue, not the bytes it names.
constexpr size_t kMaxQueuedPrefetches = 4096;
// Blocks one Read() pins at a time; a longer read goes on in further batches.
constexpr size_t kMaxBatchBlocks = 256;
// Alignment of block buffers, offsets and lengths for O_DIRECT (the largest logical
// block size in use; 512-byte devices accept it too).
constexpr uint64_t kDirectAlign = 4096;
// O_DIRECT descriptors kept open at once.
constexpr size_t kMaxDirectFds = 256;

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

}  // namespace

FileKey FileKeyFromStat(const struct stat& st) {
  FileKey key;
  key.dev = static_cast<uint64_t>(st.st_dev);
  key.ino = static_cast<uint64_t>(st.st_ino);
  key.size = static_cast<uint64_t>(st.st_size);
  key.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return key;
}

struct BlockCache::Block {
  enum class State { kLoading, kReady, kFailed };

  BlockId id;
  State state = State::kLoading;
  Buffer data;             // set once ready; freed under mu_ before `charged` is released
  uint64_t capacity = 0;   // bytes allocated for `data` (charged rounded up for O_DIRECT)
  uint64_t charged = 0;          // bytes reserved for this block in used_; 0 once released
  uint64_t len = 0;              // valid bytes once ready (short only if the file shrank)
  Status error;                  // once failed
  int pins = 0;                  // Read() calls that will copy from it (or wait to)
  bool in_index = true;          // false once evicted, invalidated or failed
  bool in_lru = false;
  bool prefetched = false;  // read by prefetch, not yet used by a demand read
  bool route = true;        // its loader may ask the router (false: serving a peer)
  uint64_t last_use = 0;
  std::list<Block*>::iterator lru_pos;
  std::condition_variable ready_cv;  // state left kLoading
};

BlockCache::BlockCache(BackingDir* dir, const BlockCacheOptions& options)
    : dir_(dir), opts_(options) {
  stats_.budget_bytes = options.budget_bytes;
}

Result<std::unique_ptr<BlockCache>> BlockCache::Create(BackingDir* dir,
                                                       const BlockCacheOptions& options) {
  if (dir == nullptr) return Invalid("block cache: no backing directory");
  if (options.block_bytes == 0) return Invalid("block cache: block size must be positive");
  if (options.budget_bytes < options.block_bytes) {
    return Invalid("block cache: budget " + std::to_string(options.budget_bytes) +
                   " is smaller than one block (" + std::to_string(options.block_bytes) + ")");
  }
  if (options.prefetch_threads < 0) return Invalid("block cache: negative prefetch threads");
  if (options.read_parallelism < 1) return Invalid("block cache: read parallelism must be >= 1");
  if (options.block_bytes % kDirectAlign != 0) {
    return Invalid("block cache: block size must be a multiple of " + std::to_string(kDirectAlign));
  }
  std::unique_ptr<BlockCache> cache(new BlockCache(dir, options));
  try {
    for (int i = 0; i < options.prefetch_threads; ++i) {
      cache->prefetchers_.emplace_back([c = cache.get()] { c->PrefetchLoop(); });
    }
  } catch (const std::system_error& e) {
    return Status(Code::kInternal, std::string("block cache: cannot start threads: ") + e.what());
  }
  return cache;
}

BlockCache::~BlockCache() {
  {
    Lock lock(mu_);
    stop_ = true;
    stats_.prefetch_dropped += queue_.size();
    queue_.clear();
  }
  queue_cv_.notify_all();
  for (std::thread& t : prefetchers_) t.join();
}

uint64_t BlockCache::BlockSize(const FileKey& key, uint64_t index) const {
  uint64_t start = index * opts_.block_bytes;
  if (start >= key.size) return 0;
  return std::min(opts_.block_bytes, key.size - start);
}

// ------------------------------------------------------------------------ memory

bool BlockCache::TryReserve(Lock& lock, uint64_t bytes, uint64_t tick) {
  while (used_ + bytes > opts_.budget_bytes) {
    // Blocks already served go first, least recently used first: a reader has its bytes
    // (and ranks sharing the kernel page cache have them too). A prefetched block nobody
    // has read yet is the read about to come; evicting it for another miss only makes
    // the backing store read it twice. It goes only when nothing else can.
    Block* victim = nullptr;
    Block* unread = nullptr;
    for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
      if ((*it)->pins != 0) continue;
      if (!(*it)->prefetched) {
        victim = *it;
        break;
      }
      if (unread == nullptr) unread = *it;
    }
    if (victim == nullptr) victim = unread;
    if (victim == nullptr) return false;
    // A prefetch must not push out what was used since it was asked for (that includes
    // the blocks it brought in itself): stop rather than thrash.
    if (tick != 0 && victim->last_use >= tick) return false;
    ++stats_.evictions;
    Detach(lock, victim);
  }
  used_ += bytes;
  stats_.peak_used_bytes = std::max(stats_.peak_used_bytes, used_);
  return true;
}

void BlockCache::WaitReserve(Lock& lock, uint64_t bytes) {
  ++memory_waiters_;
  while (!TryReserve(lock, bytes, 0)) memory_cv_.wait(lock);
  --memory_waiters_;
}

void BlockCache::Release(Lock& lock, uint64_t bytes) {
  used_ -= bytes;
  if (memory_waiters_ > 0) memory_cv_.notify_all();
}

void BlockCache::FreeBuffer(Lock& lock, Block* block) {
  const uint64_t charged = block->charged;
  block->charged = 0;
  Release(lock, charged);
  KeepBuffer(lock, std::move(block->data), block->capacity);
}

void BlockCache::UnmapDeleter::operator()(char* p) const { ::munmap(p, bytes); }

BlockCache::Buffer BlockCache::MapBuffer(uint64_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return Buffer(nullptr, UnmapDeleter{0});
  return Buffer(static_cast<char*>(p), UnmapDeleter{bytes});
}

BlockCache::Buffer BlockCache::TakeBuffer(Lock& lock, uint64_t bytes) {
  Buffer b;
  if (RoundUp(bytes, kDirectAlign) == opts_.block_bytes && !free_buffers_.empty()) {
    b = std::move(free_buffers_.back());
    free_buffers_.pop_back();
    free_bytes_ -= opts_.block_bytes;
  }
  // The reservation just made for `bytes` may have left held + free over the budget.
  TrimFreeBuffers(lock);
  return b;
}

void BlockCache::KeepBuffer(Lock& lock, Buffer buffer, uint64_t capacity) {
  // `used_` still counts this buffer, so keeping it leaves held + free where it was.
  if (!buffer || capacity != opts_.block_bytes || stop_) return;
  free_buffers_.push_back(std::move(buffer));
  free_bytes_ += capacity;
  TrimFreeBuffers(lock);
}

void BlockCache::TrimFreeBuffers(Lock& lock) {
  while (!free_buffers_.empty() && used_ + free_bytes_ > opts_.budget_bytes) {
    free_buffers_.pop_back();
    free_bytes_ -= opts_.block_bytes;
  }
}

std::shared_ptr<const UniqueFd> BlockCache::DirectFd(const FileKey& key, const UniqueFd& fd) {
  const std::pair<uint64_t, uint64_t> id{key.dev, key.ino};
  std::lock_guard lock(direct_mu_);
  for (uint64_t dev : no_direct_devs_) {
    if (dev == key.dev) return nullptr;
  }
  if (auto it = direct_fds_.find(id); it != direct_fds_.end()) {
    direct_lru_.remove(id);
    direct_lru_.push_front(id);
    return it->second;
  }
  // Reopen the very inode `fd` refers to: no path is looked up, so confinement holds.
  const std::string self = "/proc/self/fd/" + std::to_string(fd.get());
  int direct = ::open(self.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC | O_NOFOLLOW);
  if (direct < 0 && errno == ELOOP) {
    // /proc/self/fd entries are magic links; O_NOFOLLOW refuses them on some kernels.
    direct = ::open(self.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  }
  if (direct < 0) {
    if (errno == EINVAL) no_direct_devs_.push_back(key.dev);  // no O_DIRECT on this device
    return nullptr;
  }
  struct stat st;
  if (::fstat(direct, &st) != 0 || static_cast<uint64_t>(st.st_dev) != key.dev ||
      static_cast<uint64_t>(st.st_ino) != key.ino) {
    ::close(direct);
    return nullptr;
  }
  auto shared = std::make_shared<const UniqueFd>(direct);
  direct_fds_.emplace(id, shared);
  direct_lru_.push_front(id);
  while (direct_fds_.size() > kMaxDirectFds) {
    direct_fds_.erase(direct_lru_.back());
    direct_lru_.pop_back();
  }
  return shared;
}

void BlockCache::NoDirectIo(uint64_t dev) {
  std::lock_guard lock(direct_mu_);
  no_direct_devs_.push_back(dev);
  for (auto it = direct_fds_.begin(); it != direct_fds_.end();) {
    if (it->first.first == dev) {
      direct_lru_.remove(it->first);
      it = direct_fds_.erase(it);
    } else {
      ++it;
    }
  }
}

void BlockCache::Detach(Lock& lock, Block* block) {
  std::shared_ptr<Block> keep;  // the index may hold the last reference
  if (block->in_index) {
    auto it = blocks_.find(block->id);
    if (it != blocks_.end() && it->second.get() == block) {
      keep = std::move(it->second);
      blocks_.erase(it);
    }
    block->in_index = false;
  }
  if (block->in_lru) {
    lru_.erase(block->lru_pos);
    block->in_lru = false;
  }
  // A loading block is freed by its loader, a pinned one by its last reader.
  if (block->state == Block::State::kReady && block->pins == 0 && block->charged > 0) {
    FreeBuffer(lock, block);
  }
}

void BlockCache::DropOtherVersions(Lock& lock, const FileKey& key) {
  const BlockId lo{FileKey{key.dev, key.ino, 0, std::numeric_limits<int64_t>::min()}, 0};
  const BlockId mine_lo{key, 0};
  const BlockId mine_hi{key, std::numeric_limits<uint64_t>::max()};
  std::vector<std::shared_ptr<Block>> stale;
  for (auto it = blocks_.lower_bound(lo); it != blocks_.end() && it->first < mine_lo; ++it) {
    stale.push_back(it->second);
  }
  for (auto it = blocks_.upper_bound(mine_hi);
       it != blocks_.end() && it->first.key.dev == key.dev && it->first.key.ino == key.ino; ++it) {
    stale.push_back(it->second);
  }
  for (const auto& b : stale) Detach(lock, b.get());
}

void BlockCache::Invalidate(uint64_t dev, uint64_t ino) {
  {
    std::lock_guard direct_lock(direct_mu_);
    if (direct_fds_.erase({dev, ino}) > 0) direct_lru_.remove({dev, ino});
  }
  Lock lock(mu_);
  const BlockId lo{FileKey{dev, ino, 0, std::numeric_limits<int64_t>::min()}, 0};
  std::vector<std::shared_ptr<Block>> drop;
  for (auto it = blocks_.lower_bound(lo);
       it != blocks_.end() && it->first.key.dev == dev && it->first.key.ino == ino; ++it) {
    drop.push_back(it->second);
  }
  for (const auto& b : drop) Detach(lock, b.get());
}

// ------------------------------------------------------------------------ blocks

std::shared_ptr<BlockCache::Block> BlockCache::NewLoadingBlock(Lock& lock, const BlockId& id,
                                                               uint64_t bytes, bool prefetch,
                                                               bool route) {
  auto block = std::make_shared<Block>();
  block->id = id;
  block->route = route;
  block->charged = bytes;
  block->prefetched = prefetch;
  block->data = TakeBuffer(lock, bytes);  // null: the loader allocates one
  blocks_.emplace(id, block);
  return block;
}

void BlockCache::Touch(Lock& lock, Block* block) {
  block->last_use = ++use_tick_;
  if (block->in_lru) lru_.splice(lru_.begin(), lru_, block->lru_pos);
}

void BlockCache::Unpin(Lock& lock, Block* block) {
  if (--block->pins > 0) return;
  if (!block->in_index) {
    if (block->state == Block::State::kReady && block->charged > 0) FreeBuffer(lock, block);
  } else if (memory_waiters_ > 0) {
    memory_cv_.notify_all();  // it is evictable now
  }
}

void BlockCache::Load(const std::shared_ptr<Block>& block, const UniqueFd& fd) {
  // `charged` and `id` do not change while the block is loading; only this thread loads it.
  const uint64_t want = block->charged;
  const uint64_t start = block->id.index * opts_.block_bytes;
  Buffer buf = std::move(block->data);
  if (!buf) {
    buf = MapBuffer(RoundUp(want, kDirectAlign));
  }
  Result<size_t> got = Status(Code::kNoSpace, "block cache: out of memory");
  bool direct = false;
  bool routed = false;
  if (buf && block->route && opts_.router != nullptr) {
    if (auto n = opts_.router->ReadElsewhere(block->id.key, start, {buf.get(), want})) {
      got = std::min<size_t>(*n, want);
      routed = true;
    }
  }
  if (buf && !routed) {
    std::shared_ptr<const UniqueFd> dfd;
    if (opts_.direct_io) dfd = DirectFd(block->id.key, fd);
    if (dfd) {
      // Aligned length into an aligned buffer; a file that grew since its key was taken
      // may return more than `want`, which is not ours to serve.
      got = dir_->PRead(dfd->get(), buf.get(), RoundUp(want, kDirectAlign),
                        static_cast<off_t>(start));
      if (!got.ok() && got.status().code() == Code::kInvalid) {
        NoDirectIo(block->id.key.dev);  // the file system took the open but not the read
      } else {
        direct = true;
      }
    }
    if (!direct) got = dir_->PRead(fd.get(), buf.get(), want, static_cast<off_t>(start));
    if (got.ok()) *got = std::min<size_t>(*got, want);
  }

  Lock lock(mu_);
  if (got.ok()) {
    block->data = std::move(buf);
    block->capacity = RoundUp(want, kDirectAlign);
    block->len = *got;
    block->state = Block::State::kReady;
    (routed ? stats_.routed_bytes_read : stats_.backing_bytes_read) += *got;
    if (direct) stats_.direct_bytes_read += *got;
    if (block->prefetched) stats_.prefetched_bytes += *got;
    if (block->in_index) {
      lru_.push_front(block.get());
      block->lru_pos = lru_.begin();
      block->in_lru = true;
      block->last_use = ++use_tick_;
      if (memory_waiters_ > 0) memory_cv_.notify_all();
    } else if (block->pins == 0) {
      FreeBuffer(lock, block.get());  // invalidated while in flight, and nobody waits
    }
  } else {
    // Not cached: every waiter of this flight gets the error, the next read retries.
    block->state = Block::State::kFailed;
    block->error = got.status();
    ++stats_.read_errors;
    Detach(lock, block.get());
    Release(lock, block->charged);
    block->charged = 0;
    KeepBuffer(lock, std::move(buf), RoundUp(want, kDirectAlign));
  }
  block->ready_cv.notify_all();
}

// ------------------------------------------------------------------------ reads

Result<size_t> BlockCache::Read(const FileKey& key, std::shared_ptr<const UniqueFd> fd, char* out,
                                size_t len, uint64_t offset, bool route) {
  if (len == 0 || offset >= key.size) return size_t{0};
  if (!fd || !fd->valid()) return Invalid("block cache: read without an open file");
  const uint64_t bs = opts_.block_bytes;
  const uint64_t end = offset + std::min<uint64_t>(len, key.size - offset);
  const uint64_t last = (end - 1) / bs;
  size_t copied = 0;
  bool dropped_old = false;

  for (uint64_t next = offset / bs; next <= last;) {
    std::vector<Pinned> batch;
    int loads = 0;
    {
      Lock lock(mu_);
      for (uint64_t j = next; j <= last && batch.size() < kMaxBatchBlocks;) {
        const BlockId id{key, j};
        if (auto it = blocks_.find(id); it != blocks_.end()) {
          Block* b = it->second.get();
          ++b->pins;
          if (b->state == Block::State::kReady) {
            ++stats_.hits;
            if (b->prefetched) {
              ++stats_.prefetch_hits;
              b->prefetched = false;
            }
            Touch(lock, b);
          } else {
            ++stats_.dedup_waits;
          }
          batch.push_back({j, it->second, false});
          ++j;
          continue;
        }
        if (loads == opts_.read_parallelism) break;
        const uint64_t size = BlockSize(key, j);
        if (!TryReserve(lock, size, 0)) {
          // Never wait for memory while holding pins or unissued reads: issue these first.
          if (!batch.empty()) break;
          WaitReserve(lock, size);
          if (blocks_.count(id) > 0) {  // appeared while the lock was dropped
            Release(lock, size);
            continue;
          }
        }
        if (!dropped_old) {
          DropOtherVersions(lock, key);
          dropped_old = true;
        }
        auto b = NewLoadingBlock(lock, id, size, /*prefetch=*/false, route);
        ++b->pins;
        ++stats_.misses;
        ++loads;
        batch.push_back({j, std::move(b), true});
        ++j;
      }
    }

    // Issue this batch's backing reads in parallel: helpers for all but the first.
    {
      std::vector<std::jthread> helpers;
      const Pinned* first_load = nullptr;
      for (const Pinned& p : batch) {
        if (!p.load) continue;
        if (first_load == nullptr) {
          first_load = &p;
          continue;
        }
        try {
          helpers.emplace_back([this, b = p.block, fd] { Load(b, *fd); });
        } catch (const std::system_error&) {
          Load(p.block, *fd);  // no thread to spare: read it here
        }
      }
      if (first_load != nullptr) Load(first_load->block, *fd);
    }  // joins the helpers

    Status error;
    bool short_block = false;
    const size_t copied_before = copied;
    for (const Pinned& p : batch) {
      Block* b = p.block.get();
      {
        Lock lock(mu_);
        b->ready_cv.wait(lock, [b] { return b->state != Block::State::kLoading; });
        if (b->state == Block::State::kFailed && error.ok()) error = b->error;
      }
      if (!error.ok() || short_block) continue;
      // Pinned and ready: `data` and `len` are fixed until the pin is dropped.
      const uint64_t start = p.index * bs;
      const uint64_t from = std::max(offset, start);
      const uint64_t to = std::min(end, start + b->len);
      if (to > from) {
        std::memcpy(out + (from - offset), b->data.get() + (from - start), to - from);
        copied += to - from;
      }
      // The file is shorter than its key says: stop at the bytes that exist.
      if (b->len < BlockSize(key, p.index)) short_block = true;
    }
    {
      Lock lock(mu_);
      for (const Pinned& p : batch) Unpin(lock, p.block.get());
      stats_.bytes_served += copied - copied_before;
    }
    if (!error.ok()) return error;
    if (short_block) break;
    next += batch.size();
  }
  return copied;
}

// ------------------------------------------------------------------------ prefetch

void BlockCache::Prefetch(const FileKey& key, std::shared_ptr<const UniqueFd> fd, uint64_t offset,
                          uint64_t len) {
  if (len == 0 || offset >= key.size || !fd || !fd->valid()) return;
  const uint64_t end = offset + std::min(len, key.size - offset);
  Lock lock(mu_);
  if (stop_ || opts_.prefetch_threads == 0 || queue_.size() >= kMaxQueuedPrefetches) {
    ++stats_.prefetch_dropped;
    return;
  }
  queue_.push_back(PrefetchRequest{key, std::move(fd), offset / opts_.block_bytes,
                                   (end - 1) / opts_.block_bytes, ++use_tick_});
  lock.unlock();
  queue_cv_.notify_all();  // several threads may share one long request
}

void BlockCache::PrefetchLoop() {
  Lock lock(mu_);
  while (true) {
    queue_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    PrefetchRequest& req = queue_.front();
    const BlockId id{req.key, req.next++};
    const uint64_t tick = req.tick;
    std::shared_ptr<const UniqueFd> fd = req.fd;
    if (req.next > req.last) queue_.pop_front();
    if (blocks_.count(id) > 0) continue;  // cached or in flight already
    const uint64_t size = BlockSize(id.key, id.index);
    if (!TryReserve(lock, size, tick)) {
      // The cache is full of blocks in use: drop the rest of this request.
      if (!queue_.empty() && queue_.front().tick == tick) queue_.pop_front();
      ++stats_.prefetch_dropped;
      continue;
    }
    DropOtherVersions(lock, id.key);
    std::shared_ptr<Block> block = NewLoadingBlock(lock, id, size, /*prefetch=*/true);
    lock.unlock();
    Load(block, *fd);
    block.reset();
    fd.reset();
    lock.lock();
  }
}

BlockCacheStats BlockCache::Stats() const {
  Lock lock(mu_);
  BlockCacheStats s = stats_;
  s.used_bytes = used_;
  s.free_buffer_bytes = free_bytes_;
  s.budget_bytes = opts_.budget_bytes;
  return s;
}

}  // namespace ckptfs::store
