// GoneDirs: lets the mount forget checkpoint directories another node removed.
//
// A node that writes shards only (its ranks write into a checkpoint whose `.metadata`
// another node publishes) never sees the rotation's `rm -r`: it runs on the other node,
// and neither this node's kernel nor its node table hears of it. Each checkpoint left a
// directory node with its files in the table, and the kernel's entries for them, for the
// daemon's life (the two-node soak's peer: +3,700 nodes, +2.7 MiB an hour).
//
// Publication's sweep tells it which checkpoints are gone from the backing store
// (PublicationObserver::OnRemovedElsewhere). A directory nothing uses here (no write
// state, open handle or pending entry below it) is marked, and the kernel is told to drop
// its entry (KernelCache). Once the
// kernel has forgotten every inode of it (FORGET; Namespace::Forget calls OnForgotten),
// no request can name them any more, and the directory leaves the table if a fresh stat
// still finds it gone. A lookup of the name then asks the backing store again, as for any
// name absent from the view.
//
// Races. Nothing is taken out while the kernel holds a reference into it: a request
// resolved through a cached entry would find its inode gone (a 5-minute two-node soak of
// the first version, which detached at once, failed a re-saved directory's write with
// ENOENT). The stat runs without the table's lock; the directory is taken out only if no
// lookup or probe ran in its parent meanwhile (Node::lookups), so a stat that found the
// name made again (by the other node, for the next save into it) is never overruled by an
// older one. A directory found again is unmarked.
//
// Thread-safe. Takes the table's lock (TableLock) briefly; the stat runs without it.
#pragma once

#include <cstdint>
#include <string>

#include "fs/fs_types.h"
#include "fs/namespace/kernel_cache.h"
#include "fs/namespace/node_table.h"

namespace ckptfs::fs {

class GoneDirs {
 public:
  // `table`, `kernel` and the parts' backing dir, publication and stats must outlive it.
  GoneDirs(const FsParts& parts, NodeTable& table, KernelCache& kernel);
  GoneDirs(const GoneDirs&) = delete;
  GoneDirs& operator=(const GoneDirs&) = delete;

  // Checkpoint directory `dir` is gone from the backing store and nothing of it is queued
  // here (Publication::ForgetVanishedCheckpoints).
  void OnRemovedElsewhere(const std::string& dir) EXCLUDES(table_.mu());
  // The kernel's last reference to inode `ino` went.
  void OnForgotten(uint64_t ino) EXCLUDES(table_.mu());

 private:
  // Takes marked directory `ino` out of the table if the kernel names nothing in it, nothing
  // is in use or pending, and a stat finds it still gone; unmarks it if found again.
  void Evict(uint64_t ino) EXCLUDES(table_.mu());

  NodeTable& table_;
  store::BackingDir* const backing_;
  store::Publication* const publication_;
  FsStats* const stats_;
  store::Loader* const loader_;  // may be null (tests)
  KernelCache& kernel_;
};

}  // namespace ckptfs::fs
