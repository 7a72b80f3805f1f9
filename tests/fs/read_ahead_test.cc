// Loader::ReadAhead (store/load/loader.h), through the facade: a file outside any
// checkpoint read front to back gets blocks fetched ahead of the reader; one read at a jump
// gets none.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/fs/fs_fixture.h"

namespace ckptfs::fs {
namespace {

class ReadAheadTest : public FaultyFsTest {
 protected:
  void SetUp() override {
    cache_bytes_ = 64u << 20;
    Start();
  }
  uint64_t Prefetched() {
    return nlohmann::json::parse(fs_->control()->StatsJson()).value("prefetched_bytes", uint64_t{0});
  }
  // Waits (up to 5 s) until the prefetched bytes reach `at_least`; returns them.
  uint64_t PrefetchedAtLeast(uint64_t at_least) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    uint64_t got = Prefetched();
    while (got < at_least && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      got = Prefetched();
    }
    return got;
  }
  static std::string Pattern(size_t n, char seed) {
    std::string s(n, '\0');
    for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(seed + i * 131 + (i >> 12));
    return s;
  }
};

TEST_F(ReadAheadTest, SequentialReaderGetsBlocksAheadAndTheSameBytes) {
  const std::string data = Pattern(40u << 20, 'a');
  PutBacking("plain.bin", data);
  auto e = fs_->Lookup(kRootIno, "plain.bin");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Handle* h = OpenOk(e->ino, O_RDONLY);
  ASSERT_NE(h, nullptr);
  std::string first(1u << 20, '\0');
  auto got = fs_->Read(h, first.data(), first.size(), 0);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(*got, first.size());
  // A window past the first read is fetching without any further read.
  EXPECT_GE(PrefetchedAtLeast(8u << 20), 8u << 20);
  EXPECT_EQ(ReadAll(h), data);  // every byte, prefetched or not, is the file's
  fs_->Release(h);
}

TEST_F(ReadAheadTest, ReaderThatJumpsGetsNone) {
  PutBacking("random.bin", Pattern(40u << 20, 'r'));
  auto e = fs_->Lookup(kRootIno, "random.bin");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Handle* h = OpenOk(e->ino, O_RDONLY);
  ASSERT_NE(h, nullptr);
  char buf[4096];
  ASSERT_TRUE(fs_->Read(h, buf, sizeof(buf), 30u << 20).ok());
  ASSERT_TRUE(fs_->Read(h, buf, sizeof(buf), 5u << 20).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(Prefetched(), 0u);
  fs_->Release(h);
}

}  // namespace
}  // namespace ckptfs::fs
