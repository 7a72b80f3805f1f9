#include "store/memory/memory_tier.h"

#include <spdlog/spdlog.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <ctime>

#include "common/path.h"
#include "store/dcp/commit_names.h"
#include "store/dcp/dcp_metadata.h"
#include "store/memory/memory_tier_node.h"

namespace ckptfs::store {
namespace {

struct timespec Now() {
  struct timespec ts {};
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts;
}

uint64_t NowNs() {
  const struct timespec ts = Now();
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace

// What a tracker file may say about checkpoint directory `name`: its name, or for
// Megatron's `iter_NNNNNNN` directories the iteration number.
bool NamesCheckpoint(std::string content, const std::string& name) {
  while (!content.empty() && (content.back() == '\n' || content.back() == ' ' ||
                              content.back() == '\r' || content.back() == '\t')) {
    content.pop_back();
  }
  if (content.empty()) return false;
  if (content == name || path::Basename(content) == std::string_view(name)) return true;
  if (name.rfind("iter_", 0) == 0 && content.find_first_not_of("0123456789") == std::string::npos &&
      content.size() < 19) {
    const std::string digits = name.substr(5);
    if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos) {
      return std::stoull(digits) == std::stoull(content);
    }
  }
  return false;
}

MemoryTier::MemoryTier(const MemoryTierOptions& options) : opts_(options) {
  MutexLock lock(&mu_);
  stats_.budget_bytes = opts_.budget_bytes;
}

MemoryTier::~MemoryTier() = default;

MemoryTier::Node* MemoryTier::NodeLocked(uint64_t id) const {
  auto it = nodes_.find(id);
  return it == nodes_.end() ? nullptr : it->second.get();
}

Result<MemoryTier::Node*> MemoryTier::DirLocked(uint64_t id) const {
  Node* n = NodeLocked(id);
  if (n == nullptr) return NotFound("memory-only directory is gone");
  if (!n->dir) return Status(Code::kNotDir, n->name);
  return n;
}

uint64_t MemoryTier::TreeRoot(uint64_t key, const std::string& path) {
  MutexLock lock(&mu_);
  auto it = trees_.find(key);
  if (it != trees_.end()) {
    Node* root = NodeLocked(it->second);
    if (root != nullptr && !path.empty()) root->tree_path = path;
    return it->second;
  }
  if (Node* restored = path.empty() ? nullptr : TreeByPathLocked(path);
      restored != nullptr && (restored->tree & kProvisionalTree) != 0) {
    // A tree a restore made before the view looked at its marked directory: it is that one.
    const uint64_t old_key = restored->tree;
    for (auto& [id, n] : nodes_) {
      if (n->tree == old_key) n->tree = key;
    }
    trees_.erase(old_key);
    trees_.emplace(key, restored->id);
    return restored->id;
  }
  auto root = std::make_unique<Node>();
  root->id = next_id_++;
  root->tree = key;
  root->dir = true;
  root->tree_path = path;
  root->mode = 0755;
  root->mtime = root->ctime = Now();
  const uint64_t id = root->id;
  nodes_.emplace(id, std::move(root));
  trees_.emplace(key, id);
  stats_.trees = trees_.size();
  return id;
}

bool MemoryTier::TreeEmpty(uint64_t key) const {
  MutexLock lock(&mu_);
  auto it = trees_.find(key);
  if (it == trees_.end()) return true;
  const Node* root = NodeLocked(it->second);
  return root == nullptr || root->children.empty();
}

void MemoryTier::DropTree(uint64_t key) {
  MutexLock lock(&mu_);
  auto it = trees_.find(key);
  if (it == trees_.end()) return;
  if (Node* root = NodeLocked(it->second)) RemoveLocked(root);
  trees_.erase(it);
  stats_.trees = trees_.size();
}

MemoryTier::Node* MemoryTier::NewNodeLocked(Node* parent, std::string_view name, bool dir,
                                            mode_t mode, uid_t uid, gid_t gid) {
  auto n = std::make_unique<Node>();
  n->id = next_id_++;
  n->tree = parent->tree;
  n->parent = parent;
  n->name = std::string(name);
  n->dir = dir;
  n->mode = mode & 07777;
  n->uid = uid;
  n->gid = gid;
  n->mtime = n->ctime = Now();
  Node* raw = n.get();
  nodes_.emplace(raw->id, std::move(n));
  parent->children.emplace(raw->name, raw);
  parent->mtime = parent->ctime = raw->mtime;
  return raw;
}

void MemoryTier::RemoveLocked(Node* n) {
  std::vector<Node*> below;
  for (const auto& [name, c] : n->children) below.push_back(c);
  for (Node* c : below) RemoveLocked(c);
  used_ -= std::min<uint64_t>(used_, n->blocks.size() * opts_.block_bytes);
  if (n->parent != nullptr) {
    n->parent->children.erase(n->name);
    n->parent->mtime = n->parent->ctime = Now();
  }
  nodes_.erase(n->id);  // blocks a reader still copies from live on with it
}

Result<MemAttr> MemoryTier::Lookup(uint64_t dir, std::string_view name) const {
  MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(Node * d, DirLocked(dir));
  auto it = d->children.find(name);
  if (it == d->children.end()) return NotFound(std::string(name));
  return AttrOf(*it->second);
}

Result<MemAttr> MemoryTier::GetAttr(uint64_t id) const {
  MutexLock lock(&mu_);
  const Node* n = NodeLocked(id);
  if (n == nullptr) return NotFound("memory-only node is gone");
  return AttrOf(*n);
}

void MemoryTier::ResizeLocked(Node* n, uint64_t size) {
  const uint64_t bs = opts_.block_bytes;
  for (auto it = n->blocks.lower_bound((size + bs - 1) / bs); it != n->blocks.end();) {
    it = n->blocks.erase(it);
    used_ -= std::min<uint64_t>(used_, bs);
  }
  if (size < n->size && size % bs != 0) {
    // The kept part of the last block: zero past the new end, so a later extension reads
    // zeros there.
    auto last = n->blocks.find(size / bs);
    if (last != n->blocks.end()) {
      std::memset(last->second->p + size % bs, 0, bs - size % bs);
    }
  }
  n->size = size;
}

Result<MemAttr> MemoryTier::SetAttr(uint64_t id, const Change& change) {
  MutexLock lock(&mu_);
  Node* n = NodeLocked(id);
  if (n == nullptr) return NotFound("memory-only node is gone");
  if (change.size != nullptr) {
    if (n->dir) return Status(Code::kIsDir, n->name);
    if (n->remote) return Status(Code::kNotPermitted, n->name + " was written by another node");
    ResizeLocked(n, *change.size);
    n->mtime = Now();
  }
  if (change.mode != nullptr) n->mode = *change.mode & 07777;
  if (change.uid != nullptr) n->uid = *change.uid;
  if (change.gid != nullptr) n->gid = *change.gid;
  if (change.mtime != nullptr) n->mtime = *change.mtime;
  n->ctime = Now();
  return AttrOf(*n);
}

Result<MemAttr> MemoryTier::Mkdir(uint64_t dir, std::string_view name, mode_t mode, uid_t uid,
                                  gid_t gid) {
  MemAttr a;
  std::string tree, path;
  MemoryReplication* mirror = nullptr;
  {
    MutexLock lock(&mu_);
    CKPT_ASSIGN_OR_RETURN(Node * d, DirLocked(dir));
    if (d->children.count(name) > 0) return Status(Code::kExists, std::string(name));
    Node* n = NewNodeLocked(d, name, true, mode, uid, gid);
    a = AttrOf(*n);
    if (replication_ != nullptr) {
      mirror = replication_;
      ++calls_out_;
      tree = RootOf(n)->tree_path;
      path = TreePathOf(*n);
    }
  }
  if (mirror != nullptr) {
    // With peers the other nodes make it too, before this returns: DCP's coordinator makes
    // the checkpoint directory, then ranks on other nodes create their shards in it.
    CallOut out(this);
    mirror->MirrorDir(tree, path);
  }
  return a;
}

Result<MemAttr> MemoryTier::Create(uint64_t dir, std::string_view name, mode_t mode, uid_t uid,
                                   gid_t gid, bool exclusive) {
  MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(Node * d, DirLocked(dir));
  if (auto it = d->children.find(name); it != d->children.end()) {
    if (exclusive) return Status(Code::kExists, std::string(name));
    if (it->second->dir) return Status(Code::kIsDir, std::string(name));
    return AttrOf(*it->second);
  }
  return AttrOf(*NewNodeLocked(d, name, false, mode, uid, gid));
}

Status MemoryTier::Write(uint64_t id, uint64_t offset, size_t len, const Fill& fill) {
  if (len == 0) return Status::Ok();
  const uint64_t bs = opts_.block_bytes;
  const uint64_t end = offset + len;
  std::vector<std::shared_ptr<Block>> blocks;
  {
    MutexLock lock(&mu_);
    Node* n = NodeLocked(id);
    if (n == nullptr) return NotFound("memory-only file is gone");
    if (n->dir) return Status(Code::kIsDir, n->name);
    if (n->remote) return Status(Code::kNotPermitted, n->name + " was written by another node");
    uint64_t missing = 0;
    for (uint64_t i = offset / bs; i * bs < end; ++i) missing += n->blocks.count(i) == 0;
    if (used_ + missing * bs > opts_.budget_bytes) {
      // A save that needs room drops the older checkpoints of its tree that still wait for
      // a replica (replicating, or no peer took it), oldest first: this newer save
      // supersedes them, as its commit would. The newest committed one is never dropped,
      // so the tree always has one to load while this one is written and replicated.
      // Saves faster than replication thus keep the newest instead of failing.
      std::vector<Node*> waiting;
      for (const auto& [other_id, m] : nodes_) {
        if (m->tree == n->tree && m->dir && m->committed == 0 &&
            (m->replicating || m->unreplicated)) {
          waiting.push_back(m.get());
        }
      }
      std::sort(waiting.begin(), waiting.end(),
                [](const Node* a, const Node* b) { return a->seq < b->seq; });
      for (Node* old : waiting) {
        if (used_ + missing * bs <= opts_.budget_bytes) break;
        if (DropOlderLocked(old, n, "dropped for room (not replicated yet) by the newer save of")) {
          ++stats_.superseded_for_room;
        }
      }
    }
    if (used_ + missing * bs > opts_.budget_bytes) {
      ++stats_.nospace_writes;
      Status st(Code::kNoSpace,
                fmt::format("memory-only checkpoints: --memory-ckpt-mem is full ({} of {} "
                            "bytes in use, {} more needed for {})",
                            used_, opts_.budget_bytes, missing * bs, PathOf(*n)));
      const int64_t now_s = static_cast<int64_t>(NowNs() / 1000000000ull);
      if (now_s != nospace_logged_s_) {
        nospace_logged_s_ = now_s;
        spdlog::warn("ENOSPC to the application: {} ({} refused writes so far; an older "
                     "checkpoint of a tree stays until the newer one is replicated, so with "
                     "--peers a save can need room for three)",
                     st.message(), stats_.nospace_writes);
      }
      return st;
    }
    for (uint64_t i = offset / bs; i * bs < end; ++i) {
      std::shared_ptr<Block>& b = n->blocks[i];
      if (!b) {
        b = std::make_shared<Block>(bs);
        if (b->p == nullptr) {
          n->blocks.erase(i);
          ++stats_.nospace_writes;
          return Status(Code::kNoSpace, "memory-only checkpoints: out of memory");
        }
        used_ += bs;
      }
      blocks.push_back(b);
    }
    stats_.peak_used_bytes = std::max(stats_.peak_used_bytes, used_);
  }
  // The copy, without the lock: the blocks are this write's until it returns.
  uint64_t at = offset;
  for (const std::shared_ptr<Block>& b : blocks) {
    const uint64_t in = at % bs;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(bs - in, end - at));
    CKPT_RETURN_IF_ERROR(fill(b->p + in, n));
    at += n;
  }
  MutexLock lock(&mu_);
  if (Node* n = NodeLocked(id)) {
    n->size = std::max(n->size, end);
    n->mtime = n->ctime = Now();
  }
  return Status::Ok();
}

Result<size_t> MemoryTier::Read(uint64_t id, char* out, size_t len, uint64_t offset) const {
  const uint64_t bs = opts_.block_bytes;
  std::vector<std::pair<uint64_t, std::shared_ptr<Block>>> blocks;
  uint64_t end = 0;
  std::optional<MemRemoteFile> remote;
  MemoryReplication* from = nullptr;
  {
    MutexLock lock(&mu_);
    const Node* n = NodeLocked(id);
    if (n == nullptr) return NotFound("memory-only file is gone");
    if (n->dir) return Status(Code::kIsDir, n->name);
    if (offset >= n->size) return size_t{0};
    end = std::min<uint64_t>(n->size, offset + len);
    if (n->remote) {
      if (replication_ == nullptr) return Status(Code::kIo, n->name + ": its writer is not reachable");
      remote = n->remote;
      from = replication_;
      ++calls_out_;
    }
    for (auto it = n->blocks.lower_bound(offset / bs); it != n->blocks.end() && it->first * bs < end;
         ++it) {
      blocks.emplace_back(it->first, it->second);
    }
  }
  const size_t got = static_cast<size_t>(end - offset);
  if (remote) {  // another node wrote it: its bytes come from there (or its part's holder)
    CallOut out_call(const_cast<MemoryTier*>(this));
    for (size_t done = 0; done < got;) {
      CKPT_ASSIGN_OR_RETURN(size_t n, from->ReadRemote(*remote, out + done, got - done,
                                                       offset + done));
      if (n == 0) return Status(Code::kIo, remote->file + ": short read from its writer");
      done += n;
    }
    return got;
  }
  std::memset(out, 0, got);  // holes
  for (const auto& [i, b] : blocks) {
    const uint64_t lo = std::max(offset, i * bs), hi = std::min(end, (i + 1) * bs);
    std::memcpy(out + (lo - offset), b->p + (lo - i * bs), hi - lo);
  }
  return got;
}

void MemoryTier::MaybeCommitLocked(Node* file) {
  Node* dir = file->parent;
  if (dir == nullptr || file->dir || dir->committed != 0 ||
      CommitKindOf(file->name) != CommitKind::kDcp) {
    return;
  }
  const std::string where = PathOf(*dir);
  // G5 within memory: every file the `.metadata` names is here, long enough.
  Result<DcpMetadata> md = ParseDcpMetadata(Content(*file, file->size, opts_.block_bytes));
  if (!md.ok()) {
    ++stats_.refused_commits;
    spdlog::error("memory-only checkpoint {}: .metadata unreadable ({}); not committed", where,
                  md.status().ToString());
    return;
  }
  for (const auto& [name, need] : RequiredFileLengths(*md)) {
    const Node* at = dir;
    for (size_t start = 0; at != nullptr && start <= name.size();) {
      size_t slash = name.find('/', start);
      if (slash == std::string::npos) slash = name.size();
      auto it = at->children.find(std::string_view(name).substr(start, slash - start));
      at = it == at->children.end() ? nullptr : it->second;
      start = slash + 1;
    }
    if (at == nullptr && replication_ != nullptr) {
      // Not written here: with peers, ranks on other nodes may have written it. Their parts
      // are gathered (memory_parts.h) and it is committed once every part is replicated.
      dir->seq = std::max(NowNs(), dir->seq + 1);
      dir->replicating = dir->gathering = true;
      dir->unreplicated = false;
      spdlog::info("memory-only checkpoint {}: its .metadata names {} which was not written "
                   "here; gathering the parts other nodes wrote", where, name);
      replication_->Gather(RootOf(dir)->tree_path, TreePathOf(*dir), dir->seq);
      return;
    }
    if (at == nullptr || at->dir || at->size < need) {
      ++stats_.refused_commits;
      spdlog::error("memory-only checkpoint {}: its .metadata names {} ({} bytes) which is {}; "
                    "not committed", where, name, need, at == nullptr ? "missing" : "short");
      return;
    }
  }
  if (replication_ != nullptr) {
    // Committed once a peer holds it too (Replicated); the older ones stay until then.
    dir->seq = std::max(NowNs(), dir->seq + 1);
    dir->replicating = true;
    dir->unreplicated = false;
    spdlog::info("memory-only checkpoint {} is whole in memory here; replicating to a peer",
                 where);
    replication_->Replicate(RootOf(dir)->tree_path, TreePathOf(*dir), true, dir->seq);
    return;
  }
  spdlog::info("memory-only checkpoint {} committed in memory on this node only (no peers: "
               "not replicated; lost if this daemon stops)", where);
  CommitLocked(dir, "");
}

void MemoryTier::CommitLocked(Node* dir, const std::string& holder) {
  dir->committed = ++order_;
  dir->replicating = dir->unreplicated = false;
  dir->holder = holder;
  ++stats_.commits;
  EvictOlderLocked(dir);
}

void MemoryTier::EvictOlderLocked(Node* committed) {
  std::vector<Node*> older;
  for (const auto& [id, n] : nodes_) {
    // An older one no peer took (unreplicated) is superseded too: it never commits after.
    // So is a part of a checkpoint written through several nodes that never committed.
    const bool superseded = n->committed != 0 ||
                            ((n->unreplicated || n->part) && n->seq < committed->seq);
    if (n->tree == committed->tree && n->dir && superseded && n.get() != committed) {
      older.push_back(n.get());
    }
  }
  for (Node* old : older) DropOlderLocked(old, committed, "evicted by the newer commit of");
}

bool MemoryTier::DropOlderLocked(Node* old, Node* newer, const char* why) {
  // An ancestor or descendant of the new one (a checkpoint saved inside another): kept.
  bool related = false;
  for (const Node* a = newer; a != nullptr; a = a->parent) related |= a == old;
  for (const Node* a = old; a != nullptr; a = a->parent) related |= a == newer;
  if (related || nodes_.count(old->id) == 0) return false;
  const std::string name = old->name, where = PathOf(*old);
  const uint64_t bytes = TreeBytes(*old);
  RemoveLocked(old);
  ++stats_.evicted_checkpoints;
  stats_.evicted_bytes += bytes;
  // Trackers that name it vanish with it: files of the tree outside any checkpoint.
  for (Node* t : TrackersNaming(nodes_, newer->tree, name, opts_.block_bytes)) {
    spdlog::info("memory-only tracker {} named {}: dropped with it", PathOf(*t), where);
    RemoveLocked(t);
    ++stats_.trackers_dropped;
  }
  spdlog::info("memory-only checkpoint {} {} {} ({} bytes)", where, why, PathOf(*newer), bytes);
  return true;
}

void MemoryTier::Closed(uint64_t id) {
  MutexLock lock(&mu_);
  Node* n = NodeLocked(id);
  if (n == nullptr) return;
  MaybeCommitLocked(n);
  if (replication_ != nullptr && IsTracker(*n)) {
    n->seq = std::max(NowNs(), n->seq + 1);
    replication_->Replicate(RootOf(n)->tree_path, TreePathOf(*n), false, n->seq);
  }
}

Status MemoryTier::Unlink(uint64_t dir, std::string_view name) {
  MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(Node * d, DirLocked(dir));
  auto it = d->children.find(name);
  if (it == d->children.end()) return NotFound(std::string(name));
  if (it->second->dir) return Status(Code::kIsDir, std::string(name));
  RemoveLocked(it->second);
  return Status::Ok();
}

Status MemoryTier::Rmdir(uint64_t dir, std::string_view name) {
  std::string tree, path;
  MemoryReplication* mirror = nullptr;
  {
    MutexLock lock(&mu_);
    CKPT_ASSIGN_OR_RETURN(Node * d, DirLocked(dir));
    auto it = d->children.find(name);
    if (it == d->children.end()) return NotFound(std::string(name));
    if (!it->second->dir) return Status(Code::kNotDir, std::string(name));
    if (!it->second->children.empty()) return Status(Code::kNotEmpty, std::string(name));
    if (replication_ != nullptr) {
      mirror = replication_;
      ++calls_out_;
      tree = RootOf(it->second)->tree_path;
      path = TreePathOf(*it->second);
    }
    RemoveLocked(it->second);
  }
  if (mirror != nullptr) {
    // With peers the other nodes remove it too (a rotation's `rm -r` of a checkpoint
    // written through several nodes), as a mkdir is made on every node.
    CallOut out(this);
    mirror->MirrorRmdir(tree, path);
  }
  return Status::Ok();
}

Status MemoryTier::Rename(uint64_t dir, std::string_view name, uint64_t new_dir,
                          std::string_view new_name, bool noreplace) {
  std::string tree, from_path, to_path;
  MemoryReplication* mirror = nullptr;
  {
    MutexLock lock(&mu_);
    CKPT_ASSIGN_OR_RETURN(Node * from, DirLocked(dir));
    CKPT_ASSIGN_OR_RETURN(Node * to, DirLocked(new_dir));
    if (from->tree != to->tree) return Status(Code::kCrossDevice, "another memory-only tree");
    auto it = from->children.find(name);
    if (it == from->children.end()) return NotFound(std::string(name));
    Node* n = it->second;
    for (const Node* a = to; a != nullptr; a = a->parent) {
      if (a == n) return Invalid("a directory cannot move below itself");
    }
    if (auto old = to->children.find(new_name); old != to->children.end()) {
      if (old->second == n) return Status::Ok();
      if (noreplace) return Status(Code::kExists, std::string(new_name));
      Node* victim = old->second;
      if (victim->dir != n->dir) return Status(victim->dir ? Code::kIsDir : Code::kNotDir, "");
      if (victim->dir && !victim->children.empty()) return Status(Code::kNotEmpty, "");
      RemoveLocked(victim);
    }
    const std::string was = TreePathOf(*n);
    from->children.erase(n->name);
    from->mtime = from->ctime = Now();
    n->name = std::string(new_name);
    n->parent = to;
    to->children.emplace(n->name, n);
    to->mtime = to->ctime = n->ctime = Now();
    MaybeCommitLocked(n);  // `.metadata.tmp` -> `.metadata`
    if (n->dir && replication_ != nullptr) {
      // With peers ranks on other nodes may have written into it (their parts): it is
      // renamed there too, as a mkdir is made there.
      FollowMove(nodes_, n, was, TreePathOf(*n), replication_);
      mirror = replication_;
      ++calls_out_;
      tree = RootOf(n)->tree_path;
      from_path = was;
      to_path = TreePathOf(*n);
    } else if (replication_ != nullptr && IsTracker(*n)) {
      // A tracker renamed into place (`latest.tmp` -> `latest`) is handed over under its
      // new name, as on a close.
      n->seq = std::max(NowNs(), n->seq + 1);
      replication_->Replicate(RootOf(n)->tree_path, TreePathOf(*n), false, n->seq);
    }
  }
  if (mirror != nullptr) {
    CallOut out(this);
    mirror->MirrorRename(tree, from_path, to_path);
  }
  return Status::Ok();
}

Result<std::vector<std::pair<std::string, MemAttr>>> MemoryTier::List(uint64_t dir) const {
  MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(Node * d, DirLocked(dir));
  std::vector<std::pair<std::string, MemAttr>> out;
  for (const auto& [name, c] : d->children) out.emplace_back(name, AttrOf(*c));
  return out;
}

std::vector<MemCheckpoint> MemoryTier::Checkpoints() const {
  MutexLock lock(&mu_);
  std::vector<MemCheckpoint> out;
  for (const auto& [id, n] : nodes_) {
    if (!n->dir || n->parent == nullptr) continue;
    bool holds = n->committed != 0;
    for (const auto& [name, c] : n->children) {
      holds |= !c->dir && (IsCheckpointFileName(name) || CommitKindOf(name) != CommitKind::kNone);
    }
    if (!holds) continue;
    MemCheckpoint c{PathOf(*n), "writing", TreeBytes(*n), "", n->holder};
    c.tree = RootOf(n.get())->tree_path;
    c.in_tree = TreePathOf(*n);
    c.seq = n->seq;
    if (n->committed != 0) c.state = "committed";
    if (n->replicating) c.state = "replicating";
    if (n->unreplicated) c.state = "unreplicated";
    if (n->part && n->committed == 0 && !n->replicating && !n->unreplicated) c.state = "part";
    if (replication_ == nullptr) {
      c.where = "memory (this node only, no peers)";
    } else if (!n->holder.empty()) {
      c.where = "memory: this node + replica on " + n->holder;
    } else {
      c.where = "memory: this node only (no replica yet)";
    }
    if (!n->parts_where.empty()) c.where += "; " + n->parts_where;
    out.push_back(std::move(c));
  }
  for (const MemCheckpoint& c : lost_) out.push_back(c);
  return out;
}

MemoryTierStats MemoryTier::Stats() const {
  MutexLock lock(&mu_);
  MemoryTierStats s = stats_;
  s.used_bytes = used_;
  return s;
}

nlohmann::json MemoryTierJson(const MemoryTier& tier) {
  const MemoryTierStats s = tier.Stats();
  nlohmann::json j = {{"budget_bytes", s.budget_bytes},
                      {"used_bytes", s.used_bytes},
                      {"peak_used_bytes", s.peak_used_bytes},
                      {"trees", s.trees},
                      {"commits", s.commits},
                      {"refused_commits", s.refused_commits},
                      {"evicted_checkpoints", s.evicted_checkpoints},
                      {"evicted_bytes", s.evicted_bytes},
                      {"trackers_dropped", s.trackers_dropped},
                      {"nospace_writes", s.nospace_writes},
                      {"superseded_for_room", s.superseded_for_room},
                      {"lost_checkpoints", s.lost_checkpoints},
                      {"replicated_checkpoints", s.replicated_checkpoints},
                      {"unreplicated_checkpoints", s.unreplicated_checkpoints},
                      {"restored_checkpoints", s.restored_checkpoints},
                      {"restored_bytes", s.restored_bytes},
                      {"replica_bytes", s.replica_bytes}};
  nlohmann::json list = nlohmann::json::array();
  for (const MemCheckpoint& c : tier.Checkpoints()) {
    list.push_back({{"path", c.path}, {"state", c.state}, {"bytes", c.bytes},
                    {"tier", "memory"}, {"where", c.where}, {"holder", c.holder}});
  }
  j["checkpoints"] = std::move(list);
  return j;
}

void MemoryTier::DropAll() {
  std::vector<MemCheckpoint> held = Checkpoints();
  MutexLock lock(&mu_);
  for (const MemCheckpoint& c : held) {
    if (c.state == "lost") continue;
    if (!c.holder.empty()) {
      spdlog::info("memory-only checkpoint {} dropped here; its replica stays on {} (a restart "
                   "of this daemon gets it back)", c.path, c.holder);
      continue;
    }
    if (c.state != "committed" && c.state != "replicating" && c.state != "unreplicated") continue;
    ++stats_.lost_checkpoints;
    spdlog::warn("memory-only checkpoint {} lost: the daemon stops and no peer holds it", c.path);
  }
  nodes_.clear();
  trees_.clear();
  used_ = 0;
  stats_.trees = 0;
  gate_.Open();
}

}  // namespace ckptfs::store
