// The journal where other nodes publish into the same directories (--peers,
// JournalOptions::shared_dirs): an application's `rm -r` through this node and another
// node's late publish of a file into that directory, in both orders (soak of stop 53,
// async on two nodes: "rmdir iter_N skipped: NotEmpty" and a clean stop that exited 1).
// Another node's work is done here straight on the backing directory, as it would land.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tests/store/publish/journal_fixture.h"

namespace ckptfs::store {
namespace {

class SharedDirsTest : public JournalTest {
 protected:
  // A journal of a node with peers; `async`: failures halt (async mode), else strict.
  void MakeSharedJournal(bool async) {
    TestHooks hooks;
    hooks.options.shared_dirs = true;
    hooks.options.halt_on_failure = async;
    MakeJournal(std::move(hooks));
  }

  // A save into `ck`, committed, then a rewrite of its shard (the job saving that
  // iteration again). Returns the kept-version records (ReplacedFiles) in the state db.
  size_t KeptRecordsAfterARewrite(const std::string& ck) {
    EXPECT_TRUE(journal_->Wait(Op(OpType::kMkdir, ck)).ok());
    TempFile v1 = StartFile("");
    Write(&v1, "first save");
    EXPECT_TRUE(journal_->Wait(Publish(v1, ck + "/__0_0.distcp")).ok());
    TempFile md = StartFile("");
    Write(&md, "metadata");
    EXPECT_TRUE(journal_->Wait(Publish(md, ck + "/.metadata")).ok());
    TempFile v2 = StartFile("");
    Write(&v2, "second save");
    EXPECT_TRUE(journal_->Wait(Publish(v2, ck + "/__0_0.distcp")).ok());
    EXPECT_EQ(Read(ck + "/__0_0.distcp"), "second save");
    EXPECT_EQ(Read(v2.temp), "first save") << "the replaced version is kept until a commit";
    return KeysWithPrefix(db_.get(), "r/").size();
  }

  // A file another node publishes into `rel`.
  void OtherNodePublishes(const std::string& rel, const std::string& bytes) {
    std::ofstream out(root_ + "/" + rel, std::ios::binary | std::ios::trunc);
    out << bytes;
  }
};

// Async: the rotation's `rm -r` returned at once here; the other node's shard of that
// abandoned save lands before this node's rmdir is applied. The directory still goes, with
// the late file; nothing is skipped or halted.
TEST_F(SharedDirsTest, AnAsyncRmdirRemovesFilesAnotherNodePublishedAfterTheApplicationsListing) {
  MakeSharedJournal(/*async=*/true);
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "iter_7")).ok());
  OtherNodePublishes("iter_7/__1_0.distcp", "late shard");
  OtherNodePublishes("iter_7/__3_0.distcp", "another late shard");
  EXPECT_TRUE(journal_->Wait(Op(OpType::kRmdir, "iter_7")).ok());
  EXPECT_FALSE(Exists("iter_7"));
  EXPECT_FALSE(journal_->halted().has_value());
  EXPECT_EQ(journal_->counts().skipped, 0u);
  // Publication goes on after it.
  EXPECT_TRUE(journal_->Wait(Op(OpType::kMkdir, "iter_8")).ok());
  EXPECT_TRUE(Exists("iter_8"));
}

// A directory made there is not a late file of a save: the rmdir is refused as before.
TEST_F(SharedDirsTest, AnAsyncRmdirLeavesADirectoryAnotherNodeMadeThere) {
  MakeSharedJournal(/*async=*/true);
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "iter_7")).ok());
  fs::create_directories(root_ + "/iter_7/sub");
  OtherNodePublishes("iter_7/__1_0.distcp", "late shard");
  Status st = journal_->Wait(Op(OpType::kRmdir, "iter_7"));
  EXPECT_EQ(st.code(), Code::kNotEmpty) << st.ToString();
  EXPECT_TRUE(Exists("iter_7/sub"));
  EXPECT_TRUE(Exists("iter_7/__1_0.distcp"));
  EXPECT_EQ(journal_->counts().skipped, 1u);
}

