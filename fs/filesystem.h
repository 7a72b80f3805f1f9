// Filesystem: the ckptfs namespace and data paths, independent of FUSE.
//
// fs/fuse_server.cc translates each FUSE request into one call here and turns the
// Status into a reply. This class owns the inode table, the namespace overlay (the
// application's view = backing store + pending journal entries), the write and read
// paths, and the /.ckptfs control files.
//
// Thread-safe. Lock order: ns_mu_ -> StagedFile locks -> staged_mu_. Nothing blocks on
// the journal or the staging pool while holding ns_mu_.
#pragma once

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <thread>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "fs/node.h"
#include "fs/posix_access.h"
#include "fs/staged_file.h"
#include "fs/tensor_view.h"
#include "gpu/staging_pool.h"
#include "store/backing_dir.h"
#include "store/checkpoints.h"
#include "store/commit_gate.h"
#include "store/flush_pipeline.h"
#include "store/journal.h"
#include "store/key_index.h"
#include "store/read_checksums.h"
#include "store/block_cache.h"
#include "store/state_db.h"

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
};

struct Entry {
  uint64_t ino = 0;
  struct stat attr {};
  double timeout = 1.0;
};

// An open file or directory (the FUSE file handle).
struct Handle {
  std::shared_ptr<Node> node;
  bool writable = false;
  std::shared_ptr<StagedFile> staged;  // files written through the mount
  // The backing file, opened when the file had no write state: the current version for as
  // long as it has none (a write state lives until every handle is closed). Set at open only.
  std::shared_ptr<const UniqueFd> fd;
  store::FileKey key;                  // its identity at open, for the block cache
  std::string ckpt, file;              // checkpoint dir and file name, when in a checkpoint
  std::atomic<uint64_t> prefetched_end{0};  // end of the last item prefetched by this handle
  bool keep_cache = false;             // a committed checkpoint's file
  bool indexed = false;                // its checkpoint was indexed when it was opened
  std::string content;                 // control files: generated at open
  struct DirEnt {
    std::string name;
    uint64_t ino;
    mode_t type;
  };
  std::vector<DirEnt> entries;  // directories: listed at opendir
  // Tensor-view chunk files: a window [view_base, view_base + view_size) of a backing file.
  std::shared_ptr<UniqueFd> view_fd;
  uint64_t view_base = 0, view_size = 0;
};

// Fixed inode numbers of the control tree.
inline constexpr uint64_t kRootIno = 1;
inline constexpr uint64_t kCtlDirIno = 2;
inline constexpr uint64_t kCtlStatsIno = 3;
inline constexpr uint64_t kCtlCheckpointsIno = 4;
inline constexpr uint64_t kCtlMetricsIno = 5;
inline constexpr uint64_t kFirstNodeIno = 16;
inline constexpr char kCtlDirName[] = ".ckptfs";
inline constexpr char kTempPrefix[] = ".ckptfs-tmp.";

class Filesystem {
 public:
  static Result<std::unique_ptr<Filesystem>> Create(const FsConfig& config);
  ~Filesystem();  // Shutdown() if not yet done.
  Filesystem(const Filesystem&) = delete;
  Filesystem& operator=(const Filesystem&) = delete;

