// Journal: the ordered list of publish and namespace operations, applied to the
// backing store in order by one publisher thread (G4, G5).
//
// An entry is applied only after every earlier entry has been applied and, for a
// publish, after its file's bytes are durable (flushed and fsynced). Then the temp file
// is renamed onto its real name.
//
// Commits. An entry that makes a `.metadata` appear asks the commit gate whether the
// shards it names are durable. While it waits, the queued publishes of those shards (and
// only those, and only where no skipped entry touches their names) are applied ahead of
// it: they commit nothing until the `.metadata` lands. Every other later entry keeps its
// place behind it (G4). So any file order commits as soon as the last shard is durable.
//
// Failures halt (G7). A publish or commit that fails stays at its place and nothing after
// it is applied: the backing store stays at the last state the application passed
// through. Transient failures (IsTransient) are retried with backoff, the staged bytes
// kept; permanent ones wait for Resume() or Abort(). Wait() on a failed entry returns its
// failure at once. A namespace entry (mkdir, rename, chmod...) that fails permanently,
// which happens only when someone else changed the backing store under the mount, is
// skipped and logged as before: it carries no data and the mount already shows its
// outcome. Close(final) gives up on a halted journal: the failed entry and everything
// after it are dropped, never applied, and counted.
//
// Bounded stop (G10, G11). CloseWithin() waits while publication progresses; once it is
// halted, or a commit waits at the gate, with no progress for the bound, it hands the rest
// over to the next start instead of dropping it: every queued entry's bytes are fsynced in
// their temp file, and the entries, with a "left for resume" marker, are written synced.
// Recover() of the next start sees the marker and returns those entries (RecoveryReport::
// resumed) instead of discarding them; QueueLeft() queues them again, in order, and they
// are published as any entry (a publish fsyncs its temp file by path: no FlushTarget is
// left). Without the marker (a crash) recovery discards, as above.
//
// Entries and temp-file records are kept in RocksDB, so a restarted daemon knows which
// temp files were never published and removes them (Recover()), unless a bounded stop
// left them for it (above). Only the temp records
// guard anything (a temp file that a crash leaves behind), so only they are written
// synced, before the temp file is created; entry records and the removal of finished
// records are written unsynced (see Append and Finalize for why recovery allows that).
//
// Early syncs. A publish is applied only after its file is fsynced, by the one publisher
// thread, in journal order. So that fsyncs of many files do not run one after another,
// `presync_threads` threads fsync each publish's file as soon as the entry is appended
// (the file is complete and frozen then); the publisher's own fsync, which is what the
// guarantee rests on, then finds little or nothing left to write.
//
// Thread-safe. The destructor drains pending entries and joins the publisher.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/flush/flush_pipeline.h"
#include "store/primitives/backing_dir.h"
#include "store/primitives/state_db.h"
#include "store/publish/deletion_hold.h"
#include "store/publish/early_sync.h"
#include "store/publish/journal_entry.h"
#include "store/publish/journal_trace.h"
#include "store/publish/replaced_files.h"
#include "store/publish/temp_records.h"

