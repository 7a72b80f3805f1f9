// Deletions held behind a given-up checkpoint (store/publish/deletion_hold.h): the journal
// keeps them out of line while later entries go past, lets them go after a later commit
// once publication reaches the next deletion or empties, lets them go first for an entry
// that meets their names, and drops them at a stop (what they delete stays). The hooks
// answer as Publication does: with the hold active, a deletion in a directory with a
// `.metadata` on the backing store is held; an applied `.metadata` is a commit.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "store/publish/deletion_hold.h"
#include "tests/store/publish/journal_fixture.h"

namespace ckptfs::store {
namespace {

using namespace std::chrono_literals;

class DeletionHoldTest : public JournalTest {
 protected:
  void SetUp() override {
    JournalTest::SetUp();
    // A committed checkpoint "old" already on the backing store.
    fs::create_directories(root_ + "/old");
    std::ofstream(root_ + "/old/.metadata") << "md";
    std::ofstream(root_ + "/old/__0_0.distcp") << "shard";
    TestHooks hooks;
    hooks.options.hold = &hold_;
    hooks.options.held_grace = 300ms;
    auto deletion = [](const JournalEntry& e) {
      return !e.unheld && (e.op == OpType::kUnlink || e.op == OpType::kRmdir);
    };
    hooks.gated = [this, deletion](const JournalEntry& e) {
      return hold_.active() && deletion(e);
    };
    hooks.commit_gate = [this, deletion](const JournalEntry& e, const QueuedFn&) -> CommitCheck {
      const std::string ckpt = e.op == OpType::kRmdir ? e.path : fs::path(e.path).parent_path().string();
      if (hold_.active() && deletion(e) && Exists(ckpt + "/.metadata")) {
        // As Publication answers: whether a file that may be a tracker is beside it on the
        // backing store (here the tests' tracker, tracker.txt at the top).
        CommitCheck held = CommitCheck::Hold();
        const std::string beside = fs::path(ckpt).parent_path().string();
        held.tracker_beside = Exists(beside.empty() ? "tracker.txt" : beside + "/tracker.txt");
        return held;
      }
      return Status::Ok();
    };
    hooks.on_done = [this](const JournalEntry& e, const Status& st) {
      if (st.ok() && IsCommitName(e.path) && e.op == OpType::kPublish) hold_.Committed();
      MutexLock lock(&mu_);
      done_.push_back({e.path, st.code()});
    };
    MakeJournal(std::move(hooks));
  }

  // `rm -r old`, as the mount queues it; every call returns (held or applied).
  std::vector<uint64_t> RemoveOld() {
    std::vector<uint64_t> seqs = {Op(OpType::kUnlink, "old/__0_0.distcp"),
                                  Op(OpType::kUnlink, "old/.metadata"),
                                  Op(OpType::kRmdir, "old")};
    for (uint64_t s : seqs) EXPECT_TRUE(journal_->WaitUnlessHalted(s).ok());
    return seqs;
  }
  uint64_t PublishBytes(const std::string& path, const std::string& bytes) {
    TempFile f = StartFile(fs::path(path).parent_path().string());
    Write(&f, bytes);
    return Publish(f, path);
  }
  // The next tracker is published: the held `rm -r old` goes with it, after it.
  void TrackerThenHeldGo(const std::vector<uint64_t>& rm) {
    const uint64_t t2 = PublishBytes("tracker.txt", "new");
    for (uint64_t s : rm) ASSERT_TRUE(journal_->Wait(s).ok());
    ASSERT_TRUE(journal_->Wait(t2).ok());
    EXPECT_FALSE(Exists("old"));
    EXPECT_LT(DoneAt("tracker.txt"), DoneAt("old/.metadata"));
  }
  // The position of `path`'s last outcome among those seen so far (-1: none).
  int DoneAt(const std::string& path) {
    MutexLock lock(&mu_);
    for (size_t i = done_.size(); i > 0; --i) {
      if (done_[i - 1].first == path) return static_cast<int>(i - 1);
    }
    return -1;
  }
  Code OutcomeOf(const std::string& path) {
    MutexLock lock(&mu_);
    for (const auto& [p, code] : done_) {
      if (p == path) return code;
    }
    return Code::kInternal;  // none seen
  }

