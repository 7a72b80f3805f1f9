#include "fs/filesystem.h"

#include <dirent.h>
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "store/dcp_metadata.h"

namespace ckptfs::fs {
namespace {

constexpr blksize_t kBlockSize = 1 << 20;  // Python's buffered I/O reads this much
constexpr double kCommittedTimeout = 3600.0;
constexpr double kDefaultTimeout = 1.0;

constexpr size_t kNameMax = 255;  // NAME_MAX of every Linux file system we back onto

// Refuses names the backing store could not hold, before anything is queued.
Status CheckName(const std::string& name) {
  if (name.size() > kNameMax) {
    return Status(Code::kNameTooLong, "name longer than 255 bytes");
  }
  return Status::Ok();
}

bool IsTempName(const std::string& name) {
  return name.compare(0, sizeof(kTempPrefix) - 1, kTempPrefix) == 0;
}

// The node type of a backing store entry. FIFOs, sockets and devices are kSpecial: the
// daemon never opens them (an open of a FIFO would block a FUSE thread).
NodeType TypeOf(mode_t mode) {
  if (S_ISDIR(mode)) return NodeType::kDir;
  if (S_ISLNK(mode)) return NodeType::kSymlink;
  if (S_ISREG(mode)) return NodeType::kFile;
  return NodeType::kSpecial;
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : dir + "/" + name;
}

std::string ParentOf(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

struct timespec Now() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts;
}

bool SameTime(const struct timespec& a, const struct timespec& b) {
  return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

// EIO lines logged per second at most; the rest are counted and reported with the next.
constexpr int kIoLogsPerSecond = 20;

}  // namespace

Filesystem::Filesystem(const FsConfig& config) : config_(config) {}

Result<std::unique_ptr<Filesystem>> Filesystem::Create(const FsConfig& config) {
  std::unique_ptr<Filesystem> fs(new Filesystem(config));
  CKPT_RETURN_IF_ERROR(fs->Init());
  return fs;
}

Status Filesystem::Init() {
  CKPT_ASSIGN_OR_RETURN(backing_, store::BackingDir::Open(config_.backing_dir));
  CKPT_ASSIGN_OR_RETURN(db_, store::StateDb::Open(config_.state_dir));
  CKPT_ASSIGN_OR_RETURN(store::RecoveryReport report, store::Journal::Recover(backing_.get(),
                                                                              db_.get()));
  if (report.entries_discarded > 0 || report.temps_removed > 0) {
    spdlog::warn("recovery: discarded {} unapplied journal entries, removed {} temp files",
                 report.entries_discarded, report.temps_removed);
  }
  CKPT_ASSIGN_OR_RETURN(checkpoints_, store::CheckpointRegistry::Load(db_.get()));
  gpu::StagingOptions pool_options;
  pool_options.total_bytes = config_.staging_bytes;
  pool_options.chunk_bytes = config_.chunk_bytes;
  pool_options.backend = config_.staging_backend;
  pool_options.hugepages = config_.staging_hugepages;
  CKPT_ASSIGN_OR_RETURN(pool_, gpu::StagingPool::Create(pool_options));
  pool_->SetPressureCallback([this] { RelieveStagingPressure(); });
  store::FlushOptions flush_options;
  flush_options.threads = config_.flush_threads;
  flush_options.block_crcs = config_.write_checksums;
  flush_options.direct_io = config_.flush_direct_io;
  CKPT_ASSIGN_OR_RETURN(pipeline_, store::FlushPipeline::Create(backing_.get(), flush_options));
  staging_ctx_ = StagingContext{pool_.get(), pipeline_.get(), backing_.get()};
  store::CommitGateOptions gate_options;
  gate_options.timeout = config_.commit_timeout;
  gate_options.written_locally = [this](const std::string& path) { return WrittenLocally(path); };
  gate_options.deleted_locally = [this](const std::string& path) {
    std::lock_guard lock(dropped_mu_);
    return dropped_paths_.count(path) > 0;
  };
  gate_ = std::make_unique<store::CommitGate>(backing_.get(), std::move(gate_options));
  store::Journal::Hooks hooks;
  hooks.commit_gate = [this](const store::JournalEntry& e,
                             const std::function<bool(const std::string&)>& queued) {
    return gate_->Check(e, queued);
  };
  hooks.on_done = [this](const store::JournalEntry& e, const Status& st) { OnJournalDone(e, st); };
  hooks.on_halt = [this](const store::JournalEntry& e, const Status& st) { OnJournalHalt(e, st); };
  // Strict mode returns every failure to the operation that caused it: nothing waits.
  hooks.halt_on_failure = !config_.strict;
  // Temp files live at the backing root (BeginWriteLocked): their records can be written
  // ahead, several per synced write.
  hooks.temp_path = [](uint64_t id) { return std::string(kTempPrefix) + std::to_string(id); };
  CKPT_ASSIGN_OR_RETURN(journal_, store::Journal::Create(backing_.get(), db_.get(), hooks));

  CKPT_ASSIGN_OR_RETURN(index_, store::KeyIndex::Create(backing_.get(), db_.get()));
  read_sums_ = std::make_unique<store::ReadChecksums>(index_.get());
  tensors_ = std::make_unique<TensorView>(backing_.get(), index_.get());
  if (config_.cache_bytes > 0) {
    store::BlockCacheOptions cache_options;
    cache_options.budget_bytes = config_.cache_bytes;
    cache_options.direct_io = config_.cache_direct_io;
    CKPT_ASSIGN_OR_RETURN(cache_, store::BlockCache::Create(backing_.get(), cache_options));
  }
  indexer_ = std::thread([this] { RunIndexer(); });

  CKPT_ASSIGN_OR_RETURN(struct stat root_attr, backing_->Stat(""));
  root_ = std::make_shared<Node>();
  root_->ino = kRootIno;
  root_->type = NodeType::kDir;
  root_->attr = root_attr;
  root_->attr.st_ino = kRootIno;
  root_->on_backing = true;
  inodes_[kRootIno] = root_;
  spdlog::info("ckptfs ready: backing {} staging {} MiB ({}), {} flush threads, {} mode",
               config_.backing_dir, pool_->limit_bytes() >> 20, pool_->backend(),
               config_.flush_threads, config_.strict ? "strict" : "async");
  return Status::Ok();
}

Filesystem::~Filesystem() { Shutdown(); }

void Filesystem::NoteError(const std::string& msg) {
  errors_.fetch_add(1);
  std::lock_guard lock(error_mu_);
  last_error_ = msg;
}

// ---------------------------------------------------------------- namespace helpers

std::shared_ptr<Node> Filesystem::NodeLocked(uint64_t ino) {
  auto it = inodes_.find(ino);
  return it == inodes_.end() ? nullptr : it->second;
}

std::string Filesystem::PathLocked(const Node* node) const {
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

std::string Filesystem::TempPathLocked(const WriteState& ws) const {
  return JoinPath(PathLocked(ws.temp_dir), ws.temp_name);
}

uint64_t Filesystem::PendingRenameLocked(const Node* node) const {
  uint64_t need = 0;
  for (const Node* n = node; n != nullptr; n = n->parent) need = std::max(need, n->rename_seq);
  return need > journal_->applied() ? need : 0;
}

bool Filesystem::QuiescentLocked(const Node* node) const {
  uint64_t applied = journal_->applied();
  for (const Node* n = node; n != nullptr; n = n->parent) {
    if (n->pending_seq > applied) return false;
  }
  return true;
}

std::shared_ptr<Node> Filesystem::NewNodeLocked(Node* parent, const std::string& name,
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

void Filesystem::RefreshAttrLocked(Node* node) {
  if (node->write || !node->on_backing || !QuiescentLocked(node)) return;
  auto st = backing_->Stat(PathLocked(node));
  if (!st.ok()) return;
  ApplyBackingStatLocked(node, *st);
}

void Filesystem::ApplyBackingStatLocked(Node* node, const struct stat& st) {
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

void Filesystem::OwnAttrsLocked(Node* node) {
  node->own_attrs = true;
  node->stamped = false;
}

void Filesystem::TouchDirLocked(Node* dir, int links) {
  dir->attr.st_mtim = dir->attr.st_ctim = Now();
  dir->attr.st_nlink = static_cast<nlink_t>(static_cast<int64_t>(dir->attr.st_nlink) + links);
  OwnAttrsLocked(dir);
}

Status Filesystem::EnsureLoadedLocked(Node* dir) {
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
    auto child = NewNodeLocked(dir, e.name, TypeOf(st->st_mode));
    uint64_t ino = child->ino;
    child->attr = *st;
    child->attr.st_ino = ino;
    child->attr.st_blksize = kBlockSize;
    child->on_backing = true;
    AdoptLinkGroupLocked(child.get(), *st);
  }
  dir->loaded = true;
  return Status::Ok();
}

std::shared_ptr<Node> Filesystem::ChildLocked(Node* dir, const std::string& name) {
  auto it = dir->children.find(name);
  if (it != dir->children.end()) {
    Node* child = it->second.get();
    // Freshness: a published name that someone removed from the backing store is gone.
    if (child->on_backing && !child->write && QuiescentLocked(child)) {
      auto st = backing_->Stat(PathLocked(child));
      if (!st.ok() && st.status().code() == Code::kNotFound) {
        DetachLocked(it->second);
        return nullptr;
      }
      if (st.ok()) ApplyBackingStatLocked(child, *st);
    }
    return it->second;
  }
  // A name created on the backing store by someone else since the directory was loaded.
  if (dir->on_backing && QuiescentLocked(dir) && !IsTempName(name)) {
    auto st = backing_->Stat(JoinPath(PathLocked(dir), name));
    if (st.ok()) {
      auto child = NewNodeLocked(dir, name, TypeOf(st->st_mode));
      child->attr = *st;
      child->attr.st_ino = child->ino;
      child->attr.st_blksize = kBlockSize;
      child->on_backing = true;
      AdoptLinkGroupLocked(child.get(), *st);
      return child;
    }
  }
  return nullptr;
}

void Filesystem::DetachLocked(const std::shared_ptr<Node>& node) {
  if (node->parent != nullptr) {
    node->parent->children.erase(node->name);
    node->parent = nullptr;
  }
  if (node->nlookup == 0 && node->open_files == 0) inodes_.erase(node->ino);
}

Result<uint64_t> Filesystem::AppendLocked(store::JournalEntry entry, Node* node) {
  CKPT_ASSIGN_OR_RETURN(uint64_t seq, journal_->Append(std::move(entry)));
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

Status Filesystem::WaitIfStrict(Result<uint64_t> seq) {
  if (!seq.ok()) return seq.status();
  if (!config_.strict) return Status::Ok();
  return journal_->WaitUnlessHalted(*seq);
}

Status Filesystem::WaitForAncestorsUnlocked(uint64_t ino) {
  while (true) {
    uint64_t need = 0;
    {
      std::lock_guard lock(ns_mu_);
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
      if (need <= journal_->applied()) return Status::Ok();
    }
    // The backing path is stale until the rename is applied. If publication is halted
    // before it, say so rather than wait for an operator.
    Status st = journal_->WaitUnlessHalted(need);
    if (!st.ok() && journal_->halted()) return st;
  }
}

Entry Filesystem::EntryLocked(Node* node) {
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

bool Filesystem::CommittedDirLocked(const Node* dir) const {
  // A checkpoint is committed once its `.metadata` is published and nothing in the
  // directory is pending; the registry knows the ones saved through this mount.
  auto it = dir->children.find(".metadata");
  if (it == dir->children.end()) return false;
  const Node& md = *it->second;
  const uint64_t applied = journal_->applied();
  return md.on_backing && !md.write && md.pending_seq <= applied && dir->pending_seq <= applied;
}

double Filesystem::TimeoutFor(const Node& node) const {
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

std::string Filesystem::CheckpointDirOf(const std::string& path) const { return ParentOf(path); }

// ---------------------------------------------------------------- lookups and attributes

Result<Entry> Filesystem::Lookup(uint64_t parent, const std::string& name) {
  if (parent == kRootIno && name == kCtlDirName) {
    Entry e;
    e.ino = kCtlDirIno;
    CKPT_ASSIGN_OR_RETURN(e.attr, GetAttr(kCtlDirIno));
    return e;
  }
  if (TensorView::Owns(parent)) {
    CKPT_ASSIGN_OR_RETURN(auto v, tensors_->Lookup(parent, name));
    return Entry{v.ino, v.attr, kDefaultTimeout};
  }
  if (parent == kCtlDirIno && name == "tensors") {
    CKPT_ASSIGN_OR_RETURN(auto attr, tensors_->GetAttr(TensorView::kRootIno));
    return Entry{TensorView::kRootIno, attr, kDefaultTimeout};
  }
  if (parent == kCtlDirIno) {
    Entry e;
    if (name == "stats") e.ino = kCtlStatsIno;
    else if (name == "checkpoints") e.ino = kCtlCheckpointsIno;
    else if (name == "metrics") e.ino = kCtlMetricsIno;
    else return NotFound(name);
    CKPT_ASSIGN_OR_RETURN(e.attr, GetAttr(e.ino));
    e.timeout = 0;
    return e;
  }
  CKPT_RETURN_IF_ERROR(CheckName(name));
  if (IsTempName(name)) return NotFound(name);
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(parent));
  std::lock_guard lock(ns_mu_);
  auto dir = NodeLocked(parent);
  if (!dir) return NotFound("stale parent");
  if (dir->type != NodeType::kDir) return Status(Code::kNotDir, name);
  CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(dir.get()));
  auto child = ChildLocked(dir.get(), name);
  if (!child) return NotFound(name);
  return EntryLocked(child.get());
}

void Filesystem::Forget(uint64_t ino, uint64_t nlookup) {
  std::lock_guard lock(ns_mu_);
  auto node = NodeLocked(ino);
  if (!node || ino == kRootIno) return;
  node->nlookup -= std::min(node->nlookup, nlookup);
  if (node->nlookup == 0 && node->parent == nullptr && node->open_files == 0) {
    inodes_.erase(ino);
  }
}

double Filesystem::AttrTimeout(uint64_t ino) {
  if (ino < kFirstNodeIno && ino != kRootIno) return 0.0;  // control files: generated
  std::lock_guard lock(ns_mu_);
  auto node = NodeLocked(ino);
  return node ? std::min(TimeoutFor(*node), kDefaultTimeout) : 0.0;
}

Result<struct stat> Filesystem::GetAttr(uint64_t ino) {
  if (TensorView::Owns(ino)) return tensors_->GetAttr(ino);
  if (ino >= kCtlDirIno && ino < kFirstNodeIno) {
    struct stat st {};
    st.st_ino = ino;
    st.st_mode = ino == kCtlDirIno ? (S_IFDIR | 0555) : (S_IFREG | 0444);
    st.st_nlink = ino == kCtlDirIno ? 2 : 1;
    st.st_blksize = 4096;
    struct timespec now = Now();
    st.st_atim = st.st_mtim = st.st_ctim = now;
    return st;
  }
  std::lock_guard lock(ns_mu_);
  auto node = NodeLocked(ino);
  if (!node) return NotFound("stale inode");
  RefreshAttrLocked(node.get());
  struct stat st = node->attr;
  if (node->link_group != 0) st.st_ino = node->link_group;  // one inode, one st_ino
  if (node->write) st.st_size = static_cast<off_t>(node->write->staged->size());
  st.st_blocks = (st.st_size + 511) / 512;
  return st;
}

Result<struct stat> Filesystem::SetAttr(uint64_t ino, const struct stat& in, int to_set,
                                        Handle* handle, const Caller& caller) {
  // FUSE_SET_ATTR_* values, repeated here so this file stays free of libfuse.
  constexpr int kMode = 1 << 0, kUid = 1 << 1, kGid = 1 << 2, kSize = 1 << 3, kAtime = 1 << 4,
                kMtime = 1 << 5, kAtimeNow = 1 << 7, kMtimeNow = 1 << 8, kCtime = 1 << 10;
  if (ino < kFirstNodeIno && ino != kRootIno) return Status(Code::kPermission, "control file");
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(ino));
  Result<uint64_t> last_seq = uint64_t{0};
  {
    std::lock_guard lock(ns_mu_);
    auto node = NodeLocked(ino);
    if (!node) return NotFound("stale inode");
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
      // ftruncate through a handle opened before any write: copy from its descriptor.
      const UniqueFd* src = !node->write && handle != nullptr && handle->node == node
                                ? handle->fd.get()
                                : nullptr;
      CKPT_RETURN_IF_ERROR(EnsureWritableLocked(node.get(), in.st_size == 0, src));
      CKPT_RETURN_IF_ERROR(node->write->staged->Truncate(static_cast<uint64_t>(in.st_size)));
      if (node->open_writers == 0) last_seq = PublishLocked(node.get());
      node->attr.st_mtim = node->attr.st_ctim = Now();
    }
    // The owner before the mode: a chown clears setuid/setgid, on the backing store too.
    if (to_set & (kUid | kGid)) {
      last_seq = ChownLocked(node.get(), new_uid, new_gid);
      if (!last_seq.ok()) return last_seq.status();
    }
    if (to_set & kMode) {
      node->attr.st_mode = (node->attr.st_mode & S_IFMT) | new_mode;
      node->attr.st_ctim = Now();
      if (node->write) {
        if (::fchmod(node->write->staged->target()->fd(), new_mode) != 0) {
          return Status::FromErrno(errno, "chmod");
        }
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
  if (last_seq.ok() && *last_seq != 0) CKPT_RETURN_IF_ERROR(WaitIfStrict(last_seq));
  if (!last_seq.ok()) return last_seq.status();
  return GetAttr(ino);
}

// ---------------------------------------------------------------- namespace operations

Result<Entry> Filesystem::Mkdir(uint64_t parent, const std::string& name, mode_t mode,
                                const Caller& caller) {
  return MakeNode(parent, name, NodeType::kDir, S_IFDIR | (mode & 07777), "", 0, caller);
}

Result<Entry> Filesystem::Symlink(const std::string& target, uint64_t parent,
                                  const std::string& name, const Caller& caller) {
  return MakeNode(parent, name, NodeType::kSymlink, S_IFLNK | 0777, target, 0, caller);
}

Result<Entry> Filesystem::MakeNode(uint64_t parent, const std::string& name, NodeType type,
                                   mode_t mode, const std::string& link_target, dev_t rdev,
                                   const Caller& caller) {
  CKPT_RETURN_IF_ERROR(CheckName(name));
  if (IsTempName(name) || (parent == kRootIno && name == kCtlDirName)) {
    return Status(Code::kPermission, "reserved name " + name);
  }
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(parent));
  Entry out;
  Result<uint64_t> seq = uint64_t{0};
  {
    std::lock_guard lock(ns_mu_);
    auto dir = NodeLocked(parent);
    if (!dir || dir->type != NodeType::kDir) return Status(Code::kNotDir, name);
    CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(dir.get()));
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
  return out;
}

Result<std::string> Filesystem::Readlink(uint64_t ino) {
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(ino));
  std::lock_guard lock(ns_mu_);
  auto node = NodeLocked(ino);
  if (!node) return NotFound("stale inode");
  if (node->type != NodeType::kSymlink) return Invalid("not a symlink");
  if (!node->link_target.empty()) return node->link_target;
  // The target is returned as text and resolved by the kernel inside the mount, never
  // by the daemon (G9).
  CKPT_ASSIGN_OR_RETURN(node->link_target, backing_->Readlink(PathLocked(node.get())));
  return node->link_target;
}

Status Filesystem::Unlink(uint64_t parent, const std::string& name, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(parent));
  Result<uint64_t> seq = uint64_t{0};
  {
    std::lock_guard lock(ns_mu_);
    auto dir = NodeLocked(parent);
    if (!dir || dir->type != NodeType::kDir) return Status(Code::kNotDir, name);
    CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(dir.get()));
    auto node = ChildLocked(dir.get(), name);
    if (!node) return NotFound(name);
    if (node->type == NodeType::kDir) return Status(Code::kIsDir, name);
    CKPT_RETURN_IF_ERROR(CheckSticky(caller, dir->attr, node->attr));
    const std::string path = PathLocked(node.get());
    if (node->write && node->write->needs_publish) seq = DiscardLocked(node.get(), path);
    // Publication is halted before this name's pending publish: deleting it drops that
    // publish (so `rm -r` of a failed checkpoint lets the rest go on), and a `.metadata`
    // that names it will not wait for it.
    if (journal_->DropIfHalted(path)) {
      std::lock_guard dropped_lock(dropped_mu_);
      dropped_paths_.insert(path);
    }
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

Status Filesystem::Rmdir(uint64_t parent, const std::string& name, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(parent));
  Result<uint64_t> seq = uint64_t{0};
  {
    std::lock_guard lock(ns_mu_);
    auto dir = NodeLocked(parent);
    if (!dir || dir->type != NodeType::kDir) return Status(Code::kNotDir, name);
    CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(dir.get()));
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
    checkpoints_->OnRemoved(path, seq.ok() ? *seq : 0);
    TouchDirLocked(dir.get(), -1);
    node->on_backing = false;
    DetachLocked(node);
  }
  return WaitIfStrict(seq);
}

Status Filesystem::Rename(uint64_t parent, const std::string& name, uint64_t new_parent,
                          const std::string& new_name, unsigned flags, const Caller& caller) {
  constexpr unsigned kNoReplace = 1, kExchange = 2;
  if (flags & kExchange) return Unsupported("RENAME_EXCHANGE");
  CKPT_RETURN_IF_ERROR(CheckName(new_name));
  if (IsTempName(new_name) || (new_parent == kRootIno && new_name == kCtlDirName)) {
    return Status(Code::kPermission, "reserved name " + new_name);
  }
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(new_parent));
  Result<uint64_t> seq = uint64_t{0};
  {
    std::lock_guard lock(ns_mu_);
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
      seq = AppendLocked(std::move(e), node.get());
      if (seq.ok()) node->rename_seq = *seq;
    } else if (victim && victim->on_backing) {
      // The replaced name must vanish now; the new file replaces it when published.
      store::JournalEntry e;
      e.op = store::OpType::kUnlink;
      e.path = to;
      seq = AppendLocked(std::move(e), victim.get());
    }
    if (victim) {
      UnlinkPeersLocked(victim.get(), seq.ok() ? *seq : 0);
      victim->on_backing = false;
      if (victim->type == NodeType::kDir) checkpoints_->OnRemoved(to, seq.ok() ? *seq : 0);
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
    if (node->type == NodeType::kDir) {
      checkpoints_->OnRenamed(from, to, seq.ok() ? *seq : 0);
    } else if (store::IsCommitName(to) && node->write == nullptr && node->on_backing) {
      checkpoints_->OnCommitQueued(ParentOf(to));
    } else if (store::IsCommitName(to) && node->write) {
      checkpoints_->OnCommitQueued(ParentOf(to));
    }
  }
  return WaitIfStrict(seq);
}

// ---------------------------------------------------------------- files

Status Filesystem::BeginWriteLocked(Node* node, bool truncate, const UniqueFd* src) {
  uint64_t id = journal_->NextFileId();
  auto ws = std::make_unique<WriteState>();
  ws->file_id = id;
  ws->temp_name = std::string(kTempPrefix) + std::to_string(id);
  // Temp files live at the backing root, not beside their name: the name's directory
  // may itself still be a pending mkdir, and a root temp never moves with renames.
  ws->temp_dir = root_.get();
  const std::string temp_path = TempPathLocked(*ws);
  CKPT_RETURN_IF_ERROR(journal_->RegisterTemp(id, temp_path));
  auto fd = backing_->OpenFile(temp_path, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (!fd.ok()) {
    (void)journal_->ForgetTemp(id);
    return fd.status();
  }
  // The file's owner and exact mode (the daemon's umask must not change it), from the
  // start: the temp file counts against its owner's quota, and is published as it is.
  if (Status owned = OwnTempLocked(node, fd->get()); !owned.ok()) {
    ::unlinkat(backing_->root_fd(), temp_path.c_str(), 0);
    (void)journal_->ForgetTemp(id);
    return owned;
  }
  uint64_t size = 0;
  if (!truncate) {
    // Copy-on-write: the real name keeps its old bytes until the new ones are published.
    std::shared_ptr<StagedFile> prev = node->write ? node->write->staged : nullptr;
    UniqueFd opened;
    int src_fd = -1;
    if (prev) {
      // The new version starts as a copy of the previous one, so all of its bytes must
      // be in its temp file.
      Status settled = prev->target()->Settled();
      if (!settled.ok()) {
        ::unlinkat(backing_->root_fd(), temp_path.c_str(), 0);
        (void)journal_->ForgetTemp(id);
        return settled;
      }
      src_fd = prev->target()->fd();
      size = prev->size();
    } else if (src != nullptr || node->on_backing) {
      if (src == nullptr) {
        auto by_path = backing_->OpenFile(PathLocked(node), O_RDONLY);
        if (!by_path.ok()) {
          ::unlinkat(backing_->root_fd(), temp_path.c_str(), 0);
          (void)journal_->ForgetTemp(id);
          return by_path.status();
        }
        opened = std::move(*by_path);
        src = &opened;
      }
      src_fd = src->get();
      struct stat st;
      if (::fstat(src_fd, &st) != 0) return Status::FromErrno(errno, "fstat");
      size = static_cast<uint64_t>(st.st_size);
    }
    // copy_file_range shares extents where the file system can (XFS and btrfs reflink):
    // then a one-byte rewrite of a large file writes one block, not the file.
    loff_t in = 0, out = 0;
    uint64_t left = size;
    while (left > 0) {
      ssize_t n = ::copy_file_range(src_fd, &in, fd->get(), &out, left, 0);
      if (n <= 0) {
        Status st = Status::FromErrno(n < 0 ? errno : EIO, "copy for rewrite");
        ::unlinkat(backing_->root_fd(), temp_path.c_str(), 0);
        (void)journal_->ForgetTemp(id);
        return st;
      }
      left -= static_cast<uint64_t>(n);
    }
  }
  auto target = std::make_shared<store::FlushTarget>(id, std::move(*fd));
  ws->staged = std::make_shared<StagedFile>(staging_ctx_, std::move(target), size);
  {
    std::lock_guard lock(staged_mu_);
    live_staged_.insert(ws->staged);
  }
  if (node->write) ws->publish_seq = node->write->publish_seq;
  node->write = std::move(ws);
  node->attr.st_mtim = node->attr.st_ctim = Now();
  return Status::Ok();
}

Result<uint64_t> Filesystem::DiscardLocked(Node* node, const std::string& path) {
  store::JournalEntry d;
  d.op = store::OpType::kDiscard;
  d.from = TempPathLocked(*node->write);
  d.path = path;
  d.file_id = node->write->file_id;
  node->write->needs_publish = false;
  node->write->discarded = true;
  return AppendLocked(std::move(d), node);
}

void Filesystem::DropWriteStateLocked(Node* node) {
  // The cached attributes must describe the published file: with pending entries around
  // it they are served as they are, without asking the backing store.
  node->attr.st_size = static_cast<off_t>(node->write->staged->size());
  node->write.reset();
  RefreshAttrLocked(node);
}

Status Filesystem::EnsureWritableLocked(Node* node, bool truncate, const UniqueFd* src) {
  if (!node->write || !node->write->needs_publish) {
    CKPT_RETURN_IF_ERROR(BeginWriteLocked(node, truncate, src));
  }
  node->write->needs_publish = true;
  return Status::Ok();
}

Result<uint64_t> Filesystem::PublishLocked(Node* node) {
  WriteState& ws = *node->write;
  auto target = ws.staged->SealAll();
  store::JournalEntry e;
  e.op = store::OpType::kPublish;
  e.path = PathLocked(node);
  e.from = TempPathLocked(ws);
  e.file_id = ws.file_id;
  e.size = ws.staged->size();
  e.target = target;
  // The published file keeps the times the mount showed (its last write, or a utimens),
  // not those of the flushes.
  e.atime_sec = node->attr.st_atim.tv_sec, e.atime_nsec = node->attr.st_atim.tv_nsec;
  e.mtime_sec = node->attr.st_mtim.tv_sec, e.mtime_nsec = node->attr.st_mtim.tv_nsec;
  const std::string dir = ParentOf(e.path);
  const bool commit = store::IsCommitName(e.path);
  const uint64_t size = e.size;
  publishing_[ws.file_id] = inodes_[node->ino];
  CKPT_ASSIGN_OR_RETURN(uint64_t seq, AppendLocked(std::move(e), node));
  ws.publish_seq = seq;
  ws.needs_publish = false;
  node->on_backing = true;
  checkpoints_->OnFileQueued(dir, size);
  if (commit) checkpoints_->OnCommitQueued(dir);
  return seq;
}

Result<std::pair<Entry, Handle*>> Filesystem::Create(uint64_t parent, const std::string& name,
                                                     mode_t mode, int flags,
                                                     const Caller& caller) {
  CKPT_RETURN_IF_ERROR(CheckName(name));
  if (IsTempName(name) || (parent == kRootIno && name == kCtlDirName)) {
    return Status(Code::kPermission, "reserved name " + name);
  }
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(parent));
  uint64_t existing = 0;
  {
    std::lock_guard lock(ns_mu_);
    auto dir = NodeLocked(parent);
    if (!dir || dir->type != NodeType::kDir) return Status(Code::kNotDir, name);
    CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(dir.get()));
    std::shared_ptr<Node> node = ChildLocked(dir.get(), name);
    if (node) {
      if (flags & O_EXCL) return Status(Code::kExists, name);
      if (node->type == NodeType::kDir) return Status(Code::kIsDir, name);
      existing = node->ino;
    } else {
      const NewOwner owner = OwnerOfNew(caller, dir->attr, S_IFREG, mode);
      node = NewNodeLocked(dir.get(), name, NodeType::kFile);
      node->attr.st_mode = S_IFREG | owner.mode;
      node->attr.st_uid = owner.uid;
      node->attr.st_gid = owner.gid;
      node->attr.st_atim = node->attr.st_mtim = node->attr.st_ctim = Now();
      Status st = BeginWriteLocked(node.get(), /*truncate=*/true);
      if (!st.ok()) {
        DetachLocked(node);
        return st;
      }
      TouchDirLocked(dir.get(), 0);
      {
        std::lock_guard dropped_lock(dropped_mu_);
        if (!dropped_paths_.empty()) dropped_paths_.erase(PathLocked(node.get()));
      }
      if (store::CheckpointRegistry::IsCheckpointFile(name)) {
        checkpoints_->OnFileCreated(PathLocked(dir.get()));
      }
      auto handle = std::make_unique<Handle>();
      handle->node = node;
      handle->writable = (flags & O_ACCMODE) != O_RDONLY;  // O_RDONLY|O_CREAT makes it empty
      handle->staged = node->write->staged;
      node->open_files++;
      if (handle->writable) node->open_writers++;
      Entry e = EntryLocked(node.get());
      return std::make_pair(e, handle.release());
    }
  }
  // An existing file: the same as open(2) without O_CREAT.
  CKPT_ASSIGN_OR_RETURN(Handle * handle, Open(existing, flags));
  std::lock_guard lock(ns_mu_);
  return std::make_pair(EntryLocked(handle->node.get()), handle);
}

