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

Status AdminEnv::SetXattr(const std::string& path, const std::string& name,
                          const std::string& value) {
  if (::setxattr(path.c_str(), name.c_str(), value.data(), value.size(), 0) != 0) {
    return Status::FromErrno(errno, path + ": setxattr " + name);
  }
  return Status::Ok();
}

int RunResume(AdminEnv* env, const std::string& path, bool as_json, std::ostream& out,
              std::ostream& err) {
  auto root = FindMountRoot(path);
  if (!root.ok()) {
    err << kPrefix << root.status().message() << '\n';
    return kExitError;
  }
  Status st = env->SetXattr(path, kResumeXattr, "1");
  if (!st.ok()) {
    err << kPrefix << st.message() << '\n';
    return kExitError;
  }
  // Give the retry a moment, then report where publication stands.
  env->Sleep(0.5);
  auto text = ReadWholeFile(internal::StatsPath(*root));
  if (!text.ok()) {
    err << kPrefix << text.status().message() << '\n';
    return kExitError;
  }
  auto stats = internal::ParseJson(*text, ".ckptfs/stats");
  if (!stats.ok()) {
    err << kPrefix << stats.status().message() << '\n';
    return kExitError;
  }
  auto halted = stats->find("journal_halted");
  const bool still = halted != stats->end() && halted->is_object();
  if (as_json) {
    json j = {{"resumed", true}, {"halted", still ? *halted : json(nullptr)}};
    out << j.dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
  } else if (still) {
    out << "still halted at " << halted->value("entry", "?") << ": "
        << halted->value("error", "?") << '\n';
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
  const json dropped = j->value("dropped", json::array());
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
