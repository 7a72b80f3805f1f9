// Journal: the randomized crash model (G4/G5), described below. Fixture and helpers:
// journal_fixture.h.
#include "tests/store/publish/journal_fixture.h"

namespace ckptfs::store {
namespace {

// ------------------------------------------------------ randomized crash model (G4/G5)
//
// Each schedule is a DCP-like training run: per iteration, mkdir the checkpoint dir,
// write and publish its shards through the pipeline, write `.metadata.tmp` and rename it
// onto `.metadata` (the commit, behind a gate that checks every listed shard is on the
// backing store, durable, with its length), publish the tracker
// `latest_checkpointed_iteration.txt` (directly, or through a tmp name and a rename),
// and delete the checkpoint two iterations back. Some iterations write `.metadata` first
// and the shards after it (a sorted copy): their publishes go ahead of the waiting commit.
// Some schedules inject faults into one shard: ENOSPC on write or EIO on the rename,
// transient (the first 1-3 attempts) or for good, or EIO on fsync (always for good). A
// transient fault halts publication until a retry passes; a lasting one halts it for the
// rest of the run, and the final Close() drops the failed entry and everything after it.
// After every entry the
// publisher's on_done hook checks the backing store *as a crash at that instant would
// leave it* (unsynced bytes forgotten) against a model that applies the same entries:
//   * prefix: the real names are exactly those of the applied entries, in order, and
//     skipped entries left nothing behind;
//   * no torn file: every real name holds exactly the bytes published to it;
//   * G5: no `.metadata` unless each shard it lists is there with its full length;
//   * G4, in every schedule (a failure is followed by the tracker): the tracker only names
//     committed checkpoints.
// At a random entry the backing dir really crashes and the StateDb is copied; after the
// run, recovery on the copy must remove every temp and touch nothing else.

struct Fault {
  enum Kind { kNone, kPWrite, kFsync, kRename } kind = kNone;
  int failures = -1;  // how many attempts fail; -1: all of them
};

class CrashModel {
 public:
  // `db` and `crash_copy` are borrowed (must outlive) and reused across schedules, since
  // opening RocksDB dominates a schedule's cost; both are cleared first.
  CrashModel(uint32_t seed, int crash_at, StateDb* db, StateDb* crash_copy)
      : seed_(seed), rng_(seed), crash_at_(crash_at), db_(db), db_after_crash_(crash_copy) {}

  struct Summary {
    bool crashed = false;
    bool faulty = false;
    int entries_checked = 0;
  };

  Summary Run() {
    Summary summary;
    RunInner();
    summary.crashed = crashed_.load();
    summary.faulty = faulty_schedule_;
    summary.entries_checked = entries_done_;
    return summary;
  }

