// Replicas of memory-only checkpoints (issue 42; docs/SEMANTICS.md, "Memory-only
// directories"): with --peers, a memory-only checkpoint is committed when every file of it is
// in memory on its writer node and one peer holds a copy, so that a daemon restarted on the
// same node, or the node that replaces it, gets it back.
//
// Who holds it. The writer (rank w) hands each unit (a checkpoint directory once its
// `.metadata` names only files that are here, or a tracker on its close) to the first node
// of w+1, w+2, ... (mod N) over the peers list that is reachable now (PeerLinks): the next
// node when it is up, as the retained tier's ring (replica.h), and the one after it when not.
// A unit no node takes stays uncommitted ("unreplicated") and the older checkpoints stay.
//
// The wire is the block protocol over the daemon's PeerLinks (no new message, no new
// connection): requests for names under `.ckptfs-memory/` are answered by Serve() from
// memory, never from the backing store or the block cache. Names are hex ("x" + hex bytes)
// per component; the version (seq) travels in the request's mtime field.
//   pull/<origin>/<tree>/<path>/<c|t>   the writer asks the holder to take a unit: "P" while
//                                       the holder pulls it, "D" once it holds it whole, an
//                                       error (kNoSpace, ...) when it could not
//   list/<tree>/<path>                  the writer's manifest of a unit (JSON, paged)
//   file/<tree>/<path>/<file>           the writer's bytes of one file of it
//   index/<origin>                      what the holder keeps for rank origin (JSON, paged)
//   replica/<origin>/<tree>/<path>/<file>  the holder's bytes of one file of a replica
// The holder checks every file against the manifest's CRC32C (each block also carries the
// transport's), and keeps a unit only whole (store/memory/memory_replicas.h), in its own
// --memory-ckpt-mem. The writer polls "pull" until "D", then commits (MemoryTier::HandedOver).
//
// Still held. Every verify_interval while idle, the writer asks its committed checkpoints'
// holders again ("pull" answers "D" at once when held): a holder that restarted, and so lost
// its copy, takes it again, or the next node up does (the holder is updated, the record
// rewritten). So a holder's restart leaves a checkpoint single-copy for a few seconds only.
// A checkpoint no node took (unreplicated) is offered again the same way, and commits once a
// node takes it.
//
// Restart. Create() starts a restore: the tier's trees wait (MemoryTier::restore_gate()) while
// this node asks for the units kept for its rank: the holders its record names, and the ring
// (rank+1, rank+2, rank+3) up to the first node that answers, never every node (G12). It
// rebuilds each tree's newest checkpoint and the trackers. The checkpoints this node had
// committed are recorded in `<state_dir>/memory_checkpoints.json` (rewritten when they
// change); one that no peer gave back is reported lost (MemoryTier::NoteLost: state, log
// line, counter). A replaced node (new state dir) gets its units back the same way; it has
// no record, so it reports nothing lost. A daemon without a budget for memory-only
// checkpoints (--memory-ckpt-mem 0) runs none of this (fs/filesystem.cc): it neither
// restores nor holds replicas (PeerNode refuses them with kNoSpace; the writer tries the next
// node).
//
// Thread-safe. Two threads: one for this node's own units (restore, then hand-overs) and one
// for the pulls it makes as a holder, so two nodes handing units to each other never wait on
// each other. Stop() (the destructor) joins them; Serve() must not be called after it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/mutex.h"
#include "common/status.h"
#include "store/cache/block_source.h"
#include "store/memory/memory_parts.h"
#include "store/memory/memory_replicas.h"
#include "store/memory/memory_tier.h"
#include "store/peer/peer_links.h"

