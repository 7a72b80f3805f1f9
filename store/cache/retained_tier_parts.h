// The parts of RetainedTier (store/cache/retained_tier.h) its two source files share:
// retained_tier.cc (capture, publish, serve, budget) and retained_tier_report.cc (stats,
// listings). Private to them; nothing else includes it.
#pragma once

#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "store/cache/retained_tier.h"

namespace ckptfs::store {

// A staging chunk the pool lent (issue 42). Its memory goes back to the pool when the last
// holder of `keep` lets go: the tier's blocks and any reader still replying from them.
struct RetainedTier::Loan {
  std::shared_ptr<void> keep;  // SealedChunk::keepalive
  uint64_t bytes = 0;          // the chunk's size, charged to used_ once
  uint64_t blocks = 0;         // blocks of the tier in it (protected by the tier's mu_)
};

struct RetainedTier::Buffer {
  // A block within a lent chunk: `at` is where the block's first byte is.
  Buffer(std::shared_ptr<Loan> l, char* at, size_t n) : p(at), cap(n), loan(std::move(l)) {}
  explicit Buffer(size_t n) {
    // Populated: the copy that follows would otherwise fault in (and zero) every page.
    void* m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
    if (m != MAP_FAILED) {
      p = static_cast<char*>(m);
      cap = n;
    }
  }
  ~Buffer() {
    if (p != nullptr && loan == nullptr) munmap(p, cap);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* p = nullptr;
  size_t cap = 0;
  std::shared_ptr<Loan> loan;  // null: its own mapping
};

// One block of a capture. `ranges` (sorted, disjoint, within the block) are the bytes
// copied (or kept, in a lent chunk); a second copy of any byte poisons the block (a rewrite: the file order of the two
// writes is not the order the copies were made in).
struct RetainedTier::CaptureBlock {
  std::shared_ptr<Buffer> buf;  // null: skipped (no room) or poisoned and freed
  bool poisoned = false;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
};

struct RetainedTier::Capture {
  std::weak_ptr<FlushTarget> target;  // expired: the file was never published
  std::shared_ptr<BlockCrcMap> crcs;
  std::map<uint64_t, std::shared_ptr<CaptureBlock>> blocks;
};

struct RetainedTier::Held {
  std::shared_ptr<Buffer> buf;
  uint64_t len = 0;
  uint32_t crc = 0;
  // CRCs of its kSubBlockBytes pieces, learned (under mu_) by its first ReadInPlace.
  std::vector<uint32_t> sub_crcs;
  std::string ckpt;  // the directory it belongs to
  bool replica = false;
};

struct RetainedTier::Ckpt {
  bool committed = false;
  uint64_t created = 0;       // order first seen
  uint64_t commit_order = 0;  // order committed
  uint64_t own_bytes = 0;
  uint64_t replica_bytes = 0;
  uint64_t files = 0;
  int64_t newest_mtime_ns = 0;
  std::string origin;
  std::chrono::steady_clock::time_point last_publish{};
  std::chrono::steady_clock::time_point last_check{};
};

}  // namespace ckptfs::store
