#include "store/dcp/dcp_metadata.h"

#include <algorithm>
#include <map>
#include <span>
#include <unordered_map>
#include <unordered_set>

namespace ckptfs::store {
namespace {

using std::string_view;

// Where each DCP class lives. torch 1.13 keeps them under torch.distributed._shard, torch 2.x
// under torch.distributed.checkpoint; Megatron subclasses Metadata in its own module.
constexpr string_view kMeta1 = "torch.distributed._shard.checkpoint.metadata";
constexpr string_view kMeta2 = "torch.distributed.checkpoint.metadata";
constexpr string_view kShardedMeta = "torch.distributed._shard.sharded_tensor.metadata";
constexpr string_view kFs1 = "torch.distributed._shard.checkpoint.filesystem";
constexpr string_view kFs2 = "torch.distributed.checkpoint.filesystem";
constexpr string_view kMcore = "megatron.core.dist_checkpointing.strategies.torch";

struct ClassName {
  string_view module, name;
};
using ClassSet = std::span<const ClassName>;

constexpr ClassName kMetadata1[] = {{kMeta1, "Metadata"}};
constexpr ClassName kMetadata2[] = {{kMeta2, "Metadata"}};
constexpr ClassName kMcoreMetadata[] = {{kMcore, "MCoreMetadata"}};
constexpr ClassName kTensorStorageMetadata[] = {{kMeta1, "TensorStorageMetadata"},
                                                {kMeta2, "TensorStorageMetadata"}};
constexpr ClassName kBytesStorageMetadata[] = {{kMeta1, "BytesStorageMetadata"},
                                               {kMeta2, "BytesStorageMetadata"}};
constexpr ClassName kChunkStorageMetadata[] = {{kMeta1, "ChunkStorageMetadata"},
                                               {kMeta2, "ChunkStorageMetadata"}};
constexpr ClassName kTensorProperties[] = {{kShardedMeta, "TensorProperties"},
                                           {kMeta2, "TensorProperties"}};
constexpr ClassName kMemFormatEnum[] = {{kShardedMeta, "MEM_FORMAT_ENCODING"},
                                        {kMeta2, "_MEM_FORMAT_ENCODING"}};
constexpr ClassName kMetadataIndex[] = {{kMeta1, "MetadataIndex"}, {kMeta2, "MetadataIndex"}};
constexpr ClassName kStorageInfo[] = {{kFs1, "_StorageInfo"}, {kFs2, "_StorageInfo"}};
constexpr ClassName kStorageMeta[] = {{kMeta2, "StorageMeta"}};
// Python 3.13 moved the concrete path classes to pathlib._local.
constexpr ClassName kPosixPath[] = {{"pathlib", "PosixPath"},
                                    {"pathlib", "PurePosixPath"},
                                    {"pathlib._local", "PosixPath"},
                                    {"pathlib._local", "PurePosixPath"}};

// The enum members of MEM_FORMAT_ENCODING, in value order.
constexpr string_view kMemFormats[] = {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST",
                                       "TORCH_PRESERVE_FORMAT"};

// Identifies one stored item: (fqn, chunk offsets), with no offsets for bytes items. This is
// what MetadataIndex hashes and compares on in torch (its `index` is only a hint).
struct StorageKey {
  string_view fqn;
  const std::vector<int64_t>* offsets;  // nullptr for bytes items; borrowed
  bool operator==(const StorageKey& o) const {
    if (fqn != o.fqn || (offsets == nullptr) != (o.offsets == nullptr)) return false;
    return offsets == nullptr || *offsets == *o.offsets;
  }
};

uint64_t HashKey(const StorageKey& k) {
  uint64_t h = std::hash<string_view>()(k.fqn);
  if (k.offsets == nullptr) return h ^ 0x9e3779b97f4a7c15ull;
  for (int64_t v : *k.offsets) h = (h ^ static_cast<uint64_t>(v)) * 0x100000001b3ull;
  // Offsets differ in few bits from chunk to chunk: spread them over the whole word.
  h ^= h >> 31;
  h *= 0x9e3779b97f4a7c15ull;
  return h ^ (h >> 29);
}

struct StorageEntry {
  string_view fqn;
  bool has_offsets = false;
  std::vector<int64_t> offsets;
  string_view path;
  uint64_t offset = 0, length = 0;
  std::vector<std::string> transforms;
  bool used = false;
};

// Properties shared by every chunk of one tensor.
struct TensorProps {
  std::string dtype;
  bool strided = true;
};

// Walks the pickle graph along the DCP schema. Recursion is bounded by the schema's fixed
// depth, so cycles and memo-shared nodes in hostile input cannot make it loop.
class Interpreter {
 public:
  Interpreter(const PickleTree& tree, const DcpMetadataOptions& options)
      : t_(tree), options_(options) {}

