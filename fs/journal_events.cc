// Journal events: what the namespace, the checkpoint registry, the key index and the
// stats learn when the journal applies an entry or halts at one. Runs on the journal's
// thread; takes ns_mu_ only to update the nodes, after the registry and index calls.
#include <spdlog/spdlog.h>

#include "fs/namespace.h"
#include "fs/fs_util.h"
#include "common/path.h"
#include "store/commit_names.h"
#include "store/dcp/dcp_metadata.h"

namespace ckptfs::fs {

Node* Namespace::LoadedNodeAtLocked(const std::string& path) {
  Node* node = root_.get();
  size_t start = 0;
  while (node != nullptr && start <= path.size()) {
    size_t slash = path.find('/', start);
    std::string name = path.substr(start, slash == std::string::npos ? std::string::npos
                                                                      : slash - start);
    auto it = node->children.find(name);
    node = it == node->children.end() ? nullptr : it->second.get();
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return node;
}

bool Namespace::WrittenLocally(const std::string& path) {
  MutexLock lock(&ns_mu_);
  const Node* node = LoadedNodeAtLocked(path);
  return node != nullptr && node->write && node->write->needs_publish;
}

bool Namespace::RewrittenSince(const std::string& path, uint64_t seq) {
  MutexLock lock(&ns_mu_);
  const Node* node = LoadedNodeAtLocked(path);
  // The write state lives until its version is published (open, or its publish queued).
  return node != nullptr && node->write && !node->write->discarded &&
         node->write->began_after >= seq;
}

bool Namespace::OtherRankCommitPending(const std::string& path, uint64_t seq) {
  const std::string dir = ParentOf(path);
  const std::string_view self = path::Basename(path);
  MutexLock lock(&ns_mu_);
  const Node* node = dir.empty() ? root_.get() : LoadedNodeAtLocked(dir);
  if (node == nullptr) return false;
  for (const auto& [name, child] : node->children) {
    if (name == self) continue;
    const store::CommitKind kind = store::CommitKindOf(name);
    const bool tmp = name.ends_with(".metadata.tmp") &&
                     store::CommitKindOf(name.substr(0, name.size() - 4)) ==
                         store::CommitKind::kDcpRank;
    if (kind != store::CommitKind::kDcpRank && !tmp) continue;
    if (child->write || child->pending_seq > seq) return true;
  }
  return false;
}

bool Namespace::DeletedLocally(const std::string& path) {
  MutexLock lock(&dropped_mu_);
  return dropped_paths_.count(path) > 0;
}

bool Namespace::PendingLocally(const std::string& path) {
  MutexLock lock(&ns_mu_);
  const Node* node = LoadedNodeAtLocked(path);
  // Open for writing, or closed with its publish queued, applied ahead or being retried
  // (publishing_ holds it until the journal reports the outcome).
  return node != nullptr && node->write && !node->write->discarded &&
         (node->write->needs_publish || publishing_.count(node->write->file_id) > 0);
}

void Namespace::OnJournalHalt(const store::JournalEntry& e, const Status& st) {
  const std::string dir = ParentOf(e.path);
  if (st.ok()) {
    checkpoints_->OnResumed(dir);
  } else {
    NoteError("publication halted at " + e.Describe() + ": " + st.ToString());
    checkpoints_->OnHalted(dir, st.ToString());
  }
  if (e.op != store::OpType::kPublish) return;
  MutexLock lock(&ns_mu_);
  auto it = publishing_.find(e.file_id);
  if (it != publishing_.end()) {
    it->second->halt_error = st.ok() ? "" : st.ToString();
    it->second->halt_transient = store::IsTransient(st);
  }
}

void Namespace::OnJournalDone(const store::JournalEntry& e, const Status& st) {
  const std::string dir = ParentOf(e.path);
  const bool commit = (e.op == store::OpType::kPublish || e.op == store::OpType::kRename) &&
                      store::IsCommitName(e.path);
  if (e.op == store::OpType::kPublish && st.ok()) {
    if (e.atime_sec || e.atime_nsec || e.mtime_sec || e.mtime_nsec) {
      struct timespec ts[2] = {{e.atime_sec, e.atime_nsec}, {e.mtime_sec, e.mtime_nsec}};
      (void)backing_->Utimens(e.path, ts);
    }
    stats_->bytes_published.fetch_add(e.size);
    stats_->files_published.fetch_add(1);
    checkpoints_->OnFilePublished(dir, e.size, e.seq);
    HandOverBlockCrcs(e);
  }
  if (st.code() == Code::kSuperseded) {
    // A later save into the same directory commits it; nothing failed. The registry keeps
    // the state that later save gave the directory.
    stats_->commits_superseded.fetch_add(1);
  } else if (!st.ok()) {
    NoteError(e.Describe() + ": " + st.ToString());
    if (e.op == store::OpType::kPublish || commit) {
      if (st.code() == Code::kAborted) {
        checkpoints_->OnAborted(dir, st.ToString());
      } else {
        checkpoints_->OnFailed(dir, st.ToString(), e.seq);
      }
    }
  } else if (commit) {
    const store::CommitKind kind = store::CommitKindOf(e.path);
    // The key index reads every commit format (store/dcp/checkpoint_source.h); it is
    // built once the directory is committed, not once per rank (a build takes the
    // write path's block CRCs of the shards it covers and releases them).
    if (kind != store::CommitKind::kDcpRank) {
      checkpoints_->OnCommitted(dir, e.seq);
      read_->QueueIndexBuild(dir);
    } else if (!OtherRankCommitPending(e.path, e.seq)) {
      // A no-collectives save: each rank's `__{rank}.metadata` is gated on its own shards;
      // the directory is committed once none of them is pending any more.
      checkpoints_->OnCommitted(dir, e.seq, /*last_part=*/true);
      read_->QueueIndexBuild(dir);
    }
  }
  // Entries can be applied ahead of a waiting commit: only the journal knows the prefix.
  checkpoints_->OnApplied(journal_->applied());
  if (st.ok() && e.op == store::OpType::kRename) index_->OnRenamed(e.from, e.path);
  if (st.ok() && e.op == store::OpType::kRmdir) index_->Forget(e.path);
  if (e.op != store::OpType::kPublish) return;
  if (uint64_t dropped = NodePublishDone(e, st)) RefreshAttr(dropped);
}

uint64_t Namespace::NodePublishDone(const store::JournalEntry& e, const Status& st) {
  MutexLock lock(&ns_mu_);
  auto it = publishing_.find(e.file_id);
  if (it == publishing_.end()) return 0;
  std::shared_ptr<Node> node = it->second;
  publishing_.erase(it);
  if (st.ok()) node->halt_error.clear();  // published after retries
  // A superseded `.metadata` (torch 1.13 writes it in place): its file lives on in the
  // later version that replaced it.
  if (!st.ok() && st.code() != Code::kSuperseded) {
    node->error = "publication failed: " + st.ToString();
    node->on_backing = false;
    SyncDataLocked(node.get());
  }
  uint64_t dropped = 0;
  if (node->write && node->write->file_id == e.file_id && node->open_files == 0 &&
      !node->write->needs_publish) {
    DropWriteStateLocked(node.get());
    dropped = node->ino;
  }
  if (node->parent == nullptr && node->nlookup == 0 && !node->write) inodes_.erase(node->ino);
  return dropped;
}

void Namespace::HandOverBlockCrcs(const store::JournalEntry& e) {
  if (!e.target) return;  // replayed after a restart: nothing was recorded
  std::shared_ptr<store::BlockCrcMap> crcs = e.target->TakeBlockCrcs();
  if (!crcs) return;
  crcs->Finish(e.size);
  // The identity after the rename and the times set above: a later change by anyone makes
  // the key index ignore these CRCs.
  Result<struct stat> st = backing_->Stat(e.path);
  if (!st.ok()) return;
  index_->AddBlockCrcs(e.path, store::FileKeyFromStat(*st), std::move(crcs));
}

}  // namespace ckptfs::fs
