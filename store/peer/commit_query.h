// CommitQuerier: the asking side of the commit query (docs/PEERS.md, "Commit query").
//
// The commit gate of a node about to publish a `.metadata` asks, through Ask(), what the
// other daemons know about the shards it still waits for. A round sends one kAmShardQuery
// to every other node at once (any rank may write any shard, so every node is asked; the
// messages are small) and gathers the answers per path: the most useful state any peer gave
// (durable, with the largest length, > pending > dropped > failed > unknown) and whether some
// peer could not be asked (not connectable, in its pause after a failure, timed out, lost,
// or it answered with an error). Peers hold their answer while a path is pending there
// (long-poll, `hold`), so a round ends about when a pending shard becomes durable.
//
// Rounds run one at a time on the querier's own thread, over the daemon's PeerLinks
// (connections on demand, bounded, shared with reads; a peer that fails is skipped for its
// pause, and its silence counts towards declaring it dead). A round asks `ranks` when the
// caller names them (the nodes whose ranks wrote the paths), else every other node. `done` runs on that thread, exactly once per accepted Ask(): with the
// answers, or, when the querier stops first, with every path unreachable.
//
// Thread-safe. The destructor stops and joins the thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/peer/peer_client.h"
#include "store/peer/peer_links.h"
#include "store/publish/shard_state.h"

namespace ckptfs::store::peer {

struct CommitQueryOptions {
  std::vector<std::string> nodes;  // "host:port" of every daemon, same order everywhere
  uint32_t self = 0;
  std::string secret;
  std::chrono::milliseconds connect_timeout{3000};
  std::chrono::milliseconds request_timeout{5000};  // on top of the hold
  std::chrono::milliseconds down_backoff{5000};
};

struct CommitQueryStats {
  uint64_t rounds = 0;
  uint64_t peer_errors = 0;  // a peer not asked or not answering in a round
};

class CommitQuerier {
 public:
  // `links`: the daemon's (must outlive); null: the querier makes its own (no watcher).
  explicit CommitQuerier(CommitQueryOptions options, PeerLinks* links = nullptr);
  ~CommitQuerier();
  CommitQuerier(const CommitQuerier&) = delete;
  CommitQuerier& operator=(const CommitQuerier&) = delete;

  // Queues a round about `paths`; `sink` (must outlive the round) gets its answers with
  // `round`, on the querier's thread. False (sink is not called) once stopping.
  bool Ask(std::vector<std::string> paths, std::chrono::milliseconds hold,
           PeerShardAnswerSink* sink, uint64_t round, std::vector<uint32_t> ranks = {})
      EXCLUDES(mu_);
  CommitQueryStats Stats() const EXCLUDES(mu_);

  // How one path's answers from several peers combine (exposed for tests).
  static void Merge(const ShardStatus& from_peer, PeerShardAnswer* into);

 private:
  struct Job {
    std::vector<std::string> paths;
    std::chrono::milliseconds hold{0};
    PeerShardAnswerSink* sink = nullptr;
    uint64_t round = 0;
    std::vector<uint32_t> ranks;  // empty: every other node
  };
  void Loop();
  std::vector<PeerShardAnswer> RunRound(const Job& job);

  const CommitQueryOptions options_;
  std::unique_ptr<PeerLinks> own_links_;
  PeerLinks* links_ = nullptr;

  mutable Mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  CommitQueryStats stats_ GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace ckptfs::store::peer
