// Filesystem: the facade of the ckptfs namespace and data paths, independent of FUSE.
//
// fs/fuse_server.cc translates each FUSE request into one call here and turns the
// Status into a reply. The facade routes each call by the kind of its inode or handle
// (fs/handle.h) to the unit that owns it:
//   namespace   fs/namespace.cc, fs/posix_ops.cc: inode table, the overlay (the
//               application's view = backing store + pending journal entries), and
//               the namespace operations;
//   write path  fs/write_path.cc: copy-on-write begin, publish, discard, release,
//               staging pressure (fs/staged_file.h holds the staged bytes);
//   read path   fs/read_path.h: block cache, prefetch, read checksums;
//   control     fs/control.cc: the /.ckptfs tree and the user.ckptfs.* xattrs, with the
//               tensor view (fs/tensor_view.h);
//   journal     fs/journal_events.cc: the journal's callbacks into the checkpoint
//               registry, the key index and the namespace.
//
// Thread-safe. Locking rule (written on the members below):
//   * ns_mu_ guards the namespace (inode table, tree, write states, link groups). It is
//     held for in-memory work, for the journal append that orders a namespace change
//     (the journal's order must be the namespace's: a RocksDB Put, not synced), and for
//     the checkpoint registry's notes of that change. Backing-store I/O runs without it:
//     stats and listings (ProbeName, LoadDir, RefreshAttr, NodeOpenDir), the open of a
//     backing file (NodeOpen), the temp file and copy a write or a create begins with
//     (PlanWriteLocked / PrepareWrite / InstallWriteLocked), each re-checked under the lock
//     before its result is used. Still under it: the fallbacks after a few lost races,
//     the rare operations on a staged file (truncate, fallocate, chmod and chown of its
//     temp file, an O_TRUNC open of a file another handle is writing), the readlink a hard
//     link of a symlink makes, and shutdown.
//   * read() and write() of an open file never take ns_mu_ unless the write begins a new
//     copy of the file (its first write, or the first after a publish froze it): they take
//     its node's data_mu (fs/node.h), a leaf held to copy a few fields.
//   * Nothing waits on the pipeline or the journal (Settled, WaitUnlessHalted) with
//     ns_mu_ held, except a publish freezing a file whose writer waits for staging space
//     (StagedFile::SealAll takes the writer lock) and the fallbacks above.
//   Lock order: ns_mu_ -> Node::data_mu -> StagedFile locks -> staged_mu_; error_mu_ and
//   dropped_mu_ are leaves.
#pragma once

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/control_names.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "fs/handle.h"
#include "fs/node.h"
#include "fs/read_path.h"
#include "fs/posix_access.h"
#include "fs/staged_file.h"
#include "fs/tensor_view.h"
#include "gpu/staging_pool.h"
#include "store/backing_dir.h"
#include "store/checkpoints.h"
#include "store/commit_gate.h"
#include "store/flush_pipeline.h"
#include "store/journal.h"
#include "store/dcp/key_index.h"
#include "store/state_db.h"

namespace ckptfs::store::peer {
struct PeerNodeOptions;
}  // namespace ckptfs::store::peer

