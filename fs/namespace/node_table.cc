// The inode table and the overlay of pending journal entries on the backing store
// (fs/namespace/node_table.h): nodes and paths, loading and probing names, the journal append that
// orders a change, link groups, and the EIO log line of a failed call.
#include "fs/namespace/node_table.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

#include "common/path.h"
#include "fs/fs_util.h"
#include "fs/namespace/table_lock.h"

namespace ckptfs::fs {
namespace {

// EIO lines logged per second at most; the rest are counted and reported with the next.
constexpr int kIoLogsPerSecond = 20;

// Whether every journal entry that changed `node`'s name, or one above it, is applied.
bool Quiescent(const Node* node, uint64_t applied) {
  for (const Node* n = node; n != nullptr; n = n->parent) {
    if (n->pending_seq > applied) return false;
  }
  return true;
}

}  // namespace

NodeTable::NodeTable(const FsConfig& config, const FsParts& parts)
    : config_(config),
      backing_(parts.backing),
      publication_(parts.publication),
      stats_(parts.stats) {}

Result<std::unique_ptr<NodeTable>> NodeTable::Create(const FsConfig& config,
                                                     const FsParts& parts) {
  std::unique_ptr<NodeTable> table(new NodeTable(config, parts));
  CKPT_ASSIGN_OR_RETURN(struct stat root_attr, table->backing_->Stat(""));
  table->root_ = std::make_shared<Node>();
  table->root_->ino = kRootIno;
  table->root_->type = NodeType::kDir;
  table->root_->attr = root_attr;
  table->root_->attr.st_ino = kRootIno;
  table->root_->on_backing = true;
  {
    MutexLock lock(&table->mu_);
    table->inodes_[kRootIno] = table->root_;
  }
  return table;
}

void NodeTable::ForgetIfUnusedLocked(const Node* node) {
  if (node->parent != nullptr || node->nlookup != 0 || node->open_files != 0) return;
  // A directory detached with names still in it (removed on the backing store by someone
  // else, seen by a probe): its children go with it, as unlinked ones, and are forgotten
  // too unless the kernel or a handle still names them. Before, they stayed in the table
  // for the daemon's life with `parent` pointing at the freed directory.
  const auto it = inodes_.find(node->ino);
  if (it == inodes_.end()) return;
  const std::shared_ptr<Node> gone = it->second;  // keeps `node` alive below
  inodes_.erase(it);
  for (auto& [name, child] : gone->children) {
    child->parent = nullptr;
    ForgetIfUnusedLocked(child.get());
  }
  gone->children.clear();
}

std::shared_ptr<Node> NodeTable::PublishingLocked(uint64_t id, bool take) {
  auto it = publishing_.find(id);
  if (it == publishing_.end()) return nullptr;
  std::shared_ptr<Node> node = it->second;
  if (take) publishing_.erase(it);
  return node;
}

std::shared_ptr<Node> NodeTable::NodeLocked(uint64_t ino) {
  auto it = inodes_.find(ino);
  return it == inodes_.end() ? nullptr : it->second;
}

Result<std::shared_ptr<Node>> NodeTable::LoadedDirLocked(uint64_t ino, const std::string& name) {
  auto dir = NodeLocked(ino);
  if (!dir || dir->type != NodeType::kDir) return Status(Code::kNotDir, name);
  CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(dir.get()));
  return dir;
}

std::string NodeTable::PathLocked(const Node* node) const {
  std::vector<const std::string*> parts;
  for (const Node* n = node; n != nullptr && n->ino != kRootIno; n = n->parent) {
    parts.push_back(&n->name);
  }
  std::string path;
  for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
    if (!path.empty()) path += '/';
    path += **it;
  }
  return path;
}

std::string NodeTable::TempPathLocked(const WriteState& ws) const {
  return path::Join(PathLocked(ws.temp_dir), ws.temp_name);
}

