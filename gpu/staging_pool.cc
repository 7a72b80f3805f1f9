#include "gpu/staging_pool.h"

#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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
  std::string backend;
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
// process now rather than on the first write() of a checkpoint.
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

// Anonymous private memory, aligned to 2 MiB so transparent hugepages can back all of it
// (when `hugepages`), populated up front and locked when RLIMIT_MEMLOCK allows.
Result<Memory> AllocateHost(size_t bytes, bool hugepages) {
  if (bytes > SIZE_MAX - kHugePageBytes) return AllocFailed("mmap", bytes, ENOMEM);
  // Over-map by one hugepage and trim, since mmap only guarantees page alignment.
  const size_t mapped = bytes + kHugePageBytes;
  void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
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
  if (mlock(base, bytes) == 0) {
    memory.backend = "host-locked";
  } else {
    const int err = errno;
    (void)munlock(base, bytes);  // mlock may have locked a prefix before failing
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      spdlog::warn(
          "staging pool: mlock of {} failed ({}); using unlocked memory. Raise "
          "RLIMIT_MEMLOCK (ulimit -l) or grant CAP_IPC_LOCK to pin it",
          FormatBytes(bytes), std::strerror(err));
    }
    memory.backend = "host";
  }
  // A successful mlock has faulted every page in already, which makes this a cheap page-table
  // walk; it matters when mlock failed, or is a no-op as under ASan and TSan.
  if (Status st = Populate(base, bytes); !st.ok()) {
    memory.free();
    return st;
  }
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
  memory.backend = "cuda-pinned";
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
  if (backend == "host") return AllocateHost(bytes, hugepages);
#if defined(CKPTFS_HAVE_CUDA)
  std::string why;
  const CudaRuntime* rt = UsableCuda(&why);
  if (rt != nullptr) {
    Result<Memory> memory = AllocateCuda(*rt, bytes);
    if (memory.ok() || backend == "cuda") return memory;
    // auto: host memory without CUDA registration is still better than no mount.
    spdlog::warn("staging pool: {}; falling back to host memory", memory.status().message());
    *note = "cudaHostAlloc failed";
    return AllocateHost(bytes, hugepages);
  }
  if (backend == "cuda") return Unsupported("staging backend \"cuda\" is unavailable: " + why);
  *note = "CUDA unavailable: " + why;
#else
  if (backend == "cuda") {
    return Unsupported("staging backend \"cuda\" is unavailable: ckptfs was built without CUDA");
  }
  *note = "built without CUDA";
#endif
  return AllocateHost(bytes, hugepages);
}

}  // namespace

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

  std::string note;
  CKPT_ASSIGN_OR_RETURN(Memory memory, Allocate(backend, chunks * chunk, options.hugepages, &note));

  std::unique_ptr<StagingPool> pool(new StagingPool());
  pool->chunk_bytes_ = chunk;
  pool->total_chunks_ = chunks;
  pool->base_ = memory.base;
  pool->backend_ = std::move(memory.backend);
  pool->free_memory_ = std::move(memory.free);
  // Reserved once, so Return() never allocates. Reversed so the lowest chunk goes out first.
  {
    MutexLock lock(&pool->mu_);  // nobody else has the pool yet; taken for the analysis
    pool->free_.reserve(chunks);
    for (size_t i = chunks; i-- > 0;) pool->free_.push_back(memory.base + i * chunk);
  }

  spdlog::info("staging pool: {} as {} chunks of {}, backend {}{}", FormatBytes(chunks * chunk),
               chunks, FormatBytes(chunk), pool->backend_, note.empty() ? "" : " (" + note + ")");
  return pool;
}

StagingPool::~StagingPool() {
  size_t out;
  {
    // Taken so that a Return() still finishing on another thread completes first.
    MutexLock lock(&mu_);
    out = total_chunks_ - free_.size();
  }
  if (out != 0) {
    spdlog::critical("staging pool destroyed with {} of {} chunks still in use", out,
                     total_chunks_);
    std::abort();
  }
  if (free_memory_) free_memory_();
}

// Both acquire paths tell the pressure listener once, and count a wait, only when they are
// about to block; TryAcquireFor with a zero timeout never blocks and does neither.
ChunkBuffer StagingPool::Acquire() {
  MutexLock lock(&mu_);
  if (free_.empty()) {
    waits_.fetch_add(1, std::memory_order_relaxed);
    const auto wait_start = std::chrono::steady_clock::now();
    if (StagingPressureListener* pressure = pressure_) {
      lock.Unlock();
      pressure->RelieveStagingPressure();
      lock.Lock();
    }
    while (free_.empty()) cv_.wait(lock.native());
    StagingWaitHistogram().Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count());
  }
  uint8_t* data = free_.back();
  free_.pop_back();
  return ChunkBuffer(this, data, chunk_bytes_);
}

ChunkBuffer StagingPool::TryAcquireFor(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  MutexLock lock(&mu_);
  if (free_.empty()) {
    if (timeout <= std::chrono::milliseconds::zero()) return ChunkBuffer();
    waits_.fetch_add(1, std::memory_order_relaxed);
    const auto wait_start = std::chrono::steady_clock::now();
    if (StagingPressureListener* pressure = pressure_) {
      lock.Unlock();
      pressure->RelieveStagingPressure();
      lock.Lock();
    }
    while (free_.empty()) {
      if (cv_.wait_until(lock.native(), deadline) == std::cv_status::timeout) break;
    }
    const bool got = !free_.empty();
    StagingWaitHistogram().Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count());
    if (!got) return ChunkBuffer();
  }
  uint8_t* data = free_.back();
  free_.pop_back();
  return ChunkBuffer(this, data, chunk_bytes_);
}

void StagingPool::SetPressureListener(StagingPressureListener* listener) {
  MutexLock lock(&mu_);
  pressure_ = listener;
}

size_t StagingPool::used_bytes() const {
  MutexLock lock(&mu_);
  return (total_chunks_ - free_.size()) * chunk_bytes_;
}

void StagingPool::Return(uint8_t* data) {
  // Unsigned wrap-around makes a pointer below base_ fail the range check too.
  const size_t offset = reinterpret_cast<uintptr_t>(data) - reinterpret_cast<uintptr_t>(base_);
  if (offset >= limit_bytes() || offset % chunk_bytes_ != 0) {
    spdlog::critical("staging pool: returned pointer {} is not a chunk of this pool",
                     static_cast<void*>(data));
    std::abort();
  }
  MutexLock lock(&mu_);
  if (free_.size() >= total_chunks_) {
    spdlog::critical("staging pool: chunk at offset {} returned twice", offset);
    std::abort();
  }
  free_.push_back(data);
  // Notified under the lock: once the last chunk is back, the owner may destroy the pool
  // (and cv_) as soon as it can take mu_.
  cv_.notify_one();
}

}  // namespace ckptfs::gpu
