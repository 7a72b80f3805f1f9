// Ownership plan (store/peer/plan.h): determinism, balance, rendezvous stability, locality
// and edge cases.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <set>

#include "store/peer/plan.h"

namespace ckptfs::store::peer {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

std::vector<std::string> Nodes(uint32_t n) {
  std::vector<std::string> out;
  for (uint32_t i = 0; i < n; ++i) out.push_back("node" + std::to_string(i) + ":7070");
  return out;
}

OwnershipPlan Build(const std::vector<PlanItem>& items, const std::vector<std::string>& nodes,
                    PlanMode mode, uint64_t block = kMiB) {
  PlanOptions o;
  o.mode = mode;
  o.block_bytes = block;
  o.seed = "run1/iter_100";
  auto p = BuildPlan(items, nodes, o);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(p).value();
}

// A digest of everything a plan decides, to compare plans built separately.
uint64_t Digest(const OwnershipPlan& p, size_t items) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (size_t i = 0; i < items; ++i) mix(p.ItemOwner(i));
  for (uint64_t b : p.node_bytes()) mix(b);
  for (uint32_t n = 0; n < p.node_count(); ++n) {
    for (const OwnedBlock& b : p.BlocksOwnedBy(n)) {
      mix(b.file);
      mix(b.block);
    }
  }
  return h;
}

class PlanBothModes : public ::testing::TestWithParam<PlanMode> {};
INSTANTIATE_TEST_SUITE_P(Plan, PlanBothModes,
                         ::testing::Values(PlanMode::kBalanced, PlanMode::kFast),
                         [](const auto& info) { return std::string(PlanModeName(info.param)); });

TEST_P(PlanBothModes, SameInputsGiveTheSamePlanInThisAndAnotherProcess) {
  auto items = SyntheticPlanItems(20000, 8, 7);
  uint64_t here = Digest(Build(items, Nodes(8), GetParam()), items.size());
  EXPECT_EQ(here, Digest(Build(items, Nodes(8), GetParam()), items.size()));
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // A fresh process: its own heap layout and hash-table seeds.
    auto again = SyntheticPlanItems(20000, 8, 7);
    PlanOptions o;
    o.mode = GetParam();
    o.seed = "run1/iter_100";
    auto p = BuildPlan(again, Nodes(8), o);
    uint64_t d = p.ok() ? Digest(*p, again.size()) : 0;
    ssize_t w = ::write(fds[1], &d, sizeof(d));
    ::_exit(w == sizeof(d) ? 0 : 1);
  }
  ::close(fds[1]);
  uint64_t there = 0;
  ASSERT_EQ(::read(fds[0], &there, sizeof(there)), ssize_t(sizeof(there)));
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_EQ(here, there);
}

TEST_P(PlanBothModes, EveryTouchedBlockHasExactlyOneOwnerThatPrefetchesIt) {
  auto items = SyntheticPlanItems(3000, 5, 3);
  auto plan = Build(items, Nodes(5), GetParam());
  std::set<std::pair<uint32_t, uint64_t>> touched, listed;
  for (const auto& it : items) {
    if (it.length == 0) continue;
    uint32_t f =
        std::lower_bound(plan.files().begin(), plan.files().end(), it.file) - plan.files().begin();
    for (uint64_t b = it.offset / kMiB; b <= (it.offset + it.length - 1) / kMiB; ++b) {
      touched.insert({f, b});
    }
  }
  for (uint32_t n = 0; n < plan.node_count(); ++n) {
    for (const OwnedBlock& b : plan.BlocksOwnedBy(n)) {
      EXPECT_TRUE(listed.insert({b.file, b.block}).second) << "block listed twice";
      auto owner = plan.BlockOwner(plan.files()[b.file], b.block);
      ASSERT_TRUE(owner.ok());
      EXPECT_EQ(*owner, n);
    }
  }
  EXPECT_EQ(touched, listed);
}

TEST_P(PlanBothModes, NoItemsGivesAnEmptyPlan) {
  auto plan = Build({}, Nodes(3), GetParam());
  EXPECT_EQ(plan.Balance().total_bytes, 0u);
  EXPECT_EQ(plan.Balance().max_over_mean, 0.0);
  EXPECT_EQ(plan.BlockOwner("__0_0.distcp", 0).status().code(), Code::kNotFound);
  for (uint32_t n = 0; n < 3; ++n) EXPECT_TRUE(plan.BlocksOwnedBy(n).empty());
}

TEST_P(PlanBothModes, OneNodeOwnsEverything) {
  auto items = SyntheticPlanItems(500, 1, 1);
  auto plan = Build(items, Nodes(1), GetParam());
  for (size_t i = 0; i < items.size(); ++i) EXPECT_EQ(plan.ItemOwner(i), 0u);
  EXPECT_DOUBLE_EQ(plan.Balance().max_over_mean, 1.0);
}

