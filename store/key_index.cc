#include "store/key_index.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

#include "store/crc32c.h"
#include "store/metadata_file.h"
#include "store/record_codec.h"
#include "store/torch_zip.h"

namespace ckptfs::store {
namespace {
double TmpCpu() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}
#define TMPT(name)                                           \
  do {                                                       \
    double _n = TmpCpu();                                    \
    fprintf(stderr, "  [t] %-20s %.1f\n", name, _n - tmp_t); \
    tmp_t = _n;                                              \
  } while (0)

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// "i/" record and block layout. 3: blocks of items, CRC32C checksums (2: one key per item,
// CRC32C; 1: one key per item, XXH3-64). An index of an older format is rebuilt on first use,
// like any missing one.
constexpr int kFormat = 3;
constexpr uint8_t kValueVersion = 2;  // one item's encoding (checksum = CRC32C)
constexpr uint8_t kBlockVersion = 1;
constexpr size_t kItemsPerBlock = 256;
constexpr size_t kWindowCapacity = 4u << 20;
constexpr size_t kReadAhead = 256u << 10;
// Items up to this size are parsed from one view of the whole item (they are read anyway,
// since windows are bigger than they are); larger ones only through their head and tail.
constexpr uint64_t kWholeItemMax = 64u << 10;
// A large item's zip directory is read with this much before the item's end.
constexpr uint64_t kTailWindow = 64u << 10;
constexpr auto kMissingRetry = std::chrono::seconds(1);

std::string Join(const std::string& ckpt, const std::string& name) {
  return ckpt.empty() ? name : ckpt + "/" + name;
}

std::string InfoKey(const std::string& ckpt) { return "i/" + ckpt; }
std::string ItemPrefix(const std::string& ckpt) { return "k/" + ckpt + '\0'; }
std::string BlockKey(const std::string& prefix, const std::string& file, uint32_t block) {
  std::string key;
  key.reserve(prefix.size() + file.size() + 5);
  key.append(prefix).append(file).push_back('\0');
  for (int i = 3; i >= 0; --i) key.push_back(static_cast<char>((block >> (8 * i)) & 0xff));
  return key;
}

void AppendBigEndian(std::string* out, uint64_t v) {
  for (int i = 7; i >= 0; --i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// The item's key (fqn, then bytes or the chunk offsets) as one string, for matching the items
// of an index against a fresh parse of the .metadata (Verify).
std::string ItemSuffix(const IndexedItem& item) {
  std::string s = item.fqn;
  s.push_back('\0');
  if (item.is_bytes) {
    s.push_back('b');
    return s;
  }
  s.push_back('t');
  for (int64_t v : item.chunk_offsets) AppendBigEndian(&s, static_cast<uint64_t>(v) ^ (1ull << 63));
  return s;
}

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

// Appends the items of block `in` to `items`; false if it is malformed.
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

// --- Reading items ------------------------------------------------------------------------

// Serves reads of one open shard file from two read-ahead windows, so that the small reads
// of the zip reader over many back-to-back items cost few syscalls. Two, because the zip
// reader of a large item reads its tail (directory) before its head (data.pkl): the window
// read for one item's tail runs on into the next item's head, and stays while the next
// item's tail is read into the other.
class WindowReader {
 public:
  WindowReader(BackingDir* dir, int fd, uint64_t file_size)
      : dir_(dir), fd_(fd), size_(file_size) {}

  // [off, off+len) of the file; len <= kWindowCapacity. Valid until the second-next call.
  // On a miss, the window read starts at `off`, or at `tail_start_` when `off` lies in the
  // tail of the item being read (see ItemReader).
  Result<std::string_view> View(uint64_t off, size_t len) {
    if (off > size_ || size_ - off < len) return Corrupt("read past the end of the file");
    for (Slot& w : slots_) {
      if (w.len > 0 && off >= w.off && off + len <= w.off + w.len) {
        w.used = ++clock_;
        return std::string_view(w.buf.get() + (off - w.off), len);
      }
    }
    uint64_t start = off;
    if (off >= tail_start_ && off < tail_end_) start = tail_start_;
    Slot& w = slots_[0].used <= slots_[1].used ? slots_[0] : slots_[1];
    if (!w.buf) w.buf.reset(new char[kWindowCapacity]);  // not zeroed: read into at once
    uint64_t need = off + len - start;  // <= kWindowCapacity: the tail is at most 64 KiB
    if (need > kWindowCapacity) {
      start = off;
      need = len;
    }
    size_t want = static_cast<size_t>(std::min<uint64_t>(
        std::max<uint64_t>(need, kReadAhead), std::min<uint64_t>(kWindowCapacity, size_ - start)));
    w.len = 0;
    CKPT_ASSIGN_OR_RETURN(size_t got,
                          dir_->PRead(fd_, w.buf.get(), want, static_cast<off_t>(start)));
    if (got < need) return Corrupt("short read (file shrank?)");
    w.off = start;
    w.len = got;
    w.used = ++clock_;
    return std::string_view(w.buf.get() + (off - start), len);
  }

  Status ReadInto(uint64_t off, std::span<char> dst) {
    size_t done = 0;
    while (done < dst.size()) {
      size_t n = std::min(dst.size() - done, kWindowCapacity);
      CKPT_ASSIGN_OR_RETURN(std::string_view v, View(off + done, n));
      std::memcpy(dst.data() + done, v.data(), n);
      done += n;
    }
    return Status::Ok();
  }

  // CRC32C of [off, off+len).
  Result<uint32_t> Crc(uint64_t off, uint64_t len) {
    uint32_t crc = 0;
    for (uint64_t done = 0; done < len;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(len - done, kWindowCapacity));
      CKPT_ASSIGN_OR_RETURN(std::string_view v, View(off + done, n));
      crc = Crc32cExtend(crc, v.data(), v.size());
      done += n;
    }
    return crc;
  }

  // Reads of the item [item_offset, item_offset+item_length), for the zip reader. Also makes
  // a miss in the item's last kTailWindow bytes read that whole tail at once.
  ReadAtFn ItemReader(uint64_t item_offset, uint64_t item_length) {
    tail_end_ = item_offset + item_length;
    tail_start_ = tail_end_ - std::min(item_length, kTailWindow);
    return [this, item_offset, item_length](uint64_t rel, std::span<char> dst) -> Status {
      if (rel > item_length || item_length - rel < dst.size()) {
        return Corrupt("read past the end of the item");
      }
      return ReadInto(item_offset + rel, dst);
    };
  }

  // Parses the torch.save archive of the item [offset, offset+length): a small item from
  // one view of it, a large one through reads of its head and tail only.
  Result<TorchSaveTensor> ParseItem(uint64_t offset, uint64_t length, TorchPickleCache* cache) {
    if (length <= kWholeItemMax) {
      Result<std::string_view> whole = View(offset, static_cast<size_t>(length));
      if (!whole.ok()) return whole.status();
      return ParseTorchSaveItem(*whole, cache);
    }
    return ParseTorchSaveItem(ItemReader(offset, length), length, cache);
  }

 private:
  struct Slot {
    std::unique_ptr<char[]> buf;
    uint64_t off = 0;
    size_t len = 0;
    uint64_t used = 0;  // clock_ at the last hit: the older slot is refilled
  };
  BackingDir* dir_;
  int fd_;
  uint64_t size_;
  Slot slots_[2];
  uint64_t clock_ = 0;
  uint64_t tail_start_ = 0, tail_end_ = 0;
};

struct OpenedFile {
  UniqueFd fd;
  uint64_t size = 0;
  FileKey key;  // the version opened
};

Result<OpenedFile> OpenShard(BackingDir* dir, const std::string& path) {
  OpenedFile f;
  CKPT_ASSIGN_OR_RETURN(f.fd, dir->OpenFile(path, O_RDONLY | O_CLOEXEC));
  struct stat st;
  if (::fstat(f.fd.get(), &st) != 0) return Status::FromErrno(errno, "fstat " + path);
  if (!S_ISREG(st.st_mode)) return Invalid(path + " is not a regular file");
  f.size = static_cast<uint64_t>(st.st_size);
  f.key = FileKeyFromStat(st);
  return f;
}

// CRC32C of the item [off, off+len) of a file of `file_size` bytes from its block CRCs: the
// whole blocks inside the item come from `blocks`, the unaligned edges (under one block
// each, usually in the window the zip parse just read) from `reader`. nullopt when a block
// is unknown.
Result<std::optional<uint32_t>> CrcFromBlocks(WindowReader* reader, const BlockCrcMap& blocks,
                                              uint64_t off, uint64_t len, uint64_t file_size) {
  const uint64_t bs = blocks.block_bytes(), end = off + len;
  const uint64_t mid_begin = std::min(end, (off + bs - 1) / bs * bs);
  const uint64_t mid_end = std::max(mid_begin, end == file_size ? end : end / bs * bs);
  std::optional<uint32_t> mid = blocks.RangeCrc(mid_begin, mid_end);
  if (!mid) return std::optional<uint32_t>();
  CKPT_ASSIGN_OR_RETURN(uint32_t head, reader->Crc(off, mid_begin - off));
  CKPT_ASSIGN_OR_RETURN(uint32_t tail, reader->Crc(mid_end, end - mid_end));
  uint32_t crc = Crc32cCombine(head, *mid, mid_end - mid_begin);
  return std::optional<uint32_t>(Crc32cCombine(crc, tail, end - mid_end));
}

// Takes the fields of `d` (moved from when the caller passes an rvalue).
template <typename D>
IndexedItem FromDcp(D&& d, uint32_t ordinal) {
  IndexedItem it;
  it.kind = d.kind;
  it.fqn = std::forward<D>(d).fqn;
  it.chunk_offsets = std::forward<D>(d).chunk_offsets;
  it.chunk_sizes = std::forward<D>(d).chunk_sizes;
  it.global_size = std::forward<D>(d).global_size;
  it.stride = std::forward<D>(d).stride;
  it.dtype = std::forward<D>(d).dtype;
  it.file = std::forward<D>(d).file;
  it.offset = d.offset;
  it.length = d.length;
  it.raw_offset = d.raw_offset;
  it.raw_nbytes = d.raw_nbytes;
  it.storage_offset = d.storage_offset;
  it.transforms = std::forward<D>(d).transforms;
  it.is_bytes = d.is_bytes;
  it.ordinal = ordinal;
  return it;
}

// Resolves a kTensor item from its archive; turns it kOpaque (with `*error`) when the
// archive is broken or contradicts the metadata. Opaque-by-design archives (compressed,
// big-endian, ...) turn kOpaque without an error. The same as ResolveItemData() on the item.
void ResolveTensor(WindowReader* reader, IndexedItem* item, std::string* error,
                   TorchPickleCache* cache) {
  Result<TorchSaveTensor> t = reader->ParseItem(item->offset, item->length, cache);
  Status st = t.ok() ? Status::Ok() : t.status();
  if (st.ok() && !t->is_tensor) {
    item->kind = ItemKind::kOpaque;
    return;
  }
  if (st.ok()) {
    st = CheckItemData(
        *t, ItemFacts{item->fqn, item->file, item->dtype, item->chunk_sizes, item->length});
  }
  if (!st.ok()) {
    item->kind = ItemKind::kOpaque;
    *error = st.ToString();
    return;
  }
  item->raw_offset = item->offset + t->data_offset;
  item->raw_nbytes = t->data_nbytes;
  item->stride = std::move(t->stride);
  item->storage_offset = t->storage_offset;
}

struct MetadataId {
  uint64_t size = 0, mtime_ns = 0, ino = 0;
  bool operator==(const MetadataId&) const = default;
};

MetadataId IdOf(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_size),
          static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000ull +
              static_cast<uint64_t>(st.st_mtim.tv_nsec),
          static_cast<uint64_t>(st.st_ino)};
}

