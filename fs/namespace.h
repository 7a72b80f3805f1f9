// Namespace: the application's view of the mount and the write path of its files.
//
// It owns the inode table, the overlay (the application's view = backing store + pending
// journal entries), link groups, the write states of files being written (begin, publish,
// discard, release; staging pressure) and publication's observer (what it asks about
// files written here and tells about their entries: store/publish/publication.h). The
// facade (fs/filesystem.h) routes every call on a namespace inode or file handle here.
// Its code is spread by concern:
//   fs/namespace.cc       inodes, the overlay, lookup/getattr/setattr, mkdir, unlink,
//                         rmdir, rename, readdir;
//   fs/posix_ops.cc       ownership, mknod, hard links, fallocate;
//   fs/write_path.cc      copy-on-write begin, create/open, write, flush, publish, discard,
//                         release, staging pressure (fs/staged_file.h holds the bytes);
//   fs/journal_events.cc  store::PublicationObserver: the write states' side of an entry;
//   fs/namespace_report.cc what it tells the control tree (fs/namespace_view.h).
// The namespace and the write path share one lock and the write states of the nodes by
// design: a write begins a copy, a publish freezes it, a rename moves it, all in the
// journal's order.
//
// Thread-safe. Locking rule (written on the members below):
//   * ns_mu_ guards the namespace (inode table, tree, write states, link groups). It is
//     held for in-memory work and for the journal append that orders a namespace change
//     (the journal's order must be the namespace's: a RocksDB Put, not synced; the
//     checkpoint registry's notes of the entry, store::Publication::Append). Backing-store
//     I/O runs without it: stats and listings (ProbeName, LoadDir, RefreshAttr,
//     NodeOpenDir), the open of a backing file (NodeOpen), the temp file and copy a write,
//     a create or a truncate begins with (PlanWriteLocked / PrepareWrite /
//     InstallWriteLocked), a truncate's wait for flushes and ftruncate (Resize), fallocate,
//     and the owner and mode of a staged file's temp (FollowOwnerInTemp), each re-checked
//     under the lock before its result is used (RaceRetry, fs/fs_util.h). Still under it:
//     the fallbacks after kRaceTries lost races (a write's or a create's copy, an open),
//     an O_TRUNC open of a file another handle is writing, the readlink a hard link of a
//     symlink makes, and PublishOpenFiles at shutdown.
//   * read() and write() of an open file never take ns_mu_ unless the write begins a new
//     copy of the file (its first write, or the first after a publish froze it): they take
//     its node's data_mu (fs/node.h), a leaf held to copy a few fields.
//   * Nothing waits on the pipeline or the journal (Settled, WaitUnlessHalted) with
//     ns_mu_ held, except a publish freezing a file whose writer waits for staging space
//     (StagedFile::SealAll takes the writer lock) and the fallbacks above.
//   Lock order: ns_mu_ -> Node::data_mu -> StagedFile locks -> staged_mu_; publication's
//   locks (its journal's Append, the registry) after ns_mu_; FsStats::error_mu is a leaf.
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "fs/fs_stats.h"
#include "fs/fs_types.h"
#include "fs/handle.h"
#include "fs/namespace_view.h"
#include "fs/node.h"
#include "fs/posix_access.h"
#include "fs/read_path.h"
#include "fs/staged_file.h"
#include "gpu/staging_pool.h"
#include "store/primitives/backing_dir.h"
#include "store/flush/flush_pipeline.h"
#include "store/publish/journal.h"
#include "store/publish/publication.h"
#include "store/dcp/key_index.h"

namespace ckptfs::fs {

class Namespace final : public NamespaceView, public store::PublicationObserver {
 public:
  // Stats the backing root for the root node. `config` and the parts must outlive it; it
  // uses their backing, checkpoints, pool, pipeline, journal, index, read and stats.
  static Result<std::unique_ptr<Namespace>> Create(const FsConfig& config, const FsParts& parts);
  Namespace(const Namespace&) = delete;
  Namespace& operator=(const Namespace&) = delete;

