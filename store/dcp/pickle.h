// A strict reader for Python pickles (protocols 2 to 5) that never executes anything.
//
// ParsePickle() runs the pickle virtual machine symbolically and returns a PickleTree: a
// generic value graph of None, bool, int, float, str, bytes, tuple, list, dict, global
// references, calls (REDUCE), object creations (NEWOBJ, with BUILD state) and persistent ids.
// Nothing is imported or called; interpreting classes is the caller's job (dcp_metadata.h,
// torch_zip.h), by module and name from their own allowlists.
//
// Supported opcodes are the ones DCP `.metadata` and torch.save `data.pkl` use (see
// DCP_FORMAT.md). Any other opcode is an error naming the opcode byte and its offset.
//
// Hostile input is expected: truncation, lengths past the end, bad memo references, stack
// underflow, MARK misuse, memo bombs and deep nesting all yield a Corrupt status (Unsupported
// for an unknown opcode or protocol), never a crash. Everything the parser allocates is
// bounded by PickleLimits: about 24 bytes per node, plus 4 bytes per container element,
// stack entry and memo entry.
//
// Shape of the result: memo references make the graph a DAG (a node may have several
// parents), immutable singletons (None, bools, ints 0..255, the empty tuple) are shared, and
// a hostile pickle can even build cycles (a list appended to itself). Code that walks a
// PickleTree must therefore bound its recursion; the interpreters in store/ only descend
// along fixed schema paths.
//
// Lifetime: str/bytes values are views into the parsed input, so the input buffer must
// outlive the PickleTree. A PickleTree is immutable after parsing and safe to read from
// several threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace ckptfs::store {

// Limits on what a pickle may make the parser allocate. Defaults fit a `.metadata` with
// a few million chunks; lower them for small inputs such as torch.save `data.pkl`.
struct PickleLimits {
  uint64_t max_input_bytes = 256ull << 20;
  // Nesting depth of any value (containers, calls, objects) and of open MARKs.
  uint32_t max_depth = 512;
  uint32_t max_memo_entries = 1u << 26;
  // Elements of one tuple/list, or key/value pairs of one dict.
  uint32_t max_container_size = 1u << 25;
  uint32_t max_nodes = 1u << 25;
  uint32_t max_stack = 1u << 25;
};

using NodeId = uint32_t;
inline constexpr NodeId kNoNode = 0xffffffffu;

enum class PickleKind : uint8_t {
  kNone,
  kBool,
  kInt,  // int64; wider integers are rejected
  kFloat,
  kStr,    // UTF-8 text (unicode opcodes)
  kBytes,  // bytes, bytearray and protocol-2 byte strings
  kTuple,
  kList,
  kDict,    // keys may be any value, objects included; order is insertion order
  kGlobal,  // a reference to module.name (GLOBAL, STACK_GLOBAL)
  kReduce,  // callable(*args) as REDUCE describes it
  kNewObj,  // cls.__new__(cls, *args) (NEWOBJ), plus BUILD state
  kPersId,  // a persistent id (BINPERSID), e.g. a torch storage reference
};

std::string_view PickleKindName(PickleKind kind);

// The value graph of one pickle. Accessors never abort: asked for something the node's kind
// does not have (or an invalid id), they return a neutral value (0, "", kNoNode, an empty
// span), so interpreters can probe an unexpected shape safely and check kind() to decide.
class PickleTree {
 public:
  NodeId root() const { return root_; }
  size_t node_count() const { return nodes_.size(); }
  int protocol() const { return protocol_; }
  bool valid(NodeId id) const { return id < nodes_.size(); }

  PickleKind kind(NodeId id) const;
  bool Is(NodeId id, PickleKind k) const { return valid(id) && nodes_[id].kind == k; }
  bool bool_value(NodeId id) const;
  int64_t int_value(NodeId id) const;
  double float_value(NodeId id) const;
  // kStr or kBytes payload.
  std::string_view str(NodeId id) const;

  // kTuple/kList: the elements. kDict: keys and values interleaved (k0, v0, k1, v1, ...).
  // kReduce/kNewObj: items added after creation by APPEND(S) (list-like) or SETITEM(S)
  // (dict-like, interleaved as for kDict); see object_items_are_dict().
  std::span<const NodeId> items(NodeId id) const;
  size_t dict_size(NodeId id) const { return Is(id, PickleKind::kDict) ? items(id).size() / 2 : 0; }
  // Value of the first dict entry whose key is the str `key`; kNoNode if absent.
  NodeId DictGet(NodeId dict, std::string_view key) const;
  bool object_items_are_dict(NodeId id) const;

  // kGlobal.
  std::string_view global_module(NodeId id) const;
  std::string_view global_name(NodeId id) const;
  // True if `id` is the global module.name.
  bool IsGlobal(NodeId id, std::string_view module, std::string_view name) const;

  // kReduce: the callable; kNewObj: the class.
  NodeId callable(NodeId id) const;
  // kReduce/kNewObj: the argument tuple.
  NodeId args(NodeId id) const;
  // kReduce/kNewObj: the BUILD state, kNoNode if none was applied.
  NodeId state(NodeId id) const;
  // kPersId: the persistent id value.
  NodeId persid(NodeId id) const;

  // A short, bounded, human-readable rendering for error messages and tests.
  std::string DebugString(NodeId id, size_t max_chars = 200) const;

 private:
  friend class PickleMachine;

  struct Node {
    PickleKind kind = PickleKind::kNone;
    uint8_t flags = 0;
    uint16_t depth = 1;
    uint32_t seq = kNoNode;  // lists, dicts, objects' added items: index into seqs_
    union {
      int64_t i;
      double f;
      uint64_t offset;  // kStr/kBytes: into input_; kTuple: into tuple_items_
      struct {
        NodeId a, b;  // global: module/name str nodes; reduce/newobj: callable/args
      } ref;
    } u{};
    uint32_t len = 0;    // kStr/kBytes: bytes; kTuple: elements
    NodeId c = kNoNode;  // reduce/newobj: state; persid: value
  };

  void DebugStringImpl(NodeId id, int depth, std::string* out, size_t max_chars) const;

  std::string_view input_;
  std::vector<Node> nodes_;
  std::vector<std::vector<NodeId>> seqs_;
  // Tuples are immutable, so their elements are stored back to back in one array.
  std::vector<NodeId> tuple_items_;
  NodeId root_ = kNoNode;
  int protocol_ = 0;
};

// Parses `bytes` (which must outlive the result) up to its STOP opcode. Trailing bytes after
// STOP are an error: a `.metadata` or `data.pkl` is exactly one pickle.
Result<PickleTree> ParsePickle(std::string_view bytes, const PickleLimits& limits = {});

}  // namespace ckptfs::store
