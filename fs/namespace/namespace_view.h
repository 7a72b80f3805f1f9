// What the control tree (fs/control/control_tree.h) reads of the namespace: names of inodes, the
// count of unpublished files, and the progress of a path's publication. Implemented by
// fs::Namespace; thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace ckptfs::fs {

class NamespaceView {
 public:
  virtual ~NamespaceView() = default;
  // The path of `ino` relative to the mount ("" for the root); NotFound for a stale inode.
  virtual Result<std::string> PathOf(uint64_t ino) = 0;
  // PathOf a directory; Invalid for anything else.
  virtual Result<std::string> DirPathOf(uint64_t ino) = 0;
  struct Counts {
    uint64_t files_pending = 0;  // written, not yet published
    uint64_t inodes = 0;
  };
  virtual Counts CountNodes() = 0;
  // The user.ckptfs.progress value of `ino` (JSON: state, bytes_total, bytes_done, error).
  virtual std::string ProgressJson(uint64_t ino) = 0;
};

}  // namespace ckptfs::fs
