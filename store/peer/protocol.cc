#include "store/peer/protocol.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>

#include "store/primitives/record_codec.h"

namespace ckptfs::store::peer {
namespace {

// A checksum record's fixed part: index, dev, ino, size, mtime, block size, count.
constexpr size_t kChecksumRecordBytes = 4 + 8 * 4 + 4 + 4;

// The messages are records (store/primitives/record_codec.h) of fixed-width fields, so that the
// response header has one size. A decoder checks once, at the end, that the message was
// neither short nor longer than its fields.
Status Finish(const Decoder& d, std::string_view what) {
  if (!d.ok()) return Corrupt("peer protocol: truncated " + std::string(what));
  if (!d.done()) return Corrupt("peer protocol: trailing bytes after " + std::string(what));
  return Status::Ok();
}

template <size_t N>
void ReadArray(Decoder* d, std::array<unsigned char, N>* a) {
  std::string_view v = d->Bytes(N);
  if (v.size() == N) std::memcpy(a->data(), v.data(), N);
}

// A byte string with a fixed-width length of `len_bytes` (2 or 4) before it.
void PutBytes(StringWriter* w, std::string_view s, int len_bytes) {
  if (len_bytes == 2) {
    w->Fixed16(static_cast<uint16_t>(s.size()));
  } else {
    w->Fixed32(static_cast<uint32_t>(s.size()));
  }
  w->Raw(s.data(), s.size());
}

}  // namespace

std::string EncodeHello(const Hello& m) {
  std::string out;
  StringWriter w(&out);
  w.Fixed32(kProtocolMagic);
  w.Fixed16(kProtocolVersion);
  PutBytes(&w, m.node_id, 2);
  w.Raw(m.client_nonce.data(), m.client_nonce.size());
  return out;
}

Result<Hello> DecodeHello(std::string_view bytes) {
  Decoder d(bytes);
  uint32_t magic = d.Fixed32();
  uint16_t version = d.Fixed16();
  uint16_t id_len = d.Fixed16();
  if (magic != kProtocolMagic) return Corrupt("peer protocol: hello has a bad magic number");
  if (version != kProtocolVersion) {
    return Unsupported("peer protocol: version " + std::to_string(version) + " (this is " +
                       std::to_string(kProtocolVersion) + ")");
  }
  if (id_len == 0 || id_len > kMaxNodeIdBytes) return Invalid("peer protocol: bad node id length");
  Hello m;
  m.node_id = std::string(d.Bytes(id_len));
  ReadArray(&d, &m.client_nonce);
  CKPT_RETURN_IF_ERROR(Finish(d, "hello"));
  return m;
}

std::string EncodeChallenge(const Challenge& m) {
  return std::string(reinterpret_cast<const char*>(m.server_nonce.data()), m.server_nonce.size());
}

Result<Challenge> DecodeChallenge(std::string_view bytes) {
  Decoder d(bytes);
  Challenge m;
  ReadArray(&d, &m.server_nonce);
  CKPT_RETURN_IF_ERROR(Finish(d, "challenge"));
  return m;
}

std::string EncodeAuthResult(const AuthResult& m) {
  std::string out;
  StringWriter w(&out);
  w.Byte(m.accepted ? 1 : 0);
  if (m.accepted) w.Raw(m.server_proof.data(), m.server_proof.size());
  return out;
}

Result<AuthResult> DecodeAuthResult(std::string_view bytes) {
  Decoder d(bytes);
  AuthResult m;
  uint8_t accepted = d.Byte();
  if (accepted > 1) return Corrupt("peer protocol: bad auth result");
  m.accepted = accepted == 1;
  if (m.accepted) ReadArray(&d, &m.server_proof);
  CKPT_RETURN_IF_ERROR(Finish(d, "auth result"));
  return m;
}

std::string EncodeAuth(const AuthMsg& m) {
  return std::string(reinterpret_cast<const char*>(m.client_proof.data()), m.client_proof.size());
}

Result<AuthMsg> DecodeAuth(std::string_view bytes) {
  Decoder d(bytes);
  AuthMsg m;
  ReadArray(&d, &m.client_proof);
  CKPT_RETURN_IF_ERROR(Finish(d, "auth"));
  return m;
}

std::string EncodeRequest(const BlockRequest& m) {
  std::string out;
  StringWriter w(&out);
  w.Fixed64(m.request_id);
  w.Fixed64(m.offset);
  w.Fixed64(m.length);
  w.Fixed64(m.id.size);
  w.Fixed64(static_cast<uint64_t>(m.id.mtime_ns));
  PutBytes(&w, m.id.path, 4);
  return out;
}

Result<BlockRequest> DecodeRequest(std::string_view bytes) {
  Decoder d(bytes);
  BlockRequest m;
  m.request_id = d.Fixed64();
  m.offset = d.Fixed64();
  m.length = d.Fixed64();
  m.id.size = d.Fixed64();
  m.id.mtime_ns = static_cast<int64_t>(d.Fixed64());
  uint32_t path_len = d.Fixed32();
  if (path_len > kMaxPathBytes) return Invalid("peer protocol: request path too long");
  m.id.path = std::string(d.Bytes(path_len));
  CKPT_RETURN_IF_ERROR(Finish(d, "request"));
  return m;
}

std::array<char, kResponseHeaderBytes> EncodeResponseHeader(const ResponseHeader& m) {
  std::string s;
  StringWriter w(&s);
  w.Fixed64(m.request_id);
  w.Fixed32(m.code);
  w.Fixed32(m.crc32c);
  w.Fixed64(m.length);
  std::array<char, kResponseHeaderBytes> out{};
  std::memcpy(out.data(), s.data(), out.size());
  return out;
}

Result<ResponseHeader> DecodeResponseHeader(std::string_view bytes) {
  Decoder d(bytes);
  ResponseHeader m;
  m.request_id = d.Fixed64();
  m.code = d.Fixed32();
  m.crc32c = d.Fixed32();
  m.length = d.Fixed64();
  CKPT_RETURN_IF_ERROR(Finish(d, "response header"));
  return m;
}

std::string EncodeShardQuery(const ShardQuery& m) {
  std::string out;
  StringWriter w(&out);
  w.Fixed64(m.query_id);
  w.Fixed32((m.hold_ms & ~kQueryWantsChecksums) | (m.want_checksums ? kQueryWantsChecksums : 0));
  w.Fixed32(static_cast<uint32_t>(m.paths.size()));
  for (const std::string& p : m.paths) PutBytes(&w, p, 4);
  return out;
}

Result<ShardQuery> DecodeShardQuery(std::string_view bytes) {
  if (bytes.size() > kMaxQueryBytes) return Invalid("peer protocol: shard query too large");
  Decoder d(bytes);
  ShardQuery m;
  m.query_id = d.Fixed64();
  m.hold_ms = d.Fixed32();
  m.want_checksums = (m.hold_ms & kQueryWantsChecksums) != 0;
  m.hold_ms &= ~kQueryWantsChecksums;
  uint32_t count = d.Fixed32();
  if (count > kMaxQueryPaths) return Invalid("peer protocol: shard query names too many paths");
  // Each path takes at least its 4-byte length: a count the bytes cannot hold is truncated.
  if (uint64_t{count} * 4 > bytes.size()) return Corrupt("peer protocol: truncated shard query");
  m.paths.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t len = d.Fixed32();
    if (len > kMaxPathBytes) return Invalid("peer protocol: shard query path too long");
    m.paths.emplace_back(d.Bytes(len));
  }
  CKPT_RETURN_IF_ERROR(Finish(d, "shard query"));
  return m;
}

