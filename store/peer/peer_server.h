// PeerServer: serves blocks of the backing directory to authenticated peer daemons over UCX.
//
// It listens on ADDR:PORT (ucp_listener; TCP here, RDMA where the fabric has it). A
// connecting peer must be listed (its node id among `allowed_peers` and, with
// `check_source_address`, connecting from an address its host name resolves to) and must
// pass the HMAC challenge-response of protocol.h before any request is served. An unlisted or
// unauthenticated peer gets no block: its connection is closed and the event is logged at
// warn level. Connections that have not authenticated within `handshake_timeout` are closed
// when the next connection arrives.
//
// Requests are read by `serve_threads` threads through the BlockSource (never on the UCX
// progress thread, which only moves messages). Each reply carries the CRC32C of its bytes
// (the provider's, when it knows one, else computed here). A request for more than
// `max_block_bytes`, a bad path, or one that would take the bytes being served past
// `max_inflight_bytes` gets an error reply (Invalid, Invalid, Busy), never a crash.
//
// Thread-safe. The destructor stops accepting, drops queued requests, joins the serving
// threads, closes every connection and joins the progress thread; the provider must outlive
// the server.
//
// Commit queries (docs/PEERS.md, "Commit query") from authenticated peers are answered from
// a ShardStateProvider (options.shard_states) by a query thread that may hold an answer
// until a pending shard becomes durable (long-poll); a malformed one gets an error answer
// when its id can be read, else it is dropped with a log line.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "store/cache/block_source.h"
#include "store/publish/shard_state.h"

namespace ckptfs::store::peer {

struct PeerServerOptions {
  std::string listen = "0.0.0.0:0";        // ADDR:PORT; port 0 picks a free one (see port())
  std::string node_id;                     // this node's name, for log lines
  std::string secret;                      // shared secret (ReadSecretFile)
  std::vector<std::string> allowed_peers;  // node ids ("host:port") that may connect
  bool check_source_address = true;
  int serve_threads = 2;
  uint64_t max_block_bytes = 64ull << 20;
  uint64_t max_inflight_bytes = 256ull << 20;
  std::chrono::milliseconds handshake_timeout{5000};
  // Commit queries (protocol.h kAmShardQuery): answered from `shard_states` (must outlive
  // the server) by one query thread, never the progress thread. A query is held until a
  // path it found pending here leaves that state, or for at most `max_query_hold`;
  // at most `max_held_queries` are held at once (beyond that the oldest is answered as it
  // stands). Null: queries get an Unsupported answer.
  ShardStateProvider* shard_states = nullptr;
  // Told of each authenticated commit query as it arrives, on the query thread: who asked
  // (its node id) and about which paths. The asker is about to publish the `.metadata`
  // naming them, so PeerNode learns from it which node commits a checkpoint.
  std::function<void(const std::string& node_id, const std::vector<std::string>& paths)>
      on_shard_query;
  std::chrono::milliseconds max_query_hold{2000};
  size_t max_held_queries = 256;
};

struct PeerServerStats {
  uint64_t connections = 0;    // accepted at the transport level
  uint64_t authenticated = 0;  // passed the handshake
  uint64_t refused = 0;        // unlisted, bad proof, protocol violation, handshake timeout
  uint64_t blocks_served = 0;
  uint64_t bytes_served = 0;
  uint64_t request_errors = 0;  // error replies (provider errors, bad requests, busy)
  uint64_t shard_queries = 0;   // commit queries answered
  uint64_t shard_query_errors = 0;  // malformed, oversized or unsupported ones
  uint64_t pooled_bytes = 0;  // reply buffers kept for reuse (BufferPool)
};

class PeerServer {
 public:
  static Result<std::unique_ptr<PeerServer>> Create(const PeerServerOptions& options,
                                                    BlockSource* provider);  // must outlive
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  uint16_t port() const;  // the port listened on
  PeerServerStats stats() const;
  // The peers allowed from now on (a membership change): node ids and, with
  // check_source_address, their hosts resolved again. Connections already authenticated
  // stay; a node no longer listed cannot make a new one.
  Status SetAllowedPeers(const std::vector<std::string>& peers);

  class Impl;

 private:
  explicit PeerServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ckptfs::store::peer
