#include "common/logging.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

namespace ckptfs {

Status SetupLogging(const std::string& level, const std::string& file) {
  auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return Invalid("unknown log level '" + level + "' (trace|debug|info|warn|error|off)");
  }
  try {
    std::shared_ptr<spdlog::logger> logger;
    if (file.empty()) {
      logger = spdlog::stderr_logger_mt("ckptfs");
    } else {
      logger = spdlog::basic_logger_mt("ckptfs", file);
    }
    logger->set_level(lvl);
    logger->flush_on(spdlog::level::warn);
    spdlog::set_default_logger(logger);
    // Info and debug lines reach the file within a second, so a crash leaves a usable log.
    spdlog::flush_every(std::chrono::seconds(1));
    spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] [%t] %v");
  } catch (const spdlog::spdlog_ex& e) {
    return Status(Code::kIo, std::string("cannot open log: ") + e.what());
  }
  return Status::Ok();
}

}  // namespace ckptfs
