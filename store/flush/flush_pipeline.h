// FlushPipeline: writes sealed staging chunks to their backing temp files on N threads.
//
// A FlushTarget is one backing file being written (its temp file). It is shared by
// the open file in fs/ and by the chunks in flight, hence shared_ptr.
//
// Errors. The first failed write of a target is sticky for the application: Error()
// returns it from then on, so the next write/fsync/close reports it (G7). What happens
// to the bytes depends on the error:
//   - transient (IsTransient: ENOSPC, EDQUOT, EIO, EMFILE, timeouts): the chunk is kept in
//     staging and retried with backoff (RetryNow() retries at once), so nothing is lost
//     when the condition clears. Sync() meanwhile returns the error without waiting.
//   - permanent (anything else), or Cancel(): the target's bytes are lost; later chunks
//     are dropped and Sync() returns the failure for good.
//
// Checksums. With FlushOptions::block_crcs, each chunk written is also fed to its target's
// BlockCrcMap while the bytes are still in staging (no extra read), so that the key index
// can later derive item checksums. The owner of a target must report every other change
// to the file's bytes (NoteTruncated); bytes that reach the file any other way (a copy of
// the old contents) are simply never recorded, hence unknown.
//
// Direct I/O. With FlushOptions::direct_io, a chunk whose file offset, length and staging
// address are all 4 KiB aligned is written with O_DIRECT, through a second descriptor of
// the same inode: straight from staging to the device, with no copy into the page cache
// (that copy was most of the daemon's CPU while saving). Other chunks (a file's tail, small
// writes) are written through the page cache as before; the kernel keeps the two coherent
// (a direct write flushes and drops cached pages it overlaps). Sync() fsyncs the inode,
// which covers both. Where the file system refuses O_DIRECT, the target falls back to the
// page cache for good.
//
// Thread-safe. The destructor drains the queue and joins every thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/chunk_lender.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "store/flush/block_crc_map.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {

class FlushTarget {
 public:
  // `retainable`: the file may be kept in the retained tier (its name at open is a
  // checkpoint file's); the tier passes over the chunks of any other.
  FlushTarget(uint64_t id, UniqueFd fd, bool retainable = true)
      : id_(id), retainable_(retainable), fd_(std::move(fd)) {}
  FlushTarget(const FlushTarget&) = delete;
  FlushTarget& operator=(const FlushTarget&) = delete;

  uint64_t id() const { return id_; }
  bool retainable() const { return retainable_; }
  int fd() const { return fd_.get(); }
  // The O_DIRECT descriptor of the same file, opened on first use; -1 where the file
  // system refuses it (then always -1).
  int DirectFd() EXCLUDES(direct_mu_);
  void DisableDirect();  // a direct write failed with EINVAL: use fd() from now on
  // The first error seen for this file, or ok (sticky, for the application).
  Status Error() const;
  void SetError(const Status& status);
  // Marks the target's bytes lost (permanently failed) with `status`; parked chunks are
  // dropped by the pipeline. Used when a publication is aborted.
  void Cancel(const Status& status);
  // Blocks until no chunk of this file is queued or being written. Chunks parked for a
  // retry do not count, but then Error() is set: a caller that needs no bytes pending at
  // all (truncate, an overlapping write) checks Error() after this and gives up.
  void WaitIdle();
  // WaitIdle(), then: ok if every byte handed over is in the file (not necessarily
  // durable); the error while a chunk waits for a retry; the failure if bytes were lost.
  Status Settled();
  // Waits for the chunks being written, then fsyncs: the file's bytes are durable when
  // this returns ok. Returns at once with the error while a chunk waits for a retry, and
  // with the permanent failure once bytes were lost. Calls are serialized: the kernel
  // reports a writeback error to one fsync of a file description only, so of two
  // concurrent fsyncs (an early sync and the publisher's) one could pass over lost
  // bytes; one at a time, the second sees the first's failure (lost). `unless_synced`:
  // returns ok at once if a Sync() passed before (an early sync the publisher overtook).
  Status Sync(BackingDir* dir, bool unless_synced = false) EXCLUDES(sync_mu_);
  uint64_t inflight() const;
  uint64_t parked() const;
  bool lost() const;  // bytes were dropped: this file can never be published
  Status Lost() const;  // why the bytes were dropped, or ok
  uint64_t bytes_flushed() const { return bytes_flushed_.load(std::memory_order_relaxed); }
  bool synced() const { return synced_.load(); }