Result<Handle*> Filesystem::Open(uint64_t ino, int flags) {
  Result<Handle*> h = OpenFile(ino, flags);
  if (!h.ok()) return LogIfIo("open", ino, 0, h.status());
  return h;
}

Result<Handle*> Filesystem::OpenFile(uint64_t ino, int flags) {
  auto handle = std::make_unique<Handle>();
  if (TensorView::Owns(ino)) {
    if ((flags & O_ACCMODE) != O_RDONLY) return Status(Code::kPermission, "tensor view");
    CKPT_RETURN_IF_ERROR(tensors_->Open(ino, &handle->content, &handle->view_fd,
                                        &handle->view_base, &handle->view_size));
    return handle.release();
  }
  if (ino >= kCtlStatsIno && ino <= kCtlMetricsIno) {
    if ((flags & O_ACCMODE) != O_RDONLY) return Status(Code::kPermission, "control file");
    handle->content = ino == kCtlStatsIno         ? StatsJson()
                      : ino == kCtlCheckpointsIno ? CheckpointsJson()
                                                  : MetricsText();
    return handle.release();
  }
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(ino));
  std::unique_lock lock(ns_mu_);
  auto node = NodeLocked(ino);
  if (!node) return NotFound("stale inode");
  // Its staged bytes may have been published since the wait above: then the backing
  // path must be current before it is opened (a rename may still be pending).
  while (!node->write && node->on_backing) {
    const uint64_t seq = PendingRenameLocked(node.get());
    if (seq == 0) break;
    lock.unlock();
    Status st = journal_->WaitUnlessHalted(seq);  // the outcome belongs to its entry...
    if (!st.ok() && journal_->halted()) return st;  // ...unless publication is halted
    lock.lock();
  }
  if (node->type == NodeType::kDir) return Status(Code::kIsDir, "open of a directory");
  // The kernel serves FIFOs, sockets and devices itself; never block a thread on one.
  if (node->type == NodeType::kSpecial) return Status(Code::kInvalid, "open of a special file");
  if (!node->error.empty()) return Status(Code::kIo, node->error);
  if (!node->write && node->parent == nullptr) return NotFound("unlinked file");
  handle->node = node;
  const bool writable = (flags & O_ACCMODE) != O_RDONLY;
  if (writable && node->attr.st_nlink > 1 && node->type == NodeType::kFile) {
    return Status(Code::kTooManyLinks, "a file with several hard links cannot be rewritten");
  }
  if (writable && (flags & O_TRUNC)) {
    CKPT_RETURN_IF_ERROR(EnsureWritableLocked(node.get(), /*truncate=*/true));
    CKPT_RETURN_IF_ERROR(node->write->staged->Truncate(0));
  }
  // Without O_TRUNC, opening for writing starts nothing: the first write does (Write).
  if (node->write) {
    handle->staged = node->write->staged;
  } else {
    CKPT_ASSIGN_OR_RETURN(UniqueFd fd, backing_->OpenFile(PathLocked(node.get()), O_RDONLY));
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) return Status::FromErrno(errno, "fstat");
    handle->key = store::FileKeyFromStat(st);
    handle->fd = std::make_shared<const UniqueFd>(std::move(fd));
    handle->keep_cache = !writable && TimeoutFor(*node) > kDefaultTimeout;
    if (node->parent != nullptr && CommittedDirLocked(node->parent)) {
      handle->ckpt = PathLocked(node->parent);
      handle->file = node->name;
      handle->indexed = index_->IsIndexed(handle->ckpt);
      // Reading `.metadata` is how every DCP load starts: fetch the checkpoint ahead.
      if (node->name == ".metadata" && cache_ && !writable) QueuePrefetch(handle->ckpt);
    }
  }
  handle->writable = writable;
  node->open_files++;
  if (writable) node->open_writers++;
  return handle.release();
}

