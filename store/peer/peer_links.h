// PeerLinks: this daemon's connections to the other daemons, shared by everything in
// store/peer/ that talks to a peer: the block source (cooperative reads), the commit
// querier and the replicator (docs/PEERS.md, "Connections").
//
// On demand, bounded. Nothing connects at start-up: a link to rank r is made the first time
// a read, a commit query or the replicator needs r, and it is kept while it is used. At most
// `max_links` are kept open (default 64); making one more closes the least recently used
// (calls in flight on it finish first: it closes when the last returns), so a daemon's
// connections, UCX workers and threads stay bounded whatever the cluster's size, and a read
// is never refused for want of a slot. Concurrent callers for the same rank share one
// connect (single flight).
//
// Liveness. A rank is *down* from its first failure (no connection, the connection lost, a
// request or a heartbeat timed out, a bad checksum, the secret refused) until a connection
// to it authenticates again. After each failure it is paused (`down_backoff`, doubling to
// `max_down_backoff`): Get() returns null at once, so nothing waits on a node known to be
// down. A rank down for `dead_after` is declared *dead* (DeadPeers); one that authenticates
// again at the same address afterwards was a false positive (counted). A rank nobody has
// needed is *unknown*: neither up nor down, and it costs nothing.
//
// Heartbeat. A watcher thread pings (an empty commit query) every open link idle for
// `heartbeat`; no answer within `request_timeout` marks the rank down. So a hung daemon
// (SIGSTOP, a wedged host: its connection stays open) is down within heartbeat +
// request_timeout and dead `dead_after` later. The watcher also retries down ranks after
// their pause (so a node that comes back is up again without anyone waiting on it) and
// declares deaths. Only an authenticated member's silence counts: garbage from an
// unauthenticated sender never reaches a link.
//
// Thread-safe. The destructor joins the watcher and drops every link; no call may be in
// progress once it runs.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/peer/peer_client.h"

namespace ckptfs::store::peer {

struct PeerLinksOptions {
  std::vector<std::string> nodes;  // "host:port" of every daemon, same order everywhere
  uint32_t self = 0;               // this node's rank in `nodes`
  std::string secret;
  std::chrono::milliseconds connect_timeout{3000};
  std::chrono::milliseconds request_timeout{5000};
  std::chrono::milliseconds down_backoff{1000};       // first pause after a failure
  std::chrono::milliseconds max_down_backoff{30000};  // cap of the doubling pause
  std::chrono::milliseconds dead_after{15000};        // down this long: declared dead
  std::chrono::milliseconds heartbeat{2000};          // ping a link idle this long
  size_t max_links = 64;                              // open connections kept at most
  bool watch = true;  // false: no watcher thread (tests drive Watch() themselves)
};

enum class LinkState { kUnknown, kUp, kDown, kDead };
const char* LinkStateName(LinkState s);

struct LinkInfo {
  uint32_t rank = 0;
  std::string address;
  LinkState state = LinkState::kUnknown;
  bool open = false;         // a connection is held now
  double silent_s = 0;       // down or dead: for how long
  uint64_t failures = 0;     // failures reported (each one)
  std::string last_error;
};

struct PeerLinksStats {
  uint32_t open = 0;                 // connections held now
  uint32_t max_links = 0;
  uint64_t connects = 0;             // connections made (authenticated)
  uint64_t connect_failures = 0;
  uint64_t evicted = 0;              // closed as least recently used
  uint64_t heartbeats = 0;           // pings sent
  uint64_t heartbeat_failures = 0;   // pings unanswered in time
  uint64_t declared_dead = 0;        // ranks declared dead (each time)
  uint64_t revived = 0;              // ... that authenticated again at the same address
  uint32_t up = 0, down = 0, dead = 0;
  uint64_t pooled_bytes = 0;         // buffers the open links keep for reuse, in all
  std::vector<LinkInfo> links;       // every rank but self that is not unknown
};

class PeerLinks {
 public:
  static Result<std::unique_ptr<PeerLinks>> Create(const PeerLinksOptions& options);
  ~PeerLinks();
  PeerLinks(const PeerLinks&) = delete;
  PeerLinks& operator=(const PeerLinks&) = delete;

