// ckptfs-admin wait and top: polling a mount's progress over time.
#include <unistd.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <set>

#include "mount/admin.h"
#include "mount/admin_internal.h"

namespace ckptfs::admin {

using namespace internal;  // NOLINT: the helpers of admin_internal.h

WaitOutcome WaitForPath(AdminEnv* env, const std::string& path, const WaitOptions& options,
                        std::ostream& err) {
  WaitOutcome outcome;
  const bool draw = env->StderrIsTerminal();
  const double start = env->MonotonicSeconds();
  double next_plain = start + options.plain_every_s;
  RateMeter rate;
  std::string drawn;
  auto stop = [&](int code, std::string message) {
    if (!drawn.empty()) err << '\n' << std::flush;
    outcome.exit_code = code;
    outcome.message = std::move(message);
    return outcome;
  };

  bool seen = false;
  while (true) {
    auto raw = env->GetXattr(path, kProgressXattr);
    if (!raw.ok() && seen && raw.status().code() == Code::kNotFound) {
      // It was there unpublished and is gone: deleted, or a withheld tracker the backing
      // store never had (the mount shows what the store keeps). Either way never published.
      return stop(kExitFailed, path + ": gone from the mount before it was published (" +
                                   DescribeProgress(outcome.last) + ")");
    }
    if (!raw.ok()) return stop(kExitError, raw.status().message());
    seen = true;
    auto progress = ParseProgress(*raw);
    if (!progress.ok()) return stop(kExitError, path + ": " + progress.status().message());
    outcome.last = std::move(progress).value();
    const double now = env->MonotonicSeconds();
    const double bytes_per_s = rate.Add(now, outcome.last.bytes_done);

    if (draw) {
      std::string line = RenderProgressLine(outcome.last, 30, bytes_per_s);
      if (line != drawn) {
        err << '\r' << line << "\x1b[K" << std::flush;  // Erase what a longer line left.
        drawn = std::move(line);
      }
    } else if (options.plain_every_s > 0 && now >= next_plain &&
               ClassifyState(outcome.last.state) == StateKind::kInProgress) {
      // Slurm logs and pipes: a plain line now and then, never a carriage return.
      err << kPrefix << path << ": "
          << Percent(PercentDone(outcome.last.bytes_done, outcome.last.bytes_total)) << "  "
          << HumanBytes(outcome.last.bytes_done) << " / " << HumanBytes(outcome.last.bytes_total)
          << "  " << outcome.last.state;
      if (bytes_per_s >= 0) {
        err << ", " << HumanBytes(static_cast<uint64_t>(bytes_per_s)) << "/s";
        if (bytes_per_s > 0 && outcome.last.bytes_total > outcome.last.bytes_done) {
          err << ", ETA "
              << HumanDuration(
                     static_cast<double>(outcome.last.bytes_total - outcome.last.bytes_done) /
                     bytes_per_s);
        }
      }
      err << ", waited " << HumanDuration(now - start) << '\n' << std::flush;
      next_plain = now + options.plain_every_s;
    }

    switch (ClassifyState(outcome.last.state)) {
      case StateKind::kSucceeded:
        return stop(kExitOk, "");
      case StateKind::kFailed:
        return stop(kExitFailed,
                    path + ": " + outcome.last.state + ": " +
                        (outcome.last.error.empty() ? "no error reported" : outcome.last.error));
      case StateKind::kInProgress:
        break;
    }
    if (options.stalled) {
      if (std::optional<std::string> why = options.stalled()) {
        WaitOutcome& o = outcome;
        o.stalled = true;
        return stop(kExitFailed, std::move(*why));
      }
    }

    double waited = now - start;
    double nap = options.interval_s;
    if (options.timeout_s) {
      if (waited >= *options.timeout_s) {
        return stop(kExitError, path + ": timed out after " + Seconds(*options.timeout_s) + " (" +
                                    DescribeProgress(outcome.last) + ")");
      }
      nap = std::min(nap, *options.timeout_s - waited);
    }
    env->Sleep(nap);
  }
}

std::string WaitOutcomeJson(const std::string& path, const WaitOutcome& outcome, double elapsed_s) {
  json j = {{"path", path},
            {"state", outcome.last.state.empty() ? json(nullptr) : json(outcome.last.state)},
            {"bytes_total", outcome.last.bytes_total},
            {"bytes_done", outcome.last.bytes_done},
            {"error", outcome.last.error.empty() ? json(nullptr) : json(outcome.last.error)},
            {"exit_code", outcome.exit_code},
            {"elapsed_s", elapsed_s},
            {"message", outcome.message}};
  return j.dump();
}

int RunWait(AdminEnv* env, const std::string& path, const WaitOptions& options, std::ostream& out,
            std::ostream& err) {
  const double start = env->MonotonicSeconds();
  auto finish = [&](const WaitOutcome& outcome) {
    if (options.json) {
      out << WaitOutcomeJson(path, outcome, env->MonotonicSeconds() - start) << '\n';
    } else if (outcome.exit_code == kExitOk) {
      out << path << ": " << outcome.last.state << " (" << HumanBytes(outcome.last.bytes_total)
          << ")\n";
    }
    if (outcome.exit_code != kExitOk) err << kPrefix << outcome.message << '\n';
    return outcome.exit_code;
  };
  // A path that does not exist yet (the checkpoint the trainer is about to save) may
  // appear within --create-timeout; one that exists outside any mount fails at once.
  auto root = FindMountRoot(path);
  while (!root.ok() && ::access(path.c_str(), F_OK) != 0 &&
         env->MonotonicSeconds() - start < options.create_timeout_s) {
    env->Sleep(
        std::min(options.interval_s, options.create_timeout_s - (env->MonotonicSeconds() - start)));
    root = FindMountRoot(path);
  }
  if (!root.ok()) {
    WaitOutcome outcome;
    outcome.message = root.status().message();
    if (options.create_timeout_s > 0 && ::access(path.c_str(), F_OK) != 0) {
      outcome.message += " (did not appear within " + Seconds(options.create_timeout_s) + ")";
    }
    return finish(outcome);
  }
  WaitOptions rest = options;
  if (rest.timeout_s) {
    rest.timeout_s = std::max(0.0, *rest.timeout_s - (env->MonotonicSeconds() - start));
  }
  return finish(WaitForPath(env, path, rest, err));
}

// ---------------------------------------------------------------------------------------
// top

namespace {

struct Sample {
  double t = 0;
  json stats;
  std::map<std::string, json> checkpoints;  // by path
};

Result<Sample> TakeSample(AdminEnv* env, const std::string& root) {
  Sample s;
  s.t = env->MonotonicSeconds();
  CKPT_ASSIGN_OR_RETURN(std::string stats_text, ReadWholeFile(StatsPath(root)));
  CKPT_ASSIGN_OR_RETURN(s.stats, ParseJson(stats_text, ".ckptfs/stats"));
  if (!s.stats.is_object()) return Corrupt(".ckptfs/stats is not a JSON object");
  CKPT_ASSIGN_OR_RETURN(std::string ck_text, ReadWholeFile(CheckpointsPath(root)));
  CKPT_ASSIGN_OR_RETURN(json list, ParseJson(ck_text, ".ckptfs/checkpoints"));
  if (!list.is_array()) return Corrupt(".ckptfs/checkpoints is not a JSON array");
  for (auto& e : list) {
    if (!e.is_object()) continue;
    auto p = GetString(e, "path");
    if (p) s.checkpoints[*p] = std::move(e);
  }
  return s;
}

// Bytes/s of a counter between two JSON objects; null when either lacks it.
json RateOf(const json& a, const json& b, const char* key, double dt) {
  auto x = GetU64(a, key), y = GetU64(b, key);
  if (!x || !y || dt <= 0) return nullptr;
  return *y >= *x ? static_cast<double>(*y - *x) / dt : 0.0;
}

std::string RateText(const json& rate) {
  return rate.is_number() ? HumanBytes(static_cast<uint64_t>(rate.get<double>())) + "/s" : "-";
}

json Frame(const Sample& a, const Sample& b, const std::string& root, double wall_now) {
  const double dt = b.t - a.t;
  json frame = {{"mountpoint", root},
                {"interval_s", dt},
                {"write_rate", RateOf(a.stats, b.stats, "bytes_written", dt)},
                {"publish_rate", RateOf(a.stats, b.stats, "bytes_published", dt)},
                {"backing_read_rate", RateOf(a.stats, b.stats, "backing_bytes_read", dt)},
                {"serve_rate", RateOf(a.stats, b.stats, "bytes_served", dt)},
                {"staging_used", GetU64(b.stats, "staging_used").value_or(0)},
                {"staging_limit", GetU64(b.stats, "staging_limit").value_or(0)},
                {"journal_pending", GetU64(b.stats, "journal_pending").value_or(0)},
                {"errors", GetU64(b.stats, "errors").value_or(0)}};
  json rows = json::array();
  for (const auto& [path, e] : b.checkpoints) {
    const std::string state = GetString(e, "state").value_or("-");
    const double updated = GetDouble(e, "updated").value_or(0);
    // Committed checkpoints are history; show them only while recent (a minute).
    if (ClassifyState(state) == StateKind::kSucceeded && wall_now - updated > 60) continue;
    auto prev = a.checkpoints.find(path);
    json rate = prev == a.checkpoints.end() ? json(nullptr)
                                            : RateOf(prev->second, e, "bytes_published", dt);
    const uint64_t bytes = GetU64(e, "bytes").value_or(0);
    const uint64_t published = GetU64(e, "bytes_published").value_or(0);
    json eta = nullptr;
    if (rate.is_number() && rate.get<double>() > 0 && bytes > published) {
      eta = static_cast<double>(bytes - published) / rate.get<double>();
    }
    rows.push_back({{"path", path},
                    {"state", state},
                    {"bytes", bytes},
                    {"bytes_published", published},
                    {"percent", PercentDone(published, bytes)},
                    {"publish_rate", rate},
                    {"eta_s", eta},
                    {"error", e.contains("error") ? e["error"] : json(nullptr)}});
  }
  frame["checkpoints"] = rows;
  return frame;
}

std::string FormatFrame(const json& f) {
  std::string text = FormatKeyValues({
      {"mountpoint", f.value("mountpoint", "-")},
      {"write", RateText(f["write_rate"])},
      {"publish", RateText(f["publish_rate"])},
      {"backing read", RateText(f["backing_read_rate"])},
      {"served", RateText(f["serve_rate"])},
      {"staging", HumanBytes(f.value("staging_used", uint64_t{0})) + " / " +
                      HumanBytes(f.value("staging_limit", uint64_t{0}))},
      {"journal pending", std::to_string(f.value("journal_pending", uint64_t{0}))},
      {"errors", std::to_string(f.value("errors", uint64_t{0}))},
  });
  std::vector<std::vector<std::string>> rows;
  for (const auto& c : f["checkpoints"]) {
    rows.push_back({c.value("path", "-"), c.value("state", "-"), Percent(c.value("percent", 0.0)),
                    HumanBytes(c.value("bytes_published", uint64_t{0})) + " / " +
                        HumanBytes(c.value("bytes", uint64_t{0})),
                    RateText(c["publish_rate"]),
                    c["eta_s"].is_number() ? HumanDuration(c["eta_s"].get<double>()) : "-",
                    c["error"].is_string() ? c["error"].get<std::string>() : ""});
  }
  text += "\n";
  text += FormatTable({{"CHECKPOINT"},
                       {"STATE"},
                       {"DONE", true},
                       {"PUBLISHED", true},
                       {"RATE", true},
                       {"ETA", true},
                       {"ERROR"}},
                      rows);
  return text;
}

}  // namespace

int RunTop(AdminEnv* env, const std::string& path, const TopOptions& options, std::ostream& out,
           std::ostream& err) {
  auto root = FindMountRoot(path);
  if (!root.ok()) {
    err << kPrefix << root.status().message() << '\n';
    return kExitError;
  }
  auto prev = TakeSample(env, *root);
  if (!prev.ok()) {
    err << kPrefix << prev.status().message() << '\n';
    return kExitError;
  }
  const bool redraw = !options.json && env->StdoutIsTerminal();
  for (int frame = 0; options.iterations == 0 || frame < options.iterations; ++frame) {
    env->Sleep(options.interval_s);
    auto next = TakeSample(env, *root);
    if (!next.ok()) {  // the mount went away: say so and stop
      err << kPrefix << next.status().message() << '\n';
      return kExitError;
    }
    json f = Frame(*prev, *next, *root, env->WallSeconds());
    if (options.json) {
      out << f.dump() << '\n';
    } else {
      if (redraw) out << "\x1b[H\x1b[2J";
      out << FormatFrame(f);
      if (!redraw) out << '\n';
    }
    out << std::flush;
    prev = std::move(next);
  }
  return kExitOk;
}

}  // namespace ckptfs::admin
