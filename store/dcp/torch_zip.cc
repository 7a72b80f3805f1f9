#include "store/dcp/torch_zip.h"

#include <algorithm>
#include <unordered_set>

#include "store/dcp/pickle.h"

namespace ckptfs::store {
namespace {

constexpr uint32_t kLocalHeaderSig = 0x04034b50;
constexpr uint32_t kCentralHeaderSig = 0x02014b50;
constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kEocd64Sig = 0x06064b50;
constexpr uint32_t kEocd64LocatorSig = 0x07064b50;
constexpr uint16_t kZip64ExtraId = 0x0001;
constexpr size_t kLocalHeaderSize = 30;
constexpr size_t kCentralHeaderSize = 46;
constexpr size_t kEocdSize = 22;
constexpr size_t kEocd64Size = 56;
constexpr size_t kEocd64LocatorSize = 20;
constexpr size_t kMaxCommentSize = 0xffff;
constexpr int kMaxTensorDims = 64;

uint64_t Le(std::string_view b, size_t pos, size_t n) {  // caller checked bounds
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(b[pos + i])} << (8 * i);
  return v;
}

Status ZipError(std::string what) { return Corrupt("torch zip: " + what); }

// Where the reader's bytes come from: an item in memory hands out views of itself, without
// copying; a ReadAtFn fills a buffer that the caller provides, so that a view lives as long
// as that buffer.
class Source {
 public:
  Source(const ReadAtFn& read, uint64_t size) : read_(&read), size_(size) {}
  explicit Source(std::string_view item) : mem_(item), size_(item.size()) {}
  uint64_t size() const { return size_; }

  // Bytes [offset, offset+n) of the item; `buf` backs them when the item is not in memory.
  Result<std::string_view> Get(uint64_t offset, uint64_t n, std::string* buf) const {
    if (read_ == nullptr) {
      if (offset > mem_.size() || mem_.size() - offset < n) {
        return Corrupt("torch zip: read past the end of the item");
      }
      return mem_.substr(offset, n);
    }
    buf->resize(n);
    if (n > 0) CKPT_RETURN_IF_ERROR((*read_)(offset, std::span<char>(buf->data(), n)));
    return std::string_view(*buf);
  }

 private:
  const ReadAtFn* read_ = nullptr;
  std::string_view mem_;
  uint64_t size_;
};

// A central directory entry whose name is a view into the directory's bytes.
struct Entry {
  std::string_view name;
  uint16_t flags = 0, method = 0;
  uint32_t crc32 = 0;
  uint64_t compressed_size = 0, uncompressed_size = 0, local_header_offset = 0;
  bool readable() const { return method == 0 && (flags & 1) == 0; }
};

// The parsed central directory; not movable, since the entries' names may point into `buf`.
struct Directory {
  Directory() = default;
  Directory(const Directory&) = delete;
  Directory& operator=(const Directory&) = delete;

  std::string buf;  // the directory's bytes, when read through a ReadAtFn
  std::vector<Entry> entries;
  uint64_t central_directory_offset = 0;