  DeletionHold hold_;
  Mutex mu_;
  std::vector<std::pair<std::string, Code>> done_ GUARDED_BY(mu_);
};

TEST_F(DeletionHoldTest, ADeletionBehindAGivenUpCheckpointWaitsForTheNextCommitAndItsTracker) {
  hold_.GaveUp();
  const std::vector<uint64_t> rm = RemoveOld();
  // Later entries go past the held deletion; the committed checkpoint stays.
  const uint64_t t1 = PublishBytes("tracker.txt", "old");
  ASSERT_TRUE(journal_->Wait(t1).ok());
  EXPECT_TRUE(Exists("old/.metadata"));
  EXPECT_TRUE(Exists("old/__0_0.distcp"));
  EXPECT_EQ(journal_->counts().held, 3u);
  EXPECT_EQ(journal_->counts().applied, rm[0] - 1) << "done only up to the held entries";
  EXPECT_FALSE(journal_->WaitDoneFor(rm[2], 100ms));

  // The next save commits, then its tracker: only then does `old` go.
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "new")).ok());
  PublishBytes("new/__0_0.distcp", "shard");
  PublishBytes("new/.metadata", "md");
  const uint64_t t2 = PublishBytes("tracker.txt", "new");
  ASSERT_TRUE(journal_->Wait(t2).ok());
  for (uint64_t s : rm) ASSERT_TRUE(journal_->Wait(s).ok());
  EXPECT_FALSE(Exists("old"));
  EXPECT_TRUE(Exists("new/.metadata"));
  EXPECT_EQ(Read("tracker.txt"), "new");
  EXPECT_LT(DoneAt("new/.metadata"), DoneAt("old/.metadata"));
  EXPECT_LT(DoneAt("tracker.txt"), DoneAt("old/.metadata"));
  EXPECT_EQ(journal_->counts().held, 0u);
  EXPECT_EQ(journal_->counts().held_total, 3u);
  EXPECT_EQ(journal_->counts().applied, t2);
}

// After the commit, the next deletion (the next rotation) lets the held ones go first.
TEST_F(DeletionHoldTest, TheNextDeletionAfterACommitLetsTheHeldOnesGoFirst) {
  fs::create_directories(root_ + "/mid");
  std::ofstream(root_ + "/mid/.metadata") << "md";
  hold_.GaveUp();
  const std::vector<uint64_t> rm = RemoveOld();
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "new")).ok());
  PublishBytes("new/.metadata", "md");
  const uint64_t rm_mid = Op(OpType::kUnlink, "mid/.metadata");
  ASSERT_TRUE(journal_->Wait(rm_mid).ok());
  ASSERT_TRUE(journal_->Wait(rm[2]).ok());
  EXPECT_LT(DoneAt("old"), DoneAt("mid/.metadata")) << "held deletions keep their order";
  EXPECT_FALSE(Exists("old"));
  EXPECT_FALSE(Exists("mid/.metadata"));
}

// Where a tracker is in use beside the checkpoints, only a tracker applied after the commit
// lets the held deletions go: not an unrelated deletion (a log's, another directory's
// rotation) nor a small file elsewhere, which can come between the commit and its tracker
// while the tracker on the backing store still names what they delete (the short soak of
// d15be0d: `rm -r` of the checkpoint the backing tracker named went at the next commit).
TEST_F(DeletionHoldTest, WithATrackerBesideOnlyATrackerAfterTheCommitLetsThemGo) {
  fs::create_directories(root_ + "/logs");
  std::ofstream(root_ + "/logs/old.log") << "log";
  ASSERT_TRUE(journal_->Wait(PublishBytes("tracker.txt", "old")).ok());
  hold_.GaveUp();
  const std::vector<uint64_t> rm = RemoveOld();
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "new")).ok());
  ASSERT_TRUE(journal_->Wait(PublishBytes("new/.metadata", "md")).ok());
  ASSERT_TRUE(journal_->Wait(Op(OpType::kUnlink, "logs/old.log")).ok());
  ASSERT_TRUE(journal_->Wait(PublishBytes("logs/run.dat", "small")).ok());
  EXPECT_FALSE(journal_->WaitDoneFor(rm[2], 100ms));
  EXPECT_TRUE(Exists("old/.metadata")) << "gone while the tracker still names it";
  EXPECT_EQ(Read("tracker.txt"), "old");

  TrackerThenHeldGo(rm);
}

