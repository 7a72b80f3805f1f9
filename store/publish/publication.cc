#include "store/publish/publication.h"

#include <dirent.h>
#include <malloc.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <chrono>

#include "common/path.h"
#include "store/dcp/checkpoint_source.h"
#include "store/dcp/commit_names.h"
#include "store/dcp/metadata_file.h"
#include "store/flush/flush_pipeline.h"
#include "store/primitives/file_key.h"
#include "store/publish/tracker_text.h"

namespace ckptfs::store {
namespace {

// A published file keeps the times the mount showed (its last write, or a utimens).
void SetFileTimes(BackingDir* dir, const JournalEntry& e) {
  if (!(e.atime_sec || e.atime_nsec || e.mtime_sec || e.mtime_nsec)) return;
  struct timespec ts[2] = {{e.atime_sec, e.atime_nsec}, {e.mtime_sec, e.mtime_nsec}};
  (void)dir->Utimens(e.path, ts);
}

// A deletion DeletionHold may hold: an unlink or rmdir the application made (not an
// abort's withdrawal or restore, not a directory a rename replaced), never one let go.
bool HeldDeletionCandidate(const JournalEntry& e) {
  if (e.unheld || e.withdraw || e.restore) return false;
  return e.op == OpType::kRmdir || (e.op == OpType::kUnlink && !S_ISDIR(e.mode));
}

// Whether `parent` on the backing store holds a file a tracker could be (IsTrackerCandidate's
// rules: small, not a shard, a temp file or `.metadata`). Asked when a deletion is first
// held: after a restart the journal has not yet seen a tracker there applied, and a
// tracker already on the backing store may name what the deletion removes.
bool TrackerBeside(BackingDir* dir, const std::string& parent) {
  auto entries = dir->List(parent);
  if (!entries.ok()) return false;
  for (const DirEntry& d : *entries) {
    if (d.type != DT_REG && d.type != DT_UNKNOWN) continue;
    JournalEntry probe;
    probe.op = OpType::kPublish;
    probe.path = path::Join(parent, d.name);
    auto st = dir->Stat(probe.path);
    if (!st.ok() || !S_ISREG(st->st_mode)) continue;
    probe.mode = st->st_mode;
    probe.size = static_cast<uint64_t>(st->st_size);
    if (IsTrackerCandidate(probe)) return true;
  }
  return false;
}

// Whether a file at `path` could be a tracker (IsTrackerCandidate's rules by its name).
bool IsTrackerName(const std::string& path) {
  JournalEntry probe;
  probe.op = OpType::kPublish;
  probe.path = path;
  probe.mode = S_IFREG;
  return !path.empty() && IsTrackerCandidate(probe);
}

// At start, with cross-node order: a record the last run left aborted with every shard
// published whose `.metadata` another node has published meanwhile is committed.
void ReconcileForeignCommits(BackingDir* dir, CheckpointRegistry* registry) {
  // Shards of a checkpoint whose `.metadata` another node publishes, every one of them
  // published here, when the last run ended (a clean stop does not wait for that node's
  // commit): it may have come since. Such a record is committed, not aborted.
  for (const CheckpointInfo& info : registry->List()) {
    if (info.state != CkptState::kAborted ||
        info.error != CheckpointRegistry::kStoppedBeforeCommit || info.files == 0 ||
        info.bytes_published < info.bytes) {
      continue;
    }
    if (CommittedElsewhere(dir, info.path, info.created)) {
      spdlog::info("checkpoint {}: its .metadata was published by another node", info.path);
      registry->OnCommitted(info.path);
    } else if (dir->Stat(info.path).status().code() == Code::kNotFound) {
      // Removed since (a rotation through another node): forgotten, so that each record
      // is looked at by one start, not by every start after it.
      registry->OnRemoved(info.path);
    }
  }
}

}  // namespace

Publication::Publication(BackingDir* dir, KeyIndex* index, PublicationOptions options)
    : dir_(dir), index_(index), options_(std::move(options)) {}

Publication::~Publication() = default;

Result<std::unique_ptr<Publication>> Publication::Create(BackingDir* dir, StateDb* db,
                                                         KeyIndex* index,
                                                         PublicationOptions options) {
  std::unique_ptr<JournalTrace> trace;
  if (!options.journal_trace.empty()) {
    CKPT_ASSIGN_OR_RETURN(trace, JournalTrace::Open(options.journal_trace));
  }
  CKPT_ASSIGN_OR_RETURN(RecoveryReport report, Journal::Recover(dir, db));
  if (report.entries_discarded > 0 || report.temps_removed > 0) {
    spdlog::warn("recovery: discarded {} unapplied journal entries, removed {} temp files",
                 report.entries_discarded, report.temps_removed);
  }
  if (trace) {
    for (const JournalEntry& e : report.resumed) trace->Recovered("resume", e);
    for (const JournalEntry& e : report.discarded) trace->Recovered("discard", e);
  }
  std::unique_ptr<Publication> p(new Publication(dir, index, std::move(options)));
  p->trace_ = std::move(trace);
  Publication* self = p.get();
  // Entries the last stop left for this start: queued by Start(), once the observer exists.
  p->left_ = std::move(report.resumed);
  CKPT_ASSIGN_OR_RETURN(p->registry_, CheckpointRegistry::Load(db));
  if (p->options_.cross_node_order) ReconcileForeignCommits(dir, p->registry_.get());
  for (const std::string& restored : report.restored) {
    p->registry_->OnEarlierCommitKept(restored,
                                      "a later save into it was lost with the daemon; the "
                                      "files it had replaced were put back");
  }
  p->withheld_trackers_ = std::make_unique<WithheldTrackers>(db, &p->hold_);
  CKPT_RETURN_IF_ERROR(p->withheld_trackers_->Load());
  p->aborted_rewrites_ =
      std::make_unique<AbortedRewrites>(dir, p->registry_.get(), p->options_.cross_node_order);
  p->lost_publishes_ = std::make_unique<LostPublishes>(db);
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> lost, p->lost_publishes_->Load());

