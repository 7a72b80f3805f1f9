#include "store/publish/journal.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <thread>

#include "common/path.h"
#include "common/thread_name.h"
#include "store/dcp/commit_names.h"
#include "store/primitives/record_codec.h"
#include "store/publish/entry_apply.h"

namespace ckptfs::store {
namespace {

constexpr char kEntryPrefix[] = "j/";
constexpr char kEpochKey[] = "m/epoch";
// Written (synced) by a bounded stop that left entries for the next start: the highest
// sequence number it left. Entry records up to it are resumed, not discarded.
constexpr char kLeftKey[] = "m/left";

std::string Key(const char* prefix, uint64_t n) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%s%016" PRIx64, prefix, n);
  return buf;
}

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

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

constexpr auto kRetryMin = std::chrono::milliseconds(100);
constexpr auto kRetryMax = std::chrono::seconds(5);
// A permanent failure waits for Resume() or Abort(); this only bounds the wait.
constexpr auto kPermanentRetry = std::chrono::hours(24);

// Fsyncs the file at `path`: a publish left by the previous run has no FlushTarget.
Status SyncPath(BackingDir* dir, const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, dir->OpenFile(path, O_RDONLY | O_CLOEXEC));
  return dir->Fsync(fd.get());
}

}  // namespace

const char* OpName(OpType op) {
  switch (op) {
    case OpType::kPublish: return "publish";
    case OpType::kRename: return "rename";
    case OpType::kUnlink: return "unlink";
    case OpType::kRmdir: return "rmdir";
    case OpType::kMkdir: return "mkdir";
    case OpType::kSymlink: return "symlink";
    case OpType::kChmod: return "chmod";
    case OpType::kUtimens: return "utimens";
    case OpType::kDiscard: return "discard";
    case OpType::kChown: return "chown";
    case OpType::kLink: return "link";
    case OpType::kMknod: return "mknod";
  }
  return "?";
}

bool IsCommitName(const std::string& path) { return CommitKindOf(path) != CommitKind::kNone; }

// Binary record (store/primitives/record_codec.h): names are bytes, any bytes a client may use.
// Version 2; version 1 records were JSON (a daemon never reads another run's entries
// except in Recover(), which treats an unreadable record as a discarded entry).
constexpr uint8_t kEntryVersion = 2;

std::string JournalEntry::Serialize() const {
  std::string out;
  out.reserve(48 + path.size() + from.size() + link_target.size());
  StringWriter w(&out);
  w.Byte(kEntryVersion);
  w.Varint(seq);
  w.Varint(static_cast<uint64_t>(op));
  w.String(path);
  w.String(from);
  w.String(link_target);
  w.Varint(mode);
  w.Signed(atime_sec);
  w.Signed(atime_nsec);
  w.Signed(mtime_sec);
  w.Signed(mtime_nsec);
  w.Varint(file_id);
  w.Varint(size);
  // Multi-user POSIX fields (version 2 records end here when unset).
  w.Varint(uid);
  w.Varint(gid);
  w.Varint(rdev);
  return out;
}

Result<JournalEntry> JournalEntry::Parse(std::string_view text) {
  Decoder d(text);
  if (d.Byte() != kEntryVersion || !d.ok()) return Corrupt("journal entry: unknown record version");
  JournalEntry e;
  e.seq = d.Varint();
  uint64_t op = d.Varint();
  e.path = d.String();
  e.from = d.String();
  e.link_target = d.String();
  e.mode = static_cast<uint32_t>(d.Varint());
  e.atime_sec = d.Signed();
  e.atime_nsec = d.Signed();
  e.mtime_sec = d.Signed();
  e.mtime_nsec = d.Signed();
  e.file_id = d.Varint();
  e.size = d.Varint();
  e.uid = static_cast<uint32_t>(d.Varint());
  e.gid = static_cast<uint32_t>(d.Varint());
  e.rdev = d.Varint();
  if (!d.done()) return Corrupt("journal entry: truncated or trailing bytes");
  if (op < static_cast<uint64_t>(OpType::kPublish) || op > static_cast<uint64_t>(OpType::kMknod)) {
    return Corrupt("journal entry: unknown op " + std::to_string(op));
  }
  e.op = static_cast<OpType>(op);
  return e;
}

