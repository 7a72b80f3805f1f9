#include "common/logging.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/rotating_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <mutex>

namespace ckptfs {
namespace {

// A rotating file sink that can be reopened: the inner sink is replaced under the
// sink's own mutex, which every log call already takes.
class ReopenableFileSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  ReopenableFileSink(std::string file, LogRotation rotation)
      : file_(std::move(file)), rotation_(rotation) {
    inner_ = Open();  // throws spdlog_ex, caught by SetupLogging
  }

  void Reopen() {
    std::lock_guard lock(mutex_);
    auto fresh = Open();  // throws on failure; the old file stays in use
    inner_->flush();
    inner_ = std::move(fresh);
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override { inner_->log(msg); }
  void flush_() override { inner_->flush(); }
  void set_pattern_(const std::string& pattern) override {
    set_formatter_(std::make_unique<spdlog::pattern_formatter>(pattern));
  }
  void set_formatter_(std::unique_ptr<spdlog::formatter> formatter) override {
    inner_->set_formatter(formatter->clone());
    formatter_ = std::move(formatter);
  }

 private:
  std::shared_ptr<spdlog::sinks::rotating_file_sink_st> Open() {
    auto sink = std::make_shared<spdlog::sinks::rotating_file_sink_st>(
        file_, rotation_.max_bytes, static_cast<size_t>(rotation_.max_files));
    if (formatter_) sink->set_formatter(formatter_->clone());  // base_sink's, under mutex_
    return sink;
  }

  const std::string file_;
  const LogRotation rotation_;
  std::shared_ptr<spdlog::sinks::rotating_file_sink_st> inner_;  // guarded by mutex_
};

std::shared_ptr<ReopenableFileSink> g_file_sink;  // set once by SetupLogging

}  // namespace

Status SetupLogging(const std::string& level, const std::string& file,
                    const LogRotation& rotation) {
  auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return Invalid("unknown log level '" + level + "' (trace|debug|info|warn|error|off)");
  }
  try {
    std::shared_ptr<spdlog::logger> logger;
    if (file.empty()) {
      logger = spdlog::stderr_logger_mt("ckptfs");
    } else {
      g_file_sink = std::make_shared<ReopenableFileSink>(file, rotation);
      logger = std::make_shared<spdlog::logger>("ckptfs", g_file_sink);
      spdlog::register_logger(logger);
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

Status ReopenLogFile() {
  if (!g_file_sink) return Status::Ok();
  try {
    g_file_sink->Reopen();
  } catch (const spdlog::spdlog_ex& e) {
    return Status(Code::kIo, std::string("cannot reopen log: ") + e.what());
  }
  return Status::Ok();
}

}  // namespace ckptfs
