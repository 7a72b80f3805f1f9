#include "gpu/staging_pool.h"

#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ckptfs::gpu {
namespace {

using std::chrono::milliseconds;

// The pool's pressure listener as a function, for tests.
struct OnPressure final : gpu::StagingPressureListener {
  explicit OnPressure(std::function<void()> fn) : fn(std::move(fn)) {}
  void RelieveStagingPressure() override { fn(); }
  std::function<void()> fn;
};

constexpr size_t kChunk = size_t{64} << 10;

std::unique_ptr<StagingPool> MakePool(size_t chunks, const std::string& backend = "host") {
  StagingOptions options;
  options.chunk_bytes = kChunk;
  options.total_bytes = chunks * kChunk;
  options.backend = backend;
  auto pool = StagingPool::Create(options);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  return pool.ok() ? std::move(pool).value() : nullptr;
}

Status CreateStatus(size_t total_bytes, size_t chunk_bytes, const std::string& backend) {
  StagingOptions options;
  options.total_bytes = total_bytes;
  options.chunk_bytes = chunk_bytes;
  options.backend = backend;
  return StagingPool::Create(options).status();
}

TEST(StagingPool, RejectsChunkSizeThatIsNotAPageMultiple) {
  Status st = CreateStatus(size_t{1} << 20, kChunk + 512, "host");
  EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
  EXPECT_NE(st.message().find("chunk_bytes"), std::string::npos) << st.message();
}

TEST(StagingPool, RejectsChunkSizeBelow64KiB) {
  Status st = CreateStatus(size_t{1} << 20, 32 << 10, "host");
  EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
  EXPECT_EQ(CreateStatus(size_t{1} << 20, 0, "host").code(), Code::kInvalid);
}

TEST(StagingPool, RejectsTotalSmallerThanOneChunk) {
  Status st = CreateStatus(kChunk - 1, kChunk, "host");
  EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
  EXPECT_NE(st.message().find("smaller than one chunk"), std::string::npos) << st.message();
  EXPECT_EQ(CreateStatus(0, kChunk, "host").code(), Code::kInvalid);
}

TEST(StagingPool, RejectsUnknownBackend) {
  Status st = CreateStatus(size_t{1} << 20, kChunk, "gpu");
  EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
  EXPECT_NE(st.message().find("gpu"), std::string::npos) << st.message();
}

TEST(StagingPool, RoundsTotalDownToWholeChunks) {
  StagingOptions options;
  options.chunk_bytes = kChunk;
  options.total_bytes = 3 * kChunk + kChunk / 2;
  options.backend = "host";
  auto pool = StagingPool::Create(options);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->chunk_bytes(), kChunk);
  EXPECT_EQ((*pool)->total_chunks(), 3u);
  EXPECT_EQ((*pool)->limit_bytes(), 3 * kChunk);
  EXPECT_EQ((*pool)->used_bytes(), 0u);
}

TEST(StagingPool, UsedBytesCountsChunksOutstanding) {
  auto pool = MakePool(4);
  ASSERT_NE(pool, nullptr);
  std::vector<ChunkBuffer> held;
  for (size_t i = 1; i <= 4; ++i) {
    held.push_back(pool->Acquire());
    EXPECT_EQ(pool->used_bytes(), i * kChunk);
  }
  EXPECT_FALSE(pool->TryAcquireFor(milliseconds(0)));
  held.pop_back();
  EXPECT_EQ(pool->used_bytes(), 3 * kChunk);
  held.clear();
  EXPECT_EQ(pool->used_bytes(), 0u);
  EXPECT_EQ(pool->waits(), 0u);
}

TEST(StagingPool, ChunksArePageAlignedDisjointAndWritable) {
  auto pool = MakePool(8);
  ASSERT_NE(pool, nullptr);
  std::vector<ChunkBuffer> held;
  std::set<uint8_t*> starts;
  for (int i = 0; i < 8; ++i) {
    ChunkBuffer chunk = pool->Acquire();
    ASSERT_TRUE(chunk);
    EXPECT_EQ(chunk.capacity(), kChunk);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(chunk.data()) % 4096, 0u);
    std::memset(chunk.data(), i, chunk.capacity());
    starts.insert(chunk.data());
    held.push_back(std::move(chunk));
  }
  ASSERT_EQ(starts.size(), 8u);
  // Sorted starts one chunk apart means no two chunks overlap.
  uint8_t* prev = nullptr;
  for (uint8_t* p : starts) {
    if (prev != nullptr) {
      EXPECT_GE(static_cast<size_t>(p - prev), kChunk);
    }
    prev = p;
  }
  for (int i = 0; i < 8; ++i) {
    const ChunkBuffer& c = held[i];
    EXPECT_EQ(c.data()[0], i);
    EXPECT_EQ(c.data()[c.capacity() - 1], i);
  }
}

