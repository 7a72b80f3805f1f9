// MemoryTier (issue 42): the files of memory-only trees, kept in the daemon's memory and
// never written to the backing store.
//
// A tree is a directory marked `user.ckptfs.tier=memory` (the mark is an xattr of the
// backing directory, kept there by the caller) and everything below it. Every name below
// the marked directory is a node of this tier: directories and regular files, their bytes
// in blocks of `block_bytes` within one budget (`--memory-ckpt-mem`), apart from staging, so
// a save to the backing store never waits for it. A write that does not fit fails with
// kNoSpace and changes nothing; nothing is evicted for it.
//
// Checkpoints. A directory of a tree is a checkpoint once it holds a checkpoint file; it is
// *committed* when its commit file (`.metadata`, store/dcp/commit_names.h) appears, by
// rename or by the close of a handle that wrote it, and every file the `.metadata` names is
// there with at least the length it needs (else the commit is refused, kept `writing`). This
// node is the only one: committed in memory alone (no peer holds a replica), and the log
// says so. A commit drops the other committed checkpoints of its tree (the newest evicts the
// older ones), and with them every tracker of the tree that names one: a small file whose
// content is a dropped checkpoint's directory name, or the iteration of an `iter_NNNNNNN`
// directory (Megatron's latest_checkpointed_iteration.txt). So the budget must hold two
// checkpoints of a tree: the newest committed one stays whole while the next is written.
//
// With peers (SetReplication, store/peer/memory_replica.h), a checkpoint whose files are all
// here is *replicating* until one peer holds a copy of it, and committed (evicting the older
// ones) only then; a tracker (a small file outside any checkpoint) is copied to the peer on
// each close. A restarted daemon gets its units back (RestoreFile, FinishRestore, while
// restore_gate() is closed), and a recorded checkpoint that no peer gave back is *lost*
// (NoteLost): listed as such, never served.
//
// Node ids are never reused. Open files hold ids: a node that is gone (unlinked, dropped)
// answers kNotFound. Stop (DropAll) drops every tree: without peers nothing else holds
// them; with peers the replicas stay in the peers' memory (docs/SEMANTICS.md,
// "Memory-only directories").
//
// Thread-safe. One mutex guards the tree and the budget; file bytes are copied without it
// (blocks are shared_ptrs, so a concurrent drop cannot free them under a copy).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/mutex.h"
#include "common/status.h"