std::string EncodeShardAnswer(const ShardAnswer& m) {
  std::string out;
  StringWriter w(&out);
  w.Fixed64(m.query_id);
  w.Fixed32(m.code);
  if (m.code != static_cast<uint32_t>(Code::kOk)) {
    w.Fixed32(0);
    PutBytes(&w, m.error, 4);
    return out;
  }
  w.Fixed32(static_cast<uint32_t>(m.states.size()));
  for (const ShardStatus& s : m.states) {
    w.Byte(static_cast<uint8_t>(s.state));
    w.Fixed64(s.length);
  }
  // The checksum section: durable states' block CRCs, within the byte bound.
  std::vector<uint32_t> with;
  size_t section = 0;
  for (uint32_t i = 0; i < m.states.size(); ++i) {
    const ShardStatus& s = m.states[i];
    if (s.state != ShardState::kDurable || !s.checksums) continue;
    const size_t bytes = kChecksumRecordBytes + 4 * s.checksums->block_crcs.size();
    if (section + bytes > kMaxAnswerChecksumBytes) continue;
    section += bytes;
    with.push_back(i);
  }
  if (with.empty()) return out;
  w.Byte(kChecksumSectionVersion);
  w.Fixed32(static_cast<uint32_t>(with.size()));
  for (uint32_t i : with) {
    const ShardChecksums& c = *m.states[i].checksums;
    w.Fixed32(i);
    w.Fixed64(c.id.dev);
    w.Fixed64(c.id.ino);
    w.Fixed64(c.id.size);
    w.Fixed64(static_cast<uint64_t>(c.id.mtime_ns));
    w.Fixed32(c.block_bytes);
    w.Fixed32(static_cast<uint32_t>(c.block_crcs.size()));
    for (uint32_t crc : c.block_crcs) w.Fixed32(crc);
  }
  return out;
}

