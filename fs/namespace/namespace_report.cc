// What the namespace reports (fs/namespace/namespace_report.h): the NamespaceView the control tree
// reads (names of inodes, counts, the progress of a path's publication).
#include "fs/namespace/namespace_report.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/json_text.h"
#include "fs/fs_util.h"
#include "fs/namespace/table_lock.h"

namespace ckptfs::fs {

NamespaceReport::NamespaceReport(const FsConfig& config, const FsParts& parts, NodeTable& table)
    : config_(config),
      table_(table),
      publication_(parts.publication) {}

Result<std::string> NamespaceReport::PathOf(uint64_t ino) {
  TableLock lock(table_);
  auto node = table_.NodeLocked(ino);
  if (!node) return NotFound("stale inode");
  return table_.PathLocked(node.get());
}

Result<std::string> NamespaceReport::DirPathOf(uint64_t ino) {
  TableLock lock(table_);
  auto node = table_.NodeLocked(ino);
  if (!node || node->type != NodeType::kDir) return Invalid("not a directory");
  return table_.PathLocked(node.get());
}

NamespaceView::Counts NamespaceReport::CountNodes() {
  const uint64_t applied = publication_->view().applied();
  TableLock lock(table_);
  Counts counts;
  table_.ForEachNodeLocked([&](const std::shared_ptr<Node>& node) {
    ++counts.inodes;
    if (node->write && (node->write->needs_publish || node->write->publish_seq > applied)) {
      ++counts.files_pending;
    }
  });
  return counts;
}

std::string NamespaceReport::ProgressJson(uint64_t ino) {
  nlohmann::json j = {{"state", "published"}, {"bytes_total", 0}, {"bytes_done", 0}, {"error", ""}};
  if (ino < kFirstNodeIno && ino != kRootIno) return JsonText(j);
  bool foreign_commit = false;
  std::string dir_path;
  double since = 0;  // when this node began writing the checkpoint (0: unknown)
  {
    TableLock lock(table_);
    auto node = table_.NodeLocked(ino);
    if (!node) return JsonText(j);
    const uint64_t applied = publication_->view().applied();
    if (node->type == NodeType::kFile) {
      if (!node->error.empty() || (!node->halt_error.empty() && !node->halt_transient)) {
        j["state"] = "failed";
        j["error"] = node->error.empty() ? node->halt_error : node->error;
      } else if (!node->halt_error.empty()) {
        // Publication halts here on a transient error; the bytes are kept and retried.
        j["state"] = "retrying";
        j["error"] = node->halt_error;
      } else if (!node->withheld.empty() && !node->write) {
        // Never published: `ckptfs-admin wait` on it fails instead of reporting success.
        j["state"] = "withheld";
        j["error"] = node->withheld;
      } else if (node->write) {
        const WriteState& ws = *node->write;
        const uint64_t size = ws.staged->size();
        j["bytes_total"] = size;
        j["bytes_done"] = std::min<uint64_t>(size, ws.staged->target()->bytes_flushed());
        const Status flush_error = ws.staged->error();
        // kNodeLost: the journal gave its publish up (a tracker naming a checkpoint that
        // never commits): not a failure of the file; its outcome, withheld, follows.
        if (!flush_error.ok() && flush_error.code() != Code::kNodeLost) {
          // Reported to the application either way; "failed" only once bytes are lost.
          const bool kept = store::IsTransient(flush_error) && !ws.staged->target()->lost();
          j["state"] = kept ? "retrying" : "failed";
          j["error"] = flush_error.ToString();
        } else if (ws.needs_publish || ws.staged->staged_bytes() > 0) {
          j["state"] = "staged";
        } else if (ws.publish_seq > applied ||
                   (ws.publish_seq != 0 && table_.PublishingLocked(ws.file_id, /*take=*/false))) {
          // Applied, but its outcome (published, withheld, failed) is not recorded yet.
          j["state"] = ws.staged->target()->synced() ? "durable" : "staged";
        }
      } else if (node->pending_seq > applied) {
        j["state"] = "staged";
      } else {
        j["bytes_total"] = j["bytes_done"] = static_cast<uint64_t>(node->attr.st_size);
      }
      return JsonText(j);
    }
    const std::string path = table_.PathLocked(node.get());
    if (auto info = publication_->view().Checkpoint(path)) {
      j["state"] = store::CkptStateName(info->state);
      j["bytes_total"] = info->bytes;
      j["bytes_done"] = info->bytes_published;
      j["error"] = info->error;
      // Shards written here of a checkpoint whose `.metadata` another node publishes: this
      // node never sees its commit, so once its own files are all published it asks the
      // backing store (below, outside the lock).
      if (!config_.peers || info->state != store::CkptState::kWriting ||
          info->bytes_published < info->bytes) {
        return JsonText(j);
      }
      foreign_commit = true;
      since = info->created;
    } else if (config_.peers && node->loaded) {
      // A DCP checkpoint whose shards were written here and whose `.metadata` another node
      // publishes: done only once that `.metadata` is on the backing store (checked below,
      // outside the lock).
      bool has_metadata = false;
      for (const auto& [name, child] : node->children) {
        if (name == ".metadata") has_metadata = true;
        if (name.size() > 7 && name.compare(name.size() - 7, 7, ".distcp") == 0) {
          foreign_commit = true;
        }
      }
      if (has_metadata) foreign_commit = false;
    }
    // Any other directory: published once no entry made so far is pending. (Entries
    // are applied in order, so this covers everything below it.) Its bytes are those of
    // the unpublished files below it: total staged, done durable on the backing store.
    const uint64_t last = publication_->view().last_appended();
    if (last > applied) {
      j["state"] = "staged";
      // Below it: `node` is an ancestor (a parent walk, no path strings under the lock).
      auto below = [&](const Node* n) {
        for (const Node* p = n->parent; p != nullptr; p = p->parent) {
          if (p == node.get()) return true;
        }
        return false;
      };
      uint64_t total = 0, done = 0;
      table_.ForEachNodeLocked([&](const std::shared_ptr<Node>& n) {
        if (n->type != NodeType::kFile || !n->write) return;
        const WriteState& ws = *n->write;
        if (!ws.needs_publish && ws.publish_seq <= applied) return;
        if (!below(n.get())) return;
        const uint64_t size = ws.staged->size();
        total += size;
        done += std::min<uint64_t>(size, ws.staged->target()->bytes_flushed());
      });
      j["bytes_total"] = total;
      j["bytes_done"] = done;
      j["entries_pending"] = last - applied;
    }
    if (foreign_commit) dir_path = path;
  }
  if (foreign_commit && (j["state"] == "published" || j["state"] == "writing")) {
    // Everything written here is published; the checkpoint is committed once the node of
    // its coordinator rank has published `.metadata` (G5: only after every shard).
    if (publication_->NoteCommittedElsewhere(dir_path, since)) {
      j["state"] = "committed";  // and its record says so from now on
    } else {
      j["state"] = "pending";
      j["waiting_for"] = ".metadata from another node";
    }
  }
  return JsonText(j);
}

}  // namespace ckptfs::fs
