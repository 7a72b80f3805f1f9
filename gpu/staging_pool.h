// StagingPool: a fixed pool of equal-sized staging chunks.
//
// The memory is pinned: cudaHostAlloc when a CUDA runtime and device are present, allocated
// whole at Create(); otherwise page-locked anonymous memory (mlock; transparent hugepages
// only when asked: StagingOptions::hugepages). Host memory is reserved whole at Create() but
// each chunk is pinned on its first Acquire(), so a daemon that only reads holds none of it,
// and it may be given back after an idle period (StagingOptions::release_idle).
// Locking is best effort; an mlock failure is logged once and the pool still works.
// The pool never reserves after Create() and never pins more than its chunks, so it never
// holds more than its budget (G6).
//
// Lending (issue 42, common/chunk_lender.h): a flushed chunk may leave staging for good as a
// retained block. A spare chunk of the same size takes its place at once (a spare kept from an
// earlier loan, else newly allocated the way the pool was), so the chunks staging can use never
// fall below total_chunks() (G6); the lent chunk comes back as a spare when released. Lent
// and spare memory together stay within SetLendLimit() (0, the default: nothing is lent).
//
// Thread-safe. Acquire() blocks while every chunk is in use (backpressure).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/chunk_lender.h"
#include "common/mutex.h"
#include "common/status.h"

namespace ckptfs::gpu {

class StagingPool;

// One chunk of staging memory. Returned to its pool when destroyed. Move-only.
class ChunkBuffer {
 public:
  ChunkBuffer() = default;
  ~ChunkBuffer();
  ChunkBuffer(ChunkBuffer&& other) noexcept;
  ChunkBuffer& operator=(ChunkBuffer&& other) noexcept;
  ChunkBuffer(const ChunkBuffer&) = delete;
  ChunkBuffer& operator=(const ChunkBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  friend class StagingPool;
  ChunkBuffer(StagingPool* pool, uint8_t* data, size_t capacity)
      : pool_(pool), data_(data), capacity_(capacity) {}
  void Release();

  StagingPool* pool_ = nullptr;  // not owned; the pool outlives its chunks
  uint8_t* data_ = nullptr;
  size_t capacity_ = 0;
};

struct StagingOptions {
  size_t total_bytes = size_t{1} << 30;
  size_t chunk_bytes = size_t{4} << 20;
  // "auto": CUDA pinned memory when a device is present, else locked host memory.
  // "host": always locked host memory. "cuda": fail if CUDA is unavailable.
  std::string backend = "auto";
  // Host memory: back the pool with transparent hugepages (MADV_HUGEPAGE), or keep them
  // off (MADV_NOHUGEPAGE, whatever the system default). Off by default: on the VMs this
  // was measured on (Linux 6.1 guests), the flush threads' pwrite() out of a hugepage
  // pool into the page cache ran at half the speed (1 GiB published in 4.8 s against
  // 2.3 s, medians of 6); copying into the pool was no faster either way.
  bool hugepages = false;
  // Host memory: once no chunk has been out for this long, the pinned chunks are unlocked
  // and given back to the system, to be pinned again on their next Acquire(). Zero (the
  // default) keeps a chunk pinned from its first Acquire() until the pool is destroyed.
  // CUDA memory is always kept.
  std::chrono::milliseconds release_idle{0};
};

// The owner of the staged bytes (fs::Namespace): told when a writer is about to wait for
// a free chunk, so that it seals partly filled chunks of idle files and lets them flush.
class StagingPressureListener {
 public:
  // On the waiting writer's thread, no pool lock held; must not wait for a chunk itself.
  virtual void RelieveStagingPressure() = 0;

 protected:
  ~StagingPressureListener() = default;
};

// What this process's memory cgroup and its ancestors can still charge: the least of
// limit - (usage - page cache) over the levels that have a limit (the page cache is
// reclaimed for pinned memory); nullopt when none has one or their files cannot be read.
// `self_cgroup` is the text of /proc/self/cgroup; `root` is where the cgroup file systems
// are mounted (/sys/fs/cgroup): cgroup v1's memory hierarchy under root/memory, else the
// v2 hierarchy at root (or root/unified).
std::optional<uint64_t> MemoryCgroupHeadroom(std::string_view self_cgroup,
                                             const std::string& root);

class StagingPool final : public ChunkLender {
 public:
  // Allocates (CUDA) or reserves (host) the whole pool. Fails if total_bytes < chunk_bytes,
  // if memory is short, or if a host pool would not fit the memory cgroup's limit: its
  // chunks are pinned later, and pinning past that limit would get the daemon OOM-killed.
  static Result<std::unique_ptr<StagingPool>> Create(const StagingOptions& options);
  ~StagingPool();  // All ChunkBuffers, lent ones too, must have been returned.
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // Blocks until a chunk is free. Before blocking it tells the pressure listener once, so
  // that the owner can seal partly filled chunks and let them flush. Empty only when the
  // chunk's memory could not be pinned (the system is out of memory); `error` then says why.
  ChunkBuffer Acquire(Status* error = nullptr);
  // Returns an empty ChunkBuffer if none frees up within `timeout`, or, with `error` set,
  // when the chunk's memory could not be pinned.
  ChunkBuffer TryAcquireFor(std::chrono::milliseconds timeout, Status* error = nullptr);
  // Told (without pool locks held) when Acquire() would block. Borrowed: must outlive every
  // Acquire(); null removes it.
  void SetPressureListener(StagingPressureListener* listener) EXCLUDES(mu_);