namespace ckptfs::store {

// What a commit gate says about an entry that makes a `.metadata` appear. Implicitly made
// from a Status: ok means ready, anything else refuses the commit.
struct CommitCheck {
  CommitCheck() = default;
  CommitCheck(Status s) : status(std::move(s)) {}  // NOLINT: implicit on purpose
  static CommitCheck Wait(std::vector<std::string> shards, std::chrono::milliseconds recheck) {
    CommitCheck c;
    c.ready = false;
    c.shards = std::move(shards);
    c.recheck = recheck;
    return c;
  }
  Status status;                       // not ok: the commit is refused (the journal halts)
  bool ready = true;                   // false: not yet; ask again
  std::vector<std::string> shards;     // paths whose queued publishes may go ahead of it
  std::chrono::milliseconds recheck{0};  // when not ready: ask again after this at the latest
  // Not ready because of shards not queued here (nobody has written them yet, or another
  // node writes them) or still open for writing here: a synchronous caller must not wait
  // for this commit, it may be the one to write or close them (G10).
  bool waits_for_unwritten = false;
  // A deletion of a committed checkpoint behind a given-up one (DeletionHold): it waits
  // out of line, later entries go past it, and its synchronous caller returns now.
  bool hold = false;
  // With `hold`: the directory beside the held checkpoint holds a file that may be a
  // tracker on the backing store now. The hold then waits for a tracker applied there after
  // the next commit even when the journal has seen none there yet (after a restart).
  bool tracker_beside = false;
  static CommitCheck Hold() {
    CommitCheck c;
    c.ready = false;
    c.hold = true;
    return c;
  }
};

// The entry a halted journal stopped at.
struct HaltInfo {
  uint64_t seq = 0;
  std::string what;    // Describe() of the entry
  std::string path;
  Status error;
  uint64_t attempts = 0;
  bool transient = false;  // retried by itself
  double since = 0;        // unix time of the first failure
};

struct RecoveryReport {
  uint64_t entries_discarded = 0;
  uint64_t temps_removed = 0;
  // Publish targets whose bytes died with the last run (their temp file was still there);
  // recorded for LostPublishes in the same write as the discarding.
  std::vector<std::string> lost_paths;
  // Directories whose rewrite died with the last run: what it replaced was put back, and
  // each is its earlier save again (ReplacedFiles::RecoverKept).
  std::vector<std::string> restored;
  // What a bounded stop of the previous run left for this one (CloseWithin), in order:
  // hand them to QueueLeft(). Their records, temp files and the marker stay until each
  // is done.
  std::vector<JournalEntry> resumed;
  // The entries a crash of the previous run left, dropped (for the journal trace).
  std::vector<JournalEntry> discarded;
};

// What a bounded stop (CloseWithin) did.
struct StopReport {
  uint64_t dropped_publishes = 0;  // as Close(): never applied, their bytes gone
  uint64_t left = 0;               // entries handed over to the next start
  std::string waiting_for;         // what publication waited for when the bound ran out
};

// Where a directory's life ends in the queue (QueuedPublishes::DirectoryEndsAfter).
struct DirectoryEnd {
  uint64_t seq = 0;      // the entry; 0: the directory lives on past every queued entry
  bool removed = false;  // an rmdir (or a rename replacing it), not a move of it
};

// What the journal's queue holds (the commit gate's questions; the Journal answers them).
class QueuedPublishes {
 public:
  virtual bool PublishQueued(const std::string& path) const = 0;
  // The first entry queued after `seq` that removes or moves `dir` or a directory above it
  // (an rmdir, a rename from or onto it). From there on, a name below `dir` belongs to
  // another incarnation of the directory (one the application made again, or the one it
  // moved away): a commit in `dir` appended at `seq` never judges, waits for or is
  // superseded by what happens past it. A root (`dir` empty) never ends.
  virtual DirectoryEnd DirectoryEndsAfter(uint64_t seq, const std::string& dir) const = 0;
  // A publish of `path` queued before entry `before` whose writes began before entry `seq`
  // was appended: a version the commit appended at `seq` names.
  virtual bool VersionQueued(const std::string& path, uint64_t seq, uint64_t before) const = 0;

