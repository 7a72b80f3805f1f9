// LostPublishes: the names a crash lost (written by Journal::Recover) survive restarts,
// leave the record once this mount publishes, deletes or moves them again, and stay
// bounded; LocalShardStates answers them "failed" for the commit query until then.
#include "store/publish/lost_publishes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "store/primitives/state_db.h"
#include "store/publish/shard_state.h"
#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {

class LostPublishesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto db = StateDb::Open(tmp_.Sub("state", false));
    ASSERT_TRUE(db.ok()) << db.status().ToString();
    db_ = std::move(db).value();
  }
  // What Journal::Recover writes for the names a crash at time `when` lost.
  void Lose(const std::vector<std::string>& paths, double when = 1000) {
    std::vector<std::pair<std::string, std::string>> puts;
    for (const std::string& p : paths) puts.push_back(LostPublishes::Record(p, when));
    ASSERT_TRUE(db_->Write(puts, {}).ok());
  }
  std::vector<std::string> Keys() {
    std::vector<std::string> keys;
    EXPECT_TRUE(db_->Scan(LostPublishes::kPrefix, [&](std::string_view k, std::string_view) {
                     keys.emplace_back(k);
                   }).ok());
    return keys;
  }
  std::vector<std::string> LoadAgain() {
    LostPublishes again(db_.get());
    auto names = again.Load();
    EXPECT_TRUE(names.ok()) << names.status().ToString();
    std::vector<std::string> out = names.ok() ? *names : std::vector<std::string>{};
    std::sort(out.begin(), out.end());
    return out;
  }
  static JournalEntry Entry(OpType op, const std::string& path, const std::string& from = "") {
    JournalEntry e;
    e.op = op;
    e.path = path;
    e.from = from;
    return e;
  }

  ScopedTempDir tmp_{"ckptfs-lost-test"};
  std::unique_ptr<StateDb> db_;
};

TEST_F(LostPublishesTest, NamesLeaveTheRecordOnlyWhenThisMountWritesDeletesOrMovesThemAgain) {
  Lose({"a/__1_0.distcp", "a/__1_1.distcp", "b/__1_0.distcp", "c/x/__1_0.distcp",
        "d/__1_0.distcp"});
  LostPublishes lost(db_.get());
  auto names = lost.Load();
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(names->size(), 5u);

  lost.OnDone(Entry(OpType::kChmod, "a/__1_0.distcp"), Status::Ok());  // attributes: still lost
  lost.OnDone(Entry(OpType::kUtimens, "a/__1_0.distcp"), Status::Ok());
  lost.OnDone(Entry(OpType::kPublish, "a/__1_0"), Status::Ok());  // a prefix, not the name
  EXPECT_EQ(lost.size(), 5u);
  lost.OnDone(Entry(OpType::kPublish, "a/__1_0.distcp"), Status::Ok());  // written again
  lost.OnDone(Entry(OpType::kRmdir, "c"), Status::Ok());                 // everything below goes
  lost.OnDone(Entry(OpType::kRename, "e", "d"), Status::Ok());           // moved away
  EXPECT_EQ(lost.size(), 2u);
  EXPECT_EQ(LoadAgain(), (std::vector<std::string>{"a/__1_1.distcp", "b/__1_0.distcp"}))
      << "a restart still knows the rest";
  lost.OnDone(Entry(OpType::kUnlink, "a/__1_1.distcp"), Status::Ok());
  lost.OnDone(Entry(OpType::kRename, "b", "elsewhere"), Status::Ok());  // replaced by a rename onto it
  EXPECT_EQ(lost.size(), 0u);
  EXPECT_TRUE(Keys().empty());
}

TEST_F(LostPublishesTest, TheRecordKeepsTheNewestNamesWithinItsBound) {
  std::vector<std::string> old_names = {"old/0", "old/1", "old/2"};
  Lose(old_names, 10);
  std::vector<std::string> names;
  for (size_t i = 0; i < LostPublishes::kMaxRecords; ++i) {
    names.push_back("new/" + std::to_string(i));
  }
  Lose(names, 20);
  LostPublishes lost(db_.get());
  auto loaded = lost.Load();
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->size(), LostPublishes::kMaxRecords);
  EXPECT_EQ(std::count_if(loaded->begin(), loaded->end(),
                          [](const std::string& n) { return n.rfind("old/", 0) == 0; }),
            0);
  EXPECT_EQ(Keys().size(), LostPublishes::kMaxRecords) << "the oldest records are deleted";
}

