#include "store/peer/cooperative_source.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>

#include "common/thread_name.h"
#include "store/peer/membership.h"

namespace ckptfs::store::peer {

using Clock = std::chrono::steady_clock;

namespace {
thread_local int serving_depth = 0;
}  // namespace

ServingScope::ServingScope() { ++serving_depth; }
ServingScope::~ServingScope() { --serving_depth; }
bool ServingScope::Active() { return serving_depth > 0; }

struct CooperativeSource::Peer {
  std::atomic<uint64_t> fetched_bytes{0}, failures{0};
};

CooperativeSource::CooperativeSource(const CooperativeOptions& options, BlockSource* fallback)
    : options_(options), fallback_(fallback) {}

PeerLinksOptions LinksOptionsFor(const CooperativeOptions& o) {
  PeerLinksOptions lo;
  lo.nodes = o.nodes;
  lo.self = o.self;
  lo.secret = o.secret;
  lo.connect_timeout = o.connect_timeout;
  lo.request_timeout = o.request_timeout;
  lo.down_backoff = o.down_backoff;
  lo.max_down_backoff = o.max_down_backoff;
  lo.dead_after = o.dead_after;
  lo.heartbeat = o.heartbeat;
  lo.max_links = o.max_links;
  lo.watch = o.connect_in_background;
  return lo;
}

Result<std::unique_ptr<CooperativeSource>> CooperativeSource::Create(
    const CooperativeOptions& options, BlockSource* fallback, PeerLinks* links) {
  if (fallback == nullptr) return Invalid("cooperative source: no fallback source");
  if (options.nodes.empty()) return Invalid("cooperative source: empty peer list");
  if (options.self >= options.nodes.size()) {
    return Invalid("cooperative source: node rank " + std::to_string(options.self) +
                   " is out of range for " + std::to_string(options.nodes.size()) + " peers");
  }
  std::unique_ptr<CooperativeSource> s(new CooperativeSource(options, fallback));
  if (links == nullptr) {
    CKPT_ASSIGN_OR_RETURN(s->own_links_, PeerLinks::Create(LinksOptionsFor(options)));
    links = s->own_links_.get();
  }
  s->links_ = links;
  s->peers_.resize(options.nodes.size());
  // By rank, not address: a node that moves keeps the blocks it stands in for.
  for (uint32_t i = 0; i < options.nodes.size(); ++i) {
    const std::string n = RankName(i);
    s->node_hash_.push_back(XXH3_64bits(n.data(), n.size()));
    if (i != options.self) s->peers_[i] = std::make_unique<Peer>();
  }
  return s;
}

CooperativeSource::~CooperativeSource() = default;

void CooperativeSource::SetPlan(const std::string& ckpt, std::shared_ptr<const OwnershipPlan> plan) {
  MutexLock lock(&plans_mu_);
  const std::string prefix = ckpt.empty() ? "" : ckpt + "/";
  if (auto old = by_ckpt_.find(ckpt); old != by_ckpt_.end()) {
    for (const std::string& f : old->second->files()) by_path_.erase(prefix + f);
  }
  for (const std::string& f : plan->files()) by_path_[prefix + f] = PlanRef{plan, f};
  if (by_ckpt_.insert_or_assign(ckpt, std::move(plan)).second) plan_order_.push_back(ckpt);
  while (by_ckpt_.size() > kMaxPlans && !plan_order_.empty()) {
    const std::string oldest = std::move(plan_order_.front());
    plan_order_.pop_front();
    auto it = by_ckpt_.find(oldest);
    if (it == by_ckpt_.end()) continue;
    const std::string old_prefix = oldest.empty() ? "" : oldest + "/";
    for (const std::string& f : it->second->files()) by_path_.erase(old_prefix + f);
    by_ckpt_.erase(it);
  }
}

bool CooperativeSource::HasPlan(const std::string& ckpt) const {
  MutexLock lock(&plans_mu_);
  return by_ckpt_.count(ckpt) > 0;
}

std::optional<uint32_t> CooperativeSource::Owner(const std::string& path, uint64_t offset) const {
  PlanRef ref;
  {
    MutexLock lock(&plans_mu_);
    auto it = by_path_.find(path);
    if (it == by_path_.end()) return std::nullopt;
    ref = it->second;
  }
  auto owner = ref.plan->BlockOwner(ref.file, offset / ref.plan->block_bytes());
  if (!owner.ok()) return std::nullopt;
  return *owner;
}

void CooperativeSource::PeerFailed(uint32_t node, const Status& status,
                                   const std::shared_ptr<PeerClient>& client) {
  peers_[node]->failures.fetch_add(1, std::memory_order_relaxed);
  if (links_->Failed(node, client, status)) {
    spdlog::warn("peer {}: {}; its blocks go to their stand-ins or the backing store",
                 links_->AddressOf(node), status.ToString());
  } else {
    spdlog::debug("peer {}: {}; to a stand-in or the backing store", links_->AddressOf(node),
                  status.ToString());
  }
}

std::optional<BlockRead> CooperativeSource::TryPeers(const BlockId& id, uint64_t offset,
                                                     std::span<char> out) {
  std::optional<uint32_t> owner = Owner(id.path, offset);
  if (!owner) {
    unplanned_.fetch_add(1, std::memory_order_relaxed);
    return std::nullopt;
  }
  if (*owner == options_.self || *owner >= peers_.size() || ServingScope::Active()) {
    local_owned_.fetch_add(1, std::memory_order_relaxed);
    return std::nullopt;
  }
  std::shared_ptr<PeerClient> client = links_->Get(*owner);
  if (!client) {
    fb_down_.fetch_add(1, std::memory_order_relaxed);
    peers_[*owner]->failures.fetch_add(1, std::memory_order_relaxed);
    return TryStandIn(id, offset, out, *owner);
  }
  if (auto r = Fetch(*owner, client, id, offset, out)) return r;
  return TryStandIn(id, offset, out, *owner);
}

std::optional<BlockRead> CooperativeSource::Fetch(uint32_t node,
                                                  const std::shared_ptr<PeerClient>& client,
                                                  const BlockId& id, uint64_t offset,
                                                  std::span<char> out) {
  Result<size_t> got = client->Fetch(id, offset, out);
  if (!got.ok()) {
    switch (got.status().code()) {
      case Code::kTimeout: fb_timeout_.fetch_add(1); break;
      case Code::kCorrupt: fb_crc_.fetch_add(1); break;
      case Code::kIo: fb_conn_.fetch_add(1); break;
      default: fb_error_.fetch_add(1); break;
    }
    PeerFailed(node, got.status(), client);
    return std::nullopt;
  }
  peers_[node]->fetched_bytes.fetch_add(*got, std::memory_order_relaxed);
  peer_bytes_.fetch_add(*got, std::memory_order_relaxed);
  peer_blocks_.fetch_add(1, std::memory_order_relaxed);
  links_->Succeeded(node);
  return BlockRead{*got, std::nullopt};
}

bool CooperativeSource::Reachable(uint32_t node) { return links_->Reachable(node); }

uint32_t CooperativeSource::StandIn(const std::string& path, uint64_t offset, uint32_t owner) {
  // Rendezvous over the nodes this node sees up (itself always): the same key on every
  // node, so nodes that agree on who is down agree on the stand-in.
  std::vector<uint32_t> up;
  for (uint32_t n = 0; n < node_hash_.size(); ++n) {
    if (n != owner && Reachable(n)) up.push_back(n);
  }
  return Rendezvous(XXH3_64bits_withSeed(path.data(), path.size(), offset), node_hash_, up);
}

std::optional<BlockRead> CooperativeSource::TryStandIn(const BlockId& id, uint64_t offset,
                                                       std::span<char> out, uint32_t owner) {
  const uint32_t stand_in = StandIn(id.path, offset, owner);
  if (stand_in == options_.self) {
    stand_in_local_.fetch_add(1, std::memory_order_relaxed);
    return std::nullopt;
  }
  std::shared_ptr<PeerClient> client = links_->Get(stand_in);
  if (!client) return std::nullopt;
  std::optional<BlockRead> r = Fetch(stand_in, client, id, offset, out);
  if (r) stand_in_.fetch_add(1, std::memory_order_relaxed);
  return r;
}

Result<BlockRead> CooperativeSource::ReadBlock(const BlockId& id, uint64_t offset,
                                               std::span<char> out) {
  if (auto r = TryPeers(id, offset, out)) return *r;
  return fallback_->ReadBlock(id, offset, out);
}

void CooperativeSource::MoveNode(uint32_t rank, const std::string& address) {
  links_->MoveNode(rank, address);
}

void CooperativeSource::ConnectNow() { links_->ConnectAll(); }

std::vector<CooperativeSource::DeadPeer> CooperativeSource::DeadPeers() {
  std::vector<DeadPeer> dead;
  for (const PeerLinks::Dead& d : links_->DeadPeers()) {
    dead.push_back(DeadPeer{d.rank, d.address, d.silent_s});
  }
  return dead;
}

CooperativeStats CooperativeSource::Stats() const {
  CooperativeStats s;
  s.nodes = static_cast<uint32_t>(options_.nodes.size());
  s.self = options_.self;
  s.peer_bytes = peer_bytes_.load();
  s.peer_blocks = peer_blocks_.load();
  s.local_owned_reads = local_owned_.load();
  s.stand_in_blocks = stand_in_.load();
  s.stand_in_local = stand_in_local_.load();
  s.unplanned_reads = unplanned_.load();
  s.fallbacks.peer_down = fb_down_.load();
  s.fallbacks.timeout = fb_timeout_.load();
  s.fallbacks.bad_checksum = fb_crc_.load();
  s.fallbacks.connection = fb_conn_.load();
  s.fallbacks.error_reply = fb_error_.load();
  s.links = links_->Stats();
  s.declared_dead = s.links.declared_dead;
  s.revived = s.links.revived;
  s.peers_dead = s.links.dead;
  for (const LinkInfo& l : s.links.links) {
    PeerState st;
    st.node = l.address;
    st.state = LinkStateName(l.state);
    st.connected = l.open;
    st.last_error = l.last_error;
    st.dead = l.state == LinkState::kDead;
    st.fetched_bytes = peers_[l.rank]->fetched_bytes.load();
    st.failures = peers_[l.rank]->failures.load();
    if (st.connected) ++s.peers_connected;
    s.peers.push_back(std::move(st));
  }
  return s;
}

}  // namespace ckptfs::store::peer