 protected:
  ~QueuedPublishes() = default;
};

// The journal's owner (Publication): asked about commits and told every outcome, on the
// publisher thread.
class JournalDelegate {
 public:
  // Before an entry that makes a name `.metadata` appear (or a Gated() one), after the
  // entry's own bytes are durable, and again until it is ready or refuses. `queued` tells
  // whether a publish of a path is still queued in this journal. It must not block for
  // long: it says when to ask again instead.
  virtual CommitCheck CheckCommit(const JournalEntry& e, const QueuedPublishes& queued) = 0;
  // Entries other than a `.metadata` that CheckCommit is asked about too, before they are
  // applied (a tracker or a delete that must wait for a checkpoint another node commits).
  // Called under the journal's lock: it must look at the entry only.
  virtual bool Gated(const JournalEntry& e) = 0;
  // After each entry is applied, skipped or dropped (aborted: Code::kAborted).
  virtual void OnDone(const JournalEntry& e, const Status& st) = 0;
  // When an entry fails and the journal halts at it (each attempt), and with an ok status
  // when a halted entry finally passes.
  virtual void OnHalt(const JournalEntry& e, const Status& st) = 0;

 protected:
  ~JournalDelegate() = default;
};

// Journal::Abort()'s question about a save whose queued files it drops (Publication's
// AbortedRewrites answers it).
class AbortWithdrawals {
 public:
  // The queued files of a save into `dir` are dropped (its commit not in flight), and
  // nothing it replaced there is kept (ReplacedFiles): true if something of that save may
  // be on the backing store in `dir` already (`in_place`: a dropped entry's failed attempt
  // left its name there), so that a `.metadata` of an earlier save there no longer
  // describes the directory and is withdrawn. Called under the journal's lock: it must
  // not call the journal.
  virtual bool WithdrawOnAbort(const std::string& dir, bool in_place) = 0;

 protected:
  ~AbortWithdrawals() = default;
};

struct JournalOptions {
  // false (strict mode, where every failure is returned to the operation that caused
  // it): a failed entry is skipped and dropped, never halts; nothing waits for an
  // operator.
  bool halt_on_failure = true;
  // Threads that fsync published files ahead of the publisher (0: none).
  int presync_threads = 4;
  // Other nodes write into the same directories (--peers): putting back what an aborted
  // rewrite replaced here cannot make a directory whole (Abort), so its `.metadata` is
  // withdrawn after that too.
  bool shared_dirs = false;
  // The owner names the temp file of file `id` "<temp_prefix><id>" (TempRecords), if it
  // can say in advance (empty: it cannot). Then TempRecords::NextId() writes the records of
  // the next ids ahead, several in one synced write, and Register() of such a path
  // writes nothing.
  std::string temp_prefix;
  // Deletions held behind a given-up checkpoint until a later one commits (may be null:
  // none is ever held). Borrowed; the delegate's CheckCommit says which (CommitCheck::hold).
  const DeletionHold* hold = nullptr;
  // How long held deletions wait, after a later commit, for its tracker when nothing else
  // comes (a loop without trackers, or the last save of a run).
  std::chrono::milliseconds held_grace{std::chrono::seconds(30)};
  // A line per entry done and at the start (store/publish/journal_trace.h); null: none.
  // Borrowed: must outlive the journal.
  const JournalTrace* trace = nullptr;
};

// What the journal holds and has done (Journal::counts(), /.ckptfs/stats).
struct JournalCounts {
  uint64_t pending = 0;        // entries queued, or dropped and not yet settled
  uint64_t last_appended = 0;  // the sequence number of the last entry appended
  uint64_t applied = 0;        // every entry with a sequence number up to this one is done
  uint64_t skipped = 0;        // entries skipped or dropped, never applied (not superseded)
  uint64_t superseded = 0;     // commits a later save replaced (not a failure)
  uint64_t given_up = 0;       // of `skipped`: commits and trackers given up for a lost node
  uint64_t applied_ahead = 0;  // publishes applied ahead of a waiting commit
  uint64_t retries = 0;        // attempts at a halted entry
  uint64_t presyncs = 0;       // early syncs that succeeded (EarlySyncs)
  uint64_t room_waits = 0;     // WaitForRoom() calls that found the queue full and waited
  uint64_t room_wait_ms = 0;   // their time, in all
  uint64_t held = 0;           // deletions held behind a given-up checkpoint now
  uint64_t held_total = 0;     // deletions ever held (DeletionHold)
  uint64_t held_dropped = 0;   // of those, dropped by a stop: their files stay
};

class Journal final : public QueuedPublishes {
 public:
  // Removes the temp files of a previous run that were never published and clears its
  // pending entries, except those a bounded stop left for this run (the marker): those are
  // returned in `resumed`. Call before Create() on the same StateDb.
  static Result<RecoveryReport> Recover(BackingDir* dir, StateDb* db);

