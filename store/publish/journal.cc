#include "store/publish/journal.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <thread>

#include "common/path.h"
#include "common/thread_name.h"
#include "store/publish/entry_apply.h"

namespace ckptfs::store {
namespace {

constexpr char kEpochKey[] = "m/epoch";

using path::IsAtOrBelow;

// Two entries' names overlap: one is the other or below it.
bool Touches(const JournalEntry& a, const JournalEntry& b) {
  for (const std::string* x : {&a.path, &a.from}) {
    if (x->empty()) continue;
    for (const std::string* y : {&b.path, &b.from}) {
      if (!y->empty() && (IsAtOrBelow(*x, *y) || IsAtOrBelow(*y, *x))) return true;
    }
  }
  return false;
}

// An entry left behind a waiting commit that keeps `e` (a shard's publish or a rename onto
// it) from going ahead of the commit: one on its own names, or one that moves, removes or
// makes a directory above it. A chmod, chown or utimens of a directory above it does not:
// the shard can land first with no state the application did not pass through (the
// directory's attributes are set by the later entry either way), and waiting for it would
// hold the commit until the commit itself is applied (G10: `touch ckpt/` between a
// `.metadata` copied first and its shards).
bool BlocksAhead(const JournalEntry& e, const JournalEntry& b) {
  if (!Touches(e, b)) return false;
  const bool attributes_only =
      b.op == OpType::kChmod || b.op == OpType::kChown || b.op == OpType::kUtimens;
  if (!attributes_only) return true;
  for (const std::string* x : {&e.path, &e.from}) {
    if (!x->empty() && IsAtOrBelow(b.path, *x)) return true;  // its own name, or below it
  }
  return false;
}

bool IsCommitEntry(const JournalEntry& e) {
  return (e.op == OpType::kPublish || e.op == OpType::kRename) && IsCommitName(e.path);
}

bool IsDeletion(const JournalEntry& e) {
  return e.op == OpType::kUnlink || e.op == OpType::kRmdir;
}

// Entry `e` must not go past the held deletion `held`: it changes a name the deletion
// removes, or one below or above it, or it commits the directory the deletion empties (a
// save into a directory removed and made again, its `.metadata` copied first).
bool MeetsHeld(const JournalEntry& e, const JournalEntry& held) {
  if (Touches(e, held)) return true;
  if (!IsCommitEntry(e)) return false;
  const std::string dir = path::Parent(e.path);
  return IsAtOrBelow(dir, held.path) || IsAtOrBelow(held.path, dir);
}

// The directory a held deletion's tracker would be in: beside the checkpoint it removes
// (the rmdir's directory, or the directory of the unlinked file).
std::string HeldBeside(const JournalEntry& held) {
  return path::Parent(held.op == OpType::kRmdir ? held.path : path::Parent(held.path));
}

// Records that a tracker in `dir` was applied at DeletionHold::commits() == `commits`
// (Journal::tracker_commits_, bounded: trackers live in a few directories). With
// `only_if_new`, a directory already recorded keeps its record.
void NoteTracker(std::map<std::string, uint64_t>& trackers, const std::string& dir,
                 uint64_t commits, bool only_if_new) {
  constexpr size_t kTrackerDirs = 64;
  const bool known = trackers.count(dir) > 0;
  if (known && only_if_new) return;
  if (!known && trackers.size() >= kTrackerDirs) trackers.erase(trackers.begin());
  trackers[dir] = commits;
}

}  // namespace

Journal::Journal(BackingDir* dir, StateDb* db, JournalDelegate* delegate, JournalOptions options,
                 uint64_t next_seq, uint64_t next_id)
    : dir_(dir),
      db_(db),
      delegate_(delegate),
      options_(std::move(options)),
      temps_(db, options_.temp_prefix, next_id),
      replaced_(dir, db, &temps_),
      presync_(dir, options_.presync_threads),
      next_seq_(next_seq),
      done_seq_(next_seq - 1) {
  thread_ = std::thread([this] {
    NameThisThread("ckptfs-journal");
    Run();
    {
      MutexLock lock(&mu_);
      publisher_exited_ = true;
    }
    done_cv_.notify_all();
  });
}

Result<std::unique_ptr<Journal>> Journal::Create(BackingDir* dir, StateDb* db,
                                                 JournalDelegate* delegate,
                                                 JournalOptions options) {
  // File ids are (epoch << 32 | n): unique across restarts, so a temp name of an
  // earlier run can never be reused by this one.
  uint64_t epoch = 1;
  auto prev = db->Get(kEpochKey);
  if (prev.ok()) epoch = std::strtoull(prev->c_str(), nullptr, 10) + 1;
  CKPT_RETURN_IF_ERROR(db->Put(kEpochKey, std::to_string(epoch)));
  if (options.trace != nullptr) options.trace->Start(epoch);
  return std::unique_ptr<Journal>(
      new Journal(dir, db, delegate, std::move(options), 1, epoch << 32));
}

Journal::~Journal() {
  Close();
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

Result<uint64_t> Journal::Append(JournalEntry entry) {
  MutexLock lock(&mu_);
  entry.seq = next_seq_++;
  // Unsynced: the record only tells a restarted daemon what was pending (it reports
  // such entries as discarded); the temp records, written synced, are what recovery
  // acts on. A crash loses every queued entry anyway (they are in memory), and a lost
  // record can only lose an entry that was never applied: an uncommitted operation.
  Status st = db_->Put(JournalEntry::RecordKey(entry.seq), entry.Serialize(), WriteMode::kUnsynced);
  if (!st.ok()) {
    // Keep the sequence dense: the entry is queued anyway, in memory, and the error
    // is logged. Publication order is what matters for the backing store.
    spdlog::warn("journal: could not persist {}: {}", entry.Describe(), st.ToString());
  }
  uint64_t seq = entry.seq;
  std::shared_ptr<FlushTarget> presync = entry.op == OpType::kPublish ? entry.target : nullptr;
  Queued q;
  q.e = std::move(entry);
  queue_.push_back(std::move(q));
  lock.Unlock();
  work_cv_.notify_one();
  presync_.Submit(std::move(presync));
  return seq;
}

void Journal::ReleaseWaiters() {
  {
    MutexLock lock(&mu_);
    releasing_ = true;
  }
  done_cv_.notify_all();
}

bool Journal::releasing() const {
  MutexLock lock(&mu_);
  return releasing_;
}

Status Journal::ReleasedLocked() const {
  std::string what = WaitingForLocked();
  return Status(Code::kAborted, "ckptfs is stopping; publication waits" +
                                    (what.empty() ? std::string() : ": " + what));
}

Status Journal::Wait(uint64_t seq) {
  MutexLock lock(&mu_);
  done_cv_.wait(lock.native(), [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    return ((done_seq_ >= seq || done_ahead_.count(seq) > 0 || failures_.count(seq) > 0) &&
            unsettled_.count(seq) == 0) ||
           releasing_;
  });
  auto it = failures_.find(seq);
  if (it != failures_.end()) return it->second;
  if (done_seq_ >= seq || done_ahead_.count(seq) > 0) return Status::Ok();
  return ReleasedLocked();
}

Status Journal::WaitUnlessHalted(uint64_t seq) {
  MkdirAhead(seq);
  MutexLock lock(&mu_);
  const Queued* halt = nullptr;
  done_cv_.wait(lock.native(), [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    if (unsettled_.count(seq) > 0) return false;  // its Finalize runs: the outcome follows
    if (done_seq_ >= seq || done_ahead_.count(seq) > 0 || failures_.count(seq) > 0) return true;
    if (releasing_) return true;
    // A halt before it first: the early return below must not hide it.
    halt = nullptr;
    for (const Queued& q : queue_) {
      // Held out of line behind a given-up checkpoint (DeletionHold): it follows a later
      // commit, which may be this caller's to make.
      if (q.e.seq == seq && q.held) return true;
      if (q.e.seq >= seq) break;
      if (!q.error.ok()) {
        halt = &q;
        break;
      }
    }
    if (halt != nullptr) return true;
    // A commit whose gate waits for shards not written yet: the caller may be the one to
    // write them (a copy in sorted order), so it must not wait for the commit itself.
    return gate_seq_ != 0 && gate_seq_ <= seq && !gate_ready_ && gate_unwritten_;
  });
  auto it = failures_.find(seq);
  if (it != failures_.end()) return it->second;
  if (done_seq_ >= seq || done_ahead_.count(seq) > 0) return Status::Ok();
  if (releasing_) return ReleasedLocked();
  if (halt == nullptr) return Status::Ok();
  return Status(halt->error.code(),
                "publication is halted at " + halt->e.Describe() + ": " + halt->error.ToString());
}

void Journal::MkdirAhead(uint64_t seq) {
  JournalEntry e;
  {
    MutexLock lock(&mu_);
    if (releasing_ || closing_ || leaving_ || queue_.empty()) return;
    auto it = queue_.begin();
    while (it != queue_.end() && it->e.seq != seq) ++it;
    // At the head the publisher takes it next; a failed attempt keeps its place (a halt).
    if (it == queue_.end() || it == queue_.begin() || it->busy || it->drop ||
        !it->error.ok() || it->e.op != OpType::kMkdir) {
      return;
    }
    if (delegate_ != nullptr && delegate_->Gated(it->e)) return;
    for (auto b = queue_.begin(); b != it; ++b) {
      if (Touches(it->e, b->e)) return;  // its name, or a directory above it, changes first
    }
    it->busy = true;  // the publisher waits for it at the head (NextStepLocked)
    ++finalizing_;    // and a stop, until it is done
    e = it->e;
  }
  bool tried = false, kept = false;  // a mkdir keeps nothing (Process)
  Status st = Process(e, /*retry=*/false, &tried, &kept);
  if (st.ok()) Finalize(e, st, /*applied=*/true);
  MutexLock lock(&mu_);
  --finalizing_;
  auto it = queue_.begin();
  while (it != queue_.end() && it->e.seq != seq) ++it;
  if (it != queue_.end()) {
    if (st.ok()) {
      queue_.erase(it);
      if (seq > done_seq_) done_ahead_.insert(seq);
      ++applied_ahead_;
      gate_dirty_ = true;
      AdvanceDoneLocked();
    } else {
      it->busy = false;  // not here (its parent failed to appear): it waits for its turn
      spdlog::info("journal: {} not applied ahead ({}); it waits for its turn",
                   e.Describe(), st.ToString());
    }
  }
  lock.Unlock();
  work_cv_.notify_all();
  done_cv_.notify_all();
}

bool Journal::WaitDoneFor(uint64_t seq, std::chrono::milliseconds max) const {
  MutexLock lock(&mu_);
  return done_cv_.wait_for(lock.native(), max, [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    return ((done_seq_ >= seq || done_ahead_.count(seq) > 0 || failures_.count(seq) > 0) &&
            unsettled_.count(seq) == 0) ||
           releasing_;
  }) && !(releasing_ && done_seq_ < seq && done_ahead_.count(seq) == 0 &&
          failures_.count(seq) == 0);
}

void Journal::WaitForRoom(size_t limit, std::chrono::milliseconds max) {
  if (limit == 0) return;
  MutexLock lock(&mu_);
  auto room = [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    if (queue_.size() < limit || releasing_ || closing_) return true;
    if (gate_seq_ != 0 && !gate_ready_ && gate_unwritten_) return true;
    return std::any_of(queue_.begin(), queue_.end(), [](const Queued& q) { return !q.error.ok(); });
  };
  if (room()) return;
  const auto start = std::chrono::steady_clock::now();
  done_cv_.wait_for(lock.native(), max, room);
  ++room_waits_;
  room_wait_ms_ += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                             std::chrono::steady_clock::now() - start)
                                             .count());
}

