// StateDb: the node-local durable state of one daemon (RocksDB): the publish journal,
// temp-file records and checkpoint states. Everything in it can be rebuilt from the
// backing store except which work was still pending at a crash.
//
// Thread-safe (RocksDB is). Writes are synced (WAL fsync) so a record reaches disk
// before the action it guards.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace rocksdb {
class DB;
}

namespace ckptfs::store {

class StateDb {
 public:
  // Opens or creates the database in `dir` (created if missing). Fails with kBusy
  // when another daemon holds it.
  static Result<std::unique_ptr<StateDb>> Open(const std::string& dir);
  ~StateDb();
  StateDb(const StateDb&) = delete;
  StateDb& operator=(const StateDb&) = delete;

  Status Put(std::string_view key, std::string_view value);
  Status Delete(std::string_view key);
  // Applies the puts and deletes atomically.
  Status Write(const std::vector<std::pair<std::string, std::string>>& puts,
               const std::vector<std::string>& deletes);
  Result<std::string> Get(std::string_view key);  // kNotFound if absent
  // Calls `fn(key, value)` for every key starting with `prefix`, in key order.
  Status Scan(std::string_view prefix,
              const std::function<void(std::string_view, std::string_view)>& fn);

 private:
  explicit StateDb(rocksdb::DB* db);
  // After a failed write RocksDB must not be written again until it has recovered (its
  // WAL writer asserts otherwise): writes fail fast with the first error, and a Resume()
  // is tried at most once a second until it works.
  Status CheckWritable();
  Status NoteWrite(Status st);

  std::unique_ptr<rocksdb::DB> db_;
  // Serializes writes, so that no write is in flight while an earlier one is failing.
  std::mutex serial_mu_;
  std::mutex write_mu_;
  Status write_error_;  // GUARDED_BY(write_mu_)
  std::chrono::steady_clock::time_point last_resume_;  // GUARDED_BY(write_mu_)
};

}  // namespace ckptfs::store
