// TableLock and RaceRetry: how the parts of the namespace take the node table's lock, and
// the one way they drop it around I/O.
//
// NodeTable's mutex is private (fs/namespace/node_table.h). A part takes it for a scope with
// TableLock, and names it in its annotations as `table.mu()`, a const reference that cannot
// lock anything. The lock is dropped before its scope ends in one way only:
// TableLock::WithoutLock (unlock, do the I/O, relock; the caller re-checks what it read
// before) and TableLock::Await (a condition variable's wait), both REQUIRES(table.mu()),
// so clang's -Wthread-safety checks every caller.
//
// RaceRetry is the retry rule of work planned under the lock, done without it and checked
// again under it (the copy a write begins, the backing open of a file, the cut of a
// truncate, the readlink of a symlink a link names, the listing of a directory): a change
// of the node in between (a rename of it or of a directory above it, a chmod or chown, a
// publish freezing its contents, another call's copy) loses the race, and the work starts
// over from what the node is now. After kRaceTries lost races in one call the caller takes
// the node's I/O token before its next try and holds it until the call ends. The token is
// not a lock: it is a mark in the table (NodeTable::io_tokens_), taken and given back under
// the table's lock and waited for with it released (TableLock::Await), and its I/O runs
// without the table's lock. While a call holds it, what would make it lose waits for it,
// without the table's lock: a chmod or chown of the node (PosixOps::SetAttr), a rename of
// the node or of a directory above it (Namespace::Rename), a publish of the node
// (WriteStates::PublishLocked), and the tries of other calls on the node (Enter), among
// them another handle's copy (AwaitTokenHolders, Change). So a token holder loses at most one
// further race to each change already past that wait when it took the token (a publish
// waiting for a writer to let it freeze, another call's copy in flight: one per thread) and
// to the drop of a published write state: a bound, not "as long as another thread keeps
// changing the node". The call never fails because it lost a race (no EAGAIN, no kAborted
// to the application).
//
// No wait depends on the waiter. A thread that holds a token never waits for a token (its
// nested RaceRetry, a directory listed for an operation that holds a file's, goes on
// without taking another; a publish, chmod or rename it makes itself does not wait), so
// token holders wait on no one who waits on them. A token holder waits for publishes only
// through AwaitFreezeLocked, for those already freezing, which went past their wait for the
// token; a publish still waiting for the token has frozen nothing and appended nothing, so
// no one waits for it. A token holder waits for the journal only in an open's wait for a
// pending rename (WriteStates::NodeOpen, through AwaitJournal): meanwhile publishes do not
// wait for its token, so no commit the journal holds at its gate waits on the holder (a
// publish that goes by then costs the holder at most one more race).
// The waits for a token hold no lock meanwhile: the table's lock is released by the
// condition variable, and no caller holds data_mu or a staged file's lock.
//
// A *Locked method that had to drop the lock to do I/O the operation did not do before it
// took the lock (NodeTable::EnsureLoadedLocked: a directory to list) returns
// kAborted after the I/O; LockDropped() tells the caller to start its operation over.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>

#include "common/mutex.h"
#include "common/status.h"
#include "fs/namespace/node.h"
#include "fs/namespace/node_table.h"

namespace ckptfs::fs {

class SCOPED_CAPABILITY TableLock {
 public:
  explicit TableLock(NodeTable& table) ACQUIRE(table.mu()) : table_(table) {
    table_.mu_.native().lock();
  }
  ~TableLock() RELEASE() {
    if (held_) table_.mu_.native().unlock();
  }
  TableLock(const TableLock&) = delete;
  TableLock& operator=(const TableLock&) = delete;
  // Releases the lock before the end of the scope, for good.
  void Unlock() RELEASE() {
    held_ = false;
    table_.mu_.native().unlock();
  }

