// MemoryTier with replication (issue 42): with a replication set, a whole checkpoint waits
// for a peer before it commits (and before it evicts the older ones); trackers are handed
// over on close; the manifest and bytes a
// holder pulls; what a restart is given back (adopted by the tree when the view first looks
// at it) and what it reports lost. And MemoryReplicas, the holder's store of other nodes'
// units. Real torch 1.13 checkpoint files.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "store/memory/memory_replicas.h"
#include "store/memory/memory_tier.h"
#include "store/primitives/crc32c.h"

namespace ckptfs::store {
namespace {

constexpr uint64_t kBlock = 64 << 10;
const std::filesystem::path kFixture =
    std::filesystem::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp/torch113_basic_single_file";

std::string ReadFixture(const std::string& name) {
  std::ifstream f(kFixture / name, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// What the tier handed to replication, in order (the real one queues the same way).
struct Handed : MemoryReplication {
  struct Unit {
    std::string tree, path;
    bool checkpoint;
    uint64_t seq;
  };
  void Replicate(const std::string& tree, const std::string& path, bool checkpoint,
                 uint64_t seq) override {
    units.push_back({tree, path, checkpoint, seq});
  }
  void Gather(const std::string& tree, const std::string& path, uint64_t seq) override {
    gathers.push_back({tree, path, true, seq});
  }
  void MirrorDir(const std::string& tree, const std::string& path) override {
    mirrored.push_back(tree + "/" + path);
  }
  void MirrorRmdir(const std::string& tree, const std::string& path) override {
    removed.push_back(tree + "/" + path);
  }
  void MirrorRename(const std::string& tree, const std::string& from,
                    const std::string& to) override {
    renamed.push_back(tree + "/" + from + " -> " + to);
  }
  std::vector<std::string> removed, renamed;
  Result<size_t> ReadRemote(const MemRemoteFile& f, char*, size_t, uint64_t) override {
    return Status(Code::kIo, "no peers in this test: " + f.file);
  }
  std::vector<Unit> units;
  std::vector<Unit> gathers;
  std::vector<std::string> mirrored;
};

MemoryTier::Fill FillFrom(const std::string& bytes) {
  auto at = std::make_shared<size_t>(0);
  return [&bytes, at](char* out, size_t n) {
    std::memcpy(out, bytes.data() + *at, n);
    *at += n;
    return Status::Ok();
  };
}

class MemoryTierReplicationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MemoryTierOptions o;
    o.budget_bytes = 64 * kBlock;
    o.block_bytes = kBlock;
    tier_ = std::make_unique<MemoryTier>(o);
    root_ = tier_->TreeRoot(/*key=*/42, "run/mem");
  }

  Status Put(uint64_t dir, const std::string& name, const std::string& bytes) {
    auto f = tier_->Create(dir, name, 0644, 0, 0, false);
    if (!f.ok()) return f.status();
    Status st = tier_->Write(f->id, 0, bytes.size(), FillFrom(bytes));
    tier_->Closed(f->id);
    return st;
  }

  uint64_t Save(const std::string& name) {
    auto d = tier_->Mkdir(root_, name, 0755, 0, 0);
    EXPECT_TRUE(d.ok());
    EXPECT_TRUE(Put(d->id, "__0_0.distcp", ReadFixture("__0_0.distcp")).ok());
    EXPECT_TRUE(Put(d->id, ".metadata", ReadFixture(".metadata")).ok());
    return d->id;
  }

  std::string StateOf(const std::string& path) {
    for (const MemCheckpoint& c : tier_->Checkpoints()) {
      if (c.path == path) return c.state;
    }
    return "<absent>";
  }

  std::unique_ptr<MemoryTier> tier_;
  uint64_t root_ = 0;
  Handed handed_;
};

TEST_F(MemoryTierReplicationTest, ACheckpointCommitsOnlyOnceAPeerHoldsItThenEvictsTheOlder) {
  Save("step1");  // no replication yet: committed in memory alone
  EXPECT_EQ(StateOf("run/mem/step1"), "committed");
  tier_->SetReplication(&handed_);
  Save("step2");
  ASSERT_EQ(handed_.units.size(), 1u);
  const Handed::Unit u = handed_.units[0];
  EXPECT_EQ(u.tree, "run/mem");
  EXPECT_EQ(u.path, "step2");
  EXPECT_TRUE(u.checkpoint);
  EXPECT_EQ(StateOf("run/mem/step2"), "replicating");
  EXPECT_EQ(StateOf("run/mem/step1"), "committed") << "the older one stays until then";

  // What the holder pulls: every file, its size and CRC32C, and its bytes.
  auto m = tier_->Manifest(u.tree, u.path, u.seq);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->files.size(), 2u);
  EXPECT_EQ(m->files[0].name, ".metadata");
  EXPECT_EQ(m->files[1].name, "__0_0.distcp");
  const std::string shard = ReadFixture("__0_0.distcp");
  EXPECT_EQ(m->files[1].size, shard.size());
  EXPECT_EQ(m->files[1].crc32c, Crc32c(shard.data(), shard.size()));
  std::string got(shard.size(), '\0');
  auto n = tier_->ReadUnit(u.tree, u.path, u.seq, "__0_0.distcp", got.data(), got.size(), 0);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(got, shard);
  EXPECT_EQ(tier_->Manifest(u.tree, u.path, u.seq + 1).status().code(), Code::kNotFound)
      << "another version is not served as this one";