  // Operations that create names or check ownership take the `caller` (root when left
  // out: the daemon itself). New names belong to the caller on the mount at once and on
  // the backing store when published; see fs/posix_access.h for the rules.
  Result<Entry> Lookup(uint64_t parent, const std::string& name);
  void Forget(uint64_t ino, uint64_t nlookup);
  Result<struct stat> GetAttr(uint64_t ino);
  // `to_set` is a mask of FUSE_SET_ATTR_* bits, passed through as ints.
  Result<struct stat> SetAttr(uint64_t ino, const struct stat& in, int to_set, Handle* handle,
                              const Caller& caller = {});
  Result<Entry> Mkdir(uint64_t parent, const std::string& name, mode_t mode,
                      const Caller& caller = {});
  Result<Entry> Symlink(const std::string& target, uint64_t parent, const std::string& name,
                        const Caller& caller = {});
  // A FIFO, socket or device (journaled like mkdir), or an empty regular file (published
  // like a created and closed one). `mode` holds the S_IF* type.
  Result<Entry> Mknod(uint64_t parent, const std::string& name, mode_t mode, dev_t rdev,
                      const Caller& caller = {});
  // A hard link `new_parent/new_name` of `ino` (a file, symlink or special node; not a
  // directory: kNotPermitted). Journaled after the source's publication, so on the
  // backing store it is a real hard link. A file open for writing through the mount
  // cannot be linked (kBusy), and a file with several links cannot be written
  // (kTooManyLinks): publication replaces a name by rename, which would split the links.
  Result<Entry> Link(uint64_t ino, uint64_t new_parent, const std::string& new_name,
                     const Caller& caller = {});
  // fallocate(2) on an open file: mode 0 reserves the range on the backing store and
  // extends the size; other modes are kUnsupported (EOPNOTSUPP).
  Status Fallocate(Handle* h, int mode, uint64_t offset, uint64_t length);
  Result<std::string> Readlink(uint64_t ino);
  Status Unlink(uint64_t parent, const std::string& name, const Caller& caller = {});
  Status Rmdir(uint64_t parent, const std::string& name, const Caller& caller = {});
  Status Rename(uint64_t parent, const std::string& name, uint64_t new_parent,
                const std::string& new_name, unsigned flags, const Caller& caller = {});
  Result<std::pair<Entry, Handle*>> Create(uint64_t parent, const std::string& name, mode_t mode,
                                           int flags, const Caller& caller = {});
  // Opening for writing changes nothing: a file is copied for rewriting at its first write
  // (or O_TRUNC), so an open and close without a write leaves it, and its times, as they were.
  Result<Handle*> Open(uint64_t ino, int flags);
  // Open/Read/Write/Flush/Fsync log every error they return as EIO with ino, path, offset.
  Result<size_t> Read(Handle* h, char* out, size_t len, uint64_t offset);
  Status Write(Handle* h, const char* data, size_t len, uint64_t offset);
  Status Flush(Handle* h);
  Status Fsync(Handle* h);
  void Release(Handle* h);
  Result<Handle*> OpenDir(uint64_t ino);
  void ReleaseDir(Handle* h);
  Result<struct statvfs> StatFs();
  Result<std::string> GetXattr(uint64_t ino, const std::string& name);
  // Operator controls (user.ckptfs.resume, user.ckptfs.abort); others are unsupported.
  Status SetXattr(uint64_t ino, const std::string& name, const std::string& value);
  std::string ListXattr(uint64_t ino);

  // Publishes everything still staged and waits until the journal is empty (G8).
  // Returns how many files could not be published.
  uint64_t Shutdown();

  // Operator controls (ckptfs-admin resume / abort): retry a halted publication now; drop
  // the pending entries at or below `path` (relative to the mount) and say what went.
  void Resume();
  std::vector<std::string> Abort(const std::string& path);

  // The control files' contents.
  std::string StatsJson();
  // Forgets finished checkpoints whose directory (or, for those known only from the
  // index, whose `.metadata`) is gone from the backing store, removed by someone else.
  // Does nothing while journal entries are pending (the backing store lags the mount).
  void ForgetVanishedCheckpoints();
  std::string CheckpointsJson();
  std::string MetricsText();

  bool strict() const { return config_.strict; }
  const FsConfig& config() const { return config_; }
  uint64_t errors() const { return errors_.load(); }
  // Entry/attr timeout for `attr` (long for files of committed checkpoints).
  double TimeoutFor(const Node& node) const;
  // The attribute timeout of a getattr/setattr reply for `ino` (0 for hard-linked names).
  double AttrTimeout(uint64_t ino);

 private:
  explicit Filesystem(const FsConfig& config);
  Status Init();

