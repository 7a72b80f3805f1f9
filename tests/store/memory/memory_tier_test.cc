// MemoryTier (issue 42): files of memory-only trees. Budget (a write that does not fit
// fails and changes nothing), the commit of a checkpoint by its `.metadata` (only with every
// file it names), the newest commit evicting older checkpoints and the trackers naming them,
// renames across trees, and the stop. Real torch 1.13 checkpoint files (tests/fixtures).
#include "store/memory/memory_tier.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace ckptfs::store {
namespace {

constexpr uint64_t kBlock = 64 << 10;
const std::filesystem::path kFixture =
    std::filesystem::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp/torch113_basic_single_file";

std::string ReadFixture(const std::string& name) {
  std::ifstream f(kFixture / name, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

class MemoryTierTest : public ::testing::Test {
 protected:
  void Make(uint64_t blocks) {
    MemoryTierOptions o;
    o.budget_bytes = blocks * kBlock;
    o.block_bytes = kBlock;
    tier_ = std::make_unique<MemoryTier>(o);
    root_ = tier_->TreeRoot(/*key=*/42, "ckpts");
  }

  Status Put(uint64_t dir, const std::string& name, const std::string& bytes) {
    auto f = tier_->Create(dir, name, 0644, 0, 0, false);
    if (!f.ok()) return f.status();
    size_t at = 0;
    Status st = tier_->Write(f->id, 0, bytes.size(), [&](char* out, size_t n) {
      std::memcpy(out, bytes.data() + at, n);
      at += n;
      return Status::Ok();
    });
    tier_->Closed(f->id);
    return st;
  }

  std::string Get(uint64_t dir, const std::string& name) {
    auto a = tier_->Lookup(dir, name);
    if (!a.ok()) return "<" + a.status().ToString() + ">";
    std::string out(a->size, '\0');
    auto n = tier_->Read(a->id, out.data(), out.size(), 0);
    EXPECT_TRUE(n.ok());
    return out;
  }

  // A torch 1.13 DCP save into `name`: the shard, then `.metadata.tmp` renamed.
  uint64_t SaveCheckpoint(const std::string& name) {
    auto d = tier_->Mkdir(root_, name, 0755, 0, 0);
    EXPECT_TRUE(d.ok());
    EXPECT_TRUE(Put(d->id, "__0_0.distcp", ReadFixture("__0_0.distcp")).ok());
    EXPECT_TRUE(Put(d->id, ".metadata.tmp", ReadFixture(".metadata")).ok());
    EXPECT_TRUE(tier_->Rename(d->id, ".metadata.tmp", d->id, ".metadata", false).ok());
    return d->id;
  }

  std::unique_ptr<MemoryTier> tier_;
  uint64_t root_ = 0;
};

TEST_F(MemoryTierTest, AWriteThatDoesNotFitFailsWholeAndLeavesWhatIsThere) {
  Make(4);
  const std::string a(3 * kBlock, 'a');
  ASSERT_TRUE(Put(root_, "f", a).ok());
  auto f = tier_->Lookup(root_, "f");
  ASSERT_TRUE(f.ok());
  bool filled = false;
  Status st = tier_->Write(f->id, 3 * kBlock, 2 * kBlock, [&](char*, size_t) {
    filled = true;
    return Status::Ok();
  });
  EXPECT_EQ(st.code(), Code::kNoSpace) << st.ToString();
  EXPECT_FALSE(filled) << "a refused write copied bytes";
  EXPECT_EQ(Get(root_, "f"), a);
  EXPECT_EQ(tier_->Stats().used_bytes, 3 * kBlock);
  EXPECT_EQ(tier_->Stats().nospace_writes, 1u);
  // A rewrite in place needs no new block; a hole reads zeros; unlink frees the budget.
  ASSERT_TRUE(tier_->Write(f->id, 10, 3, [](char* out, size_t n) {
    std::memset(out, 'b', n);
    return Status::Ok();
  }).ok());
  EXPECT_EQ(Get(root_, "f").substr(8, 7), "aabbbaa");
  ASSERT_TRUE(tier_->Unlink(root_, "f").ok());
  EXPECT_EQ(tier_->Stats().used_bytes, 0u);
  EXPECT_EQ(tier_->GetAttr(f->id).status().code(), Code::kNotFound);
}

TEST_F(MemoryTierTest, ACheckpointCommitsWithItsMetadataAndTheNewestEvictsTheOlderOnes) {
  Make(64);
  const uint64_t one = SaveCheckpoint("iter_0000001");
  ASSERT_TRUE(Put(root_, "latest_checkpointed_iteration.txt", "1\n").ok());
  auto list = tier_->Checkpoints();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].path, "ckpts/iter_0000001");
  EXPECT_EQ(list[0].state, "committed");
  EXPECT_EQ(tier_->Stats().commits, 1u);

  // The next save is written while the first stays whole; its commit evicts the first and
  // the tracker that names it (the new tracker is written after, as Megatron does).
  auto two = tier_->Mkdir(root_, "iter_0000002", 0755, 0, 0);
  ASSERT_TRUE(two.ok());
  ASSERT_TRUE(Put(two->id, "__0_0.distcp", ReadFixture("__0_0.distcp")).ok());
  EXPECT_EQ(Get(one, "__0_0.distcp"), ReadFixture("__0_0.distcp")) << "the older one is intact";
  ASSERT_TRUE(Put(two->id, ".metadata", ReadFixture(".metadata")).ok());  // written in place
  EXPECT_EQ(tier_->Lookup(root_, "iter_0000001").status().code(), Code::kNotFound);
  EXPECT_EQ(tier_->Lookup(root_, "latest_checkpointed_iteration.txt").status().code(),
            Code::kNotFound)
      << "a tracker naming an evicted checkpoint must vanish with it";
  EXPECT_EQ(tier_->GetAttr(one).status().code(), Code::kNotFound);
  const MemoryTierStats s = tier_->Stats();
  EXPECT_EQ(s.commits, 2u);
  EXPECT_EQ(s.evicted_checkpoints, 1u);
  EXPECT_EQ(s.trackers_dropped, 1u);
  EXPECT_EQ(Get(two->id, "__0_0.distcp"), ReadFixture("__0_0.distcp"));
  // Another tree is another run: untouched by this tree's commits.
  const uint64_t other = tier_->TreeRoot(7, "other");
  auto o = tier_->Mkdir(other, "step", 0755, 0, 0);
  ASSERT_TRUE(o.ok());
  ASSERT_TRUE(Put(o->id, "__0_0.distcp", ReadFixture("__0_0.distcp")).ok());
  ASSERT_TRUE(Put(o->id, ".metadata", ReadFixture(".metadata")).ok());
  EXPECT_TRUE(tier_->Lookup(root_, "iter_0000002").ok());
  EXPECT_EQ(tier_->Rename(root_, "iter_0000002", other, "moved", false).code(),
            Code::kCrossDevice);
}

TEST_F(MemoryTierTest, AMetadataNamingAShortOrMissingShardDoesNotCommit) {
  Make(64);
  auto d = tier_->Mkdir(root_, "step1", 0755, 0, 0);
  ASSERT_TRUE(d.ok());
  const std::string shard = ReadFixture("__0_0.distcp");
  ASSERT_TRUE(Put(d->id, "__0_0.distcp", shard.substr(0, shard.size() / 2)).ok());
  ASSERT_TRUE(Put(d->id, ".metadata", ReadFixture(".metadata")).ok());
  EXPECT_EQ(tier_->Stats().commits, 0u);
  EXPECT_EQ(tier_->Stats().refused_commits, 1u);
  ASSERT_EQ(tier_->Checkpoints().size(), 1u);
  EXPECT_EQ(tier_->Checkpoints()[0].state, "writing");
}

TEST_F(MemoryTierTest, TheBudgetHoldsTheCommittedCheckpointWhileTheNextDoesNotFit) {
  const uint64_t shard_blocks = (ReadFixture("__0_0.distcp").size() + kBlock - 1) / kBlock;
  Make(2 * shard_blocks + 2);  // one checkpoint (shard + .metadata) and a bit
  SaveCheckpoint("a");
  auto b = tier_->Mkdir(root_, "b", 0755, 0, 0);
  ASSERT_TRUE(b.ok());
  const std::string big((shard_blocks + 2) * kBlock, 'x');
  EXPECT_EQ(Put(b->id, "__0_0.distcp", big).code(), Code::kNoSpace);
  EXPECT_EQ(Get(tier_->Lookup(root_, "a")->id, "__0_0.distcp"), ReadFixture("__0_0.distcp"))
      << "a save that does not fit must leave the committed one intact";
}

TEST_F(MemoryTierTest, TheStopDropsEveryTreeAndCountsTheCommittedOnesLost) {
  Make(64);
  SaveCheckpoint("a");
  EXPECT_FALSE(tier_->TreeEmpty(42));
  tier_->DropAll();
  EXPECT_EQ(tier_->Stats().lost_checkpoints, 1u);
  EXPECT_EQ(tier_->Stats().used_bytes, 0u);
  EXPECT_TRUE(tier_->TreeEmpty(42));
  EXPECT_EQ(tier_->Lookup(root_, "a").status().code(), Code::kNotFound);
}

}  // namespace
}  // namespace ckptfs::store