  // ------------------------------------------------------------ FUSE-level operations
  // On namespace inodes and file handles only (the facade routes the others). Operations
  // that create names or check ownership take the `caller`; see fs/filesystem.h.
  Result<Entry> NodeLookup(uint64_t parent, const std::string& name) EXCLUDES(ns_mu_);
  void Forget(uint64_t ino, uint64_t nlookup) EXCLUDES(ns_mu_);
  Result<struct stat> NodeGetAttr(uint64_t ino) EXCLUDES(ns_mu_);
  Result<struct stat> SetAttr(uint64_t ino, const struct stat& in, int to_set, Handle* handle,
                              const Caller& caller = {}) EXCLUDES(ns_mu_);
  Result<Entry> Mkdir(uint64_t parent, const std::string& name, mode_t mode,
                      const Caller& caller = {}) EXCLUDES(ns_mu_);
  Result<Entry> Symlink(const std::string& target, uint64_t parent, const std::string& name,
                        const Caller& caller = {}) EXCLUDES(ns_mu_);
  Result<Entry> Mknod(uint64_t parent, const std::string& name, mode_t mode, dev_t rdev,
                      const Caller& caller = {}) EXCLUDES(ns_mu_);
  Result<Entry> Link(uint64_t ino, uint64_t new_parent, const std::string& new_name,
                     const Caller& caller = {}) EXCLUDES(ns_mu_);
  Status Fallocate(Handle* h, int mode, uint64_t offset, uint64_t length) EXCLUDES(ns_mu_);
  Result<std::string> Readlink(uint64_t ino) EXCLUDES(ns_mu_);
  Status Unlink(uint64_t parent, const std::string& name, const Caller& caller = {})
      EXCLUDES(ns_mu_);
  Status Rmdir(uint64_t parent, const std::string& name, const Caller& caller = {})
      EXCLUDES(ns_mu_);
  Status Rename(uint64_t parent, const std::string& name, uint64_t new_parent,
                const std::string& new_name, unsigned flags, const Caller& caller = {})
      EXCLUDES(ns_mu_);
  Result<std::pair<Entry, Handle*>> Create(uint64_t parent, const std::string& name, mode_t mode,
                                           int flags, const Caller& caller = {})
      EXCLUDES(ns_mu_);
  Result<Handle*> NodeOpen(uint64_t ino, int flags) EXCLUDES(ns_mu_);
  Result<Handle*> NodeOpenDir(uint64_t ino) EXCLUDES(ns_mu_);
  Status WriteData(FileHandle* h, ByteSource& src, uint64_t offset) EXCLUDES(ns_mu_);
  Status FlushData(FileHandle* h) EXCLUDES(ns_mu_);
  void ReleaseFile(FileHandle* h) EXCLUDES(ns_mu_);
  // The attribute timeout of a getattr/setattr reply for `ino` (0 for hard-linked names).
  double AttrTimeout(uint64_t ino) EXCLUDES(ns_mu_);

  // Logs `st` when it reaches the application as EIO (ino, path, offset; rate-limited) and
  // returns it.
  Status LogIfIo(const char* op, uint64_t ino, uint64_t offset, Status st) EXCLUDES(ns_mu_);
  // Shutdown (G8): queues the publication of every file still open for writing (a lazy
  // unmount); returns how many could not be queued.
  uint64_t PublishOpenFiles() EXCLUDES(ns_mu_);

  // ------------------------------------------------------------ PublicationObserver
  // (journal_events.cc) What publication asks about files written here and tells about
  // their entries; see store/publish/publication.h.
  bool WrittenLocally(const std::string& path) override EXCLUDES(ns_mu_);
  bool RewrittenSince(const std::string& path, uint64_t seq) override EXCLUDES(ns_mu_);
  bool PendingLocally(const std::string& path) override EXCLUDES(ns_mu_);
  bool RankCommitPending(const std::string& path, uint64_t seq) override EXCLUDES(ns_mu_);
  void OnOutcome(const store::JournalEntry& e, const Status& st,
                 const store::PublishOutcome& outcome) override EXCLUDES(ns_mu_);
  void OnHalted(const store::JournalEntry& e, const Status& st) override EXCLUDES(ns_mu_);
  // The node at `path` (relative to the root) in the in-memory tree, or null: no I/O, so a
  // name this mount never loaded was not written through it.
  Node* LoadedNodeAtLocked(const std::string& path) REQUIRES(ns_mu_);
  // ".ckptfs-tmp.[n<node rank>.]": temp names unique among the daemons sharing the
  // backing dir (store::PublicationOptions::temp_prefix).
  static std::string TempPrefix(const FsConfig& config);
  // The staging pool's pressure callback: seals idle staged files.
  void RelieveStagingPressure() EXCLUDES(staged_mu_);