TEST_P(PlanBothModes, SingleReaderItemsAreOwnedByTheirReader) {
  // Own-shard load: rank r reads only file __r_0.distcp.
  std::vector<PlanItem> items;
  for (uint32_t r = 0; r < 4; ++r) {
    for (uint64_t k = 0; k < 50; ++k) {
      items.push_back({"__" + std::to_string(r) + "_0.distcp", k * 3 * kMiB + 17, 3 * kMiB, {r}});
    }
  }
  auto plan = Build(items, Nodes(4), GetParam());
  for (size_t i = 0; i < items.size(); ++i) EXPECT_EQ(plan.ItemOwner(i), items[i].readers[0]);
  for (uint32_t r = 0; r < 4; ++r) {
    for (uint64_t b = 0; b < 150; ++b) {
      auto owner = plan.BlockOwner("__" + std::to_string(r) + "_0.distcp", b);
      ASSERT_TRUE(owner.ok());
      EXPECT_EQ(*owner, r) << "file " << r << " block " << b;
    }
  }
}

TEST_P(PlanBothModes, SeveralReadersKeepTheOwnerAmongThem) {
  // One item per 1000-byte block, so no block is shared by items with other readers.
  std::vector<PlanItem> items;
  for (uint32_t i = 0; i < 2000; ++i) {
    items.push_back({"__" + std::to_string(i % 7) + "_0.distcp",
                     uint64_t(i) * 1000,
                     1000 - i % 3,
                     {i % 6, (i + 2) % 6}});
  }
  auto plan = Build(items, Nodes(6), GetParam(), /*block=*/1000);
  for (size_t i = 0; i < items.size(); ++i) {
    uint32_t o = plan.ItemOwner(i);
    EXPECT_TRUE(o == items[i].readers[0] || o == items[i].readers[1]) << i;
  }
}

TEST_P(PlanBothModes, MoreNodesThanItems) {
  std::vector<PlanItem> items = {{"a", 0, 10 * kMiB, {}}, {"b", 0, 5 * kMiB, {}}};
  auto plan = Build(items, Nodes(16), GetParam());
  EXPECT_EQ(plan.Balance().total_bytes, 15 * kMiB);
  if (GetParam() == PlanMode::kBalanced) {
    // Cut into 1 MiB pieces (a block; a quarter of the mean share is less): 15 pieces,
    // one per node, the 16th node idle.
    EXPECT_NE(plan.ItemOwner(0), plan.ItemOwner(1));
    EXPECT_EQ(plan.Balance().max_node_bytes, kMiB);
  }
  uint32_t idle = 0;
  for (uint64_t b : plan.node_bytes()) idle += b == 0;
  EXPECT_GE(idle, 1u);
}

TEST_P(PlanBothModes, HugeItemsNearTheEndOfTheOffsetSpaceDoNotOverflow) {
  uint64_t big = 1ull << 40;  // 1 TiB
  std::vector<PlanItem> items = {
      {"a", 0, big, {}}, {"a", UINT64_MAX - big, big, {}}, {"b", 12345, 1, {}}};
  auto plan = Build(items, Nodes(3), GetParam(), 64 * kMiB);
  EXPECT_EQ(plan.Balance().total_bytes, 2 * big + 1);
  EXPECT_TRUE(plan.BlockOwner("a", (UINT64_MAX - 1) / (64 * kMiB)).ok());
  std::vector<PlanItem> overflow = {{"a", UINT64_MAX - 10, 11, {}}};
  EXPECT_EQ(BuildPlan(overflow, Nodes(2), {}).status().code(), Code::kInvalid);
}

TEST(PlanBalanced, LoadStaysWithinOneItemOfTheMean) {
  // Greedy largest-first bound: max load <= mean + the largest item.
  for (uint32_t nodes : {2u, 7u, 32u}) {
    auto items = SyntheticPlanItems(20000, nodes, nodes);
    auto plan = Build(items, Nodes(nodes), PlanMode::kBalanced);
    uint64_t largest = 0;
    for (const auto& it : items) largest = std::max(largest, it.length);
    PlanBalance b = plan.Balance();
    EXPECT_LE(double(b.max_node_bytes), b.mean_node_bytes + double(largest)) << nodes;
  }
}

