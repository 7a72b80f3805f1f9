// ckptfs-admin checkpoints: the table of MOUNT/.ckptfs/checkpoints, one row a checkpoint,
// oldest first.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "mount/admin.h"
#include "mount/admin_internal.h"

namespace ckptfs::admin {

using namespace internal;  // NOLINT: the helpers of admin_internal.h

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
  const bool memory = std::any_of(entries.begin(), entries.end(),
                                  [](const json* e) { return e->contains("in_memory"); });
  // Issue 42: a tier column once a memory-only checkpoint is listed, with its replica.
  const bool tiers = std::any_of(entries.begin(), entries.end(),
                                 [](const json* e) { return e->contains("tier"); });
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
    if (tiers) {
      std::string tier = GetString(*e, "tier").value_or("backing");
      if (tier == "memory") {
        auto holder = GetString(*e, "replica_holder");
        tier += holder ? ", replica on " + *holder : ", this node only";
      }
      rows.back().push_back(tier);
    }
  }
  std::vector<Column> columns = {
      {"PATH"},        {"STATE"},     {"SIZE", true}, {"PUBLISHED", true},
      {"FILES", true}, {"AGE", true}, {"COMMITTED"},  {"ERROR"}};
  if (memory) columns.push_back({"IN MEMORY"});
  if (tiers) columns.push_back({"TIER"});
  return FormatTable(columns, rows);
}

int RunCheckpoints(AdminEnv* env, const std::string& path, bool as_json, std::ostream& out,
                   std::ostream& err) {
  return PrintControlFile(
      path, CheckpointsPath, as_json,
      [env](std::string_view text) { return FormatCheckpoints(text, env->WallSeconds()); }, out,
      err);
}

}  // namespace ckptfs::admin