  const Entry* Find(std::string_view prefix, std::string_view rest) const {
    for (const Entry& e : entries) {
      if (e.name.size() == prefix.size() + rest.size() && e.name.starts_with(prefix) &&
          e.name.ends_with(rest)) {
        return &e;
      }
    }
    return nullptr;
  }
};

// Buffers for local header reads through a ReadAtFn.
struct HeaderBufs {
  std::string header, name;
};

struct EndRecord {
  uint64_t entries = 0, cd_size = 0, cd_offset = 0;
  uint64_t cd_limit = 0;  // where the central directory must end (start of the end records)
};

// The classic end record inside `tail` (which starts at item offset `tail_pos`). Its comment
// must reach exactly the end of the item, so a signature inside data or comment is never
// taken for it.
Result<EndRecord> FindEndIn(std::string_view tail, uint64_t tail_pos, uint64_t* eocd_pos) {
  for (size_t p = tail.size() - kEocdSize + 1; p-- > 0;) {
    if (Le(tail, p, 4) != kEocdSig) continue;
    if (p + kEocdSize + Le(tail, p + 20, 2) != tail.size()) continue;
    if (Le(tail, p + 4, 2) != 0 || Le(tail, p + 6, 2) != 0) {
      return ZipError("multi-disk archives are not supported");
    }
    EndRecord end;
    end.entries = Le(tail, p + 10, 2);
    if (Le(tail, p + 8, 2) != end.entries) return ZipError("entry counts disagree in EOCD");
    end.cd_size = Le(tail, p + 12, 4);
    end.cd_offset = Le(tail, p + 16, 4);
    *eocd_pos = tail_pos + p;
    end.cd_limit = *eocd_pos;
    return end;
  }
  return ZipError("no end-of-central-directory record");
}

// torch writes no archive comment, so the record is usually the last 22 bytes; only if it is
// not there is the longest possible comment's worth read.
Result<EndRecord> FindEnd(const Source& src, uint64_t* eocd_pos, std::string* buf) {
  const uint64_t size = src.size();
  if (size < kEocdSize) return ZipError("too small for a zip archive");
  for (uint64_t want : {kEocdSize, kEocdSize + kMaxCommentSize}) {
    uint64_t tail_len = std::min<uint64_t>(size, want);
    CKPT_ASSIGN_OR_RETURN(std::string_view tail, src.Get(size - tail_len, tail_len, buf));
    Result<EndRecord> end = FindEndIn(tail, size - tail_len, eocd_pos);
    if (end.ok() || tail_len == size || want > kEocdSize) return end;
  }
  return ZipError("no end-of-central-directory record");  // not reached
}

// Zip64: a locator right before the classic record points at the zip64 end record, whose
// 64-bit fields win. 32-bit fields that are not saturated must agree with them.
Status ApplyZip64(const Source& src, uint64_t eocd_pos, EndRecord* end, std::string* buf) {
  if (eocd_pos < kEocd64LocatorSize) return Status::Ok();
  uint64_t loc_pos = eocd_pos - kEocd64LocatorSize;
  CKPT_ASSIGN_OR_RETURN(std::string_view loc, src.Get(loc_pos, kEocd64LocatorSize, buf));
  if (Le(loc, 0, 4) != kEocd64LocatorSig) {
    if (end->entries == 0xffff || end->cd_size == 0xffffffff || end->cd_offset == 0xffffffff) {
      return ZipError("saturated EOCD without a zip64 locator");
    }
    return Status::Ok();
  }
  uint64_t rec_pos = Le(loc, 8, 8);
  if (Le(loc, 4, 4) != 0 || Le(loc, 16, 4) > 1) return ZipError("multi-disk zip64 archive");
  if (rec_pos > loc_pos || loc_pos - rec_pos < kEocd64Size) {
    return ZipError("zip64 end record outside the archive");
  }
  CKPT_ASSIGN_OR_RETURN(std::string_view rec, src.Get(rec_pos, kEocd64Size, buf));
  if (Le(rec, 0, 4) != kEocd64Sig) return ZipError("bad zip64 end record signature");
  if (Le(rec, 16, 4) != 0 || Le(rec, 20, 4) != 0) return ZipError("multi-disk zip64 archive");
  uint64_t entries = Le(rec, 32, 8), cd_size = Le(rec, 40, 8), cd_offset = Le(rec, 48, 8);
  if (Le(rec, 24, 8) != entries) return ZipError("entry counts disagree in zip64 end record");
  if ((end->entries != 0xffff && end->entries != entries) ||
      (end->cd_size != 0xffffffff && end->cd_size != cd_size) ||
      (end->cd_offset != 0xffffffff && end->cd_offset != cd_offset)) {
    return ZipError("EOCD and zip64 end record disagree");
  }
  end->entries = entries;
  end->cd_size = cd_size;
  end->cd_offset = cd_offset;
  end->cd_limit = rec_pos;
  return Status::Ok();
}

// Replaces saturated 32-bit fields of `e` from its zip64 extra field, in the order the
// format fixes: uncompressed size, compressed size, local header offset, disk.
Status ApplyZip64Extra(std::string_view extra, bool disk_saturated, Entry* e) {
  bool need_u = e->uncompressed_size == 0xffffffff, need_c = e->compressed_size == 0xffffffff;
  bool need_o = e->local_header_offset == 0xffffffff;
  if (!need_u && !need_c && !need_o && !disk_saturated) return Status::Ok();
  size_t p = 0;
  while (p + 4 <= extra.size()) {
    uint64_t id = Le(extra, p, 2), len = Le(extra, p + 2, 2);
    if (p + 4 + len > extra.size()) break;
    if (id == kZip64ExtraId) {
      std::string_view f = extra.substr(p + 4, len);
      size_t q = 0;
      auto take = [&](uint64_t* v) {
        if (q + 8 > f.size()) return false;
        *v = Le(f, q, 8);
        q += 8;
        return true;
      };
      if ((need_u && !take(&e->uncompressed_size)) || (need_c && !take(&e->compressed_size)) ||
          (need_o && !take(&e->local_header_offset))) {
        return ZipError("zip64 extra field too short for '" + std::string(e->name) + "'");
      }
      if (disk_saturated && (q + 4 > f.size() || Le(f, q, 4) != 0)) {
        return ZipError("multi-disk entry '" + std::string(e->name) + "'");
      }
      return Status::Ok();
    }
    p += 4 + len;
  }
  return ZipError("missing zip64 extra field for '" + std::string(e->name) + "'");
}

Status ParseCentralDirectory(std::string_view cd, uint64_t count, const EndRecord& end,
                             Directory* dir) {
  dir->entries.reserve(count);
  size_t p = 0;
  for (uint64_t i = 0; i < count; ++i) {
    if (cd.size() - p < kCentralHeaderSize || Le(cd, p, 4) != kCentralHeaderSig) {
      return ZipError("bad central directory entry " + std::to_string(i));
    }
    size_t name_len = Le(cd, p + 28, 2), extra_len = Le(cd, p + 30, 2);
    size_t comment_len = Le(cd, p + 32, 2);
    if (cd.size() - p - kCentralHeaderSize < name_len + extra_len + comment_len) {
      return ZipError("central directory entry " + std::to_string(i) + " runs past its end");
    }
    Entry& e = dir->entries.emplace_back();
    e.flags = Le(cd, p + 8, 2);
    e.method = Le(cd, p + 10, 2);
    e.crc32 = Le(cd, p + 16, 4);
    e.compressed_size = Le(cd, p + 20, 4);
    e.uncompressed_size = Le(cd, p + 24, 4);
    e.local_header_offset = Le(cd, p + 42, 4);
    e.name = cd.substr(p + kCentralHeaderSize, name_len);
    uint64_t disk = Le(cd, p + 34, 2);
    if (disk != 0 && disk != 0xffff) {
      return ZipError("multi-disk entry '" + std::string(e.name) + "'");
    }
    CKPT_RETURN_IF_ERROR(ApplyZip64Extra(cd.substr(p + kCentralHeaderSize + name_len, extra_len),
                                         disk == 0xffff, &e));
    if (e.local_header_offset >= end.cd_offset ||
        end.cd_offset - e.local_header_offset < kLocalHeaderSize) {
      return ZipError("local header of '" + std::string(e.name) + "' lies outside the data area");
    }
    p += kCentralHeaderSize + name_len + extra_len + comment_len;
  }
  if (p != cd.size()) return ZipError("central directory size disagrees with its entries");
  // A torch archive has a handful of entries: comparing pairs beats hashing them.
  const std::vector<Entry>& es = dir->entries;
  if (es.size() <= 32) {
    for (size_t i = 1; i < es.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (es[i].name == es[j].name) {
          return ZipError("duplicate entry '" + std::string(es[i].name) + "'");
        }
      }
    }
    return Status::Ok();
  }
  std::unordered_set<std::string_view> names;
  names.reserve(es.size());
  for (const Entry& e : es) {
    if (!names.insert(e.name).second) {
      return ZipError("duplicate entry '" + std::string(e.name) + "'");
    }
  }
  return Status::Ok();
}

