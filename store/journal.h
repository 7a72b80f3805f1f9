// Journal: the ordered list of publish and namespace operations, applied to the
// backing store strictly in order by one publisher thread (G4, G5).
//
// An entry is applied only after every earlier entry has been applied (or skipped)
// and, for a publish, after its file's bytes are durable (flushed and fsynced). Then
// the temp file is renamed onto its real name. An entry whose data failed, or a commit
// that its gate refuses, is skipped: nothing of it reaches the backing store, and its
// failure is reported through the hooks and to Wait().
//
// Entries and temp-file records are kept in RocksDB, so a restarted daemon knows which
// temp files were never published and removes them (Recover()).
//
// Thread-safe. The destructor drains pending entries and joins the publisher.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "store/backing_dir.h"
#include "store/flush_pipeline.h"
#include "store/state_db.h"

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

  std::string Serialize() const;
  static Result<JournalEntry> Parse(std::string_view text);
  std::string Describe() const;
};

struct RecoveryReport {
  uint64_t entries_discarded = 0;
  uint64_t temps_removed = 0;
  std::vector<std::string> discarded_paths;  // publish targets that never appeared
};

class Journal {
 public:
  struct Hooks {
    // Runs on the publisher thread before an entry that makes a name `.metadata`
    // appear. It may block (for example while shards from other nodes become
    // durable). Non-ok skips the entry.
    std::function<Status(const JournalEntry&)> commit_gate;
    // Runs on the publisher thread after each entry is applied or skipped.
    std::function<void(const JournalEntry&, const Status&)> on_done;
  };

  // Removes the temp files of a previous run that were never published and clears its
  // pending entries. Call before Create() on the same StateDb.
  static Result<RecoveryReport> Recover(BackingDir* dir, StateDb* db);

  static Result<std::unique_ptr<Journal>> Create(BackingDir* dir,  // must outlive
                                                 StateDb* db,      // must outlive
                                                 Hooks hooks);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // Records a temp file before it is created, so a crash cannot leak it.
  Status RegisterTemp(uint64_t file_id, const std::string& temp_path);
  // Forgets a temp file that was removed without ever being journaled.
  Status ForgetTemp(uint64_t file_id);
  uint64_t NextFileId();

  // Persists and queues `entry`; returns its sequence number.
  Result<uint64_t> Append(JournalEntry entry);
  // Blocks until entry `seq` is applied or skipped; returns its outcome.
  Status Wait(uint64_t seq);
  // Blocks until every appended entry is done.
  void Drain();

  uint64_t pending() const;
  uint64_t last_appended() const;
  uint64_t applied() const;
  uint64_t skipped() const;

 private:
  Journal(BackingDir* dir, StateDb* db, Hooks hooks, uint64_t next_seq, uint64_t next_id);
  void Run();
  Status Apply(const JournalEntry& e);
  Status ApplyPublish(const JournalEntry& e);
  // The owner and exact mode of a name kMkdir/kSymlink/kMknod just made.
  Status ApplyOwner(const JournalEntry& e);
  // Keeps temp records right when a directory holding temps is renamed.
  void MoveTempRecords(const std::string& from, const std::string& to);

  BackingDir* const dir_;
  StateDb* const db_;
  const Hooks hooks_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<JournalEntry> queue_;       // GUARDED_BY(mu_)
  uint64_t next_seq_;                    // GUARDED_BY(mu_)
  uint64_t done_seq_;                    // GUARDED_BY(mu_): every seq <= this is done
  std::map<uint64_t, Status> failures_;  // GUARDED_BY(mu_): outcomes of skipped entries
  std::map<uint64_t, std::string> temps_;  // GUARDED_BY(mu_): file id -> temp path
  uint64_t next_file_id_;                // GUARDED_BY(mu_)
  uint64_t skipped_ = 0;                 // GUARDED_BY(mu_)
  bool stop_ = false;                    // GUARDED_BY(mu_)
  std::thread thread_;
};

// True if `path`'s last component is `.metadata` (the DCP commit file).
bool IsCommitName(const std::string& path);

}  // namespace ckptfs::store
