// Fuzzes the pickle reader: any input must parse or fail cleanly, and a parsed graph
// (which may share nodes or contain cycles) must be safe to walk with the tree's accessors.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "store/dcp/pickle.h"

namespace {

using ckptfs::store::NodeId;
using ckptfs::store::PickleKind;
using ckptfs::store::PickleTree;

// Touches every accessor of every node; never recurses, so cycles are harmless.
void TouchAll(const PickleTree& t) {
  size_t sum = 0;
  for (NodeId id = 0; id < t.node_count(); ++id) {
    sum += static_cast<size_t>(t.kind(id));
    sum += t.str(id).size() + t.items(id).size() + t.dict_size(id);
    sum += static_cast<size_t>(t.int_value(id)) + t.bool_value(id);
    sum += t.global_module(id).size() + t.global_name(id).size();
    sum += t.callable(id) + t.args(id) + t.state(id) + t.persid(id);
    if (t.Is(id, PickleKind::kDict)) sum += t.DictGet(id, "state_dict_metadata");
  }
  volatile size_t sink = sum;
  (void)sink;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ckptfs::store::PickleLimits limits;
  limits.max_input_bytes = 1 << 20;
  limits.max_nodes = 1 << 20;
  auto tree = ckptfs::store::ParsePickle(
      std::string_view(reinterpret_cast<const char*>(data), size), limits);
  if (tree.ok()) {
    TouchAll(*tree);
    (void)tree->DebugString(tree->root(), 4096);
  }
  return 0;
}
