// Journal: the commit gate (a `.metadata` waits for its shards, G5) and recovery of a
// previous run's temp files. Fixture: journal_fixture.h.
#include <algorithm>
#include <atomic>
#include <future>

#include "tests/store/publish/journal_fixture.h"

namespace ckptfs::store {
namespace {

// ---------------------------------------------------------------------- commit gate

TEST_F(JournalTest, ARefusedCommitHaltsTheJournalUntilItsCheckpointIsAborted) {
  std::mutex mu;
  std::vector<std::string> gated;
  TestHooks hooks;
  hooks.commit_gate = [&](const JournalEntry& e, const QueuedFn&) {
    std::lock_guard lock(mu);
    gated.push_back(e.path);
    return Status(Code::kAborted, "checkpoint failed");
  };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck2")).ok());
  TempFile shard = StartFile("ck"), md_tmp = StartFile("ck"), md = StartFile("ck2");
  Write(&shard, "shard");
  Write(&md_tmp, "md");
  Write(&md, "md2");
  uint64_t s1 = Publish(shard, "ck/__0_0.distcp");
  uint64_t s2 = Publish(md_tmp, "ck/.metadata.tmp");
  uint64_t s3 = Op(OpType::kRename, "ck/.metadata", "ck/.metadata.tmp");  // DCP's commit
  uint64_t s4 = Publish(md, "ck2/.metadata");                             // written in place
  uint64_t s5 = Op(OpType::kMkdir, "after");
  EXPECT_TRUE(journal_->Wait(s1).ok());
  EXPECT_TRUE(journal_->Wait(s2).ok());
  EXPECT_EQ(journal_->Wait(s3).code(), Code::kAborted);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(Exists("after")) << "applied past a refused commit";
  EXPECT_EQ(journal_->Abort("ck").size(), 1u);  // only the commit was still pending
  EXPECT_EQ(journal_->Wait(s4).code(), Code::kAborted);
  EXPECT_EQ(journal_->Abort("ck2").size(), 1u);
  EXPECT_TRUE(journal_->Wait(s5).ok());
  EXPECT_FALSE(Exists("ck/.metadata"));
  EXPECT_FALSE(Exists("ck2/.metadata"));
  EXPECT_FALSE(Exists(md.temp)) << "a refused commit file's temp must be removed";
  EXPECT_TRUE(Exists("ck/.metadata.tmp"));  // the application's own name; not a commit
  EXPECT_EQ(Read("ck/__0_0.distcp"), "shard");
  EXPECT_TRUE(Exists("after"));
  std::lock_guard lock(mu);
  EXPECT_EQ(gated, (std::vector<std::string>{"ck/.metadata", "ck2/.metadata"}))
      << "the gate runs exactly for entries that make a .metadata appear";
}

// An entry the operator's abort drops leaves the queue before its Finalize (its temp file
// removed, the delegate told) has run: until then it still counts as pending, so that a
// stats reader or `ckptfs-admin wait` never sees 0 with its outcome unsettled. Before, the
// count read 0 inside that Finalize.
TEST_F(JournalTest, EntriesAnAbortDropsStayPendingUntilTheirOutcomeIsSettled) {
  TestHooks hooks;
  hooks.commit_gate = [](const JournalEntry&, const QueuedFn&) {
    return Status(Code::kAborted, "checkpoint failed");
  };
  std::vector<uint64_t> pending_when_told;  // written by the aborting thread alone
  hooks.on_done = [&](const JournalEntry&, const Status& st) {
    if (st.message() == "aborted by the operator") {
      pending_when_told.push_back(journal_->counts().pending);
    }
  };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile shard = StartFile("ck"), md = StartFile("ck"), late = StartFile("ck");
  Write(&shard, "shard");
  Write(&md, "md");
  Write(&late, "late");
  uint64_t s1 = Publish(shard, "ck/__0_0.distcp");
  uint64_t s2 = Publish(md, "ck/.metadata");  // refused by the gate: publication halts
  uint64_t s3 = Publish(late, "ck/__1_0.distcp");
  EXPECT_TRUE(journal_->Wait(s1).ok());
  EXPECT_EQ(journal_->Wait(s2).code(), Code::kAborted);
  EXPECT_EQ(journal_->Abort("ck").size(), 2u);
  EXPECT_EQ(journal_->Wait(s3).code(), Code::kAborted);
  ASSERT_EQ(pending_when_told.size(), 2u);
  EXPECT_EQ(pending_when_told[0], 2u) << "both dropped entries are still unsettled";
  EXPECT_EQ(pending_when_told[1], 2u) << "settled together, once the abort told them all";
  EXPECT_EQ(journal_->counts().pending, 0u);
  EXPECT_FALSE(Exists(md.temp));
  EXPECT_FALSE(Exists(late.temp));
}

// G10: a `.metadata` that waits for shards written elsewhere (another node, or nobody),
// while the application has since made the same `.metadata` again (a second save into the
// same directory), is decided at once as superseded: skipped, never published, no halt,
// in either mode; the entries behind it and the later save's commit go on. On HEAD
// 6f2c1b5 it waited for the commit timeout, then halted the journal (async mode).
class SupersedeTest : public JournalTest {
 protected:
  void Run(bool halt_on_failure) {
    std::atomic<uint64_t> stuck{0};
    TestHooks hooks;
    hooks.options.halt_on_failure = halt_on_failure;
    hooks.commit_gate = [&](const JournalEntry& e, const QueuedFn&) -> CommitCheck {
      if (e.seq != stuck.load()) return Status::Ok();
      CommitCheck wait = CommitCheck::Wait({}, std::chrono::milliseconds(20));
      wait.waits_for_unwritten = true;  // a shard nobody here writes
      return wait;
    };
    MakeJournal(std::move(hooks));
    // The journal stops before `stuck`, which its gate reads, goes: on every way out.
    struct StopJournal {
      std::unique_ptr<Journal>& journal;
      ~StopJournal() { journal.reset(); }
    } stop_journal{journal_};
    ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
    TempFile md1 = StartFile("ck"), md2 = StartFile("ck");
    Write(&md1, "save 1");
    Write(&md2, "save 2");
    // The gate is asked only once the rename reaches the head: mark it stuck first.
    stuck = journal_->counts().last_appended + 2;
    ASSERT_EQ(Publish(md1, "ck/.metadata.tmp") + 1, stuck.load());
    const uint64_t commit1 = Op(OpType::kRename, "ck/.metadata", "ck/.metadata.tmp");
    const uint64_t between = Op(OpType::kMkdir, "between");
    auto first = std::async(std::launch::async, [&] { return journal_->Wait(commit1); });
    // Still waiting (nothing replaced it yet): not decided by itself.
    EXPECT_EQ(first.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
    Publish(md2, "ck/.metadata.tmp");
    const uint64_t commit2 = Op(OpType::kRename, "ck/.metadata", "ck/.metadata.tmp");
    if (first.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
      journal_->Abort("ck");  // so that the test ends
      FAIL() << "the superseded commit still waits";
    }
    EXPECT_EQ(first.get().code(), Code::kSuperseded);
    EXPECT_TRUE(journal_->Wait(between).ok());
    EXPECT_TRUE(journal_->Wait(commit2).ok());
    EXPECT_FALSE(journal_->halted().has_value());
    EXPECT_EQ(Read("ck/.metadata"), "save 2");
    EXPECT_TRUE(Exists("between"));
  }
};

TEST_F(SupersedeTest, ACommitWaitingForShardsFromElsewhereIsSupersededByTheNextSaveAsync) {
  Run(/*halt_on_failure=*/true);
}

TEST_F(SupersedeTest, ACommitWaitingForShardsFromElsewhereIsSupersededByTheNextSaveStrict) {
  Run(/*halt_on_failure=*/false);
}

TEST_F(JournalTest, AMetadataQueuedBeforeItsShardsCommitsOnceTheyArePublishedAheadOfIt) {
  // As `cp -r` or `rsync` copy a checkpoint: `.metadata` sorts first.
  std::mutex mu;
  std::vector<std::string> order;
  TestHooks hooks;
  const std::vector<std::string> shards = {"ck/__0_0.distcp", "ck/__1_0.distcp"};
  hooks.commit_gate = [&](const JournalEntry&, const QueuedFn& queued) -> CommitCheck {
    std::vector<std::string> waiting;
    for (const auto& p : shards) {
      if (queued(p) || !Exists(p)) waiting.push_back(p);
    }
    if (waiting.empty()) return Status::Ok();
    return CommitCheck::Wait(waiting, std::chrono::milliseconds(5000));
  };
  hooks.on_done = [&](const JournalEntry& e, const Status&) {
    std::lock_guard lock(mu);
    order.push_back(e.path);
  };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile md = StartFile(""), a = StartFile(""), b = StartFile(""), t = StartFile("");
  Write(&md, "metadata");
  Write(&a, std::string(70000, 'a'));
  Write(&b, std::string(30000, 'b'));
  Write(&t, "1");
  uint64_t commit = Publish(md, "ck/.metadata");
  uint64_t chmod = Op(OpType::kChmod, "ck/.metadata", "", 0644);  // cp -p: not a shard
  uint64_t sa = Publish(a, "ck/__0_0.distcp");
  uint64_t tracker = Publish(t, "tracker");  // written after the copy started: stays behind
  EXPECT_TRUE(journal_->Wait(sa).ok()) << "a shard goes ahead of its waiting .metadata";
  EXPECT_FALSE(Exists("ck/.metadata"));
  EXPECT_FALSE(Exists("tracker")) << "an unrelated entry went ahead of the commit";
  uint64_t sb = Publish(b, "ck/__1_0.distcp");  // the last shard, later
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(journal_->Wait(commit).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2))
      << "the commit must follow the last shard at once, not at the gate's recheck";
  EXPECT_TRUE(journal_->Wait(chmod).ok());
  EXPECT_TRUE(journal_->Wait(tracker).ok());
  EXPECT_TRUE(journal_->Wait(sb).ok());
  EXPECT_EQ(journal_->counts().applied_ahead, 2u);
  std::lock_guard lock(mu);
  EXPECT_EQ(order, (std::vector<std::string>{"ck", "ck/__0_0.distcp", "ck/__1_0.distcp",
                                             "ck/.metadata", "ck/.metadata", "tracker"}));
}

TEST_F(JournalTest, AShardAheadOfItsCommitWaitsForAnEntryThatTouchesItsName) {
  // A rename of the checkpoint directory queued between the commit and the shard: the
  // shard's publish may not overtake it.
  TestHooks hooks;
  std::atomic<int> gate_calls{0};
  hooks.commit_gate = [&](const JournalEntry&, const QueuedFn& queued) -> CommitCheck {
    // The shard is still to come when the gate is first asked (the test queues it after
    // the commit): "not yet" either way, never "gone".
    ++gate_calls;
    (void)queued;
    return CommitCheck::Wait({"ck/__0_0.distcp"}, std::chrono::milliseconds(20));
  };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile md = StartFile(""), a = StartFile("");
  Write(&md, "metadata");
  Write(&a, "shard");
  uint64_t commit = Publish(md, "ck/.metadata");
  Op(OpType::kRmdir, "ck");  // touches the shard's name (it fails: ck is not empty)
  Publish(a, "ck/__0_0.distcp");
  // The gate is asked again and again (it says "recheck in 20 ms"); the shard never moves.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (gate_calls.load() < 5 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GE(gate_calls.load(), 5) << "the gate is asked again";
  EXPECT_FALSE(Exists("ck/__0_0.distcp")) << "a shard overtook an entry on its own path";
  EXPECT_EQ(journal_->Abort("ck").size(), 3u);
  EXPECT_EQ(journal_->Wait(commit).code(), Code::kAborted);
}

// G10: a chmod, chown or utimens of the checkpoint directory queued between a `.metadata`
// copied first and its shard (`touch ckpt/`, `cp -p`, `chmod -R`) does not keep the shard
// from going ahead: before, the commit waited for a publish that could only follow it, for
// ever (the shard counts as queued here, so no timeout applied).
TEST_F(JournalTest, AnAttributeChangeOfTheDirectoryDoesNotKeepAShardBehindItsCommit) {
  TestHooks hooks;
  hooks.commit_gate = [&](const JournalEntry&, const QueuedFn& queued) -> CommitCheck {
    const std::string shard = "ck/__0_0.distcp";
    if (!queued(shard) && Exists(shard)) return Status::Ok();
    return CommitCheck::Wait({shard}, std::chrono::milliseconds(20));
  };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile md = StartFile(""), a = StartFile("");
  Write(&md, "metadata");
  Write(&a, "shard");
  const uint64_t commit = Publish(md, "ck/.metadata");
  const uint64_t chmod = Op(OpType::kChmod, "ck", "", 0755);
  const uint64_t times = Op(OpType::kUtimens, "ck");
  const uint64_t shard = Publish(a, "ck/__0_0.distcp");
  auto done = std::async(std::launch::async, [&] { return journal_->Wait(commit); });
  if (done.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    journal_->Abort("ck");  // so that the test ends
    FAIL() << "the commit waits for a shard kept behind a chmod/utimens of its directory";
  }
  EXPECT_TRUE(done.get().ok());
  EXPECT_TRUE(journal_->Wait(chmod).ok());
  EXPECT_TRUE(journal_->Wait(times).ok());
  EXPECT_TRUE(journal_->Wait(shard).ok());
  EXPECT_EQ(Read("ck/__0_0.distcp"), "shard");
}

// Strict callers behind a commit that waits for unwritten shards are let go early; a halt
// before their entry must still reach them (it was hidden by that early return, and the
// namespace's wait for a pending rename spun on it at full CPU).
TEST_F(JournalTest, WaitUnlessHaltedReportsAHaltEvenBehindACommitWaitingForUnwrittenShards) {
  TestHooks hooks;
  std::atomic<bool> refuse{false};
  hooks.commit_gate = [&](const JournalEntry&, const QueuedFn&) -> CommitCheck {
    if (refuse) return Status(Code::kTimeout, "shard never became durable");
    CommitCheck wait = CommitCheck::Wait({}, std::chrono::milliseconds(20));
    wait.waits_for_unwritten = true;
    return wait;
  };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile md = StartFile("");
  Write(&md, "metadata");
  Publish(md, "ck/.metadata");
  // Not a mkdir: its waiter would apply that ahead (WaitUnlessHalted).
  const uint64_t behind = Op(OpType::kMknod, "behind", "", S_IFIFO | 0644);
  EXPECT_TRUE(journal_->WaitUnlessHalted(behind).ok()) << "let go early, as before";
  EXPECT_FALSE(journal_->WaitDoneFor(behind, std::chrono::milliseconds(50)));
  refuse = true;  // the commit times out: the journal halts at it
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!journal_->halted() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(journal_->halted().has_value());
  EXPECT_EQ(journal_->WaitUnlessHalted(behind).code(), Code::kTimeout)
      << "a halt before the entry is hidden by the early return";
  journal_->Abort("ck");
  EXPECT_TRUE(journal_->Wait(behind).ok());
}

// G10, a stop: a FUSE worker blocked in a journal wait (here a strict caller behind a
// commit that waits for a shard queued here) kept libfuse's loop, and so the whole stop,
// from ending. ReleaseWaiters() (the FUSE session has exited) lets every such wait return
// with an error naming what publication waits for; the entries stay queued.
TEST_F(JournalTest, ReleaseWaitersLetsBlockedCallersGoAndSaysWhatPublicationWaitsFor) {
  TestHooks hooks;
  hooks.commit_gate = [&](const JournalEntry&, const QueuedFn&) -> CommitCheck {
    return CommitCheck::Wait({"ck/__0_0.distcp"}, std::chrono::milliseconds(20));
  };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile md = StartFile("");
  Write(&md, "metadata");
  Publish(md, "ck/.metadata");
  // Not a mkdir: its waiter would apply that ahead (WaitUnlessHalted).
  const uint64_t behind = Op(OpType::kMknod, "behind", "", S_IFIFO | 0644);
  auto strict = std::async(std::launch::async, [&] { return journal_->WaitUnlessHalted(behind); });
  auto plain = std::async(std::launch::async, [&] { return journal_->Wait(behind); });
  EXPECT_EQ(strict.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  journal_->ReleaseWaiters();
  ASSERT_EQ(strict.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  ASSERT_EQ(plain.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  const Status st = strict.get();
  EXPECT_EQ(st.code(), Code::kAborted);
  EXPECT_NE(st.message().find("stopping"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("ck/__0_0.distcp"), std::string::npos) << st.ToString();
  EXPECT_EQ(plain.get().code(), Code::kAborted);
  EXPECT_FALSE(journal_->WaitDoneFor(behind, std::chrono::milliseconds(10)));
  EXPECT_EQ(journal_->counts().pending, 2u) << "releasing the waiters drops nothing";
  journal_->Abort("ck");
}

// An abort that lands while the gate is being asked about the commit (the entry busy, not
// being applied) waits for that answer and drops the commit with the rest. It was kept
// queued as if being applied, waiting for shards nobody would write until the commit
// timeout: with a gate that never times out (this one), a close after it never returned
// (CI of f42c0f6, under ASan, in the test above).
TEST_F(JournalTest, AnAbortDuringTheGatesCheckOfItsCommitDropsTheCommit) {
  std::promise<void> asked;
  std::atomic<bool> first{true}, answer_ready{false};
  TestHooks hooks;
  hooks.commit_gate = [&](const JournalEntry&, const QueuedFn&) -> CommitCheck {
    if (answer_ready) return CommitCheck();  // the fallback below: never hang the close
    if (first.exchange(false)) {
      asked.set_value();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the abort lands now
    }
    return CommitCheck::Wait({"ck/__0_0.distcp"}, std::chrono::milliseconds(20));
  };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile md = StartFile("ck");
  Write(&md, "metadata");
  const uint64_t commit = Publish(md, "ck/.metadata");
  const uint64_t behind = Op(OpType::kMkdir, "behind");
  asked.get_future().wait();
  const std::vector<std::string> dropped = journal_->Abort("ck");
  const bool has_commit = std::any_of(dropped.begin(), dropped.end(), [](const std::string& d) {
    return d.find("ck/.metadata") != std::string::npos;
  });
  if (!has_commit) answer_ready = true;
  EXPECT_TRUE(has_commit) << "the commit under the gate's check was not dropped";
  EXPECT_EQ(journal_->Wait(commit).code(), Code::kAborted);
  EXPECT_TRUE(journal_->Wait(behind).ok());
  EXPECT_FALSE(Exists("ck/.metadata"));
  EXPECT_TRUE(Exists("behind"));
}

// The gate wired into the journal as the daemon does with --peers (cross-node order).
CommitGateOptions GateOptions() {
  CommitGateOptions options;
  options.timeout = std::chrono::seconds(30);
  return options;
}
TestHooks GatedHooks(CommitGate* gate) {
  TestHooks hooks;
  hooks.commit_gate = [gate](const JournalEntry& e, const QueuedFn& queued) {
    const QueuedIf q(queued);
    return gate->Check(e, &q);
  };
  hooks.gated = [](const JournalEntry& e) { return CommitGate::IsOrderedEntry(e); };
  hooks.on_done = [gate](const JournalEntry& e, const Status& st) { gate->NoteApplied(e, st); };
  return hooks;
}

// A node that published a shard of a checkpoint whose `.metadata` another node writes
// (the gate wired as the daemon does with --peers) holds its later tracker and delete until
// that `.metadata` shows on the backing store; files inside the checkpoint are not held.
TEST_F(JournalTest, TrackerAndDeleteWaitForACheckpointCommittedElsewhere) {
  CommitGate gate(dir_.get(), GateOptions());
  MakeJournal(GatedHooks(&gate));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile old = StartFile(""), shard = StartFile("ck"), tracker = StartFile("");
  TempFile inside = StartFile("ck");
  Write(&old, "old", 3);
  ASSERT_TRUE(journal_->Wait(Publish(old, "old.txt")).ok());
  Write(&shard, std::string(10000, 's'), 1000);
  ASSERT_TRUE(journal_->Wait(Publish(shard, "ck/__1_0.distcp")).ok());
  Write(&inside, "inside", 6);
  ASSERT_TRUE(journal_->Wait(Publish(inside, "ck/notes.txt")).ok());  // not held
  Write(&tracker, "ck", 2);
  const uint64_t t = Publish(tracker, "latest.txt");
  const uint64_t u = Op(OpType::kUnlink, "old.txt");
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_FALSE(Exists("latest.txt"));
  EXPECT_TRUE(Exists("old.txt"));
  EXPECT_LT(journal_->counts().applied, t);
  // The other node commits.
  { std::ofstream(root_ + "/ck/.metadata") << "committed elsewhere"; }
  ASSERT_TRUE(journal_->Wait(t).ok());
  ASSERT_TRUE(journal_->Wait(u).ok());
  EXPECT_EQ(Read("latest.txt"), "ck");
  EXPECT_FALSE(Exists("old.txt"));
  EXPECT_GT(gate.remote_polls(), 0u);
}

// A second save into the same directory: the first save's `.metadata` is still on the
// backing store while this node's new shard is published. The tracker written after it
// must wait for the new `.metadata`, not pass on the old one.
TEST_F(JournalTest, AnEarlierSavesMetadataDoesNotReleaseATrackerOfTheNextSave) {
  CommitGate gate(dir_.get(), GateOptions());
  MakeJournal(GatedHooks(&gate));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  { std::ofstream(root_ + "/ck/.metadata") << "the first save"; }
  // Past the file system's timestamp granularity (a jiffy).
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  TempFile shard = StartFile("ck"), tracker = StartFile("");
  Write(&shard, std::string(10000, 's'), 1000);
  struct timespec written {};
  clock_gettime(CLOCK_REALTIME, &written);
  ASSERT_TRUE(journal_->Wait(Publish(shard, "ck/__1_0.distcp", written)).ok());
  Write(&tracker, "ck", 2);
  const uint64_t t = Publish(tracker, "latest.txt");
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_FALSE(Exists("latest.txt")) << "released by the first save's .metadata";
  EXPECT_LT(journal_->counts().applied, t);
  // The other node commits the second save: a new `.metadata` replaces the old one.
  { std::ofstream(root_ + "/ck/.metadata.new") << "the second save"; }
  std::filesystem::rename(root_ + "/ck/.metadata.new", root_ + "/ck/.metadata");
  ASSERT_TRUE(journal_->Wait(t).ok());
  EXPECT_EQ(Read("latest.txt"), "ck");
}

TEST(CommitGate, OrderedEntriesAreTrackersRenamesAndDeletesNotShardsOrCommits) {
  auto entry = [](OpType op, const std::string& path) {
    JournalEntry e;
    e.op = op;
    e.path = path;
    return e;
  };
  EXPECT_TRUE(CommitGate::IsOrderedEntry(entry(OpType::kPublish, "latest.txt")));
  EXPECT_TRUE(CommitGate::IsOrderedEntry(entry(OpType::kRename, "a/b")));
  EXPECT_TRUE(CommitGate::IsOrderedEntry(entry(OpType::kUnlink, "ck/__0_0.distcp")));
  EXPECT_TRUE(CommitGate::IsOrderedEntry(entry(OpType::kRmdir, "ck")));
  EXPECT_FALSE(CommitGate::IsOrderedEntry(entry(OpType::kPublish, "ck/__0_0.distcp")));
  EXPECT_FALSE(CommitGate::IsOrderedEntry(entry(OpType::kRename, "ck/.metadata")));
  EXPECT_FALSE(CommitGate::IsOrderedEntry(entry(OpType::kMkdir, "ck2")));
}

TEST_F(JournalTest, TheCommitGateSeesEveryEarlierShardDurableAndTheCommitFileComplete) {
  std::string gate_problem;
  TestHooks hooks;
  hooks.commit_gate = [&](const JournalEntry& e, const QueuedFn&) {
    // Every shard published before the commit is under its real name, fsynced.
    for (const char* shard : {"ck/__0_0.distcp", "ck/__1_0.distcp"}) {
      if (!Exists(shard)) gate_problem += std::string(shard) + " missing; ";
      if (dir_->HasUnsyncedData(std::string(shard))) gate_problem += "unsynced shard; ";
    }
    // The commit file itself is complete and durable when the gate reads it.
    if (Read(e.from) != "the metadata") gate_problem += "metadata incomplete; ";
    if (dir_->HasUnsyncedData(e.from)) gate_problem += "metadata unsynced; ";
    return Status::Ok();
  };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile a = StartFile("ck"), b = StartFile("ck"), md = StartFile("ck");
  Write(&a, std::string(100000, 'a'), 1000);
  Write(&b, std::string(100000, 'b'), 1000);
  Write(&md, "the metadata", 3);
  Publish(a, "ck/__0_0.distcp");
  Publish(b, "ck/__1_0.distcp");
  uint64_t commit = Publish(md, "ck/.metadata");
  ASSERT_TRUE(journal_->Wait(commit).ok());
  EXPECT_EQ(gate_problem, "");
  EXPECT_EQ(Read("ck/.metadata"), "the metadata");
}

TEST_F(JournalTest, ADiscardRemovesTheTempAndItsRecord) {
  MakeJournal();
  TempFile f = StartFile("");
  Write(&f, "gone");
  pipeline_->Drain();
  JournalEntry e;
  e.op = OpType::kDiscard;
  e.from = f.temp;
  e.file_id = f.id;
  ASSERT_TRUE(journal_->Wait(*journal_->Append(std::move(e))).ok());
  EXPECT_FALSE(Exists(f.temp));
  EXPECT_TRUE(KeysWithPrefix(db_.get(), "t/").empty());
}

TEST_F(JournalTest, UnlinkRmdirAndMkdirOfAnAlreadyReachedStateSucceed) {
  MakeJournal();
  EXPECT_TRUE(journal_->Wait(Op(OpType::kUnlink, "never-existed")).ok());
  EXPECT_TRUE(journal_->Wait(Op(OpType::kRmdir, "never-existed-dir")).ok());
  ASSERT_EQ(::mkdir((root_ + "/d").c_str(), 0755), 0);
  EXPECT_TRUE(journal_->Wait(Op(OpType::kMkdir, "d")).ok());
  EXPECT_EQ(journal_->counts().skipped, 0u);
}

// ------------------------------------------------------------------------- recovery

TEST_F(JournalTest, RecoverRemovesTheRegisteredTempsOfACrashedRunAndClearsItsEntries) {
  Latch gate;
  TestHooks hooks;
  hooks.commit_gate = [&](const JournalEntry&, const QueuedFn&) {
    gate.Wait();
    return Status::Ok();
  };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile md = StartFile("ck");
  Write(&md, "metadata");
  uint64_t commit = Publish(md, "ck/.metadata");  // blocks in the gate
  TempFile shard = StartFile("ck");
  Write(&shard, std::string(30000, 's'));
  Publish(shard, "ck/__0_0.distcp");
  const uint64_t never_created = journal_->temps()->NextId();
  ASSERT_TRUE(journal_->temps()->Register(never_created, "ck/.ckptfs-tmp.never").ok());
  gate.AwaitWaiters(1);
  pipeline_->Drain();
  std::vector<uint64_t> ids_before = {md.id, shard.id, never_created};

  dir_->SimulateCrash();
  std::unique_ptr<StateDb> after_crash = CopyDb(db_.get(), tmp_.Sub("state2", false));
  gate.Open();
  EXPECT_FALSE(journal_->Wait(commit).ok());
  journal_.reset();  // drains against the dead directory; nothing changes on disk
  const TreeState crashed = Tree(root_);
  EXPECT_EQ(crashed.temps.size(), 2u);
  EXPECT_FALSE(Exists("ck/.metadata"));

  auto backing = BackingDir::Open(root_);
  ASSERT_TRUE(backing.ok());
  auto report = Journal::Recover(backing->get(), after_crash.get());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->temps_removed, 2u);
  EXPECT_EQ(report->entries_discarded, 2u);
  std::vector<std::string> discarded = report->lost_paths;
  std::sort(discarded.begin(), discarded.end());
  EXPECT_EQ(discarded, (std::vector<std::string>{"ck/.metadata", "ck/__0_0.distcp"}));
  const TreeState recovered = Tree(root_);
  EXPECT_TRUE(recovered.temps.empty());
  EXPECT_EQ(recovered.files, crashed.files) << "recovery must touch temps only";
  EXPECT_EQ(recovered.dirs, crashed.dirs);
  EXPECT_TRUE(KeysWithPrefix(after_crash.get(), "j/").empty());
  EXPECT_TRUE(KeysWithPrefix(after_crash.get(), "t/").empty());
  EXPECT_EQ(KeysWithPrefix(after_crash.get(), "l/"),
            (std::vector<std::string>{"l/ck/.metadata", "l/ck/__0_0.distcp"}))
      << "what the crash lost is kept for the commit query (LostPublishes)";

  auto again = Journal::Recover(backing->get(), after_crash.get());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->temps_removed, 0u);
  EXPECT_EQ(again->entries_discarded, 0u);

  EXPECT_TRUE(again->lost_paths.empty());

  // The next run never reuses a file id (and so a temp name) of the crashed one.
  auto next = Journal::Create(backing->get(), after_crash.get(), nullptr);
  ASSERT_TRUE(next.ok());
  const uint64_t id = (*next)->temps()->NextId();
  for (uint64_t old : ids_before) EXPECT_GT(id, old);
}

// A publish renamed into place before the crash, whose entry record the crash kept (the
// record goes after the rename): its temp file is gone, so it is not lost; the one whose
// temp file is still there is.
TEST_F(JournalTest, RecoverCountsAsLostOnlyThePublishesWhoseTempFileIsStillThere) {
  Latch gate;
  TestHooks hooks;
  hooks.commit_gate = [&](const JournalEntry&, const QueuedFn&) {
    gate.Wait();
    return Status::Ok();
  };
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile md = StartFile("ck");
  Write(&md, "metadata");
  const uint64_t commit = Publish(md, "ck/.metadata");  // blocks in the gate
  TempFile renamed = StartFile("ck");
  Write(&renamed, std::string(3000, 'a'));
  Publish(renamed, "ck/__0_0.distcp");
  TempFile kept = StartFile("ck");
  Write(&kept, std::string(3000, 'b'));
  Publish(kept, "ck/__1_0.distcp");
  gate.AwaitWaiters(1);
  pipeline_->Drain();

  dir_->SimulateCrash();
  std::unique_ptr<StateDb> after_crash = CopyDb(db_.get(), tmp_.Sub("state2", false));
  gate.Open();
  EXPECT_FALSE(journal_->Wait(commit).ok());
  journal_.reset();
  // The rename the crashed run had made before it died.
  fs::rename(root_ + "/" + renamed.temp, root_ + "/ck/__0_0.distcp");

  auto backing = BackingDir::Open(root_);
  ASSERT_TRUE(backing.ok());
  auto report = Journal::Recover(backing->get(), after_crash.get());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->entries_discarded, 3u);
  std::vector<std::string> lost = report->lost_paths;
  std::sort(lost.begin(), lost.end());
  EXPECT_EQ(lost, (std::vector<std::string>{"ck/.metadata", "ck/__1_0.distcp"}));
  EXPECT_EQ(KeysWithPrefix(after_crash.get(), "l/"),
            (std::vector<std::string>{"l/ck/.metadata", "l/ck/__1_0.distcp"}));
  EXPECT_TRUE(Exists("ck/__0_0.distcp"));
}

TEST_F(JournalTest, TempRecordsWrittenAheadCostOneSyncForManyFilesAndRecoveryStillRemovesTemps) {
  TestHooks hooks;
  hooks.options.temp_prefix = kTempPrefix;
  MakeJournal(std::move(hooks));
  const uint64_t synced_before = db_->synced_writes();
  std::vector<TempFile> files;
  for (int i = 0; i < 10; ++i) files.push_back(StartFile(""));
  EXPECT_EQ(db_->synced_writes() - synced_before, 1u)
      << "the temp records of 10 files should take one synced write";
  // A path other than the announced one is registered on its own, synced.
  const uint64_t odd = journal_->temps()->NextId();
  ASSERT_TRUE(journal_->temps()->Register(odd, "sub/.ckptfs-tmp.odd").ok());
  EXPECT_EQ(db_->synced_writes() - synced_before, 2u);
  for (auto& f : files) Write(&f, "bytes of " + f.temp);
  pipeline_->Drain();
  // Publish one; the others stay temps when the node crashes now.
  ASSERT_TRUE(journal_->Wait(Publish(files[0], "published")).ok());
  dir_->SimulateCrash();
  std::unique_ptr<StateDb> after_crash = CopyDb(db_.get(), tmp_.Sub("state2", false));
  journal_.reset();
  EXPECT_EQ(Tree(root_).temps.size(), 9u);

  auto backing = BackingDir::Open(root_);
  ASSERT_TRUE(backing.ok());
  auto report = Journal::Recover(backing->get(), after_crash.get());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->temps_removed, 9u);
  EXPECT_TRUE(Tree(root_).temps.empty()) << "a temp written ahead was leaked";
  EXPECT_EQ(Read("published"), "bytes of " + files[0].temp);
  EXPECT_TRUE(KeysWithPrefix(after_crash.get(), "t/").empty());
}

TEST_F(JournalTest, PublishedFilesAreFsyncedAheadOfTheBlockedPublisher) {
  Latch gate;
  TestHooks hooks;
  hooks.commit_gate = [&](const JournalEntry&, const QueuedFn&) {
    gate.Wait();
    return Status::Ok();
  };
  MakeJournal(std::move(hooks), /*early_syncs=*/true);
  TempFile md = StartFile("");
  Write(&md, "metadata");
  const uint64_t commit = Publish(md, ".metadata");  // the publisher waits in the gate
  gate.AwaitWaiters(1);
  std::vector<TempFile> shards;
  for (int i = 0; i < 3; ++i) {
    shards.push_back(StartFile(""));
    Write(&shards.back(), std::string(100000, static_cast<char>('a' + i)), 8192);
    Publish(shards.back(), "shard" + std::to_string(i));
  }
  // The early-sync threads make the shards durable while the publisher is still
  // blocked, so nothing of them is left to lose (and nothing is published yet).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline &&
         !std::all_of(shards.begin(), shards.end(),
                      [](const TempFile& f) { return f.target->synced(); })) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (const TempFile& f : shards) {
    EXPECT_TRUE(f.target->synced());
    EXPECT_FALSE(dir_->HasUnsyncedData(f.target->fd()));
    EXPECT_FALSE(Exists("shard" + std::to_string(&f - shards.data())));
  }
  EXPECT_GE(journal_->counts().presyncs, 3u);
  gate.Open();
  ASSERT_TRUE(journal_->Wait(commit).ok());
  journal_->Drain();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(Read("shard" + std::to_string(i)), std::string(100000, static_cast<char>('a' + i)));
  }
}

