// MemoryParts (issue 42): a memory-only checkpoint written through two nodes. Two tiers
// stand for the two daemons; the replication between them is played by the test as the peer
// wire would (store/peer/memory_gather.cc): node 0 (DCP's coordinator) writes __0_0.distcp
// and `.metadata`, node 1 writes __1_0.distcp..__3_0.distcp. Real torch 1.13 files.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "store/memory/memory_parts.h"
#include "store/memory/memory_tier.h"

namespace ckptfs::store {
namespace {

constexpr uint64_t kBlock = 64 << 10;
const std::filesystem::path kFixture =
    std::filesystem::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp/torch113_4rank_single_file";

std::string ReadFixture(const std::string& name) {
  std::ifstream f(kFixture / name, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// One node's replication: records what the tier asks; remote reads go to the other node's
// tier as `file/` requests do (ReadUnit of the writer's part at its version).
struct Wire : MemoryReplication {
  void Replicate(const std::string& tree, const std::string& path, bool, uint64_t seq) override {
    handed.push_back({tree + "/" + path, seq});
  }
  void Gather(const std::string& tree, const std::string& path, uint64_t seq) override {
    gathers.push_back({tree + "/" + path, seq});
  }
  void MirrorDir(const std::string& tree, const std::string& path) override {
    if (other_parts != nullptr) {
      EXPECT_TRUE(other_parts->MakeDirs(tree, path).ok());
    }
  }
  void MirrorRmdir(const std::string& tree, const std::string& path) override {
    if (other_parts != nullptr) rmdirs.push_back(other_parts->RemoveDir(tree, path));
  }
  void MirrorRename(const std::string& tree, const std::string& from,
                    const std::string& to) override {
    if (other_parts != nullptr) renames.push_back(other_parts->RenameDir(tree, from, to));
  }
  std::vector<Status> rmdirs, renames;  // the other node's answers
  Result<size_t> ReadRemote(const MemRemoteFile& f, char* out, size_t len,
                            uint64_t offset) override {
    ++remote_reads;
    return other->ReadUnit(f.tree, f.unit, f.seq, f.file, out, len, offset);
  }
  std::vector<std::pair<std::string, uint64_t>> handed, gathers;
  MemoryTier* other = nullptr;
  MemoryParts* other_parts = nullptr;
  int remote_reads = 0;
};

MemoryTier::Fill FillFrom(const std::string& bytes) {
  auto at = std::make_shared<size_t>(0);
  return [&bytes, at](char* out, size_t n) {
    std::memcpy(out, bytes.data() + *at, n);
    *at += n;
    return Status::Ok();
  };
}

class MemoryPartsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MemoryTierOptions o;
    o.budget_bytes = 64 * kBlock;
    o.block_bytes = kBlock;
    for (int i = 0; i < 2; ++i) {
      tier_[i] = std::make_unique<MemoryTier>(o);
      parts_[i] = std::make_unique<MemoryParts>(tier_[i].get());
      root_[i] = tier_[i]->TreeRoot(/*key=*/42, "run/mem");
    }
    for (int i = 0; i < 2; ++i) {
      wire_[i].other = tier_[1 - i].get();
      wire_[i].other_parts = parts_[1 - i].get();
      tier_[i]->SetReplication(&wire_[i]);
    }
  }
  void TearDown() override {
    for (int i = 0; i < 2; ++i) tier_[i]->SetReplication(nullptr);
  }

  void Put(int node, uint64_t dir, const std::string& name) {
    auto f = tier_[node]->Create(dir, name, 0644, 0, 0, false);
    ASSERT_TRUE(f.ok());
    const std::string bytes = ReadFixture(name);
    ASSERT_TRUE(tier_[node]->Write(f->id, 0, bytes.size(), FillFrom(bytes)).ok());
    tier_[node]->Closed(f->id);
  }

  std::map<std::string, MemCheckpoint> Listed(int node) {
    std::map<std::string, MemCheckpoint> out;
    for (const MemCheckpoint& c : tier_[node]->Checkpoints()) out[c.path] = c;
    return out;
  }

  std::string ReadAll(int node, uint64_t dir, const std::string& name) {
    auto a = tier_[node]->Lookup(dir, name);
    EXPECT_TRUE(a.ok()) << name;
    if (!a.ok()) return "";
    std::string out(a->size, '\0');
    auto n = tier_[node]->Read(a->id, out.data(), out.size(), 0);
    EXPECT_TRUE(n.ok()) << n.status().ToString();
    return out.substr(0, n.ok() ? *n : 0);
  }

  // Node 0 makes the directory (node 1 gets it: the mirror), the ranks write, node 0's
  // `.metadata` last. Returns the directory's id on each node.
  std::pair<uint64_t, uint64_t> Write(const std::string& name, bool node1_writes_all = true) {
    auto d0 = tier_[0]->Mkdir(root_[0], name, 0755, 0, 0);
    EXPECT_TRUE(d0.ok());
    auto d1 = tier_[1]->Lookup(root_[1], name);
    EXPECT_TRUE(d1.ok()) << "the mkdir was not mirrored";
    Put(0, d0->id, "__0_0.distcp");
    for (const char* f : {"__1_0.distcp", "__2_0.distcp", "__3_0.distcp"}) {
      if (node1_writes_all || std::string(f) != "__3_0.distcp") Put(1, d1->id, f);
    }
    Put(0, d0->id, ".metadata");
    return {d0->id, d1->id};
  }

  // Checkpoint `name` written by Write() and gathered at `seq`: node 0's part and node 1's
  // handed over, node 0 commits it, node 1 applies the commit (the wire's steps in order).
  void Commit(const std::string& name, uint64_t seq) {
    tier_[0]->HandedOver("run/mem", name, seq, std::string("node1:7"));
    ASSERT_TRUE(parts_[1]->Seal("run/mem", name, seq).ok());
    tier_[1]->HandedOver("run/mem", name, seq, std::string("node0:7"));
    auto part = parts_[1]->Seal("run/mem", name, seq);
    ASSERT_TRUE(part.ok());
    part->rank = 1;
    ASSERT_TRUE(parts_[0]->CommitGathered("run/mem", name, seq, {*part}).ok());
    auto whole = parts_[0]->Whole("run/mem", name, seq, 0);
    ASSERT_TRUE(whole.ok());
    ASSERT_TRUE(parts_[1]->ApplyCommit("run/mem", name, seq, *whole, 1).ok());
    ASSERT_EQ(Listed(1)["run/mem/" + name].state, "committed");
  }

  std::unique_ptr<MemoryTier> tier_[2];
  std::unique_ptr<MemoryParts> parts_[2];
  uint64_t root_[2] = {0, 0};
  Wire wire_[2];
};

TEST_F(MemoryPartsTest, CommittedOnlyWithEveryPartReplicatedThenListedAndReadOnBothNodes) {
  auto [d0, d1] = Write("step2");
  // The `.metadata` names files node 0 did not write: it gathers, it does not refuse.
  ASSERT_EQ(wire_[0].gathers.size(), 1u);
  const uint64_t seq = wire_[0].gathers[0].second;
  EXPECT_EQ(Listed(0)["run/mem/step2"].state, "replicating");
  EXPECT_EQ(tier_[0]->Stats().refused_commits, 0u);
  // Node 0's own part is handed over; it stays uncommitted (the others' parts are not in).
  tier_[0]->HandedOver("run/mem", "step2", seq, std::string("node1:7"));
  EXPECT_EQ(Listed(0)["run/mem/step2"].state, "replicating");
  // Node 1 is asked for its part: sealed at the commit's version and replicated.
  auto part = parts_[1]->Seal("run/mem", "step2", seq);
  ASSERT_TRUE(part.ok()) << part.status().ToString();
  EXPECT_EQ(part->holder, "");
  EXPECT_EQ(part->files.size(), 3u);
  ASSERT_EQ(wire_[1].handed.size(), 1u);
  EXPECT_EQ(wire_[1].handed[0].second, seq);
  tier_[1]->HandedOver("run/mem", "step2", seq, std::string("node0:7"));
  EXPECT_EQ(Listed(1)["run/mem/step2"].state, "part") << "a part alone is never committed";
  part = parts_[1]->Seal("run/mem", "step2", seq);  // asked again: held, not sealed twice
  ASSERT_TRUE(part.ok());
  EXPECT_EQ(part->holder, "node0:7");
  EXPECT_EQ(wire_[1].handed.size(), 1u);
  part->rank = 1;

  ASSERT_TRUE(parts_[0]->CommitGathered("run/mem", "step2", seq, {*part}).ok());
  MemCheckpoint c0 = Listed(0)["run/mem/step2"];
  EXPECT_EQ(c0.state, "committed");
  EXPECT_EQ(c0.holder, "node1:7");
  EXPECT_NE(c0.where.find("rank 1 (replica on node0:7)"), std::string::npos) << c0.where;
  // The other nodes are told: node 1 applies the whole listing.
  auto whole = parts_[0]->Whole("run/mem", "step2", seq, /*self=*/0);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(whole->size(), 5u);
  ASSERT_TRUE(parts_[1]->ApplyCommit("run/mem", "step2", seq, *whole, /*self=*/1).ok());
  EXPECT_EQ(Listed(1)["run/mem/step2"].state, "committed");
  EXPECT_EQ(Listed(1)["run/mem/step2"].bytes, c0.bytes);

  // Every file reads back exactly through either node; the other node's files remotely.
  for (const char* f : {".metadata", "__0_0.distcp", "__1_0.distcp", "__3_0.distcp"}) {
    EXPECT_EQ(ReadAll(0, d0, f), ReadFixture(f)) << f;
    EXPECT_EQ(ReadAll(1, d1, f), ReadFixture(f)) << f;
  }
  EXPECT_EQ(wire_[0].remote_reads, 2);
  EXPECT_EQ(wire_[1].remote_reads, 2);
  // A remote file is read-only here.
  auto meta1 = tier_[1]->Lookup(d1, ".metadata");
  ASSERT_TRUE(meta1.ok());
  EXPECT_EQ(tier_[1]->Write(meta1->id, 0, 1, FillFrom("x")).code(), Code::kNotPermitted);
  // Node 0's manifest (what its holder pulls) has its own files only.
  auto m = tier_[0]->Manifest("run/mem", "step2", seq);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->files.size(), 2u);

