// ckptfs: mounts the checkpoint file system.
//
//   ckptfs [options] BACKING_DIR MOUNTPOINT
//   mount.fuse.ckptfs BACKING_DIR MOUNTPOINT [-sfnv] [-o OPTIONS]   (from mount(8))
//
// Returns once the mount is ready and keeps serving in the background (-f: in the
// foreground, and under systemd Type=notify it reports READY=1 with sd_notify). On
// unmount, SIGTERM or SIGINT it publishes everything staged before it exits (G8), and
// writes STATE_DIR/exit.json. While the stop waits for a halted or waiting publication it
// says what for in STATE_DIR/stopping.json (ckptfs-admin unmount prints it); with no
// progress for --stop-timeout it leaves the rest for the next start. SIGHUP reopens the log
// file. Exit codes: 0 clean, 1 failure while running or unpublished data at exit, 2 bad
// usage or mount failure (then nothing is left mounted, and a state dir this run created is
// removed again), 3 stopped with journal entries left for the next start (nothing lost).
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/heap.h"
#include "common/json_text.h"
#include "common/lock_code.h"
#include "common/logging.h"
#include "fs/filesystem.h"
#include "fs/transport/fuse_server.h"
#include "mount/metrics_server.h"
#include "mount/options.h"
#include "mount/peers_watch.h"
#include "store/peer/peers.h"
#include "store/primitives/fault_injection.h"