  // The file is about to be truncated to `size` (no flush in flight): recorded block CRCs
  // past it are dropped, or poisoned where the cut falls inside recorded bytes.
  void NoteTruncated(uint64_t size);
  // Hands over the block CRCs recorded so far, after the last flush (for example at
  // publication); nullptr when none were recorded. Later flushes of this target record none.
  std::shared_ptr<BlockCrcMap> TakeBlockCrcs();

 private:
  friend class FlushPipeline;
  // The map to record into, created on first use; nullptr once taken.
  std::shared_ptr<BlockCrcMap> CrcMap(const BlockCrcOptions& options);

  const uint64_t id_;
  const bool retainable_;
  UniqueFd fd_;
  Mutex crc_mu_;
  std::shared_ptr<BlockCrcMap> crcs_ GUARDED_BY(crc_mu_);
  bool crcs_taken_ GUARDED_BY(crc_mu_) = false;
  mutable Mutex mu_;
  std::condition_variable idle_cv_;
  uint64_t inflight_ GUARDED_BY(mu_) = 0;  // queued, being written, or parked
  uint64_t parked_ GUARDED_BY(mu_) = 0;  // of those, waiting for a retry
  Status error_ GUARDED_BY(mu_);  // first error, reported to the application
  Status lost_ GUARDED_BY(mu_);  // bytes were dropped; publication impossible
  std::atomic<uint64_t> bytes_flushed_{0};
  std::atomic<bool> synced_{false};
  Mutex sync_mu_ ACQUIRED_BEFORE(mu_);  // held through Sync()
  Mutex direct_mu_;
  UniqueFd direct_fd_ GUARDED_BY(direct_mu_);
  bool direct_tried_ GUARDED_BY(direct_mu_) = false;
  std::atomic<bool> direct_off_{false};
};

// One sealed run of bytes for one file. `keepalive` owns the memory behind `data`
// (a staging chunk) and is released once the write finished. `on_done` runs on the
// flush thread after the write, with its result, before `keepalive` is released.
// The bytes are never changed once sealed, so whoever holds `keepalive` may read them.
struct SealedChunk {
  std::shared_ptr<FlushTarget> target;
  uint64_t offset = 0;
  const uint8_t* data = nullptr;
  size_t length = 0;
  std::shared_ptr<void> keepalive;
  std::function<void(const Status&)> on_done;
  // Issue 42: set when `data` is the start of a chunk of `lender` (the staging pool) and
  // `capacity` its size: a listener may keep the memory (lender->Lend(data), then hold
  // `keepalive`) instead of copying it. Null: copy what is to be kept.
  ChunkLender* lender = nullptr;
  size_t capacity = 0;
};

// True for failures that may clear by themselves or by an operator (a full or over-quota
// file system, an I/O error of a network file system, fd exhaustion, a timeout): the
// bytes are kept and the write or publication is retried.
bool IsTransient(const Status& status);

// Told of each chunk a flush thread wrote (issue 23: the retained tier keeps it,
// store/cache/retained_tier.h).
class FlushWriteListener {
 public:
  // For every chunk a flush thread wrote successfully, on that thread, after the write and
  // its block CRCs, before the chunk is finished and released (`crcs` is the target's map).
  // A failed write is not passed; its retry is, once it succeeds. Must not block: the
  // tier keeps the chunk itself (SealedChunk::lender), copies a few bytes, or skips it.
  virtual void OnWritten(const std::shared_ptr<BlockCrcMap>& crcs, const SealedChunk& chunk) = 0;

 protected:
  ~FlushWriteListener() = default;
};

struct FlushOptions {
  int threads = 4;
  // Backoff of retries after a transient failure: first delay, doubled up to the max.
  std::chrono::milliseconds retry_min{100};
  std::chrono::milliseconds retry_max{5000};
  bool block_crcs = true;  // record block CRCs of every chunk written (see above)
  bool direct_io = true;   // aligned chunks bypass the page cache (see above)
  BlockCrcOptions crc_options;
  // Issue 23 (the retained tier, store/cache/retained_tier.h): told of every chunk a flush
  // thread wrote (FlushWriteListener). Optional; must outlive the pipeline.
  FlushWriteListener* on_written = nullptr;
};

