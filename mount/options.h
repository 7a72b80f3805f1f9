// Command-line options of the ckptfs daemon: parsing and validation, with one clear
// error line for every bad input.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace ckptfs {

struct DaemonOptions {
  std::string backing_dir;   // absolute, canonical
  std::string mountpoint;    // absolute, canonical
  std::string state_dir;     // absolute
  bool foreground = false;
  bool strict = false;
  uint64_t staging_bytes = uint64_t{1} << 30;
  uint64_t chunk_bytes = uint64_t{4} << 20;
  uint64_t cache_bytes = uint64_t{1} << 30;
  uint64_t read_ahead_bytes = uint64_t{4} << 20;  // the mount's kernel read-ahead; 0: default
  bool cache_direct_io = true;
  int flush_threads = 2;
  int fuse_threads = 32;
  int commit_timeout_s = 600;
  std::string staging_backend = "auto";
  bool write_checksums = true;  // --write-checksums=on|off
  std::string log_level = "info";
  std::string log_file;
  std::vector<std::string> fuse_options;
  bool help = false;
  std::string help_text;
};

// Parses "4096", "64K", "512M", "2G", "1T" (also "2GiB", "2GB"): powers of 1024.
Result<uint64_t> ParseSize(const std::string& text);

// Parses argv. A syntax error returns kInvalid with the message to print.
Result<DaemonOptions> ParseDaemonOptions(int argc, const char* const* argv);

// Checks the paths: backing dir and mountpoint exist and are directories, the
// mountpoint is not already mounted, neither contains the other, and the state dir is
// outside the mount. Fills in the default state dir.
Status ValidateDaemonOptions(DaemonOptions* options);

// True if `path` (canonical) is a mount point listed in /proc/self/mountinfo.
bool IsMountPoint(const std::string& path);

}  // namespace ckptfs
