// Applying one journal entry when the backing store fails twice in a row (found with the
// fault layer of issue 41, reproduced here without it): a rename that succeeded, a
// directory fsync after it that failed, and the rename that should have taken it back
// failing as well. The name is then in place though the entry failed; its retry must
// finish the entry (make the directory durable) instead of renaming again, which would
// exchange the old file back over the new one (a replaced file) or fail for good on the
// missing source (a new file, a rename) and halt publication until an operator acts.
#include "tests/store/publish/journal_fixture.h"

namespace ckptfs::store {
namespace {

class EntryApplyTest : public JournalTest {
 protected:
  // Entry `seq` is done within 10 s (a journal halted for good never gets there) and ok.
  void ExpectDone(uint64_t seq) {
    ASSERT_TRUE(journal_->WaitDoneFor(seq, std::chrono::seconds(10)))
        << "publication is stuck: " << journal_->WaitingFor();
    EXPECT_TRUE(journal_->Wait(seq).ok());
  }
};

TEST_F(EntryApplyTest, APublishWhoseUndoFailedIsFinishedByItsRetry) {
  MakeJournal();
  TempFile f = StartFile("");
  Write(&f, "new bytes");
  // Rename in (ok), directory fsync (EIO), rename back (EIO).
  dir_->FailNthSyncParent(dir_->sync_parent_calls() + 1, EIO);
  dir_->FailNthRename(dir_->rename_calls() + 2, EIO);
  uint64_t publish = Publish(f, "x");
  uint64_t later = Op(OpType::kMkdir, "later");
  EXPECT_EQ(journal_->Wait(publish).code(), Code::kIo) << "the failure is reported";
  journal_->Resume();
  ExpectDone(later);
  EXPECT_EQ(Read("x"), "new bytes");
  EXPECT_TRUE(Exists("later"));
  EXPECT_FALSE(Exists(f.temp));
  EXPECT_FALSE(journal_->halted().has_value());
}

TEST_F(EntryApplyTest, AReplacingPublishWhoseUndoFailedKeepsTheNewBytes) {
  MakeJournal();
  TempFile old_file = StartFile("");
  Write(&old_file, "old bytes");
  ASSERT_TRUE(journal_->Wait(Publish(old_file, "x")).ok());
  ASSERT_EQ(Read("x"), "old bytes");
  TempFile f = StartFile("");
  Write(&f, "new bytes");
  // Exchange in (ok), directory fsync (EIO), exchange back (EIO): the real name holds
  // the new file, the temp name the old one.
  dir_->FailNthSyncParent(dir_->sync_parent_calls() + 1, EIO);
  dir_->FailNthRename(dir_->rename_calls() + 2, EIO);
  uint64_t publish = Publish(f, "x");
  uint64_t later = Op(OpType::kMkdir, "later");
  EXPECT_EQ(journal_->Wait(publish).code(), Code::kIo);
  journal_->Resume();
  ExpectDone(later);
  EXPECT_EQ(Read("x"), "new bytes") << "the retry exchanged the old file back in";
  EXPECT_FALSE(Exists(f.temp)) << "the replaced file is removed";
}

TEST_F(EntryApplyTest, ARenameWhoseDirectorySyncFailedIsFinishedByItsRetry) {
  MakeJournal();
  TempFile f = StartFile("");
  Write(&f, "log");
  ASSERT_TRUE(journal_->Wait(Publish(f, "a.tmp")).ok());
  // Rename (ok), directory fsync (EIO): not a commit name, so the rename stays.
  dir_->FailNthSyncParent(dir_->sync_parent_calls() + 1, EIO);
  uint64_t rename = Op(OpType::kRename, "a.log", "a.tmp");
  uint64_t later = Op(OpType::kMkdir, "later");
  EXPECT_EQ(journal_->Wait(rename).code(), Code::kIo);
  journal_->Resume();
  ExpectDone(later);
  EXPECT_EQ(Read("a.log"), "log");
  EXPECT_FALSE(Exists("a.tmp"));
}

TEST_F(EntryApplyTest, ACommitRenameWhoseUndoFailedIsFinishedByItsRetry) {
  TestHooks hooks;
  hooks.commit_gate = [](const JournalEntry&, const QueuedFn&) { return Status::Ok(); };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile md = StartFile("ck");
  Write(&md, "metadata");
  ASSERT_TRUE(journal_->Wait(Publish(md, "ck/.metadata.tmp")).ok());
  // Rename to the commit name (ok), directory fsync (EIO), rename back (EIO).
  dir_->FailNthSyncParent(dir_->sync_parent_calls() + 1, EIO);
  dir_->FailNthRename(dir_->rename_calls() + 2, EIO);
  uint64_t commit = Op(OpType::kRename, "ck/.metadata", "ck/.metadata.tmp");
  uint64_t later = Op(OpType::kMkdir, "later");
  EXPECT_EQ(journal_->Wait(commit).code(), Code::kIo);
  journal_->Resume();
  ExpectDone(later);
  EXPECT_EQ(Read("ck/.metadata"), "metadata");
  EXPECT_FALSE(Exists("ck/.metadata.tmp"));
}

// The ordinary case stays what it was: a failed directory fsync whose undo works leaves
// nothing under the real name until the retry.
TEST_F(EntryApplyTest, AFailedDirectorySyncWithAWorkingUndoIsRetriedFromTheTemp) {
  MakeJournal();
  TempFile f = StartFile("");
  Write(&f, "bytes");
  std::atomic<bool> seen_before_retry{false};
  dir_->FailNthSyncParent(dir_->sync_parent_calls() + 1, EIO);
  uint64_t publish = Publish(f, "x");
  EXPECT_EQ(journal_->Wait(publish).code(), Code::kIo);
  seen_before_retry = Exists("x");
  EXPECT_FALSE(seen_before_retry.load()) << "withdrawn after the failed fsync";
  journal_->Resume();
  ExpectDone(Op(OpType::kMkdir, "later"));
  EXPECT_EQ(Read("x"), "bytes");
  EXPECT_FALSE(Exists(f.temp));
}

}  // namespace
}  // namespace ckptfs::store
