#include "store/dcp/pickle.h"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <unordered_map>

namespace ckptfs::store {
namespace {

// Opcodes, named as in CPython's Lib/pickle.py.
enum Op : uint8_t {
  kMark = '(',
  kStop = '.',
  kPop = '0',
  kDup = '2',
  kBinInt = 'J',
  kBinInt1 = 'K',
  kBinInt2 = 'M',
  kNone = 'N',
  kBinPersId = 'Q',
  kReduce = 'R',
  kBinString = 'T',
  kShortBinString = 'U',
  kBinUnicode = 'X',
  kAppend = 'a',
  kBuild = 'b',
  kGlobal = 'c',
  kAppends = 'e',
  kBinGet = 'h',
  kLongBinGet = 'j',
  kEmptyList = ']',
  kBinPut = 'q',
  kLongBinPut = 'r',
  kSetItem = 's',
  kTuple = 't',
  kEmptyTuple = ')',
  kSetItems = 'u',
  kEmptyDict = '}',
  kBinFloat = 'G',
  kBinBytes = 'B',
  kShortBinBytes = 'C',
  kProto = 0x80,
  kNewObj = 0x81,
  kTuple1 = 0x85,
  kTuple2 = 0x86,
  kTuple3 = 0x87,
  kNewTrue = 0x88,
  kNewFalse = 0x89,
  kLong1 = 0x8a,
  kLong4 = 0x8b,
  kShortBinUnicode = 0x8c,
  kBinUnicode8 = 0x8d,
  kBinBytes8 = 0x8e,
  kStackGlobal = 0x93,
  kMemoize = 0x94,
  kFrame = 0x95,
  kByteArray8 = 0x96,
};

constexpr uint8_t kObjListItems = 1;
constexpr uint8_t kObjDictItems = 2;

std::string Hex(uint8_t byte) {
  static constexpr char kDigits[] = "0123456789abcdef";
  return std::string{'0', 'x', kDigits[byte >> 4], kDigits[byte & 15]};
}

// Python decodes pickled text as UTF-8 with "surrogatepass", so surrogate code points are
// accepted; overlong forms, stray continuation bytes and values past U+10FFFF are not.
bool IsValidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  size_t n = s.size(), i = 0;
  while (i < n) {
    // Names and paths are ASCII: take 8 such bytes at a time.
    if (n - i >= 8) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if ((w & 0x8080808080808080ull) == 0) {
        i += 8;
        continue;
      }
    }
    uint8_t c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if ((c & 0xe0) == 0xc0) {
      len = 2;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    static constexpr uint32_t kMinForLen[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLen[len] || cp > 0x10ffff) return false;
    i += len;
  }
  return true;
}

// Big buffers that are filled at once (a .metadata's nodes: tens of MiB) take a fraction of
// the page faults with transparent huge pages, where the system leaves them to madvise.
void AdviseHuge(void* p, size_t bytes) {
  constexpr uintptr_t kHuge = 2u << 20;
  if (bytes < 4 * kHuge) return;
  uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace

// The symbolic pickle virtual machine. One instance parses one input.
//
// The hot path returns bool and keeps the first error in error_: a .metadata runs millions of
// opcodes, and building and destroying a Status per opcode and per node used to cost more
// than the opcodes themselves.
class PickleMachine {
 public:
  PickleMachine(std::string_view in, const PickleLimits& limits) : in_(in), limits_(limits) {
    tree_.input_ = in;
    max_depth_ = std::min<uint32_t>(limits.max_depth, 0xffff);
    std::fill(std::begin(small_ints_), std::end(small_ints_), kNoNode);
  }

  Result<PickleTree> Run();

 private:
  using Node = PickleTree::Node;

  bool Step(uint8_t op);
  // Records the first error (a Corrupt one naming the current opcode) and returns false.
  bool Err(std::string what) {
    return Fail(Corrupt("pickle: " + what + " (opcode " + Hex(op_) + " at offset " +
                        std::to_string(op_pos_) + ")"));
  }
  bool Fail(Status st) {
    if (error_.ok()) error_ = std::move(st);
    return false;
  }

  // --- input ---
  bool Need(uint64_t n) {
    if (n > in_.size() - pos_) return Err("truncated: needs " + std::to_string(n) + " bytes");
    return true;
  }
  uint64_t ReadLe(size_t n) {  // caller checked Need(n)
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(in_[pos_ + i])} << (8 * i);
    pos_ += n;
    return v;
  }
  bool ReadLength(size_t width, uint64_t* len);
  bool ReadLine(std::string_view* line);

  // --- nodes (kNoNode on failure) ---
  NodeId NewNode(PickleKind kind, uint32_t depth = 1);
  NodeId NewInt(int64_t v);
  NodeId NewString(PickleKind kind, uint64_t offset, uint64_t len);
  NodeId NewTuple(std::span<const NodeId> elems);
  // Immutable values that CPython shares too (None, bools, small ints, the empty tuple) get
  // one node each, which keeps the node count of a real .metadata down by a third.
  NodeId Shared(NodeId* slot, PickleKind kind, int64_t value);
  Node& node(NodeId id) { return tree_.nodes_[id]; }
  uint32_t DepthOf(std::initializer_list<NodeId> ids);
  bool RaiseDepth(NodeId parent, NodeId child);

  // --- stack ---
  size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }
  bool Push(NodeId id) {
    if (id == kNoNode) return false;  // the node could not be made; error_ says why
    if (stack_.size() >= limits_.max_stack) return Err("stack limit exceeded");
    stack_.push_back(id);
    return true;
  }
  bool Pop(NodeId* id) {
    if (stack_.size() <= fence()) return Err("stack underflow");
    *id = stack_.back();
    stack_.pop_back();
    return true;
  }
  bool Top(NodeId* id) {
    if (stack_.size() <= fence()) return Err("stack underflow");
    *id = stack_.back();
    return true;
  }
  bool PopMark(size_t* mark) {
    if (marks_.empty()) return Err("no MARK on the stack");
    *mark = marks_.back();
    marks_.pop_back();
    return true;
  }