void Journal::Drain() {
  MutexLock lock(&mu_);
  done_cv_.wait(lock.native(), [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    return queue_.empty();
  });
}

JournalCounts Journal::counts() const {
  JournalCounts c;
  c.presyncs = presync_.done();
  MutexLock lock(&mu_);
  // An entry dropped or skipped is out of the queue before its outcome (the removal of its
  // temp file among it, Finalize) is done: it counts until then, so that "0 pending" means
  // the backing store is settled.
  c.pending = queue_.size() + unsettled_.size();
  c.last_appended = next_seq_ - 1;
  c.applied = done_seq_;
  c.skipped = skipped_;
  c.superseded = superseded_;
  c.given_up = given_up_;
  c.applied_ahead = applied_ahead_;
  c.retries = retries_;
  c.room_waits = room_waits_;
  c.room_wait_ms = room_wait_ms_;
  for (auto it = queue_.begin(); it != queue_.end() && it->held; ++it) ++c.held;  // a prefix
  c.held_total = held_total_;
  c.held_dropped = held_dropped_;
  return c;
}

void Journal::AdvanceDoneLocked() {
  done_seq_ = queue_.empty() ? next_seq_ - 1 : queue_.front().e.seq - 1;
  done_ahead_.erase(done_ahead_.begin(), done_ahead_.upper_bound(done_seq_));
  // Bound the memory of old outcomes; waiters read theirs promptly.
  while (failures_.size() > 4096) failures_.erase(failures_.begin());
}