  tier_->HandedOver(u.tree, u.path, u.seq, std::string("10.0.0.2:7470"));
  EXPECT_EQ(StateOf("run/mem/step2"), "committed");
  EXPECT_EQ(StateOf("run/mem/step1"), "<absent>");
  EXPECT_EQ(tier_->Lookup(root_, "step1").status().code(), Code::kNotFound);
  for (const MemCheckpoint& c : tier_->Checkpoints()) {
    EXPECT_EQ(c.holder, "10.0.0.2:7470");
    EXPECT_EQ(c.where, "memory: this node + replica on 10.0.0.2:7470");
  }
  EXPECT_EQ(tier_->Stats().replicated_checkpoints, 1u);
}

TEST_F(MemoryTierReplicationTest, ACheckpointNoPeerTookStaysUncommittedWithTheOlderOne) {
  tier_->SetReplication(&handed_);
  Save("step1");
  tier_->HandedOver("run/mem", "step1", handed_.units[0].seq, std::string("peer"));
  Save("step2");
  tier_->HandedOver("run/mem", "step2", handed_.units[1].seq,
                    Status(Code::kIo, "every other node is down"));
  EXPECT_EQ(StateOf("run/mem/step2"), "unreplicated");
  EXPECT_EQ(StateOf("run/mem/step1"), "committed");
  EXPECT_EQ(tier_->Stats().unreplicated_checkpoints, 1u);
  // A late answer for a version that is gone changes nothing.
  tier_->HandedOver("run/mem", "step2", handed_.units[1].seq + 7, std::string("peer"));
  EXPECT_EQ(StateOf("run/mem/step2"), "unreplicated");
  // A newer checkpoint that commits supersedes it: it never commits after the newer one.
  Save("step3");
  tier_->HandedOver("run/mem", "step3", handed_.units[2].seq, std::string("peer"));
  EXPECT_EQ(StateOf("run/mem/step3"), "committed");
  EXPECT_EQ(StateOf("run/mem/step2"), "<absent>");
  EXPECT_EQ(StateOf("run/mem/step1"), "<absent>");
}

TEST_F(MemoryTierReplicationTest, ASaveFasterThanReplicationDropsTheOneStillWaitingNotTheCommitted) {
  // Room for two checkpoints and a bit: the committed one and the one being written.
  const uint64_t one = ReadFixture("__0_0.distcp").size() + ReadFixture(".metadata").size();
  MemoryTierOptions o;
  o.block_bytes = kBlock;
  o.budget_bytes = ((2 * one + 4 * kBlock) / kBlock + 2) * kBlock;
  tier_ = std::make_unique<MemoryTier>(o);
  root_ = tier_->TreeRoot(/*key=*/42, "run/mem");
  tier_->SetReplication(&handed_);
  Save("step1");
  tier_->HandedOver("run/mem", "step1", handed_.units[0].seq, std::string("peer"));
  Save("step2");  // its replica is still being pulled...
  ASSERT_EQ(StateOf("run/mem/step2"), "replicating");
  auto tracker = tier_->Create(root_, "latest", 0644, 0, 0, false);
  ASSERT_TRUE(tracker.ok());
  const std::string names = "step2";
  ASSERT_TRUE(tier_->Write(tracker->id, 0, names.size(), FillFrom(names)).ok());
  tier_->Closed(tracker->id);
  // ...when the next save begins: it takes step2's room instead of failing with ENOSPC.
  Save("step3");
  EXPECT_EQ(StateOf("run/mem/step3"), "replicating");
  EXPECT_EQ(StateOf("run/mem/step2"), "<absent>");
  EXPECT_EQ(StateOf("run/mem/step1"), "committed") << "the tree always keeps one to load";
  EXPECT_EQ(tier_->Lookup(root_, "latest").status().code(), Code::kNotFound)
      << "a tracker naming the dropped one vanishes with it";
  EXPECT_EQ(tier_->Stats().superseded_for_room, 1u);
  EXPECT_EQ(tier_->Stats().nospace_writes, 0u);
  // A late answer for the dropped one changes nothing; the newest commits as usual.
  tier_->HandedOver("run/mem", "step2", handed_.units[1].seq, std::string("peer"));
  EXPECT_EQ(StateOf("run/mem/step2"), "<absent>");
  tier_->HandedOver("run/mem", "step3", handed_.units.back().seq, std::string("peer"));
  EXPECT_EQ(StateOf("run/mem/step3"), "committed");
  EXPECT_EQ(StateOf("run/mem/step1"), "<absent>");
}

TEST_F(MemoryTierReplicationTest, ATrackerIsHandedOverOnEachCloseAShardIsNot) {
  tier_->SetReplication(&handed_);
  auto d = tier_->Mkdir(root_, "step1", 0755, 0, 0);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(Put(d->id, "__0_0.distcp", ReadFixture("__0_0.distcp")).ok());
  EXPECT_TRUE(handed_.units.empty());
  ASSERT_TRUE(Put(root_, "latest", "step1").ok());
  ASSERT_EQ(handed_.units.size(), 1u);
  EXPECT_FALSE(handed_.units[0].checkpoint);
  EXPECT_EQ(handed_.units[0].path, "latest");
  auto m = tier_->Manifest("run/mem", "latest", handed_.units[0].seq);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->files.size(), 1u);
  EXPECT_EQ(m->files[0].name, "");
  EXPECT_EQ(m->files[0].size, 5u);
  ASSERT_TRUE(Put(root_, "latest", "step2").ok());
  ASSERT_EQ(handed_.units.size(), 2u);
  EXPECT_GT(handed_.units[1].seq, handed_.units[0].seq);
  // A tracker written by rename is handed over under its new name; a directory's rename
  // is mirrored to the other nodes instead.
  ASSERT_TRUE(Put(root_, "latest.tmp", "step1").ok());
  ASSERT_EQ(handed_.units.size(), 3u);
  ASSERT_TRUE(tier_->Rename(root_, "latest.tmp", root_, "latest", false).ok());
  ASSERT_EQ(handed_.units.size(), 4u);
  EXPECT_EQ(handed_.units[3].path, "latest");
  EXPECT_GT(handed_.units[3].seq, handed_.units[2].seq);
  EXPECT_TRUE(tier_->Manifest("run/mem", "latest", handed_.units[3].seq).ok());
  EXPECT_TRUE(handed_.renamed.empty());
  ASSERT_TRUE(tier_->Rename(root_, "step1", root_, "step1.old", false).ok());
  EXPECT_EQ(handed_.renamed, std::vector<std::string>{"run/mem/step1 -> step1.old"});
  EXPECT_EQ(handed_.units.size(), 4u) << "a directory nothing of which was on its way";
}