namespace ckptfs::store::peer {

inline constexpr std::string_view kMemoryPrefix = ".ckptfs-memory/";

struct MemoryReplicatorOptions {
  uint32_t self = 0;
  uint32_t nodes = 0;
  uint64_t block_bytes = 1ull << 20;   // bytes per request
  std::string state_dir;               // where the record of committed checkpoints lives
  std::chrono::milliseconds poll{50};  // the writer's look at a pull
  std::chrono::milliseconds replicate_timeout{300000};  // a holder that takes longer: the next
  std::chrono::milliseconds hand_over_wait{30000};      // no node up this long: not committed
  std::chrono::milliseconds verify_interval{5000};      // idle: are the committed ones still held?
};

struct MemoryReplicatorStats {
  uint64_t handed = 0;         // units a peer took
  uint64_t hand_failures = 0;  // hand-overs a peer refused or did not finish
  uint64_t pulled_units = 0;   // units this node took as a holder
  uint64_t pulled_bytes = 0;
  uint64_t pull_failures = 0;
  uint64_t restored_units = 0;
  uint64_t restored_bytes = 0;
  uint64_t restore_failures = 0;
  uint64_t verify_failures = 0;  // checks of a committed checkpoint no node answered
  double restore_s = 0;          // how long the restore at start took
  bool restoring = false;
};

class MemoryReplicator final : public MemoryReplication {
 public:
  // `tier` and `links` must outlive the replicator. Starts the restore.
  static Result<std::unique_ptr<MemoryReplicator>> Create(const MemoryReplicatorOptions& options,
                                                          MemoryTier* tier, PeerLinks* links);
  ~MemoryReplicator() override;
  MemoryReplicator(const MemoryReplicator&) = delete;
  MemoryReplicator& operator=(const MemoryReplicator&) = delete;

  // Unsets the tier's replication, stops and joins both threads. Idempotent.
  void Stop() EXCLUDES(mu_);
  // MemoryReplication: queues the unit (runs under the tier's lock).
  void Replicate(const std::string& tree, const std::string& path, bool checkpoint,
                 uint64_t seq) override EXCLUDES(mu_);
  // Checkpoints written through several nodes (store/memory/memory_parts.h; memory_gather.cc).
  void Gather(const std::string& tree, const std::string& path, uint64_t seq) override
      EXCLUDES(mu_);
  void MirrorDir(const std::string& tree, const std::string& path) override EXCLUDES(mu_);
  void MirrorRmdir(const std::string& tree, const std::string& path) override EXCLUDES(mu_);
  void MirrorRename(const std::string& tree, const std::string& from, const std::string& to)
      override EXCLUDES(mu_);
  Result<size_t> ReadRemote(const MemRemoteFile& f, char* out, size_t len, uint64_t offset) override
      EXCLUDES(mu_);
  // A peer's request for a name under kMemoryPrefix.
  Result<BlockRead> Serve(const BlockId& id, uint64_t offset, std::span<char> out) EXCLUDES(mu_);
  // "memory_replication" in /.ckptfs/stats, beside the tier's "memory_ckpt".
  void AppendJson(nlohmann::json* j) const EXCLUDES(mu_);

 private:
  struct Job {
    uint32_t origin = 0;
    std::string tree, path;
    bool checkpoint = true;
    uint64_t seq = 0;
    bool verify = false;  // a check that a committed checkpoint is still held
    // kGather (own): gather the parts of a checkpoint written through several nodes;
    // kApply (pulls): one the node `origin` committed, applied here.
    enum Kind { kHand, kGather, kApply } kind = kHand;
  };
  struct Recorded {  // a committed checkpoint of a tree, as the record keeps it
    std::string path;
    uint64_t seq = 0;
    std::string holder;
    // Written through several nodes: the other nodes are told of its commit again while
    // idle (a node restarted since gets its part committed and the others' files listed).
    bool parts = false;
    std::vector<uint32_t> part_ranks;  // the other nodes that wrote parts of it
  };
  using PullKey = std::tuple<uint32_t, std::string, std::string, uint64_t>;
  struct PullState {
    bool done = false;
    Status failed;  // not ok: the pull failed
  };

