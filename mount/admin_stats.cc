// ckptfs-admin stats and peers: the daemon's statistics and its peer membership, both read
// from MOUNT/.ckptfs/stats.
#include <algorithm>
#include <cstdio>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "mount/admin.h"
#include "mount/admin_internal.h"

namespace ckptfs::admin {
namespace {

using namespace internal;  // NOLINT: the helpers of admin_internal.h

// The state of publication, from the stats' journal_halted.
std::string HaltLine(const json& stats) {
  auto it = stats.find("journal_halted");
  if (it == stats.end() || !it->is_object()) return "running";
  const json& h = *it;
  std::string line = "HALTED at " + GetString(h, "entry").value_or("?") + ": " +
                     GetString(h, "error").value_or("?");
  line +=
      GetBool(h, "retrying").value_or(false) ? " (retrying; " : " (waiting for resume or abort; ";
  line += std::to_string(GetU64(h, "attempts").value_or(0)) + " attempts)";
  return line;
}

}  // namespace

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
    if (const std::optional<uint64_t> indexed = GetU64(*r, "index_read_bytes");
        indexed && *indexed > 0) {
      hits += "; index builds read " + BytesOrDash(indexed) + " from memory";
    }
    rows.push_back({"restart reads", hits});
  }
  return FormatKeyValues(rows);
}

int RunStats(const std::string& path, bool as_json, std::ostream& out, std::ostream& err) {
  return PrintControlFile(path, StatsPath, as_json, FormatStats, out, err);
}

Result<std::string> FormatPeers(std::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Invalid("not a JSON object");
  auto p = j.find("peers");
  if (p == j.end() || !p->is_object()) return std::string("peers: off (no --peers)\n");
  std::ostringstream out;
  // Every field read without throwing (control_fuzz: a "node" that was a number ended
  // ckptfs-admin with an uncaught type_error): the daemon's output is input here.
  static const nlohmann::json kNone = nlohmann::json::object();
  auto members_it = p->find("membership");
  const nlohmann::json& members =
      members_it != p->end() && members_it->is_object() ? *members_it : kNone;
  const uint64_t self = GetU64(*p, "node_rank").value_or(0);
  out << "membership epoch " << GetU64(members, "epoch").value_or(0) << ", "
      << GetU64(members, "updates").value_or(0) << " change(s) taken, "
      << GetU64(members, "rejected").value_or(0) << " refused";
  if (auto why = GetString(members, "last_rejection").value_or(""); !why.empty()) {
    out << " (last: " << why << ")";
  }
  out << "\n";
  // Per peer: connected or not, from the block source's view.
  std::map<std::string, nlohmann::json> state;
  if (auto peers = p->find("peers"); peers != p->end() && peers->is_array()) {
    for (const auto& peer : *peers) {
      if (auto node = GetString(peer, "node")) state[*node] = peer;
    }
  }
  out << "rank  address                     state\n";
  auto nodes_it = members.find("nodes");
  const nlohmann::json nodes =
      nodes_it != members.end() && nodes_it->is_array() ? *nodes_it : nlohmann::json::array();
  for (size_t r = 0; r < nodes.size(); ++r) {
    const std::string address = nodes[r].is_string() ? nodes[r].get<std::string>() : "?";
    std::string what = "this node";
    if (r != self) {
      auto it = state.find(address);
      if (it == state.end()) {
        what = "unknown";
      } else if (GetBool(it->second, "connected").value_or(false)) {
        what = "connected";
      } else {
        what = "not connected";
        if (auto e = GetString(it->second, "last_error").value_or(""); !e.empty()) {
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

}  // namespace ckptfs::admin
