#include "store/flush/block_crc_map.h"

#include <algorithm>
#include <memory>

#include "store/primitives/crc32c.h"

namespace ckptfs::store {
namespace {

// One table per block size in use (normally one), built once: folding a range of blocks is
// then four lookups per block.
const Crc32cCombiner& BlockCombiner(uint32_t block_bytes) {
  static Mutex mu;
  static std::map<uint32_t, std::unique_ptr<Crc32cCombiner>> combiners;  // under mu
  MutexLock lock(&mu);
  auto& c = combiners[block_bytes];
  if (!c) c = std::make_unique<Crc32cCombiner>(block_bytes);
  return *c;
}

struct NewPiece {
  uint64_t block;
  uint32_t begin, end, crc;
};

}  // namespace

BlockCrcMap::BlockCrcMap(const BlockCrcOptions& options) : opts_(options) {}

void BlockCrcMap::Record(uint64_t offset, const void* data, size_t n) {
  if (n == 0) return;
  const uint64_t bs = opts_.block_bytes;
  const auto* p = static_cast<const uint8_t*>(data);
  // Hash outside the lock: flush threads of one file run in parallel.
  std::vector<NewPiece> pieces;
  pieces.reserve(n / bs + 2);
  for (uint64_t off = offset, left = n; left > 0;) {
    const uint64_t block = off / bs;
    const uint32_t begin = static_cast<uint32_t>(off % bs);
    const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(left, bs - begin));
    pieces.push_back({block, begin, begin + len, Crc32c(p, len)});
    p += len;
    off += len;
    left -= len;
  }
  MutexLock lock(&mu_);
  for (const NewPiece& piece : pieces) {
    if (finished_) {
      // A write after the file was declared complete: whatever was known there is stale.
      if (piece.block < state_.size()) PoisonLocked(piece.block);
      continue;
    }
    AddPieceLocked(piece.block, piece.begin, piece.end, piece.crc);
  }
}

bool BlockCrcMap::EnsureSlotLocked(uint64_t block) {
  if (block >= opts_.max_blocks) return false;  // past the bound: stays unknown
  if (block >= state_.size()) {
    crc_.resize(block + 1, 0);
    state_.resize(block + 1, kEmpty);
  }
  return true;
}

void BlockCrcMap::PoisonLocked(uint64_t block) {
  if (block >= state_.size() || state_[block] == kPoisoned) return;
  if (state_[block] == kKnown) --known_;
  partial_.erase(block);
  state_[block] = kPoisoned;
  crc_[block] = 0;
  ++poisoned_;
}

void BlockCrcMap::AddPieceLocked(uint64_t block, uint32_t begin, uint32_t end, uint32_t crc) {
  if (!EnsureSlotLocked(block)) return;
  const uint32_t bs = opts_.block_bytes;
  switch (state_[block]) {
    case kPoisoned:
      return;
    case kKnown:
      PoisonLocked(block);  // a rewrite of recorded bytes
      return;
    case kEmpty:
      if (begin == 0 && end == bs) {
        state_[block] = kKnown;
        crc_[block] = crc;
        ++known_;
        return;
      }
      if (partial_.size() >= opts_.max_partial_blocks) {
        PoisonLocked(block);
        return;
      }
      partial_[block] = {Piece{begin, end, crc}};
      state_[block] = kPartial;
      return;
    default:
      break;
  }
  std::vector<Piece>& v = partial_[block];
  auto it = std::lower_bound(v.begin(), v.end(), begin,
                             [](const Piece& p, uint32_t b) { return p.end <= b; });
  // `it` is the first piece ending after `begin`: it overlaps unless it starts at or after end.
  if (it != v.end() && it->begin < end) {
    PoisonLocked(block);
    return;
  }
  it = v.insert(it, Piece{begin, end, crc});
  // Fold with contiguous neighbours, so a block completes as one piece.
  if (auto next = it + 1; next != v.end() && next->begin == it->end) {
    it->crc = Crc32cCombine(it->crc, next->crc, next->end - next->begin);
    it->end = next->end;
    it = v.erase(next) - 1;
  }
  if (it != v.begin()) {
    auto prev = it - 1;
    if (prev->end == it->begin) {
      prev->crc = Crc32cCombine(prev->crc, it->crc, it->end - it->begin);
      prev->end = it->end;
      v.erase(it);
    }
  }
  if (v.size() == 1 && v[0].begin == 0 && v[0].end == bs) {
    crc_[block] = v[0].crc;
    state_[block] = kKnown;
    ++known_;
    partial_.erase(block);
  }
}

void BlockCrcMap::TruncateLocked(uint64_t size) {
  const uint64_t bs = opts_.block_bytes;
  const uint64_t first = size / bs;  // the block holding offset `size`
  const uint32_t cut = static_cast<uint32_t>(size % bs);
  // Blocks wholly at or past `size`: their recorded bytes no longer exist.
  const uint64_t keep = first + (cut != 0 ? 1 : 0);
  for (uint64_t b = keep; b < state_.size(); ++b) {
    if (state_[b] == kKnown) --known_;
    if (state_[b] == kPoisoned) --poisoned_;
  }
  partial_.erase(partial_.lower_bound(keep), partial_.end());
  if (keep < state_.size()) {
    state_.resize(keep);
    crc_.resize(keep);
  }
  if (cut == 0 || first >= state_.size()) return;
  switch (state_[first]) {
    case kKnown:
      PoisonLocked(first);  // recorded bytes on both sides of the cut
      return;
    case kPartial: {
      std::vector<Piece>& v = partial_[first];
      for (const Piece& p : v) {
        if (p.begin < cut && p.end > cut) {
          PoisonLocked(first);
          return;
        }
      }
      std::erase_if(v, [&](const Piece& p) { return p.begin >= cut; });
      if (v.empty()) {
        partial_.erase(first);
        state_[first] = kEmpty;
      }
      return;
    }
    default:
      return;
  }
}

