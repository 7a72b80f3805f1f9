// TempRecords: the records, in the state db, of the temp files a journal's owner creates
// (`.ckptfs-tmp.<id>`), so that a crash cannot leak one: Journal::Recover removes every
// temp file a record names that was never published. A record is written synced before
// its temp file is created (Register), or ahead of time for the next ids when the owner's
// temp names are known in advance (NextId with a prefix); the journal removes it with the
// entry that publishes or discards the file, and moves it when a directory holding temps
// is renamed (Move).
//
// Thread-safe; its lock is a leaf (it may be taken under the journal's).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "common/mutex.h"
#include "common/status.h"
#include "store/primitives/state_db.h"

namespace ckptfs::store {

class TempRecords {
 public:
  // Key prefix of the records in the state db.
  static constexpr char kPrefix[] = "t/";
  static std::string Key(uint64_t file_id);

  // `db` must outlive it. `temp_prefix`: the owner names file `id`'s temp
  // "<temp_prefix><id>" (empty: not known in advance). Ids start after `last_id`.
  TempRecords(StateDb* db, std::string temp_prefix, uint64_t last_id)
      : db_(db), temp_prefix_(std::move(temp_prefix)), next_file_id_(last_id) {}
  TempRecords(const TempRecords&) = delete;
  TempRecords& operator=(const TempRecords&) = delete;

  // The next file id. With a temp prefix, writes the records of the next ids ahead, in
  // one synced write.
  uint64_t NextId() EXCLUDES(mu_);
  // Records a temp file before it is created; synced before this returns, or ahead of
  // time (NextId).
  Status Register(uint64_t file_id, const std::string& temp_path) EXCLUDES(mu_);
  // Forgets a temp file that was removed without ever being journaled.
  Status Forget(uint64_t file_id) EXCLUDES(mu_);
  // A file whose record is on disk already (an entry a bounded stop left).
  void Note(uint64_t file_id, const std::string& temp_path) EXCLUDES(mu_);
  // Its record is being removed with its entry (the journal's write).
  void Drop(uint64_t file_id) EXCLUDES(mu_);
  // A directory holding temps was renamed from `from` to `to`: their records follow.
  void Move(const std::string& from, const std::string& to) EXCLUDES(mu_);

 private:
  StateDb* const db_;
  const std::string temp_prefix_;
  Mutex mu_;
  std::map<uint64_t, std::string> temps_ GUARDED_BY(mu_);  // file id -> temp path
  uint64_t next_file_id_ GUARDED_BY(mu_);
  // Ids [reserved_from_, reserved_until_] have a synced record of their temp name.
  uint64_t reserved_from_ GUARDED_BY(mu_) = 1;
  uint64_t reserved_until_ GUARDED_BY(mu_) = 0;
};

}  // namespace ckptfs::store
