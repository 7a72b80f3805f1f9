// CommitGate: decides when a DCP checkpoint's `.metadata` may appear on the backing store
// (G5): only once every shard it names is durable there with at least the referenced
// length. Publication asks it for the journal (JournalDelegate::CheckCommit) and it never blocks: it
// answers "ready", "refused" or "not yet, these shards are missing, ask again by then".
//
// Shards are judged in this order:
//   1. a publish of the shard still queued in this mount's journal: wait for it (the
//      journal applies it ahead of the `.metadata`);
//   2. a shard being written through this mount and not yet closed (WrittenLocally):
//      wait for its close;
//   Except for a rewrite: a shard whose version here began after the `.metadata` entry was
//   appended (the next save into the same directory rewrites it, as torch's overwrite
//   does) while an earlier version published through this mount has the length the
//   `.metadata` needs is judged by that earlier version (3a), which is what the
//   `.metadata` names, never by the rewrite (G10: no wait for a version a later write
//   replaced). A first write of a shard after its `.metadata` (`cp -r`) is waited for.
//   A synchronous caller (strict mode) is not held by 2 either (waits_for_unwritten): it
//   may be the process holding the shard open.

//   3. otherwise it was written elsewhere (another node, or before this mount), or
//      published already through this mount. Only these can time out. In that order:
//      a. published through this mount (PublishedLength) with at least the required length:
//         it counts after one confirming stat of the backing file;
//      b. with peers (PeerShardAsker), the other daemons are asked (docs/PEERS.md, "Commit
//         query"), asynchronously: the gate answers "not yet" while a round is out and
//         wakes the journal (CommitGateHost::WakeGate) when it ends. A peer's answer, per path:
//           durable with length L >= required: counts after ONE confirming stat of the
//             backing file (cheap; keeps G5 even if a peer is wrong or the store shows
//             a rename late: a failed confirmation sends the path to polling);
//           pending: wait, without touching the backing store, and ask again (the peer
//             holds its answer until the state changes, so a round ends about when the
//             shard becomes durable);
//           dropped (deleted before publication on its writer) with every peer
//             reachable: refused at once, as for a shard deleted here (DeletedLocally);
//           failed (its publication failed for good there), unknown to every peer, some
//             peer unreachable, or shorter than required: polled as below (a strict
//             caller waits for a shard whose node did not answer, as for a first answer);
//      c. polled: it counts once the backing store shows it with the required length,
//         stat'ed with backoff (50 ms doubling to 2 s), counted in commit_polls; unless
//         its mtime is earlier than this mount's first write of the save less
//         kEarlierSaveSlack (save_began): that file is an earlier save's version at the
//         name (a peer's lagging publish into the directory made again, a peer restarted
//         since), nobody is writing this save's, and the commit is refused (the two-node
//         async soak, seed 5801).
// A `.metadata` that is not a DCP metadata this parser understands commits by order alone.
//
// Across nodes (G4): a mount whose ranks wrote shards of a checkpoint whose `.metadata`
// another node publishes has no journal entry to order its later entries after. So the
// gate remembers each directory where this mount published a `*.distcp` and no
// `.metadata` (NoteApplied), and an ordered entry (IsOrderedEntry: a tracker, any other
// non-shard file, a rename, a delete) waits until the backing store shows every such
// directory's `.metadata`, polled with the same backoff and timeout. A `.metadata` counts
// only with a ctime at or after the last write of this mount's first shard there: an
// earlier save's `.metadata`, still in place while a second save into the same directory
// runs, does not (the backing store's clock against this node's: wrong only where they
// differ by more than a save takes); on timeout it is
// refused (the journal halts there, or skips it in strict mode). These polls (counted in
// ordered_polls; remote_polls() is commit_polls + ordered_polls) do not ask the peers
// yet: the commit is a single `.metadata` per directory and the 2 s backoff cap bounds how
// late a tracker follows it.
//
// Thread-safe; called from the journal's publisher thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include <nlohmann/json.hpp>
#include <vector>

#include "store/primitives/backing_dir.h"
#include "store/publish/deletion_hold.h"
#include "store/publish/journal.h"
#include "store/publish/shard_state.h"

