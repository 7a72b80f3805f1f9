#include "store/primitives/state_db.h"

#include <fcntl.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/listener.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "common/unique_fd.h"

namespace ckptfs::store {
namespace {

Status FromRocks(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return Status::Ok();
  std::string msg = std::string(what) + ": " + s.ToString();
  if (s.IsNotFound()) return Status(Code::kNotFound, msg);
  if (s.IsBusy() || s.IsTimedOut()) return Status(Code::kBusy, msg);
  if (s.IsNoSpace()) return Status(Code::kNoSpace, msg);
  if (s.IsCorruption()) return Status(Code::kCorrupt, msg);
  // RocksDB keeps no errno, only its text.
  if (s.IsIOError() && (msg.find(std::strerror(EMFILE)) != std::string::npos ||
                        msg.find(std::strerror(ENFILE)) != std::string::npos)) {
    return Status(Code::kTooManyOpenFiles, msg);
  }
  if (s.IsIOError() && s.ToString().find("lock") != std::string::npos) {
    return Status(Code::kBusy, msg + " (is another ckptfs using this --state-dir?)");
  }
  return Status(Code::kIo, msg);
}

rocksdb::WriteOptions SyncWrite(WriteMode mode) {
  rocksdb::WriteOptions w;
  w.sync = mode == WriteMode::kSynced;
  return w;
}

// RocksDB's info log, forwarded to spdlog. RocksDB's default logger writes a LOG file
// in the state dir; once a line of it fails (ENOSPC) the next line trips an assertion
// in WritableFileWriter (Debian builds RocksDB with assertions on), which kills the
// daemon exactly when the state dir's disk is full.
//
// Lines logged while DB::Open runs are held back: if the open fails, its error reaches
// the caller (and the daemon's one-line startup error) anyway, so they go to debug.
class SpdlogRocksLogger : public rocksdb::Logger {
 public:
  SpdlogRocksLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL) {}

  void Logv(const char* format, va_list ap) override {
    Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap);
  }

  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    if (level < GetInfoLogLevel() || level == rocksdb::InfoLogLevel::HEADER_LEVEL) return;
    char buf[1024];
    int n = std::vsnprintf(buf, sizeof(buf), format, ap);
    if (n < 0) return;
    size_t len = std::min(static_cast<size_t>(n), sizeof(buf) - 1);
    while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == '\r')) --len;
    {
      MutexLock lock(&mu_);
      if (holding_) {
        held_.emplace_back(level, std::string(buf, len));
        return;
      }
    }
    Emit(level, std::string_view(buf, len));
  }

  void Hold() {
    MutexLock lock(&mu_);
    holding_ = true;
  }
  // Ends Hold(): the held lines are logged as they came, or at debug if `!opened`.
  void Release(bool opened) {
    std::vector<std::pair<rocksdb::InfoLogLevel, std::string>> held;
    {
      MutexLock lock(&mu_);
      holding_ = false;
      held.swap(held_);
    }
    for (const auto& [level, line] : held) {
      Emit(opened ? level : rocksdb::InfoLogLevel::DEBUG_LEVEL, line);
    }
  }

 private:
  static void Emit(rocksdb::InfoLogLevel level, std::string_view line) {
    if (level >= rocksdb::InfoLogLevel::ERROR_LEVEL) {
      spdlog::error("state db (rocksdb): {}", line);
    } else if (level == rocksdb::InfoLogLevel::WARN_LEVEL) {
      spdlog::warn("state db (rocksdb): {}", line);
    } else {
      spdlog::debug("state db (rocksdb): {}", line);
    }
  }

  Mutex mu_;
  bool holding_ GUARDED_BY(mu_) = false;
  std::vector<std::pair<rocksdb::InfoLogLevel, std::string>> held_;  // GUARDED_BY(mu_)
};

// Turns RocksDB's own recovery from a background error off. It is the same in-place
// resume that can keep a failed WAL writer (see state_db.h), and it waits for free
// space of a whole memtable per column family. StateDb reopens the database instead.
class NoAutoRecovery : public rocksdb::EventListener {
 public:
  const char* Name() const override { return "ckptfs.NoAutoRecovery"; }
  void OnErrorRecoveryBegin(rocksdb::BackgroundErrorReason, rocksdb::Status,
                            bool* auto_recovery) override {
    *auto_recovery = false;
  }
};