Journal::Step Journal::NextStepLocked() {
  Step step;
  if (leaving_) {  // CloseWithin() hands the queue over to the next start
    step.kind = Step::kExit;
    return step;
  }
  if (queue_.empty()) {
    step.kind = stop_ ? Step::kExit : Step::kIdle;
    return step;
  }
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    if (it->drop && !it->busy) {
      step.kind = Step::kDrop;
      step.it = it;
      return step;
    }
  }
  const auto now = std::chrono::steady_clock::now();
  auto head = queue_.begin();
  // Deletions held behind a given-up checkpoint (DeletionHold) are the first entries;
  // publication goes on past them.
  if (head->held) {
    const auto first = head;
    while (head != queue_.end() && head->held) ++head;
    if (releasing_ || closing_ || stop_) {
      step.kind = Step::kDrop;  // a stop: what they delete stays (deletion_hold.h)
      step.it = first;
      return step;
    }
    // A later checkpoint committed and its tracker is through: a tracker beside the held
    // checkpoint was applied since; or, where no tracker was ever applied beside it (a loop
    // without trackers), publication reached the next deletion (they go before it); or
    // nothing came for JournalOptions::held_grace. Or an entry that meets them comes up:
    // they go first, in the application's order. Where trackers are in use, the next
    // deletion says nothing: an unrelated one (a log's, another directory's rotation) can
    // come between the commit and its tracker, and the tracker on the backing store may
    // still name what they delete (the short soak of d15be0d: an operator abort of a
    // halted tracker dropped trackers 38 to 41; `rm -r` of 37 and 38 went at the next
    // commit, under a tracker that named 37).
    const bool committed = options_.hold == nullptr || options_.hold->commits() > first->held_at;
    bool release = options_.hold == nullptr;
    // Trackers are in use beside them: only a tracker applied after the commit lets them
    // go, never the grace. (A tracker an operator's abort dropped, the later ones withheld
    // behind given-up checkpoints: the grace let 1,300 held deletions go under the backing
    // store's tracker 85, and 83 to 85 were gone: the two-node async soak, seed 6203.)
    // Each held deletion's own tracker decides, not the first one's: held deletions of
    // several trees (a trainer's at the top, a side job's in its directory) go only once
    // every tracker beside them has been applied since it was held (stop 63's soak, seed
    // 6302: the top tracker let 120 held deletions go, async2/iter_0000019 among them,
    // under async2/'s tracker 19).
    bool trackers_beside = false;
    if (!release && committed) {
      // Stops at the first one still waiting (while they wait, that is the first one).
      bool every_tracker_through = true;
      for (auto it = first; it != head && every_tracker_through; ++it) {
        const auto tracker = tracker_commits_.find(HeldBeside(it->e));
        if (tracker == tracker_commits_.end()) continue;
        trackers_beside = true;
        every_tracker_through = tracker->second > it->held_at;
      }
      release = trackers_beside ? every_tracker_through
                                : head != queue_.end() && IsDeletion(head->e);
    }
    if (committed && !release && !trackers_beside && head == queue_.end()) {
      if (first->commit_seen == std::chrono::steady_clock::time_point{}) first->commit_seen = now;
      release = now >= first->commit_seen + options_.held_grace;
      if (!release) {
        step.kind = Step::kWait;
        step.until = first->commit_seen + options_.held_grace;
        return step;
      }
    }
    // A deletion that may be held itself (the rest of an `rm -r`) is held behind them
    // instead (the gate step).
    const bool may_hold = head != queue_.end() && IsDeletion(head->e) && !head->e.unheld &&
                          options_.hold != nullptr && options_.hold->active() &&
                          delegate_ != nullptr &&
                          delegate_->Gated(head->e);
    for (auto it = first; !release && !may_hold && head != queue_.end() && it != head; ++it) {
      release = MeetsHeld(head->e, it->e);
    }
    if (!release && head == queue_.end()) {
      step.kind = Step::kIdle;
      return step;
    }
    if (release) {
      for (auto it = first; it != head; ++it) {
        it->held = false;
        it->e.unheld = true;
      }
      spdlog::info("journal: {} held deletion(s) from {} go now", std::distance(first, head),
                   first->e.Describe());
      gate_dirty_ = true;
      head = first;
    }
  }
  if (head->busy) {  // a mkdir its waiter applies ahead (MkdirAhead): done, or back, soon
    step.kind = Step::kIdle;
    return step;
  }
  if (!head->error.ok() && now < head->retry_at) {
    step.kind = Step::kWait;
    step.until = head->retry_at;
    return step;
  }
  const bool gated =
      IsCommitEntry(head->e) || (delegate_ != nullptr && delegate_->Gated(head->e));
  if (!gated || (gate_seq_ == head->e.seq && gate_ready_)) {
    step.kind = Step::kProcess;
    step.it = head;
    return step;
  }
  if (gate_seq_ != head->e.seq || gate_dirty_ || now >= gate_recheck_) {
    step.kind = Step::kGate;
    step.it = head;
    return step;
  }
  // The commit waits for its shards: apply their queued publishes ahead of it, in order,
  // where no entry left behind touches their names. A failed one halts everything after it.
  // A shard may also arrive by a rename of a file published under another name first.
  std::unordered_set<std::string> feeders;
  for (auto it = std::next(head); it != queue_.end(); ++it) {
    if (it->e.op == OpType::kRename && gate_shard_set_.count(it->e.path) > 0) {
      feeders.insert(it->e.from);
    }
  }
  std::vector<const JournalEntry*> left_behind;
  for (auto it = queue_.begin(); it != head; ++it) left_behind.push_back(&it->e);  // held
  step.kind = Step::kWait;
  step.until = gate_recheck_;
  for (auto it = std::next(head); it != queue_.end(); ++it) {
    const JournalEntry& e = it->e;
    bool eligible = (e.op == OpType::kPublish || e.op == OpType::kRename) &&
                    (gate_shard_set_.count(e.path) > 0 || feeders.count(e.path) > 0);
    for (const JournalEntry* b : left_behind) {
      if (eligible && BlocksAhead(e, *b)) eligible = false;
    }
    if (!it->error.ok()) {
      if (eligible && now >= it->retry_at) {
        step.kind = Step::kProcess;
        step.it = it;
      } else {
        step.until = std::min(step.until, it->retry_at);
      }
      return step;
    }
    if (eligible) {
      step.kind = Step::kProcess;
      step.it = it;
      return step;
    }
    left_behind.push_back(&e);
  }
  return step;
}

