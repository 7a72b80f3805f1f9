// The pure pieces of ckptfs-admin's output: progress parsing, sizes, durations, tables and
// the progress bar. No I/O.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <iterator>
#include <nlohmann/json.hpp>

#include "mount/admin.h"
#include "mount/admin_internal.h"

namespace ckptfs::admin {

using namespace internal;  // NOLINT: the helpers of admin_internal.h

Result<Progress> ParseProgress(std::string_view text) {
  CKPT_ASSIGN_OR_RETURN(json j, ParseJson(text, kProgressXattr));
  if (!j.is_object()) return Corrupt(std::string(kProgressXattr) + " is not a JSON object");
  Progress p;
  auto state = GetString(j, "state");
  if (!state || state->empty()) {
    return Corrupt(std::string(kProgressXattr) + " has no \"state\": " + std::string(text));
  }
  p.state = *state;
  p.bytes_total = GetU64(j, "bytes_total").value_or(0);
  p.bytes_done = GetU64(j, "bytes_done").value_or(0);
  p.error = GetString(j, "error").value_or("");
  return p;
}

StateKind ClassifyState(std::string_view state) {
  if (state == "published" || state == "committed") return StateKind::kSucceeded;
  if (state == "failed" || state == "aborted" || state == "withheld") return StateKind::kFailed;
  return StateKind::kInProgress;
}

int ExitCodeForState(std::string_view state) {
  switch (ClassifyState(state)) {
    case StateKind::kSucceeded:
      return kExitOk;
    case StateKind::kFailed:
      return kExitFailed;
    case StateKind::kInProgress:
      return kExitError;
  }
  return kExitError;
}

// ---------------------------------------------------------------------------------------

std::string HumanBytes(uint64_t bytes) {
  if (bytes < 1024) return std::to_string(bytes) + " B";
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  constexpr int kLast = static_cast<int>(std::size(kUnits)) - 1;
  double v = static_cast<double>(bytes);
  int unit = -1;
  while (v >= 1024 && unit < kLast) {
    v /= 1024;
    ++unit;
  }
  // Avoid "1024.00 KiB" for values that round up to the next unit.
  if (v >= 1023.995 && unit < kLast) {
    v /= 1024;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[unit]);
  return buf;
}

std::string HumanDuration(double seconds) {
  if (!(seconds > 0)) seconds = 0;  // Also catches NaN.
  uint64_t s = seconds >= 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(seconds);
  char buf[48];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%llus", static_cast<unsigned long long>(s));
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%llum %02llus", static_cast<unsigned long long>(s / 60),
                  static_cast<unsigned long long>(s % 60));
  } else if (s < 86400) {
    std::snprintf(buf, sizeof(buf), "%lluh %02llum", static_cast<unsigned long long>(s / 3600),
                  static_cast<unsigned long long>(s % 3600 / 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%llud %02lluh", static_cast<unsigned long long>(s / 86400),
                  static_cast<unsigned long long>(s % 86400 / 3600));
  }
  return buf;
}

std::string FormatLocalTime(double epoch_seconds) {
  // A time the daemon (or whatever answers at that path) reports beyond what time_t holds,
  // or NaN, is shown as unknown; the cast would be undefined (found by control_fuzz).
  if (!(epoch_seconds > -9.2e18 && epoch_seconds < 9.2e18)) return "-";
  time_t t = static_cast<time_t>(epoch_seconds);
  struct tm tm;
  if (::localtime_r(&t, &tm) == nullptr) return "-";
  char buf[32];
  if (std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm) == 0) return "-";
  return buf;
}

std::string FormatTable(const std::vector<Column>& columns,
                        const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(columns.size());
  for (size_t c = 0; c < columns.size(); ++c) width[c] = columns[c].header.size();
  for (const auto& row : rows) {
    for (size_t c = 0; c < columns.size() && c < row.size(); ++c) {
      width[c] = std::max(width[c], row[c].size());
    }
  }
  std::string out;
  auto emit = [&](auto cell_of) {
    std::string line;
    for (size_t c = 0; c < columns.size(); ++c) {
      const std::string& cell = cell_of(c);
      if (c > 0) line += "  ";
      std::string pad(width[c] - cell.size(), ' ');
      line += columns[c].right_align ? pad + cell : cell + pad;
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out += line;
    out += '\n';
  };
  static const std::string kEmpty;
  emit([&](size_t c) -> const std::string& { return columns[c].header; });
  for (const auto& row : rows) {
    emit([&](size_t c) -> const std::string& { return c < row.size() ? row[c] : kEmpty; });
  }
  return out;
}

std::string FormatKeyValues(const std::vector<std::pair<std::string, std::string>>& pairs) {
  size_t width = 0;
  for (const auto& [key, value] : pairs) width = std::max(width, key.size());
  std::string out;
  for (const auto& [key, value] : pairs) {
    out += key;
    out += std::string(width - key.size() + 2, ' ');
    out += value;
    out += '\n';
  }
  return out;
}

double RateMeter::Add(double now, uint64_t bytes) {
  samples_.emplace_back(now, bytes);
  while (samples_.size() > 2 && now - samples_.front().first > 10) {
    samples_.erase(samples_.begin());
  }
  const auto& [t0, b0] = samples_.front();
  if (now - t0 < 0.5) return -1;
  return bytes >= b0 ? static_cast<double>(bytes - b0) / (now - t0) : 0;
}

std::string RenderProgressLine(const Progress& progress, int bar_width, double rate) {
  bar_width = std::max(bar_width, 1);
  double pct = PercentDone(progress.bytes_done, progress.bytes_total);
  const StateKind kind = ClassifyState(progress.state);
  if (kind == StateKind::kSucceeded) pct = 100;
  int filled = static_cast<int>(pct / 100.0 * bar_width);
  char pct_buf[16];
  std::snprintf(pct_buf, sizeof(pct_buf), "%5.1f%%", pct);
  std::string line = "[" + std::string(filled, '#') + std::string(bar_width - filled, '-') + "]  " +
                     pct_buf + "  " + HumanBytes(progress.bytes_done) + " / " +
                     HumanBytes(progress.bytes_total) + "  " + progress.state;
  if (rate >= 0 && kind == StateKind::kInProgress) {
    line += ", " + HumanBytes(static_cast<uint64_t>(rate)) + "/s";
    if (rate > 0 && progress.bytes_total > progress.bytes_done) {
      line += ", ETA " +
              HumanDuration(static_cast<double>(progress.bytes_total - progress.bytes_done) / rate);
    }
  }
  return line;
}

}  // namespace ckptfs::admin
