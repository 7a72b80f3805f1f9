// Membership: which daemons make up the job and where each one listens now (issue 39,
// docs/PEERS.md, "Membership").
//
// A node's rank is its position in the peers list; the ownership plan, the stand-ins and
// the replica ring are computed from ranks, never from addresses, so a node that moves to
// a new address (a spare replacing a failed node, a pod rescheduled) keeps its rank and its
// share, and every node that learns the move routes to the new address. A change is made
// by the scheduler rewriting the peers file on every node (docs/integration.md); the
// daemon re-reads it (mount/peers_watch.h) and hands the new list to Update().
//
// What may change while daemons run: the address of any rank but this node's own. A list
// with another number of nodes (a join or a leave re-plans every checkpoint and moves the
// replica ring) is refused with a clear reason and the old membership is kept: that needs
// the daemons restarted with the new list. Nothing else is dropped on a refusal.
//
// Every accepted change bumps the epoch. Nodes that briefly disagree (one has read the new
// file, another not yet) never serve or accept a wrong byte: blocks are named by file
// version and checked by CRC, a peer is authenticated by the shared secret whatever its
// address, and a node that cannot reach a rank falls back to the stand-in or the backing
// store. Membership never widens trust.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"

namespace ckptfs::store::peer {

// The name of rank `rank` in the ownership plan and the stand-in rendezvous: the same on
// every node whatever the addresses, so that a node moving keeps its share.
inline std::string RankName(uint32_t rank) { return "rank-" + std::to_string(rank); }

// The ranks whose address an update changed, and the epoch it made.
struct MembershipChange {
  std::vector<uint32_t> moved;
  uint64_t epoch = 0;
};

struct MembershipView {
  std::vector<std::string> nodes;
  uint32_t self = 0;
  uint64_t epoch = 0;
  uint64_t updates = 0;   // accepted changes
  uint64_t rejected = 0;  // lists refused (the old membership kept)
  std::string last_rejection;
};

class Membership {
 public:
  Membership(std::vector<std::string> nodes, uint32_t self)
      : nodes_(std::move(nodes)), ranks_(RanksOf(nodes_)), self_(self) {}
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  uint32_t size() const { return static_cast<uint32_t>(size_); }
  uint32_t self() const { return self_; }
  // Where rank `rank` listens now.
  std::string Address(uint32_t rank) const EXCLUDES(mu_);
  // The rank listed at `address` now (a peer's node id), or nullopt. O(1): it is asked for
  // every shard query a peer sends.
  std::optional<uint32_t> RankOf(std::string_view address) const EXCLUDES(mu_);
  MembershipView View() const EXCLUDES(mu_);

  // Takes the scheduler's new list. Refused (the old one kept, `rejected` counted, the
  // reason kept for stats): another number of nodes, this node's own entry changed, an
  // empty or duplicate entry. An identical list changes nothing (no new epoch).
  Result<MembershipChange> Update(const std::vector<std::string>& nodes) EXCLUDES(mu_);
  // A list the caller could not even read or parse (an unreadable or malformed peers file):
  // counted and kept as the last rejection.
  void NoteRejected(const std::string& why) EXCLUDES(mu_);

 private:
  // Looked up by string_view without making a string (heterogeneous lookup).
  struct AddressHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using RankMap = std::unordered_map<std::string, uint32_t, AddressHash, std::equal_to<>>;
  static RankMap RanksOf(const std::vector<std::string>& nodes);

  mutable Mutex mu_;
  std::vector<std::string> nodes_ GUARDED_BY(mu_);
  RankMap ranks_ GUARDED_BY(mu_);  // address -> rank
  const size_t size_ = nodes_.size();
  const uint32_t self_;
  uint64_t epoch_ GUARDED_BY(mu_) = 1;
  uint64_t updates_ GUARDED_BY(mu_) = 0;
  uint64_t rejected_ GUARDED_BY(mu_) = 0;
  std::string last_rejection_ GUARDED_BY(mu_);
};

}  // namespace ckptfs::store::peer
