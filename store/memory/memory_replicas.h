// MemoryReplicas (issue 42): the copies this node holds of other nodes' memory-only units
// (checkpoint directories and trackers, store/memory/memory_tier.h's MemUnit), so that a
// writer that restarts, or the node that replaces it, gets them back.
//
// A replica is whole or absent: Put() takes one whose every file was received and checked
// against its manifest's CRC32C. It lives in the budget of this node's MemoryTier
// (`--memory-ckpt-mem`: Reserve() before receiving, kNoSpace when it does not fit). Per
// origin node and tree, a checkpoint replaces the older checkpoints (as on its writer) and a
// tracker the older version of the same tracker. Replicas are never written anywhere: they
// last as long as this daemon runs.
//
// Thread-safe. File bytes are shared, immutable: reads copy without the lock.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/mutex.h"
#include "common/status.h"
#include "store/memory/memory_tier.h"

namespace ckptfs::store {

struct MemReplica {
  uint32_t origin = 0;         // the writer's rank
  std::string origin_address;  // where it listened when this was pulled
  MemUnit unit;
  std::vector<std::shared_ptr<const std::string>> data;  // one per unit.files, in order
};

class MemoryReplicas {
 public:
  explicit MemoryReplicas(MemoryTier* tier) : tier_(tier) {}  // must outlive
  MemoryReplicas(const MemoryReplicas&) = delete;
  MemoryReplicas& operator=(const MemoryReplicas&) = delete;
  ~MemoryReplicas();  // gives the budget back

  // `bytes` of the tier's budget for a replica about to be received (kNoSpace).
  Status Reserve(uint64_t bytes) { return tier_->ChargeReplicas(static_cast<int64_t>(bytes)); }
  void Unreserve(uint64_t bytes) { (void)tier_->ChargeReplicas(-static_cast<int64_t>(bytes)); }
  // Keeps `r`, whose bytes were reserved; drops what it replaces (their budget given back).
  void Put(MemReplica r) EXCLUDES(mu_);
  // Directory `from` of `tree` was renamed to `to` (on every node): the units at or below
  // it, of every origin, are held under their new names (what those names held is dropped).
  void Rename(const std::string& tree, const std::string& from, const std::string& to)
      EXCLUDES(mu_);
  // Whether unit `path` of `tree` from `origin` is held at version `seq`.
  bool Has(uint32_t origin, const std::string& tree, const std::string& path, uint64_t seq) const
      EXCLUDES(mu_);
  // Every unit held for `origin`, checkpoints first.
  std::vector<MemUnit> Index(uint32_t origin) const EXCLUDES(mu_);
  Result<size_t> Read(uint32_t origin, const std::string& tree, const std::string& path,
                      uint64_t seq, const std::string& file, char* out, size_t len,
                      uint64_t offset) const EXCLUDES(mu_);
  nlohmann::json Json() const EXCLUDES(mu_);

 private:
  using Key = std::tuple<uint32_t, std::string, std::string>;  // origin, tree, path
  MemoryTier* const tier_;
  mutable Mutex mu_;
  std::map<Key, MemReplica> held_ GUARDED_BY(mu_);
};

}  // namespace ckptfs::store
