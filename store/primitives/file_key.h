// FileKey: the node-local identity of one version of a backing file (device, inode, size,
// mtime). A change in any field means new contents. It names bytes only on this node; the
// name every daemon agrees on is store::BlockId (store/cache/block_source.h).
#pragma once

#include <sys/stat.h>

#include <compare>
#include <cstdint>

namespace ckptfs::store {

struct FileKey {
  uint64_t dev = 0, ino = 0, size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileKey&) const = default;
  auto operator<=>(const FileKey&) const = default;
};

// The key of a file as fstat() describes it now.
inline FileKey FileKeyFromStat(const struct stat& st) {
  FileKey key;
  key.dev = static_cast<uint64_t>(st.st_dev);
  key.ino = static_cast<uint64_t>(st.st_ino);
  key.size = static_cast<uint64_t>(st.st_size);
  key.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return key;
}

}  // namespace ckptfs::store
