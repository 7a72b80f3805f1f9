// NodeTable: the inode table and the overlay, and the one lock of the namespace.
//
// Owns every Node (fs/namespace/node.h) of the mount's view (the backing store plus the journal
// entries not yet applied): the inode table, the tree, link groups, the files whose
// publish entry awaits its outcome, and the loading and probing of directories and names
// from the backing store. The parts of the namespace share it and its lock by design: a
// write begins a copy, a publish freezes it, a rename moves it, all in the journal's order.
// The parts (each holds a reference, takes the lock with TableLock and annotates its
// helpers REQUIRES(table.mu()); fs/namespace/table_lock.h):
//   namespace.h        the namespace operations (lookup, mkdir, unlink, rename, opendir);
//   write_states.h     the write states of files (begin, publish, discard, release);
//   posix_ops.h        ownership and permissions (setattr, chown, links, fallocate);
//   journal_events.h   publication's observer (store::PublicationObserver);
//   namespace_report.h what the control tree reads (NamespaceView);
// all in fs/namespace/. A part's *Locked helper that another part calls takes the table
// whose lock its caller holds as a parameter (REQUIRES(table.mu())): the analysis names a
// lock by the path to it, and proves it held at every call, with no run-time check.
// It calls only publication (append an entry, ask what is applied), the backing store
// (stat, list, readlink) and the stats; never a part.
//
// Thread-safe. Locking rule:
//   * The lock (private `mu_`; `mu()` names it for the annotations) guards the tables
//     here (the inodes, the files being published, the link groups, the I/O tokens held;
//     the parts reach them through the *Locked methods, links() and RaceRetry) and the
//     fields of every Node but its `data` (fs/namespace/node.h).
//     It is held for in-memory work and for the journal append that orders a namespace
//     change (the journal's order must be the namespace's: a RocksDB Put, not synced; the
//     checkpoint registry's notes of the entry, store::Publication::Append). Backing-store
//     I/O runs without it: stats and listings (ProbeName, LoadDir, RefreshAttr), the open
//     of a backing file, the temp file and copy a write, a create or a truncate begins
//     with, a truncate's wait for flushes and ftruncate, fallocate, the owner and mode of
//     a staged file's temp, a publish's wait for a writer to let it freeze the file, the
//     readlink of a symlink: each re-checked under the lock before its result is used
//     (RaceRetry, fs/namespace/table_lock.h). After kRaceTries lost races a call takes the
//     node's I/O token and goes on without the lock: no fallback does I/O under it, and
//     the chmods, chowns, renames and publishes that would make it lose again wait for
//     the token (without the lock), so it loses a bounded number of further races. A
//     directory no LoadDir loaded before an operation took the lock is listed without it
//     too (EnsureLoadedLocked), and the operation starts over (LockDropped).
//   * Inside a scope the lock is dropped only by TableLock::WithoutLock (unlock, I/O or a
//     wait, relock) and TableLock::Await (a condition variable). Nothing waits on the
//     pipeline or the journal (Settled, WaitUnlessHalted, AwaitApplied) with it held.
//   * read() and write() of an open file never take it unless the write begins a new copy
//     of the file (its first write, or the first after a publish froze it): they take its
//     node's data_mu (fs/namespace/node.h), a leaf held to copy a few fields.
//   An I/O token is not a lock: it is taken and given back under the table's lock and
//   waited for with it released (TableLock::Await); a thread that holds one never waits
//   for one (table_lock.h tells why no wait depends on the waiter).
//   Lock order: the table's lock -> Node::data_mu -> store::StagedFile
//   locks -> WriteStates' staged_mu_; publication's locks (its journal's Append, the
//   registry) after the table's lock; FsStats::error_mu is a leaf.
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "fs/fs_stats.h"
#include "fs/fs_types.h"
#include "fs/namespace/link_groups.h"
#include "fs/namespace/node.h"
#include "store/primitives/backing_dir.h"
#include "store/publish/journal.h"
#include "store/publish/publication.h"

namespace ckptfs::fs {

class NodeTable {
 public:
  // Stats the backing root for the root node. `config` and the parts must outlive it; it
  // uses their backing, publication and stats.
  static Result<std::unique_ptr<NodeTable>> Create(const FsConfig& config, const FsParts& parts);
  NodeTable(const NodeTable&) = delete;
  NodeTable& operator=(const NodeTable&) = delete;