bool AllResident(const uint8_t* data, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident(bytes / page);
  EXPECT_EQ(mincore(const_cast<uint8_t*>(data), bytes, resident.data()), 0) << strerror(errno);
  return std::all_of(resident.begin(), resident.end(), [](unsigned char v) { return v & 1; });
}

bool NoneResident(const uint8_t* data, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident(bytes / page);
  EXPECT_EQ(mincore(const_cast<uint8_t*>(data), bytes, resident.data()), 0) << strerror(errno);
  return std::none_of(resident.begin(), resident.end(), [](unsigned char v) { return v & 1; });
}

TEST(StagingPool, AcquiredChunksAreResident) {
  auto pool = MakePool(16);
  ASSERT_NE(pool, nullptr);
  std::vector<ChunkBuffer> held;
  for (int i = 0; i < 16; ++i) held.push_back(pool->Acquire());
  for (const ChunkBuffer& chunk : held) {
    EXPECT_TRUE(AllResident(chunk.data(), chunk.capacity()))
        << "a chunk's pages were not populated when it was acquired";
  }
  EXPECT_EQ(pool->resident_bytes(), 16 * kChunk);
  EXPECT_EQ(pool->pins(), 16u);
}

// A daemon that only reads must hold no staging memory: chunks are pinned as first used,
// and a returned chunk stays pinned and goes out again before an unpinned one.
TEST(StagingPool, HostChunksArePinnedOnFirstUseAndKept) {
  auto pool = MakePool(16);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->resident_bytes(), 0u);
  EXPECT_EQ(pool->pins(), 0u);
  uint8_t* first = nullptr;
  {
    ChunkBuffer chunk = pool->Acquire();
    first = chunk.data();
    EXPECT_EQ(pool->resident_bytes(), kChunk);
    EXPECT_EQ(pool->pins(), 1u);
  }
  EXPECT_EQ(pool->resident_bytes(), kChunk) << "a returned chunk stays pinned";
  ChunkBuffer again = pool->Acquire();
  EXPECT_EQ(again.data(), first) << "the pinned chunk goes out before an unpinned one";
  EXPECT_EQ(pool->pins(), 1u);
  ChunkBuffer second = pool->Acquire();
  EXPECT_EQ(pool->pins(), 2u);
  EXPECT_EQ(pool->resident_bytes(), 2 * kChunk);
  EXPECT_EQ(pool->releases(), 0u);
}

std::unique_ptr<StagingPool> MakeReleasingPool(size_t chunks, milliseconds release_idle) {
  StagingOptions options;
  options.chunk_bytes = kChunk;
  options.total_bytes = chunks * kChunk;
  options.backend = "host";
  options.release_idle = release_idle;
  auto pool = StagingPool::Create(options);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  return pool.ok() ? std::move(pool).value() : nullptr;
}

template <typename Pred>
bool WaitFor(Pred pred, milliseconds limit = milliseconds(10000)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return true;
}

TEST(StagingPool, IdleChunksAreGivenBackAfterReleaseIdleAndPinnedAgainOnUse) {
  auto pool = MakeReleasingPool(4, milliseconds(100));
  ASSERT_NE(pool, nullptr);
  std::vector<uint8_t*> addresses;
  {
    std::vector<ChunkBuffer> held;
    for (int i = 0; i < 3; ++i) {
      held.push_back(pool->Acquire());
      std::memset(held.back().data(), 0x5a, kChunk);
      addresses.push_back(held.back().data());
    }
    // Held longer than release_idle: nothing is given back while a chunk is out.
    std::this_thread::sleep_for(milliseconds(300));
    EXPECT_EQ(pool->resident_bytes(), 3 * kChunk);
    EXPECT_EQ(pool->releases(), 0u);
  }
  ASSERT_TRUE(WaitFor([&] { return pool->resident_bytes() == 0; }))
      << pool->resident_bytes() << " bytes still pinned";
  EXPECT_EQ(pool->releases(), 3u);
  EXPECT_EQ(pool->used_bytes(), 0u);
  for (uint8_t* address : addresses) {
    EXPECT_TRUE(NoneResident(address, kChunk)) << "a released chunk kept its pages";
  }
  ChunkBuffer chunk = pool->Acquire();
  EXPECT_EQ(pool->pins(), 4u);
  EXPECT_TRUE(AllResident(chunk.data(), kChunk));
  EXPECT_EQ(chunk.data()[0], 0) << "given-back memory comes back zeroed";
  std::memset(chunk.data(), 0x33, kChunk);
  EXPECT_EQ(chunk.data()[kChunk - 1], 0x33);
  EXPECT_EQ(pool->waits(), 0u);
}

