// PeerClient: fetches blocks from one peer daemon's PeerServer over UCX.
//
// Connect() opens the connection and runs the mutual HMAC handshake (protocol.h): the
// client proves it knows the shared secret, then the server proves it too, so a rogue server
// cannot feed blocks. It returns once authenticated, or with an error within
// `connect_timeout`: Permission when the server refused this node (unlisted, wrong secret)
// or failed its own proof; Io when nothing listens or the connection dies; Timeout when the
// handshake does not finish in time; Invalid for a bad address or a short secret.
//
// Fetch() may be called from any number of threads at once; requests are pipelined over the
// one connection. Each waits at most `request_timeout` (Timeout). The reply's CRC32C is
// verified before a byte reaches the caller (Corrupt on mismatch). A lost connection (peer
// died, link cut: UCX error-handling mode PEER) fails every outstanding and later Fetch
// with the same Io error at once: the client is then dead for good (healthy() is false),
// and the owner makes a new one to reconnect. A failed fetch never leaves the caller's
// buffer written by a late reply: replies land in a private buffer and are copied out only
// by the waiting caller.
//
// Thread-safe. The destructor fails outstanding fetches (Aborted) and joins the progress
// thread; no Fetch may be in progress once it runs.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "store/cache/block_source.h"
#include "store/publish/shard_state.h"

namespace ckptfs::store::peer {

struct PeerClientOptions {
  std::string server;   // "host:port" of the peer's PeerServer
  std::string node_id;  // this node's name in the peer list, as the server knows it
  std::string secret;   // shared secret (ReadSecretFile)
  std::chrono::milliseconds connect_timeout{5000};
  std::chrono::milliseconds request_timeout{10000};
};

// The options to reach `server` as this node: any of the peer modules' options (they all
// carry the peer list `nodes`, this node's index `self` in it, the shared `secret` and the
// two timeouts).
template <typename PeerModuleOptions>
PeerClientOptions ClientOptionsFor(const std::string& server, const PeerModuleOptions& o) {
  PeerClientOptions co;
  co.server = server;
  co.node_id = o.nodes[o.self];
  co.secret = o.secret;
  co.connect_timeout = o.connect_timeout;
  co.request_timeout = o.request_timeout;
  return co;
}

struct PeerClientStats {
  uint64_t fetched_blocks = 0;
  uint64_t fetched_bytes = 0;
  uint64_t errors = 0;  // error replies from the server
  uint64_t timeouts = 0;
  uint64_t bad_checksums = 0;
  uint64_t pooled_bytes = 0;  // request buffers kept for reuse (BufferPool, at most 64 MiB)
};

class PeerClient {
 public:
  static Result<std::unique_ptr<PeerClient>> Connect(const PeerClientOptions& options);
  ~PeerClient();
  PeerClient(const PeerClient&) = delete;
  PeerClient& operator=(const PeerClient&) = delete;

  // Reads up to out.size() bytes at `offset` of `id` from the peer into `out`; returns the
  // count (short only at the end of the file). Errors: the server's status (NotFound,
  // Aborted for a stale version, ...), Timeout, Corrupt (checksum), Io (connection lost).
  Result<size_t> Fetch(const BlockId& id, uint64_t offset, std::span<char> out);

  // Commit query (protocol.h kAmShardQuery): what the peer knows about `paths` (relative to
  // the backing root), one status per path in order. The server may hold the answer up to
  // `hold` (long-poll); the call waits at most hold + request_timeout (Timeout). Errors:
  // the server's (Unsupported: it keeps no shard states; Invalid: too many or too long
  // paths), Io (connection lost), Corrupt (a malformed answer). Start/Wait split it so one
  // thread can ask several peers at once; the call must be waited for (or dropped) before
  // the client is destroyed.
  struct QueryCall;
  std::shared_ptr<QueryCall> StartShardQuery(const std::vector<std::string>& paths,
                                             std::chrono::milliseconds hold);
  Result<std::vector<ShardStatus>> WaitShardQuery(const std::shared_ptr<QueryCall>& call);
  Result<std::vector<ShardStatus>> QueryShards(const std::vector<std::string>& paths,
                                               std::chrono::milliseconds hold) {
    return WaitShardQuery(StartShardQuery(paths, hold));
  }

  bool healthy() const;
  PeerClientStats stats() const;
  const std::string& server() const;

  class Impl;

 private:
  explicit PeerClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ckptfs::store::peer
