// The mount's side of publication (store::PublicationObserver): what the commit gate and
// the shard states ask about files written here, and what the namespace, the stats and
// the read path learn when an entry is done or publication halts. Runs on the journal's
// thread (questions also on a peer's query thread); takes ns_mu_ briefly, never calls
// back into publication.
#include <spdlog/spdlog.h>

#include "fs/namespace.h"
#include "fs/fs_util.h"
#include "common/path.h"
#include "store/publish/commit_names.h"

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

bool Namespace::RankCommitPending(const std::string& path, uint64_t seq) {
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

bool Namespace::PendingLocally(const std::string& path) {
  MutexLock lock(&ns_mu_);
  const Node* node = LoadedNodeAtLocked(path);
  // Open for writing, or closed with its publish queued, applied ahead or being retried
  // (publishing_ holds it until the journal reports the outcome).
  return node != nullptr && node->write && !node->write->discarded &&
         (node->write->needs_publish || publishing_.count(node->write->file_id) > 0);
}

void Namespace::OnHalted(const store::JournalEntry& e, const Status& st) {
  if (!st.ok()) NoteError("publication halted at " + e.Describe() + ": " + st.ToString());
  if (e.op != store::OpType::kPublish) return;
  MutexLock lock(&ns_mu_);
  auto it = publishing_.find(e.file_id);
  if (it != publishing_.end()) {
    it->second->halt_error = st.ok() ? "" : st.ToString();
    it->second->halt_transient = store::IsTransient(st);
  }
}

void Namespace::OnOutcome(const store::JournalEntry& e, const Status& st,
                          const store::PublishOutcome& outcome) {
  if (e.op == store::OpType::kPublish && st.ok()) {
    stats_->bytes_published.fetch_add(e.size);
    stats_->files_published.fetch_add(1);
  }
  if (st.code() == Code::kSuperseded) {
    stats_->commits_superseded.fetch_add(1);
  } else if (!st.ok()) {
    NoteError(e.Describe() + ": " + st.ToString());
  }
  if (!outcome.committed_dir.empty()) read_->QueueIndexBuild(outcome.committed_dir);
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

}  // namespace ckptfs::fs
