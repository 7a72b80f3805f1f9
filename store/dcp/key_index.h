// KeyIndex: which byte range of which shard file holds which DCP key, per checkpoint.
//
// Every checkpoint format of checkpoint_source.h is indexed the same way: a DCP `.metadata`,
// a no-collectives save's `__{rank}.metadata` files, or Hugging Face safetensors (index and
// shard headers; an item is a tensor's raw bytes, there is no archive to read). Below,
// ".metadata" stands for whichever commit files the checkpoint has.
//
// A checkpoint directory's `.metadata` (dcp_metadata.h) and each item's torch.save archive
// (torch_zip.h) are read from the backing store and turned into one IndexedItem per key
// (checkpoint dir, fqn, chunk offsets); bytes items have no offsets. The index lives in
// RocksDB (StateDb) and in memory, with a per-file interval map so that a read offset
// resolves to its key in O(log n) without touching RocksDB.
//
// RocksDB layout (the index is a cache: deleting the state dir loses nothing, it is rebuilt
// from the backing store on first use):
//   "k/" + ckpt + '\0' + file + '\0' + block (4 bytes, big-endian) -> the binary IndexedItems
//     (index_codec.h) of up to 256 items of `file`, in (offset, ordinal) order: block b
//     holds that file's items b*256 to b*256+255. A 100,000-chunk checkpoint is ~400 values,
//     not 100,000 keys, and a checksum recorded later rewrites one block.
//   "i/" + ckpt -> JSON {format, state: ok|partial|failed, error, build_ms, built_at, items,
//                        checksum: "crc32c", checksums: {items, from_blocks, read_items,
//                        read_bytes}, metadata: {size, mtime_ns, ino}}
// The `.metadata` identity (size, mtime, inode) is recorded so that an index loaded from
// RocksDB after a restart is rebuilt when the checkpoint was rewritten in the meantime. While
// the daemon runs, the caller keeps the index current: Build() on publish, Forget() on
// removal, OnRenamed() on a directory rename.
//
// Checksums (CRC32C of each item's bytes, see crc32c.h) come from three places, none of which
// reads the bulk data just to hash it when it can be avoided:
//   * the write path: a shard written through the mount hands over its BlockCrcMap at
//     publication (AddBlockCrcs); a build then combines the CRCs of the blocks inside each
//     item with the CRCs of its unaligned edges (under one block each, mostly already read by
//     the zip parse);
//   * the first full read of an item (RecordChecksums, fed by the read path);
//   * a build or FillChecksums() with checksums requested reads the items still without one.
// A lazy build (first look at a checkpoint written elsewhere) reads no bulk data: its items
// have no checksum until one of the above supplies it, and Verify reports them as unchecked.
//
// Errors. A malformed `.metadata` never crashes anything: the checkpoint is indexed as
// "failed", with no items and an IndexError(). An item whose archive cannot be read or
// contradicts the metadata is kept as kOpaque (its bytes stay servable), and the checkpoint
// is "partial" with an IndexError() naming the first such key.
//
// Parts. KeyIndex owns the in-memory indexes (CkptIndex, ckpt_index.h), the lookups, the
// checksums recorded later, forget/rename, and when each checkpoint is built or loaded. It
// owns and uses: KeyIndexBuilder (key_index_builder.h: commit and shard files -> CkptIndex),
// KeyIndexStore (key_index_store.h: the RocksDB records), KeyIndexVerifier
// (key_index_verifier.h: re-reading items for Verify and FillChecksums) and the BlockCrcCache.
// None of the parts has a lock of its own but the block CRC cache; index_codec (records),
// item_reader (reading items) and fqn_names are below them.
//
// Thread-safe. Lock order: a checkpoint's build mutex, then persist_mu_, then mu_ (the block
// CRC cache's lock is a leaf). No I/O under mu_: the builder and the verifier read with no
// lock of KeyIndex held (a build under its checkpoint's build mutex), the store writes under
// persist_mu_ only.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/dcp/block_crc_cache.h"
#include "store/dcp/checkpoint_source.h"
#include "store/dcp/ckpt_index.h"
#include "store/dcp/dcp_metadata.h"
#include "store/dcp/fqn_names.h"
#include "store/dcp/indexed_item.h"
#include "store/dcp/key_index_builder.h"
#include "store/dcp/key_index_store.h"
#include "store/dcp/key_index_verifier.h"
#include "store/flush/block_crc_map.h"
#include "store/primitives/backing_dir.h"
#include "store/primitives/file_key.h"
#include "store/primitives/state_db.h"