const char* StateName(int s) {
  static const char* kNames[] = {"ok", "partial", "failed", "missing"};
  return kNames[s];
}

// The items of one shard file, by (offset, ordinal).
struct FileGroup {
  std::string_view name;  // borrowed from the items
  std::vector<uint32_t> idx;
};

// Groups items by file, files by name, so that each shard file is opened once and read
// forward. Items usually come in offset order within a file already (DCP writes them so);
// only a group that is not gets sorted.
std::vector<FileGroup> GroupByFile(const std::vector<IndexedItem>& items) {
  std::unordered_map<std::string_view, uint32_t> ids;
  std::vector<FileGroup> groups;
  std::string_view last;
  uint32_t last_id = 0;
  for (uint32_t i = 0; i < items.size(); ++i) {
    std::string_view f = items[i].file;
    if (groups.empty() || f != last) {
      auto [it, added] = ids.try_emplace(f, static_cast<uint32_t>(groups.size()));
      if (added) groups.push_back({f, {}});
      last = f;
      last_id = it->second;
    }
    groups[last_id].idx.push_back(i);
  }
  auto by_offset = [&](uint32_t a, uint32_t b) {
    return items[a].offset != items[b].offset ? items[a].offset < items[b].offset : a < b;
  };
  for (FileGroup& g : groups) {
    if (!std::is_sorted(g.idx.begin(), g.idx.end(), by_offset)) {
      std::sort(g.idx.begin(), g.idx.end(), by_offset);
    }
  }
  std::sort(groups.begin(), groups.end(),
            [](const FileGroup& a, const FileGroup& b) { return a.name < b.name; });
  return groups;
}

