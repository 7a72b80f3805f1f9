// PosixOps: ownership, permissions and the other multi-user POSIX operations on names
// the namespace holds: setattr (chown, chmod, utimens, truncate), hard links, fallocate.
//
// It owns no state: it changes nodes of the table (fs/namespace/node_table.h), journals the change
// (or, for a file being written, gives its temp file the new owner and mode), and may
// call the write states (fs/namespace/write_states.h) for a truncate, the publish a link needs
// first, and the copy a fallocate begins. Permission rules are fs/namespace/posix_access.h's.
//
// Thread-safe. Takes the table's lock (TableLock) for in-memory work and the journal
// append (the rule is in fs/namespace/node_table.h); the temp file's owner and mode, a
// truncate, a fallocate, the publish a link needs first and the readlink of a symlink a
// link names run without it and are re-checked under it (RaceRetry,
// fs/namespace/table_lock.h: after kRaceTries lost races, holding the node's I/O token).
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "fs/fs_types.h"
#include "fs/namespace/handle.h"
#include "fs/namespace/node_table.h"
#include "fs/namespace/posix_access.h"
#include "fs/namespace/write_states.h"
#include "store/flush/staged_file.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::fs {

class PosixOps {
 public:
  // The parts, `table` and `writes` must outlive it; it uses the parts' backing store.
  PosixOps(const FsParts& parts, NodeTable& table, WriteStates& writes);
  PosixOps(const PosixOps&) = delete;
  PosixOps& operator=(const PosixOps&) = delete;

  // `to_set` holds FUSE_SET_ATTR_* bits; `handle` is the open file of an ftruncate or
  // null. Returns the attributes after the change.
  Result<struct stat> SetAttr(uint64_t ino, const struct stat& in, int to_set, Handle* handle,
                              const Caller& caller = {}) EXCLUDES(table_.mu());
  Result<Entry> Link(uint64_t ino, uint64_t new_parent, const std::string& new_name,
                     const Caller& caller = {}) EXCLUDES(table_.mu());
  Status Fallocate(Handle* h, int mode, uint64_t offset, uint64_t length) EXCLUDES(table_.mu());

 private:
  // Journals a chown of `node` (for a staged file the caller gives its temp file the
  // owner after the lock: FollowOwnerInTemp); returns the last entry's seq, or 0.
  Result<uint64_t> ChownLocked(Node* node, uid_t uid, gid_t gid) REQUIRES(table_.mu());
  // Gives the temp file of `staged` (the write state of `ino`) the node's owner (with
  // `owner`) and mode, without the lock; again if they changed meanwhile. Nothing when
  // the node has moved on to another version (made with the node's attributes).
  Status FollowOwnerInTemp(uint64_t ino, std::shared_ptr<store::StagedFile> staged, bool owner)
      EXCLUDES(table_.mu());

  NodeTable& table_;
  WriteStates& writes_;
  store::BackingDir* const backing_;
};

}  // namespace ckptfs::fs
