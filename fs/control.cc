// The /.ckptfs control files and the user.ckptfs.* xattrs.
#include <sys/xattr.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <set>
#include <sstream>

#include "common/json_text.h"
#include "fs/filesystem.h"

namespace ckptfs::fs {
namespace {

constexpr char kStateXattr[] = "user.ckptfs.state";
constexpr char kProgressXattr[] = "user.ckptfs.progress";
constexpr char kVerifyXattr[] = "user.ckptfs.verify";
constexpr char kChecksumsXattr[] = "user.ckptfs.checksums";
// Operator controls, set with setxattr (a single call, unlike getxattr's size probe):
// resume retries a halted publication now; abort drops the pending entries at or below
// the path. The report of the last abort is read back from kAbortReportXattr.
constexpr char kResumeXattr[] = "user.ckptfs.resume";
constexpr char kAbortXattr[] = "user.ckptfs.abort";
constexpr char kAbortReportXattr[] = "user.ckptfs.aborted";
constexpr char kVersion[] = "0.1.0";

}  // namespace

std::string Filesystem::StatsJson() {
  nlohmann::json j;
  j["pid"] = ::getpid();
  j["version"] = kVersion;
  j["mountpoint"] = config_.mountpoint;
  j["backing_dir"] = config_.backing_dir;
  j["state_dir"] = config_.state_dir;
  j["durability"] = config_.strict ? "strict" : "async";
  j["uptime_s"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  const uint64_t written = bytes_written_.load();
  j["bytes_written"] = written;
  j["bytes_staged"] = written;  // every write is copied into staging
  j["bytes_flushed"] = pipeline_->bytes_flushed();
  j["bytes_published"] = bytes_published_.load();
  j["files_published"] = files_published_.load();
  j["staging_used"] = pool_->used_bytes();
  j["staging_limit"] = pool_->limit_bytes();
  j["staging_backend"] = pool_->backend();
  j["staging_waits"] = pool_->waits();
  j["backing_bytes_read"] = backing_->bytes_read();
  j["write_checksums"] = config_.write_checksums;
  j["checksum_bytes_hashed"] = pipeline_->crc_bytes();  // by the flush threads, in staging
  j["checksum_hash_s"] = pipeline_->crc_ns() / 1e9;
  j["checksum_block_maps_bytes"] = index_->block_crc_bytes();
  j["checksums_on_read"] = read_sums_->recorded();
  j["backing_bytes_written"] = backing_->bytes_written();
  j["bytes_served"] = bytes_read_.load();
  if (cache_) {
    store::BlockCacheStats c = cache_->Stats();
    j["cache_hits"] = c.hits;
    j["cache_misses"] = c.misses;
    j["cache_dedup_waits"] = c.dedup_waits;
    j["cache_used"] = c.used_bytes;
    j["cache_limit"] = c.budget_bytes;
    j["cache_peak"] = c.peak_used_bytes;
    j["cache_backing_bytes_read"] = c.backing_bytes_read;
    j["cache_direct_bytes_read"] = c.direct_bytes_read;
    j["cache_free_buffers"] = c.free_buffer_bytes;
    j["cache_bytes_served"] = c.bytes_served;
    j["prefetched_bytes"] = c.prefetched_bytes;
    j["prefetch_hits"] = c.prefetch_hits;
    j["cache_evictions"] = c.evictions;
    j["dedup_ratio"] = c.backing_bytes_read == 0
                           ? 0.0
                           : static_cast<double>(c.bytes_served) / c.backing_bytes_read;
  }
  j["journal_pending"] = journal_->pending();
  j["journal_applied_ahead"] = journal_->applied_ahead();
  j["journal_retries"] = journal_->retries();
  j["journal_halted"] = nullptr;
  if (auto halt = journal_->halted()) {
    j["journal_halted"] = {{"seq", halt->seq},
                           {"entry", halt->what},
                           {"path", halt->path},
                           {"error", halt->error.ToString()},
                           {"attempts", halt->attempts},
                           {"retrying", halt->transient},
                           {"since", halt->since}};
  }
  j["flush_queue"] = pipeline_->queued();
  j["flush_retries"] = pipeline_->retries();
  j["flush_parked"] = pipeline_->parked();
  {
    std::lock_guard lock(ns_mu_);
    uint64_t files_pending = 0;
    for (const auto& [_, node] : inodes_) {
      if (node->write && (node->write->needs_publish ||
                          node->write->publish_seq > journal_->applied())) {
        ++files_pending;
      }
    }
    j["files_pending"] = files_pending;
    j["inodes"] = inodes_.size();
  }
  j["checkpoints"] = checkpoints_->CountByState();
  j["errors"] = errors_.load() + pipeline_->errors();
  {
    std::lock_guard lock(error_mu_);
    j["last_error"] = last_error_;
  }
  return JsonText(j, 1) + "\n";
}

std::string Filesystem::CheckpointsJson() {
  ForgetVanishedCheckpoints();
  nlohmann::json arr = nlohmann::json::array();
  std::set<std::string> listed;
  for (const auto& info : checkpoints_->List()) {
    nlohmann::json j = info.ToJson();
    std::string index_error = index_->IndexError(info.path);
    j["index_error"] = index_error.empty() ? nlohmann::json() : nlohmann::json(index_error);
    listed.insert(info.path);
    arr.push_back(std::move(j));
  }
  // Checkpoints that were already on the backing store (saved before this mount or by
  // another node) appear once they have been looked at and indexed.
  for (const auto& path : index_->IndexedCheckpoints()) {
    if (listed.count(path)) continue;
    store::CheckpointInfo info;
    info.path = path;
    info.state = store::CkptState::kCommitted;
    nlohmann::json j = info.ToJson();
    std::string index_error = index_->IndexError(path);
    j["index_error"] = index_error.empty() ? nlohmann::json() : nlohmann::json(index_error);
    j["committed"] = nullptr;
    j["created"] = j["updated"] = nullptr;  // unknown: not saved through this mount
    j["origin"] = "backing store";
    arr.push_back(std::move(j));
  }
  return JsonText(arr, 1) + "\n";
}

std::string Filesystem::MetricsText() {
  auto stats = nlohmann::json::parse(StatsJson());
  std::ostringstream out;
  auto metric = [&](const char* name, const char* type, const char* help, uint64_t value) {
    out << "# HELP ckptfs_" << name << " " << help << "\n# TYPE ckptfs_" << name << " " << type
        << "\nckptfs_" << name << " " << value << "\n";
  };
  metric("bytes_written_total", "counter", "Bytes written by applications.",
         stats["bytes_written"]);
  metric("bytes_flushed_total", "counter", "Bytes written to backing temp files.",
         stats["bytes_flushed"]);
  metric("bytes_published_total", "counter", "Bytes of files published on the backing store.",
         stats["bytes_published"]);
  metric("backing_bytes_read_total", "counter", "Bytes read from the backing store.",
         stats["backing_bytes_read"]);
  metric("bytes_served_total", "counter", "Bytes returned to readers.", stats["bytes_served"]);
  if (stats.contains("cache_hits")) {
    metric("cache_hits_total", "counter", "Block cache hits.", stats["cache_hits"]);
    metric("cache_misses_total", "counter", "Block cache misses.", stats["cache_misses"]);
    metric("cache_dedup_waits_total", "counter", "Reads that joined a backing read in flight.",
           stats["cache_dedup_waits"]);
    metric("cache_used_bytes", "gauge", "Block cache memory in use.", stats["cache_used"]);
    out << "# HELP ckptfs_dedup_ratio Bytes served from the cache per byte read from the "
           "backing store.\n# TYPE ckptfs_dedup_ratio gauge\nckptfs_dedup_ratio "
        << stats["dedup_ratio"].get<double>() << "\n";
  }
  metric("staging_used_bytes", "gauge", "Staging memory in use.", stats["staging_used"]);
  metric("staging_limit_bytes", "gauge", "Staging memory budget.", stats["staging_limit"]);
  metric("staging_waits_total", "counter", "Writes that waited for staging memory.",
         stats["staging_waits"]);
  metric("journal_pending", "gauge", "Journal entries not yet applied.",
         stats["journal_pending"]);
  metric("files_pending", "gauge", "Files not yet published.", stats["files_pending"]);
  metric("errors_total", "counter", "Errors (flush, publish, commit).", stats["errors"]);
  out << "# HELP ckptfs_checkpoints Checkpoints by state.\n# TYPE ckptfs_checkpoints gauge\n";
  for (const auto& [state, n] : stats["checkpoints"].items()) {
    out << "ckptfs_checkpoints{state=\"" << state << "\"} " << n.get<uint64_t>() << "\n";
  }
  return out.str();
}

std::string Filesystem::ProgressJson(uint64_t ino) {
  nlohmann::json j = {{"state", "published"}, {"bytes_total", 0}, {"bytes_done", 0},
                      {"error", ""}};
  if (ino < kFirstNodeIno && ino != kRootIno) return JsonText(j);
  std::lock_guard lock(ns_mu_);
  auto node = NodeLocked(ino);
  if (!node) return JsonText(j);
  const uint64_t applied = journal_->applied();
  if (node->type == NodeType::kFile) {
    if (!node->error.empty() || !node->halt_error.empty()) {
      j["state"] = "failed";
      j["error"] = node->error.empty() ? node->halt_error : node->error;
    } else if (node->write) {
      const WriteState& ws = *node->write;
      const uint64_t size = ws.staged->size();
      j["bytes_total"] = size;
      j["bytes_done"] = std::min<uint64_t>(size, ws.staged->target()->bytes_flushed());
      if (!ws.staged->error().ok()) {
        j["state"] = "failed";
        j["error"] = ws.staged->error().ToString();
      } else if (ws.needs_publish || ws.staged->staged_bytes() > 0) {
        j["state"] = "staged";
      } else if (ws.publish_seq > applied) {
        j["state"] = ws.staged->target()->synced() ? "durable" : "staged";
      }
    } else if (node->pending_seq > applied) {
      j["state"] = "staged";
    } else {
      j["bytes_total"] = j["bytes_done"] = static_cast<uint64_t>(node->attr.st_size);
    }
    return JsonText(j);
  }
  const std::string path = PathLocked(node.get());
  if (auto info = checkpoints_->Get(path)) {
    j["state"] = store::CkptStateName(info->state);
    j["bytes_total"] = info->bytes;
    j["bytes_done"] = info->bytes_published;
    j["error"] = info->error;
    return JsonText(j);
  }
  // Any other directory: published once no entry made so far is pending. (Entries
  // are applied in order, so this covers everything below it.)
  const uint64_t last = journal_->last_appended();
  if (last > applied) {
    j["state"] = "staged";
    j["bytes_total"] = last;
    j["bytes_done"] = applied;
  }
  return JsonText(j);
}

void Filesystem::Resume() {
  spdlog::info("operator: resume");
  pipeline_->RetryNow();
  journal_->Resume();
}

std::vector<std::string> Filesystem::Abort(const std::string& path) {
  spdlog::warn("operator: abort {}", path.empty() ? "/" : path);
  std::vector<std::string> dropped = journal_->Abort(path);
  checkpoints_->OnAborted(path, "aborted by the operator");
  return dropped;
}

Status Filesystem::SetXattr(uint64_t ino, const std::string& name, const std::string&) {
  if (name == kResumeXattr) {
    Resume();
    return Status::Ok();
  }
  if (name != kAbortXattr) return Status(Code::kUnsupported, "setxattr " + name);
  std::string path;
  {
    std::lock_guard lock(ns_mu_);
    auto node = NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    path = PathLocked(node.get());
  }
  std::vector<std::string> dropped = Abort(path);
  nlohmann::json report = {{"path", path}, {"dropped", dropped}};
  std::lock_guard lock(error_mu_);
  last_abort_report_ = JsonText(report, 1) + "\n";
  return Status::Ok();
}

Result<std::string> Filesystem::GetXattr(uint64_t ino, const std::string& name) {
  if (name == kAbortReportXattr) {
    std::lock_guard lock(error_mu_);
    return last_abort_report_.empty() ? std::string("{}\n") : last_abort_report_;
  }
  if (name == kProgressXattr) return ProgressJson(ino);
  if (name == kChecksumsXattr) {
    // Checksums the items that have none yet (read from the backing store once).
    std::string path;
    {
      std::lock_guard lock(ns_mu_);
      auto node = NodeLocked(ino);
      if (!node || node->type != NodeType::kDir) return Invalid("checksums need a checkpoint dir");
      path = PathLocked(node.get());
    }
    CKPT_ASSIGN_OR_RETURN(uint64_t filled, index_->FillChecksums(path));
    nlohmann::json j = {{"checksum", store::kChecksumAlgorithm}, {"computed", filled}};
    return JsonText(j);
  }
  if (name == kVerifyXattr) {
    // Re-reads the checkpoint from the backing store and checks structure and checksums.
    std::string path;
    {
      std::lock_guard lock(ns_mu_);
      auto node = NodeLocked(ino);
      if (!node || node->type != NodeType::kDir) return Invalid("verify needs a checkpoint dir");
      path = PathLocked(node.get());
    }
    CKPT_ASSIGN_OR_RETURN(store::VerifyReport report, index_->Verify(path));
    nlohmann::json bad = nlohmann::json::array();
    for (const auto& [key, why] : report.bad) {
      if (bad.size() >= 200) break;  // an xattr value holds at most 64 KiB
      bad.push_back({{"key", key}, {"error", why}});
    }
    nlohmann::json j = {{"items", report.items},
                        {"bytes", report.bytes},
                        {"checksum", store::kChecksumAlgorithm},
                        {"unchecked", report.unchecked},
                        {"bad_count", report.bad.size()},
                        {"bad", bad}};
    return JsonText(j);
  }
  if (name == kStateXattr) {
    auto j = nlohmann::json::parse(ProgressJson(ino));
    return j["state"].get<std::string>();
  }
  return Status(Code::kNotFound, "no xattr " + name);
}

std::string Filesystem::ListXattr(uint64_t ino) {
  std::string out;
  out.append(kStateXattr).push_back('\0');
  out.append(kProgressXattr).push_back('\0');
  return out;
}

}  // namespace ckptfs::fs
