// Helpers shared by the ckptfs-admin sources (mount/admin_*.cc): JSON access that never
// throws (the daemon's output is input, not an invariant), small formatting pieces and
// the printing of one control file. Internal to mount/; not thread-safe state, none kept.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iosfwd>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "common/control_names.h"
#include "mount/admin.h"

namespace ckptfs::admin::internal {

using nlohmann::json;

inline constexpr char kPrefix[] = "ckptfs-admin: ";

// ---- JSON access that never throws: the daemon's output is input, not an invariant.

inline Result<json> ParseJson(std::string_view text, std::string_view what) {
  json j = json::parse(text, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Corrupt(std::string(what) + " is not valid JSON");
  return j;
}

inline std::optional<uint64_t> GetU64(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return std::nullopt;
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  if (it->is_number_integer()) {
    int64_t v = it->get<int64_t>();
    if (v >= 0) return static_cast<uint64_t>(v);
  } else if (it->is_number_float()) {
    double v = it->get<double>();
    if (std::isfinite(v) && v >= 0 && v < 1.8e19) return static_cast<uint64_t>(v);
  }
  return std::nullopt;
}

inline std::optional<double> GetDouble(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

inline std::optional<std::string> GetString(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return std::nullopt;
  return it->get<std::string>();
}

inline std::optional<bool> GetBool(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_boolean()) return std::nullopt;
  return it->get<bool>();
}

inline std::string OrDash(const std::optional<std::string>& s) {
  return s && !s->empty() ? *s : "-";
}
inline std::string BytesOrDash(const std::optional<uint64_t>& n) {
  return n ? HumanBytes(*n) : "-";
}
inline std::string CountOrDash(const std::optional<uint64_t>& n) {
  return n ? std::to_string(*n) : "-";
}

// "5s", "0.5s": a user-given number of seconds, as given.
inline std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%gs", s);
  return buf;
}

// Percent done, rounded down so that 100% means done.
inline double PercentDone(uint64_t done, uint64_t total) {
  if (total == 0) return 0;
  if (done >= total) return 100;
  return std::floor(static_cast<double>(done) * 1000.0 / static_cast<double>(total)) / 10.0;
}

inline std::string Percent(double pct) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.1f%%", pct);
  return buf;
}

inline Result<std::string> RealPath(const std::string& path) {
  std::unique_ptr<char, decltype(&std::free)> real(::realpath(path.c_str(), nullptr), &std::free);
  if (!real) return Status::FromErrno(errno, path);
  return std::string(real.get());
}

inline std::string Join(const std::string& dir, std::string_view name) {
  std::string p = dir;
  if (p.empty() || p.back() != '/') p += '/';
  p += name;
  return p;
}

// The control files of the mount at `root` (names: common/control_names.h).
inline std::string StatsPath(const std::string& root) {
  return Join(Join(root, kCtlDirName), kCtlStatsName);
}
inline std::string CheckpointsPath(const std::string& root) {
  return Join(Join(root, kCtlDirName), kCtlCheckpointsName);
}

// "staged, 1.00 GiB of 2.00 GiB done"
inline std::string DescribeProgress(const Progress& p) {
  if (p.state.empty()) return "no progress read";
  return p.state + ", " + HumanBytes(p.bytes_done) + " of " + HumanBytes(p.bytes_total) + " done";
}

// Prints the control file `file_of(root)` of the mount that holds `path`: as it is with
// `as_json`, else through `format`. Anything that fails is one line on `err`. Returns the
// exit code (admin_env.cc).
int PrintControlFile(const std::string& path, std::string (*file_of)(const std::string&),
                     bool as_json,
                     const std::function<Result<std::string>(std::string_view)>& format,
                     std::ostream& out, std::ostream& err);

}  // namespace ckptfs::admin::internal
