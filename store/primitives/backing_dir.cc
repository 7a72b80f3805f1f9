#include "store/primitives/backing_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstring>

#include "common/path.h"

namespace ckptfs::store {
namespace {

std::atomic<bool> g_have_openat2{true};

std::string Ctx(const char* op, const std::string& path) {
  return std::string(op) + " " + (path.empty() ? "." : path);
}

// Status::FromErrno, plus a log line when the daemon is out of file descriptors: the
// caller only sees EMFILE, the operator needs to know it was the daemon's limit. At
// most one line per 10 s, counting the ones left out.
Status OsError(int err, const std::string& context) {
  Status st = Status::FromErrno(err, context);
  if (err == EMFILE || err == ENFILE) {
    static std::atomic<int64_t> next_log_s{0};
    static std::atomic<uint64_t> left_out{0};
    const int64_t now_s = std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::steady_clock::now().time_since_epoch())
                              .count();
    int64_t next = next_log_s.load(std::memory_order_relaxed);
    if (now_s >= next && next_log_s.compare_exchange_strong(next, now_s + 10)) {
      struct rlimit lim = {};
      ::getrlimit(RLIMIT_NOFILE, &lim);
      spdlog::error("backing dir: {} (the daemon's RLIMIT_NOFILE is {}; {} more like it "
                    "not logged); operations fail with EMFILE until files are closed",
                    st.message(), static_cast<uint64_t>(lim.rlim_cur), left_out.exchange(0));
    } else {
      left_out.fetch_add(1, std::memory_order_relaxed);
    }
  }
  return st;
}

// Refuses an absolute path and an empty, "." or ".." component (path::IsConfined): every
// name stays beneath the root (G9).
Status CheckConfined(const std::string& path) {
  if (path::IsConfined(path)) return Status::Ok();
  if (path.front() == '/') return Status(Code::kPermission, "absolute path refused: " + path);
  return Status(Code::kPermission, "path component refused: " + path);
}

}  // namespace

Result<std::unique_ptr<BackingDir>> BackingDir::Open(const std::string& root_path) {
  int fd = ::open(root_path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "backing dir " + root_path);
  return std::unique_ptr<BackingDir>(new BackingDir(root_path, UniqueFd(fd)));
}

BackingDir::BackingDir(std::string root_path, UniqueFd root)
    : root_path_(std::move(root_path)), root_(std::move(root)) {
  struct stat st;
  if (::fstat(root_.get(), &st) == 0) root_dev_ = st.st_dev;
  // A call holds at most two fds at once (a rename's two directories); two callers may
  // be short at the same time (the publisher and a FUSE thread).
  constexpr int kSpareFds = 4;
  for (int i = 0; i < kSpareFds; ++i) {
    UniqueFd spare(::fcntl(root_.get(), F_DUPFD_CLOEXEC, 0));
    if (spare.valid()) spares_.push_back(std::move(spare));
  }
}

BackingDir::CallFd::~CallFd() {
  if (spare_ && fd_.valid()) {
    MutexLock lock(&owner_->spare_mu_);
    owner_->spares_.push_back(std::move(fd_));  // any open fd holds a slot as well
  }
}

Result<BackingDir::CallFd> BackingDir::OpenForCall(const std::string& path, int flags,
                                                   mode_t mode) {
  Result<UniqueFd> fd = Resolve(path, flags, mode);
  if (fd.ok()) return CallFd(this, std::move(*fd), false);
  if (fd.status().code() != Code::kTooManyOpenFiles) return fd.status();
  UniqueFd spare;
  {
    MutexLock lock(&spare_mu_);
    if (spares_.empty()) return fd.status();
    spare = std::move(spares_.back());
    spares_.pop_back();
  }
  spare.Reset();  // frees its slot for the open below
  fd = Resolve(path, flags, mode);
  if (fd.ok()) return CallFd(this, std::move(*fd), true);
  // Someone else took the slot, or the open failed for its own reason: win a spare back
  // if there is a slot for one.
  UniqueFd again(::fcntl(root_.get(), F_DUPFD_CLOEXEC, 0));
  if (again.valid()) {
    MutexLock lock(&spare_mu_);
    spares_.push_back(std::move(again));
  }
  return fd.status();
}