bool Journal::SupersededLocked(const JournalEntry& commit) const {
  // A save into a directory of the same name made again after an rmdir (PyTorch's
  // test_load_with_different_shard_plan), or into the one a rename put there, is another
  // checkpoint: it supersedes nothing of this one.
  const DirectoryEnd end = DirectoryEndsAfterLocked(commit.seq, path::Parent(commit.path));
  for (const Queued& q : queue_) {
    if (end.seq != 0 && q.e.seq >= end.seq) break;
    if (q.e.seq > commit.seq && q.e.path == commit.path && IsCommitEntry(q.e)) return true;
  }
  return false;
}

DirectoryEnd Journal::DirectoryEndsAfterLocked(uint64_t seq, const std::string& dir) const {
  if (dir.empty()) return {};
  for (const Queued& q : queue_) {
    const JournalEntry& e = q.e;
    if (e.seq <= seq) continue;
    switch (e.op) {
      case OpType::kRmdir:
        if (IsAtOrBelow(dir, e.path)) return {e.seq, true};
        break;
      case OpType::kUnlink:  // a directory a rename replaced
        if (S_ISDIR(e.mode) && IsAtOrBelow(dir, e.path)) return {e.seq, true};
        break;
      case OpType::kRename:
        if (!S_ISDIR(e.mode)) break;
        if (IsAtOrBelow(dir, e.path)) return {e.seq, true};   // replaced (it was empty)
        if (IsAtOrBelow(dir, e.from)) return {e.seq, false};  // moved away
        break;
      default:
        break;
    }
  }
  return {};
}