  // ------------------------------------------------------------ NamespaceView (progress.cc)
  Result<std::string> PathOf(uint64_t ino) override EXCLUDES(ns_mu_);
  Result<std::string> DirPathOf(uint64_t ino) override EXCLUDES(ns_mu_);
  Counts CountNodes() override EXCLUDES(ns_mu_);
  std::string ProgressJson(uint64_t ino) override EXCLUDES(ns_mu_);

 private:
  Namespace(const FsConfig& config, const FsParts& parts);
  void NoteError(const std::string& msg) { stats_->NoteError(msg); }
  // Entry/attr timeout for `node` (long for files of committed checkpoints).
  double TimeoutFor(const Node& node) const REQUIRES(ns_mu_);

  // ------------------------------------------------------------ namespace (namespace.cc)
  // Mkdir, Symlink and Mknod of a special file: a new name owned by `caller`, journaled
  // (and applied first in strict mode). `mode` holds the S_IF* type.
  Result<Entry> MakeNode(uint64_t parent, const std::string& name, NodeType type, mode_t mode,
                         const std::string& link_target, dev_t rdev, const Caller& caller)
      EXCLUDES(ns_mu_);
  // Mknod of a regular file: an empty file, published like a created one.
  Result<Entry> MakeEmptyFile(uint64_t parent, const std::string& name, mode_t mode,
                              const Caller& caller) EXCLUDES(ns_mu_);
  // Journals a chown of `node` (and applies it to its temp file when staged), then the
  // mode a chown leaves.
  Result<uint64_t> ChownLocked(Node* node, uid_t uid, gid_t gid) REQUIRES(ns_mu_);
  // Gives the temp file of `staged` (the write state of `ino`) the node's owner (with
  // `owner`) and mode, without ns_mu_; again if they changed meanwhile. Nothing when the
  // node has moved on to another version (made with the node's attributes).
  Status FollowOwnerInTemp(uint64_t ino, std::shared_ptr<StagedFile> staged, bool owner)
      EXCLUDES(ns_mu_);
  // `node` loses a name: the other names of its link group count one link less. Journal
  // entry `seq` makes that true on the backing store: until then the others' attributes
  // are not refreshed from it.
  void UnlinkPeersLocked(Node* node, uint64_t seq) REQUIRES(ns_mu_);
  // Gives the other names of `node`'s link group its inode attributes (one inode), as
  // entry `seq` will on the backing store.
  void SyncPeersLocked(const Node* node, uint64_t seq) REQUIRES(ns_mu_);
  std::shared_ptr<Node> NodeLocked(uint64_t ino) REQUIRES(ns_mu_);
  // Directory `ino`, loaded (EnsureLoadedLocked); kNotDir, naming `name`, for anything else.
  Result<std::shared_ptr<Node>> LoadedDirLocked(uint64_t ino, const std::string& name)
      REQUIRES(ns_mu_);
  std::string PathLocked(const Node* node) const REQUIRES(ns_mu_);
  std::string TempPathLocked(const WriteState& ws) const REQUIRES(ns_mu_);
  Status EnsureLoadedLocked(Node* dir) REQUIRES(ns_mu_);
  std::shared_ptr<Node> NewNodeLocked(Node* parent, const std::string& name, NodeType type)
      REQUIRES(ns_mu_);
  // The child `name` of `dir` in the mount's view; no I/O (ProbeName refreshes it first).
  std::shared_ptr<Node> ChildLocked(Node* dir, const std::string& name) REQUIRES(ns_mu_);
  // Loads directory `ino` from the backing store if it is not loaded yet: the listing and
  // the stats run without ns_mu_, the result is merged under it if the directory is still
  // at the path listed. EnsureLoadedLocked is the fallback, under the lock, for a
  // directory that was moved meanwhile or that no operation loaded first.
  Status LoadDir(uint64_t ino) EXCLUDES(ns_mu_);
  // LoadDir of the child directory `name` of `dir_ino`, if there is one.
  Status LoadChildDir(uint64_t dir_ino, const std::string& name) EXCLUDES(ns_mu_);
  // Before an operation on `dir_ino`/`name` takes ns_mu_: loads the directory and brings
  // the mount's view of the name up to date with the backing store (a published name
  // removed there is gone; a name created there appears), with the stat outside the lock.
  // The result is applied only if nothing changed meanwhile through the mount.
  Status ProbeName(uint64_t dir_ino, const std::string& name) EXCLUDES(ns_mu_);
  std::shared_ptr<Node> AddBackingChildLocked(Node* dir, const std::string& name,
                                              const struct stat& st) REQUIRES(ns_mu_);
  // Refreshes the attributes of `ino` from a stat of its backing path (taken without
  // ns_mu_) while nothing of it is pending.
  void RefreshAttr(uint64_t ino) EXCLUDES(ns_mu_);
  // Takes the attributes of `node` from a stat of its backing path, keeping the ones the
  // mount owns (Node::own_attrs) while the backing inode shows only this mount's changes.
  void ApplyBackingStatLocked(Node* node, const struct stat& st) REQUIRES(ns_mu_);
  // The mount changed `node` on the backing store (a journal entry): its backing times
  // will move, its attributes through the mount stay as they are.
  void OwnAttrsLocked(Node* node) REQUIRES(ns_mu_);
  // A user operation changed the entries of `dir`: mtime and ctime now, nlink by `links`.
  void TouchDirLocked(Node* dir, int links) REQUIRES(ns_mu_);
  bool QuiescentLocked(const Node* node) const REQUIRES(ns_mu_);
  // The last pending rename of `node` or an ancestor (its backing path is stale until
  // then), or 0.
  uint64_t PendingRenameLocked(const Node* node) const REQUIRES(ns_mu_);
  void DetachLocked(const std::shared_ptr<Node>& node) REQUIRES(ns_mu_);
  Result<uint64_t> AppendLocked(store::JournalEntry entry, Node* node) REQUIRES(ns_mu_);
  Entry EntryLocked(Node* node) REQUIRES(ns_mu_);
  bool CommittedDirLocked(const Node* dir) const REQUIRES(ns_mu_);
  // Waits (without locks) until every pending rename among `node`'s ancestors is applied.
  // Fails (with the halt's error) if publication is halted before that rename.
  Status WaitForAncestorsUnlocked(uint64_t ino) EXCLUDES(ns_mu_);
  Status WaitIfStrict(Result<uint64_t> seq) EXCLUDES(ns_mu_);
  // With peers: waits until journal entry `seq` (a mkdir) is applied (see MakeNode).
  void WaitForOtherNodes(uint64_t seq) EXCLUDES(ns_mu_);
  // Mirrors node->write and node->error into node->data for the data path; called after
  // every change of either.
  void SyncDataLocked(Node* node) REQUIRES(ns_mu_);
  // Takes the time of the latest write (recorded by the data path) into node->attr;
  // called before node->attr's times are read or set.
  void FoldWriteTimeLocked(Node* node) REQUIRES(ns_mu_);
  // A name loaded from the backing store with several links joins the group of the
  // other names of its backing inode.
  void AdoptLinkGroupLocked(Node* node, const struct stat& st) REQUIRES(ns_mu_);
  // The live names of `group` other than `except`; forgets dead ones.
  std::vector<std::shared_ptr<Node>> LinkPeersLocked(uint64_t group, const Node* except)
      REQUIRES(ns_mu_);

