// DeletionHold: while a checkpoint has been given up (it never commits: a node was lost,
// or its `.metadata` never appeared within --commit-timeout) and no later checkpoint has
// committed since, the deletion of a committed checkpoint waits: the backing store always
// keeps a committed one (issue 39, docs/SEMANTICS.md "A lost node").
//
// A training loop rotates: save N, tracker N, `rm -r` N-k. When save N is given up, its
// tracker is withheld (the backing store's tracker still names an older checkpoint), and
// the `rm -r` of N-k would leave the backing store with one committed checkpoint fewer,
// perhaps none, or the very one the tracker names gone (G4). So that deletion is held out
// of the journal's line (Journal: a held entry; every later entry goes past it unless it
// touches the held names), and it is applied once a later checkpoint has committed and its
// tracker is through: a tracker beside the held checkpoint applied since the commit; where
// no tracker was ever applied beside it (and none is on the backing store there: after a
// restart the journal has seen none applied yet), publication reaching the next deletion,
// or the queue empty for the grace (never where a tracker was applied beside it: stop 62,
// the two-node async soak, seed 6203). A stop before that drops the held deletion:
// the old checkpoint stays on the backing store, which the application had deleted (a
// directory more, never a checkpoint fewer).
//
// An operator's abort of a halted tracker drops every queued version of it: the backing
// store's tracker names an older checkpoint until the application writes the tracker
// again and that version is applied. Later commits do not end that (their trackers were
// dropped), so the hold stays on past them, until a version of the tracker is through
// (TrackersWithheld, TrackerThrough; the short soak of 415da15: the rotation's `rm -r` of
// 194 to 197 went after the abort of tracker 197, under the backing store's tracker 196).
//
// Who tells it what: Publication (a commit applied here, a checkpoint given up), the
// commit gate (another node's `.metadata` seen on the backing store, a foreign checkpoint
// given up). The journal reads it on its publisher thread. Lock-free.
#pragma once

#include <atomic>
#include <cstdint>

namespace ckptfs::store {

class DeletionHold {
 public:
  // A checkpoint was given up: deletions of committed checkpoints are held from now until
  // a checkpoint commits.
  void GaveUp() {
    gave_up_.fetch_add(1, std::memory_order_acq_rel);
    active_.store(true, std::memory_order_release);
  }
  // A checkpoint committed (applied here, or another node's `.metadata` seen).
  void Committed() {
    commits_.fetch_add(1, std::memory_order_acq_rel);
    active_.store(false, std::memory_order_release);
  }
  // An abort dropped queued versions of a tracker; until a later version of it is applied,
  // deletions of committed checkpoints are held, past any commit.
  void TrackersWithheld() { trackers_withheld_.store(true, std::memory_order_release); }
  void TrackerThrough() { trackers_withheld_.store(false, std::memory_order_release); }
  // Deletions of committed checkpoints are held now.
  bool active() const {
    return active_.load(std::memory_order_acquire) ||
           trackers_withheld_.load(std::memory_order_acquire);
  }
  // Commits seen so far: a held entry remembers the count when it was held and is let go
  // once it has grown.
  uint64_t commits() const { return commits_.load(std::memory_order_acquire); }
  uint64_t given_up() const { return gave_up_.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> active_{false};
  std::atomic<bool> trackers_withheld_{false};
  std::atomic<uint64_t> commits_{0};
  std::atomic<uint64_t> gave_up_{0};
};

}  // namespace ckptfs::store
