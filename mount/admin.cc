#include "mount/admin.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <thread>
#include <utility>

#include "ckptfs_version.h"
#include "common/unique_fd.h"
#include "mount/admin_internal.h"

namespace ckptfs::admin {
namespace {

using namespace internal;  // NOLINT: the helpers of admin_internal.h

class SystemEnvImpl final : public AdminEnv {
 public:
  Result<std::string> GetXattr(const std::string& path, const std::string& name) override {
    // The value is generated when read and may grow between a size query and the read,
    // so start with a buffer that fits any progress JSON and grow on ERANGE.
    std::string buf(4096, '\0');
    for (int attempt = 0; attempt < 8; ++attempt) {
      ssize_t n = ::getxattr(path.c_str(), name.c_str(), buf.data(), buf.size());
      if (n >= 0) {
        buf.resize(static_cast<size_t>(n));
        return buf;
      }
      if (errno == EINTR) continue;
      if (errno != ERANGE) return Status::FromErrno(errno, path + ": getxattr " + name);
      ssize_t need = ::getxattr(path.c_str(), name.c_str(), nullptr, 0);
      if (need < 0) return Status::FromErrno(errno, path + ": getxattr " + name);
      buf.assign(std::max(buf.size() * 2, static_cast<size_t>(need) * 2), '\0');
    }
    return Status(Code::kIo, path + ": getxattr " + name + ": value keeps growing");
  }

  double MonotonicSeconds() override {
    using namespace std::chrono;
    return duration<double>(steady_clock::now().time_since_epoch()).count();
  }

  double WallSeconds() override {
    using namespace std::chrono;
    return duration<double>(system_clock::now().time_since_epoch()).count();
  }

  void Sleep(double seconds) override {
    if (seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }

  bool ProcessAlive(int pid) override {
    if (pid <= 0) return false;  // kill(0 or -1, ...) would address process groups.
    // A pidfd polls readable once the process has exited, zombie or not.
    UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
    if (pidfd.valid()) {
      struct pollfd p = {pidfd.get(), POLLIN, 0};
      return ::poll(&p, 1, 0) == 0;
    }
    if (errno == ESRCH) return false;
    // No pidfd_open (kernel < 5.3): kill() succeeds on a zombie, so ask /proc.
    if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
    auto stat = ReadWholeFile("/proc/" + std::to_string(pid) + "/stat");
    if (!stat.ok()) return stat.status().code() != Code::kNotFound;
    size_t paren = stat->rfind(')');
    if (paren == std::string::npos || paren + 2 >= stat->size()) return true;
    char state = (*stat)[paren + 2];
    return state != 'Z' && state != 'X';
  }

  Status FuseUnmount(const std::string& mountpoint) override {
    // A working directory inside the mount would keep it busy.
    if (::chdir("/") != 0) return Status::FromErrno(errno, "chdir /");
    auto rc = RunProgram({"fusermount3", "-u", mountpoint});
    if (!rc.ok()) return rc.status();
    if (*rc == 127) return NotFound("fusermount3 not found in PATH");
    if (*rc != 0) {
      return Status(Code::kBusy,
                    "fusermount3 -u " + mountpoint + " exited with status " + std::to_string(*rc));
    }
    return Status::Ok();
  }

  bool StderrIsTerminal() override { return ::isatty(STDERR_FILENO) == 1; }
  bool StdoutIsTerminal() override { return ::isatty(STDOUT_FILENO) == 1; }
};

}  // namespace

Status AdminEnv::SetXattr(const std::string& path, const std::string& name,
                          const std::string& value) {
  if (::setxattr(path.c_str(), name.c_str(), value.data(), value.size(), 0) != 0) {
    return Status::FromErrno(errno, path + ": setxattr " + name);
  }
  return Status::Ok();
}

AdminEnv* SystemEnv() {
  static SystemEnvImpl* env = new SystemEnvImpl();
  return env;
}

Result<int> RunProgram(const std::vector<std::string>& argv) {
  if (argv.empty()) return Invalid("RunProgram: empty argv");
  // Build argv before fork: the child may only call async-signal-safe functions.
  std::vector<char*> cargv;
  cargv.reserve(argv.size() + 1);
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);

