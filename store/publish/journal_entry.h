// A journal entry: one publish or namespace operation, as the application made it, in the
// order the journal applies it (store/publish/journal.h), and its record in the state db.
// Plain values; no thread-safety of their own.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"
#include "store/flush/flush_pipeline.h"

namespace ckptfs::store {

enum class OpType : int {
  kPublish = 1,  // fsync `from` (a temp file), rename it onto `path`
  kRename = 2,   // rename `from` onto `path`
  kUnlink = 3,
  kRmdir = 4,
  kMkdir = 5,
  kSymlink = 6,  // `link_target` -> `path`
  kChmod = 7,
  kUtimens = 8,
  kDiscard = 9,  // unlink the temp file `from` of a file deleted before publication
  kChown = 10,   // owner `uid` and/or group `gid` of `path` (kNoOwner leaves one alone)
  kLink = 11,    // hard link `path` of the published name `from`
  kMknod = 12,   // FIFO, socket or device `path` with `mode` (type bits too) and `rdev`
};

// "Leave unchanged" for JournalEntry::uid/gid, as (uid_t)-1 for chown(2).
inline constexpr uint32_t kNoOwner = 0xffffffffu;

const char* OpName(OpType op);

struct JournalEntry {
  uint64_t seq = 0;
  OpType op = OpType::kPublish;
  std::string path;
  std::string from;
  std::string link_target;
  // kMkdir/kMknod/kChmod: the mode. kRename/kUnlink: S_IFDIR when a directory moves or
  // goes (the checkpoint registry follows it, store/publish/publication.h); not applied.
  uint32_t mode = 0;
  int64_t atime_sec = 0, atime_nsec = 0, mtime_sec = 0, mtime_nsec = 0;
  uint64_t file_id = 0;
  uint64_t size = 0;
  // Multi-user POSIX. kMkdir, kSymlink and kMknod make the new name owned by uid/gid
  // (kNoOwner: left as the daemon made it, as entries from before these fields);
  // kChown changes them. rdev: the device of a kMknod.
  uint32_t uid = kNoOwner, gid = kNoOwner;
  uint64_t rdev = 0;
  // In memory only: the file whose bytes a publish waits for.
  std::shared_ptr<FlushTarget> target;
  // In memory only, kPublish: the last sequence number appended when this version's writes
  // began (a version written for a commit appended after it has began_after >= its seq).
  // 0 for entries a previous run left: they count as older than any commit.
  uint64_t began_after = 0;
  // In memory only: a failed attempt of this entry left its name in place (its rename
  // landed, then the directory fsync failed, and the rename that should have taken it back
  // too): an abort that drops it must withdraw what it left (Journal::Abort).
  bool in_place = false;
  // In memory only, kUnlink: the withdrawal of a commit name queued by an abort
  // (Journal::Abort): unlinked and made durable (directory fsync), a missing name is fine.
  bool withdraw = false;
  // In memory only, kUnlink queued by an abort in place of the withdrawal of `path` (a
  // commit name): the files of its directory that the aborted save replaced are put back
  // (Journal::Abort), so the directory is again what that `.metadata` names.
  bool restore = false;
  // In memory only, kPublish applied: the file it replaced stays under its temp name
  // `from`, kept by the journal (its directory was committed: ApplyEntry's keep_replaced).
  bool kept = false;
  // In memory only: a deletion the journal held behind a given-up checkpoint and then let
  // go (DeletionHold): never held again.
  bool unheld = false;

  // The entry's record (a binary record, store/primitives/record_codec.h), kept in the
  // state db under RecordKey(seq).
  std::string Serialize() const;
  static Result<JournalEntry> Parse(std::string_view text);
  static std::string RecordKey(uint64_t seq);
  static constexpr char kRecordPrefix[] = "j/";  // every entry record's key begins so
  // "publish #12 ckpt/__0_0.distcp (from ckpt/.ckptfs-tmp.7)", for logs and reports.
  std::string Describe() const;
};

// True if `path`'s last component commits a checkpoint directory: `.metadata`, a per-rank
// `__{rank}.metadata`, a `*.safetensors.index.json` or `model.safetensors`
// (store/dcp/commit_names.h).
bool IsCommitName(const std::string& path);

// A small file that may name a checkpoint (Megatron's latest_checkpointed_iteration.txt):
// published or renamed onto its name, not a shard, commit or `*.tmp` file.
bool IsTrackerCandidate(const JournalEntry& e);

}  // namespace ckptfs::store
