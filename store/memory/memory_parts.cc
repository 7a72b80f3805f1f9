#include "store/memory/memory_parts.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <set>

#include "common/path.h"
#include "store/dcp/commit_names.h"
#include "store/dcp/dcp_metadata.h"
#include "store/memory/memory_tier_node.h"

namespace ckptfs::store {
namespace {

using Node = MemoryTier::Node;

// Whether a peer's file name is a plain relative path (no empty, "." or ".." component):
// bad input is refused, never made into names.
bool PlainName(const std::string& name) {
  const std::vector<std::string> comps = path::Components(name);
  if (comps.empty() || name.front() == '/') return false;
  return std::none_of(comps.begin(), comps.end(),
                      [](const std::string& c) { return c == "." || c == ".."; });
}

// The files below `n` (paths relative to it), depth first.
void FilesBelow(Node* n, const std::string& rel, std::vector<std::pair<std::string, Node*>>* out) {
  for (const auto& [name, c] : n->children) {
    const std::string at = rel.empty() ? name : rel + "/" + name;
    if (c->dir) {
      FilesBelow(c, at, out);
    } else {
      out->emplace_back(at, c);
    }
  }
}

std::string Joined(const std::set<std::string>& items) {
  std::string out;
  for (const std::string& i : items) out += (out.empty() ? "" : ", ") + i;
  return out;
}

}  // namespace

Node* MemoryParts::PlaceRemoteLocked(MemoryTier* t, Node* n, const std::string& name,
                                     uint64_t size) {
  const std::vector<std::string> comps = path::Components(name);
  Node* at = n;
  for (size_t i = 0; at != nullptr && i + 1 < comps.size(); ++i) {
    auto it = at->children.find(comps[i]);
    at = it == at->children.end() ? t->NewNodeLocked(at, comps[i], true, 0755, 0, 0)
         : it->second->dir        ? it->second
                                  : nullptr;
  }
  if (at == nullptr || comps.empty()) return nullptr;
  Node* f = t->NewNodeLocked(at, comps.back(), false, 0644, 0, 0);
  f->size = size;
  return f;
}

Status MemoryParts::MakeDirs(const std::string& tree, const std::string& path) {
  MemoryTier* t = tier_;
  MutexLock lock(&t->mu_);
  Node* root = t->TreeByPathLocked(tree);
  if (root == nullptr) {
    // The view has not looked at this marked directory here yet: a provisional tree, adopted
    // by TreeRoot when it does (as a restore makes one).
    auto r = std::make_unique<Node>();
    r->id = t->next_id_++;
    r->tree = kProvisionalTree | t->next_provisional_++;
    r->dir = true;
    r->tree_path = tree;
    r->mode = 0755;
    clock_gettime(CLOCK_REALTIME, &r->mtime);
    r->ctime = r->mtime;
    root = r.get();
    t->trees_.emplace(r->tree, r->id);
    t->nodes_.emplace(r->id, std::move(r));
    t->stats_.trees = t->trees_.size();
  }
  return MakeDirsLocked(t, root, path).status();
}

Result<Node*> MemoryParts::MakeDirsLocked(MemoryTier* t, Node* root, const std::string& path) {
  Node* at = root;
  for (const std::string& part : path::Components(path)) {
    if (part == "." || part == "..") return Invalid("memory-only mkdir: bad path " + path);
    auto it = at->children.find(part);
    if (it == at->children.end()) {
      at = t->NewNodeLocked(at, part, true, 0755, 0, 0);
    } else if (!it->second->dir) {
      return Status(Code::kNotDir, "memory-only mkdir: " + part + " is a file here");
    } else {
      at = it->second;
    }
  }
  return at;
}

namespace {

// A file below `n` that is no committed checkpoint's (`inside`: `n` is in one).
bool UncommittedFileBelow(const MemoryTier::Node& n, bool inside) {
  for (const auto& [name, c] : n.children) {
    if (c->dir ? UncommittedFileBelow(*c, inside || c->committed != 0) : !inside) return true;
  }
  return false;
}

}  // namespace

Status MemoryParts::RemoveDir(const std::string& tree, const std::string& path) {
  MemoryTier* t = tier_;
  MutexLock lock(&t->mu_);
  Node* root = t->TreeByPathLocked(tree);
  Node* n = root == nullptr ? nullptr : Walk(root, path);
  if (n == nullptr || n == root) return Status::Ok();  // gone already (a tree's root stays)
  if (!n->dir) return Status(Code::kNotDir, "memory-only rmdir: " + path + " is a file here");
  if (UncommittedFileBelow(*n, n->committed != 0)) {
    return Status(Code::kNotEmpty, "memory-only rmdir: " + path +
                                       " holds a file here that no committed checkpoint has");
  }
  t->RemoveLocked(n);
  return Status::Ok();
}

Status MemoryParts::RenameDir(const std::string& tree, const std::string& from,
                              const std::string& to) {
  if (from.empty() || to.empty() || path::IsAtOrBelow(to, from) || !PlainName(from) ||
      !PlainName(to)) {
    return Invalid("memory-only rename: bad paths " + from + " -> " + to);
  }
  MemoryTier* t = tier_;
  MutexLock lock(&t->mu_);
  Node* root = t->TreeByPathLocked(tree);
  Node* n = root == nullptr ? nullptr : Walk(root, from);
  if (n == nullptr) return Status::Ok();  // nothing of it here
  if (!n->dir) return Status(Code::kNotDir, "memory-only rename: " + from + " is a file here");
  const auto [up, name] = path::Split(to);
  CKPT_ASSIGN_OR_RETURN(Node * parent, MakeDirsLocked(t, root, up));
  if (auto old = parent->children.find(name); old != parent->children.end()) {
    // The rename was made on its node, where `to` was absent or an empty directory; here it
    // may list a committed checkpoint that node no longer has: replaced as an rmdir would
    // remove it, never while a rank here may be writing into it.
    Node* victim = old->second;
    if (!victim->dir) return Status(Code::kNotDir, "memory-only rename: " + to + " is a file here");
    if (UncommittedFileBelow(*victim, victim->committed != 0)) {
      return Status(Code::kNotEmpty, "memory-only rename: " + to +
                                         " holds a file here that no committed checkpoint has");
    }
    t->RemoveLocked(victim);
  }
  n->parent->children.erase(n->name);
  n->name = name;
  n->parent = parent;
  parent->children.emplace(n->name, n);
  clock_gettime(CLOCK_REALTIME, &n->ctime);
  FollowMove(t->nodes_, n, from, to, t->replication_);
  spdlog::info("memory-only {}/{}: renamed to {} (made on another node)", tree, from, to);
  return Status::Ok();
}

Result<MemPart> MemoryParts::Seal(const std::string& tree, const std::string& path, uint64_t seq) {
  MemoryTier* t = tier_;
  MutexLock lock(&t->mu_);
  Node* root = t->TreeByPathLocked(tree);
  Node* n = root == nullptr ? nullptr : Walk(root, path);
  if (n == nullptr || n == root || !n->dir) return NotFound("no part of " + path + " here");
  std::vector<std::pair<std::string, Node*>> files;
  FilesBelow(n, "", &files);
  std::erase_if(files, [](const auto& f) { return f.second->remote.has_value(); });
  if (files.empty()) return NotFound("no part of " + path + " here");
  if (n->seq != seq || !(n->part || n->committed != 0)) {
    if (t->replication_ == nullptr) return Status(Code::kAborted, "this node has no peers now");
    // Sealed at the commit's version and handed to a holder; a re-save seals it again.
    n->part = true;
    n->committed = 0;
    n->seq = seq;
    n->replicating = true;
    n->unreplicated = false;
    n->holder.clear();
    spdlog::info(
        "memory-only {}: this node's part ({} files) is asked for by the node with "
        "its .metadata; replicating it",
        PathOf(*n), files.size());
    t->replication_->Replicate(tree, path, true, seq);
  }
  if (n->unreplicated) {
    return Status(Code::kAborted, "no peer took this node's part of " + PathOf(*n));
  }
  MemPart part;
  part.holder = n->holder;  // empty while it is replicated
  for (const auto& [rel, f] : files) part.files.push_back(MemUnitFile{rel, f->size, 0});
  return part;
}

Status MemoryParts::CommitGathered(const std::string& tree, const std::string& path, uint64_t seq,
                                   const std::vector<MemPart>& parts) {
  for (const MemPart& p : parts) {
    for (const MemUnitFile& f : p.files) {
      if (!PlainName(f.name)) return Invalid("memory-only part: bad file name " + f.name);
    }
  }
  MemoryTier* t = tier_;
  MutexLock lock(&t->mu_);
  Node* root = t->TreeByPathLocked(tree);
  Node* n = root == nullptr ? nullptr : Walk(root, path);
  if (n == nullptr || n == root || !n->gathering || n->seq != seq) {
    return NotFound("memory-only " + path + ": gone or another version now");
  }
  const Node* md = nullptr;
  for (const auto& [name, c] : n->children) {
    if (!c->dir && !c->remote && CommitKindOf(name) == CommitKind::kDcp) md = c;
  }
  Status refused;
  std::map<std::string, std::pair<uint64_t, const MemPart*>> elsewhere;
  for (const MemPart& p : parts) {
    for (const MemUnitFile& f : p.files) elsewhere[f.name] = {f.size, &p};
  }
  if (md == nullptr) {
    refused = NotFound("its .metadata is gone");
  } else {
    Result<DcpMetadata> parsed = ParseDcpMetadata(Content(*md, md->size, t->opts_.block_bytes));
    if (!parsed.ok()) refused = parsed.status();
    for (const auto& [name, need] : parsed.ok() ? RequiredFileLengths(*parsed)
                                                : std::vector<std::pair<std::string, uint64_t>>{}) {
      const Node* here = Walk(n, name);
      if (here != nullptr && !here->dir && !here->remote && here->size >= need) continue;
      auto it = elsewhere.find(name);
      if (it != elsewhere.end() && it->second.first >= need) continue;
      refused = NotFound(
          fmt::format("it names {} ({} bytes), which no node holds {}", name, need,
                      it == elsewhere.end() && here == nullptr ? "(missing)" : "whole (short)"));
      break;
    }
  }
  if (!refused.ok()) {
    n->gathering = n->replicating = false;
    ++t->stats_.refused_commits;
    spdlog::error("memory-only checkpoint {} NOT committed: {}", PathOf(*n), refused.message());
    return refused;
  }
  // The other nodes' files, listed here: reads go to their writer (or its part's holder).
  std::set<std::string> holders;
  for (const auto& [name, v] : elsewhere) {
    const auto& [size, p] = v;
    Node* here = Walk(n, name);
    if (here != nullptr && !here->remote) continue;  // written here too: this node's copy
    if (here != nullptr) t->RemoveLocked(here);
    Node* f = PlaceRemoteLocked(t, n, name, size);
    if (f == nullptr) continue;
    f->remote = MemRemoteFile{p->rank, p->holder, tree, path, name, seq, size};
    holders.insert("rank " + std::to_string(p->rank) + " (replica on " + p->holder + ")");
  }
  n->gathering = false;
  n->parts_where =
      fmt::format("written by {} nodes; the others' parts: {}", parts.size() + 1, Joined(holders));
  ++t->stats_.replicated_checkpoints;
  spdlog::info(
      "memory-only checkpoint {} committed: every part in memory on its writer and "
      "replicated (this node's to {}; {})",
      PathOf(*n), n->holder, n->parts_where);
  t->CommitLocked(n, n->holder);
  return Status::Ok();
}

void MemoryParts::Lose(const std::string& tree, const std::string& path, uint64_t seq,
                       const std::string& why) {
  {
    MemoryTier* t = tier_;
    MutexLock lock(&t->mu_);
    Node* root = t->TreeByPathLocked(tree);
    Node* n = root == nullptr ? nullptr : Walk(root, path);
    // Committed here, or this node's part of it (told by the `.metadata`'s node).
    if (n == nullptr || n == root || (n->committed == 0 && !n->part) || n->seq != seq) return;
    t->RemoveLocked(n);
  }
  tier_->NoteLost(tree, path, why);  // listed lost, counted, logged; its trackers go
}

void MemoryParts::GatherFailed(const std::string& tree, const std::string& path, uint64_t seq,
                               const Status& why) {
  MemoryTier* t = tier_;
  MutexLock lock(&t->mu_);
  Node* root = t->TreeByPathLocked(tree);
  Node* n = root == nullptr ? nullptr : Walk(root, path);
  if (n == nullptr || n == root || !n->gathering || n->seq != seq) return;
  n->gathering = n->replicating = false;
  ++t->stats_.refused_commits;
  spdlog::error(
      "memory-only checkpoint {} NOT committed: the parts other nodes wrote were not "
      "all replicated ({}); the older checkpoints of its tree stay",
      PathOf(*n), why.ToString());
}

Result<std::vector<MemRemoteFile>> MemoryParts::Whole(const std::string& tree,
                                                      const std::string& path, uint64_t seq,
                                                      uint32_t self) {
  MemoryTier* t = tier_;
  MutexLock lock(&t->mu_);
  Node* root = t->TreeByPathLocked(tree);
  Node* n = root == nullptr ? nullptr : Walk(root, path);
  if (n == nullptr || n == root || n->committed == 0 || n->seq != seq) {
    return NotFound("memory-only " + path + ": not committed at that version here");
  }
  std::vector<std::pair<std::string, Node*>> files;
  FilesBelow(n, "", &files);
  std::vector<MemRemoteFile> out;
  for (const auto& [rel, f] : files) {
    out.push_back(f->remote ? *f->remote
                            : MemRemoteFile{self, n->holder, tree, path, rel, seq, f->size});
  }
  return out;
}

Status MemoryParts::ApplyCommit(const std::string& tree, const std::string& path, uint64_t seq,
                                const std::vector<MemRemoteFile>& files, uint32_t self) {
  for (const MemRemoteFile& f : files) {
    if (!PlainName(f.file)) return Invalid("memory-only listing: bad file name " + f.file);
  }
  CKPT_RETURN_IF_ERROR(MakeDirs(tree, path));
  MemoryTier* t = tier_;
  MutexLock lock(&t->mu_);
  Node* root = t->TreeByPathLocked(tree);
  Node* n = root == nullptr ? nullptr : Walk(root, path);
  if (n == nullptr || n == root || !n->dir) return NotFound("memory-only " + path + " is gone");
  if (n->committed != 0 && n->seq == seq) return Status::Ok();  // told twice
  std::set<std::string> holders;
  std::set<uint32_t> ranks;
  for (const MemRemoteFile& f : files) {
    Node* here = Walk(n, f.file);
    if (f.rank == self) {
      if (here == nullptr || here->remote || here->size < f.size) {
        spdlog::error(
            "memory-only checkpoint {}: {} is listed as this node's but is not here "
            "whole; not committed here",
            PathOf(*n), f.file);
        return NotFound(f.file + " is not here");
      }
      continue;
    }
    if (here != nullptr && !here->remote) continue;
    if (here != nullptr) t->RemoveLocked(here);
    Node* r = PlaceRemoteLocked(t, n, f.file, f.size);
    if (r == nullptr) continue;
    r->remote = f;
    ranks.insert(f.rank);
    holders.insert("rank " + std::to_string(f.rank) + " (replica on " + f.holder + ")");
  }
  const bool part = n->part && n->seq == seq;
  n->seq = seq;
  n->gathering = false;
  n->parts_where = fmt::format("written by {} nodes; the others' parts: {}",
                               ranks.size() + (part ? 1 : 0), Joined(holders));
  spdlog::info("memory-only checkpoint {} committed by the node with its .metadata ({}{})",
               PathOf(*n), part ? "this node's part replicated to " + n->holder + "; " : "",
               n->parts_where);
  t->CommitLocked(n, part ? n->holder : "");
  return Status::Ok();
}

}  // namespace ckptfs::store
