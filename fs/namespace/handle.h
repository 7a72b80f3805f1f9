// Handle: an open file or directory (the FUSE file handle), one kind of several.
//
// The kind is fixed at open; the facade (fs/filesystem.h) routes each call by it.
// Handles are heap objects owned by the kernel's fh until release; never moved.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "common/unique_fd.h"
#include "fs/namespace/node.h"
#include "store/load/loader.h"

namespace ckptfs::fs {

// A file of the namespace (fs/namespace/node.h). Its data source is the node's staged
// contents while it has a write state (Node::data), else its backing file, read by the
// loader (store/load/loader.h).
struct FileHandle {
  std::shared_ptr<Node> node;
  bool writable = false;
  // The backing file, opened when the file had no write state (`backing.fd` is null
  // otherwise): the current version for as long as it has none (a write state lives until
  // every handle is closed). Set at open only, but for the loader's read-ahead state.
  store::LoadFile backing;
  bool keep_cache = false;             // a committed checkpoint's file
  // Its io mode in the PassthroughTable (set by fs/transport/fuse_ops.cc once the open is taken
  // there): counted (released with the handle), and passed through the kernel.
  bool io_counted = false;
  bool passthrough = false;
  uint64_t io_ino = 0;  // the FUSE inode it was counted under
};

// A control file or a tensor view's meta.json: generated at open.
struct ContentHandle {
  std::string content;
};

// A tensor-view chunk file: the window [base, base + size) of a backing file.
struct ViewHandle {
  std::shared_ptr<UniqueFd> fd;
  uint64_t base = 0, size = 0;
};

// A file of a memory-only tree (issue 42, fs/namespace/memory_view.h): the tier's node id.
struct MemoryHandle {
  uint64_t id = 0;
  bool wrote = false;  // its close may commit a checkpoint (store::MemoryTier::Closed)
};

// A directory, listed at opendir (`node` is null for the virtual ones).
struct DirHandle {
  struct Ent {
    std::string name;
    uint64_t ino;
    mode_t type;
  };
  std::shared_ptr<Node> node;
  std::vector<Ent> entries;
};

struct Handle {
  std::variant<FileHandle, ContentHandle, ViewHandle, DirHandle, MemoryHandle> kind;

  FileHandle* file() { return std::get_if<FileHandle>(&kind); }
  const FileHandle* file() const { return std::get_if<FileHandle>(&kind); }
  ContentHandle* content() { return std::get_if<ContentHandle>(&kind); }
  ViewHandle* view() { return std::get_if<ViewHandle>(&kind); }
  DirHandle* dir() { return std::get_if<DirHandle>(&kind); }
  MemoryHandle* memory() { return std::get_if<MemoryHandle>(&kind); }
  const DirHandle* dir() const { return std::get_if<DirHandle>(&kind); }
  // The inode of a namespace file or directory, 0 for the virtual kinds (for logs).
  uint64_t ino() const;
};

inline uint64_t Handle::ino() const {
  if (const FileHandle* f = file()) return f->node->ino;
  if (const DirHandle* d = dir(); d != nullptr && d->node) return d->node->ino;
  return 0;
}

}  // namespace ckptfs::fs