void BlockCrcMap::Truncate(uint64_t size) {
  MutexLock lock(&mu_);
  if (finished_) {
    // After Finish the map describes a sealed file; a truncate means it was not.
    for (uint64_t b = 0; b < state_.size(); ++b) PoisonLocked(b);
    return;
  }
  TruncateLocked(size);
}

void BlockCrcMap::Finish(uint64_t size) {
  MutexLock lock(&mu_);
  if (finished_) return;
  TruncateLocked(size);
  const uint64_t bs = opts_.block_bytes;
  const uint64_t last = size / bs;
  const uint32_t tail = static_cast<uint32_t>(size % bs);
  if (tail != 0 && last < state_.size() && state_[last] == kPartial) {
    const std::vector<Piece>& v = partial_[last];
    if (v.size() == 1 && v[0].begin == 0 && v[0].end == tail) {
      crc_[last] = v[0].crc;
      state_[last] = kKnown;
      ++known_;
    }
  }
  // Incomplete blocks stay unknown; their pieces are of no further use.
  for (const auto& [block, pieces] : partial_) {
    if (state_[block] == kPartial) state_[block] = kEmpty;
  }
  partial_.clear();
  crc_.shrink_to_fit();
  state_.shrink_to_fit();
  finished_ = true;
  size_ = size;
}

std::optional<uint32_t> BlockCrcMap::RangeCrc(uint64_t begin, uint64_t end) const {
  const uint64_t bs = opts_.block_bytes;
  MutexLock lock(&mu_);
  if (begin == end) return 0u;
  if (begin % bs != 0 || end < begin) return std::nullopt;
  if (finished_ && end > size_) return std::nullopt;
  if (end % bs != 0 && !(finished_ && end == size_)) return std::nullopt;
  const Crc32cCombiner& combine = BlockCombiner(opts_.block_bytes);
  uint32_t crc = 0;
  for (uint64_t b = begin / bs, last = (end - 1) / bs; b <= last; ++b) {
    if (b >= state_.size() || state_[b] != kKnown) return std::nullopt;
    const uint64_t len = std::min<uint64_t>(bs, end - b * bs);
    crc = len == bs ? combine.Combine(crc, crc_[b]) : Crc32cCombine(crc, crc_[b], len);
  }
  return crc;
}

std::optional<std::vector<uint32_t>> BlockCrcMap::BlockCrcs() const {
  MutexLock lock(&mu_);
  if (!finished_) return std::nullopt;
  const uint64_t bs = opts_.block_bytes;
  const uint64_t n = (size_ + bs - 1) / bs;
  if (n > state_.size()) return std::nullopt;
  for (uint64_t b = 0; b < n; ++b) {
    if (state_[b] != kKnown) return std::nullopt;
  }
  return std::vector<uint32_t>(crc_.begin(), crc_.begin() + static_cast<ptrdiff_t>(n));
}

std::shared_ptr<BlockCrcMap> BlockCrcMap::FromBlockCrcs(uint32_t block_bytes, uint64_t size,
                                                        const std::vector<uint32_t>& crcs,
                                                        uint64_t max_blocks) {
  if (block_bytes < kMinBlockBytes || block_bytes > kMaxBlockBytes ||
      (block_bytes & (block_bytes - 1)) != 0) {
    return nullptr;
  }
  const uint64_t n = size / block_bytes + (size % block_bytes != 0 ? 1 : 0);
  if (crcs.size() != n || n > max_blocks) return nullptr;
  BlockCrcOptions options;
  options.block_bytes = block_bytes;
  options.max_blocks = max_blocks;
  auto map = std::make_shared<BlockCrcMap>(options);
  {
    MutexLock lock(&map->mu_);
    map->crc_ = crcs;
    map->state_.assign(n, kKnown);
    map->known_ = n;
    map->finished_ = true;
    map->size_ = size;
  }
  return map;
}

bool BlockCrcMap::finished() const {
  MutexLock lock(&mu_);
  return finished_;
}

uint64_t BlockCrcMap::size() const {
  MutexLock lock(&mu_);
  return size_;
}

uint64_t BlockCrcMap::known_blocks() const {
  MutexLock lock(&mu_);
  return known_;
}

uint64_t BlockCrcMap::poisoned_blocks() const {
  MutexLock lock(&mu_);
  return poisoned_;
}

size_t BlockCrcMap::MemoryBytes() const {
  MutexLock lock(&mu_);
  size_t n = sizeof(*this) + crc_.capacity() * sizeof(uint32_t) + state_.capacity();
  for (const auto& [block, pieces] : partial_) n += 64 + pieces.capacity() * sizeof(Piece);
  return n;
}

}  // namespace ckptfs::store