  // ------------------------------------------------------------ write path (write_path.cc)
  // Starts writing a file: a new temp file, filled with the current contents unless
  // `truncate`: those of its write state, else of `src` (an open backing file of the current
  // version, or null), else of its backing path. The copy is copy_file_range, a reflink
  // where the backing file system shares extents (XFS, btrfs), so only changed blocks
  // are written.
  Status BeginWriteLocked(Node* node, bool truncate, const UniqueFd* src = nullptr)
      REQUIRES(ns_mu_);
  // BeginWriteLocked in three steps, so that a write can begin a copy without holding
  // ns_mu_ across its I/O: what to copy (under the lock), the temp file and the copy
  // (no lock: RegisterTemp's synced write, open, owner, the wait for the previous
  // version's flushes, copy_file_range), and its installation (under the lock, after
  // the caller checked that the node is still as planned; else AbandonWrite).
  struct WritePlan {
    uint64_t id = 0;
    std::string temp_name;  // at the backing root
    uid_t uid = 0;
    gid_t gid = 0;
    mode_t mode = 0;
    bool truncate = false;
    uint64_t prev_file_id = 0;          // the write state it starts from, 0 if none
    std::shared_ptr<StagedFile> prev;   // copy from its (settled) temp file,
    int src_fd = -1;                    // or from this open backing file (borrowed),
    std::string src_path;               // or from this backing path
  };
  WritePlan PlanWriteLocked(Node* node, bool truncate, const UniqueFd* src) REQUIRES(ns_mu_);
  Result<std::unique_ptr<WriteState>> PrepareWrite(const WritePlan& plan);
  void AbandonWrite(const WriteState& ws);
  void InstallWriteLocked(Node* node, std::unique_ptr<WriteState> ws) REQUIRES(ns_mu_);
  // The temp file's owner and mode (OwnTempLocked without the node).
  Status OwnTemp(uid_t uid, gid_t gid, mode_t mode, int fd);
  // Drops the unpublished bytes of `node` (named `path`, or unnamed): its temp file is
  // removed in journal order; open handles keep reading them; it is never published.
  Result<uint64_t> DiscardLocked(Node* node, const std::string& path) REQUIRES(ns_mu_);
  // Forgets the write state of a fully published file, keeping its size.
  void DropWriteStateLocked(Node* node) REQUIRES(ns_mu_);
  // Makes `node` writable: a fresh copy when it is not being written or its contents
  // are frozen for publication. Marks it as needing publication.
  Status EnsureWritableLocked(Node* node, bool truncate, const UniqueFd* src = nullptr)
      REQUIRES(ns_mu_);
  // Queues the publication of `node`'s staged contents; returns the entry's seq.
  Result<uint64_t> PublishLocked(Node* node) REQUIRES(ns_mu_);
  // The staged file a write through `h` goes to, beginning a copy when needed.
  Result<std::shared_ptr<StagedFile>> WritableStaged(FileHandle* h) EXCLUDES(ns_mu_);
  // Truncate (or extend) file `ino` to `size`: a new version first if its contents are
  // not being written (a copy from `from`'s descriptor, if it is an ftruncate of a handle
  // opened before any write, else from its backing path), all I/O without ns_mu_
  // (RaceRetry). Publishes it when no handle writes it; returns that entry's seq, or 0.
  Result<uint64_t> Resize(uint64_t ino, uint64_t size, const FileHandle* from) EXCLUDES(ns_mu_);
  // The node is still as `plan` found it: same version, not being written meanwhile, same
  // owner and mode, no error. Else the prepared write is abandoned.
  bool PlanHoldsLocked(const Node& node, const WritePlan& plan) const REQUIRES(ns_mu_);
  // Returns whether the node's write state was dropped (then RefreshAttr it).
  bool ReleaseFileLocked(FileHandle* h) REQUIRES(ns_mu_);

