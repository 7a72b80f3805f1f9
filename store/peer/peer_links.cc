#include "store/peer/peer_links.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "common/backoff.h"
#include "common/thread_name.h"

namespace ckptfs::store::peer {

using Clock = std::chrono::steady_clock;

namespace {
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Errors that say something about the peer, not about one request.
bool AboutThePeer(Code code) {
  return code == Code::kTimeout || code == Code::kIo || code == Code::kCorrupt ||
         code == Code::kPermission;
}
}  // namespace

const char* LinkStateName(LinkState s) {
  switch (s) {
    case LinkState::kUnknown: return "unknown";
    case LinkState::kUp: return "up";
    case LinkState::kDown: return "down";
    case LinkState::kDead: return "dead";
  }
  return "?";
}

struct PeerLinks::Link {
  Link(uint32_t rank, std::string address, std::chrono::milliseconds backoff)
      : rank(rank), address(std::move(address)), backoff(backoff) {}
  const uint32_t rank;
  std::string address;
  std::shared_ptr<PeerClient> client;  // open when set
  bool connecting = false;
  bool pinging = false;
  uint64_t last_used = 0;           // LRU tick of the last Get()
  Clock::time_point last_answer{};  // the last call known to have succeeded
  LinkState state = LinkState::kUnknown;
  Clock::time_point down_since{};
  Clock::time_point down_until{};
  std::chrono::milliseconds backoff;
  bool streak = false;  // failing since the last success
  bool moved = false;   // moved while dead: its answering is a replacement
  uint64_t failures = 0;
  std::string last_error;
};

PeerLinks::PeerLinks(const PeerLinksOptions& options) : options_(options) {}

Result<std::unique_ptr<PeerLinks>> PeerLinks::Create(const PeerLinksOptions& options) {
  if (options.nodes.empty()) return Invalid("peer links: empty peer list");
  if (options.self >= options.nodes.size()) {
    return Invalid("peer links: node rank " + std::to_string(options.self) +
                   " is out of range for " + std::to_string(options.nodes.size()) + " peers");
  }
  if (options.max_links == 0) return Invalid("peer links: --peer-max-links must be at least 1");
  std::unique_ptr<PeerLinks> links(new PeerLinks(options));
  {
    MutexLock lock(&links->mu_);
    links->links_.resize(options.nodes.size());
    for (uint32_t i = 0; i < options.nodes.size(); ++i) {
      if (i == options.self) continue;
      links->links_[i] = std::make_unique<Link>(i, options.nodes[i], options.down_backoff);
    }
  }
  if (options.watch && options.nodes.size() > 1) {
    links->watcher_ = std::thread([l = links.get()] {
      NameThisThread("ckptfs-links");
      l->Loop();
    });
  }
  return links;
}

PeerLinks::~PeerLinks() {
  {
    MutexLock lock(&stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  std::vector<std::shared_ptr<PeerClient>> closing;
  {
    MutexLock lock(&mu_);
    for (auto& l : links_) {
      if (l && l->client) closing.push_back(std::move(l->client));
    }
    open_ = 0;
  }
  closing.clear();  // joins each client's progress thread, outside the lock
}

void PeerLinks::MarkDownLocked(Link& l, const std::string& why) {
  const auto now = Clock::now();
  if (l.state != LinkState::kDead) l.state = LinkState::kDown;
  if (l.down_since == Clock::time_point{}) l.down_since = now;
  l.streak = true;
  l.last_error = why;
  if (now >= l.down_until) {
    l.down_until = now + l.backoff;
    l.backoff = Backoff{options_.down_backoff, options_.max_down_backoff}.After(l.backoff);
  }
}

void PeerLinks::EvictLocked(uint32_t keep, std::vector<std::shared_ptr<PeerClient>>* closed) {
  while (open_ > options_.max_links) {
    Link* victim = nullptr;
    for (auto& l : links_) {
      if (!l || !l->client || l->rank == keep) continue;
      // Idle links first (only this table holds them), then the least recently used.
      const bool idle = l->client.use_count() == 1;
      if (victim == nullptr) {
        victim = l.get();
        continue;
      }
      const bool victim_idle = victim->client.use_count() == 1;
      if ((idle && !victim_idle) || (idle == victim_idle && l->last_used < victim->last_used)) {
        victim = l.get();
      }
    }
    if (victim == nullptr) return;
    spdlog::debug("peer {} (rank {}): link closed, least recently used of {} (--peer-max-links)",
                  victim->address, victim->rank, open_);
    closed->push_back(std::move(victim->client));
    --open_;
    ++counters_.evicted;
  }
}

std::shared_ptr<PeerClient> PeerLinks::Get(uint32_t rank, bool connect) {
  std::vector<std::shared_ptr<PeerClient>> closed;  // released after the lock
  MutexLock lock(&mu_);
  if (rank >= links_.size() || !links_[rank]) return nullptr;
  Link& l = *links_[rank];
  while (true) {
    if (l.client && l.client->healthy()) {
      if (Clock::now() < l.down_until) return nullptr;  // paused after a bad reply
      l.last_used = ++tick_;
      return l.client;
    }
    if (l.client) {
      // The connection died between calls (the peer exited or the link broke).
      const bool first = !l.streak;
      closed.push_back(std::move(l.client));
      --open_;
      MarkDownLocked(l, "connection lost");
      if (first) {
        spdlog::warn("peer {} (rank {}): connection lost; what it owns goes to stand-ins or the "
                     "backing store",
                     l.address, rank);
      }
    }
    if (!connect || Clock::now() < l.down_until) return nullptr;
    if (!l.connecting) break;
    // Another caller is connecting: share its result.
    const std::string address = l.address;
    if (!connected_cv_.wait_for(lock.native(), options_.connect_timeout + std::chrono::seconds(1),
                                [&] {
                                  mu_.AssertHeld();
                                  return !l.connecting;
                                })) {
      return nullptr;
    }
    if (l.address != address) return nullptr;
    if (!l.client && Clock::now() < l.down_until) return nullptr;
  }
  lock.Unlock();
  std::shared_ptr<PeerClient> c = Connect(rank);
  return c;
}

std::shared_ptr<PeerClient> PeerLinks::Connect(uint32_t rank) {
  std::string address;
  {
    MutexLock lock(&mu_);
    Link& l = *links_[rank];
    if (l.connecting) return nullptr;
    if (l.client && l.client->healthy()) return l.client;
    l.connecting = true;
    address = l.address;
  }
  auto made = PeerClient::Connect(ClientOptionsFor(address, options_));
  std::vector<std::shared_ptr<PeerClient>> closed;
  std::shared_ptr<PeerClient> out;
  {
    MutexLock lock(&mu_);
    Link& l = *links_[rank];
    l.connecting = false;
    connected_cv_.notify_all();
    if (l.address != address) return nullptr;  // moved meanwhile: the next call goes there
    if (!made.ok()) {
      const std::string err = made.status().ToString();
      ++counters_.connect_failures;
      ++l.failures;
      if (!l.streak || l.last_error != err) {
        spdlog::warn("peer {} (rank {}): cannot connect: {}", address, rank, err);
      }
      MarkDownLocked(l, err);
      return nullptr;
    }
    out = std::shared_ptr<PeerClient>(std::move(made).value());
    if (l.client) closed.push_back(std::move(l.client));
    else ++open_;
    l.client = out;
    l.last_used = ++tick_;
    l.last_answer = Clock::now();
    ++counters_.connects;
    if (l.state == LinkState::kDead) {
      if (!l.moved) {
        ++counters_.revived;
        spdlog::warn("peer {} (rank {}): answers again after it was declared dead ({:.1f} s of "
                     "silence): counted as a false positive",
                     address, rank, Seconds(Clock::now() - l.down_since));
      } else {
        spdlog::info("peer {} (rank {}): the replacement of a dead node is up", address, rank);
      }
    }
    if (l.state != LinkState::kUp) {
      spdlog::info("peer {} (rank {}): connected and authenticated", address, rank);
    }
    l.state = LinkState::kUp;
    l.moved = false;
    l.down_since = {};
    l.down_until = {};
    l.streak = false;
    l.backoff = options_.down_backoff;
    EvictLocked(rank, &closed);
  }
  return out;
}

bool PeerLinks::Failed(uint32_t rank, const std::shared_ptr<PeerClient>& client,
                       const Status& status) {
  std::shared_ptr<PeerClient> dropped;
  MutexLock lock(&mu_);
  if (rank >= links_.size() || !links_[rank]) return false;
  Link& l = *links_[rank];
  ++l.failures;
  const bool first = !l.streak;
  if (!AboutThePeer(status.code())) {
    // A server error about one request (stale version, not found, busy): the peer is fine.
    l.streak = true;
    l.last_error = status.ToString();
    return first;
  }
  if (client && l.client == client && status.code() != Code::kCorrupt) {
    // A dead or hung connection is dropped; the next Get() after the pause makes a new one.
    dropped = std::move(l.client);
    --open_;
    MarkDownLocked(l, status.ToString());
  } else {
    l.streak = true;
    l.last_error = status.ToString();
    const auto now = Clock::now();
    if (now >= l.down_until) {
      l.down_until = now + l.backoff;
      l.backoff = Backoff{options_.down_backoff, options_.max_down_backoff}.After(l.backoff);
    }
  }
  return first;
}

void PeerLinks::Succeeded(uint32_t rank) {
  MutexLock lock(&mu_);
  if (rank >= links_.size() || !links_[rank]) return;
  Link& l = *links_[rank];
  l.last_answer = Clock::now();
  if (l.streak) {
    l.streak = false;
    l.backoff = options_.down_backoff;
  }
}

bool PeerLinks::Reachable(uint32_t rank) const {
  if (rank == options_.self) return true;
  MutexLock lock(&mu_);
  if (rank >= links_.size() || !links_[rank]) return false;
  const Link& l = *links_[rank];
  if (l.state == LinkState::kDown || l.state == LinkState::kDead) return false;
  return Clock::now() >= l.down_until;
}

bool PeerLinks::IsOpen(uint32_t rank) const {
  MutexLock lock(&mu_);
  if (rank >= links_.size() || !links_[rank]) return false;
  return links_[rank]->client && links_[rank]->client->healthy();
}

void PeerLinks::MoveNode(uint32_t rank, const std::string& address) {
  std::shared_ptr<PeerClient> old;
  {
    MutexLock lock(&mu_);
    if (rank >= links_.size() || !links_[rank]) return;
    Link& l = *links_[rank];
    if (l.address == address) return;
    l.address = address;
    if (l.client) {
      old = std::move(l.client);
      --open_;
    }
    // A fresh start at the new address: no pause carried over. A rank declared dead stays
    // dead until it answers (then it is a replacement); any other is unknown again.
    if (l.state == LinkState::kDead) {
      l.moved = true;
    } else {
      l.state = LinkState::kUnknown;
      l.down_since = {};
    }
    l.streak = false;
    l.last_error.clear();
    l.backoff = options_.down_backoff;
    l.down_until = {};
  }
  old.reset();  // calls holding it finish or fail over; this was the last other reference
  stop_cv_.notify_all();
}

std::string PeerLinks::AddressOf(uint32_t rank) const {
  MutexLock lock(&mu_);
  if (rank >= links_.size() || !links_[rank]) {
    return rank < options_.nodes.size() ? options_.nodes[rank] : std::string();
  }
  return links_[rank]->address;
}

std::vector<PeerLinks::Dead> PeerLinks::DeadPeers() {
  std::vector<Dead> dead;
  const auto now = Clock::now();
  MutexLock lock(&mu_);
  for (auto& lp : links_) {
    if (!lp) continue;
    Link& l = *lp;
    if (l.state == LinkState::kDown && now - l.down_since >= options_.dead_after) {
      l.state = LinkState::kDead;
      ++counters_.declared_dead;
      spdlog::error("peer {} (rank {}) declared dead: no answer for {:.1f} s; what waits for "
                    "it is given up",
                    l.address, l.rank, Seconds(now - l.down_since));
    }
    if (l.state == LinkState::kDead) {
      dead.push_back(Dead{l.rank, l.address, Seconds(now - l.down_since)});
    }
  }
  return dead;
}

void PeerLinks::Watch() {
  struct Ping {
    uint32_t rank;
    std::shared_ptr<PeerClient> client;
    std::shared_ptr<PeerClient::QueryCall> call;
  };
  std::vector<Ping> pings;
  std::vector<uint32_t> retry;
  std::vector<std::shared_ptr<PeerClient>> closed;
  {
    MutexLock lock(&mu_);
    const auto now = Clock::now();
    for (auto& lp : links_) {
      if (!lp) continue;
      Link& l = *lp;
      if (l.client && !l.client->healthy()) {
        closed.push_back(std::move(l.client));
        --open_;
        MarkDownLocked(l, "connection lost");
        spdlog::warn("peer {} (rank {}): connection lost", l.address, l.rank);
      }
      if (l.client) {
        if (!l.pinging && now - l.last_answer >= options_.heartbeat) {
          l.pinging = true;
          pings.push_back(Ping{l.rank, l.client, nullptr});
        }
      } else if ((l.state == LinkState::kDown || l.state == LinkState::kDead) && !l.connecting &&
                 now >= l.down_until) {
        retry.push_back(l.rank);
      }
    }
  }
  closed.clear();
  // Every ping goes out before any answer is waited for: a hung peer costs one
  // request_timeout for the round, not one per link.
  for (Ping& p : pings) p.call = p.client->StartShardQuery({}, std::chrono::milliseconds(0));
  for (Ping& p : pings) {
    Result<std::vector<ShardStatus>> r = p.client->WaitShardQuery(p.call);
    const bool lost = !r.ok() && (r.status().code() == Code::kTimeout ||
                                  r.status().code() == Code::kIo);
    {
      MutexLock lock(&mu_);
      ++counters_.heartbeats;
      if (lost) ++counters_.heartbeat_failures;
      links_[p.rank]->pinging = false;
    }
    if (lost) {
      if (Failed(p.rank, p.client, r.status())) {
        spdlog::warn("peer {} (rank {}): no heartbeat answer: {}", AddressOf(p.rank), p.rank,
                     r.status().ToString());
      }
    } else {
      Succeeded(p.rank);  // any answer, even an error, is a live authenticated member
    }
  }
  pings.clear();
  for (uint32_t rank : retry) {
    {
      MutexLock lock(&stop_mu_);
      if (stop_) return;
    }
    Connect(rank);
  }
  (void)DeadPeers();
}

void PeerLinks::ConnectAll() {
  for (uint32_t r = 0; r < options_.nodes.size(); ++r) {
    if (r != options_.self) Get(r, true);
  }
}

void PeerLinks::Loop() {
  const auto tick = std::clamp<std::chrono::milliseconds>(options_.heartbeat / 2,
                                                          std::chrono::milliseconds(50),
                                                          std::chrono::milliseconds(1000));
  MutexLock lock(&stop_mu_);
  while (!stop_) {
    lock.Unlock();
    Watch();
    lock.Lock();
    stop_cv_.wait_for(lock.native(), tick, [this] {
      stop_mu_.AssertHeld();  // the predicate runs under the lock
      return stop_;
    });
  }
}

PeerLinksStats PeerLinks::Stats() const {
  MutexLock lock(&mu_);
  PeerLinksStats s = counters_;
  s.open = open_;
  s.max_links = static_cast<uint32_t>(options_.max_links);
  const auto now = Clock::now();
  for (const auto& lp : links_) {
    if (!lp) continue;
    const Link& l = *lp;
    LinkInfo i;
    i.rank = l.rank;
    i.address = l.address;
    i.state = l.state;
    i.open = l.client != nullptr;
    if (l.client != nullptr) s.pooled_bytes += l.client->stats().pooled_bytes;
    i.failures = l.failures;
    i.last_error = l.last_error;
    if (l.state == LinkState::kDown || l.state == LinkState::kDead) {
      i.silent_s = Seconds(now - l.down_since);
    }
    switch (l.state) {
      case LinkState::kUp: ++s.up; break;
      case LinkState::kDown: ++s.down; break;
      case LinkState::kDead: ++s.dead; break;
      case LinkState::kUnknown: break;
    }
    s.links.push_back(std::move(i));
  }
  return s;
}

}  // namespace ckptfs::store::peer
