// MemoryTier's replication and restore (issue 42): the writer's side of replicating a unit
// (a checkpoint directory or a tracker) to a peer, and what a restarted daemon is given
// back. The peer talk lives in store/peer/memory_replica.cc; this file only reads and
// changes the tree.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "common/path.h"
#include "store/dcp/commit_names.h"
#include "store/dcp/dcp_metadata.h"
#include "store/memory/memory_tier.h"
#include "store/memory/memory_tier_node.h"
#include "store/primitives/crc32c.h"

namespace ckptfs::store {

MemoryTier::Node* MemoryTier::TreeByPathLocked(const std::string& tree) const {
  for (const auto& [key, id] : trees_) {
    Node* root = NodeLocked(id);
    if (root != nullptr && root->tree_path == tree) return root;
  }
  return nullptr;
}

Result<const MemoryTier::Node*> MemoryTier::UnitLocked(const std::string& tree,
                                                       const std::string& path,
                                                       uint64_t seq) const {
  Node* root = TreeByPathLocked(tree);
  const Node* n = root == nullptr ? nullptr : Walk(root, path);
  if (n == nullptr || n == root) return NotFound("memory-only " + tree + "/" + path + " is gone");
  if (n->seq != seq) return NotFound("memory-only " + path + ": another version now");
  return n;
}

void MemoryTier::SetReplication(MemoryReplication* replication) {
  MutexLock lock(&mu_);
  replication_ = replication;
  // Calls made into the old one without the lock end first (each bounded by a peer timeout).
  calls_cv_.wait(lock.native(), [this] {
    mu_.AssertHeld();
    return calls_out_ == 0;
  });
}

Result<MemUnit> MemoryTier::Manifest(const std::string& tree, const std::string& path,
                                     uint64_t seq) const {
  struct Pending {
    MemUnitFile file;
    std::vector<std::shared_ptr<Block>> blocks;  // by index, null for holes
  };
  std::vector<Pending> pending;
  MemUnit unit;
  {
    MutexLock lock(&mu_);
    CKPT_ASSIGN_OR_RETURN(const Node* n, UnitLocked(tree, path, seq));
    unit.tree = tree;
    unit.path = path;
    unit.seq = seq;
    unit.checkpoint = n->dir;
    // Every file below it, depth first, with its blocks (shared: a drop cannot free them).
    std::vector<std::pair<std::string, const Node*>> todo = {{"", n}};
    while (!todo.empty()) {
      auto [rel, at] = todo.back();
      todo.pop_back();
      if (at->dir) {
        for (const auto& [name, c] : at->children) {
          todo.emplace_back(rel.empty() ? name : rel + "/" + name, c);
        }
        continue;
      }
      if (at->remote) continue;  // another node's part: replicated by that node
      Pending p;
      p.file.name = rel;
      p.file.size = at->size;
      const uint64_t count = (at->size + opts_.block_bytes - 1) / opts_.block_bytes;
      p.blocks.resize(count);
      for (const auto& [i, b] : at->blocks) {
        if (i < count) p.blocks[i] = b;
      }
      pending.push_back(std::move(p));
    }
  }
  // The checksums, without the lock.
  const uint64_t bs = opts_.block_bytes;
  std::vector<char> zeros;
  for (Pending& p : pending) {
    uint32_t crc = 0;
    for (uint64_t i = 0; i < p.blocks.size(); ++i) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(bs, p.file.size - i * bs));
      if (p.blocks[i]) {
        crc = Crc32cExtend(crc, p.blocks[i]->p, n);
      } else {
        zeros.resize(bs, 0);
        crc = Crc32cExtend(crc, zeros.data(), n);
      }
    }
    p.file.crc32c = crc;
    unit.files.push_back(std::move(p.file));
  }
  std::sort(unit.files.begin(), unit.files.end(),
            [](const MemUnitFile& a, const MemUnitFile& b) { return a.name < b.name; });
  return unit;
}

Result<size_t> MemoryTier::ReadUnit(const std::string& tree, const std::string& path, uint64_t seq,
                                    const std::string& file, char* out, size_t len,
                                    uint64_t offset) const {
  uint64_t id = 0;
  {
    MutexLock lock(&mu_);
    CKPT_ASSIGN_OR_RETURN(const Node* n, UnitLocked(tree, path, seq));
    const Node* f = file.empty() ? n : Walk(const_cast<Node*>(n), file);
    if (f == nullptr || f->dir || f->remote) {
      return NotFound("memory-only " + path + "/" + file + " is gone");
    }
    id = f->id;
  }
  return Read(id, out, len, offset);
}