std::string MiBString(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

rocksdb::Options DbOptions(std::shared_ptr<rocksdb::Logger> logger) {
  rocksdb::Options options;
  options.create_if_missing = true;
  options.max_open_files = 64;
  options.max_background_jobs = 1;
  // Small memtables: a flush (which opening after an error starts with) then needs far
  // less disk than StateDbOptions::min_free_bytes keeps in reserve. And the daemon's memory
  // stays flat: a memtable fills with every record written (about 11 KiB per 2-rank DCP
  // save, mostly removals) until it is flushed, so 8 MiB read as a leak of 10 KiB per save
  // for 750 saves (issue 41's bound: RSS after 1,000 saves within 10 % of after 50).
  options.write_buffer_size = 2 << 20;
  // Every write is in the synced WAL: closing need not flush, and must not try to
  // write more to a disk that just failed.
  options.avoid_flush_during_shutdown = true;
  options.listeners.push_back(std::make_shared<NoAutoRecovery>());
  options.info_log = std::move(logger);
  options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  return options;
}

Result<std::unique_ptr<rocksdb::DB>> OpenRocks(const std::string& dir) {
  rocksdb::DB* db = nullptr;
  auto logger = std::make_shared<SpdlogRocksLogger>();
  logger->Hold();
  rocksdb::Status s = rocksdb::DB::Open(DbOptions(logger), dir, &db);
  logger->Release(s.ok());
  CKPT_RETURN_IF_ERROR(FromRocks(s, "open state db " + dir));
  return std::unique_ptr<rocksdb::DB>(db);
}

// False when the process is (nearly) out of file descriptors: closing the database then
// would leave it closed, since opening it again needs about as many as it held.
bool HaveSpareFds(const std::string& dir) {
  constexpr int kSpare = 16;
  std::vector<UniqueFd> probe;
  for (int i = 0; i < kSpare; ++i) {
    probe.emplace_back(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!probe.back().valid()) return false;
  }
  return true;
}

Status Unavailable(const std::string& dir) {
  return Status(Code::kIo, "state db " + dir + " is closed after a failed write; reopening");
}

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// The pid that /proc/locks lists as holding a lock on `path` (RocksDB's LOCK is a POSIX
// fcntl lock): nullopt when none is listed, 0 when the holder is not visible from this pid
// namespace. /proc/locks rather than F_GETLK: opening and closing the file here would drop
// any lock this process holds on it (POSIX locks go with the first close).
std::optional<pid_t> LockHolder(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  char want[64];
  std::snprintf(want, sizeof(want), "%02x:%02x:%lu", major(st.st_dev), minor(st.st_dev),
                static_cast<unsigned long>(st.st_ino));
  std::istringstream locks(ReadSmallFile("/proc/locks"));
  std::string line;
  while (std::getline(locks, line)) {
    // "1: POSIX  ADVISORY  WRITE 1234 fd:00:5678 0 EOF"; waiters have "->" after the id.
    std::istringstream in(line);
    std::string id, type, mode, access, dev;
    long pid = 0;
    if (!(in >> id >> type) || type == "->") continue;
    if (!(in >> mode >> access >> pid >> dev)) continue;
    if (dev == want) return static_cast<pid_t>(pid < 0 ? 0 : pid);
  }
  return std::nullopt;
}

enum class Holder { kGone, kExiting, kLive };

// Whether `pid` is on its way out. A process killed while one of its threads waits for
// uninterruptible I/O lives on until that returns: its leader is a zombie (or has
// PF_EXITING set) and the threads still in the kernel have SIGKILL pending.
Holder ProbeHolder(pid_t pid) {
  const std::string base = "/proc/" + std::to_string(pid);
  std::string stat = ReadSmallFile(base + "/stat");
  size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return Holder::kGone;
  // After "(comm) ": state ppid pgrp session tty_nr tpgid flags ...
  std::istringstream fields(stat.substr(paren + 2));
  char state = 0;
  long skip = 0;
  unsigned long flags = 0;
  fields >> state >> skip >> skip >> skip >> skip >> skip >> flags;
  constexpr unsigned long kPfExiting = 0x4;
  if (state == 'Z' || state == 'X' || state == 'x' || (flags & kPfExiting) != 0) {
    return Holder::kExiting;
  }
  constexpr unsigned long long kSigKillBit = 1ull << (SIGKILL - 1);
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator(base + "/task", ec)) {
    std::istringstream status(ReadSmallFile(task.path().string() + "/status"));
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("SigPnd:", 0) != 0 && line.rfind("ShdPnd:", 0) != 0) continue;
      unsigned long long mask = std::strtoull(line.c_str() + 7, nullptr, 16);
      if ((mask & kSigKillBit) != 0) return Holder::kExiting;
    }
  }
  if (::kill(pid, 0) != 0 && errno == ESRCH) return Holder::kGone;
  return Holder::kLive;
}

