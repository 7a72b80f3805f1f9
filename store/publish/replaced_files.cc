#include "store/publish/replaced_files.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <iterator>
#include <utility>

#include "common/path.h"
#include "store/publish/entry_apply.h"

namespace ckptfs::store {

ReplacedFiles::ReplacedFiles(BackingDir* dir, StateDb* db, TempRecords* temps)
    : dir_(dir), db_(db), temps_(temps) {}

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
    Status db_st = db_->Write({}, {TempRecords::Key(k.file_id)}, WriteMode::kUnsynced);
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
  }
  // Unsynced: a crash that loses it leaves recovery a record whose file is gone.
  Status db_st = db_->Write({}, deletes, WriteMode::kUnsynced);
  if (!db_st.ok()) spdlog::warn("journal: state db: {}", db_st.ToString());
  for (const Kept& k : gone) temps_->Drop(k.file_id);
}

}  // namespace ckptfs::store
