#include "store/publish/checkpoints.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include <chrono>

#include "common/path.h"
#include "store/dcp/commit_names.h"
#include "store/primitives/record_codec.h"

namespace ckptfs::store {
namespace {

constexpr char kPrefix[] = "c/";
constexpr uint8_t kRecordVersion = 2;  // 1 was JSON

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

CkptState StateFromName(const std::string& s) {
  if (s == "writing") return CkptState::kWriting;
  if (s == "pending") return CkptState::kPending;
  if (s == "committed") return CkptState::kCommitted;
  if (s == "failed") return CkptState::kFailed;
  return CkptState::kAborted;
}

}  // namespace

const char* CkptStateName(CkptState s) {
  switch (s) {
    case CkptState::kWriting: return "writing";
    case CkptState::kPending: return "pending";
    case CkptState::kCommitted: return "committed";
    case CkptState::kFailed: return "failed";
    case CkptState::kAborted: return "aborted";
  }
  return "?";
}

nlohmann::json CheckpointInfo::ToJson() const {
  nlohmann::json j = {{"path", path},       {"state", CkptStateName(state)},
                      {"bytes", bytes},     {"bytes_published", bytes_published},
                      {"files", files},     {"created", created},
                      {"updated", updated}};
  j["committed"] = committed > 0 ? nlohmann::json(committed) : nlohmann::json(nullptr);
  j["error"] = error.empty() ? nlohmann::json(nullptr) : nlohmann::json(error);
  return j;
}

std::string CheckpointInfo::Encode() const {
  std::string out;
  StringWriter w(&out);
  w.Byte(kRecordVersion);
  w.String(path);
  w.Byte(static_cast<uint8_t>(state));
  w.Varint(bytes);
  w.Varint(bytes_published);
  w.Varint(files);
  for (double t : {created, updated, committed}) w.Signed(static_cast<int64_t>(t * 1e6));
  w.String(error);
  return out;
}

bool CheckpointInfo::Decode(std::string_view in, CheckpointInfo* out) {
  Decoder d(in);
  if (d.Byte() != kRecordVersion) return false;
  out->path = d.String();
  uint8_t state = d.Byte();
  if (state > static_cast<uint8_t>(CkptState::kAborted)) return false;
  out->state = static_cast<CkptState>(state);
  out->bytes = d.Varint();
  out->bytes_published = d.Varint();
  out->files = d.Varint();
  for (double* t : {&out->created, &out->updated, &out->committed}) *t = d.Signed() / 1e6;
  out->error = d.String();
  return d.done();
}

Result<std::unique_ptr<CheckpointRegistry>> CheckpointRegistry::Load(StateDb* db) {
  std::unique_ptr<CheckpointRegistry> reg(new CheckpointRegistry(db));
  std::vector<CheckpointInfo> aborted;
  MutexLock lock(&reg->mu_);  // nobody else has the registry yet; taken for the analysis
  CKPT_RETURN_IF_ERROR(db->Scan(kPrefix, [&](std::string_view, std::string_view v) {
    reg->mu_.AssertHeld();  // the scan calls back on this thread, under `lock`
    CheckpointInfo info;
    if (!v.empty() && v[0] == '{') {
      // A record of an older daemon (JSON): read it once; it is rewritten in binary.
      auto j = nlohmann::json::parse(v, nullptr, false);
      if (j.is_discarded()) return;
      info.path = j.value("path", "");
      info.state = StateFromName(j.value("state", "aborted"));
      info.bytes = j.value("bytes", uint64_t{0});
      info.bytes_published = j.value("bytes_published", uint64_t{0});
      info.files = j.value("files", uint64_t{0});
      info.created = j.value("created", 0.0);
      info.updated = j.value("updated", 0.0);
      if (j["committed"].is_number()) info.committed = j["committed"].get<double>();
      if (j["error"].is_string()) info.error = j["error"].get<std::string>();
    } else if (!CheckpointInfo::Decode(v, &info)) {
      spdlog::warn("checkpoint registry: an unreadable record was ignored");
      return;
    }
    if (info.state == CkptState::kWriting || info.state == CkptState::kPending) {
      info.state = CkptState::kAborted;
      info.error = kStoppedBeforeCommit;
      aborted.push_back(info);
      spdlog::warn("checkpoint {} was not committed when the last run ended: aborted",
                   info.path);
    }
    reg->ckpts_[info.path] = info;
  }));
  for (const auto& info : aborted) reg->Persist(info);
  return reg;
}

bool CheckpointRegistry::IsCheckpointFile(const std::string& name) {
  return IsCheckpointFileName(name);
}

CheckpointInfo& CheckpointRegistry::Touch(const std::string& dir) {
  auto [it, inserted] = ckpts_.try_emplace(dir);
  CheckpointInfo& info = it->second;
  double now = Now();
  if (inserted || info.state == CkptState::kCommitted || info.state == CkptState::kAborted ||
      (info.state == CkptState::kFailed && !info.halted)) {
    if (!inserted) spdlog::info("checkpoint {} is being written again", dir);
    info = CheckpointInfo{};
    info.path = dir;
    info.created = now;
    Persist(info);
  }
  info.updated = now;
  return info;
}

void CheckpointRegistry::Persist(const CheckpointInfo& info, WriteMode mode) {
  Status st = db_->Put(std::string(kPrefix) + info.path, info.Encode(), mode);
  if (!st.ok()) spdlog::warn("checkpoint {}: cannot persist state: {}", info.path, st.ToString());
}

void CheckpointRegistry::OnFileCreated(const std::string& dir) {
  MutexLock lock(&mu_);
  auto it = ckpts_.find(dir);
  if (it == ckpts_.end() || it->second.state != CkptState::kWriting) {
    Touch(dir);
    spdlog::info("checkpoint {}: writing", dir);
  }
  ckpts_[dir].updated = Now();
}

void CheckpointRegistry::OnFileQueued(const std::string& dir, uint64_t bytes) {
  MutexLock lock(&mu_);
  auto it = ckpts_.find(dir);
  if (it == ckpts_.end()) return;
  it->second.bytes += bytes;
  it->second.files += 1;
  it->second.updated = Now();
}

std::optional<std::string> CheckpointRegistry::ResolveLocked(std::string dir,
                                                            uint64_t seq) const {
  if (seq == kNow) return dir;
  // Replay the renames and removals made after the entry, in their order.
  for (const Moved& m : moves_) {
    if (m.seq <= seq || !path::IsAtOrBelow(dir, m.from)) continue;
    if (m.to.empty()) return std::nullopt;  // removed
    dir = *path::Rebase(dir, m.from, m.to);
  }
  return dir;
}

CheckpointInfo* CheckpointRegistry::FindLocked(const std::string& dir, uint64_t seq) {
  std::optional<std::string> now = ResolveLocked(dir, seq);
  if (!now) return nullptr;
  auto it = ckpts_.find(*now);
  return it == ckpts_.end() ? nullptr : &it->second;
}

void CheckpointRegistry::OnApplied(uint64_t seq) {
  MutexLock lock(&mu_);
  std::erase_if(moves_, [seq](const Moved& m) { return m.seq <= seq; });
}

void CheckpointRegistry::OnFilePublished(const std::string& dir, uint64_t bytes, uint64_t seq) {
  MutexLock lock(&mu_);
  CheckpointInfo* info = FindLocked(dir, seq);
  if (info == nullptr) return;
  const bool was_all = info->bytes_published >= info->bytes;
  info->bytes_published += bytes;
  info->updated = Now();
  // Every file queued so far is on the backing store: kept, so that the next start can
  // tell a record of shards whose `.metadata` another node published (Publication's
  // reconciliation) from a save the stop cut short. Unsynced: a kill keeps it.
  if (!was_all && info->bytes_published >= info->bytes &&
      (info->state == CkptState::kWriting || info->state == CkptState::kPending)) {
    Persist(*info, WriteMode::kUnsynced);
  }
}

void CheckpointRegistry::OnCommitQueued(const std::string& dir, uint64_t seq) {
  MutexLock lock(&mu_);
  CheckpointInfo& info = ckpts_.count(dir) ? ckpts_[dir] : Touch(dir);
  info.commit_queued = true;
  info.commit_seq = std::max(info.commit_seq, seq);
  if (info.state == CkptState::kWriting) {
    info.state = CkptState::kPending;
    info.updated = Now();
    Persist(info);
    spdlog::info("checkpoint {}: pending ({} bytes queued)", dir, info.bytes);
  }
}

void CheckpointRegistry::OnCommitted(const std::string& dir, uint64_t seq, bool last_part) {
  MutexLock lock(&mu_);
  std::optional<std::string> now = ResolveLocked(dir, seq);
  if (!now) return;  // removed before its commit was applied: no record comes back
  CheckpointInfo* found = FindLocked(*now, kNow);
  // A rank's part of a save whose other part failed (strict mode goes on past a failure)
  // does not make the directory committed.
  if (last_part && found != nullptr && found->state == CkptState::kFailed) return;
  if (found == nullptr) {
    // A commit whose queueing this registry did not see.
    found = &ckpts_[*now];
    found->path = *now;
    found->created = Now();
  }
  CheckpointInfo& info = *found;
  if (seq != kNow && info.commit_seq > seq) {
    // The save this commit closes is on the backing store, but the application has since
    // queued another save's commit of the same directory: until that one is applied, the
    // directory is that later save's, pending (`ckptfs-admin wait` waits for it).
    spdlog::info("checkpoint {}: an earlier save committed; the next one (entry #{}) is "
                 "pending", info.path, info.commit_seq);
    return;
  }
  info.state = CkptState::kCommitted;
  info.committed = info.updated = Now();
  info.error.clear();  // an earlier failure or stop of this directory's save
  Persist(info);
  spdlog::info("checkpoint {}: committed ({} bytes)", info.path, info.bytes);
}

void CheckpointRegistry::OnFailed(const std::string& dir, const std::string& error,
                                  uint64_t seq) {
  MutexLock lock(&mu_);
  FailLocked(dir, error, seq);
}

CheckpointInfo* CheckpointRegistry::FailLocked(const std::string& dir, const std::string& error,
                                               uint64_t seq) {
  CheckpointInfo* found = FindLocked(dir, seq);
  if (found == nullptr) return nullptr;
  CheckpointInfo& info = *found;
  // Aborted is the operator's last word on the save: a failure of one of its files told
  // after the abort (the publisher reports a halt once the journal's lock is released, and
  // the abort can come in between) does not turn it back into `failed`.
  if (info.state == CkptState::kFailed || info.state == CkptState::kAborted) return found;
  info.state = CkptState::kFailed;
  info.error = error;
  info.updated = Now();
  Persist(info);
  spdlog::error("checkpoint {}: failed: {}", info.path, error);
  return found;
}

void CheckpointRegistry::OnRenamed(const std::string& from, const std::string& to,
                                   uint64_t seq) {
  MutexLock lock(&mu_);
  if (seq != 0) moves_.push_back(Moved{seq, from, to});
  std::vector<CheckpointInfo> moved;
  for (auto it = ckpts_.begin(); it != ckpts_.end();) {
    if (std::optional<std::string> now = path::Rebase(it->first, from, to)) {
      CheckpointInfo info = it->second;
      info.path = std::move(*now);
      Status st = db_->Delete(std::string(kPrefix) + it->first);
      if (!st.ok()) spdlog::warn("checkpoint registry: {}", st.ToString());
      it = ckpts_.erase(it);
      moved.push_back(std::move(info));
    } else {
      ++it;
    }
  }
  for (auto& info : moved) {
    spdlog::info("checkpoint {}: renamed to {}", from + info.path.substr(to.size()), info.path);
    Persist(info);
    ckpts_[info.path] = std::move(info);
  }
}

void CheckpointRegistry::OnHalted(const std::string& dir, const std::string& error) {
  // Failed and halted in one step: a file created in between (Touch) would otherwise see
  // a failure that does not hold publication and start the checkpoint over.
  MutexLock lock(&mu_);
  CheckpointInfo* found = FailLocked(dir, error, kNow);
  if (found != nullptr && found->state == CkptState::kFailed) found->halted = true;
}

void CheckpointRegistry::OnResumed(const std::string& dir) {
  MutexLock lock(&mu_);
  auto it = ckpts_.find(dir);
  if (it == ckpts_.end() || it->second.state != CkptState::kFailed) return;
  CheckpointInfo& info = it->second;
  info.halted = false;
  info.state = info.commit_queued ? CkptState::kPending : CkptState::kWriting;
  info.error.clear();
  info.updated = Now();
  Persist(info);
  spdlog::info("checkpoint {}: publication resumed ({})", dir, CkptStateName(info.state));
}

void CheckpointRegistry::OnAborted(const std::string& path, const std::string& why,
                                   bool subtree) {
  MutexLock lock(&mu_);
  for (auto& [dir, info] : ckpts_) {
    const bool there = subtree ? path::IsAtOrBelow(dir, path) : dir == path;
    if (!there || info.state == CkptState::kCommitted || info.state == CkptState::kAborted) {
      continue;
    }
    info.state = CkptState::kAborted;
    info.error = why;
    info.updated = Now();
    Persist(info);
    spdlog::warn("checkpoint {}: aborted: {}", dir, why);
  }
}

void CheckpointRegistry::OnEarlierCommitKept(const std::string& dir, const std::string& why) {
  MutexLock lock(&mu_);
  auto it = ckpts_.find(dir);
  if (it == ckpts_.end() || it->second.state == CkptState::kCommitted) return;
  CheckpointInfo& info = it->second;
  info.state = CkptState::kCommitted;
  info.error = why;
  info.committed = info.updated = Now();
  Persist(info);
  spdlog::warn("checkpoint {}: committed (the earlier save): {}", dir, why);
}

void CheckpointRegistry::OnRemoved(const std::string& dir, uint64_t seq) {
  MutexLock lock(&mu_);
  if (seq != 0) moves_.push_back(Moved{seq, dir, ""});
  for (auto it = ckpts_.begin(); it != ckpts_.end();) {
    if (!path::IsAtOrBelow(it->first, dir)) {
      ++it;
      continue;
    }
    spdlog::info("checkpoint {}: removed", it->first);
    Status st = db_->Delete(std::string(kPrefix) + it->first);
    if (!st.ok()) spdlog::warn("checkpoint registry: {}", st.ToString());
    it = ckpts_.erase(it);
  }
}

std::optional<CheckpointInfo> CheckpointRegistry::Get(const std::string& dir) const {
  MutexLock lock(&mu_);
  auto it = ckpts_.find(dir);
  if (it == ckpts_.end()) return std::nullopt;
  return it->second;
}

std::vector<CheckpointInfo> CheckpointRegistry::List() const {
  MutexLock lock(&mu_);
  std::vector<CheckpointInfo> out;
  out.reserve(ckpts_.size());
  for (const auto& [_, info] : ckpts_) out.push_back(info);
  return out;
}

std::map<std::string, uint64_t> CheckpointRegistry::CountByState() const {
  MutexLock lock(&mu_);
  std::map<std::string, uint64_t> counts = {
      {"writing", 0}, {"pending", 0}, {"committed", 0}, {"failed", 0}, {"aborted", 0}};
  for (const auto& [_, info] : ckpts_) counts[CkptStateName(info.state)]++;
  return counts;
}

}  // namespace ckptfs::store
