// Where one run of the journal ends and the next begins: Recover() (what the last run
// left), Close() and the bounded stop CloseWithin(), and QueueLeft()/WaitLeft() for the
// entries a bounded stop handed over (store/publish/journal.h, "Bounded stop").
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <iterator>
#include <set>

#include "store/publish/entry_apply.h"
#include "store/publish/journal.h"
#include "store/publish/lost_publishes.h"

namespace ckptfs::store {

Result<RecoveryReport> Journal::Recover(BackingDir* dir, StateDb* db) {
  RecoveryReport report;
  std::vector<std::string> deletes;
  std::vector<std::string> temps;
  // A bounded stop left the entries up to `left_until` for this run, synced and with
  // their bytes durable: they are resumed. Everything else is what a crash left.
  uint64_t left_until = 0;
  if (auto left = db->Get(kLeftKey); left.ok()) {
    left_until = std::strtoull(left->c_str(), nullptr, 10);
  }
  bool resuming = left_until > 0;
  std::vector<std::pair<std::string, std::string>> discarded;  // publishes: (path, temp)
  std::set<uint64_t> resumed_ids;  // file ids whose temp files the resumed entries need
  CKPT_RETURN_IF_ERROR(
      db->Scan(JournalEntry::kRecordPrefix, [&](std::string_view k, std::string_view v) {
        auto e = JournalEntry::Parse(v);
        if (resuming && e.ok() && e->seq <= left_until) {
          if (e->op == OpType::kPublish || e->op == OpType::kDiscard)
            resumed_ids.insert(e->file_id);
          report.resumed.push_back(std::move(e).value());
          return;
        }
        // An unreadable record among the left ones: the rest cannot follow it in order.
        if (!e.ok()) resuming = false;
        deletes.emplace_back(k);
        ++report.entries_discarded;
        if (e.ok() && e->op == OpType::kPublish) discarded.emplace_back(e->path, e->from);
        if (e.ok()) report.discarded.push_back(std::move(e).value());
      }));
  CKPT_RETURN_IF_ERROR(db->Scan(TempRecords::kPrefix, [&](std::string_view k, std::string_view v) {
    const uint64_t id =
        std::strtoull(std::string(k.substr(sizeof(TempRecords::kPrefix) - 1)).c_str(), nullptr, 16);
    if (resumed_ids.count(id) > 0) return;  // published by this run
    deletes.emplace_back(k);
    temps.emplace_back(v);
  }));
  // What a rewrite that died with the daemon replaced goes back, before the temp files
  // go (ReplacedFiles).
  CKPT_RETURN_IF_ERROR(ReplacedFiles::RecoverKept(dir, db, &deletes, &report.restored));
  if (left_until > 0 && report.resumed.empty()) deletes.emplace_back(kLeftKey);
  if (!report.resumed.empty()) {
    spdlog::info("recovery: resuming {} journal entries the last stop left ({} .. {})",
                 report.resumed.size(), report.resumed.front().Describe(),
                 report.resumed.back().Describe());
  }
  // A discarded publish whose temp file is still there never reached its name: its bytes
  // die here (async mode allows that), and the next runs tell the peers (LostPublishes).
  // One whose temp is gone was renamed into place before the crash.
  std::vector<std::pair<std::string, std::string>> lost;
  const double now = static_cast<double>(std::time(nullptr));
  for (const auto& [path, temp] : discarded) {
    if (!dir->Stat(temp).ok()) continue;
    report.lost_paths.push_back(path);
    lost.push_back(LostPublishes::Record(path, now));
  }
  for (const auto& temp : temps) {
    Status st = dir->Unlink(temp);
    if (st.ok()) {
      ++report.temps_removed;
      spdlog::info("recovery: removed unpublished temp file {}", temp);
    } else if (st.code() != Code::kNotFound) {
      return st;  // keep the records; the next start tries again
    }
  }
  CKPT_RETURN_IF_ERROR(db->Write(lost, deletes));
  return report;
}

uint64_t Journal::Close() {
  MutexLock lock(&mu_);
  closing_ = true;
  for (Queued& q : queue_) {
    if (!q.error.ok()) q.retry_at = std::chrono::steady_clock::now();  // one last attempt
  }
  work_cv_.notify_all();
  done_cv_.wait(lock.native(), [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    return queue_.empty() && finalizing_ == 0;
  });
  const uint64_t dropped = dropped_publishes_;
  lock.Unlock();
  // Every entry is done: a rewrite that neither committed nor was aborted stays as the
  // application left it (G8); the versions it replaced go.
  replaced_.ReleaseAll();
  return dropped;
}

StopReport Journal::CloseWithin(std::chrono::milliseconds stall,
                                const std::function<void(const std::string&)>& waiting) {
  using Clock = std::chrono::steady_clock;
  StopReport report;
  MutexLock lock(&mu_);
  for (Queued& q : queue_) {
    if (!q.error.ok()) q.retry_at = Clock::now();  // one more attempt, at once
  }
  gate_dirty_ = true;
  work_cv_.notify_all();
  // Progress is an entry done; a failed attempt or another "not yet" of the gate is not.
  auto last_progress = Clock::now();
  size_t last_size = queue_.size();
  uint64_t last_done = done_seq_;
  std::string said;
  while (!queue_.empty() || finalizing_ > 0) {
    const auto now = Clock::now();
    std::string what = WaitingForLocked();
    if (what.empty() || queue_.size() != last_size || done_seq_ != last_done) {
      last_progress = now;
      last_size = queue_.size();
      last_done = done_seq_;
    }
    if (what != said) {
      said = what;
      lock.Unlock();
      if (!what.empty()) {
        spdlog::warn(
            "stop: publication waits: {}; what is queued is left for the next start "
            "after {} s without progress",
            what, std::chrono::duration<double>(stall).count());
      }
      if (waiting) waiting(what);
      lock.Lock();
      continue;
    }
    if (!what.empty() && now - last_progress >= stall) {
      report.waiting_for = what;
      break;
    }
    auto until = now + std::chrono::seconds(1);
    if (!what.empty()) until = std::min(until, last_progress + stall);
    done_cv_.wait_until(lock.native(), until);
  }
  if (queue_.empty() && finalizing_ == 0) {
    report.dropped_publishes = dropped_publishes_;
    lock.Unlock();
    replaced_.ReleaseAll();  // as Close()
    return report;
  }

  // Hand over: the publisher stops at its next step, leaving every queued entry.
  leaving_ = true;
  work_cv_.notify_all();
  done_cv_.wait(lock.native(), [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    return publisher_exited_ && finalizing_ == 0;
  });
  std::vector<Queued> all(std::make_move_iterator(queue_.begin()),
                          std::make_move_iterator(queue_.end()));
  queue_.clear();
  gate_seq_ = 0;
  gate_ready_ = false;
  lock.Unlock();

  // Bytes first: every publish's file fsynced. From the first one whose bytes cannot be
  // made durable (still in staging behind a full disk, or lost) on, nothing can be handed
  // over in order: those are dropped, as Close() drops them (G4).
  size_t cut = all.size();
  Status cut_why;
  for (size_t i = 0; i < all.size() && cut == all.size(); ++i) {
    const JournalEntry& e = all[i].e;
    if (all[i].drop || e.op != OpType::kPublish) continue;
    Status st = e.target ? e.target->Sync(dir_) : SyncFileAt(dir_, e.from);
    if (!st.ok()) {
      cut = i;
      cut_why = st;
    }
  }
  // The records of what is left, and the marker, in one synced write. The records of the
  // entries deleted through the mount meanwhile (DropIfHalted) go in it too.
  std::vector<std::pair<std::string, std::string>> puts;
  std::vector<std::string> deletes;
  uint64_t left_until = 0;
  for (size_t i = 0; i < cut; ++i) {
    const JournalEntry& e = all[i].e;
    if (all[i].drop) {
      deletes.push_back(JournalEntry::RecordKey(e.seq));
      continue;
    }
    puts.emplace_back(JournalEntry::RecordKey(e.seq), e.Serialize());
    left_until = std::max(left_until, e.seq);
  }
  if (left_until > 0) {
    puts.emplace_back(kLeftKey, std::to_string(left_until));
    Status st = db_->Write(puts, deletes, WriteMode::kSynced);
    if (!st.ok()) {
      spdlog::error("stop: cannot record the entries left for the next start: {}", st.ToString());
      cut = 0;
      cut_why = st;
      left_until = 0;
    }
  }
  // Records of an earlier hand-over are this one's now (or dropped below): their removal
  // must not take the new marker with it.
  resumed_.until.store(0, std::memory_order_release);

  std::vector<std::pair<JournalEntry, Status>> dropped;
  const Status behind(Code::kAborted, cut < all.size() ? "not published: " + all[cut].e.Describe() +
                                                             " could not be made durable first"
                                                       : "");
  const Status deleted(Code::kAborted, "deleted through the mount before it was published");
  const Status left(Code::kAborted, "left for the next start");
  lock.Lock();
  resumed_left_ = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    JournalEntry& e = all[i].e;
    if (i < cut && !all[i].drop) {
      failures_[e.seq] = left;
      ++report.left;
      continue;
    }
    const Status& why = all[i].drop ? deleted : i == cut ? cut_why : behind;
    failures_[e.seq] = why;
    if (e.op == OpType::kPublish) ++dropped_publishes_;
    dropped.emplace_back(std::move(e), why);
  }
  AdvanceDoneLocked();
  report.dropped_publishes = dropped_publishes_;
  lock.Unlock();
  if (report.left > 0) {
    spdlog::warn(
        "stop: {} journal entries left for the next start, their bytes durable "
        "(first {}); publication waited for: {}",
        report.left, all.front().e.Describe(), report.waiting_for);
  }
  if (cut < all.size()) {
    spdlog::error(
        "stop: {} could not be made durable ({}); it and {} entries after it are "
        "not published",
        all[cut].e.Describe(), cut_why.ToString(), all.size() - cut - 1);
  }
  for (const auto& [e, why] : dropped) Finalize(e, why, /*applied=*/false);
  done_cv_.notify_all();
  return report;
}

