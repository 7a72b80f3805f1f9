// The Hugging Face sharded-safetensors index (`model.safetensors.index.json`):
//   {"metadata": {"total_size": N, ...}, "weight_map": {"tensor name": "shard file", ...}}
// Only what the commit gate needs: the shard files it names. Never throws; a malformed
// index (not JSON, no `weight_map` object, a value that is not a plain file name in the
// same directory) is a clear Corrupt error.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace ckptfs::store {

// The distinct shard files `json`'s weight_map names, sorted. A name is a single path
// component (no `/`, not `.` or `..`, no NUL), as transformers and torch write them.
Result<std::vector<std::string>> ParseSafetensorsIndex(std::string_view json);

// A safetensors file is at least its 8-byte little-endian header length.
inline constexpr uint64_t kMinSafetensorsBytes = 8;

}  // namespace ckptfs::store
