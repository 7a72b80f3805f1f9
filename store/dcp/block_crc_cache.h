// BlockCrcCache: the write path's block CRC maps (BlockCrcMap) of files just published,
// kept until a key index build uses them, within a memory bound (oldest dropped first).
// Keyed by the file's path relative to the backing root; a map is handed out only for the
// very file version (FileKey) it was recorded for.
//
// Thread-safe; a leaf lock (calls nothing outside while holding it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "common/mutex.h"
#include "store/flush/block_crc_map.h"
#include "store/primitives/file_key.h"

namespace ckptfs::store {

class BlockCrcCache {
 public:
  explicit BlockCrcCache(uint64_t max_bytes) : max_bytes_(max_bytes) {}

  // Keeps `map`, the CRCs of `path` finished at its final size, for the version `id`
  // (replacing any earlier one of `path`). Ignored when unfinished or of another size.
  // `from_peer`: the map is what another node vouched for (KeyIndex::AddPeerBlockCrcs); it
  // never displaces a map kept for `path` already (of any version), and Latest() never
  // hands it on.
  void Add(const std::string& path, const FileKey& id, std::shared_ptr<const BlockCrcMap> map,
           bool from_peer = false) EXCLUDES(mu_);
  // The map of `path` if it describes the version `id`, else nullptr.
  std::shared_ptr<const BlockCrcMap> For(const std::string& path, const FileKey& id) EXCLUDES(mu_);
  // The map this node recorded for `path`, of whichever version (set in `*id`), or nullptr
  // (also when the map kept came from a peer).
  std::shared_ptr<const BlockCrcMap> Latest(const std::string& path, FileKey* id) EXCLUDES(mu_);
  void Drop(const std::string& path) EXCLUDES(mu_);
  // Drops the maps of the files directly in directory `dir` (not of nested directories).
  void DropFilesIn(const std::string& dir) EXCLUDES(mu_);
  // `from` was renamed to `to`: maps at or below `from` move (path::Rebase); whatever was
  // kept under their new names is gone (renamed over).
  void OnRenamed(const std::string& from, const std::string& to) EXCLUDES(mu_);
  uint64_t bytes() const EXCLUDES(mu_);

 private:
  struct Entry {
    FileKey id;
    std::shared_ptr<const BlockCrcMap> map;
    uint64_t seq = 0;  // age, for eviction
    size_t bytes = 0;
    bool from_peer = false;
  };
  void DropLocked(const std::string& path) REQUIRES(mu_);

  const uint64_t max_bytes_;
  mutable Mutex mu_;
  std::map<std::string, Entry> by_path_ GUARDED_BY(mu_);
  std::map<uint64_t, std::string> by_age_ GUARDED_BY(mu_);  // seq -> path
  uint64_t seq_ GUARDED_BY(mu_) = 0;
  uint64_t total_ GUARDED_BY(mu_) = 0;  // bytes
};

}  // namespace ckptfs::store