  // The parts ask Publication what the mount knows (its private bases).
  // Peers asking about a shard durable here get its block CRCs with the answer, so the
  // node indexing the checkpoint need not read it back (docs/PEERS.md).
  p->shard_states_ = std::make_unique<LocalShardStates>(
      static_cast<LocalShardQuestions*>(self), 65536,
      [index](const std::string& path) {
        return index != nullptr ? index->ShardChecksumsOf(path) : nullptr;
      });
  p->shard_states_->NoteLost(lost);
  CommitGateOptions gate = p->options_.gate;
  gate.hold = &p->hold_;  // another node's commit seen ends a hold of deletions
  // When this save began here: the first checkpoint file this mount made in it, if one
  // besides the commit file was queued (a `.metadata` alone says nothing of the shards).
  gate.save_began = [registry = p->registry_.get()](const std::string& dir)
      -> std::optional<double> {
    const std::optional<CheckpointInfo> info = registry->Get(dir);
    if (!info || info->files < 2 ||
        (info->state != CkptState::kWriting && info->state != CkptState::kPending)) {
      return std::nullopt;
    }
    return info->created;
  };
  p->gate_ = std::make_unique<CommitGate>(dir, gate, static_cast<CommitGateHost*>(self),
                                          p->options_.peers);
  JournalOptions journal;
  journal.hold = &p->hold_;
  journal.halt_on_failure = p->options_.halt_on_failure;
  journal.shared_dirs = p->options_.cross_node_order;
  // Temp files live at the backing root: their records can be written ahead, several
  // per synced write.
  journal.temp_prefix = p->options_.temp_prefix;
  journal.trace = p->trace_.get();
  CKPT_ASSIGN_OR_RETURN(p->journal_, Journal::Create(dir, db, static_cast<JournalDelegate*>(self),
                                                     std::move(journal)));
  return p;
}

void Publication::Start(PublicationObserver* observer) {
  observer_ = observer;
  if (left_.empty()) return;
  // The mount shows the backing store as the last daemon left it; give what it left a
  // moment to be published before serving (docs/SEMANTICS.md, "Stopping").
  const size_t n = left_.size();
  journal_->QueueLeft(std::move(left_));
  left_.clear();
  const bool done = journal_->WaitLeft(std::chrono::seconds(2));
  spdlog::info("resumed {} journal entries left by the last stop: {}", n,
               done ? "all published" : "still pending: " + journal_->WaitingFor());
}

std::string Publication::TempName(uint64_t id) const {
  return options_.temp_prefix + std::to_string(id);
}

