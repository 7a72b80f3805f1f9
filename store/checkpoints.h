// CheckpointRegistry: the state of every checkpoint directory this daemon has seen.
//
// A directory becomes a checkpoint when a DCP file (`*.distcp`, `.metadata`,
// `.metadata.tmp`) is created in it through the mount. States:
//   writing   - files are being written
//   pending   - `.metadata` was written by the application; publication is queued
//   committed - `.metadata` is on the backing store (every shard durable before it)
//   failed    - a flush or publish failed; its `.metadata` will never be published
//   aborted   - the daemon stopped (crash) before the checkpoint committed
// Records live in RocksDB, so states survive restarts; on load, writing/pending
// records become aborted.
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

#include "common/status.h"
#include "store/state_db.h"

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
  nlohmann::json ToJson() const;
  std::string Encode() const;  // the persisted record (binary: paths are bytes)
  static bool Decode(std::string_view in, CheckpointInfo* out);
};

class CheckpointRegistry {
 public:
  // Loads the records of earlier runs; writing/pending ones become aborted.
  static Result<std::unique_ptr<CheckpointRegistry>> Load(StateDb* db);  // db must outlive

  // True if a file named `name` makes its directory a checkpoint.
  static bool IsCheckpointFile(const std::string& name);

  void OnFileCreated(const std::string& dir);
  void OnFileQueued(const std::string& dir, uint64_t bytes);
  void OnFilePublished(const std::string& dir, uint64_t bytes);
  void OnCommitQueued(const std::string& dir);
  void OnCommitted(const std::string& dir);
  void OnFailed(const std::string& dir, const std::string& error);
  // A failed checkpoint whose publication passed after all (a retry or resume).
  void OnResumed(const std::string& dir);
  // The operator dropped the pending entries at or below `path`: checkpoints there that
  // had not committed become aborted.
  void OnAborted(const std::string& path, const std::string& why);
  void OnRenamed(const std::string& from, const std::string& to);
  void OnRemoved(const std::string& dir);

  std::optional<CheckpointInfo> Get(const std::string& dir) const;
  std::vector<CheckpointInfo> List() const;
  std::map<std::string, uint64_t> CountByState() const;

 private:
  explicit CheckpointRegistry(StateDb* db) : db_(db) {}
  CheckpointInfo& Touch(const std::string& dir);  // REQUIRES(mu_)
  void Persist(const CheckpointInfo& info);       // REQUIRES(mu_)

  StateDb* const db_;
  mutable std::mutex mu_;
  std::map<std::string, CheckpointInfo> ckpts_;  // GUARDED_BY(mu_)
};

}  // namespace ckptfs::store