namespace ckptfs::store {

// Builds the index of a checkpoint that was just committed, in the background, so that
// the journal that committed it never waits for the build. Publication queues one per
// commit (PublicationOptions::index_builds); the loader (store/load/loader.h) runs them on
// its worker. Thread-safe; never blocks.
class KeyIndexBuilds {
 public:
  virtual ~KeyIndexBuilds() = default;
  virtual void QueueBuild(const std::string& ckpt) = 0;
  // The journal removed the backing store's file `path` or put another one at its name
  // (an unlink, a publish or rename over it, a rename away): descriptors kept open to
  // read it close now, so that the space of a deleted file is freed at once (a
  // rotation's `rm -r` of old checkpoints), not when the loader's descriptor cache evicts
  // it (the soak, async on two nodes: 346 descriptors of deleted shards at the end).
  virtual void FileGone(const std::string& path) = 0;
};

struct KeyIndexOptions {
  // Memory for block CRC maps handed over by the write path and not used by a build yet;
  // the oldest are dropped beyond it (their items are then read to be checksummed).
  uint64_t max_block_crc_bytes = uint64_t{128} << 20;
  // The build after a commit reads the items nobody vouched for (no block CRCs of that file
  // version, no checksum recorded) to checksum them. False with peers: those are other
  // nodes' shards (G12: no node reads another node's data back after a save); they stay
  // unchecked until their first full read (ReadChecksums) or FillChecksums.
  bool read_unvouched_items = true;
  // Shard bytes memory still holds (the retained tier keeps the checkpoint just committed):
  // a build reads those from it, not from the backing store. Borrowed, may be null.
  keyidx::HeldBytes* held = nullptr;
};

class KeyIndex {
 public:
  static Result<std::unique_ptr<KeyIndex>> Create(BackingDir* dir,  // must outlive
                                                  StateDb* db,      // must outlive
                                                  const KeyIndexOptions& options = {});
  ~KeyIndex();
  KeyIndex(const KeyIndex&) = delete;
  KeyIndex& operator=(const KeyIndex&) = delete;

  // (Re)builds the index of checkpoint dir `ckpt` (relative to the backing root, "" = root)
  // from its .metadata and each item's zip directory. Item checksums come from block CRCs
  // (AddBlockCrcs) and RecordChecksums() where those cover the item; with `checksums`, every
  // other item is read once to checksum it, and the block CRC maps used are released.
  // NotFound when `ckpt` has no .metadata; Corrupt when the .metadata is malformed (the
  // checkpoint is then indexed as failed). A partial index (some items opaque) is OK.
  Status Build(const std::string& ckpt, bool checksums);
  // Same, from metadata already parsed by the caller (e.g. the publish path). The .metadata
  // identity is still taken from the backing store when it is there.
  Status BuildFrom(const std::string& ckpt, const DcpMetadata& md, bool checksums);

  // Items of `ckpt` in .metadata order, building lazily (without reading items to checksum
  // them) on first use if not indexed yet. The index error of a failed checkpoint is returned
  // as a Corrupt status. A copy of the whole index: for tools and tests; a lookup path uses
  // Fqns() / ItemsOf() / Locate().
  Result<std::vector<IndexedItem>> Items(const std::string& ckpt);
  // The distinct fqns of `ckpt`, sorted. Same laziness and errors as Items().
  Result<std::vector<std::string>> Fqns(const std::string& ckpt);
  // The items (chunks) of one fqn of `ckpt`, in .metadata order; empty when there is no such
  // fqn. O(log n + chunks): no pass over the index. Same laziness and errors as Items().
  Result<std::vector<IndexedItem>> ItemsOf(const std::string& ckpt, const std::string& fqn);

  // The item whose byte range [offset, offset+length) in `file` of `ckpt` contains `offset`,
  // or nullopt. In memory, O(log n): an interval map per file, loaded from RocksDB on first
  // use, or built without checksums when there is no index yet (which does I/O once).
  std::optional<IndexedItem> Resolve(const std::string& ckpt, const std::string& file,
                                     uint64_t offset);