  // `delegate` may be null (every commit is ready, nothing is told), else must outlive it.
  static Result<std::unique_ptr<Journal>> Create(BackingDir* dir,  // must outlive
                                                 StateDb* db,      // must outlive
                                                 JournalDelegate* delegate,
                                                 JournalOptions options = {});
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // The records of the owner's temp files (file ids, Register before a temp is created,
  // Forget): a crash cannot leak one. A record written ahead for an id that is never used
  // costs recovery one unlink that finds nothing.
  TempRecords* temps() { return &temps_; }

  // Persists (unsynced) and queues `entry`; returns its sequence number. A publish's
  // file is handed to the early-sync threads.
  Result<uint64_t> Append(JournalEntry entry);
  // Blocks until entry `seq` is applied or skipped, or has failed; returns its outcome.
  Status Wait(uint64_t seq);
  // As Wait(), but also returns (with that failure) as soon as the journal is halted at
  // an earlier entry: a synchronous caller (strict mode) gets the error instead of waiting
  // for an operator. Its entry stays queued. And it returns ok for a commit that is
  // durable and next in line but waits for shards nobody has written yet or that are still
  // open here (CommitCheck::waits_for_unwritten), and for entries queued behind such a
  // commit: whoever closes a `.metadata` first may be the one to write or close the shards
  // (a copy in sorted order); the commit follows the last shard, and the entries behind it
  // follow the commit, in order. A halt before the entry is reported even then. Returns
  // kAborted at once after ReleaseWaiters() (a stop).
  // A mkdir waited for is applied first, on the waiter's thread, ahead of the entries
  // queued before it, where none of them touches its name or a directory above it and it
  // was never tried (MkdirAhead): another node can see the directory at once, instead of
  // after this node's backlog of publishes (a new empty directory appears early, as a
  // waiting commit's shards do; it names no checkpoint).
  Status WaitUnlessHalted(uint64_t seq);
  // Waits up to `max` for entry `seq` to be done (applied, skipped or failed); returns
  // whether it is. For a caller that WaitUnlessHalted() let go early (a commit waiting for
  // shards nobody has written) and that must still see the entry done: it polls without
  // spinning. With `max` 0: whether it is done now (ahead of its turn too).
  bool WaitDoneFor(uint64_t seq, std::chrono::milliseconds max) const;
  // Backpressure for async writers: blocks while `limit` or more entries are queued, up to
  // `max`. It returns at once when the journal is halted (the backlog is reported, and the
  // operator resumes or aborts), when a commit waits for shards not written yet (the caller
  // may be the one to write them) and after ReleaseWaiters(): no wait depends on the waiter.
  void WaitForRoom(size_t limit, std::chrono::milliseconds max) EXCLUDES(mu_);
  // A stop has begun: every Wait(), WaitUnlessHalted() and WaitDoneFor() of an entry not
  // yet done returns now, and from now on, with kAborted "ckptfs is stopping; publication
  // waits: ..." (the entries stay queued; the stop publishes or leaves them). Publication
  // goes on.
  void ReleaseWaiters() EXCLUDES(mu_);
  bool releasing() const EXCLUDES(mu_);
  // Blocks until every appended entry is done.
  void Drain();
  // Final drain (shutdown): waits for every entry; a halted entry gets one more attempt,
  // then it and every entry after it are dropped. Returns the publishes dropped.
  uint64_t Close();
  // Final drain with a bound (a daemon's stop): waits while publication progresses, a
  // halted entry getting one more attempt at once. When it is halted, or a commit waits at
  // the gate, with no progress for `stall`, it stops the publisher and hands every queued
  // entry over to the next start (see the top of this file); from the first entry whose
  // bytes cannot be made durable (still only in staging, or lost) on, entries are dropped
  // as Close() drops them. `waiting` (may be empty) gets what publication waits for, each
  // time that changes. After it, the journal is empty; the destructor does nothing more.
  StopReport CloseWithin(std::chrono::milliseconds stall,
                         const std::function<void(const std::string&)>& waiting = {});
  // Queues the entries Recover() returned in `resumed`, before anything else is appended,
  // with their own sequence numbers; they are applied in order, before every later entry.
  void QueueLeft(std::vector<JournalEntry> left);
  // Waits until the entries of QueueLeft() are done, or publication halts, or nothing is
  // done for `stall`. True if they are all done.
  bool WaitLeft(std::chrono::milliseconds stall);
  // What publication waits for now: the halted entry and its error, or a commit waiting
  // at the gate and the shards it waits for, with how many entries are queued behind;
  // empty when it is not waiting on either.
  std::string WaitingFor() const;