  pid_t pid = ::fork();
  if (pid < 0) return Status::FromErrno(errno, "fork");
  if (pid == 0) {
    ::execvp(cargv[0], cargv.data());
    ::_exit(127);
  }
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) return Status::FromErrno(errno, "waitpid " + argv[0]);
  }
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return 128 + WTERMSIG(wstatus);
  return Internal("waitpid " + argv[0] + ": unexpected status");
}

// ---------------------------------------------------------------------------------------

Result<std::string> FindMountRoot(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(std::string dir, RealPath(path));
  const std::string real = dir;
  while (true) {
    std::string stats = StatsPath(dir);
    struct stat st;
    if (::stat(stats.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        ::access(stats.c_str(), R_OK) == 0) {
      return dir;
    }
    if (dir == "/") break;
    size_t slash = dir.rfind('/');
    dir = slash == 0 ? "/" : dir.substr(0, slash);
  }
  std::string msg = path + ": not inside a ckptfs mount";
  if (real != path) msg += " (" + real + ")";
  return NotFound(std::move(msg));
}

Result<std::string> ReadWholeFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return Status::FromErrno(errno, path);
  std::string data;
  char buf[64 * 1024];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n == 0) return data;
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, path);
    }
    data.append(buf, static_cast<size_t>(n));
  }
}

// ---------------------------------------------------------------------------------------

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
  if (state == "failed" || state == "aborted") return StateKind::kFailed;
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

// The state of publication, from the stats' journal_halted.
std::string HaltLine(const json& stats) {
  auto it = stats.find("journal_halted");
  if (it == stats.end() || !it->is_object()) return "running";
  const json& h = *it;
  std::string line = "HALTED at " + GetString(h, "entry").value_or("?") + ": " +
                     GetString(h, "error").value_or("?");
  line += h.value("retrying", false) ? " (retrying; " : " (waiting for resume or abort; ";
  line += std::to_string(GetU64(h, "attempts").value_or(0)) + " attempts)";
  return line;
}