  // A connected, authenticated client for `rank`, or null: the rank is self, out of range,
  // in its pause after a failure, or the connect failed (reported, the rank is down).
  // With connect=false only an open link is returned (the caller never waits).
  std::shared_ptr<PeerClient> Get(uint32_t rank, bool connect = true) EXCLUDES(mu_);

  // A call on `client` (from Get(rank)) failed with `status`. Errors about the peer
  // (Timeout, Io, Corrupt, Permission) mark the rank down and pause it, and drop the link
  // when it is still `client` (Corrupt keeps it: one bad reply, the transport is fine).
  // Returns true for the first failure of a streak (the caller logs at warn then).
  bool Failed(uint32_t rank, const std::shared_ptr<PeerClient>& client, const Status& status)
      EXCLUDES(mu_);
  // A call on rank's link succeeded: the streak ends, the next pause starts short again.
  void Succeeded(uint32_t rank) EXCLUDES(mu_);

  // False when the rank is known down or dead (or out of range); unknown and up are true.
  // Every node that sees the same ranks down agrees on stand-ins (CooperativeSource).
  bool Reachable(uint32_t rank) const EXCLUDES(mu_);
  bool IsOpen(uint32_t rank) const EXCLUDES(mu_);

  // Rank `rank` listens at `address` from now on (membership.h): its link is dropped, the
  // next Get() connects there, with no pause carried over. A dead rank stays dead until it
  // answers; its answering then is a replacement, not a false positive.
  void MoveNode(uint32_t rank, const std::string& address) EXCLUDES(mu_);
  std::string AddressOf(uint32_t rank) const EXCLUDES(mu_);

  // Ranks declared dead now, each with its address and silence; declares first those whose
  // silence reached dead_after.
  struct Dead {
    uint32_t rank = 0;
    std::string address;
    double silent_s = 0;
  };
  std::vector<Dead> DeadPeers() EXCLUDES(mu_);

  // One round of the watcher: pings idle links, retries down ranks past their pause,
  // declares deaths. The watcher thread calls it every ~heartbeat/2 (tests call it).
  void Watch() EXCLUDES(mu_);
  // Connects every rank now (tests, bench): as many as max_links allows.
  void ConnectAll() EXCLUDES(mu_);

  PeerLinksStats Stats() const EXCLUDES(mu_);
  const PeerLinksOptions& options() const { return options_; }

 private:
  struct Link;
  explicit PeerLinks(const PeerLinksOptions& options);
  void Loop() EXCLUDES(stop_mu_);
  // Connects `rank` (single flight); the new client or null.
  std::shared_ptr<PeerClient> Connect(uint32_t rank) EXCLUDES(mu_);
  void MarkDownLocked(Link& link, const std::string& why) REQUIRES(mu_);
  // Closes least recently used links until fewer than max_links are open, sparing `keep`.
  void EvictLocked(uint32_t keep, std::vector<std::shared_ptr<PeerClient>>* closed)
      REQUIRES(mu_);

  const PeerLinksOptions options_;
  mutable Mutex mu_;
  std::condition_variable connected_cv_;  // a connect finished (single flight)
  std::vector<std::unique_ptr<Link>> links_ GUARDED_BY(mu_);  // by rank; null for self
  uint32_t open_ GUARDED_BY(mu_) = 0;
  uint64_t tick_ GUARDED_BY(mu_) = 0;  // LRU clock
  PeerLinksStats counters_ GUARDED_BY(mu_);  // the counters only

  Mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ GUARDED_BY(stop_mu_) = false;
  std::thread watcher_;
};

}  // namespace ckptfs::store::peer
