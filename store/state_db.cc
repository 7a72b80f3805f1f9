#include "store/state_db.h"

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <spdlog/spdlog.h>

#include <filesystem>

namespace ckptfs::store {
namespace {

Status FromRocks(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return Status::Ok();
  std::string msg = std::string(what) + ": " + s.ToString();
  if (s.IsNotFound()) return Status(Code::kNotFound, msg);
  if (s.IsBusy() || s.IsTimedOut()) return Status(Code::kBusy, msg);
  if (s.IsNoSpace()) return Status(Code::kNoSpace, msg);
  if (s.IsCorruption()) return Status(Code::kCorrupt, msg);
  if (s.IsIOError() && s.ToString().find("lock") != std::string::npos) {
    return Status(Code::kBusy, msg + " (is another ckptfs using this --state-dir?)");
  }
  return Status(Code::kIo, msg);
}

rocksdb::WriteOptions SyncWrite() {
  rocksdb::WriteOptions w;
  w.sync = true;
  return w;
}

}  // namespace

StateDb::StateDb(rocksdb::DB* db) : db_(db) {}
StateDb::~StateDb() = default;

Result<std::unique_ptr<StateDb>> StateDb::Open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::FromErrno(ec.value(), "create state dir " + dir);
  rocksdb::Options options;
  options.create_if_missing = true;
  options.max_open_files = 64;
  options.keep_log_file_num = 2;
  options.max_background_jobs = 1;
  options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, dir, &db);
  CKPT_RETURN_IF_ERROR(FromRocks(s, "open state db " + dir));
  return std::unique_ptr<StateDb>(new StateDb(db));
}

Status StateDb::CheckWritable() {
  std::lock_guard lock(write_mu_);
  if (write_error_.ok()) return Status::Ok();
  auto now = std::chrono::steady_clock::now();
  if (now - last_resume_ < std::chrono::seconds(1)) return write_error_;
  last_resume_ = now;
  rocksdb::Status s = db_->Resume();
  if (!s.ok()) return write_error_;
  spdlog::info("state db: writable again after: {}", write_error_.ToString());
  write_error_ = Status::Ok();
  return Status::Ok();
}

Status StateDb::NoteWrite(Status st) {
  if (!st.ok()) {
    std::lock_guard lock(write_mu_);
    if (write_error_.ok()) {
      spdlog::error("state db: write failed, refusing writes until it recovers: {}",
                    st.ToString());
      write_error_ = st;
      last_resume_ = std::chrono::steady_clock::now();
    }
  }
  return st;
}

Status StateDb::Put(std::string_view key, std::string_view value) {
  std::lock_guard serial(serial_mu_);
  CKPT_RETURN_IF_ERROR(CheckWritable());
  return NoteWrite(FromRocks(db_->Put(SyncWrite(), rocksdb::Slice(key.data(), key.size()),
                                      rocksdb::Slice(value.data(), value.size())),
                             "state db put"));
}

Status StateDb::Delete(std::string_view key) {
  std::lock_guard serial(serial_mu_);
  CKPT_RETURN_IF_ERROR(CheckWritable());
  return NoteWrite(FromRocks(db_->Delete(SyncWrite(), rocksdb::Slice(key.data(), key.size())),
                             "state db delete"));
}

Status StateDb::Write(const std::vector<std::pair<std::string, std::string>>& puts,
                      const std::vector<std::string>& deletes) {
  rocksdb::WriteBatch batch;
  for (const auto& [k, v] : puts) batch.Put(k, v);
  for (const auto& k : deletes) batch.Delete(k);
  std::lock_guard serial(serial_mu_);
  CKPT_RETURN_IF_ERROR(CheckWritable());
  return NoteWrite(FromRocks(db_->Write(SyncWrite(), &batch), "state db write"));
}

Result<std::string> StateDb::Get(std::string_view key) {
  std::string value;
  rocksdb::Status s =
      db_->Get(rocksdb::ReadOptions(), rocksdb::Slice(key.data(), key.size()), &value);
  CKPT_RETURN_IF_ERROR(FromRocks(s, "state db get"));
  return value;
}

Status StateDb::Scan(std::string_view prefix,
                     const std::function<void(std::string_view, std::string_view)>& fn) {
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  rocksdb::Slice p(prefix.data(), prefix.size());
  for (it->Seek(p); it->Valid() && it->key().starts_with(p); it->Next()) {
    fn(std::string_view(it->key().data(), it->key().size()),
       std::string_view(it->value().data(), it->value().size()));
  }
  return FromRocks(it->status(), "state db scan");
}

}  // namespace ckptfs::store