TEST_F(MemoryTierReplicationTest, AnUnreplicatedCheckpointIsListedWithItsTreePathAndVersion) {
  tier_->SetReplication(&handed_);
  Save("step1");
  tier_->HandedOver("run/mem", "step1", handed_.units[0].seq, Status(Code::kNoSpace, "full"));
  const std::vector<MemCheckpoint> list = tier_->Checkpoints();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].state, "unreplicated");
  EXPECT_EQ(list[0].tree, "run/mem");
  EXPECT_EQ(list[0].in_tree, "step1");
  EXPECT_EQ(list[0].seq, handed_.units[0].seq);
  // Offered again and taken: committed.
  tier_->HandedOver("run/mem", "step1", list[0].seq, std::string("peer"));
  EXPECT_EQ(StateOf("run/mem/step1"), "committed");
  EXPECT_TRUE(NamesCheckpoint("step1\n", "step1"));
  EXPECT_TRUE(NamesCheckpoint("15", "iter_0000015"));
  EXPECT_FALSE(NamesCheckpoint("step1", "step2"));
}

TEST_F(MemoryTierReplicationTest, ARestoreIsAdoptedByItsTreeAndALostOneTakesItsTracker) {
  MemoryTierOptions o;
  o.budget_bytes = 64 * kBlock;
  o.block_bytes = kBlock;
  MemoryTier fresh(o);  // a restarted daemon: no tree looked at yet
  fresh.restore_gate().Close();
  const std::string shard = ReadFixture("__0_0.distcp"), md = ReadFixture(".metadata");
  ASSERT_TRUE(
      fresh.RestoreFile("run/mem", "step2/__0_0.distcp", shard.size(), FillFrom(shard)).ok());
  ASSERT_TRUE(fresh.RestoreFile("run/mem", "step2/.metadata", md.size(), FillFrom(md)).ok());
  fresh.FinishRestore("run/mem", "step2", 99, "peer:1", shard.size() + md.size(), true);
  const std::string tracker = "step1";
  ASSERT_TRUE(fresh.RestoreFile("run/mem", "latest", tracker.size(), FillFrom(tracker)).ok());
  ASSERT_TRUE(fresh.RestoreFile("other", "old/latest", tracker.size(), FillFrom(tracker)).ok());
  fresh.NoteLost("run/mem", "step1", "no peer holds it");
  fresh.restore_gate().Open();
  fresh.restore_gate().Wait(std::chrono::milliseconds(1));  // returns at once

  // The view's first look at the marked directory: the restored tree is that one.
  const uint64_t root = fresh.TreeRoot(/*key=*/77, "run/mem");
  auto d = fresh.Lookup(root, "step2");
  ASSERT_TRUE(d.ok());
  auto f = fresh.Lookup(d->id, "__0_0.distcp");
  ASSERT_TRUE(f.ok());
  std::string got(f->size, '\0');
  ASSERT_TRUE(fresh.Read(f->id, got.data(), got.size(), 0).ok());
  EXPECT_EQ(got, shard);
  EXPECT_EQ(fresh.Lookup(root, "latest").status().code(), Code::kNotFound)
      << "a tracker naming the lost checkpoint vanishes with it";
  std::map<std::string, MemCheckpoint> listed;
  for (const MemCheckpoint& c : fresh.Checkpoints()) listed[c.path] = c;
  EXPECT_EQ(listed["run/mem/step2"].state, "committed");
  EXPECT_EQ(listed["run/mem/step2"].holder, "peer:1");
  EXPECT_EQ(listed["run/mem/step1"].state, "lost");
  const MemoryTierStats s = fresh.Stats();
  EXPECT_EQ(s.restored_checkpoints, 1u);
  EXPECT_EQ(s.lost_checkpoints, 1u);
  EXPECT_EQ(s.trackers_dropped, 1u);
  // The other tree's tracker names a checkpoint of its own tree: kept, and adopted too.
  const uint64_t other = fresh.TreeRoot(78, "other");
  auto old = fresh.Lookup(other, "old");
  ASSERT_TRUE(old.ok());
  EXPECT_TRUE(fresh.Lookup(old->id, "latest").ok());
  // A restore that failed part way leaves nothing of it.
  fresh.FinishRestore("run/mem", "step2", 99, "", 0, /*whole=*/false);
  EXPECT_EQ(fresh.Lookup(root, "step2").status().code(), Code::kNotFound);
}