// Acquires racing the release thread, with a pool of one chunk so that an Acquire() often
// finds its only chunk being unpinned: it gets it without counting a wait, and the pool's
// accounting stays whole.
TEST(StagingPool, AcquireRacingTheReleaseThreadNeitherWaitsNorLosesAChunk) {
  auto pool = MakeReleasingPool(1, milliseconds(1));
  ASSERT_NE(pool, nullptr);
  for (int i = 0; i < 300; ++i) {
    ChunkBuffer chunk = pool->TryAcquireFor(milliseconds(5000));
    ASSERT_TRUE(chunk) << "round " << i;
    std::memset(chunk.data(), i & 0xff, 4096);
    EXPECT_EQ(pool->used_bytes(), kChunk);
    chunk = ChunkBuffer();
    std::this_thread::sleep_for(std::chrono::microseconds(i % 3 == 0 ? 1500 : 200));
  }
  EXPECT_EQ(pool->waits(), 0u);
  EXPECT_EQ(pool->used_bytes(), 0u);
  EXPECT_GE(pool->pins(), 1u);
  EXPECT_LE(pool->releases(), pool->pins());
}

TEST(StagingPool, TryAcquireForReturnsEmptyWhenExhausted) {
  auto pool = MakePool(1);
  ASSERT_NE(pool, nullptr);
  ChunkBuffer held = pool->Acquire();
  ChunkBuffer none = pool->TryAcquireFor(milliseconds(20));
  EXPECT_FALSE(none);
  EXPECT_EQ(none.data(), nullptr);
  EXPECT_EQ(none.capacity(), 0u);
  EXPECT_EQ(pool->used_bytes(), kChunk);
  EXPECT_EQ(pool->waits(), 1u);
  // A zero timeout is a plain try: it neither waits nor counts one.
  EXPECT_FALSE(pool->TryAcquireFor(milliseconds(0)));
  EXPECT_EQ(pool->waits(), 1u);
}

TEST(StagingPool, AcquireBlocksWhenExhaustedAndWakesWhenChunkReturned) {
  auto pool = MakePool(1);
  ASSERT_NE(pool, nullptr);
  ChunkBuffer held = pool->Acquire();
  uint8_t* const held_data = held.data();

  // The pressure callback runs just before Acquire() blocks: the hook that says the
  // waiter has found the pool empty. The TryAcquireFor below calls it again.
  std::promise<void> about_to_block;
  std::atomic<int> pressure_calls{0};
  OnPressure on_pressure([&] {
    if (pressure_calls.fetch_add(1) == 0) about_to_block.set_value();
  });
  pool->SetPressureListener(&on_pressure);
  std::atomic<bool> acquired{false};
  std::thread waiter([&] {
    ChunkBuffer chunk = pool->Acquire();
    EXPECT_TRUE(chunk);
    EXPECT_EQ(chunk.data(), held_data);
    acquired.store(true);
  });
  about_to_block.get_future().wait();
  // Still exhausted, so the waiter cannot have been handed a chunk.
  EXPECT_FALSE(pool->TryAcquireFor(milliseconds(20)));
  EXPECT_FALSE(acquired.load());

  held = ChunkBuffer();  // returns the chunk and wakes the waiter
  waiter.join();
  EXPECT_TRUE(acquired.load());
  EXPECT_EQ(pool->used_bytes(), 0u);
  EXPECT_EQ(pool->waits(), 2u);  // the waiter and the TryAcquireFor above
  EXPECT_EQ(pressure_calls.load(), 2);
}

