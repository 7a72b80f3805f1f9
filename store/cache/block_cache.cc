#include "store/cache/block_cache.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>

namespace ckptfs::store {
namespace {

// Prefetch requests waiting for a thread; more are dropped. A request is one range (a
// DCP item, say), so this bounds the queue, not the bytes it names.
constexpr size_t kMaxQueuedPrefetches = 4096;
// Blocks one Read() pins at a time; a longer read goes on in further batches.
constexpr size_t kMaxBatchBlocks = 256;

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

}  // namespace

bool BlockCache::KeyLess::Less(const BlockId& a, uint64_t ai, const BlockId& b, uint64_t bi) {
  if (int c = a.path.compare(b.path); c != 0) return c < 0;
  return std::tie(a.size, a.mtime_ns, ai) < std::tie(b.size, b.mtime_ns, bi);
}

// Every field but `ready_cv` is guarded by the cache's mu_; a pinned ready block's `data`
// and `len` do not change until the pin is dropped, so readers copy out without the lock.
struct BlockCache::Block {
  enum class State { kLoading, kReady, kFailed };

  BlockKey key;
  State state = State::kLoading;
  Buffer data;             // set once ready; freed under mu_ before `charged` is released
  uint64_t want = 0;       // the block's bytes in its file version
  uint64_t capacity = 0;   // bytes allocated for `data` (`want` rounded up for O_DIRECT)
  uint64_t charged = 0;    // bytes reserved for this block in used_; 0 once released
  uint64_t len = 0;        // valid bytes once ready (short only if the file shrank)
  Status error;            // once failed
  int pins = 0;            // Read() calls that will copy from it (or wait to)
  bool in_index = true;    // false once evicted, invalidated or failed
  bool in_lru = false;
  bool prefetched = false;  // read by prefetch, not yet used by a demand read
  uint64_t last_use = 0;
  std::list<Block*>::iterator lru_pos;
  std::condition_variable ready_cv;  // state left kLoading
};

BlockCache::BlockCache(BlockSource* source, const BlockCacheOptions& options)
    : source_(source), opts_(options) {
  MutexLock lock(&mu_);
  stats_.budget_bytes = options.budget_bytes;
}

Result<std::unique_ptr<BlockCache>> BlockCache::Create(BlockSource* source,
                                                       const BlockCacheOptions& options) {
  if (source == nullptr) return Invalid("block cache: no block source");
  if (options.block_bytes == 0) return Invalid("block cache: block size must be positive");
  if (options.budget_bytes < options.block_bytes) {
    return Invalid("block cache: budget " + std::to_string(options.budget_bytes) +
                   " is smaller than one block (" + std::to_string(options.block_bytes) + ")");
  }
  if (options.prefetch_threads < 0) return Invalid("block cache: negative prefetch threads");
  if (options.read_parallelism < 1) return Invalid("block cache: read parallelism must be >= 1");
  if (options.block_bytes % kDirectIoAlign != 0) {
    return Invalid("block cache: block size must be a multiple of " +
                   std::to_string(kDirectIoAlign));
  }
  std::unique_ptr<BlockCache> cache(new BlockCache(source, options));
  CKPT_ASSIGN_OR_RETURN(
      cache->prefetcher_,
      Prefetcher::Create(options.prefetch_threads, kMaxQueuedPrefetches,
                         [c = cache.get()](const BlockId& id, uint64_t index, uint64_t tick) {
                           return c->PrefetchBlock(id, index, tick);
                         }));
  return cache;
}

BlockCache::~BlockCache() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  prefetcher_.reset();  // drops the queue, joins
}

uint64_t BlockCache::BlockSize(const BlockId& id, uint64_t index) const {
  uint64_t start = index * opts_.block_bytes;
  if (start >= id.size) return 0;
  return std::min(opts_.block_bytes, id.size - start);
}