class FlushPipeline {
 public:
  static Result<std::unique_ptr<FlushPipeline>> Create(BackingDir* dir,  // must outlive
                                                       const FlushOptions& options);
  ~FlushPipeline();  // Drains and joins; never detaches.
  FlushPipeline(const FlushPipeline&) = delete;
  FlushPipeline& operator=(const FlushPipeline&) = delete;

  // Takes ownership. Never blocks: the staging pool bounds what can be queued.
  void Submit(SealedChunk chunk);
  // Blocks until every submitted chunk has been written, dropped, or parked for a retry.
  void Drain();
  // Retries every parked chunk now (an operator's `resume`).
  void RetryNow();
  // RetryNow, then waits (at most `timeout`) until each of those retries has ended: written
  // or parked again. So a publication retried right after sees where the bytes went, not
  // the error of a chunk whose retry had not started yet.
  void RetryNowAndWait(std::chrono::milliseconds timeout);
  // What became of a round of retries (RetryParkedNow).
  struct RetryRound {
    uint64_t retried = 0;   // chunks parked when the round began, all made due at once
    uint64_t released = 0;  // retries that ended with the chunk's memory back in the pool
                            // (written, or dropped for good): the store took bytes again
    uint64_t refused = 0;   // retries the store refused again: parked for a later one
  };
  // For a writer that finds staging full while chunks wait out their backoff: retries
  // every parked chunk now and waits (at most `timeout`) until one retry released its
  // memory or as many retries as there were parked chunks were refused (any retry that
  // ends meanwhile counts, one on its own backoff too). Flush threads end them; the
  // caller holds nothing they take. With `released` 0 and `refused` > 0, the store
  // still refuses.
  RetryRound RetryParkedNow(std::chrono::milliseconds timeout);
  // Drops every parked chunk (their targets become lost): the daemon is stopping.
  // Returns how many were dropped.
  uint64_t DropParked(const Status& why);

  uint64_t bytes_flushed() const { return bytes_flushed_.load(std::memory_order_relaxed); }
  uint64_t queued() const;
  uint64_t errors() const { return errors_.load(std::memory_order_relaxed); }
  uint64_t retries() const { return retries_.load(std::memory_order_relaxed); }
  // Rounds of RetryParkedNow that found parked chunks, and of those, the rounds in which
  // the store refused every retry that ended (the writer then failed with ENOSPC).
  uint64_t retry_rounds() const { return retry_rounds_.load(std::memory_order_relaxed); }
  uint64_t retry_rounds_refused() const {
    return retry_rounds_refused_.load(std::memory_order_relaxed);
  }
  uint64_t parked() const;
  // Bytes hashed into block CRCs, and the flush threads' time spent hashing them.
  uint64_t crc_bytes() const { return crc_bytes_.load(std::memory_order_relaxed); }
  uint64_t crc_ns() const { return crc_ns_.load(std::memory_order_relaxed); }
  uint64_t direct_bytes() const { return direct_bytes_.load(std::memory_order_relaxed); }

 private:
  FlushPipeline(BackingDir* dir, const FlushOptions& options);
  void Run();
  // Writes one chunk; returns false if it was parked for a retry (still owned).
  bool WriteChunk(SealedChunk& chunk, int attempts);
  // Releases a chunk that will not be retried.
  void Finish(SealedChunk& chunk, const Status& st, bool was_parked);

  struct Parked {
    SealedChunk chunk;
    int attempts = 0;
    std::chrono::steady_clock::time_point retry_at;
  };

  BackingDir* const dir_;
  const FlushOptions options_;
  mutable Mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable drained_cv_;
  std::deque<SealedChunk> queue_ GUARDED_BY(mu_);
  std::deque<Parked> parked_ GUARDED_BY(mu_);  // waiting for a retry
  uint64_t active_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> bytes_flushed_{0};
  std::atomic<uint64_t> errors_{0};
  std::atomic<uint64_t> retries_{0};
  std::atomic<uint64_t> retry_rounds_{0};
  std::atomic<uint64_t> retry_rounds_refused_{0};
  // Retries that ended (RetryParkedNow); changed under mu_, with drained_cv_ notified.
  uint64_t retries_released_ GUARDED_BY(mu_) = 0;
  uint64_t retries_refused_ GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> crc_bytes_{0};
  std::atomic<uint64_t> crc_ns_{0};
  std::atomic<uint64_t> direct_bytes_{0};
};

}  // namespace ckptfs::store
