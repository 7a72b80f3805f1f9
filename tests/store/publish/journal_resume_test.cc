// Journal: a bounded stop (CloseWithin) of a halted or waiting publication leaves what is
// queued for the next start, its bytes durable, and the next start (Recover, QueueLeft)
// publishes it in order, byte-exact (G10, G11). A crash keeps the old rule (discard), see
// journal_crash_model_test.cc. Fixture: journal_fixture.h.
#include "tests/store/publish/journal_fixture.h"

namespace ckptfs::store {
namespace {

using namespace std::chrono_literals;

constexpr char kMissingShard[] = "ck/__1_0.distcp";

// A commit gate that waits for kMissingShard until it is on the backing store.
CommitCheck WaitForMissingShard(const std::string& root, const JournalEntry&, const QueuedFn&) {
  struct stat st;
  if (::stat((root + "/" + kMissingShard).c_str(), &st) == 0) return Status::Ok();
  return CommitCheck::Wait({kMissingShard}, 10ms);
}

class JournalResumeTest : public JournalTest {
 protected:
  // Every outcome reported by on_done, in order.
  TestHooks Recording(bool gate) {
    TestHooks hooks;
    if (gate) {
      hooks.commit_gate = [root = root_](const JournalEntry& e, const QueuedFn& q) {
        return WaitForMissingShard(root, e, q);
      };
    }
    hooks.on_done = [this](const JournalEntry& e, const Status& st) {
      std::lock_guard lock(mu_);
      done_.emplace_back(e.seq, st);
    };
    return hooks;
  }
  // Stops the journal, then recovers as the next start does.
  RecoveryReport Restart() {
    journal_.reset();
    auto report = Journal::Recover(dir_.get(), db_.get());
    EXPECT_TRUE(report.ok()) << report.status().ToString();
    return report.ok() ? std::move(report).value() : RecoveryReport{};
  }
  std::vector<std::pair<uint64_t, Status>> Done() {
    std::lock_guard lock(mu_);
    return done_;
  }