Status BackingDir::CheckRoot() {
  struct stat st;
  // A removed directory keeps no links; one that was only moved keeps its link.
  if (::fstat(root_.get(), &st) == 0 && st.st_nlink > 0) return Status::Ok();
  MutexLock lock(&root_mu_);
  if (::fstat(root_.get(), &st) == 0 && st.st_nlink > 0) return Status::Ok();  // raced
  auto gone = [&](const std::string& why) {
    root_mu_.AssertHeld();  // called below, under the lock
    if (!root_gone_) {
      spdlog::error("backing dir {} was removed under the mount ({}); operations fail until "
                    "a directory is created there again",
                    root_path_, why);
      root_gone_ = true;
    }
    return Status(Code::kNotFound, "backing dir " + root_path_ + " was removed (" + why + ")");
  };
  // root_path_ is canonical (checked at mount): a symlink there now is not followed.
  UniqueFd fresh(::open(root_path_.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fresh.valid()) return gone(std::strerror(errno));
  struct stat fresh_st;
  if (::fstat(fresh.get(), &fresh_st) != 0) return gone(std::strerror(errno));
  if (fresh_st.st_nlink == 0) return gone("removed again");
  // Another file system at that path (a mount, perhaps this very FUSE mount) is not
  // the backing store the daemon was started on.
  if (fresh_st.st_dev != root_dev_) return gone("a directory on another file system");
  if (::dup3(fresh.get(), root_.get(), O_CLOEXEC) < 0) {
    return OsError(errno, "reopen backing dir " + root_path_);
  }
  spdlog::warn("backing dir {} was created again: using the new directory (inode {})",
               root_path_, static_cast<uint64_t>(fresh_st.st_ino));
  root_gone_ = false;
  return Status::Ok();
}

Result<UniqueFd> BackingDir::Resolve(const std::string& path, int flags, mode_t mode) {
  CKPT_RETURN_IF_ERROR(CheckConfined(path));
  CKPT_RETURN_IF_ERROR(CheckRoot());
  const char* p = path.empty() ? "." : path.c_str();
  if (g_have_openat2.load(std::memory_order_relaxed)) {
    struct open_how how;
    std::memset(&how, 0, sizeof(how));
    how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
    how.mode = (flags & (O_CREAT | O_TMPFILE)) ? mode : 0;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
    long fd = ::syscall(SYS_openat2, root_.get(), p, &how, sizeof(how));
    if (fd >= 0) return UniqueFd(static_cast<int>(fd));
    if (errno != ENOSYS) {
      if (errno == EXDEV) return Status(Code::kPermission, "path escapes backing dir: " + path);
      return OsError(errno, Ctx("open", path));
    }
    g_have_openat2.store(false);
  }
  // Fallback: walk each component with O_NOFOLLOW, so no symlink is ever followed.
  UniqueFd dir(::openat(root_.get(), ".", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dir.valid()) return OsError(errno, "open backing root");
  if (path.empty()) {
    int fd = ::openat(root_.get(), ".", flags | O_CLOEXEC, mode);
    if (fd < 0) return OsError(errno, Ctx("open", path));
    return UniqueFd(fd);
  }
  size_t start = 0;
  while (true) {
    size_t end = path.find('/', start);
    std::string comp = path.substr(start, end == std::string::npos ? std::string::npos
                                                                    : end - start);
    if (end == std::string::npos) {
      int fd = ::openat(dir.get(), comp.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, mode);
      if (fd < 0) return OsError(errno, Ctx("open", path));
      return UniqueFd(fd);
    }
    int next = ::openat(dir.get(), comp.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) return OsError(errno, Ctx("open", path));
    dir.Reset(next);
    start = end + 1;
  }
}

Result<BackingDir::CallFd> BackingDir::OpenDir(const std::string& dir) {
  return OpenForCall(dir, O_PATH | O_DIRECTORY, 0);
}

Result<UniqueFd> BackingDir::OpenFile(const std::string& path, int flags, mode_t mode) {
  // The final component must not be a symlink: a data open never follows one.
  return Resolve(path, flags | O_NOFOLLOW, mode);
}

Result<struct stat> BackingDir::Stat(const std::string& path) {
  CKPT_RETURN_IF_ERROR(CheckConfined(path));
  auto [parent, name] = path::Split(path);
  CKPT_ASSIGN_OR_RETURN(CallFd dir, OpenDir(parent));
  struct stat st;
  const char* n = name.empty() ? "" : name.c_str();
  int flags = AT_SYMLINK_NOFOLLOW | (name.empty() ? AT_EMPTY_PATH : 0);
  if (::fstatat(dir.get(), n, &st, flags) != 0) return OsError(errno, Ctx("stat", path));
  return st;
}

#define CKPT_AT_OP(op_name, call)                                  \
  CKPT_RETURN_IF_ERROR(CheckConfined(path));                       \
  auto [parent, name] = path::Split(path);                         \
  if (name.empty()) return Invalid(std::string(op_name) + " of backing root"); \
  CKPT_ASSIGN_OR_RETURN(CallFd dir, OpenDir(parent));            \
  if ((call) != 0) return OsError(errno, Ctx(op_name, path)); \
  return Status::Ok()

Status BackingDir::Mkdir(const std::string& path, mode_t mode) {
  CKPT_AT_OP("mkdir", ::mkdirat(dir.get(), name.c_str(), mode));
}

Status BackingDir::Rmdir(const std::string& path) {
  CKPT_AT_OP("rmdir", ::unlinkat(dir.get(), name.c_str(), AT_REMOVEDIR));
}

Status BackingDir::Unlink(const std::string& path) {
  CKPT_AT_OP("unlink", ::unlinkat(dir.get(), name.c_str(), 0));
}

Status BackingDir::Symlink(const std::string& target, const std::string& path) {
  CKPT_AT_OP("symlink", ::symlinkat(target.c_str(), dir.get(), name.c_str()));
}

Result<std::string> BackingDir::GetDirXattr(const std::string& path, const std::string& name) {
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
  char buf[256];
  const ssize_t n = ::fgetxattr(fd.get(), name.c_str(), buf, sizeof(buf));
  if (n < 0) {
    if (errno == ENODATA || errno == ENOTSUP) return Status(Code::kNotFound, name);
    return OsError(errno, Ctx("getxattr", path));
  }
  return std::string(buf, static_cast<size_t>(n));
}

Status BackingDir::SetDirXattr(const std::string& path, const std::string& name,
                               const std::string& value) {
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
  if (::fsetxattr(fd.get(), name.c_str(), value.data(), value.size(), 0) != 0) {
    return OsError(errno, Ctx("setxattr", path));
  }
  return Status::Ok();
}

Status BackingDir::RemoveDirXattr(const std::string& path, const std::string& name) {
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
  if (::fremovexattr(fd.get(), name.c_str()) != 0 && errno != ENODATA) {
    return OsError(errno, Ctx("removexattr", path));
  }
  return Status::Ok();
}

Status BackingDir::Chmod(const std::string& path, mode_t mode) {
  // Never follow a final symlink, even one swapped in after a type check: open the
  // name itself with O_PATH|O_NOFOLLOW and change that inode through /proc.
  CKPT_ASSIGN_OR_RETURN(CallFd fd, OpenForCall(path, O_PATH | O_NOFOLLOW, 0));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return OsError(errno, Ctx("chmod", path));
  if (S_ISLNK(st.st_mode)) return Status::Ok();  // a symlink's mode is meaningless
  std::string proc = "/proc/self/fd/" + std::to_string(fd.get());
  if (::chmod(proc.c_str(), mode & 07777) != 0) return OsError(errno, Ctx("chmod", path));
  return Status::Ok();
}

Status BackingDir::Utimens(const std::string& path, const struct timespec times[2]) {
  CKPT_AT_OP("utimens", ::utimensat(dir.get(), name.c_str(), times, AT_SYMLINK_NOFOLLOW));
}

Status BackingDir::Chown(const std::string& path, uid_t uid, gid_t gid) {
  if (path.empty()) {
    if (::fchownat(root_.get(), "", uid, gid, AT_EMPTY_PATH) != 0) {
      return OsError(errno, Ctx("chown", path));
    }
    return Status::Ok();
  }
  CKPT_AT_OP("chown", ::fchownat(dir.get(), name.c_str(), uid, gid, AT_SYMLINK_NOFOLLOW));
}

Status BackingDir::Mknod(const std::string& path, mode_t mode, dev_t rdev) {
  CKPT_AT_OP("mknod", ::mknodat(dir.get(), name.c_str(), mode, rdev));
}

#undef CKPT_AT_OP

Status BackingDir::Link(const std::string& from, const std::string& to) {
  CKPT_RETURN_IF_ERROR(CheckConfined(from));
  CKPT_RETURN_IF_ERROR(CheckConfined(to));
  auto [from_parent, from_name] = path::Split(from);
  auto [to_parent, to_name] = path::Split(to);
  if (from_name.empty() || to_name.empty()) return Invalid("link of backing root");
  CKPT_ASSIGN_OR_RETURN(CallFd from_dir, OpenDir(from_parent));
  CKPT_ASSIGN_OR_RETURN(CallFd to_dir, OpenDir(to_parent));
  // No AT_SYMLINK_FOLLOW: a symlink `from` gets a second name; its target is never reached.
  if (::linkat(from_dir.get(), from_name.c_str(), to_dir.get(), to_name.c_str(), 0) != 0) {
    return OsError(errno, "link " + from + " -> " + to);
  }
  return Status::Ok();
}

Status BackingDir::Truncate(const std::string& path, off_t size) {
  CKPT_ASSIGN_OR_RETURN(CallFd fd, OpenForCall(path, O_WRONLY | O_NOFOLLOW, 0));
  if (::ftruncate(fd.get(), size) != 0) return OsError(errno, Ctx("truncate", path));
  return Status::Ok();
}

Status BackingDir::Rename(const std::string& from, const std::string& to, unsigned flags) {
  CKPT_RETURN_IF_ERROR(CheckConfined(from));
  CKPT_RETURN_IF_ERROR(CheckConfined(to));
  auto [from_parent, from_name] = path::Split(from);
  auto [to_parent, to_name] = path::Split(to);
  if (from_name.empty() || to_name.empty()) return Invalid("rename of backing root");
  CKPT_ASSIGN_OR_RETURN(CallFd from_dir, OpenDir(from_parent));
  CKPT_ASSIGN_OR_RETURN(CallFd to_dir, OpenDir(to_parent));
  if (::renameat2(from_dir.get(), from_name.c_str(), to_dir.get(), to_name.c_str(), flags) != 0) {
    return OsError(errno, "rename " + from + " -> " + to);
  }
  return Status::Ok();
}

Result<std::string> BackingDir::Readlink(const std::string& path) {
  CKPT_RETURN_IF_ERROR(CheckConfined(path));
  auto [parent, name] = path::Split(path);
  CKPT_ASSIGN_OR_RETURN(CallFd dir, OpenDir(parent));
  char buf[4096];
  ssize_t n = ::readlinkat(dir.get(), name.c_str(), buf, sizeof(buf));
  if (n < 0) return OsError(errno, Ctx("readlink", path));
  return std::string(buf, static_cast<size_t>(n));
}

Result<std::vector<DirEntry>> BackingDir::List(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, Resolve(path, O_RDONLY | O_DIRECTORY, 0));
  DIR* d = ::fdopendir(fd.get());
  if (d == nullptr) return OsError(errno, Ctx("opendir", path));
  fd.Release();  // owned by `d` now
  std::vector<DirEntry> out;
  errno = 0;
  while (struct dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    out.push_back(DirEntry{e->d_name, e->d_type});
  }
  int err = errno;
  ::closedir(d);
  if (err != 0) return OsError(err, Ctx("readdir", path));
  return out;
}

Result<struct statvfs> BackingDir::StatFs() {
  struct statvfs st;
  if (::fstatvfs(root_.get(), &st) != 0) {
    // O_PATH fds do not support fstatvfs on every kernel; fall back to the path.
    if (::statvfs(root_path_.c_str(), &st) != 0) return OsError(errno, "statfs");
  }
  return st;
}

Status BackingDir::SyncParent(const std::string& path) {
  auto [parent, name] = path::Split(path);
  CKPT_ASSIGN_OR_RETURN(CallFd dir, OpenForCall(parent, O_RDONLY | O_DIRECTORY, 0));
  if (::fsync(dir.get()) != 0) return OsError(errno, Ctx("fsync dir", parent));
  return Status::Ok();
}

Status BackingDir::PWrite(int fd, const void* buf, size_t len, off_t offset) {
  const char* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n = ::pwrite(fd, p, len, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return OsError(errno, "pwrite");
    }
    if (n == 0) return OsError(EIO, "pwrite wrote nothing");
    p += n;
    len -= static_cast<size_t>(n);
    offset += n;
    bytes_written_.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
  }
  return Status::Ok();
}

