#include "store/primitives/crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#define CKPTFS_CRC32C_X86 1
#endif

namespace ckptfs::store {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// The CRC register (no pre/post conditioning) is linear over GF(2): after feeding M from
// state s it is s * x^(8|M|) + M * x^32 (mod P), in the reflected bit order where bit 31 is
// x^0. So a CRC is moved past n zero bytes by one multiplication by x^(8n) mod P.

// a * b mod P (reflected). After zlib's multmodp.
uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

struct PowerTable {
  uint32_t x2n[64];  // x^(2^k) mod P
  PowerTable() {
    uint32_t p = 1u << 30;  // x^1
    x2n[0] = p;
    for (int k = 1; k < 64; ++k) x2n[k] = p = MultModP(p, p);
  }
};
const PowerTable& Powers() {
  static const PowerTable t;
  return t;
}

// x^(8 * nbytes) mod P.
uint32_t XPow8N(uint64_t nbytes) {
  const PowerTable& t = Powers();
  uint32_t p = 1u << 31;  // x^0
  // 8 * nbytes as a bit pattern: start at k = 3 so nbytes itself never overflows.
  for (unsigned k = 3; nbytes != 0; nbytes >>= 1, ++k) {
    if (nbytes & 1) p = MultModP(t.x2n[k & 63], p);
  }
  return p;
}

// Slicing-by-8 tables: table[0] is the classic byte table.
struct SliceTables {
  uint32_t t[8][256];
  SliceTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (int k = 1; k < 8; ++k) {
      for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
    }
  }
};
const SliceTables& Slices() {
  static const SliceTables t;
  return t;
}

inline uint32_t Load32Le(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

// Raw register update (no conditioning), portable.
uint32_t RawPortable(uint32_t c, const uint8_t* p, size_t n) {
  const SliceTables& s = Slices();
  const auto& t = s.t;
  while (n >= 8) {
    uint32_t lo = Load32Le(p) ^ c, hi = Load32Le(p + 4);
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
        t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return c;
}

}  // namespace

Crc32cCombiner::Crc32cCombiner(uint64_t len_b) {
  const uint32_t op = XPow8N(len_b);
  for (int i = 0; i < 4; ++i) {
    for (uint32_t b = 0; b < 256; ++b) table_[i][b] = MultModP(op, b << (8 * i));
  }
}

uint32_t Crc32cCombiner::Combine(uint32_t crc_a, uint32_t crc_b) const {
  return table_[0][crc_a & 0xff] ^ table_[1][(crc_a >> 8) & 0xff] ^
         table_[2][(crc_a >> 16) & 0xff] ^ table_[3][crc_a >> 24] ^ crc_b;
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // The ~0 conditioning of A's start and B's end cancels out (see zlib's crc32_combine).
  if (len_b == 0) return crc_a;
  return MultModP(XPow8N(len_b), crc_a) ^ crc_b;
}

namespace crc32c_internal {

uint32_t ExtendPortable(uint32_t crc, const void* data, size_t n) {
  return ~RawPortable(~crc, static_cast<const uint8_t*>(data), n);
}

#if CKPTFS_CRC32C_X86

namespace {
// Three streams of kLong (then kShort) bytes run in parallel to hide the 3-cycle latency of
// crc32; the second and third start from 0 and are folded in by a shift of one stream length.
constexpr size_t kLong = 8192, kShort = 256;
const Crc32cCombiner& LongShift() {
  static const Crc32cCombiner c(kLong);
  return c;
}
const Crc32cCombiner& ShortShift() {
  static const Crc32cCombiner c(kShort);
  return c;
}

inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <size_t kStream>
__attribute__((target("sse4.2"))) inline uint64_t ThreeWay(uint64_t c0, const uint8_t*& p,
                                                            size_t& n,
                                                            const Crc32cCombiner& shift) {
  while (n >= 3 * kStream) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t* end = p + kStream;
    do {
      c0 = _mm_crc32_u64(c0, Load64(p));
      c1 = _mm_crc32_u64(c1, Load64(p + kStream));
      c2 = _mm_crc32_u64(c2, Load64(p + 2 * kStream));
      p += 8;
    } while (p < end);
    // Raw states: R(s, ABC) = shift(shift(R(s,A)) ^ R(0,B)) ^ R(0,C).
    c0 = shift.Combine(static_cast<uint32_t>(c0), static_cast<uint32_t>(c1));
    c0 = shift.Combine(static_cast<uint32_t>(c0), static_cast<uint32_t>(c2));
    p += 2 * kStream;
    n -= 3 * kStream;
  }
  return c0;
}
}  // namespace

bool HardwareAvailable() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}

__attribute__((target("sse4.2"))) uint32_t ExtendHardware(uint32_t crc, const void* data,
                                                          size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t c = static_cast<uint32_t>(~crc);
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  if (n >= 3 * kShort) {
    c = ThreeWay<kLong>(c, p, n, LongShift());
    c = ThreeWay<kShort>(c, p, n, ShortShift());
  }
  while (n >= 8) {
    c = _mm_crc32_u64(c, Load64(p));
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  return ~static_cast<uint32_t>(c);
}

#else  // !CKPTFS_CRC32C_X86

bool HardwareAvailable() { return false; }
uint32_t ExtendHardware(uint32_t crc, const void* data, size_t n) {
  return ExtendPortable(crc, data, n);
}

#endif

}  // namespace crc32c_internal

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  static const bool hw = crc32c_internal::HardwareAvailable();
  return hw ? crc32c_internal::ExtendHardware(crc, data, n)
            : crc32c_internal::ExtendPortable(crc, data, n);
}

}  // namespace ckptfs::store