  // ------------------------------------------------------------ the tables
  // The table's lock, for annotations only: REQUIRES(table.mu()). Held across namespace
  // work, never across backing-store I/O (see the rule above); the parts take it with
  // TableLock (fs/namespace/table_lock.h), which a const reference cannot.
  const Mutex& mu() const RETURN_CAPABILITY(mu_) { return mu_; }
  const std::shared_ptr<Node>& root() const { return root_; }  // never changes
  // Calls `f(node)` for every inode the kernel or an open handle may still name.
  template <typename F>
  void ForEachNodeLocked(F&& f) REQUIRES(mu_) {
    for (const auto& [ino, node] : inodes_) f(node);
  }
  // Forgets inode `ino` (no name, no kernel reference, no write state left).
  void ForgetNodeLocked(uint64_t ino) REQUIRES(mu_) { inodes_.erase(ino); }
  // The file whose publish entry for file id `id` awaits its outcome: noted when the
  // entry is appended (NotePublishingLocked), found while it is pending, taken when the
  // journal reports its outcome (`take`). Null when none.
  void NotePublishingLocked(uint64_t id, Node* node) REQUIRES(mu_) {
    publishing_[id] = NodeLocked(node->ino);
  }
  std::shared_ptr<Node> PublishingLocked(uint64_t id, bool take = false) REQUIRES(mu_);
  // The hard-link groups of the names (fs/namespace/link_groups.h).
  LinkGroups& links() REQUIRES(mu_) { return links_; }

  // ------------------------------------------------------------ nodes and paths
  std::shared_ptr<Node> NodeLocked(uint64_t ino) REQUIRES(mu_);
  // Directory `ino`, loaded (EnsureLoadedLocked: kAborted when it had to list it without
  // the lock, LockDropped); kNotDir, naming `name`, for anything else.
  Result<std::shared_ptr<Node>> LoadedDirLocked(uint64_t ino, const std::string& name)
      REQUIRES(mu_);
  std::string PathLocked(const Node* node) const REQUIRES(mu_);
  std::string TempPathLocked(const WriteState& ws) const REQUIRES(mu_);
  // The node at `path` (relative to the root) in the in-memory tree, or null: no I/O, so a
  // name this mount never loaded was not written through it.
  Node* LoadedNodeAtLocked(const std::string& path) REQUIRES(mu_);
  std::shared_ptr<Node> NewNodeLocked(Node* parent, const std::string& name, NodeType type)
      REQUIRES(mu_);
  // The child `name` of `dir` in the mount's view; no I/O (ProbeName refreshes it first).
  std::shared_ptr<Node> ChildLocked(Node* dir, const std::string& name) REQUIRES(mu_);
  // Takes `node` out of the tree; forgets it when nothing names it any more.
  // `evicted`: not through the mount, but let go of (GoneDirs): counted apart, so that a
  // probe of another name in the directory stands.
  void DetachLocked(const std::shared_ptr<Node>& node, bool evicted = false) REQUIRES(mu_);
  // Forgets an unlinked `node` that no kernel reference nor open handle names.
  void ForgetIfUnusedLocked(const Node* node) REQUIRES(mu_);
  // The entry of a lookup reply for `node` (counts a kernel reference).
  Entry EntryLocked(Node* node) REQUIRES(mu_);
  // Entry/attr timeout for `node` (long for files of committed checkpoints).
  double TimeoutFor(const Node& node) const REQUIRES(mu_);
  bool CommittedDirLocked(const Node* dir) const REQUIRES(mu_);
  // The attributes of `ino` for a getattr reply, refreshed first (RefreshAttr), except a
  // committed checkpoint's file: the kernel keeps its attributes kCommittedTimeout, and asks
  // again before that only because a passthrough read invalidated its atime (the kernel
  // does so after every read of a writable mount). A replicated per-item load sent one
  // such GETATTR per file and rank; each cost four syscalls on the backing store.
  Result<struct stat> GetAttr(uint64_t ino) EXCLUDES(mu_);

