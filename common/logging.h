// Logging setup for the ckptfs programs (spdlog). Libraries just call spdlog::*.
#pragma once

#include <string>

#include "common/status.h"

namespace ckptfs {

// Installs the default logger: stderr, or `file` when non-empty. `level` is one of
// trace, debug, info, warn, error, off.
Status SetupLogging(const std::string& level, const std::string& file);

}  // namespace ckptfs
