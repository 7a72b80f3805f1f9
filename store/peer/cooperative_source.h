// CooperativeSource: a BlockSource that reads each block of a planned checkpoint from the
// node that owns it (docs/PEERS.md, issue 12), so that across the cluster every byte leaves
// the shared file system once.
//
// Routing. Checkpoints are registered with their OwnershipPlan (SetPlan): every file of the
// checkpoint, by its path relative to the backing directory. A read of a block owned by
// another node is fetched from that node's PeerServer; a block this node owns, a file no
// plan covers, and every failure go to the `fallback` source (the backing store). A read
// never fails because of a peer.
//
// Failure handling. Connections are PeerLinks' (peer_links.h): made on demand, bounded,
// shared with the commit querier and the replicator, with one view of which peers are down.
// A peer that refuses the connection, drops it, times out or returns a bad checksum is
// skipped: the event is counted by kind and logged (warn on the first failure of a streak,
// debug after), and the peer is *down* for its pause: reads owned by it no longer wait on it.
// Such a read goes to the block's *stand-in*: of every node but the owner that this node
// does not see down (itself included), the one of highest rendezvous weight for (path,
// offset). Every survivor that sees the same nodes down picks the same stand-in, with no
// communication, so a dead owner's share is still read from the backing store once, spread
// over the survivors, instead of once per node. When the stand-in is this node, or fails
// too, the read goes to the fallback. The first read of a block a peer owns connects to it
// (once: concurrent reads share the connect); a peer in its pause costs a read nothing.
//
// Thread-safe. The destructor drops the links it made itself; no ReadBlock may be in
// progress once it runs.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/cache/block_source.h"
#include "store/peer/peer_client.h"
#include "store/peer/peer_links.h"
#include "store/peer/plan.h"

namespace ckptfs::store::peer {

struct CooperativeOptions {
  std::vector<std::string> nodes;  // "host:port" of every daemon, same order everywhere
  uint32_t self = 0;               // this node's index in `nodes`
  std::string secret;              // shared secret (ReadSecretFile)
  std::chrono::milliseconds connect_timeout{3000};
  std::chrono::milliseconds request_timeout{5000};
  std::chrono::milliseconds down_backoff{1000};      // first pause after a failure
  std::chrono::milliseconds max_down_backoff{30000};  // cap of the doubling pause
  // Links made by the source itself (no PeerLinks given): false runs no watcher thread
  // (tests drive it).
  bool connect_in_background = true;
  // A peer with no authenticated connection for this long is declared dead (docs/PEERS.md,
  // "A lost node"): what waits for it (a commit of its shards) is given up at once.
  std::chrono::milliseconds dead_after{10000};
  std::chrono::milliseconds heartbeat{2000};  // ping a link idle this long (peer_links.h)
  size_t max_links = 64;                      // open connections kept at most
};

// Why a read owned by a peer went to the fallback instead.
struct FallbackCounts {
  uint64_t peer_down = 0;      // the owner was not connected or in its backoff pause
  uint64_t timeout = 0;        // no reply within request_timeout
  uint64_t bad_checksum = 0;   // the reply's CRC32C did not match its bytes
  uint64_t connection = 0;     // connection lost (peer died, link cut)
  uint64_t error_reply = 0;    // the owner answered with an error (NotFound, stale, busy, ...)
  uint64_t total() const { return peer_down + timeout + bad_checksum + connection + error_reply; }
};

struct PeerState {
  std::string node;
  std::string state;  // unknown | up | down | dead (LinkStateName)
  bool connected = false;
  uint64_t fetched_bytes = 0;
  uint64_t failures = 0;     // fallbacks caused by this peer
  std::string last_error;    // empty when none yet
  bool dead = false;         // declared dead (no authenticated connection for dead_after)
};

struct CooperativeStats {
  uint32_t nodes = 0;
  uint32_t self = 0;
  uint32_t peers_connected = 0;
  uint32_t peers_dead = 0;
  uint64_t peer_bytes = 0;       // bytes fetched from owners
  uint64_t peer_blocks = 0;
  uint64_t local_owned_reads = 0;   // reads this node owns (went to the fallback by design)
  uint64_t stand_in_blocks = 0;     // blocks of a failed owner fetched from their stand-in
  uint64_t stand_in_local = 0;      // ... read here, this node being their stand-in
  uint64_t unplanned_reads = 0;     // reads of files no plan covers
  FallbackCounts fallbacks;
  std::vector<PeerState> peers;  // every node but self, in node order
  uint64_t declared_dead = 0;    // peers declared dead (each time)
  uint64_t revived = 0;          // ... that answered again at the same address: false positives
  PeerLinksStats links;          // connections: open, bound, connects, evictions, heartbeats
};

// Marks the reads of this thread, while it lives, as serving a peer's request: a
// CooperativeSource then reads locally whatever its plan says, so an owner never forwards a
// request (two daemons with different plans cannot bounce a block between them). The block
// cache reads a single-block ReadBlock() on the calling thread, so the mark reaches it.
class ServingScope {
 public:
  ServingScope();
  ~ServingScope();
  ServingScope(const ServingScope&) = delete;
  ServingScope& operator=(const ServingScope&) = delete;
  static bool Active();
};

class CooperativeSource : public BlockSource {
 public:
  // `links`: the daemon's shared links (must outlive); null: the source makes its own from
  // `options`.
  static Result<std::unique_ptr<CooperativeSource>> Create(const CooperativeOptions& options,
                                                           BlockSource* fallback,  // must outlive
                                                           PeerLinks* links = nullptr);
  ~CooperativeSource() override;
  CooperativeSource(const CooperativeSource&) = delete;
  CooperativeSource& operator=(const CooperativeSource&) = delete;