  Result<DcpMetadata> Run();

 private:
  bool IsClass(NodeId cls, ClassSet set) const;
  std::string Describe(NodeId id) const { return t_.DebugString(id, 120); }
  Result<NodeId> ObjectState(NodeId obj, ClassSet set, string_view what) const;
  NodeId Field(NodeId state, string_view name) const;
  bool IsNone(NodeId id) const { return id == kNoNode || t_.Is(id, PickleKind::kNone); }

  Result<std::vector<int64_t>> ParseSize(NodeId id, string_view what) const;
  Result<int64_t> ParseNonNegInt(NodeId id, string_view what) const;
  Result<std::string> ParseDtype(NodeId id) const;
  Result<bool> ParseLayout(NodeId id) const;
  Status CheckMemoryFormat(NodeId id) const;
  Result<TensorProps> ParseTensorProperties(NodeId id) const;

  Status ParseStorageData(NodeId dict);
  Result<StorageEntry> ParseStorageEntry(NodeId key, NodeId value) const;
  Status BuildIndex();
  Status ParseStateDictMetadata(NodeId dict);
  Status AddBytesItem(string_view fqn);
  Status AddTensorItems(string_view fqn, NodeId tensor_md);
  Result<StorageEntry*> Claim(const StorageKey& key);
  void ParseExtras(NodeId state);

