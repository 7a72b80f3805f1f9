#include "store/torch_zip.h"

#include <algorithm>
#include <unordered_set>

#include "store/pickle.h"

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

Result<std::string> ReadRange(const ReadAtFn& read, uint64_t offset, uint64_t n) {
  std::string buf(n, '\0');
  if (n > 0) CKPT_RETURN_IF_ERROR(read(offset, std::span<char>(buf.data(), buf.size())));
  return buf;
}

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
Result<EndRecord> FindEnd(const ReadAtFn& read, uint64_t size, uint64_t* eocd_pos) {
  if (size < kEocdSize) return ZipError("too small for a zip archive");
  for (uint64_t want : {kEocdSize, kEocdSize + kMaxCommentSize}) {
    uint64_t tail_len = std::min<uint64_t>(size, want);
    CKPT_ASSIGN_OR_RETURN(std::string tail, ReadRange(read, size - tail_len, tail_len));
    Result<EndRecord> end = FindEndIn(tail, size - tail_len, eocd_pos);
    if (end.ok() || tail_len == size || want > kEocdSize) return end;
  }
  return ZipError("no end-of-central-directory record");  // not reached
}

// Zip64: a locator right before the classic record points at the zip64 end record, whose
// 64-bit fields win. 32-bit fields that are not saturated must agree with them.
Status ApplyZip64(const ReadAtFn& read, uint64_t eocd_pos, EndRecord* end) {
  if (eocd_pos < kEocd64LocatorSize) return Status::Ok();
  uint64_t loc_pos = eocd_pos - kEocd64LocatorSize;
  CKPT_ASSIGN_OR_RETURN(std::string loc, ReadRange(read, loc_pos, kEocd64LocatorSize));
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
  CKPT_ASSIGN_OR_RETURN(std::string rec, ReadRange(read, rec_pos, kEocd64Size));
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
Status ApplyZip64Extra(std::string_view extra, bool disk_saturated, ZipEntry* e) {
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
        return ZipError("zip64 extra field too short for '" + e->name + "'");
      }
      if (disk_saturated && (q + 4 > f.size() || Le(f, q, 4) != 0)) {
        return ZipError("multi-disk entry '" + e->name + "'");
      }
      return Status::Ok();
    }
    p += 4 + len;
  }
  return ZipError("missing zip64 extra field for '" + e->name + "'");
}

Status ParseCentralDirectory(std::string_view cd, uint64_t count, const EndRecord& end,
                             ZipDirectory* dir) {
  dir->entries.reserve(count);
  std::unordered_set<std::string_view> names;
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
    ZipEntry& e = dir->entries.emplace_back();
    e.flags = Le(cd, p + 8, 2);
    e.method = Le(cd, p + 10, 2);
    e.crc32 = Le(cd, p + 16, 4);
    e.compressed_size = Le(cd, p + 20, 4);
    e.uncompressed_size = Le(cd, p + 24, 4);
    e.local_header_offset = Le(cd, p + 42, 4);
    e.name = std::string(cd.substr(p + kCentralHeaderSize, name_len));
    uint64_t disk = Le(cd, p + 34, 2);
    if (disk != 0 && disk != 0xffff) return ZipError("multi-disk entry '" + e.name + "'");
    CKPT_RETURN_IF_ERROR(ApplyZip64Extra(cd.substr(p + kCentralHeaderSize + name_len, extra_len),
                                         disk == 0xffff, &e));
    if (e.local_header_offset >= end.cd_offset ||
        end.cd_offset - e.local_header_offset < kLocalHeaderSize) {
      return ZipError("local header of '" + e.name + "' lies outside the data area");
    }
    p += kCentralHeaderSize + name_len + extra_len + comment_len;
  }
  if (p != cd.size()) return ZipError("central directory size disagrees with its entries");
  // Names point into dir->entries, which no longer grows.
  for (const ZipEntry& e : dir->entries) {
    if (!names.insert(e.name).second) return ZipError("duplicate entry '" + e.name + "'");
  }
  return Status::Ok();
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

