// CheckpointRegistry: the state of every checkpoint directory this daemon has seen.
//
// A directory becomes a checkpoint when a checkpoint file (store/publish/commit_names.h: DCP's
// `*.distcp`, `.metadata`, `.metadata.tmp`, `__{rank}.metadata[.tmp]`; Hugging Face's
// `*.safetensors.index.json`, `model.safetensors`, `*-NNNNN-of-NNNNN.safetensors`) is
// created in it through the mount. "The commit file" below is `.metadata`, a
// `*.safetensors.index.json` or `model.safetensors`; a no-collectives DCP save has one per
// rank, and the directory is committed when the last of them that is pending (queued or
// being written through the mount) is applied (docs/SEMANTICS.md, rule 2). States:
//   writing   - files are being written
//   pending   - the commit file was written by the application; publication is queued
//   committed - the commit file is on the backing store (every shard durable before it)
//   failed    - a flush or publish failed; its commit file will never be published
//   aborted   - the daemon stopped (crash) before the checkpoint committed
// Records live in RocksDB, so states survive restarts; on load, writing/pending
// records become aborted.
//
// Renames and removals. The mount renames or removes a checkpoint directory at once, but
// journal entries queued before that still name the old path when they are applied
// (async mode). A callback for an applied entry passes its journal seq: entries older than
// a rename are credited to the record under its new name, entries older than a removal
// are dropped (they never bring a removed checkpoint back as a record with no history).
// A record made under the same name after the removal is a new checkpoint and keeps
// only the entries queued after the removal. OnApplied(seq) forgets renames and removals
// that no queued entry predates any more.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/mutex.h"
#include "common/status.h"
#include "store/primitives/state_db.h"

namespace ckptfs::store {

enum class CkptState { kWriting, kPending, kCommitted, kFailed, kAborted };
const char* CkptStateName(CkptState s);

struct CheckpointInfo {
  std::string path;
  CkptState state = CkptState::kWriting;
  uint64_t bytes = 0;            // bytes of files queued for publication
  uint64_t bytes_published = 0;  // of those, bytes on the backing store
  uint64_t files = 0;
  double created = 0, updated = 0, committed = 0;
  std::string error;
  bool commit_queued = false;  // its `.metadata` was written (in memory only)
  // The journal entry of the last commit file queued for it (in memory only): an earlier
  // save's commit applied while a later save's is queued leaves it pending (a re-save
  // into the same directory is not committed until its own `.metadata` is).
  uint64_t commit_seq = 0;
  // Its failure holds publication (an async halt) until resumed or aborted (in memory
  // only): files written into it meanwhile belong to the same, still failed, save.
  bool halted = false;
  nlohmann::json ToJson() const;
  std::string Encode() const;  // the persisted record (binary: paths are bytes)
  static bool Decode(std::string_view in, CheckpointInfo* out);
};

class CheckpointRegistry {
 public:
  // The error of a record that was writing or pending when the last run ended.
  static constexpr char kStoppedBeforeCommit[] = "daemon stopped before the checkpoint committed";
  // Loads the records of earlier runs; writing/pending ones become aborted
  // (kStoppedBeforeCommit).
  static Result<std::unique_ptr<CheckpointRegistry>> Load(StateDb* db);  // db must outlive

  // True if a file named `name` makes its directory a checkpoint.
  static bool IsCheckpointFile(const std::string& name);

  // `seq`: the journal entry that made the event, for events of applied entries; kNow
  // for events that name the directory's current path.
  static constexpr uint64_t kNow = UINT64_MAX;

  void OnFileCreated(const std::string& dir);
  void OnFileQueued(const std::string& dir, uint64_t bytes);
  void OnFilePublished(const std::string& dir, uint64_t bytes, uint64_t seq = kNow);
  // `seq`: the commit entry (0: unknown, as in tests that do not care).
  void OnCommitQueued(const std::string& dir, uint64_t seq = 0);
  // `last_part`: the last pending per-rank commit file of a no-collectives DCP save
  // (`__{rank}.metadata`, store/publish/commit_names.h) was applied; a record already failed by
  // another rank's part stays failed.
  void OnCommitted(const std::string& dir, uint64_t seq = kNow, bool last_part = false);
  void OnFailed(const std::string& dir, const std::string& error, uint64_t seq = kNow);
  // An entry of `dir` halted publication (async): failed, and it stays failed, even while
  // more of its files are written, until OnResumed or OnAborted.
  void OnHalted(const std::string& dir, const std::string& error);
  // `seq`: the journal entry of the rename or removal (0: none is pending, as in strict
  // mode once it returned). A rename moves every record at or below `from`.
  // A failed checkpoint whose publication passed after all (a retry or resume).
  void OnResumed(const std::string& dir);
  // The operator dropped the pending entries at or below `path` (`subtree`), or a file of
  // the directory `path` was dropped: checkpoints there that had not committed become
  // aborted.
  void OnAborted(const std::string& path, const std::string& why, bool subtree);
  // A save into `dir`, a committed checkpoint, was aborted and nothing of it stays on the
  // backing store (none of it reached it, or what it replaced was put back): the earlier
  // save's commit stands there, and the record says so (committed, with `why`).
  void OnEarlierCommitKept(const std::string& dir, const std::string& why);
  void OnRenamed(const std::string& from, const std::string& to, uint64_t seq = 0);
  void OnRemoved(const std::string& dir, uint64_t seq = 0);
  // Every journal entry up to `seq` has been applied.
  void OnApplied(uint64_t seq);

  std::optional<CheckpointInfo> Get(const std::string& dir) const;
  std::vector<CheckpointInfo> List() const;
  std::map<std::string, uint64_t> CountByState() const;

 private:
  explicit CheckpointRegistry(StateDb* db) : db_(db) {}
  CheckpointInfo& Touch(const std::string& dir) REQUIRES(mu_);
  void Persist(const CheckpointInfo& info, WriteMode mode = WriteMode::kSynced) REQUIRES(mu_);
  // The path now of the directory that entry `seq` named `dir`, or nullopt when it was
  // removed since.
  std::optional<std::string> ResolveLocked(std::string dir, uint64_t seq) const REQUIRES(mu_);
  // Its record, or null.
  CheckpointInfo* FindLocked(const std::string& dir, uint64_t seq) REQUIRES(mu_);
  // OnFailed under the lock; returns the checkpoint, if found.
  CheckpointInfo* FailLocked(const std::string& dir, const std::string& error, uint64_t seq)
      REQUIRES(mu_);

  StateDb* const db_;
  mutable Mutex mu_;
  std::map<std::string, CheckpointInfo> ckpts_ GUARDED_BY(mu_);
  struct Moved {
    uint64_t seq;     // the rename's or removal's journal entry
    std::string from;
    std::string to;   // empty: removed
  };
  std::vector<Moved> moves_ GUARDED_BY(mu_);  // in seq order, pending ones only
};

}  // namespace ckptfs::store