namespace ckptfs::store {

struct MemoryTierOptions {
  uint64_t budget_bytes = 0;          // 0: every write into a memory-only tree is kNoSpace
  uint64_t block_bytes = 1ull << 20;
};

struct MemAttr {
  uint64_t id = 0;
  bool dir = false;
  uint64_t size = 0;
  mode_t mode = 0;  // permission bits
  uid_t uid = 0;
  gid_t gid = 0;
  struct timespec mtime {};
  struct timespec ctime {};
  uint64_t nlink = 1;
};

struct MemCheckpoint {
  std::string path;  // the marked directory's path (as last told) + the path in the tree
  // "writing", "replicating" (whole here, no peer holds it yet), "committed",
  // "unreplicated" (whole here, no peer took it: not committed) or "lost".
  std::string state;
  uint64_t bytes = 0;
  std::string where;  // "memory (this node only, no peers)", "this node + replica on ..."
  std::string holder;  // the peer that holds its replica ("" when none)
  std::string tree;     // the marked directory's path
  std::string in_tree;  // the checkpoint's path in the tree
  uint64_t seq = 0;     // its version handed to replication (0: none)
};

// One unit of replication: a checkpoint directory of a tree, or a tracker file.
struct MemUnitFile {
  std::string name;  // relative to the unit's path ("" for a tracker: the unit is the file)
  uint64_t size = 0;
  uint32_t crc32c = 0;
};
struct MemUnit {
  std::string tree;  // the marked directory's path
  std::string path;  // in the tree
  bool checkpoint = true;
  uint64_t seq = 0;  // its version: the wall clock (ns) when it was handed to replication
  std::vector<MemUnitFile> files;
  uint64_t bytes() const {
    uint64_t b = 0;
    for (const MemUnitFile& f : files) b += f.size;
    return b;
  }
};

// A file of a checkpoint written by ranks on several nodes that another node wrote: this
// node lists it and reads it from its writer (`rank`), or from the node holding the
// writer's part (`holder`), never keeping its bytes.
struct MemRemoteFile {
  uint32_t rank = 0;   // the writer node
  std::string holder;  // the address of the node holding the writer's part ("" unknown)
  std::string tree;    // the marked directory's path
  std::string unit;    // the checkpoint's path in the tree (the part's unit on the writer)
  std::string file;    // the file's path in the checkpoint
  uint64_t seq = 0;    // the part's version
  uint64_t size = 0;
};

// What a node holds of a checkpoint written through several nodes (its part), as the
// `.metadata`'s node gathers it.
struct MemPart {
  uint32_t rank = 0;
  std::string holder;  // where the part is replicated
  std::vector<MemUnitFile> files;
};

// Where replication is queued (store/peer/memory_replica.h). Replicate() and Gather() run
// under the tier's lock: they must only queue, never call the tier. MirrorDir(),
// MirrorRmdir(), MirrorRename() and ReadRemote() are called without it and may talk to peers
// (bounded by the peer timeout).
class MemoryReplication {
 public:
  virtual ~MemoryReplication() = default;
  virtual void Replicate(const std::string& tree, const std::string& path, bool checkpoint,
                         uint64_t seq) = 0;
  // Checkpoint `path` of `tree` (version `seq`) has its `.metadata` here but names files
  // this node did not write: its own part is handed over and the other nodes' parts are
  // gathered (CommitGathered), or it is refused (GatherFailed).
  virtual void Gather(const std::string& tree, const std::string& path, uint64_t seq) = 0;
  // Directory `path` of `tree` was made here: the other nodes make it too (ranks on other
  // nodes write their shards into the directory DCP's coordinator made).
  virtual void MirrorDir(const std::string& tree, const std::string& path) = 0;
  // Directory `path` of `tree` was removed here: the other nodes remove it too, with what
  // they list of a committed checkpoint in it, unless a file of their own that is no
  // committed checkpoint's is still in it (a rank there may be writing: that directory
  // stays there, as a non-empty rmdir fails).
  virtual void MirrorRmdir(const std::string& tree, const std::string& path) = 0;
  // Directory `from` of `tree` was renamed to `to` here (a save into a temporary directory
  // renamed into place): the other nodes rename it too, with their parts in it, and the
  // replicas held of units below it follow (RenameDir on the wire; FollowMove).
  virtual void MirrorRename(const std::string& tree, const std::string& from,
                            const std::string& to) = 0;
  virtual Result<size_t> ReadRemote(const MemRemoteFile& f, char* out, size_t len,
                                    uint64_t offset) = 0;
};

struct MemoryTierStats {
  uint64_t budget_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t peak_used_bytes = 0;
  uint64_t trees = 0;
  uint64_t commits = 0;
  uint64_t refused_commits = 0;  // a `.metadata` naming files missing or short
  uint64_t evicted_checkpoints = 0;
  uint64_t evicted_bytes = 0;
  uint64_t trackers_dropped = 0;
  uint64_t nospace_writes = 0;
  // Checkpoints still waiting for a replica dropped to make room for a newer save.
  uint64_t superseded_for_room = 0;
  uint64_t lost_checkpoints = 0;  // dropped by a stop without a replica, or not given back
  uint64_t replicated_checkpoints = 0;  // committed once a peer held them
  uint64_t unreplicated_checkpoints = 0;  // no peer took them: never committed
  uint64_t restored_checkpoints = 0;  // given back by a peer after a restart
  uint64_t restored_bytes = 0;
  uint64_t replica_bytes = 0;  // peers' replicas held here (in the same budget)
};

// Whether a restore is under way (issue 42): a tree's first look after a restart waits for
// it (fs/namespace/memory_view.cc), bounded. Thread-safe.
class MemoryRestoreGate {
 public:
  void Close() EXCLUDES(mu_);  // a restore starts
  void Open() EXCLUDES(mu_);   // it ended, or was cut short
  // Returns once open, or after `max`.
  void Wait(std::chrono::milliseconds max) EXCLUDES(mu_);

 private:
  Mutex mu_;
  std::condition_variable cv_;  // closed_ cleared; waited on with mu_
  bool closed_ GUARDED_BY(mu_) = false;
};

class MemoryParts;

class MemoryTier {
 public:
  explicit MemoryTier(const MemoryTierOptions& options);
  ~MemoryTier();
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  // The root node of the tree of marked directory `key` (an id the caller keeps for that
  // directory while the daemon runs), made on first use; `path` names it in listings and
  // logs (relative to the backing root; call again after a rename to update it; empty:
  // keep the one it has).
  uint64_t TreeRoot(uint64_t key, const std::string& path) EXCLUDES(mu_);
  // Whether the tree of `key` has no names (an unmarked or unknown key has none).
  bool TreeEmpty(uint64_t key) const EXCLUDES(mu_);
  // Forgets the (empty) tree of `key`: its marked directory is gone.
  void DropTree(uint64_t key) EXCLUDES(mu_);

