#include "store/peer/protocol.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cstring>

#include "common/unique_fd.h"

namespace ckptfs::store::peer {
namespace {

class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void Bytes(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string Take() { return std::move(out_); }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

// Bounds-checked reader: after the first short read every getter returns zeros and ok()
// is false, so decoders check once at the end.
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  uint64_t Le(int n) {
    if (!Need(n)) return 0;
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= uint64_t(static_cast<unsigned char>(in_[pos_ + i])) << (8 * i);
    pos_ += n;
    return v;
  }
  uint8_t U8() { return static_cast<uint8_t>(Le(1)); }
  uint16_t U16() { return static_cast<uint16_t>(Le(2)); }
  uint32_t U32() { return static_cast<uint32_t>(Le(4)); }
  uint64_t U64() { return Le(8); }
  std::string_view Bytes(size_t n) {
    if (!Need(n)) return {};
    std::string_view v = in_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  template <size_t N>
  void Array(std::array<unsigned char, N>* a) {
    std::string_view v = Bytes(N);
    if (v.size() == N) std::memcpy(a->data(), v.data(), N);
  }
  Status Finish(std::string_view what) const {
    if (!ok_) return Corrupt(std::string("peer protocol: truncated ") + std::string(what));
    if (pos_ != in_.size()) {
      return Corrupt(std::string("peer protocol: trailing bytes after ") + std::string(what));
    }
    return Status::Ok();
  }

 private:
  bool Need(size_t n) {
    if (!ok_ || in_.size() - pos_ < n) {
      ok_ = false;
      return false;
    }
    return true;
  }
  std::string_view in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace

std::string EncodeHello(const Hello& m) {
  Writer w;
  w.U32(kProtocolMagic);
  w.U16(kProtocolVersion);
  w.U16(static_cast<uint16_t>(m.node_id.size()));
  w.Bytes(m.node_id.data(), m.node_id.size());
  w.Bytes(m.client_nonce.data(), m.client_nonce.size());
  return w.Take();
}

Result<Hello> DecodeHello(std::string_view bytes) {
  Reader r(bytes);
  uint32_t magic = r.U32();
  uint16_t version = r.U16();
  uint16_t id_len = r.U16();
  if (magic != kProtocolMagic) return Corrupt("peer protocol: hello has a bad magic number");
  if (version != kProtocolVersion) {
    return Unsupported("peer protocol: version " + std::to_string(version) + " (this is " +
                       std::to_string(kProtocolVersion) + ")");
  }
  if (id_len == 0 || id_len > kMaxNodeIdBytes) return Invalid("peer protocol: bad node id length");
  Hello m;
  m.node_id = std::string(r.Bytes(id_len));
  r.Array(&m.client_nonce);
  CKPT_RETURN_IF_ERROR(r.Finish("hello"));
  return m;
}

std::string EncodeChallenge(const Challenge& m) {
  Writer w;
  w.Bytes(m.server_nonce.data(), m.server_nonce.size());
  return w.Take();
}

Result<Challenge> DecodeChallenge(std::string_view bytes) {
  Reader r(bytes);
  Challenge m;
  r.Array(&m.server_nonce);
  CKPT_RETURN_IF_ERROR(r.Finish("challenge"));
  return m;
}

std::string EncodeAuthResult(const AuthResult& m) {
  Writer w;
  w.U8(m.accepted ? 1 : 0);
  if (m.accepted) w.Bytes(m.server_proof.data(), m.server_proof.size());
  return w.Take();
}

Result<AuthResult> DecodeAuthResult(std::string_view bytes) {
  Reader r(bytes);
  AuthResult m;
  uint8_t accepted = r.U8();
  if (accepted > 1) return Corrupt("peer protocol: bad auth result");
  m.accepted = accepted == 1;
  if (m.accepted) r.Array(&m.server_proof);
  CKPT_RETURN_IF_ERROR(r.Finish("auth result"));
  return m;
}

std::string EncodeAuth(const AuthMsg& m) {
  return std::string(reinterpret_cast<const char*>(m.client_proof.data()), m.client_proof.size());
}

Result<AuthMsg> DecodeAuth(std::string_view bytes) {
  Reader r(bytes);
  AuthMsg m;
  r.Array(&m.client_proof);
  CKPT_RETURN_IF_ERROR(r.Finish("auth"));
  return m;
}

std::string EncodeRequest(const BlockRequest& m) {
  Writer w;
  w.U64(m.request_id);
  w.U64(m.offset);
  w.U64(m.length);
  w.U64(m.id.size);
  w.U64(static_cast<uint64_t>(m.id.mtime_ns));
  w.U32(static_cast<uint32_t>(m.id.path.size()));
  w.Bytes(m.id.path.data(), m.id.path.size());
  return w.Take();
}

Result<BlockRequest> DecodeRequest(std::string_view bytes) {
  Reader r(bytes);
  BlockRequest m;
  m.request_id = r.U64();
  m.offset = r.U64();
  m.length = r.U64();
  m.id.size = r.U64();
  m.id.mtime_ns = static_cast<int64_t>(r.U64());
  uint32_t path_len = r.U32();
  if (path_len > kMaxPathBytes) return Invalid("peer protocol: request path too long");
  m.id.path = std::string(r.Bytes(path_len));
  CKPT_RETURN_IF_ERROR(r.Finish("request"));
  return m;
}

std::array<char, kResponseHeaderBytes> EncodeResponseHeader(const ResponseHeader& m) {
  Writer w;
  w.U64(m.request_id);
  w.U32(m.code);
  w.U32(m.crc32c);
  w.U64(m.length);
  std::string s = w.Take();
  std::array<char, kResponseHeaderBytes> out{};
  std::memcpy(out.data(), s.data(), out.size());
  return out;
}

Result<ResponseHeader> DecodeResponseHeader(std::string_view bytes) {
  Reader r(bytes);
  ResponseHeader m;
  m.request_id = r.U64();
  m.code = r.U32();
  m.crc32c = r.U32();
  m.length = r.U64();
  CKPT_RETURN_IF_ERROR(r.Finish("response header"));
  return m;
}

std::string EncodeShardQuery(const ShardQuery& m) {
  Writer w;
  w.U64(m.query_id);
  w.U32(m.hold_ms);
  w.U32(static_cast<uint32_t>(m.paths.size()));
  for (const std::string& p : m.paths) {
    w.U32(static_cast<uint32_t>(p.size()));
    w.Bytes(p.data(), p.size());
  }
  return w.Take();
}

Result<ShardQuery> DecodeShardQuery(std::string_view bytes) {
  if (bytes.size() > kMaxQueryBytes) return Invalid("peer protocol: shard query too large");
  Reader r(bytes);
  ShardQuery m;
  m.query_id = r.U64();
  m.hold_ms = r.U32();
  uint32_t count = r.U32();
  if (count > kMaxQueryPaths) return Invalid("peer protocol: shard query names too many paths");
  // Each path takes at least its 4-byte length: a count the bytes cannot hold is truncated.
  if (uint64_t{count} * 4 > bytes.size()) return Corrupt("peer protocol: truncated shard query");
  m.paths.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t len = r.U32();
    if (len > kMaxPathBytes) return Invalid("peer protocol: shard query path too long");
    m.paths.emplace_back(r.Bytes(len));
  }
  CKPT_RETURN_IF_ERROR(r.Finish("shard query"));
  return m;
}

std::string EncodeShardAnswer(const ShardAnswer& m) {
  Writer w;
  w.U64(m.query_id);
  w.U32(m.code);
  if (m.code != static_cast<uint32_t>(Code::kOk)) {
    w.U32(0);
    w.U32(static_cast<uint32_t>(m.error.size()));
    w.Bytes(m.error.data(), m.error.size());
    return w.Take();
  }
  w.U32(static_cast<uint32_t>(m.states.size()));
  for (const ShardStatus& s : m.states) {
    w.U8(static_cast<uint8_t>(s.state));
    w.U64(s.length);
  }
  return w.Take();
}

Result<ShardAnswer> DecodeShardAnswer(std::string_view bytes) {
  Reader r(bytes);
  ShardAnswer m;
  m.query_id = r.U64();
  m.code = r.U32();
  uint32_t count = r.U32();
  if (m.code != static_cast<uint32_t>(Code::kOk)) {
    if (count != 0) return Corrupt("peer protocol: error shard answer with states");
    uint32_t len = r.U32();
    if (len > kMaxPathBytes) return Corrupt("peer protocol: shard answer error too long");
    m.error = std::string(r.Bytes(len));
    CKPT_RETURN_IF_ERROR(r.Finish("shard answer"));
    return m;
  }
  if (count > kMaxQueryPaths) return Corrupt("peer protocol: shard answer too long");
  if (uint64_t{count} * 9 > bytes.size()) return Corrupt("peer protocol: truncated shard answer");
  m.states.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    uint8_t state = r.U8();
    uint64_t length = r.U64();
    if (state > kMaxShardState) return Corrupt("peer protocol: bad shard state");
    m.states.push_back(ShardStatus{static_cast<ShardState>(state), length});
  }
  CKPT_RETURN_IF_ERROR(r.Finish("shard answer"));
  return m;
}

Proof ComputeProof(std::string_view secret, ProofRole role, std::string_view node_id,
                   const Nonce& client_nonce, const Nonce& server_nonce) {
  Writer w;
  std::string_view label =
      role == ProofRole::kServer ? "ckptfs-peer-v1 server" : "ckptfs-peer-v1 client";
  w.Bytes(label.data(), label.size());
  w.U16(static_cast<uint16_t>(node_id.size()));
  w.Bytes(node_id.data(), node_id.size());
  w.Bytes(client_nonce.data(), client_nonce.size());
  w.Bytes(server_nonce.data(), server_nonce.size());
  std::string msg = w.Take();
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
