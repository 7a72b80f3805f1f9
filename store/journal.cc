#include "store/journal.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <cinttypes>
#include <cstdio>
#include <nlohmann/json.hpp>

namespace ckptfs::store {
namespace {

constexpr char kEntryPrefix[] = "j/";
constexpr char kTempPrefix[] = "t/";
constexpr char kEpochKey[] = "m/epoch";

std::string Key(const char* prefix, uint64_t n) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%s%016" PRIx64, prefix, n);
  return buf;
}

bool HasPrefix(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

const char* OpName(OpType op) {
  switch (op) {
    case OpType::kPublish: return "publish";
    case OpType::kRename: return "rename";
    case OpType::kUnlink: return "unlink";
    case OpType::kRmdir: return "rmdir";
    case OpType::kMkdir: return "mkdir";
    case OpType::kSymlink: return "symlink";
    case OpType::kChmod: return "chmod";
    case OpType::kUtimens: return "utimens";
    case OpType::kDiscard: return "discard";
    case OpType::kChown: return "chown";
    case OpType::kLink: return "link";
    case OpType::kMknod: return "mknod";
  }
  return "?";
}

bool IsCommitName(const std::string& path) {
  auto slash = path.rfind('/');
  std::string_view name = slash == std::string::npos ? std::string_view(path)
                                                     : std::string_view(path).substr(slash + 1);
  return name == ".metadata";
}

std::string JournalEntry::Serialize() const {
  nlohmann::json j = {{"seq", seq},   {"op", static_cast<int>(op)}, {"path", path},
                      {"from", from}, {"link", link_target},        {"mode", mode},
                      {"at", {atime_sec, atime_nsec}}, {"mt", {mtime_sec, mtime_nsec}},
                      {"id", file_id}, {"size", size}};
  // Multi-user POSIX fields, only when set, so older entries keep their exact form.
  if (uid != kNoOwner || gid != kNoOwner) j["own"] = {uid, gid};
  if (rdev != 0) j["rdev"] = rdev;
  return j.dump();
}

Result<JournalEntry> JournalEntry::Parse(std::string_view text) {
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Corrupt("journal entry is not JSON");
  JournalEntry e;
  try {
    e.seq = j.at("seq").get<uint64_t>();
    e.op = static_cast<OpType>(j.at("op").get<int>());
    e.path = j.at("path").get<std::string>();
    e.from = j.at("from").get<std::string>();
    e.link_target = j.at("link").get<std::string>();
    e.mode = j.at("mode").get<uint32_t>();
    e.atime_sec = j.at("at")[0].get<int64_t>();
    e.atime_nsec = j.at("at")[1].get<int64_t>();
    e.mtime_sec = j.at("mt")[0].get<int64_t>();
    e.mtime_nsec = j.at("mt")[1].get<int64_t>();
    e.file_id = j.at("id").get<uint64_t>();
    e.size = j.at("size").get<uint64_t>();
    if (j.contains("own")) {
      e.uid = j.at("own").at(0).get<uint32_t>();
      e.gid = j.at("own").at(1).get<uint32_t>();
    }
    if (j.contains("rdev")) e.rdev = j.at("rdev").get<uint64_t>();
  } catch (const nlohmann::json::exception& ex) {
    return Corrupt(std::string("journal entry: ") + ex.what());
  }
  return e;
}

std::string JournalEntry::Describe() const {
  std::string s = std::string(OpName(op)) + " #" + std::to_string(seq) + " " + path;
  if (!from.empty()) s += " (from " + from + ")";
  return s;
}

Result<RecoveryReport> Journal::Recover(BackingDir* dir, StateDb* db) {
  RecoveryReport report;
  std::vector<std::string> deletes;
  std::vector<std::string> temps;
  CKPT_RETURN_IF_ERROR(db->Scan(kEntryPrefix, [&](std::string_view k, std::string_view v) {
    deletes.emplace_back(k);
    auto e = JournalEntry::Parse(v);
    ++report.entries_discarded;
    if (e.ok() && e->op == OpType::kPublish) report.discarded_paths.push_back(e->path);
  }));
  CKPT_RETURN_IF_ERROR(db->Scan(kTempPrefix, [&](std::string_view k, std::string_view v) {
    deletes.emplace_back(k);
    temps.emplace_back(v);
  }));
  for (const auto& temp : temps) {
    Status st = dir->Unlink(temp);
    if (st.ok()) {
      ++report.temps_removed;
      spdlog::info("recovery: removed unpublished temp file {}", temp);
    } else if (st.code() != Code::kNotFound) {
      return st;  // keep the records; the next start tries again
    }
  }
  CKPT_RETURN_IF_ERROR(db->Write({}, deletes));
  return report;
}

Journal::Journal(BackingDir* dir, StateDb* db, Hooks hooks, uint64_t next_seq, uint64_t next_id)
    : dir_(dir), db_(db), hooks_(std::move(hooks)), next_seq_(next_seq), done_seq_(next_seq - 1),
      next_file_id_(next_id) {
  thread_ = std::thread([this] { Run(); });
}

Result<std::unique_ptr<Journal>> Journal::Create(BackingDir* dir, StateDb* db, Hooks hooks) {
  // File ids are (epoch << 32 | n): unique across restarts, so a temp name of an
  // earlier run can never be reused by this one.
  uint64_t epoch = 1;
  auto prev = db->Get(kEpochKey);
  if (prev.ok()) epoch = std::strtoull(prev->c_str(), nullptr, 10) + 1;
  CKPT_RETURN_IF_ERROR(db->Put(kEpochKey, std::to_string(epoch)));
  return std::unique_ptr<Journal>(new Journal(dir, db, std::move(hooks), 1, epoch << 32));
}

Journal::~Journal() {
  Drain();
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

uint64_t Journal::NextFileId() {
  std::lock_guard lock(mu_);
  return ++next_file_id_;
}

Status Journal::RegisterTemp(uint64_t file_id, const std::string& temp_path) {
  CKPT_RETURN_IF_ERROR(db_->Put(Key(kTempPrefix, file_id), temp_path));
  std::lock_guard lock(mu_);
  temps_[file_id] = temp_path;
  return Status::Ok();
}

Status Journal::ForgetTemp(uint64_t file_id) {
  {
    std::lock_guard lock(mu_);
    temps_.erase(file_id);
  }
  return db_->Delete(Key(kTempPrefix, file_id));
}

Result<uint64_t> Journal::Append(JournalEntry entry) {
  std::unique_lock lock(mu_);
  entry.seq = next_seq_++;
  // The record only tells a restarted daemon what was pending; the temp records are
  // what recovery acts on, so this write need not be synced separately.
  Status st = db_->Put(Key(kEntryPrefix, entry.seq), entry.Serialize());
  if (!st.ok()) {
    // Keep the sequence dense: the entry is queued anyway, in memory, and the error
    // is logged. Publication order is what matters for the backing store.
    spdlog::warn("journal: could not persist {}: {}", entry.Describe(), st.ToString());
  }
  uint64_t seq = entry.seq;
  queue_.push_back(std::move(entry));
  lock.unlock();
  work_cv_.notify_one();
  return seq;
}

Status Journal::Wait(uint64_t seq) {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return done_seq_ >= seq; });
  auto it = failures_.find(seq);
  return it == failures_.end() ? Status::Ok() : it->second;
}

void Journal::Drain() {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return done_seq_ + 1 >= next_seq_; });
}

