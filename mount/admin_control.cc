// ckptfs-admin resume / abort: the operator's answers to a halted publication (G7).
//
// Both are extended attributes the daemon acts on (setxattr is one call, unlike getxattr's
// size probe, so an action never runs twice): user.ckptfs.resume on any path retries the
// halted entry and the parked flushes now; user.ckptfs.abort on a path drops the pending
// entries at or below it, and user.ckptfs.aborted then reports what went.
#include <sys/xattr.h>

#include <nlohmann/json.hpp>

#include "mount/admin.h"
#include "mount/admin_internal.h"

namespace ckptfs::admin {
namespace {

using internal::kPrefix;
using json = nlohmann::json;


}  // namespace

int RunResume(AdminEnv* env, const std::string& path, bool as_json, std::ostream& out,
              std::ostream& err) {
  auto root = FindMountRoot(path);
  if (!root.ok()) {
    err << kPrefix << root.status().message() << '\n';
    return kExitError;
  }
  // Where publication stands: the halt (seq, failed attempts so far), or none.
  auto read_halt = [&]() -> Result<json> {
    CKPT_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(internal::StatsPath(*root)));
    CKPT_ASSIGN_OR_RETURN(json stats, internal::ParseJson(text, ".ckptfs/stats"));
    auto halted = stats.find("journal_halted");
    return halted != stats.end() && halted->is_object() ? *halted : json(nullptr);
  };
  auto before = read_halt();
  if (!before.ok()) {
    err << kPrefix << before.status().message() << '\n';
    return kExitError;
  }
  Status st = env->SetXattr(path, kResumeXattr, "1");
  if (!st.ok()) {
    err << kPrefix << st.message() << '\n';
    return kExitError;
  }
  // Wait for the retry this starts: until publication runs again, or the halted entry
  // failed once more (or publication halted at a later entry), for 10 s at most. Under
  // load a retry can take seconds (parked chunks are rewritten first), and a `wait` run
  // right after must see where it went.
  const auto attempts_of = [](const json& h) {
    return internal::GetU64(h, "attempts").value_or(0);
  };
  const auto seq_of = [](const json& h) { return internal::GetU64(h, "seq").value_or(0); };
  json halted = nullptr;
  for (int i = 0; i < 100; ++i) {
    env->Sleep(0.1);
    auto now = read_halt();
    if (!now.ok()) {
      err << kPrefix << now.status().message() << '\n';
      return kExitError;
    }
    halted = std::move(now).value();
    if (halted.is_null()) break;
    if (before->is_null() || seq_of(halted) != seq_of(*before) ||
        attempts_of(halted) > attempts_of(*before)) {
      break;
    }
  }
  const bool still = !halted.is_null();
  if (as_json) {
    json j = {{"resumed", true}, {"halted", halted}};
    out << j.dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
  } else if (still) {
    out << "still halted at " << internal::GetString(halted, "entry").value_or("?") << ": "
        << internal::GetString(halted, "error").value_or("?") << '\n';
  } else {
    out << "publication runs\n";
  }
  return still ? kExitFailed : kExitOk;
}

int RunAbort(AdminEnv* env, const std::string& path, bool as_json, std::ostream& out,
             std::ostream& err) {
  auto root = FindMountRoot(path);
  if (!root.ok()) {
    err << kPrefix << root.status().message() << '\n';
    return kExitError;
  }
  Status st = env->SetXattr(path, kAbortXattr, "1");
  if (!st.ok()) {
    err << kPrefix << st.message() << '\n';
    return kExitError;
  }
  auto report = env->GetXattr(path, kAbortReportXattr);
  if (!report.ok()) {
    err << kPrefix << report.status().message() << '\n';
    return kExitError;
  }
  auto j = internal::ParseJson(*report, kAbortReportXattr);
  if (!j.ok()) {
    err << kPrefix << j.status().message() << '\n';
    return kExitError;
  }
  if (as_json) {
    out << j->dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
    return kExitOk;
  }
  const json dropped = j->is_object() && j->contains("dropped") && (*j)["dropped"].is_array()
                           ? (*j)["dropped"]
                           : json::array();
  if (dropped.empty()) {
    out << "nothing pending at or below " << path << "\n";
    return kExitOk;
  }
  out << "dropped " << dropped.size() << " pending entr" << (dropped.size() == 1 ? "y" : "ies")
      << " (never published):\n";
  for (const json& line : dropped) {
    if (line.is_string()) out << "  " << line.get<std::string>() << '\n';
  }
  return kExitOk;
}

}  // namespace ckptfs::admin
