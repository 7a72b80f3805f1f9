#include "gpu/staging_pool.h"

#include <linux/capability.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include "common/histogram.h"

#if defined(CKPTFS_HAVE_CUDA)
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#endif

namespace ckptfs::gpu {
namespace {

constexpr size_t kPageBytes = 4096;
constexpr size_t kMinChunkBytes = size_t{64} << 10;
constexpr size_t kHugePageBytes = size_t{2} << 20;

// The pool's memory, before it is split into chunks.
struct Memory {
  uint8_t* base = nullptr;
  bool cuda = false;           // cudaHostAlloc'd, pinned whole; else reserved host memory
  std::function<void()> free;  // releases `base` the way it was allocated
};

Status AllocFailed(std::string_view what, size_t bytes, int err) {
  std::string context =
      std::string(what) + " of " + std::to_string(bytes) + " bytes for the staging pool";
  if (err == ENOMEM) return Status(Code::kNoSpace, context + ": " + std::strerror(err));
  return Status::FromErrno(err, context);
}

// "64 KiB", "4 MiB", "1.5 GiB": for log lines.
std::string FormatBytes(size_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  return fmt::format("{:.{}f} {}", value, value == static_cast<uint64_t>(value) ? 0 : 1,
                     kUnits[unit]);
}

// Faults in every page of [base, base+bytes) for writing, so the memory is charged to the
// process when a chunk is pinned rather than on the write() that fills it.
Status Populate(uint8_t* base, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  if (madvise(base, bytes, MADV_POPULATE_WRITE) == 0) return Status::Ok();
  // EINVAL: the kernel predates 5.14; touch the pages by hand instead. Anything else
  // (ENOMEM, EFAULT) is a real failure that touching would turn into a SIGBUS or OOM kill.
  if (errno != EINVAL) return AllocFailed("populating", bytes, errno);
#endif
  volatile uint8_t* p = base;
  for (size_t off = 0; off < bytes; off += kPageBytes) p[off] = 0;
  return Status::Ok();
}

// Whether this process may lock `bytes` more: the kernel allows it with CAP_IPC_LOCK, or
// while the process's locked memory stays within RLIMIT_MEMLOCK. Sets `why` when not.
bool MlockWouldFit(size_t bytes, std::string* why) {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return true;
  uint64_t cap_eff = 0, locked_kib = 0;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("CapEff:", 0) == 0) cap_eff = std::strtoull(line.c_str() + 7, nullptr, 16);
    if (line.rfind("VmLck:", 0) == 0) locked_kib = std::strtoull(line.c_str() + 6, nullptr, 10);
  }
  if (cap_eff & (uint64_t{1} << CAP_IPC_LOCK)) return true;
  const uint64_t locked = locked_kib << 10;
  if (locked + bytes <= limit.rlim_cur) return true;
  *why = fmt::format("RLIMIT_MEMLOCK is {} and {} is locked already", FormatBytes(limit.rlim_cur),
                     FormatBytes(locked));
  return false;
}

// A number from a cgroup file; "max" (v2) and v1's "unlimited" (2^63 rounded to a page)
// read as nullopt, as does a file that cannot be read.
std::optional<uint64_t> ReadCgroupNumber(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0') return std::nullopt;
  if (value >= (uint64_t{1} << 62)) return std::nullopt;
  return value;
}

// One "KEY VALUE" line of a memory.stat file; 0 when absent.
uint64_t ReadCgroupStat(const std::string& path, std::string_view key) {
  std::ifstream in(path);
  std::string name;
  uint64_t value = 0;
  while (in >> name >> value) {
    if (name == key) return value;
  }
  return 0;
}

bool IsDir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void WarnUnlocked(size_t bytes, const std::string& why) {
  static std::atomic<bool> warned{false};
  if (warned.exchange(true)) return;
  spdlog::warn(
      "staging pool: {} cannot be locked ({}); using unlocked memory. Raise RLIMIT_MEMLOCK "
      "(ulimit -l) or grant CAP_IPC_LOCK to pin it",
      FormatBytes(bytes), why);
}