namespace ckptfs::fs {

struct FsConfig {
  std::string backing_dir;
  std::string mountpoint;
  std::string state_dir;
  bool strict = false;
  uint64_t staging_bytes = uint64_t{1} << 30;
  uint64_t chunk_bytes = uint64_t{4} << 20;
  int flush_threads = 2;
  uint64_t cache_bytes = uint64_t{1} << 30;  // block cache budget for reads; 0 disables
  bool cache_direct_io = true;  // block cache reads with O_DIRECT where the backing fs allows
  std::string staging_backend = "auto";
  bool staging_hugepages = false;  // gpu::StagingOptions::hugepages
  bool flush_direct_io = true;     // store::FlushOptions::direct_io
  // Block CRCs of every flushed chunk, so the index checksums items without re-reading them.
  bool write_checksums = true;
  // How long a `.metadata` publication waits for shards from other writers to appear.
  std::chrono::milliseconds commit_timeout{std::chrono::minutes(10)};
  // Cooperating peer daemons (issue 12); null: this daemon works alone.
  std::shared_ptr<const store::peer::PeerNodeOptions> peers;
};

struct Entry {
  uint64_t ino = 0;
  struct stat attr {};
  double timeout = 1.0;
};

// Dependencies a caller may inject instead of having Create() make them from the
// config (each one left null is made from it): tests drive the namespace and the write
// path on a FaultyBackingDir this way. The pipeline, key index and cache must be made over
// the injected `backing` (and `db`). The journal is always made here: its hooks are the
// facade's (fs/journal_events.cc).
struct FsDeps {
  std::unique_ptr<store::BackingDir> backing;    // else BackingDir::Open(config.backing_dir)
  std::unique_ptr<store::StateDb> db;            // else StateDb::Open(config.state_dir)
  std::unique_ptr<gpu::StagingPool> pool;        // else from staging_bytes, chunk_bytes
  std::unique_ptr<store::FlushPipeline> pipeline;  // else from flush_threads
  std::unique_ptr<store::KeyIndex> index;
  // The block cache reads its misses through `cache_source` (made over the backing dir
  // when left null); both are made from cache_bytes when `cache` is left null (0: none).
  std::unique_ptr<store::BackingSource> cache_source;
  std::unique_ptr<store::BlockCache> cache;
};

// Fixed inode numbers of the control tree.
inline constexpr uint64_t kRootIno = 1;
inline constexpr uint64_t kCtlDirIno = 2;
inline constexpr uint64_t kCtlStatsIno = 3;
inline constexpr uint64_t kCtlCheckpointsIno = 4;
inline constexpr uint64_t kCtlMetricsIno = 5;
inline constexpr uint64_t kFirstNodeIno = 16;
// kCtlDirName and kTempPrefix: common/control_names.h.

class Filesystem {
 public:
  static Result<std::unique_ptr<Filesystem>> Create(const FsConfig& config, FsDeps deps = {});
  ~Filesystem();  // Shutdown() if not yet done.
  Filesystem(const Filesystem&) = delete;
  Filesystem& operator=(const Filesystem&) = delete;

  // Operations that create names or check ownership take the `caller` (root when left
  // out: the daemon itself). New names belong to the caller on the mount at once and on
  // the backing store when published; see fs/posix_access.h for the rules.
  Result<Entry> Lookup(uint64_t parent, const std::string& name) EXCLUDES(ns_mu_);
  void Forget(uint64_t ino, uint64_t nlookup) EXCLUDES(ns_mu_);
  Result<struct stat> GetAttr(uint64_t ino) EXCLUDES(ns_mu_);
  // `to_set` is a mask of FUSE_SET_ATTR_* bits, passed through as ints.
  Result<struct stat> SetAttr(uint64_t ino, const struct stat& in, int to_set, Handle* handle,
                              const Caller& caller = {}) EXCLUDES(ns_mu_);
  Result<Entry> Mkdir(uint64_t parent, const std::string& name, mode_t mode,
                      const Caller& caller = {}) EXCLUDES(ns_mu_);
  Result<Entry> Symlink(const std::string& target, uint64_t parent, const std::string& name,
                        const Caller& caller = {}) EXCLUDES(ns_mu_);
  // A FIFO, socket or device (journaled like mkdir), or an empty regular file (published
  // like a created and closed one). `mode` holds the S_IF* type.
  Result<Entry> Mknod(uint64_t parent, const std::string& name, mode_t mode, dev_t rdev,
                      const Caller& caller = {}) EXCLUDES(ns_mu_);
  // A hard link `new_parent/new_name` of `ino` (a file, symlink or special node; not a
  // directory: kNotPermitted). Journaled after the source's publication, so on the
  // backing store it is a real hard link. A file open for writing through the mount
  // cannot be linked (kBusy), and a file with several links cannot be written
  // (kTooManyLinks): publication replaces a name by rename, which would split the links.
  Result<Entry> Link(uint64_t ino, uint64_t new_parent, const std::string& new_name,
                     const Caller& caller = {}) EXCLUDES(ns_mu_);
  // fallocate(2) on an open file: mode 0 reserves the range on the backing store and
  // extends the size; other modes are kUnsupported (EOPNOTSUPP).
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
  // Opening for writing changes nothing: a file is copied for rewriting at its first write
  // (or O_TRUNC), so an open and close without a write leaves it, and its times, as they were.
  Result<Handle*> Open(uint64_t ino, int flags) EXCLUDES(ns_mu_);
  // Open/Read/Write/Flush/Fsync log every error they return as EIO with ino, path, offset.
  // Read and Write of a file take no namespace lock (see the locking rule above).
  Result<size_t> Read(Handle* h, char* out, size_t len, uint64_t offset) EXCLUDES(ns_mu_);
  // Read() of a backing file from the block cache without a copy (ReadPath::ReadBackingInPlace); nullopt: use Read().
  Result<std::optional<size_t>> ReadInPlace(Handle* h, size_t len, uint64_t offset, const store::BlockCache::InPlaceUse& use) EXCLUDES(ns_mu_);
  Status Write(Handle* h, const char* data, size_t len, uint64_t offset) EXCLUDES(ns_mu_);
  Status Flush(Handle* h) EXCLUDES(ns_mu_);
  Status Fsync(Handle* h) EXCLUDES(ns_mu_);
  void Release(Handle* h) EXCLUDES(ns_mu_);
  Result<Handle*> OpenDir(uint64_t ino) EXCLUDES(ns_mu_);
  void ReleaseDir(Handle* h);
  Result<struct statvfs> StatFs();
  Result<std::string> GetXattr(uint64_t ino, const std::string& name) EXCLUDES(ns_mu_);
  // Operator controls (user.ckptfs.resume, user.ckptfs.abort); others are unsupported.
  Status SetXattr(uint64_t ino, const std::string& name, const std::string& value)
      EXCLUDES(ns_mu_);
  std::string ListXattr(uint64_t ino);

