#include "store/flush/block_crc_map.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "store/primitives/crc32c.h"

namespace ckptfs::store {
namespace {

constexpr uint32_t kBlock = 4096;  // small blocks: many edges per test file

BlockCrcOptions Small() {
  BlockCrcOptions o;
  o.block_bytes = kBlock;
  return o;
}

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// Cuts [0, n) into random pieces: sizes from 1 byte to several blocks, most unaligned.
std::vector<std::pair<uint64_t, uint64_t>> RandomChunks(uint64_t n, std::mt19937_64& rng) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (uint64_t off = 0; off < n;) {
    uint64_t len;
    switch (rng() % 4) {
      case 0: len = 1 + rng() % 100; break;
      case 1: len = kBlock; break;
      case 2: len = 1 + rng() % (5 * kBlock); break;
      default: len = kBlock * (1 + rng() % 4) - off % kBlock; break;  // ends aligned
    }
    len = std::min(len, n - off);
    out.emplace_back(off, len);
    off += len;
  }
  return out;
}

// What the key index does with a map: head edge and tail edge hashed from the bytes, the
// aligned middle from the map.
std::optional<uint32_t> ItemCrc(const BlockCrcMap& map, const std::string& file, uint64_t off,
                                uint64_t len) {
  const uint64_t bs = map.block_bytes(), end = off + len;
  uint64_t mid_begin = std::min(end, (off + bs - 1) / bs * bs);
  uint64_t mid_end = end == file.size() ? end : end / bs * bs;
  if (mid_end < mid_begin) mid_end = mid_begin;
  uint32_t crc = Crc32c(file.data() + off, mid_begin - off);
  std::optional<uint32_t> mid = map.RangeCrc(mid_begin, mid_end);
  if (!mid) return std::nullopt;
  crc = Crc32cCombine(crc, *mid, mid_end - mid_begin);
  return Crc32cCombine(crc, Crc32c(file.data() + mid_end, end - mid_end), end - mid_end);
}

TEST(BlockCrcMap, RandomChunkingsInAnyOrderGiveExactItemCrcs) {
  std::mt19937_64 rng(1);
  for (int round = 0; round < 60; ++round) {
    const uint64_t n = 1 + rng() % (40 * kBlock);
    const std::string file = RandomBytes(n, round);
    auto chunks = RandomChunks(n, rng);
    std::shuffle(chunks.begin(), chunks.end(), rng);  // parallel flushes land in any order
    BlockCrcMap map(Small());
    for (auto [off, len] : chunks) map.Record(off, file.data() + off, len);
    map.Finish(n);
    ASSERT_EQ(map.poisoned_blocks(), 0u);
    ASSERT_EQ(map.known_blocks(), (n + kBlock - 1) / kBlock) << "every block complete";
    ASSERT_EQ(map.RangeCrc(0, n), Crc32c(file.data(), n));
    // Random items, aligned or not, small or spanning many blocks.
    for (int i = 0; i < 50; ++i) {
      uint64_t off = rng() % n, len = rng() % (n - off + 1);
      std::optional<uint32_t> got = ItemCrc(map, file, off, len);
      ASSERT_TRUE(got.has_value()) << off << "+" << len;
      ASSERT_EQ(*got, Crc32c(file.data() + off, len)) << "round " << round << " item " << off
                                                      << "+" << len;
    }
  }
}

TEST(BlockCrcMap, ConcurrentRecordersAgreeWithTheBytes) {
  const uint64_t n = 300 * kBlock + 77;
  const std::string file = RandomBytes(n, 9);
  std::mt19937_64 rng(2);
  auto chunks = RandomChunks(n, rng);
  BlockCrcMap map(Small());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < chunks.size(); i += 4) {
        map.Record(chunks[i].first, file.data() + chunks[i].first, chunks[i].second);
      }
    });
  }
  for (auto& th : threads) th.join();
  map.Finish(n);
  EXPECT_EQ(map.RangeCrc(0, n), Crc32c(file.data(), n));
}