// Anonymous private address space, aligned to 2 MiB so transparent hugepages can back all
// of it (when `hugepages`). Nothing is faulted in: chunks are pinned as they are first used.
Result<Memory> ReserveHost(size_t bytes, bool hugepages) {
  if (bytes > SIZE_MAX - kHugePageBytes) return AllocFailed("mmap", bytes, ENOMEM);
  // Over-map by one hugepage and trim, since mmap only guarantees page alignment.
  const size_t mapped = bytes + kHugePageBytes;
  void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return AllocFailed("mmap", bytes, errno);
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePageBytes - 1) & ~uintptr_t{kHugePageBytes - 1};
  if (aligned > start) munmap(raw, aligned - start);
  if (const uintptr_t tail = start + mapped - (aligned + bytes); tail > 0) {
    munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  }
  auto* base = reinterpret_cast<uint8_t*>(aligned);

  // Before the first fault, or the pages come in small. Best effort: THP may be disabled.
  // Without hugepages, say so explicitly: THP may be "always" (see StagingOptions).
  (void)madvise(base, bytes, hugepages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);

  Memory memory;
  memory.base = base;
  memory.free = [base, bytes] { munmap(base, bytes); };
  return memory;
}

#if defined(CKPTFS_HAVE_CUDA)

// The CUDA runtime, resolved with dlopen so that the binary starts without a driver.
struct CudaRuntime {
  decltype(&::cudaGetDeviceCount) get_device_count = nullptr;
  decltype(&::cudaHostAlloc) host_alloc = nullptr;
  decltype(&::cudaFreeHost) free_host = nullptr;
  decltype(&::cudaGetErrorString) error_string = nullptr;  // optional
  std::string missing;  // why it could not be loaded; empty when loaded

  std::string ErrorName(cudaError_t err) const {
    std::string name = error_string != nullptr ? error_string(err) : "unknown";
    return name + " (" + std::to_string(static_cast<int>(err)) + ")";
  }
};

// Loaded once per process and never unloaded: pinned memory from it may be live until exit,
// and the runtime does not support being unloaded.
const CudaRuntime& LoadCudaRuntime() {
  static const CudaRuntime runtime = [] {
    CudaRuntime rt;
    void* lib = nullptr;
    for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) {
      rt.missing = "libcudart.so not found";
      return rt;
    }
    rt.get_device_count =
        reinterpret_cast<decltype(rt.get_device_count)>(dlsym(lib, "cudaGetDeviceCount"));
    rt.host_alloc = reinterpret_cast<decltype(rt.host_alloc)>(dlsym(lib, "cudaHostAlloc"));
    rt.free_host = reinterpret_cast<decltype(rt.free_host)>(dlsym(lib, "cudaFreeHost"));
    rt.error_string = reinterpret_cast<decltype(rt.error_string)>(dlsym(lib, "cudaGetErrorString"));
    if (rt.get_device_count == nullptr || rt.host_alloc == nullptr || rt.free_host == nullptr) {
      rt.missing = "libcudart lacks cudaGetDeviceCount/cudaHostAlloc/cudaFreeHost";
    }
    return rt;
  }();
  return runtime;
}

// Sets `why` and returns nullptr when CUDA cannot be used (no runtime, driver or device).
const CudaRuntime* UsableCuda(std::string* why) {
  const CudaRuntime& rt = LoadCudaRuntime();
  if (!rt.missing.empty()) {
    *why = rt.missing;
    return nullptr;
  }
  int devices = 0;
  if (cudaError_t err = rt.get_device_count(&devices); err != cudaSuccess) {
    *why = "cudaGetDeviceCount: " + rt.ErrorName(err);
    return nullptr;
  }
  if (devices == 0) {
    *why = "no CUDA device";
    return nullptr;
  }
  return &rt;
}

