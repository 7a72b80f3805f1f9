// Replicas of the retained tier (issue 23): each node keeps a copy of the newest committed
// checkpoint share of the node before it on the ring, so a daemon started fresh on a
// replaced node reads its share from memory on a survivor instead of the backing store.
//
// Who holds whose copy. Node n's replica is held by ReplicaHolderOf(n) = (n + 1) mod N, over
// the peer list every daemon has in the same order: survivors agree on it without a message.
//
// Both directions ask for blocks "from memory only" (kRetainedOnlyPrefix, retained_tier.h):
// a peer that does not hold a block answers NotFound at once instead of reading it from the
// backing store, so replication and read-back never add backing-store reads.
//
// Replication is a pull over the existing block protocol (no new message). In the background,
// a Replicator thread of the holder H looks at the checkpoints its own tier holds committed
// (its ranks wrote shards of them; the lazy `.metadata` check runs here too), lists each one
// on the backing store and fetches, from its predecessor W, the blocks of the files W's ranks
// wrote (DCP `__<rank>_<n>.distcp`, writer node = rank * N / world as in the ownership plan's
// writer locality; `.metadata` with rank 0). W serves them from its tier through its block
// cache (no backing read while W holds them). Each block arrives with the transport's CRC32C
// checked and is kept by RetainedTier::PutReplica within H's own budget; a full budget stops
// the pull. A peer that dies mid-pull leaves only whole, checked blocks: nothing half-served.
//
// Reading. ReplicaSource sits between the tier's RetainedSource and the cooperative source: a
// read of a DCP file of this node's own share (the plan's owner is this node, or no plan
// covers it) while this node's tier holds no committed checkpoint of that run (it started
// fresh) asks this node's holder first; anything the holder cannot give (down, not
// connected, error, bad checksum) falls through to the cooperative source as before. Links
// are the daemon's PeerLinks (on demand, shared): a pull connects to the predecessor when it
// has something to pull, a cold read to the holder the first time it asks it (once, for all
// concurrent reads). A read made to serve a peer is never forwarded (ServingScope).
//
// Thread-safe. The destructor stops and joins the thread; no ReadBlock may be in progress.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/mutex.h"
#include "common/status.h"
#include "store/cache/block_source.h"
#include "store/cache/retained_tier.h"
#include "store/peer/cooperative_source.h"
#include "store/peer/peer_client.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store::peer {

inline uint32_t ReplicaHolderOf(uint32_t node, uint32_t nodes) {
  return nodes == 0 ? 0 : (node + 1) % nodes;
}

// The node whose ranks wrote `file` of a checkpoint saved by `world` ranks on `nodes` nodes
// (the writer-locality rule), or nullopt when the name says nothing.
std::optional<uint32_t> WriterNodeOf(const std::string& file, uint32_t world, uint32_t nodes);

struct ReplicatorOptions {
  std::vector<std::string> nodes;  // "host:port" of every daemon, same order everywhere
  uint32_t self = 0;
  std::string secret;
  uint64_t block_bytes = 1ull << 20;
  std::chrono::milliseconds connect_timeout{3000};
  std::chrono::milliseconds request_timeout{5000};
  std::chrono::milliseconds interval{300};  // between looks for new commits / reconnects
};

struct ReplicatorStats {
  uint64_t pulled_bytes = 0;         // replica bytes fetched from the predecessor
  uint64_t pulled_blocks = 0;
  uint64_t pull_failures = 0;        // fetches that failed (the pull is retried later)
  uint64_t pull_refused = 0;         // blocks the budget had no room for
  uint64_t checkpoints_replicated = 0;
  uint64_t holder_bytes = 0;         // own share read back from the holder
  uint64_t holder_blocks = 0;
  uint64_t holder_fallbacks = 0;     // holder asked, then the read went on elsewhere
  bool pred_connected = false, holder_connected = false;
  std::string last_checkpoint;
  void AppendJson(nlohmann::json* j) const;
};

class Replicator {
 public:
  // `tier`, `dir` and `coop` must outlive the replicator.
  static Result<std::unique_ptr<Replicator>> Create(const ReplicatorOptions& options,
                                                    RetainedTier* tier, BackingDir* dir,
                                                    CooperativeSource* coop);
  ~Replicator();  // Stop()
  Replicator(const Replicator&) = delete;
  Replicator& operator=(const Replicator&) = delete;

  // The block from this node's replica holder when it is connected; nullopt otherwise.
  std::optional<BlockRead> TryHolder(const BlockId& id, uint64_t offset, std::span<char> out)
      EXCLUDES(mu_);
  // Stops pulling and drops both connections (the daemon is stopping); TryHolder then gives
  // nothing. Idempotent.
  void Stop() EXCLUDES(mu_);
  // Rank `rank` listens at `address` from now on (a membership change): the shared links
  // (PeerLinks::MoveNode) reconnect there; this logs it and wakes the puller.
  void MoveNode(uint32_t rank, const std::string& address);
  ReplicatorStats Stats() const EXCLUDES(mu_);
  const ReplicatorOptions& options() const { return options_; }
  CooperativeSource* coop() const { return coop_; }

 private:
  Replicator(const ReplicatorOptions& options, RetainedTier* tier, BackingDir* dir,
             CooperativeSource* coop);
  void Loop() EXCLUDES(mu_);
  // Pulls the predecessor's share of committed checkpoint `dir`; true when complete.
  bool Pull(const std::string& dir) EXCLUDES(mu_);

  const ReplicatorOptions options_;
  RetainedTier* const tier_;
  BackingDir* const dir_;
  CooperativeSource* const coop_;
  const uint32_t pred_;    // whose replica this node holds
  const uint32_t holder_;  // who holds this node's replica
  PeerLinks* const links_;  // the daemon's (coop's): connections on demand, shared

  mutable Mutex mu_;
  std::condition_variable cv_;  // stop_ set; waited on with mu_
  bool stop_ GUARDED_BY(mu_) = false;
  std::set<std::string> done_ GUARDED_BY(mu_);  // checkpoints pulled completely
  ReplicatorStats stats_ GUARDED_BY(mu_);
  std::thread thread_;
};

// Tier (in front of it) → holder of this node's share when the tier is cold → `inner`.
class ReplicaSource final : public BlockSource {
 public:
  ReplicaSource(RetainedTier* tier, Replicator* replicator, BlockSource* inner)  // must outlive
      : tier_(tier), replicator_(replicator), inner_(inner) {}
  Result<BlockRead> ReadBlock(const BlockId& id, uint64_t offset, std::span<char> out) override;

 private:
  RetainedTier* const tier_;
  Replicator* const replicator_;
  BlockSource* const inner_;
};

}  // namespace ckptfs::store::peer
