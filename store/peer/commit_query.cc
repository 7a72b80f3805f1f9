#include "store/peer/commit_query.h"

#include <spdlog/spdlog.h>

#include "common/thread_name.h"

namespace ckptfs::store::peer {
namespace {

int Rank(ShardState s) {
  switch (s) {
    case ShardState::kDurable:
      return 5;
    case ShardState::kPending:
      return 4;
    case ShardState::kDropped:
      return 3;
    case ShardState::kFailed:
      return 2;
    case ShardState::kUnknown:
      return 1;
  }
  return 0;
}

}  // namespace

void CommitQuerier::Merge(const ShardStatus& from_peer, PeerShardAnswer* into) {
  const int have = Rank(into->status.state), got = Rank(from_peer.state);
  if (got > have) {
    into->status = from_peer;
  } else if (got == have && from_peer.state == ShardState::kDurable) {
    // The longest wins, with its writer's block CRCs (if it sent them).
    if (from_peer.length > into->status.length ||
        (from_peer.length == into->status.length && !into->status.checksums)) {
      into->status = from_peer;
    }
  }
}

CommitQuerier::CommitQuerier(CommitQueryOptions options)
    : options_(std::move(options)), peers_(options_.nodes.size()), nodes_(options_.nodes) {
  thread_ = std::thread([this] {
    NameThisThread("ckptfs-cquery");
    Loop();
  });
}

CommitQuerier::~CommitQuerier() {
  std::deque<Job> left;
  {
    MutexLock lock(&mu_);
    stop_ = true;
    left = std::move(jobs_);
    jobs_.clear();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (Job& job : left) {
    std::vector<PeerShardAnswer> none(job.paths.size());
    for (PeerShardAnswer& a : none) a.unreachable = true;
    job.sink->OnPeerShardAnswers(job.round, std::move(none));
  }
}

bool CommitQuerier::Ask(std::vector<std::string> paths, std::chrono::milliseconds hold,
                        PeerShardAnswerSink* sink, uint64_t round) {
  {
    MutexLock lock(&mu_);
    if (stop_) return false;
    jobs_.push_back(Job{std::move(paths), hold, sink, round});
  }
  cv_.notify_all();
  return true;
}

CommitQueryStats CommitQuerier::Stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

void CommitQuerier::Loop() {
  while (true) {
    Job job;
    {
      MutexLock lock(&mu_);
      while (!stop_ && jobs_.empty()) cv_.wait(lock.native());
      if (stop_) break;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job.sink->OnPeerShardAnswers(job.round, RunRound(job));
  }
  // Clients go on this thread, which made them; a round's calls are all waited for.
  peers_.clear();
}

std::string CommitQuerier::AddressOf(uint32_t node) const {
  MutexLock lock(&mu_);
  return nodes_[node];
}

void CommitQuerier::MoveNode(uint32_t rank, const std::string& address) {
  MutexLock lock(&mu_);
  if (rank < nodes_.size()) nodes_[rank] = address;
}

std::shared_ptr<PeerClient> CommitQuerier::ClientFor(uint32_t node) {
  Peer& peer = peers_[node];
  const std::string address = AddressOf(node);
  if (peer.connected_to != address) {
    // The node moved (a membership change): no pause carried over from the old address.
    peer.client.reset();
    peer.down_until = {};
  }
  if (peer.client && peer.client->healthy()) return peer.client;
  const auto now = std::chrono::steady_clock::now();
  if (now < peer.down_until) return nullptr;
  peer.client.reset();
  peer.connected_to = address;
  auto client = PeerClient::Connect(ClientOptionsFor(address, options_));
  if (!client.ok()) {
    spdlog::warn(
        "commit query: cannot reach peer {} ({}); its shards are checked on the "
        "backing store for {} ms",
        address, client.status().ToString(), options_.down_backoff.count());
    peer.down_until = std::chrono::steady_clock::now() + options_.down_backoff;
    return nullptr;
  }
  peer.client = std::move(client).value();
  return peer.client;
}

std::vector<PeerShardAnswer> CommitQuerier::RunRound(const Job& job) {
  std::vector<PeerShardAnswer> out(job.paths.size());
  uint64_t errors = 0;
  // Every query goes out before any answer is waited for: peers hold their answers.
  std::vector<std::pair<uint32_t, std::shared_ptr<PeerClient::QueryCall>>> calls;
  for (uint32_t node = 0; node < options_.nodes.size(); ++node) {
    if (node == options_.self) continue;
    std::shared_ptr<PeerClient> client = ClientFor(node);
    if (!client) {
      ++errors;
      for (PeerShardAnswer& a : out) a.unreachable = true;
      continue;
    }
    calls.emplace_back(node, client->StartShardQuery(job.paths, job.hold));
  }
  for (auto& [node, call] : calls) {
    Result<std::vector<ShardStatus>> states = peers_[node].client->WaitShardQuery(call);
    if (!states.ok()) {
      ++errors;
      spdlog::debug("commit query: peer {}: {}", AddressOf(node), states.status().ToString());
      if (states.status().code() != Code::kUnsupported) {
        peers_[node].down_until = std::chrono::steady_clock::now() + options_.down_backoff;
        if (states.status().code() == Code::kTimeout) peers_[node].client.reset();
      }
      for (PeerShardAnswer& a : out) a.unreachable = true;
      continue;
    }
    for (size_t i = 0; i < out.size(); ++i) Merge((*states)[i], &out[i]);
  }
  MutexLock lock(&mu_);
  ++stats_.rounds;
  stats_.peer_errors += errors;
  return out;
}

}  // namespace ckptfs::store::peer