Result<uint64_t> Publication::Append(JournalEntry e) {
  const OpType op = e.op;
  const std::string path = e.path;
  const std::string from = e.from;
  const uint64_t size = e.size;
  const bool dir = S_ISDIR(e.mode);
  CKPT_ASSIGN_OR_RETURN(uint64_t seq, journal_->Append(std::move(e)));
  // The registry follows the application's order: what this entry queues, as it is
  // queued (a rename or removal of a directory moves its records before the backing store
  // does; the outcomes of earlier entries are resolved through it, CheckpointRegistry).
  switch (op) {
    case OpType::kPublish:
      registry_->OnFileQueued(path::Parent(path), size);
      if (IsCommitName(path)) registry_->OnCommitQueued(path::Parent(path), seq);
      break;
    case OpType::kRename:
      if (dir) {
        registry_->OnRemoved(path, seq);  // a directory it replaces (empty) goes
        registry_->OnRenamed(from, path, seq);
      } else if (IsCommitName(path)) {
        registry_->OnCommitQueued(path::Parent(path), seq);
      }
      break;
    case OpType::kRmdir:
      registry_->OnRemoved(path, seq);
      break;
    case OpType::kUnlink:
      if (dir) registry_->OnRemoved(path, seq);  // a directory a rename replaces
      break;
    default:
      break;
  }
  return seq;
}

void Publication::NoteWriteBegun(const std::string& dir, const std::string& name) {
  if (CheckpointRegistry::IsCheckpointFile(name)) registry_->OnFileCreated(dir);
  MutexLock lock(&dropped_mu_);
  if (!dropped_paths_.empty()) dropped_paths_.erase(path::Join(dir, name));
}

bool Publication::DropIfHalted(const std::string& path) {
  // A checkpoint whose queued publishes are dropped never commits: a tracker queued behind
  // them that names it is withheld, as one naming an aborted checkpoint (Abort), until the
  // directory is removed or committed again. Marked before the journal drops anything, so
  // the publisher cannot reach such a tracker first.
  const std::string dir = path::Parent(path);
  const std::optional<CheckpointInfo> info = registry_->Get(dir);
  bool marked = false;
  if (info && info->state != CkptState::kCommitted) {
    MutexLock lock(&lost_mu_);
    if (lost_.count(dir) == 0) {
      if (lost_.size() >= 1024) lost_.erase(lost_.begin());
      lost_[dir] = "deleted through the mount before it was published";
      marked = true;
    }
  }
  if (!journal_->DropIfHalted(path)) {
    if (marked) {
      MutexLock lock(&lost_mu_);
      lost_.erase(dir);
    }
    return false;
  }
  MutexLock lock(&dropped_mu_);
  dropped_paths_.insert(path);
  return true;
}

bool Publication::DeletedLocally(const std::string& path) {
  MutexLock lock(&dropped_mu_);
  return dropped_paths_.count(path) > 0;
}

// ------------------------------------------------------------ the parts' questions

