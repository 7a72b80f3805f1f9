// Binary record codec: varints, zigzag integers, fixed-width little-endian integers and
// length-prefixed byte strings.
//
// Every record ckptfs keeps in RocksDB (journal entries, checkpoint records, index items)
// and every peer protocol message (store/peer/protocol.h) is encoded with these, never as
// JSON: Linux names are bytes, not UTF-8, and a record must hold any name a client can
// create. Decoders never throw and never read past the input; a malformed record makes
// ok() false.
//
// Not thread-safe (one object per record).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace ckptfs::store {

inline uint64_t ZigZag(int64_t v) {
  return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);
}
inline int64_t UnZigZag(uint64_t v) { return static_cast<int64_t>((v >> 1) ^ (~(v & 1) + 1)); }

// Writes through a raw cursor into room the caller sized (std::string::push_back per byte
// cost more than the rest of the build's encoding).
class CursorWriter {
 public:
  explicit CursorWriter(char* p) : p_(p) {}
  char* pos() const { return p_; }
  void Byte(uint8_t b) { *p_++ = static_cast<char>(b); }
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      *p_++ = static_cast<char>(v | 0x80);
      v >>= 7;
    }
    *p_++ = static_cast<char>(v);
  }
  void String(std::string_view s) {
    Varint(s.size());
    std::memcpy(p_, s.data(), s.size());
    p_ += s.size();
  }
  void Ints(const std::vector<int64_t>& v) {
    Varint(v.size());
    for (int64_t x : v) Varint(ZigZag(x));
  }

 private:
  char* p_;
};

// Appends to a string; for records of unknown size.
class StringWriter {
 public:
  explicit StringWriter(std::string* out) : out_(out) {}
  void Byte(uint8_t b) { out_->push_back(static_cast<char>(b)); }
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      out_->push_back(static_cast<char>(v | 0x80));
      v >>= 7;
    }
    out_->push_back(static_cast<char>(v));
  }
  void Signed(int64_t v) { Varint(ZigZag(v)); }
  void String(std::string_view s) {
    Varint(s.size());
    out_->append(s.data(), s.size());
  }
  // Fixed-width little-endian integers, for fields a reader must find at a known offset.
  void Fixed16(uint16_t v) { Fixed(v, 2); }
  void Fixed32(uint32_t v) { Fixed(v, 4); }
  void Fixed64(uint64_t v) { Fixed(v, 8); }
  // Bytes as they are, with no length (the reader knows it).
  void Raw(const void* p, size_t n) { out_->append(static_cast<const char*>(p), n); }

 private:
  void Fixed(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string* out_;
};

class Decoder {
 public:
  explicit Decoder(std::string_view in) : in_(in) {}
  bool ok() const { return ok_; }
  bool done() const { return ok_ && in_.empty(); }
  uint8_t Byte() {
    if (in_.empty()) return Fail();
    uint8_t b = static_cast<uint8_t>(in_[0]);
    in_.remove_prefix(1);
    return b;
  }
  uint64_t Varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (in_.empty()) return Fail();
      uint8_t b = static_cast<uint8_t>(in_[0]);
      in_.remove_prefix(1);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return v;
    }
    return Fail();
  }
  std::string String() {
    uint64_t n = Varint();
    if (n > in_.size()) return (Fail(), std::string());
    std::string s(in_.substr(0, n));
    in_.remove_prefix(n);
    return s;
  }
  // The next n bytes, as a view.
  std::string_view Bytes(uint64_t n) {
    if (n > in_.size()) return (Fail(), std::string_view());
    std::string_view v = in_.substr(0, n);
    in_.remove_prefix(n);
    return v;
  }
  int64_t Signed() { return UnZigZag(Varint()); }
  uint16_t Fixed16() { return static_cast<uint16_t>(Fixed(2)); }
  uint32_t Fixed32() { return static_cast<uint32_t>(Fixed(4)); }
  uint64_t Fixed64() { return Fixed(8); }
  std::vector<int64_t> Ints() {
    uint64_t n = Varint();
    if (n > in_.size()) return (Fail(), std::vector<int64_t>());
    std::vector<int64_t> v(n);
    for (auto& x : v) x = UnZigZag(Varint());
    return v;
  }

 private:
  uint64_t Fixed(size_t n) {
    if (n > in_.size()) return Fail();
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(in_[i])} << (8 * i);
    in_.remove_prefix(n);
    return v;
  }
  uint8_t Fail() {
    ok_ = false;
    in_ = {};
    return 0;
  }
  std::string_view in_;
  bool ok_ = true;
};

}  // namespace ckptfs::store
