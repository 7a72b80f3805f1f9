// AbortedRewrites: what an operator's abort of a save makes of an earlier save's commit in
// the same directory (docs/SEMANTICS.md rule 4, "An aborted rewrite"), where the journal
// keeps nothing of the aborted save to put back (ReplacedFiles). The earlier `.metadata` is
// withdrawn when something of the aborted save may be in the directory (WithdrawOnAbort,
// Journal::Abort's question); its commit stands, and the registry says so, when nothing of
// the aborted save reached the backing store (KeepEarlierCommits). The directories whose
// `.metadata` it withdrew are remembered until a commit of theirs is applied again
// (OnCommitted); bounded.
//
// Thread-safe. Its lock is a leaf, never held over a call out: WithdrawOnAbort runs under
// the journal's lock and asks the registry first.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "store/primitives/backing_dir.h"
#include "store/publish/checkpoints.h"
#include "store/publish/journal.h"

namespace ckptfs::store {

class AbortedRewrites final : public AbortWithdrawals {
 public:
  // `shared_dirs`: other nodes write into the same directories (--peers), so this node
  // cannot tell that nothing of an aborted save reached one.
  AbortedRewrites(BackingDir* dir,               // must outlive
                  CheckpointRegistry* registry,  // must outlive
                  bool shared_dirs)
      : dir_(dir), registry_(registry), shared_dirs_(shared_dirs) {}
  AbortedRewrites(const AbortedRewrites&) = delete;
  AbortedRewrites& operator=(const AbortedRewrites&) = delete;

  // AbortWithdrawals: the queued files of a save into `dir` are dropped; true if
  // something of it may be in `dir` on the backing store (`in_place`: a failed attempt left
  // its name there; or its record counts published bytes; or an earlier abort withdrew the
  // `.metadata` already), so that an earlier `.metadata` there is withdrawn.
  bool WithdrawOnAbort(const std::string& dir, bool in_place) override EXCLUDES(mu_);
  // Aborted saves into `dirs` of which nothing reached the backing store (Journal::Abort's
  // `untouched`): where an earlier save's `.metadata` is there and nothing withdraws it,
  // that commit stands and the registry's record says committed again. Returns those
  // directories (a tracker naming one may be published).
  std::vector<std::string> KeepEarlierCommits(const std::vector<std::string>& dirs) EXCLUDES(mu_);
  // A commit of `dir` was applied: its `.metadata` is there again.
  void OnCommitted(const std::string& dir) EXCLUDES(mu_);

 private:
  static constexpr size_t kMaxWithdrawn = 1024;

  BackingDir* const dir_;
  CheckpointRegistry* const registry_;
  const bool shared_dirs_;

  Mutex mu_;
  // Directories whose earlier `.metadata` an abort withdraws. Protected by mu_.
  std::set<std::string> withdrawn_ GUARDED_BY(mu_);
};

}  // namespace ckptfs::store