Result<Memory> AllocateCuda(const CudaRuntime& rt, size_t bytes) {
  void* ptr = nullptr;
  // Portable: the pool is shared by every GPU (context) on the node.
  if (cudaError_t err = rt.host_alloc(&ptr, bytes, cudaHostAllocPortable); err != cudaSuccess) {
    return Status(Code::kNoSpace, "cudaHostAlloc of " + std::to_string(bytes) +
                                      " bytes for the staging pool failed: " + rt.ErrorName(err));
  }
  Memory memory;
  memory.base = static_cast<uint8_t*>(ptr);
  memory.cuda = true;
  memory.free = [&rt, ptr] {
    if (cudaError_t err = rt.free_host(ptr); err != cudaSuccess) {
      spdlog::error("staging pool: cudaFreeHost failed: {}", rt.ErrorName(err));
    }
  };
  return memory;
}

#endif  // CKPTFS_HAVE_CUDA

// Picks the backend and allocates. `note` receives why "auto" did not use CUDA.
Result<Memory> Allocate(const std::string& backend, size_t bytes, bool hugepages,
                        std::string* note) {
  if (backend == "host") return ReserveHost(bytes, hugepages);
#if defined(CKPTFS_HAVE_CUDA)
  std::string why;
  const CudaRuntime* rt = UsableCuda(&why);
  if (rt != nullptr) {
    Result<Memory> memory = AllocateCuda(*rt, bytes);
    if (memory.ok() || backend == "cuda") return memory;
    // auto: host memory without CUDA registration is still better than no mount.
    spdlog::warn("staging pool: {}; falling back to host memory", memory.status().message());
    *note = "cudaHostAlloc failed";
    return ReserveHost(bytes, hugepages);
  }
  if (backend == "cuda") return Unsupported("staging backend \"cuda\" is unavailable: " + why);
  *note = "CUDA unavailable: " + why;
#else
  if (backend == "cuda") {
    return Unsupported("staging backend \"cuda\" is unavailable: ckptfs was built without CUDA");
  }
  *note = "built without CUDA";
#endif
  return ReserveHost(bytes, hugepages);
}

// One more chunk's memory, allocated the way the pool's was (a spare for a loan).
Result<Memory> AllocateLike(bool cuda, size_t bytes, bool hugepages) {
#if defined(CKPTFS_HAVE_CUDA)
  if (cuda) {
    std::string why;
    const CudaRuntime* rt = UsableCuda(&why);
    if (rt == nullptr) return Unsupported("CUDA is gone: " + why);
    return AllocateCuda(*rt, bytes);
  }
#else
  (void)cuda;
#endif
  return ReserveHost(bytes, hugepages);
}

}  // namespace

std::optional<uint64_t> MemoryCgroupHeadroom(std::string_view self_cgroup,
                                             const std::string& root) {
  std::string v1_path, v2_path;
  bool have_v2 = false;
  size_t start = 0;
  while (start < self_cgroup.size()) {
    size_t end = self_cgroup.find('\n', start);
    if (end == std::string_view::npos) end = self_cgroup.size();
    const std::string_view line = self_cgroup.substr(start, end - start);
    start = end + 1;
    // "ID:CONTROLLERS:PATH"; v2's line is "0::PATH".
    const size_t a = line.find(':');
    const size_t b = a == std::string_view::npos ? a : line.find(':', a + 1);
    if (b == std::string_view::npos) continue;
    const std::string_view controllers = line.substr(a + 1, b - a - 1);
    const std::string path(line.substr(b + 1));
    if (controllers.empty()) {
      v2_path = path;
      have_v2 = true;
      continue;
    }
    for (size_t c = 0; c <= controllers.size();) {
      size_t comma = controllers.find(',', c);
      if (comma == std::string_view::npos) comma = controllers.size();
      if (controllers.substr(c, comma - c) == "memory") v1_path = path;
      c = comma + 1;
    }
  }
  std::string base, dir;
  const char* limit_file;
  const char* usage_file;
  const char* cache_key;  // memory.stat's page cache, reclaimable: not counted as used
  if (!v1_path.empty()) {
    base = root + "/memory";
    dir = base + v1_path;
    limit_file = "memory.limit_in_bytes";
    usage_file = "memory.usage_in_bytes";
    cache_key = "total_cache";
  } else if (have_v2) {
    base = IsDir(root + "/unified") ? root + "/unified" : root;
    dir = base + v2_path;
    limit_file = "memory.max";
    usage_file = "memory.current";
    cache_key = "file";
  } else {
    return std::nullopt;
  }
  while (!dir.empty() && dir.back() == '/') dir.pop_back();
  std::optional<uint64_t> headroom;
  // From the process's own cgroup up to (not including) the hierarchy's root, which has no
  // limit of its own.
  while (dir.size() > base.size() && dir.compare(0, base.size(), base) == 0) {
    if (std::optional<uint64_t> limit = ReadCgroupNumber(dir + "/" + limit_file)) {
      uint64_t usage = ReadCgroupNumber(dir + "/" + usage_file).value_or(0);
      usage -= std::min(usage, ReadCgroupStat(dir + "/memory.stat", cache_key));
      const uint64_t left = usage >= *limit ? 0 : *limit - usage;
      headroom = headroom ? std::min(*headroom, left) : left;
    }
    dir.resize(dir.rfind('/'));
  }
  return headroom;
}

