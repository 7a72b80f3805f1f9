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

CommitQuerier::CommitQuerier(CommitQueryOptions options, PeerLinks* links)
    : options_(std::move(options)), links_(links) {
  if (links_ == nullptr) {
    PeerLinksOptions lo;
    lo.nodes = options_.nodes;
    lo.self = options_.self;
    lo.secret = options_.secret;
    lo.connect_timeout = options_.connect_timeout;
    lo.request_timeout = options_.request_timeout;
    lo.down_backoff = options_.down_backoff;
    lo.watch = false;
    if (auto made = PeerLinks::Create(lo); made.ok()) {
      own_links_ = std::move(made).value();
      links_ = own_links_.get();
    } else {
      spdlog::error("commit query: {}", made.status().ToString());
    }
  }
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
                        PeerShardAnswerSink* sink, uint64_t round, std::vector<uint32_t> ranks) {
  {
    MutexLock lock(&mu_);
    if (stop_ || links_ == nullptr) return false;
    jobs_.push_back(Job{std::move(paths), hold, sink, round, std::move(ranks)});
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
}

std::vector<PeerShardAnswer> CommitQuerier::RunRound(const Job& job) {
  std::vector<PeerShardAnswer> out(job.paths.size());
  uint64_t errors = 0;
  std::vector<uint32_t> ranks = job.ranks;
  if (ranks.empty()) {
    for (uint32_t node = 0; node < options_.nodes.size(); ++node) {
      if (node != options_.self) ranks.push_back(node);
    }
  }
  // Every query goes out before any answer is waited for: peers hold their answers.
  struct Call {
    uint32_t node;
    std::shared_ptr<PeerClient> client;
    std::shared_ptr<PeerClient::QueryCall> call;
  };
  std::vector<Call> calls;
  for (uint32_t node : ranks) {
    if (node == options_.self || node >= options_.nodes.size()) continue;
    std::shared_ptr<PeerClient> client = links_->Get(node);
    if (!client) {
      ++errors;
      for (PeerShardAnswer& a : out) a.unreachable = true;
      continue;
    }
    calls.push_back(Call{node, client, client->StartShardQuery(job.paths, job.hold)});
  }
  for (Call& c : calls) {
    Result<std::vector<ShardStatus>> states = c.client->WaitShardQuery(c.call);
    if (!states.ok()) {
      ++errors;
      spdlog::debug("commit query: peer {}: {}", links_->AddressOf(c.node),
                    states.status().ToString());
      if (states.status().code() != Code::kUnsupported) {
        links_->Failed(c.node, c.client, states.status());
      }
      for (PeerShardAnswer& a : out) a.unreachable = true;
      continue;
    }
    links_->Succeeded(c.node);
    for (size_t i = 0; i < out.size(); ++i) Merge((*states)[i], &out[i]);
  }
  calls.clear();
  MutexLock lock(&mu_);
  ++stats_.rounds;
  stats_.peer_errors += errors;
  return out;
}

}  // namespace ckptfs::store::peer
