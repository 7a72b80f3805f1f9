// FUSE over io_uring (Linux 6.14+) beside libfuse 3.14's /dev/fuse loop.
//
// Over /dev/fuse every request costs a daemon thread's wakeup on whatever CPU is free, a
// read() (two system calls when spliced) and a writev(). Over io_uring the kernel hands a
// request to a ring entry of the queue of the CPU that made it, and one io_uring_enter both
// answers a request and waits for the next (FUSE_IO_URING_CMD_COMMIT_AND_FETCH). On this
// project's 2-core VM an open() costs about 30% less (docs/BENCHMARKS.md).
//
// How it fits libfuse 3.14, which knows nothing of it:
//   * INIT still comes over /dev/fuse; the InitPatcher (fs/transport/passthrough.h) adds
//     FUSE_OVER_IO_URING to the reply where the kernel offered it. Once that reply is
//     written, Start() runs the queues: a queue per possible CPU (the kernel's rule), each
//     with its own threads, each thread with its own small ring and one entry.
//     The kernel moves every request but FORGET and INTERRUPT to the rings once every
//     queue has an entry; until then, and for ever if a queue cannot register, requests
//     keep coming over /dev/fuse, which libfuse's loop serves as before. The threads are
//     not pinned: the scheduler keeps them near their CPU, and moves them to an idle one
//     when the reader's own CPU is busy (see Serve()).
//   * A request that arrives in an entry is laid out as libfuse reads one off /dev/fuse
//     (in_header, op struct, payload, contiguous: the payload is not copied) and handed to
//     `dispatch` (fuse_session_process_buf). The reply libfuse writes comes back through
//     the session's custom writev, which calls TakeReply: a reply to the request this
//     thread is serving is copied into the entry and committed with the next fetch. So a
//     read the daemon serves itself (block cache, retained tier, peers) is copied twice:
//     into the entry, then by the kernel into the reader's pages; over /dev/fuse the
//     kernel copies straight from the cache's blocks (fuse_reply_iov). Passthrough reads
//     never reach the daemon either way.
//   * A thread serves one request at a time, like a libfuse worker. When a thread takes a
//     request and leaves its queue fewer than spare_entries idle registered entries,
//     another thread is started for that queue (up to max_threads_per_queue), so a handler
//     that waits (a strict close, a conflict wait) never leaves the requests of its CPU
//     without a server (G10). The spare is kept ahead because of a kernel rule (6.14 to
//     6.18): a request that finds no registered entry is queued and taken only by the next
//     COMMIT_AND_FETCH on that queue; an entry registered later does not take it. A burst
//     of more waiting requests than spare entries, within the time a new thread takes to
//     register, can still leave one queued until a handler of that queue replies.
//
// Errors never hang clients: a request that cannot be laid out or got no reply is answered
// EIO; an entry the kernel refuses is registered again; a queue left with no thread ends the
// session through `fatal` (the daemon then drains and stops, as on SIGTERM) instead of
// leaving that CPU's requests unanswered. After Stop() requests already delivered are left
// unanswered, as libfuse leaves a request read after its loop exited: the unmount that
// follows ends them.
//
// Thread-safe. TakeReply is called from any thread (libfuse's writev).
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "fs/fs_stats.h"

namespace ckptfs::fs {

struct FuseUringOptions {
  int min_threads_per_queue = 2;
  int max_threads_per_queue = 16;
  // Idle registered entries each queue keeps ahead of its requests: a thread that takes a
  // request and leaves fewer starts another.
  int spare_entries = 2;
};

class FuseUring {
 public:
  // Serves one request: `size` bytes at `request`, laid out as read off /dev/fuse. Must
  // reply (through the session's writev) before it returns.
  using Dispatch = std::function<void(char* request, size_t size)>;
  // The rings can no longer serve some CPU's requests: end the session.
  using Fatal = std::function<void(const std::string& why)>;

  // `dev_fd`: the session's /dev/fuse descriptor (borrowed). `stats` must outlive.
  FuseUring(int dev_fd, FuseUringOptions options, Dispatch dispatch, Fatal fatal,
            FuseTransportStats* stats);
  ~FuseUring();  // Stop()
  FuseUring(const FuseUring&) = delete;
  FuseUring& operator=(const FuseUring&) = delete;

  // Starts the queues (once; later calls do nothing). Call after the INIT reply that asked
  // for FUSE_OVER_IO_URING was written; `max_payload` is what that reply allows
  // (InitPatcher::max_payload()), each entry's payload size. Returns at once; queues
  // register in the background.
  void Start(uint32_t max_payload) EXCLUDES(mu_);
  // Takes no new request, lets each thread finish the one it serves, joins them.
  void Stop() EXCLUDES(mu_);

  // A reply about to be written to /dev/fuse (`iov[0]` is its fuse_out_header): true when
  // it answers the request the calling thread serves from a ring; then it is taken here.
  bool TakeReply(const struct iovec* iov, int count);

  // The possible CPUs, from /sys/devices/system/cpu/possible: the kernel's queue count.
  static int PossibleCpus();

  // The kernel's switch, /sys/module/fuse/parameters/enable_uring: whether the kernel
  // offers FUSE over io_uring to new connections. Error when the kernel has no such
  // parameter (built without CONFIG_FUSE_IO_URING).
  static Result<bool> KernelEnabled();
  static Status SetKernelEnabled(bool on);  // root

  // How a request in a ring entry becomes libfuse's contiguous layout (exposed for tests).
  // `op_in` holds the op struct, whose size is what in_header.len leaves of the header and
  // `payload_sz`; it is copied into the `room` bytes before `payload`. Returns the start of
  // the request, or an error when the sizes do not add up.
  static Result<char*> LayOut(const void* in_out, const void* op_in, uint32_t payload_sz,
                              char* payload, size_t room, uint32_t max_payload);

 private:
  struct Entry;
  struct Queue {
    int qid = 0;
    std::atomic<int> threads{0};  // started and not yet ended
    std::atomic<int> idle{0};     // waiting for a request
  };
  static thread_local Entry* current_;  // the entry this thread serves, in its handler

  void Spawn(Queue* q) EXCLUDES(mu_);
  void Serve(Queue* q);
  void Answer(Entry* e);
  void ThreadEnded(Queue* q, const std::string& why);

  const int dev_fd_;
  const FuseUringOptions options_;
  const Dispatch dispatch_;
  const Fatal fatal_;
  FuseTransportStats* const stats_;
  int stop_fd_ = -1;  // an eventfd every ring polls: written once by Stop()
  uint32_t max_payload_ = 0;  // set by Start() before any thread runs, then fixed
  std::atomic<bool> stopping_{false};
  std::vector<std::unique_ptr<Queue>> queues_;  // set by Start(), then fixed
  Mutex mu_;
  bool started_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ GUARDED_BY(mu_);
};

}  // namespace ckptfs::fs