  // What a read path needs of the resolved item, without copying names and shapes: Resolve()
  // without allocation. Same lookup and laziness as Resolve().
  using Located = ItemSpan;  // ordinal: index into Items()
  std::optional<Located> Locate(const std::string& ckpt, const std::string& file, uint64_t offset);

  // "" when `ckpt` is indexed without error, or is not indexed (yet).
  std::string IndexError(const std::string& ckpt);

  // Re-reads every item from the backing store: the .metadata still parses and agrees with
  // the index, each item's archive is intact and agrees with the metadata (dtype, shape, raw
  // range), and checksums match. Lists every bad key; items without a checksum are counted
  // as unchecked, not bad. Never modifies the index. Errors only when `ckpt` cannot be
  // indexed at all (no .metadata).
  Result<VerifyReport> Verify(const std::string& ckpt);

  // Reads the items of `ckpt` that have no checksum yet and records their checksums (trust
  // on first use: use Verify to compare with checksums taken earlier). Returns how many.
  Result<uint64_t> FillChecksums(const std::string& ckpt);

  // Block CRCs of the file `path` (relative to the backing root), recorded while it was
  // written and finished at its final size; `id` is the file's identity right after its
  // publication. A build uses them only for the very same file version.
  void AddBlockCrcs(const std::string& path, const FileKey& id,
                    std::shared_ptr<const BlockCrcMap> map);
  uint64_t block_crc_bytes();  // memory held by those maps now
  // The file `path` was unlinked on the backing store: its block CRCs go. (A checkpoint's
  // files go with it, Forget; a file outside any, such as a log the application deletes,
  // would stay until the maps' memory bound evicted it.)
  void OnFileRemoved(const std::string& path);

  // Block CRCs that a peer vouched for (the commit query) for the file `path`. Kept as
  // AddBlockCrcs keeps this node's own, but only when the backing store shows that very
  // version now (ino, size and mtime: the peer's device number is its own), and never in
  // place of a map kept already. A wrong CRC from an authenticated peer makes a wrong
  // checksum, which Verify (a re-read) reports. False when not taken.
  bool AddPeerBlockCrcs(const std::string& path, const ShardChecksums& sums);
  // The block CRCs this node recorded for `path` (its latest version published here), every
  // block known, for a peer; null when there are none. In memory only.
  std::shared_ptr<const ShardChecksums> ShardChecksumsOf(const std::string& path);

  // Records checksums computed elsewhere (e.g. by the read path from the bytes of an item
  // read in full) for `file` of `ckpt`. A range equal to an indexed item's range sets its
  // checksum (persisted); ranges of a checkpoint not indexed yet are kept in memory for its
  // next Build(), which then does not read those items again.
  void RecordChecksums(const std::string& ckpt, const std::string& file,
                       const std::vector<RangeChecksum>& sums) EXCLUDES(persist_mu_, mu_);

  // Drops the index of `ckpt` (memory and RocksDB) and any pending checksums and block CRCs.
  void Forget(const std::string& ckpt) EXCLUDES(mu_);
  // Directory `from` was renamed to `to`: every checkpoint at or below `from` moves
  // (path::Rebase, the rename rule of every path-keyed store).
  void OnRenamed(const std::string& from, const std::string& to) EXCLUDES(mu_);
  // Checkpoints with an index (in RocksDB or in memory), sorted.
  std::vector<std::string> IndexedCheckpoints() EXCLUDES(mu_);
  // Whether `ckpt` is among IndexedCheckpoints(), without listing them all. The read path
  // asks this on every open of a committed checkpoint's file: a checkpoint found in memory
  // or known to have no index answers without RocksDB (a point lookup that misses costs
  // more than the rest of the open; a load of a checkpoint saved around the mount spent
  // 16% of the daemon's CPU in it).
  bool IsIndexed(const std::string& ckpt) EXCLUDES(mu_);

 private:
  using State = IndexState;
  using FileMap = CkptIndex::FileMap;

