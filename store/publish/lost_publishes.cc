#include "store/publish/lost_publishes.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>
#include <utility>

#include "common/path.h"

namespace ckptfs::store {

std::pair<std::string, std::string> LostPublishes::Record(const std::string& path, double when) {
  return {std::string(kPrefix) + path, std::to_string(when)};
}

Result<std::vector<std::string>> LostPublishes::Load() {
  std::vector<std::pair<double, std::string>> found;  // (recovery time, name)
  CKPT_RETURN_IF_ERROR(db_->Scan(kPrefix, [&](std::string_view key, std::string_view value) {
    found.emplace_back(std::strtod(std::string(value).c_str(), nullptr),
                       std::string(key.substr(sizeof(kPrefix) - 1)));
  }));
  if (found.size() > kMaxRecords) {
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
      return a.first > b.first;  // newest first
    });
    std::vector<std::string> old;
    for (size_t i = kMaxRecords; i < found.size(); ++i) {
      old.push_back(std::string(kPrefix) + found[i].second);
    }
    found.resize(kMaxRecords);
    Status st = db_->Write({}, old, WriteMode::kUnsynced);
    if (!st.ok()) spdlog::warn("lost publishes: trimming the record: {}", st.ToString());
  }
  std::vector<std::string> names;
  names.reserve(found.size());
  for (auto& [when, name] : found) names.push_back(std::move(name));
  {
    MutexLock lock(&mu_);
    paths_.insert(names.begin(), names.end());
  }
  if (!names.empty()) {
    spdlog::warn("publication: {} file(s) closed before an earlier crash never reached the "
                 "backing store (e.g. {}); the commit query answers them failed until they "
                 "are written again",
                 names.size(), names.front());
  }
  return names;
}

void LostPublishes::ForgetAtOrBelowLocked(const std::string& path,
                                          std::vector<std::string>* keys, bool below_only) {
  for (auto it = paths_.lower_bound(path);
       it != paths_.end() && it->compare(0, path.size(), path) == 0;) {
    if (below_only ? path::IsBelow(*it, path) : path::IsAtOrBelow(*it, path)) {
      keys->push_back(std::string(kPrefix) + *it);
      it = paths_.erase(it);
    } else {
      ++it;
    }
  }
}

void LostPublishes::OnDone(const JournalEntry& e, const Status& st) {
  // Attributes change nothing about where the name's bytes are.
  if (e.op == OpType::kChmod || e.op == OpType::kUtimens || e.op == OpType::kChown) return;
  std::vector<std::string> keys;
  {
    MutexLock lock(&mu_);
    if (paths_.empty()) return;
    ForgetAtOrBelowLocked(e.path, &keys);
    if (e.op == OpType::kRename) ForgetAtOrBelowLocked(e.from, &keys);
    if (st.ok() && (e.op == OpType::kPublish || e.op == OpType::kRename) &&
        IsCommitName(e.path)) {
      ForgetAtOrBelowLocked(path::Parent(e.path), &keys, /*below_only=*/true);
    }
  }
  Delete(keys);
}

void LostPublishes::Settled(const std::string& dir) {
  std::vector<std::string> keys;
  {
    MutexLock lock(&mu_);
    if (paths_.empty()) return;
    ForgetAtOrBelowLocked(dir, &keys, /*below_only=*/true);
  }
  Delete(keys);
}

void LostPublishes::Delete(const std::vector<std::string>& keys) {
  if (keys.empty()) return;
  // Unsynced, as the journal's own records: the WAL's write(2) survives a kill; only a
  // power loss could bring a record back.
  Status st = db_->Write({}, keys, WriteMode::kUnsynced);
  if (!st.ok()) spdlog::warn("lost publishes: forgetting {}: {}", keys.front(), st.ToString());
}

size_t LostPublishes::size() const {
  MutexLock lock(&mu_);
  return paths_.size();
}

}  // namespace ckptfs::store
