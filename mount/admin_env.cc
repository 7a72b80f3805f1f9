// ckptfs-admin's view of the OS: the real AdminEnv, running a helper program, and finding
// and reading the control files of the mount that holds a path.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <ostream>
#include <thread>
#include <utility>

#include "common/unique_fd.h"
#include "mount/admin.h"
#include "mount/admin_internal.h"

namespace ckptfs::admin {
namespace {

using namespace internal;  // NOLINT: the helpers of admin_internal.h

class SystemEnvImpl final : public AdminEnv {
 public:
  Result<std::string> GetXattr(const std::string& path, const std::string& name) override {
    // The value is generated when read and may grow between a size query and the read,
    // so start with a buffer that fits any progress JSON and grow on ERANGE.
    std::string buf(4096, '\0');
    for (int attempt = 0; attempt < 8; ++attempt) {
      ssize_t n = ::getxattr(path.c_str(), name.c_str(), buf.data(), buf.size());
      if (n >= 0) {
        buf.resize(static_cast<size_t>(n));
        return buf;
      }
      if (errno == EINTR) continue;
      if (errno != ERANGE) return Status::FromErrno(errno, path + ": getxattr " + name);
      ssize_t need = ::getxattr(path.c_str(), name.c_str(), nullptr, 0);
      if (need < 0) return Status::FromErrno(errno, path + ": getxattr " + name);
      buf.assign(std::max(buf.size() * 2, static_cast<size_t>(need) * 2), '\0');
    }
    return Status(Code::kIo, path + ": getxattr " + name + ": value keeps growing");
  }

  double MonotonicSeconds() override {
    using namespace std::chrono;
    return duration<double>(steady_clock::now().time_since_epoch()).count();
  }

  double WallSeconds() override {
    using namespace std::chrono;
    return duration<double>(system_clock::now().time_since_epoch()).count();
  }

  void Sleep(double seconds) override {
    if (seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }

  bool ProcessAlive(int pid) override {
    if (pid <= 0) return false;  // kill(0 or -1, ...) would address process groups.
    // A pidfd polls readable once the process has exited, zombie or not.
    UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
    if (pidfd.valid()) {
      struct pollfd p = {pidfd.get(), POLLIN, 0};
      return ::poll(&p, 1, 0) == 0;
    }
    if (errno == ESRCH) return false;
    // No pidfd_open (kernel < 5.3): kill() succeeds on a zombie, so ask /proc.
    if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
    auto stat = ReadWholeFile("/proc/" + std::to_string(pid) + "/stat");
    if (!stat.ok()) return stat.status().code() != Code::kNotFound;
    size_t paren = stat->rfind(')');
    if (paren == std::string::npos || paren + 2 >= stat->size()) return true;
    char state = (*stat)[paren + 2];
    return state != 'Z' && state != 'X';
  }

  Status FuseUnmount(const std::string& mountpoint) override {
    // A working directory inside the mount would keep it busy.
    if (::chdir("/") != 0) return Status::FromErrno(errno, "chdir /");
    auto rc = RunProgram({"fusermount3", "-u", mountpoint});
    if (!rc.ok()) return rc.status();
    if (*rc == 127) return NotFound("fusermount3 not found in PATH");
    if (*rc != 0) {
      return Status(Code::kBusy,
                    "fusermount3 -u " + mountpoint + " exited with status " + std::to_string(*rc));
    }
    return Status::Ok();
  }

  bool StderrIsTerminal() override { return ::isatty(STDERR_FILENO) == 1; }
  bool StdoutIsTerminal() override { return ::isatty(STDOUT_FILENO) == 1; }
};
}  // namespace

Status AdminEnv::SetXattr(const std::string& path, const std::string& name,
                          const std::string& value) {
  if (::setxattr(path.c_str(), name.c_str(), value.data(), value.size(), 0) != 0) {
    return Status::FromErrno(errno, path + ": setxattr " + name);
  }
  return Status::Ok();
}

AdminEnv* SystemEnv() {
  static SystemEnvImpl* env = new SystemEnvImpl();
  return env;
}

Result<int> RunProgram(const std::vector<std::string>& argv) {
  if (argv.empty()) return Invalid("RunProgram: empty argv");
  // Build argv before fork: the child may only call async-signal-safe functions.
  std::vector<char*> cargv;
  cargv.reserve(argv.size() + 1);
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);

  pid_t pid = ::fork();
  if (pid < 0) return Status::FromErrno(errno, "fork");
  if (pid == 0) {
    ::execvp(cargv[0], cargv.data());
    ::_exit(127);
  }
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) return Status::FromErrno(errno, "waitpid " + argv[0]);
  }
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return 128 + WTERMSIG(wstatus);
  return Internal("waitpid " + argv[0] + ": unexpected status");
}

// ---------------------------------------------------------------------------------------

Result<std::string> FindMountRoot(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(std::string dir, RealPath(path));
  const std::string real = dir;
  while (true) {
    std::string stats = StatsPath(dir);
    struct stat st;
    if (::stat(stats.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        ::access(stats.c_str(), R_OK) == 0) {
      return dir;
    }
    if (dir == "/") break;
    size_t slash = dir.rfind('/');
    dir = slash == 0 ? "/" : dir.substr(0, slash);
  }
  std::string msg = path + ": not inside a ckptfs mount";
  if (real != path) msg += " (" + real + ")";
  return NotFound(std::move(msg));
}

Result<std::string> ReadWholeFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return Status::FromErrno(errno, path);
  std::string data;
  char buf[64 * 1024];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n == 0) return data;
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, path);
    }
    data.append(buf, static_cast<size_t>(n));
  }
}

namespace internal {

int PrintControlFile(const std::string& path, std::string (*file_of)(const std::string&),
                     bool as_json,
                     const std::function<Result<std::string>(std::string_view)>& format,
                     std::ostream& out, std::ostream& err) {
  auto root = FindMountRoot(path);
  if (!root.ok()) {
    err << kPrefix << root.status().message() << '\n';
    return kExitError;
  }
  const std::string file = file_of(*root);
  auto text = ReadWholeFile(file);
  if (!text.ok()) {
    err << kPrefix << text.status().message() << '\n';
    return kExitError;
  }
  if (as_json) {
    out << *text;
    if (text->empty() || text->back() != '\n') out << '\n';
    return kExitOk;
  }
  auto formatted = format(*text);
  if (!formatted.ok()) {
    err << kPrefix << file << ": " << formatted.status().message() << '\n';
    return kExitError;
  }
  out << *formatted;
  return kExitOk;
}

}  // namespace internal
}  // namespace ckptfs::admin