  const PickleTree& t_;
  const DcpMetadataOptions& options_;
  DcpMetadata md_;
  std::vector<StorageEntry> entries_;
  // Open addressing over entries_, by HashKey: a slot holds the key's hash in its high 32
  // bits and entry index + 1 in its low 32 bits (0: empty). Flat, unlike a node-based map,
  // so the lookup per chunk costs one or two cache misses, not four.
  std::vector<uint64_t> slots_;
  size_t next_claim_ = 0;  // entries_ index Claim() tries first
  // The slot holding `key`, or the empty slot where it would go.
  uint64_t* FindSlot(const StorageKey& key, uint64_t hash);
};

bool Interpreter::IsClass(NodeId cls, ClassSet set) const {
  if (!t_.Is(cls, PickleKind::kGlobal)) return false;
  string_view module = t_.global_module(cls), name = t_.global_name(cls);
  for (const ClassName& c : set) {
    if (c.module == module && c.name == name) return true;
  }
  return false;
}

// A dataclass instance pickles as NEWOBJ(cls, ()) followed by BUILD(state dict), with no
// BUILD when the instance has no fields. Returns the state (kNoNode when there is none).
Result<NodeId> Interpreter::ObjectState(NodeId obj, ClassSet set, string_view what) const {
  if (!t_.Is(obj, PickleKind::kNewObj) || !IsClass(t_.callable(obj), set)) {
    return Corrupt(std::string("dcp metadata: expected ") + std::string(what) + ", got " +
                   Describe(obj));
  }
  if (!t_.items(t_.args(obj)).empty() || !t_.items(obj).empty()) {
    return Corrupt("dcp metadata: unexpected constructor arguments for " + std::string(what));
  }
  return t_.state(obj);
}

// Looks a field up in an object state: a dict, or the (dict, slots dict) pair that objects
// with __slots__ produce.
NodeId Interpreter::Field(NodeId state, string_view name) const {
  if (t_.Is(state, PickleKind::kDict)) return t_.DictGet(state, name);
  if (t_.Is(state, PickleKind::kTuple) && t_.items(state).size() == 2) {
    for (NodeId part : t_.items(state)) {
      NodeId v = t_.DictGet(part, name);
      if (v != kNoNode) return v;
    }
  }
  return kNoNode;
}

// torch.Size pickles as REDUCE(torch.Size, (tuple_of_ints,)); plain tuples are accepted too.
Result<std::vector<int64_t>> Interpreter::ParseSize(NodeId id, string_view what) const {
  NodeId tuple = id;
  if (t_.Is(id, PickleKind::kReduce)) {
    std::span<const NodeId> args = t_.items(t_.args(id));
    if (!t_.IsGlobal(t_.callable(id), "torch", "Size") || args.size() != 1) {
      return Corrupt("dcp metadata: " + std::string(what) +
                     " is not a torch.Size: " + Describe(id));
    }
    tuple = args[0];
  }
  if (!t_.Is(tuple, PickleKind::kTuple) && !t_.Is(tuple, PickleKind::kList)) {
    return Corrupt("dcp metadata: " + std::string(what) + " is not a size: " + Describe(id));
  }
  std::span<const NodeId> elems = t_.items(tuple);
  if (elems.size() > options_.max_dims) {
    return Corrupt("dcp metadata: " + std::string(what) + " has " + std::to_string(elems.size()) +
                   " dimensions");
  }
  std::vector<int64_t> out;
  out.reserve(elems.size());
  for (NodeId e : elems) {
    CKPT_ASSIGN_OR_RETURN(int64_t v, ParseNonNegInt(e, what));
    out.push_back(v);
  }
  return out;
}

Result<int64_t> Interpreter::ParseNonNegInt(NodeId id, string_view what) const {
  if (!t_.Is(id, PickleKind::kInt) || t_.int_value(id) < 0) {
    return Corrupt("dcp metadata: " + std::string(what) +
                   " is not a non-negative int: " + Describe(id));
  }
  return t_.int_value(id);
}

// Dtypes are bare globals such as torch.float16. Unknown names from newer torch versions
// are kept as they are; torch_zip.cc decides whether it can read such data.
Result<std::string> Interpreter::ParseDtype(NodeId id) const {
  string_view name = t_.global_name(id);
  bool ok = t_.Is(id, PickleKind::kGlobal) && t_.global_module(id) == "torch" && !name.empty();
  for (char c : name) {
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_');
  }
  if (!ok) return Corrupt("dcp metadata: not a torch dtype: " + Describe(id));
  return std::string(name);
}

// Layout is torch.serialization._get_layout('torch.strided') (or a bare torch.<layout> global
// in some versions). Returns whether it is strided.
Result<bool> Interpreter::ParseLayout(NodeId id) const {
  if (t_.Is(id, PickleKind::kReduce) &&
      t_.IsGlobal(t_.callable(id), "torch.serialization", "_get_layout")) {
    std::span<const NodeId> args = t_.items(t_.args(id));
    if (args.size() == 1 && t_.Is(args[0], PickleKind::kStr)) {
      return t_.str(args[0]) == "torch.strided";
    }
  }
  if (t_.Is(id, PickleKind::kGlobal) && t_.global_module(id) == "torch") {
    return t_.global_name(id) == "strided";
  }
  return Corrupt("dcp metadata: not a torch layout: " + Describe(id));
}

// The memory-format enum member is either getattr(Enum, 'NAME') or Enum(value), depending
// on the CPython patch version that wrote the file. Both are accepted; the value itself
// does not change how stored bytes are laid out (stride does).
Status Interpreter::CheckMemoryFormat(NodeId id) const {
  if (t_.Is(id, PickleKind::kReduce)) {
    NodeId fn = t_.callable(id);
    std::span<const NodeId> args = t_.items(t_.args(id));
    bool is_getattr =
        t_.IsGlobal(fn, "builtins", "getattr") || t_.IsGlobal(fn, "__builtin__", "getattr");
    if (is_getattr && args.size() == 2 && IsClass(args[0], kMemFormatEnum) &&
        t_.Is(args[1], PickleKind::kStr)) {
      for (string_view name : kMemFormats) {
        if (t_.str(args[1]) == name) return Status::Ok();
      }
    }
    if (IsClass(fn, kMemFormatEnum) && args.size() == 1 && t_.Is(args[0], PickleKind::kInt) &&
        t_.int_value(args[0]) >= 0 && t_.int_value(args[0]) < std::ssize(kMemFormats)) {
      return Status::Ok();
    }
  }
  return Corrupt("dcp metadata: not a memory format: " + Describe(id));
}

// TensorProperties pickles its state as a 5-tuple (dtype, layout, requires_grad,
// memory_format, pin_memory); a plain field dict is accepted too.
Result<TensorProps> Interpreter::ParseTensorProperties(NodeId id) const {
  CKPT_ASSIGN_OR_RETURN(NodeId state, ObjectState(id, kTensorProperties, "TensorProperties"));
  NodeId dtype, layout, memory_format;
  std::span<const NodeId> tuple = t_.items(state);
  if (t_.Is(state, PickleKind::kTuple) && tuple.size() == 5) {
    dtype = tuple[0];
    layout = tuple[1];
    memory_format = tuple[3];
  } else if (t_.Is(state, PickleKind::kDict)) {
    dtype = Field(state, "dtype");
    layout = Field(state, "layout");
    memory_format = Field(state, "memory_format");
  } else {
    return Corrupt("dcp metadata: unexpected TensorProperties state: " + Describe(state));
  }
  TensorProps props;
  CKPT_ASSIGN_OR_RETURN(props.dtype, ParseDtype(dtype));
  if (!IsNone(layout)) {
    CKPT_ASSIGN_OR_RETURN(props.strided, ParseLayout(layout));
  }
  if (!IsNone(memory_format)) CKPT_RETURN_IF_ERROR(CheckMemoryFormat(memory_format));
  return props;
}

Result<StorageEntry> Interpreter::ParseStorageEntry(NodeId key, NodeId value) const {
  StorageEntry e;
  CKPT_ASSIGN_OR_RETURN(NodeId ks, ObjectState(key, kMetadataIndex, "MetadataIndex"));
  NodeId fqn = Field(ks, "fqn");
  if (!t_.Is(fqn, PickleKind::kStr)) {
    return Corrupt("dcp metadata: MetadataIndex without an fqn: " + Describe(key));
  }
  e.fqn = t_.str(fqn);
  // MetadataIndex leaves `offset` out of its state when it is None (bytes items).
  NodeId offset = Field(ks, "offset");
  if (!IsNone(offset)) {
    e.has_offsets = true;
    CKPT_ASSIGN_OR_RETURN(e.offsets, ParseSize(offset, "MetadataIndex.offset"));
  }
  CKPT_ASSIGN_OR_RETURN(NodeId vs, ObjectState(value, kStorageInfo, "_StorageInfo"));
  NodeId path = Field(vs, "relative_path");
  if (!t_.Is(path, PickleKind::kStr)) {
    return Corrupt("dcp metadata: _StorageInfo of '" + std::string(e.fqn) +
                   "' has no relative_path");
  }
  e.path = t_.str(path);
  Status st = ValidateRelativePath(e.path);
  if (!st.ok()) return Corrupt("dcp metadata: item '" + std::string(e.fqn) + "': " + st.message());
  CKPT_ASSIGN_OR_RETURN(int64_t off, ParseNonNegInt(Field(vs, "offset"), "_StorageInfo.offset"));
  CKPT_ASSIGN_OR_RETURN(int64_t len, ParseNonNegInt(Field(vs, "length"), "_StorageInfo.length"));
  e.offset = static_cast<uint64_t>(off);
  e.length = static_cast<uint64_t>(len);
  NodeId transforms = Field(vs, "transform_descriptors");
  if (!IsNone(transforms)) {
    if (!t_.Is(transforms, PickleKind::kList) && !t_.Is(transforms, PickleKind::kTuple)) {
      return Corrupt("dcp metadata: bad transform_descriptors: " + Describe(transforms));
    }
    for (NodeId d : t_.items(transforms)) {
      if (!t_.Is(d, PickleKind::kStr)) {
        return Corrupt("dcp metadata: transform descriptor is not a str: " + Describe(d));
      }
      e.transforms.emplace_back(t_.str(d));
    }
  }
  return e;
}

Status Interpreter::ParseStorageData(NodeId dict) {
  if (!t_.Is(dict, PickleKind::kDict)) {
    return Corrupt("dcp metadata: storage_data is not a dict: " + Describe(dict));
  }
  std::span<const NodeId> kv = t_.items(dict);
  entries_.reserve(kv.size() / 2);
  for (size_t i = 0; i + 1 < kv.size(); i += 2) {
    CKPT_ASSIGN_OR_RETURN(StorageEntry e, ParseStorageEntry(kv[i], kv[i + 1]));
    entries_.push_back(std::move(e));
  }
  return BuildIndex();
}

uint64_t* Interpreter::FindSlot(const StorageKey& key, uint64_t hash) {
  const size_t mask = slots_.size() - 1;
  const uint64_t tag = hash & 0xffffffff00000000ull;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    uint64_t& slot = slots_[i];
    if (slot == 0) return &slot;
    if ((slot & 0xffffffff00000000ull) != tag) continue;
    const StorageEntry& e = entries_[(slot & 0xffffffffu) - 1];
    if (StorageKey{e.fqn, e.has_offsets ? &e.offsets : nullptr} == key) return &slot;
  }
}

// Built only once entries_ is final, since keys point into it.
Status Interpreter::BuildIndex() {
  if (entries_.size() >= 0xffffffffu) return Corrupt("dcp metadata: too many storage entries");
  size_t capacity = 16;
  while (capacity < entries_.size() * 2) capacity *= 2;  // at most half full
  slots_.assign(capacity, 0);
  for (size_t i = 0; i < entries_.size(); ++i) {
    const StorageEntry& e = entries_[i];
    StorageKey key{e.fqn, e.has_offsets ? &e.offsets : nullptr};
    uint64_t hash = HashKey(key);
    uint64_t* slot = FindSlot(key, hash);
    if (*slot != 0) {
      return Corrupt("dcp metadata: storage_data names '" + std::string(e.fqn) +
                     "' at the same offsets twice");
    }
    *slot = (hash & 0xffffffff00000000ull) | (i + 1);
  }
  return Status::Ok();
}

Result<StorageEntry*> Interpreter::Claim(const StorageKey& key) {
  // storage_data usually lists the chunks in state_dict order: try the entry after the one
  // claimed last before hashing. Keys are unique (BuildIndex), so a match is the match.
  StorageEntry* e = nullptr;
  if (next_claim_ < entries_.size()) {
    StorageEntry& next = entries_[next_claim_];
    if (StorageKey{next.fqn, next.has_offsets ? &next.offsets : nullptr} == key) e = &next;
  }
  if (e == nullptr) {
    uint64_t slot = slots_.empty() ? 0 : *FindSlot(key, HashKey(key));
    if (slot == 0) {
      return Corrupt("dcp metadata: no storage_data entry for '" + std::string(key.fqn) + "'" +
                     (key.offsets ? " chunk" : ""));
    }
    e = &entries_[(slot & 0xffffffffu) - 1];
  }
  next_claim_ = static_cast<size_t>(e - entries_.data()) + 1;
  if (e->used) {
    return Corrupt("dcp metadata: '" + std::string(key.fqn) + "' lists one chunk twice");
  }
  e->used = true;
  return e;
}

Status Interpreter::AddBytesItem(string_view fqn) {
  CKPT_ASSIGN_OR_RETURN(StorageEntry * e, Claim(StorageKey{fqn, nullptr}));
  DcpItem& item = md_.items.emplace_back();
  item.kind = e->transforms.empty() ? ItemKind::kBytes : ItemKind::kOpaque;
  item.is_bytes = true;
  item.fqn = std::string(fqn);
  item.file = std::string(e->path);
  item.offset = e->offset;
  item.length = e->length;
  item.transforms = std::move(e->transforms);
  return Status::Ok();
}

Status Interpreter::AddTensorItems(string_view fqn, NodeId tensor_md) {
  std::string where = "TensorStorageMetadata of '" + std::string(fqn) + "'";
  CKPT_ASSIGN_OR_RETURN(NodeId state, ObjectState(tensor_md, kTensorStorageMetadata, where));
  CKPT_ASSIGN_OR_RETURN(TensorProps props, ParseTensorProperties(Field(state, "properties")));
  CKPT_ASSIGN_OR_RETURN(std::vector<int64_t> global_size, ParseSize(Field(state, "size"), where));
  NodeId chunks = Field(state, "chunks");
  if (!t_.Is(chunks, PickleKind::kList) && !t_.Is(chunks, PickleKind::kTuple)) {
    return Corrupt("dcp metadata: " + where + " has no chunk list");
  }
  uint32_t chunk_index = 0;
  for (NodeId chunk : t_.items(chunks)) {
    CKPT_ASSIGN_OR_RETURN(NodeId cs, ObjectState(chunk, kChunkStorageMetadata, where));
    CKPT_ASSIGN_OR_RETURN(std::vector<int64_t> offsets, ParseSize(Field(cs, "offsets"), where));
    CKPT_ASSIGN_OR_RETURN(std::vector<int64_t> sizes, ParseSize(Field(cs, "sizes"), where));
    if (offsets.size() != global_size.size() || sizes.size() != global_size.size()) {
      return Corrupt("dcp metadata: chunk of '" + std::string(fqn) + "' has the wrong rank");
    }
    for (size_t d = 0; d < global_size.size(); ++d) {
      // All three are non-negative int64, so the sum cannot overflow uint64.
      if (static_cast<uint64_t>(offsets[d]) + static_cast<uint64_t>(sizes[d]) >
          static_cast<uint64_t>(global_size[d])) {
        return Corrupt("dcp metadata: chunk of '" + std::string(fqn) + "' lies outside the tensor");
      }
    }
    CKPT_ASSIGN_OR_RETURN(StorageEntry * e, Claim(StorageKey{fqn, &offsets}));
    DcpItem& item = md_.items.emplace_back();
    item.kind = (e->transforms.empty() && props.strided) ? ItemKind::kTensor : ItemKind::kOpaque;
    item.fqn = std::string(fqn);
    item.chunk_offsets = std::move(offsets);
    item.chunk_sizes = std::move(sizes);
    item.global_size = global_size;
    item.dtype = props.dtype;
    item.file = std::string(e->path);
    item.offset = e->offset;
    item.length = e->length;
    item.transforms = std::move(e->transforms);
    item.chunk_index = chunk_index++;
  }
  return Status::Ok();
}

Status Interpreter::ParseStateDictMetadata(NodeId dict) {
  if (!t_.Is(dict, PickleKind::kDict)) {
    return Corrupt("dcp metadata: state_dict_metadata is not a dict: " + Describe(dict));
  }
  std::span<const NodeId> kv = t_.items(dict);
  std::unordered_set<string_view> seen;
  seen.reserve(kv.size() / 2);
  md_.items.reserve(entries_.size());
  for (size_t i = 0; i + 1 < kv.size(); i += 2) {
    if (!t_.Is(kv[i], PickleKind::kStr)) {
      return Corrupt("dcp metadata: state_dict_metadata key is not a str: " + Describe(kv[i]));
    }
    string_view fqn = t_.str(kv[i]);
    if (!seen.insert(fqn).second) {
      return Corrupt("dcp metadata: fqn '" + std::string(fqn) + "' appears twice");
    }
    NodeId value = kv[i + 1];
    if (t_.Is(value, PickleKind::kNewObj) && IsClass(t_.callable(value), kBytesStorageMetadata)) {
      NodeId st = t_.state(value);
      if (!IsNone(st) && t_.dict_size(st) != 0) {
        return Corrupt("dcp metadata: BytesStorageMetadata of '" + std::string(fqn) +
                       "' has fields");
      }
      CKPT_RETURN_IF_ERROR(AddBytesItem(fqn));
    } else {
      CKPT_RETURN_IF_ERROR(AddTensorItems(fqn, value));
    }
  }
  for (const StorageEntry& e : entries_) {
    if (!e.used) {
      return Corrupt("dcp metadata: storage_data entry for '" + std::string(e.fqn) +
                     "' matches nothing in state_dict_metadata");
    }
  }
  return Status::Ok();
}

// Informational fields: never fatal, since loading does not depend on them.
void Interpreter::ParseExtras(NodeId state) {
  std::span<const NodeId> kv = t_.items(state);
  for (size_t i = 0; i + 1 < kv.size(); i += 2) {
    string_view name = t_.str(kv[i]);
    if (!t_.Is(kv[i], PickleKind::kStr) || name == "state_dict_metadata" ||
        name == "storage_data" || IsNone(kv[i + 1])) {
      continue;
    }
    md_.other_fields.emplace_back(name);
  }
  std::sort(md_.other_fields.begin(), md_.other_fields.end());
  NodeId version = Field(state, "version");
  if (t_.Is(version, PickleKind::kStr)) md_.version = std::string(t_.str(version));

  NodeId storage_meta = Field(state, "storage_meta");
  if (!t_.Is(storage_meta, PickleKind::kNewObj) ||
      !IsClass(t_.callable(storage_meta), kStorageMeta)) {
    return;
  }
  NodeId id = Field(t_.state(storage_meta), "checkpoint_id");
  if (t_.Is(id, PickleKind::kStr)) {
    md_.checkpoint_id = std::string(t_.str(id));
  } else if (t_.Is(id, PickleKind::kReduce) && IsClass(t_.callable(id), kPosixPath)) {
    // PosixPath pickles as REDUCE(PosixPath, parts), e.g. ('/', 'ckpt', 'step_100').
    std::string path;
    for (NodeId part : t_.items(t_.args(id))) {
      if (!t_.Is(part, PickleKind::kStr)) return;
      if (!path.empty() && path.back() != '/') path += '/';
      path += t_.str(part);
    }
    md_.checkpoint_id = std::move(path);
  }
}

Result<DcpMetadata> Interpreter::Run() {
  NodeId root = t_.root();
  if (!t_.Is(root, PickleKind::kNewObj)) {
    return Corrupt("dcp metadata: top-level value is not a Metadata object: " + Describe(root));
  }
  NodeId cls = t_.callable(root);
  if (IsClass(cls, kMetadata1)) {
    md_.flavor = "torch1";
  } else if (IsClass(cls, kMetadata2)) {
    md_.flavor = "torch2";
  } else if (IsClass(cls, kMcoreMetadata)) {
    md_.flavor = "mcore";
  } else {
    return Corrupt("dcp metadata: unknown top-level class " + Describe(cls));
  }
  NodeId state = t_.state(root);
  if (!t_.Is(state, PickleKind::kDict)) return Corrupt("dcp metadata: Metadata has no state");
  NodeId storage_data = Field(state, "storage_data");
  if (IsNone(storage_data)) return Corrupt("dcp metadata: no storage_data");
  CKPT_RETURN_IF_ERROR(ParseStorageData(storage_data));
  CKPT_RETURN_IF_ERROR(ParseStateDictMetadata(Field(state, "state_dict_metadata")));
  ParseExtras(state);
  return std::move(md_);
}

}  // namespace

