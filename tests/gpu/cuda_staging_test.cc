// Staging from device memory: a tensor's bytes copied by the CUDA runtime out of device memory
// into a chunk of the staging pool arrive intact, and the "cuda" backend's chunks are really
// pinned (the copy into them beats a copy into pageable memory of the same size).
//
// Runs wherever a CUDA runtime and device are present; skips elsewhere, unless
// CKPTFS_EXPECT_GPU=1 (scripts/gpu_check.sh on a GPU machine), where a missing GPU fails.
// The runtime is resolved with dlopen, as the pool does, so this binary starts without CUDA.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu/staging_pool.h"

namespace ckptfs::gpu {
namespace {

constexpr int kHostToDevice = 1;  // cudaMemcpyKind
constexpr int kDeviceToHost = 2;

// The handful of runtime calls the test needs; cudaError_t is an int-sized enum (0 = success).
struct Cuda {
  int (*get_device_count)(int*) = nullptr;
  int (*malloc)(void**, size_t) = nullptr;
  int (*free)(void*) = nullptr;
  int (*memcpy)(void*, const void*, size_t, int) = nullptr;
  int (*synchronize)() = nullptr;
  std::string why;  // empty when usable

  static Cuda Load() {
    Cuda cuda;
    void* lib = nullptr;
    for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
      if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    }
    if (lib == nullptr) {
      cuda.why = "libcudart.so not found";
      return cuda;
    }
    cuda.get_device_count = reinterpret_cast<int (*)(int*)>(dlsym(lib, "cudaGetDeviceCount"));
    cuda.malloc = reinterpret_cast<int (*)(void**, size_t)>(dlsym(lib, "cudaMalloc"));
    cuda.free = reinterpret_cast<int (*)(void*)>(dlsym(lib, "cudaFree"));
    cuda.memcpy =
        reinterpret_cast<int (*)(void*, const void*, size_t, int)>(dlsym(lib, "cudaMemcpy"));
    cuda.synchronize = reinterpret_cast<int (*)()>(dlsym(lib, "cudaDeviceSynchronize"));
    if (!cuda.get_device_count || !cuda.malloc || !cuda.free || !cuda.memcpy ||
        !cuda.synchronize) {
      cuda.why = "libcudart lacks a symbol the test needs";
      return cuda;
    }
    int devices = 0;
    if (int err = cuda.get_device_count(&devices); err != 0 || devices == 0) {
      cuda.why = "no CUDA device (cudaGetDeviceCount: " + std::to_string(err) + ", " +
                 std::to_string(devices) + " devices)";
    }
    return cuda;
  }
};

bool GpuExpected() {
  const char* v = std::getenv("CKPTFS_EXPECT_GPU");
  return v != nullptr && std::string(v) == "1";
}

// Device buffer freed on scope exit.
struct DeviceBuffer {
  const Cuda& cuda;
  void* ptr = nullptr;
  DeviceBuffer(const Cuda& c, size_t bytes) : cuda(c) {
    if (cuda.malloc(&ptr, bytes) != 0) ptr = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr != nullptr) cuda.free(ptr);
  }
};

// Seconds per copy of `bytes` from device memory into `dst`: the best of `reps`.
double BestCopySeconds(const Cuda& cuda, void* dst, const void* src, size_t bytes, int reps) {
  double best = 1e9;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(cuda.memcpy(dst, src, bytes, kDeviceToHost), 0);
    EXPECT_EQ(cuda.synchronize(), 0);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                              .count());
  }
  return best;
}

TEST(CudaStaging, DeviceMemoryCopiedIntoPinnedChunksArrivesIntactAndFasterThanPageable) {
  Cuda cuda = Cuda::Load();
  if (!cuda.why.empty()) {
    if (GpuExpected()) FAIL() << "CKPTFS_EXPECT_GPU=1 but CUDA is unusable: " << cuda.why;
    GTEST_SKIP() << cuda.why;
  }
  constexpr size_t kChunkBytes = size_t{64} << 20;
  constexpr size_t kChunks = 4;
  StagingOptions options;
  options.chunk_bytes = kChunkBytes;
  options.total_bytes = kChunks * kChunkBytes;
  options.backend = "cuda";
  auto pool = StagingPool::Create(options);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ASSERT_EQ((*pool)->backend(), "cuda-pinned");

  // A "tensor" in device memory with a pattern no two chunks share.
  const size_t total = kChunks * kChunkBytes;
  std::vector<uint8_t> pattern(total);
  for (size_t i = 0; i < total; ++i) pattern[i] = static_cast<uint8_t>((i * 131 + i / 4099) & 0xff);
  DeviceBuffer tensor(cuda, total);
  ASSERT_NE(tensor.ptr, nullptr) << "cudaMalloc of " << total << " bytes failed";
  ASSERT_EQ(cuda.memcpy(tensor.ptr, pattern.data(), total, kHostToDevice), 0);

  // Stage it chunk by chunk, as a save's write() lands in the pool.
  std::vector<ChunkBuffer> chunks;
  for (size_t c = 0; c < kChunks; ++c) {
    chunks.push_back((*pool)->Acquire());
    ASSERT_TRUE(chunks.back());
    ASSERT_EQ(cuda.memcpy(chunks.back().data(),
                          static_cast<const uint8_t*>(tensor.ptr) + c * kChunkBytes, kChunkBytes,
                          kDeviceToHost),
              0);
  }
  for (size_t c = 0; c < kChunks; ++c) {
    ASSERT_EQ(std::memcmp(chunks[c].data(), pattern.data() + c * kChunkBytes, kChunkBytes), 0)
        << "chunk " << c;
  }

  // Pinned against pageable, the same bytes, best of 5 each.
  std::unique_ptr<uint8_t[]> pageable(new uint8_t[kChunkBytes]);
  std::memset(pageable.get(), 0, kChunkBytes);  // fault it in: time the copy, not page faults
  const double pinned_s = BestCopySeconds(cuda, chunks[0].data(), tensor.ptr, kChunkBytes, 5);
  const double pageable_s = BestCopySeconds(cuda, pageable.get(), tensor.ptr, kChunkBytes, 5);
  const double gbps_pinned = kChunkBytes / pinned_s / 1e9;
  const double gbps_pageable = kChunkBytes / pageable_s / 1e9;
  std::printf("device->staging chunk (cuda-pinned): %.1f GB/s; device->pageable: %.1f GB/s\n",
              gbps_pinned, gbps_pageable);
  RecordProperty("device_to_pinned_gbps", std::to_string(gbps_pinned));
  RecordProperty("device_to_pageable_gbps", std::to_string(gbps_pageable));
  // Pinned memory is copied by DMA at the link's speed; pageable goes through a bounce buffer.
  EXPECT_GT(gbps_pinned, gbps_pageable) << "the cuda backend's chunks do not behave as pinned";
}

}  // namespace
}  // namespace ckptfs::gpu
