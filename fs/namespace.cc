// The namespace: the inode table, the overlay of pending journal entries on the backing
// store, and the namespace operations (lookup, attributes, mkdir, unlink, rmdir, rename,
// opendir). Link, mknod, chown and fallocate are in fs/posix_ops.cc.
#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "fs/namespace.h"
#include "fs/fs_util.h"
#include "store/dcp/dcp_metadata.h"

namespace ckptfs::fs {

Namespace::Namespace(const FsConfig& config, const FsParts& parts)
    : config_(config),
      backing_(parts.backing),
      pipeline_(parts.pipeline),
      publication_(parts.publication),
      index_(parts.index),
      read_(parts.read),
      stats_(parts.stats),
      staging_ctx_{parts.pool, parts.pipeline, parts.backing} {}

Result<std::unique_ptr<Namespace>> Namespace::Create(const FsConfig& config,
                                                     const FsParts& parts) {
  std::unique_ptr<Namespace> ns(new Namespace(config, parts));
  CKPT_ASSIGN_OR_RETURN(struct stat root_attr, ns->backing_->Stat(""));
  ns->root_ = std::make_shared<Node>();
  ns->root_->ino = kRootIno;
  ns->root_->type = NodeType::kDir;
  ns->root_->attr = root_attr;
  ns->root_->attr.st_ino = kRootIno;
  ns->root_->on_backing = true;
  {
    MutexLock lock(&ns->ns_mu_);
    ns->inodes_[kRootIno] = ns->root_;
  }
  return ns;
}

uint64_t Namespace::PublishOpenFiles() {
  uint64_t unpublished = 0;
  MutexLock lock(&ns_mu_);
  for (auto& [ino, node] : inodes_) {
    if (node->write && node->write->needs_publish && node->parent != nullptr) {
      auto seq = PublishLocked(node.get());
      if (!seq.ok()) ++unpublished;
    }
  }
  return unpublished;
}

// ---------------------------------------------------------------- namespace helpers

std::shared_ptr<Node> Namespace::NodeLocked(uint64_t ino) {
  auto it = inodes_.find(ino);
  return it == inodes_.end() ? nullptr : it->second;
}

Result<std::shared_ptr<Node>> Namespace::LoadedDirLocked(uint64_t ino, const std::string& name) {
  auto dir = NodeLocked(ino);
  if (!dir || dir->type != NodeType::kDir) return Status(Code::kNotDir, name);
  CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(dir.get()));
  return dir;
}