Result<std::shared_ptr<StagedFile>> Filesystem::WritableStaged(Handle* h) {
  std::lock_guard lock(ns_mu_);
  Node* node = h->node.get();
  if (!node->error.empty()) return Status(Code::kIo, node->error);
  if (node->write && node->write->discarded) {
    h->staged = node->write->staged;  // unlinked: keeps its bytes, never published
    return h->staged;
  }
  // Not yet written through this mount, or its previous contents are queued for
  // publication and frozen: continue in a copy, published again later. With no write
  // state, `h->fd` is the current version (a write state lives while any handle is open).
  CKPT_RETURN_IF_ERROR(EnsureWritableLocked(node, false, node->write ? nullptr : h->fd.get()));
  if (node->parent == nullptr) {
    // Unlinked after its last publication: the copy lives on, unnamed, until closed.
    CKPT_RETURN_IF_ERROR(DiscardLocked(node, "").status());
  }
  h->staged = node->write->staged;
  return h->staged;
}

Status Filesystem::LogIfIo(const char* op, uint64_t ino, uint64_t offset, Status st) {
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
    std::lock_guard lock(ns_mu_);
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

Status Filesystem::Write(Handle* h, const char* data, size_t len, uint64_t offset) {
  return LogIfIo("write", h->node ? h->node->ino : 0, offset, WriteData(h, data, len, offset));
}

Status Filesystem::WriteData(Handle* h, const char* data, size_t len, uint64_t offset) {
  if (!h->writable) return Status(Code::kPermission, "not open for writing");
  std::shared_ptr<StagedFile> staged = h->staged;
  for (int attempt = 0;; ++attempt) {
    bool fresh;
    {
      std::lock_guard lock(ns_mu_);
      Node* node = h->node.get();
      fresh = staged && node->write && node->write->staged == staged &&
              (node->write->needs_publish || node->write->discarded);
      node->attr.st_mtim = node->attr.st_ctim = Now();
    }
    if (!fresh) {
      CKPT_ASSIGN_OR_RETURN(staged, WritableStaged(h));
    }
    Status st = staged->Write(data, len, offset);
    if (st.code() == Code::kAborted && attempt < 3) continue;  // frozen by a publish
    if (!st.ok()) {
      NoteError("write " + std::to_string(h->node->ino) + ": " + st.ToString());
      return st;
    }
    bytes_written_.fetch_add(len, std::memory_order_relaxed);
    return Status::Ok();
  }
}

Result<size_t> Filesystem::Read(Handle* h, char* out, size_t len, uint64_t offset) {
  Result<size_t> got = ReadData(h, out, len, offset);
  if (!got.ok()) return LogIfIo("read", h->node ? h->node->ino : 0, offset, got.status());
  return got;
}

Result<size_t> Filesystem::ReadData(Handle* h, char* out, size_t len, uint64_t offset) {
  if (h->view_fd) {  // a tensor-view chunk: a window of a backing file
    if (offset >= h->view_size) return size_t{0};
    size_t n = static_cast<size_t>(std::min<uint64_t>(len, h->view_size - offset));
    CKPT_ASSIGN_OR_RETURN(size_t got, backing_->PRead(h->view_fd->get(), out, n,
                                                      static_cast<off_t>(h->view_base + offset)));
    if (got < n) {
      // The index says these bytes exist; a short shard file must not pass as a short tensor.
      return Status(Code::kIo, "tensor chunk extends past the end of its shard file");
    }

    bytes_read_.fetch_add(got, std::memory_order_relaxed);
    return got;
  }
  if (!h->node) {  // control file or meta.json
    if (offset >= h->content.size()) return size_t{0};
    size_t n = std::min<size_t>(len, h->content.size() - offset);
    std::memcpy(out, h->content.data() + offset, n);
    return n;
  }
  std::shared_ptr<StagedFile> staged;
  {
    std::lock_guard lock(ns_mu_);
    if (!h->node->error.empty()) return Status(Code::kIo, h->node->error);
    if (h->node->write) staged = h->node->write->staged;
  }
  Result<size_t> got = size_t{0};
  if (staged) {
    got = staged->Read(out, len, offset);
  } else if (!h->fd) {
    // Opened while the file was being written: its write state lives until this handle
    // is closed (Release), so this is a broken invariant, not a backing-store error.
    return Status(Code::kInternal, "handle lost its data source (write state dropped early)");
  } else if (cache_) {
    // The file's identity now, not at open: someone may have rewritten it in place.
    struct stat st;
    if (::fstat(h->fd->get(), &st) != 0) return Status::FromErrno(errno, "fstat");
    store::FileKey key = store::FileKeyFromStat(st);
    if (!h->ckpt.empty()) PrefetchItem(h, offset);
    got = cache_->Read(key, h->fd, out, len, offset);
    if (got.ok() && h->indexed) read_sums_->OnRead(h->ckpt, h->file, key, offset, out, *got);
  } else {
    got = backing_->PRead(h->fd->get(), out, len, static_cast<off_t>(offset));
  }
  if (got.ok()) bytes_read_.fetch_add(*got, std::memory_order_relaxed);
  return got;
}

Status Filesystem::Flush(Handle* h) {
  return LogIfIo("flush", h->node ? h->node->ino : 0, 0, FlushData(h));
}

Status Filesystem::FlushData(Handle* h) {
  if (!h->node || !h->writable) return Status::Ok();
  Result<uint64_t> seq = uint64_t{0};
  {
    std::lock_guard lock(ns_mu_);
    Node* node = h->node.get();
    if (!node->error.empty()) return Status(Code::kIo, node->error);
    if (!node->write) return Status::Ok();
    CKPT_RETURN_IF_ERROR(node->write->staged->error());
    if (!config_.strict) return Status::Ok();
    if (node->write->needs_publish && node->parent != nullptr) seq = PublishLocked(node);
    else seq = node->write->publish_seq;
  }
  return WaitIfStrict(seq);
}

Status Filesystem::Fsync(Handle* h) { return Flush(h); }

void Filesystem::Release(Handle* h) {
  std::unique_ptr<Handle> owned(h);
  if (!h->node) return;
  std::lock_guard lock(ns_mu_);
  Node* node = h->node.get();
  node->open_files--;
  if (h->writable) node->open_writers--;
  if (node->write) {
    WriteState& ws = *node->write;
    // The last writer publishes (a file made by O_RDONLY|O_CREAT: its only handle).
    if (node->open_writers == 0 && ws.needs_publish && node->parent != nullptr) {
      auto seq = PublishLocked(node);
      if (!seq.ok()) NoteError("publish " + PathLocked(node) + ": " + seq.status().ToString());
    }
    if (node->open_files == 0 && !ws.needs_publish && ws.publish_seq <= journal_->applied() &&
        publishing_.count(ws.file_id) == 0) {
      DropWriteStateLocked(node);  // fully published: the backing file is the truth again
    }
  }
  if (node->parent == nullptr && node->nlookup == 0 && node->open_files == 0) {
    inodes_.erase(node->ino);
  }
}

Result<Handle*> Filesystem::OpenDir(uint64_t ino) {
  auto handle = std::make_unique<Handle>();
  if (TensorView::Owns(ino)) {
    CKPT_ASSIGN_OR_RETURN(auto list, tensors_->List(ino));
    handle->entries = {{".", ino, S_IFDIR}, {"..", kCtlDirIno, S_IFDIR}};
    for (auto& e : list) handle->entries.push_back({e.name, e.ino, e.type});
    return handle.release();
  }
  if (ino == kCtlDirIno) {
    handle->entries = {{".", kCtlDirIno, S_IFDIR}, {"..", kRootIno, S_IFDIR},
                       {"tensors", TensorView::kRootIno, S_IFDIR},
                       {"stats", kCtlStatsIno, S_IFREG},
                       {"checkpoints", kCtlCheckpointsIno, S_IFREG},
                       {"metrics", kCtlMetricsIno, S_IFREG}};
    return handle.release();
  }
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(ino));
  std::lock_guard lock(ns_mu_);
  auto node = NodeLocked(ino);
  if (!node) return NotFound("stale inode");
  if (node->type != NodeType::kDir) return Status(Code::kNotDir, "opendir");
  CKPT_RETURN_IF_ERROR(EnsureLoadedLocked(node.get()));
  // Pick up names other writers created on the backing store since the load.
  if (node->on_backing && QuiescentLocked(node.get())) {
    auto listed = backing_->List(PathLocked(node.get()));
    if (listed.ok()) {
      for (const auto& e : *listed) {
        if (!node->children.count(e.name) && !IsTempName(e.name) &&
            !(ino == kRootIno && e.name == kCtlDirName)) {
          ChildLocked(node.get(), e.name);
        }
      }
    }
  }
  handle->node = node;
  handle->entries.push_back({".", ino, S_IFDIR});
  handle->entries.push_back({"..", node->parent ? node->parent->ino : kRootIno, S_IFDIR});
  if (ino == kRootIno) handle->entries.push_back({kCtlDirName, kCtlDirIno, S_IFDIR});
  for (const auto& [name, child] : node->children) {
    handle->entries.push_back({name, child->ino, child->attr.st_mode & S_IFMT});
  }
  return handle.release();
}

