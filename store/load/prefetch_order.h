// The order in which a load's page-cache prefetch asks for a checkpoint's files.
//
// Ranks read their files side by side, each its own sequence of files front to back: torch's
// FileSystemWriter names them `__<rank>_<n>.distcp`, n counting up per rank (one file per
// rank: n is 0; one file per item: n per item, in the order the items are read back). The
// prefetch takes one window from each rank's sequence in turn, so every rank's next bytes
// arrive early and none waits behind the others' whole files. A file named otherwise is a
// sequence of its own. Pure: no I/O.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ckptfs::store {

struct PrefetchWindow {
  size_t file = 0;  // index into the files given to PrefetchOrder
  uint64_t offset = 0;
  uint64_t length = 0;

  bool operator==(const PrefetchWindow& o) const {
    return file == o.file && offset == o.offset && length == o.length;
  }
};

// (rank, n) of a name `__<rank>_<n>.distcp` (decimal, no sign); nullopt for any other.
std::optional<std::pair<uint64_t, uint64_t>> DcpWriterFile(std::string_view name);

// Windows of at most `window` bytes (> 0) covering every file's [0, length), in the order
// to ask for them. `files`: (name, length) pairs.
std::vector<PrefetchWindow> PrefetchOrder(
    const std::vector<std::pair<std::string, uint64_t>>& files, uint64_t window);

}  // namespace ckptfs::store
