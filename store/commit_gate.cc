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

CommitCheck CommitGate::Check(const JournalEntry& e,
                              const std::function<bool(const std::string&)>& queued) {
  MutexLock lock(&mu_);
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