TEST(BlockCrcMap, OverlappingRecordsPoisonOnlyTheBlocksTheyTouch) {
  const uint64_t n = 10 * kBlock;
  std::string file = RandomBytes(n, 3);
  BlockCrcMap map(Small());
  map.Record(0, file.data(), n);
  // Rewrite 10 bytes straddling blocks 3 and 4 with new contents.
  const uint64_t at = 4 * kBlock - 5;
  std::string patch = RandomBytes(10, 4);
  file.replace(at, 10, patch);
  map.Record(at, patch.data(), patch.size());
  map.Finish(n);
  EXPECT_EQ(map.poisoned_blocks(), 2u);
  EXPECT_FALSE(map.RangeCrc(0, n).has_value()) << "never a stale CRC";
  EXPECT_FALSE(map.RangeCrc(3 * kBlock, 4 * kBlock).has_value());
  EXPECT_FALSE(map.RangeCrc(4 * kBlock, 5 * kBlock).has_value());
  EXPECT_EQ(map.RangeCrc(0, 3 * kBlock), Crc32c(file.data(), 3 * kBlock));
  EXPECT_EQ(map.RangeCrc(5 * kBlock, n), Crc32c(file.data() + 5 * kBlock, n - 5 * kBlock));

  // Overlap inside a block still incomplete (two partial pieces) poisons it too, even when a
  // later piece would have completed it.
  BlockCrcMap partial(Small());
  partial.Record(0, file.data(), 100);
  partial.Record(50, file.data() + 50, 100);
  partial.Record(150, file.data() + 150, kBlock - 150);
  partial.Finish(kBlock);
  EXPECT_FALSE(partial.RangeCrc(0, kBlock).has_value());
}

TEST(BlockCrcMap, UnrecordedBytesAndHolesStayUnknown) {
  const uint64_t n = 8 * kBlock;
  const std::string file = RandomBytes(n, 5);
  BlockCrcMap map(Small());
  // Bytes [kBlock + 10, kBlock + 20) never recorded (copied in some other way).
  map.Record(0, file.data(), kBlock + 10);
  map.Record(kBlock + 20, file.data() + kBlock + 20, n - kBlock - 20);
  map.Finish(n);
  EXPECT_FALSE(map.RangeCrc(kBlock, 2 * kBlock).has_value());
  EXPECT_EQ(map.RangeCrc(0, kBlock), Crc32c(file.data(), kBlock));
  EXPECT_EQ(map.RangeCrc(2 * kBlock, n), Crc32c(file.data() + 2 * kBlock, n - 2 * kBlock));
  // Ranges not block-aligned, or past the end, are refused rather than guessed.
  EXPECT_FALSE(map.RangeCrc(1, kBlock).has_value());
  EXPECT_FALSE(map.RangeCrc(0, kBlock + 1).has_value());
  EXPECT_FALSE(map.RangeCrc(0, n + kBlock).has_value());
}

TEST(BlockCrcMap, TruncateDropsCutBytesAndPoisonsAStraddledBlock) {
  const uint64_t n = 6 * kBlock;
  std::string file = RandomBytes(n, 6);
  {
    // Shrink into block 2, then extend with zeros (ftruncate semantics): block 2 held
    // recorded bytes past the cut, so it is unknown; blocks past it are simply unwritten.
    BlockCrcMap map(Small());
    map.Record(0, file.data(), n);
    const uint64_t cut = 2 * kBlock + 100;
    map.Truncate(cut);
    std::fill(file.begin() + cut, file.end(), '\0');
    map.Truncate(n);
    map.Finish(n);
    EXPECT_EQ(map.RangeCrc(0, 2 * kBlock), Crc32c(file.data(), 2 * kBlock));
    EXPECT_FALSE(map.RangeCrc(2 * kBlock, 3 * kBlock).has_value());
    EXPECT_FALSE(map.RangeCrc(3 * kBlock, 4 * kBlock).has_value()) << "zeros were never recorded";
  }
  {
    // Shrink, then write the tail again: exact again, with the new bytes.
    BlockCrcMap map(Small());
    map.Record(0, file.data(), n);
    map.Truncate(3 * kBlock);  // aligned cut: nothing straddles
    std::string tail = RandomBytes(n - 3 * kBlock, 7);
    file.replace(3 * kBlock, tail.size(), tail);
    map.Record(3 * kBlock, tail.data(), tail.size());
    map.Finish(n);
    EXPECT_EQ(map.RangeCrc(0, n), Crc32c(file.data(), n));
  }
  {
    // A partial block cut between its pieces keeps the pieces before the cut.
    BlockCrcMap map(Small());
    map.Record(0, file.data(), 100);
    map.Record(200, file.data() + 200, 100);
    map.Truncate(150);
    map.Record(100, file.data() + 100, 50);
    map.Finish(150);
    EXPECT_EQ(map.RangeCrc(0, 150), Crc32c(file.data(), 150));
  }
  {
    // Finish at a smaller size than written: the last short block is exact only if its
    // recorded bytes end exactly there.
    BlockCrcMap map(Small());
    map.Record(0, file.data(), 2 * kBlock);
    map.Finish(kBlock + 10);
    EXPECT_EQ(map.RangeCrc(0, kBlock), Crc32c(file.data(), kBlock));
    EXPECT_FALSE(map.RangeCrc(0, kBlock + 10).has_value());
  }
}

