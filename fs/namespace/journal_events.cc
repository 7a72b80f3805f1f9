// The mount's side of publication (fs/namespace/journal_events.h): what the commit gate and the
// shard states ask about files written here, and what the namespace and the stats learn
// when an entry is done or publication halts.
#include "fs/namespace/journal_events.h"

#include <spdlog/spdlog.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/path.h"
#include "fs/fs_util.h"
#include "fs/namespace/table_lock.h"
#include "store/dcp/commit_names.h"

namespace ckptfs::fs {

JournalEvents::JournalEvents(const FsParts& parts, NodeTable& table, WriteStates& writes,
                             GoneDirs& gone, KernelCache& kernel)
    : table_(table), writes_(writes), gone_(gone), kernel_(kernel), stats_(parts.stats) {}

void JournalEvents::OnCommitSeen(const std::string& dir, uint64_t seq) {
  std::vector<uint64_t> files;
  {
    TableLock lock(table_);
    const Node* d = dir.empty() ? table_.root().get() : table_.LoadedNodeAtLocked(dir);
    if (d == nullptr || d->type != NodeType::kDir) return;
    for (const auto& [name, child] : d->children) {
      // Written here: the table has this version's attributes already.
      if (child->type == NodeType::kFile && child->on_backing && !child->write) {
        files.push_back(child->ino);
      }
    }
  }
  uint64_t changed = 0;
  for (uint64_t ino : files) {
    // Another node's commit (seq 0): entries applied so far (1: nothing beyond them).
    const uint64_t done_through = seq != 0 ? seq : 1;
    if (!table_.RefreshAttr(ino, /*unless_committed=*/false, done_through)) continue;
    kernel_.DropInode(ino);
    ++changed;
  }
  if (changed > 0) {
    spdlog::info("checkpoint {}: {} file(s) in it were written again through other nodes: "
                 "their new sizes and bytes are shown", dir, changed);
  }
}

bool JournalEvents::WrittenLocally(const std::string& path) {
  TableLock lock(table_);
  const Node* node = table_.LoadedNodeAtLocked(path);
  return node != nullptr && node->write && node->write->needs_publish;
}

bool JournalEvents::RewrittenSince(const std::string& path, uint64_t seq) {
  TableLock lock(table_);
  const Node* node = table_.LoadedNodeAtLocked(path);
  // The write state lives until its version is published (open, or its publish queued).
  return node != nullptr && node->write && !node->write->discarded &&
         node->write->began_after >= seq;
}

bool JournalEvents::RankCommitPending(const std::string& path, uint64_t seq) {
  const std::string dir = path::Parent(path);
  const std::string_view self = path::Basename(path);
  TableLock lock(table_);
  const Node* node = dir.empty() ? table_.root().get() : table_.LoadedNodeAtLocked(dir);
  if (node == nullptr) return false;
  for (const auto& [name, child] : node->children) {
    if (name == self) continue;
    const store::CommitKind kind = store::CommitKindOf(name);
    const bool tmp = name.ends_with(".metadata.tmp") &&
                     store::CommitKindOf(name.substr(0, name.size() - 4)) ==
                         store::CommitKind::kDcpRank;
    if (kind != store::CommitKind::kDcpRank && !tmp) continue;
    if (child->pending_seq > seq) return true;
    // Still to be published: open with changes, or its publish entry awaiting its outcome.
    // Not a write state that merely outlives its applied publish until the kernel's
    // RELEASE of the rank's handle arrives: counted as pending, the last rank's commit
    // left the directory `writing` for good (e2e test_torch2_clients, per_rank, in CI).
    const WriteState* ws = child->write.get();
    if (ws != nullptr && !ws->discarded &&
        (ws->needs_publish || table_.PublishingLocked(ws->file_id) != nullptr)) {
      return true;
    }
  }
  return false;
}

bool JournalEvents::PendingLocally(const std::string& path) {
  TableLock lock(table_);
  const Node* node = table_.LoadedNodeAtLocked(path);
  // Open for writing, or closed with its publish queued, applied ahead or being retried
  // (NodeTable::PublishingLocked finds it until the journal reports the outcome).
  return node != nullptr && node->write && !node->write->discarded &&
         (node->write->needs_publish || table_.PublishingLocked(node->write->file_id) != nullptr);
}

void JournalEvents::OnHalted(const store::JournalEntry& e, const Status& st) {
  if (!st.ok()) table_.NoteError("publication halted at " + e.Describe() + ": " + st.ToString());
  if (e.op != store::OpType::kPublish) return;
  TableLock lock(table_);
  if (std::shared_ptr<Node> node = table_.PublishingLocked(e.file_id)) {
    node->halt_error = st.ok() ? "" : st.ToString();
    node->halt_transient = store::IsTransient(st);
  }
}

void JournalEvents::OnOutcome(const store::JournalEntry& e, const Status& st) {
  if (e.op == store::OpType::kPublish && st.ok()) {
    stats_->bytes_published.fetch_add(e.size);
    stats_->files_published.fetch_add(1);
  }
  if (st.code() == Code::kSuperseded) {
    stats_->commits_superseded.fetch_add(1);
  } else if (!st.ok()) {
    table_.NoteError(e.Describe() + ": " + st.ToString());
  }
  if (e.op != store::OpType::kPublish) return;
  if (uint64_t dropped = NodePublishDone(e, st)) table_.RefreshAttr(dropped);
}

uint64_t JournalEvents::NodePublishDone(const store::JournalEntry& e, const Status& st) {
  TableLock lock(table_);
  std::shared_ptr<Node> node = table_.PublishingLocked(e.file_id, /*take=*/true);
  if (!node) return 0;
  if (st.ok()) {
    node->halt_error.clear();  // published after retries
    node->withheld.clear();
  }
  // A superseded `.metadata` (torch 1.13 writes it in place): its file lives on in the
  // later version that replaced it.
  // A tracker withheld for a lost node's checkpoint (kNodeLost) failed nothing of its
  // own: the mount shows what the backing store keeps (the tracker before it), and the
  // next write replaces it as usual.
  if (st.code() == Code::kNodeLost) node->withheld = st.message();
  if (!st.ok() && st.code() != Code::kSuperseded && st.code() != Code::kNodeLost) {
    node->error = "publication failed: " + st.ToString();
    node->error_told = false;  // FlushData says so when a close returns it
    node->on_backing = false;
    table_.SyncDataLocked(node.get());
  }
  uint64_t dropped = 0;
  if (node->write && node->write->file_id == e.file_id && node->open_files == 0 &&
      !node->write->needs_publish) {
    WriteStates::DropWriteStateLocked(table_, node.get());
    dropped = node->ino;
  }
  if (node->parent == nullptr && node->nlookup == 0 && !node->write) {
    table_.ForgetNodeLocked(node->ino);
  }
  return dropped;
}

}  // namespace ckptfs::fs