DirectoryEnd Journal::DirectoryEndsAfter(uint64_t seq, const std::string& dir) const {
  MutexLock lock(&mu_);
  return DirectoryEndsAfterLocked(seq, dir);
}

bool Journal::VersionQueued(const std::string& path, uint64_t seq, uint64_t before) const {
  MutexLock lock(&mu_);
  for (const Queued& q : queue_) {
    if (q.e.seq >= before) break;
    if (q.e.op == OpType::kPublish && q.e.path == path && q.e.began_after < seq) return true;
  }
  return false;
}

bool Journal::PublishQueued(const std::string& path) const {
  MutexLock lock(&mu_);
  for (const Queued& q : queue_) {
    if (q.e.op == OpType::kPublish && q.e.path == path) return true;
  }
  return false;
}

void Journal::Run() {
  MutexLock lock(&mu_);
  while (true) {
    Step step = NextStepLocked();
    if (step.kind == Step::kExit) return;
    if (step.kind == Step::kIdle) {
      work_cv_.wait(lock.native());
      continue;
    }
    if (step.kind == Step::kWait) {
      work_cv_.wait_until(lock.native(), step.until);
      continue;
    }
    if (step.kind == Step::kDrop) {
      JournalEntry e = std::move(step.it->e);
      if (e.seq == gate_seq_) gate_seq_ = 0;
      const bool at_head = step.it == queue_.begin();
      const bool held = step.it->held;
      queue_.erase(step.it);
      const Status why =
          held ? Status(Code::kAborted,
                        "not applied: held behind a given-up checkpoint until a later one "
                        "commits, and ckptfs stopped first (what it deletes stays)")
               : Status(Code::kAborted, "deleted through the mount before it was published");
      if (held) ++held_dropped_;
      failures_[e.seq] = why;
      if (e.op == OpType::kPublish) ++dropped_publishes_;
      if (!at_head) done_ahead_.insert(e.seq);
      gate_dirty_ = true;
      AdvanceDoneLocked();
      ++finalizing_;
      unsettled_.insert(e.seq);
      lock.Unlock();
      spdlog::warn("journal: {} dropped: {}", e.Describe(), why.ToString());
      Finalize(e, why, /*applied=*/false);
      lock.Lock();
      --finalizing_;
      unsettled_.erase(e.seq);
      lock.Unlock();
      done_cv_.notify_all();
      lock.Lock();
      continue;
    }
    Queued& q = *step.it;
    q.busy = true;
    JournalEntry e = q.e;  // a copy: Abort() may reshape the queue meanwhile
    const bool at_head = step.it == queue_.begin();
    const bool commit = IsCommitEntry(e);
    const bool failed_before = !q.error.ok();
    if (failed_before) ++retries_;
    if (step.kind == Step::kGate) gate_asking_ = e.seq;
    lock.Unlock();

    if (step.kind == Step::kGate) {
      // Data first: the gate reads this very file.
      Status st = e.op == OpType::kPublish && e.target ? e.target->Sync(dir_) : Status::Ok();
      CommitCheck check = st;
      if (st.ok() && delegate_ != nullptr) check = delegate_->CheckCommit(e, *this);
      lock.Lock();
      FindLocked(e.seq)->busy = false;
      gate_asking_ = 0;
      done_cv_.notify_all();  // an Abort() waiting for the answer
      if (check.status.ok() && !check.ready && check.waits_for_unwritten && commit) {
        // It waits for shards that are not here to wait for, and the application has since
        // made the same `.metadata` again in the same directory (that later save commits
        // the directory), or removed the directory: decided now instead of at the commit
        // timeout; it holds up nothing and leaves nothing of itself (RemoveSkippedCommit).
        const DirectoryEnd end = DirectoryEndsAfterLocked(e.seq, path::Parent(e.path));
        if (SupersededLocked(e)) {
          check.status = Status(Code::kSuperseded,
                                "a later save into " + e.path + " replaced it before its "
                                "shards were durable");
        } else if (end.removed) {
          check.status = Status(Code::kSuperseded,
                                "the application removed " + path::Parent(e.path) +
                                    " (entry #" + std::to_string(end.seq) +
                                    ") before its shards were durable");
        }
      }
      if (!check.status.ok()) {
        lock.Unlock();
        HaltOrSkip(e, check.status, commit, at_head);
        lock.Lock();
        continue;
      }
      const bool meets_held =
          IsDeletion(e) && !e.unheld && !queue_.empty() && queue_.front().held &&
          std::any_of(queue_.begin(), queue_.end(), [&](const Queued& q) {
            return q.held && MeetsHeld(e, q.e);
          });
      if ((check.hold || meets_held) && !e.unheld && IsDeletion(e) && check.status.ok()) {
        // Every entry before it is held too (it was the first one not held); a deletion of
        // names a held one deletes too keeps its place behind it.
        auto it = FindLocked(e.seq);
        it->held = true;
        it->held_at = options_.hold != nullptr ? options_.hold->commits() : 0;
        if (check.tracker_beside) {
          // A tracker on the backing store beside it, none applied since this journal
          // started: the tracker rule applies, as if one had been applied before the hold.
          NoteTracker(tracker_commits_, HeldBeside(e), 0, /*only_if_new=*/true);
        }
        ++held_total_;
        if (gate_seq_ == e.seq) gate_seq_ = 0;
        gate_dirty_ = true;
        lock.Unlock();
        spdlog::warn("journal: {} held: a checkpoint before it was given up, or a tracker "
                     "withheld; it is applied once a later checkpoint commits and its tracker "
                     "is through", e.Describe());
        done_cv_.notify_all();  // its WaitUnlessHalted()
        lock.Lock();
        continue;
      }
      gate_seq_ = e.seq;
      gate_ready_ = check.ready;
      gate_unwritten_ = check.waits_for_unwritten;
      if (!check.ready) done_cv_.notify_all();  // WaitUnlessHalted() of the commit
      gate_dirty_ = false;
      gate_shard_set_ = std::unordered_set<std::string>(check.shards.begin(), check.shards.end());
      gate_recheck_ = std::chrono::steady_clock::now() +
                      std::max(check.recheck, std::chrono::milliseconds(1));
      continue;
    }

    bool tried = false, kept = false;
    Status st = Process(e, failed_before, &tried, &kept);
    if (!st.ok() && options_.shared_dirs) {
      st = SettleAcrossNodes(dir_, e, st, /*rmdir_returned=*/options_.halt_on_failure);
    }
    if (!st.ok() && tried && !e.in_place) e.in_place = LeftInPlace(dir_, e);
    if (st.ok()) {
      if (kept) {
        // The committed version it replaced, kept until this save commits or is aborted.
        e.kept = true;
        replaced_.Keep(e.path, e.from, e.file_id);
      }
      Finalize(e, st, /*applied=*/true);
      if (commit) {
        replaced_.Release(path::Parent(e.path), /*subtree=*/false);  // the rewrite committed
      } else if (e.op == OpType::kRmdir || e.op == OpType::kUnlink || e.op == OpType::kRename) {
        replaced_.Release(e.op == OpType::kRename ? e.from : e.path, /*subtree=*/true);
      }
      if (failed_before) {
        // Before the entry leaves the queue: whoever sees the halt gone (ckptfs-admin
        // resume, then wait) must not still see its checkpoint failed.
        spdlog::info("journal: {} applied after {} retries; publication resumes", e.Describe(),
                     counts().retries);
        if (delegate_ != nullptr) delegate_->OnHalt(e, Status::Ok());
      }
      lock.Lock();
      // A tracker through: deletions held for a commit before it may go (NextStepLocked).
      if (options_.hold != nullptr && IsTrackerCandidate(e)) {
        NoteTracker(tracker_commits_, path::Parent(e.path), options_.hold->commits(),
                    /*only_if_new=*/false);
      }
      auto it = FindLocked(e.seq);
      queue_.erase(it);
      if (!at_head) {
        done_ahead_.insert(e.seq);
        ++applied_ahead_;
      }
      if (commit) gate_seq_ = 0, gate_ready_ = false;
      gate_dirty_ = true;
      // A withdrawal or restore took the place of an aborted entry (Abort): that outcome
      // stays.
      if (!e.withdraw && !e.restore) failures_.erase(e.seq);
      AdvanceDoneLocked();
      lock.Unlock();
      done_cv_.notify_all();
      lock.Lock();
      continue;
    }
    HaltOrSkip(e, st, commit, at_head);
    lock.Lock();
  }
}