namespace ckptfs::store {

struct CommitGateOptions {
  // How long a `.metadata` waits for shards written elsewhere.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  // How long a peer may hold its answer to a commit query while a shard is pending there.
  std::chrono::milliseconds peer_hold{1500};
  // Bound on the wait for a round, as the gate's recheck (the host's WakeGate normally
  // comes first).
  std::chrono::milliseconds peer_recheck{1000};
  // Told when another node's `.metadata` is seen (borrowed, may be null).
  DeletionHold* hold = nullptr;
  // When this mount began writing the save of checkpoint `dir` whose commit is checked
  // (wall-clock seconds), if it wrote a shard of it; nullopt else. A shard polled on the
  // backing store whose mtime (the writer's last write, which its publish keeps) is
  // earlier by more than kEarlierSaveSlack is an earlier save's (below). May be empty.
  std::function<std::optional<double>(const std::string& dir)> save_began;
};

// How much earlier than this mount's first write of a save another rank's shard of it may
// have been written (ranks start their writes together, after DCP's plan; clocks of
// nodes and the store agree to well under this).
inline constexpr double kEarlierSaveSlack = 2.0;

// The gate's owner (Publication): what it knows of the files of this mount, and the journal
// to wake. Called on the publisher thread, and WakeGate on a peer querier's thread; in
// memory only, brief, never back into the gate.
class CommitGateHost {
 public:
  // True while `path` (relative to the backing root) is open for writing through this
  // mount and its publication is not yet queued.
  virtual bool WrittenLocally(const std::string& path) = 0;
  // True while a version of `path` is being written or published through this mount whose
  // writes began after journal entry `seq` (the commit) was appended.
  virtual bool RewrittenSince(const std::string& path, uint64_t seq) = 0;
  // True if the application deleted `path` through this mount before it was published, or
  // the operator's abort dropped its publish: a `.metadata` naming it is refused at once.
  virtual bool DeletedLocally(const std::string& path) = 0;
  // The size `path` was published with through this mount, if this mount published it.
  virtual std::optional<uint64_t> PublishedLength(const std::string& path) = 0;
  // A round of peer answers arrived: the journal asks the gate again now.
  virtual void WakeGate() = 0;
  // Checkpoint `dir`, whose `.metadata` another node was to publish, is given up: a node
  // was declared dead and the `.metadata` never appeared (docs/SEMANTICS.md, "A lost node").
  virtual void GaveUp(const std::string& dir, const std::string& why) { (void)dir, (void)why; }
  // A peer answered `path` durable with its block CRCs (the commit query): whoever indexes
  // the checkpoint may use them for that very file version. Called outside the gate's lock.
  virtual void OnPeerChecksums(const std::string& path,
                               std::shared_ptr<const ShardChecksums> checksums) {
    (void)path;
    (void)checksums;
  }

 protected:
  ~CommitGateHost() = default;
};

struct CommitGateStats {
  // Backing-store stats polling what other nodes write; remote_polls (JSON, remote_polls())
  // is their sum.
  uint64_t commit_polls = 0;   // shards of a `.metadata` (step c)
  uint64_t ordered_polls = 0;  // another node's `.metadata`, for cross-node order
  uint64_t confirm_stats = 0;  // one-off stats confirming a peer's or this mount's durable
  uint64_t peer_commit_queries = 0;  // rounds asked
  uint64_t peer_commit_paths = 0;    // paths asked, summed over rounds
  // Per path answered, by the gathered state.
  uint64_t answers_durable = 0, answers_pending = 0, answers_dropped = 0, answers_failed = 0,
           answers_unknown = 0;
  uint64_t peer_checksums = 0;  // durable answers that came with the shard's block CRCs
  uint64_t answers_unreachable = 0;  // unknown while some peer could not be asked
  uint64_t coordinator_queries = 0;  // rounds asking the coordinator about a `.metadata`
  uint64_t coordinator_failed = 0;   // ... that it said failed or deleted: given up
  uint64_t peer_confirmed = 0;       // shards counted on a peer's word (+ a stat)
  uint64_t peer_refused = 0;         // commits refused on a peer's "dropped"
  uint64_t earlier_saves = 0;        // ... on a polled shard of an earlier save
  uint64_t given_up = 0;             // commits given up: their shards were a dead node's
  uint64_t ordered_timeouts = 0;     // ... of them: another node's `.metadata` never came
  // Under "commit_gate" in /.ckptfs/stats, plus flat peer_commit_queries, remote_polls.
  void AppendJson(nlohmann::json* j) const;
};

class CommitGate final : private PeerShardAnswerSink {
 public:
  // `dir` must outlive it; `host` (nothing written here, no wake: the gate says when to ask
  // again) and `peers` (no commit queries) may be null, else must outlive it and every
  // round it starts.
  CommitGate(BackingDir* dir, CommitGateOptions options, CommitGateHost* host = nullptr,
             PeerShardAsker* peers = nullptr)
      : dir_(dir), options_(options), host_(host), peers_(peers) {}
  CommitGate(const CommitGate&) = delete;
  CommitGate& operator=(const CommitGate&) = delete;

  // `queued` (may be null: nothing is) tells which shards' publishes are still queued.
  CommitCheck Check(const JournalEntry& e, const QueuedPublishes* queued);

  uint64_t remote_polls() const;
  CommitGateStats stats() const;