std::string JournalEntry::Describe() const {
  std::string s = std::string(OpName(op)) + " #" + std::to_string(seq) + " " + path;
  if (!from.empty()) s += " (from " + from + ")";
  return s;
}

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
  std::set<uint64_t> resumed_ids;  // file ids whose temp files the resumed entries need
  CKPT_RETURN_IF_ERROR(db->Scan(kEntryPrefix, [&](std::string_view k, std::string_view v) {
    auto e = JournalEntry::Parse(v);
    if (resuming && e.ok() && e->seq <= left_until) {
      if (e->op == OpType::kPublish || e->op == OpType::kDiscard) resumed_ids.insert(e->file_id);
      report.resumed.push_back(std::move(e).value());
      return;
    }
    // An unreadable record among the left ones: the rest cannot follow it in order.
    if (!e.ok()) resuming = false;
    deletes.emplace_back(k);
    ++report.entries_discarded;
    if (e.ok() && e->op == OpType::kPublish) report.discarded_paths.push_back(e->path);
  }));
  CKPT_RETURN_IF_ERROR(db->Scan(TempRecords::kPrefix, [&](std::string_view k, std::string_view v) {
    const uint64_t id = std::strtoull(std::string(k.substr(sizeof(TempRecords::kPrefix) - 1)).c_str(),
                                      nullptr, 16);
    if (resumed_ids.count(id) > 0) return;  // published by this run
    deletes.emplace_back(k);
    temps.emplace_back(v);
  }));
  if (left_until > 0 && report.resumed.empty()) deletes.emplace_back(kLeftKey);
  if (!report.resumed.empty()) {
    spdlog::info("recovery: resuming {} journal entries the last stop left ({} .. {})",
                 report.resumed.size(), report.resumed.front().Describe(),
                 report.resumed.back().Describe());
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
  CKPT_RETURN_IF_ERROR(db->Write({}, deletes));
  return report;
}

Journal::Journal(BackingDir* dir, StateDb* db, JournalDelegate* delegate, JournalOptions options,
                 uint64_t next_seq, uint64_t next_id)
    : dir_(dir),
      db_(db),
      delegate_(delegate),
      options_(std::move(options)),
      temps_(db, options_.temp_prefix, next_id),
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
  Status st = db_->Put(Key(kEntryPrefix, entry.seq), entry.Serialize(), WriteMode::kUnsynced);
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
    return done_seq_ >= seq || done_ahead_.count(seq) > 0 || failures_.count(seq) > 0 ||
           releasing_;
  });
  auto it = failures_.find(seq);
  if (it != failures_.end()) return it->second;
  if (done_seq_ >= seq || done_ahead_.count(seq) > 0) return Status::Ok();
  return ReleasedLocked();
}

