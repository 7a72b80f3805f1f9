#include "store/flush/staged_file.h"

#include <chrono>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace ckptfs::store {
namespace {

// How long a write that found staging full waits for the retries of refused chunks it
// started (FlushPipeline::RetryParkedNow) before it looks at the pool again.
constexpr std::chrono::seconds kRefusedRetryWait{5};

}  // namespace

StagedFile::StagedFile(const StagingContext& ctx, std::shared_ptr<FlushTarget> target,
                       uint64_t size)
    : ctx_(ctx), target_(std::move(target)), size_(size) {}

uint64_t StagedFile::size() const {
  MutexLock lock(&mu_);
  return size_;
}

uint64_t StagedFile::staged_bytes() const {
  MutexLock lock(&mu_);
  uint64_t n = active_ ? active_->length : 0;
  for (const auto& [_, c] : sealed_) n += c->length;
  return n;
}

bool StagedFile::OverlapsSealedLocked(uint64_t offset, size_t len) const {
  // Chunks do not overlap each other, so only the one starting before `offset + len`
  // with the highest start, and its predecessors that reach `offset`, can intersect.
  auto it = sealed_.lower_bound(offset + len);
  while (it != sealed_.begin()) {
    --it;
    const StagedChunk& c = *it->second;
    if (c.file_offset + c.length > offset) return true;
    // Sorted by start and disjoint: an earlier chunk ends before this one starts.
    return false;
  }
  return false;
}

void StagedFile::SealLocked() {
  if (!active_) return;
  std::shared_ptr<StagedChunk> chunk = std::move(active_);
  active_.reset();
  if (chunk->length == 0) return;
  sealed_[chunk->file_offset] = chunk;
  std::weak_ptr<StagedFile> weak = weak_from_this();
  store::SealedChunk sealed;
  sealed.target = target_;
  sealed.offset = chunk->file_offset;
  sealed.data = chunk->buffer.data();
  sealed.length = chunk->length;
  sealed.keepalive = chunk;
  sealed.lender = ctx_.pool;  // issue 42: the retained tier may keep the chunk itself
  sealed.capacity = chunk->buffer.capacity();
  const uint64_t key = chunk->file_offset;
  StagedChunk* raw = chunk.get();
  sealed.on_done = [weak, key, raw](const Status&) {
    // Success or failure, the chunk leaves the overlay: on success the temp file has
    // its bytes; on failure they are lost (a parked chunk stays until its retry).
    if (auto self = weak.lock()) {
      MutexLock lock(&self->mu_);
      auto it = self->sealed_.find(key);
      if (it != self->sealed_.end() && it->second.get() == raw) self->sealed_.erase(it);
    }
  };
  ctx_.pipeline->Submit(std::move(sealed));
}

Status MemorySource::CopyTo(char* out, size_t n) {
  std::memcpy(out, data_, n);
  data_ += n;
  len_ -= n;
  return Status::Ok();
}

Status StagedFile::Write(ByteSource& src, uint64_t offset) {
  size_t len = src.size();
  MutexLock write_lock(&write_mu_);
  {
    MutexLock lock(&mu_);
    if (frozen_) return Status(Code::kAborted, "file is frozen for publication");
  }
  CKPT_RETURN_IF_ERROR(target_->Error());
  const size_t cap = ctx_.pool->chunk_bytes();
  while (len > 0) {
    MutexLock lock(&mu_);
    if (active_ && offset >= active_->file_offset &&
        offset <= active_->file_offset + active_->length &&
        offset < active_->file_offset + cap) {
      size_t pos = offset - active_->file_offset;
      size_t n = std::min(len, cap - pos);
      if (pos + n > active_->length &&
          OverlapsSealedLocked(active_->file_offset + active_->length,
                               pos + n - active_->length)) {
        // Growing the active chunk over bytes still in flight would let the older
        // flush land last: seal it, and take the overlap path below.
        SealLocked();
        continue;
      }
      // A pipe source reads here under mu_: its bytes are already in the pipe.
      CKPT_RETURN_IF_ERROR(src.CopyTo(reinterpret_cast<char*>(active_->buffer.data()) + pos, n));
      active_->length = std::max(active_->length, pos + n);
      size_ = std::max<uint64_t>(size_, offset + n);
      len -= n;
      offset += n;
      if (active_->length == cap) SealLocked();
      continue;
    }
    SealLocked();
    if (OverlapsSealedLocked(offset, std::min(len, cap))) {
      // Rewriting bytes still in flight: let them land first, keeping chunks disjoint.
      lock.Unlock();
      target_->WaitIdle();
      CKPT_RETURN_IF_ERROR(target_->Error());
      continue;
    }
    lock.Unlock();
    // Waits while the pool is full; the pool's pressure callback seals idle chunks. Part
    // of the pool may be held by chunks the backing store refused, parked for a retry
    // (G7) whose backoff has grown to seconds: the store may have room again long
    // before. So they are retried now, by the flush threads; the write goes on waiting
    // while retries free memory, and fails as the store's would (ENOSPC) only when the
    // store refused them again and took none, instead of hanging. A chunk whose memory
    // cannot be pinned (the system is out of memory) fails it too.
    gpu::ChunkBuffer buffer;
    Status pin_error;
    while (!(buffer = ctx_.pool->TryAcquireFor(std::chrono::milliseconds(200), &pin_error))) {
      CKPT_RETURN_IF_ERROR(pin_error);
      if (ctx_.pipeline->parked() == 0) continue;  // chunks in flight come back (G6)
      const FlushPipeline::RetryRound round = ctx_.pipeline->RetryParkedNow(kRefusedRetryWait);
      if (round.released == 0 && round.refused > 0) {
        return Status(Code::kNoSpace,
                      "staging is full of bytes the backing store refused again on a retry "
                      "(kept for a later one)");
      }
    }
    lock.Lock();
    auto chunk = std::make_shared<StagedChunk>();
    chunk->buffer = std::move(buffer);
    chunk->file_offset = offset;
    chunk->length = 0;
    // No other writer can have created a chunk meanwhile (write_mu_), but a truncate
    // or a pressure seal may have run; either leaves no active chunk.
    active_ = std::move(chunk);
  }
  return Status::Ok();
}

