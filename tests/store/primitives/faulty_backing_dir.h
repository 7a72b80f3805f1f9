// FaultyBackingDir: a store::BackingDir for tests that fails chosen calls and can
// "crash", after RocksDB's fault-injecting file system.
//
// Faults. Each of PWrite, Fsync, Rename and SyncParent is counted from 1 over the life
// of the object; FailNth*() makes call number n fail with an errno (ENOSPC, EIO...).
// A hook can instead decide per call, from the call's arguments. The ownership and
// special-file calls (Chown, Fchown, Link, Mknod, Fallocate) share one hook that gets
// the call's name ("chown", "fchown", "link", "mknod", "fallocate") and its path (the
// new name for Link, empty for the fd calls); so do the fd calls a rewrite makes
// (Fchmod, Ftruncate, CopyFileRange: "fchmod", "ftruncate", "copy_file_range"). The
// lookups (Stat, OpenFile, List) have their own hook, SetLookupHook, that gets "stat",
// "open" or "list" and the path. A hook runs before any
// lock of this class is taken, so it may block on a latch to order a race
// deterministically.
//
// Crash model. A file written through PWrite since its last successful Fsync holds
// unsynced data. SimulateCrash() "forgets" it: each such file is truncated back to the
// size it had at its last Fsync (or just before its first unsynced write). Then the
// directory is switched off, as if the node had died: every later call fails with EIO
// and changes nothing. Limits, stated so nobody relies on more: an overwrite inside the
// synced size is not rolled back, and directory entries (renames, unlinks, mkdirs) are
// treated as durable at once.
//
// ScopedTempDir: a fresh directory, removed with everything under it on destruction.
// Placed on /dev/shm when it exists, so that fsync-heavy tests stay fast;
// CKPTFS_TEST_TMPDIR overrides the location.
//
// Thread-safe.
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {

class ScopedTempDir {
 public:
  explicit ScopedTempDir(const std::string& prefix = "ckptfs-test") {
    std::string tmpl = (Root() / (prefix + ".XXXXXX")).string();
    char* made = ::mkdtemp(tmpl.data());
    if (made == nullptr) std::abort();
    path_ = std::filesystem::canonical(made).string();
  }
  ~ScopedTempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);  // never follows symlinks
  }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::string& path() const { return path_; }
  // `path()/rel`, created as a directory (with parents) when `mkdir`.
  std::string Sub(const std::string& rel, bool mkdir = true) const {
    std::string p = path_ + "/" + rel;
    if (mkdir) std::filesystem::create_directories(p);
    return p;
  }

 private:
  static std::filesystem::path Root() {
    if (const char* env = std::getenv("CKPTFS_TEST_TMPDIR"); env != nullptr && *env) return env;
    std::error_code ec;
    if (std::filesystem::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0) {
      return "/dev/shm";
    }
    return std::filesystem::temp_directory_path();
  }

  std::string path_;
};

class FaultyBackingDir : public BackingDir {
 public:
  // Returns 0 to let the call proceed, or an errno to fail it.
  using PWriteHook = std::function<int(int fd, off_t offset, size_t len)>;
  using FsyncHook = std::function<int(int fd)>;
  using RenameHook = std::function<int(const std::string& from, const std::string& to)>;
  using PathHook = std::function<int(const std::string& path)>;
  using PosixHook = std::function<int(const std::string& op, const std::string& path)>;

