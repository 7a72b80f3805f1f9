#include "store/backing_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace ckptfs::store {
namespace {

std::atomic<bool> g_have_openat2{true};

std::string Ctx(const char* op, const std::string& path) {
  return std::string(op) + " " + (path.empty() ? "." : path);
}

}  // namespace

Result<std::unique_ptr<BackingDir>> BackingDir::Open(const std::string& root_path) {
  int fd = ::open(root_path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "backing dir " + root_path);
  return std::unique_ptr<BackingDir>(new BackingDir(root_path, UniqueFd(fd)));
}

Status BackingDir::CheckRelative(const std::string& path) {
  if (path.empty()) return Status::Ok();
  if (path.front() == '/') return Status(Code::kPermission, "absolute path refused: " + path);
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    std::string_view comp(path.data() + start, end - start);
    if (comp.empty() || comp == "." || comp == "..") {
      return Status(Code::kPermission, "path component refused: " + path);
    }
    start = end + 1;
  }
  return Status::Ok();
}

std::pair<std::string, std::string> BackingDir::SplitParent(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return {"", path};
  return {path.substr(0, slash), path.substr(slash + 1)};
}

Result<UniqueFd> BackingDir::Resolve(const std::string& path, int flags, mode_t mode) {
  CKPT_RETURN_IF_ERROR(CheckRelative(path));
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
      return Status::FromErrno(errno, Ctx("open", path));
    }
    g_have_openat2.store(false);
  }
  // Fallback: walk each component with O_NOFOLLOW, so no symlink is ever followed.
  UniqueFd dir(::openat(root_.get(), ".", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dir.valid()) return Status::FromErrno(errno, "open backing root");
  if (path.empty()) {
    int fd = ::openat(root_.get(), ".", flags | O_CLOEXEC, mode);
    if (fd < 0) return Status::FromErrno(errno, Ctx("open", path));
    return UniqueFd(fd);
  }
  size_t start = 0;
  while (true) {
    size_t end = path.find('/', start);
    std::string comp = path.substr(start, end == std::string::npos ? std::string::npos
                                                                    : end - start);
    if (end == std::string::npos) {
      int fd = ::openat(dir.get(), comp.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, mode);
      if (fd < 0) return Status::FromErrno(errno, Ctx("open", path));
      return UniqueFd(fd);
    }
    int next = ::openat(dir.get(), comp.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) return Status::FromErrno(errno, Ctx("open", path));
    dir.Reset(next);
    start = end + 1;
  }
}

Result<UniqueFd> BackingDir::OpenDir(const std::string& dir) {
  return Resolve(dir, O_PATH | O_DIRECTORY, 0);
}

Result<UniqueFd> BackingDir::OpenFile(const std::string& path, int flags, mode_t mode) {
  // The final component must not be a symlink: a data open never follows one.
  return Resolve(path, flags | O_NOFOLLOW, mode);
}

Result<struct stat> BackingDir::Stat(const std::string& path) {
  CKPT_RETURN_IF_ERROR(CheckRelative(path));
  auto [parent, name] = SplitParent(path);
  CKPT_ASSIGN_OR_RETURN(UniqueFd dir, OpenDir(parent));
  struct stat st;
  const char* n = name.empty() ? "" : name.c_str();
  int flags = AT_SYMLINK_NOFOLLOW | (name.empty() ? AT_EMPTY_PATH : 0);
  if (::fstatat(dir.get(), n, &st, flags) != 0) return Status::FromErrno(errno, Ctx("stat", path));
  return st;
}

#define CKPT_AT_OP(op_name, call)                                  \
  CKPT_RETURN_IF_ERROR(CheckRelative(path));                       \
  auto [parent, name] = SplitParent(path);                         \
  if (name.empty()) return Invalid(std::string(op_name) + " of backing root"); \
  CKPT_ASSIGN_OR_RETURN(UniqueFd dir, OpenDir(parent));            \
  if ((call) != 0) return Status::FromErrno(errno, Ctx(op_name, path)); \
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