// Parses the end records and the central directory of the archive in `src` into `dir`.
Status ReadDirectory(const Source& src, const ZipLimits& limits, Directory* dir) {
  uint64_t eocd_pos = 0;
  std::string tail_buf;
  CKPT_ASSIGN_OR_RETURN(EndRecord end, FindEnd(src, &eocd_pos, &tail_buf));
  CKPT_RETURN_IF_ERROR(ApplyZip64(src, eocd_pos, &end, &tail_buf));
  if (end.cd_offset > end.cd_limit || end.cd_limit - end.cd_offset < end.cd_size) {
    return ZipError("central directory lies outside the archive");
  }
  if (end.entries > limits.max_entries) {
    return ZipError(std::to_string(end.entries) + " entries exceed the limit");
  }
  if (end.cd_size > limits.max_central_directory_bytes) {
    return ZipError("central directory of " + std::to_string(end.cd_size) + " bytes is too big");
  }
  if (end.cd_size / kCentralHeaderSize < end.entries) {
    return ZipError("central directory too small for its entries");
  }
  CKPT_ASSIGN_OR_RETURN(std::string_view cd, src.Get(end.cd_offset, end.cd_size, &dir->buf));
  dir->central_directory_offset = end.cd_offset;
  return ParseCentralDirectory(cd, end.entries, end, dir);
}