TEST(PlanBalanced, LargeItemsAreCutIntoBlockAlignedPiecesAcrossNodes) {
  // Three 100 MiB items and a small one on 8 nodes, 1 MiB blocks: the mean share is about
  // 37.6 MiB, so pieces of at most ceil(37.6 / 4) = 10 MiB (whole blocks). Whole items would
  // leave 5 nodes idle and put 100 MiB on 3 of them.
  std::vector<PlanItem> items = {{"a", 0, 100 * kMiB, {}},
                                 {"a", 100 * kMiB + 12345, 100 * kMiB, {}},
                                 {"b", 7, 100 * kMiB, {}},
                                 {"b", 200 * kMiB, 1000, {}}};
  auto plan = Build(items, Nodes(8), PlanMode::kBalanced);
  PlanBalance b = plan.Balance();
  EXPECT_EQ(b.total_bytes, 300 * kMiB + 1000);
  EXPECT_LE(b.max_over_mean, 1.1) << b.max_node_bytes;
  for (uint64_t n : plan.node_bytes()) EXPECT_GT(n, 0u);
  // Every block has one owner, and a piece's edge inside an item falls on a block boundary:
  // the blocks of one item carry at most one owner change per piece (at most 11 pieces).
  for (const char* f : {"a", "b"}) {
    uint32_t changes = 0;
    auto prev = plan.BlockOwner(f, 0);
    ASSERT_TRUE(prev.ok());
    for (uint64_t blk = 1; blk < 100; ++blk) {
      auto o = plan.BlockOwner(f, blk);
      ASSERT_TRUE(o.ok()) << f << " " << blk;
      changes += *o != *prev;
      prev = o;
    }
    EXPECT_GE(changes, 9u) << f;
    EXPECT_LE(changes, 11u) << f;
  }
  // Items with readers stay whole, with their reader.
  items.push_back({"c", 0, 500 * kMiB, {3}});
  plan = Build(items, Nodes(8), PlanMode::kBalanced);
  for (uint64_t blk = 0; blk < 500; ++blk) EXPECT_EQ(*plan.BlockOwner("c", blk), 3u) << blk;
}

TEST(PlanBalanced, EqualItemsSpreadEvenlyWithTiesToTheLowestNode) {
  std::vector<PlanItem> items;
  for (int i = 0; i < 41; ++i) items.push_back({"f", uint64_t(i) * 100, 100, {}});
  auto plan = Build(items, Nodes(4), PlanMode::kBalanced, 1);
  // 41 equal items on 4 nodes (each under a quarter of the mean share: none is cut):
  // loads 11,10,10,10 in node order; item 0 on node 0.
  EXPECT_EQ(plan.node_bytes(), (std::vector<uint64_t>{1100, 1000, 1000, 1000}));
  EXPECT_EQ(plan.ItemOwner(0), 0u);
  EXPECT_EQ(plan.ItemOwner(1), 1u);
}

TEST(PlanBalanced, BlockOwnerFollowsTheItemAtTheBlockStart) {
  // Blocks of 100 bytes: items [0,150) [150,300) and, after a gap, [420,500). A large item
  // in another file keeps them far under a quarter of the mean share, so they stay whole.
  std::vector<PlanItem> items = {
      {"f", 0, 150, {}}, {"f", 150, 150, {}}, {"f", 420, 80, {}}, {"h", 0, 6000, {}}};
  auto plan = Build(items, Nodes(3), PlanMode::kBalanced, 100);
  EXPECT_EQ(*plan.BlockOwner("f", 0), plan.ItemOwner(0));
  EXPECT_EQ(*plan.BlockOwner("f", 1), plan.ItemOwner(0));  // starts inside item 0
  EXPECT_EQ(*plan.BlockOwner("f", 2), plan.ItemOwner(1));
  EXPECT_EQ(plan.BlockOwner("f", 3).status().code(), Code::kNotFound);  // [300,400): a gap
  EXPECT_EQ(*plan.BlockOwner("f", 4), plan.ItemOwner(2));  // gap, then item 2 starts inside
  EXPECT_EQ(plan.BlockOwner("f", 5).status().code(), Code::kNotFound);
  EXPECT_EQ(plan.BlockOwner("g", 0).status().code(), Code::kNotFound);
}

TEST(PlanFast, ManyBlocksSpreadEvenly) {
  auto items = SyntheticPlanItems(100000, 16, 5);
  for (auto& it : items) it.length = std::min<uint64_t>(it.length, 8 * kMiB);  // no giants
  auto plan = Build(items, Nodes(16), PlanMode::kFast);
  EXPECT_LT(plan.Balance().max_over_mean, 1.1);
}

TEST(PlanFast, RemovingANodeMovesOnlyItsBlocks) {
  auto items = SyntheticPlanItems(20000, 8, 11);
  auto nodes = Nodes(8);
  auto before = Build(items, nodes, PlanMode::kFast);
  const uint32_t gone = 3;
  std::vector<std::string> fewer = nodes;
  fewer.erase(fewer.begin() + gone);
  auto after = Build(items, fewer, PlanMode::kFast);
  std::map<uint32_t, uint64_t> moved_to;
  uint64_t kept = 0;
  for (uint32_t n = 0; n < 8; ++n) {
    for (const OwnedBlock& b : before.BlocksOwnedBy(n)) {
      uint32_t now = *after.BlockOwner(before.files()[b.file], b.block);
      std::string now_name = fewer[now];
      if (n == gone) {
        moved_to[now]++;
      } else {
        EXPECT_EQ(now_name, nodes[n]) << "a block of a surviving node moved";
        kept++;
      }
    }
  }
  EXPECT_GT(kept, 0u);
  EXPECT_EQ(moved_to.size(), 7u) << "the lost node's blocks spread over all survivors";
}

