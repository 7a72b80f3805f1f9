#define FUSE_USE_VERSION 312
#include "fs/transport/fuse_server.h"

#include <libmount/libmount.h>

#include <fuse3/fuse_log.h>
#include <fuse3/fuse_lowlevel.h>
#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/thread_name.h"
#include "fs/transport/fuse_ops.h"

namespace ckptfs::fs {
namespace {

// The "major:minor" of the newest mount on `mountpoint`, from /proc/self/mountinfo (via
// libmount). Not stat(): the mount is ours and nobody serves it yet, so a stat would wait
// forever.
std::string MountDevice(const std::string& mountpoint) {
  libmnt_table* table = mnt_new_table();
  if (table == nullptr) return "";
  std::string device;
  if (mnt_table_parse_file(table, "/proc/self/mountinfo") == 0) {
    // Backward: the last line for a target is the newest mount on it.
    if (libmnt_fs* fs = mnt_table_find_target(table, mountpoint.c_str(), MNT_ITER_BACKWARD)) {
      const dev_t dev = mnt_fs_get_devno(fs);
      device = std::to_string(major(dev)) + ":" + std::to_string(minor(dev));
    }
  }
  mnt_unref_table(table);
  return device;
}

// Sets read_ahead_kb of the mount's bdi (named after its anonymous device, "0:NN"). It
// must happen before the INIT request is answered: the kernel then lowers the bdi's
// read-ahead to min(read_ahead_kb, INIT's max_readahead), and later leaves it alone.
// Needs root (sysfs); without it the kernel default stays, with a log line.
void SetReadAhead(const std::string& mountpoint, uint64_t bytes) {
  const std::string device = MountDevice(mountpoint);
  if (device.empty()) {
    spdlog::warn("read-ahead: cannot find the device of {}; the kernel default stays",
                 mountpoint);
    return;
  }
  const std::string path = "/sys/class/bdi/" + device + "/read_ahead_kb";
  const std::string kb = std::to_string(bytes >> 10);
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  bool ok = fd >= 0 && ::write(fd, kb.data(), kb.size()) == static_cast<ssize_t>(kb.size());
  if (!ok) {
    spdlog::warn("read-ahead: cannot set {} to {} KiB ({}); the kernel default stays", path, kb,
                 std::strerror(errno));
  } else {
    spdlog::info("read-ahead: {} KiB ({})", kb, path);
  }
  if (fd >= 0) ::close(fd);
}

// Custom I/O on /dev/fuse (fuse_session_custom_io): plain read/writev/splice, with the
// INIT exchange shown to the InitPatcher (fs/transport/passthrough.h). `userdata` is the session's.
ssize_t IoRead(int fd, void* buf, size_t len, void* userdata) {
  const ssize_t n = ::read(fd, buf, len);
  auto* context = static_cast<FuseServer::Context*>(userdata);
  if (n > 0 && context->init != nullptr) {
    const int saved = errno;
    context->init->OnRequest(buf, static_cast<size_t>(n));
    errno = saved;
  }
  return n;
}

// The kernel's io_uring switch is global, and what INIT offers is fixed when mount(2) runs:
// a daemon that turns it on for its own INIT (FuseTuning::Uring::kOn) holds this lock from
// before its mount to its INIT reply, so that daemons starting together neither see each
// other's switch nor turn it off under each other. Waits at most 10 s; false without it.
constexpr char kUringLock[] = "/run/lock/ckptfs-fuse-uring.lock";
bool TakeKernelUring(FuseServer::Context* context) {
  int fd = ::open(kUringLock, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) fd = ::open("/tmp/ckptfs-fuse-uring.lock", O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  for (int i = 0; ::flock(fd, LOCK_EX | LOCK_NB) != 0; ++i) {
    if (errno != EWOULDBLOCK || i >= 1000) {
      ::close(fd);
      return false;
    }
    ::usleep(10000);
  }
  context->uring_lock_fd = fd;
  Result<bool> enabled = FuseUring::KernelEnabled();
  if (enabled.ok() && !*enabled) {
    if (Status st = FuseUring::SetKernelEnabled(true); st.ok()) {
      context->restore_kernel_uring = true;
    } else {
      spdlog::warn("fuse: io_uring: cannot turn fuse.enable_uring on ({}); requests come "
                   "over /dev/fuse",
                   st.message());
    }
  }
  return true;
}

// Puts the switch back as it was and lets the next daemon take the lock.
void ReleaseKernelUring(FuseServer::Context* context) {
  if (context->restore_kernel_uring) {
    context->restore_kernel_uring = false;
    if (Status st = FuseUring::SetKernelEnabled(false); !st.ok()) {
      spdlog::warn("fuse: io_uring: cannot turn fuse.enable_uring back off: {}", st.message());
    }
  }
  if (context->uring_lock_fd >= 0) {
    ::close(context->uring_lock_fd);  // releases the flock
    context->uring_lock_fd = -1;
  }
}

// The INIT reply was written (`ok`) or not: FUSE over io_uring starts if it asked for it,
// and the kernel's switch goes back off if this mount turned it on.
void AfterInitReply(FuseServer::Context* context, bool ok) {
  ReleaseKernelUring(context);
  FuseTransportStats* transport = &context->fs->stats()->fuse;
  if (context->uring == nullptr) return;
  if (!context->init->uring_offered()) {
    transport->SetState("/dev/fuse: this kernel does not offer io_uring (fuse.enable_uring "
                        "is off, or Linux before 6.14)");
  } else if (!ok) {
    transport->SetState("/dev/fuse: the INIT reply failed");
  } else if (context->init->uring_patched()) {
    context->uring->Start(context->init->max_payload());
  }
}

ssize_t IoWritev(int fd, struct iovec* iov, int count, void* userdata) {
  auto* context = static_cast<FuseServer::Context*>(userdata);
  if (context->uring != nullptr && context->uring->TakeReply(iov, count)) {
    size_t n = 0;
    for (int i = 0; i < count; ++i) n += iov[i].iov_len;
    return static_cast<ssize_t>(n);
  }
  const bool init = context->init != nullptr && context->init->OnReply(iov, count);
  const ssize_t n = ::writev(fd, iov, count);
  if (init) {
    const int saved = errno;
    AfterInitReply(context, n >= 0);
    errno = saved;
  }
  return n;
}

ssize_t IoSpliceReceive(int fdin, off_t* offin, int fdout, off_t* offout, size_t len,
                        unsigned int flags, void*) {
  return ::splice(fdin, offin, fdout, offout, len, flags);
}

// libfuse's own messages (e.g. "fuse: unknown option(s): `-o foo'"), kept so that a failed
// mount can say why, and logged.
Mutex g_fuse_log_mu;
std::string g_fuse_partial GUARDED_BY(g_fuse_log_mu);  // a line libfuse has not ended yet
std::string g_fuse_log GUARDED_BY(g_fuse_log_mu);      // the lines of the current Mount()

// libfuse may write one message in several calls ("unknown option(s): `", "-o ", ...):
// whole lines are logged and kept.
void FuseLog(enum fuse_log_level level, const char* fmt, va_list ap) {
  char buf[1024];
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  std::vector<std::string> lines;
  {
    MutexLock lock(&g_fuse_log_mu);
    g_fuse_partial += buf;
    size_t nl;
    while ((nl = g_fuse_partial.find('\n')) != std::string::npos) {
      lines.push_back(g_fuse_partial.substr(0, nl));
      g_fuse_partial.erase(0, nl + 1);
      if (level <= FUSE_LOG_WARNING && g_fuse_log.size() < 4096) {
        if (!g_fuse_log.empty()) g_fuse_log += "; ";
        g_fuse_log += lines.back();
      }
    }
  }
  for (const auto& line : lines) {
    if (level <= FUSE_LOG_ERR) {
      spdlog::error("{}", line);
    } else {
      spdlog::debug("{}", line);
    }
  }
}

// "fuse: cannot mount on X" plus what libfuse said about it.
std::string WithFuseLog(std::string message) {
  MutexLock lock(&g_fuse_log_mu);
  std::string said = g_fuse_log;
  if (!g_fuse_partial.empty()) said += (said.empty() ? "" : "; ") + g_fuse_partial;
  if (!said.empty()) message += ": " + said;
  return message;
}

// fuse_opt splits option groups at commas; a backslash escapes one.
std::string EscapeOptionValue(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == ',' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// Detaches the dead mount a killed daemon left at `mountpoint`, right before this daemon
// mounts there: until now the application's calls failed with ENOTCONN; for the moment
// in between they reach the directory underneath (a dead mount cannot be mounted over:
// mount(2) must stat its target). Root detaches it itself; a user's daemon through
// fusermount3, as libfuse mounts.
Status DetachDeadMount(const std::string& mountpoint) {
  if (::umount2(mountpoint.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0) {
    const int err = errno;
    if (err == EINVAL) return Status::Ok();  // not a mount any more: detached meanwhile
    if (err != EPERM) return Status::FromErrno(err, "detach the dead mount at " + mountpoint);
    const char* argv[] = {"fusermount3", "-u", "-z", mountpoint.c_str(), nullptr};
    pid_t pid = 0;
    int status = 0;
    if (::posix_spawnp(&pid, "fusermount3", nullptr, nullptr, const_cast<char**>(argv),
                       environ) != 0 ||
        ::waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      return Status(Code::kBusy, "mountpoint " + mountpoint +
                                     " holds the mount of a daemon that is gone (Transport "
                                     "endpoint is not connected) and it cannot be detached; "
                                     "run: fusermount3 -u -z " + mountpoint);
    }
  }
  spdlog::warn("fuse: {} held the mount of a ckptfs that was killed (Transport endpoint is "
               "not connected): detached, mounting again", mountpoint);
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<FuseServer>> FuseServer::Mount(Filesystem* fs, const std::string& mountpoint,
                                                      const std::vector<std::string>& options,
                                                      const FuseTuning& tuning) {
  // default_permissions: the kernel checks mode bits, owners and the sticky bit against
  // the attributes ckptfs reports, for every request, before it reaches the daemon. That
  // is exactly POSIX for a mount shared by several users (allow_other), costs no round
  // trip, and the daemon's view (the overlay) is what the checks must see: attributes of
  // staged and unpublished names live only here, so checking against the backing store
  // could not be right. Where the kernel needs the daemon (who may chown, chmod and set
  // times, what a chown clears, the owner of a new name) the daemon applies the same
  // rules (fs/namespace/posix_access.h). Without it, a root mount with allow_other would let any
  // user read and overwrite every file.
  // df and mount show the backing dir as the source and "fuse.ckptfs" as the type.
  const std::string fsname = tuning.fsname.empty() ? "ckptfs" : tuning.fsname;
  std::vector<std::string> argv_store = {
      "ckptfs", "-o",
      "fsname=" + EscapeOptionValue(fsname) + ",subtype=ckptfs,default_permissions"};
  for (const auto& o : options) {
    argv_store.push_back("-o");
    argv_store.push_back(o);
  }
  std::vector<char*> argv;
  for (auto& s : argv_store) argv.push_back(s.data());
  struct fuse_args args = FUSE_ARGS_INIT(static_cast<int>(argv.size()), argv.data());
  {
    MutexLock lock(&g_fuse_log_mu);
    g_fuse_log.clear();
    g_fuse_partial.clear();
  }
  fuse_set_log_func(FuseLog);
  std::unique_ptr<FuseServer> server(new FuseServer());
  server->context_.fs = fs;
  server->context_.tuning = tuning;
  server->passthrough_ =
      std::make_unique<PassthroughTable>(PassthroughTable::Options{}, &fs->stats()->passthrough);
  server->context_.passthrough = server->passthrough_.get();
  server->session_ = fuse_session_new(&args, &FuseOps(), sizeof(FuseOps()), &server->context_);
  if (server->session_ == nullptr) {
    return Invalid(WithFuseLog("fuse: cannot create session (bad -o option?)"));
  }
  server->context_.session = server->session_;
  // The kernel decides what INIT offers when the mount is made: kOn turns its io_uring
  // switch on first, and AfterInitReply turns it back off.
  bool want_uring = tuning.uring != FuseTuning::Uring::kOff;
  if (want_uring) {
    Result<bool> enabled = FuseUring::KernelEnabled();
    if (!enabled.ok()) {
      spdlog::info("fuse: io_uring: {}; requests come over /dev/fuse", enabled.status().message());
      fs->stats()->fuse.SetState("/dev/fuse: " + enabled.status().message());
      want_uring = false;
    } else if (tuning.uring == FuseTuning::Uring::kOn && ::geteuid() == 0 &&
               !TakeKernelUring(&server->context_)) {
      spdlog::warn("fuse: io_uring: another daemon holds {} for its start; this mount asks "
                   "only if the switch is on", kUringLock);
    }
  }
  if (tuning.replace_dead_mount) {
    Status detached = DetachDeadMount(mountpoint);
    if (!detached.ok()) {
      ReleaseKernelUring(&server->context_);
      return detached;
    }
  }
  const int mounted = fuse_session_mount(server->session_, mountpoint.c_str());
  if (mounted != 0) {
    ReleaseKernelUring(&server->context_);
    return Status(Code::kIo, WithFuseLog("fuse: cannot mount on " + mountpoint));
  }
  server->mounted_ = true;
  // The loop has not started, so INIT is not read yet: custom I/O on the session's own
  // descriptor lets the InitPatcher ask for passthrough and io_uring (libfuse 3.14 can do
  // neither). Splice stays as it was (splice_receive); replies are never spliced (OpInit).
  if (fs->config().passthrough || want_uring) {
    server->init_ = std::make_unique<InitPatcher>(fs->config().passthrough, want_uring);
    struct fuse_custom_io io;
    std::memset(&io, 0, sizeof(io));
    io.read = IoRead;
    io.writev = IoWritev;
    io.splice_receive = IoSpliceReceive;
    const int rc = fuse_session_custom_io(server->session_, &io, fuse_session_fd(server->session_));
    if (rc == 0) {
      server->context_.init = server->init_.get();
    } else {
      spdlog::warn("fuse: custom I/O not installed ({}); passthrough and io_uring off", rc);
      fs->stats()->fuse.SetState("/dev/fuse: libfuse custom I/O unavailable");
      want_uring = false;
      ReleaseKernelUring(&server->context_);
    }
  }
  if (want_uring) {
    FuseUringOptions uo;
    const int queues = FuseUring::PossibleCpus();
    // Many queues (a big machine, or hot-plug CPUs counted as possible): one thread each to
    // begin with; a queue's first request starts more (FuseUringOptions::spare_entries).
    if (queues > 16) uo.min_threads_per_queue = 1;
    uo.max_threads_per_queue = std::max(uo.min_threads_per_queue, tuning.uring_max_threads / queues);
    struct fuse_session* session = server->session_;
    FuseServer* self = server.get();
    server->uring_ = std::make_unique<FuseUring>(
        fuse_session_fd(session), uo,
        [session](char* request, size_t size) {
          struct fuse_buf buf;
          std::memset(&buf, 0, sizeof(buf));
          buf.size = size;
          buf.mem = request;
          fuse_session_process_buf(session, &buf);
        },
        [session, self](const std::string& why) {
          // As on SIGTERM: the loop ends, publication is handed over, the mount goes. The
          // signal wakes libfuse's loop, whose workers wait on /dev/fuse, where no request
          // comes any more.
          spdlog::error("fuse: {}; stopping", why);
          fuse_session_exit(session);
          if (self->signals_) ::kill(::getpid(), SIGTERM);
        },
        &fs->stats()->fuse);
    server->context_.uring = server->uring_.get();
  }
  // The loop has not started, so INIT is not answered yet (see SetReadAhead).
  if (tuning.read_ahead_bytes > 0) SetReadAhead(mountpoint, tuning.read_ahead_bytes);
  // libfuse ends the loop on SIGTERM, SIGINT and SIGHUP. SIGHUP is the program's (it
  // reopens the log: logrotate sends it), so its disposition is put back as it was.
  struct sigaction hup;
  ::sigaction(SIGHUP, nullptr, &hup);
  if (fuse_set_signal_handlers(server->session_) == 0) server->signals_ = true;
  ::sigaction(SIGHUP, &hup, nullptr);
  // What the kernel caches of names and files changed behind its back (a checkpoint
  // directory another node removed, files another node wrote again), dropped by a thread
  // of its own (fs/transport/entry_invalidator.h, fs/namespace/kernel_cache.h).
  server->invalidator_ = std::make_shared<EntryInvalidator>(server->session_);
  server->context_.invalidate = [inv = server->invalidator_](uint64_t ino,
                                                             const std::string& name) {
    inv->Push(ino, name);
  };
  spdlog::info("mounted on {}", mountpoint);
  return server;
}

FuseServer::~FuseServer() {
  ReleaseKernelUring(&context_);  // when no INIT reply came
  Unmount();
  if (invalidator_) invalidator_->Stop();  // its queue sent (or refused: the session ended)
  if (uring_) uring_->Stop();  // before the session's descriptor goes
  if (session_ != nullptr) fuse_session_destroy(session_);
}

void FuseServer::Unmount() {
  if (signals_) {
    fuse_remove_signal_handlers(session_);
    signals_ = false;
  }
  if (mounted_) {
    fuse_session_unmount(session_);
    mounted_ = false;
  }
}

Status FuseServer::Run(int max_threads) {
  struct fuse_loop_config* cfg = fuse_loop_cfg_create();
  fuse_loop_cfg_set_max_threads(cfg, static_cast<unsigned>(max_threads));
  fuse_loop_cfg_set_idle_threads(cfg, 8);
  // A stop (SIGTERM, SIGINT, unmount) ends the loop only once every worker has finished
  // its request, and the stop's own hand-over runs after that (G10). A worker blocked in a
  // journal wait (a strict operation behind a commit that waits for shards) would keep the
  // daemon alive for ever: once the session has exited, such waits are released with an
  // error that says what publication waits for.
  std::mutex watch_mu;
  std::condition_variable watch_cv;
  bool loop_done = false;
  std::thread watcher([&] {
    NameThisThread("ckptfs-stopwatch");
    std::unique_lock lock(watch_mu);
    while (!loop_done) {
      if (fuse_session_exited(session_)) {
        lock.unlock();
        context_.fs->OnStopRequested();
        return;
      }
      watch_cv.wait_for(lock, std::chrono::milliseconds(100));
    }
  });
  int rc = fuse_session_loop_mt(session_, cfg);
  {
    std::lock_guard lock(watch_mu);
    loop_done = true;
  }
  watch_cv.notify_all();
  watcher.join();
  if (uring_) {
    // Ring threads finish the request each serves, as libfuse's workers did: release
    // those in a journal wait first (the watcher may have missed the exit).
    context_.fs->OnStopRequested();
    uring_->Stop();
  }
  fuse_loop_cfg_destroy(cfg);
  if (rc < 0) return Status::FromErrno(-rc, "fuse loop");
  return Status::Ok();
}

}  // namespace ckptfs::fs