  // Publishes everything still staged and waits until the journal is empty (G8).
  // Returns how many files could not be published.
  uint64_t Shutdown() EXCLUDES(ns_mu_);

  // Operator controls (ckptfs-admin resume / abort): retry a halted publication now; drop
  // the pending entries at or below `path` (relative to the mount) and say what went.
  void Resume();
  std::vector<std::string> Abort(const std::string& path);

  // The control files' contents.
  std::string StatsJson() EXCLUDES(ns_mu_);
  // Forgets finished checkpoints whose directory (or, for those known only from the
  // index, whose `.metadata`) is gone from the backing store, removed by someone else.
  // Does nothing while journal entries are pending (the backing store lags the mount).
  void ForgetVanishedCheckpoints();
  std::string CheckpointsJson();
  std::string MetricsText() EXCLUDES(ns_mu_);

  bool strict() const { return config_.strict; }
  const FsConfig& config() const { return config_; }
  uint64_t errors() const { return errors_.load(); }
  // Entry/attr timeout for `node` (long for files of committed checkpoints).
  double TimeoutFor(const Node& node) const REQUIRES(ns_mu_);
  // The attribute timeout of a getattr/setattr reply for `ino` (0 for hard-linked names).
  double AttrTimeout(uint64_t ino) EXCLUDES(ns_mu_);

 private:
  explicit Filesystem(const FsConfig& config);
  Status Init(FsDeps deps);

  // ------------------------------------------------------------ facade (filesystem.cc)
  void NoteError(const std::string& msg) EXCLUDES(error_mu_);
  // Logs `st` when it reaches the application as EIO (ino, path, offset; rate-limited) and
  // returns it.
  Status LogIfIo(const char* op, uint64_t ino, uint64_t offset, Status st) EXCLUDES(ns_mu_);

  // ------------------------------------------------------------ control (control.cc)
  static bool IsControl(uint64_t ino) { return ino >= kCtlDirIno && ino < kFirstNodeIno; }
  Result<Entry> CtlLookup(uint64_t parent, const std::string& name);
  Result<struct stat> CtlGetAttr(uint64_t ino);
  Result<Handle*> CtlOpen(uint64_t ino, int flags) EXCLUDES(ns_mu_);
  Result<Handle*> CtlOpenDir(uint64_t ino);
  std::string ProgressJson(uint64_t ino) EXCLUDES(ns_mu_);

