// Publication: one owner for a file's life on the backing store, from the journal entry
// that queues it to its outcome (G4, G5, G7, G10, G11).
//
// It owns the journal (journal.h: order, apply, halt, bounded stop), the commit gate
// (commit_gate.h: when a `.metadata` may appear), what this mount knows of its shards for
// peers (shard_state.h) and the checkpoint registry (checkpoints.h), and it is the only
// place that wires them together. Applying an entry stays here from append to outcome:
//   Append(entry)            the registry notes what the entry queues (a file of a
//                            checkpoint, its commit, a rename or removal of a directory);
//   journal publisher        fsync, gate, rename/unlink/... (journal.cc, commit_gate.cc);
//   OnDone (publisher)       file times of a publish, the registry's outcome, the key
//                            index (renames, removals, a published file's block CRCs),
//                            the gate's cross-node notes, then the observer, then the
//                            shard states.
// The mount (fs/) sees a narrow interface: it appends entries and asks what is applied;
// it answers the gate's questions and is told outcomes through one observer
// (PublicationObserver), which it implements. Nothing here calls into fs/ otherwise.
//
// Thread-safe. Create(), then Start() with the observer before anything is appended.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/dcp/key_index.h"
#include "store/primitives/backing_dir.h"
#include "store/primitives/state_db.h"
#include "store/publish/aborted_rewrites.h"
#include "store/publish/checkpoints.h"
#include "store/publish/commit_gate.h"
#include "store/publish/deletion_hold.h"
#include "store/publish/journal.h"
#include "store/publish/journal_trace.h"
#include "store/publish/lost_publishes.h"
#include "store/publish/publication_view.h"
#include "store/publish/shard_state.h"
#include "store/publish/withheld_trackers.h"