 private:
  void RunInner() {
    SCOPED_TRACE("seed " + std::to_string(seed_) + " crash_at " + std::to_string(crash_at_));
    root_ = tmp_.Sub("backing");
    dir_ = FaultyBackingDir::Open(root_);
    ASSERT_NE(dir_, nullptr);
    ClearDb(db_);
    ClearDb(db_after_crash_);
    FlushOptions options;
    options.threads = 1 + static_cast<int>(rng_() % 3);
    options.retry_min = std::chrono::milliseconds(1);
    options.retry_max = std::chrono::milliseconds(2);
    pipeline_ = std::move(FlushPipeline::Create(dir_.get(), options)).value();
    faulty_schedule_ = rng_() % 3 == 0;
    dir_->SetPWriteHook([this](int fd, off_t, size_t) { return FaultFor(fd, Fault::kPWrite); });
    dir_->SetFsyncHook([this](int fd) { return FaultFor(fd, Fault::kFsync); });
    dir_->SetRenameHook([this](const std::string& from, const std::string&) {
      std::lock_guard lock(mu_);
      auto it = rename_faults_.find(from);
      if (it == rename_faults_.end() || it->second == 0) return 0;
      if (it->second > 0) --it->second;
      return EIO;
    });
    hooks_.commit_gate = [this](const JournalEntry& e, const QueuedFn& queued) {
      return Gate(e, queued);
    };
    hooks_.on_done = [this](const JournalEntry& e, const Status& st) { OnDone(e, st); };
    journal_ = std::move(Journal::Create(dir_.get(), db_, &hooks_, hooks_.options)).value();

    Drive();
    // Let transient faults pass (retries are pushed rather than waited for), then stop
    // as a daemon does: a journal halted for good gives up at Close().
    for (int i = 0; i < 5000 && !crashed_.load() && journal_->counts().pending > 0; ++i) {
      auto halt = journal_->halted();
      if (halt && !IsLasting(halt->seq)) {
        pipeline_->RetryNow();
        journal_->Resume();
      } else if (halt) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    journal_->Close();
    pipeline_->DropParked(Status(Code::kAborted, "stopped"));
    pipeline_->Drain();
    journal_.reset();
    pipeline_.reset();
    targets_.clear();
    CheckAfterRun();
  }

  // ---- the application (test thread)
  void Drive() {
    const int iterations = 2 + static_cast<int>(rng_() % 3);
    for (int it = 1; it <= iterations && !crashed_.load(); ++it) {
      const std::string ck = "ckpt_" + std::to_string(it);
      if (!WaitApplied(Op(OpType::kMkdir, ck, ""))) return;  // crashed: dies with the node
      const int shards = 1 + static_cast<int>(rng_() % 3);
      const int faulty_shard =
          faulty_schedule_ && rng_() % 2 == 0 ? static_cast<int>(rng_() % shards) : -1;
      std::string metadata;
      std::vector<std::pair<std::string, std::string>> files;  // name -> bytes
      std::vector<Fault> faults;
      for (int s = 0; s < shards; ++s) {
        const std::string name = "__" + std::to_string(s) + "_0.distcp";
        std::string bytes = RandomBytes(1 + rng_() % 40000);
        Fault fault;
        if (s == faulty_shard) {
          fault.kind = static_cast<Fault::Kind>(1 + rng_() % 3);
          if (fault.kind != Fault::kFsync && rng_() % 2) fault.failures = 1 + rng_() % 3;
        }
        metadata += name + " " + std::to_string(bytes.size()) + "\n";
        files.emplace_back(name, std::move(bytes));
        faults.push_back(fault);
      }
      const bool metadata_first = rng_() % 3 == 0;  // a checkpoint copied in sorted order
      if (metadata_first && !WriteAndPublish(ck, Join(ck, ".metadata"), metadata, {})) return;
      for (size_t s = 0; s < files.size(); ++s) {
        if (!WriteAndPublish(ck, Join(ck, files[s].first), files[s].second, faults[s])) return;
      }
      if (!metadata_first) {
        if (!WriteAndPublish(ck, Join(ck, ".metadata.tmp"), metadata, {})) return;
        Op(OpType::kRename, Join(ck, ".metadata"), Join(ck, ".metadata.tmp"));
      }
      const std::string tracker = "latest_checkpointed_iteration.txt";
      if (rng_() % 2) {
        if (!WriteAndPublish("", tracker, std::to_string(it), {})) return;
      } else {
        if (!WriteAndPublish("", tracker + ".tmp", std::to_string(it), {})) return;
        Op(OpType::kRename, tracker, tracker + ".tmp");
      }
      if (it > 2) {
        const std::string old = "ckpt_" + std::to_string(it - 2);
        // Uncommit first, as a careful application does, so that G5 holds throughout.
        Op(OpType::kUnlink, Join(old, ".metadata"), "");
        for (const auto& name : shard_names_[old]) Op(OpType::kUnlink, Join(old, name), "");
        Op(OpType::kRmdir, old, "");
      }
    }
  }

  bool WriteAndPublish(const std::string& dir, const std::string& path, const std::string& bytes,
                       Fault fault) {
    if (crashed_.load()) return false;
    const uint64_t id = journal_->temps()->NextId();
    const std::string temp = Join(dir, kTempPrefix + std::to_string(id));
    if (!journal_->temps()->Register(id, temp).ok()) return false;
    auto fd = dir_->OpenFile(temp, O_RDWR | O_CREAT | O_EXCL, 0644);
    if (!fd.ok()) return false;  // only after the crash
    auto target = std::make_shared<FlushTarget>(id, std::move(*fd));
    auto keep = std::make_shared<std::string>(bytes);
    {
      std::lock_guard lock(mu_);
      contents_[id] = bytes;
      if (fault.kind == Fault::kPWrite || fault.kind == Fault::kFsync) {
        fd_faults_[target->fd()] = fault;
      }
      if (fault.kind == Fault::kRename) rename_faults_[temp] = fault.failures;
      if (fault.kind != Fault::kNone && fault.failures < 0) lasting_ids_.insert(id);
      if (IsTemp(path) == false && path.find(".distcp") != std::string::npos) {
        shard_names_[dir].push_back(fs::path(path).filename().string());
      }
    }
    targets_.push_back(target);  // fds stay open, so fd numbers are never reused
    // Chunks of random sizes, submitted in random order.
    std::vector<std::pair<size_t, size_t>> pieces;
    for (size_t off = 0; off < bytes.size();) {
      size_t len = std::min<size_t>(bytes.size() - off, 1 + rng_() % 9000);
      pieces.emplace_back(off, len);
      off += len;
    }
    std::shuffle(pieces.begin(), pieces.end(), rng_);
    for (auto [off, len] : pieces) {
      SealedChunk c;
      c.target = target;
      c.offset = off;
      c.data = reinterpret_cast<const uint8_t*>(keep->data()) + off;
      c.length = len;
      c.keepalive = keep;
      pipeline_->Submit(std::move(c));
    }
    JournalEntry e;
    e.op = OpType::kPublish;
    e.path = path;
    e.from = temp;
    e.file_id = id;
    e.size = bytes.size();
    e.target = target;
    auto seq = journal_->Append(std::move(e));
    if (!seq.ok()) return false;
    std::lock_guard lock(mu_);
    if (lasting_ids_.count(id)) lasting_seqs_.insert(*seq);
    return true;
  }

  // Waits as an application waits for a strict mkdir; an async one just goes on, which is
  // what it does behind a failure that lasts. False once crashed.
  bool WaitApplied(uint64_t seq) {
    for (int i = 0; i < 20000; ++i) {
      if (crashed_.load()) return false;
      if (journal_->counts().applied >= seq) return true;
      auto halt = journal_->halted();
      if (halt && IsLasting(halt->seq)) return true;
      if (halt) {
        pipeline_->RetryNow();
        journal_->Resume();
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    auto halt = journal_->halted();
    ADD_FAILURE() << "entry " << seq << " never applied; applied " << journal_->counts().applied
                  << ", halted at " << (halt ? halt->what + " " + halt->error.ToString() : "-");
    return false;
  }

  // The entry fails for good (a lasting fault).
  bool IsLasting(uint64_t seq) {
    std::lock_guard lock(mu_);
    return lasting_seqs_.count(seq) > 0;
  }

  uint64_t Op(OpType op, const std::string& path, const std::string& from) {
    JournalEntry e;
    e.op = op;
    e.path = path;
    e.from = from;
    e.mode = 0755;
    auto seq = journal_->Append(std::move(e));
    return seq.ok() ? *seq : 0;
  }

  std::string RandomBytes(size_t n) {
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>('a' + rng_() % 26);
    return s;
  }

  int FaultFor(int fd, Fault::Kind kind) {
    std::lock_guard lock(mu_);
    auto it = fd_faults_.find(fd);
    if (it == fd_faults_.end() || it->second.kind != kind || it->second.failures == 0) return 0;
    if (it->second.failures > 0) --it->second.failures;
    return kind == Fault::kPWrite ? ENOSPC : EIO;
  }

  // ---- the commit gate and the per-entry check (publisher thread)

  // What the fs gate does for DCP: every shard listed must be on the backing store; one
  // whose publish is still queued is waited for.
  CommitCheck Gate(const JournalEntry& e, const QueuedFn& queued) {
    auto fd = dir_->OpenFile(e.from, O_RDONLY);
    if (!fd.ok()) return fd.status();
    std::string md(1 << 16, '\0');
    auto got = dir_->PRead(fd->get(), md.data(), md.size(), 0);
    if (!got.ok()) return got.status();
    md.resize(*got);
    std::istringstream lines(md);
    std::string name;
    uint64_t size;
    const std::string ck = fs::path(e.path).parent_path().string();
    std::vector<std::string> waiting;
    while (lines >> name >> size) {
      if (queued(Join(ck, name))) {
        waiting.push_back(Join(ck, name));
        continue;
      }
      auto st = dir_->Stat(Join(ck, name));
      if (!st.ok() || static_cast<uint64_t>(st->st_size) < size) {
        // Not queued yet (the application is still writing it): as the real gate does
        // for a shard it cannot account for, look again later.
        waiting.push_back(Join(ck, name));
        continue;
      }
      if (dir_->HasUnsyncedData(Join(ck, name))) {
        return Status(Code::kAborted, "shard " + name + " is not durable");
      }
    }
    if (!waiting.empty()) return CommitCheck::Wait(waiting, std::chrono::milliseconds(2));
    return Status::Ok();
  }

  bool ExpectedOk(const JournalEntry& e) {
    // Behind a lasting failure nothing is applied; Close() drops it all.
    if (halted_for_good_) return false;
    switch (e.op) {
      case OpType::kMkdir:
      case OpType::kUnlink:
        return true;
      case OpType::kPublish: {
        if (IsCommitName(e.path)) {
          // Written before its shards: commits once they are all there.
          const std::string ck = fs::path(e.path).parent_path().string();
          std::lock_guard lock(mu_);
          std::istringstream lines(contents_[e.file_id]);
          std::string name;
          uint64_t size;
          while (lines >> name >> size) {
            auto it = model_.files.find(Join(ck, name));
            if (it == model_.files.end() || it->second.size() < size) return false;
          }
        }
        std::lock_guard lock(mu_);
        return lasting_ids_.count(e.file_id) == 0;
      }
      case OpType::kRename: {
        if (!model_.files.count(e.from)) return false;
        if (!IsCommitName(e.path)) return true;
        const std::string ck = fs::path(e.path).parent_path().string();
        std::istringstream lines(model_.files[e.from]);
        std::string name;
        uint64_t size;
        while (lines >> name >> size) {
          auto it = model_.files.find(Join(ck, name));
          if (it == model_.files.end() || it->second.size() < size) return false;
        }
        return true;
      }
      case OpType::kRmdir: {
        for (const auto& [path, _] : model_.files) {
          if (path.rfind(e.path + "/", 0) == 0) return false;
        }
        return true;
      }
      default:
        return true;
    }
  }

  void ApplyToModel(const JournalEntry& e) {
    switch (e.op) {
      case OpType::kMkdir:
        model_.dirs.insert(e.path);
        break;
      case OpType::kPublish: {
        std::lock_guard lock(mu_);
        model_.files[e.path] = contents_[e.file_id];
        break;
      }
      case OpType::kRename:
        model_.files[e.path] = model_.files[e.from];
        model_.files.erase(e.from);
        break;
      case OpType::kUnlink:
        model_.files.erase(e.path);
        break;
      case OpType::kRmdir:
        model_.dirs.erase(e.path);
        break;
      default:
        ADD_FAILURE() << "unexpected op " << e.Describe();
    }
  }

  void OnDone(const JournalEntry& e, const Status& st) {
    if (crashed_.load()) {
      EXPECT_FALSE(st.ok()) << "after the crash nothing may reach the disk: " << e.Describe();
      return;
    }
    ++entries_done_;
    const bool expected = ExpectedOk(e);
    EXPECT_EQ(st.ok(), expected) << e.Describe() << ": " << st.ToString();
    if (st.ok()) ApplyToModel(e);
    if (!st.ok() && !IsCommitName(e.path)) halted_for_good_ = true;
    if (!st.ok() && IsCommitName(e.path)) halted_for_good_ = true;
    if (!st.ok() && e.op == OpType::kPublish) {
      EXPECT_FALSE(fs::exists(fs::symlink_status(root_ + "/" + e.from)))
          << "the temp of a skipped publish must be removed: " << e.Describe();
    }
    CheckCrashView(e);
    if (entries_done_ == crash_at_) {
      dir_->SimulateCrash();
      CopyInto(db_, db_after_crash_);
      crash_state_ = Tree(root_);
      crashed_ = true;
    }
  }

  void CheckCrashView(const JournalEntry& after) {
    const TreeState view = Tree(root_, dir_.get());
    SCOPED_TRACE("after " + after.Describe());
    EXPECT_EQ(view.dirs, model_.dirs) << "directories are not the applied prefix";
    EXPECT_EQ(view.files.size(), model_.files.size());
    for (const auto& [path, bytes] : model_.files) {
      auto it = view.files.find(path);
      if (it == view.files.end()) {
        ADD_FAILURE() << path << " is missing after a crash here";
      } else if (it->second != bytes) {
        ADD_FAILURE() << path << " would be torn by a crash here (" << it->second.size() << " of "
                      << bytes.size() << " bytes)";
      }
    }
    for (const auto& [path, bytes] : view.files) {
      if (!model_.files.count(path)) ADD_FAILURE() << path << " appeared out of order";
    }
    // G5 on the view itself, independent of the model.
    for (const auto& [path, bytes] : view.files) {
      if (fs::path(path).filename() != ".metadata") continue;
      const std::string ck = fs::path(path).parent_path().string();
      std::istringstream lines(bytes);
      std::string name;
      uint64_t size;
      while (lines >> name >> size) {
        auto it = view.files.find(Join(ck, name));
        EXPECT_TRUE(it != view.files.end() && it->second.size() >= size)
            << path << " is published but its shard " << name << " is not durable";
      }
    }
    // G4 for the tracker, in every schedule: a failed shard never lets a later tracker
    // name its checkpoint.
    auto tracker = view.files.find("latest_checkpointed_iteration.txt");
    if (tracker != view.files.end()) {
      EXPECT_TRUE(view.files.count("ckpt_" + tracker->second + "/.metadata"))
          << "the tracker names checkpoint " << tracker->second << ", which is not committed";
    }
  }

  // ---- after the run (test thread)
  void CheckAfterRun() {
    if (!crashed_.load()) {
      // Ran to completion: everything applied is there and no temp is left behind.
      const TreeState final_state = Tree(root_);
      EXPECT_EQ(final_state.files, model_.files);
      EXPECT_TRUE(final_state.temps.empty());
      return;
    }
    const TreeState after = Tree(root_);
    EXPECT_EQ(after.files, crash_state_.files) << "the disk changed after the crash";
    EXPECT_EQ(after.dirs, crash_state_.dirs);
    auto backing = BackingDir::Open(root_);
    ASSERT_TRUE(backing.ok());
    auto report = Journal::Recover(backing->get(), db_after_crash_);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    const TreeState recovered = Tree(root_);
    EXPECT_TRUE(recovered.temps.empty()) << "recovery leaked " << recovered.temps.size()
                                         << " temp files, e.g. " << *recovered.temps.begin();
    EXPECT_EQ(recovered.files, crash_state_.files) << "recovery touched a real name";
    EXPECT_EQ(recovered.dirs, crash_state_.dirs);
    EXPECT_EQ(report->temps_removed, crash_state_.temps.size());
  }

  const uint32_t seed_;
  std::mt19937 rng_;
  const int crash_at_;
  ScopedTempDir tmp_{"ckptfs-crash-model"};
  std::string root_;
  StateDb* const db_;
  StateDb* const db_after_crash_;  // the records a crash left behind
  std::unique_ptr<FaultyBackingDir> dir_;
  std::unique_ptr<FlushPipeline> pipeline_;
  TestHooks hooks_;  // outlives journal_
  std::unique_ptr<Journal> journal_;
  std::vector<std::shared_ptr<FlushTarget>> targets_;
  bool faulty_schedule_ = false;

  std::mutex mu_;  // between the application and the publisher/flush threads
  std::map<uint64_t, std::string> contents_;                     // GUARDED_BY(mu_)
  std::map<int, Fault> fd_faults_;                               // GUARDED_BY(mu_)
  std::map<std::string, int> rename_faults_;                     // GUARDED_BY(mu_)
  std::set<uint64_t> lasting_ids_;                               // GUARDED_BY(mu_)
  std::set<uint64_t> lasting_seqs_;                              // GUARDED_BY(mu_)
  std::map<std::string, std::vector<std::string>> shard_names_;  // GUARDED_BY(mu_)

  // Publisher thread only, until the run is over.
  TreeState model_;
  int entries_done_ = 0;
  bool halted_for_good_ = false;
  std::atomic<bool> crashed_{false};
  TreeState crash_state_;
};

TEST(JournalCrashModel, EveryCrashPointLeavesAnAppliedPrefixAndRecoveryRemovesAllTemps) {
  int schedules = 2000;  // ~8 s on 2 cores; CKPTFS_CRASH_SCHEDULES for more
  if (const char* env = std::getenv("CKPTFS_CRASH_SCHEDULES")) schedules = std::atoi(env);
  uint32_t base_seed = 20240601;
  if (const char* env = std::getenv("CKPTFS_CRASH_SEED")) base_seed = std::atoi(env);
  const auto level = spdlog::get_level();
  if (!std::getenv("CKPTFS_CRASH_LOG")) spdlog::set_level(spdlog::level::off);  // failures log by design
  ScopedTempDir state("ckptfs-crash-model-state");
  auto db = StateDb::Open(state.Sub("db", false));
  auto crash_copy = StateDb::Open(state.Sub("crash_copy", false));
  ASSERT_TRUE(db.ok() && crash_copy.ok());
  std::mt19937 pick(base_seed);
  int crashed = 0, completed = 0, faulty = 0, entries = 0;
  for (int i = 0; i < schedules && !::testing::Test::HasFailure(); ++i) {
    // Schedules have 8 to 50 entries; some crash points fall past the end (no crash).
    const int crash_at = 1 + static_cast<int>(pick() % 50);
    auto s = CrashModel(base_seed + i, crash_at, db->get(), crash_copy->get()).Run();
    (s.crashed ? crashed : completed)++;
    faulty += s.faulty;
    entries += s.entries_checked;
  }
  // The schedules must actually cover both outcomes, or the test proves little.
  if (schedules >= 100 && !::testing::Test::HasFailure()) {
    EXPECT_GT(crashed, schedules / 4);
    EXPECT_GT(completed, schedules / 20);
    EXPECT_GT(faulty, schedules / 10);
    EXPECT_GT(entries, schedules * 5);
  }
  spdlog::set_level(level);
}

}  // namespace
}  // namespace ckptfs::store
