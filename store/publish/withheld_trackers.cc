#include "store/publish/withheld_trackers.h"

#include <spdlog/spdlog.h>

#include <string_view>
#include <vector>

namespace ckptfs::store {
namespace {

constexpr char kPrefix[] = "w/";

}  // namespace

Status WithheldTrackers::Load() {
  std::vector<std::string> names;
  CKPT_RETURN_IF_ERROR(db_->Scan(kPrefix, [&](std::string_view key, std::string_view) {
    names.emplace_back(key.substr(sizeof(kPrefix) - 1));
  }));
  MutexLock lock(&mu_);
  paths_.insert(names.begin(), names.end());
  if (paths_.empty()) return Status::Ok();
  hold_->TrackersWithheld();
  spdlog::warn("publication: tracker {} (and {} more) was aborted before this start; "
               "deletions of committed checkpoints wait until a version of it is applied",
               *paths_.begin(), paths_.size() - 1);
  return Status::Ok();
}

void WithheldTrackers::Withhold(const std::string& path) {
  MutexLock lock(&mu_);
  hold_->TrackersWithheld();
  if (!paths_.insert(path).second) return;
  Status st = db_->Put(std::string(kPrefix) + path, "");
  if (!st.ok()) {
    spdlog::warn("publication: recording withheld tracker {}: {}", path, st.ToString());
  }
  spdlog::warn("publication: the abort withholds tracker {}: deletions of committed "
               "checkpoints wait until a version of it is applied", path);
}

void WithheldTrackers::Through(const std::string& path) {
  MutexLock lock(&mu_);
  if (paths_.erase(path) == 0) return;
  Status st = db_->Delete(std::string(kPrefix) + path);
  if (!st.ok()) {
    spdlog::warn("publication: forgetting withheld tracker {}: {}", path, st.ToString());
  }
  if (paths_.empty()) hold_->TrackerThrough();
  spdlog::info("publication: tracker {} applied again (or removed) after an abort", path);
}

}  // namespace ckptfs::store
