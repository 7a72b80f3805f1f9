#include "store/dcp/safetensors_header.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

namespace ckptfs::store {
namespace {

using json = nlohmann::json;

struct DtypeInfo {
  std::string_view st, torch;
  uint32_t bits;
};
constexpr DtypeInfo kDtypes[] = {
    {"BOOL", "bool", 8},          {"U8", "uint8", 8},
    {"I8", "int8", 8},            {"I16", "int16", 16},
    {"U16", "uint16", 16},        {"F16", "float16", 16},
    {"BF16", "bfloat16", 16},     {"I32", "int32", 32},
    {"U32", "uint32", 32},        {"F32", "float32", 32},
    {"F64", "float64", 64},       {"I64", "int64", 64},
    {"U64", "uint64", 64},        {"C64", "complex64", 64},
    {"F8_E4M3", "float8_e4m3fn", 8}, {"F8_E5M2", "float8_e5m2", 8},
};

// Element count of `shape` times `bits` / 8, or false on overflow.
bool NBytes(const std::vector<int64_t>& shape, uint32_t bits, uint64_t* out) {
  unsigned __int128 n = bits;
  for (int64_t d : shape) {
    n *= static_cast<uint64_t>(d);
    if (n > (static_cast<unsigned __int128>(1) << 70)) return false;
  }
  if (n % 8 != 0) return false;
  *out = static_cast<uint64_t>(n / 8);
  return true;
}

bool NonNegInt(const json& v, int64_t* out) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    *out = v.get<int64_t>();
    return *out >= 0;
  }
  return false;
}

}  // namespace

