// WriteStates: the write path of files through the mount.
//
// Owns the write state of every file being written (Node::write, fs/namespace/node.h): the
// copy-on-write begin of a rewrite (plan under the lock, temp file and copy without it,
// install under it), create and open, writes into staging (store/flush/staged_file.h holds the
// bytes), publish, discard of unpublished bytes, release of a file handle, truncate, and
// the live staged files for staging pressure. It may call the node table
// (fs/namespace/node_table.h), publication (temp files, appends), the backing store (the temp
// files) and the key index and read path (an open of a committed checkpoint's file).
//
// Thread-safe. Takes the table's lock (TableLock, fs/namespace/table_lock.h) for in-memory
// work and the journal append (the rule is in fs/namespace/node_table.h); helpers named
// *Locked require it. Without it, on every path: the temp file and copy a write, a create,
// an O_TRUNC open or a truncate begins with (plan, PrepareWrite, install), the open of a
// backing file, the cut of an O_TRUNC open or a truncate of a file being written (it waits
// for the file's flushes), and a publish's freeze of a file whose writer is inside a write
// (store::StagedFile::SealAll waits for it; WriteState::freezing holds off other changes of
// that write state meanwhile, AwaitFreezeLocked). A call that lost kRaceTries races holds
// the node's I/O token for its next tries (RaceRetry), never the table's lock, and never
// fails for a lost race; a publish of that node waits for the token (PublishLocked).
// staged_mu_ (the live staged files) is a leaf.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "fs/fs_stats.h"
#include "fs/fs_types.h"
#include "fs/namespace/handle.h"
#include "fs/namespace/node.h"
#include "fs/namespace/node_table.h"
#include "fs/namespace/posix_access.h"
#include "fs/namespace/table_lock.h"
#include "gpu/staging_pool.h"
#include "store/dcp/key_index.h"
#include "store/flush/staged_file.h"
#include "store/primitives/backing_dir.h"
#include "store/publish/publication.h"

namespace ckptfs::fs {

class WriteStates final : public gpu::StagingPressureListener {
 public:
  // `config`, the parts and `table` must outlive it; it uses their backing, pool,
  // pipeline, publication, index, read and stats.
  WriteStates(const FsConfig& config, const FsParts& parts, NodeTable& table);
  WriteStates(const WriteStates&) = delete;
  WriteStates& operator=(const WriteStates&) = delete;

  // ".ckptfs-tmp.[n<node rank>.]": temp names unique among the daemons sharing the
  // backing dir (store::PublicationOptions::temp_prefix).
  static std::string TempPrefix(const FsConfig& config);

  // ------------------------------------------------------------ FUSE-level operations
  Result<std::pair<Entry, Handle*>> Create(uint64_t parent, const std::string& name, mode_t mode,
                                           int flags, const Caller& caller = {})
      EXCLUDES(table_.mu());
  Result<Handle*> NodeOpen(uint64_t ino, int flags) EXCLUDES(table_.mu());
  Status WriteData(FileHandle* h, store::ByteSource& src, uint64_t offset) EXCLUDES(table_.mu());
  Status FlushData(FileHandle* h) EXCLUDES(table_.mu());
  void ReleaseFile(FileHandle* h) EXCLUDES(table_.mu());
  // Shutdown (G8): queues the publication of every file still open for writing (a lazy
  // unmount); returns how many could not be queued.
  uint64_t PublishOpenFiles() EXCLUDES(table_.mu());
  // gpu::StagingPressureListener: the staging pool is short of chunks; seals idle staged
  // files.
  void RelieveStagingPressure() override EXCLUDES(staged_mu_);

