#include "common/lock_code.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

namespace ckptfs {

CodeLock LockCodeInMemory() {
  CodeLock out;
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  const std::string self = n > 0 ? std::string(exe, static_cast<size_t>(n)) : "";
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> objects;
  std::string line;
  while (std::getline(maps, line)) {
    // "start-end perms offset dev inode path"
    std::istringstream in(line);
    std::string range, perms, offset, dev, inode, path;
    if (!(in >> range >> perms >> offset >> dev >> inode)) continue;
    std::getline(in >> std::ws, path);
    if (path.empty() || path[0] != '/' || perms.size() < 4) continue;
    const bool object = path == self || path.find(".so") != std::string::npos;
    // Writable data is copied on write anyway; "---p" gaps between segments are no pages.
    if (!object || perms[0] != 'r' || perms[1] == 'w') continue;
    const size_t dash = range.find('-');
    const uint64_t start = std::stoull(range.substr(0, dash), nullptr, 16);
    const uint64_t end = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (end <= start) continue;
    if (::mlock(reinterpret_cast<void*>(start), end - start) == 0) {
      out.bytes += end - start;
      objects.insert(path);
    } else {
      out.failed += end - start;
      if (out.error.empty()) out.error = std::strerror(errno);
    }
  }
  out.objects = static_cast<int>(objects.size());
  return out;
}

}  // namespace ckptfs
