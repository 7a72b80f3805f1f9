// PassthroughReads: which read-only opens the kernel may serve itself (FUSE passthrough,
// fs/transport/passthrough.h), and what a negotiated passthrough changes in the daemon.
//
// Owns the PassthroughTable (the io mode of each inode, kept by fs/transport/fuse_ops.cc) and
// decides, per open handle, whether its backing file may be handed to the kernel. It reads
// the handle's node state under that node's data_mu (a leaf, never held across I/O); the
// table has its own leaf lock. No lock of its own.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "fs/fs_stats.h"
#include "fs/fs_types.h"
#include "fs/handle.h"
#include "fs/transport/passthrough.h"
#include "fs/read_path.h"
#include "store/cache/retained_tier.h"

namespace ckptfs::fs {

class PassthroughReads {
 public:
  // All must outlive; `retained` may be null (no retained tier).
  PassthroughReads(const FsConfig& config, store::RetainedTier* retained, ReadPath* read,
                   PassthroughStats* stats);
  PassthroughReads(const PassthroughReads&) = delete;
  PassthroughReads& operator=(const PassthroughReads&) = delete;

  PassthroughTable* table() { return &table_; }

  // The backing file a read-only open may be passed through to (its descriptor, borrowed
  // from `h`, and its identity and size as the open found them: no syscall), or nullopt
  // when the daemon must serve it: a writable handle, a file with staged bytes
  // (read-your-writes) or a failed publication, a control file or tensor view, a file
  // below passthrough_min_bytes, a version the retained tier holds, or a checkpoint's file
  // while peers share the load (blocks come from the peer that owns them).
  struct Source {
    int fd;
    dev_t dev;
    ino_t ino;
    uint64_t size;
  };
  std::optional<Source> SourceOf(Handle* h);

  // The INIT exchange is done: `on` when the kernel will pass reads through. A load then
  // no longer prefetches into the block cache (without peers): the kernel reads the bytes.
  void OnNegotiated(bool on);

 private:
  const FsConfig& config_;
  store::RetainedTier* const retained_;
  ReadPath* const read_;
  PassthroughStats* const stats_;
  PassthroughTable table_;
};

}  // namespace ckptfs::fs