// Item-relative offset of the data of the entry (name, method, local header offset,
// compressed size), from its LOCAL header; see ZipDataOffset().
Result<uint64_t> DataOffset(const Source& src, uint64_t limit, std::string_view entry_name,
                            uint16_t method, uint64_t local_header_offset, uint64_t compressed_size,
                            HeaderBufs* bufs) {
  if (local_header_offset > limit || limit - local_header_offset < kLocalHeaderSize) {
    return ZipError("local header of '" + std::string(entry_name) + "' lies outside the data area");
  }
  CKPT_ASSIGN_OR_RETURN(std::string_view h,
                        src.Get(local_header_offset, kLocalHeaderSize, &bufs->header));
  if (Le(h, 0, 4) != kLocalHeaderSig) {
    return ZipError("bad local header for '" + std::string(entry_name) + "'");
  }
  uint64_t name_len = Le(h, 26, 2), extra_len = Le(h, 28, 2);
  if (Le(h, 8, 2) != method) {
    return ZipError("local and central headers of '" + std::string(entry_name) +
                    "' disagree on method");
  }
  uint64_t name_pos = local_header_offset + kLocalHeaderSize;
  uint64_t data = name_pos + name_len + extra_len;
  if (data > limit || limit - data < compressed_size) {
    return ZipError("data of '" + std::string(entry_name) + "' runs past the data area");
  }
  CKPT_ASSIGN_OR_RETURN(std::string_view name, src.Get(name_pos, name_len, &bufs->name));
  if (name != entry_name) {
    return ZipError("local header name '" + std::string(name) + "' differs from '" +
                    std::string(entry_name) + "'");
  }
  return data;
}

// --- torch.save interpretation -------------------------------------------------------------

struct DtypeInfo {
  std::string_view name;
  int itemsize;
};

constexpr DtypeInfo kDtypes[] = {
    {"float16", 2},         {"bfloat16", 2},
    {"float32", 4},         {"float64", 8},
    {"complex32", 4},       {"complex64", 8},
    {"complex128", 16},     {"int8", 1},
    {"uint8", 1},           {"int16", 2},
    {"int32", 4},           {"int64", 8},
    {"uint16", 2},          {"uint32", 4},
    {"uint64", 8},          {"bool", 1},
    {"float8_e4m3fn", 1},   {"float8_e5m2", 1},
    {"float8_e4m3fnuz", 1}, {"float8_e5m2fnuz", 1},
    {"float8_e8m0fnu", 1},  {"float4_e2m1fn_x2", 1},
    {"bits8", 1},           {"bits16", 2},
};

// Typed storage classes used by _rebuild_tensor_v2 (torch.storage._dtype_to_storage_type_map).
// Quantized storages are left out on purpose: their bytes need scale/zero-point to mean
// anything, so such items stay opaque.
struct StorageType {
  std::string_view cls, dtype;
};

