// FanOut: one call to each of many nodes, a bounded number at a time. A daemon that tells
// every other node something (a memory-only tree's mkdir or rmdir, a commit notice, a lost
// checkpoint) waits for the slowest of `width` concurrent calls rather than the sum of all
// of them in turn: at 1,000 nodes and 1 ms a round trip, 1 s in turn against about 60 ms
// 16 at a time, and a node that is down costs its own wait once, not once per node after
// it. Threads: width - 1 started for the call, the caller's own the last; none outlive it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace ckptfs {

// The default width of a fan-out to other nodes.
inline constexpr uint32_t kFanOutWidth = 16;

// Calls `fn(rank)` once for every rank in [0, nodes) except `self`, starting after `self`
// (self + 1, self + 2, ...: nodes that all tell everyone do not all start with the same
// one), at most `width` at a time; returns once every call has returned. `fn` must be
// safe to call concurrently.
inline void ForEachOtherRank(uint32_t nodes, uint32_t self, uint32_t width,
                             const std::function<void(uint32_t rank)>& fn) {
  if (nodes <= 1) return;
  const uint32_t others = nodes - 1;
  std::atomic<uint32_t> next{1};
  auto work = [&] {
    for (uint32_t k = next.fetch_add(1); k <= others; k = next.fetch_add(1)) {
      fn((self + k) % nodes);
    }
  };
  const uint32_t threads = std::min(std::max<uint32_t>(width, 1), others);
  std::vector<std::thread> helpers;
  helpers.reserve(threads - 1);
  for (uint32_t i = 1; i < threads; ++i) helpers.emplace_back(work);
  work();
  for (std::thread& t : helpers) t.join();
}

}  // namespace ckptfs
