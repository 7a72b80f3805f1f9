#include "store/flush/flush_pipeline.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <string>

#include <chrono>
#include <functional>
#include <memory>
#include <thread>

#include "common/backoff.h"
#include "common/thread_name.h"

namespace ckptfs::store {

Status FlushTarget::Error() const {
  MutexLock lock(&mu_);
  return error_;
}

void FlushTarget::SetError(const Status& status) {
  MutexLock lock(&mu_);
  if (error_.ok()) error_ = status;
}

void FlushTarget::WaitIdle() {
  MutexLock lock(&mu_);
  idle_cv_.wait(lock.native(), [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    return inflight_ == parked_;
  });
}

uint64_t FlushTarget::inflight() const {
  MutexLock lock(&mu_);
  return inflight_;
}

Status FlushTarget::Settled() {
  MutexLock lock(&mu_);
  idle_cv_.wait(lock.native(), [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    return inflight_ == parked_;
  });
  if (!lost_.ok()) return lost_;
  return parked_ > 0 ? error_ : Status::Ok();
}

bool FlushTarget::lost() const {
  MutexLock lock(&mu_);
  return !lost_.ok();
}

Status FlushTarget::Lost() const {
  MutexLock lock(&mu_);
  return lost_;
}

uint64_t FlushTarget::parked() const {
  MutexLock lock(&mu_);
  return parked_;
}

void FlushTarget::Cancel(const Status& status) {
  MutexLock lock(&mu_);
  if (error_.ok()) error_ = status;
  if (lost_.ok()) lost_ = status;
}

int FlushTarget::DirectFd() {
  if (direct_off_.load(std::memory_order_relaxed)) return -1;
  MutexLock lock(&direct_mu_);
  if (!direct_tried_) {
    direct_tried_ = true;
    // Reopens the very inode fd_ refers to: no path is looked up, so confinement holds.
    const std::string self = "/proc/self/fd/" + std::to_string(fd_.get());
    direct_fd_ = UniqueFd(::open(self.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC));
    if (!direct_fd_.valid()) direct_off_.store(true, std::memory_order_relaxed);
  }
  return direct_fd_.valid() && !direct_off_.load(std::memory_order_relaxed) ? direct_fd_.get()
                                                                            : -1;
}

void FlushTarget::DisableDirect() { direct_off_.store(true, std::memory_order_relaxed); }

Status FlushTarget::Sync(BackingDir* dir, bool unless_synced) {
  MutexLock sync_lock(&sync_mu_);
  if (unless_synced && synced_.load()) return Status::Ok();
  {
    MutexLock lock(&mu_);
    idle_cv_.wait(lock.native(), [&] {
      mu_.AssertHeld();  // the predicate runs under the lock
      return inflight_ == parked_;
    });
    if (!lost_.ok()) return lost_;
    if (parked_ > 0) return error_;  // transient: the journal retries the publication later
  }
  Status st = dir->Fsync(fd());
  if (!st.ok()) {
    // Permanent: after a failed fsync the kernel may have dropped the dirty pages, and a
    // second fsync would succeed over lost bytes.
    MutexLock lock(&mu_);
    if (error_.ok()) error_ = st;
    if (lost_.ok()) {
      lost_ = Status(Code::kAborted, "bytes may be lost after a failed fsync (" + st.ToString() + ")");
    }
    return lost_;
  }
  synced_.store(true);
  return Status::Ok();
}

bool IsTransient(const Status& status) {
  switch (status.code()) {
    case Code::kNoSpace:
    case Code::kIo:
    case Code::kTooManyOpenFiles:
    case Code::kTimeout:
    case Code::kBusy:
      return true;
    default:
      return false;
  }
}

void FlushTarget::NoteTruncated(uint64_t size) {
  MutexLock lock(&crc_mu_);
  if (crcs_) crcs_->Truncate(size);
}

std::shared_ptr<BlockCrcMap> FlushTarget::TakeBlockCrcs() {
  MutexLock lock(&crc_mu_);
  crcs_taken_ = true;
  return std::move(crcs_);
}

std::shared_ptr<BlockCrcMap> FlushTarget::CrcMap(const BlockCrcOptions& options) {
  MutexLock lock(&crc_mu_);
  if (!crcs_ && !crcs_taken_) crcs_ = std::make_shared<BlockCrcMap>(options);
  return crcs_;
}

FlushPipeline::FlushPipeline(BackingDir* dir, const FlushOptions& options)
    : dir_(dir), options_(options) {
  for (int i = 0; i < options.threads; ++i) {
    threads_.emplace_back([this] {
      NameThisThread("ckptfs-flush");
      Run();
    });
  }
}

Result<std::unique_ptr<FlushPipeline>> FlushPipeline::Create(BackingDir* dir,
                                                             const FlushOptions& options) {
  if (options.threads < 1 || options.threads > 256) {
    return Invalid("flush threads must be between 1 and 256");
  }
  const uint32_t bs = options.crc_options.block_bytes;
  if (bs < 512 || (bs & (bs - 1)) != 0) {
    return Invalid("checksum block size must be a power of two of at least 512 bytes");
  }
  return std::unique_ptr<FlushPipeline>(new FlushPipeline(dir, options));
}

FlushPipeline::~FlushPipeline() {
  DropParked(Status(Code::kAborted, "flush pipeline stopped"));
  Drain();
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void FlushPipeline::Submit(SealedChunk chunk) {
  {
    MutexLock lock(&chunk.target->mu_);
    ++chunk.target->inflight_;
  }
  {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(chunk));
  }
  work_cv_.notify_one();
}

void FlushPipeline::Drain() {
  MutexLock lock(&mu_);
  drained_cv_.wait(lock.native(), [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    return queue_.empty() && active_ == 0;
  });
}

uint64_t FlushPipeline::queued() const {
  MutexLock lock(&mu_);
  return queue_.size() + active_;
}

uint64_t FlushPipeline::parked() const {
  MutexLock lock(&mu_);
  return parked_.size();
}

void FlushPipeline::RetryNow() {
  {
    MutexLock lock(&mu_);
    for (Parked& p : parked_) p.retry_at = std::chrono::steady_clock::now();
  }
  work_cv_.notify_all();
}

void FlushPipeline::RetryNowAndWait(std::chrono::milliseconds timeout) {
  const uint64_t start = retries_.load();
  size_t want = 0;
  {
    MutexLock lock(&mu_);
    want = parked_.size();
    for (Parked& p : parked_) p.retry_at = std::chrono::steady_clock::now();
  }
  work_cv_.notify_all();
  if (want == 0) return;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  MutexLock lock(&mu_);
  // Started (retries_) and none running (active_): each has been written or parked again.
  while (retries_.load() < start + want || active_ > 0) {
    if (std::chrono::steady_clock::now() >= deadline) return;
    drained_cv_.wait_for(lock.native(), std::chrono::milliseconds(20));
  }
}

FlushPipeline::RetryRound FlushPipeline::RetryParkedNow(std::chrono::milliseconds timeout) {
  RetryRound round;
  MutexLock lock(&mu_);
  round.retried = parked_.size();
  if (round.retried == 0) return round;
  retry_rounds_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t released0 = retries_released_;
  const uint64_t refused0 = retries_refused_;
  const auto now = std::chrono::steady_clock::now();
  for (Parked& p : parked_) p.retry_at = now;
  work_cv_.notify_all();
  const auto deadline = now + timeout;
  bool timed_out = false;
  while (true) {
    round.released = retries_released_ - released0;
    round.refused = retries_refused_ - refused0;
    if (round.released > 0 || round.refused >= round.retried || timed_out) break;
    timed_out = drained_cv_.wait_until(lock.native(), deadline) == std::cv_status::timeout;
  }
  if (round.released == 0 && round.refused > 0) {
    retry_rounds_refused_.fetch_add(1, std::memory_order_relaxed);
  }
  return round;
}

uint64_t FlushPipeline::DropParked(const Status& why) {
  std::deque<Parked> dropped;
  {
    MutexLock lock(&mu_);
    dropped.swap(parked_);
  }
  for (Parked& p : dropped) {
    p.chunk.target->Cancel(why);
    Finish(p.chunk, why, /*was_parked=*/true);
  }
  if (!dropped.empty()) {
    spdlog::warn("flush: dropped {} chunks that waited for a retry: {}", dropped.size(),
                 why.ToString());
  }
  return dropped.size();
}

void FlushPipeline::Finish(SealedChunk& chunk, const Status& st, bool was_parked) {
  FlushTarget& target = *chunk.target;
  if (chunk.on_done) chunk.on_done(st);
  chunk.keepalive.reset();  // returns the staging memory
  {
    MutexLock lock(&target.mu_);
    if (was_parked) --target.parked_;
    --target.inflight_;
    if (target.inflight_ == target.parked_) target.idle_cv_.notify_all();
  }
  chunk.target.reset();
}

bool FlushPipeline::WriteChunk(SealedChunk& chunk, int attempts) {
  FlushTarget& target = *chunk.target;
  Status st;
  {
    MutexLock lock(&target.mu_);
    st = target.lost_;
  }
  if (st.ok()) {
    constexpr uint64_t kAlign = 4096;
    int direct = -1;
    if (options_.direct_io && chunk.offset % kAlign == 0 && chunk.length % kAlign == 0 &&
        reinterpret_cast<uintptr_t>(chunk.data) % kAlign == 0) {
      direct = target.DirectFd();
    }
    if (direct >= 0) {
      st = dir_->PWrite(direct, chunk.data, chunk.length, static_cast<off_t>(chunk.offset));
      if (st.ok()) {
        direct_bytes_.fetch_add(chunk.length, std::memory_order_relaxed);
      } else if (st.code() == Code::kInvalid) {
        // The file system takes O_DIRECT opens but not these writes: the page cache then.
        spdlog::debug("flush of file {}: direct write refused ({}); buffered from now on",
                      target.id(), st.ToString());
        target.DisableDirect();
        direct = -1;
      }
    }
    if (direct < 0) {
      st = dir_->PWrite(target.fd(), chunk.data, chunk.length, static_cast<off_t>(chunk.offset));
    }
    if (st.ok() && options_.block_crcs) {
      // The bytes are still in staging: hashing them here costs no read. Before the
      // target's inflight count drops, so a later overlapping chunk records after this.
      if (std::shared_ptr<BlockCrcMap> crcs = target.CrcMap(options_.crc_options)) {
        auto t0 = std::chrono::steady_clock::now();
        crcs->Record(chunk.offset, chunk.data, chunk.length);
        crc_ns_.fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                    std::chrono::steady_clock::now() - t0)
                                                    .count()),
                          std::memory_order_relaxed);
        crc_bytes_.fetch_add(chunk.length, std::memory_order_relaxed);
        // Issue 23/42: the retained tier keeps the chunk (or skips it); never a wait.
        if (options_.on_written != nullptr) options_.on_written->OnWritten(crcs, chunk);
      }
    }
    if (st.ok()) {
      target.bytes_flushed_.fetch_add(chunk.length, std::memory_order_relaxed);
      bytes_flushed_.fetch_add(chunk.length, std::memory_order_relaxed);
    } else {
      errors_.fetch_add(1, std::memory_order_relaxed);
      target.SetError(st);
      if (IsTransient(st)) {
        // Keep the bytes in staging and try again later (G7: nothing is lost when the
        // condition clears). Chunks of one target in flight are disjoint, so a retry
        // can never land over newer bytes.
        const auto delay =
            Backoff{options_.retry_min, options_.retry_max}.Delay(static_cast<uint64_t>(attempts));
        if (attempts == 0) {
          spdlog::error("flush of file {} at offset {} ({} bytes) failed: {}; kept for a retry",
                        target.id(), chunk.offset, chunk.length, st.ToString());
        }
        MutexLock lock(&mu_);
        {
          MutexLock tlock(&target.mu_);
          ++target.parked_;
          if (target.inflight_ == target.parked_) target.idle_cv_.notify_all();
        }
        parked_.push_back({std::move(chunk), attempts + 1,
                           std::chrono::steady_clock::now() + delay});
        return false;
      }
      spdlog::error("flush of file {} at offset {} ({} bytes) failed: {}", target.id(),
                    chunk.offset, chunk.length, st.ToString());
      MutexLock lock(&target.mu_);
      if (target.lost_.ok()) target.lost_ = st;
    }
  }
  Finish(chunk, st, /*was_parked=*/false);
  return true;
}