  // --- opcode families ---
  bool OpLong(size_t width_of_len);
  bool OpString(PickleKind kind, size_t width_of_len);
  bool OpTuple(size_t n);
  bool OpTupleFromMark();
  bool OpAppend(bool many);
  bool OpSetItem(bool many);
  bool AddItems(NodeId target, size_t first, bool dict_like);
  bool OpPut(uint64_t key);
  bool OpGet(uint64_t key);
  bool OpCall(PickleKind kind);
  bool OpBuild();
  bool OpGlobal(bool from_stack);

  std::string_view in_;
  PickleLimits limits_;
  uint32_t max_depth_;
  uint64_t pos_ = 0;
  uint64_t op_pos_ = 0;
  uint8_t op_ = 0;
  bool stopped_ = false;
  Status error_;
  PickleTree tree_;
  std::vector<NodeId> stack_;
  std::vector<size_t> marks_;
  // MEMOIZE/BINPUT keys are dense in everything Python writes; sparse keys fall back to a map
  // so a single huge LONG_BINPUT key cannot make us allocate a huge vector.
  std::vector<NodeId> memo_;
  std::unordered_map<uint64_t, NodeId> sparse_memo_;
  NodeId none_ = kNoNode, true_ = kNoNode, false_ = kNoNode, empty_tuple_ = kNoNode;
  NodeId small_ints_[256];
};