// Reads a small STORED record in full; the caller checked Readable() and the size.
Result<std::string> ReadSmallRecord(const ReadAtFn& read, const ZipDirectory& dir,
                                    const ZipEntry& e) {
  CKPT_ASSIGN_OR_RETURN(uint64_t off, ZipDataOffset(read, dir, e));
  return ReadRange(read, off, e.compressed_size);
}

bool Readable(const ZipEntry& e) { return e.method == 0 && !e.encrypted(); }

}  // namespace

const ZipEntry* ZipDirectory::Find(std::string_view name) const {
  for (const ZipEntry& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

Result<ZipDirectory> ReadZipDirectory(const ReadAtFn& read, uint64_t size,
                                      const ZipLimits& limits) {
  uint64_t eocd_pos = 0;
  CKPT_ASSIGN_OR_RETURN(EndRecord end, FindEnd(read, size, &eocd_pos));
  CKPT_RETURN_IF_ERROR(ApplyZip64(read, eocd_pos, &end));
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
  CKPT_ASSIGN_OR_RETURN(std::string cd, ReadRange(read, end.cd_offset, end.cd_size));
  ZipDirectory dir;
  dir.central_directory_offset = end.cd_offset;
  CKPT_RETURN_IF_ERROR(ParseCentralDirectory(cd, end.entries, end, &dir));
  return dir;
}

Result<uint64_t> ZipDataOffset(const ReadAtFn& read, const ZipDirectory& dir,
                               const ZipEntry& entry) {
  uint64_t limit = dir.central_directory_offset;
  if (entry.local_header_offset > limit || limit - entry.local_header_offset < kLocalHeaderSize) {
    return ZipError("local header of '" + entry.name + "' lies outside the data area");
  }
  CKPT_ASSIGN_OR_RETURN(std::string h,
                        ReadRange(read, entry.local_header_offset, kLocalHeaderSize));
  if (Le(h, 0, 4) != kLocalHeaderSig) return ZipError("bad local header for '" + entry.name + "'");
  uint64_t name_len = Le(h, 26, 2), extra_len = Le(h, 28, 2);
  if (Le(h, 8, 2) != entry.method) {
    return ZipError("local and central headers of '" + entry.name + "' disagree on method");
  }
  uint64_t name_pos = entry.local_header_offset + kLocalHeaderSize;
  uint64_t data = name_pos + name_len + extra_len;
  if (data > limit || limit - data < entry.compressed_size) {
    return ZipError("data of '" + entry.name + "' runs past the data area");
  }
  CKPT_ASSIGN_OR_RETURN(std::string name, ReadRange(read, name_pos, name_len));
  if (name != entry.name) {
    return ZipError("local header name '" + name + "' differs from '" + entry.name + "'");
  }
  return data;
}

int DtypeItemSize(std::string_view dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.name == dtype) return d.itemsize;
  }
  return 0;
}

