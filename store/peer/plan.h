// Ownership plan: which node owns (reads from the backing store once, and serves to every
// other node) each block of a committed checkpoint.
//
// Every daemon builds the plan from the same inputs (the checkpoint's parsed `.metadata`
// and the peer list, in the same order) and gets the same answer, with no communication:
// the result depends only on the inputs, never on timing, addresses or hash-table order.
//
// Two modes (`--plan`, env CKPTFS_PLAN):
//   balanced  Items, largest first, each to the least-loaded eligible node; ties go to
//             the lowest node index, and equal items are ordered by (file, offset, input
//             index). This is Megatron's distribute_shards_to_ranks, with one change: an
//             item any node may own that is larger than 1/kPiecesPerNode of a node's mean
//             share is cut at block boundaries into pieces of about that size, each placed
//             as an item. Whole items left most nodes idle when a checkpoint has fewer
//             large items than nodes (max/mean 6.1 at 1000 nodes and 100k items, one in
//             20,000 items 1 GiB); greedy largest-first keeps max <= mean + the largest
//             unit. It costs a sort of all items and pieces (at most items +
//             kPiecesPerNode x nodes + one per cut item).
//   fast      Rendezvous (highest-random-weight) hashing of block ids (file, offset /
//             block_bytes) to node names: each block goes independently, so a block's
//             owner can also be computed on demand with no table, and removing a node moves
//             only the blocks that node owned. An item is split at block boundaries.
//   auto      fast when there are more than `auto_fast_above_items` items and at most
//             `auto_fast_max_nodes` nodes, else balanced. Measured (scripts/bench/
//             bench_plan.py, docs/PEERS.md): balanced costs O(items log items), fast
//             O(blocks x nodes); on 16 nodes fast plans ~1.7x faster from 200k items up, on
//             64 nodes they tie at 1M items, on 128 nodes balanced is faster. Both stay
//             under 0.5 s at 1M items, so `auto` only matters for very large checkpoints.
//
// Locality. A PlanItem may name the nodes known to read it (`readers`). Its owner is then
// chosen among those readers only, by the same rule (least-loaded reader; highest weight
// among readers). So an item that a single node reads, as in an own-shard load, is owned by
// that reader and its bytes never cross the network. In fast mode a block touched by items
// with readers takes its owner from the first such item in input order, so every piece of
// a block has one owner.
//
// BlockOwner() answers for blocks of `block_bytes`: in balanced mode the owner of the first
// item or piece, in file-offset order, that touches the block (DCP items of a file do not overlap,
// so this is the item holding the block's first byte, or the first item starting inside
// the block when that byte is in a gap); in fast mode the block's hash owner.
//
// Thread-safe after construction: OwnershipPlan is immutable.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "store/dcp/dcp_metadata.h"