Result<std::string> FormatStats(std::string_view stats_json) {
  CKPT_ASSIGN_OR_RETURN(json j, ParseJson(stats_json, ".ckptfs/stats"));
  if (!j.is_object()) return Corrupt(".ckptfs/stats is not a JSON object");

  std::string staging = "-";
  auto used = GetU64(j, "staging_used");
  auto limit = GetU64(j, "staging_limit");
  if (used && limit) {
    staging = HumanBytes(*used) + " / " + HumanBytes(*limit);
    if (*limit > 0) staging += " (" + Percent(PercentDone(*used, *limit)) + ")";
  } else if (used) {
    staging = HumanBytes(*used);
  }

  auto journal = GetU64(j, "journal_pending");
  auto files = GetU64(j, "files_pending");
  std::string pending = "-";
  if (journal || files) {
    pending = CountOrDash(journal) + (journal == 1u ? " journal entry, " : " journal entries, ") +
              CountOrDash(files) + (files == 1u ? " file" : " files");
  }

  std::string checkpoints = "-";
  auto cks = j.find("checkpoints");
  if (cks != j.end() && cks->is_object()) {
    checkpoints.clear();
    static const char* const kKnown[] = {"writing", "pending", "committed", "failed", "aborted"};
    for (const char* state : kKnown) {
      if (!checkpoints.empty()) checkpoints += ", ";
      checkpoints += CountOrDash(GetU64(*cks, state)) + " " + state;
    }
    // States a newer daemon reports (e.g. "halted") follow, so none is hidden.
    for (const auto& [state, n] : cks->items()) {
      if (std::find(std::begin(kKnown), std::end(kKnown), state) != std::end(kKnown)) continue;
      checkpoints += ", " + CountOrDash(GetU64(*cks, state.c_str())) + " " + state;
    }
  }

  auto pid = GetU64(j, "pid");
  auto uptime = GetDouble(j, "uptime_s");
  std::vector<std::pair<std::string, std::string>> rows = {
      {"mountpoint", OrDash(GetString(j, "mountpoint"))},
      {"backing dir", OrDash(GetString(j, "backing_dir"))},
      {"state dir", OrDash(GetString(j, "state_dir"))},
      {"pid", CountOrDash(pid)},
      {"version", OrDash(GetString(j, "version"))},
      {"uptime", uptime ? HumanDuration(*uptime) : "-"},
      {"durability", OrDash(GetString(j, "durability"))},
      {"bytes written", BytesOrDash(GetU64(j, "bytes_written"))},
      {"bytes staged", BytesOrDash(GetU64(j, "bytes_staged"))},
      {"bytes flushed", BytesOrDash(GetU64(j, "bytes_flushed"))},
      {"bytes published", BytesOrDash(GetU64(j, "bytes_published"))},
      {"backing read", BytesOrDash(GetU64(j, "backing_bytes_read"))},
      {"staging", staging},
      {"pending", pending},
      {"checkpoints", checkpoints},
      {"errors", CountOrDash(GetU64(j, "errors"))},
      {"last error", OrDash(GetString(j, "last_error"))},
      {"publication", HaltLine(j)},
  };
  // Peer daemons (issue 12), when this daemon has a peer list.
  if (auto nodes = GetU64(j, "peers_nodes")) {
    std::string rank = "?";
    if (auto p = j.find("peers"); p != j.end() && p->is_object()) {
      rank = CountOrDash(GetU64(*p, "node_rank"));
    }
    rows.push_back({"peers", CountOrDash(GetU64(j, "peers_connected")) + " of " +
                                 std::to_string(*nodes > 0 ? *nodes - 1 : 0) +
                                 " connected (this node: rank " + rank + ")"});
    rows.push_back({"read from peers", BytesOrDash(GetU64(j, "peer_bytes_read")) + ", " +
                                           CountOrDash(GetU64(j, "peer_fallbacks")) +
                                           " fallbacks to the backing store"});
    rows.push_back({"served to peers", BytesOrDash(GetU64(j, "peer_bytes_served")) + ", " +
                                           CountOrDash(GetU64(j, "peer_refused")) +
                                           " connections refused"});
  }
  // The retained tier (issue 23), when this daemon keeps committed checkpoints in memory.
  if (auto r = j.find("retained"); r != j.end() && r->is_object()) {
    size_t held = 0;
    if (auto c = r->find("checkpoints"); c != r->end() && c->is_array()) held = c->size();
    rows.push_back({"in memory", BytesOrDash(GetU64(*r, "retained_bytes")) + " own, " +
                                     BytesOrDash(GetU64(*r, "replica_bytes")) +
                                     " replicas for others, " + std::to_string(held) +
                                     " checkpoints (" + BytesOrDash(GetU64(*r, "used_bytes")) +
                                     " of " + BytesOrDash(GetU64(*r, "budget_bytes")) + ")"});
    std::string hits = BytesOrDash(GetU64(*r, "hit_bytes")) + " from memory";
    if (auto rep = r->find("replication"); rep != r->end() && rep->is_object()) {
      hits += ", " + BytesOrDash(GetU64(*rep, "holder_bytes")) + " from the replica holder";
    }
    hits += ", " + CountOrDash(GetU64(*r, "crc_errors")) + " checksum errors";
    rows.push_back({"restart reads", hits});
  }
  return FormatKeyValues(rows);
}

