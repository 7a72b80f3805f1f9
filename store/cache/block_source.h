// BlockSource: where blocks of backing files come from, and the node-independent name of a
// block that every daemon agrees on. The backing store is one source; a peer daemon is
// another. The block cache reads its misses through a source, and a PeerServer serves
// through one.
//
// A block is `length` bytes at `offset` of one *version* of a file of the backing directory,
// named by BlockId: the path relative to the backing directory plus the size and mtime (ns)
// that every node sees for it on the shared file system. Unlike the block cache's local
// FileKey (dev, ino), this name means the same bytes on every node; a file rewritten by
// anyone has a new size or mtime and so is a different BlockId (issue 9's block identity).
//
// Implementations must be thread-safe: the block cache and a PeerServer call ReadBlock from
// several threads at once (a PeerServer never from its UCX progress thread). They must confine reads to the
// backing directory (G9); the server has already rejected paths that are absolute or hold
// "..", "." or empty components.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "common/status.h"

namespace ckptfs::store {

struct BlockId {
  std::string path;      // relative to the backing directory, e.g. "run1/iter_100/__0_0.distcp"
  uint64_t size = 0;     // file size the requester expects
  int64_t mtime_ns = 0;  // file mtime the requester expects
  bool operator==(const BlockId&) const = default;
};

struct BlockRead {
  size_t bytes = 0;  // bytes placed at the start of the buffer; < buffer size only at EOF
  // CRC32C of those bytes when the provider knows it from an independent source (the write
  // path's block checksums). The server sends it as the block's checksum, so the requester
  // also detects a bad read on the owner's side. Empty: the server computes it.
  std::optional<uint32_t> crc32c;
};

class BlockSource {
 public:
  virtual ~BlockSource() = default;
  // Reads up to out.size() bytes at `offset` of the file version `id` into `out`.
  // NotFound when the file is absent; Aborted (stale) when its size or mtime differ from
  // `id`; Invalid when offset is past the end; any other error as the read returned it.
  virtual Result<BlockRead> ReadBlock(const BlockId& id, uint64_t offset, std::span<char> out) = 0;
};

}  // namespace ckptfs::store
