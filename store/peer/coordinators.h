// Which node commits a checkpoint, as learned from the commit queries this node answers
// (docs/PEERS.md, "Commit query"): the node that asks about the shards of directory D is
// the one about to publish D's `.metadata` (DCP's rank 0, wherever the job placed it).
// PeerNode::AskCoordinator asks that node about D's `.metadata` (a tracker or a deletion
// waiting for it here); a directory not learned yet is asked of the first node of the
// list, where a job usually puts rank 0.
//
// Bounded: the `max_dirs` most recently learned directories (a job commits one checkpoint
// at a time; the bound is for a store with many jobs). Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>

#include "common/mutex.h"

namespace ckptfs::store::peer {

class CheckpointCoordinators {
 public:
  explicit CheckpointCoordinators(size_t max_dirs = 4096) : max_dirs_(max_dirs) {}

  // Node `rank` asked about a shard in `dir`.
  void Learn(const std::string& dir, uint32_t rank) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    auto [it, added] = by_dir_.insert_or_assign(dir, rank);
    if (!added) return;
    order_.push_back(it->first);
    while (order_.size() > max_dirs_) {
      by_dir_.erase(order_.front());
      order_.pop_front();
    }
  }
  std::optional<uint32_t> Of(const std::string& dir) const EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    auto it = by_dir_.find(dir);
    if (it == by_dir_.end()) return std::nullopt;
    return it->second;
  }
  size_t size() const EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return by_dir_.size();
  }

 private:
  const size_t max_dirs_;
  mutable Mutex mu_;
  std::map<std::string, uint32_t> by_dir_ GUARDED_BY(mu_);
  std::deque<std::string> order_ GUARDED_BY(mu_);  // learned first, first
};

}  // namespace ckptfs::store::peer
