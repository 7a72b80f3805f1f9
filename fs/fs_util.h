// Small helpers shared by the fs/ units: names, paths and times. Internal to fs/.
#pragma once

#include <sys/stat.h>
#include <time.h>

#include <cstddef>
#include <string>

#include "common/control_names.h"
#include "common/path.h"
#include "common/status.h"
#include "fs/fs_types.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::fs {

// st_blksize of files made through the mount: Python's buffered I/O moves this much per
// write request. Files on the backing store show the store's own (BackingBlockSize): a
// reader buffers as it would reading the store directly. torch 2.14's loads on Python 3.14
// buffer max(st_blksize, 128 KiB) and seek around each item's zip records: at 1 MiB every
// seek refilled a 1 MiB buffer, 1.2x the bytes copied of a direct load.
inline constexpr blksize_t kBlockSize = 1 << 20;
inline blksize_t BackingBlockSize(const struct stat& st) {
  return st.st_blksize > 0 ? st.st_blksize : kBlockSize;
}
inline constexpr double kCommittedTimeout = 3600.0;
inline constexpr double kDefaultTimeout = 1.0;
inline constexpr size_t kNameMax = 255;  // NAME_MAX of every Linux file system we back onto

// Refuses names the backing store could not hold, before anything is queued.
inline Status CheckName(const std::string& name) {
  if (name.size() > kNameMax) {
    return Status(Code::kNameTooLong, "name longer than 255 bytes");
  }
  return Status::Ok();
}

inline bool IsTempName(const std::string& name) {
  return name.compare(0, sizeof(kTempPrefix) - 1, kTempPrefix) == 0;
}

// A name an application may create under `parent`: CheckName, and not reserved (a temp
// file's name anywhere, the control directory's at the root).
inline Status CheckNewName(uint64_t parent, const std::string& name) {
  CKPT_RETURN_IF_ERROR(CheckName(name));
  if (IsTempName(name) || (parent == kRootIno && name == kCtlDirName)) {
    return Status(Code::kPermission, "reserved name " + name);
  }
  return Status::Ok();
}

inline struct timespec Now() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts;
}

inline bool SameTime(const struct timespec& a, const struct timespec& b) {
  return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

}  // namespace ckptfs::fs
