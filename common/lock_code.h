// Keeps the daemon's own code in memory.
//
// Every FUSE request waits on the daemon's code. When memory is short, or someone drops the
// page cache (as every cold-load benchmark does, and as operators do before a restart), the
// kernel may evict the pages of the executable and of its shared libraries; the next
// requests then wait for the disk to page them in again, competing with the very reads the
// job is waiting for (measured: about 40 MB read back from the disk during one cold torch
// load through a freshly started daemon). Under memory pressure a FUSE daemon that must fault
// its code in to answer the request reclaim is waiting on is the classic FUSE stall.
#pragma once

#include <cstdint>
#include <string>

namespace ckptfs {

struct CodeLock {
  uint64_t bytes = 0;     // locked
  int objects = 0;        // the executable and the shared libraries locked
  uint64_t failed = 0;    // bytes mlock refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK)
  std::string error;      // the first refusal
};

// mlock()s the file-backed read-only and executable mappings of the executable and of the
// shared libraries loaded now (text, rodata, unwind tables): not their writable data, not
// other mapped files. Best effort; never fails the caller.
CodeLock LockCodeInMemory();

}  // namespace ckptfs