TEST(StagingPool, TryAcquireForWakesWhenChunkReturnedBeforeTimeout) {
  auto pool = MakePool(1);
  ASSERT_NE(pool, nullptr);
  ChunkBuffer held = pool->Acquire();
  std::promise<void> about_to_block;
  OnPressure on_pressure([&] { about_to_block.set_value(); });
  pool->SetPressureListener(&on_pressure);
  std::thread waiter([&] {
    // Far longer than the test can take, so success means it was woken.
    ChunkBuffer chunk = pool->TryAcquireFor(milliseconds(60'000));
    EXPECT_TRUE(chunk);
  });
  about_to_block.get_future().wait();
  held = ChunkBuffer();
  waiter.join();
  EXPECT_EQ(pool->used_bytes(), 0u);
}

TEST(StagingPool, PressureCallbackIsCalledOnceWhenExhaustedAndMayReturnChunks) {
  auto pool = MakePool(2);
  ASSERT_NE(pool, nullptr);
  int calls = 0;
  std::vector<ChunkBuffer> sealed;
  // Like the write path sealing partly filled chunks: the callback frees one. It runs
  // without pool locks, so returning a chunk from inside it must not deadlock.
  OnPressure on_pressure([&] {
    ++calls;
    sealed.pop_back();
  });
  pool->SetPressureListener(&on_pressure);
  sealed.push_back(pool->Acquire());
  sealed.push_back(pool->Acquire());
  EXPECT_EQ(calls, 0) << "not called while chunks are free";

  ChunkBuffer chunk = pool->Acquire();
  EXPECT_TRUE(chunk);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(pool->waits(), 1u);
  EXPECT_EQ(pool->used_bytes(), 2 * kChunk);

  pool->SetPressureListener(nullptr);
  sealed.clear();
}

TEST(StagingPool, DefaultChunkBufferIsEmpty) {
  ChunkBuffer chunk;
  EXPECT_FALSE(chunk);
  EXPECT_EQ(chunk.data(), nullptr);
  EXPECT_EQ(chunk.capacity(), 0u);
}

TEST(StagingPool, MoveConstructionTransfersChunkAndEmptiesSource) {
  auto pool = MakePool(2);
  ASSERT_NE(pool, nullptr);
  ChunkBuffer a = pool->Acquire();
  uint8_t* data = a.data();
  ChunkBuffer b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): the contract under test
  EXPECT_EQ(a.capacity(), 0u);
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.capacity(), kChunk);
  EXPECT_EQ(pool->used_bytes(), kChunk);
  b = ChunkBuffer();
  EXPECT_EQ(pool->used_bytes(), 0u);
}

TEST(StagingPool, MoveAssignmentReturnsTheOverwrittenChunk) {
  auto pool = MakePool(2);
  ASSERT_NE(pool, nullptr);
  ChunkBuffer a = pool->Acquire();
  ChunkBuffer b = pool->Acquire();
  uint8_t* b_data = b.data();
  EXPECT_EQ(pool->used_bytes(), 2 * kChunk);
  a = std::move(b);
  EXPECT_EQ(a.data(), b_data);
  EXPECT_FALSE(b);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(pool->used_bytes(), kChunk);
  // The returned chunk is immediately reusable.
  ChunkBuffer c = pool->TryAcquireFor(milliseconds(0));
  EXPECT_TRUE(c);
}