  KeyIndex(BackingDir* dir, StateDb* db, const KeyIndexOptions& options)
      : dir_(dir),
        block_crcs_(options.max_block_crc_bytes),
        builder_(dir, &block_crcs_, options.read_unvouched_items, options.held),
        store_(dir, db),
        verifier_(dir) {}

  // Calls fn(const CkptIndex&, const Located*) under a shared lock of mu_ with the item
  // containing `offset`, or nullptr; loads or builds the index first when needed.
  template <typename Fn>
  auto WithItemAt(const std::string& ckpt, const std::string& file, uint64_t offset, Fn fn);
  // Calls fn(const CkptIndex&) under a shared lock of mu_ once `ckpt` is present and neither
  // missing nor failed (whose statuses it returns instead).
  template <typename Fn>
  auto WithIndex(const std::string& ckpt, Fn fn) -> decltype(fn(std::declval<const CkptIndex&>()));

  // Per-checkpoint build lock, so concurrent lazy builds of one checkpoint happen once.
  std::shared_ptr<std::mutex> BuildMutex(const std::string& ckpt) EXCLUDES(build_mus_mu_);
  // Caller holds the build mutex of `ckpt`.
  Status BuildLocked(const std::string& ckpt, const DcpMetadata* given, bool checksums)
      EXCLUDES(persist_mu_, mu_);
  // Makes `ckpt` present in memory: loads it from RocksDB or builds it. OK also for failed
  // and missing checkpoints (see the state).
  Status Ensure(const std::string& ckpt, bool checksums) EXCLUDES(persist_mu_, mu_);
  Status LoadFromDb(const std::string& ckpt, bool* found) EXCLUDES(persist_mu_, mu_);
  // Every index installed or moved invalidates what IsIndexed remembers as unindexed.
  void ForgetNotIndexedLocked() REQUIRES(mu_);
  // Installs `index` in memory, applying checksums recorded meanwhile. Caller holds
  // persist_mu_ so that those checksums reach RocksDB after the index itself.
  void Install(const std::string& ckpt, std::unique_ptr<CkptIndex> index) REQUIRES(persist_mu_)
      EXCLUDES(mu_);

  BackingDir* const dir_;
  BlockCrcCache block_crcs_;  // by backing path
  KeyIndexBuilder builder_;   // uses block_crcs_
  KeyIndexStore store_;       // writes ordered by persist_mu_
  KeyIndexVerifier verifier_;

  Mutex build_mus_mu_;
  std::map<std::string, std::weak_ptr<std::mutex>> build_mus_ GUARDED_BY(build_mus_mu_);

  // Orders the RocksDB writes of the index (a build's blocks, then checksums recorded later),
  // which are encoded under mu_ but written after it is released.
  Mutex persist_mu_ ACQUIRED_BEFORE(mu_);

  SharedMutex mu_;
  std::unordered_map<std::string, std::unique_ptr<CkptIndex>> ckpts_ GUARDED_BY(mu_);
  // ckpt -> file -> (offset, length) -> checksum, for checkpoints not indexed yet.
  std::map<std::string, KnownSums> pending_sums_ GUARDED_BY(mu_);
  // Checkpoints IsIndexed found in neither memory nor RocksDB, since not_indexed_gen_ last
  // moved; at most kMaxNotIndexed (then emptied).
  static constexpr size_t kMaxNotIndexed = 4096;
  std::unordered_set<std::string> not_indexed_ GUARDED_BY(mu_);
  uint64_t not_indexed_gen_ GUARDED_BY(mu_) = 0;
};

// Defined here beside the class (the lookups and FillChecksums instantiate it).
template <typename Fn>
auto KeyIndex::WithIndex(const std::string& ckpt, Fn fn)
    -> decltype(fn(std::declval<const CkptIndex&>())) {
  CKPT_RETURN_IF_ERROR(Ensure(ckpt, /*checksums=*/false));
  ReaderLock lock(&mu_);
  auto it = ckpts_.find(ckpt);
  if (it == ckpts_.end()) return Internal("index of '" + ckpt + "' vanished");
  const CkptIndex& index = *it->second;
  if (index.state == State::kMissing) return NotFound("no checkpoint files in '" + ckpt + "'");
  if (index.state == State::kFailed) return Corrupt(index.error);
  return fn(index);
}

}  // namespace ckptfs::store
