#include "store/memory/memory_replicas.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "common/path.h"

namespace ckptfs::store {

MemoryReplicas::~MemoryReplicas() {
  MutexLock lock(&mu_);
  for (const auto& [key, r] : held_) Unreserve(r.unit.bytes());
}

void MemoryReplicas::Put(MemReplica r) {
  std::vector<MemReplica> dropped;
  {
    MutexLock lock(&mu_);
    // The same unit's older version; for a checkpoint, the older checkpoints of its tree.
    std::vector<std::string> evicted;  // their names
    for (auto it = held_.begin(); it != held_.end();) {
      const MemReplica& old = it->second;
      const bool same_tree = old.origin == r.origin && old.unit.tree == r.unit.tree;
      const bool replaced =
          same_tree && (old.unit.path == r.unit.path || (r.unit.checkpoint && old.unit.checkpoint));
      if (replaced) {
        if (old.unit.checkpoint && old.unit.path != r.unit.path) {
          evicted.emplace_back(path::Basename(old.unit.path));
        }
        dropped.push_back(std::move(it->second));
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
    // And the trackers naming those, as on the writer (memory_tier.h): a restore never
    // brings back a tracker that names a checkpoint it cannot bring back.
    for (auto it = held_.begin(); it != held_.end();) {
      const MemReplica& t = it->second;
      bool names = false;
      if (!t.unit.checkpoint && t.origin == r.origin && t.unit.tree == r.unit.tree &&
          !t.data.empty() && t.data[0]->size() <= 4096) {
        for (const std::string& e : evicted) names |= NamesCheckpoint(*t.data[0], e);
      }
      if (names) {
        dropped.push_back(std::move(it->second));
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
    spdlog::info("memory-only replica of {}/{} from rank {} ({}) held: {} files, {} bytes",
                 r.unit.tree, r.unit.path, r.origin, r.origin_address, r.unit.files.size(),
                 r.unit.bytes());
    Key key{r.origin, r.unit.tree, r.unit.path};
    held_.emplace(std::move(key), std::move(r));
  }
  for (const MemReplica& d : dropped) {
    spdlog::debug("memory-only replica of {}/{} from rank {} replaced", d.unit.tree, d.unit.path,
                  d.origin);
    Unreserve(d.unit.bytes());
  }
}

void MemoryReplicas::Rename(const std::string& tree, const std::string& from,
                            const std::string& to) {
  std::vector<MemReplica> dropped;
  {
    MutexLock lock(&mu_);
    std::vector<MemReplica> moved;
    for (auto it = held_.begin(); it != held_.end();) {
      std::optional<std::string> now;
      if (it->second.unit.tree == tree) now = path::Rebase(it->second.unit.path, from, to);
      if (!now) {
        ++it;
        continue;
      }
      it->second.unit.path = *now;
      moved.push_back(std::move(it->second));
      it = held_.erase(it);
    }
    for (MemReplica& r : moved) {
      Key key{r.origin, r.unit.tree, r.unit.path};
      if (auto old = held_.find(key); old != held_.end()) {  // what the new name held
        dropped.push_back(std::move(old->second));
        held_.erase(old);
      }
      held_.emplace(std::move(key), std::move(r));
    }
  }
  for (const MemReplica& d : dropped) Unreserve(d.unit.bytes());
}

bool MemoryReplicas::Has(uint32_t origin, const std::string& tree, const std::string& path,
                         uint64_t seq) const {
  MutexLock lock(&mu_);
  auto it = held_.find(Key{origin, tree, path});
  return it != held_.end() && it->second.unit.seq == seq;
}

std::vector<MemUnit> MemoryReplicas::Index(uint32_t origin) const {
  MutexLock lock(&mu_);
  std::vector<MemUnit> out;
  for (const auto& [key, r] : held_) {
    if (r.origin == origin) out.push_back(r.unit);
  }
  std::stable_partition(out.begin(), out.end(), [](const MemUnit& u) { return u.checkpoint; });
  return out;
}

Result<size_t> MemoryReplicas::Read(uint32_t origin, const std::string& tree,
                                    const std::string& path, uint64_t seq, const std::string& file,
                                    char* out, size_t len, uint64_t offset) const {
  std::shared_ptr<const std::string> data;
  {
    MutexLock lock(&mu_);
    auto it = held_.find(Key{origin, tree, path});
    if (it == held_.end() || it->second.unit.seq != seq) {
      return NotFound("no replica of " + tree + "/" + path + " for rank " + std::to_string(origin));
    }
    const MemReplica& r = it->second;
    for (size_t i = 0; i < r.unit.files.size(); ++i) {
      if (r.unit.files[i].name == file) data = r.data[i];
    }
  }
  if (!data) return NotFound("no file " + file + " in the replica of " + path);
  if (offset > data->size()) return Invalid("offset past the end of " + path + "/" + file);
  const size_t n = std::min<uint64_t>(len, data->size() - offset);
  std::memcpy(out, data->data() + offset, n);
  return n;
}

nlohmann::json MemoryReplicas::Json() const {
  MutexLock lock(&mu_);
  nlohmann::json list = nlohmann::json::array();
  uint64_t bytes = 0;
  for (const auto& [key, r] : held_) {
    list.push_back({{"origin_rank", r.origin},
                    {"origin", r.origin_address},
                    {"path", r.unit.tree + "/" + r.unit.path},
                    {"kind", r.unit.checkpoint ? "checkpoint" : "tracker"},
                    {"bytes", r.unit.bytes()}});
    bytes += r.unit.bytes();
  }
  return {{"held", list}, {"held_bytes", bytes}};
}

}  // namespace ckptfs::store
