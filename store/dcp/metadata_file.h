// Reading a `.metadata` file from the backing store, size-capped. Every reader of a
// `.metadata` (commit gate, key index) goes through this, so an oversized or hostile file
// is refused the same way everywhere, before it is read into memory.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {

// The pickle reader refuses larger inputs anyway (PickleLimits::max_input_bytes).
inline constexpr uint64_t kMaxMetadataBytes = 256ull << 20;

// The bytes of the file at `path` in `dir`; Corrupt when it is over kMaxMetadataBytes.
Result<std::string> ReadMetadataBytes(BackingDir* dir, const std::string& path);

}  // namespace ckptfs::store
