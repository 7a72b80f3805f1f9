// RetainedTier (issue 23): the newest committed checkpoint stays in the daemon's memory, so a
// restarted training job reads it back from memory instead of the backing store.
//
// Capture. The flush pipeline hands every chunk it wrote (OnWritten, on the flush thread,
// after the write, while the bytes are still in staging), per flush target (the backing
// temp file). Issue 42: the tier keeps the staging chunk itself, no copy: the staging pool
// lends it (SealedChunk::lender, common/chunk_lender.h) and puts a spare chunk in its
// place, and the blocks that start in the chunk point into it; the chunk goes back to the
// pool (as a spare) when the last of its blocks is dropped and no reader holds it. Only
// the pieces of blocks that start in another chunk (a chunk sealed early, mid-block) are
// copied, into block buffers of the block cache's size; a chunk mostly of such pieces, a
// chunk the pool will not lend, and a chunk without a lender (tests) are copied or skipped.
// Files whose name at open is not a checkpoint file's are passed over (FlushTarget::
// retainable). It never waits: when the budget has no room (after evicting what may be
// evicted, below) the block is skipped and simply not retained. A save never waits for
// the tier.
//
// Publish. When the journal publishes the target under its real name (OnJournalDone), each
// captured block is kept only if it is provably the file's bytes: its capture covers the
// block exactly once (an overlapping write, a copy of old contents or a gap leaves it out)
// and the write path's block CRCs (BlockCrcMap, fed the very same bytes; a truncate
// poisons it) know the block; that CRC is stored with it. The blocks are then named by the
// file's node-independent BlockId{path, size, mtime} as stat shows it after the rename and
// the times set by the publish: a file replaced or rewritten by anyone has another id, and
// a publish, unlink, rename or utimens of a path through this mount drops (or renames) what
// the tier held for it.
//
// Commit. Blocks belong to their checkpoint: the directory they are in. A checkpoint is
// *pending* until its `.metadata` is published, by this node's journal or (for a node that
// wrote only shards) seen on the backing store by a lazy check at read time that finds
// `.metadata` no older than the newest retained file of the checkpoint. Only committed
// checkpoints are served. When a checkpoint commits, the other committed checkpoints of
// its run (the parent directory), and pending ones of the run seen before it, are dropped.
//
// Budget. Captures, retained blocks, replicas, spare buffers, the lent chunks (their whole
// size, once, however many of their blocks are kept) and the staging pool's spares (memory
// it keeps for the next loan, `lender`) count against `budget_bytes`. A loan turns a pool
// spare into the lent chunk; a copy or replica takes a spare buffer (one of a dropped block,
// kept mapped) first. Else room is made by giving pool spares back, then evicting, in order:
// checkpoints pending for longer than `stale_pending` (a save that never committed), then
// committed ones, oldest commit first. Fresh pending checkpoints and captures in progress
// are never evicted.
//
// Serve. Lookup() copies a committed block into the caller's buffer and checks it against
// its stored CRC; a mismatch drops the block (counted) and reports a miss, so the caller
// falls back to its next source. RetainedSource puts the tier in front of the block cache's
// source: this node's copy, then the peers (owner or replica holder), then the backing store.
//
// Thread-safe. One mutex guards the index; no lock is held while bytes are copied, hashed or
// while the backing store is asked (the lazy commit check).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <sys/uio.h>

#include <nlohmann/json.hpp>

#include "common/mutex.h"
#include "common/status.h"
#include "store/cache/block_source.h"
#include "store/flush/block_crc_map.h"
#include "store/flush/flush_pipeline.h"
#include "store/primitives/backing_dir.h"
#include "store/publish/journal.h"
#include "store/publish/publication.h"

