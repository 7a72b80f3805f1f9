#include "common/heap.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

// The sanitizers' runtimes bring their own allocator: glibc's mallopt and mallinfo2 say
// nothing about it.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define CKPTFS_OWN_ALLOCATOR 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define CKPTFS_OWN_ALLOCATOR 1
#endif
#endif

namespace ckptfs {
namespace {

constexpr int64_t kMiB = 1 << 20;

// The daemon's pattern (common/heap.h): blocks of 1-4 MiB allocated and freed on many
// threads, small allocations made and kept in between. Unconfigured glibc keeps the freed
// blocks in each thread's arena once the first one raised its mmap threshold (about 4 MiB
// free per thread here); configured, they are unmapped at free.
TEST(Heap, FreedMiBBlocksOnManyThreadsGoBackOnceConfigured) {
#ifdef CKPTFS_OWN_ALLOCATOR
  GTEST_SKIP() << "a sanitizer's allocator replaces glibc's (the fresh-clone CI's asan run)";
#endif
  ASSERT_TRUE(ConfigureHeap());
  const int64_t free_before = static_cast<int64_t>(HeapNow().free_held);
  std::vector<std::vector<std::unique_ptr<char[]>>> kept(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&kept, t] {
      for (int i = 0; i < 20; ++i) {
        const size_t n = (i % 2 ? 4 : 1) * kMiB;
        std::unique_ptr<char[]> block(new char[n]);
        for (size_t off = 0; off < n; off += 4096) block[off] = static_cast<char>(i);
        kept[t].emplace_back(new char[96]);  // lives on past the block, as records do
      }
    });
  }
  for (auto& th : threads) th.join();
  const HeapUsage after = HeapNow();
  EXPECT_LT(static_cast<int64_t>(after.free_held) - free_before, 2 * kMiB)
      << "free held " << after.free_held << " in use " << after.in_use;
  EXPECT_GT(after.in_use, 8u * 20u * 96u);  // the kept records are counted
}

}  // namespace
}  // namespace ckptfs
