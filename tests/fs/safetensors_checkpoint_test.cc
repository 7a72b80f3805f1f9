// Hugging Face safetensors checkpoints in the filesystem (issue 22): indexed when their
// index commits, with checksums from the write path, and prefetched when a load opens the
// index, like a DCP checkpoint when its `.metadata` is opened.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "common/control_names.h"
#include "tests/fs/fs_fixture.h"

namespace ckptfs::fs {
namespace {

using json = nlohmann::json;

// One tensor `name` of `n` uint8 in a safetensors file.
std::string Safetensors(const std::string& name, size_t n, char seed) {
  json h = {{name, {{"dtype", "U8"}, {"shape", {n}}, {"data_offsets", {0, n}}}}};
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  std::string data(n, '\0');
  for (size_t i = 0; i < n; ++i) data[i] = static_cast<char>(seed + i * 131 + (i >> 12));
  return out + text + data;
}

std::string Index() {
  return json{{"metadata", {{"total_size", 1}}},
              {"weight_map",
               {{"a", "model-00001-of-00002.safetensors"},
                {"b", "model-00002-of-00002.safetensors"}}}}
      .dump();
}

class SafetensorsCheckpointTest : public FaultyFsTest {
 protected:
  void SetUp() override {
    cache_bytes_ = 64u << 20;
    Start();
  }
  uint64_t Prefetched() {
    return json::parse(fs_->control()->StatsJson()).value("prefetched_bytes", uint64_t{0});
  }
};

TEST_F(SafetensorsCheckpointTest, CommittedThroughTheMountIsIndexedWithWritePathChecksums) {
  auto dir = fs_->Mkdir(kRootIno, "hf", 0755);
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  WriteFile(dir->ino, "model-00001-of-00002.safetensors", Safetensors("a", 3u << 20, 'a'));
  WriteFile(dir->ino, "model-00002-of-00002.safetensors", Safetensors("b", 5u << 20, 'b'));
  WriteFile(dir->ino, "model.safetensors.index.json", Index());
  // The commit queues the build; verify then finds every tensor checksummed, none of them
  // read back to be (the write path's block CRCs cover them).
  json report;
  ASSERT_TRUE(Eventually([&] {
    auto v = fs_->GetXattr(dir->ino, kVerifyXattr);
    if (!v.ok()) return false;
    report = json::parse(*v);
    return report.value("items", 0) == 2 && report.value("unchecked", 1) == 0;
  })) << report.dump();
  EXPECT_EQ(report.value("bad_count", 1), 0) << report.dump();
}

TEST_F(SafetensorsCheckpointTest, OpeningTheIndexToLoadPrefetchesTheShards) {
  std::filesystem::create_directories(BackingPath("hf"));
  const std::string a = Safetensors("a", 6u << 20, 'a'), b = Safetensors("b", 6u << 20, 'b');
  PutBacking("hf/model-00001-of-00002.safetensors", a);
  PutBacking("hf/model-00002-of-00002.safetensors", b);
  PutBacking("hf/model.safetensors.index.json", Index());
  auto dir = fs_->Lookup(kRootIno, "hf");
  ASSERT_TRUE(dir.ok());
  auto index = fs_->Lookup(dir->ino, "model.safetensors.index.json");
  ASSERT_TRUE(index.ok());
  EXPECT_EQ(Prefetched(), 0u);
  Handle* h = OpenOk(index->ino, O_RDONLY);
  ASSERT_NE(h, nullptr);
  // Both shards are fetched into the cache before any of their bytes is read.
  EXPECT_TRUE(Eventually([&] { return Prefetched() >= a.size() + b.size() - (2u << 20); }))
      << Prefetched();
  fs_->Release(h);
  auto shard = fs_->Lookup(dir->ino, "model-00002-of-00002.safetensors");
  ASSERT_TRUE(shard.ok());
  Handle* s = OpenOk(shard->ino, O_RDONLY);
  EXPECT_EQ(ReadAll(s), b);
  fs_->Release(s);
}

}  // namespace
}  // namespace ckptfs::fs