constexpr StorageType kStorageTypes[] = {
    {"DoubleStorage", "float64"},
    {"FloatStorage", "float32"},
    {"HalfStorage", "float16"},
    {"BFloat16Storage", "bfloat16"},
    {"LongStorage", "int64"},
    {"IntStorage", "int32"},
    {"ShortStorage", "int16"},
    {"CharStorage", "int8"},
    {"ByteStorage", "uint8"},
    {"BoolStorage", "bool"},
    {"ComplexFloatStorage", "complex64"},
    {"ComplexDoubleStorage", "complex128"},
};

// What data.pkl says about the tensor, before the zip records are checked against it.
struct RebuildCall {
  std::string dtype;
  bool untyped = false;  // v3: storage numel counts bytes
  std::string key;
  int64_t storage_numel = 0;
  int64_t storage_offset = 0;
  std::vector<int64_t> shape, stride;
};

// Either a RebuildCall or the reason the pickle is not a plain tensor.
struct Interpretation {
  bool ok = false;
  std::string reason;
  RebuildCall call;
};

Interpretation NotTensor(std::string reason) {
  return Interpretation{false, std::move(reason), {}};
}

bool ParseInts(const PickleTree& t, NodeId id, std::vector<int64_t>* out) {
  if (!t.Is(id, PickleKind::kTuple) && !t.Is(id, PickleKind::kList)) return false;
  std::span<const NodeId> elems = t.items(id);
  if (elems.size() > kMaxTensorDims) return false;
  for (NodeId e : elems) {
    if (!t.Is(e, PickleKind::kInt) || t.int_value(e) < 0) return false;
    out->push_back(t.int_value(e));
  }
  return true;
}

Interpretation InterpretTensorPickle(const PickleTree& t) {
  NodeId root = t.root();
  // nn.Parameter wraps the tensor: _rebuild_parameter(data, requires_grad, hooks[, state]).
  if (t.Is(root, PickleKind::kReduce) &&
      (t.IsGlobal(t.callable(root), "torch._utils", "_rebuild_parameter") ||
       t.IsGlobal(t.callable(root), "torch._utils", "_rebuild_parameter_with_state"))) {
    std::span<const NodeId> pargs = t.items(t.args(root));
    if (pargs.empty()) return NotTensor("_rebuild_parameter without arguments");
    root = pargs[0];
  }
  if (!t.Is(root, PickleKind::kReduce)) return NotTensor("data.pkl is not a tensor");
  NodeId fn = t.callable(root);
  bool v2 = t.IsGlobal(fn, "torch._utils", "_rebuild_tensor_v2");
  bool v3 = t.IsGlobal(fn, "torch._utils", "_rebuild_tensor_v3");
  if (!v2 && !v3) return NotTensor("data.pkl is not a plain tensor: " + t.DebugString(fn, 80));
  std::span<const NodeId> args = t.items(t.args(root));
  // v2: (storage, storage_offset, size, stride, requires_grad, hooks[, metadata])
  // v3: (storage, storage_offset, size, stride, requires_grad, hooks, dtype[, metadata])
  size_t fixed = v3 ? 7 : 6;
  if (args.size() != fixed && args.size() != fixed + 1) {
    return NotTensor("unexpected rebuild arguments: " + t.DebugString(t.args(root), 120));
  }
  if (args.size() == fixed + 1) {
    NodeId meta = args[fixed];
    // Tensor metadata (e.g. conj/neg bits) changes what the bytes mean.
    if (!t.Is(meta, PickleKind::kNone) &&
        !(t.Is(meta, PickleKind::kDict) && t.dict_size(meta) == 0)) {
      return NotTensor("tensor carries rebuild metadata");
    }
  }
  RebuildCall call;
  NodeId pid = t.persid(args[0]);
  std::span<const NodeId> p = t.items(pid);
  if (!t.Is(pid, PickleKind::kTuple) || p.size() != 5 || t.str(p[0]) != "storage" ||
      !t.Is(p[0], PickleKind::kStr) || !t.Is(p[1], PickleKind::kGlobal) ||
      t.global_module(p[1]) != "torch" || !t.Is(p[2], PickleKind::kStr) ||
      !t.Is(p[4], PickleKind::kInt) || t.int_value(p[4]) < 0) {
    return NotTensor("storage is not a persistent-id storage reference");
  }
  std::string_view storage_cls = t.global_name(p[1]);
  call.key = std::string(t.str(p[2]));
  call.storage_numel = t.int_value(p[4]);
  if (v3) {
    if (storage_cls != "UntypedStorage") return NotTensor("v3 rebuild with a typed storage");
    if (!t.Is(args[6], PickleKind::kGlobal) || t.global_module(args[6]) != "torch") {
      return NotTensor("v3 rebuild without a dtype");
    }
    call.untyped = true;
    call.dtype = std::string(t.global_name(args[6]));
  } else {
    for (const StorageType& s : kStorageTypes) {
      if (s.cls == storage_cls) call.dtype = std::string(s.dtype);
    }
    if (call.dtype.empty())
      return NotTensor("unsupported storage type " + std::string(storage_cls));
  }
  if (DtypeItemSize(call.dtype) == 0) return NotTensor("unsupported dtype " + call.dtype);
  if (!t.Is(args[1], PickleKind::kInt) || t.int_value(args[1]) < 0 ||
      !ParseInts(t, args[2], &call.shape) || !ParseInts(t, args[3], &call.stride) ||
      call.shape.size() != call.stride.size()) {
    return NotTensor("malformed storage offset, size or stride");
  }
  call.storage_offset = t.int_value(args[1]);
  return Interpretation{true, "", std::move(call)};
}