  // ------------------------------------------------------------ namespace (namespace.cc)
  Result<Entry> NodeLookup(uint64_t parent, const std::string& name) EXCLUDES(ns_mu_);
  Result<struct stat> NodeGetAttr(uint64_t ino) EXCLUDES(ns_mu_);
  Result<Handle*> NodeOpenDir(uint64_t ino) EXCLUDES(ns_mu_);
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
  // Sets the temp file's owner and mode from node->attr.
  Status OwnTempLocked(Node* node, int fd) REQUIRES(ns_mu_);
  // `node` loses a name: the other names of its link group count one link less. Journal
  // entry `seq` makes that true on the backing store: until then the others' attributes
  // are not refreshed from it.
  void UnlinkPeersLocked(Node* node, uint64_t seq) REQUIRES(ns_mu_);
  // Gives the other names of `node`'s link group its inode attributes (one inode), as
  // entry `seq` will on the backing store.
  void SyncPeersLocked(const Node* node, uint64_t seq) REQUIRES(ns_mu_);
  std::shared_ptr<Node> NodeLocked(uint64_t ino) REQUIRES(ns_mu_);
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
  // ".ckptfs-tmp.[n<node rank>.]<id>": unique among the daemons sharing the backing dir.
  std::string TempName(uint64_t id) const;
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
  Result<Handle*> NodeOpen(uint64_t ino, int flags) EXCLUDES(ns_mu_);
  // The staged file a write through `h` goes to, beginning a copy when needed.
  Result<std::shared_ptr<StagedFile>> WritableStaged(FileHandle* h) EXCLUDES(ns_mu_);
  Status WriteData(FileHandle* h, const char* data, size_t len, uint64_t offset)
      EXCLUDES(ns_mu_);
  Result<size_t> ReadData(Handle* h, char* out, size_t len, uint64_t offset) EXCLUDES(ns_mu_);
  Status FlushData(FileHandle* h) EXCLUDES(ns_mu_);
  void ReleaseFile(FileHandle* h) EXCLUDES(ns_mu_);
  // Returns whether the node's write state was dropped (then RefreshAttr it).
  bool ReleaseFileLocked(FileHandle* h) REQUIRES(ns_mu_);
  void RelieveStagingPressure() EXCLUDES(staged_mu_);

  // ------------------------------------------------------------ journal (journal_events.cc)
  void OnJournalDone(const store::JournalEntry& e, const Status& st) EXCLUDES(ns_mu_);
  // The node's side of a publish entry's outcome; returns the inode whose write state
  // was dropped (to RefreshAttr), or 0.
  uint64_t NodePublishDone(const store::JournalEntry& e, const Status& st) EXCLUDES(ns_mu_);
  void OnJournalHalt(const store::JournalEntry& e, const Status& st) EXCLUDES(ns_mu_);
  // Gives a just-published file's block CRCs (recorded by the flush pipeline) to the index.
  void HandOverBlockCrcs(const store::JournalEntry& e);
  // The commit gate's question: is `path` open for writing here, its publish not queued?
  bool WrittenLocally(const std::string& path) EXCLUDES(ns_mu_);

  // ------------------------------------------------------------ dependencies
  const FsConfig config_;
  std::unique_ptr<store::BackingDir> backing_;
  std::unique_ptr<store::StateDb> db_;
  std::unique_ptr<store::CheckpointRegistry> checkpoints_;
  std::unique_ptr<gpu::StagingPool> pool_;
  std::unique_ptr<store::FlushPipeline> pipeline_;
  std::unique_ptr<store::CommitGate> gate_;
  std::unique_ptr<store::Journal> journal_;
  std::unique_ptr<store::KeyIndex> index_;
  std::unique_ptr<ReadPath> read_;
  std::unique_ptr<TensorView> tensors_;
  StagingContext staging_ctx_{};

  // ------------------------------------------------------------ namespace state
  // Held across namespace work on the backing store; never by read()/write() of a file
  // whose data source is set (see the locking rule at the top).
  mutable Mutex ns_mu_ ACQUIRED_BEFORE(staged_mu_, dropped_mu_, error_mu_);
  std::unordered_map<uint64_t, std::shared_ptr<Node>> inodes_ GUARDED_BY(ns_mu_);
  std::shared_ptr<Node> root_;  // set by Init, never changed
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

  // Names whose pending publish was dropped because the application deleted them while
  // publication was halted: a `.metadata` naming one is refused at once.
  Mutex dropped_mu_;
  std::set<std::string> dropped_paths_ GUARDED_BY(dropped_mu_);

  // ------------------------------------------------------------ stats
  std::atomic<bool> shut_down_{false};
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> bytes_published_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> files_published_{0};
  std::atomic<uint64_t> errors_{0};
  mutable Mutex error_mu_;
  std::string last_error_ GUARDED_BY(error_mu_);
  std::string last_abort_report_ GUARDED_BY(error_mu_);
  std::atomic<int64_t> io_log_second_{0};
  std::atomic<int> io_logged_{0};
  std::atomic<uint64_t> io_suppressed_{0};
};

}  // namespace ckptfs::fs
