// What a daemon knows about the shard files written through its own mount, for the
// cross-node commit query (docs/PEERS.md, "Commit query"): node X's commit gate asks the
// other daemons about the shards of a `.metadata` it is about to publish, and each answers
// from its ShardStateProvider instead of X polling the backing store.
//
// States, per path relative to the backing root:
//   kPending  open for writing through this mount, or its publish queued or retried here
//             (not yet durable);
//   kDurable  its publish (or a rename onto it) was applied through this mount: fsynced,
//             renamed onto its name; `length` is the size it was published with;
//   kDropped  deleted through this mount before it was published (its publish was dropped
//             or aborted): it will not appear from here;
//   kFailed   its publication failed for good here (strict mode skips the entry), or it
//             died with an earlier run of this daemon (closed, never published: a crash);
//   kUnknown  none of these (never written here, or forgotten: the record is bounded).
// A path open for writing again after a publish is kPending: pending wins over a record.
//
// LocalShardStates is the daemon's provider: Publication (publication.h) answers the
// pending/deleted questions (LocalShardQuestions: the mount's observer, its dropped paths) and gives it the
// journal's outcomes (NoteDone), kept in a bounded record of the most recent `max_records`
// paths.
//
// Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/flush/block_crc_map.h"
#include "store/publish/journal.h"

namespace ckptfs::store {

enum class ShardState : uint8_t {
  kUnknown = 0,
  kPending = 1,
  kDurable = 2,
  kDropped = 3,
  kFailed = 4,
};
inline constexpr uint8_t kMaxShardState = 4;
const char* ShardStateName(ShardState s);

struct ShardStatus {
  ShardState state = ShardState::kUnknown;
  uint64_t length = 0;  // kDurable: the published size
  // kDurable, when the writer has them and the asker wants them: the shard's block CRCs.
  // Not part of the status's identity (operator==).
  std::shared_ptr<const ShardChecksums> checksums;
  bool operator==(const ShardStatus& o) const { return state == o.state && length == o.length; }
};

// One path's answer gathered from every peer (CommitQuerier): the most useful state any
// peer gave (durable > pending > dropped > failed > unknown) and whether some peer could
// not be asked (then "unknown" may only mean "the one who knows did not answer").
struct PeerShardAnswer {
  ShardStatus status;
  bool unreachable = false;
};

// Told that some path may have left kPending (ShardStateProvider::SetListener).
class ShardStateListener {
 public:
  // On the journal's thread, shortly; never under the provider's lock order with anything
  // else.
  virtual void OnShardStatesChanged() = 0;

 protected:
  ~ShardStateListener() = default;
};

class ShardStateProvider {
 public:
  virtual ~ShardStateProvider() = default;
  // In memory only: never touches the backing store, never waits for long (it may take
  // the namespace lock briefly).
  virtual ShardStatus Query(const std::string& path) = 0;
  // The block CRCs this node recorded while writing `path` (its latest published version),
  // or null. In memory only, like Query.
  virtual std::shared_ptr<const ShardChecksums> Checksums(const std::string& path) {
    (void)path;
    return nullptr;
  }
  // One listener (borrowed); null removes it, and returns only once no call to the old one
  // is running.
  virtual void SetListener(ShardStateListener* listener) = 0;
};

// Receives the answers of one commit-query round (PeerShardAsker), on the asker's thread.
class PeerShardAnswerSink {
 public:
  // `round` as given to AskShardStates; one answer per asked path, in order.
  virtual void OnPeerShardAnswers(uint64_t round, std::vector<PeerShardAnswer> answers) = 0;

 protected:
  ~PeerShardAnswerSink() = default;
};

// Asks the other daemons about shards written through their mounts (docs/PEERS.md, "Commit
// query"). store::peer::Peers implements it; the commit gate holds it.
class PeerShardAsker {
 public:
  // Asks about `paths` (relative to the backing root), each peer holding its answer up to
  // `hold` while a path is pending there; returns false if it cannot (not serving yet,
  // stopping). Else, later and exactly once, `sink` (must outlive the round) gets the
  // answers with `round`. Never blocks.
  virtual bool AskShardStates(std::vector<std::string> paths, std::chrono::milliseconds hold,
                              PeerShardAnswerSink* sink, uint64_t round) = 0;
  // The peers declared dead now (no authenticated connection for --peer-dead-after), for a
  // log line and a checkpoint's failure reason; empty when none. A shard that no live
  // node is writing or has published, and that the backing store does not show, belongs to
  // one of them: its commit is given up (docs/SEMANTICS.md, "A lost node").
  virtual std::string LostPeers() { return {}; }
  // AskShardStates, of the node that commits each path's checkpoint only (the node of DCP
  // rank 0, the coordinator that writes `.metadata`: the node that asked this one about
  // the checkpoint's shards, else the first node of the peer list, where a job usually
  // places rank 0). False when this node is that node, or it cannot ask.
  // One message per wait, not one per peer: at 1,000 nodes, every node asking every other
  // about each `.metadata` would be a million messages per save.
  virtual bool AskCoordinator(std::vector<std::string> paths, std::chrono::milliseconds hold,
                              PeerShardAnswerSink* sink, uint64_t round) {
    (void)paths, (void)hold, (void)sink, (void)round;
    return false;
  }