uint64_t BlockCache::Charge(uint64_t bytes) { return RoundUp(bytes, kDirectIoAlign); }

uint64_t BlockCache::IndexBytes(const BlockKey& key) {
  // The Block with its shared_ptr control block, the map's node with its key, the LRU
  // list's node, the path's two heap copies (past the small-string buffer) and the
  // allocator's headers (an estimate from the types' sizes, not a measurement).
  const uint64_t path = key.file.path.size() > 15 ? 2 * (key.file.path.size() + 1) : 0;
  return sizeof(Block) + sizeof(BlockKey) + sizeof(std::shared_ptr<Block>) + path + 96;
}

// ------------------------------------------------------------------------ memory

bool BlockCache::TryReserve(uint64_t bytes, uint64_t tick) {
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
    Detach(victim);
  }
  used_ += bytes;
  stats_.peak_used_bytes = std::max(stats_.peak_used_bytes, used_);
  return true;
}

void BlockCache::WaitReserve(MutexLock& lock, uint64_t bytes) {
  ++memory_waiters_;
  while (!TryReserve(bytes, 0)) memory_cv_.wait(lock.native());
  --memory_waiters_;
}

void BlockCache::Release(uint64_t bytes) {
  used_ -= bytes;
  if (memory_waiters_ > 0) memory_cv_.notify_all();
}

void BlockCache::FreeBuffer(Block* block) {
  const uint64_t charged = block->charged;
  block->charged = 0;
  Release(charged);
  KeepBuffer(std::move(block->data), block->capacity);
}

void BlockCache::UnmapDeleter::operator()(char* p) const { ::munmap(p, bytes); }

BlockCache::Buffer BlockCache::MapBuffer(uint64_t bytes) {
  // MAP_POPULATE: the block is about to be written whole, so its pages are made in the
  // mmap call itself rather than by a fault per page (PrefaultForWrite in common/heap.h).
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) return Buffer(nullptr, UnmapDeleter{0});
  return Buffer(static_cast<char*>(p), UnmapDeleter{bytes});
}

BlockCache::Buffer BlockCache::TakeBuffer(uint64_t bytes) {
  Buffer b;
  if (RoundUp(bytes, kDirectIoAlign) == opts_.block_bytes && !free_buffers_.empty()) {
    b = std::move(free_buffers_.back());
    free_buffers_.pop_back();
    free_bytes_ -= opts_.block_bytes;
  }
  // The reservation just made for `bytes` may have left held + free over the budget.
  TrimFreeBuffers();
  return b;
}

void BlockCache::KeepBuffer(Buffer buffer, uint64_t capacity) {
  // `used_` still counts this buffer, so keeping it leaves held + free where it was.
  if (!buffer || capacity != opts_.block_bytes || stop_) return;
  free_buffers_.push_back(std::move(buffer));
  free_bytes_ += capacity;
  TrimFreeBuffers();
}

void BlockCache::TrimFreeBuffers() {
  while (!free_buffers_.empty() && used_ + free_bytes_ > opts_.budget_bytes) {
    free_buffers_.pop_back();
    free_bytes_ -= opts_.block_bytes;
  }
}

void BlockCache::Detach(Block* block) {
  std::shared_ptr<Block> keep;  // the index may hold the last reference
  if (block->in_index) {
    auto it = blocks_.find(KeyRef{&block->key.file, block->key.index});
    if (it != blocks_.end() && it->second.get() == block) {
      keep = std::move(it->second);
      blocks_.erase(it);
      index_bytes_ -= IndexBytes(block->key);
    }
    block->in_index = false;
  }
  if (block->in_lru) {
    lru_.erase(block->lru_pos);
    block->in_lru = false;
  }
  // A loading block is freed by its loader, a pinned one by its last reader.
  if (block->state == Block::State::kReady && block->pins == 0 && block->charged > 0) {
    FreeBuffer(block);
  }
}