TEST(StagingPool, ConcurrentAcquireReleaseNeverExceedsTotalChunks) {
  constexpr size_t kChunks = 4;
  constexpr int kThreads = 8;
  constexpr int kIterations = 2000;
  auto pool = MakePool(kChunks);
  ASSERT_NE(pool, nullptr);
  std::atomic<int> pressure_calls{0};
  OnPressure on_pressure([&] { pressure_calls.fetch_add(1); });
  pool->SetPressureListener(&on_pressure);

  std::atomic<size_t> in_use{0};
  std::atomic<size_t> high_water{0};
  std::atomic<int> corrupted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIterations; ++i) {
        ChunkBuffer chunk = (i % 3 == 0) ? pool->TryAcquireFor(milliseconds(1)) : pool->Acquire();
        if (!chunk) continue;
        size_t now = in_use.fetch_add(1) + 1;
        size_t seen = high_water.load();
        while (now > seen && !high_water.compare_exchange_weak(seen, now)) {
        }
        // A chunk handed to two threads at once would see the other's tag.
        const uint64_t tag = (uint64_t{static_cast<uint32_t>(t)} << 32) | static_cast<uint32_t>(i);
        std::memcpy(chunk.data(), &tag, sizeof(tag));
        std::memcpy(chunk.data() + chunk.capacity() - sizeof(tag), &tag, sizeof(tag));
        std::this_thread::yield();
        uint64_t head, tail;
        std::memcpy(&head, chunk.data(), sizeof(head));
        std::memcpy(&tail, chunk.data() + chunk.capacity() - sizeof(tail), sizeof(tail));
        if (head != tag || tail != tag) corrupted.fetch_add(1);
        in_use.fetch_sub(1);
      }
    });
  }
  for (std::thread& th : threads) th.join();

  EXPECT_LE(high_water.load(), kChunks);
  EXPECT_GE(high_water.load(), 1u);
  EXPECT_EQ(corrupted.load(), 0);
  EXPECT_EQ(pool->used_bytes(), 0u);
  EXPECT_EQ(static_cast<uint64_t>(pressure_calls.load()), pool->waits());
}

TEST(StagingPool, HostBackendUsesHostMemory) {
  auto pool = MakePool(4, "host");
  ASSERT_NE(pool, nullptr);
  EXPECT_TRUE(pool->backend() == "host" || pool->backend() == "host-locked") << pool->backend();
}

TEST(StagingPool, SmallHostPoolIsLockedWhenMemlockLimitAllows) {
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &limit), 0);
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < (size_t{4} << 20)) {
    GTEST_SKIP() << "RLIMIT_MEMLOCK is " << limit.rlim_cur << " bytes";
  }
  auto pool = MakePool(4, "host");
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->backend(), "host-locked");
}

// In a death-test child: gives up CAP_IPC_LOCK, so RLIMIT_MEMLOCK binds. 0, or an exit code.
int DropIpcLock() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[_LINUX_CAPABILITY_U32S_3] = {};
  if (syscall(SYS_capget, &header, caps) != 0) return 10;
  caps[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  caps[CAP_IPC_LOCK / 32].permitted &= ~(1u << (CAP_IPC_LOCK % 32));
  if (syscall(SYS_capset, &header, caps) != 0) return 11;
  return 0;
}

// Runs in a child process: drops CAP_IPC_LOCK and lowers RLIMIT_MEMLOCK so that mlock must
// fail, then checks that the pool still works on populated, unlocked memory.
int CreatePoolWhereMlockFails() {
  if (int rc = DropIpcLock(); rc != 0) return rc;
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return 12;
  limit.rlim_cur = kChunk;
  if (setrlimit(RLIMIT_MEMLOCK, &limit) != 0) return 13;

  StagingOptions options;
  options.chunk_bytes = kChunk;
  options.total_bytes = 16 * kChunk;
  options.backend = "host";
  auto pool = StagingPool::Create(options);
  if (!pool.ok()) {
    std::fprintf(stderr, "Create: %s\n", pool.status().ToString().c_str());
    return 14;
  }
  if ((*pool)->backend() != "host") {
    std::fprintf(stderr, "backend %s\n", (*pool)->backend().c_str());
    return 15;
  }
  std::vector<ChunkBuffer> held;
  for (int i = 0; i < 16; ++i) held.push_back((*pool)->Acquire());
  std::vector<unsigned char> resident(kChunk / static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  for (const ChunkBuffer& chunk : held) {
    if (mincore(chunk.data(), chunk.capacity(), resident.data()) != 0) return 16;
    for (unsigned char v : resident) {
      if (!(v & 1)) return 17;
    }
    std::memset(chunk.data(), 0x5a, chunk.capacity());
  }
  return 0;
}

// g++ announces ASan and TSan with __SANITIZE_*__, clang (before 16) only via __has_feature.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define CKPTFS_TEST_MLOCK_IS_FAKED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define CKPTFS_TEST_MLOCK_IS_FAKED 1
#endif
#endif

TEST(StagingPoolDeathTest, MlockFailureFallsBackToPopulatedUnlockedMemory) {
#ifdef CKPTFS_TEST_MLOCK_IS_FAKED
  GTEST_SKIP() << "ASan and TSan replace mlock with a no-op that succeeds";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(CreatePoolWhereMlockFails()), testing::ExitedWithCode(0), "");
}

