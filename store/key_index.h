// KeyIndex: which byte range of which shard file holds which DCP key, per checkpoint.
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
//     (see key_index.cc) of up to 256 items of `file`, in (offset, ordinal) order: block b
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
// Thread-safe. Lock order: a checkpoint's build mutex, then persist_mu_, then mu_. No I/O
// under mu_.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.h"
#include "store/backing_dir.h"
#include "store/block_cache.h"
#include "store/block_crc_map.h"
#include "store/dcp_metadata.h"
#include "store/state_db.h"

namespace ckptfs::store {

struct IndexedItem {
  ItemKind kind = ItemKind::kBytes;
  std::string fqn;
  std::vector<int64_t> chunk_offsets, chunk_sizes, global_size, stride;  // empty for bytes
  std::string dtype;
  std::string file;                         // relative to the checkpoint dir
  uint64_t offset = 0, length = 0;          // item range in file
  uint64_t raw_offset = 0, raw_nbytes = 0;  // file-absolute raw tensor bytes (kTensor only)
  int64_t storage_offset = 0;               // in elements
  std::vector<std::string> transforms;
  uint64_t checksum = 0;  // CRC32C of the item's bytes [offset, offset+length)
  bool has_checksum = false;
  bool is_bytes = false;  // a BytesStorageMetadata entry (also when kOpaque)
  uint32_t ordinal = 0;   // position in the .metadata (state_dict order, then chunk order)

  bool operator==(const IndexedItem&) const = default;
};

// "fqn@<ChunkFileName>", e.g. "layer.weight@0_128" or "step@data": how reports name a key.
std::string KeyName(const IndexedItem& item);

// The checksum algorithm of IndexedItem::checksum, as reports name it.
inline constexpr char kChecksumAlgorithm[] = "crc32c";
// Checksum of one item's bytes, as the index stores it (CRC32C).
uint64_t ItemChecksum(std::span<const char> bytes);

struct VerifyReport {
  uint64_t items = 0, bytes = 0;  // items checked, bytes re-read
  uint64_t unchecked = 0;         // items re-read but without a checksum to compare with
  std::vector<std::pair<std::string, std::string>> bad;  // (KeyName or file, reason)
};

struct KeyIndexOptions {
  // Memory for block CRC maps handed over by the write path and not used by a build yet;
  // the oldest are dropped beyond it (their items are then read to be checksummed).
  uint64_t max_block_crc_bytes = uint64_t{128} << 20;
};

// A checksum of the byte range [offset, offset+length) of a shard file, computed elsewhere.
struct RangeChecksum {
  uint64_t offset = 0, length = 0, checksum = 0;
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
  // as a Corrupt status.
  Result<std::vector<IndexedItem>> Items(const std::string& ckpt);

  // The item whose byte range [offset, offset+length) in `file` of `ckpt` contains `offset`,
  // or nullopt. In memory, O(log n): an interval map per file, loaded from RocksDB on first
  // use, or built without checksums when there is no index yet (which does I/O once).
  std::optional<IndexedItem> Resolve(const std::string& ckpt, const std::string& file,
                                     uint64_t offset);

  // What a read path needs of the resolved item, without copying names and shapes: Resolve()
  // without allocation. Same lookup and laziness as Resolve().
  struct Located {
    uint32_t ordinal;  // index into Items()
    ItemKind kind;
    bool has_checksum;
    uint64_t offset, length, raw_offset, raw_nbytes, checksum;
  };
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

  // Records checksums computed elsewhere (e.g. by the read path from the bytes of an item
  // read in full) for `file` of `ckpt`. A range equal to an indexed item's range sets its
  // checksum (persisted); ranges of a checkpoint not indexed yet are kept in memory for its
  // next Build(), which then does not read those items again.
  void RecordChecksums(const std::string& ckpt, const std::string& file,
                       const std::vector<RangeChecksum>& sums);

  // Drops the index of `ckpt` (memory and RocksDB) and any pending checksums and block CRCs.
  void Forget(const std::string& ckpt);
  // Directory `from` was renamed to `to`: every checkpoint at or below `from` moves.
  void OnRenamed(const std::string& from, const std::string& to);
  // Checkpoints with an index (in RocksDB or in memory), sorted.
  std::vector<std::string> IndexedCheckpoints();
  // Whether `ckpt` is among IndexedCheckpoints(), without listing them all (one point
  // lookup: the read path asks this on every open).
  bool IsIndexed(const std::string& ckpt);

 private:
  // The items of one shard file. `all` is every item of the file by (offset, ordinal), the
  // order they are persisted in. The items with a non-empty range, by offset, are in parallel
  // arrays, so that the binary search touches only the dense `begins` (and a sample of every
  // kSample-th of them, which stays in L1), and a lookup then reads one Located record,
  // never the IndexedItem with its names and shapes.
  struct FileMap {
    static constexpr size_t kSample = 32;
    std::string name;
    std::vector<uint32_t> all;
    std::vector<uint64_t> begins, sample;
    std::vector<Located> spans;  // spans[i].offset == begins[i]
    // Index of the span containing `offset`, or -1.
    ptrdiff_t Find(uint64_t offset) const {
      auto s = std::upper_bound(sample.begin(), sample.end(), offset);
      if (s == sample.begin()) return -1;
      size_t lo = (s - sample.begin() - 1) * kSample;
      size_t hi = std::min(lo + kSample, begins.size());
      auto it = std::upper_bound(begins.begin() + lo, begins.begin() + hi, offset);
      ptrdiff_t i = it - begins.begin() - 1;
      return offset - spans[i].offset < spans[i].length ? i : -1;
    }
  };
  // Where item `ordinal` is: maps[map], position `pos` in its `all`, span `span` (or -1).
  struct Place {
    uint32_t map = 0, pos = 0;
    int32_t span = -1;
  };
  enum class State { kOk, kPartial, kFailed, kMissing };
  struct CkptIndex {
    State state = State::kOk;
    std::string error;
    std::vector<IndexedItem> items;                     // ordinal order
    std::vector<FileMap> maps;                          // by file name
    std::unordered_map<std::string, uint32_t> files;    // name -> index into maps
    std::vector<Place> places;                          // by ordinal
    std::chrono::steady_clock::time_point retry_after;  // kMissing only
  };

