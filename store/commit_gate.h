// CommitGate: decides when a DCP checkpoint's `.metadata` may appear on the backing store
// (G5): only once every shard it names is durable there with at least the referenced
// length. It is the journal's commit_gate hook (Journal::Hooks) and never blocks: it
// answers "ready", "refused" or "not yet, these shards are missing, ask again by then".
//
// Shards are judged in this order:
//   1. a publish of the shard still queued in this mount's journal: wait for it (the
//      journal applies it ahead of the `.metadata`);
//   2. a shard being written through this mount and not yet closed (written_locally):
//      wait for its close;
//   3. otherwise it was written elsewhere (another node, or before this mount): it counts
//      once the backing store shows it with the required length. Only these are polled,
//      with backoff (50 ms doubling to 2 s), and only these can time out.
// A `.metadata` that is not a DCP metadata this parser understands commits by order alone.
//
// Across nodes (G4): a mount whose ranks wrote shards of a checkpoint whose `.metadata`
// another node publishes has no journal entry to order its later entries after. So the
// gate remembers each directory where this mount published a `*.distcp` and no
// `.metadata` (NoteApplied), and an ordered entry (IsOrderedEntry: a tracker, any other
// non-shard file, a rename, a delete) waits until the backing store shows every such
// directory's `.metadata`, polled with the same backoff and timeout; on timeout it is
// refused (the journal halts there, or skips it in strict mode).
//
// Thread-safe; called from the journal's publisher thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "store/backing_dir.h"
#include "store/journal.h"

namespace ckptfs::store {

struct CommitGateOptions {
  // How long a `.metadata` waits for shards written elsewhere.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  // True while `path` (relative to the backing root) is open for writing through this
  // mount and its publication is not yet queued. May be empty (nothing is).
  std::function<bool(const std::string&)> written_locally;
  // True if the application deleted `path` through this mount before it was published
  // (its publish was dropped): a `.metadata` naming it is refused at once. May be empty.
  std::function<bool(const std::string&)> deleted_locally;
};

class CommitGate {
 public:
  CommitGate(BackingDir* dir, CommitGateOptions options)  // dir must outlive
      : dir_(dir), options_(std::move(options)) {}
  CommitGate(const CommitGate&) = delete;
  CommitGate& operator=(const CommitGate&) = delete;

  CommitCheck Check(const JournalEntry& e,
                    const std::function<bool(const std::string&)>& queued);

  uint64_t remote_polls() const;

  // Entries that wait for checkpoints committed elsewhere (see above). Looks at the entry
  // only; safe under any lock.
  static bool IsOrderedEntry(const JournalEntry& e);
  // The journal's on_done: tracks directories holding shards published here whose
  // `.metadata` this mount did not publish.
  void NoteApplied(const JournalEntry& e, const Status& st);

 private:
  struct Pending {
    uint64_t seq = 0;
    bool by_order = false;                    // not a metadata we understand
    std::map<std::string, uint64_t> need;     // shard path -> minimum length, not yet seen
    std::chrono::steady_clock::time_point deadline;
    std::chrono::steady_clock::time_point next_poll;
    std::chrono::milliseconds backoff{50};
  };
  Status Load(const JournalEntry& e, Pending* p);
  CommitCheck CheckOrdered(const JournalEntry& e) REQUIRES(mu_);

  BackingDir* const dir_;
  const CommitGateOptions options_;
  mutable Mutex mu_;
  Pending current_ GUARDED_BY(mu_);  // the commit being judged
  uint64_t remote_polls_ GUARDED_BY(mu_) = 0;
  // Checkpoint dirs with shards published here and no `.metadata` seen yet, and the
  // ordered entry waiting for them.
  std::set<std::string> foreign_ GUARDED_BY(mu_);
  Pending ordered_ GUARDED_BY(mu_);  // seq, deadline, backoff only
};

}  // namespace ckptfs::store
