// Fuzzes the peer wire protocol (issue 41): every message a daemon on a network port decodes
// from bytes another daemon, or anything that reaches its port, sent
// (store/peer/protocol.h: the handshake before authentication, block requests and response
// headers, the commit query and its answer with the checksum section), and the names and
// unit records of the memory-only replica protocol (store/peer/memory_wire.h). The first
// byte picks the decoder; the rest is the message.
//
// Beyond "no crash, no leak, no UB" (ASan/UBSan), each accepted message must be stable: its
// encoding decodes again, and encoding that gives the same bytes (what a peer relays or
// answers is what it understood). A decoder that accepts something its own encoder cannot
// reproduce would let two daemons disagree about one message.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "store/peer/memory_wire.h"
#include "store/peer/protocol.h"

namespace {

using namespace ckptfs::store::peer;

template <typename Decode, typename Encode>
void Stable(std::string_view bytes, Decode decode, Encode encode) {
  auto first = decode(bytes);
  if (!first.ok()) return;
  const auto once = encode(*first);
  const std::string a(once.begin(), once.end());
  auto second = decode(std::string_view(a));
  if (!second.ok()) __builtin_trap();  // its own encoding refused
  const auto twice = encode(*second);
  if (std::string(twice.begin(), twice.end()) != a) __builtin_trap();
}

void WriteSeed(const std::string& dir, const std::string& name, char kind, std::string_view bytes) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out.put(kind);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void WriteSeeds(const std::string& dir) {
  const std::vector<std::string> shards = {"run/iter_0000002/__0_0.distcp",
                                           "run/iter_0000002/__1_0.distcp",
                                           "run/iter_0000002/__2_0.distcp",
                                           "run/iter_0000002/__3_0.distcp"};
  Hello hello;
  hello.node_id = "10.77.0.2:7470";
  for (size_t i = 0; i < hello.client_nonce.size(); ++i) hello.client_nonce[i] = static_cast<unsigned char>(i * 7);
  WriteSeed(dir, "hello", 0, EncodeHello(hello));
  Challenge challenge;
  challenge.server_nonce.fill(0x5a);
  WriteSeed(dir, "challenge", 1, EncodeChallenge(challenge));
  AuthResult result;
  result.accepted = true;
  result.server_proof = ComputeProof("0123456789abcdef0123456789abcdef", ProofRole::kServer,
                                     hello.node_id, hello.client_nonce, challenge.server_nonce);
  WriteSeed(dir, "auth-result", 2, EncodeAuthResult(result));
  AuthMsg auth;
  auth.client_proof = ComputeProof("0123456789abcdef0123456789abcdef", ProofRole::kClient,
                                   hello.node_id, hello.client_nonce, challenge.server_nonce);
  WriteSeed(dir, "auth", 3, EncodeAuth(auth));
  BlockRequest req;
  req.request_id = 41;
  req.id = {shards[1], 16ull << 20, 1764400000123456789};
  req.offset = 4ull << 20;
  req.length = 4ull << 20;
  WriteSeed(dir, "request", 4, EncodeRequest(req));
  ResponseHeader header{41, 0, 0x1c2d3e4f, 4ull << 20};
  const auto h = EncodeResponseHeader(header);
  WriteSeed(dir, "response-header", 5, std::string_view(h.data(), h.size()));
  ShardQuery query;
  query.query_id = 7;
  query.hold_ms = 1500;
  query.want_checksums = true;
  query.paths = shards;
  WriteSeed(dir, "shard-query", 6, EncodeShardQuery(query));
  ShardAnswer answer;
  answer.query_id = 7;
  for (size_t i = 0; i < shards.size(); ++i) {
    ckptfs::store::ShardStatus st;
    st.state = i == 3 ? ckptfs::store::ShardState::kPending : ckptfs::store::ShardState::kDurable;
    st.length = i == 3 ? 0 : (1ull << 20) + i;
    if (i < 2) {
      auto sums = std::make_shared<ckptfs::store::ShardChecksums>();
      sums->id = {2049, 131 + i, st.length, 1764400000123456789};
      sums->block_bytes = 64u << 10;
      for (uint64_t b = 0; b < (st.length + sums->block_bytes - 1) / sums->block_bytes; ++b) {
        sums->block_crcs.push_back(static_cast<uint32_t>(0x9e3779b9u * (b + 1)));
      }
      st.checksums = std::move(sums);
    }
    answer.states.push_back(st);
  }
  WriteSeed(dir, "shard-answer", 7, EncodeShardAnswer(answer));
  ShardAnswer refused;
  refused.query_id = 8;
  refused.code = 5;
  refused.error = "shard states: not available";
  WriteSeed(dir, "shard-answer-error", 7, EncodeShardAnswer(refused));
  ckptfs::store::MemUnit unit;
  unit.tree = "fast";
  unit.path = "fast/iter_0000003";
  unit.seq = 1764400000123456789;
  for (size_t i = 0; i < 2; ++i) unit.files.push_back({"__" + std::to_string(i) + "_0.distcp", 1u << 20, 0x01020304u + static_cast<uint32_t>(i)});
  WriteSeed(dir, "memory-unit", 8, wire::UnitJson(unit).dump());
  WriteSeed(dir, "memory-name", 9, wire::Hex("iter_0000003"));
  WriteSeed(dir, "memory-rank", 9, "12");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("WIRE_FUZZ_SEEDS")) {
    WriteSeeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 10) {
    case 0:
      Stable(bytes, DecodeHello, EncodeHello);
      break;
    case 1:
      Stable(bytes, DecodeChallenge, EncodeChallenge);
      break;
    case 2:
      Stable(bytes, DecodeAuthResult, EncodeAuthResult);
      break;
    case 3:
      Stable(bytes, DecodeAuth, EncodeAuth);
      break;
    case 4:
      Stable(bytes, DecodeRequest, EncodeRequest);
      break;
    case 5:
      Stable(bytes, DecodeResponseHeader, EncodeResponseHeader);
      break;
    case 6:
      Stable(bytes, DecodeShardQuery, EncodeShardQuery);
      break;
    case 7:
      Stable(bytes, DecodeShardAnswer, EncodeShardAnswer);
      break;
    case 8: {
      // A memory replica's unit record: JSON from a peer, names in hex.
      nlohmann::json j = nlohmann::json::parse(bytes, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) break;
      auto unit = wire::UnitFromJson(j);
      if (!unit.ok()) break;
      const std::string once = wire::UnitJson(*unit).dump();
      auto again = wire::UnitFromJson(nlohmann::json::parse(once));
      if (!again.ok() || wire::UnitJson(*again).dump() != once) __builtin_trap();
      break;
    }
    case 9: {
      // A name component of the memory replica protocol, and a rank.
      auto name = wire::Unhex(bytes);
      if (name.ok() && wire::Hex(*name) != bytes) __builtin_trap();
      auto rank = wire::ParseRank(bytes);
      if (rank.ok()) {
        // Only 1 to 9 digits: a rank fits, leading zeros and all.
        if (bytes.empty() || bytes.size() > 9) __builtin_trap();
        uint64_t value = 0;
        for (char c : bytes) {
          if (c < '0' || c > '9') __builtin_trap();
          value = value * 10 + static_cast<uint64_t>(c - '0');
        }
        if (value != *rank) __builtin_trap();
      }
      break;
    }
  }
  return 0;
}