void Filesystem::ReleaseDir(Handle* h) { delete h; }

Result<struct statvfs> Filesystem::StatFs() { return backing_->StatFs(); }

// ---------------------------------------------------------------- journal callbacks

bool Filesystem::WrittenLocally(const std::string& path) {
  std::lock_guard lock(ns_mu_);
  // Only the in-memory tree: a name this mount never loaded was not written through it.
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
  return node != nullptr && node->write && node->write->needs_publish;
}

void Filesystem::OnJournalHalt(const store::JournalEntry& e, const Status& st) {
  const std::string dir = ParentOf(e.path);
  if (st.ok()) {
    checkpoints_->OnResumed(dir);
  } else {
    NoteError("publication halted at " + e.Describe() + ": " + st.ToString());
    checkpoints_->OnFailed(dir, st.ToString());
  }
  if (e.op != store::OpType::kPublish) return;
  std::lock_guard lock(ns_mu_);
  auto it = publishing_.find(e.file_id);
  if (it != publishing_.end()) {
    it->second->halt_error = st.ok() ? "" : st.ToString();
    it->second->halt_transient = store::IsTransient(st);
  }
}

void Filesystem::OnJournalDone(const store::JournalEntry& e, const Status& st) {
  const std::string dir = ParentOf(e.path);
  const bool commit = (e.op == store::OpType::kPublish || e.op == store::OpType::kRename) &&
                      store::IsCommitName(e.path);
  if (e.op == store::OpType::kPublish && st.ok()) {
    if (e.atime_sec || e.atime_nsec || e.mtime_sec || e.mtime_nsec) {
      struct timespec ts[2] = {{e.atime_sec, e.atime_nsec}, {e.mtime_sec, e.mtime_nsec}};
      (void)backing_->Utimens(e.path, ts);
    }
    bytes_published_.fetch_add(e.size);
    files_published_.fetch_add(1);
    checkpoints_->OnFilePublished(dir, e.size, e.seq);
    HandOverBlockCrcs(e);
  }
  if (!st.ok()) {
    NoteError(e.Describe() + ": " + st.ToString());
    if (e.op == store::OpType::kPublish || commit) {
      if (st.code() == Code::kAborted) {
        checkpoints_->OnAborted(dir, st.ToString());
      } else {
        checkpoints_->OnFailed(dir, st.ToString(), e.seq);
      }
    }
  } else if (commit) {
    checkpoints_->OnCommitted(dir, e.seq);
    QueueIndexBuild(dir);
  }
  // Entries can be applied ahead of a waiting commit: only the journal knows the prefix.
  checkpoints_->OnApplied(journal_->applied());
  if (st.ok() && e.op == store::OpType::kRename) index_->OnRenamed(e.from, e.path);
  if (st.ok() && e.op == store::OpType::kRmdir) index_->Forget(e.path);
  if (e.op != store::OpType::kPublish) return;
  std::lock_guard lock(ns_mu_);
  auto it = publishing_.find(e.file_id);
  if (it == publishing_.end()) return;
  std::shared_ptr<Node> node = it->second;
  publishing_.erase(it);
  if (st.ok()) node->halt_error.clear();  // published after retries
  if (!st.ok()) {
    node->error = "publication failed: " + st.ToString();
    node->on_backing = false;
  }
  if (node->write && node->write->file_id == e.file_id && node->open_files == 0 &&
      !node->write->needs_publish) {
    DropWriteStateLocked(node.get());
  }
  if (node->parent == nullptr && node->nlookup == 0 && !node->write) inodes_.erase(node->ino);
}