// Runs in a child process: RLIMIT_MEMLOCK fits each of two pools alone but not both, so a
// later chunk's mlock fails. That pool goes on with populated, unlocked memory and says so.
int PinWhereALaterMlockFails() {
  if (int rc = DropIpcLock(); rc != 0) return rc;
  size_t locked_kib = 0;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, f) != nullptr) {
      std::sscanf(line, "VmLck: %zu kB", &locked_kib);
    }
    std::fclose(f);
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return 12;
  limit.rlim_cur = (locked_kib << 10) + 3 * kChunk;
  if (setrlimit(RLIMIT_MEMLOCK, &limit) != 0) return 13;

  auto a = MakePool(2);
  auto b = MakePool(2);
  if (a == nullptr || b == nullptr) return 14;
  if (a->backend() != "host-locked" || b->backend() != "host-locked") return 15;
  std::vector<ChunkBuffer> held;
  for (int i = 0; i < 2; ++i) held.push_back(a->Acquire());
  for (int i = 0; i < 2; ++i) held.push_back(b->Acquire());
  for (const ChunkBuffer& chunk : held) {
    if (!chunk || !AllResident(chunk.data(), chunk.capacity())) return 16;
    std::memset(chunk.data(), 0x5a, chunk.capacity());
  }
  if (a->backend() != "host-locked") return 17;
  if (b->backend() != "host") {
    std::fprintf(stderr, "backend %s\n", b->backend().c_str());
    return 18;
  }
  if (b->resident_bytes() != 2 * kChunk) return 19;
  return 0;
}

TEST(StagingPoolDeathTest, ALaterMlockFailureFallsBackToUnlockedMemoryAndSaysSo) {
#ifdef CKPTFS_TEST_MLOCK_IS_FAKED
  GTEST_SKIP() << "ASan and TSan replace mlock with a no-op that succeeds";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(PinWhereALaterMlockFails()), testing::ExitedWithCode(0), "");
}

// Consistent on machines with and without a GPU: "cuda" either works or fails with
// Unsupported, and "auto" picks CUDA exactly when "cuda" works.
TEST(StagingPool, CudaBackendFailsCleanlyWithoutGpuAndAutoFallsBackToHost) {
  StagingOptions options;
  options.chunk_bytes = kChunk;
  options.total_bytes = 4 * kChunk;
  options.backend = "cuda";
  auto cuda = StagingPool::Create(options);
  options.backend = "auto";
  auto automatic = StagingPool::Create(options);
  ASSERT_TRUE(automatic.ok()) << automatic.status().ToString();
  if (cuda.ok()) {
    EXPECT_EQ((*cuda)->backend(), "cuda-pinned");
    EXPECT_EQ((*automatic)->backend(), "cuda-pinned");
    ChunkBuffer chunk = (*cuda)->Acquire();
    std::memset(chunk.data(), 0xab, chunk.capacity());
  } else {
    EXPECT_EQ(cuda.status().code(), Code::kUnsupported) << cuda.status().ToString();
    EXPECT_NE(cuda.status().message().find("cuda"), std::string::npos);
    const std::string& backend = (*automatic)->backend();
    EXPECT_TRUE(backend == "host" || backend == "host-locked") << backend;
  }
}

// A cgroup tree in a temporary directory, for MemoryCgroupHeadroom.
class CgroupTree {
 public:
  CgroupTree() {
    char tmpl[] = "/tmp/ckptfs-cgroup-test-XXXXXX";
    root_ = ::mkdtemp(tmpl);
  }
  ~CgroupTree() { std::filesystem::remove_all(root_); }
  const std::string& root() const { return root_; }
  void Write(const std::string& rel, const std::string& text) {
    const std::filesystem::path path = root_ + "/" + rel;
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path) << text;
  }

 private:
  std::string root_;
};

constexpr uint64_t kMiB = uint64_t{1} << 20;