  // Retries a halted entry (and parked flush chunks, via the caller) now.
  void Resume();
  // Asks the commit gate again now: it learned something (a peer's answer).
  void RecheckGate() EXCLUDES(mu_) {
    { MutexLock lock(&mu_); gate_dirty_ = true; } work_cv_.notify_all(); }
  // Drops every queued entry at or below `path` (a checkpoint directory or a file) that
  // has not been applied: their temp files are removed and nothing of them reaches the
  // backing store. An entry being applied at that moment is not dropped. Where a dropped
  // save replaced files of a committed directory (ReplacedFiles), or a file of it is being
  // published at that moment (it may replace one yet), a restore entry takes the place of
  // one of its entries and puts them back (JournalEntry::restore). Else,
  // where `withdraw` (may be empty: never) says that part of a dropped save may already
  // be in its directory, the save's commit names (`.metadata` if none was queued) are
  // withdrawn in its place, in order: unlinked, the directory synced (JournalEntry::
  // withdraw). Returns what was dropped, one Describe() line each. `untouched` (may be
  // null) gets the directories of dropped saves that `withdraw` found untouched.
  std::vector<std::string> Abort(const std::string& path,
                                 AbortWithdrawals* withdraw = nullptr,  // borrowed, may be null
                                 std::vector<std::string>* untouched = nullptr);
  // The application deleted `path`, a name in the directory of the entry publication is
  // halted at (a failed checkpoint it removes), through the mount while publication is
  // halted before its pending publish (or rename onto it): that entry is dropped instead
  // of waiting for the halt (a rename becomes the removal of its source, which the
  // application's view no longer has either). Returns whether an entry was marked. Nothing
  // of the entries before the halt changes, so the backing store still passes only through
  // states the application passed through, less a file it deleted; a name elsewhere keeps
  // its place (dropped, a tracker queued before its deletion could name a checkpoint that
  // never commits).
  bool DropIfHalted(const std::string& path);
  // The entry the journal is halted at, if any.
  std::optional<HaltInfo> halted() const;
  // A publish of `path` is queued and not yet done.
  bool PublishQueued(const std::string& path) const override EXCLUDES(mu_);
  DirectoryEnd DirectoryEndsAfter(uint64_t seq, const std::string& dir) const override
      EXCLUDES(mu_);
  bool VersionQueued(const std::string& path, uint64_t seq, uint64_t before) const override
      EXCLUDES(mu_);

  // What the journal holds and has done, in one look.
  JournalCounts counts() const EXCLUDES(mu_);