namespace ckptfs::store {

// The mount's side of publication: what it knows of files written through it, and what it
// is told happened. Implemented by fs/ (the write states); held here, borrowed.
// The questions run on the publisher thread and on a peer's query thread: in memory only,
// brief, and they never call back into Publication. Paths are relative to the backing root.
class PublicationObserver {
 public:
  virtual ~PublicationObserver() = default;
  // Written locally: `path` is open for writing through this mount and its publish is not
  // queued yet.
  virtual bool WrittenLocally(const std::string& path) = 0;
  // A version of `path` is being written or published here whose writes began after
  // journal entry `seq` (a commit) was appended.
  virtual bool RewrittenSince(const std::string& path, uint64_t seq) = 0;
  // Pending locally: open for writing here, or its publish queued and its outcome not yet
  // told (OnOutcome).
  virtual bool PendingLocally(const std::string& path) = 0;
  // No-collectives DCP: another rank's `__{rank}.metadata` of `path`'s directory (or its
  // `.tmp`) is being written here or renamed by an entry after `seq`.
  virtual bool RankCommitPending(const std::string& path, uint64_t seq) = 0;
  // Outcome: entry `e` was applied, skipped or dropped (st), after the store side is done
  // (registry, key index, file times) and before the shard states hear of it.
  virtual void OnOutcome(const JournalEntry& e, const Status& st) = 0;
  // Halted: publication stopped at `e` with `st` (each attempt), or passed it (ok). The
  // registry has been told already.
  virtual void OnHalted(const JournalEntry& e, const Status& st) = 0;
  // Checkpoint `dir`, which this mount wrote into, is gone from the backing store (removed
  // through another node, or by hand) and nothing is pending here: the mount's view may
  // let it go (ForgetVanishedCheckpoints).
  virtual void OnRemovedElsewhere(const std::string& dir) = 0;
  // A save of checkpoint `dir` committed (applied here, or its `.metadata` seen published
  // by another node): files in it other nodes wrote may be new versions.
  // `seq`: the commit's entry, applied but reported only now (0: another node's).
  virtual void OnCommitSeen(const std::string& dir, uint64_t seq) = 0;
};

// Told every entry's outcome after the publish's file times are set (so that it can key
// blocks by the published mtime) and before the shard states hear of it. Implemented by
// the retained memory tier (store/cache/retained_tier.h; issue 23); runs on the publisher
// thread.
class JournalOutcomeListener {
 public:
  virtual ~JournalOutcomeListener() = default;
  virtual void OnJournalDone(const JournalEntry& e, const Status& st) = 0;
};

struct PublicationOptions {
  // The commit gate's timeout and peer timings; its questions about local files are
  // answered by the observer.
  CommitGateOptions gate;
  // Asks the other daemons about shards written through their mounts (store::peer::Peers;
  // docs/PEERS.md, "Commit query"). Optional; must outlive the Publication.
  PeerShardAsker* peers = nullptr;
  // Other nodes write into the same backing dir (peers): entries that must follow a
  // checkpoint another node commits wait at the gate, and the gate notes applied shards.
  bool cross_node_order = false;
  // false (strict mode): a failed entry is skipped, never halts (JournalOptions).
  bool halt_on_failure = true;
  // Temp files are "<temp_prefix><id>" at the backing root (TempName).
  std::string temp_prefix = ".ckptfs-tmp.";
  // The retained memory tier (store/cache/retained_tier.h; issue 23): told every outcome.
  // Optional; must outlive the Publication.
  JournalOutcomeListener* retained = nullptr;
  // Where the key index of each checkpoint an entry commits (its commit file landed; for
  // per-rank metadata, the last rank's) is built, in the background: the loader
  // (store/load/loader.h). Optional (no builds at commit: the index is built lazily on
  // first use); must outlive the journal's last outcome.
  KeyIndexBuilds* index_builds = nullptr;
  // Entries that may be queued before AwaitBacklogRoom() waits (0: no bound).
  size_t max_pending = 0;
  // A file to append the journal's trace to (store/publish/journal_trace.h); empty: none.
  std::string journal_trace;
};

class Publication final : private JournalDelegate,
                          private CommitGateHost,
                          private LocalShardQuestions {
 public:
  // Recovers what the last run left (Journal::Recover), loads the registry and makes the
  // parts. `dir`, `db` and `index` must outlive it.
  static Result<std::unique_ptr<Publication>> Create(BackingDir* dir, StateDb* db,
                                                     KeyIndex* index,
                                                     PublicationOptions options);
  ~Publication();  // the journal drains and joins (Journal's destructor)
  Publication(const Publication&) = delete;
  Publication& operator=(const Publication&) = delete;

  // Sets the observer (must outlive every entry's outcome) and queues the entries a
  // bounded stop of the last run left, giving them a moment (2 s) before the mount serves.
  void Start(PublicationObserver* observer);

  // ------------------------------------------------------------ the mount's interface
  // Persists (unsynced) and queues `entry`; the registry notes what it queues.
  Result<uint64_t> Append(JournalEntry entry);
  uint64_t NextFileId() { return journal_->temps()->NextId(); }
  std::string TempName(uint64_t id) const;
  // TempRecords::Register / Forget: a synced write (Register) unless written ahead.
  Status RegisterTemp(uint64_t id, const std::string& temp_path) {
    return journal_->temps()->Register(id, temp_path);
  }
  Status ForgetTemp(uint64_t id) { return journal_->temps()->Forget(id); }
  // File `name` in directory `dir` began a new version through the mount (created, or
  // written again in place): its checkpoint, if it is one, is being written, and a delete
  // while halted (DropIfHalted) no longer refuses a `.metadata` that names it.
  void NoteWriteBegun(const std::string& dir, const std::string& name) EXCLUDES(dropped_mu_);
  // The application deleted `path` while publication is halted before its pending publish
  // (Journal::DropIfHalted); a `.metadata` naming it is then refused at once.
  bool DropIfHalted(const std::string& path) EXCLUDES(dropped_mu_);
  Status WaitUnlessHalted(uint64_t seq) { return journal_->WaitUnlessHalted(seq); }
  // Async backpressure before a new file version: waits (up to a minute) while
  // `max_pending` entries are queued, unless publication is halted (Journal::WaitForRoom).
  void AwaitBacklogRoom() { journal_->WaitForRoom(options_.max_pending, std::chrono::minutes(1)); }
  // One slice of waiting for entry `seq`: an error only when publication is halted before
  // it or the daemon stops; ok otherwise, when it is done or after a short while (a commit
  // before it waits for shards nobody has written yet). The caller checks and calls again.
  Status AwaitApplied(uint64_t seq);

  // ------------------------------------------------------------ what the backing store shows
  // The registry kept true to the backing store beyond this mount's entries (the control
  // tree calls these before it reports). Finished checkpoints whose directory (or, for
  // those known only from the key index, whose checkpoint files) is gone from the backing
  // store, removed by someone else, are forgotten, record and key index: a record unless
  // an entry queued here removes or moves its directory (the backing store lags the
  // mount), an index-only one only with nothing pending. `in_flight`: entries done but not
  // yet counted as applied (1 from the publisher's own sweep, AfterEntry).
  void ForgetVanishedCheckpoints(uint64_t in_flight = 0);
  // With cross-node order (peers): checkpoints this node wrote shards of, all published,
  // whose `.metadata` another node has since published (CommittedElsewhere) become
  // committed here too.
  void NoteForeignCommits();
  // Whether another node published the `.metadata` of `dir` after `since`
  // (CommittedElsewhere); if so, and the registry knows the checkpoint (`since` != 0), its
  // record says committed from now on.
  // `since` in seconds with its fraction: a whole second would let the previous save's
  // `.metadata`, published in the same second, commit the next one.
  bool NoteCommittedElsewhere(const std::string& dir, double since);

  // ------------------------------------------------------------ operator, reports, stop
  void Resume() { journal_->Resume(); }
  // Drops every queued entry at or below `path` and marks its checkpoints aborted. A save
  // of which something already reached its directory (a rewrite over an earlier save) has
  // that earlier save's `.metadata` withdrawn from the backing store (Journal::Abort).
  std::vector<std::string> Abort(const std::string& path);
  // What the mount may read: journal counts and waits, checkpoint records, gate counters.
  PublicationView view() const { return PublicationView(journal_.get(), registry_.get(), gate_.get()); }
  // A stop has begun: every wait for an entry returns now (Journal::ReleaseWaiters).
  void ReleaseWaiters() { journal_->ReleaseWaiters(); }
  // The daemon's final drain, bounded by `stall` without progress (Journal::CloseWithin):
  // what is queued then is left for the next start.
  StopReport Stop(std::chrono::milliseconds stall,
                  const std::function<void(const std::string&)>& waiting = {}) {
    return journal_->CloseWithin(stall, waiting);
  }
  // What this mount wrote, for peers' commit queries (outlives the peer server).
  ShardStateProvider* shard_states() { return shard_states_.get(); }

 private:
  Publication(BackingDir* dir, KeyIndex* index, PublicationOptions options);
  // JournalDelegate (publisher thread): the gate's answer, and the outcome of every entry.
  CommitCheck CheckCommit(const JournalEntry& e, const QueuedPublishes& queued) override;
  bool Gated(const JournalEntry& e) override;
  void OnDone(const JournalEntry& e, const Status& st) override;
  void OnHalt(const JournalEntry& e, const Status& st) override;
  // CommitGateHost and LocalShardQuestions: the observer's answers, the dropped names, the
  // shard states' record, and the journal to wake.
  bool WrittenLocally(const std::string& path) override;
  bool RewrittenSince(const std::string& path, uint64_t seq) override;
  bool PendingLocally(const std::string& path) override;
  bool DeletedLocally(const std::string& path) override EXCLUDES(dropped_mu_);
  bool GivenUpLocally(const std::string& dir) override EXCLUDES(lost_mu_);
  void GaveUp(const std::string& dir, const std::string& why) override EXCLUDES(lost_mu_);
  std::optional<uint64_t> PublishedLength(const std::string& path) override;
  void WakeGate() override;
  void OnPeerChecksums(const std::string& path,
                       std::shared_ptr<const ShardChecksums> checksums) override;
  // The registry's and the key index's side of an applied entry; returns the directory
  // of a checkpoint it committed, or "".
  std::string NoteApplied(const JournalEntry& e, const Status& st);
  // Gives a just-published file's block CRCs (recorded by the flush pipeline) to the index.
  void HandOverBlockCrcs(const JournalEntry& e);
  // After OnDone: the records' sweep every 10 s (NoteForeignCommits,
  // ForgetVanishedCheckpoints), and the allocator's free pages returned once a backlog has
  // drained.
  void AfterEntry(const Status& st) EXCLUDES(trim_mu_);

  BackingDir* const dir_;
  KeyIndex* const index_;
  const PublicationOptions options_;
  PublicationObserver* observer_ = nullptr;  // set by Start(), before any entry
  std::vector<JournalEntry> left_;           // from Recover(), for Start()
  std::unique_ptr<CheckpointRegistry> registry_;
  std::unique_ptr<AbortedRewrites> aborted_rewrites_;  // over dir_ and registry_
  std::unique_ptr<LocalShardStates> shard_states_;
  std::unique_ptr<LostPublishes> lost_publishes_;  // what crashes lost (persisted), for shard_states_
  // Deletions of committed checkpoints held while a given-up checkpoint is the newest
  // (read by the journal and the gate, declared before both).
  DeletionHold hold_;
  std::unique_ptr<WithheldTrackers> withheld_trackers_;  // arms hold_ (Abort of a tracker)
  std::unique_ptr<CommitGate> gate_;
  std::unique_ptr<JournalTrace> trace_;  // before journal_, which writes to it
  std::unique_ptr<Journal> journal_;  // last: its publisher calls into the parts above

  // The longest queue seen since the last trim, when that was, and the last sweep
  // (AfterEntry; OnDone runs on the publisher, an aborting or a stopping thread).
  struct AfterEntryTimes {
    uint64_t backlog_peak = 0;
    std::chrono::steady_clock::time_point last_trim, last_sweep;
  };
  Mutex trim_mu_;
  AfterEntryTimes after_entry_ GUARDED_BY(trim_mu_);

  // Names whose pending publish was dropped because the application deleted them while
  // publication was halted: a `.metadata` naming one is refused at once.
  Mutex dropped_mu_;
  std::set<std::string> dropped_paths_ GUARDED_BY(dropped_mu_);

  // Checkpoints given up because a node they waited for was declared dead (dir -> reason),
  // for the trackers that name them (docs/SEMANTICS.md, "A lost node"); bounded.
  mutable Mutex lost_mu_;
  std::map<std::string, std::string> lost_ GUARDED_BY(lost_mu_);
  // The given-up checkpoint the tracker `e` names, if any, with the reason it was given up.
  std::optional<std::pair<std::string, std::string>> NamesLostCheckpoint(const JournalEntry& e)
      EXCLUDES(lost_mu_);
};

}  // namespace ckptfs::store