Status Journal::WaitUnlessHalted(uint64_t seq) {
  MutexLock lock(&mu_);
  const Queued* halt = nullptr;
  done_cv_.wait(lock.native(), [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    if (done_seq_ >= seq || done_ahead_.count(seq) > 0 || failures_.count(seq) > 0) return true;
    if (releasing_) return true;
    // A halt before it first: the early return below must not hide it.
    halt = nullptr;
    for (const Queued& q : queue_) {
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

bool Journal::WaitDoneFor(uint64_t seq, std::chrono::milliseconds max) {
  MutexLock lock(&mu_);
  return done_cv_.wait_for(lock.native(), max, [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    return done_seq_ >= seq || done_ahead_.count(seq) > 0 || failures_.count(seq) > 0 ||
           releasing_;
  }) && !(releasing_ && done_seq_ < seq && done_ahead_.count(seq) == 0 &&
          failures_.count(seq) == 0);
}

void Journal::Drain() {
  MutexLock lock(&mu_);
  done_cv_.wait(lock.native(), [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    return queue_.empty();
  });
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
  return dropped_publishes_;
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
        spdlog::warn("stop: publication waits: {}; what is queued is left for the next start "
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
    Status st = e.target ? e.target->Sync(dir_) : SyncPath(dir_, e.from);
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
      deletes.push_back(Key(kEntryPrefix, e.seq));
      continue;
    }
    puts.emplace_back(Key(kEntryPrefix, e.seq), e.Serialize());
    left_until = std::max(left_until, e.seq);
  }
  if (left_until > 0) {
    puts.emplace_back(kLeftKey, std::to_string(left_until));
    Status st = db_->Write(puts, deletes, WriteMode::kSynced);
    if (!st.ok()) {
      spdlog::error("stop: cannot record the entries left for the next start: {}",
                    st.ToString());
      cut = 0;
      cut_why = st;
      left_until = 0;
    }
  }
  // Records of an earlier hand-over are this one's now (or dropped below): their removal
  // must not take the new marker with it.
  resumed_until_.store(0, std::memory_order_release);

  std::vector<std::pair<JournalEntry, Status>> dropped;
  const Status behind(Code::kAborted,
                      cut < all.size() ? "not published: " + all[cut].e.Describe() +
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
    spdlog::warn("stop: {} journal entries left for the next start, their bytes durable "
                 "(first {}); publication waited for: {}",
                 report.left, all.front().e.Describe(), report.waiting_for);
  }
  if (cut < all.size()) {
    spdlog::error("stop: {} could not be made durable ({}); it and {} entries after it are "
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
    resumed_until_.store(left.back().seq, std::memory_order_release);
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

std::vector<std::string> Journal::Abort(const std::string& path) {
  std::vector<JournalEntry> dropped;
  {
    MutexLock lock(&mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      const JournalEntry& e = it->e;
      bool below = IsAtOrBelow(e.path, path) || (!e.from.empty() && IsAtOrBelow(e.from, path));
      if (!below || it->busy) {
        ++it;
        continue;
      }
      if (e.seq == gate_seq_) gate_seq_ = 0;
      dropped.push_back(std::move(it->e));
      it = queue_.erase(it);
    }
    gate_dirty_ = true;
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
      done_ahead_.insert(e.seq);
    }
    AdvanceDoneLocked();
  }
  done_cv_.notify_all();
  work_cv_.notify_all();
  return lines;
}

uint64_t Journal::pending() const {
  MutexLock lock(&mu_);
  return queue_.size();
}

uint64_t Journal::last_appended() const {
  MutexLock lock(&mu_);
  return next_seq_ - 1;
}

uint64_t Journal::applied() const {
  MutexLock lock(&mu_);
  return done_seq_;
}

JournalCounts Journal::counts() const {
  JournalCounts c;
  c.presyncs = presync_.done();
  MutexLock lock(&mu_);
  c.skipped = skipped_;
  c.superseded = superseded_;
  c.given_up = given_up_;
  c.applied_ahead = applied_ahead_;
  c.retries = retries_;
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
      queue_.erase(step.it);
      const Status why(Code::kAborted, "deleted through the mount before it was published");
      failures_[e.seq] = why;
      if (e.op == OpType::kPublish) ++dropped_publishes_;
      if (!at_head) done_ahead_.insert(e.seq);
      gate_dirty_ = true;
      AdvanceDoneLocked();
      ++finalizing_;
      lock.Unlock();
      spdlog::warn("journal: {} dropped: {}", e.Describe(), why.ToString());
      Finalize(e, why, /*applied=*/false);
      lock.Lock();
      --finalizing_;
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
    lock.Unlock();

    if (step.kind == Step::kGate) {
      // Data first: the gate reads this very file.
      Status st = e.op == OpType::kPublish && e.target ? e.target->Sync(dir_) : Status::Ok();
      CommitCheck check = st;
      if (st.ok() && delegate_ != nullptr) check = delegate_->CheckCommit(e, *this);
      lock.Lock();
      FindLocked(e.seq)->busy = false;
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

    Status st = Process(e, failed_before);
    if (st.ok()) {
      Finalize(e, st, /*applied=*/true);
      if (failed_before) {
        // Before the entry leaves the queue: whoever sees the halt gone (ckptfs-admin
        // resume, then wait) must not still see its checkpoint failed.
        spdlog::info("journal: {} applied after {} retries; publication resumes", e.Describe(),
                     counts().retries);
        if (delegate_ != nullptr) delegate_->OnHalt(e, Status::Ok());
      }
      lock.Lock();
      auto it = FindLocked(e.seq);
      queue_.erase(it);
      if (!at_head) {
        done_ahead_.insert(e.seq);
        ++applied_ahead_;
      }
      if (commit) gate_seq_ = 0, gate_ready_ = false;
      gate_dirty_ = true;
      failures_.erase(e.seq);
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
    lock.Unlock();
    if (st.code() == Code::kSuperseded) {
      spdlog::info("journal: {} superseded: {}", e.Describe(), st.message());
    } else if (st.code() == Code::kNodeLost) {
      spdlog::error("journal: {} given up: {}", e.Describe(), st.message());
    } else {
      spdlog::error("journal: {} skipped: {}", e.Describe(), st.ToString());
    }
    Finalize(e, st, /*applied=*/false);
    lock.Lock();
    --finalizing_;
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
    const Status behind(Code::kAborted, "not published: " + e.Describe() + " failed first");
    for (auto it = from; it != queue_.end(); ++it) {
      dropped.emplace_back(std::move(it->e), it->e.seq == e.seq ? st : behind);
    }
    queue_.erase(from, queue_.end());
    for (const auto& [d, why] : dropped) {
      failures_[d.seq] = why;
      if (d.op == OpType::kPublish) ++dropped_publishes_;
    }
    gate_seq_ = 0;
    AdvanceDoneLocked();
    ++finalizing_;  // Close() returns once their records are gone too
    lock.Unlock();
    spdlog::error("journal: {} failed at shutdown ({}); {} entries after it not applied",
                  e.Describe(), st.ToString(), dropped.size() - 1);
    for (const auto& [d, why] : dropped) Finalize(d, why, /*applied=*/false);
    lock.Lock();
    --finalizing_;
    lock.Unlock();
    done_cv_.notify_all();
    return;
  }
  auto it = FindLocked(e.seq);
  it->busy = false;
  if (it->drop) {
    work_cv_.notify_all();  // deleted through the mount meanwhile: the publisher drops it
    return;
  }
  const bool first = it->error.ok();
  it->error = st;
  ++it->attempts;
  if (first) it->failed_since = UnixNow();
  auto delay = IsTransient(st) ? std::min<std::chrono::milliseconds>(
                                     kRetryMax, kRetryMin * (1LL << std::min<uint64_t>(it->attempts - 1, 16)))
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

Status Journal::Process(const JournalEntry& e, bool retry) {
  auto apply = [&] {
    bool renamed = false;
    Status st = ApplyEntry(dir_, e, &renamed, retry);
    if (renamed) temps_.Move(e.from, e.path);  // temps below a renamed directory
    return st;
  };
  if (e.op == OpType::kPublish && e.target) CKPT_RETURN_IF_ERROR(e.target->Sync(dir_));
  if (e.target || !Resumed(e.seq)) return apply();
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
    Status st = SyncPath(dir_, e.from);
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
  std::vector<std::string> deletes{Key(kEntryPrefix, e.seq)};
  if (e.op == OpType::kPublish || e.op == OpType::kDiscard) {
    deletes.push_back(TempRecords::Key(e.file_id));
  }
  // An entry the previous run left: its record is removed synced, so that a crash now
  // never resumes it twice; the marker goes with the last one.
  const bool resumed = Resumed(e.seq);
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
  if (e.op == OpType::kPublish || e.op == OpType::kDiscard) temps_.Drop(e.file_id);
  if (delegate_ != nullptr) delegate_->OnDone(e, st);
}

}  // namespace ckptfs::store