TEST(PlanFast, AddingANodeMovesBlocksOnlyToIt) {
  auto items = SyntheticPlanItems(5000, 4, 2);
  auto nodes = Nodes(4);
  auto before = Build(items, nodes, PlanMode::kFast);
  auto more = nodes;
  more.push_back("node-new:7070");
  auto after = Build(items, more, PlanMode::kFast);
  uint64_t to_new = 0;
  for (uint32_t n = 0; n < 4; ++n) {
    for (const OwnedBlock& b : before.BlocksOwnedBy(n)) {
      uint32_t now = *after.BlockOwner(before.files()[b.file], b.block);
      if (now == 4) {
        to_new++;
      } else {
        EXPECT_EQ(now, n);
      }
    }
  }
  EXPECT_GT(to_new, 0u);
}

TEST(PlanFast, OwnersArePinnedAcrossVersions) {
  // Daemons of different builds must agree: pin the hash owners of a fixed input. A change
  // here breaks mixed-version clusters and needs a protocol version bump.
  std::vector<PlanItem> items = {{"__0_0.distcp", 0, 8 * kMiB, {}}};
  auto plan = Build(items, Nodes(5), PlanMode::kFast);
  std::vector<uint32_t> owners;
  for (uint64_t b = 0; b < 8; ++b) owners.push_back(*plan.BlockOwner("__0_0.distcp", b));
  EXPECT_EQ(owners, (std::vector<uint32_t>{4, 0, 3, 1, 2, 3, 4, 0}));
}

TEST(PlanAuto, PicksFastAboveTheThreshold) {
  PlanOptions o;
  o.mode = PlanMode::kAuto;
  o.auto_fast_above_items = 10;
  auto ten = SyntheticPlanItems(10, 2, 1), eleven = SyntheticPlanItems(11, 2, 1);
  EXPECT_EQ(BuildPlan(ten, Nodes(2), o)->mode(), PlanMode::kBalanced);
  EXPECT_EQ(BuildPlan(eleven, Nodes(2), o)->mode(), PlanMode::kFast);
  EXPECT_EQ(BuildPlan(ten, Nodes(2), PlanOptions{})->mode(), PlanMode::kBalanced);
  o.auto_fast_max_nodes = 1;  // many nodes: fast's per-block cost grows with the node count
  EXPECT_EQ(BuildPlan(eleven, Nodes(2), o)->mode(), PlanMode::kBalanced);
}

TEST(Plan, BadInputsAreInvalid) {
  std::vector<PlanItem> items = {{"a", 0, 10, {}}};
  EXPECT_EQ(BuildPlan(items, {}, {}).status().code(), Code::kInvalid);
  std::vector<std::string> dup = {"n:1", "n:1"};
  EXPECT_EQ(BuildPlan(items, dup, {}).status().code(), Code::kInvalid);
  std::vector<std::string> empty_name = {""};
  EXPECT_EQ(BuildPlan(items, empty_name, {}).status().code(), Code::kInvalid);
  std::vector<PlanItem> bad_reader = {{"a", 0, 10, {2}}};
  EXPECT_EQ(BuildPlan(bad_reader, Nodes(2), {}).status().code(), Code::kInvalid);
  PlanOptions zero;
  zero.block_bytes = 0;
  EXPECT_EQ(BuildPlan(items, Nodes(2), zero).status().code(), Code::kInvalid);
  EXPECT_EQ(ParsePlanMode("greedy").status().code(), Code::kInvalid);
  EXPECT_EQ(*ParsePlanMode("auto"), PlanMode::kAuto);
}

TEST(Plan, ItemsComeFromDcpMetadataInOrder) {
  DcpMetadata md;
  DcpItem a;
  a.fqn = "w";
  a.file = "__0_0.distcp";
  a.offset = 0;
  a.length = 100;
  DcpItem b = a;
  b.fqn = "b";
  b.file = "__1_0.distcp";
  b.offset = 64;
  b.length = 7;
  md.items = {a, b};
  auto items = PlanItemsFromMetadata(md);
  ASSERT_EQ(items.size(), 2u);
  EXPECT_EQ(items[1].file, "__1_0.distcp");
  EXPECT_EQ(items[1].offset, 64u);
  EXPECT_EQ(items[1].length, 7u);
  EXPECT_TRUE(items[0].readers.empty());
}

}  // namespace
}  // namespace ckptfs::store::peer