// The first item whose key (fqn, bytes or chunk offsets) an earlier item has already, or -1.
// Open addressing over item indices: no allocation per item.
ptrdiff_t FirstDuplicateKey(const std::vector<IndexedItem>& items) {
  auto same = [&](uint32_t a, uint32_t b) {
    const IndexedItem &x = items[a], &y = items[b];
    return x.is_bytes == y.is_bytes && x.fqn == y.fqn && x.chunk_offsets == y.chunk_offsets;
  };
  auto hash = [&](uint32_t i) {
    const IndexedItem& it = items[i];
    uint64_t h = XXH3_64bits_withSeed(it.chunk_offsets.data(),
                                      it.chunk_offsets.size() * sizeof(int64_t), it.is_bytes);
    return XXH3_64bits_withSeed(it.fqn.data(), it.fqn.size(), h);
  };
  constexpr uint32_t kEmpty = 0xffffffffu;
  size_t capacity = 16;
  while (capacity < items.size() * 2) capacity *= 2;  // at most half full
  std::vector<uint32_t> slots(capacity, kEmpty);
  const size_t mask = capacity - 1;
  for (uint32_t i = 0; i < items.size(); ++i) {
    for (size_t s = hash(i) & mask;; s = (s + 1) & mask) {
      if (slots[s] == kEmpty) {
        slots[s] = i;
        break;
      }
      if (same(slots[s], i)) return i;
    }
  }
  return -1;
}

}  // namespace

std::string KeyName(const IndexedItem& item) { return item.fqn + "@" + ChunkFileName(item); }

uint64_t ItemChecksum(std::span<const char> bytes) { return Crc32c(bytes.data(), bytes.size()); }

// --- KeyIndex -----------------------------------------------------------------------------

Result<std::unique_ptr<KeyIndex>> KeyIndex::Create(BackingDir* dir, StateDb* db,
                                                   const KeyIndexOptions& options) {
  if (dir == nullptr || db == nullptr) return Invalid("KeyIndex needs a backing dir and a db");
  return std::unique_ptr<KeyIndex>(new KeyIndex(dir, db, options));
}

KeyIndex::~KeyIndex() = default;

std::shared_ptr<std::mutex> KeyIndex::BuildMutex(const std::string& ckpt) {
  std::lock_guard lock(build_mu_map_mu_);
  std::weak_ptr<std::mutex>& weak = build_mus_[ckpt];
  std::shared_ptr<std::mutex> m = weak.lock();
  if (!m) {
    m = std::make_shared<std::mutex>();
    weak = m;
  }
  if (build_mus_.size() > 1024) {  // drop entries nobody holds any more
    std::erase_if(build_mus_, [](const auto& kv) { return kv.second.expired(); });
  }
  return m;
}

void KeyIndex::BuildFileMaps(CkptIndex* index) {
  index->maps.clear();
  index->files.clear();
  index->places.assign(index->items.size(), Place{});
  std::vector<FileGroup> groups = GroupByFile(index->items);
  index->maps.reserve(groups.size());
  index->files.reserve(groups.size());
  for (FileGroup& g : groups) {
    const uint32_t m = static_cast<uint32_t>(index->maps.size());
    FileMap& map = index->maps.emplace_back();
    map.name = std::string(g.name);
    index->files.emplace(map.name, m);
    map.all = std::move(g.idx);
    map.begins.reserve(map.all.size());
    map.spans.reserve(map.all.size());
    for (uint32_t pos = 0; pos < map.all.size(); ++pos) {
      const uint32_t i = map.all[pos];
      const IndexedItem& it = index->items[i];
      index->places[i] = Place{m, pos, -1};
      if (it.length == 0) continue;  // owns no byte
      if (!map.spans.empty() && it.offset - map.spans.back().offset < map.spans.back().length &&
          index->error.empty()) {
        index->state = State::kPartial;
        index->error = "items overlap in " + map.name + ": " +
                       KeyName(index->items[map.spans.back().ordinal]) + " and " + KeyName(it);
      }
      index->places[i].span = static_cast<int32_t>(map.spans.size());
      map.begins.push_back(it.offset);
      map.spans.push_back(Located{i, it.kind, it.has_checksum, it.offset, it.length, it.raw_offset,
                                  it.raw_nbytes, it.checksum});
    }
    for (size_t k = 0; k < map.begins.size(); k += FileMap::kSample) {
      map.sample.push_back(map.begins[k]);
    }
  }
}

void KeyIndex::SetChecksum(CkptIndex* index, uint32_t ordinal, uint64_t checksum) {
  IndexedItem& it = index->items[ordinal];
  it.checksum = checksum;
  it.has_checksum = true;
  const Place& p = index->places[ordinal];
  if (p.span >= 0) {
    Located& l = index->maps[p.map].spans[p.span];
    l.checksum = checksum;
    l.has_checksum = true;
  }
}

std::vector<std::pair<std::string, std::string>> KeyIndex::EncodeBlocksOf(
    const std::string& ckpt, const CkptIndex& index, const std::vector<uint32_t>& ordinals) {
  std::set<std::pair<uint32_t, uint32_t>> blocks;  // (map, block)
  for (uint32_t i : ordinals) {
    const Place& p = index.places[i];
    blocks.emplace(p.map, static_cast<uint32_t>(p.pos / kItemsPerBlock));
  }
  const std::string prefix = ItemPrefix(ckpt);
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(blocks.size());
  for (auto [m, b] : blocks) {
    const FileMap& map = index.maps[m];
    std::span<const uint32_t> all(map.all);
    size_t first = size_t{b} * kItemsPerBlock;
    auto& [key, value] = out.emplace_back(BlockKey(prefix, map.name, b), std::string());
    EncodeBlock(index.items, all.subspan(first, std::min(kItemsPerBlock, all.size() - first)),
                &value);
  }
  return out;
}

Status KeyIndex::Build(const std::string& ckpt, bool checksums) {
  std::shared_ptr<std::mutex> m = BuildMutex(ckpt);
  std::lock_guard lock(*m);
  return BuildLocked(ckpt, nullptr, checksums);
}

Status KeyIndex::BuildFrom(const std::string& ckpt, const DcpMetadata& md, bool checksums) {
  std::shared_ptr<std::mutex> m = BuildMutex(ckpt);
  std::lock_guard lock(*m);
  return BuildLocked(ckpt, &md, checksums);
}

