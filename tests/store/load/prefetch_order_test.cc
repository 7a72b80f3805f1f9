// PrefetchOrder: a load's page-cache prefetch takes each writer rank's next window in turn.
#include "store/load/prefetch_order.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace ckptfs::store {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::vector<std::string> Names(const std::vector<std::pair<std::string, uint64_t>>& files,
                               const std::vector<PrefetchWindow>& order) {
  std::vector<std::string> out;
  for (const PrefetchWindow& w : order) out.push_back(files[w.file].first);
  return out;
}

TEST(DcpWriterFile, ParsesTorchWriterNamesAndNothingElse) {
  EXPECT_EQ(DcpWriterFile("__0_0.distcp"), std::make_pair(uint64_t{0}, uint64_t{0}));
  EXPECT_EQ(DcpWriterFile("__12_345.distcp"), std::make_pair(uint64_t{12}, uint64_t{345}));
  for (const char* other : {".metadata", "__0_0.distcp.tmp", "__a_0.distcp", "__0_.distcp",
                            "___0.distcp", "__0_-1.distcp", "_0_0.distcp", "__0_0_1.distcp",
                            "__99999999999999999999_0.distcp", "model.safetensors"}) {
    EXPECT_FALSE(DcpWriterFile(other).has_value()) << other;
  }
}

TEST(PrefetchOrder, OneFilePerItemTakesEachRanksNextFileInTurnNumerically) {
  // Alphabetically __0_10 sorts before __0_2, and every rank-0 file before rank 1's: a
  // prefetch in that order made rank 1 wait behind all of rank 0's files.
  std::vector<std::pair<std::string, uint64_t>> files;
  for (int rank : {1, 0}) {
    for (int n : {10, 2, 0, 1}) {
      files.emplace_back("__" + std::to_string(rank) + "_" + std::to_string(n) + ".distcp",
                         4 * kMiB);
    }
  }
  const auto order = PrefetchOrder(files, 8 * kMiB);
  EXPECT_EQ(Names(files, order),
            (std::vector<std::string>{"__0_0.distcp", "__1_0.distcp", "__0_1.distcp",
                                      "__1_1.distcp", "__0_2.distcp", "__1_2.distcp",
                                      "__0_10.distcp", "__1_10.distcp"}));
  for (const PrefetchWindow& w : order) {
    EXPECT_EQ(w.offset, 0u);
    EXPECT_EQ(w.length, 4 * kMiB);
  }
}

TEST(PrefetchOrder, OneFilePerRankGoesRoundRobinInWindowsAndCoversEveryByteOnce) {
  std::vector<std::pair<std::string, uint64_t>> files = {
      {"__1_0.distcp", 20 * kMiB + 5}, {"__0_0.distcp", 9 * kMiB}, {"empty", 0}};
  const auto order = PrefetchOrder(files, 8 * kMiB);
  std::vector<PrefetchWindow> want = {
      {1, 0, 8 * kMiB}, {0, 0, 8 * kMiB}, {1, 8 * kMiB, kMiB},
      {0, 8 * kMiB, 8 * kMiB}, {0, 16 * kMiB, 4 * kMiB + 5}};
  EXPECT_EQ(order, want);
}

TEST(PrefetchOrder, OtherNamesAreSequencesOfTheirOwnAfterTheRanks) {
  std::vector<std::pair<std::string, uint64_t>> files = {
      {"model-00002.safetensors", kMiB}, {"__0_0.distcp", 2 * kMiB},
      {"model-00001.safetensors", kMiB}};
  const auto order = PrefetchOrder(files, kMiB);
  EXPECT_EQ(Names(files, order),
            (std::vector<std::string>{"__0_0.distcp", "model-00001.safetensors",
                                      "model-00002.safetensors", "__0_0.distcp"}));
  EXPECT_TRUE(PrefetchOrder({}, kMiB).empty());
}

}  // namespace
}  // namespace ckptfs::store