uint64_t Journal::pending() const {
  std::lock_guard lock(mu_);
  return next_seq_ - 1 - done_seq_;
}

uint64_t Journal::last_appended() const {
  std::lock_guard lock(mu_);
  return next_seq_ - 1;
}

uint64_t Journal::applied() const {
  std::lock_guard lock(mu_);
  return done_seq_;
}

uint64_t Journal::skipped() const {
  std::lock_guard lock(mu_);
  return skipped_;
}

void Journal::Run() {
  while (true) {
    JournalEntry entry;
    {
      std::unique_lock lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      entry = std::move(queue_.front());
      queue_.pop_front();
    }
    Status st = Status::Ok();
    bool commit = (entry.op == OpType::kPublish || entry.op == OpType::kRename) &&
                  IsCommitName(entry.path);
    if (entry.op == OpType::kPublish) {
      // Data first: the commit gate may read this very file.
      if (entry.target) st = entry.target->Sync(dir_);
    }
    if (st.ok() && commit && hooks_.commit_gate) st = hooks_.commit_gate(entry);
    if (st.ok()) st = Apply(entry);
    if (!st.ok()) {
      spdlog::error("journal: {} skipped: {}", entry.Describe(), st.ToString());
      if (entry.op == OpType::kPublish) {
        // Nothing of a failed file may appear under its real name (G4, G7).
        Status rm = dir_->Unlink(entry.from);
        if (!rm.ok() && rm.code() != Code::kNotFound) {
          spdlog::error("journal: cannot remove temp {}: {}", entry.from, rm.ToString());
        }
      }
    }
    std::vector<std::string> deletes{Key(kEntryPrefix, entry.seq)};
    if (entry.op == OpType::kPublish || entry.op == OpType::kDiscard) {
      deletes.push_back(Key(kTempPrefix, entry.file_id));
    }
    Status db_st = db_->Write({}, deletes);
    if (!db_st.ok()) spdlog::warn("journal: state db: {}", db_st.ToString());
    if (hooks_.on_done) hooks_.on_done(entry, st);
    entry.target.reset();
    {
      std::lock_guard lock(mu_);
      if (entry.op == OpType::kPublish || entry.op == OpType::kDiscard) {
        temps_.erase(entry.file_id);
      }
      if (!st.ok()) {
        failures_[entry.seq] = st;
        ++skipped_;
        // Bound the memory of old outcomes; waiters read theirs promptly.
        while (failures_.size() > 4096) failures_.erase(failures_.begin());
      }
      done_seq_ = entry.seq;
    }
    done_cv_.notify_all();
  }
}