Status KeyIndex::BuildLocked(const std::string& ckpt, const DcpMetadata* given, bool checksums) {
  Clock::time_point start = Clock::now();
  double tmp_t = TmpCpu();
  const std::string md_path = Join(ckpt, ".metadata");
  auto index = std::make_unique<CkptIndex>();
  MetadataId id;
  Result<struct stat> st = dir_->Stat(md_path);
  if (st.ok()) {
    id = IdOf(*st);
  } else if (given == nullptr) {
    if (st.status().code() != Code::kNotFound) return st.status();
    // Not (or no longer) a checkpoint: drop any stale index, remember for a while.
    Forget(ckpt);
    index->state = State::kMissing;
    index->retry_after = Clock::now() + kMissingRetry;
    Install(ckpt, std::move(index));
    return NotFound("no .metadata in '" + ckpt + "'");
  }

  // Checksums the write pipeline handed over before this build.
  std::map<std::string, std::map<std::pair<uint64_t, uint64_t>, uint64_t>> known_sums;
  {
    std::unique_lock lock(mu_);
    auto it = pending_sums_.find(ckpt);
    if (it != pending_sums_.end()) {
      known_sums = std::move(it->second);
      pending_sums_.erase(it);
    }
  }

  Result<DcpMetadata> parsed = DcpMetadata{};
  if (given == nullptr) {
    Result<std::string> bytes = ReadMetadataBytes(dir_, md_path);
    parsed = bytes.ok() ? ParseDcpMetadata(*bytes) : Result<DcpMetadata>(bytes.status());
  }
  TMPT("metadata");
  const DcpMetadata* md = given != nullptr ? given : (parsed.ok() ? &*parsed : nullptr);
  auto since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  const double parse_ms = since(start);
  Clock::time_point phase = Clock::now();
  Status result = Status::Ok();

  if (md == nullptr) {
    index->state = State::kFailed;
    index->error = ".metadata: " + parsed.status().ToString();
    result = Status(Code::kCorrupt, "index of '" + ckpt + "': " + index->error);
  } else {
    index->items.reserve(md->items.size());
    if (given == nullptr) {
      for (DcpItem& d : parsed->items) {
        index->items.push_back(FromDcp(std::move(d), static_cast<uint32_t>(index->items.size())));
      }
      parsed = DcpMetadata{};  // free the rest now
    } else {
      for (const DcpItem& d : md->items) {
        index->items.push_back(FromDcp(d, static_cast<uint32_t>(index->items.size())));
      }
    }
    ptrdiff_t dup = FirstDuplicateKey(index->items);
    if (dup >= 0) {
      index->state = State::kFailed;
      index->error = ".metadata: duplicate key " + KeyName(index->items[dup]);
      index->items.clear();
      result = Status(Code::kCorrupt, "index of '" + ckpt + "': " + index->error);
    }
  }

  uint64_t unresolved = 0;
  std::string first_error;
  auto note = [&](const IndexedItem& it, const std::string& why) {
    if (unresolved++ == 0) first_error = KeyName(it) + ": " + why;
  };
  uint64_t with_sum = 0, from_blocks = 0, read_items = 0, read_bytes = 0;
  std::vector<std::string> used_block_crcs;
  TorchPickleCache pickle_cache;
  TMPT("fromdcp+dups");
  for (const FileGroup& g : GroupByFile(index->items)) {
    const std::string file(g.name);
    const std::string path = Join(ckpt, file);
    Result<OpenedFile> f = OpenShard(dir_, path);
    auto& sums = known_sums[file];
    if (!f.ok()) {
      for (uint32_t i : g.idx) {
        IndexedItem& it = index->items[i];
        if (it.kind == ItemKind::kTensor) it.kind = ItemKind::kOpaque;
        note(it, f.status().ToString());
      }
      continue;
    }
    WindowReader reader(dir_, f->fd.get(), f->size);
    std::shared_ptr<const BlockCrcMap> blocks = BlockCrcsFor(path, f->key);
    if (blocks) used_block_crcs.push_back(path);
    for (uint32_t i : g.idx) {
      IndexedItem& it = index->items[i];
      if (it.offset > f->size || f->size - it.offset < it.length) {
        if (it.kind == ItemKind::kTensor) it.kind = ItemKind::kOpaque;
        note(it, "item range past the end of " + file + " (" + std::to_string(f->size) + " bytes)");
        continue;
      }
      if (it.kind == ItemKind::kTensor) {
        std::string error;
        ResolveTensor(&reader, &it, &error, &pickle_cache);
        if (!error.empty()) note(it, error);
      }
      auto known = sums.find({it.offset, it.length});
      if (known != sums.end()) {
        it.checksum = known->second;
        it.has_checksum = true;
      }
      if (!it.has_checksum && blocks) {
        Result<std::optional<uint32_t>> c =
            CrcFromBlocks(&reader, *blocks, it.offset, it.length, f->size);
        if (c.ok() && c->has_value()) {
          it.checksum = **c;
          it.has_checksum = true;
          ++from_blocks;
        }
      }
      if (!it.has_checksum && checksums) {
        Result<uint32_t> h = reader.Crc(it.offset, it.length);
        if (h.ok()) {
          it.checksum = *h;
          it.has_checksum = true;
          ++read_items;
          read_bytes += it.length;
        } else {
          note(it, "checksum: " + h.status().ToString());
        }
      }
      if (it.has_checksum) ++with_sum;
    }
  }
  if (checksums && !used_block_crcs.empty()) {
    // Every item of those files now has its checksum in the index: the maps are done.
    std::unique_lock lock(mu_);
    for (const std::string& path : used_block_crcs) DropBlockCrcsLocked(path);
  }
  if (unresolved > 0) {
    index->state = State::kPartial;
    index->error = std::to_string(unresolved) + " item(s) not resolved; first: " + first_error;
  }
  TMPT("items");
  BuildFileMaps(index.get());
  const double items_ms = since(phase);
  TMPT("filemaps");
  phase = Clock::now();

  double build_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  json info = {{"format", kFormat},
               {"state", StateName(static_cast<int>(index->state))},
               {"error", index->error},
               {"build_ms", build_ms},
               {"built_at", static_cast<int64_t>(std::time(nullptr))},
               {"items", index->items.size()},
               {"checksum", kChecksumAlgorithm},
               {"checksums",
                {{"items", with_sum},
                 {"from_blocks", from_blocks},
                 {"read_items", read_items},
                 {"read_bytes", read_bytes}}},
               {"metadata", {{"size", id.size}, {"mtime_ns", id.mtime_ns}, {"ino", id.ino}}}};
  State state = index->state;
  std::string error = index->error;
  size_t n = index->items.size();
  double persist_ms = 0;
  {
    // Checksums recorded from now on wait, so that they reach RocksDB after these blocks.
    std::lock_guard persist_lock(persist_mu_);
    tmp_t = TmpCpu();
    Status persisted = Persist(ckpt, *index, info.dump());
    TMPT("persist");
    persist_ms = since(phase);
    if (!persisted.ok()) {
      spdlog::warn("key index: cannot persist the index of '{}': {}", ckpt, persisted.ToString());
    }
    Install(ckpt, std::move(index));
  }
  if (state == State::kOk) {
    spdlog::info(
        "key index: indexed '{}': {} items in {:.1f} ms (metadata {:.1f}, items {:.1f}, "
        "persist {:.1f}); checksums: {} from write-path blocks, {} read ({} bytes), {} none",
        ckpt, n, build_ms + persist_ms, parse_ms, items_ms, persist_ms, from_blocks, read_items,
        read_bytes, n - with_sum);
  } else {
    spdlog::warn("key index: '{}' indexed as {}: {}", ckpt, StateName(static_cast<int>(state)),
                 error);
  }
  return result;
}