 private:
  Journal(BackingDir* dir, StateDb* db, JournalDelegate* delegate, JournalOptions options,
          uint64_t next_seq, uint64_t next_id);
  struct Queued {
    JournalEntry e;
    bool busy = false;  // being processed (the publisher, or a mkdir's waiter)
    Status error;              // the last failure while the journal is halted at it
    uint64_t attempts = 0;
    double failed_since = 0;
    std::chrono::steady_clock::time_point retry_at{};
    bool drop = false;  // DropIfHalted(): to be dropped by the publisher
    // A deletion held behind a given-up checkpoint (CommitCheck::hold), out of line; the
    // held entries are always the queue's first ones. `held_at`: DeletionHold::commits()
    // when it was held.
    bool held = false;
    uint64_t held_at = 0;
    std::chrono::steady_clock::time_point commit_seen{};  // a later commit, first seen idle
  };
  // What the publisher does next.
  struct Step {
    enum Kind { kIdle, kWait, kProcess, kGate, kDrop, kExit } kind = kIdle;
    std::deque<Queued>::iterator it;
    std::chrono::steady_clock::time_point until{};
  };
  Step NextStepLocked() REQUIRES(mu_);
  std::deque<Queued>::iterator FindLocked(uint64_t seq) REQUIRES(mu_);  // must exist
  void Run();
  // A failed entry: halts the journal at it (publishes, commits, transient failures),
  // or skips it (namespace entries refused for good), or, when closing, drops it and
  // everything after it.
  void HaltOrSkip(const JournalEntry& e, const Status& st, bool commit, bool at_head);
  // A later entry makes the same `.metadata` appear as `commit` (a later save into the
  // same directory), before anything removes or moves that directory.
  bool SupersededLocked(const JournalEntry& commit) const REQUIRES(mu_);
  DirectoryEnd DirectoryEndsAfterLocked(uint64_t seq, const std::string& dir) const
      REQUIRES(mu_);
  // A commit decided without being applied (superseded, or its directory removed later):
  // the source of its rename goes as the application's rename took it away, so that
  // nothing of it stays on the backing store and the entries after it (an rmdir of the
  // directory) apply as the application made them.
  void RemoveSkippedCommit(const JournalEntry& e);
  // WaitUnlessHalted() of a mkdir: applies it now if nothing queued before it touches its
  // name or a directory above it; else (or if that fails) it keeps its place in line.
  void MkdirAhead(uint64_t seq) EXCLUDES(mu_);
  // Syncs the data (publish) and applies one entry; false with `st` on failure. `retry`:
  // an earlier attempt of this entry failed (ApplyEntry). `tried` is set once it changes
  // (or tries to change) the backing store's names; `kept` when a publish kept the file
  // it replaced (ApplyEntry's keep_replaced). A restore entry (JournalEntry::restore)
  // puts back what its directory's rewrite replaced (ReplacedFiles::PutBack).
  Status Process(const JournalEntry& e, bool retry, bool* tried, bool* kept);
  std::string WaitingForLocked() const REQUIRES(mu_);
  // Removes the entry's records (and, if not applied, its temp file) and runs on_done.
  void Finalize(const JournalEntry& e, const Status& st, bool applied);
  void AdvanceDoneLocked() REQUIRES(mu_);

  // Written (synced) by a bounded stop that left entries for the next start: the highest
  // sequence number it left. Entry records up to it are resumed, not discarded.
  static constexpr char kLeftKey[] = "m/left";

  BackingDir* const dir_;
  StateDb* const db_;
  JournalDelegate* const delegate_;
  const JournalOptions options_;
  TempRecords temps_;
  // What rewrites of committed directories replaced, until each commits, is aborted (then
  // it is put back), its directory goes, or the journal stops. Its own lock, a leaf.
  ReplacedFiles replaced_;
  EarlySyncs presync_;

