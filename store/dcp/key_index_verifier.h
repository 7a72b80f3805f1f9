// KeyIndexVerifier: re-reads a checkpoint's items from the backing store, to check them
// against their index (Verify) or to checksum those without a checksum (ChecksumItems).
//
// Works on a copy of the items that KeyIndex hands it, so it never holds KeyIndex's locks
// while it reads; it owns no state and no lock, and never modifies the index itself.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "store/dcp/checkpoint_source.h"
#include "store/dcp/ckpt_index.h"
#include "store/dcp/indexed_item.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {

struct VerifyReport {
  uint64_t items = 0, bytes = 0;  // items checked, bytes re-read
  uint64_t unchecked = 0;         // items re-read but without a checksum to compare with
  std::vector<std::pair<std::string, std::string>> bad;  // (KeyName or file, reason)
};

class KeyIndexVerifier {
 public:
  explicit KeyIndexVerifier(BackingDir* dir) : dir_(dir) {}  // must outlive

  // Checks `items`, the index of `ckpt` built from a `source_kind` checkpoint: the commit
  // files still parse and agree with them, each item's archive is intact and agrees with the
  // metadata (dtype, shape, raw range), and checksums match. Lists every bad key; items
  // without a checksum are counted as unchecked, not bad.
  VerifyReport Verify(const std::string& ckpt, const std::vector<IndexedItem>& items,
                      SourceKind source_kind);

  // Reads `items` of `ckpt` (those without a checksum) and hands their checksums to
  // `record`, one shard file at a time. Returns how many; the first read error when none.
  using Record = std::function<void(const std::string& file, const std::vector<RangeChecksum>&)>;
  Result<uint64_t> ChecksumItems(const std::string& ckpt, const std::vector<IndexedItem>& items,
                                 const Record& record);

 private:
  BackingDir* const dir_;
};

}  // namespace ckptfs::store