Status KeyIndex::Persist(const std::string& ckpt, const CkptIndex& index, const std::string& info) {
  const std::string prefix = ItemPrefix(ckpt);
  std::vector<std::pair<std::string, std::string>> puts;
  for (const FileMap& map : index.maps) {
    std::span<const uint32_t> all(map.all);
    for (size_t first = 0; first < all.size(); first += kItemsPerBlock) {
      auto& [key, value] = puts.emplace_back(
          BlockKey(prefix, map.name, static_cast<uint32_t>(first / kItemsPerBlock)), std::string());
      EncodeBlock(index.items, all.subspan(first, std::min(kItemsPerBlock, all.size() - first)),
                  &value);
    }
  }
  puts.emplace_back(InfoKey(ckpt), info);
  // Keys of an earlier build that this one does not overwrite.
  std::vector<std::string> old_keys;
  CKPT_RETURN_IF_ERROR(db_->Scan(
      prefix, [&](std::string_view key, std::string_view) { old_keys.emplace_back(key); }));
  std::vector<std::string> deletes;
  if (!old_keys.empty()) {
    std::unordered_set<std::string_view> new_keys;
    new_keys.reserve(puts.size());
    for (const auto& [key, value] : puts) new_keys.insert(key);
    for (std::string& key : old_keys) {
      if (!new_keys.count(key)) deletes.push_back(std::move(key));
    }
  }
  return db_->Write(puts, deletes);
}

void KeyIndex::Install(const std::string& ckpt, std::unique_ptr<CkptIndex> index) {
  std::vector<std::pair<std::string, std::string>> puts;
  {
    std::unique_lock lock(mu_);
    // Checksums recorded while this index was being built.
    auto pending = pending_sums_.find(ckpt);
    if (pending != pending_sums_.end() && index->state != State::kMissing) {
      std::vector<uint32_t> changed;
      for (IndexedItem& it : index->items) {
        auto f = pending->second.find(it.file);
        if (f == pending->second.end()) continue;
        auto s = f->second.find({it.offset, it.length});
        if (s == f->second.end()) continue;
        SetChecksum(index.get(), it.ordinal, s->second);
        changed.push_back(it.ordinal);
      }
      pending_sums_.erase(pending);
      if (!changed.empty()) puts = EncodeBlocksOf(ckpt, *index, changed);
    }
    ckpts_[ckpt] = std::move(index);
  }
  if (!puts.empty()) {
    Status st = db_->Write(puts, {});
    if (!st.ok()) spdlog::warn("key index: persist checksums of '{}': {}", ckpt, st.ToString());
  }
}

Status KeyIndex::LoadFromDb(const std::string& ckpt, bool* found) {
  *found = false;
  Result<std::string> raw = db_->Get(InfoKey(ckpt));
  if (!raw.ok()) return raw.status().code() == Code::kNotFound ? Status::Ok() : raw.status();
  json info = json::parse(*raw, nullptr, /*allow_exceptions=*/false);
  auto index = std::make_unique<CkptIndex>();
  MetadataId recorded;
  uint64_t count = 0;
  try {
    if (!info.is_object() || info.value("format", 0) != kFormat) return Status::Ok();
    std::string state = info.value("state", "");
    if (state == "ok") {
      index->state = State::kOk;
    } else if (state == "partial") {
      index->state = State::kPartial;
    } else if (state == "failed") {
      index->state = State::kFailed;
    } else {
      return Status::Ok();
    }
    index->error = info.value("error", "");
    count = info.value("items", uint64_t{0});
    const json& m = info.at("metadata");
    recorded = {m.at("size").get<uint64_t>(), m.at("mtime_ns").get<uint64_t>(),
                m.at("ino").get<uint64_t>()};
  } catch (const json::exception&) {
    return Status::Ok();  // unreadable record: rebuild
  }
  // The checkpoint may have been rewritten (by another node, or before a restart).
  Result<struct stat> st = dir_->Stat(Join(ckpt, ".metadata"));
  if (!st.ok() || !(IdOf(*st) == recorded)) return Status::Ok();

  // Blocks hold items in file order; each item's ordinal says where it goes.
  bool bad = false;
  std::vector<IndexedItem> loaded;
  loaded.reserve(count);
  CKPT_RETURN_IF_ERROR(db_->Scan(ItemPrefix(ckpt), [&](std::string_view, std::string_view v) {
    if (!bad && (!DecodeBlock(v, &loaded) || loaded.size() > count)) bad = true;
  }));
  if (bad || loaded.size() != count) return Status::Ok();
  index->items.resize(count);
  std::vector<bool> seen(count);
  for (IndexedItem& it : loaded) {
    if (it.ordinal >= count || seen[it.ordinal]) return Status::Ok();
    seen[it.ordinal] = true;
    index->items[it.ordinal] = std::move(it);
  }
  loaded = {};
  State state = index->state;
  std::string error = index->error;
  BuildFileMaps(index.get());
  index->state = state;  // overlaps were already recorded at build time
  index->error = error;
  {
    std::lock_guard persist_lock(persist_mu_);
    Install(ckpt, std::move(index));
  }
  *found = true;
  return Status::Ok();
}

Status KeyIndex::Ensure(const std::string& ckpt, bool checksums) {
  auto present = [&] {
    std::shared_lock lock(mu_);
    auto it = ckpts_.find(ckpt);
    return it != ckpts_.end() &&
           (it->second->state != State::kMissing || Clock::now() < it->second->retry_after);
  };
  if (present()) return Status::Ok();
  std::shared_ptr<std::mutex> m = BuildMutex(ckpt);
  std::lock_guard lock(*m);
  if (present()) return Status::Ok();
  bool found = false;
  Status st = LoadFromDb(ckpt, &found);
  if (!st.ok()) spdlog::warn("key index: load '{}' from the state db: {}", ckpt, st.ToString());
  if (found) return Status::Ok();
  st = BuildLocked(ckpt, nullptr, checksums);
  // A missing or failed checkpoint is installed with its state; only I/O errors remain.
  if (st.code() == Code::kNotFound || st.code() == Code::kCorrupt) return Status::Ok();
  return st;
}

