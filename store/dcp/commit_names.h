// Which file names commit a checkpoint directory, and which formats they belong to: a rule
// of the DCP and safetensors formats, used by publication and by the readers. The
// journal gates an entry that makes such a name appear (CommitGate), the registry lists
// the directory as committed once it is applied (docs/SEMANTICS.md, rule 2).
//
//   .metadata                DCP (every torch): the one commit file of a directory.
//   __{rank}.metadata        DCP no-collectives save (torch 2.x `use_collectives=False`,
//                            `no_dist`): every rank writes its own, naming only its shards
//                            (`__{rank}_{n}.distcp`); there is no `.metadata`.
//   *.safetensors.index.json Hugging Face sharded safetensors (`model.safetensors.index.json`,
//                            torch's HuggingFaceStorageWriter): its `weight_map` names the
//                            shard files.
//   model.safetensors        a single-file safetensors checkpoint: it commits on its own
//                            publish, by order.
// Pure functions of the name, and one stat (CommittedElsewhere); thread-safe.
#pragma once

#include <string>
#include <string_view>

namespace ckptfs::store {

class BackingDir;  // store/primitives/backing_dir.h

enum class CommitKind {
  kNone,
  kDcp,                // .metadata
  kDcpRank,            // __{rank}.metadata
  kSafetensorsIndex,   // *.safetensors.index.json
  kSafetensorsSingle,  // model.safetensors
};

// The kind of commit file `path`'s last component is.
CommitKind CommitKindOf(std::string_view path);

// True if a file named `name` (a last component) belongs to a checkpoint of a format
// above: a commit file, its temp name (`.metadata.tmp`, `__{rank}.metadata.tmp`), a DCP
// shard (`*.distcp`) or a Hugging Face shard (`*-NNNNN-of-NNNNN.safetensors`).
bool IsCheckpointFileName(std::string_view name);

// Whether another node has committed the checkpoint in `dir` that this node began writing
// shards for at `since` (epoch seconds, this node's clock): its `.metadata` is on the
// backing store, and was made at or after `since`. A `.metadata` from before, that of an
// earlier save into the same directory, does not count. The comparison crosses clocks (the
// backing store stamps ctime), so it is wrong only where they differ by more than the time
// between two saves into one directory. `since` 0: any `.metadata` counts.
bool CommittedElsewhere(BackingDir* backing, const std::string& dir, double since);

}  // namespace ckptfs::store
