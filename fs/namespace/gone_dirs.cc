// Letting go of checkpoint directories another node removed (fs/namespace/gone_dirs.h).
#include "fs/namespace/gone_dirs.h"

#include <spdlog/spdlog.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fs/namespace/table_lock.h"
#include "store/load/loader.h"

namespace ckptfs::fs {

namespace {

// Whether anything below `dir` (itself included) passes `f`.
bool AnyBelow(const Node* dir, const std::function<bool(const Node*)>& f) {
  if (f(dir)) return true;
  for (const auto& [name, child] : dir->children) {
    if (AnyBelow(child.get(), f)) return true;
  }
  return false;
}

// In use here: a write state, an open handle or an entry not yet applied below it.
bool InUse(const Node* dir, uint64_t applied) {
  return AnyBelow(dir, [applied](const Node* n) {
    return n->write || n->open_files > 0 || n->pending_seq > applied;
  });
}

// The kernel holds a reference (a lookup not yet forgotten) below it.
bool KernelNames(const Node* dir) {
  return AnyBelow(dir, [](const Node* n) { return n->nlookup > 0; });
}

}  // namespace

GoneDirs::GoneDirs(const FsParts& parts, NodeTable& table, KernelCache& kernel)
    : table_(table),
      backing_(parts.backing),
      publication_(parts.publication),
      stats_(parts.stats),
      loader_(parts.loader),
      kernel_(kernel) {}

void GoneDirs::OnRemovedElsewhere(const std::string& dir) {
  std::optional<std::pair<uint64_t, std::string>> entry;
  uint64_t evict = 0;
  std::vector<std::string> files;
  {
    const uint64_t applied = publication_->view().applied();
    TableLock lock(table_);
    Node* node = table_.LoadedNodeAtLocked(dir);
    if (node == nullptr || node->type != NodeType::kDir || node->parent == nullptr) return;
    // Its files' descriptors the block cache's source keeps (opened to serve a peer's or
    // a load's reads) hold the deleted files' space on the backing store: they go now,
    // not a few at a time on later reads (the two-node soak's peer ended with 24 of them,
    // seed 6001). A read in flight keeps its own.
    for (const auto& [name, child] : node->children) {
      if (child->type == NodeType::kFile) files.push_back(table_.PathLocked(child.get()));
    }
    if (InUse(node, applied)) {
      spdlog::debug("checkpoint {}: removed elsewhere, in use here: kept", dir);
      return;
    }
    node->gone_elsewhere = true;
    if (KernelNames(node)) {
      entry.emplace(node->parent->ino, node->name);
    } else {
      evict = node->ino;
    }
  }
  if (loader_ != nullptr) {
    for (const std::string& f : files) loader_->FileGone(f);
  }
  spdlog::debug("checkpoint {}: removed elsewhere; {}", dir,
                entry ? "the kernel is told to drop its entry" : "leaves the table");
  if (evict != 0) Evict(evict);
  if (entry) kernel_.DropEntry(entry->first, entry->second);
}

void GoneDirs::OnForgotten(uint64_t ino) {
  uint64_t marked = 0;
  {
    TableLock lock(table_);
    std::shared_ptr<Node> node = table_.NodeLocked(ino);
    for (const Node* n = node.get(); n != nullptr; n = n->parent) {
      if (n->gone_elsewhere) {
        // The kernel forgets a directory after everything in it (a child's entry holds its
        // parent's): its files' forgets cost a walk up, not a scan of the whole checkpoint.
        if (n->nlookup == 0 && !KernelNames(n)) marked = n->ino;
        break;
      }
    }
  }
  if (marked != 0) Evict(marked);
}

void GoneDirs::Evict(uint64_t ino) {
  std::string path;
  uint64_t lookups = 0;
  std::shared_ptr<Node> node;
  Node* parent = nullptr;
  // Still a marked directory in the view that neither the kernel nor anything here uses.
  auto evictable = [&]() REQUIRES(table_.mu()) {
    node = table_.NodeLocked(ino);
    if (!node || node->type != NodeType::kDir || !node->gone_elsewhere ||
        node->parent == nullptr) {
      return false;
    }
    parent = node->parent;
    return !KernelNames(node.get()) && !InUse(node.get(), publication_->view().applied()) &&
           table_.ListingCurrentLocked(parent);
  };
  {
    TableLock lock(table_);
    if (!evictable()) return;
    path = table_.PathLocked(node.get());
    lookups = parent->lookups;
  }
  Result<struct stat> st = backing_->Stat(path);  // without the lock
  TableLock lock(table_);
  // A lookup or probe in the parent while the stat ran may have found it made again.
  if (!evictable() || parent->lookups != lookups || table_.PathLocked(node.get()) != path) {
    return;
  }
  if (st.ok()) {
    node->gone_elsewhere = false;  // made again: it lives
    return;
  }
  if (st.status().code() != Code::kNotFound) return;  // marked still: the next forget tries
  table_.DetachLocked(node, /*evicted=*/true);
  stats_->gone_dirs_evicted++;
}

}  // namespace ckptfs::fs