// Where a tracker was applied beside them, publication idle past the grace does not let
// them go either: the tracker may have been dropped by an operator's abort, its later
// versions withheld behind given-up checkpoints, and the backing store's tracker still
// names a checkpoint they delete (the two-node async soak, seed 6203: tracker 85 on the
// store, 83 to 85 gone after the grace).
TEST_F(DeletionHoldTest, WithATrackerBesideTheGraceDoesNotLetThemGo) {
  ASSERT_TRUE(journal_->Wait(PublishBytes("tracker.txt", "old")).ok());
  hold_.GaveUp();
  const std::vector<uint64_t> rm = RemoveOld();
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "new")).ok());
  ASSERT_TRUE(journal_->Wait(PublishBytes("new/.metadata", "md")).ok());
  EXPECT_FALSE(journal_->WaitDoneFor(rm[2], 900ms)) << "went after the grace (300 ms)";
  EXPECT_TRUE(Exists("old/.metadata")) << "gone while the tracker still names it";
  EXPECT_EQ(Read("tracker.txt"), "old");

  TrackerThenHeldGo(rm);
}

// Held deletions of two trees, each with its tracker (a trainer's at the top, a side job's
// in side/): the top tracker after the commit does not let side/'s go while side/'s tracker
// still names what they delete; side/'s next tracker lets them all go (stop 63's soak,
// seed 6302: the main trainer's tracker let async2/iter_0000019 go under async2's 19).
TEST_F(DeletionHoldTest, OneTreesTrackerDoesNotLetAnotherTreesHeldDeletionsGo) {
  fs::create_directories(root_ + "/side/old");
  std::ofstream(root_ + "/side/old/.metadata") << "md";
  ASSERT_TRUE(journal_->Wait(PublishBytes("tracker.txt", "old")).ok());
  ASSERT_TRUE(journal_->Wait(PublishBytes("side/tracker.txt", "old")).ok());
  hold_.GaveUp();
  const std::vector<uint64_t> rm = RemoveOld();
  const std::vector<uint64_t> side = {Op(OpType::kUnlink, "side/old/.metadata"),
                                      Op(OpType::kRmdir, "side/old")};
  for (uint64_t s : side) ASSERT_TRUE(journal_->WaitUnlessHalted(s).ok());
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "new")).ok());
  ASSERT_TRUE(journal_->Wait(PublishBytes("new/.metadata", "md")).ok());
  ASSERT_TRUE(journal_->Wait(PublishBytes("tracker.txt", "new")).ok());
  EXPECT_FALSE(journal_->WaitDoneFor(side[1], 900ms)) << "side/'s went at the top's tracker";
  EXPECT_TRUE(Exists("side/old/.metadata")) << "gone while side/'s tracker still names it";
  EXPECT_EQ(Read("side/tracker.txt"), "old");

  const uint64_t t2 = PublishBytes("side/tracker.txt", "new");
  for (uint64_t s : side) ASSERT_TRUE(journal_->Wait(s).ok());
  for (uint64_t s : rm) ASSERT_TRUE(journal_->Wait(s).ok());
  ASSERT_TRUE(journal_->Wait(t2).ok());
  EXPECT_FALSE(Exists("side/old"));
  EXPECT_FALSE(Exists("old"));
  EXPECT_LT(DoneAt("side/tracker.txt"), DoneAt("side/old/.metadata"));
}

// After a restart the journal has seen no tracker applied, but the one a previous run
// published is on the backing store beside the checkpoints: the tracker rule holds all the
// same (Publication says so with the hold), and the next deletion does not let them go.
TEST_F(DeletionHoldTest, AfterARestartATrackerOnTheStoreBesideKeepsTheTrackerRule) {
  std::ofstream(root_ + "/tracker.txt") << "old";  // published by the previous run
  fs::create_directories(root_ + "/logs");
  std::ofstream(root_ + "/logs/old.log") << "log";
  hold_.GaveUp();
  const std::vector<uint64_t> rm = RemoveOld();
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "new")).ok());
  ASSERT_TRUE(journal_->Wait(PublishBytes("new/.metadata", "md")).ok());
  ASSERT_TRUE(journal_->Wait(Op(OpType::kUnlink, "logs/old.log")).ok());
  EXPECT_FALSE(journal_->WaitDoneFor(rm[2], 100ms));
  EXPECT_TRUE(Exists("old/.metadata")) << "gone while the tracker still names it";

  TrackerThenHeldGo(rm);
}