ChunkBuffer::~ChunkBuffer() { Release(); }

ChunkBuffer::ChunkBuffer(ChunkBuffer&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      capacity_(std::exchange(other.capacity_, 0)) {}

ChunkBuffer& ChunkBuffer::operator=(ChunkBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void ChunkBuffer::Release() {
  if (data_ != nullptr) pool_->Return(data_);
  pool_ = nullptr;
  data_ = nullptr;
  capacity_ = 0;
}

Result<std::unique_ptr<StagingPool>> StagingPool::Create(const StagingOptions& options) {
  const size_t chunk = options.chunk_bytes;
  if (chunk < kMinChunkBytes || chunk % kPageBytes != 0) {
    return Invalid("staging chunk_bytes must be a multiple of 4096 and at least 64 KiB, got " +
                   std::to_string(chunk));
  }
  const size_t chunks = options.total_bytes / chunk;
  if (chunks == 0) {
    return Invalid("staging total_bytes (" + std::to_string(options.total_bytes) +
                   ") is smaller than one chunk (" + std::to_string(chunk) + ")");
  }
  const std::string& backend = options.backend;
  if (backend != "auto" && backend != "host" && backend != "cuda") {
    return Invalid("unknown staging backend \"" + backend + "\" (expected auto, host or cuda)");
  }
  if (options.release_idle.count() < 0) return Invalid("staging release_idle is negative");

  std::string note;
  CKPT_ASSIGN_OR_RETURN(Memory memory, Allocate(backend, chunks * chunk, options.hugepages, &note));
  if (!memory.cuda) {
    std::string cgroups;
    if (std::ifstream in("/proc/self/cgroup"); in) {
      cgroups.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    if (std::optional<uint64_t> headroom = MemoryCgroupHeadroom(cgroups, "/sys/fs/cgroup");
        headroom && *headroom < chunks * chunk) {
      memory.free();
      return Status(Code::kNoSpace,
                    fmt::format("the staging pool ({}) does not fit this process's memory "
                                "cgroup, which can charge {} more; its chunks are pinned as "
                                "writes need them, and past the limit the daemon would be "
                                "OOM-killed mid-save. Lower --staging-mem or raise the "
                                "cgroup's memory limit",
                                FormatBytes(chunks * chunk), FormatBytes(*headroom)));
    }
  }

  std::unique_ptr<StagingPool> pool(new StagingPool());
  pool->chunk_bytes_ = chunk;
  pool->total_chunks_ = chunks;
  pool->base_ = memory.base;
  pool->cuda_ = memory.cuda;
  pool->hugepages_ = options.hugepages;
  pool->free_memory_ = std::move(memory.free);
  if (!pool->cuda_) {
    std::string why;
    const bool fits = MlockWouldFit(chunks * chunk, &why);
    if (!fits) WarnUnlocked(chunks * chunk, why);
    pool->lock_memory_.store(fits);
    pool->release_idle_ = options.release_idle;
  }
  {
    MutexLock lock(&pool->mu_);  // nobody else has the pool yet; taken for the analysis
    // Reserved once, so Return() never allocates. Reversed so the lowest chunk goes out first.
    std::vector<uint8_t*>& initial = pool->cuda_ ? pool->free_pinned_ : pool->free_unpinned_;
    pool->free_pinned_.reserve(chunks);
    pool->free_unpinned_.reserve(chunks);
    for (size_t i = chunks; i-- > 0;) initial.push_back(memory.base + i * chunk);
    pool->last_return_ = std::chrono::steady_clock::now();
  }
  if (pool->cuda_) pool->resident_chunks_.store(chunks);

  std::string pinning = "allocated pinned";
  if (!pool->cuda_) {
    pinning = "each chunk pinned on first use";
    if (pool->release_idle_.count() > 0) {
      pinning += fmt::format(", given back after {:.3g} s with none in use",
                             pool->release_idle_.count() / 1000.0);
      pool->releaser_ = std::thread([p = pool.get()] { p->ReleaseIdleChunks(); });
    }
  }
  spdlog::info("staging pool: {} as {} chunks of {}, backend {}{}, {}", FormatBytes(chunks * chunk),
               chunks, FormatBytes(chunk), pool->backend(), note.empty() ? "" : " (" + note + ")",
               pinning);
  return pool;
}

StagingPool::~StagingPool() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    release_cv_.notify_all();
  }
  if (releaser_.joinable()) releaser_.join();
  size_t out, lent;
  std::unordered_map<const uint8_t*, std::function<void()>> extra;
  {
    // Taken so that a Return() still finishing on another thread completes first.
    MutexLock lock(&mu_);
    out = total_chunks_ - FreeLocked();
    lent = lent_.size();
    extra.swap(extra_);
  }
  if (out != 0 || lent != 0) {
    spdlog::critical("staging pool destroyed with {} of {} chunks still in use and {} lent",
                     out, total_chunks_, lent);
    std::abort();
  }
  for (auto& [data, free] : extra) free();
  if (free_memory_) free_memory_();
}

std::string StagingPool::backend() const {
  if (cuda_) return "cuda-pinned";
  return lock_memory_.load(std::memory_order_relaxed) ? "host-locked" : "host";
}

ChunkBuffer StagingPool::Acquire(Status* error) { return AcquireUntil(nullptr, error); }

ChunkBuffer StagingPool::TryAcquireFor(std::chrono::milliseconds timeout, Status* error) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  return AcquireUntil(&deadline, error);
}

