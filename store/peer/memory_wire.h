// The names and answers of the memory-only replica protocol (memory_replica.h), shared by
// memory_replica.cc and memory_gather.cc. Private to store/peer/.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "store/cache/block_source.h"
#include "store/memory/memory_tier.h"

namespace ckptfs::store::peer::wire {

// "x" + hex: a name component that is never empty, ".", ".." nor holds a '/'.
inline std::string Hex(std::string_view s) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out = "x";
  for (unsigned char c : s) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

inline Result<std::string> Unhex(std::string_view s) {
  if (s.empty() || s[0] != 'x' || s.size() % 2 != 1) return Invalid("memory replica: bad name");
  std::string out;
  for (size_t i = 1; i < s.size(); i += 2) {
    auto digit = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      return -1;
    };
    const int hi = digit(s[i]), lo = digit(s[i + 1]);
    if (hi < 0 || lo < 0) return Invalid("memory replica: bad name");
    out.push_back(static_cast<char>(hi << 4 | lo));
  }
  return out;
}

inline std::vector<std::string_view> Split(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t slash = s.find('/', start);
    if (slash == std::string_view::npos) slash = s.size();
    out.push_back(s.substr(start, slash - start));
    start = slash + 1;
  }
  return out;
}

inline Result<uint32_t> ParseRank(std::string_view s) {
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string_view::npos) {
    return Invalid("memory replica: bad rank");
  }
  return static_cast<uint32_t>(std::stoul(std::string(s)));
}

// An unsigned integer field of a peer's JSON, at most `max`. A float, a negative number or
// one past the range is refused: nlohmann converts those with undefined behaviour (found by
// wire_fuzz: a `"seq"` of 6.6e21). Throws as nlohmann's at() does for a missing key.
inline Result<uint64_t> UnsignedField(const nlohmann::json& j, const char* key,
                                      uint64_t max = UINT64_MAX) {
  const nlohmann::json& v = j.at(key);
  if (!v.is_number_unsigned() || v.get<uint64_t>() > max) {
    return Invalid(std::string("memory replica: ") + key + " is not an unsigned integer in range");
  }
  return v.get<uint64_t>();
}

// Names are bytes: hex in JSON.
inline nlohmann::json UnitJson(const MemUnit& u) {
  nlohmann::json files = nlohmann::json::array();
  for (const MemUnitFile& f : u.files) {
    files.push_back({{"name", Hex(f.name)}, {"size", f.size}, {"crc32c", f.crc32c}});
  }
  return {{"tree", Hex(u.tree)},
          {"path", Hex(u.path)},
          {"checkpoint", u.checkpoint},
          {"seq", u.seq},
          {"files", std::move(files)}};
}

inline Result<MemUnit> UnitFromJson(const nlohmann::json& j) {
  try {
    MemUnit u;
    CKPT_ASSIGN_OR_RETURN(u.tree, Unhex(j.at("tree").get<std::string>()));
    CKPT_ASSIGN_OR_RETURN(u.path, Unhex(j.at("path").get<std::string>()));
    u.checkpoint = j.at("checkpoint").get<bool>();
    CKPT_ASSIGN_OR_RETURN(u.seq, UnsignedField(j, "seq"));
    for (const nlohmann::json& f : j.at("files")) {
      MemUnitFile file;
      CKPT_ASSIGN_OR_RETURN(file.name, Unhex(f.at("name").get<std::string>()));
      CKPT_ASSIGN_OR_RETURN(file.size, UnsignedField(f, "size"));
      CKPT_ASSIGN_OR_RETURN(const uint64_t crc, UnsignedField(f, "crc32c", UINT32_MAX));
      file.crc32c = static_cast<uint32_t>(crc);
      u.files.push_back(std::move(file));
    }
    if (u.path.empty() || (!u.checkpoint && u.files.size() != 1)) {
      return Invalid("memory replica: malformed unit");
    }
    return u;
  } catch (const nlohmann::json::exception& e) {
    return Invalid(std::string("memory replica: malformed manifest: ") + e.what());
  }
}

inline Result<BlockRead> Page(const std::string& text, uint64_t offset, std::span<char> out) {
  if (offset > text.size()) return Invalid("memory replica: offset past the end");
  const size_t n = std::min<uint64_t>(out.size(), text.size() - offset);
  std::memcpy(out.data(), text.data() + offset, n);
  return BlockRead{.bytes = n, .crc32c = std::nullopt};
}

// Only these mark the rank down; a refusal (kNoSpace, kSuperseded, ...) is an answer.
inline bool ConnectionLost(const Status& st) {
  return st.code() == Code::kIo || st.code() == Code::kTimeout;
}

}  // namespace ckptfs::store::peer::wire