  // Entries that wait for checkpoints committed elsewhere (see above). Looks at the entry
  // only; safe under any lock.
  static bool IsOrderedEntry(const JournalEntry& e);
  // The journal's on_done: tracks directories holding shards published here whose
  // `.metadata` this mount did not publish.
  void NoteApplied(const JournalEntry& e, const Status& st);
  // Nothing waits for the `.metadata` of `dir` any more: this mount's commit of it was
  // decided without one (the application removed the directory before its shards were
  // durable), or it was seen committed by another node, or gone from the backing store.
  // (A node that writes shards only, never an ordered entry, kept every directory it
  // wrote into for its life: the two-node soak's heap, issue 41.)
  void Forget(const std::string& dir);

 private:
  struct Pending {
    uint64_t seq = 0;
    bool by_order = false;                    // not a metadata we understand
    std::map<std::string, uint64_t> need;     // shard path -> minimum length, not yet seen
    std::chrono::steady_clock::time_point deadline;
    std::chrono::steady_clock::time_point next_poll;
    std::chrono::milliseconds backoff{50};
    // Remote paths judged by polling (peers do not know them, or cannot be asked).
    std::set<std::string> polled;
    // Of `polled`, those whose node did not answer (unreachable): a strict caller waits
    // for them, as for a first answer still out.
    std::set<std::string> unanswered;
    // When each path's node was first found silent in this commit (asked again until
    // kSilentPeerWait has passed).
    std::map<std::string, std::chrono::steady_clock::time_point> silent_since;
  };
  // Commit `e` is refused for `why`: forgotten, and its directory no longer waited for
  // by ordered entries (foreign_).
  Status Refuse(const JournalEntry& e, Status why) REQUIRES(mu_);
  // One stat: `path` on the backing store with at least `min_len` bytes.
  bool Confirm(const std::string& path, uint64_t min_len) REQUIRES(mu_);
  // Why the polled file `st` at `path` is an earlier save's than commit `e` names, or
  // nullopt (options_.save_began).
  std::optional<std::string> EarlierSave(const JournalEntry& e, const std::string& path,
                                         const struct stat& st) const;
  // Stores a round's answers (the querier's thread).
  void OnPeerShardAnswers(uint64_t round, std::vector<PeerShardAnswer> answers) override
      EXCLUDES(mu_);
  Status Load(const JournalEntry& e, Pending* p);
  // A `.metadata` or index: waits for its shards.
  CommitCheck CheckCommit(const JournalEntry& e, const QueuedPublishes* queued) EXCLUDES(mu_);
  // An ordered entry: waits for other nodes' `.metadata` (foreign_); `to_ask` gets the
  // `.metadata` paths to ask the coordinator about.
  CommitCheck CheckOrdered(const JournalEntry& e, const QueuedPublishes* queued,
                           std::vector<std::string>* to_ask)
      REQUIRES(mu_);

  BackingDir* const dir_;
  const CommitGateOptions options_;
  CommitGateHost* const host_;
  PeerShardAsker* const peers_;
  mutable Mutex mu_;
  Pending current_ GUARDED_BY(mu_);  // the commit being judged
  CommitGateStats stats_ GUARDED_BY(mu_);
  // The peer round for the commit being judged: at most one out at a time; its answers
  // wait in answers_ until the next Check() takes them.
  uint64_t round_ GUARDED_BY(mu_) = 0;       // last round started
  uint64_t round_seq_ GUARDED_BY(mu_) = 0;   // the commit it was for
  bool round_out_ GUARDED_BY(mu_) = false;
  std::vector<std::string> round_paths_ GUARDED_BY(mu_);  // what round_ asked
  std::map<std::string, PeerShardAnswer> answers_ GUARDED_BY(mu_);
  // Checkpoint dirs with shards published here and no `.metadata` seen yet, and the
  // ordered entry waiting for them.
  // Each with the time (epoch seconds, this node's clock) of the earliest such shard's
  // last write: only a `.metadata` whose ctime is at or after it commits the directory.
  std::map<std::string, double> foreign_ GUARDED_BY(mu_);
  // Checkpoint dirs where this mount published rank 0's first file, whose `.metadata` this
  // node writes: never waited for as foreign (bounded; a commit applied here ends one).
  std::set<std::string> commits_here_ GUARDED_BY(mu_);
  Pending ordered_ GUARDED_BY(mu_);  // seq, deadline, backoff only
  // The coordinator round for foreign_ (AskCoordinator): one out at a time, numbered with
  // kOrderedRound set so its answers are told from a commit round's; answers by `.metadata`
  // path wait in ordered_answers_ for the next CheckOrdered.
  static constexpr uint64_t kOrderedRound = 1ull << 63;
  uint64_t ordered_round_ GUARDED_BY(mu_) = 0;
  bool ordered_round_out_ GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point ordered_next_ask_ GUARDED_BY(mu_){};
  std::vector<std::string> ordered_round_paths_ GUARDED_BY(mu_);
  std::map<std::string, PeerShardAnswer> ordered_answers_ GUARDED_BY(mu_);
};

}  // namespace ckptfs::store