Result<std::string> FormatCheckpoints(std::string_view checkpoints_json, double now_epoch) {
  CKPT_ASSIGN_OR_RETURN(json j, ParseJson(checkpoints_json, ".ckptfs/checkpoints"));
  if (!j.is_array()) return Corrupt(".ckptfs/checkpoints is not a JSON array");
  if (j.empty()) return std::string("no checkpoints\n");

  std::vector<const json*> entries;
  for (const json& e : j) {
    if (!e.is_object()) return Corrupt(".ckptfs/checkpoints holds a non-object entry");
    entries.push_back(&e);
  }
  std::stable_sort(entries.begin(), entries.end(), [](const json* a, const json* b) {
    return GetDouble(*a, "created").value_or(0) < GetDouble(*b, "created").value_or(0);
  });

  // Issue 23: a column for checkpoints held in memory, only when the daemon reports any.
  const bool memory = std::any_of(entries.begin(), entries.end(), [](const json* e) {
    return e->contains("in_memory");
  });
  std::vector<std::vector<std::string>> rows;
  for (const json* e : entries) {
    auto bytes = GetU64(*e, "bytes");
    auto published = GetU64(*e, "bytes_published");
    auto created = GetDouble(*e, "created");
    auto committed = GetDouble(*e, "committed");
    std::string done = "-";
    if (bytes && published && *bytes > 0) done = Percent(PercentDone(*published, *bytes));
    rows.push_back({
        OrDash(GetString(*e, "path")),
        OrDash(GetString(*e, "state")),
        BytesOrDash(bytes),
        done,
        CountOrDash(GetU64(*e, "files")),
        created ? HumanDuration(now_epoch - *created) : "-",
        committed ? FormatLocalTime(*committed) : "-",
        OrDash(GetString(*e, "error")),
    });
    if (memory) {
      std::string cell = "-";
      if (auto m = e->find("in_memory"); m != e->end() && m->is_object()) {
        cell = "here: " + BytesOrDash(GetU64(*m, "own_bytes")) + " own";
        if (GetU64(*m, "replica_bytes").value_or(0) > 0) {
          cell += ", " + BytesOrDash(GetU64(*m, "replica_bytes")) + " replica of " +
                  OrDash(GetString(*m, "replica_of"));
        }
        if (GetString(*m, "state").value_or("") != "committed") cell += " (not served: pending)";
      }
      rows.back().push_back(cell);
    }
  }
  std::vector<Column> columns = {{"PATH"},      {"STATE"}, {"SIZE", true},
                                 {"PUBLISHED", true}, {"FILES", true}, {"AGE", true},
                                 {"COMMITTED"}, {"ERROR"}};
  if (memory) columns.push_back({"IN MEMORY"});
  return FormatTable(columns, rows);
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
  std::string line = "[" + std::string(filled, '#') + std::string(bar_width - filled, '-') +
                     "]  " + pct_buf + "  " + HumanBytes(progress.bytes_done) + " / " +
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

// ---------------------------------------------------------------------------------------

namespace {

// Prints the control file `file_of(root)` of the mount that holds `path`: as it is with
// `as_json`, else through `format`. Anything that fails is one line on `err`.
int PrintControlFile(const std::string& path, std::string (*file_of)(const std::string&),
                     bool as_json,
                     const std::function<Result<std::string>(std::string_view)>& format,
                     std::ostream& out, std::ostream& err) {
  auto root = FindMountRoot(path);
  if (!root.ok()) {
    err << kPrefix << root.status().message() << '\n';
    return kExitError;
  }
  const std::string file = file_of(*root);
  auto text = ReadWholeFile(file);
  if (!text.ok()) {
    err << kPrefix << text.status().message() << '\n';
    return kExitError;
  }
  if (as_json) {
    out << *text;
    if (text->empty() || text->back() != '\n') out << '\n';
    return kExitOk;
  }
  auto formatted = format(*text);
  if (!formatted.ok()) {
    err << kPrefix << file << ": " << formatted.status().message() << '\n';
    return kExitError;
  }
  out << *formatted;
  return kExitOk;
}

}  // namespace

int RunStats(const std::string& path, bool as_json, std::ostream& out, std::ostream& err) {
  return PrintControlFile(path, StatsPath, as_json, FormatStats, out, err);
}

Result<std::string> FormatPeers(std::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Invalid("not a JSON object");
  auto p = j.find("peers");
  if (p == j.end() || !p->is_object()) return std::string("peers: off (no --peers)\n");
  std::ostringstream out;
  const nlohmann::json members = p->value("membership", nlohmann::json::object());
  const auto self = p->value("node_rank", uint64_t{0});
  out << "membership epoch " << members.value("epoch", uint64_t{0}) << ", "
      << members.value("updates", uint64_t{0}) << " change(s) taken, "
      << members.value("rejected", uint64_t{0}) << " refused";
  if (auto why = members.value("last_rejection", std::string()); !why.empty()) {
    out << " (last: " << why << ")";
  }
  out << "\n";
  // Per peer: connected or not, from the block source's view.
  std::map<std::string, nlohmann::json> state;
  for (const auto& peer : p->value("peers", nlohmann::json::array())) {
    state[peer.value("node", std::string())] = peer;
  }
  out << "rank  address                     state\n";
  const auto nodes = members.value("nodes", nlohmann::json::array());
  for (size_t r = 0; r < nodes.size(); ++r) {
    const std::string address = nodes[r].is_string() ? nodes[r].get<std::string>() : "?";
    std::string what = "this node";
    if (r != self) {
      auto it = state.find(address);
      if (it == state.end()) {
        what = "unknown";
      } else if (it->second.value("connected", false)) {
        what = "connected";
      } else {
        what = "not connected";
        if (auto e = it->second.value("last_error", std::string()); !e.empty()) {
          what += ": " + e;
        }
      }
    }
    char line[64];
    std::snprintf(line, sizeof(line), "%-5zu %-27s ", r, address.c_str());
    out << line << what << "\n";
  }
  return out.str();
}

int RunPeers(const std::string& path, bool as_json, std::ostream& out, std::ostream& err) {
  return PrintControlFile(path, StatsPath, as_json, FormatPeers, out, err);
}

int RunCheckpoints(AdminEnv* env, const std::string& path, bool as_json, std::ostream& out,
                   std::ostream& err) {
  return PrintControlFile(
      path, CheckpointsPath, as_json,
      [env](std::string_view text) { return FormatCheckpoints(text, env->WallSeconds()); }, out,
      err);
}

int RunUnmount(AdminEnv* env, const std::string& mountpoint, const WaitOptions& options,
               std::ostream& out, std::ostream& err) {
  json report_json = {{"mountpoint", mountpoint}, {"pid", nullptr},  {"clean", false},
                      {"unpublished_files", nullptr}, {"error", nullptr}};
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
    const bool halted = now_stats->contains("journal_halted") &&
                        (*now_stats)["journal_halted"].is_object();
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

// ---------------------------------------------------------------------------------------

int RunAdmin(const std::vector<std::string>& args, AdminEnv* env, std::ostream& out,
             std::ostream& err) {
  CLI::App app{"Inspect and control a running ckptfs mount.", "ckptfs-admin"};
  app.footer("Run 'ckptfs-admin COMMAND --help' for a command's options. Every command "
             "takes --json.");
  app.set_version_flag("--version", std::string("ckptfs-admin ") + CKPTFS_VERSION + " (git " +
                                        CKPTFS_GIT_COMMIT + ")");
  app.require_subcommand(1);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string(kPrefix) + e.what() + " (see --help)\n";
  });

  std::string path;
  bool as_json = false;
  double timeout_s = 0;
  double create_timeout_s = 0;
  double plain_every_s = 5;
  double top_interval_s = 2;
  int top_iterations = 0;
  int interval_ms = 100;
  const std::string path_help = "Any path inside the ckptfs mount";
  const CLI::Validator seconds(
      [](std::string& value) -> std::string {
        char* end = nullptr;
        double v = std::strtod(value.c_str(), &end);
        if (value.empty() || *end != '\0' || !std::isfinite(v) || v < 0) {
          return "expected a number of seconds >= 0, got '" + value + "'";
        }
        return "";
      },
      "");

  CLI::App* stats = app.add_subcommand("stats", "Print the daemon's statistics.");
  stats->add_option("PATH", path, path_help)->required();
  stats->add_flag("--json", as_json, "Print the raw JSON of .ckptfs/stats");

  CLI::App* peers = app.add_subcommand(
      "peers", "Show the peer membership: its epoch, the rank -> address map, each peer's state.");
  peers->add_option("PATH", path, path_help)->required();
  peers->add_flag("--json", as_json, "Print the raw JSON of .ckptfs/stats");

  CLI::App* checkpoints =
      app.add_subcommand("checkpoints", "List checkpoints with their state, size and age.");
  checkpoints->add_option("PATH", path, path_help)->required();
  checkpoints->add_flag("--json", as_json, "Print the raw JSON of .ckptfs/checkpoints");

  CLI::App* wait =
      app.add_subcommand("wait", "Wait, with a progress bar, until PATH is published.");
  wait->footer(
      "A checkpoint directory is done when committed. Exit status: 0 published or committed, "
      "1 failed or aborted, 2 timeout or error.");
  wait->add_option("PATH", path, "The file or directory to wait for")->required();
  CLI::Option* wait_timeout =
      wait->add_option("--timeout", timeout_s, "Give up after S seconds (default: never)")
          ->type_name("S")
          ->check(seconds);
  wait->add_option("--interval", interval_ms, "Poll every MS milliseconds")
      ->type_name("MS")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600 * 1000));
  wait->add_option("--create-timeout", create_timeout_s,
                   "Wait up to S seconds for PATH to appear (default 0: it must exist)")
      ->type_name("S")
      ->check(seconds);
  wait->add_option("--print-every", plain_every_s,
                   "Not on a terminal: print a progress line every S seconds (default 5)")
      ->type_name("S")
      ->check(seconds);
  wait->add_flag("--json", as_json, "Print the outcome as JSON on stdout");

  CLI::App* unmount =
      app.add_subcommand("unmount", "Drain and unmount a ckptfs mount, and check its exit.");
  unmount->footer(
      "Waits until everything is published, runs fusermount3 -u, waits for the daemon to "
      "exit and reads its exit report. When publication is halted or a commit waits for "
      "shards, it says so and unmounts at once; the daemon then waits up to its "
      "--stop-timeout without progress and leaves the rest for its next start. Exit "
      "status: 0 clean exit with nothing unpublished, 1 unclean exit, unpublished files or "
      "entries left for the next start, 2 timeout or error.");
  unmount->add_option("MOUNTPOINT", path, "The mountpoint of the ckptfs mount")->required();
  CLI::Option* unmount_timeout =
      unmount->add_option("--timeout", timeout_s, "Give up after S seconds (default: never)")
          ->type_name("S")
          ->check(seconds);
  unmount->add_flag("--json", as_json, "Print the outcome as JSON on stdout");

  CLI::App* top = app.add_subcommand(
      "top", "Live throughput and per-checkpoint progress of a mount (like top).");
  top->add_option("PATH", path, path_help)->required();
  top->add_option("--interval", top_interval_s, "Seconds between frames (default 2)")
      ->type_name("S")
      ->check(CLI::Range(0.05, 3600.0));
  top->add_option("-n,--iterations", top_iterations, "Print N frames, then exit (default: run "
                  "until interrupted)")
      ->type_name("N")
      ->check(CLI::Range(0, 1000000));
  top->add_flag("--json", as_json, "One JSON object per frame and line");

  std::string other;
  CLI::App* ls = app.add_subcommand("ls", "List a checkpoint's tensors: fqn, dtype, shape, chunks, bytes.");
  ls->add_option("CKPT", path, "A checkpoint directory inside the mount")->required();
  ls->add_flag("--json", as_json, "Print JSON");
  CLI::App* verify = app.add_subcommand(
      "verify", "Re-read a checkpoint from the backing store; check structure and checksums.");
  verify->footer("Exit status: 0 intact, 1 bad keys (listed), 2 error.");
  verify->add_option("CKPT", path, "A checkpoint directory inside the mount")->required();
  verify->add_flag("--json", as_json, "Print the daemon's verify report as JSON");
  CLI::App* diff =
      app.add_subcommand("diff", "Which tensors changed between two checkpoints, by checksum.");
  diff->footer("Exit status: 0 identical, 1 different, 2 error.");
  diff->add_option("CKPT_A", path, "First checkpoint")->required();
  diff->add_option("CKPT_B", other, "Second checkpoint")->required();
  diff->add_flag("--json", as_json, "Print the differences as JSON");

  CLI::App* resume = app.add_subcommand(
      "resume", "Retry a halted publication now (after freeing space, fixing permissions...).");
  resume->footer("Exit status: 0 publication runs, 1 still halted, 2 error.");
  resume->add_option("PATH", path, path_help)->required();
  resume->add_flag("--json", as_json, "Print the outcome as JSON");
  CLI::App* abort_cmd = app.add_subcommand(
      "abort", "Drop the pending (unpublished) entries at or below PATH so the rest goes on.");
  abort_cmd->footer(
      "Use on a failed checkpoint that halts publication. Nothing of the dropped entries "
      "reaches the backing store; each is listed. Exit status: 0 done, 2 error.");
  abort_cmd->add_option("PATH", path, "A checkpoint directory or file inside the mount")
      ->required();
  abort_cmd->add_flag("--json", as_json, "Print what was dropped as JSON");

  // CLI11 reports an unknown command as a missing one; name it instead.
  auto is_command = [&](const std::string& name) {
    return !app.get_subcommands([&](CLI::App* sub) { return sub->check_name(name); }).empty();
  };
  if (!args.empty() && !args[0].empty() && args[0][0] != '-' && !is_command(args[0])) {
    err << kPrefix << "unknown command '" << args[0] << "' (see --help)\n";
    return kExitError;
  }
  try {
    app.parse(std::vector<std::string>(args.rbegin(), args.rend()));
  } catch (const CLI::ParseError& e) {
    return app.exit(e, out, err) == 0 ? kExitOk : kExitError;
  }

  WaitOptions options;
  options.interval_s = interval_ms / 1000.0;
  options.create_timeout_s = create_timeout_s;
  options.plain_every_s = plain_every_s;
  options.json = as_json;
  if (stats->parsed()) return RunStats(path, as_json, out, err);
  if (checkpoints->parsed()) return RunCheckpoints(env, path, as_json, out, err);
  if (peers->parsed()) return RunPeers(path, as_json, out, err);
  if (wait->parsed()) {
    if (wait_timeout->count() > 0) options.timeout_s = timeout_s;
    return RunWait(env, path, options, out, err);
  }
  if (resume->parsed()) return RunResume(env, path, as_json, out, err);
  if (abort_cmd->parsed()) return RunAbort(env, path, as_json, out, err);
  if (ls->parsed()) return RunLs(path, as_json, out, err);
  if (verify->parsed()) return RunVerify(env, path, as_json, out, err);
  if (diff->parsed()) return RunDiff(env, path, other, as_json, out, err);
  if (top->parsed()) {
    TopOptions top_options;
    top_options.interval_s = top_interval_s;
    top_options.iterations = top_iterations;
    top_options.json = as_json;
    return RunTop(env, path, top_options, out, err);
  }
  if (unmount->parsed()) {
    if (unmount_timeout->count() > 0) options.timeout_s = timeout_s;
    return RunUnmount(env, path, options, out, err);
  }
  err << kPrefix << "no command given (see --help)\n";
  return kExitError;
}

}  // namespace ckptfs::admin
