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
  Peer(uint32_t index, std::string node, std::chrono::milliseconds backoff)
      : index(index), node(std::move(node)), backoff(backoff) {}
  std::string Node() EXCLUDES(mu) {
    MutexLock lock(&mu);
    return node;
  }

  const uint32_t index;
  Mutex mu;
  std::string node GUARDED_BY(mu);  // its address now (MoveNode)
  std::shared_ptr<PeerClient> client GUARDED_BY(mu);  // null when not connected
  Clock::time_point down_until GUARDED_BY(mu) = {};
  std::chrono::milliseconds backoff GUARDED_BY(mu);  // next pause after a failure
  bool streak GUARDED_BY(mu) = false;                // failing since the last success
  std::string last_error GUARDED_BY(mu);
  // Silence: since when it has had no working connection (the start counts: a peer that
  // never comes up is silent from the start); epoch () while connected.
  Clock::time_point down_since GUARDED_BY(mu) = Clock::now();
  bool dead GUARDED_BY(mu) = false;   // declared dead (DeadPeers)
  bool moved GUARDED_BY(mu) = false;  // since it was declared dead: a spare, not a revival
  // The peer has no working connection from now: its silence starts, unless it had begun.
  void NoteDown() REQUIRES(mu) {
    if (down_since == Clock::time_point{}) down_since = Clock::now();
  }
  std::atomic<uint64_t> fetched_bytes{0}, failures{0};
};

CooperativeSource::CooperativeSource(const CooperativeOptions& options, BlockSource* fallback)
    : options_(options), fallback_(fallback) {}

Result<std::unique_ptr<CooperativeSource>> CooperativeSource::Create(
    const CooperativeOptions& options, BlockSource* fallback) {
  if (fallback == nullptr) return Invalid("cooperative source: no fallback source");
  if (options.nodes.empty()) return Invalid("cooperative source: empty peer list");
  if (options.self >= options.nodes.size()) {
    return Invalid("cooperative source: node rank " + std::to_string(options.self) +
                   " is out of range for " + std::to_string(options.nodes.size()) + " peers");
  }
  std::unique_ptr<CooperativeSource> s(new CooperativeSource(options, fallback));
  s->peers_.resize(options.nodes.size());
  // By rank, not address: a node that moves keeps the blocks it stands in for.
  for (uint32_t i = 0; i < options.nodes.size(); ++i) {
    const std::string n = RankName(i);
    s->node_hash_.push_back(XXH3_64bits(n.data(), n.size()));
  }
  for (uint32_t i = 0; i < options.nodes.size(); ++i) {
    if (i == options.self) continue;
    s->peers_[i] = std::make_unique<Peer>(i, options.nodes[i], options.down_backoff);
  }
  if (options.connect_in_background && options.nodes.size() > 1) {
    s->connector_ = std::thread([c = s.get()] {
      NameThisThread("ckptfs-connect");
      c->ConnectLoop();
    });
  }
  return s;
}

