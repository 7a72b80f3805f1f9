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
// truncate, the readlink of a symlink a link names): a change of the node in between (a
// rename, a publish freezing its contents, another handle's copy) loses the race, and the
// work starts over from what the node is now. After kRaceTries lost races in one call the
// caller takes the node's I/O token (Node::io_token) before its next try and holds it
// until the call ends: the I/O of that node's racing calls is then done one at a time, as
// the table's lock did before, but nothing else waits for it. The I/O itself still runs
// without the table's lock, and the call goes on trying: it never fails because it lost
// a race (no EAGAIN, no kAborted to the application). The operations that make it lose
// (a rename, a chmod, a publish) do not wait for the token: each further try follows one
// of them having completed, so the namespace as a whole always moves on, though one call
// on a node that another thread changes without pause tries for as long as that lasts.
//
// Lock order: Node::io_token -> the table's lock. A token is taken with the table's lock
// released (TableLock::WithoutLock), and a thread holds one token at a time: a RaceRetry
// nested in a call that holds a token (a directory listed for an operation that holds a
// file's) goes on trying without taking another, so no token holder waits for a token.
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

class RaceRetry {
 public:
  RaceRetry() = default;
  RaceRetry(const RaceRetry&) = delete;
  RaceRetry& operator=(const RaceRetry&) = delete;
  ~RaceRetry() {
    if (token_.owns_lock()) thread_token_ = nullptr;
  }

  // The try now beginning lost its race: the caller starts over.
  void Lose() { ++lost_; }
  // Whether this call holds a node's I/O token (after kRaceTries lost races).
  bool holds_token() const { return token_.owns_lock(); }
  // A try failed with kAborted on `staged`, a staged file a publish froze
  // (store::StagedFile::Write, Truncate): a lost race, the next try goes to the next copy.
  // Unless the try before failed so on the same file: then no publish moves it on (its
  // entry failed to append and it stays frozen), and the caller returns the error.
  bool LostToFreeze(const void* staged) {
    const bool again = staged == last_frozen_;
    last_frozen_ = staged;
    return !again;
  }

  // Before a try on `node`, with the table's lock held: after kRaceTries lost races, takes
  // the node's I/O token, waiting for it without the lock (then what the caller read
  // before may have changed). Kept until this object goes; a call holds one token.
  void Enter(NodeTable& table, const std::shared_ptr<Node>& node) REQUIRES(table.mu()) {
    if (lost_ < kRaceTries || token_.owns_lock() || !node || thread_token_ != nullptr) return;
    std::unique_lock<std::mutex> token(node->io_token, std::try_to_lock);
    if (!token.owns_lock()) TableLock::WithoutLock(table, [&token] { token.lock(); });
    Took(std::move(token), node);
  }
  // The same, for a caller that does not hold the table's lock.
  void EnterUnlocked(NodeTable& table, const std::shared_ptr<Node>& node) EXCLUDES(table.mu()) {
    if (lost_ < kRaceTries || token_.owns_lock() || !node || thread_token_ != nullptr) return;
    Took(std::unique_lock<std::mutex>(node->io_token), node);
  }

 private:
  void Took(std::unique_lock<std::mutex> token, const std::shared_ptr<Node>& node) {
    token_ = std::move(token);
    token_node_ = node;
    thread_token_ = node.get();
  }

  // The node whose token this thread holds, if any (one at a time).
  static inline thread_local const Node* thread_token_ = nullptr;
  int lost_ = 0;
  const void* last_frozen_ = nullptr;  // LostToFreeze
  std::shared_ptr<Node> token_node_;  // keeps the token's node alive while it is held
  std::unique_lock<std::mutex> token_;
};

}  // namespace ckptfs::fs
