// ckptfs-admin ls / verify / diff: checkpoint contents through the tensor view
// (/.ckptfs/tensors) and the user.ckptfs.verify xattr.
#include <dirent.h>
#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "mount/admin.h"
#include "mount/admin_internal.h"

namespace ckptfs::admin {
namespace {

constexpr char kPrefix[] = "ckptfs-admin: ";

// The tensor-view directory of checkpoint `ckpt` (a path inside a mount).
Result<std::string> ViewDirOf(const std::string& ckpt) {
  CKPT_ASSIGN_OR_RETURN(std::string root, FindMountRoot(ckpt));
  char real[PATH_MAX];
  if (::realpath(ckpt.c_str(), real) == nullptr) return Status::FromErrno(errno, ckpt);
  std::string rel = std::string(real).substr(root.size());
  while (!rel.empty() && rel.front() == '/') rel.erase(0, 1);
  return root + "/" + kCtlDirName + "/" + kCtlTensorsName + (rel.empty() ? "" : "/" + rel);
}

// Makes a meta.json what the commands read (the daemon's output is input: another
// version's, a torn read, not ckptfs at all): an object whose fqn, kind and dtype are
// strings, whose chunks are objects with "offsets" and "checksum", and whose counts are
// numbers; a field missing or of another type reads as empty. False when it is no object.
bool ReadableMeta(nlohmann::json* m) {
  if (!m->is_object()) return false;
  for (const char* key : {"fqn", "kind", "dtype"}) {
    if (!(*m)[key].is_string()) (*m)[key] = "";
  }
  if (!(*m)["global_shape"].is_array()) (*m)["global_shape"] = nullptr;
  nlohmann::json chunks = nlohmann::json::array();
  if ((*m)["chunks"].is_array()) {
    for (nlohmann::json& c : (*m)["chunks"]) {
      if (!c.is_object()) continue;
      if (!c.contains("offsets")) c["offsets"] = nullptr;
      if (!c["checksum"].is_string()) c["checksum"] = nullptr;
      for (const char* key : {"raw_nbytes", "item_length"}) {
        if (!c[key].is_number_unsigned()) c[key] = 0;
      }
      chunks.push_back(std::move(c));
    }
  }
  (*m)["chunks"] = std::move(chunks);
  return true;
}

// One meta.json per fqn, in name order.
Result<std::vector<nlohmann::json>> LoadMetas(const std::string& ckpt) {
  CKPT_ASSIGN_OR_RETURN(std::string dir, ViewDirOf(ckpt));
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return Status::FromErrno(errno, "not an indexed checkpoint: " + ckpt);
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  std::vector<nlohmann::json> metas;
  for (const auto& n : names) {
    auto text = ReadWholeFile(dir + "/" + n + "/meta.json");
    if (!text.ok()) continue;  // a sub-directory that is not a tensor
    auto j = nlohmann::json::parse(*text, nullptr, false);
    if (ReadableMeta(&j)) metas.push_back(std::move(j));
  }
  return metas;
}

uint64_t MetaBytes(const nlohmann::json& meta) {
  uint64_t n = 0;
  for (const auto& c : meta["chunks"]) {
    n += meta.value("kind", "") == "tensor" ? c.value("raw_nbytes", uint64_t{0})
                                            : c.value("item_length", uint64_t{0});
  }
  return n;
}

std::string ShapeText(const nlohmann::json& shape) {
  if (!shape.is_array()) return "-";
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + shape[i].dump();
  return s + "]";
}

}  // namespace

int RunLs(const std::string& ckpt, bool json, std::ostream& out, std::ostream& err) {
  auto metas = LoadMetas(ckpt);
  if (!metas.ok()) {
    err << kPrefix << metas.status().message() << "\n";
    return 2;
  }
  if (json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const auto& m : *metas) {
      arr.push_back({{"fqn", m["fqn"]}, {"kind", m["kind"]}, {"dtype", m["dtype"]},
                     {"shape", m["global_shape"]}, {"chunks", m["chunks"].size()},
                     {"bytes", MetaBytes(m)}});
    }
    out << arr.dump(1) << "\n";
    return 0;
  }
  std::vector<Column> cols = {{"FQN", false}, {"KIND", false}, {"DTYPE", false},
                              {"SHAPE", false}, {"CHUNKS", true}, {"BYTES", true}};
  std::vector<std::vector<std::string>> rows;
  uint64_t total = 0;
  for (const auto& m : *metas) {
    uint64_t bytes = MetaBytes(m);
    total += bytes;
    rows.push_back({m.value("fqn", ""), m.value("kind", ""), m.value("dtype", "-"),
                    ShapeText(m["global_shape"]), std::to_string(m["chunks"].size()),
                    HumanBytes(bytes)});
  }
  out << FormatTable(cols, rows);
  out << metas->size() << " entries, " << HumanBytes(total) << "\n";
  return 0;
}