CommitCheck Publication::CheckCommit(const JournalEntry& e, const QueuedPublishes& queued) {
  CommitCheck check = gate_->Check(e, &queued);  // may give up a checkpoint (GaveUp)
  if (check.status.code() == Code::kAborted && IsCommitName(e.path)) {
    // A shard of it was deleted before it was published, its publish dropped behind a
    // halt (DropIfHalted marked the directory): it can never commit, and the application
    // removed it. Decided, as a commit given up for a lost node is: skipped instead of a
    // halt that waits for an operator, and a tracker naming it stays withheld.
    const std::string dir = path::Parent(e.path);
    {
      MutexLock lock(&lost_mu_);
      if (lost_.count(dir) > 0) return Status(Code::kNodeLost, check.status.message());
      // Refused otherwise (a peer's shard dropped, failed or lost with its node, an earlier
      // save's file at a shard's name): it halts here for the operator, but a tracker
      // naming it stays withheld even if the application removes the directory meanwhile
      // (the halted entry then goes with it, and the tracker behind it was applied: the
      // two-node async soak, seed 5803, "the tracker names a checkpoint with no
      // .metadata"); deletions of committed checkpoints wait for a later commit.
      if (lost_.size() >= 1024) lost_.erase(lost_.begin());
      lost_[dir] = "its commit was refused: " + check.status.message();
    }
    hold_.GaveUp();
  }
  if (check.status.ok() && check.ready && hold_.active() && HeldDeletionCandidate(e)) {
    // A checkpoint before it was given up and none has committed since: the deletion of a
    // committed checkpoint waits for a later one (deletion_hold.h), unless it deletes the
    // given-up checkpoint itself.
    const std::string ckpt = e.op == OpType::kRmdir ? e.path : path::Parent(e.path);
    bool lost = false;
    {
      MutexLock lock(&lost_mu_);
      lost = lost_.count(ckpt) > 0;
    }
    if (!lost && dir_->Stat(path::Join(ckpt, ".metadata")).ok()) {
      CommitCheck hold = CommitCheck::Hold();
      hold.tracker_beside = TrackerBeside(dir_, path::Parent(ckpt));
      return hold;
    }
  }
  if (check.status.ok() && check.ready && !IsCommitName(e.path) && IsTrackerCandidate(e)) {
    if (auto lost = NamesLostCheckpoint(e)) {
      // G4 over G8: the tracker would name a checkpoint that never commits. The backing
      // store keeps the tracker before it (naming the last committed one), unless the
      // application wrote the tracker again since: that version replaces this one, which
      // then failed nothing (a rotation that outran publication removed the checkpoint).
      if (observer_->RewrittenSince(e.path, e.seq)) {
        return Status(Code::kSuperseded, "it names checkpoint " + lost->first + ", which "
                                         "never commits (" + lost->second + "), and a "
                                         "later version of it is queued");
      }
      return Status(Code::kNodeLost, "it names checkpoint " + lost->first +
                                         ", which was given up: " + lost->second);
    }
  }
  return check;
}

void Publication::GaveUp(const std::string& dir, const std::string& why) {
  registry_->OnFailed(dir, "given up: " + why);
  hold_.GaveUp();
  MutexLock lock(&lost_mu_);
  if (lost_.size() >= 1024) lost_.erase(lost_.begin());
  lost_[dir] = why;
}

bool Publication::Gated(const JournalEntry& e) {
  if (options_.cross_node_order && CommitGate::IsOrderedEntry(e)) return true;
  if (hold_.active() && HeldDeletionCandidate(e)) return true;  // CheckCommit may hold it
  if (!IsTrackerCandidate(e)) return false;
  MutexLock lock(&lost_mu_);
  return !lost_.empty();
}

std::optional<std::pair<std::string, std::string>> Publication::NamesLostCheckpoint(
    const JournalEntry& e) {
  std::map<std::string, std::string> lost;
  {
    MutexLock lock(&lost_mu_);
    if (lost_.empty()) return std::nullopt;
    lost = lost_;
  }
  Result<std::string> text = TrackerText(dir_, e);
  if (!text.ok() || text->empty()) return std::nullopt;
  for (const auto& [dir, why] : lost) {
    const bool names = TrackerNames(*text, e.path, dir);
    if (names) return std::make_pair(dir, why);
  }
  return std::nullopt;
}

bool Publication::WrittenLocally(const std::string& path) {
  return observer_->WrittenLocally(path);
}

bool Publication::RewrittenSince(const std::string& path, uint64_t seq) {
  return observer_->RewrittenSince(path, seq);
}

bool Publication::GivenUpLocally(const std::string& dir) {
  MutexLock lock(&lost_mu_);
  return lost_.count(dir) > 0;
}

bool Publication::PendingLocally(const std::string& path) {
  return observer_->PendingLocally(path);
}

std::optional<uint64_t> Publication::PublishedLength(const std::string& path) {
  return shard_states_->Durable(path);
}

void Publication::WakeGate() { journal_->RecheckGate(); }

Status Publication::AwaitApplied(uint64_t seq) {
  Status st = journal_->WaitUnlessHalted(seq);  // the outcome belongs to its entry...
  // ...unless publication is halted, or the daemon is stopping.
  if (!st.ok() && (journal_->halted() || journal_->releasing())) return st;
  // Let go early behind a commit that waits for unwritten shards: wait for the entry
  // itself a slice at a time, so that a halt or a stop is seen; no busy loop.
  if (st.ok()) journal_->WaitDoneFor(seq, std::chrono::milliseconds(50));
  return Status::Ok();
}