namespace {

// The checksum section of an Ok shard answer (see protocol.h), into `states`. `*skipped`:
// a section of a later version, left unread (the answer stands without checksums).
Status DecodeChecksumSection(Decoder* d, size_t total_bytes, std::vector<ShardStatus>* states,
                             bool* skipped) {
  *skipped = false;
  if (d->done()) return Status::Ok();  // an older server: none
  const uint8_t version = d->Byte();
  if (version != kChecksumSectionVersion) {
    *skipped = d->ok();
    return Status::Ok();
  }
  const uint32_t n = d->Fixed32();
  if (n > states->size()) return Corrupt("peer protocol: more checksum records than paths");
  if (uint64_t{n} * kChecksumRecordBytes > total_bytes) {
    return Corrupt("peer protocol: truncated checksum section");
  }
  for (uint32_t r = 0; r < n; ++r) {
    const uint32_t index = d->Fixed32();
    auto c = std::make_shared<ShardChecksums>();
    c->id.dev = d->Fixed64();
    c->id.ino = d->Fixed64();
    c->id.size = d->Fixed64();
    c->id.mtime_ns = static_cast<int64_t>(d->Fixed64());
    c->block_bytes = d->Fixed32();
    const uint32_t count = d->Fixed32();
    if (!d->ok()) return Corrupt("peer protocol: truncated checksum section");
    if (index >= states->size()) return Corrupt("peer protocol: checksum of no path");
    ShardStatus& s = (*states)[index];
    if (s.state != ShardState::kDurable || s.checksums) {
      return Corrupt("peer protocol: checksums of a path not durable, or twice");
    }
    const uint32_t bs = c->block_bytes;
    if (bs < BlockCrcMap::kMinBlockBytes || bs > BlockCrcMap::kMaxBlockBytes ||
        (bs & (bs - 1)) != 0) {
      return Corrupt("peer protocol: bad checksum block size");
    }
    if (c->id.size != s.length ||
        count != c->id.size / bs + (c->id.size % bs != 0 ? 1 : 0)) {
      return Corrupt("peer protocol: checksum count does not fit the shard's size");
    }
    if (uint64_t{count} * 4 > total_bytes) return Corrupt("peer protocol: truncated checksums");
    std::string_view crcs = d->Bytes(uint64_t{count} * 4);
    if (!d->ok()) return Corrupt("peer protocol: truncated checksums");
    c->block_crcs.resize(count);
    for (uint32_t b = 0; b < count; ++b) {
      uint32_t v = 0;
      for (int k = 3; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(crcs[4 * b + k]);
      c->block_crcs[b] = v;
    }
    s.checksums = std::move(c);
  }
  return Status::Ok();
}

}  // namespace

Result<ShardAnswer> DecodeShardAnswer(std::string_view bytes) {
  Decoder d(bytes);
  ShardAnswer m;
  m.query_id = d.Fixed64();
  m.code = d.Fixed32();
  uint32_t count = d.Fixed32();
  if (m.code != static_cast<uint32_t>(Code::kOk)) {
    if (count != 0) return Corrupt("peer protocol: error shard answer with states");
    uint32_t len = d.Fixed32();
    if (len > kMaxPathBytes) return Corrupt("peer protocol: shard answer error too long");
    m.error = std::string(d.Bytes(len));
    CKPT_RETURN_IF_ERROR(Finish(d, "shard answer"));
    return m;
  }
  if (count > kMaxQueryPaths) return Corrupt("peer protocol: shard answer too long");
  if (uint64_t{count} * 9 > bytes.size()) return Corrupt("peer protocol: truncated shard answer");
  m.states.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    uint8_t state = d.Byte();
    uint64_t length = d.Fixed64();
    if (state > kMaxShardState) return Corrupt("peer protocol: bad shard state");
    m.states.push_back(ShardStatus{static_cast<ShardState>(state), length, nullptr});
  }
  if (!d.ok()) return Corrupt("peer protocol: truncated shard answer");
  bool skipped = false;
  CKPT_RETURN_IF_ERROR(DecodeChecksumSection(&d, bytes.size(), &m.states, &skipped));
  if (skipped) return m;
  CKPT_RETURN_IF_ERROR(Finish(d, "shard answer"));
  return m;
}

Proof ComputeProof(std::string_view secret, ProofRole role, std::string_view node_id,
                   const Nonce& client_nonce, const Nonce& server_nonce) {
  std::string msg;
  StringWriter w(&msg);
  std::string_view label =
      role == ProofRole::kServer ? "ckptfs-peer-v1 server" : "ckptfs-peer-v1 client";
  w.Raw(label.data(), label.size());
  PutBytes(&w, node_id, 2);
  w.Raw(client_nonce.data(), client_nonce.size());
  w.Raw(server_nonce.data(), server_nonce.size());
  Proof out{};
  unsigned int out_len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out.data(), &out_len);
  return out;
}

bool ProofEquals(const Proof& a, const Proof& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

Result<Nonce> RandomNonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    return Internal("peer: the OpenSSL random generator failed");
  }
  return n;
}

Result<std::pair<std::string, uint16_t>> SplitHostPort(std::string_view address) {
  size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) {
    return Invalid("peer address '" + std::string(address) + "' is not HOST:PORT");
  }
  std::string host(address.substr(0, colon));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  uint32_t port = 0;
  for (char c : address.substr(colon + 1)) {
    if (c < '0' || c > '9' || port > 65535) {
      return Invalid("peer address '" + std::string(address) + "' has a bad port");
    }
    port = port * 10 + static_cast<uint32_t>(c - '0');
  }
  if (port > 65535 || address.size() == colon + 1) {
    return Invalid("peer address '" + std::string(address) + "' has a bad port");
  }
  return std::make_pair(host, static_cast<uint16_t>(port));
}

}  // namespace ckptfs::store::peer