Result<size_t> StagedFile::Read(char* out, size_t len, uint64_t offset) {
  std::vector<std::shared_ptr<StagedChunk>> overlay;
  std::vector<size_t> overlay_len;
  uint64_t size;
  {
    MutexLock lock(&mu_);
    size = size_;
    if (offset >= size) return size_t{0};
    len = static_cast<size_t>(std::min<uint64_t>(len, size - offset));
    auto it = sealed_.upper_bound(offset);
    if (it != sealed_.begin()) --it;
    for (; it != sealed_.end() && it->first < offset + len; ++it) {
      overlay.push_back(it->second);
      overlay_len.push_back(it->second->length);
    }
    if (active_) {
      overlay.push_back(active_);
      overlay_len.push_back(active_->length);
    }
  }
  // A chunk parked for a retry (a transient write-back error) is still in `sealed_`, so
  // every byte can be read; bytes the store lost for good, or any other error, fail it.
  CKPT_RETURN_IF_ERROR(target_->Lost());
  if (Status err = target_->Error(); !err.ok() && !IsTransient(err)) return err;
  // Bytes flushed before the snapshot are in the temp file; the rest are in `overlay`.
  CKPT_ASSIGN_OR_RETURN(size_t got, ctx_.backing->PRead(target_->fd(), out, len,
                                                        static_cast<off_t>(offset)));
  if (got < len) std::memset(out + got, 0, len - got);  // a hole not yet flushed
  for (size_t i = 0; i < overlay.size(); ++i) {
    const StagedChunk& c = *overlay[i];
    uint64_t start = std::max<uint64_t>(offset, c.file_offset);
    uint64_t end = std::min<uint64_t>(offset + len, c.file_offset + overlay_len[i]);
    if (start >= end) continue;
    std::memcpy(out + (start - offset), c.buffer.data() + (start - c.file_offset), end - start);
  }
  return len;
}

Status StagedFile::Truncate(uint64_t size) {
  MutexLock write_lock(&write_mu_);
  {
    MutexLock lock(&mu_);
    if (frozen_) return Status(Code::kAborted, "file is frozen for publication");
    SealLocked();
  }
  target_->WaitIdle();
  CKPT_RETURN_IF_ERROR(target_->Error());
  target_->NoteTruncated(size);  // before the cut: block checksums must never be stale
  if (Status st = ctx_.backing->Ftruncate(target_->fd(), static_cast<off_t>(size)); !st.ok()) {
    target_->SetError(st);
    return st;
  }
  MutexLock lock(&mu_);
  size_ = size;
  return Status::Ok();
}

std::shared_ptr<FlushTarget> StagedFile::SealAll() {
  freezes_waiting_.fetch_add(1);
  MutexLock write_lock(&write_mu_);
  freezes_waiting_.fetch_sub(1);
  MutexLock lock(&mu_);
  frozen_ = true;
  SealLocked();
  return target_;
}

bool StagedFile::TrySealAll() {
  if (!write_mu_.TryLock()) return false;
  {
    MutexLock lock(&mu_);
    frozen_ = true;
    SealLocked();
  }
  write_mu_.Unlock();
  return true;
}

void StagedFile::Thaw() {
  MutexLock lock(&mu_);
  frozen_ = false;
}

void StagedFile::SealIfIdle() {
  // Only mu_: a writer blocked in the pool holds write_mu_ but not mu_.
  MutexLock lock(&mu_);
  SealLocked();
}

}  // namespace ckptfs::store
