// The retained tier as the key index's source of shard bytes held in memory
// (keyidx::HeldBytes): the index build after a commit reads the zip headers and item edges
// of the checkpoint the tier has just kept from the tier, not from the backing store (G12:
// what a node reads per save follows its share, and with the tier that share is zero).
#pragma once

#include <span>
#include <string>

#include "store/cache/retained_tier.h"
#include "store/dcp/item_reader.h"

namespace ckptfs::store {

class RetainedBytes final : public keyidx::HeldBytes {
 public:
  explicit RetainedBytes(RetainedTier* tier) : tier_(tier) {}  // must outlive

  // Served when every block of the range is held by a committed checkpoint and passes its
  // CRC check (RetainedTier::ReadInPlace), for exactly the version `key` describes.
  bool Read(const std::string& path, const FileKey& key, uint64_t off,
            std::span<char> out) override;

 private:
  RetainedTier* const tier_;
};

}  // namespace ckptfs::store
