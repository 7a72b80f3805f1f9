// LostPublishes: the files whose publish died with a crashed run of this daemon (closed
// through the mount, their publish queued, their bytes still in the temp file when the
// daemon was killed: Journal::Recover discards such entries). Async mode allows that loss;
// what it must not allow is another node committing a `.metadata` that names the file on
// the strength of whatever the backing store shows at that name (an earlier save's
// version). So the next run answers the commit query for these names "failed" (its
// publication failed for good here), and the asking gate refuses the commit instead of
// polling (docs/PEERS.md, "Commit query").
//
// The names are kept in the state db ("l/" + path, written by Journal::Recover with the
// discarding of the entries, in one write): a second crash before the asking node's
// round still answers them. A name leaves the record once this mount publishes, deletes
// or moves it again; the record keeps the newest kMaxRecords names.
//
// Thread-safe: Load at start, OnDone on the journal's threads, Settled wherever another
// node's commit is seen.
#pragma once

#include <cstddef>
#include <set>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "store/primitives/state_db.h"
#include "store/publish/journal_entry.h"

namespace ckptfs::store {

class LostPublishes {
 public:
  static constexpr char kPrefix[] = "l/";
  static constexpr size_t kMaxRecords = 65536;
  // The record of lost name `path`, written at recovery time `when` (seconds).
  static std::pair<std::string, std::string> Record(const std::string& path, double when);

  explicit LostPublishes(StateDb* db) : db_(db) {}  // must outlive it
  LostPublishes(const LostPublishes&) = delete;
  LostPublishes& operator=(const LostPublishes&) = delete;

  // The names the earlier runs lost, newest kMaxRecords (older records are deleted).
  Result<std::vector<std::string>> Load() EXCLUDES(mu_);
  // An entry is done (`st`: applied or not): a lost name this mount publishes, deletes or
  // moves again is forgotten, with every lost name at or below a removed or moved
  // directory; a commit applied here settles its directory (below).
  void OnDone(const JournalEntry& e, const Status& st) EXCLUDES(mu_);
  // Checkpoint `dir` committed (here or elsewhere): a later save of it no longer needs the
  // names lost in an earlier one (that one's commit was refused).
  void Settled(const std::string& dir) EXCLUDES(mu_);
  size_t size() const EXCLUDES(mu_);

 private:
  // `below_only`: not `path` itself.
  void ForgetAtOrBelowLocked(const std::string& path, std::vector<std::string>* keys,
                             bool below_only = false) REQUIRES(mu_);
  void Delete(const std::vector<std::string>& keys);

  StateDb* const db_;
  mutable Mutex mu_;
  std::set<std::string> paths_ GUARDED_BY(mu_);
};

}  // namespace ckptfs::store