bool SafetensorsDtype(std::string_view st_dtype, std::string* torch_name, uint32_t* bits) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.st == st_dtype) {
      *torch_name = std::string(d.torch);
      *bits = d.bits;
      return true;
    }
  }
  return false;
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view text, uint64_t data_start,
                                                 uint64_t file_size, std::string_view what) {
  auto bad = [&](const std::string& why) {
    return Status(Code::kCorrupt, "safetensors " + std::string(what) + ": " + why);
  };
  if (data_start > file_size) return bad("header runs past the end of the file");
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return bad("header is not valid JSON");
  if (!j.is_object()) return bad("header is not a JSON object");
  SafetensorsHeader h;
  h.data_start = data_start;
  const uint64_t data_bytes = file_size - data_start;

  // DCP sharding info: fqn -> saved_offsets.
  std::map<std::string, std::vector<int64_t>> saved;
  if (auto m = j.find("__metadata__"); m != j.end()) {
    if (!m->is_object()) return bad("\"__metadata__\" is not an object");
    for (const auto& [k, v] : m->items()) {
      if (!v.is_string()) return bad("\"__metadata__\" value of \"" + k + "\" is not a string");
      h.metadata[k] = v.get<std::string>();
    }
    if (auto info = h.metadata.find("DCP_SHARDING_INFO"); info != h.metadata.end()) {
      json s = json::parse(info->second, nullptr, /*allow_exceptions=*/false);
      if (!s.is_object()) return bad("DCP_SHARDING_INFO is not a JSON object");
      for (const auto& [fqn, v] : s.items()) {
        if (!v.is_object()) return bad("DCP_SHARDING_INFO of \"" + fqn + "\" is not an object");
        auto offs = v.find("saved_offsets");
        if (offs == v.end()) continue;
        if (!offs->is_array()) return bad("saved_offsets of \"" + fqn + "\" is not a list");
        std::vector<int64_t>& out = saved[fqn];
        for (const json& o : *offs) {
          int64_t x;
          if (!NonNegInt(o, &x)) return bad("saved_offsets of \"" + fqn + "\": not an offset");
          out.push_back(x);
        }
      }
    }
  }

  for (const auto& item : j.items()) {
    // Not a structured binding: clang 14 (the sanitizer trees) cannot capture one in a lambda.
    const std::string& name = item.key();
    const nlohmann::json& v = item.value();
    if (name == "__metadata__") continue;
    auto t_bad = [&](const std::string& why) { return bad("tensor \"" + name + "\": " + why); };
    if (name.empty()) return bad("a tensor has an empty name");
    if (!v.is_object()) return t_bad("not an object");
    auto dt = v.find("dtype");
    auto shape = v.find("shape");
    auto offs = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return t_bad("no string \"dtype\"");
    if (shape == v.end() || !shape->is_array()) return t_bad("no list \"shape\"");
    if (offs == v.end() || !offs->is_array() || offs->size() != 2) {
      return t_bad("\"data_offsets\" is not [begin, end]");
    }
    SafetensorsTensor t;
    t.name = name;
    t.st_dtype = dt->get<std::string>();
    if (shape->size() > 64) return t_bad("more than 64 dimensions");
    for (const json& d : *shape) {
      int64_t x;
      if (!NonNegInt(d, &x)) return t_bad("shape holds something other than a size");
      t.shape.push_back(x);
    }
    int64_t b, e;
    if (!NonNegInt((*offs)[0], &b) || !NonNegInt((*offs)[1], &e) || b > e) {
      return t_bad("\"data_offsets\" is not an increasing pair of offsets");
    }
    if (static_cast<uint64_t>(e) > data_bytes) {
      return t_bad("data [" + std::to_string(b) + ", " + std::to_string(e) +
                   ") runs past the end of the file (" + std::to_string(data_bytes) +
                   " data bytes)");
    }
    t.begin = data_start + static_cast<uint64_t>(b);
    t.end = data_start + static_cast<uint64_t>(e);
    uint32_t bits = 0;
    t.known_dtype = SafetensorsDtype(t.st_dtype, &t.dtype, &bits);
    if (t.known_dtype) {
      uint64_t want = 0;
      if (!NBytes(t.shape, bits, &want) || want != t.end - t.begin) {
        return t_bad(t.st_dtype + " of this shape is not " + std::to_string(t.end - t.begin) +
                     " bytes");
      }
    } else {
      t.dtype = t.st_dtype;
    }
    if (auto s = saved.find(name); s != saved.end()) {
      if (s->second.size() != t.shape.size()) {
        return t_bad("saved_offsets has " + std::to_string(s->second.size()) +
                     " dimensions, shape " + std::to_string(t.shape.size()));
      }
      t.saved_offsets = s->second;
    } else {
      t.saved_offsets.assign(t.shape.size(), 0);
    }
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.name < b.name;
  });
  // The safetensors library rejects overlapping tensors; so does ckptfs.
  for (size_t i = 1; i < h.tensors.size(); ++i) {
    const SafetensorsTensor &p = h.tensors[i - 1], &t = h.tensors[i];
    if (t.begin < p.end) return bad("tensors \"" + p.name + "\" and \"" + t.name + "\" overlap");
  }
  return h;
}

Result<SafetensorsHeader> ReadSafetensorsHeader(BackingDir* dir, const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, dir->OpenFile(path, O_RDONLY | O_CLOEXEC));
  CKPT_ASSIGN_OR_RETURN(struct stat st, dir->Fstat(fd.get()));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  unsigned char len[8];
  if (size < 8) return Corrupt("safetensors " + path + ": " + std::to_string(size) +
                               " bytes, shorter than its 8-byte header length");
  CKPT_ASSIGN_OR_RETURN(size_t got, dir->PRead(fd.get(), len, 8, 0));
  if (got != 8) return Corrupt("safetensors " + path + ": short read of the header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n > kMaxSafetensorsHeaderBytes) {
    return Corrupt("safetensors " + path + ": header of " + std::to_string(n) +
                   " bytes, over the " + std::to_string(kMaxSafetensorsHeaderBytes) +
                   "-byte limit");
  }
  if (n > size - 8) {
    return Corrupt("safetensors " + path + ": header of " + std::to_string(n) +
                   " bytes runs past the end of the file (" + std::to_string(size) + " bytes)");
  }
  std::string text(n, '\0');
  CKPT_ASSIGN_OR_RETURN(got, dir->PRead(fd.get(), text.data(), n, 8));
  if (got != n) return Corrupt("safetensors " + path + ": short read of the header");
  return ParseSafetensorsHeader(text, 8 + n, size, path);
}

}  // namespace ckptfs::store
