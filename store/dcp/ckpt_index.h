// CkptIndex: the in-memory index of one checkpoint, as KeyIndex holds it (key_index.h).
//
// The items in ordinal (.metadata) order, plus per shard file an interval map, so that a read
// offset resolves to its item in O(log n), and the items' order by fqn. A plain value: it
// owns no lock; KeyIndex keeps each CkptIndex under its mu_, KeyIndexBuilder fills a fresh
// one that nobody else sees yet, KeyIndexStore encodes and decodes them (the caller's lock).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "store/dcp/checkpoint_source.h"
#include "store/dcp/indexed_item.h"

namespace ckptfs::store {

// A checksum of the byte range [offset, offset+length) of a shard file, computed elsewhere.
struct RangeChecksum {
  uint64_t offset = 0, length = 0, checksum = 0;
};

// What a read path needs of an item, without its names and shapes (KeyIndex::Located).
struct ItemSpan {
  uint32_t ordinal;  // index into the checkpoint's items
  ItemKind kind;
  bool has_checksum;
  uint64_t offset, length, raw_offset, raw_nbytes, checksum;
};

// ok / partial: indexed (partial: some items opaque); failed: the commit files are
// malformed; missing: no checkpoint there (looked at again after retry_after).
enum class IndexState { kOk, kPartial, kFailed, kMissing };
const char* IndexStateName(IndexState s);

struct CkptIndex {
  // The items of one shard file. `all` is every item of the file by (offset, ordinal), the
  // order they are persisted in. The items with a non-empty range, by offset, are in parallel
  // arrays, so that the binary search touches only the dense `begins` (and a sample of every
  // kSample-th of them, which stays in L1), and a lookup then reads one ItemSpan record,
  // never the IndexedItem with its names and shapes.
  struct FileMap {
    static constexpr size_t kSample = 32;
    std::string name;
    std::vector<uint32_t> all;
    std::vector<uint64_t> begins, sample;
    std::vector<ItemSpan> spans;  // spans[i].offset == begins[i]
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

  IndexState state = IndexState::kOk;
  std::string error;
  SourceKind source = SourceKind::kDcp;               // what the items were read from
  std::vector<IndexedItem> items;                     // ordinal order
  std::vector<FileMap> maps;                          // by file name
  std::unordered_map<std::string, uint32_t> files;    // name -> index into maps
  std::vector<Place> places;                          // by ordinal
  std::vector<uint32_t> by_fqn;                       // ordinals by (fqn, ordinal)
  std::chrono::steady_clock::time_point retry_after;  // kMissing only

  // Fills maps, files, places and by_fqn from items; marks the index partial when items
  // overlap.
  void BuildFileMaps();
  // Sets item `ordinal`'s checksum in the item and its span.
  void SetChecksum(uint32_t ordinal, uint64_t checksum);
};

}  // namespace ckptfs::store