Result<std::vector<IndexedItem>> KeyIndex::Items(const std::string& ckpt) {
  CKPT_RETURN_IF_ERROR(Ensure(ckpt, /*checksums=*/false));
  std::shared_lock lock(mu_);
  auto it = ckpts_.find(ckpt);
  if (it == ckpts_.end()) return Internal("index of '" + ckpt + "' vanished");
  const CkptIndex& index = *it->second;
  if (index.state == State::kMissing) return NotFound("no .metadata in '" + ckpt + "'");
  if (index.state == State::kFailed) return Corrupt(index.error);
  return index.items;
}

template <typename Fn>
auto KeyIndex::WithItemAt(const std::string& ckpt, const std::string& file, uint64_t offset,
                          Fn fn) {
  for (int attempt = 0;; ++attempt) {
    {
      std::shared_lock lock(mu_);
      auto it = ckpts_.find(ckpt);
      if (it != ckpts_.end()) {
        const CkptIndex& index = *it->second;
        if (index.state != State::kMissing || Clock::now() < index.retry_after) {
          auto f = index.files.find(file);
          if (f == index.files.end()) return fn(index, nullptr);
          const FileMap& map = index.maps[f->second];
          ptrdiff_t i = map.Find(offset);
          return fn(index, i < 0 ? nullptr : &map.spans[i]);
        }
      }
    }
    if (attempt > 0 || !Ensure(ckpt, /*checksums=*/false).ok()) {
      static const CkptIndex kNone;
      std::shared_lock lock(mu_);  // fn's contract: called under the lock
      return fn(kNone, nullptr);
    }
  }
}

std::optional<IndexedItem> KeyIndex::Resolve(const std::string& ckpt, const std::string& file,
                                             uint64_t offset) {
  return WithItemAt(ckpt, file, offset,
                    [](const CkptIndex& index, const Located* l) -> std::optional<IndexedItem> {
                      if (l == nullptr) return std::nullopt;
                      return index.items[l->ordinal];
                    });
}

std::optional<KeyIndex::Located> KeyIndex::Locate(const std::string& ckpt, const std::string& file,
                                                  uint64_t offset) {
  return WithItemAt(ckpt, file, offset,
                    [](const CkptIndex&, const Located* l) -> std::optional<Located> {
                      if (l == nullptr) return std::nullopt;
                      return *l;
                    });
}

std::string KeyIndex::IndexError(const std::string& ckpt) {
  {
    std::shared_lock lock(mu_);
    auto it = ckpts_.find(ckpt);
    if (it != ckpts_.end()) return it->second->error;
  }
  Result<std::string> raw = db_->Get(InfoKey(ckpt));
  if (!raw.ok()) return "";
  json info = json::parse(*raw, nullptr, false);
  if (!info.is_object()) return "";
  auto e = info.find("error");
  return e != info.end() && e->is_string() ? e->get<std::string>() : "";
}

Result<VerifyReport> KeyIndex::Verify(const std::string& ckpt) {
  CKPT_RETURN_IF_ERROR(Ensure(ckpt, /*checksums=*/false));
  std::vector<IndexedItem> items;
  {
    std::shared_lock lock(mu_);
    auto it = ckpts_.find(ckpt);
    if (it == ckpts_.end()) return Internal("index of '" + ckpt + "' vanished");
    if (it->second->state == State::kMissing) return NotFound("no .metadata in '" + ckpt + "'");
    items = it->second->items;
  }
  VerifyReport report;
  auto bad = [&](std::string key, std::string why) {
    report.bad.emplace_back(std::move(key), std::move(why));
  };

  // The .metadata itself, and whether the index still describes it.
  Result<std::string> bytes = ReadMetadataBytes(dir_, Join(ckpt, ".metadata"));
  Result<DcpMetadata> md =
      bytes.ok() ? ParseDcpMetadata(*bytes) : Result<DcpMetadata>(bytes.status());
  if (!md.ok()) {
    bad(".metadata", md.status().ToString());
  } else {
    std::unordered_map<std::string, const IndexedItem*> by_key;
    for (const IndexedItem& it : items) by_key[ItemSuffix(it)] = &it;
    for (uint32_t i = 0; i < md->items.size(); ++i) {
      IndexedItem want = FromDcp(md->items[i], i);
      auto found = by_key.find(ItemSuffix(want));
      if (found == by_key.end()) {
        bad(KeyName(want), "in .metadata but not in the index");
        continue;
      }
      const IndexedItem& have = *found->second;
      if (have.file != want.file || have.offset != want.offset || have.length != want.length ||
          have.dtype != want.dtype || have.chunk_sizes != want.chunk_sizes ||
          have.global_size != want.global_size || have.transforms != want.transforms) {
        bad(KeyName(want), "the index differs from .metadata");
      }
      by_key.erase(found);
    }
    for (const auto& [key, it] : by_key) bad(KeyName(*it), "in the index but not in .metadata");
  }

  TorchPickleCache pickle_cache;
  for (const FileGroup& g : GroupByFile(items)) {
    const std::string file(g.name);
    Result<OpenedFile> f = OpenShard(dir_, Join(ckpt, file));
    if (!f.ok()) {
      for (uint32_t i : g.idx) bad(KeyName(items[i]), f.status().ToString());
      continue;
    }
    WindowReader reader(dir_, f->fd.get(), f->size);
    for (uint32_t i : g.idx) {
      const IndexedItem& it = items[i];
      ++report.items;
      if (it.offset > f->size || f->size - it.offset < it.length) {
        bad(KeyName(it), "item range past the end of " + file);
        continue;
      }
      // Structure: the archive still reads as what the index says.
      if (it.kind == ItemKind::kTensor) {
        IndexedItem again = it;
        std::string error;
        ResolveTensor(&reader, &again, &error, &pickle_cache);
        if (!error.empty()) {
          bad(KeyName(it), "archive: " + error);
          continue;
        }
        if (again.kind != ItemKind::kTensor || again.raw_offset != it.raw_offset ||
            again.raw_nbytes != it.raw_nbytes || again.stride != it.stride ||
            again.storage_offset != it.storage_offset) {
          bad(KeyName(it), "archive no longer agrees with the index");
          continue;
        }
      } else if (it.is_bytes && it.transforms.empty()) {
        Result<ZipDirectory> zd =
            ReadZipDirectory(reader.ItemReader(it.offset, it.length), it.length);
        if (!zd.ok()) {
          bad(KeyName(it), "archive: " + zd.status().ToString());
          continue;
        }
      }
      Result<uint32_t> h = reader.Crc(it.offset, it.length);
      if (!h.ok()) {
        bad(KeyName(it), "read: " + h.status().ToString());
        continue;
      }
      report.bytes += it.length;
      if (!it.has_checksum) {
        ++report.unchecked;
      } else if (*h != it.checksum) {
        char buf[80];
        std::snprintf(buf, sizeof(buf), "checksum mismatch: %s %08x, indexed %08llx",
                      kChecksumAlgorithm, *h, static_cast<unsigned long long>(it.checksum));
        bad(KeyName(it), buf);
      }
    }
  }
  return report;
}

