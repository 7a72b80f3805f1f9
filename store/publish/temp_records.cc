#include "store/publish/temp_records.h"

#include <spdlog/spdlog.h>

#include <cinttypes>
#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

#include "common/path.h"

namespace ckptfs::store {

std::string TempRecords::Key(uint64_t file_id) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%s%016" PRIx64, kPrefix, file_id);
  return buf;
}

uint64_t TempRecords::NextId() {
  MutexLock lock(&mu_);
  const uint64_t id = ++next_file_id_;
  if (!temp_prefix_.empty() && (id < reserved_from_ || id > reserved_until_)) {
    // One synced write for the temp records of the next kTempsAhead files, instead of one
    // per file (each while the caller holds the namespace lock). Should it fail, each
    // Register writes its own record, and reports the failure.
    constexpr uint64_t kTempsAhead = 64;
    std::vector<std::pair<std::string, std::string>> puts;
    for (uint64_t i = id; i < id + kTempsAhead; ++i) {
      puts.emplace_back(Key(i), temp_prefix_ + std::to_string(i));
    }
    if (db_->Write(puts, {}).ok()) {
      reserved_from_ = id;
      reserved_until_ = id + kTempsAhead - 1;
    }
  }
  return id;
}

Status TempRecords::Register(uint64_t file_id, const std::string& temp_path) {
  {
    MutexLock lock(&mu_);
    if (file_id >= reserved_from_ && file_id <= reserved_until_ && !temp_prefix_.empty() &&
        temp_prefix_ + std::to_string(file_id) == temp_path) {
      temps_[file_id] = temp_path;  // its record is on disk already
      return Status::Ok();
    }
  }
  CKPT_RETURN_IF_ERROR(db_->Put(Key(file_id), temp_path));
  MutexLock lock(&mu_);
  temps_[file_id] = temp_path;
  return Status::Ok();
}

Status TempRecords::Forget(uint64_t file_id) {
  Drop(file_id);
  return db_->Delete(Key(file_id));
}

void TempRecords::Note(uint64_t file_id, const std::string& temp_path) {
  MutexLock lock(&mu_);
  temps_[file_id] = temp_path;
}

void TempRecords::Drop(uint64_t file_id) {
  MutexLock lock(&mu_);
  temps_.erase(file_id);
}

void TempRecords::Move(const std::string& from, const std::string& to) {
  std::vector<std::pair<std::string, std::string>> puts;
  {
    MutexLock lock(&mu_);
    for (auto& [id, temp] : temps_) {
      std::optional<std::string> moved = path::Rebase(temp, from, to);
      if (!moved) continue;
      temp = std::move(*moved);
      puts.emplace_back(Key(id), temp);
    }
  }
  if (!puts.empty()) {
    Status st = db_->Write(puts, {});
    if (!st.ok()) spdlog::warn("journal: cannot update temp records: {}", st.ToString());
  }
}

}  // namespace ckptfs::store
