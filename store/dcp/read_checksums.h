// ReadChecksums: checksums of DCP items taken on their first full read, from the bytes the
// read path has in hand, for checkpoints that did not come through this mount (their index
// is built lazily without reading the data).
//
// OnRead() is given each run of bytes served from a shard file of an indexed checkpoint.
// For every item without a checksum that the run overlaps, the CRC32C of the overlap is kept
// as a piece (only the parts not seen before; reads may come in any order, repeat, or
// overlap). Once an item's pieces cover it, their combination is its CRC32C, recorded with
// KeyIndex::RecordChecksums(). Pieces are tied to the file version (FileKey): bytes of
// another version start the item over, so an item's CRC never mixes two versions.
//
// Memory: at most `max_items` items in progress; the oldest is dropped beyond that.
//
// Thread-safe. CRCs are computed outside the lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "store/dcp/key_index.h"
#include "store/primitives/file_key.h"

namespace ckptfs::store {

class ReadChecksums {
 public:
  explicit ReadChecksums(KeyIndex* index,  // must outlive
                         size_t max_items = 4096)
      : index_(index), max_items_(max_items) {}
  ReadChecksums(const ReadChecksums&) = delete;
  ReadChecksums& operator=(const ReadChecksums&) = delete;

  // `data` holds bytes [offset, offset+n) of `file` (relative to checkpoint dir `ckpt`,
  // which must be indexed already: this never builds an index) in its version `version`.
  void OnRead(const std::string& ckpt, const std::string& file, const FileKey& version,
              uint64_t offset, const char* data, size_t n);

  uint64_t recorded() const;     // item checksums recorded so far
  size_t items_in_progress() const;

 private:
  struct Piece {
    uint64_t begin, end;  // item-relative
    uint32_t crc;
  };
  struct Progress {
    FileKey version;
    uint64_t length = 0;
    uint64_t seq = 0;
    std::vector<Piece> pieces;  // sorted, disjoint, contiguous ones folded
  };

  // Adds the pieces of one item; returns true and its CRC when the item is complete.
  bool AddLocked(const std::string& key, const FileKey& version, uint64_t length,
                 const std::vector<Piece>& pieces, uint32_t* crc) REQUIRES(mu_);

  KeyIndex* const index_;
  const size_t max_items_;
  mutable Mutex mu_;
  std::map<std::string, Progress> items_ GUARDED_BY(mu_);  // ckpt \0 file \0 item offset
  std::map<uint64_t, std::string> age_ GUARDED_BY(mu_);  // seq -> key
  uint64_t seq_ GUARDED_BY(mu_) = 0;
  uint64_t recorded_ GUARDED_BY(mu_) = 0;
};

}  // namespace ckptfs::store