  // Unlocks `table`, runs `io` (backing-store I/O, a wait), and locks it again: what the
  // caller read under the lock before may have changed, and is read again. (The body is
  // the one place that drops the lock inside a scope; the analysis checks its callers.)
  template <typename F>
  static decltype(auto) WithoutLock(NodeTable& table, F&& io) REQUIRES(table.mu())
      NO_THREAD_SAFETY_ANALYSIS {
    table.mu_.native().unlock();
    struct Relock {
      NodeTable& t;
      ~Relock() { t.mu_.native().lock(); }
    } relock{table};
    return std::forward<F>(io)();
  }
  // Waits on `cv` until `done()` (the table's lock released meanwhile, as
  // std::condition_variable does). Whoever changes what `done` reads notifies `cv` with
  // the lock held.
  template <typename P>
  static void Await(NodeTable& table, std::condition_variable& cv, P done) REQUIRES(table.mu())
      NO_THREAD_SAFETY_ANALYSIS {
    std::unique_lock<std::mutex> lock(table.mu_.native(), std::adopt_lock);
    cv.wait(lock, std::move(done));
    lock.release();  // still held: the caller's scope releases it
  }

 private:
  NodeTable& table_;
  bool held_ = true;
};

inline constexpr int kRaceTries = 3;

// The *Locked method dropped the lock to do I/O (see above): start the operation over.
inline bool LockDropped(const Status& st) { return st.code() == Code::kAborted; }

// One call's tries (see above). Declared before any TableLock of its scope: it gives its
// token back in its destructor, under the table's lock, so it must end after them.
class RaceRetry {
 public:
  RaceRetry() = default;
  RaceRetry(const RaceRetry&) = delete;
  RaceRetry& operator=(const RaceRetry&) = delete;
  ~RaceRetry() { GiveBack(); }

  // The try now beginning lost its race: the caller starts over.
  void Lose() { ++lost_; }
  // Whether this call holds a node's I/O token (after kRaceTries lost races).
  bool holds_token() const { return token_node_ != nullptr; }
  // A try failed with kAborted on `staged`, a staged file a publish froze
  // (store::StagedFile::Write, Truncate): a lost race, the next try goes to the next copy.
  // Unless the try before failed so on the same file: then no publish moves it on (its
  // entry failed to append and it stays frozen), and the caller returns the error.
  bool LostToFreeze(const void* staged) {
    const bool again = staged == last_frozen_;
    last_frozen_ = staged;
    return !again;
  }

  // Before a try on `node`, with the table's lock held: waits (without the lock) while
  // another call holds the node's token, and after kRaceTries lost races takes it; then
  // what the caller read before may have changed. Kept until this object goes; a thread
  // holds one token at a time, and one that holds a token neither waits nor takes another.
  void Enter(NodeTable& table, const std::shared_ptr<Node>& node) REQUIRES(table.mu());
  // After kRaceTries lost races, the same for a caller that does not hold the table's lock
  // (the data path: before that it takes no lock here, the try itself waits in Enter).
  void EnterUnlocked(NodeTable& table, const std::shared_ptr<Node>& node) EXCLUDES(table.mu());

  // Runs `wait` (a wait for the journal) without the table's lock; meanwhile a publish of
  // this call's token node does not wait for the token (see above).
  template <typename F>
  auto AwaitJournal(NodeTable& table, F&& wait) REQUIRES(table.mu()) {
    MarkAwaitingJournal(table, true);
    auto result = TableLock::WithoutLock(table, std::forward<F>(wait));
    MarkAwaitingJournal(table, false);
    return result;
  }

  // What an operation that would make a token holder lose does to the node (see above).
  enum class Change {
    kOwnerOrMode,  // a chmod or chown: the owner and mode a copy was planned with
    kMove,         // a rename: the backing path of the node and of every node below it
    kPublish,      // a publish: freezes the contents a write goes to
    kTry,          // another call's try on the node (Enter): its copy, its open
  };
  // Waits, without the table's lock, while another thread holds a token `change` of `node`
  // would make lose. Returns whether it waited: then the caller reads what it read before
  // again. A thread that holds a token returns false at once.
  static bool AwaitTokenHolders(NodeTable& table, const Node* node, Change change)
      REQUIRES(table.mu());

 private:
  static bool HeldLocked(const NodeTable& table, const Node* node, Change change)
      REQUIRES(table.mu());
  void MarkAwaitingJournal(NodeTable& table, bool awaiting) REQUIRES(table.mu());
  void GiveBack();

  // The node whose token this thread holds, if any (one at a time).
  static inline thread_local const Node* thread_token_ = nullptr;
  int lost_ = 0;
  const void* last_frozen_ = nullptr;  // LostToFreeze
  NodeTable* table_ = nullptr;         // the table whose token this call holds
  std::shared_ptr<Node> token_node_;   // that token's node, kept alive while it is held
};

}  // namespace ckptfs::fs