TEST(MemoryReplicas, AReplicaIsReplacedByTheNewerCheckpointOfItsTreeAndOriginOnly) {
  MemoryTierOptions o;
  o.budget_bytes = 1000;
  o.block_bytes = kBlock;
  MemoryTier tier(o);
  auto unit = [](const std::string& tree, const std::string& path, bool ckpt, uint64_t seq,
                 uint64_t size) {
    MemUnit u;
    u.tree = tree;
    u.path = path;
    u.checkpoint = ckpt;
    u.seq = seq;
    u.files.push_back({ckpt ? "a" : "", size, 0});
    return u;
  };
  {
    MemoryReplicas r(&tier);
    auto put = [&](uint32_t origin, MemUnit u, std::string content = "") {
      ASSERT_TRUE(r.Reserve(u.bytes()).ok());
      MemReplica rep;
      rep.origin = origin;
      if (content.empty()) content = std::string(u.bytes(), 'x');
      rep.data.push_back(std::make_shared<std::string>(content));
      rep.unit = std::move(u);
      r.Put(std::move(rep));
    };
    put(0, unit("t", "s1", true, 1, 300));
    put(1, unit("t", "s1", true, 1, 300));  // another origin: kept apart
    put(0, unit("t", "latest", false, 2, 5));
    put(0, unit("t", "names_s1", false, 2, 3), "s1\n");  // a tracker naming s1
    EXPECT_EQ(tier.Stats().replica_bytes, 608u);
    EXPECT_EQ(r.Reserve(400).code(), Code::kNoSpace) << "replicas share the tier's budget";
    put(0, unit("t", "s2", true, 3, 300));  // replaces origin 0's s1 only, and its tracker
    EXPECT_EQ(tier.Stats().replica_bytes, 605u);
    EXPECT_FALSE(r.Has(0, "t", "names_s1", 2)) << "a tracker naming an evicted one goes too";
    EXPECT_FALSE(r.Has(0, "t", "s1", 1));
    EXPECT_TRUE(r.Has(1, "t", "s1", 1));
    EXPECT_TRUE(r.Has(0, "t", "s2", 3));
    std::vector<MemUnit> idx = r.Index(0);
    ASSERT_EQ(idx.size(), 2u);
    EXPECT_TRUE(idx[0].checkpoint) << "checkpoints first";
    EXPECT_EQ(idx[0].path, "s2");
    EXPECT_EQ(idx[1].path, "latest");
    char buf[8];
    auto n = r.Read(0, "t", "latest", 2, "", buf, sizeof(buf), 2);
    ASSERT_TRUE(n.ok());
    EXPECT_EQ(*n, 3u);
    EXPECT_EQ(r.Read(0, "t", "latest", 1, "", buf, sizeof(buf), 0).status().code(),
              Code::kNotFound);
  }
  EXPECT_EQ(tier.Stats().used_bytes, 0u) << "the store gives its budget back";
}

}  // namespace
}  // namespace ckptfs::store