  // ------------------------------------------------------------ for the other parts
  // The parts share one table and its lock, but the analysis names a lock by the path to
  // it: the *Locked methods other parts call take the table whose lock the caller holds
  // (this part's table), so that the analysis proves it held at every call.
  // The temp file's owner and mode (without the lock).
  Status OwnTemp(uid_t uid, gid_t gid, mode_t mode, int fd);
  // Drops the unpublished bytes of `node` (named `path`, or unnamed): its temp file is
  // removed in journal order; open handles keep reading them; it is never published.
  static Result<uint64_t> DiscardLocked(NodeTable& table, Node* node, const std::string& path)
      REQUIRES(table.mu());
  // Forgets the write state of a fully published file, keeping its size.
  static void DropWriteStateLocked(NodeTable& table, Node* node) REQUIRES(table.mu());
  // Queues the publication of `node`'s staged contents (node->write->needs_publish);
  // returns the entry's seq. It first waits for a call holding the node's I/O token
  // (RaceRetry; not when this thread holds one), and freezing the contents may wait for a
  // write in progress: then the lock is released meanwhile (the caller re-checks what it
  // read before), and the result is the seq of a publish queued meanwhile, or 0 if the
  // file was unlinked (discarded) or published and dropped meanwhile.
  Result<uint64_t> PublishLocked(NodeTable& table, Node* node) REQUIRES(table.mu());
  // The staged file a write through `h` goes to, beginning a copy when needed; `race` is
  // the caller's (its lost races count here too, and its I/O token is kept).
  Result<std::shared_ptr<store::StagedFile>> WritableStaged(FileHandle* h, RaceRetry& race)
      EXCLUDES(table_.mu());
  // Truncate (or extend) file `ino` to `size`: a new version first if its contents are
  // not being written (a copy from `from`'s descriptor, if it is an ftruncate of a handle
  // opened before any write, else from its backing path), all I/O without the lock
  // (RaceRetry). Publishes it when no handle writes it; returns that entry's seq, or 0.
  Result<uint64_t> Resize(uint64_t ino, uint64_t size, const FileHandle* from)
      EXCLUDES(table_.mu());

 private:
  // A write's copy in three steps, so that it is begun without holding the lock across
  // its I/O: what to copy (under the lock), the temp file and the copy (no
  // lock: RegisterTemp's synced write, open, owner, the wait for the previous version's
  // flushes, copy_file_range), and its installation (under the lock, after the caller
  // checked that the node is still as planned; else AbandonWrite).
  struct WritePlan {
    uint64_t id = 0;
    std::string temp_name;  // at the backing root
    uid_t uid = 0;
    gid_t gid = 0;
    mode_t mode = 0;
    bool truncate = false;
    bool retainable = false;            // a checkpoint file's name: the retained tier may keep it
    uint64_t prev_file_id = 0;          // the write state it starts from, 0 if none
    std::shared_ptr<store::StagedFile> prev;   // copy from its (settled) temp file,
    int src_fd = -1;                    // or from this open backing file (borrowed),
    std::string src_path;               // or from this backing path
  };
  WritePlan PlanWriteLocked(Node* node, bool truncate, const UniqueFd* src) REQUIRES(table_.mu());
  Result<std::unique_ptr<WriteState>> PrepareWrite(const WritePlan& plan);
  void AbandonWrite(const WriteState& ws);
  void InstallWriteLocked(Node* node, std::unique_ptr<WriteState> ws) REQUIRES(table_.mu());
  // The node is still as `plan` found it: same version, not being written meanwhile, same
  // owner and mode, no error. Else the prepared write is abandoned.
  bool PlanHoldsLocked(const Node& node, const WritePlan& plan) const REQUIRES(table_.mu());
  // Returns whether the node's write state was dropped (then RefreshAttr it).
  bool ReleaseFileLocked(FileHandle* h) REQUIRES(table_.mu());
  // Node::error_told, the last handle closed: the failure is cleared when the backing store
  // still has a file at the name (stat'ed without the lock); the caller then RefreshAttrs.
  void ShowBackingAfterToldFailure(Node* node) EXCLUDES(table_.mu());
  // Waits, the lock released meanwhile, while a publish freezes `node`'s write state
  // (WriteState::freezing); the caller re-checks the node after.
  void AwaitFreezeLocked(const Node* node) REQUIRES(table_.mu());

  // ------------------------------------------------------------ dependencies (borrowed)
  const FsConfig& config_;
  NodeTable& table_;
  store::BackingDir* const backing_;
  store::Publication* const publication_;
  store::Loader* const loader_;
  FsStats* const stats_;
  const store::StagingContext staging_ctx_;

  // Signalled, with the table's lock held, when a file's freeze for publication ends
  // (WriteState::freezing; AwaitFreezeLocked waits for it).
  std::condition_variable frozen_cv_;

  // Every staged file not yet destroyed, for staging pressure.
  Mutex staged_mu_;
  std::set<std::weak_ptr<store::StagedFile>, std::owner_less<std::weak_ptr<store::StagedFile>>> live_staged_
      GUARDED_BY(staged_mu_);
  size_t staged_sweep_at_ GUARDED_BY(staged_mu_) = 256;  // live_staged_'s size at the next sweep
};

}  // namespace ckptfs::fs