  Result<MemAttr> Lookup(uint64_t dir, std::string_view name) const EXCLUDES(mu_);
  Result<MemAttr> GetAttr(uint64_t id) const EXCLUDES(mu_);
  // Unset fields are left as they are; `size` truncates or extends (with zeros) a file.
  struct Change {
    const mode_t* mode = nullptr;
    const uid_t* uid = nullptr;
    const gid_t* gid = nullptr;
    const uint64_t* size = nullptr;
    const struct timespec* mtime = nullptr;
  };
  Result<MemAttr> SetAttr(uint64_t id, const Change& change) EXCLUDES(mu_);
  Result<MemAttr> Mkdir(uint64_t dir, std::string_view name, mode_t mode, uid_t uid, gid_t gid)
      EXCLUDES(mu_);
  // A new empty file, or (not `exclusive`) the existing file of that name.
  Result<MemAttr> Create(uint64_t dir, std::string_view name, mode_t mode, uid_t uid, gid_t gid,
                         bool exclusive) EXCLUDES(mu_);

  // Writes [offset, offset+len) of file `id`: `fill(out, n)` copies the next n bytes of the
  // payload into `out` (without the tier's lock). kNoSpace, nothing written, when the
  // blocks it needs do not fit the budget.
  using Fill = std::function<Status(char* out, size_t n)>;
  Status Write(uint64_t id, uint64_t offset, size_t len, const Fill& fill) EXCLUDES(mu_);
  Result<size_t> Read(uint64_t id, char* out, size_t len, uint64_t offset) const EXCLUDES(mu_);
  // A handle that wrote `id` was closed: a commit file commits its checkpoint.
  void Closed(uint64_t id) EXCLUDES(mu_);

  Status Unlink(uint64_t dir, std::string_view name) EXCLUDES(mu_);
  Status Rmdir(uint64_t dir, std::string_view name) EXCLUDES(mu_);
  // Within one tree (another tree: kCrossDevice). `noreplace`: kExists if `new_name` is.
  // With peers a directory's rename is made on every node before it returns (MirrorRename).
  Status Rename(uint64_t dir, std::string_view name, uint64_t new_dir, std::string_view new_name,
                bool noreplace) EXCLUDES(mu_);
  Result<std::vector<std::pair<std::string, MemAttr>>> List(uint64_t dir) const EXCLUDES(mu_);

  std::vector<MemCheckpoint> Checkpoints() const EXCLUDES(mu_);
  MemoryTierStats Stats() const EXCLUDES(mu_);
  // The daemon is stopping: every tree is dropped, each checkpoint without a replica
  // logged as lost.
  void DropAll() EXCLUDES(mu_);

  // --- Replication (with peers). `replication` must outlive the tier or be unset first.
  void SetReplication(MemoryReplication* replication) EXCLUDES(mu_);
  // The files of unit `path` of `tree` at version `seq`, with their CRC32C. kNotFound when
  // it is gone or another version now (the peer wire carries codes up to kTooManyOpenFiles).
  Result<MemUnit> Manifest(const std::string& tree, const std::string& path, uint64_t seq) const
      EXCLUDES(mu_);
  // Bytes of file `file` of that unit ("" for a tracker unit).
  Result<size_t> ReadUnit(const std::string& tree, const std::string& path, uint64_t seq,
                          const std::string& file, char* out, size_t len, uint64_t offset) const
      EXCLUDES(mu_);
  // The hand-over of unit `path` at version `seq` ended: `holder` holds it (a checkpoint
  // is committed now, the older ones evicted; one committed before takes the new holder),
  // or no peer took it (it stays uncommitted, "unreplicated", logged). A unit gone or of
  // another version by now: nothing. An unreplicated checkpoint is listed as such
  // (Checkpoints(): tree, in_tree, seq) and may be handed over again.
  void HandedOver(const std::string& tree, const std::string& path, uint64_t seq,
                  const Result<std::string>& holder) EXCLUDES(mu_);
  // Peers' replicas held here count in the budget: kNoSpace when `delta` > 0 bytes do not
  // fit; a negative `delta` gives bytes back.
  Status ChargeReplicas(int64_t delta) EXCLUDES(mu_);