void Publication::ForgetVanishedCheckpoints(uint64_t in_flight) {
  const uint64_t last = journal_->counts().last_appended;
  const bool caught_up = journal_->counts().applied + in_flight >= last;
  // A removal counts only if this node has no queued entry that removes, replaces or
  // moves the directory (or one above it), before the stat and after it: the mount's
  // record moves with a rename before the backing store does. Other entries do not
  // matter, so a node that publishes all the time (saves back to back) still gets
  // through its records: the two-node soak's peer, with the whole queue as the guard,
  // forgot 283 of 2,161 removed checkpoints in its quiet phase (seed 5904).
  auto gone = [&](const std::string& path) {
    if (journal_->DirectoryEndsAfter(0, path).seq != 0) return false;
    Result<struct stat> st = dir_->Stat(path);
    return !st.ok() && st.status().code() == Code::kNotFound &&
           journal_->DirectoryEndsAfter(0, path).seq == 0;
  };
  for (const auto& info : registry_->List()) {
    // Writing: only one whose every file this node wrote is published and whose commit is
    // another node's (a node that writes shards only, whose checkpoint was removed before
    // it saw the commit: it kept the record for its life).
    const bool shards_done = info.state == CkptState::kWriting && !info.commit_queued &&
                             info.files > 0 && info.bytes_published >= info.bytes;
    if ((info.state == CkptState::kWriting && !shards_done) || info.state == CkptState::kPending) {
      continue;
    }
    if (gone(info.path)) {
      spdlog::info("checkpoint {}: gone from the backing store", info.path);
      registry_->OnRemoved(info.path);
      index_->Forget(info.path);
      if (options_.cross_node_order) gate_->Forget(info.path);
      if (observer_ != nullptr) observer_->OnRemovedElsewhere(info.path);
    }
  }
  if (!caught_up) return;
  for (const auto& path : index_->IndexedCheckpoints()) {
    if (!registry_->Get(path) && journal_->counts().last_appended == last &&
        FindCheckpointSource(dir_, path).status().code() == Code::kNotFound) {
      index_->Forget(path);
    }
  }
}

void Publication::NoteForeignCommits() {
  if (!options_.cross_node_order) return;
  for (const auto& info : registry_->List()) {
    // Shards written here, every one published, of a checkpoint whose `.metadata` another
    // node publishes: this node never queues that commit, so it looks for it.
    if (info.state != CkptState::kWriting || info.commit_queued || info.files == 0 ||
        info.bytes_published < info.bytes) {
      continue;
    }
    if (CommittedElsewhere(dir_, info.path, info.created)) {
      spdlog::info("checkpoint {}: its .metadata was published by another node", info.path);
      registry_->OnCommitted(info.path);
      shard_states_->Settled(info.path);  // what this mount knew answered for that save
      lost_publishes_->Settled(info.path);
      gate_->Forget(info.path);
      if (observer_ != nullptr) observer_->OnCommitSeen(info.path, 0);
    }
  }
}

bool Publication::NoteCommittedElsewhere(const std::string& dir, double since) {
  if (!CommittedElsewhere(dir_, dir, since)) return false;
  if (since != 0) {
    registry_->OnCommitted(dir);
    shard_states_->Settled(dir);
    lost_publishes_->Settled(dir);
    if (options_.cross_node_order) gate_->Forget(dir);
    if (observer_ != nullptr) observer_->OnCommitSeen(dir, 0);
  }
  return true;
}