// Opens the database, waiting up to `wait` while its lock is held by an exiting process.
Result<std::unique_ptr<rocksdb::DB>> OpenRocksWaitingForExitingHolder(
    const std::string& dir, std::chrono::milliseconds wait) {
  const auto start = std::chrono::steady_clock::now();
  const std::string lock_path = dir + "/LOCK";
  pid_t waited_for = 0;
  for (int free_tries = 0;;) {
    Result<std::unique_ptr<rocksdb::DB>> db = OpenRocks(dir);
    if (db.ok() || db.status().code() != Code::kBusy) {
      if (db.ok() && waited_for != 0) {
        spdlog::info(
            "state dir {}: pid {} released it after {:.1f} s", dir, waited_for,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      return db;
    }
    std::optional<pid_t> pid = LockHolder(lock_path);
    // Not listed: released since (or held where /proc/locks cannot tell); a few tries.
    if (!pid.has_value() && ++free_tries < 5) continue;
    Holder holder =
        !pid.has_value() || *pid == 0 || *pid == ::getpid() ? Holder::kLive : ProbeHolder(*pid);
    if (holder == Holder::kLive) {
      if (!pid.has_value() || *pid == 0) return db.status();
      return Status(Code::kBusy, "open state db " + dir + ": its LOCK is held by pid " +
                                     std::to_string(*pid) +
                                     " (is another ckptfs using this --state-dir?)");
    }
    auto waited = std::chrono::steady_clock::now() - start;
    if (waited >= wait) {
      return Status(
          Code::kBusy,
          "open state db " + dir + ": its LOCK is still held by pid " + std::to_string(*pid) +
              ", which is exiting, after " +
              std::to_string(std::chrono::duration_cast<std::chrono::seconds>(waited).count()) +
              " s (a killed ckptfs stuck in I/O?)");
    }
    if (holder == Holder::kExiting && waited_for != *pid) {
      waited_for = *pid;
      spdlog::warn(
          "state dir {}: its lock is still held by pid {}, which is exiting (a "
          "killed ckptfs finishing its I/O); waiting up to {} s for it",
          dir, *pid, std::chrono::duration_cast<std::chrono::seconds>(wait).count());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(holder == Holder::kGone ? 5 : 50));
  }
}

}  // namespace

StateDb::StateDb(std::unique_ptr<rocksdb::DB> db, std::string dir,
                 const StateDbOptions& options)
    : dir_(std::move(dir)), options_(options), db_(std::move(db)) {}
StateDb::~StateDb() = default;

Result<std::unique_ptr<StateDb>> StateDb::Open(const std::string& dir,
                                               const StateDbOptions& options) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::FromErrno(ec.value(), "create state dir " + dir);
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<rocksdb::DB> db,
                        OpenRocksWaitingForExitingHolder(dir, options.exiting_holder_wait));
  std::unique_ptr<StateDb> state(new StateDb(std::move(db), dir, options));
  Result<uint64_t> free_bytes = state->FreeBytes();
  if (free_bytes.ok() && *free_bytes < options.min_free_bytes) {
    spdlog::warn("state db: only {} free on {} ({} kept in reserve): creating files will "
                 "fail with ENOSPC until space is freed",
                 MiBString(*free_bytes), dir, MiBString(options.min_free_bytes));
  }
  return state;
}

Result<uint64_t> StateDb::FreeBytes() const {
  struct statvfs st;
  if (::statvfs(dir_.c_str(), &st) != 0) return Status::FromErrno(errno, "statvfs " + dir_);
  // Root may use the blocks a file system reserves for it; others may not.
  uint64_t blocks = ::geteuid() == 0 ? st.f_bfree : st.f_bavail;
  return blocks * st.f_frsize;
}

Status StateDb::CheckWritable() {
  if (options_.min_free_bytes > 0) {
    Result<uint64_t> free_bytes = FreeBytes();
    // A failing statvfs is not a reason to refuse: RocksDB reports real errors itself.
    if (free_bytes.ok() && *free_bytes < options_.min_free_bytes) {
      std::string msg = "state dir " + dir_ + ": No space left on device (" +
                        MiBString(*free_bytes) + " free, " +
                        MiBString(options_.min_free_bytes) + " kept in reserve)";
      if (!low_space_) {
        spdlog::error("state db: {}; refusing writes until space is freed", msg);
        low_space_ = true;
      }
      return Status(Code::kNoSpace, std::move(msg));
    }
    if (free_bytes.ok() && low_space_) {
      spdlog::warn("state db: {} free on {} again; writes resume", MiBString(*free_bytes),
                   dir_);
      low_space_ = false;
      last_reopen_ = {};  // space is back: a failed database may reopen right away
    }
  }
  if (write_error_.ok()) return Status::Ok();
  auto now = std::chrono::steady_clock::now();
  if (now - last_reopen_ < std::chrono::seconds(1)) return write_error_;
  last_reopen_ = now;
  return Reopen();
}