// What data.pkl says, from its bytes alone. The reader's limits are fixed, except the input
// size, which the caller checked against ZipLimits::max_pickle_bytes already.
Interpretation InterpretPickle(std::string_view pickle) {
  PickleLimits plimits;
  plimits.max_input_bytes = pickle.size();
  plimits.max_depth = 64;
  plimits.max_memo_entries = 1u << 16;
  plimits.max_container_size = 1u << 16;
  plimits.max_nodes = 1u << 18;
  plimits.max_stack = 1u << 16;
  Result<PickleTree> tree = ParsePickle(pickle, plimits);
  // A bytes item may pickle anything; what the reader does not understand is opaque.
  if (!tree.ok()) return NotTensor(tree.status().message());
  return InterpretTensorPickle(*tree);
}

// Bytes the view (storage_offset, shape, stride) needs from the start of the storage.
// Returns false on overflow.
bool ExtentBytes(const RebuildCall& c, int itemsize, uint64_t* bytes) {
  for (int64_t d : c.shape) {
    if (d == 0) {
      *bytes = 0;
      return true;
    }
  }
  unsigned __int128 last = static_cast<uint64_t>(c.storage_offset);
  for (size_t i = 0; i < c.shape.size(); ++i) {
    last += static_cast<unsigned __int128>(c.shape[i] - 1) * static_cast<uint64_t>(c.stride[i]);
    if (last > UINT64_MAX) return false;
  }
  unsigned __int128 total = (last + 1) * static_cast<unsigned>(itemsize);
  if (total > UINT64_MAX) return false;
  *bytes = static_cast<uint64_t>(total);
  return true;
}

TorchSaveTensor Opaque(std::string reason) {
  TorchSaveTensor out;
  out.opaque_reason = std::move(reason);
  return out;
}

}  // namespace

// Interpretations of data.pkl records, keyed by their bytes. Bounded: past kMaxEntries
// distinct records, or for records over kMaxKeyBytes, it interprets without remembering.
struct TorchPickleCache::Impl {
  static constexpr size_t kMaxEntries = 4096;
  static constexpr size_t kMaxKeyBytes = 4096;

  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
  };
  std::unordered_map<std::string, Interpretation, Hash, std::equal_to<>> map;
  uint64_t hits = 0, misses = 0;

  Interpretation Interpret(std::string_view pickle) {
    if (auto it = map.find(pickle); it != map.end()) {
      ++hits;
      return it->second;
    }
    ++misses;
    Interpretation in = InterpretPickle(pickle);
    if (map.size() < kMaxEntries && pickle.size() <= kMaxKeyBytes) {
      map.emplace(std::string(pickle), in);
    }
    return in;
  }
};

TorchPickleCache::TorchPickleCache() : impl_(std::make_unique<Impl>()) {}
TorchPickleCache::~TorchPickleCache() = default;
uint64_t TorchPickleCache::hits() const { return impl_->hits; }
uint64_t TorchPickleCache::misses() const { return impl_->misses; }