// A commit of the directory (here, or another node's seen) settles its earlier saves:
// the names lost in one of them are forgotten, the `.metadata` is not a lost name.
TEST_F(LostPublishesTest, ACommitOfTheirDirectorySettlesThem) {
  Lose({"a/__1_0.distcp", "a/sub/__1_1.distcp", "b/__1_0.distcp", "c/__1_0.distcp"});
  LostPublishes lost(db_.get());
  ASSERT_TRUE(lost.Load().ok());
  lost.OnDone(Entry(OpType::kRename, "a/.metadata", "a/.metadata.tmp"), Status::Ok());
  lost.OnDone(Entry(OpType::kPublish, "b/.metadata"), Status(Code::kAborted, "refused"));
  lost.Settled("c");
  EXPECT_EQ(LoadAgain(), (std::vector<std::string>{"b/__1_0.distcp"}))
      << "a refused commit settles nothing";
}

// What the restarted node answers the commit query: failed, until the name is written
// through this mount again (pending wins, then the new outcome).
TEST_F(LostPublishesTest, TheShardStatesAnswerALostNameFailedUntilItIsWrittenAgain) {
  class Questions : public LocalShardQuestions {
   public:
    bool PendingLocally(const std::string& path) override { return path == pending; }
    bool DeletedLocally(const std::string&) override { return false; }
    std::string pending;
  } questions;
  LocalShardStates states(&questions);
  states.NoteLost({"ck/__1_0.distcp"});
  EXPECT_EQ(states.Query("ck/__1_0.distcp"), (ShardStatus{ShardState::kFailed, 0}));
  EXPECT_EQ(states.Query("ck/__0_0.distcp"), (ShardStatus{ShardState::kUnknown, 0}));
  questions.pending = "ck/__1_0.distcp";
  EXPECT_EQ(states.Query("ck/__1_0.distcp"), (ShardStatus{ShardState::kPending, 0}));
  questions.pending.clear();
  JournalEntry e = Entry(OpType::kPublish, "ck/__1_0.distcp");
  e.size = 4096;
  states.NoteDone(e, Status::Ok());
  EXPECT_EQ(states.Query("ck/__1_0.distcp"), (ShardStatus{ShardState::kDurable, 4096}));
}

// Once the checkpoint commits, its files' records answered for that save: kept, a
// "durable" for an earlier save's version would outrank the "pending" of the node that
// writes the name in the next save (a rank placed elsewhere). The `.metadata`'s record
// stays (the coordinator's answer to nodes ordering entries after it).
TEST_F(LostPublishesTest, TheShardStatesForgetAFilesRecordOnceItsCheckpointCommits) {
  LocalShardStates states(nullptr);
  auto publish = [&](const std::string& path, uint64_t size) {
    JournalEntry e = Entry(OpType::kPublish, path);
    e.size = size;
    states.NoteDone(e, Status::Ok());
  };
  publish("ck/__1_0.distcp", 4096);
  publish("ck2/__1_0.distcp", 4096);
  publish("ck/.metadata.tmp", 100);
  EXPECT_EQ(states.Query("ck/__1_0.distcp").state, ShardState::kDurable);
  states.NoteDone(Entry(OpType::kRename, "ck/.metadata", "ck/.metadata.tmp"), Status::Ok());
  EXPECT_EQ(states.Query("ck/__1_0.distcp").state, ShardState::kUnknown);
  EXPECT_EQ(states.Query("ck/.metadata"), (ShardStatus{ShardState::kDurable, 100}));
  EXPECT_EQ(states.Query("ck2/__1_0.distcp").state, ShardState::kDurable) << "another dir";
  states.Settled("ck2");  // its `.metadata` seen, published by another node
  EXPECT_EQ(states.Query("ck2/__1_0.distcp").state, ShardState::kUnknown);
}

}  // namespace
}  // namespace ckptfs::store
