// SyntheticProvider: a BlockSource over made-up files whose bytes are a deterministic
// function of (path, offset), so a requester can check every byte it gets without a copy
// of the data. Used by the peer tests and ckptfs-peer-tool's benchmarks, never by the
// daemon. Fault hooks: corrupt the next N replies (a flipped byte under the true checksum,
// as a bad read on the owner would give) and delay every read.
//
// Thread-safe.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "store/cache/block_source.h"
#include "store/primitives/crc32c.h"

namespace ckptfs::store::peer {

class SyntheticProvider : public BlockSource {
 public:
  static constexpr size_t kPatternBytes = 1048573;  // prime: blocks never line up with it

  // `files`: path -> (size, mtime_ns).
  explicit SyntheticProvider(std::map<std::string, std::pair<uint64_t, int64_t>> files)
      : files_(std::move(files)), pattern_(kPatternBytes) {
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (char& c : pattern_) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      c = static_cast<char>(x >> 56);
    }
  }

  // The bytes of `path` at [offset, offset + out.size()).
  void Fill(const std::string& path, uint64_t offset, std::span<char> out) const {
    uint64_t pos = (offset + Seed(path)) % kPatternBytes;
    size_t done = 0;
    while (done < out.size()) {
      size_t n = std::min<size_t>(out.size() - done, kPatternBytes - pos);
      std::memcpy(out.data() + done, pattern_.data() + pos, n);
      done += n;
      pos = 0;
    }
  }

  Result<BlockRead> ReadBlock(const BlockId& id, uint64_t offset, std::span<char> out) override {
    reads_.fetch_add(1, std::memory_order_relaxed);
    if (int ms = delay_ms_.load(); ms > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    auto it = files_.find(id.path);
    if (it == files_.end()) return NotFound("no file " + id.path);
    if (it->second.first != id.size || it->second.second != id.mtime_ns) {
      return Status(Code::kAborted, "stale version of " + id.path);
    }
    if (offset > id.size) return Invalid("offset past the end of " + id.path);
    size_t n = static_cast<size_t>(std::min<uint64_t>(out.size(), id.size - offset));
    Fill(id.path, offset, out.first(n));
    BlockRead r;
    r.bytes = n;
    if (corrupt_next_.load() > 0 && corrupt_next_.fetch_sub(1) > 0 && n > 0) {
      r.crc32c = Crc32c(out.data(), n);  // the true checksum, over bytes that then rot
      out[n / 2] = static_cast<char>(out[n / 2] ^ 0x40);
    }
    return r;
  }

  void CorruptNext(int n) { corrupt_next_.store(n); }
  void SetDelayMs(int ms) { delay_ms_.store(ms); }
  uint64_t reads() const { return reads_.load(); }

 private:
  static uint64_t Seed(const std::string& path) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : path) h = (h ^ c) * 1099511628211ull;
    return h % kPatternBytes;
  }

  const std::map<std::string, std::pair<uint64_t, int64_t>> files_;
  std::vector<char> pattern_;
  std::atomic<int> corrupt_next_{0};
  std::atomic<int> delay_ms_{0};
  std::atomic<uint64_t> reads_{0};
};

}  // namespace ckptfs::store::peer
