// The key index's RocksDB records: keys, and the binary encoding of items in blocks of up
// to kItemsPerBlock (store/primitives/record_codec.h primitives). See key_index.h for the layout.
#pragma once

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "store/dcp/indexed_item.h"

namespace ckptfs::store::keyidx {

// "i/" record and block layout. 3: blocks of items, CRC32C checksums (2: one key per item,
// CRC32C; 1: one key per item, XXH3-64). An index of an older format is rebuilt on first use,
// like any missing one.
inline constexpr int kFormat = 3;
inline constexpr size_t kItemsPerBlock = 256;

std::string InfoKey(const std::string& ckpt);     // "i/" + ckpt
std::string ItemPrefix(const std::string& ckpt);  // "k/" + ckpt + '\0'
// prefix + file + '\0' + block (4 bytes, big-endian).
std::string BlockKey(const std::string& prefix, const std::string& file, uint32_t block);

// Appends to `out` the block of the items `ordinals` of `items`.
void EncodeBlock(const std::vector<IndexedItem>& items, std::span<const uint32_t> ordinals,
                 std::string* out);
// Appends the items of block `in` to `items`; false if it is malformed.
bool DecodeBlock(std::string_view in, std::vector<IndexedItem>* items);

// The identity of a `.metadata` recorded with its index, so that an index loaded after a
// restart is rebuilt when the checkpoint was rewritten meanwhile.
struct MetadataId {
  uint64_t size = 0, mtime_ns = 0, ino = 0;
  bool operator==(const MetadataId&) const = default;
};
MetadataId MetadataIdOf(const struct stat& st);

}  // namespace ckptfs::store::keyidx
