// Interprets a PyTorch Distributed Checkpoint `.metadata` file as an index of items.
//
// ParseDcpMetadata() parses the pickle with the never-executing reader (pickle.h) and then
// reads the value graph against the known DCP schemas:
//   * torch 1.13: torch.distributed._shard.checkpoint.metadata.Metadata ("torch1"),
//   * torch 2.x:  torch.distributed.checkpoint.metadata.Metadata, with planner_data,
//                 storage_meta (its checkpoint_id may be a pathlib path), version and
//                 per-item transform_descriptors ("torch2"),
//   * Megatron-core <= 0.15: MCoreMetadata, a Metadata subclass adding mcore_data and
//                 all_local_plans ("mcore").
// Classes are recognised by (module, name) from a short allowlist; anything else where the
// schema expects a DCP class is an error. Fields that ckptfs does not need (planner_data,
// mcore_data, all_local_plans, ...) are never interpreted, only named in `other_fields`.
//
// The result has one DcpItem per stored chunk (tensors) or per bytes entry, in
// state_dict_metadata order and, within a tensor, chunk order. Every chunk must have exactly
// one storage_data entry and vice versa; relative paths must stay inside the checkpoint
// directory. Violations are Corrupt errors with a message naming the fqn.
//
// Pure functions: thread-safe, no I/O. Cost is linear in the input size.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "store/dcp/pickle.h"

namespace ckptfs::store {

enum class ItemKind { kTensor, kBytes, kOpaque };

std::string_view ItemKindName(ItemKind kind);  // "tensor", "bytes", "opaque"

struct DcpItem {
  ItemKind kind = ItemKind::kBytes;
  std::string fqn;
  std::vector<int64_t> chunk_offsets, chunk_sizes, global_size;  // empty for bytes
  std::string dtype;                    // "float16", "bfloat16", ... ; empty for bytes
  std::string file;                     // relative_path, e.g. "__0_0.distcp"
  uint64_t offset = 0, length = 0;      // item byte range inside `file`
  std::vector<std::string> transforms;  // transform descriptors; non-empty => kOpaque
  // Index of the chunk within its tensor's chunk list (0 for bytes items).
  uint32_t chunk_index = 0;
  // True for BytesStorageMetadata entries, also when transforms make the item kOpaque.
  bool is_bytes = false;
  // Where the tensor's raw bytes are, from the item's torch.save archive. Filled by
  // ResolveItemData() (torch_zip.h); the metadata alone does not say.
  bool data_resolved = false;
  uint64_t raw_offset = 0;  // file-absolute: offset + the archive's data offset
  uint64_t raw_nbytes = 0;  // size of the storage record
  std::vector<int64_t> stride;
  int64_t storage_offset = 0;  // in elements
};

struct DcpMetadata {
  std::string flavor;  // "torch1", "torch2", "mcore"
  std::vector<DcpItem> items;
  // Metadata.version (torch >= 2.4), empty when absent.
  std::string version;
  // storage_meta.checkpoint_id as a string (a pathlib path is joined), empty when absent.
  std::string checkpoint_id;
  // Sorted names of the Metadata fields other than state_dict_metadata and storage_data
  // whose value is not None, e.g. {"planner_data", "storage_meta", "version"}.
  std::vector<std::string> other_fields;
};

struct DcpMetadataOptions {
  PickleLimits pickle_limits;
  // Dimensions of one tensor. torch itself allows at most 64.
  uint32_t max_dims = 64;
};

Result<DcpMetadata> ParseDcpMetadata(std::string_view bytes);
Result<DcpMetadata> ParseDcpMetadata(std::string_view bytes, const DcpMetadataOptions& options);

// Distinct files referenced by the metadata with the minimum length each must have
// (max over its items of offset+length). Used for the atomic-commit check (G5).
// Sorted by file name.
std::vector<std::pair<std::string, uint64_t>> RequiredFileLengths(const DcpMetadata& md);

// OK if `path` names a file inside the checkpoint directory: non-empty, relative, no NUL,
// no empty, "." or ".." components. Exposed for callers that receive paths elsewhere.
Status ValidateRelativePath(std::string_view path);

}  // namespace ckptfs::store
