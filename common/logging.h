// Logging setup for the ckptfs programs (spdlog). Libraries just call spdlog::*.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace ckptfs {

struct LogRotation {
  uint64_t max_bytes = uint64_t{100} << 20;  // a file is rotated at this size
  int max_files = 5;  // this many rotated files are kept: ckptfs.1.log ... ckptfs.N.log
};

// Installs the default logger: stderr, or `file` when non-empty, rotated by size
// (spdlog's naming: ckptfs.log, ckptfs.1.log, ckptfs.2.log, ...). `level` is one of trace, debug, info, warn, error, off. Call once,
// before other threads log.
Status SetupLogging(const std::string& level, const std::string& file,
                    const LogRotation& rotation = {});

// Closes and reopens the log file (after logrotate moved it away). Thread-safe: lines
// logged meanwhile go to the old or the new file, none is lost. A no-op when logging
// goes to stderr. On failure the old file stays in use and the error is returned.
Status ReopenLogFile();

}  // namespace ckptfs