std::vector<std::string> Publication::Abort(const std::string& path) {
  // What is aborted never commits: a tracker queued behind it that names it is withheld,
  // as one naming a lost node's checkpoint (G4), until a save commits it again. Marked
  // before the journal drops the entries, so the publisher cannot reach such a tracker
  // first; not for a checkpoint that is committed (an abort with nothing pending).
  const std::optional<CheckpointInfo> info = registry_->Get(path);
  const bool committed = info && info->state == CkptState::kCommitted;
  bool marked = false;
  if (!committed) {
    MutexLock lock(&lost_mu_);
    if (lost_.count(path) == 0) {
      if (lost_.size() >= 1024) lost_.erase(lost_.begin());
      lost_[path] = "aborted by the operator";
      marked = true;
    }
  }
  // Deletions of committed checkpoints behind it wait for a later commit, as behind a
  // checkpoint given up for a lost node (deletion_hold.h): the rotation's `rm -r` of an
  // older one, queued after the aborted save's tracker, would otherwise leave the backing
  // store one committed checkpoint short of what the application kept. Held before the
  // journal drops the entries, so the publisher cannot reach such a deletion first.
  if (marked) hold_.GaveUp();
  // Aborted first: a restore the journal queues may be applied before this returns, and
  // it makes the record committed again (NoteApplied).
  registry_->OnAborted(path, "aborted by the operator", /*subtree=*/true);
  // An abort of a tracker with versions queued drops them all: the backing store's tracker
  // stays older until the application writes it again, and deletions of committed
  // checkpoints are held until then (deletion_hold.h), before the journal drops them.
  if (!info && IsTrackerName(path) && journal_->PublishQueued(path)) {
    withheld_trackers_->Withhold(path);
  }
  std::vector<std::string> untouched;
  std::vector<std::string> dropped = journal_->Abort(path, aborted_rewrites_.get(), &untouched);
  const std::vector<std::string> kept = aborted_rewrites_->KeepEarlierCommits(untouched);
  MutexLock lock(&lost_mu_);
  if (dropped.empty() && marked) lost_.erase(path);      // nothing was pending: no tracker waits
  for (const std::string& dir : kept) lost_.erase(dir);  // committed: a tracker may name it
  return dropped;
}

void Publication::OnHalt(const JournalEntry& e, const Status& st) {
  const std::string dir = path::Parent(e.path);
  if (e.withdraw || e.restore) {
    // An abort's withdrawal or restore retried: the checkpoint stays aborted.
    observer_->OnHalted(e, st);
    return;
  }
  if (st.ok()) {
    registry_->OnResumed(dir);
  } else {
    registry_->OnHalted(dir, st.ToString());
  }
  observer_->OnHalted(e, st);
}

void Publication::OnDone(const JournalEntry& e, const Status& st) {
  if (options_.cross_node_order) gate_->NoteApplied(e, st);
  const std::string committed_dir = NoteApplied(e, st);
  // Before the tracker behind it is applied: what the mount shows of other nodes' files in
  // the directory is brought up to date.
  if (!committed_dir.empty()) observer_->OnCommitSeen(committed_dir, e.seq);
  if (options_.index_builds != nullptr) {
    if (!committed_dir.empty()) options_.index_builds->QueueBuild(committed_dir);
    if (st.ok() && (e.op == OpType::kUnlink || e.op == OpType::kPublish ||
                    e.op == OpType::kRename)) {
      options_.index_builds->FileGone(e.path);
      if (e.op == OpType::kRename) options_.index_builds->FileGone(e.from);
    }
  }
  observer_->OnOutcome(e, st);
  if (options_.retained) options_.retained->OnJournalDone(e, st);
  shard_states_->NoteDone(e, st);  // after the mount let go of a published path
  lost_publishes_->OnDone(e, st);
  AfterEntry(st);
}

