// Fuzzes the two safetensors parsers the daemon runs on files it did not write: a
// safetensors header (u64 length | JSON | data; read at commit and for the tensor view)
// and a Hugging Face index (model.safetensors.index.json; read by the commit gate). The
// input is taken as a whole safetensors file and, separately, as an index. What either
// accepts must hold its contract: tensor ranges inside the data, index entries plain names.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "store/dcp/safetensors_header.h"
#include "store/safetensors_index.h"

namespace {

void CheckHeader(std::string_view file) {
  if (file.size() < 8) return;
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);  // little-endian, as the format and this host
  const std::string_view json =
      file.substr(8, static_cast<size_t>(std::min<uint64_t>(n, file.size() - 8)));
  const uint64_t data_start = 8 + json.size();
  auto h = ckptfs::store::ParseSafetensorsHeader(json, data_start, file.size(), "fuzz");
  if (!h.ok()) return;
  if (h->data_start != data_start) __builtin_trap();
  for (const auto& t : h->tensors) {
    if (t.begin < data_start || t.begin > t.end || t.end > file.size()) __builtin_trap();
    if (t.known_dtype && t.dtype.empty()) __builtin_trap();
  }
}

void CheckIndex(std::string_view json) {
  auto files = ckptfs::store::ParseSafetensorsIndex(json);
  if (!files.ok()) return;
  for (size_t i = 0; i < files->size(); ++i) {
    const std::string& f = (*files)[i];
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos ||
        f.find('\0') != std::string::npos) {
      __builtin_trap();
    }
    if (i > 0 && !((*files)[i - 1] < f)) __builtin_trap();  // sorted and distinct
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  CheckHeader(in);
  CheckIndex(in);
  return 0;
}
