// Peers: what the daemon (fs/, mount/) holds of its cluster of ckptfs daemons (issue 12,
// docs/PEERS.md). fs/ and mount/ see this interface and the options below only, never the
// transport: the UCX implementation (PeerNode, peer_node.h) is chosen by Peers::Create, the
// one place that knows whether this ckptfs was built with it.
//
//   * source(): the block cache's source of misses. Blocks owned by other nodes come from
//     them; the rest, and every peer failure, from the `fallback` given to Create.
//   * StartServing()/StopServing(): serve this node's blocks (and commit queries) to peers.
//   * PlanCheckpoint(): the ownership plan of a committed checkpoint, with this node's share.
//   * AskShardStates(): the commit gate's questions about shards written through other mounts.
//
// Thread-safe. StopServing() must run before the block cache is destroyed; the Peers must
// outlive the cache (the cache reads through source()).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "store/cache/block_source.h"
#include "store/dcp/dcp_metadata.h"
#include "store/peer/plan.h"
#include "store/publish/shard_state.h"

namespace ckptfs::store {
class BackingDir;
class BlockCache;
class MemoryTier;
class RetainedTier;
}  // namespace ckptfs::store

namespace ckptfs::store::peer {

struct PeerNodeOptions {
  std::vector<std::string> nodes;  // "host:port" of every daemon, same order everywhere
  uint32_t self = 0;               // this node's index (--node-rank)
  std::string listen;              // ADDR:PORT the server binds (--peer-listen)
  std::string secret;              // shared secret bytes (--peer-secret-file)
  PlanMode plan_mode = PlanMode::kAuto;
  uint64_t block_bytes = 1ull << 20;  // must equal the block cache's
  bool writer_locality = true;
  double locality_max_imbalance = 1.5;
  bool check_source_address = true;
  std::chrono::milliseconds connect_timeout{3000};
  std::chrono::milliseconds request_timeout{5000};
  // No authenticated connection for this long: the peer is declared dead (a lost node).
  std::chrono::milliseconds dead_after{15000};
  // Connections (peer_links.h): a link idle this long is pinged; at most max_links open.
  std::chrono::milliseconds heartbeat{2000};
  size_t max_links = 64;
};

// This node's share of a planned checkpoint: byte ranges of its files (relative to the
// checkpoint), block aligned, merged.
struct OwnedRange {
  std::string file;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// Ok when this ckptfs has the peer transport; Unsupported, naming what it was built
// without, when not.
Status PeerTransportAvailable();

// Reads the shared secret: the file's bytes without trailing whitespace, kMinSecretBytes to
// kMaxSecretBytes long (protocol.h). Warns (once per call) when the file is readable by
// group or others.
Result<std::string> ReadSecretFile(const std::string& path);

class Peers : public PeerShardAsker {
 public:
  // The UCX peer node; Unsupported (PeerTransportAvailable) when built without it.
  static Result<std::unique_ptr<Peers>> Create(const PeerNodeOptions& options,
                                               BackingDir* dir,         // must outlive
                                               BlockSource* fallback);  // must outlive
  virtual ~Peers() = default;

  // The block cache's source: blocks owned elsewhere from their owner, the rest from the
  // fallback.
  virtual BlockSource* source() const = 0;

  // The server answers peers' shard-state queries from `provider` (must outlive
  // StopServing()). Call before StartServing(); without it queries get Unsupported.
  virtual void SetShardStateProvider(ShardStateProvider* provider) = 0;
  // Serves this node's blocks, reading through `cache` (must outlive StopServing()).
  virtual Status StartServing(BlockCache* cache) = 0;
  // Stops serving (closes peer connections, joins the server's threads). Idempotent.
  virtual void StopServing() = 0;

  // Plans checkpoint `ckpt` (relative to the backing dir) from its parsed `.metadata`;
  // `files` are its data files (name in the checkpoint, BlockId now). Returns this node's
  // share. A plan already built for the same file versions is reused.
  virtual Result<std::vector<OwnedRange>> PlanCheckpoint(
      const std::string& ckpt, const DcpMetadata& metadata,
      const std::vector<std::pair<std::string, BlockId>>& files) = 0;

  // As a PeerShardAsker (store/publish/shard_state.h; the commit gate holds it), a Peers
  // asks every other node about shards once this node serves (StartServing), and refuses
  // (false) before that and once stopped.

  // Adds the peer statistics to /.ckptfs/stats: flat top-level fields (peers_connected,
  // peer_bytes_read, peer_fallbacks, ...) and a "peers" object with the detail.
  virtual void AppendStats(nlohmann::json* stats) const = 0;

  // Replicas of the retained tier (issue 23; docs/PEERS.md, "Replicas"): pulls the previous
  // node's committed share into `tier` (must outlive StopReplicas()) and returns the source
  // that serves this node's own share from its replica holder before `fallback` (must
  // outlive StopReplicas()). The tier's stats gain the replicator's. Once per node.
  virtual Result<BlockSource*> StartReplicas(RetainedTier* tier, uint64_t block_bytes,
                                             BlockSource* fallback) = 0;
  // Stops the replicator (joins its thread). Idempotent; nothing to do without replicas.
  virtual void StopReplicas() = 0;
  // Replicas of memory-only checkpoints (issue 42; memory_replica.h): a checkpoint of
  // `tier` (must outlive StopMemoryReplicas()) commits once a peer holds it, and what peers
  // keep for this node comes back now (a restart); `state_dir` keeps the record of what was
  // committed. Call before StartServing(). Once per node.
  virtual Status StartMemoryReplicas(MemoryTier* tier, const std::string& state_dir) = 0;
  // Stops them (joins their threads). Idempotent. After StopServing().
  virtual void StopMemoryReplicas() = 0;
  // Membership (docs/PEERS.md, "Membership"): the scheduler's new peer list, re-read from
  // --peers-file. A rank may move to a new address; anything else is refused with the
  // reason, the old membership kept and the refusal counted.
  virtual Status UpdateMembership(const std::vector<std::string>& nodes) = 0;
  // A new list that could not be read or parsed: counted and shown with the membership.
  virtual void NoteMembershipRejected(const std::string& why) = 0;
};

}  // namespace ckptfs::store::peer
