// KeyIndexBuilder: from a checkpoint's commit files (.metadata, per-rank metadata or a
// safetensors index) and its shard files to a fresh CkptIndex and its "i/" record.
//
// Reads the backing store; owns no index and no lock. Item checksums come from the checksums
// handed in (recorded before the build), from the write path's block CRCs (BlockCrcCache,
// whose own lock is a leaf) or, when asked, from reading the items. KeyIndex serializes the
// builds of one checkpoint (its build mutex) and persists and installs what comes out.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "common/status.h"
#include "store/dcp/block_crc_cache.h"
#include "store/dcp/ckpt_index.h"
#include "store/dcp/dcp_metadata.h"
#include "store/dcp/item_reader.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {

// Checksums known for a checkpoint's items: file -> (offset, length) -> checksum.
using KnownSums = std::map<std::string, std::map<std::pair<uint64_t, uint64_t>, uint64_t>>;

class KeyIndexBuilder {
 public:
  // With `read_unvouched` false, Build with `checksums` reads no item to checksum it: an
  // item without a known checksum or block CRCs stays unchecked. Shard bytes that `held`
  // (may be null: the retained tier) holds are read from memory, not the backing store.
  KeyIndexBuilder(BackingDir* dir, BlockCrcCache* block_crcs,  // both must outlive
                  bool read_unvouched = true, keyidx::HeldBytes* held = nullptr)
      : dir_(dir), block_crcs_(block_crcs), held_(held), read_unvouched_(read_unvouched) {}

  struct Built {
    std::unique_ptr<CkptIndex> index;
    // NotFound when the index is missing (no commit files), Corrupt when failed (malformed
    // commit files), else OK (also when partial).
    Status result;
    std::string info;  // the "i/" record; empty when missing
    double parse_ms = 0, items_ms = 0, build_ms = 0;
    uint64_t with_sum = 0, from_blocks = 0, read_items = 0, read_bytes = 0;
    uint64_t from_memory = 0, from_backing = 0;  // shard bytes read, by where from
  };

  // Builds the index of `ckpt` from its commit files, or from `given` (a `.metadata` parsed
  // by the caller) when not null. `take_known_sums` is called once the checkpoint is found,
  // for the checksums recorded before this build. With `checksums`, every item without one
  // is read, and the block CRC maps used are dropped. An error only when the commit files
  // cannot be looked for.
  Result<Built> Build(const std::string& ckpt, const DcpMetadata* given, bool checksums,
                      const std::function<KnownSums()>& take_known_sums);

 private:
  BackingDir* const dir_;
  BlockCrcCache* const block_crcs_;
  keyidx::HeldBytes* const held_;
  const bool read_unvouched_;
};

}  // namespace ckptfs::store
