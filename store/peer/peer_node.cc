#include "store/peer/peer_node.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <system_error>

#include "common/path.h"
#include "common/thread_name.h"
#include "store/cache/backing_source.h"
#include "store/cache/retained_tier.h"
#include "store/dcp/checkpoint_source.h"
#include "store/peer/protocol.h"

namespace ckptfs::store::peer {
std::optional<uint32_t> DcpWriterRank(std::string_view file) {
  const size_t slash = file.rfind('/');
  if (slash != std::string_view::npos) file = file.substr(slash + 1);
  constexpr std::string_view kSuffix = ".distcp";
  if (file.size() < 2 + kSuffix.size() || file.substr(0, 2) != "__" ||
      file.substr(file.size() - kSuffix.size()) != kSuffix) {
    return std::nullopt;
  }
  std::string_view mid = file.substr(2, file.size() - 2 - kSuffix.size());  // "<rank>_<n>"
  const size_t us = mid.find('_');
  if (us == std::string_view::npos || us == 0) return std::nullopt;
  uint32_t rank = 0;
  auto [p, ec] = std::from_chars(mid.data(), mid.data() + us, rank);
  if (ec != std::errc() || p != mid.data() + us) return std::nullopt;
  return rank;
}

// What the PeerServer reads through: the block cache, never routed (this node is the owner).
class PeerNode::ServingSource : public BlockSource {
 public:
  ServingSource(PeerNode* node, BlockCache* cache) : node_(node), cache_(cache) {}

  Result<BlockRead> ReadBlock(const BlockId& id, uint64_t offset, std::span<char> out) override {
    if (id.path.starts_with(kMemoryPrefix)) {  // issue 42: memory-only checkpoints
      MemoryReplicator* m = node_->memory_serving_.load();
      if (m == nullptr) {  // a refusal the writer moves on from (never "gone")
        return Status(Code::kNoSpace, "this node keeps no memory-only checkpoints "
                                      "(--memory-ckpt-mem 0)");
      }
      return m->Serve(id, offset, out);
    }
    if (id.path.starts_with(kRetainedOnlyPrefix)) {
      // A replica pull (issue 23): only the retained tier answers, neither planned nor
      // cached here (the cache kept a second copy under this name, never invalidated, and
      // the planner a checkpoint that does not exist: a peer daemon's heap grew with every
      // save, the soak's leak bound, issue 41).
      RetainedTier* tier = node_->tier_.load();
      if (tier == nullptr) return Status(Code::kNotFound, "no retained tier on this node");
      BlockId real = id;
      real.path.erase(0, kRetainedOnlyPrefix.size());
      if (std::optional<BlockRead> hit = tier->Lookup(real, offset, out)) return *hit;
      return Status(Code::kNotFound, "not held in memory: " + real.path);
    }
    const std::string ckpt = path::Parent(id.path);
    if (!node_->coop_->HasPlan(ckpt)) node_->LoadStartedElsewhere(ckpt);
    // Through the cache (single flight with local readers); the cache's source checks the
    // version and confines the path (G9). Never forwarded: this node is asked as the owner.
    ServingScope serving;
    return cache_->ReadBlock(id, offset, out);
  }

