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
#include "store/torch_zip.h"

namespace ckptfs::store {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// "i/" record and item value format. 2: checksums are CRC32C (1 was XXH3-64): an index of an
// older format is rebuilt on first use, like any missing one.
constexpr int kFormat = 2;
constexpr uint8_t kValueVersion = 2;
constexpr uint64_t kMaxMetadataBytes = 256ull << 20;  // PickleLimits::max_input_bytes
constexpr size_t kWindowCapacity = 4u << 20;
constexpr size_t kReadAhead = 256u << 10;
constexpr auto kMissingRetry = std::chrono::seconds(1);

std::string Join(const std::string& ckpt, const std::string& name) {
  return ckpt.empty() ? name : ckpt + "/" + name;
}

std::string InfoKey(const std::string& ckpt) { return "i/" + ckpt; }
std::string ItemPrefix(const std::string& ckpt) { return "k/" + ckpt + '\0'; }

void AppendBigEndian(std::string* out, uint64_t v) {
  for (int i = 7; i >= 0; --i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

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

// --- Binary value encoding ----------------------------------------------------------------

void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
uint64_t ZigZag(int64_t v) {
  return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);
}
int64_t UnZigZag(uint64_t v) { return static_cast<int64_t>((v >> 1) ^ (~(v & 1) + 1)); }
void PutString(std::string* out, std::string_view s) {
  PutVarint(out, s.size());
  out->append(s);
}
void PutInts(std::string* out, const std::vector<int64_t>& v) {
  PutVarint(out, v.size());
  for (int64_t x : v) PutVarint(out, ZigZag(x));
}

std::string EncodeItem(const IndexedItem& item) {
  std::string out;
  out.reserve(64 + item.fqn.size() + item.file.size());
  out.push_back(static_cast<char>(kValueVersion));
  out.push_back(static_cast<char>(item.kind));
  out.push_back(static_cast<char>((item.has_checksum ? 1 : 0) | (item.is_bytes ? 2 : 0)));
  PutVarint(&out, item.ordinal);
  PutString(&out, item.fqn);
  PutString(&out, item.dtype);
  PutString(&out, item.file);
  PutVarint(&out, item.offset);
  PutVarint(&out, item.length);
  PutVarint(&out, item.raw_offset);
  PutVarint(&out, item.raw_nbytes);
  PutVarint(&out, ZigZag(item.storage_offset));
  PutVarint(&out, item.checksum);
  PutInts(&out, item.chunk_offsets);
  PutInts(&out, item.chunk_sizes);
  PutInts(&out, item.global_size);
  PutInts(&out, item.stride);
  PutVarint(&out, item.transforms.size());
  for (const std::string& t : item.transforms) PutString(&out, t);
  return out;
}

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
  std::vector<int64_t> Ints() {
    uint64_t n = Varint();
    if (n > in_.size()) return (Fail(), std::vector<int64_t>());
    std::vector<int64_t> v(n);
    for (auto& x : v) x = UnZigZag(Varint());
    return v;
  }

 private:
  uint8_t Fail() {
    ok_ = false;
    in_ = {};
    return 0;
  }
  std::string_view in_;
  bool ok_ = true;
};

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

// --- Reading items ------------------------------------------------------------------------

// Serves reads of one open shard file from a read-ahead window, so that the small reads of
// the zip reader over many back-to-back items cost few syscalls.
class WindowReader {
 public:
  WindowReader(BackingDir* dir, int fd, uint64_t file_size)
      : dir_(dir), fd_(fd), size_(file_size), buf_(kWindowCapacity) {}

