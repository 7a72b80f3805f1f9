// ForEachOtherRank: every other rank exactly once, never more than `width` at a time, and
// the calls overlap (the whole takes about the slowest call, not the sum).
#include "common/fan_out.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <vector>

namespace ckptfs {
namespace {

TEST(FanOut, EveryOtherRankOnceStartingAfterSelf) {
  std::mutex mu;
  std::vector<uint32_t> seen;
  ForEachOtherRank(7, 3, 1, [&](uint32_t rank) {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(rank);
  });
  EXPECT_EQ(seen, (std::vector<uint32_t>{4, 5, 6, 0, 1, 2})) << "width 1: in turn, after self";
  seen.clear();
  ForEachOtherRank(100, 99, 16, [&](uint32_t rank) {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(rank);
  });
  std::set<uint32_t> unique(seen.begin(), seen.end());
  EXPECT_EQ(seen.size(), 99u);
  EXPECT_EQ(unique.size(), 99u);
  EXPECT_EQ(unique.count(99), 0u) << "never self";
  ForEachOtherRank(1, 0, 16, [&](uint32_t) { ADD_FAILURE() << "a node alone calls nobody"; });
}

TEST(FanOut, AtMostWidthAtOnceAndTheCallsOverlap) {
  std::atomic<int> running{0}, peak{0};
  const auto start = std::chrono::steady_clock::now();
  ForEachOtherRank(33, 0, 8, [&](uint32_t) {
    const int now = ++running;
    int seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    --running;
  });
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LE(peak.load(), 8);
  EXPECT_GE(peak.load(), 2) << "the calls never overlapped";
  // 32 calls of 50 ms, 8 at a time: about 200 ms; in turn it would be 1.6 s.
  EXPECT_LT(took, std::chrono::milliseconds(1200));
}

}  // namespace
}  // namespace ckptfs
