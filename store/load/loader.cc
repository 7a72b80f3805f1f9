#include "store/load/loader.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>

#include "common/path.h"
#include "common/thread_name.h"
#include "store/cache/retained_tier.h"
#include "store/dcp/checkpoint_source.h"
#include "store/dcp/commit_names.h"
#include "store/dcp/dcp_metadata.h"
#include "store/dcp/metadata_file.h"
#include "store/load/prefetch_order.h"
#include "store/peer/peers.h"

namespace ckptfs::store {

Loader::Loader(BackingDir* backing, KeyIndex* index, std::unique_ptr<BackingSource> source,
               std::shared_ptr<peer::Peers> peers, std::unique_ptr<BlockCache> cache)
    : backing_(backing),
      index_(index),
      source_(std::move(source)),
      peers_(std::move(peers)),
      cache_(std::move(cache)),
      read_sums_(std::make_unique<ReadChecksums>(index)) {}

Loader::~Loader() {
  StopServingPeers();
  Stop();
}

void Loader::StopServingPeers() {
  if (peers_) peers_->StopServing();
}

void Loader::Start() {
  worker_ = std::thread([this] {
    NameThisThread("ckptfs-loader");
    Run();
  });
}

void Loader::Stop() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void Loader::Opened(LoadFile* f, bool writable) {
  if (f->ckpt.empty()) return;
  // A prefix scan of the key index.
  f->indexed = index_->IsIndexed(f->ckpt);
  if (writable) return;
  // Reading a commit file is how every load starts (`.metadata` for DCP, the index or
  // model.safetensors for Hugging Face): fetch the checkpoint ahead.
  if (CommitKindOf(f->file) != CommitKind::kNone) {
    QueuePrefetch(f->ckpt);
  } else {
    NoteDataOpen(f->ckpt);
  }
}

Result<struct stat> Loader::BeginRead(LoadFile* f, size_t len, uint64_t offset,
                                        const struct stat* known) {
  // The file's version now, not at open: someone may have rewritten it in place. Its name
  // for the cache is the backing path it was opened under; the open descriptor is lent to
  // the cache's source, so a miss reads the very inode the application opened.
  struct stat st;
  if (known != nullptr) {
    st = *known;
  } else {
    CKPT_ASSIGN_OR_RETURN(st, backing_->Fstat(f->fd->get()));
  }
  const BlockId id = BlockIdFromStat(f->block.path, st);
  Adopt(id, f->fd, st);
  if (!f->ckpt.empty()) {
    if (peers_ && !f->indexed && CommitKindOf(f->file) == CommitKind::kNone) {
      WaitForPlan(f->ckpt);
    }
    PrefetchItem(f, id, offset);
  } else {
    ReadAhead(f, id, offset, len);
  }
  return st;
}

Result<size_t> Loader::ReadBacking(LoadFile* f, char* out, size_t len, uint64_t offset) {
  if (!cache_) return backing_->PRead(f->fd->get(), out, len, static_cast<off_t>(offset));
  CKPT_ASSIGN_OR_RETURN(struct stat st, BeginRead(f, len, offset));
  const BlockId id = BlockIdFromStat(f->block.path, st);
  Result<size_t> got = cache_->Read(id, out, len, offset);
  if (!got.ok() && (got.status().code() == Code::kAborted ||
                    got.status().code() == Code::kNotFound)) {
    // The source lost the descriptor (its bound was reached) and the path now names
    // another file, or none: this handle's file is still readable directly.
    got = backing_->PRead(f->fd->get(), out, len, static_cast<off_t>(offset));
  }
  if (got.ok() && f->indexed) {
    read_sums_->OnRead(f->ckpt, f->file, FileKeyFromStat(st), offset, out, *got);
  }
  return got;
}

Result<std::optional<size_t>> Loader::ReadBackingInPlace(
    LoadFile* f, size_t len, uint64_t offset, const BlockCache::InPlaceUse& use) {
  if (!cache_) return std::optional<size_t>();
  CKPT_ASSIGN_OR_RETURN(struct stat st, backing_->Fstat(f->fd->get()));
  const BlockId id = BlockIdFromStat(f->block.path, st);
  // An indexed shard: checksums of first full reads are taken over the pinned blocks, run
  // by run, before they are replied (ReadChecksums takes pieces in any order).
  const FileKey version = FileKeyFromStat(st);
  BlockCache::InPlaceUse checksummed;
  if (f->indexed) {
    checksummed = [&](std::span<const struct iovec> runs) {
      uint64_t at = offset;
      for (const struct iovec& run : runs) {
        read_sums_->OnRead(f->ckpt, f->file, version, at, static_cast<const char*>(run.iov_base),
                           run.iov_len);
        at += run.iov_len;
      }
      use(runs);
    };
  }
  const BlockCache::InPlaceUse& reply = f->indexed ? checksummed : use;
  // Issue 23: a committed checkpoint's file that the retained tier holds is replied from
  // the tier's blocks themselves: no copy into the block cache, no prefetch, no plan.
  if (retained_ != nullptr && !f->ckpt.empty()) {
    if (std::optional<size_t> got = retained_->ReadInPlace(id, len, offset, reply)) return got;
  }
  CKPT_RETURN_IF_ERROR(BeginRead(f, len, offset, &st).status());
  auto got = cache_->ReadInPlace(id, len, offset, reply);
  if (!got.ok() && (got.status().code() == Code::kAborted ||
                    got.status().code() == Code::kNotFound)) {
    return std::optional<size_t>();  // ReadBacking() reads the descriptor itself
  }
  return got;
}

void Loader::Adopt(const BlockId& id, std::shared_ptr<const UniqueFd> fd,
                     const struct stat& st) {
  source_->Adopt(id, std::move(fd), st, [this](const std::string& p) { cache_->Invalidate(p); });
}

Result<size_t> Loader::ReadWindow(int fd, uint64_t base, uint64_t size, char* out, size_t len,
                                  uint64_t offset) {
  if (offset >= size) return size_t{0};
  size_t n = static_cast<size_t>(std::min<uint64_t>(len, size - offset));
  CKPT_ASSIGN_OR_RETURN(size_t got, backing_->PRead(fd, out, n, static_cast<off_t>(base + offset)));
  if (got < n) {
    // The index says these bytes exist; a short shard file must not pass as a short tensor.
    return Status(Code::kIo, "tensor chunk extends past the end of its shard file");
  }
  return got;
}

void Loader::FileGone(const std::string& path) {
  if (source_) source_->Forget(path);  // none without a block cache
}

void Loader::QueueBuild(const std::string& ckpt) {
  {
    MutexLock lock(&mu_);
    index_queue_.push_back(ckpt);
  }
  cv_.notify_one();
}

void Loader::QueuePrefetch(const std::string& ckpt) {
  if (!prefetch_.load() || (!cache_ && !page_cache_.load())) return;
  // A checkpoint the retained tier holds has nothing to plan: its readers must not wait
  // for a worker that may be busy for seconds (an index build) to say so.
  const bool plan = peers_ && !HeldInMemory(ckpt);
  {
    MutexLock lock(&mu_);
    for (const auto& queued : prefetch_queue_) {
      if (queued == ckpt) return;
    }
    prefetch_queue_.push_back(ckpt);
    if (plan) planning_.insert(ckpt);
    if (queued_at_.size() > 64) {
      queued_at_.clear();
      data_opened_.clear();
    }
    queued_at_[ckpt] = std::chrono::steady_clock::now();
  }
  cv_.notify_one();
}

void Loader::PlanDone(const std::string& ckpt) {
  {
    MutexLock lock(&mu_);
    if (planning_.erase(ckpt) == 0) return;
  }
  planned_cv_.notify_all();
}

void Loader::WaitForPlan(const std::string& ckpt) {
  // Planning takes milliseconds (a second for a million items); a worker busy elsewhere
  // (an index build) must not hold reads for long: past the bound they read unplanned.
  constexpr auto kPlanWait = std::chrono::seconds(1);
  MutexLock lock(&mu_);
  if (planning_.count(ckpt) == 0) return;
  const bool planned = planned_cv_.wait_for(lock.native(), kPlanWait, [&] {
    mu_.AssertHeld();  // the predicate runs under the lock
    return stop_ || planning_.count(ckpt) == 0;
  });
  if (!planned) plan_wait_timeouts_.fetch_add(1, std::memory_order_relaxed);
}

// Issue 23: `.metadata` through the block cache, so a checkpoint held in the retained tier
// (or by a peer) is planned without reading the backing store; without a cache, directly.
Result<std::string> Loader::ReadMetadataCached(const std::string& path) {
  if (!cache_) return ReadMetadataBytes(backing_, path);
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, backing_->OpenFile(path, O_RDONLY));
  CKPT_ASSIGN_OR_RETURN(struct stat st, backing_->Fstat(fd.get()));
  if (static_cast<uint64_t>(st.st_size) > kMaxMetadataBytes) {
    return ReadMetadataBytes(backing_, path);  // reports the limit
  }
  const BlockId id = BlockIdFromStat(path, st);
  Adopt(id, std::make_shared<const UniqueFd>(std::move(fd)), st);
  std::string out(static_cast<size_t>(st.st_size), '\0');
  CKPT_ASSIGN_OR_RETURN(size_t got, cache_->Read(id, out.data(), out.size(), 0));
  out.resize(got);
  return out;
}