namespace {

// Reads a small STORED record in full into `buf`; the caller checked readable() and the size.
Result<std::string_view> ReadSmallRecord(const Source& src, const Directory& dir, const Entry& e,
                                         HeaderBufs* hbufs, std::string* buf) {
  CKPT_ASSIGN_OR_RETURN(uint64_t off,
                        DataOffset(src, dir.central_directory_offset, e.name, e.method,
                                   e.local_header_offset, e.compressed_size, hbufs));
  return src.Get(off, e.compressed_size, buf);
}

Result<TorchSaveTensor> ParseItem(const Source& src, const ZipLimits& limits,
                                  TorchPickleCache::Impl* cache) {
  Directory dir;
  CKPT_RETURN_IF_ERROR(ReadDirectory(src, limits, &dir));

  // The archive's top-level folder varies ("archive", or a file stem); data.pkl names it.
  const Entry* pkl = nullptr;
  for (const Entry& e : dir.entries) {
    size_t slash = e.name.find('/');
    if (slash != std::string_view::npos && slash > 0 && e.name.substr(slash) == "/data.pkl") {
      if (pkl != nullptr) return Opaque("several data.pkl records");
      pkl = &e;
    }
  }
  if (pkl == nullptr) return Opaque("no <archive>/data.pkl record");
  std::string_view prefix =
      pkl->name.substr(0, pkl->name.size() - std::string_view("data.pkl").size());

  HeaderBufs hbufs;
  if (const Entry* bo = dir.Find(prefix, "byteorder")) {
    if (!bo->readable() || bo->compressed_size > 16) return Opaque("unreadable byteorder record");
    std::string buf;
    CKPT_ASSIGN_OR_RETURN(std::string_view order, ReadSmallRecord(src, dir, *bo, &hbufs, &buf));
    if (order != "little") return Opaque("byte order '" + std::string(order.substr(0, 16)) + "'");
  }

  if (!pkl->readable()) return Opaque("data.pkl is compressed or encrypted");
  if (pkl->compressed_size > limits.max_pickle_bytes) return Opaque("data.pkl is too large");
  std::string pickle_buf;
  CKPT_ASSIGN_OR_RETURN(std::string_view pickle,
                        ReadSmallRecord(src, dir, *pkl, &hbufs, &pickle_buf));
  Interpretation in = cache != nullptr ? cache->Interpret(pickle) : InterpretPickle(pickle);
  if (!in.ok) return Opaque(in.reason);
  RebuildCall& call = in.call;

  TorchSaveTensor out;
  out.record_name.reserve(prefix.size() + 5 + call.key.size());
  out.record_name.append(prefix).append("data/").append(call.key);
  const Entry* rec = dir.Find(out.record_name, "");
  if (rec == nullptr) return ZipError("data.pkl names a missing record '" + out.record_name + "'");
  if (!rec->readable()) return Opaque("tensor record is compressed or encrypted");
  if (rec->compressed_size != rec->uncompressed_size) {
    return ZipError("STORED record '" + std::string(rec->name) + "' has differing sizes");
  }
  int itemsize = DtypeItemSize(call.dtype);
  unsigned __int128 storage_bytes = static_cast<unsigned __int128>(call.storage_numel) *
                                    (call.untyped ? 1 : static_cast<unsigned>(itemsize));
  if (storage_bytes != rec->uncompressed_size) {
    return ZipError("storage of " + std::to_string(call.storage_numel) +
                    " elements does not match "
                    "record '" +
                    std::string(rec->name) + "' of " + std::to_string(rec->uncompressed_size) +
                    " bytes");
  }
  uint64_t extent = 0;
  if (!ExtentBytes(call, itemsize, &extent) || extent > rec->uncompressed_size) {
    return ZipError("tensor view reaches past its storage");
  }
  CKPT_ASSIGN_OR_RETURN(out.data_offset,
                        DataOffset(src, dir.central_directory_offset, rec->name, rec->method,
                                   rec->local_header_offset, rec->compressed_size, &hbufs));
  out.is_tensor = true;
  out.dtype = std::string(call.dtype);
  out.shape = std::move(call.shape);
  out.stride = std::move(call.stride);
  out.storage_offset = call.storage_offset;
  out.storage_key = std::string(call.key);
  out.data_nbytes = rec->uncompressed_size;
  return out;
}

}  // namespace