Node* NodeTable::LoadedNodeAtLocked(const std::string& path) {
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

std::shared_ptr<Node> NodeTable::NewNodeLocked(Node* parent, const std::string& name,
                                                NodeType type) {
  auto node = std::make_shared<Node>();
  node->ino = next_ino_++;
  node->type = type;
  node->parent = parent;
  node->name = name;
  node->attr.st_ino = node->ino;
  node->attr.st_nlink = type == NodeType::kDir ? 2 : 1;
  node->attr.st_blksize = kBlockSize;
  if (parent != nullptr) parent->children[name] = node;
  inodes_[node->ino] = node;
  return node;
}

std::shared_ptr<Node> NodeTable::ChildLocked(Node* dir, const std::string& name) {
  // The mount's view only: ProbeName refreshed it from the backing store before the lock.
  auto it = dir->children.find(name);
  return it == dir->children.end() ? nullptr : it->second;
}

void NodeTable::DetachLocked(const std::shared_ptr<Node>& node, bool evicted) {
  if (node->parent != nullptr) {
    node->parent->children.erase(node->name);
    (evicted ? node->parent->names_evicted : node->parent->names_removed)++;
    node->parent = nullptr;
  }
  ForgetIfUnusedLocked(node.get());
}

Entry NodeTable::EntryLocked(Node* node) {
  FoldWriteTimeLocked(node);
  node->nlookup++;
  if (node->parent != nullptr) node->parent->lookups++;
  Entry e;
  e.ino = node->ino;
  e.attr = node->attr;
  if (node->link_group != 0) e.attr.st_ino = node->link_group;  // one inode, one st_ino
  if (node->write) e.attr.st_size = static_cast<off_t>(node->write->staged->size());
  e.attr.st_blocks = (e.attr.st_size + 511) / 512;
  e.timeout = TimeoutFor(*node);
  return e;
}

double NodeTable::TimeoutFor(const Node& node) const {
  // Names of one inode are separate FUSE inodes: a change through one name reaches the
  // others' cached attributes only if the kernel keeps none.
  if (node.type != NodeType::kDir && node.attr.st_nlink > 1) return 0.0;
  // Files of a committed checkpoint do not change: let the kernel keep their entries,
  // attributes and pages (ranks on one node share the page cache).
  if (node.type != NodeType::kFile || node.write || node.parent == nullptr) {
    return kDefaultTimeout;
  }
  return CommittedDirLocked(node.parent) ? kCommittedTimeout : kDefaultTimeout;
}

bool NodeTable::CommittedDirLocked(const Node* dir) const {
  // A checkpoint is committed once its commit file is published and nothing in the
  // directory is pending; the registry knows the ones saved through this mount. The commit
  // file: `.metadata`, a no-collectives save's `__0.metadata` (rank 0 always writes one), a
  // Hugging Face index or single file under the names transformers and torch give them.
  auto it = dir->children.end();
  for (const char* name : {".metadata", "model.safetensors.index.json", "model.safetensors",
                           "__0.metadata"}) {
    it = dir->children.find(name);
    if (it != dir->children.end()) break;
  }
  if (it == dir->children.end()) return false;
  const Node& md = *it->second;
  const uint64_t applied = publication_->view().applied();
  return md.on_backing && !md.write && md.pending_seq <= applied && dir->pending_seq <= applied;
}

Status NodeTable::EnsureLoadedLocked(Node* dir) {
  if (dir->loaded) return Status::Ok();
  if (!dir->on_backing) {
    dir->loaded = true;  // made through the mount: nothing on the backing store yet
    return Status::Ok();
  }
  // A directory no LoadDir loaded before the operation took the lock (one that appeared
  // since): listed without the lock, then the operation starts over (LockDropped).
  const uint64_t ino = dir->ino;
  CKPT_RETURN_IF_ERROR(TableLock::WithoutLock(*this, [this, ino] { return LoadDir(ino); }));
  return Status(Code::kAborted, "directory listed without the lock: start over");
}

std::shared_ptr<Node> NodeTable::AddBackingChildLocked(Node* dir, const std::string& name,
                                                        const struct stat& st) {
  auto child = NewNodeLocked(dir, name, TypeOf(st.st_mode));
  child->attr = st;
  child->attr.st_ino = child->ino;
  child->attr.st_blksize = BackingBlockSize(st);
  child->on_backing = true;
  links_.Adopt(child, st);
  return child;
}

Status NodeTable::LoadDir(uint64_t ino) {
  for (RaceRetry race;; race.Lose()) {
    std::string path;
    {
      TableLock lock(*this);
      auto dir = NodeLocked(ino);
      if (!dir || dir->type != NodeType::kDir || dir->loaded) return Status::Ok();
      // A loaded directory (the lookups' case) waits for no token holder. After races lost:
      // the directory's I/O token (Enter may wait without the lock: read it again).
      race.Enter(*this, dir);
      dir = NodeLocked(ino);
      if (!dir || dir->type != NodeType::kDir || dir->loaded) return Status::Ok();
      if (!dir->on_backing) {
        dir->loaded = true;  // made through the mount: nothing on the backing store yet
        return Status::Ok();
      }
      path = PathLocked(dir.get());
    }
    // The listing and the stats, without the lock.
    CKPT_ASSIGN_OR_RETURN(auto entries, backing_->List(path));
    std::vector<std::pair<std::string, struct stat>> found;
    for (const auto& e : entries) {
      if (IsTempName(e.name) || (ino == kRootIno && e.name == kCtlDirName)) continue;
      auto st = backing_->Stat(path::Join(path, e.name));
      if (st.ok()) found.emplace_back(e.name, *st);  // else raced with an external delete
    }
    TableLock lock(*this);
    auto dir = NodeLocked(ino);
    if (!dir || dir->loaded) return Status::Ok();
    if (PathLocked(dir.get()) != path) continue;  // moved meanwhile: list it where it is now
    for (const auto& [name, st] : found) {
      if (!dir->children.count(name)) AddBackingChildLocked(dir.get(), name, st);
    }
    dir->loaded = true;
    return Status::Ok();
  }
}

Status NodeTable::ProbeName(uint64_t dir_ino, const std::string& name) {
  CKPT_RETURN_IF_ERROR(LoadDir(dir_ino));
  // A second round: the name was evicted while its stat ran (GoneDirs: another node removed
  // it and the kernel had forgotten it); probed again as an absent name, since the stat
  // may have found it made again.
  for (int round = 0; round < 2; ++round) {
    // What to stat: the name's backing path while the mount's view of it may be refreshed
    // from the backing store (nothing of it pending), else nothing.
    std::shared_ptr<Node> child;
    std::string path;
    uint64_t removed = 0;  // the directory's names_removed when the stat was planned
    uint64_t evicted = 0;  // and its names_evicted
    auto probe_path = [&](Node* dir) REQUIRES(mu_) -> std::string {
      if (child) {
        const bool fresh = child->on_backing && !child->write &&
                           Quiescent(child.get(), publication_->view().applied());
        return fresh ? PathLocked(child.get()) : std::string();
      }
      // Absent from the view: another node may have published it (a shard of a checkpoint
      // this node's rank 0 made the directory of), while this node's own backlog (held
      // deletions, the next saves) keeps the directory from being quiescent: the two-node
      // soak's load got ENOENT for a shard of a committed checkpoint (seed 4101).
      const bool fresh = ListingCurrentLocked(dir) && !IsTempName(name);
      return fresh ? path::Join(PathLocked(dir), name) : std::string();
    };
    {
      MutexLock lock(&mu_);
      auto dir = NodeLocked(dir_ino);
      if (!dir || dir->type != NodeType::kDir || !dir->loaded) return Status::Ok();
      auto it = dir->children.find(name);
      if (it != dir->children.end()) child = it->second;
      path = probe_path(dir.get());
      if (path.empty()) return Status::Ok();
      removed = dir->names_removed;
      evicted = dir->names_evicted;
      dir->lookups++;
    }
    Result<struct stat> st = backing_->Stat(path);  // without mu
    MutexLock lock(&mu_);
    auto dir = NodeLocked(dir_ino);
    if (!dir || dir->type != NodeType::kDir || !dir->loaded) return Status::Ok();
    auto it = dir->children.find(name);
    const std::shared_ptr<Node> now = it == dir->children.end() ? nullptr : it->second;
    dir->lookups++;
    if (child && !now && dir->names_evicted != evicted) continue;  // probe it again
    // Changed through the mount meanwhile: its view is the truth, not this stat. A name
    // absent from the view before and after the stat was not touched through the mount if
    // no name left the directory meanwhile (making it would have left it in the view): its
    // stat stands even if the directory has other entries pending since.
    if (now != child) return Status::Ok();
    if (child ? probe_path(dir.get()) != path
              : !ListingCurrentLocked(dir.get()) || dir->names_removed != removed ||
                    path::Join(PathLocked(dir.get()), name) != path) {
      return Status::Ok();
    }
    if (child) {
      // Freshness: a published name that someone removed from the backing store is gone.
      if (!st.ok() && st.status().code() == Code::kNotFound) {
        DetachLocked(child);
      } else if (st.ok()) {
        ApplyBackingStatLocked(child.get(), *st);
        child->gone_elsewhere = false;  // made again (GoneDirs)
      }
    } else if (st.ok()) {
      // A name created on the backing store by someone else since the directory was loaded.
      AddBackingChildLocked(dir.get(), name, *st);
    }
    return Status::Ok();
  }
  return Status::Ok();
}

Status NodeTable::LoadChildDir(uint64_t dir_ino, const std::string& name) {
  uint64_t ino = 0;
  {
    MutexLock lock(&mu_);
    auto dir = NodeLocked(dir_ino);
    if (!dir || dir->type != NodeType::kDir) return Status::Ok();
    auto it = dir->children.find(name);
    if (it == dir->children.end() || it->second->type != NodeType::kDir) return Status::Ok();
    ino = it->second->ino;
  }
  return LoadDir(ino);
}

bool NodeTable::RefreshAttr(uint64_t ino, bool unless_committed, uint64_t done_through) {
  // The stat runs without mu; it is applied only if the node's backing path is still
  // the one stat'ed and nothing of it is pending.
  auto refreshable = [this, done_through](const Node* node) REQUIRES(mu_) {
    if (node->write || !node->on_backing) return false;
    const uint64_t applied = std::max(publication_->view().applied(), done_through);
    // A commit's refresh: the file's own entries done and its path the backing one (no
    // rename above it pending) suffice; entries of other names above it (the next
    // tracker, the rotation's rmdirs at the root: almost always, while saves go on) do not
    // change this file. Otherwise nothing above it may be pending.
    if (done_through != 0) return node->pending_seq <= applied && PendingRenameLocked(node) == 0;
    return Quiescent(node, applied);
  };
  std::string path;
  {
    MutexLock lock(&mu_);
    auto node = NodeLocked(ino);
    if (!node || !refreshable(node.get())) return false;
    if (unless_committed && TimeoutFor(*node) >= kCommittedTimeout) return false;
    path = PathLocked(node.get());
  }
  Result<struct stat> backing = backing_->Stat(path);
  if (!backing.ok()) return false;
  MutexLock lock(&mu_);
  auto node = NodeLocked(ino);
  if (!node || !refreshable(node.get()) || PathLocked(node.get()) != path) return false;
  // A file renamed over its name has a new ctime even with the old size and mtime. A name
  // this mount wrote shows its own times: the backing store's are judged against the ones
  // first seen there (stamp_*), as ApplyBackingStatLocked does.
  const Node& n = *node;
  const bool times_moved =
      !n.own_attrs ? !SameTime(n.attr.st_mtim, backing->st_mtim) ||
                         !SameTime(n.attr.st_ctim, backing->st_ctim)
      : n.stamped  ? !SameTime(n.stamp_mtime, backing->st_mtim) ||
                         !SameTime(n.stamp_ctime, backing->st_ctim)
                   : false;
  const bool changed = n.attr.st_size != backing->st_size || times_moved;
  ApplyBackingStatLocked(node.get(), *backing);
  return changed;
}

void NodeTable::ApplyBackingStatLocked(Node* node, const struct stat& st) {
  FoldWriteTimeLocked(node);
  if ((st.st_mode & S_IFMT) != (node->attr.st_mode & S_IFMT)) {
    // Replaced on the backing store by another kind of object. A file keeps its
    // attributes: it may be open, and its descriptors still read the file it was (were
    // the type to change, the kernel would mark the inode bad and fail every operation
    // on it, reads of those descriptors included, with EIO). A directory takes the new
    // type, so the kernel refuses every operation through it (EIO) rather than serve
    // names it no longer has.
    spdlog::warn("ino {} path '{}': replaced on the backing store by mode {:o}{}", node->ino,
                 PathLocked(node), st.st_mode & S_IFMT,
                 node->type == NodeType::kFile ? "; kept as the file it was"
                                               : "; the kernel fails operations on it (EIO)");
    if (node->type == NodeType::kFile) return;
  }
  const struct stat shown = node->attr;
  node->attr = st;
  node->attr.st_ino = node->ino;
  node->attr.st_blksize = BackingBlockSize(st);
  if (node->ino == kRootIno) {
    // Every temp file is made and renamed away in the backing root: its times move with
    // any write anywhere. Through the mount they move only with the root's own entries.
    node->own_attrs = true;
    node->stamped = false;
  } else if (!node->own_attrs) {
    return;
  } else if (!node->stamped) {
    node->stamp_mtime = st.st_mtim;
    node->stamp_ctime = st.st_ctim;
    node->stamped = true;
  } else if (!SameTime(st.st_mtim, node->stamp_mtime) || !SameTime(st.st_ctim, node->stamp_ctime)) {
    node->own_attrs = false;  // changed on the backing store by someone else
    return;
  }
  node->attr.st_mtim = shown.st_mtim;
  node->attr.st_ctim = shown.st_ctim;
  if (node->type == NodeType::kDir) {
    node->attr.st_size = shown.st_size;
    node->attr.st_nlink = shown.st_nlink;
  }
}

void NodeTable::OwnAttrsLocked(Node* node) {
  node->own_attrs = true;
  node->stamped = false;
}

void NodeTable::TouchDirLocked(Node* dir, int links) {
  dir->attr.st_mtim = dir->attr.st_ctim = Now();
  dir->attr.st_nlink = static_cast<nlink_t>(static_cast<int64_t>(dir->attr.st_nlink) + links);
  OwnAttrsLocked(dir);
}

bool NodeTable::ListingCurrentLocked(const Node* dir) const {
  const store::PublicationView view = publication_->view();
  if (!dir->on_backing || dir->removed_seq > view.applied() || PendingRenameLocked(dir) != 0) {
    return false;
  }
  for (const Node* n = dir; n != nullptr; n = n->parent) {
    if (n->made_seq != 0 && !view.done(n->made_seq)) return false;
  }
  return true;
}

uint64_t NodeTable::PendingRenameLocked(const Node* node) const {
  uint64_t need = 0;
  for (const Node* n = node; n != nullptr; n = n->parent) need = std::max(need, n->rename_seq);
  return need > publication_->view().applied() ? need : 0;
}

void NodeTable::SyncDataLocked(Node* node) {
  MutexLock lock(&node->data_mu);
  node->data.staged = node->write ? node->write->staged : nullptr;
  node->data.accepting = node->write && (node->write->needs_publish || node->write->discarded);
  node->data.error = node->error;
}

void NodeTable::FoldWriteTimeLocked(Node* node) {
  MutexLock lock(&node->data_mu);
  if (!node->data.written) return;
  node->attr.st_mtim = node->attr.st_ctim = node->data.write_time;
  node->data.written = false;
}

Result<uint64_t> NodeTable::AppendLocked(store::JournalEntry entry, Node* node) {
  const store::OpType entry_op = entry.op;
  CKPT_ASSIGN_OR_RETURN(uint64_t seq, publication_->Append(std::move(entry)));
  if (node != nullptr) {
    // The name and its directory's listing differ from the backing store until `seq`
    // is applied: neither may be refreshed from it meanwhile.
    node->pending_seq = seq;
    OwnAttrsLocked(node);
    if (node->parent != nullptr) {
      node->parent->pending_seq = seq;
      if (entry_op == store::OpType::kUnlink || entry_op == store::OpType::kRmdir ||
          entry_op == store::OpType::kRename) {
        node->parent->removed_seq = seq;
      }
      OwnAttrsLocked(node->parent);
    }
  }
  return seq;
}

Status NodeTable::WaitForAncestorsUnlocked(uint64_t ino) {
  while (true) {
    uint64_t need = 0;
    {
      MutexLock lock(&mu_);
      auto node = NodeLocked(ino);
      if (!node) return Status::Ok();
      // Only an operation that reaches the backing store by path must wait: loading a
      // directory, or opening a file that is not being written.
      const bool by_path = node->on_backing && (node->type == NodeType::kDir ? !node->loaded
                                                                             : !node->write);
      if (!by_path) return Status::Ok();
      for (const Node* n = node.get(); n != nullptr; n = n->parent) {
        need = std::max(need, n->rename_seq);
      }
      if (need <= publication_->view().applied()) return Status::Ok();
    }
    // The backing path is stale until the rename is applied. If publication is halted
    // before it, say so rather than wait for an operator.
    CKPT_RETURN_IF_ERROR(publication_->AwaitApplied(need));
  }
}

Status NodeTable::WaitIfStrict(Result<uint64_t> seq) {
  if (!seq.ok()) return seq.status();
  if (!config_.strict) return Status::Ok();
  Status st = publication_->WaitUnlessHalted(*seq);
  // The application saved into the same directory again before this commit's shards were
  // in: its own later save commits the directory (docs/SEMANTICS.md, "Superseded saves").
  if (st.code() == Code::kSuperseded) return Status::Ok();
  return st;
}

Status NodeTable::LogIfIo(const char* op, uint64_t ino, uint64_t offset, Status st) {
  if (st.ok() || st.ToErrno() != EIO) return st;
  const int64_t second = std::chrono::duration_cast<std::chrono::seconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
  if (io_log_second_.exchange(second) != second) io_logged_ = 0;
  if (io_logged_.fetch_add(1) >= kIoLogsPerSecond) {
    io_suppressed_.fetch_add(1);
    return st;
  }
  std::string path = "(control file)";
  if (ino == kRootIno || ino >= kFirstNodeIno) {
    MutexLock lock(&mu_);
    auto node = NodeLocked(ino);
    path = !node                      ? "(forgotten)"
           : node->ino == kRootIno    ? ""
           : node->parent != nullptr  ? PathLocked(node.get())
                                      : "(unlinked) " + node->name;
  }
  const uint64_t suppressed = io_suppressed_.exchange(0);
  spdlog::warn("EIO to the application: {} ino {} path '{}' offset {}: {}{}", op, ino, path,
               offset, st.ToString(),
               suppressed ? fmt::format(" ({} more not logged)", suppressed) : std::string());
  return st;
}

Result<struct stat> NodeTable::GetAttr(uint64_t ino) {
  RefreshAttr(ino, /*unless_committed=*/true);
  MutexLock lock(&mu_);
  auto node = NodeLocked(ino);
  if (!node) return NotFound("stale inode");
  FoldWriteTimeLocked(node.get());
  struct stat st = node->attr;
  if (node->link_group != 0) st.st_ino = node->link_group;  // one inode, one st_ino
  if (node->write) st.st_size = static_cast<off_t>(node->write->staged->size());
  st.st_blocks = (st.st_size + 511) / 512;
  return st;
}

}  // namespace ckptfs::fs