void FlushPipeline::Run() {
  while (true) {
    SealedChunk chunk;
    int attempts = 0;
    bool retry = false;
    {
      MutexLock lock(&mu_);
      while (true) {
        auto now = std::chrono::steady_clock::now();
        auto due = parked_.end();
        auto next = std::chrono::steady_clock::time_point::max();
        for (auto it = parked_.begin(); it != parked_.end(); ++it) {
          if (it->retry_at <= now) {
            due = it;
            break;
          }
          next = std::min(next, it->retry_at);
        }
        if (due != parked_.end()) {
          chunk = std::move(due->chunk);
          attempts = due->attempts;
          parked_.erase(due);
          retry = true;
          break;
        }
        if (!queue_.empty()) {
          chunk = std::move(queue_.front());
          queue_.pop_front();
          break;
        }
        if (stop_) return;  // nothing left; parked chunks were dropped before stop_
        if (next == std::chrono::steady_clock::time_point::max()) {
          work_cv_.wait(lock.native());
        } else {
          work_cv_.wait_until(lock.native(), next);
        }
      }
      ++active_;
    }
    if (retry) {
      retries_.fetch_add(1, std::memory_order_relaxed);
      MutexLock tlock(&chunk.target->mu_);
      --chunk.target->parked_;
    }
    const bool ended = WriteChunk(chunk, attempts);
    {
      MutexLock lock(&mu_);
      --active_;
      if (retry) ++(ended ? retries_released_ : retries_refused_);
      if (retry || (queue_.empty() && active_ == 0)) drained_cv_.notify_all();
    }
  }
}

}  // namespace ckptfs::store