TEST(MemoryCgroupHeadroom, V1TakesTheLeastHeadroomOverTheCgroupAndItsAncestorsLessPageCache) {
  CgroupTree tree;
  // The job's cgroup: 1 GiB limit, 700 MiB used of which 500 MiB page cache: 824 MiB left.
  tree.Write("memory/jobs/job1/memory.limit_in_bytes", std::to_string(1024 * kMiB) + "\n");
  tree.Write("memory/jobs/job1/memory.usage_in_bytes", std::to_string(700 * kMiB) + "\n");
  tree.Write("memory/jobs/job1/memory.stat",
             "cache 1\nrss 2\ntotal_cache " + std::to_string(500 * kMiB) + "\ntotal_rss 3\n");
  // Its parent: unlimited (v1 writes 2^63 rounded down to a page).
  tree.Write("memory/jobs/memory.limit_in_bytes", "9223372036854771712\n");
  tree.Write("memory/jobs/memory.usage_in_bytes", std::to_string(900 * kMiB) + "\n");
  const std::string self = "12:pids:/jobs/job1\n4:cpu,memory:/jobs/job1\n0::/\n";
  EXPECT_EQ(MemoryCgroupHeadroom(self, tree.root()), 824 * kMiB);

  // A tighter parent wins.
  tree.Write("memory/jobs/memory.limit_in_bytes", std::to_string(1000 * kMiB));
  EXPECT_EQ(MemoryCgroupHeadroom(self, tree.root()), 100 * kMiB);

  // Used past the limit: nothing left, never a wrapped-around number.
  tree.Write("memory/jobs/job1/memory.stat", "total_cache 0\n");
  tree.Write("memory/jobs/job1/memory.usage_in_bytes", std::to_string(1100 * kMiB));
  EXPECT_EQ(MemoryCgroupHeadroom(self, tree.root()), 0u);
}

TEST(MemoryCgroupHeadroom, V2ReadsMemoryMaxAndTreatsMaxAsNoLimit) {
  CgroupTree tree;
  tree.Write("svc/ckptfs/memory.max", "max\n");
  tree.Write("svc/ckptfs/memory.current", "12345\n");
  tree.Write("svc/memory.max", std::to_string(2048 * kMiB) + "\n");
  tree.Write("svc/memory.current", std::to_string(1024 * kMiB) + "\n");
  tree.Write("svc/memory.stat", "anon 1\nfile " + std::to_string(512 * kMiB) + "\n");
  EXPECT_EQ(MemoryCgroupHeadroom("0::/svc/ckptfs\n", tree.root()), 1536 * kMiB);
  tree.Write("svc/memory.max", "max\n");
  EXPECT_EQ(MemoryCgroupHeadroom("0::/svc/ckptfs\n", tree.root()), std::nullopt);
}

TEST(MemoryCgroupHeadroom, NoLimitAnywhereOrNothingReadableIsNoHeadroomToCheck) {
  CgroupTree tree;
  EXPECT_EQ(MemoryCgroupHeadroom("", tree.root()), std::nullopt);
  EXPECT_EQ(MemoryCgroupHeadroom("4:memory:/\n", tree.root()), std::nullopt);
  EXPECT_EQ(MemoryCgroupHeadroom("4:memory:/gone\n", tree.root()), std::nullopt);
  EXPECT_EQ(MemoryCgroupHeadroom("garbage without colons\n", tree.root()), std::nullopt);
  tree.Write("memory/a/memory.limit_in_bytes", "not a number\n");
  EXPECT_EQ(MemoryCgroupHeadroom("4:memory:/a\n", tree.root()), std::nullopt);
}

// This process's own cgroup, as the pool reads it: a pool far larger than any machine's
// memory is refused only where a limit applies, and then with a message naming it.
TEST(MemoryCgroupHeadroom, APoolPastTheLimitIsRefusedAtCreate) {
  std::ifstream in("/proc/self/cgroup");
  const std::string self((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::optional<uint64_t> headroom = MemoryCgroupHeadroom(self, "/sys/fs/cgroup");
  if (!headroom) GTEST_SKIP() << "no memory cgroup limit applies to this process";
  StagingOptions options;
  options.chunk_bytes = size_t{4} << 20;
  options.total_bytes = (*headroom + (size_t{64} << 20)) & ~(options.chunk_bytes - 1);
  options.backend = "host";
  auto pool = StagingPool::Create(options);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), Code::kNoSpace);
  EXPECT_NE(pool.status().message().find("memory cgroup"), std::string::npos)
      << pool.status().message();
}

TEST(StagingPoolDeathTest, DestroyingPoolWithChunkOutstandingAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        auto pool = MakePool(2);
        ChunkBuffer leaked = pool->Acquire();
        pool.reset();
      },
      testing::KilledBySignal(SIGABRT), "");
}

}  // namespace
}  // namespace ckptfs::gpu
