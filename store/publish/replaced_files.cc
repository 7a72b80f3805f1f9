#include "store/publish/replaced_files.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <set>
#include <string_view>
#include <thread>
#include <utility>

#include "common/backoff.h"
#include "common/path.h"
#include "store/flush/flush_pipeline.h"
#include "store/publish/entry_apply.h"

namespace ckptfs::store {

ReplacedFiles::ReplacedFiles(BackingDir* dir, StateDb* db, TempRecords* temps)
    : dir_(dir), db_(db), temps_(temps) {}

namespace {

constexpr char kKeptPrefix[] = "r/";

std::string KeptKey(const std::string& temp) { return kKeptPrefix + temp; }

// A kept version's record: "<its inode> <the .metadata's inode> <its name>".
struct KeptRecord {
  ino_t ino = 0;
  ino_t metadata_ino = 0;
  std::string path;
};

std::optional<KeptRecord> ParseKept(std::string_view v) {
  KeptRecord r;
  const std::string text(v);
  char* end = nullptr;
  r.ino = std::strtoull(text.c_str(), &end, 10);
  if (end == nullptr || *end != ' ') return std::nullopt;
  r.metadata_ino = std::strtoull(end + 1, &end, 10);
  if (end == nullptr || *end != ' ' || end[1] == '\0') return std::nullopt;
  r.path = end + 1;
  return r;
}

}  // namespace

bool ReplacedFiles::RecordBeforeKeep(const std::string& path, const std::string& temp) {
  auto old = dir_->Stat(path);
  if (!old.ok() || !S_ISREG(old->st_mode)) return false;
  auto metadata = dir_->Stat(path::Join(path::Parent(path), ".metadata"));
  if (!metadata.ok()) return false;
  const std::string value = std::to_string(old->st_ino) + " " +
                            std::to_string(metadata->st_ino) + " " + path;
  Status st = db_->Put(KeptKey(temp), value, WriteMode::kUnsynced);
  if (!st.ok()) {
    spdlog::warn("journal: state db: the record of {}'s replaced version: {}", path,
                 st.ToString());
    return false;
  }
  return true;
}

void ReplacedFiles::DropRecord(const std::string& temp) {
  Status st = db_->Delete(KeptKey(temp), WriteMode::kUnsynced);
  if (!st.ok()) spdlog::warn("journal: state db: {}", st.ToString());
}

namespace {

// A step of recovery tried again while the store's error is transient (EIO, a full disk, a
// busy file), for about 3 s in all: a blip of the store at start is not a failed start
// (soak seed 5609: an injected EIO on a put-back's rename ended the daemon with exit 2).
Status RetryTransient(const std::function<Status()>& step, const char* what) {
  constexpr Backoff kBackoff{std::chrono::milliseconds(100), std::chrono::milliseconds(1600)};
  constexpr uint64_t kRetries = 5;
  Status st = step();
  for (uint64_t retry = 0; !st.ok() && IsTransient(st) && retry < kRetries; ++retry) {
    const std::chrono::milliseconds pause = kBackoff.Delay(retry);
    spdlog::warn("recovery: {}: {} (trying again in {} ms)", what, st.ToString(), pause.count());
    std::this_thread::sleep_for(pause);
    st = step();
  }
  return st;
}

}  // namespace

Status ReplacedFiles::RecoverKept(BackingDir* dir, StateDb* db,
                                  std::vector<std::string>* deletes,
                                  std::vector<std::string>* restored) {
  std::vector<std::pair<std::string, std::optional<KeptRecord>>> records;
  CKPT_RETURN_IF_ERROR(db->Scan(kKeptPrefix, [&](std::string_view k, std::string_view v) {
    records.emplace_back(std::string(k), ParseKept(v));
  }));
  std::set<std::string> dirs;
  for (const auto& [key, record] : records) {
    deletes->push_back(key);
    if (!record) {
      spdlog::warn("recovery: an unreadable record of a replaced version was dropped");
      continue;
    }
    const std::string temp = key.substr(sizeof(kKeptPrefix) - 1);
    const std::string parent = path::Parent(record->path);
    auto kept = dir->Stat(temp);
    auto metadata = dir->Stat(path::Join(parent, ".metadata"));
    if (!metadata.ok() || metadata->st_ino != record->metadata_ino) {
      continue;  // the rewrite committed (or was withdrawn)
    }
    const std::string& target = record->path;  // a structured binding: not capturable
    if (!kept.ok() || kept->st_ino != record->ino) {
      // Put back already by a start that failed after it (before its directory was synced
      // and its records removed): this start syncs the directory and reports it again.
      auto back = dir->Stat(target);
      if (!kept.ok() && back.ok() && back->st_ino == record->ino) dirs.insert(parent);
      continue;  // else never replaced
    }
    CKPT_RETURN_IF_ERROR(RetryTransient(
        [&dir, &temp, &target] {
          Status st = dir->Rename(temp, target);
          // A failed attempt may have renamed it all the same: then it is back.
          if (st.ok() || dir->Stat(temp).status().code() == Code::kNotFound) {
            return Status::Ok();
          }
          return st;
        },
        "put back a replaced file"));
    spdlog::warn("recovery: {} put back: the save that replaced it never committed (the "
                 "daemon stopped first)", record->path);
    dirs.insert(parent);
  }
  for (const std::string& d : dirs) {
    CKPT_RETURN_IF_ERROR(RetryTransient(
        [&] { return dir->SyncParent(path::Join(d, ".metadata")); }, "sync a restored directory"));
    restored->push_back(d);
  }
  return Status::Ok();
}

void ReplacedFiles::Keep(const std::string& path, const std::string& temp, uint64_t file_id) {
  MutexLock lock(&mu_);
  by_dir_[path::Parent(path)].push_back(Kept{path, temp, file_id});
}

bool ReplacedFiles::IsKept(const std::string& path) const {
  MutexLock lock(&mu_);
  auto it = by_dir_.find(path::Parent(path));
  if (it == by_dir_.end()) return false;
  return std::any_of(it->second.begin(), it->second.end(),
                     [&](const Kept& k) { return k.path == path; });
}

bool ReplacedFiles::HasKept(const std::string& dir) const {
  MutexLock lock(&mu_);
  return by_dir_.count(dir) > 0;
}

Status ReplacedFiles::PutBack(const std::string& dir, bool retry) {
  std::vector<Kept> kept;
  {
    MutexLock lock(&mu_);
    auto it = by_dir_.find(dir);
    if (it != by_dir_.end()) kept = it->second;
  }
  for (const Kept& k : kept) {
    // Over the aborted save's version, which goes with it.
    Status st = dir_->Rename(k.temp, k.path);
    if (!st.ok() && !(retry && st.code() == Code::kNotFound && dir_->Stat(k.path).ok())) {
      return st;
    }
    {
      MutexLock lock(&mu_);
      auto it = by_dir_.find(dir);
      if (it != by_dir_.end()) {
        std::erase_if(it->second, [&](const Kept& x) { return x.temp == k.temp; });
        if (it->second.empty()) by_dir_.erase(it);
      }
    }
    Status db_st =
        db_->Write({}, {TempRecords::Key(k.file_id), KeptKey(k.temp)}, WriteMode::kUnsynced);
    if (!db_st.ok()) spdlog::warn("journal: state db: {}", db_st.ToString());
    temps_->Drop(k.file_id);
    spdlog::warn("journal: {} put back: the save that replaced it was aborted or given up", k.path);
  }
  // The directory's entries (its `.metadata` among them) live in `dir`: syncing the
  // parent of a name in it syncs it.
  return dir_->SyncParent(path::Join(dir, ".metadata"));
}

std::optional<JournalEntry> ReplacedFiles::PutBackForGivenUpCommit(const JournalEntry& commit,
                                                                   bool withdraw) {
  const std::string dir = path::Parent(commit.path);
  if (!HasKept(dir)) return std::nullopt;
  JournalEntry r;
  r.seq = commit.seq;
  r.op = OpType::kUnlink;
  r.path = path::Join(dir, ".metadata");
  r.restore = true;
  r.withdraw = withdraw;
  Status st = PutBack(dir, /*retry=*/false);
  if (st.ok() && r.withdraw) st = ApplyEntry(dir_, r, nullptr);
  if (!st.ok()) {
    spdlog::error("journal: cannot put back what the rewrite of {} replaced: {}", dir,
                  st.ToString());
    return std::nullopt;
  }
  return r;
}

void ReplacedFiles::Release(const std::string& dir, bool subtree) {
  std::vector<Kept> gone;
  {
    MutexLock lock(&mu_);
    for (auto it = by_dir_.begin(); it != by_dir_.end();) {
      std::vector<Kept>& list = it->second;
      for (auto k = list.begin(); k != list.end();) {
        if (subtree ? path::IsAtOrBelow(k->path, dir) : it->first == dir) {
          gone.push_back(std::move(*k));
          k = list.erase(k);
        } else {
          ++k;
        }
      }
      it = list.empty() ? by_dir_.erase(it) : std::next(it);
    }
  }
  Remove(gone);
}

void ReplacedFiles::Remove(const std::vector<Kept>& gone) {
  if (gone.empty()) return;
  std::vector<std::string> deletes;
  for (const Kept& k : gone) {
    Status rm = dir_->Unlink(k.temp);
    if (!rm.ok() && rm.code() != Code::kNotFound) {
      spdlog::warn("journal: cannot remove the replaced version of {} ({}): {}", k.path, k.temp,
                   rm.ToString());
    }
    deletes.push_back(TempRecords::Key(k.file_id));
    deletes.push_back(KeptKey(k.temp));
  }
  // Unsynced: a crash that loses it leaves recovery a record whose file is gone.
  Status db_st = db_->Write({}, deletes, WriteMode::kUnsynced);
  if (!db_st.ok()) spdlog::warn("journal: state db: {}", db_st.ToString());
  for (const Kept& k : gone) temps_->Drop(k.file_id);
}

}  // namespace ckptfs::store
