#include "store/peer/plan.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <queue>
#include <random>
#include <unordered_set>

namespace ckptfs::store::peer {

// splitmix64's finalizer: a bijective 64-bit mixer, so weights of distinct (node, block)
// pairs are independent enough for rendezvous hashing.
uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

namespace {

// One past the last byte of block `b`, saturating at 2^64 - 1.
uint64_t BlockEnd(uint64_t b, uint64_t bb) { return b * bb + std::min(bb, UINT64_MAX - b * bb); }

uint64_t BlockKey(uint64_t file_hash, uint64_t block) { return Mix(file_hash ^ Mix(block + 1)); }

}  // namespace

// Highest random weight among `candidates` (all nodes when empty); ties (64-bit, never in
// practice) to the lower index.
uint32_t Rendezvous(uint64_t key, const std::vector<uint64_t>& node_hash,
                    std::span<const uint32_t> candidates) {
  uint32_t best = 0;
  uint64_t best_w = 0;
  bool first = true;
  auto consider = [&](uint32_t n) {
    uint64_t w = Mix(key ^ node_hash[n]);
    if (first || w > best_w || (w == best_w && n < best)) {
      best = n;
      best_w = w;
      first = false;
    }
  };
  if (candidates.empty()) {
    for (uint32_t n = 0; n < node_hash.size(); ++n) consider(n);
  } else {
    for (uint32_t n : candidates) consider(n);
  }
  return best;
}

Result<PlanMode> ParsePlanMode(std::string_view name) {
  if (name == "balanced") return PlanMode::kBalanced;
  if (name == "fast") return PlanMode::kFast;
  if (name == "auto") return PlanMode::kAuto;
  return Invalid("plan mode '" + std::string(name) + "' is not balanced, fast or auto");
}

std::string_view PlanModeName(PlanMode mode) {
  switch (mode) {
    case PlanMode::kBalanced:
      return "balanced";
    case PlanMode::kFast:
      return "fast";
    case PlanMode::kAuto:
      return "auto";
  }
  return "?";
}

std::vector<PlanItem> PlanItemsFromMetadata(const DcpMetadata& metadata) {
  std::vector<PlanItem> items;
  items.reserve(metadata.items.size());
  for (const DcpItem& it : metadata.items) {
    items.push_back(PlanItem{it.file, it.offset, it.length, {}});
  }
  return items;
}

PlanBalance OwnershipPlan::Balance() const {
  PlanBalance b;
  for (uint64_t n : node_bytes_) {
    b.total_bytes += n;
    b.max_node_bytes = std::max(b.max_node_bytes, n);
  }
  if (!node_bytes_.empty()) b.mean_node_bytes = double(b.total_bytes) / node_bytes_.size();
  if (b.total_bytes > 0) b.max_over_mean = b.max_node_bytes / b.mean_node_bytes;
  return b;
}

uint32_t OwnershipPlan::HashOwner(uint32_t file, uint64_t block) const {
  return Rendezvous(BlockKey(file_hash_[file], block), node_hash_, {});
}

Result<uint32_t> OwnershipPlan::BlockOwner(std::string_view file, uint64_t block) const {
  auto it = file_index_.find(file);
  if (it == file_index_.end()) {
    return NotFound("plan: no item of the checkpoint is in file " + std::string(file));
  }
  uint32_t f = it->second;
  if (mode_ == PlanMode::kFast) {
    auto o = overrides_[f].find(block);
    return o != overrides_[f].end() ? o->second : HashOwner(f, block);
  }
  const std::vector<Span>& spans = spans_[f];
  if (block > UINT64_MAX / block_bytes_) return NotFound("plan: block index out of range");
  uint64_t start = block * block_bytes_;
  uint64_t end = BlockEnd(block, block_bytes_);
  // The first span reaching past `start` is where the running max of ends first exceeds it.
  auto first = std::upper_bound(spans.begin(), spans.end(), start,
                                [](uint64_t v, const Span& s) { return v < s.max_end; });
  if (first != spans.end() && first->offset < end) return first->owner;
  return NotFound("plan: no item touches block " + std::to_string(block) + " of " +
                  std::string(file));
}

std::vector<OwnedBlock> OwnershipPlan::BlocksOwnedBy(uint32_t node) const {
  return node < owned_.size() ? owned_[node] : std::vector<OwnedBlock>{};
}

Result<OwnershipPlan> BuildPlan(std::span<const PlanItem> items, std::span<const std::string> nodes,
                                const PlanOptions& options) {
  if (nodes.empty()) return Invalid("plan: the peer list is empty");
  if (options.block_bytes == 0) return Invalid("plan: block size 0");
  {
    std::unordered_set<std::string_view> seen;
    for (const std::string& n : nodes) {
      if (n.empty()) return Invalid("plan: empty node name");
      if (!seen.insert(n).second) return Invalid("plan: node " + n + " is listed twice");
    }
  }
  const uint32_t node_count = static_cast<uint32_t>(nodes.size());
  for (const PlanItem& it : items) {
    if (it.offset + it.length < it.offset) {
      return Invalid("plan: item of " + it.file + " at " + std::to_string(it.offset) +
                     " overflows");
    }
    for (uint32_t r : it.readers) {
      if (r >= node_count) {
        return Invalid("plan: reader " + std::to_string(r) + " of an item of " + it.file +
                       " is not in the peer list of " + std::to_string(node_count));
      }
    }
  }

  OwnershipPlan plan;
  plan.mode_ = options.mode;
  if (plan.mode_ == PlanMode::kAuto) {
    bool fast =
        items.size() > options.auto_fast_above_items && node_count <= options.auto_fast_max_nodes;
    plan.mode_ = fast ? PlanMode::kFast : PlanMode::kBalanced;
  }
  plan.block_bytes_ = options.block_bytes;
  plan.node_bytes_.assign(node_count, 0);
  plan.item_owner_.assign(items.size(), 0);
  plan.owned_.resize(node_count);

  // Files, sorted, so file indices are the same on every node whatever the input order.
  // Distinct names first (hashing), then a sort of those only: items far outnumber files.
  std::vector<uint32_t> item_file(items.size());
  {
    std::unordered_map<std::string_view, uint32_t> first_seen;
    std::vector<std::string_view> names;
    for (size_t i = 0; i < items.size(); ++i) {
      auto [it, inserted] = first_seen.try_emplace(items[i].file, uint32_t(names.size()));
      if (inserted) names.push_back(items[i].file);
      item_file[i] = it->second;
    }
    std::vector<uint32_t> by_name(names.size());
    std::iota(by_name.begin(), by_name.end(), 0u);
    std::sort(by_name.begin(), by_name.end(),
              [&](uint32_t a, uint32_t b) { return names[a] < names[b]; });
    std::vector<uint32_t> rank(names.size());
    for (uint32_t r = 0; r < by_name.size(); ++r) {
      rank[by_name[r]] = r;
      plan.files_.emplace_back(names[by_name[r]]);
    }
    for (uint32_t f = 0; f < plan.files_.size(); ++f) plan.file_index_[plan.files_[f]] = f;
    for (uint32_t& f : item_file) f = rank[f];
  }
  const uint64_t bb = options.block_bytes;
  auto last_block = [bb](const PlanItem& it) {
    return it.length == 0 ? it.offset / bb : (it.offset + it.length - 1) / bb;
  };

  if (plan.mode_ == PlanMode::kBalanced) {
    // Units to assign: whole items, except that an item any node may own and larger than
    // kPiecesPerNode pieces per node would allow is cut into block-aligned pieces of about
    // that size. Without the cut, a checkpoint with few large items (fewer than nodes, or
    // one huge embedding) leaves most nodes idle and one node reading far more than the
    // mean. Items with readers stay whole: they go to a reader.
    struct Unit {
      uint32_t item;
      uint64_t offset, length;
    };
    uint64_t free_bytes = 0;
    for (const PlanItem& it : items) {
      if (it.readers.empty()) free_bytes += it.length;
    }
    const uint64_t per_piece = free_bytes / (uint64_t{kPiecesPerNode} * node_count) + 1;
    const uint64_t piece = std::max<uint64_t>(bb, (per_piece + bb - 1) / bb * bb);
    std::vector<Unit> units;
    units.reserve(items.size());
    for (uint32_t i = 0; i < items.size(); ++i) {
      const PlanItem& it = items[i];
      if (!it.readers.empty() || it.length <= piece) {
        units.push_back({i, it.offset, it.length});
        continue;
      }
      // Cuts at block boundaries: the first at the item's first block boundary plus one
      // piece, then every piece, so no block but an item edge is shared by two pieces.
      const uint64_t end = it.offset + it.length;
      uint64_t at = it.offset;
      uint64_t cut = (it.offset + bb - 1) / bb * bb;  // no overflow: validated above
      while (end - cut > piece) {
        cut += piece;
        units.push_back({i, at, cut - at});
        at = cut;
      }
      units.push_back({i, at, end - at});
    }
    std::vector<uint32_t> order(units.size());
    std::iota(order.begin(), order.end(), 0u);
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      const Unit& x = units[a];
      const Unit& y = units[b];
      if (x.length != y.length) return x.length > y.length;
      if (item_file[x.item] != item_file[y.item]) return item_file[x.item] < item_file[y.item];
      if (x.offset != y.offset) return x.offset < y.offset;
      return a < b;
    });
    // Min-heap of (load, node) for units any node may own; its top may be stale after a
    // reader-restricted assignment, so entries are checked against the live load.
    using Entry = std::pair<uint64_t, uint32_t>;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
    for (uint32_t n = 0; n < node_count; ++n) heap.push({0, n});
    std::vector<uint32_t> unit_owner(units.size());
    for (uint32_t u : order) {
      const Unit& unit = units[u];
      const PlanItem& it = items[unit.item];
      uint32_t owner;
      if (it.readers.empty()) {
        while (heap.top().first != plan.node_bytes_[heap.top().second]) {
          uint32_t n = heap.top().second;
          heap.pop();
          heap.push({plan.node_bytes_[n], n});
        }
        owner = heap.top().second;
        heap.pop();
        heap.push({plan.node_bytes_[owner] + unit.length, owner});
      } else {
        owner = it.readers[0];
        for (uint32_t r : it.readers) {
          if (plan.node_bytes_[r] < plan.node_bytes_[owner] ||
              (plan.node_bytes_[r] == plan.node_bytes_[owner] && r < owner)) {
            owner = r;
          }
        }
      }
      unit_owner[u] = owner;
      if (unit.offset == it.offset) plan.item_owner_[unit.item] = owner;  // its first piece
      plan.node_bytes_[owner] += unit.length;
    }
    plan.spans_.resize(plan.files_.size());
    for (size_t u = 0; u < units.size(); ++u) {
      if (units[u].length == 0) continue;  // touches no block
      plan.spans_[item_file[units[u].item]].push_back(
          {units[u].offset, units[u].offset + units[u].length, unit_owner[u], 0});
    }
    for (auto& spans : plan.spans_) {
      // Ties keep input order (stable), so the first item is the same on every node.
      std::stable_sort(spans.begin(), spans.end(),
                       [](const auto& a, const auto& b) { return a.offset < b.offset; });
      uint64_t max_end = 0;
      for (auto& span : spans) span.max_end = max_end = std::max(max_end, span.end);
    }
    // Prefetch lists agree with BlockOwner: each block goes to the first span (in offset
    // order) that touches it, so a block straddling items of two owners is read once.
    for (uint32_t f = 0; f < plan.spans_.size(); ++f) {
      uint64_t next = 0;  // blocks below this one are claimed
      for (const auto& span : plan.spans_[f]) {
        uint64_t last = (span.end - 1) / bb;
        for (uint64_t b = std::max(next, span.offset / bb); b <= last; ++b) {
          plan.owned_[span.owner].push_back({f, b});
        }
        next = std::max(next, last + 1);
      }
    }
  } else {
    plan.node_hash_.resize(node_count);
    for (uint32_t n = 0; n < node_count; ++n) {
      plan.node_hash_[n] = XXH3_64bits(nodes[n].data(), nodes[n].size());
    }
    uint64_t seed = XXH3_64bits(options.seed.data(), options.seed.size());
    plan.file_hash_.resize(plan.files_.size());
    for (uint32_t f = 0; f < plan.files_.size(); ++f) {
      plan.file_hash_[f] = XXH3_64bits_withSeed(plan.files_[f].data(), plan.files_[f].size(), seed);
    }
    plan.overrides_.resize(plan.files_.size());
    for (size_t i = 0; i < items.size(); ++i) {
      const PlanItem& it = items[i];
      if (it.readers.empty() || it.length == 0) continue;
      uint32_t f = item_file[i];
      for (uint64_t b = it.offset / bb; b <= last_block(it); ++b) {
        plan.overrides_[f].try_emplace(
            b, Rendezvous(BlockKey(plan.file_hash_[f], b), plan.node_hash_, it.readers));
      }
    }
    // Items grouped by file (counting sort, input order within a file): DCP writes a file's
    // items at rising offsets, so each node's block list comes out sorted without a sort.
    std::vector<uint32_t> by_file(items.size()), file_start(plan.files_.size() + 1, 0);
    for (uint32_t f : item_file) file_start[f + 1]++;
    for (size_t f = 0; f < plan.files_.size(); ++f) file_start[f + 1] += file_start[f];
    {
      std::vector<uint32_t> fill(file_start.begin(), file_start.end() - 1);
      for (uint32_t i = 0; i < items.size(); ++i) by_file[fill[item_file[i]]++] = i;
    }
    for (uint32_t i : by_file) {
      const PlanItem& it = items[i];
      uint32_t f = item_file[i];
      const auto& over = plan.overrides_[f];
      uint64_t first = it.offset / bb;
      if (it.length == 0) {
        auto o = over.find(first);
        plan.item_owner_[i] = o != over.end() ? o->second : plan.HashOwner(f, first);
        continue;
      }
      for (uint64_t b = first; b <= last_block(it); ++b) {
        auto o = over.empty() ? over.end() : over.find(b);
        uint32_t owner = o != over.end() ? o->second : plan.HashOwner(f, b);
        uint64_t lo = std::max(it.offset, b * bb);
        uint64_t hi = std::min(it.offset + it.length, BlockEnd(b, bb));
        plan.node_bytes_[owner] += hi - lo;
        if (b == first) plan.item_owner_[i] = owner;
        auto& list = plan.owned_[owner];
        if (list.empty() || !(list.back() == OwnedBlock{f, b})) list.push_back({f, b});
      }
    }
  }
  for (auto& blocks : plan.owned_) {
    if (std::is_sorted(blocks.begin(), blocks.end(), [](const OwnedBlock& a, const OwnedBlock& b) {
          return a.file != b.file ? a.file < b.file : a.block < b.block;
        })) {
      continue;  // balanced lists come out sorted and distinct
    }
    std::sort(blocks.begin(), blocks.end(), [](const OwnedBlock& a, const OwnedBlock& b) {
      return a.file != b.file ? a.file < b.file : a.block < b.block;
    });
    blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  }
  return plan;
}

std::vector<PlanItem> SyntheticPlanItems(uint64_t items, uint32_t nodes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(std::log(1024.0), std::log(16.0 * (1 << 20)));
  uint64_t files = std::max<uint64_t>(1, uint64_t(nodes) * 8);
  std::vector<uint64_t> file_end(files, 0);
  std::vector<PlanItem> out;
  out.reserve(items);
  for (uint64_t i = 0; i < items; ++i) {
    uint64_t f = i % files;
    uint64_t len = (rng() % 20000 == 0) ? (1ull << 30) : uint64_t(std::exp(log_size(rng)));
    out.push_back(PlanItem{"__" + std::to_string(f) + "_0.distcp", file_end[f], len, {}});
    file_end[f] += len;
  }
  return out;
}

}  // namespace ckptfs::store::peer