  // [off, off+len) of the file; len <= kWindowCapacity. Valid until the next call.
  Result<std::string_view> View(uint64_t off, size_t len) {
    if (off > size_ || size_ - off < len) return Corrupt("read past the end of the file");
    if (off >= buf_off_ && off + len <= buf_off_ + buf_len_) {
      return std::string_view(buf_.data() + (off - buf_off_), len);
    }
    size_t want = static_cast<size_t>(std::min<uint64_t>(
        std::max(len, kReadAhead), std::min<uint64_t>(kWindowCapacity, size_ - off)));
    buf_len_ = 0;
    CKPT_ASSIGN_OR_RETURN(size_t got, dir_->PRead(fd_, buf_.data(), want, static_cast<off_t>(off)));
    if (got < len) return Corrupt("short read (file shrank?)");
    buf_off_ = off;
    buf_len_ = got;
    return std::string_view(buf_.data(), len);
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

  ReadAtFn ItemReader(uint64_t item_offset, uint64_t item_length) {
    return [this, item_offset, item_length](uint64_t rel, std::span<char> dst) -> Status {
      if (rel > item_length || item_length - rel < dst.size()) {
        return Corrupt("read past the end of the item");
      }
      return ReadInto(item_offset + rel, dst);
    };
  }

 private:
  BackingDir* dir_;
  int fd_;
  uint64_t size_;
  std::vector<char> buf_;
  uint64_t buf_off_ = 0;
  size_t buf_len_ = 0;
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

Result<std::string> ReadWhole(BackingDir* dir, const std::string& path, uint64_t max_bytes) {
  CKPT_ASSIGN_OR_RETURN(OpenedFile f, OpenShard(dir, path));
  if (f.size > max_bytes) {
    return Corrupt(path + " is " + std::to_string(f.size) + " bytes, over the limit");
  }
  std::string out(f.size, '\0');
  CKPT_ASSIGN_OR_RETURN(size_t got, dir->PRead(f.fd.get(), out.data(), out.size(), 0));
  out.resize(got);
  return out;
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

// What ResolveItemData() checks against the archive.
DcpItem ToDcp(const IndexedItem& it) {
  DcpItem d;
  d.kind = it.kind;
  d.fqn = it.fqn;
  d.chunk_sizes = it.chunk_sizes;
  d.dtype = it.dtype;
  d.file = it.file;
  d.offset = it.offset;
  d.length = it.length;
  d.is_bytes = it.is_bytes;
  return d;
}

// Resolves a kTensor item from its archive; turns it kOpaque (with `*error`) when the
// archive is broken or contradicts the metadata. Opaque-by-design archives (compressed,
// big-endian, ...) turn kOpaque without an error.
void ResolveTensor(WindowReader* reader, IndexedItem* item, std::string* error) {
  Result<TorchSaveTensor> t =
      ParseTorchSaveItem(reader->ItemReader(item->offset, item->length), item->length);
  Status st = t.ok() ? Status::Ok() : t.status();
  DcpItem d = ToDcp(*item);
  if (st.ok()) st = ResolveItemData(*t, &d);
  if (!st.ok()) {
    item->kind = ItemKind::kOpaque;
    *error = st.ToString();
    return;
  }
  item->kind = d.kind;
  if (d.data_resolved) {
    item->raw_offset = d.raw_offset;
    item->raw_nbytes = d.raw_nbytes;
    item->stride = d.stride;
    item->storage_offset = d.storage_offset;
  }
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

// Orders items by (file, offset) so each shard file is opened once and read forward.
std::vector<uint32_t> FileOrder(const std::vector<IndexedItem>& items) {
  std::vector<uint32_t> order(items.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const IndexedItem &x = items[a], &y = items[b];
    if (x.file != y.file) return x.file < y.file;
    return x.offset < y.offset;
  });
  return order;
}

// Calls fn(file, indices) for each run of items of one file in `order`.
template <typename Fn>
void ForEachFile(const std::vector<IndexedItem>& items, const std::vector<uint32_t>& order, Fn fn) {
  for (size_t b = 0; b < order.size();) {
    size_t e = b;
    while (e < order.size() && items[order[e]].file == items[order[b]].file) ++e;
    fn(items[order[b]].file, std::span<const uint32_t>(order.data() + b, e - b));
    b = e;
  }
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
  index->files.clear();
  std::vector<uint32_t> order = FileOrder(index->items);
  ForEachFile(index->items, order, [&](const std::string& file, std::span<const uint32_t> idx) {
    FileMap& map = index->files[file];
    map.begins.reserve(idx.size());
    map.ends.reserve(idx.size());
    map.items.reserve(idx.size());
    for (uint32_t i : idx) {
      const IndexedItem& it = index->items[i];
      if (it.length == 0) continue;  // owns no byte
      if (!map.ends.empty() && it.offset < map.ends.back() && index->error.empty()) {
        index->state = State::kPartial;
        index->error = "items overlap in " + file + ": " + KeyName(index->items[map.items.back()]) +
                       " and " + KeyName(it);
      }
      map.begins.push_back(it.offset);
      map.ends.push_back(it.offset + it.length);
      map.items.push_back(i);
    }
  });
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
    Result<std::string> bytes = ReadWhole(dir_, md_path, kMaxMetadataBytes);
    parsed = bytes.ok() ? ParseDcpMetadata(*bytes) : Result<DcpMetadata>(bytes.status());
  }
  const DcpMetadata* md = given != nullptr ? given : (parsed.ok() ? &*parsed : nullptr);
  auto since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  const double parse_ms = since(start);
  Clock::time_point phase = Clock::now();
  Status result = Status::Ok();
  std::vector<std::string> keys;  // ItemSuffix of each item

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
    keys.reserve(index->items.size());
    for (const IndexedItem& it : index->items) keys.push_back(ItemSuffix(it));
    std::unordered_set<std::string_view> distinct;
    distinct.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!distinct.insert(keys[i]).second) {
        index->state = State::kFailed;
        index->error = ".metadata: duplicate key " + KeyName(index->items[i]);
        index->items.clear();
        keys.clear();
        result = Status(Code::kCorrupt, "index of '" + ckpt + "': " + index->error);
        break;
      }
    }
  }

