// BackingDir: every access ckptfs makes to the backing store goes through here.
//
// Paths are relative to the backing root ("" is the root itself) and are resolved
// beneath it: openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS) where the kernel has it,
// else a component-by-component walk with O_NOFOLLOW. Absolute paths, ".." and
// symlinks that leave the root are refused (G9). The final component of a namespace
// operation is never followed.
//
// The backing dir is known by its path. If the directory held open is removed under a
// running daemon, path operations fail (kNotFound, logged once) until a directory is
// created at the same path on the same file system; then that one is used. A backing
// dir that is only moved away stays in use where it went: nothing in it is lost.
//
// Running out of file descriptors gives kTooManyOpenFiles and a (rate-limited) log line.
// The fds a call needs only while it runs (directories walked, renamed in, fsynced)
// fall back on a few spare fds reserved at Open, so that publishing work already
// accepted (renames, directory fsyncs, unlinks) goes on while the process is out of
// fds; only OpenFile, whose fd outlives the call, then fails with EMFILE.
//
// Thread-safe. The I/O calls are virtual so tests can inject faults (FaultyBackingDir).
#pragma once

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace ckptfs::store {

// A stat's ctime, and a time given as seconds and nanoseconds, as epoch seconds.
inline double EpochSeconds(int64_t sec, int64_t nsec) {
  return static_cast<double>(sec) + static_cast<double>(nsec) * 1e-9;
}
inline double CtimeSeconds(const struct stat& st) {
  return EpochSeconds(st.st_ctim.tv_sec, st.st_ctim.tv_nsec);
}

struct DirEntry {
  std::string name;
  unsigned char type;  // DT_* value
};

class BackingDir {
 public:
  static Result<std::unique_ptr<BackingDir>> Open(const std::string& root_path);
  virtual ~BackingDir() = default;
  BackingDir(const BackingDir&) = delete;
  BackingDir& operator=(const BackingDir&) = delete;

  // The root's fd number never changes: a re-created root is dup3()ed onto it, so a
  // call already using it keeps the directory it started with.
  int root_fd() const { return root_.get(); }

  // Opens `path` (never following a final symlink unless `follow`).
  virtual Result<UniqueFd> OpenFile(const std::string& path, int flags, mode_t mode = 0);
  virtual Result<struct stat> Stat(const std::string& path);
  virtual Status Mkdir(const std::string& path, mode_t mode);
  virtual Status Rmdir(const std::string& path);
  virtual Status Unlink(const std::string& path);
  virtual Status Rename(const std::string& from, const std::string& to, unsigned flags = 0);
  virtual Status Symlink(const std::string& target, const std::string& path);
  virtual Result<std::string> Readlink(const std::string& path);
  virtual Status Chmod(const std::string& path, mode_t mode);
  virtual Status Utimens(const std::string& path, const struct timespec times[2]);
  virtual Status Truncate(const std::string& path, off_t size);
  // Owner and group of `path` itself (a final symlink is changed, never followed);
  // (uid_t)-1 / (gid_t)-1 leave one unchanged, as chown(2).
  virtual Status Chown(const std::string& path, uid_t uid, gid_t gid);
  // A hard link `to` of the name `from` (a symlink is linked, not followed). Both stay
  // beneath the root.
  virtual Status Link(const std::string& from, const std::string& to);
  // A FIFO, socket, device or empty regular file at `path` (mode holds the type bits).
  virtual Status Mknod(const std::string& path, mode_t mode, dev_t rdev);
  virtual Result<std::vector<DirEntry>> List(const std::string& path);
  virtual Result<struct statvfs> StatFs();
  // Makes the directory entry of `path` durable (fsync of its parent directory).
  virtual Status SyncParent(const std::string& path);
  // Extended attributes of the directory `path` (never through a symlink). Get: kNotFound
  // when it has no attribute `name` (or attributes are unsupported there).
  virtual Result<std::string> GetDirXattr(const std::string& path, const std::string& name);
  virtual Status SetDirXattr(const std::string& path, const std::string& name,
                             const std::string& value);
  virtual Status RemoveDirXattr(const std::string& path, const std::string& name);

  // Data I/O on files opened above. `PWrite` writes all of `len` or fails.
  virtual Status PWrite(int fd, const void* buf, size_t len, off_t offset);
  virtual Result<size_t> PRead(int fd, void* buf, size_t len, off_t offset);
  virtual Status Fsync(int fd);
  virtual Status Fchown(int fd, uid_t uid, gid_t gid);
  // fallocate(2) on an fd opened above; EOPNOTSUPP where the backing fs lacks `mode`.
  virtual Status Fallocate(int fd, int mode, off_t offset, off_t len);
  virtual Status Fchmod(int fd, mode_t mode);
  virtual Status Ftruncate(int fd, off_t size);
  virtual Result<struct stat> Fstat(int fd);
  // Asks the kernel to read [offset, offset + len) of an fd opened above into the page
  // cache (posix_fadvise POSIX_FADV_WILLNEED): advice, it starts the reads and returns.
  virtual Status WillNeed(int fd, off_t offset, off_t len);
  // Copies `len` bytes from offset 0 of `in_fd` to offset 0 of `out_fd` with
  // copy_file_range(2): a reflink where the file system shares extents (XFS, btrfs).
  virtual Status CopyFileRange(int in_fd, int out_fd, uint64_t len);

  uint64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }
  uint64_t bytes_written() const { return bytes_written_.load(std::memory_order_relaxed); }

 protected:
  // An fd for the length of one call. If it was opened in the place of a spare fd (the
  // process had none left), it becomes a spare again when it goes out of scope.
  class CallFd {
   public:
    CallFd(BackingDir* owner, UniqueFd fd, bool spare) : owner_(owner), fd_(std::move(fd)),
                                                         spare_(spare) {}
    CallFd(CallFd&& other) noexcept = default;
    CallFd& operator=(CallFd&&) = delete;
    ~CallFd();
    int get() const { return fd_.get(); }

   private:
    BackingDir* owner_;
    UniqueFd fd_;
    bool spare_;
  };

  BackingDir(std::string root_path, UniqueFd root);
  // Resolve() for an fd used only during the call (see CallFd).
  Result<CallFd> OpenForCall(const std::string& path, int flags, mode_t mode);
  // An O_PATH|O_DIRECTORY fd of directory `dir` resolved beneath the root.
  Result<CallFd> OpenDir(const std::string& dir);
  // Resolves `path` beneath the root with `flags`.
  Result<UniqueFd> Resolve(const std::string& path, int flags, mode_t mode);
  // Ok while the root directory exists. If it was removed, switches to a directory
  // created again at root_path_ (same file system) or fails with kNotFound.
  Status CheckRoot();

 private:
  std::string root_path_;
  UniqueFd root_;
  dev_t root_dev_ = 0;       // the file system the daemon was started on
  Mutex spare_mu_;
  std::vector<UniqueFd> spares_ GUARDED_BY(spare_mu_);
  Mutex root_mu_;       // serializes the switch to a new root (CheckRoot)
  bool root_gone_ GUARDED_BY(root_mu_) = false;  // the removal was logged
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> bytes_written_{0};
};

}  // namespace ckptfs::store