std::deque<Journal::Queued>::iterator Journal::FindLocked(uint64_t seq) {
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    if (it->e.seq == seq) return it;
  }
  std::abort();  // only the publisher removes busy entries
}

Status Journal::Process(const JournalEntry& e, bool retry, bool* tried, bool* kept) {
  if (e.restore) {
    Status st = replaced_.PutBack(path::Parent(e.path), retry);
    if (!st.ok() || !e.withdraw) return st;  // else withdrawn too (shared_dirs)
  }
  auto apply = [&] {
    *tried = true;
    bool renamed = false;
    // The first version replaced is the committed one.
    const bool keep =
        e.op == OpType::kPublish && !IsCommitName(e.path) && !replaced_.IsKept(e.path);
    // Recorded first: a crash right after the publish must find what it kept. Not where
    // other nodes write into the same directories: there the rewrite's `.metadata` may
    // still commit on another node after this one restarts, naming the version this
    // publish put there, and putting the earlier one back would tear it.
    const bool recorded =
        keep && !options_.shared_dirs && replaced_.RecordBeforeKeep(e.path, e.from);
    Status st = ApplyEntry(dir_, e, &renamed, retry, keep, kept);
    if (recorded && !*kept) replaced_.DropRecord(e.from);
    if (renamed) temps_.Move(e.from, e.path);  // temps below a renamed directory
    return st;
  };
  if (e.op == OpType::kPublish && e.target) CKPT_RETURN_IF_ERROR(e.target->Sync(dir_));
  if (e.target || !resumed_.Covers(e.seq)) return apply();
  // Left by the previous run: its bytes were fsynced then; fsync again by path (cheap)
  // so that nothing rests on that. A crash of this run after applying it and before its
  // record was removed leaves it applied already: then its source is gone and its name
  // is there.
  auto applied_before = [&] {
    if (!dir_->Stat(e.path).ok()) return false;
    spdlog::warn("journal: {} was applied before the restart", e.Describe());
    return true;
  };
  if (e.op == OpType::kPublish) {
    Status st = SyncFileAt(dir_, e.from);
    if (st.code() == Code::kNotFound && applied_before()) return Status::Ok();
    CKPT_RETURN_IF_ERROR(st);
  }
  Status st = apply();
  if (st.code() == Code::kNotFound && e.op == OpType::kRename && applied_before()) {
    return Status::Ok();
  }
  if (st.code() == Code::kExists && (e.op == OpType::kSymlink || e.op == OpType::kLink ||
                                     e.op == OpType::kMknod)) {
    return Status::Ok();
  }
  return st;
}