void MemoryTier::HandedOver(const std::string& tree, const std::string& path, uint64_t seq,
                            const Result<std::string>& holder) {
  MutexLock lock(&mu_);
  Result<const Node*> u = UnitLocked(tree, path, seq);
  if (!u.ok()) return;
  Node* n = const_cast<Node*>(*u);
  if (!holder.ok()) {
    if (n->gathering) {
      // Its own part was not replicated: not committed (never offered again as a whole,
      // which it is not here); a new save of it gathers again.
      n->gathering = n->replicating = false;
      ++stats_.refused_commits;
      spdlog::error("memory-only checkpoint {} NOT committed: no peer took this node's part "
                    "({}); the older checkpoints of its tree stay",
                    PathOf(*n), holder.status().ToString());
      return;
    }
    if (!n->dir) {
      spdlog::warn("memory-only tracker {}: no peer holds it: {}", PathOf(*n),
                   holder.status().ToString());
    }
    if (!n->dir || !n->replicating) return;
    n->replicating = false;
    n->unreplicated = true;
    ++stats_.unreplicated_checkpoints;
    spdlog::error(
        "memory-only checkpoint {} NOT committed: no peer took its replica ({}); the "
        "older checkpoints of its tree stay",
        PathOf(*n), holder.status().ToString());
    return;
  }
  if (!n->dir) {  // a tracker
    n->holder = *holder;
    return;
  }
  if ((n->part || n->gathering) && n->committed == 0) {
    // A part of a checkpoint written through several nodes: committed when the node with
    // its `.metadata` has every part (memory_parts.h), not now.
    n->holder = *holder;
    n->unreplicated = false;
    n->replicating = n->gathering;
    spdlog::info("memory-only {} {}: this node's part is replicated to {}", PathOf(*n),
                 n->gathering ? "(gathering the other nodes' parts)" : "(part of a checkpoint "
                 "whose .metadata another node holds)", *holder);
    return;
  }
  if (!n->replicating && !n->unreplicated) {
    if (n->committed != 0 && n->holder != *holder) {  // a check found it elsewhere
      spdlog::info("memory-only checkpoint {}: its replica is now on {} (was {})", PathOf(*n),
                   *holder, n->holder.empty() ? "none" : n->holder);
      n->holder = *holder;
    }
    return;
  }
  ++stats_.replicated_checkpoints;
  spdlog::info("memory-only checkpoint {} committed: whole in memory here and replicated to {}",
               PathOf(*n), *holder);
  CommitLocked(n, *holder);
}

Status MemoryTier::ChargeReplicas(int64_t delta) {
  MutexLock lock(&mu_);
  if (delta < 0) {
    const uint64_t bytes = static_cast<uint64_t>(-delta);
    used_ -= std::min(used_, bytes);
    stats_.replica_bytes -= std::min(stats_.replica_bytes, bytes);
    return Status::Ok();
  }
  const uint64_t bytes = static_cast<uint64_t>(delta);
  if (used_ + bytes > opts_.budget_bytes) {
    ++stats_.nospace_writes;
    return Status(Code::kNoSpace,
                  fmt::format("memory-only checkpoints: --memory-ckpt-mem is full ({} of {} bytes "
                              "in use, {} more needed for a peer's replica)",
                              used_, opts_.budget_bytes, bytes));
  }
  used_ += bytes;
  stats_.replica_bytes += bytes;
  stats_.peak_used_bytes = std::max(stats_.peak_used_bytes, used_);
  return Status::Ok();
}

void MemoryRestoreGate::Close() {
  MutexLock lock(&mu_);
  closed_ = true;
}

void MemoryRestoreGate::Open() {
  {
    MutexLock lock(&mu_);
    closed_ = false;
  }
  cv_.notify_all();
}

void MemoryRestoreGate::Wait(std::chrono::milliseconds max) {
  MutexLock lock(&mu_);
  cv_.wait_for(lock.native(), max, [this] {
    mu_.AssertHeld();
    return !closed_;
  });
}

