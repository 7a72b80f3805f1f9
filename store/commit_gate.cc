#include "store/commit_gate.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <vector>

#include "common/path.h"
#include "store/dcp/dcp_metadata.h"
#include "store/dcp/metadata_file.h"

namespace ckptfs::store {
namespace {

constexpr auto kMaxBackoff = std::chrono::milliseconds(2000);

}  // namespace

Status CommitGate::Load(const JournalEntry& e, Pending* p) {
  p->seq = e.seq;
  p->need.clear();
  p->by_order = false;
  p->backoff = std::chrono::milliseconds(50);
  p->deadline = std::chrono::steady_clock::now() + options_.timeout;
  p->next_poll = {};
  // A publish reads its durable temp file; a rename reads the name being renamed, which
  // every earlier entry (its own publish among them) has already put in place.
  Result<std::string> bytes = ReadMetadataBytes(dir_, e.from);
  if (!bytes.ok()) return bytes.status();
  auto md = ParseDcpMetadata(*bytes);
  const std::string dir = path::Parent(e.path);
  if (!md.ok()) {
    spdlog::warn("checkpoint {}: .metadata not understood ({}); committing by order only", dir,
                 md.status().ToString());
    p->by_order = true;
    return Status::Ok();
  }
  for (const auto& [file, min_len] : RequiredFileLengths(*md)) {
    p->need[path::Join(dir, file)] = min_len;
  }
  return Status::Ok();
}

namespace {
bool IsShardName(const std::string& path) {
  constexpr std::string_view kExt = ".distcp";
  return path.size() > kExt.size() &&
         std::string_view(path).substr(path.size() - kExt.size()) == kExt;
}
}  // namespace

bool CommitGate::IsOrderedEntry(const JournalEntry& e) {
  switch (e.op) {
    case OpType::kPublish:
    case OpType::kRename:
      // Shards and commits are ordered by the `.metadata` gate itself.
      return !IsShardName(e.path) && !IsCommitName(e.path);
    case OpType::kUnlink:
    case OpType::kRmdir:
      return true;
    default:
      return false;
  }
}

void CommitGate::NoteApplied(const JournalEntry& e, const Status& st) {
  if (!st.ok() || (e.op != OpType::kPublish && e.op != OpType::kRename)) return;
  MutexLock lock(&mu_);
  if (IsShardName(e.path)) {
    foreign_.insert(path::Parent(e.path));
  } else if (IsCommitName(e.path)) {
    foreign_.erase(path::Parent(e.path));
  }
}

CommitCheck CommitGate::CheckOrdered(const JournalEntry& e) {
  // mu_ held by Check().
  const auto now = std::chrono::steady_clock::now();
  if (ordered_.seq != e.seq) {
    ordered_.seq = e.seq;
    ordered_.backoff = std::chrono::milliseconds(50);
    ordered_.deadline = now + options_.timeout;
  }
  for (auto it = foreign_.begin(); it != foreign_.end();) {
    // The checkpoint itself or inside it (its `.metadata.tmp`, written before the rename
    // that commits it; the deletion of a checkpoint that never committed): no order to
    // keep.
    if (e.path.compare(0, it->size(), *it) == 0 &&
        (e.path.size() == it->size() || e.path[it->size()] == '/')) {
      ++it;
      continue;
    }
    ++remote_polls_;
    if (dir_->Stat(path::Join(*it, ".metadata")).ok()) {
      it = foreign_.erase(it);
      continue;
    }
    // A directory gone from the backing store (deleted by its writer) has nothing left
    // to commit.
    if (dir_->Stat(*it).status().code() == Code::kNotFound) {
      it = foreign_.erase(it);
      continue;
    }
    if (now > ordered_.deadline) {
      const std::string dir = *it;
      ordered_.seq = 0;
      return Status(Code::kTimeout, e.Describe() + " waits for checkpoint " + dir +
                                        ", whose .metadata never appeared on the backing store");
    }
    spdlog::debug("journal: {} waits for the .metadata of {}, published by another node",
                  e.Describe(), *it);
    CommitCheck check = CommitCheck::Wait({}, ordered_.backoff);
    ordered_.backoff = std::min(kMaxBackoff, ordered_.backoff * 2);
    // A synchronous caller (strict mode) must not wait: it may be the one whose later
    // write commits that checkpoint.
    check.waits_for_unwritten = true;
    return check;
  }
  ordered_.seq = 0;
  return Status::Ok();
}

CommitCheck CommitGate::Check(const JournalEntry& e,
                              const std::function<bool(const std::string&)>& queued) {
  MutexLock lock(&mu_);
  if (!IsCommitName(e.path)) return CheckOrdered(e);
  if (current_.seq != e.seq) {
    Status st = Load(e, &current_);
    if (!st.ok()) {
      current_.seq = 0;
      return st;
    }
  }
  Pending& p = current_;
  if (p.by_order) return Status::Ok();
  const auto now = std::chrono::steady_clock::now();
  const bool poll = now >= p.next_poll;
  bool remote = false;  // waits for a shard not queued or open here
  std::vector<std::string> waiting;
  for (auto it = p.need.begin(); it != p.need.end();) {
    const std::string& path = it->first;
    bool mine = (queued && queued(path)) ||
                (options_.written_locally && options_.written_locally(path));
    if (!mine && options_.deleted_locally && options_.deleted_locally(path)) {
      current_.seq = 0;
      return Status(Code::kAborted, "shard " + path + " was deleted before it was published");
    }
    if (!mine) {
      // Published already (by this mount or another writer), or written elsewhere.
      if (!poll) {
        remote = true;
        waiting.push_back(path);
        ++it;
        continue;
      }
      ++remote_polls_;
      auto st = dir_->Stat(path);
      if (st.ok() && static_cast<uint64_t>(st->st_size) >= it->second) {
        it = p.need.erase(it);
        continue;
      }
      remote = true;
    }
    waiting.push_back(path);
    ++it;
  }
  if (waiting.empty()) {
    current_.seq = 0;
    return Status::Ok();
  }
  if (remote) {
    if (now > p.deadline) {
      std::string first = waiting.front();
      current_.seq = 0;
      return Status(Code::kTimeout, "shard " + first + " never became durable with " +
                                        std::to_string(p.need[first]) + " bytes");
    }
    if (poll) {
      p.next_poll = now + p.backoff;
      p.backoff = std::min(kMaxBackoff, p.backoff * 2);
    }
  }
  // Own shards wake the journal when they are queued or applied; the recheck only bounds
  // the wait for shards written elsewhere.
  auto recheck = remote ? std::chrono::duration_cast<std::chrono::milliseconds>(p.next_poll - now)
                        : std::chrono::milliseconds(1000);
  CommitCheck check =
      CommitCheck::Wait(std::move(waiting), std::max(recheck, std::chrono::milliseconds(1)));
  check.waits_for_unwritten = remote;
  return check;
}

uint64_t CommitGate::remote_polls() const {
  MutexLock lock(&mu_);
  return remote_polls_;
}

}  // namespace ckptfs::store