void Journal::Finalize(const JournalEntry& e, const Status& st, bool applied) {
  if (!applied && (e.op == OpType::kPublish || e.op == OpType::kDiscard)) {
    if (e.target && e.op == OpType::kPublish) e.target->Cancel(st);
    // Nothing of an unpublished file may appear under its real name (G4, G7).
    Status rm = dir_->Unlink(e.from);
    if (!rm.ok() && rm.code() != Code::kNotFound) {
      spdlog::error("journal: cannot remove temp {}: {}", e.from, rm.ToString());
    }
  }
  std::vector<std::string> deletes{JournalEntry::RecordKey(e.seq)};
  // A kept replaced file lives on under the temp name: its record stays (ReplacedFiles).
  const bool temp_done = (e.op == OpType::kPublish || e.op == OpType::kDiscard) && !e.kept;
  if (temp_done) deletes.push_back(TempRecords::Key(e.file_id));
  // An entry the previous run left: its record is removed synced, so that a crash now
  // never resumes it twice; the marker goes with the last one.
  const bool resumed = resumed_.Covers(e.seq);
  if (resumed) {
    MutexLock lock(&mu_);
    if (resumed_left_ > 0 && --resumed_left_ == 0) deletes.push_back(kLeftKey);
  }
  // Unsynced: the entry is done on the backing store already. If a crash of the node
  // loses this removal, recovery finds the records again: it unlinks the temp name,
  // which no longer exists after a publish (NotFound is expected) or holds the replaced
  // old file (removing it is what the publish did next), and it reports the entry as
  // discarded, a log line. Temp names are never reused (the file id has the epoch).
  Status db_st =
      db_->Write({}, deletes, resumed ? WriteMode::kSynced : WriteMode::kUnsynced);
  if (!db_st.ok()) spdlog::warn("journal: state db: {}", db_st.ToString());
  if (options_.trace != nullptr) options_.trace->Done(e, applied);
  if (temp_done) temps_.Drop(e.file_id);
  if (delegate_ != nullptr) delegate_->OnDone(e, st);
}

}  // namespace ckptfs::store
