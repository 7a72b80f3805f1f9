// ReplacedFiles: the files of a committed checkpoint directory that a later save (a
// rewrite) replaced on the backing store, kept under their temp names so that the rewrite
// can be undone. A publish over a file of a directory that holds a `.metadata` leaves the
// replaced file under the publish's temp name (ApplyEntry's keep_replaced; the entry is
// JournalEntry::kept, and its temp record stays). That file is
//   - put back (PutBack: renamed over the rewrite's version, the directory synced) when
//     the rewrite is aborted or its commit given up, so that the directory is the earlier
//     save again, whole under its `.metadata` (docs/SEMANTICS.md rule 4);
//   - released (Release: unlinked, its temp record removed) once a `.metadata` of the
//     directory is applied again, the directory goes, or the journal stops.
// Only the first version replaced is kept for a name (IsKept): that is the committed one.
// Each kept version has a record in the state db ("r/" + temp: its name, its inode and
// that of the directory's `.metadata`), written before the publish that keeps it
// (RecordBeforeKeep). After a crash the rewrite never commits (its unapplied entries are
// discarded), so recovery puts back every kept version whose `.metadata` is still the one
// it was kept under (RecoverKept): the directory is the earlier save again, instead of
// that `.metadata` over some of the lost save's files (the short soak of 415da15: a
// daemon killed during a re-save left `resave` loading neither save).
// Not with --peers (the journal's shared_dirs): another node may commit the rewrite after
// this one restarts, and recovery leaves its versions in place, as before.
//
// Thread-safe. Its lock is a leaf and is never held over I/O: the journal may ask under
// its own lock (IsKept, HasKept).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/primitives/backing_dir.h"
#include "store/primitives/state_db.h"
#include "store/publish/journal_entry.h"
#include "store/publish/temp_records.h"

namespace ckptfs::store {

class ReplacedFiles {
 public:
  ReplacedFiles(BackingDir* dir,      // must outlive
                StateDb* db,          // must outlive
                TempRecords* temps);  // must outlive
  ReplacedFiles(const ReplacedFiles&) = delete;
  ReplacedFiles& operator=(const ReplacedFiles&) = delete;

  // Before a publish of `temp` over `path` that may keep the version it replaces: where
  // `path` and its directory's `.metadata` exist, records them for recovery (unsynced,
  // as the journal's entries) and returns true. DropRecord(temp) when nothing was kept.
  bool RecordBeforeKeep(const std::string& path, const std::string& temp);
  void DropRecord(const std::string& temp);
  // The publish of `path` left the version it replaced under `temp`, whose temp record is
  // that of file `file_id`.
  void Keep(const std::string& path, const std::string& temp, uint64_t file_id) EXCLUDES(mu_);
  // Recovery, before the temp files are removed: puts back each recorded version still
  // under its temp name whose directory's `.metadata` is the one it was kept under, and
  // syncs its directory; adds every record's key to `deletes` and each directory put back
  // to `restored`. A record whose version is not there (the publish never ran, or the
  // rewrite committed) is only dropped.
  static Status RecoverKept(BackingDir* dir, StateDb* db, std::vector<std::string>* deletes,
                            std::vector<std::string>* restored);
  // A replaced version of `path` is kept (a later publish of it replaces the rewrite's own
  // version: nothing more to keep).
  bool IsKept(const std::string& path) const EXCLUDES(mu_);
  // Some replaced file of directory `dir` is kept.
  bool HasKept(const std::string& dir) const EXCLUDES(mu_);

  // Renames every kept file of `dir` back over the rewrite's version, then syncs `dir`.
  // Each file put back is forgotten (its temp record removed), so a failure stops there
  // and a later call goes on from it. `retry`: an earlier call failed; a kept file whose
  // temp is gone while its name is there was put back by it.
  Status PutBack(const std::string& dir, bool retry) EXCLUDES(mu_);
  // A commit of a rewritten directory was given up (kNodeLost: a shard dropped, or a node
  // lost): the rewrite never commits, so what it replaced is put back at the commit's
  // place, and with `withdraw` (other nodes write into the directory too) the `.metadata`
  // is withdrawn after it (JournalEntry::withdraw). Returns the restore entry that did it
  // (the commit's seq; JournalEntry::restore), for the journal's delegate, or nullopt when
  // nothing of `commit`'s directory was kept or putting it back failed (logged).
  std::optional<JournalEntry> PutBackForGivenUpCommit(const JournalEntry& commit, bool withdraw)
      EXCLUDES(mu_);
  // Removes the kept files of directory `dir` (`subtree`: of every directory at or below
  // it), their temp files and records: the rewrite committed, or the directory went.
  void Release(const std::string& dir, bool subtree) EXCLUDES(mu_);
  // Every kept file (the journal stops: a rewrite neither committed nor aborted stays as
  // the application left it).
  void ReleaseAll() EXCLUDES(mu_) { Release("", /*subtree=*/true); }

 private:
  struct Kept {
    std::string path;  // the name, which holds the rewrite's version
    std::string temp;  // the replaced (committed) version
    uint64_t file_id = 0;
  };
  // Unlinks the temp files of `gone` and removes their temp records.
  void Remove(const std::vector<Kept>& gone);

  BackingDir* const dir_;
  StateDb* const db_;
  TempRecords* const temps_;

  mutable Mutex mu_;
  // By directory, in the order the rewrite replaced them. Protected by mu_.
  std::map<std::string, std::vector<Kept>> by_dir_ GUARDED_BY(mu_);
};

}  // namespace ckptfs::store
