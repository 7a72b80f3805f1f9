// The nodes of store::MemoryTier (issue 42), shared by its two files: memory_tier.cc
// (the tree, budget, commits) and memory_tier_replication.cc (replication and restore).
// Private to store/memory/.
#pragma once

#include <sys/mman.h>
#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/path.h"
#include "store/dcp/commit_names.h"

#include "store/memory/memory_tier.h"

namespace ckptfs::store {

// Keys of trees a restore made before the view looked at their marked directory.
inline constexpr uint64_t kProvisionalTree = 1ull << 63;

// One block of a file's bytes: its own anonymous mapping, so the budget is what is mapped.
struct MemoryTier::Block {
  explicit Block(size_t n) {
    void* m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED) {
      p = static_cast<char*>(m);
      cap = n;
    }
  }
  ~Block() {
    if (p != nullptr) munmap(p, cap);
  }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  char* p = nullptr;
  size_t cap = 0;
};

struct MemoryTier::Node {
  uint64_t id = 0;
  uint64_t tree = 0;       // the marked directory's key
  Node* parent = nullptr;  // null for a tree's root
  std::string name;
  bool dir = false;
  std::string tree_path;  // roots only: the marked directory's path
  mode_t mode = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  struct timespec mtime {};
  struct timespec ctime {};
  std::map<std::string, Node*, std::less<>> children;  // directories
  uint64_t size = 0;                                   // files
  std::map<uint64_t, std::shared_ptr<Block>> blocks;   // files, by index (holes: zeros)
  uint64_t committed = 0;  // directories: commit order, 0 while not committed
  // With replication: the version handed to it (checkpoint directories, trackers), whether
  // it waits for a peer or no peer took it, and the peer that holds the replica.
  uint64_t seq = 0;
  bool replicating = false;
  bool unreplicated = false;
  std::string holder;
  // Checkpoints written through several nodes (memory_parts.h). `part`: this directory is
  // this node's part of one whose `.metadata` another node holds (sealed at `seq`);
  // `gathering`: its `.metadata` is here and the other nodes' parts are being gathered;
  // `parts_where`: where the other parts are replicated, once committed.
  bool part = false;
  bool gathering = false;
  std::string parts_where;
  // Files: set when another node wrote it (read from there, no bytes here).
  std::optional<MemRemoteFile> remote;
};

// A call into the tier's replication made without its lock (MirrorDir, ReadRemote): the
// caller counted it in calls_out_ under the lock; SetReplication waits until none is out.
struct MemoryTier::CallOut {
  explicit CallOut(MemoryTier* t) : tier(t) {}
  ~CallOut() {
    MutexLock lock(&tier->mu_);
    if (--tier->calls_out_ == 0) tier->calls_cv_.notify_all();
  }
  CallOut(const CallOut&) = delete;
  CallOut& operator=(const CallOut&) = delete;
  MemoryTier* const tier;
};

// Helpers over nodes; the caller holds the tier's lock.

// The root of `n`'s tree, and `n`'s path in it ("" for the root).
inline MemoryTier::Node* RootOf(MemoryTier::Node* n) {
  while (n->parent != nullptr) n = n->parent;
  return n;
}

inline std::string TreePathOf(const MemoryTier::Node& n) {
  if (n.parent == nullptr) return "";
  const std::string up = TreePathOf(*n.parent);
  return up.empty() ? n.name : up + "/" + n.name;
}

// The marked directory's path (as last told) + the path in the tree.
inline std::string PathOf(const MemoryTier::Node& n) {
  if (n.parent == nullptr) return n.tree_path;
  return path::Join(PathOf(*n.parent), n.name);
}

inline MemAttr AttrOf(const MemoryTier::Node& n) {
  MemAttr a;
  a.id = n.id;
  a.dir = n.dir;
  a.size = n.dir ? 4096 : n.size;
  a.mode = n.mode;
  a.uid = n.uid;
  a.gid = n.gid;
  a.mtime = n.mtime;
  a.ctime = n.ctime;
  a.nlink = n.dir ? 2 : 1;
  if (n.dir) {
    for (const auto& [name, c] : n.children) a.nlink += c->dir ? 1 : 0;
  }
  return a;
}