TEST(BlockCrcMap, WritesAfterFinishPoisonAndMemoryIsBounded) {
  const std::string file = RandomBytes(4 * kBlock, 8);
  BlockCrcMap map(Small());
  map.Record(0, file.data(), file.size());
  map.Finish(file.size());
  map.Record(kBlock, file.data() + kBlock, 1);
  EXPECT_FALSE(map.RangeCrc(0, file.size()).has_value());
  EXPECT_EQ(map.RangeCrc(0, kBlock), Crc32c(file.data(), kBlock));

  BlockCrcOptions o = Small();
  o.max_blocks = 16;
  o.max_partial_blocks = 2;
  BlockCrcMap bounded(o);
  // A write far past max_blocks records nothing and allocates nothing for it.
  bounded.Record(uint64_t{1} << 40, file.data(), kBlock);
  EXPECT_LT(bounded.MemoryBytes(), 4096u);
  // Three incomplete blocks with a bound of two: the third is poisoned, not tracked.
  for (uint64_t b = 0; b < 3; ++b) bounded.Record(b * kBlock, file.data(), 10);
  EXPECT_EQ(bounded.poisoned_blocks(), 1u);
  for (uint64_t b = 0; b < 3; ++b) {
    bounded.Record(b * kBlock + 10, file.data() + 10, kBlock - 10);
  }
  EXPECT_EQ(bounded.known_blocks(), 2u);
}

// Issue 39: what a writer hands to another node (BlockCrcs) rebuilds, there, a map that gives
// the same item CRCs; a list that does not describe a file of that size is refused, and an
// unfinished or incomplete map vouches for nothing.
TEST(BlockCrcMap, BlockCrcsRoundTripToAnotherNodeAndBadListsAreRefused) {
  const std::string file = RandomBytes(5 * kBlock + 123, 31);
  BlockCrcOptions o;
  o.block_bytes = kBlock;
  BlockCrcMap map(o);
  std::mt19937_64 rng(5);
  for (auto [off, len] : RandomChunks(file.size(), rng)) map.Record(off, file.data() + off, len);
  EXPECT_FALSE(map.BlockCrcs().has_value()) << "unfinished";
  map.Finish(file.size());
  std::optional<std::vector<uint32_t>> crcs = map.BlockCrcs();
  ASSERT_TRUE(crcs.has_value());
  ASSERT_EQ(crcs->size(), 6u);
  std::shared_ptr<BlockCrcMap> there = BlockCrcMap::FromBlockCrcs(kBlock, file.size(), *crcs);
  ASSERT_NE(there, nullptr);
  EXPECT_TRUE(there->finished());
  EXPECT_EQ(there->size(), file.size());
  for (int i = 0; i < 200; ++i) {
    uint64_t off = rng() % file.size();
    uint64_t len = rng() % (file.size() - off);
    EXPECT_EQ(ItemCrc(*there, file, off, len), Crc32c(file.data() + off, len)) << off << "+" << len;
  }
  crcs->pop_back();
  EXPECT_EQ(BlockCrcMap::FromBlockCrcs(kBlock, file.size(), *crcs), nullptr);  // count
  crcs->push_back(0);
  EXPECT_EQ(BlockCrcMap::FromBlockCrcs(kBlock + 1, file.size(), *crcs), nullptr);
  EXPECT_EQ(BlockCrcMap::FromBlockCrcs(1024, file.size(), *crcs), nullptr);  // too small
  EXPECT_EQ(BlockCrcMap::FromBlockCrcs(kBlock, file.size(), *crcs, /*max_blocks=*/5), nullptr);
  EXPECT_NE(BlockCrcMap::FromBlockCrcs(kBlock, 0, {}), nullptr);  // an empty file

  BlockCrcMap holey(o);
  holey.Record(0, file.data(), kBlock);
  holey.Record(2 * kBlock, file.data() + 2 * kBlock, file.size() - 2 * kBlock);
  holey.Finish(file.size());
  EXPECT_FALSE(holey.BlockCrcs().has_value()) << "a block never written is vouched for";
}

}  // namespace
}  // namespace ckptfs::store