  // ------------------------------------------------------------ journal (journal_events.cc)
  // The node's side of a publish entry's outcome; returns the inode whose write state
  // was dropped (to RefreshAttr), or 0.
  uint64_t NodePublishDone(const store::JournalEntry& e, const Status& st) EXCLUDES(ns_mu_);

  // ------------------------------------------------------------ dependencies (borrowed)
  const FsConfig& config_;
  store::BackingDir* const backing_;
  store::FlushPipeline* const pipeline_;
  store::Publication* const publication_;
  store::KeyIndex* const index_;
  ReadPath* const read_;
  FsStats* const stats_;
  const StagingContext staging_ctx_;

  // ------------------------------------------------------------ state
  // Held across namespace work on the backing store; never by read()/write() of a file
  // whose data source is set (see the locking rule at the top).
  mutable Mutex ns_mu_ ACQUIRED_BEFORE(staged_mu_);
  std::unordered_map<uint64_t, std::shared_ptr<Node>> inodes_ GUARDED_BY(ns_mu_);
  std::shared_ptr<Node> root_;  // set by Create, never changed
  uint64_t next_ino_ GUARDED_BY(ns_mu_) = kFirstNodeIno;
  // File id -> node, from its publish entry until the journal reports its outcome.
  std::unordered_map<uint64_t, std::shared_ptr<Node>> publishing_ GUARDED_BY(ns_mu_);
  // Link group -> its names (Node::link_group), so a link or chmod touches only those,
  // and the backing inode it was found under, if any.
  struct LinkGroup {
    std::vector<std::weak_ptr<Node>> members;
    std::pair<dev_t, ino_t> backing{0, 0};
  };
  std::unordered_map<uint64_t, LinkGroup> link_groups_ GUARDED_BY(ns_mu_);
  std::map<std::pair<dev_t, ino_t>, uint64_t> backing_links_ GUARDED_BY(ns_mu_);

  // Every staged file not yet destroyed, for staging pressure.
  Mutex staged_mu_;
  std::set<std::weak_ptr<StagedFile>, std::owner_less<std::weak_ptr<StagedFile>>> live_staged_
      GUARDED_BY(staged_mu_);

  // LogIfIo's rate limit.
  std::atomic<int64_t> io_log_second_{0};
  std::atomic<int> io_logged_{0};
  std::atomic<uint64_t> io_suppressed_{0};
};

}  // namespace ckptfs::fs
