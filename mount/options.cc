#include "mount/options.h"

#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace ckptfs {
namespace {

bool IsInside(const std::string& path, const std::string& dir) {
  if (path == dir) return true;
  std::string prefix = dir == "/" ? dir : dir + "/";
  return path.compare(0, prefix.size(), prefix) == 0;
}

// Unescapes the octal escapes (\040 for a space) of /proc/self/mountinfo.
std::string UnescapeMountPath(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() + 0 && i + 3 <= s.size() - 1 + 1) {
      int v = 0;
      bool ok = true;
      for (size_t k = 1; k <= 3; ++k) {
        if (i + k >= s.size() || s[i + k] < '0' || s[i + k] > '7') ok = false;
        else v = v * 8 + (s[i + k] - '0');
      }
      if (ok) {
        out.push_back(static_cast<char>(v));
        i += 3;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

Result<std::string> Canonical(const std::string& path, const char* what) {
  std::error_code ec;
  auto p = std::filesystem::canonical(path, ec);
  if (ec) return Status(Code::kNotFound, std::string(what) + " " + path + ": " + ec.message());
  struct stat st;
  if (::stat(p.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Status(Code::kNotDir, std::string(what) + " " + path + " is not a directory");
  }
  return p.string();
}

}  // namespace

Result<uint64_t> ParseSize(const std::string& text) {
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) {
    return Invalid("bad size '" + text + "' (use e.g. 512M, 2G)");
  }
  size_t pos = 0;
  unsigned long long n = 0;
  try {
    n = std::stoull(text, &pos);
  } catch (...) {
    return Invalid("bad size '" + text + "'");
  }
  std::string unit = text.substr(pos);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit.size() > 1 && std::string("KMGT").find(unit[0]) != std::string::npos &&
      (unit.substr(1) == "IB" || unit.substr(1) == "B")) {
    unit = unit.substr(0, 1);
  }
  int shift = 0;
  if (unit.empty() || unit == "B") shift = 0;
  else if (unit == "K") shift = 10;
  else if (unit == "M") shift = 20;
  else if (unit == "G") shift = 30;
  else if (unit == "T") shift = 40;
  else return Invalid("bad size unit in '" + text + "' (use K, M, G or T)");
  if (shift > 0 && n > (~0ULL >> shift)) return Invalid("size too large: " + text);
  return static_cast<uint64_t>(n) << shift;
}

Result<DaemonOptions> ParseDaemonOptions(int argc, const char* const* argv) {
  DaemonOptions o;
  CLI::App app{"ckptfs: a FUSE file system for fast, safe training checkpoints", "ckptfs"};
  std::string durability = "async", staging = "1G", chunk = "4M", cache = "1G";
  std::string read_ahead = "4M", direct_io = "on", write_checksums = "on";
  app.add_option("backing_dir", o.backing_dir, "Directory that stores the files")->required();
  app.add_option("mountpoint", o.mountpoint, "Where to mount")->required();
  app.add_flag("-f,--foreground", o.foreground, "Stay in the foreground");
  app.add_option("--durability", durability, "async (default) or strict")
      ->check(CLI::IsMember({"async", "strict"}));
  app.add_option("--staging-mem", staging, "Staging memory budget, e.g. 2G (default 1G)");
  app.add_option("--chunk-size", chunk, "Staging chunk size (default 4M)");
  app.add_option("--cache-mem", cache, "Read block cache budget (default 1G; 0 disables)");
  app.add_option("--read-ahead", read_ahead,
                 "Kernel read-ahead of the mount, e.g. 8M (default 4M; 0 keeps the kernel's)");
  app.add_option("--cache-direct-io", direct_io,
                 "Block cache reads the backing store with O_DIRECT where it can: on|off")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--flush-threads", o.flush_threads, "Flush threads (default 2)")
      ->check(CLI::Range(1, 256));
  app.add_option("--fuse-threads", o.fuse_threads, "Max FUSE worker threads (default 32)")
      ->check(CLI::Range(2, 1024));
  app.add_option("--commit-timeout", o.commit_timeout_s,
                 "Seconds a .metadata waits for its shards (default 600)")
      ->check(CLI::Range(1, 86400));
  app.add_option("--staging-backend", o.staging_backend, "auto, host or cuda")
      ->check(CLI::IsMember({"auto", "host", "cuda"}));
  app.add_option("--write-checksums", write_checksums,
                 "on (default): CRC32C of written blocks while in staging, so that item "
                 "checksums need no re-read; off: items are read back after the commit")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--state-dir", o.state_dir, "Node-local state directory (outside the mount)");
  app.add_option("--log-level", o.log_level, "trace|debug|info|warn|error|off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  app.add_option("--log-file", o.log_file, "Log file (default: stderr, or STATE_DIR/ckptfs.log)");
  app.add_option("-o", o.fuse_options, "FUSE mount options, comma separated")
      ->allow_extra_args(false);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    o.help = true;
    o.help_text = app.help();
    return o;
  } catch (const CLI::ParseError& e) {
    return Invalid(e.what());
  }
  o.strict = durability == "strict";
  o.write_checksums = write_checksums == "on";
  CKPT_ASSIGN_OR_RETURN(o.staging_bytes, ParseSize(staging));
  CKPT_ASSIGN_OR_RETURN(o.chunk_bytes, ParseSize(chunk));
  CKPT_ASSIGN_OR_RETURN(o.cache_bytes, ParseSize(cache));
  CKPT_ASSIGN_OR_RETURN(o.read_ahead_bytes, ParseSize(read_ahead));
  if (o.read_ahead_bytes % 4096 != 0 || o.read_ahead_bytes > (uint64_t{1} << 30)) {
    return Invalid("--read-ahead must be a multiple of 4K, at most 1G");
  }
  o.cache_direct_io = direct_io == "on";
  if (o.cache_bytes != 0 && o.cache_bytes < (1u << 20)) {
    return Invalid("--cache-mem must be 0 (off) or at least 1M");
  }
  if (o.chunk_bytes < (64u << 10) || o.chunk_bytes % 4096 != 0 || o.chunk_bytes > (256u << 20)) {
    return Invalid("--chunk-size must be a multiple of 4K between 64K and 256M");
  }
  if (o.staging_bytes < o.chunk_bytes) {
    return Invalid("--staging-mem must hold at least one chunk (" + chunk + ")");
  }
  std::vector<std::string> split;
  for (const auto& group : o.fuse_options) {
    std::stringstream ss(group);
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (!item.empty()) split.push_back(item);
    }
  }
  o.fuse_options = split;
  return o;
}

