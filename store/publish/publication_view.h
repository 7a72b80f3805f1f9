// PublicationView: what the mount may read of publication and nothing it may change: how
// far the journal is, what it waits for, the checkpoint registry's records and the commit
// gate's counters. Publication::view() hands it out; fs/ (the progress xattr, the control
// tree's stats and checkpoints) reads publication only through it, never the journal,
// registry or gate themselves.
//
// A few borrowed pointers, cheap to copy. Thread-safe: each part takes its own lock.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "store/publish/checkpoints.h"
#include "store/publish/commit_gate.h"
#include "store/publish/journal.h"

namespace ckptfs::store {

class PublicationView {
 public:
  // All must outlive the view (Publication's parts).
  PublicationView(const Journal* journal, const CheckpointRegistry* registry,
                  const CommitGate* gate)
      : journal_(journal), registry_(registry), gate_(gate) {}

  // The journal: counts, and the entries appended and done (every seq <= applied()).
  JournalCounts counts() const { return journal_->counts(); }
  uint64_t last_appended() const { return counts().last_appended; }
  uint64_t applied() const { return counts().applied; }
  // Whether entry `seq` is done, ahead of its turn too (a mkdir applied ahead).
  bool done(uint64_t seq) const { return journal_->WaitDoneFor(seq, {}); }
  // What publication waits for now (Journal::WaitingFor), and the halt, if any.
  std::string WaitingFor() const { return journal_->WaitingFor(); }
  std::optional<HaltInfo> halted() const { return journal_->halted(); }

  // The checkpoint registry: the record of checkpoint directory `dir`, all records, and
  // how many are in each state.
  std::optional<CheckpointInfo> Checkpoint(const std::string& dir) const {
    return registry_->Get(dir);
  }
  std::vector<CheckpointInfo> Checkpoints() const { return registry_->List(); }
  std::map<std::string, uint64_t> CountByState() const { return registry_->CountByState(); }

  // The commit gate's counters.
  CommitGateStats gate_stats() const { return gate_->stats(); }

 private:
  const Journal* journal_;
  const CheckpointRegistry* registry_;
  const CommitGate* gate_;
};

}  // namespace ckptfs::store