// Strict: the rmdir returns its outcome to the application, which learns the directory is
// not empty (as from any file system) and nothing is removed behind its back.
TEST_F(SharedDirsTest, AStrictRmdirOfADirectoryWithAnotherNodesFileIsRefused) {
  MakeSharedJournal(/*async=*/false);
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "iter_7")).ok());
  OtherNodePublishes("iter_7/__1_0.distcp", "shard");
  Status st = journal_->Wait(Op(OpType::kRmdir, "iter_7"));
  EXPECT_EQ(st.code(), Code::kNotEmpty) << st.ToString();
  EXPECT_EQ(Read("iter_7/__1_0.distcp"), "shard");
}

// Without peers nobody else writes there: a refused rmdir is not second-guessed.
TEST_F(SharedDirsTest, WithoutPeersAnAsyncRmdirOfANonEmptyDirectoryRemovesNothing) {
  MakeJournal();
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "iter_7")).ok());
  OtherNodePublishes("iter_7/notes.txt", "someone's file");
  Status st = journal_->Wait(Op(OpType::kRmdir, "iter_7"));
  EXPECT_EQ(st.code(), Code::kNotEmpty) << st.ToString();
  EXPECT_EQ(Read("iter_7/notes.txt"), "someone's file");
}

// The other order: the other node's rmdir is applied first, and this node's publish of
// its shard into that directory finds no directory. Dropped (superseded), its temp
// removed, nothing halts and nothing makes the directory again.
TEST_F(SharedDirsTest, APublishIntoADirectoryAnotherNodeRemovedIsDroppedWithoutAHalt) {
  MakeSharedJournal(/*async=*/true);
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "iter_7")).ok());
  TempFile f = StartFile("");
  Write(&f, "shard bytes");
  fs::remove_all(root_ + "/iter_7");  // the other node's `rm -r`, applied
  const uint64_t seq = Publish(f, "iter_7/__1_0.distcp");
  Status st = journal_->Wait(seq);
  EXPECT_EQ(st.code(), Code::kSuperseded) << st.ToString();
  EXPECT_FALSE(Exists("iter_7"));
  EXPECT_FALSE(Exists(f.temp)) << "the temp file goes with the dropped publish";
  EXPECT_FALSE(journal_->halted().has_value());
  EXPECT_TRUE(journal_->Wait(Op(OpType::kMkdir, "iter_8")).ok());
  EXPECT_TRUE(Exists("iter_8"));
}

// Without peers a publish whose directory is gone is a failure of publication (someone
// removed it behind the mount's back): it halts, as before.
TEST_F(SharedDirsTest, WithoutPeersAPublishIntoAMissingDirectoryHalts) {
  MakeJournal();
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "iter_7")).ok());
  TempFile f = StartFile("");
  Write(&f, "shard bytes");
  fs::remove_all(root_ + "/iter_7");
  const uint64_t seq = Publish(f, "iter_7/__1_0.distcp");
  EXPECT_FALSE(journal_->WaitUnlessHalted(seq).ok());
  EXPECT_TRUE(journal_->halted().has_value());
}

// A rewrite's kept version (ReplacedFiles) is recorded in the state db on one node, so
// that recovery after a crash can put it back; with peers it is not: another node may
// still commit the rewrite after this one restarts, and putting the earlier version back
// would tear that commit (stop 53).
TEST_F(SharedDirsTest, ARewriteOfACommittedCheckpointRecordsItsKeptVersionOnOneNode) {
  MakeJournal();
  EXPECT_EQ(KeptRecordsAfterARewrite("ck"), 1u);
}

TEST_F(SharedDirsTest, ARewriteOfACommittedCheckpointRecordsNoKeptVersionWithPeers) {
  MakeSharedJournal(/*async=*/true);
  EXPECT_EQ(KeptRecordsAfterARewrite("ck"), 0u);
}

}  // namespace
}  // namespace ckptfs::store