Result<size_t> BackingDir::PRead(int fd, void* buf, size_t len, off_t offset) {
  size_t done = 0;
  char* p = static_cast<char*>(buf);
  while (done < len) {
    ssize_t n = ::pread(fd, p + done, len - done, offset + static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return OsError(errno, "pread");
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  bytes_read_.fetch_add(done, std::memory_order_relaxed);
  return done;
}

Status BackingDir::Fsync(int fd) {
  if (::fsync(fd) != 0) return OsError(errno, "fsync");
  return Status::Ok();
}

Status BackingDir::Fchown(int fd, uid_t uid, gid_t gid) {
  if (::fchown(fd, uid, gid) != 0) return OsError(errno, "fchown");
  return Status::Ok();
}

Status BackingDir::Fallocate(int fd, int mode, off_t offset, off_t len) {
  while (::fallocate(fd, mode, offset, len) != 0) {
    if (errno != EINTR) return OsError(errno, "fallocate");
  }
  return Status::Ok();
}

Status BackingDir::WillNeed(int fd, off_t offset, off_t len) {
  // posix_fadvise returns the error number; it does not set errno.
  if (int rc = ::posix_fadvise(fd, offset, len, POSIX_FADV_WILLNEED); rc != 0) {
    return OsError(rc, "posix_fadvise");
  }
  return Status::Ok();
}

Status BackingDir::Fchmod(int fd, mode_t mode) {
  if (::fchmod(fd, mode) != 0) return OsError(errno, "fchmod");
  return Status::Ok();
}

Status BackingDir::Ftruncate(int fd, off_t size) {
  while (::ftruncate(fd, size) != 0) {
    if (errno != EINTR) return OsError(errno, "truncate");
  }
  return Status::Ok();
}

Result<struct stat> BackingDir::Fstat(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return OsError(errno, "fstat");
  return st;
}

Status BackingDir::CopyFileRange(int in_fd, int out_fd, uint64_t len) {
  loff_t in = 0, out = 0;
  uint64_t left = len;
  while (left > 0) {
    ssize_t n = ::copy_file_range(in_fd, &in, out_fd, &out, left, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return OsError(n < 0 ? errno : EIO, "copy for rewrite");
    left -= static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

}  // namespace ckptfs::store