  // --- Restore after a restart, while restore_gate() is closed.
  MemoryRestoreGate& restore_gate() { return gate_; }
  // File `path` of `tree` (parents made), `size` bytes from `fill`. kNoSpace as Write.
  Status RestoreFile(const std::string& tree, const std::string& path, uint64_t size,
                     const Fill& fill) EXCLUDES(mu_);
  // The restore of unit `path` of `tree` ended: `whole`, it is committed (a checkpoint), its
  // replica on `holder`; else what it left is removed, never served partly.
  void FinishRestore(const std::string& tree, const std::string& path, uint64_t seq,
                     const std::string& holder, uint64_t bytes, bool whole) EXCLUDES(mu_);
  // Checkpoint `path` of `tree` was committed before the restart and nobody gave it back.
  void NoteLost(const std::string& tree, const std::string& path, const std::string& why)
      EXCLUDES(mu_);

 public:
  // The tier's nodes: defined in memory_tier_node.h, private to store/memory/.
  struct Block;
  struct Node;
  struct CallOut;

 private:
  Node* NodeLocked(uint64_t id) const REQUIRES(mu_);
  Result<Node*> DirLocked(uint64_t id) const REQUIRES(mu_);
  Node* NewNodeLocked(Node* parent, std::string_view name, bool dir, mode_t mode, uid_t uid,
                      gid_t gid) REQUIRES(mu_);
  // Frees `n` and everything below it (its bytes leave the budget).
  void RemoveLocked(Node* n) REQUIRES(mu_);
  void ResizeLocked(Node* n, uint64_t size) REQUIRES(mu_);
  // `file` is a commit file that just appeared or was closed: commits its directory if every
  // file its `.metadata` names is there and long enough, then evicts the older ones.
  void MaybeCommitLocked(Node* file) REQUIRES(mu_);
  void EvictOlderLocked(Node* committed) REQUIRES(mu_);
  // Removes checkpoint `old` (unless it holds or is inside `newer`) and the trackers naming
  // it, logging "`old` `why` `newer`"; false if it was kept.
  bool DropOlderLocked(Node* old, Node* newer, const char* why) REQUIRES(mu_);
  Node* TreeByPathLocked(const std::string& tree) const REQUIRES(mu_);
  Result<const Node*> UnitLocked(const std::string& tree, const std::string& path,
                                 uint64_t seq) const REQUIRES(mu_);
  void CommitLocked(Node* dir, const std::string& holder) REQUIRES(mu_);

  friend class MemoryParts;  // checkpoints written through several nodes (memory_parts.h)

  const MemoryTierOptions opts_;
  mutable Mutex mu_;
  mutable std::condition_variable calls_cv_;  // calls_out_ dropped to 0; waited on with mu_
  mutable uint64_t calls_out_ GUARDED_BY(mu_) = 0;  // calls into replication_ made without mu_
  uint64_t next_id_ GUARDED_BY(mu_) = 1;
  uint64_t order_ GUARDED_BY(mu_) = 0;
  uint64_t used_ GUARDED_BY(mu_) = 0;
  // The last second a refused write was logged (one line a second: torch 2.x's zip writer
  // reports a refused write() as "unexpected pos", so the log is where a user sees why).
  int64_t nospace_logged_s_ GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::unique_ptr<Node>> nodes_ GUARDED_BY(mu_);  // by id
  std::map<uint64_t, uint64_t> trees_ GUARDED_BY(mu_);  // marked dir key -> root node id
  MemoryTierStats stats_ GUARDED_BY(mu_);
  MemoryReplication* replication_ GUARDED_BY(mu_) = nullptr;
  uint64_t next_provisional_ GUARDED_BY(mu_) = 1;  // keys of trees restored before seen
  std::vector<MemCheckpoint> lost_ GUARDED_BY(mu_);  // reported since the restart
  MemoryRestoreGate gate_;
};

// /.ckptfs/stats' "memory_ckpt": the stats and the checkpoints held.
nlohmann::json MemoryTierJson(const MemoryTier& tier);

// What a tracker file may say about checkpoint directory `name`: its name, or for
// Megatron's `iter_NNNNNNN` directories the iteration number.
bool NamesCheckpoint(std::string content, const std::string& name);

}  // namespace ckptfs::store
