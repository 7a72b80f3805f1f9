// MemoryView (issue 42): the mount's operations inside memory-only trees, translated into
// store::MemoryTier calls. Translation only: the tree, its bytes, commits and evictions live
// in store/memory/memory_tier.h.
//
// A tree is a namespace directory marked `user.ckptfs.tier=memory`. The mark is an xattr of
// its backing directory (set through the mount on an empty directory, once it is on the
// backing store), so it survives restarts; whether a directory is marked is read from the
// backing store once per inode and remembered. The marked directory stays a namespace node;
// every name below it is one of this view's inodes, never on the backing store. Renames
// between a tree and anything else are kCrossDevice (EXDEV).
//
// Thread-safe.
#pragma once

#include <sys/stat.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>

#include "common/mutex.h"
#include "common/status.h"
#include "fs/fs_types.h"
#include "fs/namespace/handle.h"
#include "fs/namespace/posix_access.h"
#include "store/flush/staged_file.h"
#include "store/memory/memory_tier.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {
class Publication;
}

namespace ckptfs::fs {

class NodeTable;

inline constexpr char kTierXattr[] = "user.ckptfs.tier";

class MemoryView {
 public:
  // Below the tensor view's inodes (TensorView::kFirstIno = 2^48).
  static constexpr uint64_t kFirstIno = 1ull << 47;
  static bool Owns(uint64_t ino) { return ino >= kFirstIno && ino < (1ull << 48); }
  // A tree's first look after a restart waits at most this for the peers' copies (issue 42).
  static constexpr std::chrono::milliseconds kRestoreWait{60000};

  // All must outlive the view.
  MemoryView(store::MemoryTier* tier, store::BackingDir* backing, NodeTable* table,
             store::Publication* publication)
      : tier_(tier), backing_(backing), table_(table), publication_(publication) {}

  // The tier's directory node for `ino`: one of the view's directories, or the root of the
  // tree of a marked namespace directory. nullopt: not in a memory-only tree.
  std::optional<uint64_t> DirOf(uint64_t ino) EXCLUDES(mu_);
  // Whether `ino` is a marked namespace directory whose tree holds names (rmdir refuses it).
  bool MarkedAndBusy(uint64_t ino) EXCLUDES(mu_);
  // The mark: `value` "memory" on an empty namespace directory (kNotEmpty otherwise); an
  // empty `value` removes it from a directory whose tree is empty.
  Status Mark(uint64_t ino, const std::string& value) EXCLUDES(mu_);

  Result<Entry> Lookup(uint64_t dir, const std::string& name);
  Result<struct stat> GetAttr(uint64_t ino);
  Result<struct stat> SetAttr(uint64_t ino, const struct stat& in, int to_set);
  Result<Entry> Mkdir(uint64_t dir, const std::string& name, mode_t mode, const Caller& caller);
  Result<std::pair<Entry, Handle*>> Create(uint64_t dir, const std::string& name, mode_t mode,
                                           int flags, const Caller& caller);
  Result<Handle*> Open(uint64_t ino, int flags);
  Result<Handle*> OpenDir(uint64_t ino);
  Result<size_t> Read(const MemoryHandle& h, char* out, size_t len, uint64_t offset);
  Status Write(MemoryHandle* h, store::ByteSource& src, uint64_t offset);
  void Release(const MemoryHandle& h);
  Status Unlink(uint64_t dir, const std::string& name);
  Status Rmdir(uint64_t dir, const std::string& name);
  Status Rename(uint64_t dir, const std::string& name, uint64_t new_dir,
                const std::string& new_name, unsigned flags);

 private:
  static uint64_t InoOf(uint64_t id) { return kFirstIno + id; }
  static uint64_t IdOf(uint64_t ino) { return ino - kFirstIno; }
  struct stat StatOf(const store::MemAttr& a) const;
  Entry EntryOf(const store::MemAttr& a) const;
  // The marked state of namespace directory `ino` (read from the backing store once).
  bool MarkedLocked(uint64_t ino) REQUIRES(mu_);
  // Drops the entries of inodes the table forgot, once the map has doubled since the last
  // time: every save makes new inodes, and the map grew by each one for the daemon's life
  // (the two-node soak's heap, issue 41).
  void PruneLocked() REQUIRES(mu_);

  store::MemoryTier* const tier_;
  store::BackingDir* const backing_;
  NodeTable* const table_;
  store::Publication* const publication_;
  Mutex mu_;
  std::unordered_map<uint64_t, bool> marked_ GUARDED_BY(mu_);  // namespace inode -> marked
  size_t prune_at_ GUARDED_BY(mu_) = 4096;
};

}  // namespace ckptfs::fs
