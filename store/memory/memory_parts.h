// MemoryParts (issue 42): memory-only checkpoints written by ranks on several nodes.
//
// Each node keeps the files its own ranks wrote (its *part*) in its MemoryTier; the node
// whose ranks wrote the `.metadata` (DCP's coordinator) commits the checkpoint once every
// file the `.metadata` names is in memory on the node that wrote it and each part is
// replicated to one peer (store/peer/memory_replica.h):
//   1. A directory made in a tree is made on the other nodes too (MakeDirs), before the
//      mkdir returns, so ranks elsewhere can create their shards in it.
//   2. The `.metadata` names files not written here (MemoryTier: "gathering"): this node
//      hands its own part to its holder and asks every other node for its part (Seal):
//      that node seals what it holds of the directory at the commit's version, hands it to
//      its own holder, and answers with its files and holder once it is held.
//   3. With every part held, CommitGathered checks the `.metadata`'s files against the
//      files here and in the parts (G5 within memory, across nodes), lists the other
//      nodes' files here as remote files (no bytes: reads go to the writer, or to the
//      holder of its part) and commits (the older checkpoints of the tree are evicted).
//   4. The other nodes are told; each fetches the whole listing (Whole) and applies it
//      (ApplyCommit): the same names, its own part committed, the older ones evicted.
// Nothing of it is written to the backing store.
//
// Thread-safe: every call takes the tier's lock (MemoryParts is its friend).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "store/memory/memory_tier.h"

namespace ckptfs::store {

class MemoryParts {
 public:
  explicit MemoryParts(MemoryTier* tier) : tier_(tier) {}  // must outlive

  // Directory `path` of `tree`, with its parents (another node made it).
  Status MakeDirs(const std::string& tree, const std::string& path);
  // Another node removed directory `path` of `tree`: removed here too, with the committed
  // checkpoints in it (this node's parts and listings of them). kNotEmpty, and nothing
  // removed, when a file in it is no committed checkpoint's (a rank here may be writing
  // it); NotFound-free: a directory not here is already gone.
  Status RemoveDir(const std::string& tree, const std::string& path);
  // Another node renamed directory `from` of `tree` to `to`: renamed here too, with this
  // node's parts in it (the parents of `to` made). Nothing of it here: Ok. kNotEmpty, and
  // nothing renamed, when `to` holds a file here that is no committed checkpoint's.
  Status RenameDir(const std::string& tree, const std::string& from, const std::string& to);
  // This node's part of checkpoint `path` of `tree` at version `seq`: kNotFound when it
  // wrote nothing there. Sealed at `seq` and handed to replication on the first ask; its
  // holder stays empty until a peer holds it; kAborted when no peer took it.
  Result<MemPart> Seal(const std::string& tree, const std::string& path, uint64_t seq);
  // On the `.metadata`'s node, every other part held: commits it when each file the
  // `.metadata` names is here or in `parts` with the length it needs, else refuses it.
  Status CommitGathered(const std::string& tree, const std::string& path, uint64_t seq,
                        const std::vector<MemPart>& parts);
  // A part of committed checkpoint `path` (at `seq`) is gone from its writer and its holder
  // alike: the checkpoint is lost here (removed, never served partly; reported as lost).
  // Also on a node that holds only its own part of it (the `.metadata`'s node told it).
  void Lose(const std::string& tree, const std::string& path, uint64_t seq, const std::string& why);
  // The gather failed (`why`): not committed, the older checkpoints stay.
  void GatherFailed(const std::string& tree, const std::string& path, uint64_t seq,
                    const Status& why);
  // Every file of checkpoint `path` committed at `seq`: those written here as rank `self`.
  Result<std::vector<MemRemoteFile>> Whole(const std::string& tree, const std::string& path,
                                           uint64_t seq, uint32_t self);
  // On another node: checkpoint `path` was committed at `seq` with `files`: listed here
  // (other nodes' files as remote files), committed, the older ones of the tree evicted.
  Status ApplyCommit(const std::string& tree, const std::string& path, uint64_t seq,
                     const std::vector<MemRemoteFile>& files, uint32_t self);

 private:
  // A new file `name` (a path below checkpoint node `n`, not there now) of `size` bytes,
  // with the directories on its way; null where one of them is a file. The caller makes
  // it remote.
  static MemoryTier::Node* PlaceRemoteLocked(MemoryTier* t, MemoryTier::Node* n,
                                             const std::string& name, uint64_t size)
      REQUIRES(t->mu_);

  // Directory `path` below `root` with its parents, made where missing.
  static Result<MemoryTier::Node*> MakeDirsLocked(MemoryTier* t, MemoryTier::Node* root,
                                                  const std::string& path) REQUIRES(t->mu_);

  MemoryTier* const tier_;
};

}  // namespace ckptfs::store