void Loader::PrefetchCheckpoint(const std::string& ckpt) {
  // Straight from the commit files (`.metadata`, per-rank metadata, a safetensors index
  // and headers): building the index here would read every DCP item's header outside the
  // cache, before the data itself.
  struct Done {  // however it ends, reads waiting for the plan go on
    Loader* self;
    const std::string& ckpt;
    ~Done() { self->PlanDone(ckpt); }
  } done{this, ckpt};
  // A DCP `.metadata` through the block cache (issue 23: a checkpoint held in the retained
  // tier or by a peer is planned without reading the backing store); other formats from
  // their commit files.
  Result<DcpMetadata> md = Status(Code::kNotFound, "no .metadata");
  if (auto bytes = ReadMetadataCached(path::Join(ckpt, ".metadata")); bytes.ok()) {
    md = ParseDcpMetadata(*bytes);
  } else {
    md = ReadCheckpointItems(backing_, ckpt);
  }
  if (!md.ok()) {
    spdlog::debug("prefetch of {}: {}", ckpt, md.status().ToString());
    return;
  }
  struct File {
    std::string name;
    uint64_t length;
    BlockId id;
  };
  std::vector<File> files;
  for (const auto& [file, length] : RequiredFileLengths(*md)) {
    auto fd = backing_->OpenFile(path::Join(ckpt, file), O_RDONLY);
    if (!fd.ok()) continue;
    auto st = backing_->Fstat(fd->get());
    if (!st.ok()) continue;
    const BlockId id = BlockIdFromStat(path::Join(ckpt, file), *st);
    Adopt(id, std::make_shared<const UniqueFd>(std::move(*fd)), *st);
    files.push_back(File{file, std::min<uint64_t>(length, static_cast<uint64_t>(st->st_size)), id});
  }
  // With peers, this node prefetches its share only: the blocks others will ask it for.
  // Everything else this node's readers need comes from its owner item by item as they
  // reach it (PrefetchItem): prefetching the whole checkpoint here pulled the other
  // nodes' shares over the network even in own-shard loads, where nobody here reads them.
  if (peers_) {
    KeepItems(ckpt, *md);
    std::vector<std::pair<std::string, BlockId>> ids;
    for (const File& f : files) ids.emplace_back(f.name, f.id);
    auto owned = peers_->PlanCheckpoint(ckpt, *md, ids);
    PlanDone(ckpt);
    if (owned.ok()) {
      for (const auto& range : *owned) {
        for (const File& f : files) {
          if (f.name == range.file) cache_->Prefetch(f.id, range.offset, range.length);
        }
      }
      spdlog::debug("prefetch of {}: this node's share of {} files queued", ckpt, files.size());
      return;
    }
    spdlog::warn("peers: cannot plan {}: {}", ckpt, owned.status().ToString());
  }
  for (const File& f : files) cache_->Prefetch(f.id, 0, f.length);
  spdlog::debug("prefetch of {}: {} files queued", ckpt, files.size());
}