void Journal::QueueLeft(std::vector<JournalEntry> left) {
  if (left.empty()) return;
  {
    MutexLock lock(&mu_);
    if (!queue_.empty() || next_seq_ != done_seq_ + 1 || next_seq_ > left.front().seq) {
      // Only a fresh journal takes them (their sequence numbers come first).
      spdlog::error("journal: entries left by the last stop queued too late; not resumed");
      return;
    }
    next_seq_ = left.back().seq + 1;
    done_seq_ = left.front().seq - 1;
    resumed_left_ = left.size();
    resumed_.until.store(left.back().seq, std::memory_order_release);
    for (JournalEntry& e : left) {
      if (e.op == OpType::kPublish || e.op == OpType::kDiscard) temps_.Note(e.file_id, e.from);
      Queued q;
      q.e = std::move(e);
      queue_.push_back(std::move(q));
    }
    gate_dirty_ = true;
  }
  work_cv_.notify_all();
}

bool Journal::WaitLeft(std::chrono::milliseconds stall) {
  using Clock = std::chrono::steady_clock;
  MutexLock lock(&mu_);
  auto last_progress = Clock::now();
  uint64_t last_left = resumed_left_;
  while (resumed_left_ > 0) {
    const auto now = Clock::now();
    if (resumed_left_ != last_left) {
      last_left = resumed_left_;
      last_progress = now;
    }
    bool halted = false;
    for (const Queued& q : queue_) halted = halted || !q.error.ok();
    if (halted || now - last_progress >= stall) return false;
    done_cv_.wait_until(lock.native(),
                        std::min(now + std::chrono::milliseconds(100), last_progress + stall));
  }
  return true;
}

}  // namespace ckptfs::store