namespace {

int Fail(const std::string& msg, int code = 2) {
  std::fprintf(stderr, "ckptfs: error: %s\n", msg.c_str());
  return code;
}

// Lets the parent of a daemonized child know how the mount went.
class ReadyPipe {
 public:
  void SetFd(int fd) { fd_ = fd; }
  void Report(const std::string& message) {
    if (fd_ < 0) return;
    ssize_t n = ::write(fd_, message.data(), message.size());
    (void)n;
    ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Reopens the log file on SIGHUP (logrotate's postrotate). SIGHUP is blocked in every
// thread (Block() runs before any thread exists) and taken here with sigwait, so no
// thread is interrupted and libfuse's handler, which would unmount, never runs.
class SighupReopener {
 public:
  static void Block() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
  }
  // `also` runs on each SIGHUP after the log is reopened (the peers file is read again).
  void Start(std::function<void()> also = {}) {
    also_ = std::move(also);
    thread_ = std::thread([this] {
      sigset_t set;
      sigemptyset(&set);
      sigaddset(&set, SIGHUP);
      while (true) {
        int sig = 0;
        if (sigwait(&set, &sig) != 0) continue;
        if (stop_.load()) return;
        ckptfs::Status st = ckptfs::ReopenLogFile();
        if (st.ok()) {
          spdlog::info("SIGHUP: log file reopened");
        } else {
          spdlog::error("SIGHUP: {}", st.ToString());
        }
        if (also_) also_();
      }
    });
  }
  // Joins the thread; SIGHUP stays blocked (pending ones are dropped at exit).
  void Stop() {
    if (!thread_.joinable()) return;
    stop_.store(true);
    pthread_kill(thread_.native_handle(), SIGHUP);
    thread_.join();
  }
  ~SighupReopener() { Stop(); }

 private:
  std::atomic<bool> stop_{false};
  std::function<void()> also_;
  std::thread thread_;
};

// Exit code 3: the stop left journal entries for the next start (nothing lost).
constexpr int kExitLeftForResume = 3;

void WriteExitReport(const std::string& state_dir, bool clean, uint64_t unpublished,
                     const std::string& error, uint64_t left = 0,
                     const std::string& waiting_for = "") {
  nlohmann::json j = {{"pid", ::getpid()},
                      {"clean", clean},
                      {"unpublished_files", unpublished},
                      {"left_for_resume", left},
                      {"waiting_for", waiting_for},
                      {"error", error}};
  std::string path = state_dir + "/exit.json";
  std::ofstream out(path + ".tmp");
  out << ckptfs::JsonText(j) << "\n";
  out.close();
  std::rename((path + ".tmp").c_str(), path.c_str());
}

// Stdio goes to /dev/null once the mount is up (a daemon must not hold its starter's
// terminal or pipe open); until then libfuse's and our errors reach the caller.
void DetachStdio() {
  int devnull = ::open("/dev/null", O_RDWR);
  if (devnull < 0) return;
  ::dup2(devnull, STDIN_FILENO);
  ::dup2(devnull, STDOUT_FILENO);
  ::dup2(devnull, STDERR_FILENO);
  if (devnull > STDERR_FILENO) ::close(devnull);
}

using PeerOptionsPtr = std::shared_ptr<const ckptfs::store::peer::PeerNodeOptions>;

// The peer options from the command line, with the secret read; null without --peers.
ckptfs::Result<PeerOptionsPtr> PeerOptions(const ckptfs::DaemonOptions& o) {
  if (o.peers.empty()) return PeerOptionsPtr();
  namespace peer = ckptfs::store::peer;
  if (ckptfs::Status st = peer::PeerTransportAvailable(); !st.ok()) {
    return ckptfs::Status(st.code(), "--peers: " + st.message());
  }
  auto p = std::make_shared<peer::PeerNodeOptions>();
  p->nodes = o.peers;
  p->self = static_cast<uint32_t>(o.node_rank);
  p->listen = o.peer_listen;
  auto secret = peer::ReadSecretFile(o.peer_secret_file);
  if (!secret.ok()) {
    return ckptfs::Status(secret.status().code(),
                          "--peer-secret-file " + o.peer_secret_file + ": " +
                              secret.status().message());
  }
  p->secret = std::move(secret).value();
  auto mode = peer::ParsePlanMode(o.plan);
  if (!mode.ok()) return mode.status();
  p->plan_mode = *mode;
  p->request_timeout = std::chrono::milliseconds(o.peer_timeout_ms);
  p->dead_after = std::chrono::milliseconds(o.peer_dead_after_ms);
  p->heartbeat = std::chrono::milliseconds(o.peer_heartbeat_ms);
  p->max_links = static_cast<size_t>(o.peer_max_links);
  p->connect_timeout = std::chrono::milliseconds(std::min(o.peer_timeout_ms, 3000));
  return PeerOptionsPtr(std::move(p));
}

int Serve(const ckptfs::DaemonOptions& o, PeerOptionsPtr peers, ReadyPipe* ready) {
  SighupReopener::Block();  // before any thread exists, so that every thread inherits it
  std::error_code ec;
  const bool new_state_dir = !std::filesystem::exists(o.state_dir, ec);
  std::filesystem::create_directories(o.state_dir, ec);
  std::remove((o.state_dir + "/exit.json").c_str());
  std::remove((o.state_dir + "/stopping.json").c_str());
  std::string log_file = o.log_file;
  if (log_file.empty() && !o.foreground) log_file = o.state_dir + "/ckptfs.log";
  ckptfs::LogRotation rotation;
  rotation.max_bytes = o.log_max_bytes;
  rotation.max_files = o.log_max_files;
  // A failed start leaves no state behind: a state dir made by this run goes again.
  auto fail_start = [&](const std::string& what, const ckptfs::Status& st) {
    ready->Report(st.message());
    if (!log_file.empty()) spdlog::error("{}: {}", what, st.ToString());
    if (new_state_dir && (o.log_file.empty() || log_file.rfind(o.state_dir + "/", 0) != 0)) {
      std::filesystem::remove_all(o.state_dir, ec);
    }
    // In the background the parent prints the reason it got through the pipe.
    return o.foreground ? Fail(st.message()) : 2;
  };
  if (auto st = ckptfs::SetupLogging(o.log_level, log_file, rotation); !st.ok()) {
    return fail_start("logging", st);
  }
  if (!log_file.empty()) {  // on stderr, a failed start stays one line
    spdlog::info("{} starting: {} on {}", ckptfs::VersionLine("ckptfs"), o.backing_dir,
                 o.mountpoint);
  }
  // Before the threads start: transient MiB-sized buffers are mapped and given back at
  // free, not kept in the arenas' heaps (common/heap.h).
  if (!ckptfs::ConfigureHeap()) spdlog::warn("heap: the fixed mmap threshold was refused");
  ckptfs::fs::FsConfig config;
  config.backing_dir = o.backing_dir;
  config.mountpoint = o.mountpoint;
  config.state_dir = o.state_dir;
  config.journal_trace = o.journal_trace;
  config.strict = o.strict;
  config.staging_bytes = o.staging_bytes;
  config.chunk_bytes = o.chunk_bytes;
  config.flush_threads = o.flush_threads;
  config.cache_bytes = o.cache_bytes;
  config.retain_bytes = o.retain_bytes;  // issue 23
  config.memory_ckpt_bytes = o.memory_ckpt_bytes;  // issue 42
  config.retain_replicas = o.retain_replicas >= 0 ? o.retain_replicas : (o.peers.empty() ? 0 : 1);
  config.cache_direct_io = o.cache_direct_io;
  config.passthrough = o.passthrough;
  config.passthrough_min_bytes = o.passthrough_min_bytes;
  config.staging_backend = o.staging_backend;
  config.staging_hugepages = o.staging_hugepages;
  config.staging_release_after_s = o.staging_release_after_s;
  config.flush_direct_io = o.flush_direct_io;
  config.write_checksums = o.write_checksums;
  config.commit_timeout = std::chrono::seconds(o.commit_timeout_s);
  config.max_pending = static_cast<size_t>(o.max_pending);
  config.stop_timeout = std::chrono::seconds(o.stop_timeout_s);
  config.peers = std::move(peers);
  if (config.peers) {
    spdlog::info("peers: node {} of {} ({}), listening on {}, plan {}", o.node_rank,
                 o.peers.size(), o.peers[static_cast<size_t>(o.node_rank)], o.peer_listen, o.plan);
  }
  std::unique_ptr<ckptfs::MetricsServer> metrics;
  std::unique_ptr<ckptfs::fs::FuseServer> server;
  ckptfs::fs::FsDeps deps;
  if (!o.fault_inject.empty()) {  // test only: parsed (and refused if bad) in main()
    auto spec = ckptfs::store::FaultSpec::Parse(o.fault_inject);
    if (!spec.ok()) return fail_start("start failed", spec.status());
    auto faulty = ckptfs::store::FaultInjectingBackingDir::Open(o.backing_dir, *spec);
    if (!faulty.ok()) return fail_start("start failed", faulty.status());
    deps.backing = std::move(faulty).value();
  }
  auto fs_or = ckptfs::fs::Filesystem::Create(config, std::move(deps));
  if (!fs_or.ok()) return fail_start("start failed", fs_or.status());
  std::unique_ptr<ckptfs::fs::Filesystem> fs = std::move(fs_or).value();
  if (!o.metrics_listen.empty()) {
    ckptfs::fs::Filesystem* raw = fs.get();
    auto m = ckptfs::MetricsServer::Start(o.metrics_host, o.metrics_port,
                                          [raw] { return raw->control()->MetricsText(); });
    if (!m.ok()) {
      fs.reset();
      return fail_start("start failed", m.status());
    }
    metrics = std::move(m).value();
  }
  ckptfs::fs::FuseTuning tuning;
  tuning.read_ahead_bytes = o.read_ahead_bytes;
  tuning.splice_writes = o.fuse_splice;
  using DirectWrites = ckptfs::fs::FuseTuning::DirectWrites;
  tuning.direct_writes = o.fuse_direct_writes == "on"    ? DirectWrites::kOn
                         : o.fuse_direct_writes == "off" ? DirectWrites::kOff
                                                         : DirectWrites::kAuto;
  tuning.fsname = o.backing_dir;
  using Uring = ckptfs::fs::FuseTuning::Uring;
  tuning.uring = o.fuse_uring == "on" ? Uring::kOn : o.fuse_uring == "off" ? Uring::kOff : Uring::kAuto;
  tuning.uring_max_threads = o.fuse_threads;
  tuning.replace_dead_mount = o.replaces_dead_mount;
  auto server_or = ckptfs::fs::FuseServer::Mount(fs.get(), o.mountpoint, o.fuse_options, tuning);
  if (!server_or.ok()) {
    metrics.reset();
    fs.reset();
    return fail_start("mount failed", server_or.status());
  }
  server = std::move(server_or).value();
  // Every request waits on the daemon's code: keep it from being paged out (common/lock_code.h).
  const ckptfs::CodeLock code = ckptfs::LockCodeInMemory();
  if (code.failed == 0) {
    spdlog::info("code locked in memory: {} MiB of the executable and {} libraries",
                 code.bytes >> 20, code.objects - 1);
  } else {
    spdlog::warn("code not all locked in memory ({} MiB locked, {} MiB refused: {}); under "
                 "memory pressure requests may wait for the daemon's code to be paged in",
                 code.bytes >> 20, code.failed >> 20, code.error);
  }
  // Membership follows the scheduler: --peers-file is read again when it changes and on
  // SIGHUP (docs/PEERS.md, "Membership").
  std::unique_ptr<ckptfs::PeersFileWatcher> peers_watch;
  if (!o.peers.empty() && !o.peers_file.empty()) {
    peers_watch = std::make_unique<ckptfs::PeersFileWatcher>(
        o.peers_file,
        [&fs](const std::vector<std::string>& nodes) { return fs->UpdatePeers(nodes); },
        [&fs](const std::string& why) { (void)fs->UpdatePeers(ckptfs::Invalid(why)); });
    peers_watch->Start();
  }
  SighupReopener reopener;
  reopener.Start([&peers_watch] {
    if (peers_watch) peers_watch->Poke();
  });
  ready->Report("OK");
  if (!o.foreground) DetachStdio();
  sd_notifyf(0, "READY=1\nMAINPID=%d\nSTATUS=serving %s", static_cast<int>(::getpid()),
             o.mountpoint.c_str());
  ckptfs::Status run = server->Run(o.fuse_threads);
  reopener.Stop();  // before the watcher it pokes goes
  if (peers_watch) peers_watch->Stop();
  sd_notify(0, "STOPPING=1\nSTATUS=draining: publishing everything staged");
  spdlog::info("unmounting {}", o.mountpoint);
  server->Unmount();
  // What the stop waits for, for ckptfs-admin unmount (the mount is gone by now).
  const std::string stopping = o.state_dir + "/stopping.json";
  const ckptfs::fs::ShutdownReport stopped = fs->Shutdown([&](const std::string& what) {
    nlohmann::json j = {{"pid", ::getpid()},
                        {"waiting_for", what},
                        {"stop_timeout_s", o.stop_timeout_s},
                        {"since", static_cast<double>(::time(nullptr))}};
    std::ofstream out(stopping + ".tmp");
    out << ckptfs::JsonText(j) << "\n";
    out.close();
    std::rename((stopping + ".tmp").c_str(), stopping.c_str());
    if (!what.empty()) {
      sd_notifyf(0, "STATUS=draining: waiting for %s", what.c_str());
    }
  });
  std::remove(stopping.c_str());
  const uint64_t unpublished = stopped.unpublished;
  const uint64_t left = stopped.stop.left;
  metrics.reset();
  reopener.Stop();  // nothing may log after spdlog::shutdown()
  // Nor any thread of the file system: the peer links' watcher logged a lost connection
  // after spdlog::shutdown() (the logger freed) and the daemon died of SIGSEGV at a clean
  // stop (the soak, async on two nodes, seed 4202). The server first: it holds `fs`.
  server.reset();
  fs.reset();
  bool clean = run.ok() && unpublished == 0 && left == 0;
  std::string error = run.ok() ? "" : run.ToString();
  if (left > 0 && error.empty()) {
    error = std::to_string(left) + " journal entries left for the next start; publication " +
            "waited for: " + stopped.stop.waiting_for;
  }
  WriteExitReport(o.state_dir, clean, unpublished, error, left, stopped.stop.waiting_for);
  spdlog::info("ckptfs exits: {} ({} files not published, {} journal entries left for the "
               "next start)",
               clean ? "clean" : "NOT clean", unpublished, left);
  spdlog::shutdown();
  if (clean) return 0;
  return run.ok() && unpublished == 0 ? kExitLeftForResume : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // As mount.fuse.ckptfs (mount -t fuse.ckptfs, fstab), argv follows mount(8)'s helper
  // convention.
  auto parsed = ckptfs::IsMountHelperName(argv[0]) ? ckptfs::ParseMountHelperArgs(argc, argv)
                                                   : ckptfs::ParseDaemonOptions(argc, argv);
  if (!parsed.ok()) return Fail(parsed.status().message());
  ckptfs::DaemonOptions o = std::move(parsed).value();
  if (o.help || o.version) {
    std::fputs(o.help_text.c_str(), stdout);
    return 0;
  }
  if (auto st = ckptfs::ValidateDaemonOptions(&o); !st.ok()) return Fail(st.message());
  auto peers = PeerOptions(o);
  if (!peers.ok()) return Fail(peers.status().message());
  if (!o.fault_inject.empty()) {
    if (auto spec = ckptfs::store::FaultSpec::Parse(o.fault_inject); !spec.ok()) {
      return Fail(spec.status().message());
    }
  }
  if (o.fake) return 0;  // mount -f

  ReadyPipe ready;
  if (!o.foreground) {
    // Fork before any thread exists (RocksDB, CUDA, flush threads); the parent waits
    // until the child reports the mount ready, so `ckptfs ...; ls MOUNT` just works.
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return Fail("pipe failed");
    pid_t pid = ::fork();
    if (pid < 0) return Fail("fork failed");
    if (pid > 0) {
      ::close(fds[1]);
      std::string msg;
      char buf[512];
      ssize_t n;
      while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) msg.append(buf, static_cast<size_t>(n));
      if (msg == "OK") return 0;
      return Fail(msg.empty() ? "daemon exited before mounting" : msg);
    }
    ::close(fds[0]);
    ready.SetFd(fds[1]);
    ::setsid();
    if (::chdir("/") != 0) return 1;
  }
  return Serve(o, std::move(peers).value(), &ready);
}