  // The next two-node checkpoint evicts it on both nodes.
  auto [e0, e1] = Write("step3");
  const uint64_t seq3 = wire_[0].gathers.back().second;
  tier_[0]->HandedOver("run/mem", "step3", seq3, std::string("node1:7"));
  ASSERT_TRUE(parts_[1]->Seal("run/mem", "step3", seq3).ok());
  tier_[1]->HandedOver("run/mem", "step3", seq3, std::string("node0:7"));
  auto p3 = parts_[1]->Seal("run/mem", "step3", seq3);
  ASSERT_TRUE(p3.ok());
  p3->rank = 1;
  ASSERT_TRUE(parts_[0]->CommitGathered("run/mem", "step3", seq3, {*p3}).ok());
  ASSERT_TRUE(
      parts_[1]
          ->ApplyCommit("run/mem", "step3", seq3, *parts_[0]->Whole("run/mem", "step3", seq3, 0), 1)
          .ok());
  for (int n = 0; n < 2; ++n) {
    EXPECT_EQ(Listed(n).count("run/mem/step2"), 0u) << "node " << n;
    EXPECT_EQ(Listed(n)["run/mem/step3"].state, "committed") << "node " << n;
    EXPECT_EQ(tier_[n]->Lookup(root_[n], "step2").status().code(), Code::kNotFound);
  }
  EXPECT_EQ(ReadAll(1, e1, "__0_0.distcp"), ReadFixture("__0_0.distcp"));
}

// A rotation's `rm -r` on one node removes the checkpoint on the other too (its part and
// its listing, rmdir/ on the wire); a directory where the other node still has a file of no
// committed checkpoint (a rank there writing) stays there.
TEST_F(MemoryPartsTest, ARmdirOnOneNodeRemovesTheCheckpointOnTheOtherUnlessARankWritesThere) {
  auto [d0, d1] = Write("step2");
  Commit("step2", wire_[0].gathers.back().second);
  const uint64_t used1 = tier_[1]->Stats().used_bytes;
  ASSERT_GT(used1, 0u);

  // `rm -r step2` through node 0: every name it lists, then the directory.
  auto names = tier_[0]->List(d0);
  ASSERT_TRUE(names.ok());
  for (const auto& [name, attr] : *names) ASSERT_TRUE(tier_[0]->Unlink(d0, name).ok()) << name;
  ASSERT_TRUE(tier_[0]->Rmdir(root_[0], "step2").ok());
  ASSERT_EQ(wire_[0].rmdirs.size(), 1u);
  EXPECT_TRUE(wire_[0].rmdirs[0].ok()) << wire_[0].rmdirs[0].ToString();
  EXPECT_EQ(tier_[1]->Lookup(root_[1], "step2").status().code(), Code::kNotFound);
  EXPECT_EQ(Listed(1).count("run/mem/step2"), 0u);
  EXPECT_LT(tier_[1]->Stats().used_bytes, used1) << "node 1's part is still held";

  // A directory node 0 made and node 1's rank is writing into: node 0's rmdir of it (empty
  // there) leaves node 1's file where it is.
  auto m0 = tier_[0]->Mkdir(root_[0], "step4", 0755, 0, 0);
  ASSERT_TRUE(m0.ok());
  auto m1 = tier_[1]->Lookup(root_[1], "step4");
  ASSERT_TRUE(m1.ok());
  Put(1, m1->id, "__1_0.distcp");
  ASSERT_TRUE(tier_[0]->Rmdir(root_[0], "step4").ok());
  ASSERT_EQ(wire_[0].rmdirs.size(), 2u);
  EXPECT_EQ(wire_[0].rmdirs[1].code(), Code::kNotEmpty);
  EXPECT_EQ(ReadAll(1, m1->id, "__1_0.distcp"), ReadFixture("__1_0.distcp"));
  // Gone on node 1 already: nothing to do, no error.
  EXPECT_TRUE(parts_[1]->RemoveDir("run/mem", "step2").ok());
}

// A save into a temporary directory renamed into place afterwards (Hugging Face's Trainer):
// the rename through node 0 is made on node 1 too, each node's files listed from the other
// follow their writer's renamed part, and every file reads back through both nodes.
TEST_F(MemoryPartsTest, ARenameOnOneNodeIsMadeOnTheOtherAndItsFilesFollow) {
  Write("tmp-step2");
  const uint64_t seq = wire_[0].gathers.back().second;
  Commit("tmp-step2", seq);
  const size_t handed = wire_[0].handed.size() + wire_[1].handed.size();

  ASSERT_TRUE(tier_[0]->Rename(root_[0], "tmp-step2", root_[0], "step2", false).ok());
  ASSERT_EQ(wire_[0].renames.size(), 1u);
  EXPECT_TRUE(wire_[0].renames[0].ok()) << wire_[0].renames[0].ToString();
  for (int n = 0; n < 2; ++n) {
    EXPECT_EQ(tier_[n]->Lookup(root_[n], "tmp-step2").status().code(), Code::kNotFound);
    auto d = tier_[n]->Lookup(root_[n], "step2");
    ASSERT_TRUE(d.ok()) << "node " << n;
    EXPECT_EQ(Listed(n).count("run/mem/tmp-step2"), 0u);
    EXPECT_EQ(Listed(n)["run/mem/step2"].state, "committed") << "node " << n;
    for (const char* f : {".metadata", "__0_0.distcp", "__1_0.distcp", "__3_0.distcp"}) {
      EXPECT_EQ(ReadAll(n, d->id, f), ReadFixture(f)) << "node " << n << ": " << f;
    }
    // Its part is served under the new name (what a holder re-checks and a restore asks).
    EXPECT_TRUE(tier_[n]->Manifest("run/mem", "step2", seq).ok()) << "node " << n;
    EXPECT_FALSE(tier_[n]->Manifest("run/mem", "tmp-step2", seq).ok()) << "node " << n;
  }
  EXPECT_EQ(wire_[0].remote_reads, 2);
  EXPECT_EQ(wire_[1].remote_reads, 2);
  EXPECT_EQ(wire_[0].handed.size() + wire_[1].handed.size(), handed)
      << "a committed part is not handed over again";

  // The other node's answers: a directory it never had is fine; a name that holds a file
  // a rank there is writing is not replaced.
  EXPECT_TRUE(parts_[1]->RenameDir("run/mem", "never", "there").ok());
  auto m1 = tier_[1]->Mkdir(root_[1], "busy", 0755, 0, 0);
  ASSERT_TRUE(m1.ok());
  Put(1, m1->id, "__1_0.distcp");
  auto e0 = tier_[0]->Mkdir(root_[0], "empty", 0755, 0, 0);
  ASSERT_TRUE(e0.ok());
  ASSERT_TRUE(tier_[0]->Rename(root_[0], "empty", root_[0], "busy", false).ok());
  ASSERT_EQ(wire_[0].renames.size(), 2u);
  EXPECT_EQ(wire_[0].renames[1].code(), Code::kNotEmpty);
  EXPECT_EQ(ReadAll(1, m1->id, "__1_0.distcp"), ReadFixture("__1_0.distcp"));
  EXPECT_EQ(parts_[1]->RenameDir("run/mem", "step2", "step2/below").code(), Code::kInvalid);
  EXPECT_EQ(parts_[1]->RenameDir("run/mem", "../x", "y").code(), Code::kInvalid);
}

// Renamed while its parts are still on their way to holders: what was queued under the old
// name is queued again under the new one, and the commit goes through under it.
TEST_F(MemoryPartsTest, ARenameWhileGatheringGathersUnderTheNewName) {
  Write("tmp-step2");
  const uint64_t seq = wire_[0].gathers.back().second;
  ASSERT_TRUE(parts_[1]->Seal("run/mem", "tmp-step2", seq).ok());  // node 1's part handed
  ASSERT_EQ(wire_[1].handed.size(), 1u);

  ASSERT_TRUE(tier_[0]->Rename(root_[0], "tmp-step2", root_[0], "step2", false).ok());
  ASSERT_EQ(wire_[0].gathers.size(), 2u);
  EXPECT_EQ(wire_[0].gathers[1], std::make_pair(std::string("run/mem/step2"), seq));
  ASSERT_EQ(wire_[1].handed.size(), 2u);
  EXPECT_EQ(wire_[1].handed[1], std::make_pair(std::string("run/mem/step2"), seq));
  // The jobs of the old name find nothing and change nothing.
  tier_[0]->HandedOver("run/mem", "tmp-step2", seq, Status(Code::kNotFound, "gone"));
  tier_[1]->HandedOver("run/mem", "tmp-step2", seq, Status(Code::kNotFound, "gone"));
  parts_[0]->GatherFailed("run/mem", "tmp-step2", seq, Status(Code::kNotFound, "gone"));
  EXPECT_EQ(Listed(0)["run/mem/step2"].state, "replicating");
  EXPECT_EQ(tier_[0]->Stats().refused_commits, 0u);
  Commit("step2", seq);
  EXPECT_EQ(Listed(0)["run/mem/step2"].state, "committed");
}

TEST_F(MemoryPartsTest, AFileNoNodeHoldsRefusesTheCommitAndTheOlderOneStays) {
  // A committed single-node checkpoint first (every file on node 0).
  auto d = tier_[0]->Mkdir(root_[0], "step1", 0755, 0, 0);
  ASSERT_TRUE(d.ok());
  for (const char* f :
       {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", ".metadata"}) {
    Put(0, d->id, f);
  }
  ASSERT_EQ(wire_[0].handed.size(), 1u);
  tier_[0]->HandedOver("run/mem", "step1", wire_[0].handed[0].second, std::string("node1:7"));
  ASSERT_EQ(Listed(0)["run/mem/step1"].state, "committed");

  Write("step2", /*node1_writes_all=*/false);  // __3_0.distcp written nowhere
  const uint64_t seq = wire_[0].gathers.back().second;
  tier_[0]->HandedOver("run/mem", "step2", seq, std::string("node1:7"));
  auto part = parts_[1]->Seal("run/mem", "step2", seq);
  ASSERT_TRUE(part.ok());
  tier_[1]->HandedOver("run/mem", "step2", seq, std::string("node0:7"));
  part = parts_[1]->Seal("run/mem", "step2", seq);
  ASSERT_TRUE(part.ok());
  part->rank = 1;
  Status st = parts_[0]->CommitGathered("run/mem", "step2", seq, {*part});
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("__3_0.distcp"), std::string::npos) << st.ToString();
  EXPECT_EQ(Listed(0)["run/mem/step2"].state, "writing");
  EXPECT_EQ(Listed(0)["run/mem/step1"].state, "committed") << "the older one stays";
  EXPECT_EQ(tier_[0]->Stats().refused_commits, 1u);
  EXPECT_FALSE(parts_[0]->Whole("run/mem", "step2", seq, 0).ok());
  // A peer's bad names are refused, never made.
  MemPart bad;
  bad.rank = 1;
  bad.files.push_back(MemUnitFile{"../escape", 1, 0});
  EXPECT_EQ(parts_[0]->CommitGathered("run/mem", "step2", seq, {bad}).code(), Code::kInvalid);
  MemRemoteFile dots{1, "node0:7", "run/mem", "step2", "a/./b", seq, 1};
  EXPECT_EQ(parts_[1]->ApplyCommit("run/mem", "step2", seq, {dots}, 1).code(), Code::kInvalid);
  // A node that wrote nothing there has no part.
  EXPECT_EQ(parts_[0]->Seal("run/mem", "nothing", seq).status().code(), Code::kNotFound);
}

TEST_F(MemoryPartsTest, AnOwnPartNoPeerTookNeverCommitsTheWholeLaterOn) {
  Write("step2");
  const uint64_t seq = wire_[0].gathers.back().second;
  tier_[0]->HandedOver("run/mem", "step2", seq, Status(Code::kIo, "no other node is up"));
  EXPECT_EQ(Listed(0)["run/mem/step2"].state, "writing");
  EXPECT_EQ(tier_[0]->Stats().refused_commits, 1u);
  // A later success (the idle re-offer of unreplicated ones) must not commit it: it never
  // gathered the other part.
  tier_[0]->HandedOver("run/mem", "step2", seq, std::string("node1:7"));
  EXPECT_NE(Listed(0)["run/mem/step2"].state, "committed");
  EXPECT_FALSE(parts_[0]->CommitGathered("run/mem", "step2", seq, {}).ok());
}

}  // namespace
}  // namespace ckptfs::store
