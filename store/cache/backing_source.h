// BackingSource: the backing directory as a BlockSource, the block cache's source of misses
// on this node and, through the cache, of the blocks a PeerServer serves.
//
// A block's file is found by its BlockId (path relative to the backing directory, size,
// mtime). Descriptors are kept open in a bounded cache by BlockId, so a cold load of a
// 1,000-block shard opens it once. There are two ways a descriptor gets there:
//   * Opened here, by the relative path, confined by BackingDir (G9). Its fstat() must match
//     the id's size and mtime, else ReadBlock returns Aborted (stale). Such a descriptor is
//     checked again on every read, since nobody else vouches for it: a file rewritten in
//     place under the same path is never served under its old name.
//   * Adopted from a caller that has the file open already and fstat()ed it (the fs read
//     path: the mount knows each open file's backing path). The caller vouches for the
//     identity, as the old FileKey contract had it, and the read needs no path lookup; it is
//     right while the path is renamed, replaced or unlinked underneath, because the inode
//     read is the one the application opened. Reads are not re-checked: a file truncated
//     underneath yields a short read, as a plain pread would.
//
// BlockId names a file version by path, size and mtime, and two files can share one (a
// file replaced by rename with the same size and mtime, common on file systems with
// coarse timestamps). Adopt() reports that case, so the caller drops the cached blocks of
// the old file before it reads the new one.
//
// O_DIRECT (options.direct_io): a read whose offset, buffer and length allow it goes through
// a second descriptor reopened from the first (/proc/self/fd: the same inode, no path
// lookup), straight from the device into the caller's buffer. A device that refuses
// O_DIRECT (tmpfs, some FUSE or network file systems) is read buffered from then on.
//
// Thread-safe; no lock is held during open or pread.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "store/cache/block_source.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {

// The BlockId of `path` (relative to the backing directory) as fstat() or stat() shows it.
BlockId BlockIdFromStat(std::string path, const struct stat& st);

// Strict weak order of BlockIds by (path, size, mtime): the blocks of one path are adjacent.
struct BlockIdLess {
  bool operator()(const BlockId& a, const BlockId& b) const;
};

// Alignment of offsets, lengths and buffers for O_DIRECT (the largest logical block size in
// use; 512-byte devices accept it too).
inline constexpr uint64_t kDirectIoAlign = 4096;

struct BackingSourceOptions {
  bool direct_io = false;        // read with O_DIRECT where the file system allows it
  size_t max_open_files = 256;   // descriptors kept open (each may have an O_DIRECT twin)
};

struct BackingSourceStats {
  uint64_t reads = 0;              // ReadBlock calls that read
  uint64_t bytes_read = 0;
  uint64_t direct_bytes_read = 0;  // part of bytes_read read with O_DIRECT
  uint64_t opens = 0;              // files opened by path
  uint64_t stale = 0;              // reads refused because the file is another version
  // Descriptors the source holds open now (owned ones and their O_DIRECT twins, bounded by
  // max_open_files twice; borrowed ones are their owners'): what a leak check of the
  // daemon's open files subtracts, as it subtracts the caches' memory.
  uint64_t open_fds = 0;
};

class BackingSource final : public BlockSource {
 public:
  static Result<std::unique_ptr<BackingSource>> Create(BackingDir* dir,  // must outlive
                                                       const BackingSourceOptions& options);
  ~BackingSource() override;
  BackingSource(const BackingSource&) = delete;
  BackingSource& operator=(const BackingSource&) = delete;

  // Reads min(out.size(), id.size - offset) bytes at `offset` (fewer only where the file is
  // shorter than id.size). NotFound when the path is absent, Aborted when it is another
  // version than `id`, Invalid when offset > id.size.
  Result<BlockRead> ReadBlock(const BlockId& id, uint64_t offset, std::span<char> out) override;

  // Binds `id` to the caller's open descriptor `fd`, whose fstat() is `st` (see above);
  // other versions of id.path bound before are dropped. When `id` was bound to a different
  // file (device or inode), blocks cached under `id` are the old file's: `drop_cached`
  // (e.g. BlockCache::Invalidate) is called with id.path, under this source's lock and
  // before the new binding is visible, so no reader that adopted the new file can read a
  // block of the old one. It must not call back into this source. Returns whether it was.
  bool Adopt(const BlockId& id, std::shared_ptr<const UniqueFd> fd, const struct stat& st,
             const std::function<void(const std::string& path)>& drop_cached = nullptr)
      EXCLUDES(mu_);

  // Closes every descriptor kept for `path`, any version.
  void Forget(const std::string& path);

  BackingSourceStats Stats() const;

 private:
  struct File {
    // Opened here by path (owned, bounded by max_open_files), or lent by Adopt(): a lent
    // descriptor is only borrowed (weak), so it closes when its owner closes the file and
    // the source never holds descriptors of files nobody has open.
    std::shared_ptr<const UniqueFd> fd;
    std::weak_ptr<const UniqueFd> borrowed;
    std::shared_ptr<const UniqueFd> direct;  // O_DIRECT twin of an owned fd, once opened
    bool direct_tried = false;
    bool vouched = false;  // adopted: not re-checked on reads
    uint64_t dev = 0, ino = 0;
    std::list<BlockId>::iterator lru_pos;
  };
  // What one read uses, taken out of the cache under the lock.
  struct Use {
    std::shared_ptr<const UniqueFd> fd, direct;
    bool vouched = false, direct_tried = false;
    uint64_t dev = 0;
  };

  BackingSource(BackingDir* dir, const BackingSourceOptions& options)
      : dir_(dir), opts_(options) {}

  // The descriptor for `id`: cached, or opened by path and checked.
  Result<Use> Acquire(const BlockId& id) EXCLUDES(mu_);
  // Inserts (or refreshes) the binding of `id`; evicts the least recently used beyond the
  // bound. Returns the binding now in the cache.
  File& BindLocked(const BlockId& id, File file) REQUIRES(mu_);
  void EraseLocked(std::map<BlockId, File, BlockIdLess>::iterator it) REQUIRES(mu_);
  // Drops the bindings whose borrowed descriptor was closed by its owner.
  void SweepLocked() REQUIRES(mu_);
  // Closes owned descriptors whose file was unlinked (by another node), a few at a time;
  // never that of `keep` (the binding just made).
  void CloseUnlinkedLocked(const BlockId& keep) REQUIRES(mu_);
  // The descriptor of a binding: owned, or borrowed while its owner keeps it open.
  static std::shared_ptr<const UniqueFd> FdOf(const File& f) {
    return f.fd ? f.fd : f.borrowed.lock();
  }
  // The O_DIRECT twin of the file of `id`, or null when its device refuses O_DIRECT.
  std::shared_ptr<const UniqueFd> DirectFd(const BlockId& id, const Use& use) EXCLUDES(mu_);
  bool NoDirectLocked(uint64_t dev) const REQUIRES(mu_);
  void NoDirectIo(uint64_t dev) EXCLUDES(mu_);

  BackingDir* const dir_;
  const BackingSourceOptions opts_;

  mutable Mutex mu_;
  std::map<BlockId, File, BlockIdLess> files_ GUARDED_BY(mu_);
  std::list<BlockId> lru_ GUARDED_BY(mu_);  // front = most recently used
  std::vector<uint64_t> no_direct_devs_ GUARDED_BY(mu_);
  BackingSourceStats stats_ GUARDED_BY(mu_);
  size_t unlink_next_ GUARDED_BY(mu_) = 0;  // where CloseUnlinkedLocked() goes on
};

}  // namespace ckptfs::store