  static std::unique_ptr<FaultyBackingDir> Open(const std::string& root_path) {
    int fd = ::open(root_path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return nullptr;
    return std::unique_ptr<FaultyBackingDir>(new FaultyBackingDir(root_path, UniqueFd(fd)));
  }

  // Call number `n` (1-based, counted over this object's life) fails with `err`. A
  // failing PWrite first writes `written_first` bytes, as a short write before ENOSPC.
  void FailNthPWrite(uint64_t n, int err, size_t written_first = 0) {
    std::lock_guard lock(fault_mu_);
    pwrite_faults_[n] = {err, written_first};
  }
  void FailNthFsync(uint64_t n, int err) { SetFault(&fsync_faults_, n, err); }
  void FailNthRename(uint64_t n, int err) { SetFault(&rename_faults_, n, err); }
  void FailNthSyncParent(uint64_t n, int err) { SetFault(&sync_parent_faults_, n, err); }

  void SetPWriteHook(PWriteHook hook) {
    std::lock_guard l(fault_mu_);
    pwrite_hook_ = std::move(hook);
  }
  void SetFsyncHook(FsyncHook hook) {
    std::lock_guard l(fault_mu_);
    fsync_hook_ = std::move(hook);
  }
  void SetRenameHook(RenameHook hook) {
    std::lock_guard l(fault_mu_);
    rename_hook_ = std::move(hook);
  }
  void SetSyncParentHook(PathHook hook) {
    std::lock_guard l(fault_mu_);
    sync_parent_hook_ = std::move(hook);
  }
  void SetPosixHook(PosixHook hook) {
    std::lock_guard l(fault_mu_);
    posix_hook_ = std::move(hook);
  }
  void SetLookupHook(PosixHook hook) {
    std::lock_guard l(fault_mu_);
    lookup_hook_ = std::move(hook);
  }

  uint64_t pwrite_calls() const { return pwrite_calls_.load(); }
  uint64_t fsync_calls() const { return fsync_calls_.load(); }
  uint64_t rename_calls() const { return rename_calls_.load(); }
  uint64_t sync_parent_calls() const { return sync_parent_calls_.load(); }
  uint64_t unlink_calls() const { return unlink_calls_.load(); }
  uint64_t posix_calls() const { return posix_calls_.load(); }
  uint64_t faults_injected() const { return faults_injected_.load(); }

  // True if the file behind `fd` / at backing-relative `path` holds unsynced data.
  bool HasUnsyncedData(int fd) const {
    struct stat st;
    if (::fstat(fd, &st) != 0) return false;
    std::lock_guard lock(state_mu_);
    return unsynced_.count({st.st_dev, st.st_ino}) > 0;
  }
  bool HasUnsyncedData(const std::string& path) const {
    struct stat st;
    if (::fstatat(root_fd(), path.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return false;
    std::lock_guard lock(state_mu_);
    return unsynced_.count({st.st_dev, st.st_ino}) > 0;
  }
  // The size a file would keep after a crash now: its synced size if it holds unsynced
  // data, else nullopt (all of it is durable).
  std::optional<off_t> SizeAfterCrash(dev_t dev, ino_t ino) const {
    std::lock_guard lock(state_mu_);
    auto it = unsynced_.find({dev, ino});
    if (it == unsynced_.end()) return std::nullopt;
    return it->second.synced_size;
  }
  size_t unsynced_files() const {
    std::lock_guard lock(state_mu_);
    return unsynced_.size();
  }

  // Forgets every unsynced byte, then fails every later call with EIO.
  void SimulateCrash() {
    std::unique_lock crash(crash_mu_);  // waits for calls in progress
    crashed_ = true;
    std::lock_guard lock(state_mu_);
    for (auto& [key, file] : unsynced_) {
      if (::ftruncate(file.fd.get(), file.synced_size) != 0) std::abort();
    }
    unsynced_.clear();
  }
  bool crashed() const {
    std::shared_lock crash(crash_mu_);
    return crashed_;
  }

  // ------------------------------------------------------------ BackingDir overrides

  Result<UniqueFd> OpenFile(const std::string& path, int flags, mode_t mode = 0) override {
    int err = LookupHookErr("open", path);
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("open " + path);
    if (err != 0) return Injected(err, "open " + path);
    return BackingDir::OpenFile(path, flags, mode);
  }
  Result<struct stat> Stat(const std::string& path) override {
    int err = LookupHookErr("stat", path);
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("stat " + path);
    if (err != 0) return Injected(err, "stat " + path);
    return BackingDir::Stat(path);
  }
  Status Mkdir(const std::string& path, mode_t mode) override {
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("mkdir " + path);
    return BackingDir::Mkdir(path, mode);
  }
  Status Rmdir(const std::string& path) override {
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("rmdir " + path);
    return BackingDir::Rmdir(path);
  }
  Status Unlink(const std::string& path) override {
    std::shared_lock crash(crash_mu_);
    unlink_calls_.fetch_add(1);
    if (crashed_) return Dead("unlink " + path);
    return BackingDir::Unlink(path);
  }
  Status Rename(const std::string& from, const std::string& to, unsigned flags = 0) override {
    uint64_t n = rename_calls_.fetch_add(1) + 1;
    int err = Decide(&rename_faults_, n);
    if (err == 0) {
      RenameHook hook = Copy(rename_hook_);
      if (hook) err = hook(from, to);
    }
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("rename " + from);
    if (err != 0) return Injected(err, "rename " + from + " -> " + to);
    return BackingDir::Rename(from, to, flags);
  }
  Status Symlink(const std::string& target, const std::string& path) override {
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("symlink " + path);
    return BackingDir::Symlink(target, path);
  }
  Result<std::string> Readlink(const std::string& path) override {
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("readlink " + path);
    return BackingDir::Readlink(path);
  }
  Status Chmod(const std::string& path, mode_t mode) override {
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("chmod " + path);
    return BackingDir::Chmod(path, mode);
  }
  Status Utimens(const std::string& path, const struct timespec times[2]) override {
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("utimens " + path);
    return BackingDir::Utimens(path, times);
  }
  Status Truncate(const std::string& path, off_t size) override {
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("truncate " + path);
    return BackingDir::Truncate(path, size);
  }
  Status Chown(const std::string& path, uid_t uid, gid_t gid) override {
    int err = PosixHookErr("chown", path);
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("chown " + path);
    if (err != 0) return Injected(err, "chown " + path);
    return BackingDir::Chown(path, uid, gid);
  }
  Status Link(const std::string& from, const std::string& to) override {
    int err = PosixHookErr("link", to);
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("link " + to);
    if (err != 0) return Injected(err, "link " + from + " -> " + to);
    return BackingDir::Link(from, to);
  }
  Status Mknod(const std::string& path, mode_t mode, dev_t rdev) override {
    int err = PosixHookErr("mknod", path);
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("mknod " + path);
    if (err != 0) return Injected(err, "mknod " + path);
    return BackingDir::Mknod(path, mode, rdev);
  }
  Status Fchown(int fd, uid_t uid, gid_t gid) override {
    int err = PosixHookErr("fchown", "");
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("fchown");
    if (err != 0) return Injected(err, "fchown");
    return BackingDir::Fchown(fd, uid, gid);
  }
  Status Fallocate(int fd, int mode, off_t offset, off_t len) override {
    int err = PosixHookErr("fallocate", "");
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("fallocate");
    if (err != 0) return Injected(err, "fallocate");
    return BackingDir::Fallocate(fd, mode, offset, len);
  }
  Status Fchmod(int fd, mode_t mode) override {
    int err = PosixHookErr("fchmod", "");
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("fchmod");
    if (err != 0) return Injected(err, "fchmod");
    return BackingDir::Fchmod(fd, mode);
  }
  Status Ftruncate(int fd, off_t size) override {
    int err = PosixHookErr("ftruncate", "");
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("ftruncate");
    if (err != 0) return Injected(err, "ftruncate");
    return BackingDir::Ftruncate(fd, size);
  }
  Status CopyFileRange(int in_fd, int out_fd, uint64_t len) override {
    int err = PosixHookErr("copy_file_range", "");
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("copy_file_range");
    if (err != 0) return Injected(err, "copy_file_range");
    NoteWrite(out_fd);
    return BackingDir::CopyFileRange(in_fd, out_fd, len);
  }
  Result<struct stat> Fstat(int fd) override {
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("fstat");
    return BackingDir::Fstat(fd);
  }
  Result<std::vector<DirEntry>> List(const std::string& path) override {
    int err = LookupHookErr("list", path);
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("list " + path);
    if (err != 0) return Injected(err, "list " + path);
    return BackingDir::List(path);
  }
  Result<struct statvfs> StatFs() override {
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("statfs");
    return BackingDir::StatFs();
  }
  Status SyncParent(const std::string& path) override {
    uint64_t n = sync_parent_calls_.fetch_add(1) + 1;
    int err = Decide(&sync_parent_faults_, n);
    if (err == 0) {
      PathHook hook = Copy(sync_parent_hook_);
      if (hook) err = hook(path);
    }
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("fsync parent of " + path);
    if (err != 0) return Injected(err, "fsync parent of " + path);
    return BackingDir::SyncParent(path);
  }
  Status PWrite(int fd, const void* buf, size_t len, off_t offset) override {
    uint64_t n = pwrite_calls_.fetch_add(1) + 1;
    int err = 0;
    size_t written_first = 0;
    {
      std::lock_guard lock(fault_mu_);
      auto it = pwrite_faults_.find(n);
      if (it != pwrite_faults_.end()) {
        err = it->second.first;
        written_first = std::min(it->second.second, len);
      }
    }
    if (err == 0) {
      PWriteHook hook = Copy(pwrite_hook_);
      if (hook) err = hook(fd, offset, len);
    }
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("pwrite");
    if (err != 0) {
      if (written_first > 0) {
        NoteWrite(fd);
        (void)BackingDir::PWrite(fd, buf, written_first, offset);
      }
      return Injected(err, "pwrite");
    }
    NoteWrite(fd);
    return BackingDir::PWrite(fd, buf, len, offset);
  }
  Result<size_t> PRead(int fd, void* buf, size_t len, off_t offset) override {
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("pread");
    return BackingDir::PRead(fd, buf, len, offset);
  }
  Status Fsync(int fd) override {
    uint64_t n = fsync_calls_.fetch_add(1) + 1;
    int err = Decide(&fsync_faults_, n);
    if (err == 0) {
      FsyncHook hook = Copy(fsync_hook_);
      if (hook) err = hook(fd);
    }
    std::shared_lock crash(crash_mu_);
    if (crashed_) return Dead("fsync");
    if (err != 0) return Injected(err, "fsync");
    struct stat before;
    if (::fstat(fd, &before) != 0) return Status::FromErrno(errno, "fstat");
    std::optional<uint64_t> gen;
    {
      std::lock_guard lock(state_mu_);
      auto it = unsynced_.find({before.st_dev, before.st_ino});
      if (it != unsynced_.end()) gen = it->second.gen;
    }
    Status st = BackingDir::Fsync(fd);
    if (st.ok() && gen) {
      std::lock_guard lock(state_mu_);
      auto it = unsynced_.find({before.st_dev, before.st_ino});
      if (it != unsynced_.end()) {
        if (it->second.gen == *gen) {
          unsynced_.erase(it);  // nothing was written while the fsync ran
        } else {
          it->second.synced_size = std::max(it->second.synced_size, before.st_size);
        }
      }
    }
    return st;
  }

 private:
  FaultyBackingDir(std::string root_path, UniqueFd root)
      : BackingDir(std::move(root_path), std::move(root)) {}

  struct Unsynced {
    UniqueFd fd;        // a dup, so the file can be truncated after its owner closed it
    off_t synced_size;  // what survives a crash
    uint64_t gen;       // bumped by every write
  };
  using Key = std::pair<dev_t, ino_t>;

  static Status Dead(const std::string& what) {
    return Status::FromErrno(EIO, what + " (backing dir crashed)");
  }
  Status Injected(int err, const std::string& what) {
    faults_injected_.fetch_add(1);
    return Status::FromErrno(err, what + " (injected)");
  }
  void SetFault(std::map<uint64_t, int>* faults, uint64_t n, int err) {
    std::lock_guard lock(fault_mu_);
    (*faults)[n] = err;
  }
  int Decide(std::map<uint64_t, int>* faults, uint64_t n) {
    std::lock_guard lock(fault_mu_);
    auto it = faults->find(n);
    return it == faults->end() ? 0 : it->second;
  }
  template <typename F>
  F Copy(const F& hook) {
    std::lock_guard lock(fault_mu_);
    return hook;
  }
  // The errno the posix hook wants for call `op`, or 0. Runs before any lock is taken.
  int PosixHookErr(const char* op, const std::string& path) {
    posix_calls_.fetch_add(1);
    PosixHook hook = Copy(posix_hook_);
    return hook ? hook(op, path) : 0;
  }
  // The errno the lookup hook wants for `op` on `path`, or 0. Runs before any lock.
  int LookupHookErr(const char* op, const std::string& path) {
    PosixHook hook = Copy(lookup_hook_);
    return hook ? hook(op, path) : 0;
  }
  // REQUIRES(crash_mu_ shared)
  void NoteWrite(int fd) {
    struct stat st;
    if (::fstat(fd, &st) != 0) return;
    std::lock_guard lock(state_mu_);
    Key key{st.st_dev, st.st_ino};
    auto it = unsynced_.find(key);
    if (it != unsynced_.end()) {
      ++it->second.gen;
      return;
    }
    int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) std::abort();
    unsynced_.emplace(key, Unsynced{UniqueFd(dup), st.st_size, 1});
  }

  mutable std::shared_mutex crash_mu_;  // shared by every call, exclusive to crash
  bool crashed_ = false;                // GUARDED_BY(crash_mu_)

  mutable std::mutex fault_mu_;
  std::map<uint64_t, std::pair<int, size_t>> pwrite_faults_;  // GUARDED_BY(fault_mu_)
  std::map<uint64_t, int> fsync_faults_;                      // GUARDED_BY(fault_mu_)
  std::map<uint64_t, int> rename_faults_;                     // GUARDED_BY(fault_mu_)
  std::map<uint64_t, int> sync_parent_faults_;                // GUARDED_BY(fault_mu_)
  PWriteHook pwrite_hook_;                                    // GUARDED_BY(fault_mu_)
  FsyncHook fsync_hook_;                                      // GUARDED_BY(fault_mu_)
  RenameHook rename_hook_;                                    // GUARDED_BY(fault_mu_)
  PathHook sync_parent_hook_;                                 // GUARDED_BY(fault_mu_)
  PosixHook posix_hook_;                                      // GUARDED_BY(fault_mu_)
  PosixHook lookup_hook_;                                     // GUARDED_BY(fault_mu_)

  mutable std::mutex state_mu_;
  std::map<Key, Unsynced> unsynced_;  // GUARDED_BY(state_mu_)

  std::atomic<uint64_t> pwrite_calls_{0};
  std::atomic<uint64_t> fsync_calls_{0};
  std::atomic<uint64_t> rename_calls_{0};
  std::atomic<uint64_t> sync_parent_calls_{0};
  std::atomic<uint64_t> unlink_calls_{0};
  std::atomic<uint64_t> posix_calls_{0};
  std::atomic<uint64_t> faults_injected_{0};
};

// A one-shot gate for hooks: Wait() blocks until Open(). Deterministic ordering of
// races without sleeps.
class Latch {
 public:
  void Open() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock lock(mu_);
    ++waiters_;
    waiter_cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
  }
  // Blocks until at least `n` threads have reached Wait().
  void AwaitWaiters(int n) {
    std::unique_lock lock(mu_);
    waiter_cv_.wait(lock, [&] { return waiters_ >= n; });
  }
  bool is_open() const {
    std::lock_guard lock(mu_);
    return open_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable waiter_cv_;
  bool open_ = false;
  int waiters_ = 0;
};

}  // namespace ckptfs::store