  uint64_t unresolved = 0;
  std::string first_error;
  auto note = [&](const IndexedItem& it, const std::string& why) {
    if (unresolved++ == 0) first_error = KeyName(it) + ": " + why;
  };
  uint64_t with_sum = 0, from_blocks = 0, read_items = 0, read_bytes = 0;
  std::vector<std::string> used_block_crcs;
  std::vector<uint32_t> order = FileOrder(index->items);
  ForEachFile(index->items, order, [&](const std::string& file, std::span<const uint32_t> idx) {
    const std::string path = Join(ckpt, file);
    Result<OpenedFile> f = OpenShard(dir_, path);
    auto& sums = known_sums[file];
    if (!f.ok()) {
      for (uint32_t i : idx) {
        IndexedItem& it = index->items[i];
        if (it.kind == ItemKind::kTensor) it.kind = ItemKind::kOpaque;
        note(it, f.status().ToString());
      }
      return;
    }
    WindowReader reader(dir_, f->fd.get(), f->size);
    std::shared_ptr<const BlockCrcMap> blocks = BlockCrcsFor(path, f->key);
    if (blocks) used_block_crcs.push_back(path);
    for (uint32_t i : idx) {
      IndexedItem& it = index->items[i];
      if (it.offset > f->size || f->size - it.offset < it.length) {
        if (it.kind == ItemKind::kTensor) it.kind = ItemKind::kOpaque;
        note(it, "item range past the end of " + file + " (" + std::to_string(f->size) + " bytes)");
        continue;
      }
      if (it.kind == ItemKind::kTensor) {
        std::string error;
        ResolveTensor(&reader, &it, &error);
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
  });
  if (checksums && !used_block_crcs.empty()) {
    // Every item of those files now has its checksum in the index: the maps are done.
    std::unique_lock lock(mu_);
    for (const std::string& path : used_block_crcs) DropBlockCrcsLocked(path);
  }
  if (unresolved > 0) {
    index->state = State::kPartial;
    index->error = std::to_string(unresolved) + " item(s) not resolved; first: " + first_error;
  }
  BuildFileMaps(index.get());
  const double items_ms = since(phase);
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
  Status persisted = Persist(ckpt, *index, keys, info.dump());
  const double persist_ms = since(phase);
  if (!persisted.ok()) {
    spdlog::warn("key index: cannot persist the index of '{}': {}", ckpt, persisted.ToString());
  }
  State state = index->state;
  std::string error = index->error;
  size_t n = index->items.size();
  Install(ckpt, std::move(index));
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

Status KeyIndex::Persist(const std::string& ckpt, const CkptIndex& index,
                         const std::vector<std::string>& suffixes, const std::string& info) {
  const std::string prefix = ItemPrefix(ckpt);
  std::vector<std::pair<std::string, std::string>> puts;
  puts.reserve(index.items.size() + 1);
  for (size_t i = 0; i < index.items.size(); ++i) {
    puts.emplace_back(prefix + suffixes[i], EncodeItem(index.items[i]));
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
  std::vector<IndexedItem> changed;
  {
    std::unique_lock lock(mu_);
    // Checksums recorded while this index was being built.
    auto pending = pending_sums_.find(ckpt);
    if (pending != pending_sums_.end() && index->state != State::kMissing) {
      for (IndexedItem& it : index->items) {
        auto f = pending->second.find(it.file);
        if (f == pending->second.end()) continue;
        auto s = f->second.find({it.offset, it.length});
        if (s == f->second.end()) continue;
        it.checksum = s->second;
        it.has_checksum = true;
        changed.push_back(it);
      }
      pending_sums_.erase(pending);
    }
    ckpts_[ckpt] = std::move(index);
  }
  if (!changed.empty()) {
    std::vector<std::pair<std::string, std::string>> puts;
    for (const IndexedItem& it : changed) {
      puts.emplace_back(ItemPrefix(ckpt) + ItemSuffix(it), EncodeItem(it));
    }
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

  bool bad = false;
  index->items.reserve(count);
  CKPT_RETURN_IF_ERROR(db_->Scan(ItemPrefix(ckpt), [&](std::string_view, std::string_view v) {
    IndexedItem it;
    if (!DecodeItem(v, &it)) bad = true;
    index->items.push_back(std::move(it));
  }));
  if (bad || index->items.size() != count) return Status::Ok();
  std::sort(index->items.begin(), index->items.end(),
            [](const IndexedItem& a, const IndexedItem& b) { return a.ordinal < b.ordinal; });
  for (uint32_t i = 0; i < index->items.size(); ++i) {
    if (index->items[i].ordinal != i) return Status::Ok();
  }
  State state = index->state;
  std::string error = index->error;
  BuildFileMaps(index.get());
  index->state = state;  // overlaps were already recorded at build time
  index->error = error;
  Install(ckpt, std::move(index));
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
          if (f == index.files.end()) return fn(nullptr);
          ptrdiff_t i = f->second.Find(offset);
          return fn(i < 0 ? nullptr : &index.items[f->second.items[i]]);
        }
      }
    }
    if (attempt > 0 || !Ensure(ckpt, /*checksums=*/false).ok()) {
      std::shared_lock lock(mu_);  // fn's contract: called under the lock
      return fn(nullptr);
    }
  }
}

std::optional<IndexedItem> KeyIndex::Resolve(const std::string& ckpt, const std::string& file,
                                             uint64_t offset) {
  return WithItemAt(ckpt, file, offset, [](const IndexedItem* it) -> std::optional<IndexedItem> {
    if (it == nullptr) return std::nullopt;
    return *it;
  });
}

std::optional<KeyIndex::Located> KeyIndex::Locate(const std::string& ckpt, const std::string& file,
                                                  uint64_t offset) {
  return WithItemAt(ckpt, file, offset, [](const IndexedItem* it) -> std::optional<Located> {
    if (it == nullptr) return std::nullopt;
    return Located{it->ordinal, it->kind,       it->has_checksum, it->offset,
                   it->length,  it->raw_offset, it->raw_nbytes,   it->checksum};
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
  Result<std::string> bytes = ReadWhole(dir_, Join(ckpt, ".metadata"), kMaxMetadataBytes);
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

  std::vector<uint32_t> order = FileOrder(items);
  ForEachFile(items, order, [&](const std::string& file, std::span<const uint32_t> idx) {
    Result<OpenedFile> f = OpenShard(dir_, Join(ckpt, file));
    if (!f.ok()) {
      for (uint32_t i : idx) bad(KeyName(items[i]), f.status().ToString());
      return;
    }
    WindowReader reader(dir_, f->fd.get(), f->size);
    for (uint32_t i : idx) {
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
        ResolveTensor(&reader, &again, &error);
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
  });
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
  std::vector<uint32_t> order = FileOrder(items);
  ForEachFile(items, order, [&](const std::string& file, std::span<const uint32_t> idx) {
    Result<OpenedFile> f = OpenShard(dir_, Join(ckpt, file));
    if (!f.ok()) {
      if (first_error.ok()) first_error = f.status();
      return;
    }
    WindowReader reader(dir_, f->fd.get(), f->size);
    std::vector<RangeChecksum> sums;
    for (uint32_t i : idx) {
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
  });
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
  std::vector<IndexedItem> changed;
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
    for (const RangeChecksum& s : sums) {
      ptrdiff_t i = f->second.Find(s.offset);
      if (i < 0) continue;
      IndexedItem& item = index.items[f->second.items[i]];
      if (item.offset != s.offset || item.length != s.length) continue;
      if (item.has_checksum && item.checksum == s.checksum) continue;
      item.checksum = s.checksum;
      item.has_checksum = true;
      changed.push_back(item);
    }
  }
  if (changed.empty()) return;
  std::vector<std::pair<std::string, std::string>> puts;
  for (const IndexedItem& it : changed) {
    puts.emplace_back(ItemPrefix(ckpt) + ItemSuffix(it), EncodeItem(it));
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
