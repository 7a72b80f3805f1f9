// The process heap (glibc malloc): its setup at daemon start, and what it holds now.
//
// Why a setup at all (issue 41's RSS bound, docs/RELIABILITY.md "Findings of stop 48"):
// glibc serves an allocation of at least its mmap threshold (128 KiB at start) with a
// mapping of its own and unmaps it at free, but it raises the threshold to the size of
// every such block freed (up to 32 MiB), and the trim threshold of each arena to twice
// that. The daemon frees blocks of 1-4 MiB all the time: the key index builder's 4 MiB read
// windows, a 1 MiB reply buffer per readdir, libfuse's 1 MiB request buffer of each worker
// thread (the loop ends idle ones and starts new ones). After the first free, those
// blocks came from the heap of whichever of up to 8 arenas per core the thread used, and
// stayed there as free memory when freed: live allocations stayed flat while the free
// memory glibc held, and RSS with it, grew save after save. A fixed threshold turns off
// the raising: each such block is mapped and unmapped again, and every arena gives back
// free memory at its top past 128 KiB, as glibc does by default until the first raise.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ckptfs {

// Blocks of this size and over are mapped on their own and unmapped at free. Above what
// the hot paths allocate per operation (paths, journal records, 64 KiB I/O buffers),
// below the 1-4 MiB buffers named above.
inline constexpr size_t kHeapMmapThreshold = 256 << 10;
// Free memory past this much at the top of an arena's heap goes back (glibc's default).
inline constexpr size_t kHeapTrimThreshold = 128 << 10;

// Fixes glibc's mmap and trim thresholds at the values above. Call once at daemon start,
// before threads exist. False when the allocator refused it (or is not glibc's): the
// daemon runs on, as before.
bool ConfigureHeap();

struct HeapUsage {
  uint64_t in_use = 0;     // bytes in live allocations (heap and mapped blocks)
  uint64_t free_held = 0;  // free bytes the heap holds (resident unless trimmed)
};
// Now, summed over every arena (glibc's mallinfo2; zeros elsewhere). Walks the arenas'
// bins under their locks: for the stats file, not for a hot path.
HeapUsage HeapNow();

// Maps the pages of [p, p + n) that lie wholly inside it, writable, in one call
// (madvise MADV_POPULATE_WRITE, Linux 5.14) instead of one page fault per 4 KiB page at
// the first write. For a large buffer that is about to be written whole (a block received
// from a peer, a block read into the cache): under a hypervisor each fault is a round trip
// to it, and on this project's test VM a cold load of 16 nodes spent a fifth of its CPU in
// them (docs/PEERS.md, "Measured"). Best effort: on an older kernel, or when memory is
// short, the pages fault in at the first write as before.
void PrefaultForWrite(void* p, size_t n);

}  // namespace ckptfs
