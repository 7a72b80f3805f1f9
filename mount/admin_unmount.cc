// ckptfs-admin unmount: drain, fusermount3 -u, wait for the daemon to exit, and read its
// exit report (STATE_DIR/exit.json).
#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>

#include "mount/admin.h"
#include "mount/admin_internal.h"

namespace ckptfs::admin {

using namespace internal;  // NOLINT: the helpers of admin_internal.h

int RunUnmount(AdminEnv* env, const std::string& mountpoint, const WaitOptions& options,
               std::ostream& out, std::ostream& err) {
  json report_json = {{"mountpoint", mountpoint},
                      {"pid", nullptr},
                      {"clean", false},
                      {"unpublished_files", nullptr},
                      {"error", nullptr}};
  auto finish = [&](int code, const std::string& message) {
    if (options.json) {
      report_json["exit_code"] = code;
      report_json["message"] = message;
      out << report_json.dump() << '\n';
    }
    return code;
  };
  auto fail = [&](int code, const std::string& message) {
    err << kPrefix << message << '\n';
    return finish(code, message);
  };
  const double start = env->MonotonicSeconds();

  auto root = FindMountRoot(mountpoint);
  if (!root.ok()) return fail(kExitError, root.status().message());
  auto real = RealPath(mountpoint);
  if (!real.ok()) return fail(kExitError, real.status().message());
  if (*real != *root) {
    return fail(kExitError, mountpoint + ": not a mountpoint; the ckptfs mount is " + *root);
  }

  // Everything needed after the mount is gone has to be read now.
  auto text = ReadWholeFile(StatsPath(*root));
  if (!text.ok()) return fail(kExitError, text.status().message());
  auto stats = ParseJson(*text, StatsPath(*root));
  if (!stats.ok()) return fail(kExitError, stats.status().message());
  auto pid64 = GetU64(*stats, "pid");
  auto state_dir = GetString(*stats, "state_dir");
  if (!pid64 || *pid64 == 0 || *pid64 > INT32_MAX || !state_dir || state_dir->empty()) {
    return fail(kExitError, StatsPath(*root) + ": no valid \"pid\" and \"state_dir\"");
  }
  const int pid = static_cast<int>(*pid64);
  report_json["mountpoint"] = *root;
  report_json["pid"] = pid;

  // 1. Drain: the root is published once everything under it is. Not while publication
  // waits for something that may never come (halted, or a commit waiting for shards from
  // elsewhere for 2 s): the daemon's own stop bounds that wait (--stop-timeout) and leaves
  // the rest for its next start.
  WaitOptions drain = options;
  std::string seen;
  double seen_since = 0;
  drain.stalled = [&]() -> std::optional<std::string> {
    auto now_text = ReadWholeFile(StatsPath(*root));
    if (!now_text.ok()) return std::nullopt;
    auto now_stats = ParseJson(*now_text, StatsPath(*root));
    if (!now_stats.ok()) return std::nullopt;
    const std::string waiting = GetString(*now_stats, "journal_waiting").value_or("");
    const bool halted =
        now_stats->contains("journal_halted") && (*now_stats)["journal_halted"].is_object();
    if (waiting != seen) {
      seen = waiting;
      seen_since = env->MonotonicSeconds();
    }
    if (waiting.empty() || (!halted && env->MonotonicSeconds() - seen_since < 2)) {
      return std::nullopt;
    }
    return waiting;
  };
  WaitOutcome drained = WaitForPath(env, *root, drain, err);
  if (drained.stalled) {
    err << kPrefix << *root << ": publication waits: " << drained.message
        << "; unmounting: the daemon waits up to its --stop-timeout without progress, then "
           "leaves the rest for its next start\n";
    report_json["waiting_for"] = drained.message;
  } else if (drained.exit_code == kExitError) {
    return fail(kExitError, drained.message);
  } else if (drained.exit_code == kExitFailed) {
    // Nothing more will be published; the daemon's exit report says what was lost.
    err << kPrefix << "warning: " << drained.message << "; unmounting anyway\n";
  }

  // 2. Unmount; the daemon drains again (G8) and exits.
  Status unmounted = env->FuseUnmount(*root);
  if (!unmounted.ok()) return fail(kExitError, unmounted.message());

  // 3. Wait for the daemon to go away, within what is left of the timeout, saying what its
  // stop waits for (STATE_DIR/stopping.json) each time that changes.
  const std::string stopping_path = Join(*state_dir, "stopping.json");
  std::string stop_said;
  while (env->ProcessAlive(pid)) {
    if (auto stopping = ReadWholeFile(stopping_path); stopping.ok()) {
      auto j = ParseJson(*stopping, stopping_path);
      const std::string what = j.ok() && GetU64(*j, "pid") == static_cast<uint64_t>(pid)
                                   ? GetString(*j, "waiting_for").value_or("")
                                   : "";
      if (!what.empty() && what != stop_said) {
        err << kPrefix << "daemon pid " << pid << " is stopping and waits for: " << what
            << " (it leaves the rest for its next start after "
            << CountOrDash(GetU64(*j, "stop_timeout_s")) << " s without progress)\n"
            << std::flush;
        report_json["waiting_for"] = what;
      }
      stop_said = what;
    }
    double waited = env->MonotonicSeconds() - start;
    double nap = options.interval_s;
    if (options.timeout_s) {
      if (waited >= *options.timeout_s) {
        return fail(kExitError, "timed out after " + Seconds(*options.timeout_s) +
                                    " waiting for daemon pid " + std::to_string(pid) +
                                    " to exit (" + *root + " is unmounted)");
      }
      nap = std::min(nap, *options.timeout_s - waited);
    }
    env->Sleep(nap);
  }

  // 4. The daemon's own account of its exit.
  const std::string exit_path = Join(*state_dir, "exit.json");
  auto exit_text = ReadWholeFile(exit_path);
  if (!exit_text.ok()) {
    return fail(kExitFailed, "daemon pid " + std::to_string(pid) + " exited without a report (" +
                                 exit_text.status().message() + "); it may have crashed");
  }
  auto report = ParseJson(*exit_text, exit_path);
  if (!report.ok()) return fail(kExitFailed, report.status().message());
  auto report_pid = GetU64(*report, "pid");
  if (report_pid != static_cast<uint64_t>(pid)) {
    return fail(kExitFailed, exit_path + " is from pid " + CountOrDash(report_pid) +
                                 ", not from daemon pid " + std::to_string(pid) +
                                 "; it may have crashed");
  }
  auto clean = GetBool(*report, "clean");
  auto unpublished = GetU64(*report, "unpublished_files");
  auto error = GetString(*report, "error");
  auto left = GetU64(*report, "left_for_resume");
  report_json["clean"] = clean.value_or(false);
  if (left) report_json["left_for_resume"] = *left;
  if (unpublished) report_json["unpublished_files"] = *unpublished;
  if (error && !error->empty()) report_json["error"] = *error;
  if (clean == true && unpublished == 0u) {
    const std::string message =
        "unmounted " + *root + " (daemon pid " + std::to_string(pid) + " exited cleanly)";
    if (!options.json) out << message << '\n';
    return finish(kExitOk, message);
  }
  if (left.value_or(0) > 0 && unpublished.value_or(0) == 0) {
    // Nothing lost: the next start publishes them (exit status 3 of the daemon).
    const std::string waited = GetString(*report, "waiting_for").value_or("");
    return fail(kExitFailed, *root + ": daemon pid " + std::to_string(pid) + " stopped with " +
                                 std::to_string(*left) +
                                 " journal entries left for its next start (publication "
                                 "waited for: " +
                                 (waited.empty() ? "-" : waited) +
                                 "); start ckptfs again on this state dir to publish them");
  }
  std::string reason = clean == true ? "daemon exited" : "daemon exited uncleanly";
  if (unpublished != 0u) {
    reason += ", " + CountOrDash(unpublished) + " files unpublished";
  }
  if (error && !error->empty()) reason += ": " + *error;
  return fail(kExitFailed, *root + ": " + reason);
}

}  // namespace ckptfs::admin