  // ------------------------------------------------------------ the overlay
  // Ok when `dir` is loaded (or made through the mount). Else it lists it without the lock
  // (LoadDir, TableLock::WithoutLock) and returns kAborted: the caller read the table
  // before the lock was dropped, and starts its operation over (LockDropped,
  // fs/namespace/table_lock.h). The listing is never done under the lock.
  Status EnsureLoadedLocked(Node* dir) REQUIRES(mu_);
  // Loads directory `ino` from the backing store if it is not loaded yet: the listing and
  // the stats run without the lock, the result is merged under it if the directory is still
  // at the path listed, else it is listed again where it is now (RaceRetry: after races
  // lost, holding the directory's I/O token). Returns once it is loaded or gone.
  Status LoadDir(uint64_t ino) EXCLUDES(mu_);
  // LoadDir of the child directory `name` of `dir_ino`, if there is one.
  Status LoadChildDir(uint64_t dir_ino, const std::string& name) EXCLUDES(mu_);
  // Before an operation on `dir_ino`/`name` takes the lock: loads the directory and brings the
  // mount's view of the name up to date with the backing store (a published name removed
  // there is gone; a name created there appears), with the stat outside the lock. The
  // result is applied only if nothing changed meanwhile through the mount.
  Status ProbeName(uint64_t dir_ino, const std::string& name) EXCLUDES(mu_);
  std::shared_ptr<Node> AddBackingChildLocked(Node* dir, const std::string& name,
                                              const struct stat& st) REQUIRES(mu_);
  // Refreshes the attributes of `ino` from a stat of its backing path (taken without the lock)
  // while nothing of it is pending.
  // `unless_committed`: not a committed checkpoint's file (GetAttr).
  // `done_through` != 0: a commit's refresh; entries up to it count as applied (the commit
  // being reported, pending in the directory until the report ends), and only the file's
  // own entries and renames above it must be done, not every entry above it. Returns
  // whether the size, mtime or ctime shown changed.
  bool RefreshAttr(uint64_t ino, bool unless_committed = false, uint64_t done_through = 0)
      EXCLUDES(mu_);
  // Takes the attributes of `node` from a stat of its backing path, keeping the ones the
  // mount owns (Node::own_attrs) while the backing inode shows only this mount's changes.
  void ApplyBackingStatLocked(Node* node, const struct stat& st) REQUIRES(mu_);
  // The mount changed `node` on the backing store (a journal entry): its backing times
  // will move, its attributes through the mount stay as they are.
  void OwnAttrsLocked(Node* node) REQUIRES(mu_);
  // A user operation changed the entries of `dir`: mtime and ctime now, nlink by `links`.
  void TouchDirLocked(Node* dir, int links) REQUIRES(mu_);
  // Whether the backing store's listing of directory `dir` can differ from the mount's
  // view only by names that other writers (other nodes) made there, so that a name found
  // there and missing from the view may be added: it is on the backing store where the
  // mount shows it (no rename of it or above it pending), it is the directory the mount
  // knows (neither it nor a directory above it was made through the mount by a mkdir not
  // yet applied: an older directory of that name may still be there, its removal
  // queued), and no name left it through the mount with that removal pending (the name
  // would come back). Other pending entries do not matter: a name made through the
  // mount is in the view.
  bool ListingCurrentLocked(const Node* dir) const REQUIRES(mu_);
  // The last pending rename of `node` or an ancestor (its backing path is stale until
  // then), or 0.
  uint64_t PendingRenameLocked(const Node* node) const REQUIRES(mu_);
  // Mirrors node->write and node->error into node->data for the data path; called after
  // every change of either.
  void SyncDataLocked(Node* node) REQUIRES(mu_);
  // Takes the time of the latest write (recorded by the data path) into node->attr;
  // called before node->attr's times are read or set.
  void FoldWriteTimeLocked(Node* node) REQUIRES(mu_);

  // ------------------------------------------------------------ the journal
  // Appends `entry`, which changes `node` (or nothing in the tree, if null): its name and
  // directory are pending until the entry is applied.
  Result<uint64_t> AppendLocked(store::JournalEntry entry, Node* node) REQUIRES(mu_);
  // Waits (without locks) until every pending rename among `node`'s ancestors is applied.
  // Fails (with the halt's error) if publication is halted before that rename.
  Status WaitForAncestorsUnlocked(uint64_t ino) EXCLUDES(mu_);
  // In strict mode, waits until entry `seq` is applied (or fails with its error).
  Status WaitIfStrict(Result<uint64_t> seq) EXCLUDES(mu_);

  // ------------------------------------------------------------ errors
  void NoteError(const std::string& msg) { stats_->NoteError(msg); }
  // Logs `st` when it reaches the application as EIO (ino, path, offset; rate-limited) and
  // returns it.
  Status LogIfIo(const char* op, uint64_t ino, uint64_t offset, Status st) EXCLUDES(mu_);

 private:
  NodeTable(const FsConfig& config, const FsParts& parts);

  // ------------------------------------------------------------ constant after construction
  const FsConfig& config_;
  store::BackingDir* const backing_;
  store::Publication* const publication_;
  FsStats* const stats_;
  std::shared_ptr<Node> root_;  // set by Create, never changed

  // The one lock of the namespace: taken by TableLock, dropped inside a scope only by
  // TableLock::WithoutLock and TableLock::Await.
  friend class TableLock;
  mutable Mutex mu_;
  // The I/O tokens (io_tokens_) are taken, waited for and given back by RaceRetry.
  friend class RaceRetry;

  // ------------------------------------------------------------ protected by mu_
  uint64_t next_ino_ GUARDED_BY(mu_) = kFirstNodeIno;
  // Every inode the kernel or an open handle may still name.
  std::unordered_map<uint64_t, std::shared_ptr<Node>> inodes_ GUARDED_BY(mu_);
  // File id -> node, from its publish entry until the journal reports its outcome.
  std::unordered_map<uint64_t, std::shared_ptr<Node>> publishing_ GUARDED_BY(mu_);
  LinkGroups links_ GUARDED_BY(mu_);
  // The I/O tokens calls hold (RaceRetry, fs/namespace/table_lock.h), and the condition
  // variable notified, with the lock held, when one is given back or its holder waits for
  // the journal.
  struct IoToken {
    const Node* node;
    bool awaiting_journal = false;  // RaceRetry::AwaitJournal
  };
  std::vector<IoToken> io_tokens_ GUARDED_BY(mu_);
  std::condition_variable io_token_cv_;

  // ------------------------------------------------------------ atomics (no lock)
  // LogIfIo's rate limit.
  std::atomic<int64_t> io_log_second_{0};
  std::atomic<int> io_logged_{0};
  std::atomic<uint64_t> io_suppressed_{0};
};

}  // namespace ckptfs::fs
