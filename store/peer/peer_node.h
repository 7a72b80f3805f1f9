// PeerNode: the daemon's part in a cluster of ckptfs daemons over UCX (issue 12,
// docs/PEERS.md); the daemon holds it as a Peers (peers.h), made by Peers::Create.
//
// It ties the pieces of store/peer/ to the daemon's block cache:
//   * source(): a CooperativeSource, the block cache's source of misses. It fetches blocks
//     owned by other nodes from them and reads the rest, and every failure, from the
//     `fallback` source (the backing store), so local readers, prefetch and the peer fetch
//     share the cache's single flight;
//   * a PeerServer that serves this node's blocks to authenticated peers, reading through the
//     block cache (ReadBlock) under a ServingScope, so remote and local readers share one
//     flight and an owner always reads its blocks from the backing store itself;
//   * PlanCheckpoint(): the ownership plan of a committed checkpoint from its `.metadata`,
//     built identically on every node, with this node's share returned for prefetch.
//
// Locality (own-shard loads must not get slower). DCP names the file each rank writes
// `__<rank>_<n>.distcp`. With `writer_locality`, an item of such a file is planned with the
// node that hosts its writer rank as its only reader (ranks spread contiguously over the
// nodes: node = rank * nodes / world, world = 1 + the highest rank seen), so when every rank
// loads what it saved, each node owns exactly the bytes its ranks read and nothing crosses
// the network, as without peers. When that assignment is lopsided (max/mean node bytes above
// `locality_max_imbalance`, e.g. a checkpoint saved by one rank) it is dropped and the
// plan balances all items over all nodes.
//
// A peer's request for a block of a checkpoint this node has not planned yet means a load
// has started elsewhere: a PeerNode thread then reads that checkpoint's `.metadata`, plans
// it and prefetches this node's share (only that: nobody here is loading it).
//
// Thread-safe. StopServing() must run before the block cache is destroyed; the PeerNode
// must outlive the cache (the cache reads through source()).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/cache/block_cache.h"
#include "store/cache/block_source.h"
#include "store/dcp/dcp_metadata.h"
#include "store/peer/commit_query.h"
#include "store/peer/cooperative_source.h"
#include "store/peer/coordinators.h"
#include "store/peer/membership.h"
#include "store/peer/memory_replica.h"
#include "store/peer/peer_links.h"
#include "store/peer/peer_server.h"
#include "store/peer/peers.h"
#include "store/peer/plan.h"
#include "store/peer/replica.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store::peer {

struct PeerNodeStats {
  CooperativeStats coop;
  PeerServerStats server;
  MembershipView membership;
  std::string listen;  // the address actually listened on
  uint64_t plans = 0;  // plans built
  double last_plan_ms = 0;
  std::string last_plan_ckpt, last_plan_mode;
  bool last_plan_locality = false;  // writer locality used
  double last_plan_max_over_mean = 0;
  uint64_t last_plan_owned_bytes = 0;  // this node's share of the last plan

  // Top-level fields for /.ckptfs/stats (peers_connected, peer_bytes_read, peer_fallbacks,
  // peer_bytes_served, ...; flat so metrics can export them) plus a "peers" object with
  // the detail: per-peer state, fallbacks by kind, the last plan.
  void AppendJson(nlohmann::json* j) const;
};

class PeerNode : public Peers {
 public:
  static Result<std::unique_ptr<PeerNode>> Create(const PeerNodeOptions& options,
                                                  BackingDir* dir,          // must outlive
                                                  BlockSource* fallback);  // must outlive
  ~PeerNode() override;
  PeerNode(const PeerNode&) = delete;
  PeerNode& operator=(const PeerNode&) = delete;

  // The block cache's source: blocks owned elsewhere from their owner, the rest from the
  // fallback.
  BlockSource* source() const override { return coop_.get(); }

  // Starts the PeerServer, reading through `cache` (must outlive StopServing()).
  Status StartServing(BlockCache* cache) override;
  // Stops serving (closes peer connections, joins the server and the planner). Idempotent.
  void StopServing() override EXCLUDES(planner_mu_);

  // Plans checkpoint `ckpt` (relative to the backing dir) from its parsed `.metadata`;
  // `files` are its data files (name in the checkpoint, BlockId now). Returns this node's
  // share. A plan already built for the same file versions is reused.
  Result<std::vector<OwnedRange>> PlanCheckpoint(
      const std::string& ckpt, const DcpMetadata& metadata,
      const std::vector<std::pair<std::string, BlockId>>& files) override EXCLUDES(mu_);

  PeerNodeStats Stats() const EXCLUDES(mu_, members_mu_);
  // The scheduler's new peer list (membership.h): ranks that moved are reached at their new
  // address by the block source, the commit querier and the replicator, and the server
  // accepts them there. Refused (the old membership kept) as Membership::Update says.
  Status UpdateMembership(const std::vector<std::string>& nodes) override EXCLUDES(members_mu_);
  void NoteMembershipRejected(const std::string& why) override { membership_.NoteRejected(why); }
  void AppendStats(nlohmann::json* stats) const override;
  const PeerNodeOptions& options() const { return options_; }