bool IsMountPoint(const std::string& path) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string id, parent, dev, root, mnt;
    fields >> id >> parent >> dev >> root >> mnt;
    if (UnescapeMountPath(mnt) == path) return true;
  }
  return false;
}

Status ValidateDaemonOptions(DaemonOptions* o) {
  CKPT_ASSIGN_OR_RETURN(o->backing_dir, Canonical(o->backing_dir, "backing dir"));
  CKPT_ASSIGN_OR_RETURN(o->mountpoint, Canonical(o->mountpoint, "mountpoint"));
  if (IsMountPoint(o->mountpoint)) {
    return Status(Code::kBusy, "mountpoint " + o->mountpoint + " is busy (already mounted)");
  }
  if (IsInside(o->mountpoint, o->backing_dir) || IsInside(o->backing_dir, o->mountpoint)) {
    return Invalid("backing dir and mountpoint must not contain each other");
  }
  if (o->state_dir.empty()) {
    std::string name = o->mountpoint;
    for (auto& c : name) {
      if (c == '/') c = '_';
    }
    o->state_dir = "/var/tmp/ckptfs" + std::string("/state") + name;
  }
  std::error_code ec;
  std::string state = std::filesystem::weakly_canonical(
      std::filesystem::absolute(o->state_dir), ec).string();
  if (ec) return Invalid("state dir " + o->state_dir + ": " + ec.message());
  if (IsInside(state, o->mountpoint)) {
    return Invalid("state dir " + state + " is inside the mount; it must be node-local storage");
  }
  if (IsInside(state, o->backing_dir)) {
    return Invalid("state dir " + state + " is inside the backing dir; keep it node-local");
  }
  o->state_dir = state;
  if (!o->log_file.empty()) {
    o->log_file = std::filesystem::weakly_canonical(std::filesystem::absolute(o->log_file), ec)
                      .string();
    if (ec) return Invalid("log file " + o->log_file + ": " + ec.message());
    if (IsInside(o->log_file, o->mountpoint)) return Invalid("log file is inside the mount");
  }
  return Status::Ok();
}

}  // namespace ckptfs