bool Loader::Stopping() {
  MutexLock lock(&mu_);
  return stop_;
}

namespace {
// MemAvailable of /proc/meminfo in bytes; 0 when it cannot be read.
uint64_t MemAvailableBytes() {
  FILE* f = std::fopen("/proc/meminfo", "re");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kb = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %" SCNu64 " kB", &kb) == 1) break;
  }
  std::fclose(f);
  return kb << 10;
}
}  // namespace

bool Loader::HeldInMemory(const std::string& ckpt) const {
  return retained_ != nullptr && retained_->HoldsCommitted(ckpt);
}

// Passthrough readers read the backing files' page cache: the kernel is asked to read the
// checkpoint into it (POSIX_FADV_WILLNEED) while the ranks plan and allocate, so their
// reads find it there. Bytes are read from the disk once however many ranks read them (the
// page cache is shared). Windows come in PrefetchOrder (each writer rank's next bytes in
// turn; in name order, torch 2.x's per-item files put all of rank 0's first), at most
// kInFlight bytes of them asked for and not yet read, so a demand read queues behind that
// much at most, never behind the whole checkpoint. It stops once a rank opens a data file
// (NoteDataOpen), and asks for nothing when one does within kReadersStartWithin of the
// load's start: the ranks read at once, and the prefetch's order-0 pages would only slow
// their reads (see NoteDataOpen).
void Loader::PrefetchIntoPageCache(const std::string& ckpt) {
  constexpr uint64_t kWindow = uint64_t{8} << 20;
  constexpr uint64_t kStep = uint64_t{1} << 20;
  constexpr uint64_t kInFlight = uint64_t{32} << 20;
  // torch 2.14's ranks open their first data file ~20 ms after `.metadata`; torch 1.13's
  // plan and allocate for 0.2 s and more first.
  constexpr auto kReadersStartWithin = std::chrono::milliseconds(50);
  constexpr auto kRecent = std::chrono::seconds(30);
  const auto started = std::chrono::steady_clock::now();
  {
    // Every rank opens `.metadata`: one prefetch per load is enough.
    MutexLock lock(&mu_);
    auto it = page_cache_done_.find(ckpt);
    if (it != page_cache_done_.end() && started - it->second < kRecent) return;
    if (page_cache_done_.size() > 64) page_cache_done_.clear();
    page_cache_done_[ckpt] = started;
  }
  auto md = ReadCheckpointItems(backing_, ckpt);
  if (!md.ok()) {
    spdlog::debug("page-cache prefetch of {}: {}", ckpt, md.status().ToString());
    return;
  }
  std::vector<UniqueFd> fds;
  std::vector<std::pair<std::string, uint64_t>> files;
  uint64_t total = 0;
  for (const auto& [file, length] : RequiredFileLengths(*md)) {
    auto fd = backing_->OpenFile(path::Join(ckpt, file), O_RDONLY);
    if (!fd.ok()) continue;
    auto st = backing_->Fstat(fd->get());
    if (!st.ok()) continue;
    const uint64_t len = std::min<uint64_t>(length, static_cast<uint64_t>(st->st_size));
    if (static_cast<uint64_t>(st->st_size) < page_cache_min_bytes_ || len == 0) continue;
    fds.push_back(std::move(*fd));
    files.emplace_back(file, len);
    total += len;
  }
  // Ranks that read right after `.metadata` (torch 2.x) leave no gap to fill: wait a
  // moment for their first data open before asking for anything.
  {
    MutexLock lock(&mu_);
    auto q = queued_at_.find(ckpt);
    const auto deadline =
        (q != queued_at_.end() ? q->second : started) + kReadersStartWithin;
    cv_.wait_until(lock.native(), deadline, [&] {
      mu_.AssertHeld();  // the predicate runs under the lock
      return stop_;
    });
  }
  if (RanksReading(ckpt)) {
    spdlog::info("page-cache prefetch of {}: none, the ranks read at once", ckpt);
    return;
  }
  // A checkpoint larger than memory would push its own first bytes out before they are
  // read: at most half of what is available now.
  const uint64_t budget = MemAvailableBytes() / 2;
  uint64_t asked = 0, in_flight = 0;
  std::deque<PrefetchWindow> pending;  // asked for, oldest first
  // Waits for the oldest window: its last page is read once the window is in.
  auto wait_oldest = [&] {
    const PrefetchWindow& w = pending.front();
    char byte;
    (void)backing_->PRead(fds[w.file].get(), &byte, 1,
                          static_cast<off_t>(w.offset + w.length - 1));
    in_flight -= w.length;
    pending.pop_front();
  };
  const char* stopped = "";
  for (const PrefetchWindow& w : PrefetchOrder(files, kWindow)) {
    if (Stopping()) {
      stopped = " (unmounting)";
      break;
    }
    if (asked + w.length > budget) {
      stopped = " (memory budget)";
      break;
    }
    if (RanksReading(ckpt)) {
      stopped = " (the ranks read)";
      break;
    }
    while (!pending.empty() && in_flight + w.length > kInFlight) wait_oldest();
    // The kernel caps one WILLNEED at the device's read-ahead or request size (8 MiB
    // on this machine's disk, 1.25 MiB and up on most): asked for in steps below both.
    for (uint64_t at = 0; at < w.length; at += kStep) {
      (void)backing_->WillNeed(fds[w.file].get(), static_cast<off_t>(w.offset + at),
                               static_cast<off_t>(std::min(kStep, w.length - at)));
    }
    asked += w.length;
    in_flight += w.length;
    pending.push_back(w);
    if (page_cache_counter_ != nullptr) page_cache_counter_->fetch_add(w.length);
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  spdlog::info("page-cache prefetch of {}: {} of {} bytes in {} files asked for in {:.3f} s{}",
               ckpt, asked, total, files.size(), secs, stopped);
}

void Loader::NoteDataOpen(const std::string& ckpt) {
  if (!page_cache_.load()) return;
  const auto now = std::chrono::steady_clock::now();
  MutexLock lock(&mu_);
  if (queued_at_.count(ckpt) == 0) return;  // no load of it began
  data_opened_[ckpt] = now;
}

bool Loader::RanksReading(const std::string& ckpt) {
  MutexLock lock(&mu_);
  auto q = queued_at_.find(ckpt);
  auto o = data_opened_.find(ckpt);
  return q != queued_at_.end() && o != data_opened_.end() && o->second >= q->second;
}

void Loader::KeepItems(const std::string& ckpt, const DcpMetadata& md) {
  FileItems items;
  for (const DcpItem& it : md.items) {
    if (it.length == 0) continue;
    items[it.file].emplace_back(it.offset, it.offset + it.length);
  }
  for (auto& [file, ranges] : items) std::sort(ranges.begin(), ranges.end());
  MutexLock lock(&items_mu_);
  if (items_.count(ckpt) == 0) {
    items_order_.push_back(ckpt);
    while (items_order_.size() > kKeptCheckpoints) {
      items_.erase(items_order_.front());
      items_order_.pop_front();
    }
  }
  items_[ckpt] = std::move(items);
}

std::optional<std::pair<uint64_t, uint64_t>> Loader::KeptItem(const std::string& ckpt,
                                                                const std::string& file,
                                                                uint64_t at) {
  MutexLock lock(&items_mu_);
  auto c = items_.find(ckpt);
  if (c == items_.end()) return std::nullopt;
  auto f = c->second.find(file);
  if (f == c->second.end()) return std::nullopt;
  const auto& ranges = f->second;
  // The last item starting at or before `at`.
  auto it = std::upper_bound(ranges.begin(), ranges.end(),
                             std::pair<uint64_t, uint64_t>{at, UINT64_MAX});
  if (it == ranges.begin()) return std::nullopt;
  --it;
  if (it->second <= at) return std::nullopt;
  return *it;
}

void Loader::PrefetchItem(LoadFile* f, const BlockId& id, uint64_t offset) {
  if (offset < f->prefetched_end.load(std::memory_order_relaxed)) return;
  uint64_t end = 0;
  if (f->indexed) {
    auto item = index_->Locate(f->ckpt, f->file, offset);
    if (!item || item->offset + item->length <= offset) return;
    end = item->offset + item->length;
  } else if (peers_) {
    // Never build an index inside a read; the items of `.metadata` kept by the checkpoint
    // prefetch say as much (they are there once that prefetch has parsed it).
    auto item = KeptItem(f->ckpt, f->file, offset);
    if (!item) return;
    end = item->second;
  } else {
    return;  // the checkpoint prefetch fetches every item
  }
  if (f->prefetched_end.exchange(end) >= end) return;  // another read got there first
  uint64_t from = offset + cache_->block_bytes();
  // With peers, an item a reader is in goes ahead of the `.metadata` prefetch of this
  // node's share, which takes the whole load on a throttled store: queued behind it, the
  // item's blocks came from their owners one FUSE request at a time.
  if (from < end) cache_->Prefetch(id, from, end - from, /*urgent=*/peers_ != nullptr);
}

void Loader::ReadAhead(LoadFile* f, const BlockId& id, uint64_t offset, size_t len) {
  const uint64_t end = offset + len;
  // Sequential: this read starts at or before the furthest end read so far (the kernel
  // sends its read-ahead requests in parallel, so they arrive a little out of order) and
  // not far behind it. A reader that jumps gets no read-ahead.
  uint64_t seen = f->read_end.load(std::memory_order_relaxed);
  while (seen < end && !f->read_end.compare_exchange_weak(seen, end, std::memory_order_relaxed)) {
  }
  if (offset > seen + cache_->block_bytes() || end + kReadAheadBytes < seen) return;
  // A window at a time: refill once the reader is half a window from its end.
  uint64_t ahead = f->prefetched_end.load(std::memory_order_relaxed);
  if (ahead >= id.size || ahead > end + kReadAheadBytes / 2) return;
  const uint64_t until = std::min<uint64_t>(id.size, end + kReadAheadBytes);
  if (until <= ahead || !f->prefetched_end.compare_exchange_strong(ahead, until)) return;
  const uint64_t from = std::max(ahead, end);
  if (from < until) cache_->Prefetch(id, from, until - from);
}

void Loader::Run() {
  while (true) {
    std::string ckpt;
    bool prefetch = false;
    {
      MutexLock lock(&mu_);
      while (!stop_ && index_queue_.empty() && prefetch_queue_.empty()) {
        cv_.wait(lock.native());
      }
      if (stop_) {
        planning_.clear();  // nobody plans them now
        planned_cv_.notify_all();
        return;  // a later look builds lazily; the index is a cache
      }
      if (!prefetch_queue_.empty()) {
        ckpt = std::move(prefetch_queue_.front());
        prefetch_queue_.pop_front();
        prefetch = true;
      } else {
        ckpt = std::move(index_queue_.front());
        index_queue_.pop_front();
      }
    }
    if (prefetch) {
      if (HeldInMemory(ckpt)) {
        // The retained tier serves it: nothing to read ahead, and no plan to wait for (a
        // reader left waiting for one would wait kPlanWait on every read).
        PlanDone(ckpt);
        continue;
      }
      if (page_cache_.load()) {
        PrefetchIntoPageCache(ckpt);
      } else {
        PrefetchCheckpoint(ckpt);
      }
      continue;
    }
    auto started = std::chrono::steady_clock::now();
    Status st = index_->Build(ckpt, /*checksums=*/true);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (st.ok()) {
      spdlog::info("checkpoint {}: indexed in {:.3f} s", ckpt, secs);
    } else {
      spdlog::warn("checkpoint {}: index error: {}", ckpt, st.ToString());
    }
  }
}

}  // namespace ckptfs::store
