#include "common/lock_code.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fstream>
#include <string>

// The sanitizers' runtimes make mlock a no-op (their shadow memory could not be locked).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define CKPTFS_MLOCK_IS_NOOP 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define CKPTFS_MLOCK_IS_NOOP 1
#endif
#endif

namespace ckptfs {
namespace {

// VmLck of this process, in bytes.
uint64_t LockedBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) << 10;
  }
  return 0;
}

TEST(LockCode, LocksTheExecutableAndItsLibrariesButNotTheirData) {
  if (::geteuid() != 0) GTEST_SKIP() << "mlock beyond RLIMIT_MEMLOCK needs CAP_IPC_LOCK";
  const uint64_t before = LockedBytes();
  const CodeLock got = LockCodeInMemory();
  EXPECT_EQ(got.failed, 0u) << got.error;
  EXPECT_TRUE(got.error.empty()) << got.error;
  // The test binary and at least libc, libstdc++ and gtest's dependencies.
  EXPECT_GE(got.objects, 3);
  EXPECT_GT(got.bytes, uint64_t{1} << 20);
#ifndef CKPTFS_MLOCK_IS_NOOP
  // The kernel counts what was locked (pages already locked before count once).
  EXPECT_GE(LockedBytes(), before + got.bytes / 2);
  EXPECT_LE(LockedBytes(), before + got.bytes);
#else
  (void)before;
#endif
  // Nothing writable was locked: the heap and the stack are not part of it.
  EXPECT_LT(got.bytes, uint64_t{1} << 30);
  ::munlockall();
}

}  // namespace
}  // namespace ckptfs