std::string Namespace::PathLocked(const Node* node) const {
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

std::string Namespace::TempPathLocked(const WriteState& ws) const {
  return JoinPath(PathLocked(ws.temp_dir), ws.temp_name);
}

uint64_t Namespace::PendingRenameLocked(const Node* node) const {
  uint64_t need = 0;
  for (const Node* n = node; n != nullptr; n = n->parent) need = std::max(need, n->rename_seq);
  return need > publication_->applied() ? need : 0;
}

bool Namespace::QuiescentLocked(const Node* node) const {
  uint64_t applied = publication_->applied();
  for (const Node* n = node; n != nullptr; n = n->parent) {
    if (n->pending_seq > applied) return false;
  }
  return true;
}

std::shared_ptr<Node> Namespace::NewNodeLocked(Node* parent, const std::string& name,
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

void Namespace::ApplyBackingStatLocked(Node* node, const struct stat& st) {
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
  node->attr.st_blksize = kBlockSize;
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

void Namespace::OwnAttrsLocked(Node* node) {
  node->own_attrs = true;
  node->stamped = false;
}

void Namespace::TouchDirLocked(Node* dir, int links) {
  dir->attr.st_mtim = dir->attr.st_ctim = Now();
  dir->attr.st_nlink = static_cast<nlink_t>(static_cast<int64_t>(dir->attr.st_nlink) + links);
  OwnAttrsLocked(dir);
}

Status Namespace::EnsureLoadedLocked(Node* dir) {
  if (dir->loaded) return Status::Ok();
  if (!dir->on_backing) {
    dir->loaded = true;  // made through the mount: nothing on the backing store yet
    return Status::Ok();
  }
  const std::string path = PathLocked(dir);
  CKPT_ASSIGN_OR_RETURN(auto entries, backing_->List(path));
  for (const auto& e : entries) {
    if (IsTempName(e.name) || dir->children.count(e.name)) continue;
    if (dir->ino == kRootIno && e.name == kCtlDirName) continue;
    auto st = backing_->Stat(JoinPath(path, e.name));
    if (!st.ok()) continue;  // raced with an external delete
    AddBackingChildLocked(dir, e.name, *st);
  }
  dir->loaded = true;
  return Status::Ok();
}

std::shared_ptr<Node> Namespace::AddBackingChildLocked(Node* dir, const std::string& name,
                                                        const struct stat& st) {
  auto child = NewNodeLocked(dir, name, TypeOf(st.st_mode));
  child->attr = st;
  child->attr.st_ino = child->ino;
  child->attr.st_blksize = kBlockSize;
  child->on_backing = true;
  AdoptLinkGroupLocked(child.get(), st);
  return child;
}

Status Namespace::LoadDir(uint64_t ino) {
  std::string path;
  {
    MutexLock lock(&ns_mu_);
    auto dir = NodeLocked(ino);
    if (!dir || dir->type != NodeType::kDir || dir->loaded) return Status::Ok();
    if (!dir->on_backing) {
      dir->loaded = true;  // made through the mount: nothing on the backing store yet
      return Status::Ok();
    }
    path = PathLocked(dir.get());
  }
  // The listing and the stats, without ns_mu_.
  CKPT_ASSIGN_OR_RETURN(auto entries, backing_->List(path));
  std::vector<std::pair<std::string, struct stat>> found;
  for (const auto& e : entries) {
    if (IsTempName(e.name) || (ino == kRootIno && e.name == kCtlDirName)) continue;
    auto st = backing_->Stat(JoinPath(path, e.name));
    if (st.ok()) found.emplace_back(e.name, *st);  // else raced with an external delete
  }
  MutexLock lock(&ns_mu_);
  auto dir = NodeLocked(ino);
  // Moved meanwhile: the listing is of another path; the operation loads it under the lock.
  if (!dir || dir->loaded || PathLocked(dir.get()) != path) return Status::Ok();
  for (const auto& [name, st] : found) {
    if (!dir->children.count(name)) AddBackingChildLocked(dir.get(), name, st);
  }
  dir->loaded = true;
  return Status::Ok();
}

Status Namespace::ProbeName(uint64_t dir_ino, const std::string& name) {
  CKPT_RETURN_IF_ERROR(LoadDir(dir_ino));
  // What to stat: the name's backing path while the mount's view of it may be refreshed
  // from the backing store (nothing of it pending), else nothing.
  std::shared_ptr<Node> child;
  std::string path;
  auto probe_path = [&](Node* dir) REQUIRES(ns_mu_) -> std::string {
    if (child) {
      const bool fresh = child->on_backing && !child->write && QuiescentLocked(child.get());
      return fresh ? PathLocked(child.get()) : std::string();
    }
    const bool fresh = dir->on_backing && QuiescentLocked(dir) && !IsTempName(name);
    return fresh ? JoinPath(PathLocked(dir), name) : std::string();
  };
  {
    MutexLock lock(&ns_mu_);
    auto dir = NodeLocked(dir_ino);
    if (!dir || dir->type != NodeType::kDir || !dir->loaded) return Status::Ok();
    auto it = dir->children.find(name);
    if (it != dir->children.end()) child = it->second;
    path = probe_path(dir.get());
    if (path.empty()) return Status::Ok();
  }
  Result<struct stat> st = backing_->Stat(path);  // without ns_mu_
  MutexLock lock(&ns_mu_);
  auto dir = NodeLocked(dir_ino);
  if (!dir || dir->type != NodeType::kDir || !dir->loaded) return Status::Ok();
  auto it = dir->children.find(name);
  const std::shared_ptr<Node> now = it == dir->children.end() ? nullptr : it->second;
  // Changed through the mount meanwhile: its view is the truth, not this stat.
  if (now != child || probe_path(dir.get()) != path) return Status::Ok();
  if (child) {
    // Freshness: a published name that someone removed from the backing store is gone.
    if (!st.ok() && st.status().code() == Code::kNotFound) {
      DetachLocked(child);
    } else if (st.ok()) {
      ApplyBackingStatLocked(child.get(), *st);
    }
  } else if (st.ok()) {
    // A name created on the backing store by someone else since the directory was loaded.
    AddBackingChildLocked(dir.get(), name, *st);
  }
  return Status::Ok();
}

Status Namespace::LoadChildDir(uint64_t dir_ino, const std::string& name) {
  uint64_t ino = 0;
  {
    MutexLock lock(&ns_mu_);
    auto dir = NodeLocked(dir_ino);
    if (!dir || dir->type != NodeType::kDir) return Status::Ok();
    auto it = dir->children.find(name);
    if (it == dir->children.end() || it->second->type != NodeType::kDir) return Status::Ok();
    ino = it->second->ino;
  }
  return LoadDir(ino);
}

std::shared_ptr<Node> Namespace::ChildLocked(Node* dir, const std::string& name) {
  // The mount's view only: ProbeName refreshed it from the backing store before the lock.
  auto it = dir->children.find(name);
  return it == dir->children.end() ? nullptr : it->second;
}

void Namespace::DetachLocked(const std::shared_ptr<Node>& node) {
  if (node->parent != nullptr) {
    node->parent->children.erase(node->name);
    node->parent = nullptr;
  }
  if (node->nlookup == 0 && node->open_files == 0) inodes_.erase(node->ino);
}

Result<uint64_t> Namespace::AppendLocked(store::JournalEntry entry, Node* node) {
  CKPT_ASSIGN_OR_RETURN(uint64_t seq, publication_->Append(std::move(entry)));
  if (node != nullptr) {
    // The name and its directory's listing differ from the backing store until `seq`
    // is applied: neither may be refreshed from it meanwhile.
    node->pending_seq = seq;
    OwnAttrsLocked(node);
    if (node->parent != nullptr) {
      node->parent->pending_seq = seq;
      OwnAttrsLocked(node->parent);
    }
  }
  return seq;
}

Status Namespace::WaitIfStrict(Result<uint64_t> seq) {
  if (!seq.ok()) return seq.status();
  if (!config_.strict) return Status::Ok();
  Status st = publication_->WaitUnlessHalted(*seq);
  // The application saved into the same directory again before this commit's shards were
  // in: its own later save commits the directory (docs/SEMANTICS.md, "Superseded saves").
  if (st.code() == Code::kSuperseded) return Status::Ok();
  return st;
}

Status Namespace::WaitForAncestorsUnlocked(uint64_t ino) {
  while (true) {
    uint64_t need = 0;
    {
      MutexLock lock(&ns_mu_);
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
      if (need <= publication_->applied()) return Status::Ok();
    }
    // The backing path is stale until the rename is applied. If publication is halted
    // before it, say so rather than wait for an operator.
    CKPT_RETURN_IF_ERROR(publication_->AwaitApplied(need));
  }
}

Entry Namespace::EntryLocked(Node* node) {
  FoldWriteTimeLocked(node);
  node->nlookup++;
  Entry e;
  e.ino = node->ino;
  e.attr = node->attr;
  if (node->link_group != 0) e.attr.st_ino = node->link_group;  // one inode, one st_ino
  if (node->write) e.attr.st_size = static_cast<off_t>(node->write->staged->size());
  e.attr.st_blocks = (e.attr.st_size + 511) / 512;
  e.timeout = TimeoutFor(*node);
  return e;
}

bool Namespace::CommittedDirLocked(const Node* dir) const {
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
  const uint64_t applied = publication_->applied();
  return md.on_backing && !md.write && md.pending_seq <= applied && dir->pending_seq <= applied;
}

double Namespace::TimeoutFor(const Node& node) const {
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


void Namespace::SyncDataLocked(Node* node) {
  MutexLock lock(&node->data_mu);
  node->data.staged = node->write ? node->write->staged : nullptr;
  node->data.accepting = node->write && (node->write->needs_publish || node->write->discarded);
  node->data.error = node->error;
}

void Namespace::FoldWriteTimeLocked(Node* node) {
  MutexLock lock(&node->data_mu);
  if (!node->data.written) return;
  node->attr.st_mtim = node->attr.st_ctim = node->data.write_time;
  node->data.written = false;
}

// ---------------------------------------------------------------- lookups and attributes

Result<Entry> Namespace::NodeLookup(uint64_t parent, const std::string& name) {
  CKPT_RETURN_IF_ERROR(CheckName(name));
  if (IsTempName(name)) return NotFound(name);
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(ProbeName(parent, name));
  MutexLock lock(&ns_mu_);
  auto dir = NodeLocked(parent);
  if (!dir) return NotFound("stale parent");
  if (dir->type != NodeType::kDir) return Status(Code::kNotDir, name);
  CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(dir.get()));
  auto child = ChildLocked(dir.get(), name);
  if (!child) return NotFound(name);
  return EntryLocked(child.get());
}

void Namespace::Forget(uint64_t ino, uint64_t nlookup) {
  MutexLock lock(&ns_mu_);
  auto node = NodeLocked(ino);
  if (!node || ino == kRootIno) return;
  node->nlookup -= std::min(node->nlookup, nlookup);
  if (node->nlookup == 0 && node->parent == nullptr && node->open_files == 0) {
    inodes_.erase(ino);
  }
}

double Namespace::AttrTimeout(uint64_t ino) {
  if (ino < kFirstNodeIno && ino != kRootIno) return 0.0;  // control files: generated
  MutexLock lock(&ns_mu_);
  auto node = NodeLocked(ino);
  return node ? std::min(TimeoutFor(*node), kDefaultTimeout) : 0.0;
}

void Namespace::RefreshAttr(uint64_t ino) {
  // The stat runs without ns_mu_; it is applied only if the node's backing path is still
  // the one stat'ed and nothing of it is pending.
  auto refreshable = [this](const Node* node) REQUIRES(ns_mu_) {
    return !node->write && node->on_backing && QuiescentLocked(node);
  };
  std::string path;
  {
    MutexLock lock(&ns_mu_);
    auto node = NodeLocked(ino);
    if (!node || !refreshable(node.get())) return;
    path = PathLocked(node.get());
  }
  Result<struct stat> backing = backing_->Stat(path);
  if (!backing.ok()) return;
  MutexLock lock(&ns_mu_);
  auto node = NodeLocked(ino);
  if (node && refreshable(node.get()) && PathLocked(node.get()) == path) {
    ApplyBackingStatLocked(node.get(), *backing);
  }
}

Result<struct stat> Namespace::NodeGetAttr(uint64_t ino) {
  RefreshAttr(ino);
  MutexLock lock(&ns_mu_);
  auto node = NodeLocked(ino);
  if (!node) return NotFound("stale inode");
  FoldWriteTimeLocked(node.get());
  struct stat st = node->attr;
  if (node->link_group != 0) st.st_ino = node->link_group;  // one inode, one st_ino
  if (node->write) st.st_size = static_cast<off_t>(node->write->staged->size());
  st.st_blocks = (st.st_size + 511) / 512;
  return st;
}

Result<struct stat> Namespace::SetAttr(uint64_t ino, const struct stat& in, int to_set,
                                        Handle* handle, const Caller& caller) {
  // FUSE_SET_ATTR_* values, repeated here so this file stays free of libfuse.
  constexpr int kMode = 1 << 0, kUid = 1 << 1, kGid = 1 << 2, kSize = 1 << 3, kAtime = 1 << 4,
                kMtime = 1 << 5, kAtimeNow = 1 << 7, kMtimeNow = 1 << 8, kCtime = 1 << 10;
  if (ino < kFirstNodeIno && ino != kRootIno) return Status(Code::kPermission, "control file");
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(ino));
  Result<uint64_t> last_seq = uint64_t{0};
  // The I/O of a change runs after the lock: the temp file's owner and mode, and a
  // truncate (the copy it may begin, its wait for flushes, the ftruncate).
  std::shared_ptr<StagedFile> follow_temp;
  bool follow_owner = false;
  const FileHandle* resize_from = nullptr;
  bool resize = false;
  {
    MutexLock lock(&ns_mu_);
    auto node = NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    FoldWriteTimeLocked(node.get());  // a write's time first: what follows may set it
    // Ownership rules first (fs/posix_access.h): nothing changes unless all of it may.
    const uid_t new_uid = (to_set & kUid) ? in.st_uid : static_cast<uid_t>(-1);
    const gid_t new_gid = (to_set & kGid) ? in.st_gid : static_cast<gid_t>(-1);
    if (to_set & (kUid | kGid)) {
      CKPT_RETURN_IF_ERROR(CheckChown(caller, node->attr, new_uid, new_gid));
    }
    mode_t new_mode = 0;
    if (to_set & kMode) {
      CKPT_ASSIGN_OR_RETURN(new_mode, CheckChmod(caller, node->attr, in.st_mode));
    }
    // A truncate carries "mtime now" with it; its permission is the open's or, for
    // truncate(path), write permission.
    if ((to_set & (kAtime | kMtime)) && !(to_set & kSize)) {
      const bool explicit_times = ((to_set & kAtime) && !(to_set & kAtimeNow)) ||
                                  ((to_set & kMtime) && !(to_set & kMtimeNow));
      CKPT_RETURN_IF_ERROR(CheckUtimes(caller, node->attr, explicit_times));
    }
    if ((to_set & kSize) && handle == nullptr && !MayAccess(caller, node->attr, W_OK)) {
      return Status(Code::kPermission, "truncate without write permission");
    }
    if (to_set & kSize) {
      if (node->type != NodeType::kFile) return Status(Code::kIsDir, "truncate of a directory");
      if (node->attr.st_nlink > 1) {
        return Status(Code::kTooManyLinks, "truncate of a file with several hard links");
      }
      resize = true;
      resize_from = handle != nullptr ? handle->file() : nullptr;
    }
    // The owner before the mode: a chown clears setuid/setgid, on the backing store too.
    if (to_set & (kUid | kGid)) {
      last_seq = ChownLocked(node.get(), new_uid, new_gid);
      if (!last_seq.ok()) return last_seq.status();
      if (node->write) {
        follow_temp = node->write->staged;
        follow_owner = true;
      }
    }
    if (to_set & kMode) {
      node->attr.st_mode = (node->attr.st_mode & S_IFMT) | new_mode;
      node->attr.st_ctim = Now();
      if (node->write) {
        follow_temp = node->write->staged;
      } else if (node->on_backing) {
        store::JournalEntry e;
        e.op = store::OpType::kChmod;
        e.path = PathLocked(node.get());
        e.mode = new_mode;
        last_seq = AppendLocked(std::move(e), node.get());
      }
    }
    if (to_set & (kAtime | kMtime | kAtimeNow | kMtimeNow)) {
      struct timespec now = Now();
      struct timespec at = {0, UTIME_OMIT}, mt = {0, UTIME_OMIT};
      if (to_set & kAtimeNow) at = now; else if (to_set & kAtime) at = in.st_atim;
      if (to_set & kMtimeNow) mt = now; else if (to_set & kMtime) mt = in.st_mtim;
      if (at.tv_nsec != UTIME_OMIT) node->attr.st_atim = at;
      if (mt.tv_nsec != UTIME_OMIT) node->attr.st_mtim = mt;
      if (node->write && node->write->needs_publish) {
        // Flushes would move mtime again; its publish sets the node's times last.
      } else if (node->on_backing) {
        store::JournalEntry e;
        e.op = store::OpType::kUtimens;
        e.path = PathLocked(node.get());
        e.atime_sec = at.tv_sec, e.atime_nsec = at.tv_nsec;
        e.mtime_sec = mt.tv_sec, e.mtime_nsec = mt.tv_nsec;
        last_seq = AppendLocked(std::move(e), node.get());
      }
    }
    if (to_set & kCtime) node->attr.st_ctim = in.st_ctim;
    SyncPeersLocked(node.get(), last_seq.ok() ? *last_seq : 0);
  }
  if (follow_temp) {
    CKPT_RETURN_IF_ERROR(FollowOwnerInTemp(ino, std::move(follow_temp), follow_owner));
  }
  if (resize && last_seq.ok()) {
    Result<uint64_t> published = Resize(ino, static_cast<uint64_t>(in.st_size), resize_from);
    if (!published.ok()) return published.status();
    if (*published != 0) last_seq = published;
  }
  if (last_seq.ok() && *last_seq != 0) CKPT_RETURN_IF_ERROR(WaitIfStrict(last_seq));
  if (!last_seq.ok()) return last_seq.status();
  return NodeGetAttr(ino);
}

// ---------------------------------------------------------------- namespace operations

Result<Entry> Namespace::Mkdir(uint64_t parent, const std::string& name, mode_t mode,
                                const Caller& caller) {
  return MakeNode(parent, name, NodeType::kDir, S_IFDIR | (mode & 07777), "", 0, caller);
}

Result<Entry> Namespace::Symlink(const std::string& target, uint64_t parent,
                                  const std::string& name, const Caller& caller) {
  return MakeNode(parent, name, NodeType::kSymlink, S_IFLNK | 0777, target, 0, caller);
}

Result<Entry> Namespace::MakeNode(uint64_t parent, const std::string& name, NodeType type,
                                   mode_t mode, const std::string& link_target, dev_t rdev,
                                   const Caller& caller) {
  CKPT_RETURN_IF_ERROR(CheckNewName(parent, name));
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(ProbeName(parent, name));
  Entry out;
  Result<uint64_t> seq = uint64_t{0};
  {
    MutexLock lock(&ns_mu_);
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Node> dir, LoadedDirLocked(parent, name));
    if (ChildLocked(dir.get(), name)) return Status(Code::kExists, name);
    const NewOwner owner = OwnerOfNew(caller, dir->attr, mode & S_IFMT, mode);
    auto node = NewNodeLocked(dir.get(), name, type);
    TouchDirLocked(dir.get(), type == NodeType::kDir ? 1 : 0);
    node->attr.st_mode = (mode & S_IFMT) | owner.mode;
    node->attr.st_uid = owner.uid;
    node->attr.st_gid = owner.gid;
    node->attr.st_rdev = rdev;
    node->attr.st_atim = node->attr.st_mtim = node->attr.st_ctim = Now();
    node->on_backing = true;
    store::JournalEntry e;
    e.path = PathLocked(node.get());
    e.uid = owner.uid;
    e.gid = owner.gid;
    if (type == NodeType::kDir) {
      node->loaded = true;  // made here: nothing to load from the backing store
      e.op = store::OpType::kMkdir;
      e.mode = owner.mode;
    } else if (type == NodeType::kSpecial) {
      e.op = store::OpType::kMknod;
      e.mode = (mode & S_IFMT) | owner.mode;
      e.rdev = rdev;
    } else {
      node->attr.st_size = static_cast<off_t>(link_target.size());
      node->link_target = link_target;
      e.op = store::OpType::kSymlink;
      e.link_target = link_target;
    }
    seq = AppendLocked(std::move(e), node.get());
    out = EntryLocked(node.get());
  }
  CKPT_RETURN_IF_ERROR(WaitIfStrict(seq));
  if (type == NodeType::kDir && config_.peers && !config_.strict) WaitForOtherNodes(*seq);
  return out;
}

// Across nodes a directory made here is looked up on the backing store by the others: DCP's
// coordinator makes the checkpoint directory and every rank, on any node, then creates its
// shard in it. So with peers a mkdir returns once it is applied, even in async mode (behind
// whatever this mount queued before it: a save's mkdir after the last one's publication). A
// halted journal does not fail it: it exists here, the others see it on resume.
void Namespace::WaitForOtherNodes(uint64_t seq) {
  if (seq == 0) return;
  Status st = publication_->WaitUnlessHalted(seq);
  if (!st.ok()) {
    spdlog::warn("mkdir (journal seq {}) is not on the backing store yet, other nodes do not "
                 "see it: {}", seq, st.ToString());
  }
}

Result<std::string> Namespace::Readlink(uint64_t ino) {
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(ino));
  std::string path;
  {
    MutexLock lock(&ns_mu_);
    auto node = NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    if (node->type != NodeType::kSymlink) return Invalid("not a symlink");
    if (!node->link_target.empty()) return node->link_target;
    path = PathLocked(node.get());
  }
  // The target is returned as text and resolved by the kernel inside the mount, never
  // by the daemon (G9). Read without ns_mu_; a symlink's target never changes, so it is
  // kept if the name is still where it was read.
  CKPT_ASSIGN_OR_RETURN(std::string target, backing_->Readlink(path));
  MutexLock lock(&ns_mu_);
  auto node = NodeLocked(ino);
  if (node && node->link_target.empty() && PathLocked(node.get()) == path) {
    node->link_target = target;
  }
  return target;
}

