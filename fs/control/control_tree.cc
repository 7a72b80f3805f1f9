// The control tree: the /.ckptfs directory (its files and the tensor view below it) and
// the user.ckptfs.* xattrs.
#include <fcntl.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <spdlog/spdlog.h>
#include <algorithm>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <utility>

#include "ckptfs_version.h"
#include "common/control_names.h"
#include "common/heap.h"
#include "common/histogram.h"
#include "common/json_text.h"
#include "fs/control/control_tree.h"

#include "fs/fs_util.h"
#include "fs/op_metrics.h"
#include "store/cache/retained_tier.h"
#include "store/memory/memory_tier.h"
#include "store/peer/peers.h"
#include "store/publish/commit_gate.h"

namespace ckptfs::fs {
namespace {

// The file and xattr names (kStateXattr, kAbortXattr...): common/control_names.h.
constexpr char kVersion[] = CKPTFS_VERSION;

// A Prometheus label value: backslash, double quote and newline escaped.
std::string LabelValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

// Save-to-commit seconds (first file created -> committed) of the checkpoints this
// process committed. The registry is polled at each scrape, and each checkpoint is
// observed once, the first time it is seen committed, so the histogram only grows.
class CommitTimes {
 public:
  void Update(const std::vector<store::CheckpointInfo>& list, double process_start) {
    MutexLock lock(&mu_);
    for (const auto& info : list) {
      if (info.state != store::CkptState::kCommitted || info.committed < process_start ||
          info.created <= 0 || !seen_.emplace(info.path, info.committed).second) {
        continue;
      }
      histogram_.Observe(std::max(0.0, info.committed - info.created));
    }
  }
  const Histogram& histogram() const { return histogram_; }