const ZipEntry* ZipDirectory::Find(std::string_view name) const {
  for (const ZipEntry& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

Result<ZipDirectory> ReadZipDirectory(const ReadAtFn& read, uint64_t size,
                                      const ZipLimits& limits) {
  Directory d;
  CKPT_RETURN_IF_ERROR(ReadDirectory(Source(read, size), limits, &d));
  ZipDirectory dir;
  dir.central_directory_offset = d.central_directory_offset;
  dir.entries.reserve(d.entries.size());
  for (const Entry& e : d.entries) {
    ZipEntry& z = dir.entries.emplace_back();
    z.name = std::string(e.name);
    z.flags = e.flags;
    z.method = e.method;
    z.crc32 = e.crc32;
    z.compressed_size = e.compressed_size;
    z.uncompressed_size = e.uncompressed_size;
    z.local_header_offset = e.local_header_offset;
  }
  return dir;
}

Result<uint64_t> ZipDataOffset(const ReadAtFn& read, const ZipDirectory& dir,
                               const ZipEntry& entry) {
  HeaderBufs bufs;
  // The ReadAtFn bounds its reads; the size is only checked for items in memory.
  return DataOffset(Source(read, UINT64_MAX), dir.central_directory_offset, entry.name,
                    entry.method, entry.local_header_offset, entry.compressed_size, &bufs);
}

int DtypeItemSize(std::string_view dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.name == dtype) return d.itemsize;
  }
  return 0;
}

Result<TorchSaveTensor> ParseTorchSaveItem(const ReadAtFn& read, uint64_t size,
                                           const ZipLimits& limits) {
  return ParseItem(Source(read, size), limits, nullptr);
}

Status CheckItemData(const TorchSaveTensor& t, const ItemFacts& item) {
  auto where = [&] {
    return "torch zip: item '" + std::string(item.fqn) + "' in " + std::string(item.file);
  };
  if (t.dtype != item.dtype) {
    return Corrupt(where() + " holds " + t.dtype + " but the metadata says " +
                   std::string(item.dtype));
  }
  if (!std::equal(t.shape.begin(), t.shape.end(), item.chunk_sizes.begin(),
                  item.chunk_sizes.end())) {
    return Corrupt(where() + " has a different shape");
  }
  if (t.data_offset > item.length || item.length - t.data_offset < t.data_nbytes) {
    return Corrupt(where() + " has data outside the item");
  }
  return Status::Ok();
}

Status ResolveItemData(const TorchSaveTensor& t, DcpItem* item) {
  if (item->kind != ItemKind::kTensor) return Status::Ok();
  if (!t.is_tensor) {
    item->kind = ItemKind::kOpaque;
    return Status::Ok();
  }
  CKPT_RETURN_IF_ERROR(CheckItemData(
      t, ItemFacts{item->fqn, item->file, item->dtype, item->chunk_sizes, item->length}));
  item->data_resolved = true;
  item->raw_offset = item->offset + t.data_offset;
  item->raw_nbytes = t.data_nbytes;
  item->stride = t.stride;
  item->storage_offset = t.storage_offset;
  return Status::Ok();
}

Result<TorchSaveTensor> ParseTorchSaveItem(std::string_view item, const ZipLimits& limits) {
  return ParseItem(Source(item), limits, nullptr);
}

Result<TorchSaveTensor> ParseTorchSaveItem(const ReadAtFn& read, uint64_t size,
                                           TorchPickleCache* cache, const ZipLimits& limits) {
  return ParseItem(Source(read, size), limits, cache ? cache->impl_.get() : nullptr);
}

Result<TorchSaveTensor> ParseTorchSaveItem(std::string_view item, TorchPickleCache* cache,
                                           const ZipLimits& limits) {
  return ParseItem(Source(item), limits, cache ? cache->impl_.get() : nullptr);
}

}  // namespace ckptfs::store