// Bytes of the files at and below `n`.
inline uint64_t TreeBytes(const MemoryTier::Node& n) {
  uint64_t b = n.size;
  for (const auto& [name, c] : n.children) b += TreeBytes(*c);
  return b;
}

// The first `max` bytes of file `n` (blocks of `block_bytes`).
inline std::string Content(const MemoryTier::Node& n, size_t max, uint64_t block_bytes) {
  std::string s(std::min<uint64_t>(n.size, max), '\0');
  for (const auto& [i, b] : n.blocks) {
    if (i * block_bytes >= s.size()) break;
    std::memcpy(s.data() + i * block_bytes, b->p,
                std::min<uint64_t>(block_bytes, s.size() - i * block_bytes));
  }
  return s;
}

// The node at `path` below `root` ("" is the root), or null.
inline MemoryTier::Node* Walk(MemoryTier::Node* root, const std::string& path) {
  MemoryTier::Node* at = root;
  size_t start = 0;
  while (start < path.size()) {
    size_t slash = path.find('/', start);
    if (slash == std::string::npos) slash = path.size();
    if (slash > start) {
      if (at == nullptr || !at->dir) return nullptr;
      auto it = at->children.find(std::string_view(path).substr(start, slash - start));
      at = it == at->children.end() ? nullptr : it->second;
    }
    start = slash + 1;
  }
  return at;
}

inline constexpr size_t kTrackerMax = 4096;  // a tracker is a small file

// A file of a tree, outside any checkpoint, small: a tracker.
inline bool IsTracker(const MemoryTier::Node& n) {
  if (n.dir || n.parent == nullptr || n.size == 0 || n.size > kTrackerMax ||
      CommitKindOf(n.name) != CommitKind::kNone || IsCheckpointFileName(n.name)) {
    return false;
  }
  for (const MemoryTier::Node* a = n.parent; a->parent != nullptr; a = a->parent) {
    if (a->committed != 0 || a->replicating || a->unreplicated) return false;
    for (const auto& [name, c] : a->children) {
      if (!c->dir && (IsCheckpointFileName(name) || CommitKindOf(name) != CommitKind::kNone)) {
        return false;
      }
    }
  }
  return true;
}

// The trackers of tree `tree` naming checkpoint `name`: they go when it goes (evicted,
// dropped for room, lost), so that none names what is no longer served (G4).
inline std::vector<MemoryTier::Node*> TrackersNaming(
    const std::map<uint64_t, std::unique_ptr<MemoryTier::Node>>& nodes, uint64_t tree,
    std::string_view name, uint64_t block_bytes) {
  std::vector<MemoryTier::Node*> trackers;
  for (const auto& [id, n] : nodes) {
    if (n->tree == tree && IsTracker(*n) &&
        NamesCheckpoint(Content(*n, kTrackerMax, block_bytes), std::string(name))) {
      trackers.push_back(n.get());
    }
  }
  return trackers;
}

// Directory `moved` of a tree was renamed from `from` to `to` (paths in the tree), here or,
// mirrored, on another node: with peers every node renames it (its writers' units with it).
// The other nodes' files listed here follow their writers' units, and what was on its way
// to a holder, or being gathered, under the old name is queued again under the new one (the
// jobs of the old name find nothing there: HandedOver and GatherFailed leave it alone).
inline void FollowMove(const std::map<uint64_t, std::unique_ptr<MemoryTier::Node>>& nodes,
                       MemoryTier::Node* moved, const std::string& from, const std::string& to,
                       MemoryReplication* replication) {
  for (const auto& [id, m] : nodes) {
    if (m->tree != moved->tree || !m->remote) continue;
    if (auto unit = path::Rebase(m->remote->unit, from, to)) m->remote->unit = *unit;
  }
  if (replication == nullptr) return;
  const std::string tree = RootOf(moved)->tree_path;
  std::vector<MemoryTier::Node*> todo = {moved};
  while (!todo.empty()) {
    MemoryTier::Node* m = todo.back();
    todo.pop_back();
    for (const auto& [name, c] : m->children) todo.push_back(c);
    if (m->gathering) {
      replication->Gather(tree, TreePathOf(*m), m->seq);
    } else if (m->replicating || (IsTracker(*m) && m->seq != 0)) {
      replication->Replicate(tree, TreePathOf(*m), m->dir, m->seq);
    }
  }
}

}  // namespace ckptfs::store
