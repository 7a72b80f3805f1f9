#include "store/dcp/fqn_names.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>

#include "store/dcp/indexed_item.h"

namespace ckptfs::store {

namespace {
constexpr size_t kMaxName = 255;
constexpr size_t kHashSuffix = 17;  // "~" + 16 hex digits
const char kHex[] = "0123456789ABCDEF";

bool NeedsEscape(unsigned char c) {
  return c == '%' || c == '/' || c == '~' || c < 0x20 || c == 0x7f;
}
int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

std::string EscapeFqn(const std::string& fqn) {
  if (fqn.empty()) return "%";
  std::string out;
  out.reserve(fqn.size());
  for (size_t i = 0; i < fqn.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(fqn[i]);
    if (NeedsEscape(c) || (i == 0 && c == '.')) {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (out.size() <= kMaxName) return out;
  size_t cut = kMaxName - kHashSuffix;
  // Never cut inside a %XX escape.
  if (out[cut - 1] == '%') {
    cut -= 1;
  } else if (out[cut - 2] == '%') {
    cut -= 2;
  }
  out.resize(cut);
  char suffix[kHashSuffix + 1];
  std::snprintf(suffix, sizeof(suffix), "~%016llx",
                static_cast<unsigned long long>(XXH3_64bits(fqn.data(), fqn.size())));
  return out + suffix;
}

std::optional<std::string> UnescapeFqn(std::string_view name) {
  if (name == "%") return std::string();
  std::string out;
  out.reserve(name.size());
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    if (c == '%') {
      if (i + 2 >= name.size()) return std::nullopt;
      int hi = HexValue(name[i + 1]), lo = HexValue(name[i + 2]);
      if (hi < 0 || lo < 0) return std::nullopt;
      out.push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    } else if (NeedsEscape(static_cast<unsigned char>(c)) || c == '\0') {
      return std::nullopt;  // '~' marks a hashed name
    } else {
      out.push_back(c);
    }
  }
  if (EscapeFqn(out) != name) return std::nullopt;  // not canonical
  return out;
}

std::optional<std::string> FindFqnByEscapedName(const std::vector<std::string>& fqns,
                                                std::string_view name) {
  if (std::optional<std::string> plain = UnescapeFqn(name)) {
    if (std::find(fqns.begin(), fqns.end(), *plain) != fqns.end()) return plain;
    return std::nullopt;
  }
  for (const std::string& fqn : fqns) {
    if (EscapeFqn(fqn) == name) return fqn;
  }
  return std::nullopt;
}

std::string KeyName(const IndexedItem& item) { return item.fqn + "@" + ChunkFileName(item); }

std::string ChunkFileName(const IndexedItem& item) {
  if (item.is_bytes) return "data";
  if (item.chunk_offsets.empty()) return "scalar";
  std::string out;
  for (size_t i = 0; i < item.chunk_offsets.size(); ++i) {
    if (i) out.push_back('_');
    out += std::to_string(item.chunk_offsets[i]);
  }
  return out;
}

}  // namespace ckptfs::store