Result<PickleTree> PickleMachine::Run() {
  if (in_.size() > limits_.max_input_bytes) {
    return Corrupt("pickle: input of " + std::to_string(in_.size()) + " bytes exceeds the " +
                   std::to_string(limits_.max_input_bytes) + "-byte limit");
  }
  if (in_.size() < 2 || static_cast<uint8_t>(in_[0]) != kProto) {
    return Unsupported("pickle: does not start with PROTO (protocol 2 or later required)");
  }
  // Rough pre-sizing: a real .metadata creates about one node per 7 input bytes.
  tree_.nodes_.reserve(std::min<uint64_t>(in_.size() / 6 + 16, limits_.max_nodes));
  AdviseHuge(tree_.nodes_.data(), tree_.nodes_.capacity() * sizeof(Node));
  tree_.tuple_items_.reserve(in_.size() / 8 + 16);
  // Sized once, so that a tiny data.pkl makes few allocations and a .metadata (which
  // memoizes nearly every value) never copies its memo while growing it. Reserved pages that
  // are never touched cost nothing.
  stack_.reserve(std::min<uint64_t>(in_.size() / 4 + 8, 1024));
  memo_.reserve(std::min<uint64_t>(in_.size() / 4 + 8, limits_.max_memo_entries));
  AdviseHuge(tree_.tuple_items_.data(), tree_.tuple_items_.capacity() * sizeof(NodeId));
  AdviseHuge(memo_.data(), memo_.capacity() * sizeof(NodeId));
  while (!stopped_) {
    if (pos_ >= in_.size()) return Corrupt("pickle: truncated: no STOP opcode");
    op_pos_ = pos_;
    op_ = static_cast<uint8_t>(in_[pos_++]);
    if (!Step(op_)) {
      if (error_.ok()) return Internal("pickle: opcode failed without an error");
      return std::move(error_);
    }
  }
  if (pos_ != in_.size()) {
    return Corrupt("pickle: " + std::to_string(in_.size() - pos_) + " trailing bytes after STOP");
  }
  return std::move(tree_);
}