// Both acquire paths tell the pressure listener once, and count a wait, only when every
// chunk is out and they are about to block; a zero timeout never blocks and does neither.
// A chunk the release thread is unpinning is on its way back: waiting for it is neither.
ChunkBuffer StagingPool::AcquireUntil(const std::chrono::steady_clock::time_point* deadline,
                                      Status* error) {
  MutexLock lock(&mu_);
  if (FreeLocked() == 0) {
    const bool full = releasing_ == 0;
    const auto wait_start = std::chrono::steady_clock::now();
    if (full && deadline != nullptr && *deadline <= wait_start) return ChunkBuffer();
    if (full) {
      waits_.fetch_add(1, std::memory_order_relaxed);
      if (StagingPressureListener* pressure = pressure_) {
        lock.Unlock();
        pressure->RelieveStagingPressure();
        lock.Lock();
      }
    }
    while (FreeLocked() == 0) {
      if (deadline == nullptr) {
        cv_.wait(lock.native());
      } else if (cv_.wait_until(lock.native(), *deadline) == std::cv_status::timeout) {
        break;
      }
    }
    if (full) {
      StagingWaitHistogram().Observe(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count());
    }
    if (FreeLocked() == 0) return ChunkBuffer();
  }
  const bool pinned = !free_pinned_.empty();
  std::vector<uint8_t*>& from = pinned ? free_pinned_ : free_unpinned_;
  uint8_t* data = from.back();
  from.pop_back();
  if (!pinned) {
    // Out of the lock: pinning faults in a whole chunk. The chunk counts as used meanwhile.
    lock.Unlock();
    Status st = Pin(data);
    if (!st.ok()) {
      lock.Lock();
      free_unpinned_.push_back(data);
      cv_.notify_one();
      spdlog::error("staging pool: {}", st.message());
      if (error != nullptr) *error = std::move(st);
      return ChunkBuffer();
    }
  }
  return ChunkBuffer(this, data, chunk_bytes_);
}