Result<uint64_t> KeyIndex::FillChecksums(const std::string& ckpt) {
  CKPT_RETURN_IF_ERROR(Ensure(ckpt, /*checksums=*/false));
  std::vector<IndexedItem> items;
  {
    std::shared_lock lock(mu_);
    auto it = ckpts_.find(ckpt);
    if (it == ckpts_.end()) return Internal("index of '" + ckpt + "' vanished");
    const CkptIndex& index = *it->second;
    if (index.state == State::kMissing) return NotFound("no .metadata in '" + ckpt + "'");
    if (index.state == State::kFailed) return Corrupt(index.error);
    for (const IndexedItem& item : index.items) {
      if (!item.has_checksum) items.push_back(item);
    }
  }
  uint64_t filled = 0;
  Status first_error;
  for (const FileGroup& g : GroupByFile(items)) {
    const std::string file(g.name);
    Result<OpenedFile> f = OpenShard(dir_, Join(ckpt, file));
    if (!f.ok()) {
      if (first_error.ok()) first_error = f.status();
      continue;
    }
    WindowReader reader(dir_, f->fd.get(), f->size);
    std::vector<RangeChecksum> sums;
    for (uint32_t i : g.idx) {
      const IndexedItem& it = items[i];
      if (it.offset > f->size || f->size - it.offset < it.length) continue;  // a broken item
      Result<uint32_t> h = reader.Crc(it.offset, it.length);
      if (!h.ok()) {
        if (first_error.ok()) first_error = h.status();
        continue;
      }
      sums.push_back({it.offset, it.length, *h});
    }
    filled += sums.size();
    RecordChecksums(ckpt, file, sums);
  }
  if (!first_error.ok() && filled == 0) return first_error;
  return filled;
}

void KeyIndex::AddBlockCrcs(const std::string& path, const FileKey& id,
                            std::shared_ptr<const BlockCrcMap> map) {
  if (!map || !map->finished() || map->size() != id.size) return;
  const size_t bytes = map->MemoryBytes();
  std::unique_lock lock(mu_);
  DropBlockCrcsLocked(path);
  if (bytes > opts_.max_block_crc_bytes) return;
  // Oldest first: a build normally follows its shards' publication within seconds.
  while (block_crc_total_ + bytes > opts_.max_block_crc_bytes && !block_crc_age_.empty()) {
    std::string victim = block_crc_age_.begin()->second;
    spdlog::debug("key index: dropping the block checksums of {} (memory bound)", victim);
    DropBlockCrcsLocked(victim);
  }
  const uint64_t seq = ++block_crc_seq_;
  block_crcs_[path] = PendingCrcs{id, std::move(map), seq, bytes};
  block_crc_age_[seq] = path;
  block_crc_total_ += bytes;
}

uint64_t KeyIndex::block_crc_bytes() {
  std::shared_lock lock(mu_);
  return block_crc_total_;
}

void KeyIndex::DropBlockCrcsLocked(const std::string& path) {
  auto it = block_crcs_.find(path);
  if (it == block_crcs_.end()) return;
  block_crc_total_ -= it->second.bytes;
  block_crc_age_.erase(it->second.seq);
  block_crcs_.erase(it);
}

std::shared_ptr<const BlockCrcMap> KeyIndex::BlockCrcsFor(const std::string& path,
                                                          const FileKey& id) {
  std::shared_lock lock(mu_);
  auto it = block_crcs_.find(path);
  if (it == block_crcs_.end() || !(it->second.id == id)) return nullptr;
  return it->second.map;
}

void KeyIndex::RecordChecksums(const std::string& ckpt, const std::string& file,
                               const std::vector<RangeChecksum>& sums) {
  std::vector<std::pair<std::string, std::string>> puts;
  // Held until the write, so that blocks reach RocksDB in the order they were encoded.
  std::lock_guard persist_lock(persist_mu_);
  {
    std::unique_lock lock(mu_);
    auto it = ckpts_.find(ckpt);
    if (it == ckpts_.end() || it->second->state == State::kMissing) {
      auto& dst = pending_sums_[ckpt][file];
      for (const RangeChecksum& s : sums) dst[{s.offset, s.length}] = s.checksum;
      return;
    }
    CkptIndex& index = *it->second;
    auto f = index.files.find(file);
    if (f == index.files.end()) return;
    const FileMap& map = index.maps[f->second];
    std::vector<uint32_t> changed;
    for (const RangeChecksum& s : sums) {
      ptrdiff_t i = map.Find(s.offset);
      if (i < 0) continue;
      const Located& l = map.spans[i];
      if (l.offset != s.offset || l.length != s.length) continue;
      if (l.has_checksum && l.checksum == s.checksum) continue;
      SetChecksum(&index, l.ordinal, s.checksum);
      changed.push_back(l.ordinal);
    }
    if (changed.empty()) return;
    puts = EncodeBlocksOf(ckpt, index, changed);
  }
  Status st = db_->Write(puts, {});
  if (!st.ok()) spdlog::warn("key index: persist checksums of '{}': {}", ckpt, st.ToString());
}

void KeyIndex::Forget(const std::string& ckpt) {
  {
    std::unique_lock lock(mu_);
    ckpts_.erase(ckpt);
    pending_sums_.erase(ckpt);
    const std::string prefix = ckpt.empty() ? "" : ckpt + "/";
    std::vector<std::string> paths;
    for (auto it = block_crcs_.lower_bound(prefix);
         it != block_crcs_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
      // Only files directly in the checkpoint dir: nested checkpoints have their own.
      if (it->first.find('/', prefix.size()) == std::string::npos) paths.push_back(it->first);
    }
    for (const std::string& path : paths) DropBlockCrcsLocked(path);
  }
  std::vector<std::string> deletes{InfoKey(ckpt)};
  Status st = db_->Scan(ItemPrefix(ckpt),
                        [&](std::string_view key, std::string_view) { deletes.emplace_back(key); });
  if (st.ok()) st = db_->Write({}, deletes);
  if (!st.ok()) spdlog::warn("key index: forget '{}': {}", ckpt, st.ToString());
}