  // Mkdir, Symlink and Mknod of a special file: a new name owned by `caller`, journaled
  // (and applied first in strict mode). `mode` holds the S_IF* type.
  Result<Entry> MakeNode(uint64_t parent, const std::string& name, NodeType type, mode_t mode,
                         const std::string& link_target, dev_t rdev, const Caller& caller);
  // Mknod of a regular file: an empty file, published like a created one.
  Result<Entry> MakeEmptyFile(uint64_t parent, const std::string& name, mode_t mode,
                              const Caller& caller);
  // Journals a chown of `node` (and applies it to its temp file when staged), then the
  // mode a chown leaves. REQUIRE(ns_mu_).
  Result<uint64_t> ChownLocked(Node* node, uid_t uid, gid_t gid);
  // Sets the temp file's owner and mode from node->attr. REQUIRE(ns_mu_).
  Status OwnTempLocked(Node* node, int fd);
  // `node` loses a name: the other names of its link group count one link less. Journal
  // entry `seq` makes that true on the backing store: until then the others' attributes
  // are not refreshed from it. REQUIRE(ns_mu_).
  void UnlinkPeersLocked(Node* node, uint64_t seq);
  // Gives the other names of `node`'s link group its inode attributes (one inode), as
  // entry `seq` will on the backing store. REQUIRE(ns_mu_).
  void SyncPeersLocked(const Node* node, uint64_t seq);
  // Namespace helpers; REQUIRE(ns_mu_).
  std::shared_ptr<Node> NodeLocked(uint64_t ino);
  std::string PathLocked(const Node* node) const;
  std::string TempPathLocked(const WriteState& ws) const;
  Status EnsureLoadedLocked(Node* dir);
  std::shared_ptr<Node> NewNodeLocked(Node* parent, const std::string& name, NodeType type);
  std::shared_ptr<Node> ChildLocked(Node* dir, const std::string& name);
  void RefreshAttrLocked(Node* node);
  // Takes the attributes of `node` from a stat of its backing path, keeping the ones the
  // mount owns (Node::own_attrs) while the backing inode shows only this mount's changes.
  void ApplyBackingStatLocked(Node* node, const struct stat& st);
  // The mount changed `node` on the backing store (a journal entry): its backing times
  // will move, its attributes through the mount stay as they are.
  void OwnAttrsLocked(Node* node);
  // A user operation changed the entries of `dir`: mtime and ctime now, nlink by `links`.
  void TouchDirLocked(Node* dir, int links);
  bool QuiescentLocked(const Node* node) const;
  // The last pending rename of `node` or an ancestor (its backing path is stale until
  // then), or 0.
  uint64_t PendingRenameLocked(const Node* node) const;
  void DetachLocked(const std::shared_ptr<Node>& node);
  Result<uint64_t> AppendLocked(store::JournalEntry entry, Node* node);
  // Starts writing a file: a new temp file, filled with the current contents unless
  // `truncate`: those of its write state, else of `src` (an open backing file of the current
  // version, or null), else of its backing path. The copy is copy_file_range, a reflink
  // where the backing file system shares extents (XFS, btrfs), so only changed blocks
  // are written.
  Status BeginWriteLocked(Node* node, bool truncate, const UniqueFd* src = nullptr);
  // Drops the unpublished bytes of `node` (named `path`, or unnamed): its temp file is
  // removed in journal order; open handles keep reading them; it is never published.
  Result<uint64_t> DiscardLocked(Node* node, const std::string& path);
  // Forgets the write state of a fully published file, keeping its size.
  void DropWriteStateLocked(Node* node);
  // Makes `node` writable: a fresh copy when it is not being written or its contents
  // are frozen for publication. Marks it as needing publication.
  Status EnsureWritableLocked(Node* node, bool truncate, const UniqueFd* src = nullptr);
  // Queues the publication of `node`'s staged contents; returns the entry's seq.
  Result<uint64_t> PublishLocked(Node* node);
  Entry EntryLocked(Node* node);
  std::string CheckpointDirOf(const std::string& path) const;

  // Waits (without locks) until every pending rename among `node`'s ancestors is applied.
  // Fails (with the halt's error) if publication is halted before that rename.
  Status WaitForAncestorsUnlocked(uint64_t ino);
  Status WaitIfStrict(Result<uint64_t> seq);
  void OnJournalDone(const store::JournalEntry& e, const Status& st);
  // Gives a just-published file's block CRCs (recorded by the flush pipeline) to the index.
  void HandOverBlockCrcs(const store::JournalEntry& e);
  // The commit gate's question: is `path` open for writing here, its publish not queued?
  bool WrittenLocally(const std::string& path);
  void OnJournalHalt(const store::JournalEntry& e, const Status& st);
  void RelieveStagingPressure();
  Result<std::shared_ptr<StagedFile>> WritableStaged(Handle* h);
  std::string ProgressJson(uint64_t ino);