Status StagingPool::Pin(uint8_t* data) {
  CKPT_RETURN_IF_ERROR(LockChunk(data));
  resident_chunks_.fetch_add(1, std::memory_order_relaxed);
  pins_.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

Status StagingPool::LockChunk(uint8_t* data) {
  if (lock_memory_.load(std::memory_order_relaxed) && mlock(data, chunk_bytes_) != 0) {
    const int err = errno;
    (void)munlock(data, chunk_bytes_);  // mlock may have locked a prefix before failing
    if (lock_memory_.exchange(false)) {
      WarnUnlocked(limit_bytes(), fmt::format("mlock of a {} chunk: {}", FormatBytes(chunk_bytes_),
                                              std::strerror(err)));
    }
  }
  // After a successful mlock every page is in, which makes this a cheap page-table walk; it
  // matters when mlock failed or is a no-op, as under ASan and TSan.
  return Populate(data, chunk_bytes_);
}

void StagingPool::ReleaseIdleChunks() {
  MutexLock lock(&mu_);
  while (!stopping_) {
    if (FreeLocked() != total_chunks_ || free_pinned_.empty()) {
      release_cv_.wait(lock.native());  // Return() tells when the last chunk is back
      continue;
    }
    const auto due = last_return_ + release_idle_;
    if (std::chrono::steady_clock::now() < due) {
      release_cv_.wait_until(lock.native(), due);
      continue;
    }
    // One chunk at a time, out of the lock, so that an Acquire() meanwhile takes another
    // pinned chunk (and ends the release) instead of waiting for the whole pool.
    uint8_t* data = free_pinned_.back();
    free_pinned_.pop_back();
    ++releasing_;
    lock.Unlock();
    (void)munlock(data, chunk_bytes_);
    (void)madvise(data, chunk_bytes_, MADV_DONTNEED);
    resident_chunks_.fetch_sub(1, std::memory_order_relaxed);
    releases_.fetch_add(1, std::memory_order_relaxed);
    lock.Lock();
    --releasing_;
    free_unpinned_.push_back(data);
    cv_.notify_one();  // an Acquire() may be waiting for this very chunk
  }
}

void StagingPool::SetPressureListener(StagingPressureListener* listener) {
  MutexLock lock(&mu_);
  pressure_ = listener;
}

size_t StagingPool::used_bytes() const {
  MutexLock lock(&mu_);
  return (total_chunks_ - FreeLocked() - releasing_) * chunk_bytes_;
}

bool StagingPool::IsChunkLocked(const uint8_t* data) const {
  // Unsigned wrap-around makes a pointer below base_ fail the range check too.
  const size_t offset = reinterpret_cast<uintptr_t>(data) - reinterpret_cast<uintptr_t>(base_);
  if (offset < limit_bytes()) return offset % chunk_bytes_ == 0;
  return extra_.count(data) > 0;
}

void StagingPool::Return(uint8_t* data) {
  MutexLock lock(&mu_);
  if (!IsChunkLocked(data)) {
    spdlog::critical("staging pool: returned pointer {} is not a chunk of this pool",
                     static_cast<void*>(data));
    std::abort();
  }
  if (lent_.erase(data) > 0) {
    // A lent chunk's last holder let go: a spare for the next loan (reserved: no allocation).
    spares_.push_back(data);
    return;
  }
  if (FreeLocked() + releasing_ >= total_chunks_) {
    spdlog::critical("staging pool: chunk {} returned twice", static_cast<void*>(data));
    std::abort();
  }
  free_pinned_.push_back(data);  // it was pinned when it went out
  last_return_ = std::chrono::steady_clock::now();
  // Notified under the lock: once the last chunk is back, the owner may destroy the pool
  // (and cv_) as soon as it can take mu_.
  cv_.notify_one();
  if (FreeLocked() == total_chunks_) release_cv_.notify_one();
}

void StagingPool::SetLendLimit(size_t bytes) {
  MutexLock lock(&mu_);
  lend_limit_chunks_ = bytes / chunk_bytes_;
  // Chunks out of staging never outnumber the highest limit: Return() and TrimSpares() file
  // them without allocating.
  spares_.reserve(std::max(spares_.capacity(), lend_limit_chunks_));
  bare_spares_.reserve(std::max(bare_spares_.capacity(), lend_limit_chunks_));
}

bool StagingPool::Lend(const void* chunk) {
  const auto* data = static_cast<const uint8_t*>(chunk);
  MutexLock lock(&mu_);
  if (!IsChunkLocked(data)) {
    spdlog::critical("staging pool: lent pointer {} is not a chunk of this pool", chunk);
    std::abort();
  }
  if (lent_.count(data) > 0) return true;
  uint8_t* spare = nullptr;
  if (!spares_.empty()) {
    spare = spares_.back();
    spares_.pop_back();
  } else {
    if (lent_.size() + allocating_ >= lend_limit_chunks_) return false;
    uint8_t* bare = nullptr;
    if (!bare_spares_.empty()) {
      bare = bare_spares_.back();
      bare_spares_.pop_back();
    }
    ++allocating_;
    lock.Unlock();
    // Out of the lock: mapping and pinning a chunk faults in all of it.
    Memory memory;
    Status st;
    if (bare != nullptr) {
      st = LockChunk(bare);
    } else if (Result<Memory> made = AllocateLike(cuda_, chunk_bytes_, hugepages_); made.ok()) {
      memory = std::move(made).value();
      if (!memory.cuda) st = LockChunk(memory.base);
      if (!st.ok()) memory.free();
    } else {
      st = made.status();
    }
    lock.Lock();
    --allocating_;
    if (!st.ok()) {
      if (bare != nullptr) bare_spares_.push_back(bare);
      spdlog::debug("staging pool: no spare chunk for a loan: {}", st.ToString());
      return false;
    }
    spare = bare != nullptr ? bare : memory.base;
    if (bare == nullptr) extra_.emplace(memory.base, std::move(memory.free));
    lend_allocs_.fetch_add(1, std::memory_order_relaxed);
  }
  lent_.insert(data);
  free_pinned_.push_back(spare);  // staging is whole again: the lent chunk was out
  lends_.fetch_add(1, std::memory_order_relaxed);
  cv_.notify_one();
  return true;
}

uint64_t StagingPool::spare_bytes() const {
  MutexLock lock(&mu_);
  return spares_.size() * chunk_bytes_;
}

size_t StagingPool::lent_bytes() const {
  MutexLock lock(&mu_);
  return lent_.size() * chunk_bytes_;
}

size_t StagingPool::lent_and_spare_bytes() const {
  MutexLock lock(&mu_);
  return (lent_.size() + spares_.size()) * chunk_bytes_;
}

void StagingPool::TrimSpares(uint64_t keep_bytes) {
  std::vector<uint8_t*> bare;
  std::vector<std::function<void()>> frees;
  {
    MutexLock lock(&mu_);
    const size_t keep = keep_bytes / chunk_bytes_;
    if (cuda_) {
      // Only spares allocated for loans can be freed; the pool's own allocation is one.
      for (size_t i = spares_.size(); i-- > 0 && spares_.size() > keep;) {
        auto it = extra_.find(spares_[i]);
        if (it == extra_.end()) continue;
        frees.push_back(std::move(it->second));
        extra_.erase(it);
        spares_.erase(spares_.begin() + static_cast<std::ptrdiff_t>(i));
      }
    } else {
      while (spares_.size() > keep) {
        bare.push_back(spares_.back());
        spares_.pop_back();
      }
    }
  }
  for (uint8_t* data : bare) {
    (void)munlock(data, chunk_bytes_);
    (void)madvise(data, chunk_bytes_, MADV_DONTNEED);
  }
  for (auto& free : frees) free();
  if (!bare.empty()) {
    MutexLock lock(&mu_);
    bare_spares_.insert(bare_spares_.end(), bare.begin(), bare.end());
  }
}

}  // namespace ckptfs::gpu
