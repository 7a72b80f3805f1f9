#include "common/heap.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

#ifdef __GLIBC__
#include <malloc.h>
#endif

namespace ckptfs {

bool ConfigureHeap() {
#ifdef __GLIBC__
  // Setting M_MMAP_THRESHOLD is what turns the dynamic raising off (glibc's mallopt(3));
  // the trim threshold is set too, in case a block was freed before this call.
  const bool mmap = mallopt(M_MMAP_THRESHOLD, static_cast<int>(kHeapMmapThreshold)) == 1;
  const bool trim = mallopt(M_TRIM_THRESHOLD, static_cast<int>(kHeapTrimThreshold)) == 1;
  return mmap && trim;
#else
  return false;
#endif
}

HeapUsage HeapNow() {
  HeapUsage u;
#ifdef __GLIBC__
  const struct mallinfo2 mi = mallinfo2();
  u.in_use = mi.uordblks + mi.hblkhd;
  u.free_held = mi.fordblks;
#endif
  return u;
}

void PrefaultForWrite(void* p, size_t n) {
#ifdef MADV_POPULATE_WRITE
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) & ~(page - 1);
  if (end > begin) {
    (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
  }
#else
  (void)p;
  (void)n;
#endif
}

}  // namespace ckptfs