CooperativeSource::~CooperativeSource() {
  {
    MutexLock lock(&stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (connector_.joinable()) connector_.join();
  for (auto& p : peers_) {
    if (!p) continue;
    std::shared_ptr<PeerClient> c;
    {
      MutexLock lock(&p->mu);
      c = std::move(p->client);
    }
    c.reset();  // the last reference: joins that client's progress thread
  }
}

void CooperativeSource::SetPlan(const std::string& ckpt, std::shared_ptr<const OwnershipPlan> plan) {
  MutexLock lock(&plans_mu_);
  const std::string prefix = ckpt.empty() ? "" : ckpt + "/";
  if (auto old = by_ckpt_.find(ckpt); old != by_ckpt_.end()) {
    for (const std::string& f : old->second->files()) by_path_.erase(prefix + f);
  }
  for (const std::string& f : plan->files()) by_path_[prefix + f] = PlanRef{plan, f};
  by_ckpt_[ckpt] = std::move(plan);
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

std::shared_ptr<PeerClient> CooperativeSource::ClientFor(uint32_t node) {
  Peer& p = *peers_[node];
  bool lost = false;
  {
    MutexLock lock(&p.mu);
    if (p.client && !p.client->healthy()) {
      // The connection died between reads (the peer exited or the link broke).
      lost = !p.streak;
      p.streak = true;
      p.last_error = "connection lost";
      p.client.reset();
      p.NoteDown();
      p.down_until = Clock::now() + p.backoff;
      p.backoff = std::min(p.backoff * 2, options_.max_down_backoff);
    }
    if (p.client && Clock::now() >= p.down_until) return p.client;
  }
  if (lost) {
    spdlog::warn("peer {}: connection lost; its blocks go to their stand-ins or the backing store",
                 p.Node());
  }
  return nullptr;
}

void CooperativeSource::PeerFailed(uint32_t node, const Status& status,
                                   const std::shared_ptr<PeerClient>& client) {
  Peer& p = *peers_[node];
  p.failures.fetch_add(1, std::memory_order_relaxed);
  bool first = false;
  std::chrono::milliseconds pause{0};
  {
    MutexLock lock(&p.mu);
    first = !p.streak;
    p.streak = true;
    p.last_error = status.ToString();
    // A server error about one block (stale version, not found) says nothing about the peer;
    // anything else does: pause it so that other reads do not wait on it too.
    const Code code = status.code();
    if (code == Code::kTimeout || code == Code::kIo || code == Code::kCorrupt ||
        code == Code::kPermission) {
      if (Clock::now() >= p.down_until) {
        pause = p.backoff;
        p.down_until = Clock::now() + pause;
        p.backoff = std::min(p.backoff * 2, options_.max_down_backoff);
      }
      // A dead or hung connection is dropped; the connector makes a new one after the pause.
      if (p.client == client && (code != Code::kCorrupt)) {
        p.client.reset();
        p.NoteDown();
      }
    }
  }
  if (first) {
    spdlog::warn("peer {}: {}; its blocks go to their stand-ins or the backing store{}", p.Node(),
                 status.ToString(),
                 pause.count() > 0 ? fmt::format(" (peer skipped for {} ms)", pause.count()) : "");
  } else {
    spdlog::debug("peer {}: {}; to a stand-in or the backing store", p.Node(), status.ToString());
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
  std::shared_ptr<PeerClient> client = ClientFor(*owner);
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
  Peer& p = *peers_[node];
  p.fetched_bytes.fetch_add(*got, std::memory_order_relaxed);
  peer_bytes_.fetch_add(*got, std::memory_order_relaxed);
  peer_blocks_.fetch_add(1, std::memory_order_relaxed);
  {
    MutexLock lock(&p.mu);
    if (p.streak) {
      p.streak = false;
      p.backoff = options_.down_backoff;
    }
  }
  return BlockRead{*got, std::nullopt};
}

bool CooperativeSource::Reachable(uint32_t node) {
  if (node == options_.self) return true;
  Peer& p = *peers_[node];
  MutexLock lock(&p.mu);
  return p.client && p.client->healthy() && Clock::now() >= p.down_until;
}

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
  std::shared_ptr<PeerClient> client = ClientFor(stand_in);
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

bool CooperativeSource::TryConnect(Peer& p) {
  std::string node;
  {
    MutexLock lock(&p.mu);
    if (p.client && p.client->healthy()) return true;
    if (Clock::now() < p.down_until) return false;
    node = p.node;
  }
  auto c = PeerClient::Connect(ClientOptionsFor(node, options_));
  MutexLock lock(&p.mu);
  if (p.node != node) return false;  // moved meanwhile: the next round connects there
  if (!c.ok()) {
    const std::string err = c.status().ToString();
    if (!p.streak || p.last_error != err) {
      spdlog::warn("peer {}: cannot connect: {}", node, err);
    }
    p.streak = true;
    p.last_error = err;
    p.NoteDown();
    p.down_until = Clock::now() + p.backoff;
    p.backoff = std::min(p.backoff * 2, options_.max_down_backoff);
    return false;
  }
  spdlog::info("peer {}: connected and authenticated", node);
  p.client = std::shared_ptr<PeerClient>(std::move(c).value());
  if (p.dead) {
    if (!p.moved) {
      revived_.fetch_add(1, std::memory_order_relaxed);
      spdlog::warn("peer {}: answers again after it was declared dead ({:.1f} s of silence): "
                   "counted as a false positive",
                   node, std::chrono::duration<double>(Clock::now() - p.down_since).count());
    }
    p.dead = false;
  }
  p.moved = false;
  p.down_since = {};
  p.streak = false;
  p.backoff = options_.down_backoff;
  p.down_until = {};
  return true;
}

void CooperativeSource::MoveNode(uint32_t rank, const std::string& address) {
  if (rank >= peers_.size() || !peers_[rank]) return;
  Peer& p = *peers_[rank];
  std::shared_ptr<PeerClient> old;
  {
    MutexLock lock(&p.mu);
    if (p.node == address) return;
    p.node = address;
    old = std::move(p.client);
    // The spare's silence counts from now; a rank declared dead stays dead until it answers.
    p.down_since = Clock::now();
    if (p.dead) p.moved = true;
    // A fresh start at the new address: no pause carried over from the old one.
    p.streak = false;
    p.last_error.clear();
    p.backoff = options_.down_backoff;
    p.down_until = {};
  }
  old.reset();  // reads holding it finish or fail over; this was the last other reference
  stop_cv_.notify_all();  // the connector tries the new address now
}

void CooperativeSource::ConnectNow() {
  for (auto& p : peers_) {
    if (p) TryConnect(*p);
  }
}

void CooperativeSource::ConnectLoop() {
  MutexLock lock(&stop_mu_);
  while (!stop_) {
    lock.Unlock();
    for (auto& p : peers_) {
      if (!p) continue;
      {
        MutexLock stop_lock(&stop_mu_);
        if (stop_) return;
      }
      TryConnect(*p);
    }
    (void)DeadPeers();  // declares those whose silence reached dead_after
    lock.Lock();
    stop_cv_.wait_for(lock.native(),
                      std::min<std::chrono::milliseconds>(options_.down_backoff,
                                                          std::chrono::milliseconds(1000)),
                      [this] {
                        stop_mu_.AssertHeld();  // the predicate runs under the lock
                        return stop_;
                      });
  }
}

std::vector<CooperativeSource::DeadPeer> CooperativeSource::DeadPeers() {
  std::vector<DeadPeer> dead;
  const auto now = Clock::now();
  for (auto& p : peers_) {
    if (!p) continue;
    bool declared = false;
    DeadPeer d;
    {
      MutexLock lock(&p->mu);
      const bool up = p->client && p->client->healthy();
      if (up) continue;
      p->NoteDown();
      d.rank = p->index;
      d.address = p->node;
      d.silent_s = std::chrono::duration<double>(now - p->down_since).count();
      if (!p->dead && now - p->down_since >= options_.dead_after) {
        p->dead = declared = true;
      }
      if (!p->dead) continue;
    }
    if (declared) {
      declared_dead_.fetch_add(1, std::memory_order_relaxed);
      spdlog::error("peer {} (rank {}) declared dead: no authenticated connection for {:.1f} s; "
                    "what waits for it is given up",
                    d.address, d.rank, d.silent_s);
    }
    dead.push_back(std::move(d));
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
  s.declared_dead = declared_dead_.load();
  s.revived = revived_.load();
  s.unplanned_reads = unplanned_.load();
  s.fallbacks.peer_down = fb_down_.load();
  s.fallbacks.timeout = fb_timeout_.load();
  s.fallbacks.bad_checksum = fb_crc_.load();
  s.fallbacks.connection = fb_conn_.load();
  s.fallbacks.error_reply = fb_error_.load();
  for (const auto& p : peers_) {
    if (!p) continue;
    PeerState st;
    {
      MutexLock lock(&p->mu);
      st.node = p->node;
      st.connected = p->client && p->client->healthy();
      st.last_error = p->last_error;
      st.dead = p->dead;
    }
    st.fetched_bytes = p->fetched_bytes.load();
    st.failures = p->failures.load();
    if (st.connected) ++s.peers_connected;
    if (st.dead) ++s.peers_dead;
    s.peers.push_back(std::move(st));
  }
  return s;
}

}  // namespace ckptfs::store::peer