  mutable Mutex mu_;
  std::condition_variable work_cv_;
  mutable std::condition_variable done_cv_;  // WaitDoneFor() is const
  std::deque<Queued> queue_ GUARDED_BY(mu_);  // not yet done, in order
  uint64_t next_seq_ GUARDED_BY(mu_);
  uint64_t done_seq_ GUARDED_BY(mu_);  // every seq <= this is done
  std::set<uint64_t> done_ahead_ GUARDED_BY(mu_);  // done seqs > done_seq_
  // The commit at the head of the queue that waits for its shards, and when to ask the
  // gate again.
  uint64_t gate_seq_ GUARDED_BY(mu_) = 0;
  bool gate_ready_ GUARDED_BY(mu_) = false;
  bool gate_unwritten_ GUARDED_BY(mu_) = false;
  std::unordered_set<std::string> gate_shard_set_ GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point gate_recheck_ GUARDED_BY(mu_) = {};
  bool gate_dirty_ GUARDED_BY(mu_) = true;  // something changed since the gate last said wait
  // The commit the gate is asked about now (busy, not applied): Abort() waits for the
  // answer, which would else keep that commit queued as if it were being applied.
  uint64_t gate_asking_ GUARDED_BY(mu_) = 0;
  bool closing_ GUARDED_BY(mu_) = false;
  bool releasing_ GUARDED_BY(mu_) = false;  // ReleaseWaiters(): waits return at once
  Status ReleasedLocked() const REQUIRES(mu_);  // Close(): give up on a halted entry
  uint64_t dropped_publishes_ GUARDED_BY(mu_) = 0;
  uint64_t applied_ahead_ GUARDED_BY(mu_) = 0;
  uint64_t retries_ GUARDED_BY(mu_) = 0;
  uint64_t room_waits_ GUARDED_BY(mu_) = 0;
  uint64_t room_wait_ms_ GUARDED_BY(mu_) = 0;
  std::map<uint64_t, Status> failures_ GUARDED_BY(mu_);  // outcomes of skipped entries
  uint64_t skipped_ GUARDED_BY(mu_) = 0;
  uint64_t superseded_ GUARDED_BY(mu_) = 0;
  uint64_t given_up_ GUARDED_BY(mu_) = 0;
  // By directory: DeletionHold::commits() when a tracker (IsTrackerCandidate) there was
  // last applied. A tracker names checkpoints beside it (TrackerNames): a held deletion of
  // a checkpoint goes after a tracker of its own directory, not after a log file's rename
  // elsewhere. Bounded (kTrackerDirs): trackers live in a few directories. Empty at start:
  // a hold whose CommitCheck says a tracker is on the backing store beside it
  // (tracker_beside, after a restart) records 0 there, so the tracker rule applies.
  std::map<std::string, uint64_t> tracker_commits_ GUARDED_BY(mu_);
  uint64_t held_total_ GUARDED_BY(mu_) = 0;
  uint64_t held_dropped_ GUARDED_BY(mu_) = 0;
  // Entries taken off queue_ whose Finalize() (records, delegate) has not returned yet.
  uint64_t finalizing_ GUARDED_BY(mu_) = 0;
  // Of those, the ones failed or dropped: their outcome is recorded (failures_, the done
  // mark) before Finalize runs, but a waiter for one of them (Wait, WaitUnlessHalted,
  // WaitDoneFor) returns only after it, so that the delegate's OnDone (the file's failed
  // state) is in place when the strict close that waited returns its error.
  std::set<uint64_t> unsettled_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  // CloseWithin() gave up: the publisher exits at its next step and leaves the queue.
  bool leaving_ GUARDED_BY(mu_) = false;
  bool publisher_exited_ GUARDED_BY(mu_) = false;
  // Entries left by the previous run (QueueLeft): every seq up to `resumed_.until`, of
  // which resumed_left_ are not done yet (the marker goes with the last).
  struct LeftMark {
    std::atomic<uint64_t> until{0};
    // An entry a bounded stop of the previous run left for this one.
    bool Covers(uint64_t seq) const { return seq <= until.load(std::memory_order_acquire); }
  };
  LeftMark resumed_;
  uint64_t resumed_left_ GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace ckptfs::store
