#include "store/publish/shard_state.h"

#include <vector>

#include "common/path.h"
#include "store/dcp/commit_names.h"

namespace ckptfs::store {

const char* ShardStateName(ShardState s) {
  switch (s) {
    case ShardState::kUnknown:
      return "unknown";
    case ShardState::kPending:
      return "pending";
    case ShardState::kDurable:
      return "durable";
    case ShardState::kDropped:
      return "dropped";
    case ShardState::kFailed:
      return "failed";
  }
  return "?";
}

ShardStatus LocalShardStates::Query(const std::string& path) {
  // The namespace first (it may take the namespace lock): a path written again is pending
  // whatever an older publish left in the record.
  if (local_ != nullptr && local_->PendingLocally(path)) return {ShardState::kPending, 0};
  {
    MutexLock lock(&mu_);
    auto it = records_.find(path);
    if (it != records_.end()) return it->second.status;
  }
  if (local_ != nullptr && local_->DeletedLocally(path)) return {ShardState::kDropped, 0};
  if (local_ != nullptr && IsCommitName(path) && local_->GivenUpLocally(path::Parent(path))) {
    return {ShardState::kFailed, 0};
  }
  return {};
}

std::optional<uint64_t> LocalShardStates::Durable(const std::string& path) const {
  MutexLock lock(&mu_);
  auto it = records_.find(path);
  if (it == records_.end() || it->second.status.state != ShardState::kDurable) return std::nullopt;
  return it->second.status.length;
}

void LocalShardStates::SetListener(ShardStateListener* listener) {
  MutexLock lock(&listener_mu_);
  listener_ = listener;
}

void LocalShardStates::PutLocked(const std::string& path, ShardStatus status) {
  const uint64_t stamp = next_stamp_++;
  records_[path] = Record{status, stamp};
  order_.emplace_back(path, stamp);
  while (records_.size() > max_records_ && !order_.empty()) {
    auto [old, old_stamp] = std::move(order_.front());
    order_.pop_front();
    auto it = records_.find(old);
    if (it != records_.end() && it->second.stamp == old_stamp) records_.erase(it);
  }
  // Stale order entries (paths recorded again, moved or erased) are dropped as they reach
  // the front, which is far when the record stays small (files published, then deleted:
  // a rotation): compact once stale entries outnumber live ones, so the deque follows
  // the record's size, not the history (amortized O(1) per put; found by the soak's
  // leak bound, issue 41).
  if (order_.size() > 2 * records_.size() + 1024) {
    std::deque<std::pair<std::string, uint64_t>> live;
    for (auto& [p, s] : order_) {
      auto it = records_.find(p);
      if (it != records_.end() && it->second.stamp == s) live.emplace_back(std::move(p), s);
    }
    order_ = std::move(live);
  }
}

void LocalShardStates::EraseAtOrBelowLocked(const std::string& dir) {
  for (auto it = records_.lower_bound(dir);
       it != records_.end() && it->first.compare(0, dir.size(), dir) == 0;) {
    if (path::IsAtOrBelow(it->first, dir)) {
      it = records_.erase(it);
    } else {
      ++it;
    }
  }
}

void LocalShardStates::NoteLost(const std::vector<std::string>& paths) {
  MutexLock lock(&mu_);
  for (const std::string& path : paths) PutLocked(path, {ShardState::kFailed, 0});
}

void LocalShardStates::Settled(const std::string& dir) {
  MutexLock lock(&mu_);
  SettledLocked(dir);
}

void LocalShardStates::SettledLocked(const std::string& dir) {
  for (auto it = records_.lower_bound(dir);
       it != records_.end() && it->first.compare(0, dir.size(), dir) == 0;) {
    if (path::IsBelow(it->first, dir) && !IsCommitName(it->first)) {
      it = records_.erase(it);
    } else {
      ++it;
    }
  }
}

void LocalShardStates::NoteDone(const JournalEntry& e, const Status& st) {
  bool notify = false;
  {
    MutexLock lock(&mu_);
    switch (e.op) {
      case OpType::kPublish:
        if (st.ok()) {
          if (IsCommitName(e.path)) SettledLocked(path::Parent(e.path));
          PutLocked(e.path, {ShardState::kDurable, e.size});
        } else if (st.code() == Code::kSuperseded) {
          break;  // a later save into the directory commits it: nothing failed
        } else if (st.code() == Code::kAborted) {
          PutLocked(e.path, {ShardState::kDropped, 0});
        } else {
          PutLocked(e.path, {ShardState::kFailed, 0});
        }
        notify = true;
        break;
      case OpType::kRename: {
        if (!st.ok()) {
          // A commit renamed into place (`.metadata.tmp` -> `.metadata`) and given up or
          // failed here: the nodes waiting for it learn it failed (CommitGate's
          // coordinator round) instead of waiting for their own verdict.
          if (st.code() != Code::kSuperseded && IsCommitName(e.path)) {
            PutLocked(e.path, {ShardState::kFailed, 0});
            notify = true;
          }
          break;
        }
        // The records at or below `from` move with it; whatever was at `path` is replaced.
        std::vector<std::pair<std::string, ShardStatus>> moved;
        for (auto it = records_.lower_bound(e.from);
             it != records_.end() && it->first.compare(0, e.from.size(), e.from) == 0; ++it) {
          if (auto to = path::Rebase(it->first, e.from, e.path)) {
            moved.emplace_back(std::move(*to), it->second.status);
          }
        }
        EraseAtOrBelowLocked(e.from);
        EraseAtOrBelowLocked(e.path);
        for (auto& [p, s] : moved) PutLocked(p, s);
        if (IsCommitName(e.path)) SettledLocked(path::Parent(e.path));  // `.metadata.tmp`
        notify = true;
        break;
      }
      case OpType::kUnlink:
      case OpType::kRmdir:
        if (st.ok()) EraseAtOrBelowLocked(e.path);
        break;
      default:
        break;
    }
  }
  if (!notify) return;
  MutexLock lock(&listener_mu_);
  if (listener_ != nullptr) listener_->OnShardStatesChanged();
}

}  // namespace ckptfs::store
