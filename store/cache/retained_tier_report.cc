// RetainedTier's reports: stats, the JSON of /.ckptfs/stats, the checkpoint list; and
// RetainedSource. Split from retained_tier.cc, which keeps the tier's behaviour.
#include <algorithm>

#include "store/cache/retained_tier.h"
#include "store/cache/retained_tier_parts.h"

namespace ckptfs::store {

std::vector<RetainedCheckpoint> RetainedTier::Checkpoints() const {
  std::vector<std::pair<uint64_t, RetainedCheckpoint>> v;
  {
    MutexLock lock(&mu_);
    for (const auto& [dir, c] : ckpts_) {
      if (c.own_bytes + c.replica_bytes == 0) continue;
      v.push_back({c.committed ? c.commit_order : 0,
                   RetainedCheckpoint{dir, c.committed, c.own_bytes, c.replica_bytes, c.files,
                                      c.origin}});
    }
  }
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<RetainedCheckpoint> out;
  for (auto& [o, c] : v) out.push_back(std::move(c));
  return out;
}

RetainedTierStats RetainedTier::Stats() const {
  MutexLock lock(&mu_);
  RetainedTierStats s = stats_;
  s.used_bytes = used_;
  uint64_t capture = 0;
  for (const auto& [id, c] : captures_) {
    for (const auto& [i, b] : c->blocks) {
      if (b->buf) capture += b->buf->loan ? b->buf->cap : opts_.block_bytes;
    }
  }
  s.capture_bytes = capture;
  s.spare_bytes = spare_.size() * opts_.block_bytes;
  for (const auto& [dir, c] : ckpts_) {
    s.retained_bytes += c.own_bytes;
    s.replica_bytes += c.replica_bytes;
  }
  return s;
}

nlohmann::json RetainedTier::StatsJson() const {
  const RetainedTierStats s = Stats();
  nlohmann::json j = {{"budget_bytes", s.budget_bytes},
                      {"used_bytes", s.used_bytes},
                      {"peak_used_bytes", s.peak_used_bytes},
                      {"capture_bytes", s.capture_bytes},
                      {"spare_bytes", s.spare_bytes},
                      {"retained_bytes", s.retained_bytes},
                      {"replica_bytes", s.replica_bytes},
                      {"captured_bytes", s.captured_bytes},
                      {"kept_bytes", s.kept_bytes},
                      {"loans", s.loans},
                      {"lent_bytes", s.lent_bytes},
                      {"skipped_bytes", s.skipped_bytes},
                      {"unverified_blocks", s.unverified_blocks},
                      {"evicted_bytes", s.evicted_bytes},
                      {"dropped_bytes", s.dropped_bytes},
                      {"hits", s.hits},
                      {"hit_bytes", s.hit_bytes},
                      {"index_read_bytes", s.index_read_bytes},
                      {"misses_committed", s.misses_committed},
                      {"crc_errors", s.crc_errors},
                      {"lazy_commit_checks", s.lazy_commit_checks},
                      {"commits", s.commits}};
  nlohmann::json list = nlohmann::json::array();
  for (const RetainedCheckpoint& c : Checkpoints()) {
    list.push_back({{"path", c.dir},
                    {"state", c.committed ? "committed" : "pending"},
                    {"own_bytes", c.own_bytes},
                    {"replica_bytes", c.replica_bytes},
                    {"files", c.files},
                    {"replica_of", c.origin}});
  }
  j["checkpoints"] = std::move(list);
  if (extra_stats_) extra_stats_(&j);
  return j;
}

bool RetainedTier::CorruptForTest(const BlockId& id, uint64_t index) {
  MutexLock lock(&mu_);
  auto it = held_.find(Key{id, index});
  if (it == held_.end() || it->second->len == 0) return false;
  it->second->buf->p[it->second->len / 2] ^= 0x5a;
  return true;
}

Result<BlockRead> RetainedSource::ReadBlock(const BlockId& id, uint64_t offset,
                                            std::span<char> out) {
  if (id.path.starts_with(kRetainedOnlyPrefix)) {
    BlockId real = id;
    real.path.erase(0, kRetainedOnlyPrefix.size());
    if (std::optional<BlockRead> hit = tier_->Lookup(real, offset, out)) return *hit;
    return Status(Code::kNotFound, "not held in memory: " + real.path);
  }
  if (std::optional<BlockRead> hit = tier_->Lookup(id, offset, out)) return *hit;
  return inner_->ReadBlock(id, offset, out);
}

}  // namespace ckptfs::store