  // Replicas of the retained tier (replica.h): a Replicator and the ReplicaSource before
  // `fallback`.
  Result<BlockSource*> StartReplicas(RetainedTier* tier, uint64_t block_bytes,
                                     BlockSource* fallback) override;
  void StopReplicas() override;
  // Memory-only checkpoints (memory_replica.h): requests under kMemoryPrefix are served
  // from the tier and the replicas, never through the cache.
  Status StartMemoryReplicas(MemoryTier* tier, const std::string& state_dir) override;
  void StopMemoryReplicas() override;

  // ---- Commit queries (docs/PEERS.md, "Commit query"; commit_query.h). A separate block.
  // The server answers peers' shard-state queries from `provider` (must outlive
  // StopServing()). Call before StartServing(); without it queries get Unsupported.
  void SetShardStateProvider(ShardStateProvider* provider) override { shard_states_ = provider; }
  // Asks every other node about `paths` (relative to the backing dir), asynchronously:
  // `sink` gets the answers once, on the querier's thread (commit_query.h). False: not
  // serving yet (StartServing), or stopped; not asked.
  bool AskShardStates(std::vector<std::string> paths, std::chrono::milliseconds hold,
                      PeerShardAnswerSink* sink, uint64_t round) override EXCLUDES(querier_mu_);
  std::string LostPeers() override;
  bool AskCoordinator(std::vector<std::string> paths, std::chrono::milliseconds hold,
                      PeerShardAnswerSink* sink, uint64_t round) override EXCLUDES(querier_mu_);

 private:
  ShardStateProvider* shard_states_ = nullptr;
  Mutex querier_mu_;
  std::unique_ptr<CommitQuerier> querier_ GUARDED_BY(querier_mu_);  // made on first use
  bool asking_ GUARDED_BY(querier_mu_) = false;  // StartServing() succeeded
  CommitQuerier* QuerierLocked() REQUIRES(querier_mu_);  // made on first use
  CheckpointCoordinators coordinators_;  // who commits which checkpoint (AskCoordinator)
  // ---- end of the commit-query block.

  class ServingSource;
  PeerNode(const PeerNodeOptions& options, BackingDir* dir);
  // Queues `ckpt` for the planner thread (a peer asked for one of its blocks).
  void LoadStartedElsewhere(const std::string& ckpt) EXCLUDES(planner_mu_);
  void PlannerLoop() EXCLUDES(planner_mu_);
  // Plans `ckpt` from its .metadata and prefetches this node's share into the cache.
  void PrefetchOwnShare(const std::string& ckpt);

  const PeerNodeOptions options_;
  BackingDir* const dir_;
  std::atomic<RetainedTier*> tier_{nullptr};  // StartReplicas: checkpoints held in memory
  std::unique_ptr<PeerLinks> links_;  // before coop_, querier_, replicator_: they use it
  std::unique_ptr<CooperativeSource> coop_;
  std::unique_ptr<ServingSource> serving_source_;
  Membership membership_;
  // Serializes membership changes with the server's start and stop.
  mutable Mutex members_mu_;
  std::unique_ptr<PeerServer> server_;  // written under members_mu_
  BlockCache* cache_ = nullptr;  // set by StartServing
  std::unique_ptr<Replicator> replicator_;       // StartReplicas
  std::unique_ptr<ReplicaSource> replica_source_;
  std::unique_ptr<MemoryReplicator> memory_replicator_;  // StartMemoryReplicas
  std::atomic<MemoryReplicator*> memory_serving_{nullptr};  // what the server asks

  Mutex planner_mu_;
  std::condition_variable planner_cv_;
  std::vector<std::string> planner_queue_ GUARDED_BY(planner_mu_);
  // Queued once each; forgotten past kMaxSeen (a checkpoint queued again is planned
  // again only if it has no plan).
  static constexpr size_t kMaxSeen = 1024;
  std::set<std::string> planner_seen_ GUARDED_BY(planner_mu_);
  bool planner_stop_ GUARDED_BY(planner_mu_) = false;
  std::thread planner_;

  mutable Mutex mu_;
  struct Planned {
    std::vector<std::pair<std::string, BlockId>> files;
    std::vector<OwnedRange> owned;
  };
  // The newest kMaxPlanned plans (as CooperativeSource keeps its own), oldest first in
  // planned_order_.
  static constexpr size_t kMaxPlanned = 64;
  std::map<std::string, Planned> planned_ GUARDED_BY(mu_);
  std::deque<std::string> planned_order_ GUARDED_BY(mu_);
  PeerNodeStats plan_stats_ GUARDED_BY(mu_);  // the plan fields only
};

// The writer rank of a DCP data file named "__<rank>_<n>.distcp", or nullopt.
std::optional<uint32_t> DcpWriterRank(std::string_view file);

}  // namespace ckptfs::store::peer