Status Namespace::Unlink(uint64_t parent, const std::string& name, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(ProbeName(parent, name));
  Result<uint64_t> seq = uint64_t{0};
  {
    MutexLock lock(&ns_mu_);
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Node> dir, LoadedDirLocked(parent, name));
    auto node = ChildLocked(dir.get(), name);
    if (!node) return NotFound(name);
    if (node->type == NodeType::kDir) return Status(Code::kIsDir, name);
    CKPT_RETURN_IF_ERROR(CheckSticky(caller, dir->attr, node->attr));
    const std::string path = PathLocked(node.get());
    if (node->write && node->write->needs_publish) seq = DiscardLocked(node.get(), path);
    // Publication is halted before this name's pending publish: deleting it drops that
    // publish (so `rm -r` of a failed checkpoint lets the rest go on), and a `.metadata`
    // that names it will not wait for it.
    (void)publication_->DropIfHalted(path);
    if (node->on_backing) {
      store::JournalEntry e;
      e.op = store::OpType::kUnlink;
      e.path = path;
      seq = AppendLocked(std::move(e), node.get());
    }
    TouchDirLocked(dir.get(), 0);
    UnlinkPeersLocked(node.get(), seq.ok() ? *seq : 0);
    node->on_backing = false;
    DetachLocked(node);
  }
  return WaitIfStrict(seq);
}