 private:
  Mutex mu_;
  // (path, commit time), so a path saved and committed again counts again.
  std::set<std::pair<std::string, double>> seen_ GUARDED_BY(mu_);
  Histogram histogram_;  // its own atomics; written under mu_
};

CommitTimes& ProcessCommitTimes() {
  static CommitTimes times;
  return times;
}

double EpochNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

ControlTree::ControlTree(const FsConfig& config, const FsParts& parts, NamespaceView* ns)
    : config_(config),
      stats_(parts.stats),
      ns_(ns),
      backing_(parts.backing),
      db_(parts.db),
      pool_(parts.pool),
      pipeline_(parts.pipeline),
      publication_(parts.publication),
      view_(parts.publication->view()),
      index_(parts.index),
      loader_(parts.loader),
      tensors_(parts.tensors),
      retained_(parts.retained),
      memory_tier_(parts.memory_tier) {}

// ---------------------------------------------------------------- the tree

Result<Entry> ControlTree::CtlLookup(uint64_t parent, const std::string& name) {
  Entry e;
  e.timeout = 0;
  if (parent == kRootIno && name == kCtlDirName) {
    e.ino = kCtlDirIno;
    e.timeout = kDefaultTimeout;
    CKPT_ASSIGN_OR_RETURN(e.attr, CtlGetAttr(kCtlDirIno));
    return e;
  }
  if (parent != kCtlDirIno) return NotFound(name);
  if (name == kCtlTensorsName) {
    CKPT_ASSIGN_OR_RETURN(auto attr, tensors_->GetAttr(TensorView::kRootIno));
    return Entry{TensorView::kRootIno, attr, kDefaultTimeout};
  }
  if (name == kCtlStatsName) e.ino = kCtlStatsIno;
  else if (name == kCtlCheckpointsName) e.ino = kCtlCheckpointsIno;
  else if (name == kCtlMetricsName) e.ino = kCtlMetricsIno;
  else return NotFound(name);
  CKPT_ASSIGN_OR_RETURN(e.attr, CtlGetAttr(e.ino));
  return e;
}

Result<struct stat> ControlTree::CtlGetAttr(uint64_t ino) {
  struct stat st {};
  st.st_ino = ino;
  st.st_mode = ino == kCtlDirIno ? (S_IFDIR | 0555) : (S_IFREG | 0444);
  st.st_nlink = ino == kCtlDirIno ? 2 : 1;
  st.st_blksize = 4096;
  struct timespec now = Now();
  st.st_atim = st.st_mtim = st.st_ctim = now;
  return st;
}

Result<Handle*> ControlTree::CtlOpen(uint64_t ino, int flags) {
  auto handle = std::make_unique<Handle>();
  if (TensorView::Owns(ino)) {
    if ((flags & O_ACCMODE) != O_RDONLY) return Status(Code::kPermission, "tensor view");
    std::string content;
    std::shared_ptr<UniqueFd> view_fd;
    uint64_t base = 0, size = 0;
    CKPT_RETURN_IF_ERROR(tensors_->Open(ino, &content, &view_fd, &base, &size));
    if (view_fd) {
      handle->kind.emplace<ViewHandle>(ViewHandle{std::move(view_fd), base, size});
    } else {
      handle->kind.emplace<ContentHandle>(ContentHandle{std::move(content)});
    }
    return handle.release();
  }
  if (ino == kCtlDirIno) return Status(Code::kIsDir, "open of a directory");
  if (ino < kCtlStatsIno || ino > kCtlMetricsIno) return NotFound("stale inode");
  if ((flags & O_ACCMODE) != O_RDONLY) return Status(Code::kPermission, "control file");
  handle->kind.emplace<ContentHandle>(ContentHandle{ino == kCtlStatsIno ? StatsJson()
                                                    : ino == kCtlCheckpointsIno
                                                        ? CheckpointsJson()
                                                        : MetricsText()});
  return handle.release();
}

Result<Handle*> ControlTree::CtlOpenDir(uint64_t ino) {
  auto handle = std::make_unique<Handle>();
  DirHandle& dh = handle->kind.emplace<DirHandle>();
  if (TensorView::Owns(ino)) {
    CKPT_ASSIGN_OR_RETURN(auto list, tensors_->List(ino));
    dh.entries = {{".", ino, S_IFDIR}, {"..", kCtlDirIno, S_IFDIR}};
    for (auto& e : list) dh.entries.push_back({e.name, e.ino, e.type});
    return handle.release();
  }
  if (ino != kCtlDirIno) return Status(Code::kNotDir, "opendir of a control file");
  dh.entries = {{".", kCtlDirIno, S_IFDIR},
                {"..", kRootIno, S_IFDIR},
                {kCtlTensorsName, TensorView::kRootIno, S_IFDIR},
                {kCtlStatsName, kCtlStatsIno, S_IFREG},
                {kCtlCheckpointsName, kCtlCheckpointsIno, S_IFREG},
                {kCtlMetricsName, kCtlMetricsIno, S_IFREG}};
  return handle.release();
}

// ---------------------------------------------------------------- the files

std::string ControlTree::StatsJson() {
  nlohmann::json j;
  j["pid"] = ::getpid();
  j["version"] = kVersion;
  j["mountpoint"] = config_.mountpoint;
  j["backing_dir"] = config_.backing_dir;
  j["state_dir"] = config_.state_dir;
  j["durability"] = config_.strict ? "strict" : "async";
  j["uptime_s"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - stats_->started).count();
  const uint64_t written = stats_->bytes_written.load();
  j["bytes_written"] = written;
  j["bytes_staged"] = written;  // every write is copied into staging
  j["bytes_flushed"] = pipeline_->bytes_flushed();
  j["bytes_published"] = stats_->bytes_published.load();
  j["files_published"] = stats_->files_published.load();
  j["commits_superseded"] = stats_->commits_superseded.load();
  j["gone_dirs_evicted"] = stats_->gone_dirs_evicted.load();
  j["staging_used"] = pool_->used_bytes();
  j["staging_limit"] = pool_->limit_bytes();
  j["staging_backend"] = pool_->backend();
  j["staging_resident"] = pool_->resident_bytes();  // pinned now: used and kept for reuse
  j["staging_pins"] = pool_->pins();
  j["staging_releases"] = pool_->releases();
  j["staging_waits"] = pool_->waits();
  // Issue 42: chunks lent to the retained tier (spares took their place) and spares kept.
  j["staging_lent"] = pool_->lent_bytes();
  j["staging_spare"] = pool_->spare_bytes();
  j["staging_lends"] = pool_->lends();
  j["staging_lend_allocs"] = pool_->lend_allocs();
  j["backing_bytes_read"] = backing_->bytes_read();
  j["write_checksums"] = config_.write_checksums;
  j["bytes_flushed_direct"] = pipeline_->direct_bytes();  // O_DIRECT, no page-cache copy
  j["checksum_bytes_hashed"] = pipeline_->crc_bytes();  // by the flush threads, in staging
  j["checksum_hash_s"] = pipeline_->crc_ns() / 1e9;
  j["checksum_block_maps_bytes"] = index_->block_crc_bytes();
  j["checksums_on_read"] = loader_->read_sums().recorded();
  j["backing_bytes_written"] = backing_->bytes_written();
  j["bytes_served"] = stats_->bytes_read.load();
  // Reads the kernel passes through never reach the daemon: counted by open, and their
  // bytes estimated by the sizes of the files opened (an upper bound).
  const FuseTransportStats& ft = stats_->fuse;
  j["fuse_transport"] = ft.state();
  j["fuse_uring_requests"] = ft.uring_requests.load();
  j["fuse_uring_threads"] = ft.uring_threads.load();
  j["fuse_uring_queues"] = ft.uring_queues.load();
  j["fuse_uring_errors"] = ft.uring_errors.load();
  const PassthroughStats& pt = stats_->passthrough;
  j["passthrough"] = pt.state();
  j["passthrough_opens"] = pt.opens.load();
  j["passthrough_open_now"] = pt.open_now.load();
  j["passthrough_bytes_opened_estimate"] = pt.bytes_opened.load();
  j["passthrough_backing_ids"] = pt.backing_opens.load();
  j["passthrough_refused"] = pt.refused.load();
  j["passthrough_conflict_waits"] = pt.conflict_waits.load();
  j["passthrough_conflict_busy"] = pt.conflict_busy.load();
  j["passthrough_page_cache_prefetched"] = pt.page_cache_prefetched.load();
  if (store::BlockCache* cache = loader_->cache()) {
    store::BlockCacheStats c = cache->Stats();
    j["cache_hits"] = c.hits;
    j["cache_misses"] = c.misses;
    j["cache_dedup_waits"] = c.dedup_waits;
    j["cache_used"] = c.used_bytes;
    j["cache_index"] = c.index_bytes;
    j["cache_limit"] = c.budget_bytes;
    j["cache_peak"] = c.peak_used_bytes;
    j["cache_backing_bytes_read"] = c.backing_bytes_read;
    const store::BackingSourceStats source = loader_->cache_source()->Stats();
    j["cache_direct_bytes_read"] = source.direct_bytes_read;
    j["cache_source_open_fds"] = source.open_fds;
    j["cache_free_buffers"] = c.free_buffer_bytes;
    j["cache_bytes_served"] = c.bytes_served;
    j["prefetched_bytes"] = c.prefetched_bytes;
    j["prefetch_hits"] = c.prefetch_hits;
    j["cache_evictions"] = c.evictions;
    j["dedup_ratio"] = c.backing_bytes_read == 0
                           ? 0.0
                           : static_cast<double>(c.bytes_served) / c.backing_bytes_read;
  }
  if (loader_->peers()) {
    loader_->peers()->AppendStats(&j);
    j["plan_wait_timeouts"] = loader_->plan_wait_timeouts();
  }
  if (memory_tier_ != nullptr) {  // issue 42; flat copies for the metrics
    j["memory_ckpt"] = store::MemoryTierJson(*memory_tier_);
    for (const char* f : {"used_bytes", "commits", "lost_checkpoints", "restored_checkpoints",
                          "restored_bytes", "replica_bytes", "unreplicated_checkpoints"}) {
      j[std::string("memory_ckpt_") + f] = j["memory_ckpt"][f];
    }
  }
  if (retained_) {  // issue 23: the memory tier; hits by tier: retained, peers, backing
    j["retained"] = retained_->StatsJson();
    j["retained_bytes"] = j["retained"]["retained_bytes"];
    j["retained_replica_bytes"] = j["retained"]["replica_bytes"];
    j["retained_used"] = j["retained"]["used_bytes"];
    j["retained_limit"] = j["retained"]["budget_bytes"];
    j["retained_hits"] = j["retained"]["hits"];
    j["retained_hit_bytes"] = j["retained"]["hit_bytes"];
    j["retained_crc_errors"] = j["retained"]["crc_errors"];
  }
  view_.gate_stats().AppendJson(&j);  // remote_polls, peer_commit_queries, "commit_gate"
  const store::JournalCounts journal = view_.counts();
  j["journal_pending"] = journal.pending;
  j["journal_applied_ahead"] = journal.applied_ahead;
  j["journal_retries"] = journal.retries;
  // Entries never applied (skipped, dropped, superseded): the application's view and the
  // backing store may differ by what each one did.
  j["journal_skipped"] = journal.skipped;
  j["journal_superseded"] = journal.superseded;
  // Commits whose shards a dead node held, and trackers naming them (docs/SEMANTICS.md).
  j["journal_given_up"] = journal.given_up;
  // Deletions of committed checkpoints held behind a given-up one until a later commit
  // (store/publish/deletion_hold.h): held now, ever, and dropped by a stop (left in place).
  j["journal_held"] = journal.held;
  j["journal_held_total"] = journal.held_total;
  j["journal_held_dropped"] = journal.held_dropped;
  j["journal_presyncs"] = journal.presyncs;
  // Async backpressure (--max-pending): creates that waited for room, and how long in all.
  j["journal_room_waits"] = journal.room_waits;
  j["journal_room_wait_ms"] = journal.room_wait_ms;
  j["state_db_writes"] = db_->writes();
  j["state_db_synced_writes"] = db_->synced_writes();
  j["state_db_memory"] = db_->BudgetedMemory();  // memtables and block cache (budgeted)
  // What publication waits for (a halt, or a commit waiting at the gate); "" when nothing.
  j["journal_waiting"] = view_.WaitingFor();
  j["journal_halted"] = nullptr;
  if (auto halt = view_.halted()) {
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
  // Writes that found staging full of parked chunks and made them retry at once; in the
  // refused rounds the store still refused them and the write failed with ENOSPC.
  j["flush_retry_rounds"] = pipeline_->retry_rounds();
  j["flush_retry_rounds_refused"] = pipeline_->retry_rounds_refused();
  const NamespaceView::Counts counts = ns_->CountNodes();
  // The heap: bytes in live allocations, and free bytes the allocator holds (what tells a
  // leak from the allocator's retention when RSS grows; docs/RELIABILITY.md).
  const HeapUsage heap = HeapNow();
  j["heap_in_use"] = heap.in_use;
  j["heap_free_held"] = heap.free_held;
  j["files_pending"] = counts.files_pending;
  j["inodes"] = counts.inodes;
  publication_->NoteForeignCommits();
  j["checkpoints"] = view_.CountByState();
  j["errors"] = stats_->errors.load() + pipeline_->errors();
  j["last_error"] = stats_->last_error();
  return JsonText(j, 1) + "\n";
}

std::string ControlTree::CheckpointsJson() {
  publication_->ForgetVanishedCheckpoints();
  publication_->NoteForeignCommits();
  nlohmann::json arr = nlohmann::json::array();
  std::set<std::string> listed;
  const std::vector<std::string> indexed = index_->IndexedCheckpoints();
  const std::set<std::string> indexed_set(indexed.begin(), indexed.end());
  for (const auto& info : view_.Checkpoints()) {
    nlohmann::json j = info.ToJson();
    std::string index_error = index_->IndexError(info.path);
    j["index_error"] = index_error.empty() ? nlohmann::json() : nlohmann::json(index_error);
    // Its tensor index is built (after the commit, in the background: the tensor view and
    // `verify` use it; building it reads item edges the write path's blocks do not cover).
    j["indexed"] = indexed_set.count(info.path) > 0;
    listed.insert(info.path);
    arr.push_back(std::move(j));
  }
  // Checkpoints that were already on the backing store (saved before this mount or by
  // another node) appear once they have been looked at and indexed.
  for (const auto& path : indexed) {
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
    j["indexed"] = true;
    arr.push_back(std::move(j));
  }
  AddRetained(&arr);
  if (memory_tier_ != nullptr) {  // issue 42: memory-only checkpoints, never on the backing store
    for (const store::MemCheckpoint& c : memory_tier_->Checkpoints()) {
      arr.push_back({{"path", c.path}, {"state", c.state}, {"tier", "memory"},
                     {"bytes", c.bytes}, {"replicas", c.where},
                     {"replica_holder", c.holder.empty() ? nlohmann::json() : nlohmann::json(c.holder)}});
    }
  }
  return JsonText(arr, 1) + "\n";
}

// Issue 23: which checkpoints this node holds in memory (its own blocks, replicas of
// another node's). Those held only as replicas of another node's are listed too.
void ControlTree::AddRetained(nlohmann::json* arr) {
  if (retained_ == nullptr) return;
  std::map<std::string, store::RetainedCheckpoint> held;
  for (store::RetainedCheckpoint& c : retained_->Checkpoints()) held[c.dir] = std::move(c);
  auto describe = [](const store::RetainedCheckpoint& c) {
    return nlohmann::json{{"state", c.committed ? "committed" : "pending"},
                          {"own_bytes", c.own_bytes},
                          {"replica_bytes", c.replica_bytes},
                          {"replica_of", c.origin}};
  };
  for (nlohmann::json& j : *arr) {
    auto it = held.find(j.value("path", std::string()));
    if (it == held.end()) continue;
    j["in_memory"] = describe(it->second);
    held.erase(it);
  }
  for (const auto& [dir, c] : held) {
    // This node's own checkpoints are listed by the registry; one it no longer lists (removed,
    // also behind the mount's back) is not shown from the tier's leftovers either.
    if (c.origin.empty()) continue;
    arr->push_back({{"path", dir}, {"state", c.committed ? "committed" : "pending"},
                    {"origin", "replica"},
                    {"in_memory", describe(c)}});
  }
}

// Prometheus text exposition (version 0.0.4). Names follow Prometheus conventions
// (base units in the name, _total for counters); every series carries the mountpoint.
std::string ControlTree::MetricsText() {
  const auto stats = nlohmann::json::parse(StatsJson());
  const std::string mnt = "mountpoint=\"" + LabelValue(config_.mountpoint) + "\"";
  const double start_epoch =
      EpochNow() -
      std::chrono::duration<double>(std::chrono::steady_clock::now() - stats_->started).count();
  std::string out;
  auto header = [&](const std::string& name, const char* type, const char* help) {
    out += "# HELP ckptfs_" + name + " " + help + "\n# TYPE ckptfs_" + name + " " + type + "\n";
  };
  auto number = [](const nlohmann::json& v) -> std::string {
    if (v.is_number_unsigned()) return std::to_string(v.get<uint64_t>());
    if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
    if (v.is_number_float()) {
      std::ostringstream f;
      f.precision(17);
      f << v.get<double>();
      return f.str();
    }
    return "0";
  };
  // A series from a stats field; fields another version of the daemon lacks are skipped.
  auto metric = [&](const std::string& name, const char* type, const char* help,
                    const char* field) {
    auto it = stats.find(field);
    if (it == stats.end() || !it->is_number()) return;
    header(name, type, help);
    out += "ckptfs_" + name + "{" + mnt + "} " + number(*it) + "\n";
  };

  header("build_info", "gauge", "Version and git commit of the running daemon; always 1.");
  out += "ckptfs_build_info{" + mnt + ",version=\"" + kVersion + "\",commit=\"" +
         CKPTFS_GIT_COMMIT + "\",durability=\"" + (config_.strict ? "strict" : "async") +
         "\"} 1\n";
  header("start_time_seconds", "gauge", "When the daemon started, in seconds since the epoch.");
  out += "ckptfs_start_time_seconds{" + mnt + "} " + number(start_epoch) + "\n";

  // Series taken from stats fields: {name, type, help, field}.
  static constexpr struct {
    const char* name;
    const char* type;
    const char* help;
    const char* field;
  } kStatsSeries[] = {
      {"written_bytes_total", "counter", "Bytes written by applications.", "bytes_written"},
      {"flushed_bytes_total", "counter", "Bytes written to backing temp files.",
       "bytes_flushed"},
      {"published_bytes_total", "counter", "Bytes of files published on the backing store.",
       "bytes_published"},
      {"published_files_total", "counter", "Files published on the backing store.",
       "files_published"},
      {"superseded_commits_total", "counter",
       "Commits replaced by a later save into the same directory before their shards were in.",
       "commits_superseded"},
      {"backing_read_bytes_total", "counter", "Bytes read from the backing store.",
       "backing_bytes_read"},
      {"backing_written_bytes_total", "counter", "Bytes written to the backing store.",
       "backing_bytes_written"},
      {"served_bytes_total", "counter", "Bytes returned to readers.", "bytes_served"},
      {"cache_hits_total", "counter", "Block cache hits.", "cache_hits"},
      {"cache_misses_total", "counter", "Block cache misses.", "cache_misses"},
      {"cache_dedup_waits_total", "counter", "Reads that joined a backing read in flight.",
       "cache_dedup_waits"},
      {"cache_used_bytes", "gauge", "Block cache memory in use.", "cache_used"},
      {"cache_limit_bytes", "gauge", "Block cache budget.", "cache_limit"},
      {"cache_index_bytes", "gauge", "Block cache index memory (outside its budget).",
       "cache_index"},
      {"prefetched_bytes_total", "counter", "Bytes prefetched into the block cache.",
       "prefetched_bytes"},
      {"dedup_ratio", "gauge",
       "Bytes served from the cache per byte read from the backing store.", "dedup_ratio"},
      {"retained_bytes", "gauge", "Bytes of committed checkpoints this node wrote kept in memory.",
       "retained_bytes"},
      {"retained_replica_bytes", "gauge", "Bytes held in memory for other nodes (replicas).",
       "retained_replica_bytes"},
      {"retained_used_bytes", "gauge", "Retained tier memory in use.", "retained_used"},
      {"retained_limit_bytes", "gauge", "Retained tier budget (--retain-mem).", "retained_limit"},
      {"retained_hit_bytes_total", "counter", "Block bytes served from the retained tier.",
       "retained_hit_bytes"},
      {"retained_crc_errors_total", "counter",
       "Retained blocks that failed their checksum (read elsewhere).", "retained_crc_errors"},
      {"memory_ckpt_used_bytes", "gauge", "Memory-only checkpoint memory in use.",
       "memory_ckpt_used_bytes"},
      {"memory_ckpt_commits_total", "counter", "Memory-only checkpoints committed.",
       "memory_ckpt_commits"},
      {"memory_ckpt_lost_total", "counter",
       "Memory-only checkpoints lost (a stop without a replica, or no peer gave them back).",
       "memory_ckpt_lost_checkpoints"},
      {"memory_ckpt_restored_total", "counter",
       "Memory-only checkpoints given back by a peer after a restart.",
       "memory_ckpt_restored_checkpoints"},
      {"memory_ckpt_unreplicated_total", "counter",
       "Memory-only checkpoints no peer took (not committed).",
       "memory_ckpt_unreplicated_checkpoints"},
      {"memory_ckpt_replica_bytes", "gauge", "Bytes of peers' memory-only checkpoints held here.",
       "memory_ckpt_replica_bytes"},
      {"peers_connected", "gauge", "Peer daemons connected and authenticated.",
       "peers_connected"},
      {"peer_read_bytes_total", "counter", "Block bytes fetched from peer daemons.",
       "peer_bytes_read"},
      {"peer_served_bytes_total", "counter", "Block bytes served to peer daemons.",
       "peer_bytes_served"},
      {"peer_fallbacks_total", "counter",
       "Reads owned by a peer that went to the backing store (peer down, timeout, bad "
       "checksum, error).",
       "peer_fallbacks"},
      {"peer_refused_total", "counter", "Peer connections refused (unlisted, bad secret).",
       "peer_refused"},
      {"staging_used_bytes", "gauge", "Staging memory in use.", "staging_used"},
      {"staging_limit_bytes", "gauge", "Staging memory budget.", "staging_limit"},
      {"staging_waits_total", "counter", "Writes that waited for staging memory.",
       "staging_waits"},
      {"journal_pending_entries", "gauge",
       "Journal entries not yet done (queued, or dropped and not yet settled).",
       "journal_pending"},
      {"journal_skipped_entries_total", "counter",
       "Journal entries never applied (skipped, dropped, given up for a lost node).",
       "journal_skipped"},
      {"journal_given_up_entries_total", "counter",
       "Commits and trackers given up because a node they wait for was declared dead.",
       "journal_given_up"},
      {"journal_held_deletions", "gauge",
       "Deletions of committed checkpoints held until a checkpoint after a given-up one commits.",
       "journal_held"},
      {"pending_files", "gauge", "Files not yet published.", "files_pending"},
      {"flush_queue_chunks", "gauge", "Sealed chunks waiting for a flush thread.",
       "flush_queue"},
      {"errors_total", "counter", "Errors (flush, publish, commit).", "errors"},
  };
  for (const auto& series : kStatsSeries) {
    metric(series.name, series.type, series.help, series.field);
  }

  header("checkpoints", "gauge", "Checkpoints known to this daemon, by state.");
  if (auto it = stats.find("checkpoints"); it != stats.end() && it->is_object()) {
    for (const auto& [state, n] : it->items()) {
      out += "ckptfs_checkpoints{" + mnt + ",state=\"" + LabelValue(state) + "\"} " + number(n) +
             "\n";
    }
  }

  const std::vector<store::CheckpointInfo> list = view_.Checkpoints();
  double last_commit = 0;
  for (const auto& info : list) {
    if (info.state == store::CkptState::kCommitted) {
      last_commit = std::max(last_commit, info.committed);
    }
  }
  header("last_commit_timestamp_seconds", "gauge",
         "When the newest checkpoint was committed, in seconds since the epoch; 0: none yet.");
  out += "ckptfs_last_commit_timestamp_seconds{" + mnt + "} " + number(last_commit) + "\n";

  CommitTimes& commit_times = ProcessCommitTimes();
  commit_times.Update(list, start_epoch);
  header("save_to_commit_seconds", "histogram",
         "Seconds from a checkpoint's first file to its commit, for checkpoints committed "
         "by this daemon.");
  commit_times.histogram().Render("ckptfs_save_to_commit_seconds", mnt, &out);
  header("staging_wait_seconds", "histogram",
         "Seconds a write waited for free staging memory (backpressure).");
  StagingWaitHistogram().Render("ckptfs_staging_wait_seconds", mnt, &out);
  header("fuse_op_duration_seconds", "histogram", "Seconds to answer a FUSE request, by op.");
  for (size_t i = 0; i < kFuseOpNames.size(); ++i) {
    FuseOpHistogram(static_cast<FuseOp>(i))
        .Render("ckptfs_fuse_op_duration_seconds", mnt + ",op=\"" + kFuseOpNames[i] + "\"",
                &out);
  }
  return out;
}

void ControlTree::Resume() {
  spdlog::info("operator: resume");
  // The parked chunks first: the journal's retry of a publication fails at once while one
  // of its chunks still waits for its own retry.
  pipeline_->RetryNowAndWait(std::chrono::seconds(5));
  publication_->Resume();
}

std::vector<std::string> ControlTree::Abort(const std::string& path) {
  spdlog::warn("operator: abort {}", path.empty() ? "/" : path);
  return publication_->Abort(path);
}

Status ControlTree::SetXattr(uint64_t ino, const std::string& name, const std::string&) {
  if (name == kResumeXattr) {
    Resume();
    return Status::Ok();
  }
  if (name != kAbortXattr) return Status(Code::kUnsupported, "setxattr " + name);
  CKPT_ASSIGN_OR_RETURN(std::string path, ns_->PathOf(ino));
  std::vector<std::string> dropped = Abort(path);
  nlohmann::json report = {{"path", path}, {"dropped", dropped}};
  MutexLock lock(&abort_mu_);
  last_abort_report_ = JsonText(report, 1) + "\n";
  return Status::Ok();
}

Result<std::string> ControlTree::GetXattr(uint64_t ino, const std::string& name) {
  if (name == kAbortReportXattr) {
    MutexLock lock(&abort_mu_);
    return last_abort_report_.empty() ? std::string("{}\n") : last_abort_report_;
  }
  if (name == kProgressXattr) return ns_->ProgressJson(ino);
  if (name == kChecksumsXattr) {
    // Checksums the items that have none yet (read from the backing store once).
    Result<std::string> path = ns_->DirPathOf(ino);
    if (!path.ok()) return Invalid("checksums need a checkpoint dir");
    CKPT_ASSIGN_OR_RETURN(uint64_t filled, index_->FillChecksums(*path));
    nlohmann::json j = {{"checksum", store::kChecksumAlgorithm}, {"computed", filled}};
    return JsonText(j);
  }
  if (name == kVerifyXattr) {
    // Re-reads the checkpoint from the backing store and checks structure and checksums.
    Result<std::string> path = ns_->DirPathOf(ino);
    if (!path.ok()) return Invalid("verify needs a checkpoint dir");
    CKPT_ASSIGN_OR_RETURN(store::VerifyReport report, index_->Verify(*path));
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
    auto j = nlohmann::json::parse(ns_->ProgressJson(ino));
    return j["state"].get<std::string>();
  }
  return Status(Code::kNotFound, "no xattr " + name);
}

std::string ControlTree::ListXattr(uint64_t ino) {
  std::string out;
  out.append(kStateXattr).push_back('\0');
  out.append(kProgressXattr).push_back('\0');
  return out;
}

}  // namespace ckptfs::fs