  const FsConfig config_;
  std::unique_ptr<store::BackingDir> backing_;
  std::unique_ptr<store::StateDb> db_;
  std::unique_ptr<store::CheckpointRegistry> checkpoints_;
  std::unique_ptr<gpu::StagingPool> pool_;
  std::unique_ptr<store::FlushPipeline> pipeline_;
  std::unique_ptr<store::CommitGate> gate_;
  std::unique_ptr<store::Journal> journal_;
  StagingContext staging_ctx_{};

  mutable std::mutex ns_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Node>> inodes_;  // GUARDED_BY(ns_mu_)
  std::shared_ptr<Node> root_;
  uint64_t next_ino_ = kFirstNodeIno;                            // GUARDED_BY(ns_mu_)
  std::unordered_map<uint64_t, std::shared_ptr<Node>> publishing_;  // file id -> node
  // Link group -> its names (Node::link_group), so a link or chmod touches only those,
  // and the backing inode it was found under, if any.
  struct LinkGroup {
    std::vector<std::weak_ptr<Node>> members;
    std::pair<dev_t, ino_t> backing{0, 0};
  };
  std::unordered_map<uint64_t, LinkGroup> link_groups_;  // GUARDED_BY(ns_mu_)
  std::map<std::pair<dev_t, ino_t>, uint64_t> backing_links_;  // GUARDED_BY(ns_mu_)
  // A name loaded from the backing store with several links joins the group of the
  // other names of its backing inode. REQUIRE(ns_mu_).
  void AdoptLinkGroupLocked(Node* node, const struct stat& st);
  // The live names of `group` other than `except`; forgets dead ones. REQUIRE(ns_mu_).
  std::vector<std::shared_ptr<Node>> LinkPeersLocked(uint64_t group, const Node* except);

  std::mutex staged_mu_;
  std::set<std::weak_ptr<StagedFile>, std::owner_less<std::weak_ptr<StagedFile>>> live_staged_;

  std::atomic<bool> shut_down_{false};
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> bytes_published_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> files_published_{0};
  std::atomic<uint64_t> errors_{0};
  mutable std::mutex error_mu_;
  std::string last_error_;  // GUARDED_BY(error_mu_)
  std::string last_abort_report_;  // GUARDED_BY(error_mu_)
  // Names whose pending publish was dropped because the application deleted them while
  // publication was halted: a `.metadata` naming one is refused at once.
  std::mutex dropped_mu_;
  std::set<std::string> dropped_paths_;  // GUARDED_BY(dropped_mu_)
  void NoteError(const std::string& msg);
  // Logs `st` when it reaches the application as EIO (ino, path, offset; rate-limited) and
  // returns it. Takes ns_mu_: call without it.
  Status LogIfIo(const char* op, uint64_t ino, uint64_t offset, Status st);
  Result<Handle*> OpenFile(uint64_t ino, int flags);
  Result<size_t> ReadData(Handle* h, char* out, size_t len, uint64_t offset);
  Status WriteData(Handle* h, const char* data, size_t len, uint64_t offset);
  Status FlushData(Handle* h);
  std::atomic<int64_t> io_log_second_{0};
  std::atomic<int> io_logged_{0};
  std::atomic<uint64_t> io_suppressed_{0};

  // Indexes committed checkpoints in the background (the journal thread never waits).
  void QueueIndexBuild(const std::string& ckpt);
  // Fetches a checkpoint's items into the block cache in file order (a load started).
  void QueuePrefetch(const std::string& ckpt);
  void PrefetchCheckpoint(const std::string& ckpt);
  // Prefetches the whole DCP item that `offset` falls in, once per item and handle.
  void PrefetchItem(Handle* h, uint64_t offset);
  bool CommittedDirLocked(const Node* dir) const;
  std::unique_ptr<store::BlockCache> cache_;
  std::deque<std::string> prefetch_queue_;  // GUARDED_BY(index_mu_)
  void RunIndexer();
  std::unique_ptr<store::KeyIndex> index_;
  std::unique_ptr<store::ReadChecksums> read_sums_;  // checksums on first full read
  std::unique_ptr<TensorView> tensors_;
  std::mutex index_mu_;
  std::condition_variable index_cv_;
  std::deque<std::string> index_queue_;  // GUARDED_BY(index_mu_)
  bool index_stop_ = false;              // GUARDED_BY(index_mu_)
  std::thread indexer_;
};

}  // namespace ckptfs::fs