  // Registers (or replaces) the plan of checkpoint `ckpt` (relative to the backing dir,
  // "" for its root); `plan` names files relative to the checkpoint.
  void SetPlan(const std::string& ckpt, std::shared_ptr<const OwnershipPlan> plan)
      EXCLUDES(plans_mu_);
  bool HasPlan(const std::string& ckpt) const EXCLUDES(plans_mu_);

  // The owner of the block at `offset` of `path` (relative to the backing dir), or nullopt
  // when no plan covers it.
  std::optional<uint32_t> Owner(const std::string& path, uint64_t offset) const
      EXCLUDES(plans_mu_);

  // Fetches the block from its owner when that is another node. nullopt: read it locally
  // (this node owns it, no plan covers it, or the owner failed: counted and logged).
  std::optional<BlockRead> TryPeers(const BlockId& id, uint64_t offset, std::span<char> out);

  // The stand-in for the block at `offset` of `path` whose owner `owner` failed: the node
  // of highest rendezvous weight among all but `owner` and the peers this node sees down.
  uint32_t StandIn(const std::string& path, uint64_t offset, uint32_t owner);

  // TryPeers, else the fallback source.
  Result<BlockRead> ReadBlock(const BlockId& id, uint64_t offset, std::span<char> out) override;

  // Connects every peer that is not connected, now, on this thread (tests, bench; the
  // daemon connects on demand).
  void ConnectNow();

  // Rank `rank` listens at `address` from now on (a membership change): its connection is
  // dropped and the next read it owns connects to the new address. Reads in flight on the
  // old connection fail over to the stand-in or the backing store, as for a dead peer.
  void MoveNode(uint32_t rank, const std::string& address);

  CooperativeStats Stats() const;
  // Ranks declared dead now (docs/PEERS.md, "A lost node"), each with its address and how
  // long it has been silent. Also declares those whose silence reached dead_after.
  struct DeadPeer {
    uint32_t rank = 0;
    std::string address;
    double silent_s = 0;
  };
  std::vector<DeadPeer> DeadPeers();
  const CooperativeOptions& options() const { return options_; }
  PeerLinks* links() const { return links_; }

 private:
  struct Peer;
  CooperativeSource(const CooperativeOptions& options, BlockSource* fallback);
  bool Reachable(uint32_t node);  // not known down, not in a pause (self: true)
  // A read owned by a peer that failed: from the block's stand-in; nullopt: read locally.
  std::optional<BlockRead> TryStandIn(const BlockId& id, uint64_t offset, std::span<char> out,
                                      uint32_t owner);
  // Fetches from `node`; on failure counts it by kind, marks the peer failed, and nullopt.
  std::optional<BlockRead> Fetch(uint32_t node, const std::shared_ptr<PeerClient>& client,
                                 const BlockId& id, uint64_t offset, std::span<char> out);
  void PeerFailed(uint32_t node, const Status& status, const std::shared_ptr<PeerClient>& client);

  const CooperativeOptions options_;
  BlockSource* const fallback_;
  std::unique_ptr<PeerLinks> own_links_;  // when Create() got none
  PeerLinks* links_ = nullptr;
  std::vector<std::unique_ptr<Peer>> peers_;  // by node index; null for self: counters

  mutable Mutex plans_mu_;
  struct PlanRef {
    std::shared_ptr<const OwnershipPlan> plan;
    std::string file;  // name inside the checkpoint
  };
  // Backing path -> its plan; checkpoints registered, the newest kMaxPlans (a plan matters
  // while its load runs; kept for every checkpoint ever loaded, they grew the heap of a
  // peer daemon by kilobytes a save: the soak's leak bound, issue 41).
  static constexpr size_t kMaxPlans = 64;
  std::unordered_map<std::string, PlanRef> by_path_ GUARDED_BY(plans_mu_);
  std::unordered_map<std::string, std::shared_ptr<const OwnershipPlan>> by_ckpt_
      GUARDED_BY(plans_mu_);
  std::deque<std::string> plan_order_ GUARDED_BY(plans_mu_);  // by_ckpt_'s keys, oldest first

  std::atomic<uint64_t> peer_bytes_{0}, peer_blocks_{0}, local_owned_{0}, unplanned_{0};
  std::atomic<uint64_t> stand_in_{0}, stand_in_local_{0};
  std::vector<uint64_t> node_hash_;  // XXH3 of each rank's RankName, for StandIn
  std::atomic<uint64_t> fb_down_{0}, fb_timeout_{0}, fb_crc_{0}, fb_conn_{0}, fb_error_{0};
};

// The links a source makes for itself from its options.
PeerLinksOptions LinksOptionsFor(const CooperativeOptions& options);

}  // namespace ckptfs::store::peer