Status StateDb::Reopen() {
  if (!HaveSpareFds(dir_)) return write_error_;
  WriterLock lock(&db_mu_);
  db_.reset();  // closes: RocksDB allows one open instance per directory
  Result<std::unique_ptr<rocksdb::DB>> db = OpenRocks(dir_);
  if (!db.ok()) {
    spdlog::debug("state db: reopen: {}", db.status().ToString());
    return write_error_;
  }
  db_ = std::move(db).value();
  spdlog::warn("state db: reopened, writable again after: {}", write_error_.ToString());
  write_error_ = Status::Ok();
  return Status::Ok();
}

Status StateDb::RunWrite(WriteMode mode, const std::function<Status(rocksdb::DB*)>& write) {
  CKPT_RETURN_IF_ERROR(CheckWritable());
  writes_.fetch_add(1, std::memory_order_relaxed);
  if (mode == WriteMode::kSynced) synced_writes_.fetch_add(1, std::memory_order_relaxed);
  Status st;
  {
    ReaderLock lock(&db_mu_);
    st = db_ ? write(db_.get()) : Unavailable(dir_);
  }
  if (!st.ok() && write_error_.ok()) {
    spdlog::error("state db: write failed, refusing writes until it is reopened: {}",
                  st.ToString());
    write_error_ = st;
    last_reopen_ = std::chrono::steady_clock::now();
  }
  return st;
}

Status StateDb::Put(std::string_view key, std::string_view value, WriteMode mode) {
  MutexLock lock(&write_mu_);
  return RunWrite(mode, [&](rocksdb::DB* db) {
    return FromRocks(db->Put(SyncWrite(mode), rocksdb::Slice(key.data(), key.size()),
                             rocksdb::Slice(value.data(), value.size())),
                     "state db put");
  });
}

Status StateDb::Delete(std::string_view key, WriteMode mode) {
  MutexLock lock(&write_mu_);
  return RunWrite(mode, [&](rocksdb::DB* db) {
    return FromRocks(db->Delete(SyncWrite(mode), rocksdb::Slice(key.data(), key.size())),
                     "state db delete");
  });
}

Status StateDb::Write(const std::vector<std::pair<std::string, std::string>>& puts,
                      const std::vector<std::string>& deletes, WriteMode mode) {
  rocksdb::WriteBatch batch;
  for (const auto& [k, v] : puts) batch.Put(k, v);
  for (const auto& k : deletes) batch.Delete(k);
  MutexLock lock(&write_mu_);
  return RunWrite(mode, [&](rocksdb::DB* db) {
    return FromRocks(db->Write(SyncWrite(mode), &batch), "state db write");
  });
}

uint64_t StateDb::BudgetedMemory() {
  ReaderLock lock(&db_mu_);
  if (!db_) return 0;
  uint64_t memtables = 0, block_cache = 0;
  if (!db_->GetIntProperty(rocksdb::DB::Properties::kCurSizeAllMemTables, &memtables)) {
    memtables = 0;
  }
  if (!db_->GetIntProperty(rocksdb::DB::Properties::kBlockCacheUsage, &block_cache)) {
    block_cache = 0;
  }
  return memtables + block_cache;
}

Result<std::string> StateDb::Get(std::string_view key) {
  std::string value;
  ReaderLock lock(&db_mu_);
  if (!db_) return Unavailable(dir_);
  rocksdb::Status s =
      db_->Get(rocksdb::ReadOptions(), rocksdb::Slice(key.data(), key.size()), &value);
  CKPT_RETURN_IF_ERROR(FromRocks(s, "state db get"));
  return value;
}

Status StateDb::Scan(std::string_view prefix,
                     const std::function<void(std::string_view, std::string_view)>& fn) {
  ReaderLock lock(&db_mu_);
  if (!db_) return Unavailable(dir_);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  rocksdb::Slice p(prefix.data(), prefix.size());
  for (it->Seek(p); it->Valid() && it->key().starts_with(p); it->Next()) {
    fn(std::string_view(it->key().data(), it->key().size()),
       std::string_view(it->value().data(), it->value().size()));
  }
  return FromRocks(it->status(), "state db scan");
}

}  // namespace ckptfs::store