void Publication::AfterEntry(const Status& st) {
  // Every 10 s, on the publisher's thread (an applied entry: not an abort's), the records
  // kept true to the backing store beyond this mount's entries, as the control tree does
  // before it reports: a node that writes shards only learns its checkpoints committed
  // elsewhere and removed elsewhere without anyone reading its stats (each kept a record
  // and a gate entry per checkpoint for the daemon's life: the two-node soak, issue 41).
  const uint64_t pending = journal_->counts().pending;
  bool sweep = false;
  {
    MutexLock lock(&trim_mu_);
    const auto now = std::chrono::steady_clock::now();
    if (st.ok() && now - after_entry_.last_sweep >= std::chrono::seconds(10)) {
      after_entry_.last_sweep = now;
      sweep = true;
    }
  }
  if (sweep) {
    NoteForeignCommits();
    ForgetVanishedCheckpoints(/*in_flight=*/1);
  }
  // A backlog (a slow or failing store while the application goes on) holds thousands of
  // queued entries, each with its records, paths and write state; once they are done the
  // allocator keeps their pages, spread between live objects, so RSS stayed at the
  // backlog's peak (the soak's leak bound, issue 41). When publication has caught up after
  // one (this entry is the last queued: the journal removes it after OnDone), the free
  // pages go back to the system; at most every 5 s, on this thread, a few milliseconds.
  // Without a backlog too, at most every 30 s: saves with small backlogs leave free memory
  // in the arenas of whichever threads made their entries, and over hundreds of saves it
  // grew by 4 MiB (the 60-minute soak, seed 5701, async: RSS less budgets +10.7 % from
  // 2,152 to 2,945 saves, heap in use +0.8 MiB, free held 1.3 -> 5.1 MiB).
  {
    MutexLock lock(&trim_mu_);
    uint64_t& peak = after_entry_.backlog_peak;
    peak = std::max(peak, pending);
    if (pending > 1) return;
    const auto now = std::chrono::steady_clock::now();
    const auto every = peak >= 256 ? std::chrono::seconds(5) : std::chrono::seconds(30);
    if (now - after_entry_.last_trim < every) return;
    after_entry_.last_trim = now;
    peak = 0;
  }
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

std::string Publication::NoteApplied(const JournalEntry& e, const Status& st) {
  const std::string dir = path::Parent(e.path);
  const bool commit = (e.op == OpType::kPublish || e.op == OpType::kRename) &&
                      IsCommitName(e.path);
  std::string committed;
  // A version of a withheld tracker applied, or the tracker removed (no version of it
  // will come): deletions held for it may go.
  if (st.ok() && !commit &&
      (e.op == OpType::kPublish || e.op == OpType::kRename || e.op == OpType::kUnlink)) {
    withheld_trackers_->Through(e.path);
  }
  if (e.op == OpType::kPublish && st.ok()) {
    SetFileTimes(dir_, e);
    registry_->OnFilePublished(dir, e.size, e.seq);
    HandOverBlockCrcs(e);
  }
  if (st.code() == Code::kSuperseded) {
    // A later save into the same directory commits it; nothing failed. The registry keeps
    // the state that later save gave the directory.
    if (commit && journal_->DirectoryEndsAfter(e.seq, dir).removed) {
      // Or the application removed the directory before its shards were durable: it never
      // commits. Entries ordered after it stop waiting for the `.metadata` this node was
      // to write, and a tracker naming it is withheld, or superseded by its later version
      // (CheckCommit): the two-node async soak, seed 5801, held every entry behind such a
      // tracker for the commit timeout, and the clean stop counted it as not published.
      // Deletions of committed checkpoints behind it wait for a later commit, as behind a
      // given-up one (deletion_hold.h): the tracker naming it is superseded, so the
      // backing store's tracker still names an earlier checkpoint, which the rotation's
      // `rm -r` must not take away first (the two-node soak, seed 5903: the tracker named
      // a removed checkpoint).
      hold_.GaveUp();
      if (options_.cross_node_order) gate_->Forget(dir);
      MutexLock lock(&lost_mu_);
      if (lost_.size() >= 1024) lost_.erase(lost_.begin());
      lost_[dir] = "the application removed it before it committed";
    }
  } else if (st.code() == Code::kNodeLost && commit) {
    registry_->OnFailed(dir, st.ToString(), e.seq);
    hold_.GaveUp();
    MutexLock lock(&lost_mu_);
    if (lost_.size() >= 1024) lost_.erase(lost_.begin());
    lost_[dir] = st.message();
  } else if (st.code() == Code::kNodeLost) {
    // A tracker withheld: nothing of its checkpoint changes.
  } else if (!st.ok()) {
    if (e.op == OpType::kPublish || commit) {
      if (st.code() == Code::kAborted) {
        registry_->OnAborted(dir, st.ToString(), /*subtree=*/false);
        // A file of it dropped (deleted before it was published, aborted): the directory
        // never commits as the application wrote it, so its commit is given up rather than
        // halted and a tracker naming it is withheld (G4), as for Abort and NoteDeleted.
        {
          MutexLock lock(&lost_mu_);
          if (lost_.count(dir) == 0) {
            if (lost_.size() >= 1024) lost_.erase(lost_.begin());
            lost_[dir] = st.message();
          }
        }
        // And deletions of committed checkpoints behind it wait for a later commit
        // (deletion_hold.h), as behind an aborted checkpoint: a rotation's `rm -r` of an
        // older one, queued after the tracker that named this one, would otherwise leave
        // the backing store one committed checkpoint short behind an older tracker, or
        // delete the one that tracker names once the next saves fail the same way (the
        // soak, seed 5701: the trainer's rotation outran a publication halted by an
        // injected fsync error; the saves it then removed were dropped, and with them
        // their trackers, while the older checkpoints' deletions went on). Told here, on
        // the publisher's thread, before it reaches any entry queued behind this one (a
        // delete through the mount marks the directory lost first, DropIfHalted, but only
        // the publisher drops the entries, in order).
        if (commit || CheckpointRegistry::IsCheckpointFile(std::string(path::Basename(e.path)))) {
          hold_.GaveUp();
        }
        if (e.op == OpType::kPublish) {
          // The gate refuses a `.metadata` naming it at once (DeletedLocally) instead of
          // waiting the commit timeout for bytes that will never come (an operator's abort
          // of a save still being written: e2e test_fault_inject, 1 in about 250 runs).
          MutexLock lock(&dropped_mu_);
          if (dropped_paths_.size() >= 4096) dropped_paths_.erase(dropped_paths_.begin());
          dropped_paths_.insert(e.path);
        }
      } else {
        registry_->OnFailed(dir, st.ToString(), e.seq);
      }
    }
  } else if (commit) {
    {
      // A later save into a directory given up earlier commits it: no longer lost.
      MutexLock lock(&lost_mu_);
      lost_.erase(dir);
    }
    aborted_rewrites_->OnCommitted(dir);
    // The key index reads every commit format (store/dcp/checkpoint_source.h); it is
    // built once the directory is committed, not once per rank (a build takes the write
    // path's block CRCs of the shards it covers and releases them).
    if (CommitKindOf(e.path) != CommitKind::kDcpRank) {
      registry_->OnCommitted(dir, e.seq);
      committed = dir;
    } else if (!observer_->RankCommitPending(e.path, e.seq)) {
      // A no-collectives save: each rank's `__{rank}.metadata` is gated on its own shards;
      // the directory is committed once none of them is pending any more.
      registry_->OnCommitted(dir, e.seq, /*last_part=*/true);
      committed = dir;
    }
  }
  if (!committed.empty()) {
    hold_.Committed();  // held deletions may go (deletion_hold.h)
    // Committed again after it was given up or aborted: trackers may name it.
    MutexLock lock(&lost_mu_);
    lost_.erase(committed);
  }
  if (e.withdraw && st.ok()) index_->Forget(dir);  // no `.metadata` to read it from
  // The directory is the earlier save again, whole under its `.metadata`; unless it has no
  // earlier save (nothing was replaced), or a later abort withdrew that `.metadata`.
  if (e.restore && !e.withdraw && st.ok() && dir_->Stat(path::Join(dir, ".metadata")).ok()) {
    registry_->OnEarlierCommitKept(dir,
                                   "a later save into it was aborted by the operator; "
                                   "the files it had replaced were put back");
    MutexLock lock(&lost_mu_);
    lost_.erase(dir);  // committed: a tracker may name it
  }
  // Entries can be applied ahead of a waiting commit: only the journal knows the prefix.
  registry_->OnApplied(journal_->counts().applied);
  if (st.ok() && e.op == OpType::kRename) index_->OnRenamed(e.from, e.path);
  if (st.ok() && e.op == OpType::kUnlink && !S_ISDIR(e.mode)) index_->OnFileRemoved(e.path);
  if (st.ok() && e.op == OpType::kRmdir) {
    index_->Forget(e.path);
    MutexLock lock(&lost_mu_);
    for (auto it = lost_.lower_bound(e.path); it != lost_.end() && it->first.starts_with(e.path);) {
      it = path::IsAtOrBelow(it->first, e.path) ? lost_.erase(it) : std::next(it);
    }
  }
  return committed;
}

void Publication::OnPeerChecksums(const std::string& path,
                                  std::shared_ptr<const ShardChecksums> checksums) {
  index_->AddPeerBlockCrcs(path, *checksums);
}

void Publication::HandOverBlockCrcs(const JournalEntry& e) {
  if (!e.target) return;  // replayed after a restart: nothing was recorded
  std::shared_ptr<BlockCrcMap> crcs = e.target->TakeBlockCrcs();
  if (!crcs) return;
  crcs->Finish(e.size);
  // The identity after the rename and the times set above: a later change by anyone makes
  // the key index ignore these CRCs.
  Result<struct stat> st = dir_->Stat(e.path);
  if (!st.ok()) return;
  index_->AddBlockCrcs(e.path, FileKeyFromStat(*st), std::move(crcs));
}

}  // namespace ckptfs::store