namespace ckptfs::store::peer {

enum class PlanMode { kBalanced, kFast, kAuto };
Result<PlanMode> ParsePlanMode(std::string_view name);  // "balanced", "fast", "auto"
std::string_view PlanModeName(PlanMode mode);

// `auto` plans in fast mode above this many items, on at most kAutoFastMaxNodes nodes.
// Measured by scripts/bench/bench_plan.py (docs/PEERS.md has the table).
inline constexpr size_t kAutoFastAboveItems = 200000;
// Balanced mode cuts an item larger than (bytes any node may own) / (kPiecesPerNode x
// nodes), rounded up to whole blocks, into pieces of that size.
inline constexpr uint32_t kPiecesPerNode = 4;
inline constexpr uint32_t kAutoFastMaxNodes = 48;

// Rendezvous hashing, shared by fast plans and CooperativeSource's stand-ins. Mix is
// splitmix64's finalizer; Rendezvous returns the node of highest weight Mix(key ^
// node_hash[n]) among `candidates` (all nodes when empty), ties to the lower index.
uint64_t Mix(uint64_t x);
uint32_t Rendezvous(uint64_t key, const std::vector<uint64_t>& node_hash,
                    std::span<const uint32_t> candidates);

struct PlanItem {
  std::string file;  // relative to the checkpoint directory, e.g. "__0_0.distcp"
  uint64_t offset = 0;
  uint64_t length = 0;
  // Indices (into the node list) of the nodes known to read this item; empty: unknown.
  std::vector<uint32_t> readers;
};

// One item per DcpItem, in metadata order, with no readers.
std::vector<PlanItem> PlanItemsFromMetadata(const DcpMetadata& metadata);

struct PlanOptions {
  PlanMode mode = PlanMode::kAuto;
  uint64_t block_bytes = 1ull << 20;  // block size of BlockOwner and of fast mode's hashing
  size_t auto_fast_above_items = kAutoFastAboveItems;
  uint32_t auto_fast_max_nodes = kAutoFastMaxNodes;
  // Mixed into every fast-mode hash (e.g. the checkpoint's path), so that checkpoints with
  // equal file names spread differently. Every daemon must pass the same value.
  std::string seed;
};

struct PlanBalance {
  uint64_t total_bytes = 0;
  uint64_t max_node_bytes = 0;
  double mean_node_bytes = 0;
  double max_over_mean = 0;  // 1.0 is perfect; 0 when there are no bytes
};

struct OwnedBlock {
  uint32_t file = 0;  // index into OwnershipPlan::files()
  uint64_t block = 0;
  bool operator==(const OwnedBlock&) const = default;
};

class OwnershipPlan {
 public:
  PlanMode mode() const { return mode_; }  // balanced or fast, never auto
  uint32_t node_count() const { return static_cast<uint32_t>(node_bytes_.size()); }
  uint64_t block_bytes() const { return block_bytes_; }
  // Bytes of items owned by each node.
  const std::vector<uint64_t>& node_bytes() const { return node_bytes_; }
  PlanBalance Balance() const;
  // Distinct files of the items, sorted.
  const std::vector<std::string>& files() const { return files_; }

  // The node that owns block `block` of `file`. NotFound for a file without items, or a
  // block of it that no item touches (balanced).
  Result<uint32_t> BlockOwner(std::string_view file, uint64_t block) const;
  // The blocks touched by items (or pieces) that `node` owns, sorted by (file, block),
  // each once: what that node prefetches when a load starts.
  std::vector<OwnedBlock> BlocksOwnedBy(uint32_t node) const;
  // Owner of input item `i` (balanced: of its first piece); of the item's first block (fast).
  uint32_t ItemOwner(size_t i) const { return item_owner_[i]; }

 private:
  friend Result<OwnershipPlan> BuildPlan(std::span<const PlanItem>, std::span<const std::string>,
                                         const PlanOptions&);
  struct Span {
    uint64_t offset, end;
    uint32_t owner;
    uint64_t max_end;  // max `end` of this and every earlier span of the file
  };
  uint32_t HashOwner(uint32_t file, uint64_t block) const;

  PlanMode mode_ = PlanMode::kBalanced;
  uint64_t block_bytes_ = 1;
  std::vector<std::string> files_;
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, uint32_t, StringHash, std::equal_to<>> file_index_;
  std::vector<uint64_t> node_bytes_;
  std::vector<uint32_t> item_owner_;
  std::vector<uint64_t> node_hash_;       // fast: per node name
  std::vector<uint64_t> file_hash_;       // fast: per file, seeded
  std::vector<std::vector<Span>> spans_;  // balanced: per file, items sorted by offset
  // fast: blocks whose owner comes from a reader set, per file (block -> owner)
  std::vector<std::unordered_map<uint64_t, uint32_t>> overrides_;
  std::vector<std::vector<OwnedBlock>> owned_;  // per node
};

// `nodes`: the peer list (distinct, non-empty names such as "host:port"), the same on every
// daemon. Invalid for no nodes, duplicate names, readers out of range, a zero block size,
// or an item whose offset + length overflows.
Result<OwnershipPlan> BuildPlan(std::span<const PlanItem> items, std::span<const std::string> nodes,
                                const PlanOptions& options);

// A made-up checkpoint for benchmarks: `items` items over 8 files per node, sizes
// log-uniform from 1 KiB to 16 MiB with rare (1 in 20,000) 1 GiB items, laid out back to back per
// file.
std::vector<PlanItem> SyntheticPlanItems(uint64_t items, uint32_t nodes, uint64_t seed);

}  // namespace ckptfs::store::peer
