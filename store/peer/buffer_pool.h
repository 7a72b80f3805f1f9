// BufferPool: reuses the large buffers that block requests and replies pass through.
//
// Without it every 1 MiB block was a fresh malloc that glibc served with mmap (or trimmed
// back to the kernel), so each block paid page faults and page clearing: on the 2-core test
// machine that halved throughput with 4 concurrent fetches (docs/PEERS.md). Buffers of at
// least kMinPooledBytes are rounded up to a power of two and kept on free lists up to
// `max_cached_bytes` in all; smaller ones are plain allocations.
//
// Thread-safe. A Buffer keeps its pool alive (shared_ptr), so buffers may outlive the object
// that made the pool, e.g. a reply still in flight when a client is destroyed.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "common/heap.h"
#include "common/mutex.h"

namespace ckptfs::store::peer {

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  static constexpr size_t kMinPooledBytes = 64 << 10;

  class Buffer {
   public:
    Buffer() = default;
    Buffer(Buffer&&) noexcept = default;
    Buffer& operator=(Buffer&& other) noexcept {
      Release();
      data_ = std::move(other.data_);
      capacity_ = other.capacity_;
      pool_ = std::move(other.pool_);
      return *this;
    }
    ~Buffer() { Release(); }
    char* data() const { return data_.get(); }
    size_t capacity() const { return capacity_; }

   private:
    friend class BufferPool;
    void Release() {
      if (pool_ && data_) pool_->Give(std::move(data_), capacity_);
      pool_.reset();
    }
    std::unique_ptr<char[]> data_;
    size_t capacity_ = 0;
    std::shared_ptr<BufferPool> pool_;  // null: not pooled
  };

  static std::shared_ptr<BufferPool> Create(uint64_t max_cached_bytes) {
    return std::shared_ptr<BufferPool>(new BufferPool(max_cached_bytes));
  }

  // A buffer of at least `n` bytes (at least 1), contents undefined.
  Buffer Take(size_t n) EXCLUDES(mu_) {
    Buffer b;
    if (n < kMinPooledBytes) {
      b.capacity_ = n == 0 ? 1 : n;
      b.data_ = std::make_unique_for_overwrite<char[]>(b.capacity_);
      return b;
    }
    b.capacity_ = std::bit_ceil(n);
    b.pool_ = shared_from_this();
    {
      MutexLock lock(&mu_);
      auto it = free_.find(b.capacity_);
      if (it != free_.end() && !it->second.empty()) {
        b.data_ = std::move(it->second.back());
        it->second.pop_back();
        cached_bytes_ -= b.capacity_;
        return b;
      }
    }
    b.data_ = std::make_unique_for_overwrite<char[]>(b.capacity_);
    PrefaultForWrite(b.data_.get(), n);  // about to be written: one call, not a fault a page
    return b;
  }

  uint64_t cached_bytes() const EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return cached_bytes_;
  }

 private:
  explicit BufferPool(uint64_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}

  void Give(std::unique_ptr<char[]> data, size_t capacity) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (cached_bytes_ + capacity > max_cached_bytes_) return;  // freed on return
    free_[capacity].push_back(std::move(data));
    cached_bytes_ += capacity;
  }

  const uint64_t max_cached_bytes_;
  mutable Mutex mu_;
  std::map<size_t, std::vector<std::unique_ptr<char[]>>> free_ GUARDED_BY(mu_);
  uint64_t cached_bytes_ GUARDED_BY(mu_) = 0;
};

}  // namespace ckptfs::store::peer