 private:
  PeerNode* const node_;
  BlockCache* const cache_;
};

PeerNode::PeerNode(const PeerNodeOptions& options, BackingDir* dir)
    : options_(options), dir_(dir), membership_(options.nodes, options.self) {}

Status PeerNode::UpdateMembership(const std::vector<std::string>& nodes) {
  MutexLock lock(&members_mu_);
  CKPT_ASSIGN_OR_RETURN(MembershipChange change, membership_.Update(nodes));
  if (change.moved.empty()) return Status::Ok();
  if (server_) {
    if (Status st = server_->SetAllowedPeers(nodes); !st.ok()) {
      // The list itself is taken (its hosts did not resolve now): connections from the
      // moved node are refused until a later change resolves them.
      spdlog::error("peers: membership epoch {}: the server cannot resolve the new list: {}",
                    change.epoch, st.ToString());
    }
  }
  // One place knows where each rank listens: the links every part talks through.
  for (uint32_t rank : change.moved) {
    links_->MoveNode(rank, nodes[rank]);
    if (replicator_) replicator_->MoveNode(rank, nodes[rank]);
  }
  spdlog::info("peers: membership epoch {}: {} node(s) moved", change.epoch, change.moved.size());
  return Status::Ok();
}

PeerNode::~PeerNode() {
  StopReplicas();
  StopServing();
  StopMemoryReplicas();
  memory_replicator_.reset();
  replica_source_.reset();
  replicator_.reset();
  {
    MutexLock lock(&querier_mu_);
    querier_.reset();
  }
  coop_.reset();
  links_.reset();  // last: every part above talked through it
}

Result<BlockSource*> PeerNode::StartReplicas(RetainedTier* tier, uint64_t block_bytes,
                                             BlockSource* fallback) {
  if (tier == nullptr || fallback == nullptr) return Invalid("replicas: no tier or source");
  if (replicator_) return Invalid("replicas: already started");
  ReplicatorOptions ro;
  ro.nodes = membership_.View().nodes;
  ro.self = options_.self;
  ro.secret = options_.secret;
  ro.block_bytes = block_bytes;
  ro.connect_timeout = options_.connect_timeout;
  ro.request_timeout = options_.request_timeout;
  CKPT_ASSIGN_OR_RETURN(replicator_, Replicator::Create(ro, tier, dir_, coop_.get()));
  tier_.store(tier);
  replica_source_ = std::make_unique<ReplicaSource>(tier, replicator_.get(), fallback);
  tier->SetExtraStats([r = replicator_.get()](nlohmann::json* j) { r->Stats().AppendJson(j); });
  return replica_source_.get();
}

void PeerNode::StopReplicas() {
  if (replicator_) replicator_->Stop();
}

Status PeerNode::StartMemoryReplicas(MemoryTier* tier, const std::string& state_dir) {
  if (memory_replicator_) return Invalid("memory replicas: already started");
  MemoryReplicatorOptions mo;
  mo.self = options_.self;
  mo.nodes = membership_.size();
  mo.block_bytes = options_.block_bytes;
  mo.state_dir = state_dir;
  CKPT_ASSIGN_OR_RETURN(memory_replicator_, MemoryReplicator::Create(mo, tier, links_.get()));
  memory_serving_.store(memory_replicator_.get());
  return Status::Ok();
}

void PeerNode::StopMemoryReplicas() {
  memory_serving_.store(nullptr);
  if (memory_replicator_) memory_replicator_->Stop();
}

void PeerNode::AppendStats(nlohmann::json* stats) const {
  Stats().AppendJson(stats);
  if (MemoryReplicator* m = memory_serving_.load()) m->AppendJson(stats);
}

Result<std::unique_ptr<PeerNode>> PeerNode::Create(const PeerNodeOptions& options,
                                                   BackingDir* dir, BlockSource* fallback) {
  if (dir == nullptr || fallback == nullptr) return Invalid("peers: no backing directory");
  if (options.block_bytes == 0) return Invalid("peers: block size must be positive");
  std::unique_ptr<PeerNode> node(new PeerNode(options, dir));
  CooperativeOptions co;
  co.nodes = options.nodes;
  co.self = options.self;
  co.secret = options.secret;
  co.connect_timeout = options.connect_timeout;
  co.request_timeout = options.request_timeout;
  co.dead_after = options.dead_after;
  co.heartbeat = options.heartbeat;
  co.max_links = options.max_links;
  CKPT_ASSIGN_OR_RETURN(node->links_, PeerLinks::Create(LinksOptionsFor(co)));
  CKPT_ASSIGN_OR_RETURN(node->coop_, CooperativeSource::Create(co, fallback, node->links_.get()));
  return node;
}

Status PeerNode::StartServing(BlockCache* cache) {
  if (cache == nullptr) return Invalid("peers: serving needs the block cache (--cache-mem > 0)");
  if (cache->block_bytes() != options_.block_bytes) {
    return Invalid("peers: plan block size differs from the block cache's");
  }
  cache_ = cache;
  serving_source_ = std::make_unique<ServingSource>(this, cache);
  try {
    planner_ = std::thread([this] {
      NameThisThread("ckptfs-planner");
      PlannerLoop();
    });
  } catch (const std::system_error& e) {
    return Status(Code::kInternal, std::string("peers: cannot start a thread: ") + e.what());
  }
  MutexLock members_lock(&members_mu_);
  PeerServerOptions so;
  so.listen = options_.listen;
  so.node_id = options_.nodes[options_.self];
  so.secret = options_.secret;
  so.allowed_peers = membership_.View().nodes;
  so.check_source_address = options_.check_source_address;
  so.shard_states = shard_states_;  // commit queries
  so.on_shard_query = [this](const std::string& node_id, const std::vector<std::string>& paths) {
    // The asker publishes the `.metadata` of these shards' directories.
    std::optional<uint32_t> rank = membership_.RankOf(node_id);
    if (!rank) return;
    std::string last;
    for (const std::string& p : paths) {
      std::string dir = path::Parent(p);
      if (dir == last) continue;
      coordinators_.Learn(dir, *rank);
      last = std::move(dir);
    }
  };
  auto server = PeerServer::Create(so, serving_source_.get());
  if (!server.ok()) {
    return Status(server.status().code(),
                  "peers: cannot listen on " + options_.listen + ": " + server.status().message());
  }
  server_ = std::move(server).value();
  {
    // This node asks its peers about shards from the moment it answers theirs.
    MutexLock lock(&querier_mu_);
    asking_ = true;
  }
  return Status::Ok();
}

void PeerNode::StopServing() {
  {
    MutexLock members_lock(&members_mu_);
    server_.reset();  // no more requests, so nothing queues for the planner
  }
  {
    MutexLock lock(&planner_mu_);
    planner_stop_ = true;
  }
  planner_cv_.notify_all();
  if (planner_.joinable()) planner_.join();
}

void PeerNode::LoadStartedElsewhere(const std::string& ckpt) {
  {
    MutexLock lock(&planner_mu_);
    if (planner_stop_) return;
    if (planner_seen_.size() >= kMaxSeen) planner_seen_.clear();
    if (!planner_seen_.insert(ckpt).second) return;
    planner_queue_.push_back(ckpt);
  }
  planner_cv_.notify_one();
}

void PeerNode::PlannerLoop() {
  MutexLock lock(&planner_mu_);
  while (true) {
    while (!planner_stop_ && planner_queue_.empty()) planner_cv_.wait(lock.native());
    if (planner_stop_) return;
    std::string ckpt = std::move(planner_queue_.front());
    planner_queue_.erase(planner_queue_.begin());
    lock.Unlock();
    PrefetchOwnShare(ckpt);
    lock.Lock();
  }
}

void PeerNode::PrefetchOwnShare(const std::string& ckpt) {
  if (coop_->HasPlan(ckpt)) return;  // a local load planned it meanwhile
  // Issue 23: a checkpoint this node's retained tier holds committed is served from memory
  // (its own blocks and the replicas it holds): nothing to read ahead, and its `.metadata`
  // is not read from the backing store (a replaced node's load read nothing else there).
  if (RetainedTier* tier = tier_.load(); tier != nullptr && tier->HoldsCommitted(ckpt)) return;
  const std::string prefix = ckpt.empty() ? "" : ckpt + "/";
  // `.metadata`, per-rank metadata or safetensors headers (checkpoint_source.h).
  auto md = ReadCheckpointItems(dir_, ckpt);
  if (!md.ok()) {
    spdlog::debug("peers: a peer reads {}, which has no readable checkpoint here: {}", ckpt,
                  md.status().ToString());
    return;
  }
  std::vector<std::pair<std::string, BlockId>> ids;
  for (const auto& [file, length] : RequiredFileLengths(*md)) {
    auto st = dir_->Stat(prefix + file);
    if (!st.ok()) continue;
    ids.emplace_back(file, BlockIdFromStat(prefix + file, *st));
  }
  auto owned = PlanCheckpoint(ckpt, *md, ids);
  if (!owned.ok()) {
    spdlog::warn("peers: cannot plan {}: {}", ckpt, owned.status().ToString());
    return;
  }
  uint64_t queued = 0;
  for (const OwnedRange& r : *owned) {
    for (const auto& [name, id] : ids) {
      if (name != r.file) continue;
      cache_->Prefetch(id, r.offset, r.length);
      queued += r.length;
    }
  }
  spdlog::info("peers: a load of {} started on another node: prefetching this node's share "
               "({} bytes)", ckpt.empty() ? "/" : ckpt, queued);
}

Result<std::vector<OwnedRange>> PeerNode::PlanCheckpoint(
    const std::string& ckpt, const DcpMetadata& metadata,
    const std::vector<std::pair<std::string, BlockId>>& files) {
  {
    MutexLock lock(&mu_);
    auto it = planned_.find(ckpt);
    if (it != planned_.end() && it->second.files == files) return it->second.owned;
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<PlanItem> items = PlanItemsFromMetadata(metadata);
  const uint32_t k = static_cast<uint32_t>(options_.nodes.size());
  bool locality = false;
  if (options_.writer_locality && k > 1 && !items.empty()) {
    uint32_t world = 0;
    bool all = true;
    std::vector<std::optional<uint32_t>> ranks;
    ranks.reserve(items.size());
    for (const PlanItem& item : items) {
      ranks.push_back(DcpWriterRank(item.file));
      if (!ranks.back()) {
        all = false;
        break;
      }
      world = std::max(world, *ranks.back() + 1);
    }
    if (all) {
      std::vector<uint64_t> bytes(k, 0);
      uint64_t total = 0;
      for (size_t i = 0; i < items.size(); ++i) {
        const uint32_t node = static_cast<uint32_t>(uint64_t{*ranks[i]} * k / world);
        bytes[node] += items[i].length;
        total += items[i].length;
      }
      const double mean = static_cast<double>(total) / k;
      const double max = static_cast<double>(*std::max_element(bytes.begin(), bytes.end()));
      if (total > 0 && max <= mean * options_.locality_max_imbalance) {
        locality = true;
        for (size_t i = 0; i < items.size(); ++i) {
          items[i].readers = {static_cast<uint32_t>(uint64_t{*ranks[i]} * k / world)};
        }
      }
    }
  }
  PlanOptions po;
  po.mode = options_.plan_mode;
  po.block_bytes = options_.block_bytes;
  po.seed = ckpt;
  // Ranks, not addresses: every node plans the same whatever address it knows for each.
  std::vector<std::string> ranks;
  for (uint32_t r = 0; r < options_.nodes.size(); ++r) ranks.push_back(RankName(r));
  CKPT_ASSIGN_OR_RETURN(OwnershipPlan built, BuildPlan(items, ranks, po));
  auto plan = std::make_shared<const OwnershipPlan>(std::move(built));
  std::vector<OwnedRange> owned;
  for (const OwnedBlock& b : plan->BlocksOwnedBy(options_.self)) {
    const std::string& file = plan->files()[b.file];
    const uint64_t off = b.block * options_.block_bytes;
    if (!owned.empty() && owned.back().file == file &&
        owned.back().offset + owned.back().length == off) {
      owned.back().length += options_.block_bytes;
    } else {
      owned.push_back(OwnedRange{file, off, options_.block_bytes});
    }
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const PlanBalance balance = plan->Balance();
  const uint64_t mine = plan->node_bytes()[options_.self];
  {
    MutexLock lock(&mu_);
    if (planned_.insert_or_assign(ckpt, Planned{files, owned}).second) {
      planned_order_.push_back(ckpt);
    }
    while (planned_.size() > kMaxPlanned && !planned_order_.empty()) {
      planned_.erase(planned_order_.front());
      planned_order_.pop_front();
    }
    ++plan_stats_.plans;
    plan_stats_.last_plan_ms = ms;
    plan_stats_.last_plan_ckpt = ckpt;
    plan_stats_.last_plan_mode = std::string(PlanModeName(plan->mode()));
    plan_stats_.last_plan_locality = locality;
    plan_stats_.last_plan_max_over_mean = balance.max_over_mean;
    plan_stats_.last_plan_owned_bytes = mine;
  }
  coop_->SetPlan(ckpt, plan);
  spdlog::info("peers: planned {} ({} items, {} nodes, {}{}) in {:.1f} ms: max/mean {:.3f}, "
               "this node owns {} of {} bytes",
               ckpt.empty() ? "/" : ckpt, items.size(), k, PlanModeName(plan->mode()),
               locality ? ", writer locality" : "", ms, balance.max_over_mean, mine,
               balance.total_bytes);
  return owned;
}

// ---- Commit queries (see peer_node.h).
CommitQuerier* PeerNode::QuerierLocked() {
  if (!querier_) {
    CommitQueryOptions qo;
    qo.nodes = membership_.View().nodes;
    qo.self = options_.self;
    qo.secret = options_.secret;
    qo.connect_timeout = options_.connect_timeout;
    qo.request_timeout = options_.request_timeout;
    querier_ = std::make_unique<CommitQuerier>(qo, links_.get());
  }
  return querier_.get();
}

bool PeerNode::AskShardStates(std::vector<std::string> paths, std::chrono::milliseconds hold,
                              PeerShardAnswerSink* sink, uint64_t round) {
  MutexLock lock(&querier_mu_);
  if (!asking_) return false;
  QuerierLocked();
  return querier_->Ask(std::move(paths), hold, sink, round);
}

bool PeerNode::AskCoordinator(std::vector<std::string> paths, std::chrono::milliseconds hold,
                              PeerShardAnswerSink* sink, uint64_t round) {
  // The node that asked this one about the checkpoint's shards (CheckpointCoordinators);
  // before it has, the first node of the list, where a job usually places DCP's rank 0.
  constexpr uint32_t kFirstNode = 0;
  std::vector<uint32_t> ranks;
  for (const std::string& p : paths) {
    const uint32_t rank = coordinators_.Of(path::Parent(p)).value_or(kFirstNode);
    if (rank != options_.self && std::find(ranks.begin(), ranks.end(), rank) == ranks.end()) {
      ranks.push_back(rank);
    }
  }
  if (ranks.empty()) return false;  // this node commits them: the backing store tells
  MutexLock lock(&querier_mu_);
  if (!asking_) return false;
  QuerierLocked();
  return querier_->Ask(std::move(paths), hold, sink, round, std::move(ranks));
}

std::string PeerNode::LostPeers() {
  std::string out;
  for (const CooperativeSource::DeadPeer& d : coop_->DeadPeers()) {
    if (!out.empty()) out += ", ";
    out += fmt::format("node rank {} ({}, silent for {:.0f} s)", d.rank, d.address, d.silent_s);
  }
  return out;
}
// ---- end of the commit-query block.

void PeerNodeStats::AppendJson(nlohmann::json* out) const {
  nlohmann::json& j = *out;
  j["peers_nodes"] = coop.nodes;
  j["peers_connected"] = coop.peers_connected;
  j["peer_bytes_read"] = coop.peer_bytes;
  j["peer_blocks_read"] = coop.peer_blocks;
  j["peer_fallbacks"] = coop.fallbacks.total();
  j["peer_bytes_served"] = server.bytes_served;
  j["peer_blocks_served"] = server.blocks_served;
  j["peer_refused"] = server.refused;
  nlohmann::json peers = nlohmann::json::array();
  for (const PeerState& p : coop.peers) {
    peers.push_back({{"node", p.node},
                     {"state", p.state},
                     {"connected", p.connected},
                     {"dead", p.dead},
                     {"fetched_bytes", p.fetched_bytes},
                     {"failures", p.failures},
                     {"last_error", p.last_error}});
  }
  j["peers_epoch"] = membership.epoch;
  j["peers_dead"] = coop.peers_dead;
  j["peers_declared_dead"] = coop.declared_dead;
  j["peers_false_dead"] = coop.revived;
  j["peers_membership_rejected"] = membership.rejected;
  // Connections (peer_links.h): made on demand, at most peers_links_max open.
  j["peers_links_open"] = coop.links.open;
  j["peers_links_max"] = coop.links.max_links;
  j["peers_links_connects"] = coop.links.connects;
  j["peers_links_connect_failures"] = coop.links.connect_failures;
  j["peers_links_evicted"] = coop.links.evicted;
  // Request and reply buffers the transport keeps for reuse (bounded per link and for the
  // server; outside every other budget).
  j["peers_buffer_pool_bytes"] = coop.links.pooled_bytes + server.pooled_bytes;
  j["peers_heartbeats"] = coop.links.heartbeats;
  j["peers_heartbeat_failures"] = coop.links.heartbeat_failures;
  j["peers_up"] = coop.links.up;
  j["peers_down"] = coop.links.down;
  j["peers"] = {
      {"node_rank", coop.self},
      {"membership",
       {{"epoch", membership.epoch},
        {"nodes", membership.nodes},
        {"updates", membership.updates},
        {"rejected", membership.rejected},
        {"last_rejection", membership.last_rejection}}},
      {"listen", listen},
      {"peers", std::move(peers)},
      {"fallbacks",
       {{"peer_down", coop.fallbacks.peer_down},
        {"timeout", coop.fallbacks.timeout},
        {"bad_checksum", coop.fallbacks.bad_checksum},
        {"connection", coop.fallbacks.connection},
        {"error_reply", coop.fallbacks.error_reply}}},
      {"local_owned_reads", coop.local_owned_reads},
      {"stand_in_blocks", coop.stand_in_blocks},
      {"stand_in_local", coop.stand_in_local},
      {"unplanned_reads", coop.unplanned_reads},
      {"server",
       {{"connections", server.connections},
        {"authenticated", server.authenticated},
        {"refused", server.refused},
        {"blocks_served", server.blocks_served},
        {"bytes_served", server.bytes_served},
        {"request_errors", server.request_errors}}},
      {"plans", plans},
      {"last_plan",
       {{"checkpoint", last_plan_ckpt},
        {"mode", last_plan_mode},
        {"ms", last_plan_ms},
        {"writer_locality", last_plan_locality},
        {"max_over_mean", last_plan_max_over_mean},
        {"owned_bytes", last_plan_owned_bytes}}}};
}

PeerNodeStats PeerNode::Stats() const {
  PeerNodeStats s;
  {
    MutexLock lock(&mu_);
    s = plan_stats_;
  }
  s.coop = coop_->Stats();
  s.membership = membership_.View();
  MutexLock members_lock(&members_mu_);
  if (server_) {
    s.server = server_->stats();
    s.listen = options_.listen;
    if (auto hp = SplitHostPort(options_.listen); hp.ok()) {
      s.listen = hp->first + ":" + std::to_string(server_->port());
    }
  }
  return s;
}

}  // namespace ckptfs::store::peer
