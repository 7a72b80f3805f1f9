// StateDb: the node-local durable state of one daemon (RocksDB): the publish journal,
// temp-file records and checkpoint states. Everything in it can be rebuilt from the
// backing store except which work was still pending at a crash.
//
// Thread-safe: writes are serialized, reads run concurrently. Writes are synced (WAL
// fsync) by default, so a record reaches disk before the action it guards. A caller whose
// record guards nothing on the backing store (recovery copes with its loss) may ask for
// WriteMode::kUnsynced: the record is appended to the WAL (a write(2), so it survives a
// crash of the daemon) but not fsynced, so a crash of the node may lose it; the next
// synced write makes it durable with itself. Each call site says why it may. A write that
// returns an error is not visible to reads (a restart may still find one whose record was
// written whole but not synced, as for any failed fsync).
//
// A full disk under the state dir is an expected condition, not a crash: writes are
// refused with kNoSpace while the state dir's file system has less than
// `min_free_bytes` free, before RocksDB itself runs out. If a RocksDB write fails
// anyway (another process took the space, an I/O error), writes fail fast with that
// error and the database is closed and reopened, at most once a second, until that
// works: RocksDB 7.8 cannot be trusted to resume in place after a WAL write error (its
// Resume() can keep the failed WAL writer, whose next append aborts the process in
// Debian's assert-enabled build). Every acknowledged write is in the synced WAL, so a
// reopen loses nothing. Both conditions clear by themselves once space is freed.
// RocksDB's own log goes to spdlog, not to a LOG file in the state dir (a LOG file
// that hit ENOSPC aborts the process on its next line, in the same way).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"

namespace rocksdb {
class DB;
}

namespace ckptfs::store {

// Whether a write waits for the WAL to reach the disk (see the class comment).
enum class WriteMode { kSynced, kUnsynced };

struct StateDbOptions {
  // Writes fail with kNoSpace while the state dir's file system has less free space
  // than this. The reserve leaves room for RocksDB's own work (memtable flushes,
  // MANIFEST updates, compactions), so those do not fail half-way.
  uint64_t min_free_bytes = 16ull << 20;
  // How long Open() waits while the state dir is locked by a process that is exiting:
  // a daemon killed with SIGKILL keeps RocksDB's lock until its last thread has finished
  // the I/O it was in (a direct write to a slow disk takes seconds), so a restart at once
  // (G11) would otherwise fail. A live holder fails Open() at once.
  std::chrono::milliseconds exiting_holder_wait{30000};
};

class StateDb {
 public:
  // Opens or creates the database in `dir` (created if missing). Fails with kBusy, at
  // once and naming its pid, when another live process (or this one) holds it; waits up
  // to `options.exiting_holder_wait`, with a log line naming the pid, when the holder is
  // exiting (killed, a zombie, or with SIGKILL pending).
  static Result<std::unique_ptr<StateDb>> Open(const std::string& dir,
                                               const StateDbOptions& options = {});
  ~StateDb();
  StateDb(const StateDb&) = delete;
  StateDb& operator=(const StateDb&) = delete;

  // kNoSpace when the state dir's disk is (nearly) full; see above.
  Status Put(std::string_view key, std::string_view value, WriteMode mode = WriteMode::kSynced);
  Status Delete(std::string_view key, WriteMode mode = WriteMode::kSynced);
  // Applies the puts and deletes atomically.
  Status Write(const std::vector<std::pair<std::string, std::string>>& puts,
               const std::vector<std::string>& deletes, WriteMode mode = WriteMode::kSynced);

  // Writes so far, all and synced ones (for /.ckptfs/stats: syncs per file saved).
  uint64_t writes() const { return writes_.load(std::memory_order_relaxed); }
  uint64_t synced_writes() const { return synced_writes_.load(std::memory_order_relaxed); }
  // Memory RocksDB fills up to budgets of its own: its memtables (write_buffer_size each,
  // flushed when full) and its block cache. A leak check counts it apart, as the daemon's
  // other budgeted memory (docs/RELIABILITY.md, the leak bound).
  uint64_t BudgetedMemory();
  // Reads work on a full disk; they fail (kIo) only while a reopen after a failed
  // write has not succeeded yet.
  Result<std::string> Get(std::string_view key);  // kNotFound if absent
  // Calls `fn(key, value)` for every key starting with `prefix`, in key order. `fn`
  // must not write to this StateDb.
  Status Scan(std::string_view prefix,
              const std::function<void(std::string_view, std::string_view)>& fn);

  // Free bytes on the state dir's file system, as the reserve check sees them.
  Result<uint64_t> FreeBytes() const;

 private:
  StateDb(std::unique_ptr<rocksdb::DB> db, std::string dir, const StateDbOptions& options);
  // Under write_mu_: the reason a write must not be tried now, or Ok. Checks the free
  // space; after a failed write, reopens the database (at most once a second).
  Status CheckWritable() REQUIRES(write_mu_);
  Status Reopen() REQUIRES(write_mu_);
  // Under write_mu_: runs one RocksDB write; a failure is kept in write_error_.
  Status RunWrite(WriteMode mode, const std::function<Status(rocksdb::DB*)>& write)
      REQUIRES(write_mu_);

  const std::string dir_;
  const StateDbOptions options_;
  // Lock order: write_mu_, then db_mu_.
  // Serializes writes (no write is in flight while an earlier one is failing) and
  // guards the members below it.
  Mutex write_mu_;
  Status write_error_ GUARDED_BY(write_mu_);
  std::chrono::steady_clock::time_point last_reopen_ GUARDED_BY(write_mu_);
  bool low_space_ GUARDED_BY(write_mu_) = false;
  // Shared by every RocksDB call, exclusive to close and reopen the database.
  SharedMutex db_mu_;
  std::unique_ptr<rocksdb::DB> db_ GUARDED_BY(db_mu_);  // null while a reopen failed
  std::atomic<uint64_t> writes_{0};
  std::atomic<uint64_t> synced_writes_{0};
};

}  // namespace ckptfs::store
