#include "store/publish/aborted_rewrites.h"

#include <optional>

#include "common/path.h"

namespace ckptfs::store {

bool AbortedRewrites::WithdrawOnAbort(const std::string& dir, bool in_place) {
  // The record is that of the save the abort drops (a rewrite starts it over). Committed:
  // its own `.metadata` is on the backing store and names what is there. Else, if any file
  // of it was published into the directory (or a failed attempt left one there), the
  // directory is no longer what an earlier `.metadata` there names: a mix of two saves
  // that a loader must not take as complete.
  const std::optional<CheckpointInfo> info = registry_->Get(dir);
  if (info && info->state == CkptState::kCommitted) return false;
  MutexLock lock(&mu_);
  if (!in_place && !(info && info->bytes_published > 0) && withdrawn_.count(dir) == 0) {
    return false;
  }
  if (withdrawn_.size() >= kMaxWithdrawn) withdrawn_.erase(withdrawn_.begin());
  withdrawn_.insert(dir);
  return true;
}

std::vector<std::string> AbortedRewrites::KeepEarlierCommits(const std::vector<std::string>& dirs) {
  std::vector<std::string> kept;
  // Other nodes' files of the save may be there: this node cannot tell.
  if (shared_dirs_) return kept;
  for (const std::string& dir : dirs) {
    {
      MutexLock lock(&mu_);
      if (withdrawn_.count(dir) > 0) continue;  // an earlier abort's withdrawal is on its way
    }
    const std::optional<CheckpointInfo> info = registry_->Get(dir);
    if (!info || info->state != CkptState::kAborted) continue;
    if (!dir_->Stat(path::Join(dir, ".metadata")).ok()) continue;
    registry_->OnEarlierCommitKept(dir,
                                   "a later save into it was aborted by the operator "
                                   "before any of it reached the backing store");
    kept.push_back(dir);
  }
  return kept;
}

void AbortedRewrites::OnCommitted(const std::string& dir) {
  MutexLock lock(&mu_);
  withdrawn_.erase(dir);
}

}  // namespace ckptfs::store
