// The nodes of store::MemoryTier (issue 42), shared by its two files: memory_tier.cc
// (the tree, budget, commits) and memory_tier_replication.cc (replication and restore).
// Private to store/memory/.
#pragma once

#include <sys/mman.h>
#include <sys/types.h>

#include <cstdint>
#include <ctime>
#include <map>
#include <memory>
#include <string>

#include "common/path.h"

#include "store/memory/memory_tier.h"

namespace ckptfs::store {

// Keys of trees a restore made before the view looked at their marked directory.
inline constexpr uint64_t kProvisionalTree = 1ull << 63;

// What a tracker file may say about checkpoint directory `name`: its name, or for
// Megatron's `iter_NNNNNNN` directories the iteration number.
inline bool NamesCheckpoint(std::string content, const std::string& name) {
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
};

// The root of `n`'s tree, and `n`'s path in it ("" for the root).
template <typename N>
N* RootOf(N* n) {
  while (n->parent != nullptr) n = n->parent;
  return n;
}

template <typename N>
inline std::string TreePathLocked(const N& n) {
  if (n.parent == nullptr) return "";
  const std::string up = TreePathLocked(*n.parent);
  return up.empty() ? n.name : up + "/" + n.name;
}

}  // namespace ckptfs::store