void BlockCache::DropVersions(const std::string& path, const BlockId* keep) {
  const BlockId first{path, 0, INT64_MIN};
  std::vector<std::shared_ptr<Block>> drop;
  for (auto it = blocks_.lower_bound(KeyRef{&first, 0});
       it != blocks_.end() && it->first.file.path == path; ++it) {
    if (keep != nullptr && it->first.file == *keep) continue;
    drop.push_back(it->second);
  }
  for (const auto& b : drop) Detach(b.get());
}

void BlockCache::Invalidate(const std::string& path) {
  MutexLock lock(&mu_);
  DropVersions(path, nullptr);
}

// ------------------------------------------------------------------------ blocks

std::shared_ptr<BlockCache::Block> BlockCache::NewLoadingBlock(const BlockId& file,
                                                               uint64_t index, uint64_t bytes,
                                                               bool prefetch) {
  auto block = std::make_shared<Block>();
  block->key = BlockKey{file, index};
  block->want = bytes;
  block->charged = Charge(bytes);
  block->prefetched = prefetch;
  block->data = TakeBuffer(bytes);  // null: the loader allocates one
  blocks_.emplace(block->key, block);
  index_bytes_ += IndexBytes(block->key);
  return block;
}

void BlockCache::Touch(Block* block) {
  block->last_use = ++use_tick_;
  if (block->in_lru) lru_.splice(lru_.begin(), lru_, block->lru_pos);
}

void BlockCache::Unpin(Block* block) {
  if (--block->pins > 0) return;
  if (!block->in_index) {
    if (block->state == Block::State::kReady && block->charged > 0) FreeBuffer(block);
  } else if (memory_waiters_ > 0) {
    memory_cv_.notify_all();  // it is evictable now
  }
}

void BlockCache::Load(const std::shared_ptr<Block>& block) {
  // `key`, `charged` and `data` are this loader's until the block leaves kLoading: only
  // this thread loads it, and nobody else touches them before.
  uint64_t want;
  Buffer buf;
  {
    MutexLock lock(&mu_);
    want = block->want;
    buf = std::move(block->data);
  }
  const BlockKey& key = block->key;
  const uint64_t start = key.index * opts_.block_bytes;
  const uint64_t capacity = RoundUp(want, kDirectIoAlign);
  if (!buf) buf = MapBuffer(capacity);
  Result<size_t> got = Status(Code::kNoSpace, "block cache: out of memory");
  if (buf) {
    // The whole aligned buffer, so the source may read it with O_DIRECT; it returns no
    // more than the file version holds.
    auto read = source_->ReadBlock(key.file, start, std::span<char>(buf.get(), capacity));
    if (read.ok()) {
      got = std::min<size_t>(read->bytes, want);
    } else {
      got = read.status();
    }
  }

  MutexLock lock(&mu_);
  if (got.ok()) {
    block->data = std::move(buf);
    block->capacity = capacity;
    block->len = *got;
    block->state = Block::State::kReady;
    stats_.backing_bytes_read += *got;
    if (block->prefetched) stats_.prefetched_bytes += *got;
    if (block->in_index) {
      lru_.push_front(block.get());
      block->lru_pos = lru_.begin();
      block->in_lru = true;
      block->last_use = ++use_tick_;
      if (memory_waiters_ > 0) memory_cv_.notify_all();
    } else if (block->pins == 0) {
      FreeBuffer(block.get());  // invalidated while in flight, and nobody waits
    }
  } else {
    // Not cached: every waiter of this flight gets the error, the next read retries.
    block->state = Block::State::kFailed;
    block->error = got.status();
    ++stats_.read_errors;
    Detach(block.get());
    Release(block->charged);
    block->charged = 0;
    KeepBuffer(std::move(buf), capacity);
  }
  block->ready_cv.notify_all();
}

// ------------------------------------------------------------------------ reads