namespace ckptfs::store {

struct RetainedTierOptions {
  uint64_t budget_bytes = 0;          // 0: the tier is off
  uint64_t block_bytes = 1ull << 20;  // the block cache's block size
  // The staging pool whose chunks are lent to the tier: its spares count against the
  // budget. Optional (null: none counted); must outlive the tier.
  ChunkLender* lender = nullptr;
  // A pending checkpoint not committed after this long may be evicted for room.
  std::chrono::milliseconds stale_pending{60000};
  // At most one lazy `.metadata` check per pending checkpoint per this interval.
  std::chrono::milliseconds commit_check_interval{200};
};

struct RetainedCheckpoint {
  std::string dir;           // relative to the backing root
  bool committed = false;
  uint64_t own_bytes = 0;      // blocks this node wrote
  uint64_t replica_bytes = 0;  // blocks held for another node
  uint64_t files = 0;
  std::string origin;  // replicas: the node they came from ("" for own)
};

struct RetainedTierStats {
  uint64_t budget_bytes = 0;
  uint64_t used_bytes = 0;       // captures + retained blocks + replicas
  uint64_t peak_used_bytes = 0;
  uint64_t capture_bytes = 0;    // block buffers of captures not yet published
  uint64_t spare_bytes = 0;      // buffers of dropped blocks kept for reuse (in used_)
  uint64_t retained_bytes = 0;   // own blocks, any checkpoint state
  uint64_t replica_bytes = 0;    // blocks held for other nodes
  uint64_t captured_bytes = 0;   // bytes copied from staging, total
  uint64_t kept_bytes = 0;       // bytes kept in lent staging chunks, no copy, total
  uint64_t loans = 0;            // staging chunks lent to the tier, total
  uint64_t lent_bytes = 0;       // memory of lent chunks held now (in used_bytes)
  uint64_t skipped_bytes = 0;    // bytes not captured: no room within the budget
  uint64_t unverified_blocks = 0;  // captured blocks dropped at publish (not provably exact)
  uint64_t evicted_bytes = 0;
  uint64_t dropped_bytes = 0;     // dropped by a newer checkpoint, a rewrite, unlink...
  uint64_t hits = 0;              // blocks served (whole or in part) to reads
  uint64_t hit_bytes = 0;         // bytes served to reads
  uint64_t index_read_bytes = 0;  // bytes index builds read (not hits: no load asked)
  uint64_t misses_committed = 0;  // lookups of committed checkpoints' files not held
  uint64_t crc_errors = 0;        // blocks whose bytes did not match their CRC (dropped)
  uint64_t lazy_commit_checks = 0;
  uint64_t commits = 0;
};

class RetainedTier final : public FlushWriteListener, public JournalOutcomeListener {
 public:
  // `backing` (may be null in tests: no stat after publish means nothing is retained) must
  // outlive the tier.
  RetainedTier(BackingDir* backing, const RetainedTierOptions& options);
  ~RetainedTier();
  RetainedTier(const RetainedTier&) = delete;
  RetainedTier& operator=(const RetainedTier&) = delete;

  bool enabled() const { return opts_.budget_bytes > 0; }
  uint64_t block_bytes() const { return opts_.block_bytes; }

  // FlushWriteListener (FlushOptions::on_written): keeps the chunk (a loan), copies the
  // pieces it must, or skips it.
  void OnWritten(const std::shared_ptr<BlockCrcMap>& crcs, const SealedChunk& chunk) override
      EXCLUDES(mu_);
  // JournalOutcomeListener (PublicationOptions::retained): the journal applied `e` (after
  // the namespace saw it: its publish set the times and finished the block CRCs).
  void OnJournalDone(const JournalEntry& e, const Status& st) override EXCLUDES(mu_);
  // Marks checkpoint `dir` committed (its `.metadata` is on the backing store).
  void OnCommitted(const std::string& dir) EXCLUDES(mu_);

  // Copies block `offset / block_bytes` of `id` into `out` when a committed checkpoint holds
  // it, out.size() is at least its length, and its bytes match its CRC. nullopt: not served.
  std::optional<BlockRead> Lookup(const BlockId& id, uint64_t offset, std::span<char> out)
      EXCLUDES(mu_);

