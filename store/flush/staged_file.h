// StagedFile: the contents of one file being written through the mount.
//
// Bytes land in staging chunks (gpu::StagingPool) and return at once; a full chunk is
// sealed and handed to the flush pipeline, which writes it into the file's backing temp
// file. Reads combine the temp file with every chunk not yet flushed, so data is
// visible as soon as write() returns (G3).
//
// Invariant: the staged chunks of a file never overlap. A write into the active chunk's
// range modifies it in place; a write overlapping a sealed (in-flight) chunk first waits
// for that file's flushes. So flushes of one file may run in parallel, in any order.
//
// Thread-safe. Lock order: write_mu_ before mu_; never hold mu_ while blocking on the
// pool or the pipeline.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "common/mutex.h"
#include "common/status.h"
#include "gpu/staging_pool.h"
#include "store/flush/flush_pipeline.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {

struct StagedChunk {
  gpu::ChunkBuffer buffer;
  uint64_t file_offset = 0;
  size_t length = 0;  // bytes of `buffer` that hold data
};

// Where a write's bytes come from. The FUSE server hands the payload either as a buffer
// or, when libfuse spliced the request off /dev/fuse, as a pipe: CopyTo then reads the
// pipe straight into the staging chunk, one copy per byte instead of two (read into
// libfuse's buffer, then memcpy). Consumed front to back.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual size_t size() const = 0;
  // Copies the next `n` bytes (n <= what is left) into `out`.
  virtual Status CopyTo(char* out, size_t n) = 0;
};

class MemorySource final : public ByteSource {
 public:
  MemorySource(const char* data, size_t len) : data_(data), len_(len) {}
  size_t size() const override { return len_; }
  Status CopyTo(char* out, size_t n) override;

 private:
  const char* data_;
  size_t len_;
};

struct StagingContext {
  gpu::StagingPool* pool;         // must outlive
  FlushPipeline* pipeline; // must outlive
  BackingDir* backing;     // must outlive
};

class StagedFile : public std::enable_shared_from_this<StagedFile> {
 public:
  StagedFile(const StagingContext& ctx, std::shared_ptr<FlushTarget> target,
             uint64_t size);
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;

  // Copies all of `src` into staging at `offset`. Blocks while the pool is full (G6).
  // Returns the file's sticky error, if any; kAborted (frozen by a publish) comes before
  // any byte of `src` is consumed.
  Status Write(ByteSource& src, uint64_t offset);
  Status Write(const char* data, size_t len, uint64_t offset) {
    MemorySource src(data, len);
    return Write(src, offset);
  }
  // Reads up to `len` bytes at `offset`; returns how many (short at end of file).
  Result<size_t> Read(char* out, size_t len, uint64_t offset);
  // Changes the size: waits for in-flight flushes, then truncates the temp file.
  Status Truncate(uint64_t size);
  // Seals the active chunk so that every byte written so far is on its way to the
  // backing temp file, and freezes the file: later writes and truncates fail with
  // kAborted, so the caller continues in a new copy. Waits for a write or truncate in
  // progress (a writer may wait for staging space): never call it under a lock that such
  // a writer may need. Returns the flush target to publish.
  std::shared_ptr<FlushTarget> SealAll();
  // SealAll if no write or truncate is in progress (never blocks); false if one is.
  bool TrySealAll();
  // Lets writes in again after SealAll: the frozen bytes will not be published after all
  // (the file was unlinked while its publish waited to freeze it).
  void Thaw();
  // Callers of SealAll waiting for a write in progress (for tests).
  int freezes_waiting() const { return freezes_waiting_.load(); }
  // Seals the active chunk if there is one (staging pressure); never blocks on I/O.
  void SealIfIdle();

  uint64_t size() const;
  uint64_t staged_bytes() const;  // bytes in chunks not yet flushed
  Status error() const { return target_->Error(); }
  const std::shared_ptr<FlushTarget>& target() const { return target_; }

 private:
  void SealLocked() REQUIRES(mu_);
  bool OverlapsSealedLocked(uint64_t offset, size_t len) const REQUIRES(mu_);

  const StagingContext ctx_;
  const std::shared_ptr<FlushTarget> target_;
  Mutex write_mu_ ACQUIRED_BEFORE(mu_);  // serializes writers, held while waiting for staging
  std::atomic<int> freezes_waiting_{0};
  mutable Mutex mu_;
  // Set only with write_mu_ held too (SealAll), so it never becomes true under a write or
  // truncate in progress.
  bool frozen_ GUARDED_BY(mu_) = false;
  uint64_t size_ GUARDED_BY(mu_);
  std::shared_ptr<StagedChunk> active_ GUARDED_BY(mu_);
  std::map<uint64_t, std::shared_ptr<StagedChunk>> sealed_ GUARDED_BY(mu_);
};

}  // namespace ckptfs::store
