// The header of a safetensors file, read without touching its data:
//   u64 little-endian N | N bytes of JSON | data
// The JSON maps each tensor name to {"dtype": "F16", "shape": [..], "data_offsets": [b, e]}
// (offsets relative to the data, which starts at 8 + N), plus an optional "__metadata__"
// map of strings. torch's HuggingFaceStorageWriter puts its DCP sharding there:
// "DCP_SHARDING_INFO" is a JSON string {fqn: {"saved_offsets": [..]}}, the chunk offsets of
// each tensor in the global tensor (all zero for a full tensor).
//
// Never throws, never crashes on hostile input: a header that is short, over the size limit,
// not a JSON object, or whose tensors have a bad shape, a range outside the file or a byte
// count that disagrees with dtype and shape is a Corrupt error naming the file and tensor.
// A dtype ckptfs does not know (a newer safetensors one) is kept with known_dtype false:
// its bytes are served, not interpreted. Pure functions apart from ReadSafetensorsHeader.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {

// The safetensors library refuses headers over 100 MB; so does ckptfs.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

struct SafetensorsTensor {
  std::string name;
  std::string st_dtype;  // as written: "BF16"
  std::string dtype;     // the torch name: "bfloat16"; st_dtype when !known_dtype
  bool known_dtype = false;
  std::vector<int64_t> shape;
  std::vector<int64_t> saved_offsets;  // from DCP_SHARDING_INFO; zeros when absent
  uint64_t begin = 0, end = 0;         // file-absolute byte range of the data
};

struct SafetensorsHeader {
  uint64_t data_start = 0;                  // 8 + N
  std::vector<SafetensorsTensor> tensors;   // by (begin, name)
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

// The torch dtype name of a safetensors dtype ("F16" -> "float16") and its element size in
// bits; false for a dtype ckptfs does not know.
bool SafetensorsDtype(std::string_view st_dtype, std::string* torch_name, uint32_t* bits);

// Parses the JSON header `json` of a file of `file_size` bytes whose data starts at
// `data_start` (8 + json.size()). `what` names the file in errors.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t data_start,
                                                 uint64_t file_size, std::string_view what);

// Reads and parses the header of the file at `path` in `dir` (two small reads).
Result<SafetensorsHeader> ReadSafetensorsHeader(BackingDir* dir, const std::string& path);

}  // namespace ckptfs::store