Result<TorchSaveTensor> ParseTorchSaveItem(const ReadAtFn& read, uint64_t size,
                                           const ZipLimits& limits) {
  CKPT_ASSIGN_OR_RETURN(ZipDirectory dir, ReadZipDirectory(read, size, limits));

  // The archive's top-level folder varies ("archive", or a file stem); data.pkl names it.
  const ZipEntry* pkl = nullptr;
  for (const ZipEntry& e : dir.entries) {
    size_t slash = e.name.find('/');
    if (slash != std::string::npos && slash > 0 && e.name.substr(slash) == "/data.pkl") {
      if (pkl != nullptr) return Opaque("several data.pkl records");
      pkl = &e;
    }
  }
  if (pkl == nullptr) return Opaque("no <archive>/data.pkl record");
  std::string prefix = pkl->name.substr(0, pkl->name.size() - std::string_view("data.pkl").size());

  if (const ZipEntry* bo = dir.Find(prefix + "byteorder")) {
    if (!Readable(*bo) || bo->compressed_size > 16) return Opaque("unreadable byteorder record");
    CKPT_ASSIGN_OR_RETURN(std::string order, ReadSmallRecord(read, dir, *bo));
    if (order != "little") return Opaque("byte order '" + order.substr(0, 16) + "'");
  }

  if (!Readable(*pkl)) return Opaque("data.pkl is compressed or encrypted");
  if (pkl->compressed_size > limits.max_pickle_bytes) return Opaque("data.pkl is too large");
  CKPT_ASSIGN_OR_RETURN(std::string pickle, ReadSmallRecord(read, dir, *pkl));
  PickleLimits plimits;
  plimits.max_input_bytes = limits.max_pickle_bytes;
  plimits.max_depth = 64;
  plimits.max_memo_entries = 1u << 16;
  plimits.max_container_size = 1u << 16;
  plimits.max_nodes = 1u << 18;
  plimits.max_stack = 1u << 16;
  Result<PickleTree> tree = ParsePickle(pickle, plimits);
  // A bytes item may pickle anything; what the reader does not understand is opaque.
  if (!tree.ok()) return Opaque(tree.status().message());
  Interpretation in = InterpretTensorPickle(*tree);
  if (!in.ok) return Opaque(in.reason);
  RebuildCall& call = in.call;

  TorchSaveTensor out;
  out.record_name = prefix + "data/" + call.key;
  const ZipEntry* rec = dir.Find(out.record_name);
  if (rec == nullptr) return ZipError("data.pkl names a missing record '" + out.record_name + "'");
  if (!Readable(*rec)) return Opaque("tensor record is compressed or encrypted");
  if (rec->compressed_size != rec->uncompressed_size) {
    return ZipError("STORED record '" + rec->name + "' has differing sizes");
  }
  int itemsize = DtypeItemSize(call.dtype);
  unsigned __int128 storage_bytes = static_cast<unsigned __int128>(call.storage_numel) *
                                    (call.untyped ? 1 : static_cast<unsigned>(itemsize));
  if (storage_bytes != rec->uncompressed_size) {
    return ZipError("storage of " + std::to_string(call.storage_numel) +
                    " elements does not match "
                    "record '" +
                    rec->name + "' of " + std::to_string(rec->uncompressed_size) + " bytes");
  }
  uint64_t extent = 0;
  if (!ExtentBytes(call, itemsize, &extent) || extent > rec->uncompressed_size) {
    return ZipError("tensor view reaches past its storage");
  }
  CKPT_ASSIGN_OR_RETURN(out.data_offset, ZipDataOffset(read, dir, *rec));
  out.is_tensor = true;
  out.dtype = std::move(call.dtype);
  out.shape = std::move(call.shape);
  out.stride = std::move(call.stride);
  out.storage_offset = call.storage_offset;
  out.storage_key = std::move(call.key);
  out.data_nbytes = rec->uncompressed_size;
  return out;
}

Status ResolveItemData(const TorchSaveTensor& t, DcpItem* item) {
  if (item->kind != ItemKind::kTensor) return Status::Ok();
  if (!t.is_tensor) {
    item->kind = ItemKind::kOpaque;
    return Status::Ok();
  }
  std::string where = "torch zip: item '" + item->fqn + "' in " + item->file;
  if (t.dtype != item->dtype) {
    return Corrupt(where + " holds " + t.dtype + " but the metadata says " + item->dtype);
  }
  if (t.shape != item->chunk_sizes) return Corrupt(where + " has a different shape");
  if (t.data_offset > item->length || item->length - t.data_offset < t.data_nbytes) {
    return Corrupt(where + " has data outside the item");
  }
  item->data_resolved = true;
  item->raw_offset = item->offset + t.data_offset;
  item->raw_nbytes = t.data_nbytes;
  item->stride = t.stride;
  item->storage_offset = t.storage_offset;
  return Status::Ok();
}

Result<TorchSaveTensor> ParseTorchSaveItem(std::string_view item, const ZipLimits& limits) {
  ReadAtFn read = [item](uint64_t offset, std::span<char> dst) -> Status {
    if (offset > item.size() || item.size() - offset < dst.size()) {
      return Corrupt("torch zip: read past the end of the item");
    }
    std::copy_n(item.data() + offset, dst.size(), dst.data());
    return Status::Ok();
  };
  return ParseTorchSaveItem(read, item.size(), limits);
}

}  // namespace ckptfs::store
