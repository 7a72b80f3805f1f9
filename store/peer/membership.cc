#include "store/peer/membership.h"

#include <spdlog/spdlog.h>

#include <set>

namespace ckptfs::store::peer {

std::string Membership::Address(uint32_t rank) const {
  MutexLock lock(&mu_);
  return rank < nodes_.size() ? nodes_[rank] : std::string();
}

Membership::RankMap Membership::RanksOf(const std::vector<std::string>& nodes) {
  RankMap ranks;
  for (size_t r = 0; r < nodes.size(); ++r) ranks.emplace(nodes[r], static_cast<uint32_t>(r));
  return ranks;
}

std::optional<uint32_t> Membership::RankOf(std::string_view address) const {
  MutexLock lock(&mu_);
  auto it = ranks_.find(address);
  if (it == ranks_.end()) return std::nullopt;
  return it->second;
}

MembershipView Membership::View() const {
  MutexLock lock(&mu_);
  return MembershipView{nodes_, self_, epoch_, updates_, rejected_, last_rejection_};
}

void Membership::NoteRejected(const std::string& why) {
  MutexLock lock(&mu_);
  ++rejected_;
  last_rejection_ = why;
  spdlog::error("peers: new peer list refused, membership epoch {} kept: {}", epoch_, why);
}

Result<MembershipChange> Membership::Update(const std::vector<std::string>& nodes) {
  std::string why;
  {
    MutexLock lock(&mu_);
    std::set<std::string> seen;
    if (nodes.size() != nodes_.size()) {
      why = "it lists " + std::to_string(nodes.size()) + " nodes, the job has " +
            std::to_string(nodes_.size()) +
            " (a node joining or leaving needs the daemons restarted with the new list)";
    } else if (nodes[self_] != nodes_[self_]) {
      why = "this node's own entry (rank " + std::to_string(self_) + ") is " + nodes[self_] +
            ", this daemon listens as " + nodes_[self_];
    } else {
      for (const std::string& n : nodes) {
        if (n.empty()) {
          why = "an empty entry";
          break;
        }
        if (!seen.insert(n).second) {
          why = n + " is listed twice";
          break;
        }
      }
    }
    if (why.empty()) {
      MembershipChange change;
      for (uint32_t r = 0; r < nodes.size(); ++r) {
        if (nodes[r] != nodes_[r]) change.moved.push_back(r);
      }
      if (!change.moved.empty()) {
        for (uint32_t r : change.moved) {
          spdlog::warn("peers: node rank {} moved from {} to {} (membership epoch {})", r,
                       nodes_[r], nodes[r], epoch_ + 1);
        }
        nodes_ = nodes;
        ranks_ = RanksOf(nodes_);
        ++epoch_;
        ++updates_;
      }
      change.epoch = epoch_;
      return change;
    }
  }
  NoteRejected(why);
  return Invalid("peer list refused: " + why);
}

}  // namespace ckptfs::store::peer
