// ckptfs: mounts the checkpoint file system.
//
//   ckptfs [options] BACKING_DIR MOUNTPOINT
//
// Returns once the mount is ready and keeps serving in the background (-f: in the
// foreground). On unmount, SIGTERM or SIGINT it publishes everything staged before it
// exits (G8), and writes STATE_DIR/exit.json. Exit codes: 0 clean, 1 failure while
// running or unpublished data at exit, 2 bad usage or mount failure.
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/json_text.h"
#include "common/logging.h"
#include "fs/filesystem.h"
#include "fs/fuse_server.h"
#include "mount/options.h"

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

void WriteExitReport(const std::string& state_dir, bool clean, uint64_t unpublished,
                     const std::string& error) {
  nlohmann::json j = {{"pid", ::getpid()},
                      {"clean", clean},
                      {"unpublished_files", unpublished},
                      {"error", error}};
  std::string path = state_dir + "/exit.json";
  std::ofstream out(path + ".tmp");
  out << ckptfs::JsonText(j) << "\n";
  out.close();
  std::rename((path + ".tmp").c_str(), path.c_str());
}

int Serve(const ckptfs::DaemonOptions& o, ReadyPipe* ready) {
  std::error_code ec;
  std::filesystem::create_directories(o.state_dir, ec);
  std::remove((o.state_dir + "/exit.json").c_str());
  std::string log_file = o.log_file;
  if (log_file.empty() && !o.foreground) log_file = o.state_dir + "/ckptfs.log";
  if (auto st = ckptfs::SetupLogging(o.log_level, log_file); !st.ok()) {
    ready->Report(st.ToString());
    return Fail(st.ToString());
  }
  ckptfs::fs::FsConfig config;
  config.backing_dir = o.backing_dir;
  config.mountpoint = o.mountpoint;
  config.state_dir = o.state_dir;
  config.strict = o.strict;
  config.staging_bytes = o.staging_bytes;
  config.chunk_bytes = o.chunk_bytes;
  config.flush_threads = o.flush_threads;
  config.cache_bytes = o.cache_bytes;
  config.cache_direct_io = o.cache_direct_io;
  config.staging_backend = o.staging_backend;
  config.write_checksums = o.write_checksums;
  config.commit_timeout = std::chrono::seconds(o.commit_timeout_s);
  auto fs = ckptfs::fs::Filesystem::Create(config);
  if (!fs.ok()) {
    ready->Report(fs.status().message());
    if (!log_file.empty()) spdlog::error("start failed: {}", fs.status().ToString());
    return Fail(fs.status().message());
  }
  ckptfs::fs::FuseTuning tuning;
  tuning.read_ahead_bytes = o.read_ahead_bytes;
  auto server = ckptfs::fs::FuseServer::Mount(fs->get(), o.mountpoint, o.fuse_options, tuning);
  if (!server.ok()) {
    ready->Report(server.status().message());
    if (!log_file.empty()) spdlog::error("mount failed: {}", server.status().ToString());
    return Fail(server.status().message());
  }
  ready->Report("OK");
  ckptfs::Status run = (*server)->Run(o.fuse_threads);
  spdlog::info("unmounting {}", o.mountpoint);
  (*server)->Unmount();
  uint64_t unpublished = (*fs)->Shutdown();
  bool clean = run.ok() && unpublished == 0;
  WriteExitReport(o.state_dir, clean, unpublished, run.ok() ? "" : run.ToString());
  spdlog::info("ckptfs exits: {} ({} files not published)", clean ? "clean" : "NOT clean",
               unpublished);
  spdlog::shutdown();
  return clean ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  auto parsed = ckptfs::ParseDaemonOptions(argc, argv);
  if (!parsed.ok()) return Fail(parsed.status().message());
  ckptfs::DaemonOptions o = std::move(parsed).value();
  if (o.help) {
    std::fputs(o.help_text.c_str(), stdout);
    return 0;
  }
  if (auto st = ckptfs::ValidateDaemonOptions(&o); !st.ok()) return Fail(st.message());

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
    int devnull = ::open("/dev/null", O_RDWR);
    if (devnull >= 0) {
      ::dup2(devnull, STDIN_FILENO);
      ::dup2(devnull, STDOUT_FILENO);
      ::dup2(devnull, STDERR_FILENO);
      if (devnull > STDERR_FILENO) ::close(devnull);
    }
  }
  return Serve(o, &ready);
}
