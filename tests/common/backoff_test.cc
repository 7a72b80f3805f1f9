// Backoff: one doubling rule, counted by attempts (Delay) or by the last pause (After).
#include "common/backoff.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

namespace ckptfs {
namespace {

using std::chrono::milliseconds;

TEST(Backoff, DelayDoublesFromFirstAndStopsAtMax) {
  constexpr Backoff b{milliseconds(100), milliseconds(5000)};
  EXPECT_EQ(b.Delay(0), milliseconds(100));
  EXPECT_EQ(b.Delay(1), milliseconds(200));
  EXPECT_EQ(b.Delay(5), milliseconds(3200));
  EXPECT_EQ(b.Delay(6), milliseconds(5000));  // 6400 capped
  EXPECT_EQ(b.Delay(1000000), milliseconds(5000));
  static_assert(Backoff{milliseconds(10), milliseconds(40)}.Delay(3) == milliseconds(40));
}

TEST(Backoff, AfterDoublesTheLastPauseAndStopsAtMax) {
  constexpr Backoff b{milliseconds(1000), milliseconds(30000)};
  milliseconds pause = b.first;
  std::vector<long> seen;
  for (int i = 0; i < 7; ++i) {
    seen.push_back(static_cast<long>(pause.count()));
    pause = b.After(pause);
  }
  EXPECT_EQ(seen, (std::vector<long>{1000, 2000, 4000, 8000, 16000, 30000, 30000}));
}

TEST(Backoff, BothCountingsAgree) {
  constexpr Backoff b{milliseconds(3), milliseconds(1000)};
  milliseconds pause = b.first;
  for (uint64_t n = 0; n < 20; ++n) {
    EXPECT_EQ(b.Delay(n), pause) << n;
    pause = b.After(pause);
  }
}

TEST(Backoff, ZeroFirstStaysZero) {
  constexpr Backoff b{milliseconds(0), milliseconds(100)};
  EXPECT_EQ(b.Delay(50), milliseconds(0));
  EXPECT_EQ(b.After(milliseconds(0)), milliseconds(0));
}

}  // namespace
}  // namespace ckptfs