Status Journal::ApplyPublish(const JournalEntry& e) {
  // Over an existing file, exchange the two names: if the directory cannot be made
  // durable, exchanging back restores exactly the old state (G4); otherwise the temp
  // name now holds the old file, which is removed.
  constexpr unsigned kExchange = 2;  // RENAME_EXCHANGE
  const bool replacing = dir_->Stat(e.path).ok();
  CKPT_RETURN_IF_ERROR(dir_->Rename(e.from, e.path, replacing ? kExchange : 0));
  Status st = dir_->SyncParent(e.path);
  if (!st.ok()) {
    // Not durable, so it must not count as published: put the names back.
    Status undo = dir_->Rename(e.path, e.from, replacing ? kExchange : 0);
    if (!undo.ok()) {
      spdlog::error("journal: cannot withdraw {} after a failed sync: {}", e.path,
                    undo.ToString());
    }
    return st;
  }
  if (replacing) {
    Status rm = dir_->Unlink(e.from);
    if (!rm.ok()) spdlog::warn("journal: cannot remove replaced {}: {}", e.from, rm.ToString());
  }
  return Status::Ok();
}

Status Journal::Apply(const JournalEntry& e) {
  switch (e.op) {
    case OpType::kPublish:
      return ApplyPublish(e);
    case OpType::kRename: {
      CKPT_RETURN_IF_ERROR(dir_->Rename(e.from, e.path));
      Status st = dir_->SyncParent(e.path);
      if (!st.ok() && IsCommitName(e.path)) {
        // A commit that is not durable must not stay visible (G5): withdraw it.
        Status undo = dir_->Rename(e.path, e.from);
        if (!undo.ok()) {
          spdlog::error("journal: cannot withdraw {}: {}", e.path, undo.ToString());
        }
        return st;
      }
      MoveTempRecords(e.from, e.path);
      return st;
    }
    case OpType::kUnlink: {
      Status st = dir_->Unlink(e.path);
      if (st.code() == Code::kNotFound) return Status::Ok();  // already gone: same state
      return st;
    }
    case OpType::kDiscard: {
      Status st = dir_->Unlink(e.from);
      return st.code() == Code::kNotFound ? Status::Ok() : st;
    }
    case OpType::kRmdir: {
      Status st = dir_->Rmdir(e.path);
      if (st.code() == Code::kNotFound) return Status::Ok();
      return st;
    }
    case OpType::kMkdir: {
      Status st = dir_->Mkdir(e.path, e.mode);
      if (st.code() == Code::kExists) return Status::Ok();
      CKPT_RETURN_IF_ERROR(st);
      return ApplyOwner(e);
    }
    case OpType::kSymlink:
      CKPT_RETURN_IF_ERROR(dir_->Symlink(e.link_target, e.path));
      return ApplyOwner(e);
    case OpType::kMknod:
      CKPT_RETURN_IF_ERROR(dir_->Mknod(e.path, e.mode, static_cast<dev_t>(e.rdev)));
      return ApplyOwner(e);
    case OpType::kChown:
      return dir_->Chown(e.path, e.uid, e.gid);
    case OpType::kLink:
      CKPT_RETURN_IF_ERROR(dir_->Link(e.from, e.path));
      return dir_->SyncParent(e.path);
    case OpType::kChmod:
      return dir_->Chmod(e.path, e.mode);
    case OpType::kUtimens: {
      struct timespec ts[2] = {{e.atime_sec, e.atime_nsec}, {e.mtime_sec, e.mtime_nsec}};
      return dir_->Utimens(e.path, ts);
    }
  }
  return Internal("unknown journal op");
}

Status Journal::ApplyOwner(const JournalEntry& e) {
  if (e.uid == kNoOwner && e.gid == kNoOwner) return Status::Ok();  // an entry of old
  // The caller's owner, then the exact mode: the daemon's umask shaped the mode it was
  // made with, and a chown clears setuid/setgid bits.
  Status owned = dir_->Chown(e.path, e.uid, e.gid);
  if (!owned.ok()) {
    // The name exists as the application made it; only its owner is the daemon's (a
    // daemon that is not root, NFS root_squash). Refusing the entry would hold back
    // publication for an owner the backing store does not allow.
    spdlog::warn("journal: {}: owner {}:{} not set: {}", e.Describe(), e.uid, e.gid,
                 owned.ToString());
  }
  if (e.op == OpType::kSymlink) return Status::Ok();
  return dir_->Chmod(e.path, e.mode & 07777);
}

void Journal::MoveTempRecords(const std::string& from, const std::string& to) {
  std::vector<std::pair<std::string, std::string>> puts;
  {
    std::lock_guard lock(mu_);
    const std::string prefix = from + "/";
    for (auto& [id, path] : temps_) {
      if (path == from) {
        path = to;
      } else if (HasPrefix(path, prefix)) {
        path = to + path.substr(from.size());
      } else {
        continue;
      }
      puts.emplace_back(Key(kTempPrefix, id), path);
    }
  }
  if (!puts.empty()) {
    Status st = db_->Write(puts, {});
    if (!st.ok()) spdlog::warn("journal: cannot update temp records: {}", st.ToString());
  }
}

}  // namespace ckptfs::store
