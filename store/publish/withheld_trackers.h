// WithheldTrackers: the trackers an operator's abort dropped queued versions of
// (Publication::Abort of a halted tracker). Until a version of each is applied again, the
// backing store's tracker names an older checkpoint than the application's, so deletions
// of committed checkpoints are held past any commit (DeletionHold::TrackersWithheld,
// deletion_hold.h). The names are kept in the state db ("w/" + path): a restart before
// the application writes its tracker again holds those deletions too.
//
// Thread-safe: Withhold on an operator's thread, Through on the publisher's.
#pragma once

#include <set>
#include <string>

#include "common/mutex.h"
#include "common/status.h"
#include "store/primitives/state_db.h"
#include "store/publish/deletion_hold.h"

namespace ckptfs::store {

class WithheldTrackers {
 public:
  WithheldTrackers(StateDb* db, DeletionHold* hold) : db_(db), hold_(hold) {}  // must outlive
  WithheldTrackers(const WithheldTrackers&) = delete;
  WithheldTrackers& operator=(const WithheldTrackers&) = delete;

  // The names the last run withheld; the hold is armed if there are any.
  Status Load() EXCLUDES(mu_);
  // An abort is about to drop the queued versions of tracker `path`: armed before the
  // journal drops them, so the publisher cannot reach a deletion behind them first.
  void Withhold(const std::string& path) EXCLUDES(mu_);
  // A version of `path` was applied, or `path` removed: once no tracker is withheld, the
  // hold is disarmed.
  void Through(const std::string& path) EXCLUDES(mu_);

 private:
  StateDb* const db_;
  DeletionHold* const hold_;
  Mutex mu_;
  std::set<std::string> paths_ GUARDED_BY(mu_);
};

}  // namespace ckptfs::store