void BlockCache::PinAndLoad(const BlockId& id, uint64_t next, uint64_t last, bool* dropped_old,
                            std::vector<Pinned>* out, Status* error) {
  std::vector<Pinned>& batch = *out;
  int loads = 0;
  {
    MutexLock lock(&mu_);
    for (uint64_t j = next; j <= last && batch.size() < kMaxBatchBlocks;) {
      if (auto it = blocks_.find(KeyRef{&id, j}); it != blocks_.end()) {
        Block* b = it->second.get();
        ++b->pins;
        if (b->state == Block::State::kReady) {
          ++stats_.hits;
          if (b->prefetched) {
            ++stats_.prefetch_hits;
            b->prefetched = false;
          }
          Touch(b);
        } else {
          ++stats_.dedup_waits;
        }
        batch.push_back({j, it->second, false});
        ++j;
        continue;
      }
      if (loads == opts_.read_parallelism) break;
      const uint64_t size = BlockSize(id, j);
      if (!TryReserve(Charge(size), 0)) {
        // Never wait for memory while holding pins or unissued reads: issue these first.
        if (!batch.empty()) break;
        WaitReserve(lock, Charge(size));
        if (blocks_.count(KeyRef{&id, j}) > 0) {  // appeared while the lock was dropped
          Release(Charge(size));
          continue;
        }
      }
      if (!*dropped_old) {
        DropVersions(id.path, &id);
        *dropped_old = true;
      }
      auto b = NewLoadingBlock(id, j, size, /*prefetch=*/false);
      ++b->pins;
      ++stats_.misses;
      ++loads;
      batch.push_back({j, std::move(b), true});
      ++j;
    }
  }

  // Issue this batch's source reads in parallel: helpers for all but the first.
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
        helpers.emplace_back([this, b = p.block] { Load(b); });
      } catch (const std::system_error&) {
        Load(p.block);  // no thread to spare: read it here
      }
    }
    if (first_load != nullptr) Load(first_load->block);
  }  // joins the helpers

  MutexLock lock(&mu_);
  for (const Pinned& p : batch) {
    Block* b = p.block.get();
    while (b->state == Block::State::kLoading) b->ready_cv.wait(lock.native());
    if (b->state == Block::State::kFailed && error->ok()) *error = b->error;
  }
}

void BlockCache::UnpinAll(const std::vector<Pinned>& batch, uint64_t served) {
  MutexLock lock(&mu_);
  for (const Pinned& p : batch) Unpin(p.block.get());
  stats_.bytes_served += served;
}

Result<size_t> BlockCache::Read(const BlockId& id, char* out, size_t len, uint64_t offset) {
  if (len == 0 || offset >= id.size) return size_t{0};
  const uint64_t bs = opts_.block_bytes;
  const uint64_t end = offset + std::min<uint64_t>(len, id.size - offset);
  const uint64_t last = (end - 1) / bs;
  size_t copied = 0;
  bool dropped_old = false;

  for (uint64_t next = offset / bs; next <= last;) {
    std::vector<Pinned> batch;
    Status error;
    PinAndLoad(id, next, last, &dropped_old, &batch, &error);
    bool short_block = false;
    const size_t copied_before = copied;
    for (const Pinned& p : batch) {
      if (!error.ok() || short_block) break;
      // Pinned and ready: `data` and `len` are fixed until the pin is dropped.
      Block* b = p.block.get();
      const uint64_t start = p.index * bs;
      const uint64_t from = std::max(offset, start);
      const uint64_t to = std::min(end, start + b->len);
      if (to > from) {
        std::memcpy(out + (from - offset), b->data.get() + (from - start), to - from);
        copied += to - from;
      }
      // The file is shorter than its id says: stop at the bytes that exist.
      if (b->len < BlockSize(id, p.index)) short_block = true;
    }
    UnpinAll(batch, copied - copied_before);
    if (!error.ok()) return error;
    if (short_block) break;
    next += batch.size();
  }
  return copied;
}

