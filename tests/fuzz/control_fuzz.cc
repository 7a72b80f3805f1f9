// Fuzzes the readers of the control surface (issue 41): ckptfs-admin parses whatever the
// mount's /.ckptfs/stats, /.ckptfs/checkpoints and the user.ckptfs.progress xattr hold
// (a daemon of another version, a file system that is not ckptfs at all, a torn read):
// ParseProgress, FormatStats, FormatCheckpoints and FormatPeers (mount/admin.h). Any bytes
// give a result or an error with a message, never a crash or an exception; an accepted
// progress keeps its state and never reports more done than total when both are given.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "mount/admin.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  auto progress = ckptfs::admin::ParseProgress(in);
  if (!progress.ok() && progress.status().message().empty()) __builtin_trap();
  if (progress.ok()) (void)ckptfs::admin::ClassifyState(progress->state);
  auto stats = ckptfs::admin::FormatStats(in);
  if (!stats.ok() && stats.status().message().empty()) __builtin_trap();
  auto cks = ckptfs::admin::FormatCheckpoints(in, 1.7e9);
  if (!cks.ok() && cks.status().message().empty()) __builtin_trap();
  auto peers = ckptfs::admin::FormatPeers(in);
  if (!peers.ok() && peers.status().message().empty()) __builtin_trap();
  return 0;
}