void KeyIndex::OnRenamed(const std::string& from, const std::string& to) {
  if (from == to) return;
  auto moved = [&](const std::string& ckpt) -> std::optional<std::string> {
    if (ckpt == from) return to;
    if (from.empty()) return Join(to, ckpt);
    if (ckpt.size() > from.size() && ckpt.compare(0, from.size(), from) == 0 &&
        ckpt[from.size()] == '/') {
      return to + ckpt.substr(from.size());
    }
    return std::nullopt;
  };
  // Whatever was indexed at the destination was replaced.
  for (const std::string& ckpt : IndexedCheckpoints()) {
    if (ckpt == to ||
        (ckpt.size() > to.size() && ckpt.compare(0, to.size(), to) == 0 &&
         ckpt[to.size()] == '/') ||
        to.empty()) {
      if (!moved(ckpt)) Forget(ckpt);
    }
  }
  {
    std::unique_lock lock(mu_);
    std::vector<std::string> names;
    for (const auto& [ckpt, index] : ckpts_) {
      if (moved(ckpt)) names.push_back(ckpt);
    }
    for (const std::string& ckpt : names) {
      auto node = ckpts_.extract(ckpt);
      node.key() = *moved(ckpt);
      ckpts_.insert(std::move(node));
    }
    std::vector<std::string> pend;
    for (const auto& [ckpt, sums] : pending_sums_) {
      if (moved(ckpt)) pend.push_back(ckpt);
    }
    for (const std::string& ckpt : pend) {
      auto node = pending_sums_.extract(ckpt);
      node.key() = *moved(ckpt);
      pending_sums_.insert(std::move(node));
    }
    // Block CRCs are keyed by file path; a file's identity does not change with a rename.
    std::vector<std::string> crc_paths;
    for (const auto& [path, pending] : block_crcs_) {
      if (moved(path)) crc_paths.push_back(path);
    }
    for (const std::string& path : crc_paths) {
      auto node = block_crcs_.extract(path);
      node.key() = *moved(path);
      DropBlockCrcsLocked(node.key());  // the file renamed over is gone
      block_crc_age_[node.mapped().seq] = node.key();
      block_crcs_.insert(std::move(node));
    }
  }
  // RocksDB: values name files relative to the checkpoint, so only keys change.
  std::vector<std::string> persisted;
  Status st = db_->Scan("i/", [&](std::string_view key, std::string_view) {
    std::string ckpt(key.substr(2));
    if (moved(ckpt)) persisted.push_back(ckpt);
  });
  for (const std::string& ckpt : persisted) {
    if (!st.ok()) break;
    std::string dest = *moved(ckpt);
    std::vector<std::pair<std::string, std::string>> puts;
    std::vector<std::string> deletes;
    const std::string old_prefix = ItemPrefix(ckpt), new_prefix = ItemPrefix(dest);
    st = db_->Scan(old_prefix, [&](std::string_view key, std::string_view value) {
      puts.emplace_back(new_prefix + std::string(key.substr(old_prefix.size())),
                        std::string(value));
      deletes.emplace_back(key);
    });
    if (!st.ok()) break;
    Result<std::string> info = db_->Get(InfoKey(ckpt));
    if (info.ok()) {
      puts.emplace_back(InfoKey(dest), *info);
      deletes.push_back(InfoKey(ckpt));
    }
    st = db_->Write(puts, deletes);
  }
  if (!st.ok()) spdlog::warn("key index: rename '{}' -> '{}': {}", from, to, st.ToString());
}

bool KeyIndex::IsIndexed(const std::string& ckpt) {
  {
    std::shared_lock lock(mu_);
    auto it = ckpts_.find(ckpt);
    if (it != ckpts_.end() && it->second->state != State::kMissing) return true;
  }
  return db_->Get(InfoKey(ckpt)).ok();
}

std::vector<std::string> KeyIndex::IndexedCheckpoints() {
  std::set<std::string> out;
  Status st =
      db_->Scan("i/", [&](std::string_view key, std::string_view) { out.emplace(key.substr(2)); });
  if (!st.ok()) spdlog::warn("key index: list checkpoints: {}", st.ToString());
  std::shared_lock lock(mu_);
  for (const auto& [ckpt, index] : ckpts_) {
    if (index->state != State::kMissing) out.insert(ckpt);
  }
  return {out.begin(), out.end()};
}

// --- Names --------------------------------------------------------------------------------

namespace {
constexpr size_t kMaxName = 255;
constexpr size_t kHashSuffix = 17;  // "~" + 16 hex digits
const char kHex[] = "0123456789ABCDEF";

bool NeedsEscape(unsigned char c) {
  return c == '%' || c == '/' || c == '~' || c < 0x20 || c == 0x7f;
}
int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

std::string EscapeFqn(const std::string& fqn) {
  if (fqn.empty()) return "%";
  std::string out;
  out.reserve(fqn.size());
  for (size_t i = 0; i < fqn.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(fqn[i]);
    if (NeedsEscape(c) || (i == 0 && c == '.')) {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (out.size() <= kMaxName) return out;
  size_t cut = kMaxName - kHashSuffix;
  // Never cut inside a %XX escape.
  if (out[cut - 1] == '%') {
    cut -= 1;
  } else if (out[cut - 2] == '%') {
    cut -= 2;
  }
  out.resize(cut);
  char suffix[kHashSuffix + 1];
  std::snprintf(suffix, sizeof(suffix), "~%016llx",
                static_cast<unsigned long long>(XXH3_64bits(fqn.data(), fqn.size())));
  return out + suffix;
}

std::optional<std::string> UnescapeFqn(std::string_view name) {
  if (name == "%") return std::string();
  std::string out;
  out.reserve(name.size());
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    if (c == '%') {
      if (i + 2 >= name.size()) return std::nullopt;
      int hi = HexValue(name[i + 1]), lo = HexValue(name[i + 2]);
      if (hi < 0 || lo < 0) return std::nullopt;
      out.push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    } else if (NeedsEscape(static_cast<unsigned char>(c)) || c == '\0') {
      return std::nullopt;  // '~' marks a hashed name
    } else {
      out.push_back(c);
    }
  }
  if (EscapeFqn(out) != name) return std::nullopt;  // not canonical
  return out;
}

std::optional<std::string> FindFqnByEscapedName(const std::vector<std::string>& fqns,
                                                std::string_view name) {
  if (std::optional<std::string> plain = UnescapeFqn(name)) {
    if (std::find(fqns.begin(), fqns.end(), *plain) != fqns.end()) return plain;
    return std::nullopt;
  }
  for (const std::string& fqn : fqns) {
    if (EscapeFqn(fqn) == name) return fqn;
  }
  return std::nullopt;
}

std::string ChunkFileName(const IndexedItem& item) {
  if (item.is_bytes) return "data";
  if (item.chunk_offsets.empty()) return "scalar";
  std::string out;
  for (size_t i = 0; i < item.chunk_offsets.size(); ++i) {
    if (i) out.push_back('_');
    out += std::to_string(item.chunk_offsets[i]);
  }
  return out;
}

}  // namespace ckptfs::store