  // Serves [offset, offset+len) of `id` (clamped to id.size) with no copy: `use` gets
  // iovecs over the held blocks, and is called exactly once when this returns a count (the
  // blocks stay mapped until it returns, whatever a concurrent drop does). Every piece is
  // checked before `use` sees it: a block's first serve hashes it whole against its CRC and
  // keeps the CRCs of its kSubBlockBytes pieces, later serves hash only the pieces they
  // reply. nullopt (`use` not called): a block of the range is not held by a committed
  // checkpoint, or failed its check (then dropped and counted, as in Lookup). A read for
  // an index build is counted apart from the hits, which stay what reads got from memory.
  using InPlaceUse = std::function<void(std::span<const struct iovec>)>;
  enum class Reader { kRead, kIndexBuild };
  std::optional<size_t> ReadInPlace(const BlockId& id, size_t len, uint64_t offset,
                                    const InPlaceUse& use, Reader reader = Reader::kRead)
      EXCLUDES(mu_);
  static constexpr uint64_t kSubBlockBytes = 64 << 10;

  // Keeps a copy of a block of a committed checkpoint received from node `origin` (a
  // replica), if `crc` matches the bytes and the budget has room. False when not kept.
  bool PutReplica(const BlockId& id, uint64_t index, std::span<const char> bytes, uint32_t crc,
                  const std::string& origin) EXCLUDES(mu_);
  // Whether a block is held (any state), for the replication pull.
  bool Holds(const BlockId& id, uint64_t index) const EXCLUDES(mu_);
  // The own blocks of committed checkpoint `dir`: (id, block index), for replication.
  std::vector<std::pair<BlockId, uint64_t>> OwnBlocksOf(const std::string& dir) const
      EXCLUDES(mu_);
  // Runs the lazy commit check (Lookup) now for every pending checkpoint held.
  void CheckPendingCommits() EXCLUDES(mu_);
  // Whether a committed checkpoint of the run of `path` (the parent of its directory) is
  // held: false on a daemon that started fresh or lost its copy (ask the replica holder).
  bool HoldsRunOf(const std::string& path) const EXCLUDES(mu_);
  // Whether checkpoint `dir` is held (any bytes) and committed: its reads are served from
  // memory, so there is nothing to plan or read ahead for it.
  bool HoldsCommitted(const std::string& dir) const EXCLUDES(mu_);
  // Committed checkpoints, newest commit first.
  std::vector<RetainedCheckpoint> Checkpoints() const EXCLUDES(mu_);

  // Frees everything and retains nothing more (the daemon is stopping).
  void DropAll() EXCLUDES(mu_);

  RetainedTierStats Stats() const EXCLUDES(mu_);
  nlohmann::json StatsJson() const EXCLUDES(mu_);
  // Adds more fields to StatsJson() (the replication's); set once, before serving.
  void SetExtraStats(std::function<void(nlohmann::json*)> extra) { extra_stats_ = std::move(extra); }

  // Tests: flips a byte of a held block, as a memory error would.
  bool CorruptForTest(const BlockId& id, uint64_t index) EXCLUDES(mu_);
  // Tests: the clock behind stale_pending and commit_check_interval.
  void SetClockForTest(std::function<std::chrono::steady_clock::time_point()> now);

 private:
  struct Loan;    // a lent staging chunk
  struct Buffer;  // one block's memory: its own anonymous mapping, or within a Loan
  struct CaptureBlock;
  struct Capture;
  struct Held;  // a retained block
  struct Ckpt;
  struct Key {
    BlockId id;
    uint64_t index = 0;
  };
  struct KeyLess {
    bool operator()(const Key& a, const Key& b) const;
  };