bool PickleMachine::Step(uint8_t op) {
  switch (op) {
    case kProto: {
      if (!Need(1)) return false;
      uint8_t proto = static_cast<uint8_t>(in_[pos_++]);
      if (proto < 2 || proto > 5) {
        return Fail(Unsupported("pickle: protocol " + std::to_string(proto) + " at offset " +
                                std::to_string(op_pos_) + " (only 2 to 5 are supported)"));
      }
      if (op_pos_ != 0) return Err("PROTO after the start");
      tree_.protocol_ = proto;
      return true;
    }
    case kFrame: {
      // Frames only group opcodes for buffered reading; the content is parsed as usual, as
      // CPython's C unpickler does. The frame must lie inside the input.
      if (!Need(8)) return false;
      uint64_t len = ReadLe(8);
      if (len > in_.size() - pos_)
        return Err("frame of " + std::to_string(len) + " bytes past end");
      return true;
    }
    case kStop: {
      if (!Pop(&tree_.root_)) return false;
      if (!stack_.empty() || !marks_.empty()) return Err("values left on the stack at STOP");
      stopped_ = true;
      return true;
    }
    case kMark:
      if (marks_.size() >= max_depth_) return Err("too many nested MARKs");
      marks_.push_back(stack_.size());
      return true;
    case kPop: {
      NodeId ignored = kNoNode;
      return Pop(&ignored);
    }
    case kDup: {
      NodeId top = kNoNode;
      return Top(&top) && Push(top);
    }
    case kNone:
      return Push(Shared(&none_, PickleKind::kNone, 0));
    case kNewTrue:
    case kNewFalse: {
      bool v = op == kNewTrue;
      return Push(Shared(v ? &true_ : &false_, PickleKind::kBool, v));
    }
    case kBinInt:
      return Need(4) && Push(NewInt(static_cast<int32_t>(ReadLe(4))));
    case kBinInt1:
    case kBinInt2: {
      size_t n = op == kBinInt1 ? 1 : 2;
      return Need(n) && Push(NewInt(static_cast<int64_t>(ReadLe(n))));
    }
    case kLong1:
      return OpLong(1);
    case kLong4:
      return OpLong(4);
    case kBinFloat: {
      if (!Need(8)) return false;
      uint64_t bits = 0;
      for (int i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<uint8_t>(in_[pos_ + i]);
      pos_ += 8;
      NodeId id = NewNode(PickleKind::kFloat);
      if (id == kNoNode) return false;
      node(id).u.f = std::bit_cast<double>(bits);
      return Push(id);
    }
    case kShortBinUnicode:
      return OpString(PickleKind::kStr, 1);
    case kBinUnicode:
      return OpString(PickleKind::kStr, 4);
    case kBinUnicode8:
      return OpString(PickleKind::kStr, 8);
    case kShortBinBytes:
    case kShortBinString:
      return OpString(PickleKind::kBytes, 1);
    case kBinBytes:
    case kBinString:
      return OpString(PickleKind::kBytes, 4);
    case kBinBytes8:
    case kByteArray8:
      return OpString(PickleKind::kBytes, 8);
    case kEmptyTuple:
      return OpTuple(0);
    case kTuple1:
      return OpTuple(1);
    case kTuple2:
      return OpTuple(2);
    case kTuple3:
      return OpTuple(3);
    case kTuple:
      return OpTupleFromMark();
    case kEmptyList:
    case kEmptyDict:
      // Elements come with APPEND/SETITEM.
      return Push(NewNode(op == kEmptyList ? PickleKind::kList : PickleKind::kDict));
    case kAppend:
      return OpAppend(false);
    case kAppends:
      return OpAppend(true);
    case kSetItem:
      return OpSetItem(false);
    case kSetItems:
      return OpSetItem(true);
    case kMemoize:
      return OpPut(memo_.size() + sparse_memo_.size());
    case kBinPut:
      return Need(1) && OpPut(ReadLe(1));
    case kLongBinPut:
      return Need(4) && OpPut(ReadLe(4));
    case kBinGet:
      return Need(1) && OpGet(ReadLe(1));
    case kLongBinGet:
      return Need(4) && OpGet(ReadLe(4));
    case kGlobal:
      return OpGlobal(false);
    case kStackGlobal:
      return OpGlobal(true);
    case kReduce:
      return OpCall(PickleKind::kReduce);
    case kNewObj:
      return OpCall(PickleKind::kNewObj);
    case kBuild:
      return OpBuild();
    case kBinPersId: {
      NodeId pid = kNoNode;
      if (!Pop(&pid)) return false;
      NodeId id = NewNode(PickleKind::kPersId, DepthOf({pid}));
      if (id == kNoNode) return false;
      node(id).c = pid;
      return Push(id);
    }
    default:
      return Fail(Unsupported("pickle: unsupported opcode " + Hex(op) + " at offset " +
                              std::to_string(op_pos_)));
  }
}

bool PickleMachine::ReadLength(size_t width, uint64_t* len) {
  if (!Need(width)) return false;
  *len = ReadLe(width);
  // BINSTRING/LONG4 lengths are signed in the format; a "negative" length is always past end.
  if (*len > in_.size() - pos_) return Err("length " + std::to_string(*len) + " past end of input");
  return true;
}

bool PickleMachine::ReadLine(std::string_view* line) {
  size_t nl = in_.find('\n', pos_);
  if (nl == std::string_view::npos) return Err("truncated: unterminated line");
  *line = in_.substr(pos_, nl - pos_);
  pos_ = nl + 1;
  return true;
}

bool PickleMachine::OpLong(size_t width_of_len) {
  uint64_t n;
  if (width_of_len == 1) {
    if (!Need(1)) return false;
    n = ReadLe(1);
  } else {
    if (!Need(4)) return false;
    int32_t signed_len = static_cast<int32_t>(ReadLe(4));
    if (signed_len < 0) return Err("negative LONG4 length");
    n = static_cast<uint64_t>(signed_len);
  }
  if (!Need(n)) return false;
  // Little-endian two's complement. Bytes beyond the eighth must only repeat the sign.
  const auto* p = reinterpret_cast<const uint8_t*>(in_.data() + pos_);
  size_t low = std::min<uint64_t>(n, 8);
  uint64_t v = 0;
  for (size_t i = 0; i < low; ++i) v |= uint64_t{p[i]} << (8 * i);
  bool negative = n > 0 && (p[n - 1] & 0x80);
  if (low > 0 && low < 8 && negative) v |= ~uint64_t{0} << (8 * low);
  for (size_t i = 8; i < n; ++i) {
    if (p[i] != (negative ? 0xff : 0x00)) return Err("integer wider than 64 bits");
  }
  if (n > 8 && (((v >> 63) != 0) != negative)) return Err("integer wider than 64 bits");
  pos_ += n;
  return Push(NewInt(static_cast<int64_t>(v)));
}

bool PickleMachine::OpString(PickleKind kind, size_t width_of_len) {
  uint64_t len = 0;
  if (!ReadLength(width_of_len, &len)) return false;
  uint64_t offset = pos_;
  pos_ += len;
  if (kind == PickleKind::kStr && !IsValidUtf8(in_.substr(offset, len))) {
    return Err("invalid UTF-8 in string");
  }
  return Push(NewString(kind, offset, len));
}

bool PickleMachine::OpTuple(size_t n) {
  if (stack_.size() - fence() < n) return Err("stack underflow");
  NodeId id = NewTuple(std::span(stack_).last(n));
  if (id == kNoNode) return false;
  stack_.resize(stack_.size() - n);
  return Push(id);
}

bool PickleMachine::OpTupleFromMark() {
  size_t mark = 0;
  if (!PopMark(&mark)) return false;
  NodeId id = NewTuple(std::span(stack_).subspan(mark));
  if (id == kNoNode) return false;
  stack_.resize(mark);
  return Push(id);
}

bool PickleMachine::OpAppend(bool many) {
  size_t first = 0;
  if (many) {
    if (!PopMark(&first)) return false;
  } else {
    if (stack_.size() <= fence()) return Err("stack underflow");
    first = stack_.size() - 1;
  }
  // The target sits just below the items and must itself be above the enclosing MARK.
  if (first <= fence()) return Err("stack underflow: nothing to append to");
  NodeId target = stack_[first - 1];
  return AddItems(target, first, /*dict_like=*/false);
}

bool PickleMachine::OpSetItem(bool many) {
  size_t first = 0;
  if (many) {
    if (!PopMark(&first)) return false;
  } else {
    if (stack_.size() < fence() + 2) return Err("stack underflow");
    first = stack_.size() - 2;
  }
  if ((stack_.size() - first) % 2 != 0) return Err("odd number of items for SETITEMS");
  if (first <= fence()) return Err("stack underflow: no dict to set items in");
  NodeId target = stack_[first - 1];
  return AddItems(target, first, /*dict_like=*/true);
}

// Moves stack_[first..] into `target`: a list (APPEND), a dict (SETITEM), or an object built
// by REDUCE/NEWOBJ (a list or dict subclass such as OrderedDict).
bool PickleMachine::AddItems(NodeId target, size_t first, bool dict_like) {
  Node& t = node(target);
  PickleKind want = dict_like ? PickleKind::kDict : PickleKind::kList;
  bool is_object = t.kind == PickleKind::kReduce || t.kind == PickleKind::kNewObj;
  if (t.kind != want && !is_object) {
    return Err(std::string(dict_like ? "SETITEM" : "APPEND") + " on a " +
               std::string(PickleKindName(t.kind)));
  }
  if (is_object) {
    uint8_t flag = dict_like ? kObjDictItems : kObjListItems;
    if (t.flags != 0 && t.flags != flag) return Err("object gets both list and dict items");
    t.flags = flag;
  }
  if (t.seq == kNoNode) {  // element storage is allocated on first use
    t.seq = static_cast<uint32_t>(tree_.seqs_.size());
    tree_.seqs_.emplace_back();
  }
  std::vector<NodeId>& seq = tree_.seqs_[node(target).seq];
  size_t add = stack_.size() - first;
  if (seq.size() + add > uint64_t{limits_.max_container_size} * (dict_like ? 2 : 1)) {
    return Err("container size limit exceeded");
  }
  for (size_t i = first; i < stack_.size(); ++i) {
    if (!RaiseDepth(target, stack_[i])) return false;
  }
  seq.insert(seq.end(), stack_.begin() + first, stack_.end());
  stack_.resize(first);
  return true;
}

bool PickleMachine::OpPut(uint64_t key) {
  NodeId top = kNoNode;
  if (!Top(&top)) return false;
  if (key < memo_.size()) {
    memo_[key] = top;
    return true;
  }
  if (memo_.size() + sparse_memo_.size() >= limits_.max_memo_entries) {
    return Err("memo entry limit exceeded");
  }
  if (key == memo_.size() && sparse_memo_.empty()) {
    memo_.push_back(top);
  } else {
    sparse_memo_[key] = top;
  }
  return true;
}

bool PickleMachine::OpGet(uint64_t key) {
  NodeId id = kNoNode;
  if (key < memo_.size()) {
    id = memo_[key];
  } else if (auto it = sparse_memo_.find(key); it != sparse_memo_.end()) {
    id = it->second;
  }
  if (id == kNoNode) return Err("memo key " + std::to_string(key) + " was never stored");
  return Push(id);
}

bool PickleMachine::OpCall(PickleKind kind) {
  NodeId args = kNoNode, callable = kNoNode;
  if (!Pop(&args) || !Pop(&callable)) return false;
  if (node(args).kind != PickleKind::kTuple) {
    return Err(std::string(kind == PickleKind::kReduce ? "REDUCE" : "NEWOBJ") +
               " arguments are not a tuple");
  }
  NodeId id = NewNode(kind, DepthOf({callable, args}));
  if (id == kNoNode) return false;
  node(id).u.ref = {callable, args};
  return Push(id);
}

bool PickleMachine::OpBuild() {
  NodeId state = kNoNode, target = kNoNode;
  if (!Pop(&state) || !Top(&target)) return false;
  Node& t = node(target);
  if (t.kind != PickleKind::kReduce && t.kind != PickleKind::kNewObj) {
    return Err("BUILD on a " + std::string(PickleKindName(t.kind)));
  }
  if (t.c != kNoNode) return Err("BUILD applied twice to one object");
  t.c = state;
  return RaiseDepth(target, state);
}

bool PickleMachine::OpGlobal(bool from_stack) {
  NodeId module = kNoNode, name = kNoNode;
  if (from_stack) {
    if (!Pop(&name) || !Pop(&module)) return false;
    if (node(module).kind != PickleKind::kStr || node(name).kind != PickleKind::kStr) {
      return Err("STACK_GLOBAL needs two strings");
    }
  } else {
    std::string_view m, n;
    if (!ReadLine(&m)) return false;
    uint64_t m_off = m.data() - in_.data();
    if (!ReadLine(&n)) return false;
    uint64_t n_off = n.data() - in_.data();
    if (!IsValidUtf8(m) || !IsValidUtf8(n)) return Err("invalid UTF-8 in GLOBAL");
    module = NewString(PickleKind::kStr, m_off, m.size());
    if (module == kNoNode) return false;
    name = NewString(PickleKind::kStr, n_off, n.size());
    if (name == kNoNode) return false;
  }
  if (node(module).len == 0 || node(name).len == 0) return Err("empty module or name in global");
  NodeId id = NewNode(PickleKind::kGlobal);
  if (id == kNoNode) return false;
  node(id).u.ref = {module, name};
  return Push(id);
}

NodeId PickleMachine::NewNode(PickleKind kind, uint32_t depth) {
  if (tree_.nodes_.size() >= limits_.max_nodes) return (Err("node limit exceeded"), kNoNode);
  if (depth > max_depth_) return (Err("nesting depth limit exceeded"), kNoNode);
  Node& n = tree_.nodes_.emplace_back();
  n.kind = kind;
  n.depth = static_cast<uint16_t>(depth);  // max_depth_ fits 16 bits
  return static_cast<NodeId>(tree_.nodes_.size() - 1);
}

NodeId PickleMachine::Shared(NodeId* slot, PickleKind kind, int64_t value) {
  if (*slot == kNoNode) {
    NodeId id = NewNode(kind);
    if (id == kNoNode) return kNoNode;
    node(id).u.i = value;
    *slot = id;
  }
  return *slot;
}

NodeId PickleMachine::NewInt(int64_t v) {
  if (v >= 0 && v < std::ssize(small_ints_)) return Shared(&small_ints_[v], PickleKind::kInt, v);
  NodeId id = NewNode(PickleKind::kInt);
  if (id != kNoNode) node(id).u.i = v;
  return id;
}

NodeId PickleMachine::NewString(PickleKind kind, uint64_t offset, uint64_t len) {
  if (len > 0xffffffffu) return (Err("string longer than 4 GiB"), kNoNode);
  NodeId id = NewNode(kind);
  if (id == kNoNode) return kNoNode;
  node(id).u.offset = offset;
  node(id).len = static_cast<uint32_t>(len);
  return id;
}

NodeId PickleMachine::NewTuple(std::span<const NodeId> elems) {
  if (elems.empty()) return Shared(&empty_tuple_, PickleKind::kTuple, 0);
  if (elems.size() > limits_.max_container_size) {
    return (Err("container size limit exceeded"), kNoNode);
  }
  uint32_t depth = 1;
  for (NodeId e : elems) depth = std::max<uint32_t>(depth, node(e).depth + 1u);
  NodeId id = NewNode(PickleKind::kTuple, depth);
  if (id == kNoNode) return kNoNode;
  node(id).u.offset = tree_.tuple_items_.size();
  node(id).len = static_cast<uint32_t>(elems.size());
  tree_.tuple_items_.insert(tree_.tuple_items_.end(), elems.begin(), elems.end());
  return id;
}

uint32_t PickleMachine::DepthOf(std::initializer_list<NodeId> ids) {
  uint32_t d = 1;
  for (NodeId id : ids) d = std::max<uint32_t>(d, node(id).depth + 1u);
  return d;
}

// Depth is tracked when a value is created or a child is added. Values mutated after being
// placed inside others (lists, dicts, BUILD) can make the graph deeper than recorded, which
// is why walkers must still bound their own recursion.
bool PickleMachine::RaiseDepth(NodeId parent, NodeId child) {
  uint32_t d = node(child).depth + 1u;
  if (d > max_depth_) return Err("nesting depth limit exceeded");
  Node& p = node(parent);
  p.depth = static_cast<uint16_t>(std::max<uint32_t>(p.depth, d));
  return true;
}

// ---------------------------------------------------------------------------------------------

std::string_view PickleKindName(PickleKind kind) {
  switch (kind) {
    case PickleKind::kNone:
      return "None";
    case PickleKind::kBool:
      return "bool";
    case PickleKind::kInt:
      return "int";
    case PickleKind::kFloat:
      return "float";
    case PickleKind::kStr:
      return "str";
    case PickleKind::kBytes:
      return "bytes";
    case PickleKind::kTuple:
      return "tuple";
    case PickleKind::kList:
      return "list";
    case PickleKind::kDict:
      return "dict";
    case PickleKind::kGlobal:
      return "global";
    case PickleKind::kReduce:
      return "reduce";
    case PickleKind::kNewObj:
      return "newobj";
    case PickleKind::kPersId:
      return "persid";
  }
  return "?";
}

PickleKind PickleTree::kind(NodeId id) const {
  return valid(id) ? nodes_[id].kind : PickleKind::kNone;
}

bool PickleTree::bool_value(NodeId id) const { return Is(id, PickleKind::kBool) && nodes_[id].u.i; }

int64_t PickleTree::int_value(NodeId id) const {
  return Is(id, PickleKind::kInt) ? nodes_[id].u.i : 0;
}

double PickleTree::float_value(NodeId id) const {
  return Is(id, PickleKind::kFloat) ? nodes_[id].u.f : 0.0;
}

std::string_view PickleTree::str(NodeId id) const {
  if (!Is(id, PickleKind::kStr) && !Is(id, PickleKind::kBytes)) return {};
  return input_.substr(nodes_[id].u.offset, nodes_[id].len);
}

std::span<const NodeId> PickleTree::items(NodeId id) const {
  if (Is(id, PickleKind::kTuple)) {
    return std::span(tuple_items_).subspan(nodes_[id].u.offset, nodes_[id].len);
  }
  if (!valid(id) || nodes_[id].seq == kNoNode) return {};
  return seqs_[nodes_[id].seq];
}

NodeId PickleTree::DictGet(NodeId dict, std::string_view key) const {
  if (!Is(dict, PickleKind::kDict)) return kNoNode;
  std::span<const NodeId> kv = items(dict);
  for (size_t i = 0; i + 1 < kv.size(); i += 2) {
    if (Is(kv[i], PickleKind::kStr) && str(kv[i]) == key) return kv[i + 1];
  }
  return kNoNode;
}

bool PickleTree::object_items_are_dict(NodeId id) const {
  return valid(id) && nodes_[id].flags == kObjDictItems;
}

std::string_view PickleTree::global_module(NodeId id) const {
  return Is(id, PickleKind::kGlobal) ? str(nodes_[id].u.ref.a) : std::string_view();
}

std::string_view PickleTree::global_name(NodeId id) const {
  return Is(id, PickleKind::kGlobal) ? str(nodes_[id].u.ref.b) : std::string_view();
}

bool PickleTree::IsGlobal(NodeId id, std::string_view module, std::string_view name) const {
  return Is(id, PickleKind::kGlobal) && global_module(id) == module && global_name(id) == name;
}

NodeId PickleTree::callable(NodeId id) const {
  return Is(id, PickleKind::kReduce) || Is(id, PickleKind::kNewObj) ? nodes_[id].u.ref.a : kNoNode;
}

NodeId PickleTree::args(NodeId id) const {
  return Is(id, PickleKind::kReduce) || Is(id, PickleKind::kNewObj) ? nodes_[id].u.ref.b : kNoNode;
}

NodeId PickleTree::state(NodeId id) const {
  return Is(id, PickleKind::kReduce) || Is(id, PickleKind::kNewObj) ? nodes_[id].c : kNoNode;
}

NodeId PickleTree::persid(NodeId id) const {
  return Is(id, PickleKind::kPersId) ? nodes_[id].c : kNoNode;
}

std::string PickleTree::DebugString(NodeId id, size_t max_chars) const {
  std::string out;
  DebugStringImpl(id, 0, &out, max_chars);
  if (out.size() > max_chars) {
    out.resize(max_chars);
    out += "...";
  }
  return out;
}

void PickleTree::DebugStringImpl(NodeId id, int depth, std::string* out, size_t max_chars) const {
  constexpr int kMaxDebugDepth = 32;
  if (out->size() > max_chars) return;
  if (!valid(id)) {
    *out += "<none>";
    return;
  }
  if (depth > kMaxDebugDepth) {
    *out += "...";
    return;
  }
  auto seq = [&](const char* open, const char* close, std::span<const NodeId> elems, bool kv) {
    *out += open;
    for (size_t i = 0; i < elems.size() && out->size() <= max_chars; ++i) {
      if (i > 0) *out += (kv && i % 2 == 1) ? ": " : ", ";
      DebugStringImpl(elems[i], depth + 1, out, max_chars);
    }
    *out += close;
  };
  switch (kind(id)) {
    case PickleKind::kNone:
      *out += "None";
      break;
    case PickleKind::kBool:
      *out += bool_value(id) ? "True" : "False";
      break;
    case PickleKind::kInt:
      *out += std::to_string(int_value(id));
      break;
    case PickleKind::kFloat:
      *out += std::to_string(float_value(id));
      break;
    case PickleKind::kStr:
      *out += "'" + std::string(str(id).substr(0, max_chars)) + "'";
      break;
    case PickleKind::kBytes:
      *out += "b<" + std::to_string(str(id).size()) + " bytes>";
      break;
    case PickleKind::kTuple:
      seq("(", items(id).size() == 1 ? ",)" : ")", items(id), false);
      break;
    case PickleKind::kList:
      seq("[", "]", items(id), false);
      break;
    case PickleKind::kDict:
      seq("{", "}", items(id), true);
      break;
    case PickleKind::kGlobal:
      *out += std::string(global_module(id)) + "." + std::string(global_name(id));
      break;
    case PickleKind::kReduce:
    case PickleKind::kNewObj:
      if (kind(id) == PickleKind::kNewObj) *out += "new ";
      DebugStringImpl(callable(id), depth + 1, out, max_chars);
      DebugStringImpl(args(id), depth + 1, out, max_chars);
      if (state(id) != kNoNode) {
        *out += "<-";
        DebugStringImpl(state(id), depth + 1, out, max_chars);
      }
      if (!items(id).empty()) seq("+[", "]", items(id), object_items_are_dict(id));
      break;
    case PickleKind::kPersId:
      *out += "persid";
      DebugStringImpl(persid(id), depth + 1, out, max_chars);
      break;
  }
}

Result<PickleTree> ParsePickle(std::string_view bytes, const PickleLimits& limits) {
  PickleMachine machine(bytes, limits);
  return machine.Run();
}

}  // namespace ckptfs::store
