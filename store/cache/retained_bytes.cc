#include "store/cache/retained_bytes.h"

#include <sys/uio.h>

#include <cstring>

namespace ckptfs::store {

bool RetainedBytes::Read(const std::string& path, const FileKey& key, uint64_t off,
                         std::span<char> out) {
  if (out.empty()) return true;
  if (!tier_->enabled() || off >= key.size || key.size - off < out.size()) return false;
  const BlockId id{path, key.size, key.mtime_ns};
  size_t copied = 0;
  const std::optional<size_t> served =
      tier_->ReadInPlace(
          id, out.size(), off,
          [&](std::span<const struct iovec> pieces) {
            for (const struct iovec& v : pieces) {
              if (v.iov_len > out.size() - copied) return;  // cannot be: the range is clamped
              std::memcpy(out.data() + copied, v.iov_base, v.iov_len);
              copied += v.iov_len;
            }
          },
          RetainedTier::Reader::kIndexBuild);
  return served && *served == out.size() && copied == out.size();
}

}  // namespace ckptfs::store