// A commit with no tracker or deletion after it (a loop without trackers, the last save of
// a run): the held deletions go once publication has been idle for the grace.
TEST_F(DeletionHoldTest, WithNothingAfterTheCommitTheHeldDeletionsGoAfterTheGrace) {
  hold_.GaveUp();
  const std::vector<uint64_t> rm = RemoveOld();
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "new")).ok());
  const auto committed_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(journal_->Wait(PublishBytes("new/.metadata", "md")).ok());
  EXPECT_TRUE(Exists("old/.metadata")) << "went at once, before a tracker could follow";
  ASSERT_TRUE(journal_->Wait(rm[2]).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - committed_at, 250ms);
  EXPECT_FALSE(Exists("old"));
}

// The application makes `old` again and saves into it: the held `rm -r old` goes first,
// in its order, or the new save would be deleted by it.
TEST_F(DeletionHoldTest, AnEntryThatMeetsAHeldDeletionLetsItGoFirst) {
  hold_.GaveUp();
  const std::vector<uint64_t> rm = RemoveOld();
  const uint64_t mk = Op(OpType::kMkdir, "old");
  ASSERT_TRUE(journal_->Wait(mk).ok());
  for (uint64_t s : rm) EXPECT_TRUE(journal_->Wait(s).ok());
  const uint64_t shard = PublishBytes("old/__0_0.distcp", "new shard");
  ASSERT_TRUE(journal_->Wait(shard).ok());
  EXPECT_EQ(Read("old/__0_0.distcp"), "new shard");
  EXPECT_FALSE(Exists("old/.metadata"));
  EXPECT_EQ(journal_->counts().held, 0u);
}

// A `.metadata` copied first into a directory whose `rm -r` is held (no mkdir: the
// directory was kept) meets it: the deletion goes first, not after the commit.
TEST_F(DeletionHoldTest, ACommitIntoTheDirectoryOfAHeldDeletionLetsItGoFirst) {
  hold_.GaveUp();
  const uint64_t unlink_md = Op(OpType::kUnlink, "old/.metadata");
  ASSERT_TRUE(journal_->WaitUnlessHalted(unlink_md).ok());
  EXPECT_TRUE(Exists("old/.metadata"));
  const uint64_t md = PublishBytes("old/.metadata", "md2");
  ASSERT_TRUE(journal_->Wait(md).ok());
  ASSERT_TRUE(journal_->Wait(unlink_md).ok());
  EXPECT_EQ(Read("old/.metadata"), "md2");
}

// A stop with deletions still held drops them: what they delete stays, nothing hangs.
TEST_F(DeletionHoldTest, AStopDropsHeldDeletionsAndKeepsWhatTheyDelete) {
  hold_.GaveUp();
  RemoveOld();
  EXPECT_EQ(journal_->counts().held, 3u);
  const auto start = std::chrono::steady_clock::now();
  journal_->Close();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_TRUE(Exists("old/.metadata"));
  EXPECT_TRUE(Exists("old/__0_0.distcp"));
  EXPECT_EQ(journal_->counts().held_dropped, 3u);
  EXPECT_EQ(OutcomeOf("old"), Code::kAborted);
}

// Without a given-up checkpoint nothing is held: a deletion applies in its place.
TEST_F(DeletionHoldTest, NothingIsHeldWithoutAGivenUpCheckpoint) {
  const std::vector<uint64_t> rm = RemoveOld();
  for (uint64_t s : rm) EXPECT_TRUE(journal_->Wait(s).ok());
  EXPECT_FALSE(Exists("old"));
  EXPECT_EQ(journal_->counts().held_total, 0u);
}

}  // namespace
}  // namespace ckptfs::store
