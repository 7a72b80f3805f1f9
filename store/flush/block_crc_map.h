// BlockCrcMap: CRC32C of the fixed, file-offset-aligned blocks of one file, learned from the
// bytes written to it, so that the CRC of any later-known byte range (a DCP item) follows
// from the block CRCs plus the few bytes at its unaligned edges, without reading the bulk.
//
// The flush pipeline feeds every sealed staging chunk (Record) while its bytes are still in
// staging; chunks arrive in any order, at any offset and length. A block becomes known once
// recorded pieces cover it exactly; pieces of a block still incomplete are kept (as CRCs)
// and folded when the block completes. The map only ever states what it knows exactly: a
// record overlapping bytes already recorded (a rewrite), a truncate cutting into recorded
// bytes, or a block that would exceed the memory bounds leaves the affected blocks unknown
// ("poisoned") for good. Blocks never written through the map (bytes copied in some other
// way) stay unknown too. So RangeCrc() is either exact or nullopt, never wrong, provided the
// owner reports every write and truncate of the file.
//
// Memory: 5 bytes per block up to the highest block recorded (at most max_blocks), plus the
// pieces of incomplete blocks (at most max_partial_blocks blocks; more are poisoned).
//
// Thread-safe. Record() computes CRCs before taking the lock, so flush threads hash in
// parallel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "common/mutex.h"
#include "store/primitives/file_key.h"

namespace ckptfs::store {

struct BlockCrcOptions {
  uint32_t block_bytes = 64u << 10;     // a power of two
  uint64_t max_blocks = uint64_t{1} << 22;  // 256 GiB of file at 64 KiB blocks
  size_t max_partial_blocks = 4096;
};

// The write path's block CRCs of one finished shard file, as its writer vouches for them to
// another node over the commit query (docs/PEERS.md, "Checksums with the commit"): CRC32C
// of every `block_bytes` block of the file version `id` (the last block short), all known.
// `id` is that version as the writer saw it: its `dev` is the writer's own, so a reader on
// another node compares ino, size and mtime only (KeyIndex::AddPeerBlockCrcs) and never
// uses the CRCs for any other version.
struct ShardChecksums {
  FileKey id;
  uint32_t block_bytes = 0;
  std::vector<uint32_t> block_crcs;  // ceil(id.size / block_bytes)
  bool operator==(const ShardChecksums&) const = default;
};

class BlockCrcMap {
 public:
  explicit BlockCrcMap(const BlockCrcOptions& options = {});
  BlockCrcMap(const BlockCrcMap&) = delete;
  BlockCrcMap& operator=(const BlockCrcMap&) = delete;

  // Bytes [offset, offset+n) of the file now hold data[0, n). Ignored after Finish() (the
  // blocks touched are poisoned).
  void Record(uint64_t offset, const void* data, size_t n);
  // The file was cut (or extended with zeros) to `size`: recorded bytes at or past `size`
  // are gone; a block holding recorded bytes on both sides of `size` is poisoned.
  void Truncate(uint64_t size);
  // No more writes: the file is `size` bytes. Truncates to `size`, completes the last, short
  // block when its bytes are all recorded, and frees the pieces of incomplete blocks.
  void Finish(uint64_t size);

  // CRC32C of [begin, end), or nullopt when a block in it is unknown. `begin` must be a
  // multiple of block_bytes, `end` too or equal to the finished size; otherwise nullopt.
  std::optional<uint32_t> RangeCrc(uint64_t begin, uint64_t end) const;

  // The CRC of every block of a finished map (the last one over its short length), or
  // nullopt when the map is unfinished or a block is unknown. What a writer vouches for.
  std::optional<std::vector<uint32_t>> BlockCrcs() const;
  // A finished map of a `size`-byte file whose blocks have the CRCs `crcs` (as BlockCrcs()
  // gives them, e.g. from a peer); null when they do not describe such a file: a block size
  // that is not a power of two in [kMinBlockBytes, kMaxBlockBytes], a count other than
  // ceil(size / block_bytes), or more than max_blocks.
  static std::shared_ptr<BlockCrcMap> FromBlockCrcs(uint32_t block_bytes, uint64_t size,
                                                    const std::vector<uint32_t>& crcs,
                                                    uint64_t max_blocks = uint64_t{1} << 22);
  static constexpr uint32_t kMinBlockBytes = 4u << 10, kMaxBlockBytes = 16u << 20;

  uint32_t block_bytes() const { return opts_.block_bytes; }
  bool finished() const;
  uint64_t size() const;  // the finished size (0 before Finish)
  // Blocks known exactly, and blocks poisoned (never to be known).
  uint64_t known_blocks() const;
  uint64_t poisoned_blocks() const;
  size_t MemoryBytes() const;

 private:
  enum : uint8_t { kEmpty = 0, kKnown = 1, kPartial = 2, kPoisoned = 3 };
  struct Piece {
    uint32_t begin, end, crc;  // [begin, end) within the block
  };

  void AddPieceLocked(uint64_t block, uint32_t begin, uint32_t end, uint32_t crc) REQUIRES(mu_);
  void PoisonLocked(uint64_t block) REQUIRES(mu_);
  void TruncateLocked(uint64_t size) REQUIRES(mu_);
  bool EnsureSlotLocked(uint64_t block) REQUIRES(mu_);

  const BlockCrcOptions opts_;
  mutable Mutex mu_;
  std::vector<uint32_t> crc_ GUARDED_BY(mu_);  // by block index
  std::vector<uint8_t> state_ GUARDED_BY(mu_);  // parallel to crc_
  std::map<uint64_t, std::vector<Piece>> partial_ GUARDED_BY(mu_);  // sorted, disjoint
  bool finished_ GUARDED_BY(mu_) = false;
  uint64_t size_ GUARDED_BY(mu_) = 0;
  uint64_t known_ GUARDED_BY(mu_) = 0;
  uint64_t poisoned_ GUARDED_BY(mu_) = 0;
};

}  // namespace ckptfs::store
