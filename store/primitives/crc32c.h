// CRC32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and final xor ~0): the
// per-item checksum of the key index.
//
// Chosen over a faster non-linear hash because CRCs compose: the CRC of A||B follows from
// crc(A), crc(B) and len(B) alone (Crc32cCombine). The write path hashes file blocks while
// their bytes are still in staging, before anyone knows where DCP items begin and end; the
// index later combines block CRCs into item CRCs without reading the bulk data again.
//
// Crc32cExtend uses the SSE4.2 crc32 instruction (three interleaved streams) when the CPU has
// it, else a portable slicing-by-8 table. Both give identical results; tests pin both.
//
// Thread-safe: the only state is read-only tables built at static initialization.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ckptfs::store {

// CRC32C of data[0, n) continued from `crc`, the CRC32C of the bytes before them (0 for
// none): Crc32cExtend(Crc32cExtend(0, a), b) == Crc32c(a || b).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

// CRC32C of A||B from crc_a = CRC32C(A), crc_b = CRC32C(B) and len_b = |B|. O(log len_b).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// Precomputed Combine for one fixed `len_b`: four table lookups per call instead of
// O(log len_b) polynomial products. For folding many equal-sized blocks.
class Crc32cCombiner {
 public:
  explicit Crc32cCombiner(uint64_t len_b);
  uint32_t Combine(uint32_t crc_a, uint32_t crc_b) const;

 private:
  uint32_t table_[4][256];
};

// The two implementations behind Crc32cExtend, for tests and benchmarks.
namespace crc32c_internal {
bool HardwareAvailable();
uint32_t ExtendPortable(uint32_t crc, const void* data, size_t n);
// Requires HardwareAvailable().
uint32_t ExtendHardware(uint32_t crc, const void* data, size_t n);
}  // namespace crc32c_internal

}  // namespace ckptfs::store
