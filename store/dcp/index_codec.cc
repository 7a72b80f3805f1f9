#include "store/dcp/index_codec.h"

#include "store/primitives/record_codec.h"

namespace ckptfs::store::keyidx {
namespace {

constexpr uint8_t kValueVersion = 2;  // one item's encoding (checksum = CRC32C)
constexpr uint8_t kBlockVersion = 1;
constexpr size_t kMaxVarint = 10;

// Bytes EncodeItem() writes at most.
size_t EncodedBound(const IndexedItem& item) {
  size_t n =
      3 + 8 * kMaxVarint + 3 * kMaxVarint + item.fqn.size() + item.dtype.size() + item.file.size();
  n += (4 + item.chunk_offsets.size() + item.chunk_sizes.size() + item.global_size.size() +
        item.stride.size()) *
       kMaxVarint;
  n += kMaxVarint;
  for (const std::string& t : item.transforms) n += kMaxVarint + t.size();
  return n;
}

// Writes the encoding of `item`; `w` has EncodedBound(item) bytes of room.
void EncodeItem(const IndexedItem& item, CursorWriter& w) {
  w.Byte(kValueVersion);
  w.Byte(static_cast<uint8_t>(item.kind));
  w.Byte((item.has_checksum ? 1 : 0) | (item.is_bytes ? 2 : 0));
  w.Varint(item.ordinal);
  w.String(item.fqn);
  w.String(item.dtype);
  w.String(item.file);
  w.Varint(item.offset);
  w.Varint(item.length);
  w.Varint(item.raw_offset);
  w.Varint(item.raw_nbytes);
  w.Varint(ZigZag(item.storage_offset));
  w.Varint(item.checksum);
  w.Ints(item.chunk_offsets);
  w.Ints(item.chunk_sizes);
  w.Ints(item.global_size);
  w.Ints(item.stride);
  w.Varint(item.transforms.size());
  for (const std::string& t : item.transforms) w.String(t);
}

bool DecodeItem(std::string_view in, IndexedItem* item) {
  Decoder d(in);
  if (d.Byte() != kValueVersion) return false;
  uint8_t kind = d.Byte();
  if (kind > static_cast<uint8_t>(ItemKind::kOpaque)) return false;
  item->kind = static_cast<ItemKind>(kind);
  uint8_t flags = d.Byte();
  item->has_checksum = (flags & 1) != 0;
  item->is_bytes = (flags & 2) != 0;
  item->ordinal = static_cast<uint32_t>(d.Varint());
  item->fqn = d.String();
  item->dtype = d.String();
  item->file = d.String();
  item->offset = d.Varint();
  item->length = d.Varint();
  item->raw_offset = d.Varint();
  item->raw_nbytes = d.Varint();
  item->storage_offset = UnZigZag(d.Varint());
  item->checksum = d.Varint();
  item->chunk_offsets = d.Ints();
  item->chunk_sizes = d.Ints();
  item->global_size = d.Ints();
  item->stride = d.Ints();
  uint64_t nt = d.Varint();
  if (nt > in.size()) return false;
  item->transforms.clear();
  for (uint64_t i = 0; i < nt && d.ok(); ++i) item->transforms.push_back(d.String());
  return d.done();
}

}  // namespace

std::string InfoKey(const std::string& ckpt) { return "i/" + ckpt; }
std::string ItemPrefix(const std::string& ckpt) { return "k/" + ckpt + '\0'; }
std::string BlockKey(const std::string& prefix, const std::string& file, uint32_t block) {
  std::string key;
  key.reserve(prefix.size() + file.size() + 5);
  key.append(prefix).append(file).push_back('\0');
  for (int i = 3; i >= 0; --i) key.push_back(static_cast<char>((block >> (8 * i)) & 0xff));
  return key;
}

// A block: kBlockVersion, the item count (varint), then each item's encoding preceded by its
// length (4 bytes, little-endian).
void EncodeBlock(const std::vector<IndexedItem>& items, std::span<const uint32_t> ordinals,
                 std::string* out) {
  size_t bound = 1 + kMaxVarint;
  for (uint32_t i : ordinals) bound += 4 + EncodedBound(items[i]);
  const size_t start = out->size();
  out->resize(start + bound);
  CursorWriter w(out->data() + start);
  w.Byte(kBlockVersion);
  w.Varint(ordinals.size());
  for (uint32_t i : ordinals) {
    char* len_at = w.pos();
    CursorWriter item(len_at + 4);
    EncodeItem(items[i], item);
    uint32_t len = static_cast<uint32_t>(item.pos() - (len_at + 4));
    for (int b = 0; b < 4; ++b) len_at[b] = static_cast<char>((len >> (8 * b)) & 0xff);
    w = item;
  }
  out->resize(static_cast<size_t>(w.pos() - out->data()));
}

bool DecodeBlock(std::string_view in, std::vector<IndexedItem>* items) {
  Decoder d(in);
  if (d.Byte() != kBlockVersion) return false;
  uint64_t n = d.Varint();
  if (!d.ok() || n > in.size()) return false;
  for (uint64_t i = 0; i < n; ++i) {
    std::string_view len = d.Bytes(4);
    if (!d.ok()) return false;
    uint32_t n_item = 0;
    for (int b = 0; b < 4; ++b) n_item |= uint32_t{static_cast<uint8_t>(len[b])} << (8 * b);
    std::string_view one = d.Bytes(n_item);
    if (!d.ok() || !DecodeItem(one, &items->emplace_back())) return false;
  }
  return d.done();
}

MetadataId MetadataIdOf(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_size),
          static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000ull +
              static_cast<uint64_t>(st.st_mtim.tv_nsec),
          static_cast<uint64_t>(st.st_ino)};
}

}  // namespace ckptfs::store::keyidx