Status Namespace::Rmdir(uint64_t parent, const std::string& name, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(ProbeName(parent, name));
  CKPT_RETURN_IF_ERROR(LoadChildDir(parent, name));  // is it empty?
  Result<uint64_t> seq = uint64_t{0};
  {
    MutexLock lock(&ns_mu_);
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Node> dir, LoadedDirLocked(parent, name));
    auto node = ChildLocked(dir.get(), name);
    if (!node) return NotFound(name);
    if (node->type != NodeType::kDir) return Status(Code::kNotDir, name);
    CKPT_RETURN_IF_ERROR(CheckSticky(caller, dir->attr, node->attr));
    CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(node.get()));
    if (!node->children.empty()) return Status(Code::kNotEmpty, name);
    const std::string path = PathLocked(node.get());
    store::JournalEntry e;
    e.op = store::OpType::kRmdir;
    e.path = path;
    seq = AppendLocked(std::move(e), node.get());
    TouchDirLocked(dir.get(), -1);
    node->on_backing = false;
    DetachLocked(node);
  }
  return WaitIfStrict(seq);
}

Status Namespace::Rename(uint64_t parent, const std::string& name, uint64_t new_parent,
                          const std::string& new_name, unsigned flags, const Caller& caller) {
  constexpr unsigned kNoReplace = 1, kExchange = 2;
  if (flags & kExchange) return Unsupported("RENAME_EXCHANGE");
  CKPT_RETURN_IF_ERROR(CheckNewName(new_parent, new_name));
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(new_parent));
  CKPT_RETURN_IF_ERROR(ProbeName(parent, name));
  CKPT_RETURN_IF_ERROR(ProbeName(new_parent, new_name));
  CKPT_RETURN_IF_ERROR(LoadChildDir(new_parent, new_name));  // a replaced dir must be empty
  Result<uint64_t> seq = uint64_t{0};
  {
    MutexLock lock(&ns_mu_);
    auto src_dir = NodeLocked(parent);
    auto dst_dir = NodeLocked(new_parent);
    if (!src_dir || !dst_dir || src_dir->type != NodeType::kDir ||
        dst_dir->type != NodeType::kDir) {
      return Status(Code::kNotDir, name);
    }
    CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(src_dir.get()));
    CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(dst_dir.get()));
    auto node = ChildLocked(src_dir.get(), name);
    if (!node) return NotFound(name);
    CKPT_RETURN_IF_ERROR(CheckSticky(caller, src_dir->attr, node->attr));
    // A directory cannot move below itself.
    for (Node* n = dst_dir.get(); n != nullptr; n = n->parent) {
      if (n == node.get()) return Invalid("rename of a directory into itself");
    }
    auto victim = ChildLocked(dst_dir.get(), new_name);
    if (victim == node) return Status::Ok();
    if (victim) {
      if (flags & kNoReplace) return Status(Code::kExists, new_name);
      CKPT_RETURN_IF_ERROR(CheckSticky(caller, dst_dir->attr, victim->attr));
      if (node->type == NodeType::kDir && victim->type != NodeType::kDir) {
        return Status(Code::kNotDir, new_name);
      }
      if (node->type != NodeType::kDir && victim->type == NodeType::kDir) {
        return Status(Code::kIsDir, new_name);
      }
      if (victim->type == NodeType::kDir) {
        CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(victim.get()));
        if (!victim->children.empty()) return Status(Code::kNotEmpty, new_name);
      }
    }
    const std::string from = PathLocked(node.get());
    const std::string to = JoinPath(PathLocked(dst_dir.get()), new_name);
    if (victim && victim->write && victim->write->needs_publish) {
      seq = DiscardLocked(victim.get(), to);
    }
    if (node->on_backing) {
      store::JournalEntry e;
      e.op = store::OpType::kRename;
      e.from = from;
      e.path = to;
      // The type tells publication that a directory moves (its checkpoint records move).
      if (node->type == NodeType::kDir) e.mode = S_IFDIR;
      seq = AppendLocked(std::move(e), node.get());
      if (seq.ok()) node->rename_seq = *seq;
    } else if (victim && victim->on_backing) {
      // The replaced name must vanish now; the new file replaces it when published.
      store::JournalEntry e;
      e.op = store::OpType::kUnlink;
      e.path = to;
      if (victim->type == NodeType::kDir) e.mode = S_IFDIR;
      seq = AppendLocked(std::move(e), victim.get());
    }
    if (victim) {
      UnlinkPeersLocked(victim.get(), seq.ok() ? *seq : 0);
      victim->on_backing = false;
      DetachLocked(victim);
    }
    if (seq.ok() && *seq != 0) dst_dir->pending_seq = std::max(dst_dir->pending_seq, *seq);
    const bool moves_dir = node->type == NodeType::kDir && src_dir != dst_dir;
    TouchDirLocked(src_dir.get(), moves_dir ? -1 : 0);
    TouchDirLocked(dst_dir.get(), (moves_dir ? 1 : 0) -
                                      (victim && victim->type == NodeType::kDir ? 1 : 0));
    src_dir->children.erase(name);
    node->parent = dst_dir.get();
    node->name = new_name;
    dst_dir->children[new_name] = node;
    node->attr.st_ctim = Now();
  }
  return WaitIfStrict(seq);
}

