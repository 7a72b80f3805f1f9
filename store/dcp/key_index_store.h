// KeyIndexStore: the KeyIndex's records in RocksDB (StateDb), see key_index.h for the layout
// ("k/" blocks of up to 256 encoded items per shard file, one "i/" JSON record per checkpoint;
// index_codec.h has the encodings).
//
// Owns nothing but the encoding: writing a built index, loading one after a restart (only
// while the checkpoint's commit files still have the identity recorded), the blocks that
// hold items whose checksums changed, and dropping or renaming a checkpoint's records.
// It has no lock: KeyIndex orders its writes under its persist_mu_ (a build's blocks before
// checksums recorded later); reads need no order.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "store/dcp/ckpt_index.h"
#include "store/primitives/backing_dir.h"
#include "store/primitives/state_db.h"

namespace ckptfs::store {

class KeyIndexStore {
 public:
  using Puts = std::vector<std::pair<std::string, std::string>>;

  KeyIndexStore(BackingDir* dir, StateDb* db) : dir_(dir), db_(db) {}  // both must outlive

  // Writes every block of `index` and its "i/" record `info` in one batch, deleting blocks
  // of an earlier build.
  Status Persist(const std::string& ckpt, const CkptIndex& index, const std::string& info);
  // The index of `ckpt` as persisted, or nullptr when there is none, it is unreadable or of
  // another format, or the checkpoint's commit files changed since (then it is rebuilt).
  Result<std::unique_ptr<CkptIndex>> Load(const std::string& ckpt);
  // The blocks of `index` that hold `ordinals`, encoded, under their keys.
  static Puts EncodeBlocksOf(const std::string& ckpt, const CkptIndex& index,
                             const std::vector<uint32_t>& ordinals);
  // Writes blocks from EncodeBlocksOf (checksums recorded later); a failure is logged.
  void WriteBlocks(const std::string& ckpt, const Puts& blocks);

  // The error recorded for `ckpt`, "" when none or not persisted.
  std::string IndexError(const std::string& ckpt);
  // Whether `ckpt` has an "i/" record (one point lookup).
  bool Has(const std::string& ckpt);
  // Adds the checkpoints with an "i/" record to `out`.
  Status List(std::set<std::string>* out);
  // Deletes every record of `ckpt`.
  Status Forget(const std::string& ckpt);
  // Moves the records of every checkpoint for which `moved` gives a new name there (values
  // name files relative to the checkpoint, so only keys change).
  Status Rename(const std::function<std::optional<std::string>(const std::string&)>& moved);

 private:
  BackingDir* const dir_;
  StateDb* const db_;
};

}  // namespace ckptfs::store