  MemoryReplicator(const MemoryReplicatorOptions& options, MemoryTier* tier, PeerLinks* links);
  void OwnLoop() EXCLUDES(mu_);
  void PullLoop() EXCLUDES(mu_);
  // One job of this node's own queue: a hand-over (and what follows it), or a gather.
  void RunOwn(const Job& job) EXCLUDES(mu_);
  // Hands `job` to a holder; the holder's address once it holds it whole.
  Result<std::string> HandOver(const Job& job) EXCLUDES(mu_);
  // As a holder: takes `job`'s unit from its origin.
  Status Pull(const Job& job) EXCLUDES(mu_);
  void Restore() EXCLUDES(mu_);
  // Rebuilds `unit` from `rank`'s replica; the bytes restored.
  Result<uint64_t> RestoreUnit(uint32_t rank, const MemUnit& unit) EXCLUDES(mu_);
  // Every byte of `name` from `rank`, paged.
  Result<std::string> FetchAll(uint32_t rank, const std::string& name, uint64_t seq);
  Result<size_t> Fetch(uint32_t rank, const std::string& name, uint64_t seq, uint64_t offset,
                       std::span<char> out);
  void WriteRecord() EXCLUDES(mu_);
  // Whether `tracker` names a checkpoint of its tree that is not committed yet (G4 on the
  // replica: the tracker is not handed over then).
  bool NamesUncommitted(const Job& tracker);
  bool Stopping() const EXCLUDES(mu_);
  // memory_gather.cc: the requests mkdir/, rmdir/, rename/, part/, done/, lost/ and whole/
  // (nullopt: not one).
  std::optional<Result<BlockRead>> ServeParts(const std::vector<std::string_view>& parts,
                                              uint64_t seq, uint64_t offset, std::span<char> out)
      EXCLUDES(mu_);
  void GatherParts(const Job& job) EXCLUDES(mu_);
  Status ApplyFrom(const Job& job) EXCLUDES(mu_);
  // Asks every other node `verb`/<tree>/<path>[/<to>] (mkdir/, rmdir/, rename/), kFanOutWidth
  // at a time (common/fan_out.h), waiting at most kMirrorWait in all for nodes down; a node
  // that did not answer is logged (`failed`, and `meaning`: what that leaves there).
  void AskEveryNode(const char* verb, const std::string& tree, const std::string& path,
                    const char* failed, const char* meaning, const std::string& to = "")
      EXCLUDES(mu_);
  // Directory `from` of `tree` is `to` now, here or on another node: the replicas held below
  // it and the record of committed checkpoints follow.
  void Renamed(const std::string& tree, const std::string& from, const std::string& to)
      EXCLUDES(mu_);
  void TellCommitted(const std::string& tree, const std::string& path, uint64_t seq);
  // Checkpoint `path` committed at `seq` is lost here (a part gone from its writer and its
  // holder): every other node drops what it holds of it (its part, its listing), so none
  // keeps a piece of it in memory or lists it. A node down or restoring is asked again
  // until hand_over_wait; one down longer keeps its part until the tree's next commit
  // evicts it (never served: its listing came from this node's commit notice).
  void TellLost(const std::string& tree, const std::string& path, uint64_t seq);
  // While idle: is every other part of committed `tree`/`r` still held by its writer or its
  // holder? A part gone from both loses the checkpoint here (MemoryParts::Lose).
  bool PartsStillHeld(const std::string& tree, const Recorded& r) EXCLUDES(mu_);
  // Fetch, tried again while `rank` is down or paused after a failure (a daemon starting,
  // a link made again), until `until`.
  Result<size_t> FetchRetrying(uint32_t rank, const std::string& name, uint64_t seq,
                               std::span<char> out, std::chrono::steady_clock::time_point until)
      EXCLUDES(mu_);
  std::optional<uint32_t> RankOf(const std::string& address) const;

  const MemoryReplicatorOptions options_;
  MemoryTier* const tier_;
  PeerLinks* const links_;
  MemoryReplicas replicas_;
  MemoryParts parts_;

  mutable Mutex mu_;
  std::condition_variable cv_;  // a job queued, or stop_; waited on with mu_
  bool stop_ GUARDED_BY(mu_) = false;
  std::deque<Job> own_ GUARDED_BY(mu_);    // this node's units to hand over
  std::deque<Job> pulls_ GUARDED_BY(mu_);  // units to take as a holder
  std::map<PullKey, PullState> pull_states_ GUARDED_BY(mu_);
  MemoryReplicatorStats stats_ GUARDED_BY(mu_);
  std::map<std::string, Recorded> record_ GUARDED_BY(mu_);  // by tree: its newest committed
  std::thread own_thread_, pull_thread_;
};

}  // namespace ckptfs::store::peer
