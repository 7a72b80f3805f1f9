// StagingPool lending (issue 42): a flushed chunk leaves staging as a retained block and a
// spare takes its place, so staging never has fewer than total_chunks() chunks (G6); lent
// and spare memory stay within the lend limit; a lent chunk's bytes are never reused while
// it is held. A real pool over host memory.
#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "gpu/staging_pool.h"

namespace ckptfs::gpu {
namespace {

using std::chrono::milliseconds;

constexpr size_t kChunk = size_t{64} << 10;

std::unique_ptr<StagingPool> MakePool(size_t chunks, size_t lend_chunks) {
  StagingOptions options;
  options.chunk_bytes = kChunk;
  options.total_bytes = chunks * kChunk;
  options.backend = "host";
  auto pool = StagingPool::Create(options);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  if (!pool.ok()) return nullptr;
  (*pool)->SetLendLimit(lend_chunks * kChunk);
  return std::move(pool).value();
}

// Every chunk staging can hand out now, without waiting.
std::vector<ChunkBuffer> TakeAllFree(StagingPool* pool) {
  std::vector<ChunkBuffer> out;
  while (ChunkBuffer b = pool->TryAcquireFor(milliseconds(0))) out.push_back(std::move(b));
  return out;
}

TEST(StagingLend, ALentChunkIsReplacedAtOnceSoStagingKeepsEveryChunk) {
  auto pool = MakePool(4, 4);
  std::vector<ChunkBuffer> out = TakeAllFree(pool.get());
  ASSERT_EQ(out.size(), 4u);
  ChunkBuffer lent = std::move(out[0]);
  out.erase(out.begin());
  ASSERT_TRUE(pool->Lend(lent.data()));
  EXPECT_EQ(pool->lent_bytes(), kChunk);
  EXPECT_EQ(pool->lend_allocs(), 1u) << "no spare yet: one was allocated";
  // Staging has a free chunk again, a new one, not the lent one.
  std::vector<ChunkBuffer> more = TakeAllFree(pool.get());
  ASSERT_EQ(more.size(), 1u);
  EXPECT_NE(more[0].data(), lent.data());
  std::memset(more[0].data(), 0x5a, kChunk);  // writable, pinned memory
  EXPECT_EQ(pool->used_bytes(), 4 * kChunk) << "the lent chunk is not staging's any more";
  EXPECT_EQ(pool->total_chunks(), 4u);
  // The lent chunk's last holder lets go: it becomes a spare, not a fifth staging chunk.
  lent = ChunkBuffer();
  EXPECT_EQ(pool->lent_bytes(), 0u);
  EXPECT_EQ(pool->spare_bytes(), kChunk);
  EXPECT_TRUE(TakeAllFree(pool.get()).empty());
  // The next loan takes the spare: nothing is allocated.
  ASSERT_TRUE(pool->Lend(more[0].data()));
  EXPECT_EQ(pool->lend_allocs(), 1u);
  EXPECT_EQ(pool->spare_bytes(), 0u);
  EXPECT_EQ(pool->lends(), 2u);
  more.clear();
  out.clear();
  EXPECT_EQ(TakeAllFree(pool.get()).size(), 4u) << "staging is whole after every return";
}

TEST(StagingLend, TheLendLimitBoundsLentAndSpareMemoryTogether) {
  auto pool = MakePool(2, 1);
  ChunkBuffer a = pool->Acquire(), b = pool->Acquire();
  ASSERT_TRUE(pool->Lend(a.data()));
  EXPECT_FALSE(pool->Lend(b.data())) << "a second loan would pass the limit";
  EXPECT_EQ(pool->lent_bytes(), kChunk);
  a = ChunkBuffer();  // back as the spare
  EXPECT_EQ(pool->spare_bytes(), kChunk);
  EXPECT_TRUE(pool->Lend(b.data())) << "the spare takes its place";
  b = ChunkBuffer();
  EXPECT_EQ(pool->spare_bytes() + pool->lent_bytes(), kChunk);
  // Without a limit (the default) nothing is lent, and the chunk returns as usual.
  auto plain = MakePool(2, 0);
  ChunkBuffer c = plain->Acquire();
  EXPECT_FALSE(plain->Lend(c.data()));
  c = ChunkBuffer();
  EXPECT_EQ(plain->used_bytes(), 0u);
  EXPECT_EQ(TakeAllFree(plain.get()).size(), 2u);
}

TEST(StagingLend, TrimmedSparesGiveTheirMemoryBackAndAreLockedAgainByTheNextLoan) {
  auto pool = MakePool(2, 2);
  {
    ChunkBuffer a = pool->Acquire(), b = pool->Acquire();
    ASSERT_TRUE(pool->Lend(a.data()));
    ASSERT_TRUE(pool->Lend(b.data()));
  }
  EXPECT_EQ(pool->spare_bytes(), 2 * kChunk);
  pool->TrimSpares(kChunk);
  EXPECT_EQ(pool->spare_bytes(), kChunk);
  pool->TrimSpares(0);
  EXPECT_EQ(pool->spare_bytes(), 0u);
  const uint64_t allocs = pool->lend_allocs();
  std::vector<ChunkBuffer> out = TakeAllFree(pool.get());
  ASSERT_EQ(out.size(), 2u);
  ASSERT_TRUE(pool->Lend(out[0].data()));
  EXPECT_EQ(pool->lend_allocs(), allocs + 1) << "a trimmed spare is pinned again";
  std::vector<ChunkBuffer> spare = TakeAllFree(pool.get());
  ASSERT_EQ(spare.size(), 1u);
  std::memset(spare[0].data(), 0x11, kChunk);
  EXPECT_EQ(spare[0].data()[kChunk - 1], 0x11);
}

TEST(StagingLend, ALentChunksBytesAreNeverReusedWhileItIsHeld) {
  auto pool = MakePool(3, 3);
  ChunkBuffer kept = pool->Acquire();
  for (size_t i = 0; i < kChunk; ++i) kept.data()[i] = static_cast<uint8_t>(i * 7);
  ASSERT_TRUE(pool->Lend(kept.data()));
  for (int round = 0; round < 20; ++round) {
    std::vector<ChunkBuffer> all = TakeAllFree(pool.get());
    ASSERT_EQ(all.size(), 3u) << round;
    for (ChunkBuffer& b : all) {
      EXPECT_NE(b.data(), kept.data());
      std::memset(b.data(), 0, kChunk);
    }
  }
  for (size_t i = 0; i < kChunk; ++i) {
    ASSERT_EQ(kept.data()[i], static_cast<uint8_t>(i * 7)) << i;
  }
}

TEST(StagingLend, ConcurrentLoansAndAcquiresKeepStagingWholeAndWithinTheLimit) {
  constexpr size_t kChunks = 4, kLimit = 3;
  auto pool = MakePool(kChunks, kLimit);
  std::atomic<bool> over{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<ChunkBuffer> held;  // lent chunks this thread keeps a while
      for (int i = 0; i < 300; ++i) {
        ChunkBuffer b = pool->Acquire();
        b.data()[0] = static_cast<uint8_t>(t);
        if (i % 3 == 0 && pool->Lend(b.data())) held.push_back(std::move(b));
        if (held.size() > 1) held.erase(held.begin());
        if (pool->used_bytes() > kChunks * kChunk ||
            pool->lent_and_spare_bytes() > kLimit * kChunk) {
          over = true;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_FALSE(over.load());
  EXPECT_EQ(pool->lent_bytes(), 0u);
  EXPECT_LE(pool->spare_bytes(), kLimit * kChunk);
  EXPECT_EQ(TakeAllFree(pool.get()).size(), kChunks);
}

TEST(StagingLendDeathTest, DestroyingThePoolWhileAChunkIsLentAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        auto pool = MakePool(2, 2);
        ChunkBuffer b = pool->Acquire();
        if (pool->Lend(b.data())) {
          ChunkBuffer* leaked = new ChunkBuffer(std::move(b));
          (void)leaked;
          pool.reset();
        }
      },
      testing::KilledBySignal(SIGABRT), "");
}

}  // namespace
}  // namespace ckptfs::gpu