Result<std::optional<size_t>> BlockCache::ReadInPlace(const BlockId& id, size_t len,
                                                      uint64_t offset, const InPlaceUse& use) {
  if (len == 0 || offset >= id.size) {
    use({});
    return std::optional<size_t>(0);
  }
  const uint64_t bs = opts_.block_bytes;
  const uint64_t end = offset + std::min<uint64_t>(len, id.size - offset);
  const uint64_t first = offset / bs;
  const uint64_t last = (end - 1) / bs;
  if (last - first + 1 > static_cast<uint64_t>(opts_.read_parallelism)) {
    return std::optional<size_t>();
  }
  bool dropped_old = false;
  std::vector<Pinned> batch;
  Status error;
  PinAndLoad(id, first, last, &dropped_old, &batch, &error);
  if (!error.ok() || batch.size() != last - first + 1) {
    UnpinAll(batch, 0);
    if (!error.ok()) return error;
    return std::optional<size_t>();  // could not pin the whole range at once (memory)
  }
  std::vector<struct iovec> iov;
  iov.reserve(batch.size());
  size_t total = 0;
  for (const Pinned& p : batch) {
    Block* b = p.block.get();  // pinned and ready: `data` and `len` are fixed
    const uint64_t start = p.index * bs;
    const uint64_t from = std::max(offset, start);
    const uint64_t to = std::min(end, start + b->len);
    if (to > from) {
      iov.push_back({b->data.get() + (from - start), static_cast<size_t>(to - from)});
      total += to - from;
    }
    if (b->len < BlockSize(id, p.index)) break;  // the file shrank: stop there
  }
  use(iov);
  UnpinAll(batch, total);
  return std::optional<size_t>(total);
}

Result<BlockRead> BlockCache::ReadBlock(const BlockId& id, uint64_t offset, std::span<char> out) {
  if (offset > id.size) {
    return Invalid("read at " + std::to_string(offset) + " past the end of " + id.path + " (" +
                   std::to_string(id.size) + " bytes)");
  }
  CKPT_ASSIGN_OR_RETURN(size_t n, Read(id, out.data(), out.size(), offset));
  BlockRead read;
  read.bytes = n;
  return read;
}

// ------------------------------------------------------------------------ prefetch

void BlockCache::Prefetch(const BlockId& id, uint64_t offset, uint64_t len, bool urgent) {
  if (len == 0 || offset >= id.size) return;
  const uint64_t end = offset + std::min(len, id.size - offset);
  uint64_t tick;
  {
    MutexLock lock(&mu_);
    if (stop_) return;
    tick = ++use_tick_;
  }
  prefetcher_->Enqueue(
      PrefetchRequest{id, offset / opts_.block_bytes, (end - 1) / opts_.block_bytes, tick},
      urgent);
}

bool BlockCache::PrefetchBlock(const BlockId& id, uint64_t index, uint64_t tick) {
  std::shared_ptr<Block> block;
  {
    MutexLock lock(&mu_);
    if (stop_ || blocks_.count(KeyRef{&id, index}) > 0) return true;  // cached or in flight
    const uint64_t size = BlockSize(id, index);
    if (size == 0) return true;
    if (!TryReserve(Charge(size), tick)) return false;
    DropVersions(id.path, &id);
    block = NewLoadingBlock(id, index, size, /*prefetch=*/true);
  }
  Load(block);
  return true;
}

BlockCacheStats BlockCache::Stats() const {
  BlockCacheStats s;
  {
    MutexLock lock(&mu_);
    s = stats_;
    s.used_bytes = used_;
    s.free_buffer_bytes = free_bytes_;
    s.index_bytes = index_bytes_;
  }
  s.budget_bytes = opts_.budget_bytes;
  if (prefetcher_) s.prefetch_dropped += prefetcher_->dropped();
  return s;
}

}  // namespace ckptfs::store
