#include "store/dcp/block_crc_cache.h"

#include <spdlog/spdlog.h>

#include <optional>
#include <utility>
#include <vector>

#include "common/path.h"

namespace ckptfs::store {

void BlockCrcCache::Add(const std::string& path, const FileKey& id,
                        std::shared_ptr<const BlockCrcMap> map, bool from_peer) {
  if (!map || !map->finished() || map->size() != id.size) return;
  const size_t bytes = map->MemoryBytes();
  MutexLock lock(&mu_);
  if (from_peer && by_path_.count(path) > 0) return;
  DropLocked(path);
  if (bytes > max_bytes_) return;
  // Oldest first: a build normally follows its shards' publication within seconds.
  while (total_ + bytes > max_bytes_ && !by_age_.empty()) {
    std::string victim = by_age_.begin()->second;
    spdlog::debug("key index: dropping the block checksums of {} (memory bound)", victim);
    DropLocked(victim);
  }
  const uint64_t seq = ++seq_;
  by_path_[path] = Entry{id, std::move(map), seq, bytes, from_peer};
  by_age_[seq] = path;
  total_ += bytes;
}

std::shared_ptr<const BlockCrcMap> BlockCrcCache::For(const std::string& path, const FileKey& id) {
  MutexLock lock(&mu_);
  auto it = by_path_.find(path);
  if (it == by_path_.end() || !(it->second.id == id)) return nullptr;
  return it->second.map;
}

std::shared_ptr<const BlockCrcMap> BlockCrcCache::Latest(const std::string& path, FileKey* id) {
  MutexLock lock(&mu_);
  auto it = by_path_.find(path);
  if (it == by_path_.end() || it->second.from_peer) return nullptr;
  *id = it->second.id;
  return it->second.map;
}

void BlockCrcCache::Drop(const std::string& path) {
  MutexLock lock(&mu_);
  DropLocked(path);
}

void BlockCrcCache::DropLocked(const std::string& path) {
  auto it = by_path_.find(path);
  if (it == by_path_.end()) return;
  total_ -= it->second.bytes;
  by_age_.erase(it->second.seq);
  by_path_.erase(it);
}

void BlockCrcCache::DropFilesIn(const std::string& dir) {
  MutexLock lock(&mu_);
  std::vector<std::string> paths;
  for (const auto& [path, entry] : by_path_) {
    // Only files directly in the directory: nested checkpoints have their own.
    if (path::IsBelow(path, dir) && path::Parent(path) == dir) paths.push_back(path);
  }
  for (const std::string& path : paths) DropLocked(path);
}

void BlockCrcCache::OnRenamed(const std::string& from, const std::string& to) {
  MutexLock lock(&mu_);
  // A file's identity does not change with a rename, so its map stays good.
  std::vector<std::pair<std::string, std::string>> moves;
  for (const auto& [path, entry] : by_path_) {
    if (std::optional<std::string> now = path::Rebase(path, from, to)) {
      moves.emplace_back(path, std::move(*now));
    }
  }
  for (auto& [old_path, new_path] : moves) {
    auto node = by_path_.extract(old_path);
    if (node.empty()) continue;  // renamed over by an earlier move
    node.key() = std::move(new_path);
    DropLocked(node.key());  // the file renamed over is gone
    by_age_[node.mapped().seq] = node.key();
    by_path_.insert(std::move(node));
  }
}

uint64_t BlockCrcCache::bytes() const {
  MutexLock lock(&mu_);
  return total_;
}

}  // namespace ckptfs::store