void Filesystem::ForgetVanishedCheckpoints() {
  const uint64_t last = journal_->last_appended();
  if (journal_->applied() < last) return;
  // A removal counts only if no entry was queued meanwhile (a rename moves the record
  // before the backing store).
  auto gone = [&](const std::string& path) {
    Result<struct stat> st = backing_->Stat(path);
    return !st.ok() && st.status().code() == Code::kNotFound && journal_->last_appended() == last;
  };
  for (const auto& info : checkpoints_->List()) {
    if (info.state == store::CkptState::kWriting || info.state == store::CkptState::kPending) {
      continue;
    }
    if (gone(info.path)) {
      spdlog::info("checkpoint {}: gone from the backing store", info.path);
      checkpoints_->OnRemoved(info.path);
      index_->Forget(info.path);
    }
  }
  for (const auto& path : index_->IndexedCheckpoints()) {
    if (!checkpoints_->Get(path) && gone(JoinPath(path, ".metadata"))) index_->Forget(path);
  }
}

void Filesystem::HandOverBlockCrcs(const store::JournalEntry& e) {
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

void Filesystem::RelieveStagingPressure() {
  std::vector<std::shared_ptr<StagedFile>> files;
  {
    std::lock_guard lock(staged_mu_);
    for (auto it = live_staged_.begin(); it != live_staged_.end();) {
      if (auto f = it->lock()) {
        files.push_back(std::move(f));
        ++it;
      } else {
        it = live_staged_.erase(it);
      }
    }
  }
  for (auto& f : files) f->SealIfIdle();
}

uint64_t Filesystem::Shutdown() {
  if (shut_down_.exchange(true)) return 0;
  if (!journal_ || !pipeline_) {  // Create() failed part way: nothing was served
    {
      std::lock_guard lock(index_mu_);
      index_stop_ = true;
    }
    index_cv_.notify_all();
    if (indexer_.joinable()) indexer_.join();
    return 0;
  }
  uint64_t unpublished = 0;
  {
    std::lock_guard lock(ns_mu_);
    // Files still open (a lazy unmount) are published as they are now (G8).
    for (auto& [ino, node] : inodes_) {
      if (node->write && node->write->needs_publish && node->parent != nullptr) {
        auto seq = PublishLocked(node.get());
        if (!seq.ok()) ++unpublished;
      }
    }
  }
  spdlog::info("draining: {} journal entries pending", journal_->pending());
  // A halted journal gets one more attempt; then the failed entry and everything after it
  // are dropped, never applied (G4), and the bytes parked for a retry are let go.
  unpublished += journal_->Close();
  pipeline_->DropParked(Status(Code::kAborted, "daemon stopped before the retry passed"));
  pipeline_->Drain();
  unpublished += journal_->skipped();
  spdlog::info("drained: {} files published, {} not published", files_published_.load(),
               unpublished);
  {
    std::lock_guard lock(index_mu_);
    index_stop_ = true;
  }
  index_cv_.notify_all();
  if (indexer_.joinable()) indexer_.join();
  return unpublished;
}

void Filesystem::QueueIndexBuild(const std::string& ckpt) {
  {
    std::lock_guard lock(index_mu_);
    index_queue_.push_back(ckpt);
  }
  index_cv_.notify_one();
}

void Filesystem::QueuePrefetch(const std::string& ckpt) {
  {
    std::lock_guard lock(index_mu_);
    for (const auto& queued : prefetch_queue_) {
      if (queued == ckpt) return;
    }
    prefetch_queue_.push_back(ckpt);
  }
  index_cv_.notify_one();
}

void Filesystem::PrefetchCheckpoint(const std::string& ckpt) {
  // Straight from `.metadata`: building the index here would read every item's header
  // outside the cache, before the data itself.
  auto md_fd = backing_->OpenFile(JoinPath(ckpt, ".metadata"), O_RDONLY);
  if (!md_fd.ok()) return;
  struct stat md_st;
  if (::fstat(md_fd->get(), &md_st) != 0) return;
  std::string bytes(static_cast<size_t>(md_st.st_size), '\0');
  auto got = backing_->PRead(md_fd->get(), bytes.data(), bytes.size(), 0);
  if (!got.ok()) return;
  bytes.resize(*got);
  auto md = store::ParseDcpMetadata(bytes);
  if (!md.ok()) {
    spdlog::debug("prefetch of {}: {}", ckpt, md.status().ToString());
    return;
  }
  size_t files = 0;
  for (const auto& [file, length] : store::RequiredFileLengths(*md)) {
    auto fd = backing_->OpenFile(JoinPath(ckpt, file), O_RDONLY);
    if (!fd.ok()) continue;
    struct stat st;
    if (::fstat(fd->get(), &st) != 0) continue;
    auto shared = std::make_shared<const UniqueFd>(std::move(*fd));
    cache_->Prefetch(store::FileKeyFromStat(st), shared, 0,
                     std::min<uint64_t>(length, static_cast<uint64_t>(st.st_size)));
    ++files;
  }
  spdlog::debug("prefetch of {}: {} files queued", ckpt, files);
}

void Filesystem::PrefetchItem(Handle* h, uint64_t offset) {
  if (!h->indexed) return;  // never build an index inside a read
  if (offset < h->prefetched_end.load(std::memory_order_relaxed)) return;
  auto item = index_->Locate(h->ckpt, h->file, offset);
  if (!item || item->offset + item->length <= offset) return;
  const uint64_t end = item->offset + item->length;
  if (h->prefetched_end.exchange(end) >= end) return;  // another read got there first
  uint64_t from = offset + cache_->block_bytes();
  if (from < end) cache_->Prefetch(h->key, h->fd, from, end - from);
}

void Filesystem::RunIndexer() {
  while (true) {
    std::string ckpt;
    {
      std::unique_lock lock(index_mu_);
      index_cv_.wait(lock, [&] {
        return index_stop_ || !index_queue_.empty() || !prefetch_queue_.empty();
      });
      if (index_stop_) return;  // a later look builds lazily; the index is a cache
      if (!prefetch_queue_.empty()) {
        ckpt = std::move(prefetch_queue_.front());
        prefetch_queue_.pop_front();
        lock.unlock();
        PrefetchCheckpoint(ckpt);
        continue;
      }
      ckpt = std::move(index_queue_.front());
      index_queue_.pop_front();
    }
    auto started = std::chrono::steady_clock::now();
    Status st = index_->Build(ckpt, /*checksums=*/true);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (st.ok()) {
      spdlog::info("checkpoint {}: indexed in {:.3f} s", ckpt, secs);
    } else {
      spdlog::warn("checkpoint {}: index error: {}", ckpt, st.ToString());
    }
  }
}

}  // namespace ckptfs::fs