  size_t chunk_bytes() const { return chunk_bytes_; }
  size_t total_chunks() const { return total_chunks_; }
  size_t limit_bytes() const { return chunk_bytes_ * total_chunks_; }
  size_t used_bytes() const;
  // Memory pinned now: the chunks out and those kept pinned for the next Acquire().
  size_t resident_bytes() const {
    return resident_chunks_.load(std::memory_order_relaxed) * chunk_bytes_;
  }
  // "cuda-pinned", "host-locked" or "host" (locking failed, or will: RLIMIT_MEMLOCK).
  std::string backend() const;
  // Lending (see above). At most `bytes` of lent and spare memory together; lowering it
  // lends no more until what is out comes back under it.
  void SetLendLimit(size_t bytes) EXCLUDES(mu_);
  bool Lend(const void* chunk) override EXCLUDES(mu_);
  uint64_t spare_bytes() const override EXCLUDES(mu_);
  // Host memory: spares are unlocked and their pages given back (the address stays, pinned
  // again by the loan that takes it). CUDA memory: spares allocated for a loan are freed;
  // chunks of the pool's own allocation cannot be and stay.
  void TrimSpares(uint64_t keep_bytes) override EXCLUDES(mu_);
  size_t lent_bytes() const EXCLUDES(mu_);
  // lent_bytes() + spare_bytes() read at one instant (a chunk coming back moves from lent
  // to spare: two separate reads can count it twice).
  size_t lent_and_spare_bytes() const EXCLUDES(mu_);
  uint64_t lends() const { return lends_.load(std::memory_order_relaxed); }
  // Loans whose spare had to be allocated (or pinned again after a trim).
  uint64_t lend_allocs() const { return lend_allocs_.load(std::memory_order_relaxed); }

  // How many Acquire() calls had to wait.
  uint64_t waits() const { return waits_.load(std::memory_order_relaxed); }
  // Chunks pinned on an Acquire() (each first use, and each use after a release), and
  // chunks given back after release_idle.
  uint64_t pins() const { return pins_.load(std::memory_order_relaxed); }
  uint64_t releases() const { return releases_.load(std::memory_order_relaxed); }

 private:
  friend class ChunkBuffer;
  StagingPool() = default;
  ChunkBuffer AcquireUntil(const std::chrono::steady_clock::time_point* deadline,
                           Status* error) EXCLUDES(mu_);
  size_t FreeLocked() const REQUIRES(mu_) { return free_pinned_.size() + free_unpinned_.size(); }
  // Outside mu_, on a chunk taken from free_unpinned_: locks (or populates) its memory.
  Status Pin(uint8_t* data);
  // Locks (or populates) one chunk's memory; Pin() without the counters.
  Status LockChunk(uint8_t* data);
  // Whether `data` is a chunk of this pool: of the first allocation, or a spare added later.
  bool IsChunkLocked(const uint8_t* data) const REQUIRES(mu_);
  // The release_idle thread: gives pinned chunks back while no chunk is out.
  void ReleaseIdleChunks() EXCLUDES(mu_);
  void Return(uint8_t* data) EXCLUDES(mu_);

  size_t chunk_bytes_ = 0;
  size_t total_chunks_ = 0;
  uint8_t* base_ = nullptr;
  bool cuda_ = false;                  // cudaHostAlloc'd whole: every chunk pinned always
  bool hugepages_ = false;
  std::atomic<bool> lock_memory_{false};  // host: mlock chunks as they are pinned
  std::chrono::milliseconds release_idle_{0};
  std::function<void()> free_memory_;  // releases base_ the way it was allocated

  mutable Mutex mu_;
  std::condition_variable cv_;
  // Free chunks, pinned (taken first, last returned first) and not (lowest first).
  std::vector<uint8_t*> free_pinned_ GUARDED_BY(mu_);
  std::vector<uint8_t*> free_unpinned_ GUARDED_BY(mu_);
  size_t releasing_ GUARDED_BY(mu_) = 0;  // taken by the release thread, being unpinned
  std::chrono::steady_clock::time_point last_return_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  std::condition_variable release_cv_;
  std::thread releaser_;
  StagingPressureListener* pressure_ GUARDED_BY(mu_) = nullptr;
  // Lending. Every chunk address is in exactly one place: staging (free or out), lent_,
  // spares_ (pinned) or bare_spares_ (host: address only, pages given back).
  size_t lend_limit_chunks_ GUARDED_BY(mu_) = 0;
  size_t allocating_ GUARDED_BY(mu_) = 0;  // spares being allocated or pinned for a loan
  std::unordered_set<const uint8_t*> lent_ GUARDED_BY(mu_);
  std::vector<uint8_t*> spares_ GUARDED_BY(mu_);
  std::vector<uint8_t*> bare_spares_ GUARDED_BY(mu_);
  // Chunks allocated after Create() for loans, with how to free each.
  std::unordered_map<const uint8_t*, std::function<void()>> extra_ GUARDED_BY(mu_);
  std::atomic<uint64_t> lends_{0};
  std::atomic<uint64_t> lend_allocs_{0};
  std::atomic<uint64_t> waits_{0};
  std::atomic<size_t> resident_chunks_{0};
  std::atomic<uint64_t> pins_{0};
  std::atomic<uint64_t> releases_{0};
};

}  // namespace ckptfs::gpu