 protected:
  ~PeerShardAsker() = default;
};

// What the mount knows of a path, for LocalShardStates (Publication answers it).
class LocalShardQuestions {
 public:
  // Open for writing through this mount, or its publish queued and not yet done.
  virtual bool PendingLocally(const std::string& path) = 0;
  // Deleted through this mount before it was published.
  virtual bool DeletedLocally(const std::string& path) = 0;
  // Checkpoint `dir` was given up here (a lost node): its `.metadata` is answered failed, so
  // the nodes waiting for it learn it from the coordinator (CommitGate).
  virtual bool GivenUpLocally(const std::string& dir) {
    (void)dir;
    return false;
  }

 protected:
  ~LocalShardQuestions() = default;
};

class LocalShardStates : public ShardStateProvider {
 public:
  using ChecksumsFn = std::function<std::shared_ptr<const ShardChecksums>(const std::string&)>;
  // `local` may be null (nothing is pending or deleted here) and must outlive it.
  // `checksums` answers Checksums() (null: none); it must be in memory and quick.
  explicit LocalShardStates(LocalShardQuestions* local, size_t max_records = 65536,
                            ChecksumsFn checksums = nullptr)
      : local_(local), max_records_(max_records), checksums_(std::move(checksums)) {}
  LocalShardStates(const LocalShardStates&) = delete;
  LocalShardStates& operator=(const LocalShardStates&) = delete;

  ShardStatus Query(const std::string& path) override;
  std::shared_ptr<const ShardChecksums> Checksums(const std::string& path) override {
    return checksums_ ? checksums_(path) : nullptr;
  }
  void SetListener(ShardStateListener* listener) override EXCLUDES(listener_mu_);

  // The size `path` was published with through this mount, if it is in the record as
  // durable (no pending check).
  std::optional<uint64_t> Durable(const std::string& path) const EXCLUDES(mu_);

  // The journal's on_done, after the namespace has taken the outcome (so that a published
  // path is no longer pending when a listener re-asks).
  void NoteDone(const JournalEntry& e, const Status& st) EXCLUDES(mu_, listener_mu_);
  // Files whose publish died with an earlier run (LostPublishes): kFailed until this mount
  // writes, publishes, deletes or moves them again.
  void NoteLost(const std::vector<std::string>& paths) EXCLUDES(mu_);
  // Checkpoint `dir` committed (its `.metadata` applied here, or seen published by another
  // node): the records of the files below it, but its commit files, are forgotten. They
  // answered for that save; kept, they would vouch for it in the next save's commit query,
  // when another node may be writing the name (a rank placed elsewhere): "durable" from a
  // stale record outranks the writer's "pending".
  void Settled(const std::string& dir) EXCLUDES(mu_);

 private:
  struct Record {
    ShardStatus status;
    uint64_t stamp = 0;
  };
  void PutLocked(const std::string& path, ShardStatus status) REQUIRES(mu_);
  void EraseAtOrBelowLocked(const std::string& dir) REQUIRES(mu_);
  void SettledLocked(const std::string& dir) REQUIRES(mu_);

  LocalShardQuestions* const local_;
  const size_t max_records_;
  const ChecksumsFn checksums_;
  mutable Mutex mu_;
  std::map<std::string, Record> records_ GUARDED_BY(mu_);
  // (path, stamp) in insertion order; an entry whose stamp differs from the record's is
  // stale. Evicts the oldest beyond max_records.
  std::deque<std::pair<std::string, uint64_t>> order_ GUARDED_BY(mu_);
  uint64_t next_stamp_ GUARDED_BY(mu_) = 1;

  Mutex listener_mu_;
  ShardStateListener* listener_ GUARDED_BY(listener_mu_) = nullptr;
};

}  // namespace ckptfs::store