  std::chrono::steady_clock::time_point Now() const;
  // Whether checkpoint `dir` is committed. When it is not and its lazy `.metadata` check is
  // due, sets `*check_dir` and `*newest` for CheckCommitNow (run without the lock).
  bool CommittedLocked(const std::string& dir, std::string* check_dir, int64_t* newest)
      REQUIRES(mu_);
  // The lazy check: commits `dir` when its `.metadata` is on the backing store, no older
  // than `newest` (the newest file retained of it). Returns whether it is committed.
  bool CheckCommitNow(const std::string& dir, int64_t newest) EXCLUDES(mu_);
  // A held block's bytes no longer match its CRC: drops it (if still held) and logs.
  void DropCorrupt(const Key& key, const std::shared_ptr<Held>& h) EXCLUDES(mu_);
  // Drops one checkpoint that may be evicted, other than `keep`. False when none may.
  bool EvictOneLocked(const std::string& keep) REQUIRES(mu_);
  // A block buffer within the budget: a spare one, else a new mapping, evicting what may be
  // evicted but checkpoint `keep`. Null when there is no room (the caller skips the block).
  std::shared_ptr<Buffer> TakeBufferLocked(const std::string& keep = {}) REQUIRES(mu_);
  // Room for a loan of `bytes` (charged to used_ when true), evicting what may be evicted.
  bool TakeLoanRoomLocked(uint64_t bytes) REQUIRES(mu_);
  // One step towards room: gives back the pool's spares beyond what fits `more` bytes, else
  // one spare buffer. False when neither had anything to give.
  bool ShrinkSparesLocked(uint64_t more) REQUIRES(mu_);
  // A buffer leaves a block (null: none): an own buffer nobody else holds stays as a spare,
  // so the next save or replica reuses its pages; any other leaves the account (a lent
  // chunk once its last block left).
  void RecycleLocked(std::shared_ptr<Buffer> buf) REQUIRES(mu_);
  void ReleaseLocked(uint64_t bytes) REQUIRES(mu_);
  Ckpt& CkptLocked(const std::string& dir) REQUIRES(mu_);
  void EraseHeldLocked(std::map<Key, std::shared_ptr<Held>, KeyLess>::iterator it,
                       uint64_t* counter) REQUIRES(mu_);
  void DropPathLocked(const std::string& path, bool subtree) REQUIRES(mu_);
  void DropCkptLocked(const std::string& dir, uint64_t* counter) REQUIRES(mu_);
  void RenameLocked(const std::string& from, const std::string& to) REQUIRES(mu_);
  void CommitLocked(const std::string& dir) REQUIRES(mu_);
  void SweepCapturesLocked() REQUIRES(mu_);
  void Publish(const JournalEntry& e) EXCLUDES(mu_);

  BackingDir* const backing_;
  const RetainedTierOptions opts_;
  std::function<std::chrono::steady_clock::time_point()> clock_;
  std::function<void(nlohmann::json*)> extra_stats_;

  mutable Mutex mu_;
  bool stopped_ GUARDED_BY(mu_) = false;
  uint64_t used_ GUARDED_BY(mu_) = 0;
  uint64_t order_ GUARDED_BY(mu_) = 0;  // creation / commit order of checkpoints
  std::map<uint64_t, std::shared_ptr<Capture>> captures_ GUARDED_BY(mu_);  // by target id
  std::map<Key, std::shared_ptr<Held>, KeyLess> held_ GUARDED_BY(mu_);
  std::map<std::string, Ckpt> ckpts_ GUARDED_BY(mu_);  // by directory
  // Buffers of dropped blocks, still mapped and counted in used_: a save's capture (and a
  // replica) reuses them before mapping new memory, so a steady run of saves copies into
  // pages that are already there (no page faults, no zeroing on the flush threads).
  std::vector<std::shared_ptr<Buffer>> spare_ GUARDED_BY(mu_);
  RetainedTierStats stats_ GUARDED_BY(mu_);
};

// A peer asks for a block "only if held in memory" by prefixing its path with this (a name
// the mount never shows): RetainedSource answers it from the tier or with NotFound, and
// never passes it on, so such a request never reads the backing store (replica pulls and
// the replica holder's reads, store/peer/replica.h).
inline constexpr std::string_view kRetainedOnlyPrefix = ".ckptfs-retained/";

// A BlockSource that serves from the tier first, then from `inner`.
class RetainedSource final : public BlockSource {
 public:
  RetainedSource(RetainedTier* tier, BlockSource* inner)  // both must outlive
      : tier_(tier), inner_(inner) {}
  Result<BlockRead> ReadBlock(const BlockId& id, uint64_t offset, std::span<char> out) override;

 private:
  RetainedTier* const tier_;
  BlockSource* const inner_;
};

}  // namespace ckptfs::store
