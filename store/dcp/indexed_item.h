// IndexedItem: one DCP key of a checkpoint as the key index keeps it, and how reports and
// the tensor view name it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "store/dcp/dcp_metadata.h"
#include "store/primitives/crc32c.h"

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

// Chunk file name: the offsets joined by '_' ("0_128"), "scalar" for a 0-dim tensor, "data"
// for bytes items.
std::string ChunkFileName(const IndexedItem& item);

// The checksum algorithm of IndexedItem::checksum, as reports name it.
inline constexpr char kChecksumAlgorithm[] = "crc32c";
// Checksum of one item's bytes, as the index stores it (CRC32C).
inline uint64_t ItemChecksum(std::span<const char> bytes) {
  return Crc32c(bytes.data(), bytes.size());
}

}  // namespace ckptfs::store