  KeyIndex(BackingDir* dir, StateDb* db, const KeyIndexOptions& options)
      : dir_(dir), db_(db), opts_(options) {}

  struct PendingCrcs {
    FileKey id;
    std::shared_ptr<const BlockCrcMap> map;
    uint64_t seq = 0;  // age, for eviction
    size_t bytes = 0;
  };
  // The block CRCs of `path` if they describe the file version `id`, else nullptr.
  std::shared_ptr<const BlockCrcMap> BlockCrcsFor(const std::string& path, const FileKey& id);
  void DropBlockCrcsLocked(const std::string& path);  // REQUIRES(mu_) exclusive

  // Calls fn(const IndexedItem*) under a shared lock of mu_ with the item containing
  // `offset`, or nullptr; loads or builds the index first when needed.
  template <typename Fn>
  auto WithItemAt(const std::string& ckpt, const std::string& file, uint64_t offset, Fn fn);

  // Per-checkpoint build lock, so concurrent lazy builds of one checkpoint happen once.
  std::shared_ptr<std::mutex> BuildMutex(const std::string& ckpt);
  Status BuildLocked(const std::string& ckpt, const DcpMetadata* given, bool checksums);
  // Makes `ckpt` present in memory: loads it from RocksDB or builds it. OK also for failed
  // and missing checkpoints (see the state).
  Status Ensure(const std::string& ckpt, bool checksums);
  Status LoadFromDb(const std::string& ckpt, bool* found);
  // Installs `index` in memory, applying checksums recorded meanwhile. Caller holds
  // persist_mu_ when `index` was persisted, so that those checksums reach RocksDB after it.
  void Install(const std::string& ckpt, std::unique_ptr<CkptIndex> index);
  // Writes every block of `index` and its "i/" record in one batch, deleting blocks of an
  // earlier build. Caller holds persist_mu_.
  Status Persist(const std::string& ckpt, const CkptIndex& index, const std::string& info);
  // The blocks of `index` that hold `ordinals`, encoded, under their keys.
  static std::vector<std::pair<std::string, std::string>> EncodeBlocksOf(
      const std::string& ckpt, const CkptIndex& index, const std::vector<uint32_t>& ordinals);
  // Sets item `ordinal`'s checksum in the item and its span.
  static void SetChecksum(CkptIndex* index, uint32_t ordinal, uint64_t checksum);
  // Fills maps, files and places from items; marks the index partial when items overlap.
  static void BuildFileMaps(CkptIndex* index);

  BackingDir* const dir_;
  StateDb* const db_;
  const KeyIndexOptions opts_;

  std::mutex build_mu_map_mu_;
  std::map<std::string, std::weak_ptr<std::mutex>> build_mus_;  // GUARDED_BY(build_mu_map_mu_)

  // Orders the RocksDB writes of the index (a build's blocks, then checksums recorded later),
  // which are encoded under mu_ but written after it is released.
  std::mutex persist_mu_;

  std::shared_mutex mu_;
  std::unordered_map<std::string, std::unique_ptr<CkptIndex>> ckpts_;  // GUARDED_BY(mu_)
  // ckpt -> file -> (offset, length) -> checksum, for checkpoints not indexed yet.
  std::map<std::string, std::map<std::string, std::map<std::pair<uint64_t, uint64_t>, uint64_t>>>
      pending_sums_;  // GUARDED_BY(mu_)
  std::map<std::string, PendingCrcs> block_crcs_;  // GUARDED_BY(mu_), by backing path
  std::map<uint64_t, std::string> block_crc_age_;  // GUARDED_BY(mu_), seq -> path
  uint64_t block_crc_seq_ = 0;                     // GUARDED_BY(mu_)
  uint64_t block_crc_total_ = 0;                   // GUARDED_BY(mu_), bytes
};

// Reversible escaping of an fqn into one file-name component: no '/', no leading '.', no
// NUL, at most 255 bytes. '%', '/', NUL and control bytes become %XX, a leading '.' becomes
// %2E, and an empty fqn is "%". A result over 255 bytes is cut and gets "~" + 16 hex digits
// of a hash of the full fqn; UnescapeFqn cannot undo that, so a caller maps such names back
// through the index (the list of fqns), e.g. with FindFqnByEscapedName.
std::string EscapeFqn(const std::string& fqn);
// Inverse of EscapeFqn for names that were not hashed; nullopt for a hashed or invalid name.
std::optional<std::string> UnescapeFqn(std::string_view name);
// The fqn among `fqns` whose EscapeFqn is `name`, or nullopt.
std::optional<std::string> FindFqnByEscapedName(const std::vector<std::string>& fqns,
                                                std::string_view name);
// Chunk file name: the offsets joined by '_' ("0_128"), "scalar" for a 0-dim tensor, "data"
// for bytes items.
std::string ChunkFileName(const IndexedItem& item);

}  // namespace ckptfs::store