std::string_view ItemKindName(ItemKind kind) {
  switch (kind) {
    case ItemKind::kTensor:
      return "tensor";
    case ItemKind::kBytes:
      return "bytes";
    case ItemKind::kOpaque:
      return "opaque";
  }
  return "?";
}

Status ValidateRelativePath(std::string_view path) {
  if (path.empty()) return Invalid("empty relative path");
  if (path.front() == '/') return Invalid("absolute path '" + std::string(path) + "'");
  if (path.find('\0') != std::string_view::npos) return Invalid("NUL byte in relative path");
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string_view::npos) end = path.size();
    std::string_view comp = path.substr(start, end - start);
    if (comp.empty() || comp == "." || comp == "..") {
      return Invalid("relative path '" + std::string(path) + "' has a '" + std::string(comp) +
                     "' component");
    }
    start = end + 1;
  }
  return Status::Ok();
}

Result<DcpMetadata> ParseDcpMetadata(std::string_view bytes) {
  return ParseDcpMetadata(bytes, DcpMetadataOptions());
}

Result<DcpMetadata> ParseDcpMetadata(std::string_view bytes, const DcpMetadataOptions& options) {
  CKPT_ASSIGN_OR_RETURN(PickleTree tree, ParsePickle(bytes, options.pickle_limits));
  return Interpreter(tree, options).Run();
}

std::vector<std::pair<std::string, uint64_t>> RequiredFileLengths(const DcpMetadata& md) {
  std::map<std::string_view, uint64_t> need;
  for (const DcpItem& item : md.items) {
    uint64_t end = item.offset + item.length;
    if (end < item.offset) end = UINT64_MAX;  // only reachable for hand-built DcpMetadata
    uint64_t& cur = need[item.file];
    cur = std::max(cur, end);
  }
  std::vector<std::pair<std::string, uint64_t>> out;
  out.reserve(need.size());
  for (const auto& [file, len] : need) out.emplace_back(std::string(file), len);
  return out;
}

}  // namespace ckptfs::store