Status BackingDir::Chmod(const std::string& path, mode_t mode) {
  // Never follow a final symlink, even one swapped in after a type check: open the
  // name itself with O_PATH|O_NOFOLLOW and change that inode through /proc.
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, Resolve(path, O_PATH | O_NOFOLLOW, 0));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Status::FromErrno(errno, Ctx("chmod", path));
  if (S_ISLNK(st.st_mode)) return Status::Ok();  // a symlink's mode is meaningless
  std::string proc = "/proc/self/fd/" + std::to_string(fd.get());
  if (::chmod(proc.c_str(), mode & 07777) != 0) return Status::FromErrno(errno, Ctx("chmod", path));
  return Status::Ok();
}

Status BackingDir::Utimens(const std::string& path, const struct timespec times[2]) {
  CKPT_AT_OP("utimens", ::utimensat(dir.get(), name.c_str(), times, AT_SYMLINK_NOFOLLOW));
}

#undef CKPT_AT_OP

Status BackingDir::Truncate(const std::string& path, off_t size) {
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_WRONLY));
  if (::ftruncate(fd.get(), size) != 0) return Status::FromErrno(errno, Ctx("truncate", path));
  return Status::Ok();
}

Status BackingDir::Rename(const std::string& from, const std::string& to, unsigned flags) {
  CKPT_RETURN_IF_ERROR(CheckRelative(from));
  CKPT_RETURN_IF_ERROR(CheckRelative(to));
  auto [from_parent, from_name] = SplitParent(from);
  auto [to_parent, to_name] = SplitParent(to);
  if (from_name.empty() || to_name.empty()) return Invalid("rename of backing root");
  CKPT_ASSIGN_OR_RETURN(UniqueFd from_dir, OpenDir(from_parent));
  CKPT_ASSIGN_OR_RETURN(UniqueFd to_dir, OpenDir(to_parent));
  if (::renameat2(from_dir.get(), from_name.c_str(), to_dir.get(), to_name.c_str(), flags) != 0) {
    return Status::FromErrno(errno, "rename " + from + " -> " + to);
  }
  return Status::Ok();
}

Result<std::string> BackingDir::Readlink(const std::string& path) {
  CKPT_RETURN_IF_ERROR(CheckRelative(path));
  auto [parent, name] = SplitParent(path);
  CKPT_ASSIGN_OR_RETURN(UniqueFd dir, OpenDir(parent));
  char buf[4096];
  ssize_t n = ::readlinkat(dir.get(), name.c_str(), buf, sizeof(buf));
  if (n < 0) return Status::FromErrno(errno, Ctx("readlink", path));
  return std::string(buf, static_cast<size_t>(n));
}

Result<std::vector<DirEntry>> BackingDir::List(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, Resolve(path, O_RDONLY | O_DIRECTORY, 0));
  DIR* d = ::fdopendir(fd.get());
  if (d == nullptr) return Status::FromErrno(errno, Ctx("opendir", path));
  fd.Release();  // owned by `d` now
  std::vector<DirEntry> out;
  errno = 0;
  while (struct dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    out.push_back(DirEntry{e->d_name, e->d_type});
  }
  int err = errno;
  ::closedir(d);
  if (err != 0) return Status::FromErrno(err, Ctx("readdir", path));
  return out;
}

Result<struct statvfs> BackingDir::StatFs() {
  struct statvfs st;
  if (::fstatvfs(root_.get(), &st) != 0) {
    // O_PATH fds do not support fstatvfs on every kernel; fall back to the path.
    if (::statvfs(root_path_.c_str(), &st) != 0) return Status::FromErrno(errno, "statfs");
  }
  return st;
}

Status BackingDir::SyncParent(const std::string& path) {
  auto [parent, name] = SplitParent(path);
  CKPT_ASSIGN_OR_RETURN(UniqueFd dir, Resolve(parent, O_RDONLY | O_DIRECTORY, 0));
  if (::fsync(dir.get()) != 0) return Status::FromErrno(errno, Ctx("fsync dir", parent));
  return Status::Ok();
}

Status BackingDir::PWrite(int fd, const void* buf, size_t len, off_t offset) {
  const char* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n = ::pwrite(fd, p, len, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "pwrite");
    }
    if (n == 0) return Status::FromErrno(EIO, "pwrite wrote nothing");
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
      return Status::FromErrno(errno, "pread");
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  bytes_read_.fetch_add(done, std::memory_order_relaxed);
  return done;
}

Status BackingDir::Fsync(int fd) {
  if (::fsync(fd) != 0) return Status::FromErrno(errno, "fsync");
  return Status::Ok();
}

}  // namespace ckptfs::store
