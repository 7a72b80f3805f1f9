// Wire format and authentication of the ckptfs peer protocol (docs/PEERS.md).
//
// Every message is a UCP active message. Small control messages carry their fields in the
// AM data; a block reply carries a fixed ResponseHeader as the AM header and the block bytes
// as the AM data (UCX sends large data by rendezvous, zero-copy on RDMA fabrics).
// Messages are records of store/primitives/record_codec.h's fixed-width fields: integers are
// little-endian; strings are length-prefixed bytes (names are bytes, not UTF-8).
//
// Connection handshake (mutual challenge-response over a shared secret, before any block):
//   client -> server  kHello      {magic, version, node_id, client_nonce[32]}
//   server -> client  kChallenge  {server_nonce[32]}
//   client -> server  kAuth       {client_proof}
//   server -> client  kAuthResult {1, server_proof} accepted, or {0} refused (then closed)
//   proof = HMAC-SHA256(secret, label || u16 len(node_id) || node_id || client_nonce ||
//                       server_nonce), label "ckptfs-peer-v1 server" / "... client".
// The client proves first, so a peer without the secret never sees a value derived from it
// (nothing to guess the secret from offline); the server's proof then shows the client that
// it talks to a daemon that knows the secret. Distinct labels keep a server proof from being
// replayed as a client proof; fresh nonces on both sides keep either from being replayed on
// another connection.
//
// Pure functions, thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "store/cache/block_source.h"
#include "store/publish/shard_state.h"

namespace ckptfs::store::peer {

// Active message ids.
enum AmId : unsigned {
  kAmHello = 1,
  kAmChallenge = 2,
  kAmAuth = 3,
  kAmAuthResult = 4,
  kAmRequest = 5,
  kAmResponse = 6,
  kAmShardQuery = 7,   // commit query (below)
  kAmShardAnswer = 8,
};

inline constexpr uint32_t kProtocolMagic = 0x50504b43;  // "CKPP"
inline constexpr uint16_t kProtocolVersion = 1;
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kProofBytes = 32;  // SHA-256
inline constexpr size_t kMaxNodeIdBytes = 256;
inline constexpr size_t kMaxPathBytes = 4096;
inline constexpr size_t kMinSecretBytes = 16;
inline constexpr size_t kMaxSecretBytes = 4096;  // ReadSecretFile (peers.h)

using Nonce = std::array<unsigned char, kNonceBytes>;
using Proof = std::array<unsigned char, kProofBytes>;

struct Hello {
  std::string node_id;
  Nonce client_nonce{};
};
struct Challenge {
  Nonce server_nonce{};
};
struct AuthResult {
  bool accepted = false;
  Proof server_proof{};  // when accepted
};
struct AuthMsg {
  Proof client_proof{};
};
struct BlockRequest {
  uint64_t request_id = 0;
  BlockId id;
  uint64_t offset = 0;
  uint64_t length = 0;
};
// AM header of a kAmResponse. The AM data holds `length` block bytes when code is kOk, else
// an error message of `length` bytes.
struct ResponseHeader {
  uint64_t request_id = 0;
  uint32_t code = 0;  // ckptfs::Code
  uint32_t crc32c = 0;
  uint64_t length = 0;
};
inline constexpr size_t kResponseHeaderBytes = 24;

// Commit query (docs/PEERS.md, "Commit query"): a node about to publish a `.metadata` asks
// a peer what it knows about shard paths (relative to the backing root). The peer answers
// once any path it reports pending has left that state, or when `hold_ms` passes (its own
// cap applies), or at once when none is pending there. Both travel eager (small), sent with
// UCP_AM_SEND_FLAG_EAGER; a rendezvous one is dropped with a log line.
//   kAmShardQuery  {query_id u64, hold_ms u32, count u32, count x {u32 len + path bytes}}
//   kAmShardAnswer {query_id u64, code u32, count u32, count x {state u8, length u64}}
//                  (code != Ok: count is 0 and an error message of u32 len + bytes follows)
// Added in protocol version 1 without a bump: a daemon that does not know these ids drops
// the query (UCX logs it) and the asker's timeout falls back to the backing store.
//
// Checksums with the commit (docs/PEERS.md): the asker sets kQueryWantsChecksums in hold_ms
// (an older server reads a long hold and caps it, then answers as before); a server that
// knows the flag may append to an Ok answer, after the states, a versioned section with the
// block CRCs of durable shards it wrote:
//   u8 version (1), u32 n, n x {u32 path index, u64 dev, u64 ino, u64 size, u64 mtime_ns,
//                               u32 block_bytes, u32 count, count x u32 crc32c}
// An answer that ends after its states (an older server) has none; a section of a version
// the asker does not know is skipped whole. Each record's count is ceil(size / block_bytes)
// with block_bytes a power of two in [4 KiB, 16 MiB]; at most kMaxAnswerChecksumBytes of
// records per answer (the shards past it go without: they stay unchecked there).
inline constexpr size_t kMaxQueryPaths = 16384;
inline constexpr size_t kMaxQueryBytes = 1u << 20;  // an encoded query, at most
inline constexpr uint32_t kQueryWantsChecksums = 1u << 31;
inline constexpr uint8_t kChecksumSectionVersion = 1;
inline constexpr size_t kMaxAnswerChecksumBytes = 1u << 20;
struct ShardQuery {
  uint64_t query_id = 0;
  uint32_t hold_ms = 0;  // below kQueryWantsChecksums
  bool want_checksums = false;
  std::vector<std::string> paths;
};
struct ShardAnswer {
  uint64_t query_id = 0;
  uint32_t code = 0;  // ckptfs::Code
  // One per queried path, in order (code Ok); a durable state may carry its shard's block
  // CRCs (encoded within kMaxAnswerChecksumBytes, the rest dropped).
  std::vector<ShardStatus> states;
  std::string error;  // code != Ok
};
std::string EncodeShardQuery(const ShardQuery& m);
Result<ShardQuery> DecodeShardQuery(std::string_view bytes);
std::string EncodeShardAnswer(const ShardAnswer& m);
Result<ShardAnswer> DecodeShardAnswer(std::string_view bytes);

std::string EncodeHello(const Hello& m);
Result<Hello> DecodeHello(std::string_view bytes);
std::string EncodeChallenge(const Challenge& m);
Result<Challenge> DecodeChallenge(std::string_view bytes);
std::string EncodeAuthResult(const AuthResult& m);
Result<AuthResult> DecodeAuthResult(std::string_view bytes);
std::string EncodeAuth(const AuthMsg& m);
Result<AuthMsg> DecodeAuth(std::string_view bytes);
std::string EncodeRequest(const BlockRequest& m);
Result<BlockRequest> DecodeRequest(std::string_view bytes);
std::array<char, kResponseHeaderBytes> EncodeResponseHeader(const ResponseHeader& m);
Result<ResponseHeader> DecodeResponseHeader(std::string_view bytes);

enum class ProofRole { kServer, kClient };
Proof ComputeProof(std::string_view secret, ProofRole role, std::string_view node_id,
                   const Nonce& client_nonce, const Nonce& server_nonce);
// Constant-time comparison.
bool ProofEquals(const Proof& a, const Proof& b);
// Cryptographically random nonce (OpenSSL RAND_bytes); Internal error if the RNG fails.
Result<Nonce> RandomNonce();

// Splits "host:port" ("[v6]:port" too). Invalid on a missing or out-of-range port; port 0
// (any free port) is accepted, for listening.
Result<std::pair<std::string, uint16_t>> SplitHostPort(std::string_view address);

}  // namespace ckptfs::store::peer
