// Namespace: the application's view of the mount, and the parts that keep it.
//
// It builds the parts over one node table and routes nothing itself: the facade
// (fs/filesystem.h) calls the part that owns an operation.
//   fs/namespace/node_table.h       NodeTable: the inode table, the overlay (the application's
//                         view = backing store + pending journal entries), link groups,
//                         getattr; its lock and the locking rule are there;
//   fs/namespace/write_states.h     WriteStates: create, open, write, flush, release, truncate,
//                         publish, discard, staging pressure;
//   fs/namespace/posix_ops.h        PosixOps: setattr (ownership, permissions, times, size), hard
//                         links, fallocate;
//   fs/namespace/journal_events.h   JournalEvents: publication's observer;
//   fs/namespace/gone_dirs.h        GoneDirs: lets go of checkpoints another node removed;
//   fs/namespace/namespace_report.h NamespaceReport: what the control tree reads.
// Namespace itself holds the operations on names: lookup, forget, mkdir, symlink, mknod,
// readlink, unlink, rmdir, rename, opendir. They may call the table and the write states
// (the discard of an unlinked file's unpublished bytes; the empty file of a mknod).
//
// Thread-safe. Takes the table's lock (TableLock) for in-memory work and the journal append, never across
// backing-store I/O: listings and stats run before it (ProbeName, LoadDir), the readlink
// of a symlink after it (see fs/namespace/node_table.h).
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "fs/fs_types.h"
#include "fs/namespace/gone_dirs.h"
#include "fs/namespace/handle.h"
#include "fs/namespace/journal_events.h"
#include "fs/namespace/kernel_cache.h"
#include "fs/namespace/namespace_report.h"
#include "fs/namespace/node_table.h"
#include "fs/namespace/posix_access.h"
#include "fs/namespace/posix_ops.h"
#include "fs/namespace/write_states.h"

namespace ckptfs::fs {

class Namespace {
 public:
  // Stats the backing root for the root node. `config` and the parts must outlive it.
  static Result<std::unique_ptr<Namespace>> Create(const FsConfig& config, const FsParts& parts);
  Namespace(const Namespace&) = delete;
  Namespace& operator=(const Namespace&) = delete;

  NodeTable& table() { return table_; }
  WriteStates& writes() { return writes_; }
  PosixOps& posix() { return posix_; }
  JournalEvents& events() { return events_; }
  GoneDirs& gone() { return gone_; }
  KernelCache& kernel() { return kernel_; }
  NamespaceReport& report() { return report_; }

  // On namespace inodes only (the facade routes the others). Operations that create names
  // or check ownership take the `caller`; see fs/filesystem.h.
  Result<Entry> NodeLookup(uint64_t parent, const std::string& name) EXCLUDES(table_.mu());
  void Forget(uint64_t ino, uint64_t nlookup) EXCLUDES(table_.mu());
  // The attribute timeout of a getattr/setattr reply for `ino` (0 for hard-linked names).
  double AttrTimeout(uint64_t ino) EXCLUDES(table_.mu());
  Result<Entry> Mkdir(uint64_t parent, const std::string& name, mode_t mode,
                      const Caller& caller = {}) EXCLUDES(table_.mu());
  Result<Entry> Symlink(const std::string& target, uint64_t parent, const std::string& name,
                        const Caller& caller = {}) EXCLUDES(table_.mu());
  Result<Entry> Mknod(uint64_t parent, const std::string& name, mode_t mode, dev_t rdev,
                      const Caller& caller = {}) EXCLUDES(table_.mu());
  Result<std::string> Readlink(uint64_t ino) EXCLUDES(table_.mu());
  Status Unlink(uint64_t parent, const std::string& name, const Caller& caller = {})
      EXCLUDES(table_.mu());
  Status Rmdir(uint64_t parent, const std::string& name, const Caller& caller = {})
      EXCLUDES(table_.mu());
  Status Rename(uint64_t parent, const std::string& name, uint64_t new_parent,
                const std::string& new_name, unsigned flags, const Caller& caller = {})
      EXCLUDES(table_.mu());
  Result<Handle*> NodeOpenDir(uint64_t ino) EXCLUDES(table_.mu());

 private:
  Namespace(const FsConfig& config, const FsParts& parts, std::unique_ptr<NodeTable> table);
  // Mkdir, Symlink and Mknod of a special file: a new name owned by `caller`, journaled
  // (and applied first in strict mode). `mode` holds the S_IF* type.
  Result<Entry> MakeNode(uint64_t parent, const std::string& name, NodeType type, mode_t mode,
                         const std::string& link_target, dev_t rdev, const Caller& caller)
      EXCLUDES(table_.mu());
  // Mknod of a regular file: an empty file, published like a created one.
  Result<Entry> MakeEmptyFile(uint64_t parent, const std::string& name, mode_t mode,
                              const Caller& caller) EXCLUDES(table_.mu());
  // With peers: waits until journal entry `seq` (a mkdir) is applied (see MakeNode).
  void WaitForOtherNodes(uint64_t seq) EXCLUDES(table_.mu());

  const FsConfig& config_;
  store::BackingDir* const backing_;
  store::Publication* const publication_;
  const std::unique_ptr<NodeTable> own_table_;
  NodeTable& table_;
  WriteStates writes_;
  PosixOps posix_;
  KernelCache kernel_;
  GoneDirs gone_;
  JournalEvents events_;
  NamespaceReport report_;
};

}  // namespace ckptfs::fs