int RunVerify(AdminEnv* env, const std::string& ckpt, bool json, std::ostream& out,
              std::ostream& err) {
  auto text = env->GetXattr(ckpt, kVerifyXattr);
  if (!text.ok()) {
    err << kPrefix << ckpt << ": " << text.status().message() << "\n";
    return 2;
  }
  auto j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded()) {
    err << kPrefix << "bad verify report\n";
    return 2;
  }
  if (!j.is_object()) {
    err << kPrefix << "bad verify report\n";
    return 2;
  }
  uint64_t bad = internal::GetU64(j, "bad_count").value_or(0);
  if (json) {
    // The daemon's report as it is (extra fields kept), with the path and the verdict.
    j["path"] = ckpt;
    j["ok"] = bad == 0;
    out << j.dump(1) << "\n";
    return bad == 0 ? 0 : 1;
  }
  const nlohmann::json bad_list = j.contains("bad") && j["bad"].is_array()
                                      ? j["bad"]
                                      : nlohmann::json::array();
  for (const auto& b : bad_list) {
    out << "BAD " << internal::GetString(b, "key").value_or("") << ": "
        << internal::GetString(b, "error").value_or("") << "\n";
  }
  // Unchecked items (no checksum taken yet: saved elsewhere and never read in full) were
  // re-read and parsed, but there was nothing to compare their bytes with.
  out << ckpt << ": " << internal::GetU64(j, "items").value_or(0) << " items, "
      << HumanBytes(internal::GetU64(j, "bytes").value_or(0)) << " re-read, " << bad
      << " bad, " << internal::GetU64(j, "unchecked").value_or(0) << " unchecked ("
      << internal::GetString(j, "checksum").value_or("?") << ")\n";
  return bad == 0 ? 0 : 1;
}

int RunDiff(AdminEnv* env, const std::string& a, const std::string& b, bool json,
            std::ostream& out, std::ostream& err) {
  // Checkpoints saved elsewhere carry no checksums until their items are read once.
  for (const std::string& ckpt : {a, b}) {
    auto filled = env->GetXattr(ckpt, kChecksumsXattr);
    if (!filled.ok()) {
      err << kPrefix << ckpt << ": " << filled.status().message() << "\n";
      return 2;
    }
  }
  auto ma = LoadMetas(a), mb = LoadMetas(b);
  if (!ma.ok() || !mb.ok()) {
    err << kPrefix << (ma.ok() ? mb.status() : ma.status()).message() << "\n";
    return 2;
  }
  // fqn -> (chunk offsets -> checksum)
  auto sums = [](const std::vector<nlohmann::json>& metas) {
    std::map<std::string, std::map<std::string, std::string>> m;
    for (const auto& meta : metas) {
      auto& chunks = m[meta.value("fqn", "")];
      for (const auto& c : meta["chunks"]) {
        chunks[c["offsets"].dump()] = c["checksum"].is_string() ? c["checksum"].get<std::string>()
                                                                : std::string("?");
      }
    }
    return m;
  };
  auto sa = sums(*ma), sb = sums(*mb);
  std::set<std::string> fqns;
  for (auto& [k, _] : sa) fqns.insert(k);
  for (auto& [k, _] : sb) fqns.insert(k);
  // A chunk without a checksum (its item unreadable) is never taken as unchanged.
  auto unknown = [](const std::map<std::string, std::string>& chunks) {
    for (const auto& [offsets, sum] : chunks) {
      if (sum == "?") return true;
    }
    return false;
  };
  int changes = 0;
  nlohmann::json entries = nlohmann::json::array();
  auto report = [&](const char* mark, const char* change, const std::string& fqn,
                    const char* note) {
    if (json) {
      entries.push_back({{"fqn", fqn}, {"change", change}});
    } else {
      out << mark << " " << fqn << note << "\n";
    }
    ++changes;
  };
  for (const auto& fqn : fqns) {
    auto ia = sa.find(fqn), ib = sb.find(fqn);
    if (ia == sa.end()) {
      report("+", "added", fqn, "");
    } else if (ib == sb.end()) {
      report("-", "removed", fqn, "");
    } else if (unknown(ia->second) || unknown(ib->second)) {
      report("?", "unknown", fqn, " (no checksum)");
    } else if (ia->second != ib->second) {
      report("M", "modified", fqn, "");
    }
  }
  if (json) {
    nlohmann::json j = {{"a", a},           {"b", b},
                        {"entries", fqns.size()}, {"differ", changes},
                        {"identical", changes == 0}, {"changes", entries}};
    out << j.dump(1) << "\n";
  } else {
    out << changes << " of " << fqns.size() << " entries differ\n";
  }
  return changes == 0 ? 0 : 1;
}

}  // namespace ckptfs::admin
