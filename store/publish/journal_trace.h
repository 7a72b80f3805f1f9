// JournalTrace: one line per journal entry done, resumed or discarded, appended to a file
// (the daemon's --journal-trace; diagnosis, and how the soak checks "nothing is published
// twice" by sequence number, issue 41).
//
//   start <epoch>                  a run's journal begins (its sequence numbers restart)
//   resume <seq> <op> <path>       recovery: an entry the last run's bounded stop left
//   discard <seq> <op> <path>      recovery: an entry a crash of the last run left
//   done <seq> <op> <0|1> <path>   an entry finished (1: applied to the backing store),
//                                  written after its record left the state db
//
// Lines of one run follow its `start`; recovery lines come before the `start` of the run
// that recovers. So a sequence number resumed or discarded must not be `done` in the run
// before (its record was removed already), and none is applied twice in one run. One
// number can be `done` twice: an abort (Journal::Abort) puts the withdrawal of a
// `.metadata` in the place, and under the number, of an entry it drops, so the dropped
// entry's `done <seq> publish 0` is followed by the withdrawal's `done <seq> unlink 1`.
// Each line is one write(2) to an O_APPEND descriptor: whole lines, in order, and a
// SIGKILL loses at most the line being written. Paths are written as they are (no newline
// can be in a path the daemon publishes). Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "common/unique_fd.h"
#include "store/publish/journal_entry.h"

namespace ckptfs::store {

class JournalTrace {
 public:
  static Result<std::unique_ptr<JournalTrace>> Open(const std::string& path);

  void Start(uint64_t epoch) const;
  // `what`: "resume" or "discard".
  void Recovered(const char* what, const JournalEntry& e) const;
  void Done(const JournalEntry& e, bool applied) const;

 private:
  explicit JournalTrace(UniqueFd fd) : fd_(std::move(fd)) {}
  void Write(const std::string& line) const;

  const UniqueFd fd_;
};

}  // namespace ckptfs::store
