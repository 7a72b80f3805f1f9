// When an entry fails (G7): the journal halts at it and retries with backoff, or skips it
// (HaltOrSkip); the operator's answers (Resume, Abort), a file deleted through the mount
// while halted (DropIfHalted), and what publication waits for (WaitingFor, halted).
#include <spdlog/spdlog.h>

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <set>

#include "common/backoff.h"
#include "common/path.h"
#include "store/publish/journal.h"

namespace ckptfs::store {
namespace {

using path::IsAtOrBelow;

bool IsCommitEntry(const JournalEntry& e) {
  return (e.op == OpType::kPublish || e.op == OpType::kRename) && IsCommitName(e.path);
}

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A transient failure is retried after 100 ms, doubling up to 5 s.
constexpr Backoff kRetry{std::chrono::milliseconds(100), std::chrono::seconds(5)};
// A permanent failure waits for Resume() or Abort(); this only bounds the wait.
constexpr auto kPermanentRetry = std::chrono::hours(24);

// A later entry of [it + 1, end) deletes the file `it` makes (following renames of it):
// its own unlink, or an rmdir of a directory it was in.
template <typename QueueIt>
bool DeletedLater(QueueIt it, QueueIt end) {
  std::string name = it->e.path;
  for (auto q = std::next(it); q != end; ++q) {
    const JournalEntry& later = q->e;
    if (later.op == OpType::kRename && later.from == name) {
      name = later.path;
    } else if ((later.op == OpType::kUnlink && later.path == name) ||
               (later.op == OpType::kRmdir && IsAtOrBelow(name, later.path))) {
      return true;
    }
  }
  return false;
}

}  // namespace

std::string Journal::WaitingFor() const {
  MutexLock lock(&mu_);
  return WaitingForLocked();
}

std::string Journal::WaitingForLocked() const {
  const std::string behind =
      queue_.size() > 1 ? "; " + std::to_string(queue_.size() - 1) + " more entries queued" : "";
  for (const Queued& q : queue_) {
    if (q.error.ok()) continue;
    return "halted at " + q.e.Describe() + ": " + q.error.ToString() +
           (IsTransient(q.error) ? " (retrying with backoff)" : " (waiting for resume or abort)") +
           behind;
  }
  if (gate_seq_ == 0 || gate_ready_ || queue_.empty() || queue_.front().e.seq != gate_seq_) {
    return "";
  }
  std::vector<std::string> shards(gate_shard_set_.begin(), gate_shard_set_.end());
  std::sort(shards.begin(), shards.end());
  std::string names;
  for (size_t i = 0; i < shards.size() && i < 3; ++i) names += (i ? ", " : "") + shards[i];
  if (shards.size() > 3) names += " and " + std::to_string(shards.size() - 3) + " more";
  return "commit " + queue_.front().e.Describe() + " waits at the gate for " +
         (shards.empty() ? std::string("its shards") : "shards " + names) + behind;
}

void Journal::Resume() {
  {
    MutexLock lock(&mu_);
    for (Queued& q : queue_) {
      if (!q.error.ok()) q.retry_at = std::chrono::steady_clock::now();
    }
    gate_dirty_ = true;
  }
  work_cv_.notify_all();
}

bool Journal::DropIfHalted(const std::string& path) {
  bool marked = false;
  {
    MutexLock lock(&mu_);
    // Only names in the halted entry's directory (a failed checkpoint the application
    // removes): what the halt itself holds up. Any other name behind the halt keeps its
    // place and is published, then deleted, in the application's order; dropped, it would
    // leave a tracker queued between naming a checkpoint that never commits (G4).
    auto halt = std::find_if(queue_.begin(), queue_.end(),
                             [](const Queued& q) { return !q.error.ok(); });
    if (halt == queue_.end() || path::Parent(halt->e.path) != path::Parent(path)) return false;
    bool behind_halt = false;
    for (Queued& q : queue_) {
      if (!q.error.ok()) behind_halt = true;
      if (!behind_halt || q.drop || q.e.path != path) continue;
      if (q.e.op == OpType::kPublish) {
        // Being retried right now: the publisher drops it if the attempt fails.
        q.drop = true;
        marked = true;
      } else if (q.e.op == OpType::kRename && !q.busy) {
        // Its source stays where it is; the application removed the result.
        if (q.e.seq == gate_seq_) gate_seq_ = 0;
        q.e.op = OpType::kUnlink;
        q.e.path = q.e.from;
        q.e.from.clear();
        q.error = Status::Ok();
        marked = true;
      }
    }
  }
  if (marked) work_cv_.notify_all();
  return marked;
}

std::optional<HaltInfo> Journal::halted() const {
  MutexLock lock(&mu_);
  for (const Queued& q : queue_) {
    if (q.error.ok()) continue;
    HaltInfo h;
    h.seq = q.e.seq;
    h.what = q.e.Describe();
    h.path = q.e.path;
    h.error = q.error;
    h.attempts = q.attempts;
    h.transient = IsTransient(q.error);
    h.since = q.failed_since;
    return h;
  }
  return std::nullopt;
}

std::vector<std::string> Journal::Abort(const std::string& path, AbortWithdrawals* withdraw,
                                        std::vector<std::string>* untouched) {
  std::vector<JournalEntry> dropped;
  std::set<uint64_t> reused;  // seqs of dropped entries a withdrawal took the place of
  std::vector<std::string> withdrawn;
  {
    MutexLock lock(&mu_);
    auto below = [&](const JournalEntry& e) {
      return IsAtOrBelow(e.path, path) || (!e.from.empty() && IsAtOrBelow(e.from, path));
    };
    // A commit the gate is being asked about is busy but not being applied: its answer
    // (a few file checks, or a peer's reply, bounded by their timeouts) comes first, so
    // that it is dropped as queued. Else it stayed queued, waiting for shards that the
    // abort dropped, until the commit timeout.
    done_cv_.wait(lock.native(), [&] {
      mu_.AssertHeld();  // the predicate runs under the lock
      const uint64_t asking = gate_asking_;
      if (asking == 0) return true;
      return std::none_of(queue_.begin(), queue_.end(),
                          [&](const Queued& q) { return q.e.seq == asking && below(q.e); });
    });
    auto file_of_save = [](const JournalEntry& e) {
      return (e.op == OpType::kPublish || e.op == OpType::kRename) && !S_ISDIR(e.mode);
    };
    // The saves it drops, by directory. An earlier save's `.metadata` there describes the
    // directory only while nothing of the dropped save reached it. The files a rewrite
    // replaced were kept (ReplacedFiles): they are put back, in the order of the dropped
    // entries, and the directory is the earlier save again. What cannot be put back (a
    // failed attempt left its name in place) has the `.metadata` withdrawn instead, so that
    // no loader takes a mix of the two saves as complete. Not while that save's commit is
    // in flight (being applied): its outcome decides. A file of it being
    // published (a retry) may replace one yet: what it keeps is put back after it.
    struct Save {
      bool in_place = false;    // a dropped entry's failed attempt left its name in place
      bool in_flight = false;   // its commit is being applied
      bool publishing = false;  // a file of it is being published (not dropped)
      bool donor = false;       // an entry of it is dropped (its place takes the withdrawal)
      std::set<std::string> commits;
    };
    std::map<std::string, Save> saves;
    for (const Queued& q : queue_) {
      if (!below(q.e) || !file_of_save(q.e)) continue;
      Save& save = saves[path::Parent(q.e.path)];
      if (q.busy) {
        save.in_flight = save.in_flight || IsCommitEntry(q.e);
        save.publishing = save.publishing || (q.e.op == OpType::kPublish && !IsCommitEntry(q.e));
        continue;
      }
      save.donor = true;
      save.in_place = save.in_place || q.e.in_place;
      if (IsCommitEntry(q.e)) save.commits.insert(q.e.path);
    }
    std::map<std::string, std::vector<std::string>> to_withdraw;  // dir -> commit names
    std::set<std::string> restore;
    for (auto& [dir, save] : saves) {
      if (save.in_flight || !save.donor) continue;
      if (!save.in_place && (save.publishing || replaced_.HasKept(dir))) {
        restore.insert(dir);
        to_withdraw[dir] = {path::Join(dir, ".metadata")};
        continue;
      }
      if (withdraw == nullptr) continue;
      if (!withdraw->WithdrawOnAbort(dir, save.in_place)) {
        if (untouched != nullptr) untouched->push_back(dir);
        continue;
      }
      if (save.commits.empty()) save.commits.insert(path::Join(dir, ".metadata"));
      to_withdraw[dir].assign(save.commits.begin(), save.commits.end());
    }
    for (auto it = queue_.begin(); it != queue_.end();) {
      // An earlier abort's own repair (a restore or withdrawal) is not dropped.
      if (!below(it->e) || it->busy || it->e.restore || it->e.withdraw) {
        ++it;
        continue;
      }
      if (it->e.seq == gate_seq_) gate_seq_ = 0;
      auto w = file_of_save(it->e) ? to_withdraw.find(path::Parent(it->e.path)) : to_withdraw.end();
      if (w == to_withdraw.end() || w->second.empty()) {
        dropped.push_back(std::move(it->e));
        it = queue_.erase(it);
        continue;
      }
      // The withdrawal takes the place (and the sequence number) of a dropped entry.
      Queued withdrawal;
      withdrawal.e.seq = it->e.seq;
      withdrawal.e.op = OpType::kUnlink;
      withdrawal.e.path = w->second.back();
      withdrawal.e.restore = restore.count(w->first) > 0;
      withdrawal.e.withdraw = !withdrawal.e.restore || options_.shared_dirs;
      w->second.pop_back();
      reused.insert(it->e.seq);
      if (withdrawal.e.withdraw) withdrawn.push_back(withdrawal.e.path);
      dropped.push_back(std::move(it->e));
      *it = std::move(withdrawal);
      ++it;
    }
    gate_dirty_ = true;
    // Out of the queue, their outcome not yet settled (Finalize removes their temp files):
    // still pending for stats and `ckptfs-admin wait`, and a stop waits for them. A seq a
    // withdrawal took over is counted by the queue already.
    for (const JournalEntry& e : dropped) {
      if (reused.count(e.seq) == 0) unsettled_.insert(e.seq);
    }
    ++finalizing_;
  }
  for (const std::string& name : withdrawn) {
    spdlog::warn(
        "journal: the abort of {} withdraws {} from the backing store: the directory "
        "holds part of the aborted save",
        path.empty() ? "/" : path, name);
  }
  std::vector<std::string> lines;
  for (JournalEntry& e : dropped) {
    lines.push_back(e.Describe());
    spdlog::warn("journal: aborted by the operator: {}", e.Describe());
    Finalize(e, Status(Code::kAborted, "aborted by the operator"), /*applied=*/false);
  }
  {
    MutexLock lock(&mu_);
    for (const JournalEntry& e : dropped) {
      failures_[e.seq] = Status(Code::kAborted, "aborted by the operator");
      if (e.op == OpType::kPublish) ++dropped_publishes_;
      if (reused.count(e.seq) == 0) {
        done_ahead_.insert(e.seq);
        unsettled_.erase(e.seq);
      }
    }
    --finalizing_;
    AdvanceDoneLocked();
  }
  done_cv_.notify_all();
  work_cv_.notify_all();
  return lines;
}

void Journal::HaltOrSkip(const JournalEntry& e, const Status& st, bool commit, bool at_head) {
  if (st.code() == Code::kSuperseded || st.code() == Code::kNodeLost) RemoveSkippedCommit(e);
  MutexLock lock(&mu_);
  // A superseded commit failed nothing: it is skipped in either mode. One given up for a
  // lost node failed its checkpoint, never the rest: skipped in either mode too.
  const bool decided = st.code() == Code::kSuperseded || st.code() == Code::kNodeLost;
  const bool halts = options_.halt_on_failure && !decided &&
                     (e.op == OpType::kPublish || commit || IsTransient(st));
  if (!halts) {
    // A namespace entry the backing store refuses for good (someone else changed it),
    // skipped as it carries no data; or any failure in strict mode, where the operation
    // that made the entry returns it to the application.
    queue_.erase(FindLocked(e.seq));
    failures_[e.seq] = st;
    if (st.code() == Code::kSuperseded) {
      ++superseded_;  // the later save commits the directory: nothing is missing
    } else {
      ++skipped_;
      if (st.code() == Code::kNodeLost) ++given_up_;
    }
    if (!at_head) done_ahead_.insert(e.seq);
    AdvanceDoneLocked();
    ++finalizing_;
    unsettled_.insert(e.seq);
    lock.Unlock();
    if (st.code() == Code::kSuperseded) {
      spdlog::info("journal: {} superseded: {}", e.Describe(), st.message());
    } else if (st.code() == Code::kNodeLost) {
      spdlog::error("journal: {} given up: {}", e.Describe(), st.message());
    } else {
      spdlog::error("journal: {} skipped: {}", e.Describe(), st.ToString());
    }
    Finalize(e, st, /*applied=*/false);
    if (commit && st.code() == Code::kNodeLost) {
      // The rewrite this commit closed never commits (its shards dropped, or a node lost):
      // what it replaced goes back, at the commit's place, as an abort's restore does.
      std::optional<JournalEntry> restored =
          replaced_.PutBackForGivenUpCommit(e, options_.shared_dirs);
      if (restored && delegate_ != nullptr) delegate_->OnDone(*restored, Status::Ok());
    }
    lock.Lock();
    --finalizing_;
    unsettled_.erase(e.seq);
    lock.Unlock();
    done_cv_.notify_all();
    return;
  }
  if (closing_) {
    // Shutting down with a failure at the head of the line: it and everything after it
    // are dropped; the backing store keeps the prefix (G4).
    std::vector<std::pair<JournalEntry, Status>> dropped;
    // A shard applied ahead fails: the commit at the head waits for it, so it goes too.
    auto from = at_head ? FindLocked(e.seq) : queue_.begin();
    FindLocked(e.seq)->e.in_place = e.in_place;
    const Status behind(Code::kAborted, "not published: " + e.Describe() + " failed first");
    for (auto it = from; it != queue_.end();) {
      if (it->busy && it->e.seq != e.seq) {  // a mkdir its waiter applies: its own outcome
        ++it;
        continue;
      }
      dropped.emplace_back(std::move(it->e), it->e.seq == e.seq ? st : behind);
      it = queue_.erase(it);
    }
    for (const auto& [d, why] : dropped) {
      failures_[d.seq] = why;
      if (d.op == OpType::kPublish) ++dropped_publishes_;
    }
    gate_seq_ = 0;
    AdvanceDoneLocked();
    ++finalizing_;  // Close() returns once their records are gone too
    for (const auto& dropped_entry : dropped) unsettled_.insert(dropped_entry.first.seq);
    lock.Unlock();
    spdlog::error("journal: {} failed at shutdown ({}); {} entries after it not applied",
                  e.Describe(), st.ToString(), dropped.size() - 1);
    for (const auto& [d, why] : dropped) Finalize(d, why, /*applied=*/false);
    lock.Lock();
    --finalizing_;
    for (const auto& dropped_entry : dropped) unsettled_.erase(dropped_entry.first.seq);
    lock.Unlock();
    done_cv_.notify_all();
    return;
  }
  auto it = FindLocked(e.seq);
  it->busy = false;
  it->e.in_place = e.in_place;  // an abort that drops it withdraws what it left
  if (it->drop) {
    work_cv_.notify_all();  // deleted through the mount meanwhile: the publisher drops it
    return;
  }
  if ((e.op == OpType::kPublish || e.op == OpType::kRename) && DeletedLater(it, queue_.end())) {
    // The application removed the file (an rm -r, a rename then a delete) before this
    // entry failed: a delete that came after the halt would have dropped it
    // (DropIfHalted); one queued before it must too, or publication halts, for good on a
    // permanent error, at a file no one can remove any more. A rename (a `.metadata.tmp`
    // whose publish was dropped) becomes the removal of its source, as DropIfHalted makes it.
    if (e.op == OpType::kPublish) {
      it->drop = true;
    } else {
      if (it->e.seq == gate_seq_) gate_seq_ = 0;
      it->e.op = OpType::kUnlink;
      it->e.path = it->e.from;
      it->e.from.clear();
      gate_dirty_ = true;
    }
    lock.Unlock();
    spdlog::warn("journal: {} failed ({}), and the application deleted it afterwards: "
                 "dropped instead of halting", e.Describe(), st.ToString());
    work_cv_.notify_all();
    return;
  }
  const bool first = it->error.ok();
  it->error = st;
  ++it->attempts;
  if (first) it->failed_since = UnixNow();
  auto delay = IsTransient(st)
                   ? kRetry.Delay(it->attempts - 1)
                   : std::chrono::duration_cast<std::chrono::milliseconds>(kPermanentRetry);
  it->retry_at = std::chrono::steady_clock::now() + delay;
  failures_[e.seq] = st;
  gate_dirty_ = true;
  const uint64_t attempts = it->attempts;
  lock.Unlock();
  if (first) {
    spdlog::error("journal: halted at {}: {} ({}); nothing after it is applied until it passes",
                  e.Describe(), st.ToString(),
                  IsTransient(st) ? "retrying with backoff" : "waiting for resume or abort");
  } else if (attempts % 20 == 0) {
    spdlog::warn("journal: still halted at {} after {} attempts: {}", e.Describe(), attempts,
                 st.ToString());
  }
  if (delegate_ != nullptr) delegate_->OnHalt(e, st);
  done_cv_.notify_all();
}

void Journal::RemoveSkippedCommit(const JournalEntry& e) {
  // A publish's temp file goes with its records (Finalize). A rename's source is the
  // application's own file (its `.metadata.tmp`), published under that name by an earlier
  // entry; the application's rename took it away, so it goes now, before any later entry.
  if (e.op != OpType::kRename || e.from.empty()) return;
  Status st = dir_->Unlink(e.from);
  if (st.ok()) {
    (void)dir_->SyncParent(e.from);
  } else if (st.code() != Code::kNotFound) {
    spdlog::warn("journal: {}: the source of the commit not applied stays: {}", e.Describe(),
                 st.ToString());
  }
}

}  // namespace ckptfs::store
