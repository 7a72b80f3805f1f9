#include "store/peer/replica.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/path.h"
#include "store/cache/backing_source.h"
#include "store/peer/peer_node.h"
#include "store/primitives/crc32c.h"

namespace ckptfs::store::peer {

namespace {

bool IsDcpFile(const std::string& path) {
  const std::string_view base = path::Basename(path);
  return base == ".metadata" || DcpWriterRank(base).has_value();
}

// The name under which a peer serves `id` only from its retained tier (kRetainedOnlyPrefix).
BlockId MemoryOnly(const BlockId& id) {
  BlockId m = id;
  m.path.insert(0, kRetainedOnlyPrefix);
  return m;
}

// A failure that means the connection is gone, not that this one block was refused.
bool ConnectionLost(const Status& st) {
  return st.code() == Code::kIo || st.code() == Code::kTimeout || st.code() == Code::kAborted;
}

}  // namespace

std::optional<uint32_t> WriterNodeOf(const std::string& file, uint32_t world, uint32_t nodes) {
  if (world == 0 || nodes == 0) return std::nullopt;
  uint32_t rank = 0;
  if (path::Basename(file) != ".metadata") {  // written by the coordinator, rank 0
    std::optional<uint32_t> r = DcpWriterRank(file);
    if (!r || *r >= world) return std::nullopt;
    rank = *r;
  }
  return static_cast<uint32_t>(uint64_t{rank} * nodes / world);
}

void ReplicatorStats::AppendJson(nlohmann::json* out) const {
  (*out)["replication"] = {{"pulled_bytes", pulled_bytes},
                           {"pulled_blocks", pulled_blocks},
                           {"pull_failures", pull_failures},
                           {"pull_refused", pull_refused},
                           {"checkpoints_replicated", checkpoints_replicated},
                           {"holder_bytes", holder_bytes},
                           {"holder_blocks", holder_blocks},
                           {"holder_fallbacks", holder_fallbacks},
                           {"predecessor_connected", pred_connected},
                           {"holder_connected", holder_connected},
                           {"last_checkpoint", last_checkpoint}};
}

Result<std::unique_ptr<Replicator>> Replicator::Create(const ReplicatorOptions& options,
                                                       RetainedTier* tier, BackingDir* dir,
                                                       CooperativeSource* coop) {
  if (options.nodes.size() < 2 || options.self >= options.nodes.size()) {
    return Status(Code::kInvalid, "replication needs at least two nodes and a valid self");
  }
  auto r = std::unique_ptr<Replicator>(new Replicator(options, tier, dir, coop));
  r->thread_ = std::thread([p = r.get()] { p->Loop(); });
  return r;
}

Replicator::Replicator(const ReplicatorOptions& options, RetainedTier* tier, BackingDir* dir,
                       CooperativeSource* coop)
    : options_(options),
      tier_(tier),
      dir_(dir),
      coop_(coop),
      pred_(static_cast<uint32_t>((options.self + options.nodes.size() - 1) % options.nodes.size())),
      holder_(ReplicaHolderOf(options.self, static_cast<uint32_t>(options.nodes.size()))),
      links_(coop->links()) {}

Replicator::~Replicator() { Stop(); }

void Replicator::Stop() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Replicator::MoveNode(uint32_t rank, const std::string& address) {
  if (rank != pred_ && rank != holder_) return;
  spdlog::info("replication: rank {} moved to {}", rank, address);
  cv_.notify_all();
}

void Replicator::Loop() {
  MutexLock lock(&mu_);
  while (!stop_) {
    lock.Unlock();
    tier_->CheckPendingCommits();
    std::set<std::string> live;
    for (const RetainedCheckpoint& c : tier_->Checkpoints()) {
      if (!c.committed || c.own_bytes == 0) continue;
      live.insert(c.dir);
      {
        MutexLock l(&mu_);
        if (stop_ || done_.count(c.dir) > 0) continue;
      }
      if (Pull(c.dir)) {
        MutexLock l(&mu_);
        done_.insert(c.dir);
        ++stats_.checkpoints_replicated;
        stats_.last_checkpoint = c.dir;
      }
    }
    lock.Lock();
    for (auto it = done_.begin(); it != done_.end();) {
      it = live.count(*it) > 0 ? std::next(it) : done_.erase(it);
    }
    cv_.wait_for(lock.native(), options_.interval, [this] {
      mu_.AssertHeld();  // the predicate runs under the lock
      return stop_;
    });
  }
}

bool Replicator::Pull(const std::string& ckpt) {
  auto entries = dir_->List(ckpt);
  if (!entries.ok()) return false;
  uint32_t world = 0;
  for (const DirEntry& e : *entries) {
    if (std::optional<uint32_t> r = DcpWriterRank(e.name)) world = std::max(world, *r + 1);
  }
  if (world == 0) return true;  // not a DCP checkpoint: nothing to replicate
  std::shared_ptr<PeerClient> client = links_->Get(pred_);
  if (!client) return false;
  const uint32_t nodes = static_cast<uint32_t>(options_.nodes.size());
  const uint64_t bs = options_.block_bytes;
  std::vector<char> buf(bs);
  for (const DirEntry& e : *entries) {
    std::optional<uint32_t> writer = WriterNodeOf(e.name, world, nodes);
    if (!writer || *writer != pred_) continue;
    const std::string p = path::Join(ckpt, e.name);
    Result<struct stat> st = dir_->Stat(p);
    if (!st.ok()) continue;
    const BlockId id = BlockIdFromStat(p, *st);
    for (uint64_t i = 0; i * bs < id.size; ++i) {
      {
        MutexLock l(&mu_);
        if (stop_) return false;
      }
      if (tier_->Holds(id, i)) continue;
      const size_t want = static_cast<size_t>(std::min(bs, id.size - i * bs));
      Result<size_t> got =
          client->Fetch(MemoryOnly(id), i * bs, std::span<char>(buf.data(), want));
      if (!got.ok()) {
        {
          MutexLock l(&mu_);
          ++stats_.pull_failures;
        }
        if (ConnectionLost(got.status())) {
          spdlog::info("replication of {} from {}: {}; retried later", ckpt,
                       links_->AddressOf(pred_), got.status().ToString());
          links_->Failed(pred_, client, got.status());
          return false;
        }
        break;  // this file changed or is not there: the next one
      }
      const std::span<const char> bytes(buf.data(), *got);
      if (!tier_->PutReplica(id, i, bytes, Crc32c(bytes.data(), bytes.size()),
                             links_->AddressOf(pred_))) {
        MutexLock l(&mu_);
        ++stats_.pull_refused;
        return true;  // no room (or stopping): keep what fits, do not retry in a loop
      }
      MutexLock l(&mu_);
      ++stats_.pulled_blocks;
      stats_.pulled_bytes += *got;
    }
  }
  spdlog::debug("replication: {} of {} held", ckpt, links_->AddressOf(pred_));
  return true;
}

std::optional<BlockRead> Replicator::TryHolder(const BlockId& id, uint64_t offset,
                                               std::span<char> out) {
  {
    MutexLock l(&mu_);
    if (stop_) return std::nullopt;
  }
  std::shared_ptr<PeerClient> client = links_->Get(holder_);
  if (!client) return std::nullopt;
  Result<size_t> got = client->Fetch(MemoryOnly(id), offset, out);
  MutexLock l(&mu_);
  if (!got.ok()) {
    ++stats_.holder_fallbacks;
    spdlog::debug("replica holder {}: {} at {}: {}", links_->AddressOf(holder_), id.path, offset,
                  got.status().ToString());
    if (ConnectionLost(got.status())) links_->Failed(holder_, client, got.status());
    return std::nullopt;
  }
  ++stats_.holder_blocks;
  stats_.holder_bytes += *got;
  return BlockRead{.bytes = *got, .crc32c = std::nullopt};
}

ReplicatorStats Replicator::Stats() const {
  MutexLock lock(&mu_);
  ReplicatorStats s = stats_;
  s.pred_connected = links_->IsOpen(pred_);
  s.holder_connected = links_->IsOpen(holder_);
  return s;
}

Result<BlockRead> ReplicaSource::ReadBlock(const BlockId& id, uint64_t offset,
                                           std::span<char> out) {
  if (!ServingScope::Active() && IsDcpFile(id.path) && !tier_->HoldsRunOf(id.path)) {
    std::optional<uint32_t> owner = replicator_->coop()->Owner(id.path, offset);
    if (!owner || *owner == replicator_->options().self) {
      if (std::optional<BlockRead> r = replicator_->TryHolder(id, offset, out)) return *r;
    }
  }
  return inner_->ReadBlock(id, offset, out);
}

}  // namespace ckptfs::store::peer
