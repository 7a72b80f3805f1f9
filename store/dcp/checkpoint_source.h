// Where the items of a checkpoint directory are described, for every checkpoint format ckptfs
// knows (store/publish/commit_names.h), and those items as one DcpMetadata:
//   .metadata                 DCP: the pickle (dcp_metadata.h).
//   __{rank}.metadata         DCP no-collectives save: every rank's pickle, merged in rank
//                             order; a key two ranks both saved (a replicated item) is
//                             kept once, from the lowest rank.
//   *.safetensors.index.json  Hugging Face sharded safetensors: each shard its weight_map
//                             names, read through its header only (safetensors_header.h).
//   model.safetensors         a single safetensors file, the same way.
// The first of these that the directory has wins (a DCP `.metadata` beside an HF index is a
// DCP checkpoint). A safetensors item is its tensor's raw bytes: kind kTensor (kOpaque for a
// dtype ckptfs does not know), offset == raw_offset, row-major stride, data_resolved set,
// chunk offsets from DCP_SHARDING_INFO's saved_offsets (zeros for a full tensor) and a
// global size that covers every chunk of the fqn.
//
// Reads only commit files and safetensors headers; never a tensor's data. Thread-safe
// (no state). Errors name the file; a malformed file is Corrupt, never a crash.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "store/dcp/dcp_metadata.h"
#include "store/dcp/index_codec.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {

enum class SourceKind { kDcp, kDcpRanks, kSafetensors };

struct CheckpointSource {
  SourceKind kind = SourceKind::kDcp;
  // The commit files (relative to the checkpoint dir): ".metadata", every "__{rank}.metadata"
  // by rank, the one index, or "model.safetensors".
  std::vector<std::string> files;
  // The identity of the commit files together (size summed, newest mtime, inodes mixed), so
  // that an index kept across a restart is rebuilt when any of them changed.
  keyidx::MetadataId id;
};

// "dcp", "dcp_no_dist", "safetensors".
const char* SourceKindName(SourceKind kind);

// The commit files of `ckpt` (relative to the backing root, "" = root), by the priority
// above. NotFound when it has none. Lists the directory only when it has no `.metadata`.
Result<CheckpointSource> FindCheckpointSource(BackingDir* dir, const std::string& ckpt);

// The items of `ckpt`, from `source` (FindCheckpointSource of it).
Result<DcpMetadata> ReadCheckpointItems(BackingDir* dir, const std::string& ckpt,
                                        const CheckpointSource& source);

// Both at once: NotFound when `ckpt` has no commit file.
Result<DcpMetadata> ReadCheckpointItems(BackingDir* dir, const std::string& ckpt,
                                        CheckpointSource* source = nullptr);

}  // namespace ckptfs::store
