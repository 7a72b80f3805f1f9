#include "store/primitives/crc32c.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace ckptfs::store {
namespace {

using Extend = uint32_t (*)(uint32_t, const void*, size_t);

struct Impl {
  const char* name;
  Extend fn;
};

std::vector<Impl> Impls() {
  std::vector<Impl> out{{"portable", &crc32c_internal::ExtendPortable}, {"dispatch", &Crc32cExtend}};
  if (crc32c_internal::HardwareAvailable()) {
    out.push_back({"sse4.2", &crc32c_internal::ExtendHardware});
  }
  return out;
}

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// A bit-at-a-time reference, straight from the definition.
uint32_t Reference(const std::string& s) {
  uint32_t c = ~0u;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

TEST(Crc32c, KnownVectors) {
  for (const Impl& impl : Impls()) {
    SCOPED_TRACE(impl.name);
    auto crc = [&](const std::string& s) { return impl.fn(0, s.data(), s.size()); };
    EXPECT_EQ(crc(""), 0u);
    EXPECT_EQ(crc("a"), 0xC1D04330u);
    EXPECT_EQ(crc("123456789"), 0xE3069283u);
    // RFC 3720 (iSCSI), appendix B.4.
    EXPECT_EQ(crc(std::string(32, '\0')), 0x8A9136AAu);
    EXPECT_EQ(crc(std::string(32, '\xff')), 0x62A8AB43u);
    std::string inc(32, '\0'), dec(32, '\0');
    for (int i = 0; i < 32; ++i) inc[i] = static_cast<char>(i), dec[i] = static_cast<char>(31 - i);
    EXPECT_EQ(crc(inc), 0x46DD794Eu);
    EXPECT_EQ(crc(dec), 0x113FDB5Cu);
  }
}

TEST(Crc32c, AllImplementationsAgreeWithTheDefinitionAtEveryLengthAndAlignment) {
  // Lengths around the three-way stream sizes (256 and 8192 bytes, times 3) included.
  const std::string data = RandomBytes(3 * 8192 * 2 + 1000, 7);
  std::vector<size_t> lengths;
  for (size_t n = 0; n < 80; ++n) lengths.push_back(n);
  for (size_t n : {255, 256, 257, 767, 768, 769, 1000, 4096, 8191, 8192, 24575, 24576, 24577,
                   24576 + 768, 49152, 50000}) {
    lengths.push_back(n);
  }
  for (size_t n : lengths) {
    for (size_t align = 0; align < 9; ++align) {
      if (align + n > data.size()) continue;
      std::string piece = data.substr(align, n);
      const uint32_t want = Reference(piece);
      for (const Impl& impl : Impls()) {
        ASSERT_EQ(impl.fn(0, data.data() + align, n), want)
            << impl.name << " n=" << n << " align=" << align;
      }
    }
  }
}

TEST(Crc32c, ExtendAndCombineMatchTheWholeOverRandomSplits) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 300; ++round) {
    size_t n = rng() % (round < 200 ? 5000 : 300000);
    std::string s = RandomBytes(n, round);
    const uint32_t whole = Crc32c(s.data(), s.size());
    size_t cut = n == 0 ? 0 : rng() % (n + 1);
    for (const Impl& impl : Impls()) {
      uint32_t a = impl.fn(0, s.data(), cut);
      ASSERT_EQ(impl.fn(a, s.data() + cut, n - cut), whole) << impl.name;
    }
    uint32_t a = Crc32c(s.data(), cut), b = Crc32c(s.data() + cut, n - cut);
    ASSERT_EQ(Crc32cCombine(a, b, n - cut), whole) << "n=" << n << " cut=" << cut;
    Crc32cCombiner fixed(n - cut);
    ASSERT_EQ(fixed.Combine(a, b), whole);
  }
  // Many pieces folded left to right, some empty.
  std::string s = RandomBytes(1 << 20, 3);
  uint32_t acc = 0;
  for (size_t off = 0; off < s.size();) {
    size_t len = std::min<size_t>(s.size() - off, rng() % 70000);
    acc = Crc32cCombine(acc, Crc32c(s.data() + off, len), len);
    off += len;
  }
  EXPECT_EQ(acc, Crc32c(s.data(), s.size()));
}

TEST(Crc32c, CombineOverHugeLengthsOfZeros) {
  // crc(A || 0^n) computed two ways: combining with the CRC of n zero bytes, and extending
  // by zeros in pieces; n above 4 GiB exercises the high powers.
  const std::string zeros(1 << 20, '\0');
  const uint32_t a = Crc32c("abc", 3);
  uint32_t by_pieces = a, zeros_crc = 0;
  const uint64_t n = (uint64_t{5} << 30) + 12345;
  for (uint64_t done = 0; done < n;) {
    size_t len = static_cast<size_t>(std::min<uint64_t>(n - done, zeros.size()));
    by_pieces = Crc32cExtend(by_pieces, zeros.data(), len);
    zeros_crc = Crc32cExtend(zeros_crc, zeros.data(), len);
    done += len;
  }
  EXPECT_EQ(Crc32cCombine(a, zeros_crc, n), by_pieces);
}

TEST(Crc32cBench, Throughput) {
  const std::string data = RandomBytes(64 << 20, 5);
  for (const Impl& impl : Impls()) {
    uint32_t sink = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (int rep = 0; rep < 4; ++rep) sink ^= impl.fn(0, data.data(), data.size());
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("[bench] crc32c %s: %.2f GB/s (%08x)\n", impl.name, 4.0 * data.size() / s / 1e9,
                sink);
  }
}

}  // namespace
}  // namespace ckptfs::store