  std::mutex mu_;
  std::vector<std::pair<uint64_t, Status>> done_;
};

TEST_F(JournalResumeTest, AStopOfACommitWaitingForAShardLeavesEverythingAndTheNextStartPublishesIt) {
  MakeJournal(Recording(/*gate=*/true));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  {
    std::lock_guard lock(mu_);
    done_.clear();  // on_done ran before Wait() returned
  }
  TempFile md = StartFile("ck"), shard = StartFile("ck"), tracker = StartFile("");
  Write(&md, "metadata bytes");
  Write(&shard, std::string(10000, 's'), 4096);
  Write(&tracker, "1");
  std::vector<uint64_t> seqs = {Publish(md, "ck/.metadata"), Publish(shard, "ck/__0_0.distcp"),
                                Publish(tracker, "tracker"), Op(OpType::kMkdir, "after")};

  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> said;
  StopReport stop = journal_->CloseWithin(300ms, [&](const std::string& w) { said.push_back(w); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "the stop is bounded";
  EXPECT_EQ(stop.left, 4u);
  EXPECT_EQ(stop.dropped_publishes, 0u);
  EXPECT_NE(stop.waiting_for.find("ck/.metadata"), std::string::npos) << stop.waiting_for;
  EXPECT_NE(stop.waiting_for.find(kMissingShard), std::string::npos) << stop.waiting_for;
  EXPECT_NE(stop.waiting_for.find("3 more entries queued"), std::string::npos)
      << stop.waiting_for;
  ASSERT_FALSE(said.empty());
  EXPECT_EQ(said.front(), stop.waiting_for) << "it said what it waited for while it waited";
  // Nothing was applied past the commit, and nothing was thrown away.
  EXPECT_FALSE(Exists("ck/.metadata"));
  EXPECT_FALSE(Exists("tracker"));
  EXPECT_FALSE(Exists("after"));
  EXPECT_TRUE(Exists(md.temp) && Exists(shard.temp) && Exists(tracker.temp));
  EXPECT_TRUE(Done().empty()) << "left entries are not reported done";
  EXPECT_EQ(KeysWithPrefix(db_.get(), "m/left").size(), 1u);

  RecoveryReport report = Restart();
  EXPECT_EQ(report.entries_discarded, 0u);
  EXPECT_EQ(report.temps_removed, 0u);
  ASSERT_EQ(report.resumed.size(), 4u);
  for (size_t i = 0; i < seqs.size(); ++i) EXPECT_EQ(report.resumed[i].seq, seqs[i]);
  EXPECT_EQ(report.resumed[0].path, "ck/.metadata");
  EXPECT_EQ(report.resumed[0].target, nullptr);

  // The condition clears (the other node's shard arrives); the next start publishes all.
  std::ofstream(root_ + "/" + kMissingShard) << "other node";
  MakeJournal(Recording(/*gate=*/true));
  journal_->QueueLeft(std::move(report.resumed));
  EXPECT_TRUE(journal_->WaitLeft(5s));
  EXPECT_EQ(Read("ck/.metadata"), "metadata bytes");
  EXPECT_EQ(Read("ck/__0_0.distcp"), std::string(10000, 's'));
  EXPECT_EQ(Read("tracker"), "1");
  EXPECT_TRUE(Exists("after"));
  EXPECT_TRUE(Tree(root_).temps.empty());
  std::vector<uint64_t> order;
  for (const auto& [seq, st] : Done()) {
    EXPECT_TRUE(st.ok()) << seq << ": " << st.ToString();
    order.push_back(seq);
  }
  EXPECT_EQ(order, seqs) << "resumed in the order they were made";
  EXPECT_GT(Op(OpType::kMkdir, "later"), seqs.back()) << "new entries come after them";
  journal_->Drain();
  EXPECT_TRUE(KeysWithPrefix(db_.get(), "j/").empty());
  EXPECT_TRUE(KeysWithPrefix(db_.get(), "t/").empty());
  EXPECT_TRUE(KeysWithPrefix(db_.get(), "m/left").empty()) << "the marker goes with the last";
}

TEST_F(JournalResumeTest, AHaltedPublishIsLeftAndPublishedByTheNextStartOnceSpaceReturns) {
  std::atomic<bool> full{true};
  dir_->SetRenameHook([&](const std::string&, const std::string& to) {
    return full && to == "x" ? ENOSPC : 0;
  });
  MakeJournal(Recording(/*gate=*/false));
  TempFile f = StartFile("");
  Write(&f, std::string(9000, 'x'), 4096);
  uint64_t s1 = Publish(f, "x");
  uint64_t s2 = Op(OpType::kUnlink, "old");
  EXPECT_EQ(journal_->Wait(s1).code(), Code::kNoSpace);
  StopReport stop = journal_->CloseWithin(300ms);
  EXPECT_EQ(stop.left, 2u);
  EXPECT_NE(stop.waiting_for.find("halted at publish #" + std::to_string(s1)), std::string::npos)
      << stop.waiting_for;
  EXPECT_FALSE(Exists("x"));

  RecoveryReport report = Restart();
  ASSERT_EQ(report.resumed.size(), 2u);
  EXPECT_EQ(report.resumed[1].seq, s2);
  full = false;
  MakeJournal(Recording(/*gate=*/false));
  journal_->QueueLeft(std::move(report.resumed));
  EXPECT_TRUE(journal_->WaitLeft(5s));
  EXPECT_EQ(Read("x"), std::string(9000, 'x'));
  EXPECT_FALSE(Exists(f.temp));
}

TEST_F(JournalResumeTest, ACrashOfTheResumingRunResumesTheSameEntriesAgain) {
  MakeJournal(Recording(/*gate=*/true));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile md = StartFile("ck");
  Write(&md, "md");
  uint64_t s = Publish(md, "ck/.metadata");
  EXPECT_EQ(journal_->CloseWithin(200ms).left, 1u);
  RecoveryReport first = Restart();
  ASSERT_EQ(first.resumed.size(), 1u);
  // The next start queues them, appends one entry of its own and dies (the state db as a
  // crash leaves it): the left entry is resumed again; its own entry is a crash's,
  // discarded and its temp removed (journal_crash_model_test.cc).
  MakeJournal(Recording(/*gate=*/true));
  journal_->QueueLeft(std::move(first.resumed));
  TempFile late = StartFile("");
  Write(&late, "late");
  EXPECT_GT(Publish(late, "late"), s);
  std::unique_ptr<StateDb> crashed = CopyDb(db_.get(), tmp_.Sub("crashed", false));
  EXPECT_EQ(journal_->CloseWithin(100ms).left, 2u);
  journal_.reset();
  auto second = Journal::Recover(dir_.get(), crashed.get());
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  ASSERT_EQ(second->resumed.size(), 1u);
  EXPECT_EQ(second->resumed[0].seq, s);
  EXPECT_EQ(second->entries_discarded, 1u);
  EXPECT_TRUE(Exists(md.temp));
  EXPECT_FALSE(Exists(late.temp)) << "the crashed run's own temp is removed, as after any crash";
  EXPECT_FALSE(Exists("ck/.metadata"));
}

TEST_F(JournalResumeTest, BytesThatCannotBeMadeDurableAreNotHandedOver) {
  MakeJournal(Recording(/*gate=*/false));
  TempFile f = StartFile("");
  Write(&f, "data");
  pipeline_->Drain();
  dir_->FailNthFsync(dir_->fsync_calls() + 1, EIO);  // a failed fsync: the bytes are lost
  uint64_t s1 = Publish(f, "x");
  Op(OpType::kMkdir, "after");
  EXPECT_FALSE(journal_->Wait(s1).ok());
  StopReport stop = journal_->CloseWithin(200ms);
  EXPECT_EQ(stop.left, 0u);
  EXPECT_EQ(stop.dropped_publishes, 1u);
  EXPECT_FALSE(Exists("x"));
  EXPECT_FALSE(Exists("after"));
  EXPECT_FALSE(Exists(f.temp));
  EXPECT_TRUE(KeysWithPrefix(db_.get(), "m/left").empty());
  RecoveryReport report = Restart();
  EXPECT_TRUE(report.resumed.empty());
}

TEST_F(JournalResumeTest, AStopThatProgressesIsNotCutShort) {
  // Each publish's fsync takes 150 ms, longer than the bound: the stop still waits for all.
  dir_->SetFsyncHook([](int) {
    std::this_thread::sleep_for(150ms);
    return 0;
  });
  MakeJournal(Recording(/*gate=*/false));
  std::vector<TempFile> files;
  for (int i = 0; i < 4; ++i) {
    files.push_back(StartFile(""));
    Write(&files.back(), "f" + std::to_string(i));
    Publish(files.back(), "f" + std::to_string(i));
  }
  StopReport stop = journal_->CloseWithin(100ms);
  EXPECT_EQ(stop.left, 0u);
  EXPECT_TRUE(stop.waiting_for.empty());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(Read("f" + std::to_string(i)), "f" + std::to_string(i));
}

}  // namespace
}  // namespace ckptfs::store