TEST_F(JournalTest, RecoverKeepsItsRecordsWhenATempCannotBeRemoved) {
  MakeJournal();
  TempFile f = StartFile("");
  Write(&f, "x");
  journal_.reset();
  pipeline_->Drain();
  dir_->SimulateCrash();  // every call now fails with EIO
  auto report = Journal::Recover(dir_.get(), db_.get());
  EXPECT_EQ(report.status().code(), Code::kIo);
  EXPECT_EQ(KeysWithPrefix(db_.get(), "t/").size(), 1u) << "records dropped, temp leaked";
  auto healthy = BackingDir::Open(root_);
  ASSERT_TRUE(healthy.ok());
  auto retry = Journal::Recover(healthy->get(), db_.get());
  ASSERT_TRUE(retry.ok()) << retry.status().ToString();
  EXPECT_EQ(retry->temps_removed, 1u);
  EXPECT_FALSE(Exists(f.temp));
}

TEST_F(JournalTest, TempRecordsFollowDirectoryRenames) {
  MakeJournal();
  for (const char* d : {"a", "ab", "p", "p/q"}) {
    ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, d)).ok());
  }
  TempFile in_a = StartFile("a"), in_ab = StartFile("ab"), in_pq = StartFile("p/q");
  TempFile in_root = StartFile("");
  ASSERT_TRUE(journal_->Wait(Op(OpType::kRename, "b", "a")).ok());
  ASSERT_TRUE(journal_->Wait(Op(OpType::kRename, "r", "p")).ok());
  // A file renamed onto a temp's directory name does not matter; only prefixes do.
  const std::string moved_a = "b/" + fs::path(in_a.temp).filename().string();
  const std::string moved_pq = "r/q/" + fs::path(in_pq.temp).filename().string();
  ASSERT_TRUE(Exists(moved_a));
  ASSERT_TRUE(Exists(moved_pq));
  journal_.reset();  // no entry pending: the temp records stay, as after a crash

  auto report = Journal::Recover(dir_.get(), db_.get());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->temps_removed, 4u) << "a temp record did not follow its directory";
  EXPECT_FALSE(Exists(moved_a));
  EXPECT_FALSE(Exists(moved_pq));
  EXPECT_FALSE(Exists(in_ab.temp)) << "a sibling sharing the prefix 'a' was mishandled";
  EXPECT_FALSE(Exists(in_root.temp));
  EXPECT_TRUE(Exists("b"));
  EXPECT_TRUE(Exists("r/q"));
  EXPECT_TRUE(Exists("ab"));
  EXPECT_TRUE(Tree(root_).temps.empty());
}

}  // namespace
}  // namespace ckptfs::store