Result<Handle*> Namespace::NodeOpenDir(uint64_t ino) {
  auto handle = std::make_unique<Handle>();
  DirHandle& dh = handle->kind.emplace<DirHandle>();
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(ino));
  CKPT_RETURN_IF_ERROR(LoadDir(ino));
  // Pick up names other writers created on the backing store since the load: listed and
  // stat'ed without ns_mu_, added if the directory is still where it was and quiescent.
  std::string path;
  bool relist = false;
  {
    MutexLock lock(&ns_mu_);
    auto node = NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    if (node->type != NodeType::kDir) return Status(Code::kNotDir, "opendir");
    if (node->loaded && node->on_backing && QuiescentLocked(node.get())) {
      path = PathLocked(node.get());
      relist = true;
    }
  }
  std::vector<std::pair<std::string, struct stat>> found;
  if (relist) {
    auto listed = backing_->List(path);
    if (listed.ok()) {
      std::set<std::string> known;
      {
        MutexLock lock(&ns_mu_);
        if (auto node = NodeLocked(ino)) {
          for (const auto& [name, child] : node->children) known.insert(name);
        }
      }
      for (const auto& e : *listed) {
        if (known.count(e.name) || IsTempName(e.name) ||
            (ino == kRootIno && e.name == kCtlDirName)) {
          continue;
        }
        auto st = backing_->Stat(JoinPath(path, e.name));
        if (st.ok()) found.emplace_back(e.name, *st);
      }
    }
  }
  MutexLock lock(&ns_mu_);
  auto node = NodeLocked(ino);
  if (!node) return NotFound("stale inode");
  if (node->type != NodeType::kDir) return Status(Code::kNotDir, "opendir");
  CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(node.get()));
  if (!found.empty() && node->on_backing && QuiescentLocked(node.get()) &&
      PathLocked(node.get()) == path) {
    for (const auto& [name, st] : found) {
      if (!node->children.count(name)) AddBackingChildLocked(node.get(), name, st);
    }
  }
  dh.node = node;
  dh.entries.push_back({".", ino, S_IFDIR});
  dh.entries.push_back({"..", node->parent ? node->parent->ino : kRootIno, S_IFDIR});
  if (ino == kRootIno) dh.entries.push_back({kCtlDirName, kCtlDirIno, S_IFDIR});
  for (const auto& [name, child] : node->children) {
    dh.entries.push_back({name, child->ino, child->attr.st_mode & S_IFMT});
  }
  return handle.release();
}


}  // namespace ckptfs::fs
