// JournalEvents: the mount's side of publication (store::PublicationObserver).
//
// What the commit gate and the shard states ask about files written here (written or
// pending locally, rewritten since an entry, a rank's commit pending), and what the node
// table, the write states and the stats learn when an entry is done or publication halts
// (store/publish/publication.h). It owns no state: it reads and changes
// nodes of the table (fs/namespace/node_table.h) and drops the write state of a published file
// (fs/namespace/write_states.h).
//
// Thread-safe. Runs on the journal's thread (questions also on a peer's query thread);
// takes the table's lock (TableLock) briefly, never calls back into publication.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "fs/fs_stats.h"
#include "fs/fs_types.h"
#include "fs/namespace/gone_dirs.h"
#include "fs/namespace/kernel_cache.h"
#include "fs/namespace/node_table.h"
#include "fs/namespace/write_states.h"
#include "store/publish/journal.h"
#include "store/publish/publication.h"

namespace ckptfs::fs {

class JournalEvents final : public store::PublicationObserver {
 public:
  // The parts, `table`, `writes`, `gone` and `kernel` must outlive it; it uses the parts'
  // stats.
  JournalEvents(const FsParts& parts, NodeTable& table, WriteStates& writes, GoneDirs& gone,
                KernelCache& kernel);
  JournalEvents(const JournalEvents&) = delete;
  JournalEvents& operator=(const JournalEvents&) = delete;

  bool WrittenLocally(const std::string& path) override EXCLUDES(table_.mu());
  bool RewrittenSince(const std::string& path, uint64_t seq) override EXCLUDES(table_.mu());
  bool PendingLocally(const std::string& path) override EXCLUDES(table_.mu());
  bool RankCommitPending(const std::string& path, uint64_t seq) override EXCLUDES(table_.mu());
  void OnOutcome(const store::JournalEntry& e, const Status& st) override EXCLUDES(table_.mu());
  void OnHalted(const store::JournalEntry& e, const Status& st) override EXCLUDES(table_.mu());
  // To GoneDirs, which lets the directory go once the kernel forgets it.
  void OnRemovedElsewhere(const std::string& dir) override { gone_.OnRemovedElsewhere(dir); }
  // A save of checkpoint `dir` committed: the files in it this mount did not write may be
  // new versions other nodes wrote (the directory saved again). Each one the table holds
  // is stat'ed; one that changed takes the new attributes, and the kernel drops its
  // cached attributes and pages. Before, a load through this node read the old size (a
  // committed checkpoint's attributes are kept for an hour): EOF in the two-node soak.
  void OnCommitSeen(const std::string& dir, uint64_t seq) override EXCLUDES(table_.mu());

 private:
  // The node's side of a publish entry's outcome; returns the inode whose write state
  // was dropped (to RefreshAttr), or 0.
  uint64_t NodePublishDone(const store::JournalEntry& e, const Status& st) EXCLUDES(table_.mu());

  NodeTable& table_;
  WriteStates& writes_;
  GoneDirs& gone_;
  KernelCache& kernel_;
  FsStats* const stats_;
};

}  // namespace ckptfs::fs
