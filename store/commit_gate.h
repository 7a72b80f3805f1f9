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
// Thread-safe; called from the journal's publisher thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
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

  BackingDir* const dir_;
  const CommitGateOptions options_;
  mutable Mutex mu_;
  Pending current_ GUARDED_BY(mu_);  // the commit being judged
  uint64_t remote_polls_ GUARDED_BY(mu_) = 0;
};

}  // namespace ckptfs::store
