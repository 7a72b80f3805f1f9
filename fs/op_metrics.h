// Latency histograms of FUSE requests, by operation, for /metrics.
//
// Process-wide (one mount per daemon process) and thread-safe: FuseServer's callbacks
// time themselves with an OpTimer; ControlTree::MetricsText renders the histograms.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>

#include "common/histogram.h"

namespace ckptfs::fs {

enum class FuseOp : size_t {
  kLookup, kGetattr, kSetattr, kReadlink, kMkdir, kSymlink, kUnlink, kRmdir, kRename,
  kCreate, kOpen, kRead, kWrite, kFlush, kRelease, kFsync, kOpendir, kReaddir,
  kReleasedir, kStatfs, kGetxattr, kListxattr, kMknod, kLink, kFallocate, kSetxattr, kCount
};

inline constexpr std::array<const char*, static_cast<size_t>(FuseOp::kCount)> kFuseOpNames = {
    "lookup", "getattr", "setattr", "readlink", "mkdir",   "symlink",    "unlink", "rmdir",
    "rename", "create",  "open",    "read",     "write",   "flush",      "release", "fsync",
    "opendir", "readdir", "releasedir", "statfs", "getxattr", "listxattr", "mknod", "link",
    "fallocate", "setxattr"};

inline Histogram& FuseOpHistogram(FuseOp op) {
  static std::array<Histogram, static_cast<size_t>(FuseOp::kCount)> histograms;
  return histograms[static_cast<size_t>(op)];
}

// Observes the time from construction to destruction (the request's reply) in the
// histogram of `op`.
class OpTimer {
 public:
  explicit OpTimer(FuseOp op) : op_(op), start_(std::chrono::steady_clock::now()) {}
  ~OpTimer() {
    FuseOpHistogram(op_).Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  const FuseOp op_;
  const std::chrono::steady_clock::time_point start_;
};

}  // namespace ckptfs::fs
