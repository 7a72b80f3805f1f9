#include "store/flush_pipeline.h"

#include <spdlog/spdlog.h>

#include <chrono>

namespace ckptfs::store {

Status FlushTarget::Error() const {
  std::lock_guard lock(mu_);
  return error_;
}

void FlushTarget::SetError(const Status& status) {
  std::lock_guard lock(mu_);
  if (error_.ok()) error_ = status;
}

void FlushTarget::WaitIdle() {
  std::unique_lock lock(mu_);
  idle_cv_.wait(lock, [&] { return inflight_ == 0; });
}

uint64_t FlushTarget::inflight() const {
  std::lock_guard lock(mu_);
  return inflight_;
}

Status FlushTarget::Sync(BackingDir* dir) {
  WaitIdle();
  CKPT_RETURN_IF_ERROR(Error());
  Status st = dir->Fsync(fd());
  if (!st.ok()) {
    SetError(st);
    return st;
  }
  synced_.store(true);
  return Status::Ok();
}

void FlushTarget::NoteTruncated(uint64_t size) {
  std::lock_guard lock(crc_mu_);
  if (crcs_) crcs_->Truncate(size);
}

std::shared_ptr<BlockCrcMap> FlushTarget::TakeBlockCrcs() {
  std::lock_guard lock(crc_mu_);
  crcs_taken_ = true;
  return std::move(crcs_);
}

std::shared_ptr<BlockCrcMap> FlushTarget::CrcMap(const BlockCrcOptions& options) {
  std::lock_guard lock(crc_mu_);
  if (!crcs_ && !crcs_taken_) crcs_ = std::make_shared<BlockCrcMap>(options);
  return crcs_;
}

FlushPipeline::FlushPipeline(BackingDir* dir, const FlushOptions& options)
    : dir_(dir), options_(options) {
  for (int i = 0; i < options.threads; ++i) threads_.emplace_back([this] { Run(); });
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
  Drain();
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void FlushPipeline::Submit(SealedChunk chunk) {
  {
    std::lock_guard lock(chunk.target->mu_);
    ++chunk.target->inflight_;
  }
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(chunk));
  }
  work_cv_.notify_one();
}

void FlushPipeline::Drain() {
  std::unique_lock lock(mu_);
  drained_cv_.wait(lock, [&] { return queue_.empty() && active_ == 0; });
}

uint64_t FlushPipeline::queued() const {
  std::lock_guard lock(mu_);
  return queue_.size() + active_;
}

void FlushPipeline::Run() {
  while (true) {
    SealedChunk chunk;
    {
      std::unique_lock lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      chunk = std::move(queue_.front());
      queue_.pop_front();
      ++active_;
    }
    FlushTarget& target = *chunk.target;
    Status st = target.Error();
    if (st.ok()) {
      st = dir_->PWrite(target.fd(), chunk.data, chunk.length, static_cast<off_t>(chunk.offset));
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
        }
      }
      if (st.ok()) {
        target.bytes_flushed_.fetch_add(chunk.length, std::memory_order_relaxed);
        bytes_flushed_.fetch_add(chunk.length, std::memory_order_relaxed);
      } else {
        errors_.fetch_add(1, std::memory_order_relaxed);
        spdlog::error("flush of file {} at offset {} ({} bytes) failed: {}", target.id(),
                      chunk.offset, chunk.length, st.ToString());
        target.SetError(st);
      }
    }
    if (chunk.on_done) chunk.on_done(st);
    chunk.keepalive.reset();  // returns the staging memory
    {
      std::lock_guard lock(target.mu_);
      if (--target.inflight_ == 0) target.idle_cv_.notify_all();
    }
    chunk.target.reset();
    {
      std::lock_guard lock(mu_);
      --active_;
      if (queue_.empty() && active_ == 0) drained_cv_.notify_all();
    }
  }
}

}  // namespace ckptfs::store