Status MemoryTier::RestoreFile(const std::string& tree, const std::string& path, uint64_t size,
                               const Fill& fill) {
  uint64_t id = 0;
  {
    MutexLock lock(&mu_);
    Node* root = TreeByPathLocked(tree);
    if (root == nullptr) {
      // The view has not looked at this marked directory since the restart: a provisional
      // tree, adopted by TreeRoot when it does.
      auto r = std::make_unique<Node>();
      r->id = next_id_++;
      r->tree = kProvisionalTree | next_provisional_++;
      r->dir = true;
      r->tree_path = tree;
      r->mode = 0755;
      clock_gettime(CLOCK_REALTIME, &r->mtime);
      r->ctime = r->mtime;
      root = r.get();
      trees_.emplace(r->tree, r->id);
      nodes_.emplace(r->id, std::move(r));
      stats_.trees = trees_.size();
    }
    const std::vector<std::string> parts = path::Components(path);
    if (parts.empty()) return Invalid("restore: empty path");
    Node* at = root;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      auto it = at->children.find(parts[i]);
      if (it == at->children.end()) {
        at = NewNodeLocked(at, parts[i], true, 0755, 0, 0);
      } else if (!it->second->dir) {
        return Status(Code::kNotDir, "restore: " + parts[i] + " is a file here");
      } else {
        at = it->second;
      }
    }
    if (auto it = at->children.find(parts.back()); it != at->children.end()) {
      if (it->second->dir) return Status(Code::kIsDir, "restore: " + path);
      RemoveLocked(it->second);  // an older copy of a tracker
    }
    id = NewNodeLocked(at, parts.back(), false, 0644, 0, 0)->id;
  }
  if (size == 0) return Status::Ok();
  return Write(id, 0, size, fill);
}

void MemoryTier::FinishRestore(const std::string& tree, const std::string& path, uint64_t seq,
                               const std::string& holder, uint64_t bytes, bool whole) {
  MutexLock lock(&mu_);
  Node* root = TreeByPathLocked(tree);
  Node* n = root == nullptr ? nullptr : Walk(root, path);
  if (n == nullptr || n == root) return;
  if (!whole) {
    RemoveLocked(n);  // never served partly
    return;
  }
  n->seq = seq;
  if (!n->dir) {
    n->holder = holder;
    return;
  }
  ++stats_.restored_checkpoints;
  stats_.restored_bytes += bytes;
  // A checkpoint written through several nodes (memory_parts.h) is never served partly:
  // this node's part without the `.metadata` waits for the `.metadata`'s node; with it, the
  // other nodes' parts are gathered again (at the same version: held parts answer at once).
  const Node* md = nullptr;
  bool shards = false;
  for (const auto& [name, c] : n->children) {
    if (!c->dir && CommitKindOf(name) == CommitKind::kDcp) md = c;
    shards |= !c->dir && IsCheckpointFileName(name);
  }
  if (md == nullptr && shards) {
    n->part = true;
    n->holder = holder;
    spdlog::info("memory-only {}: this node's part restored from {} ({} bytes); its .metadata "
                 "is on another node", PathOf(*n), holder, bytes);
    return;
  }
  if (md != nullptr && replication_ != nullptr) {
    Result<DcpMetadata> parsed = ParseDcpMetadata(Content(*md, md->size, opts_.block_bytes));
    bool missing = false;
    if (parsed.ok()) {
      for (const auto& [name, need] : RequiredFileLengths(*parsed)) {
        missing |= Walk(n, name) == nullptr;
      }
    }
    if (missing) {
      n->holder = holder;
      n->replicating = n->gathering = true;
      spdlog::info("memory-only {}: restored from {}; gathering the parts other nodes wrote",
                   PathOf(*n), holder);
      replication_->Gather(RootOf(n)->tree_path, TreePathOf(*n), seq);
      return;
    }
  }
  CommitLocked(n, holder);
  // A restored checkpoint is not a lost one any more.
  const std::string where = PathOf(*n);
  std::erase_if(lost_, [&](const MemCheckpoint& c) { return c.path == where; });
  spdlog::info("memory-only checkpoint {} restored from its replica on {} ({} bytes)", where,
               holder, bytes);
}

void MemoryTier::NoteLost(const std::string& tree, const std::string& path,
                          const std::string& why) {
  MutexLock lock(&mu_);
  const std::string where = tree.empty() ? path : tree + "/" + path;
  for (const MemCheckpoint& c : lost_) {
    if (c.path == where) return;
  }
  ++stats_.lost_checkpoints;
  lost_.push_back({where, "lost", 0, "lost: " + why, ""});
  // A tracker of its tree that names it (given back by another peer) vanishes with it.
  if (Node* root = TreeByPathLocked(tree)) {
    for (Node* t : TrackersNaming(nodes_, root->tree, path::Basename(path), opts_.block_bytes)) {
      spdlog::warn("memory-only tracker {} named the lost {}: dropped", PathOf(*t), where);
      RemoveLocked(t);
      ++stats_.trackers_dropped;
    }
  }
  spdlog::warn(
      "memory-only checkpoint {} LOST: {}; it is not served (ENOENT), and trackers "
      "naming it are gone with it",
      where, why);
}

}  // namespace ckptfs::store
