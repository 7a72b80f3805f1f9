// MemoryReplicator (issue 42) between two nodes in this process over real UCX on 127.0.0.1
// (UCX_TLS=tcp, UCX_NET_DEVICES=lo): each node is a MemoryTier, a PeerServer answering
// `.ckptfs-memory/` requests from its replicator, and PeerLinks. A memory-only checkpoint
// commits once the other node holds it; a "restarted" writer (a new tier and replicator, the
// same state dir) gets it and its tracker back exactly; with the holder's copies gone too, the
// restarted writer reports it lost and serves nothing of it. Real torch 1.13 files.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "store/memory/memory_tier.h"
#include "store/peer/memory_replica.h"
#include "store/peer/memory_wire.h"
#include "store/peer/peer_links.h"
#include "store/peer/peer_server.h"

namespace ckptfs::store::peer {
namespace {

using namespace std::chrono_literals;

const bool kUcxEnv = [] {
  ::setenv("UCX_TLS", "tcp", 1);
  ::setenv("UCX_NET_DEVICES", "lo", 1);
  return true;
}();

constexpr char kSecret[] = "correct horse battery staple 42";
constexpr uint64_t kBlock = 64 << 10;
const std::filesystem::path kFixture =
    std::filesystem::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp/torch113_basic_single_file";

std::string ReadFixture(const std::string& name) {
  std::ifstream f(kFixture / name, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// What a node's PeerServer reads through: its replicator, once it has one.
class Forward : public BlockSource {
 public:
  Result<BlockRead> ReadBlock(const BlockId& id, uint64_t offset, std::span<char> out) override {
    MemoryReplicator* r = replicator.load();
    if (r == nullptr) return Status(Code::kNoSpace, "no memory-only checkpoints here");
    return r->Serve(id, offset, out);
  }
  std::atomic<MemoryReplicator*> replicator{nullptr};
};

struct Node {
  Forward forward;
  std::unique_ptr<PeerServer> server;
  std::unique_ptr<PeerLinks> links;
  std::unique_ptr<MemoryTier> tier;
  std::unique_ptr<MemoryReplicator> replicator;
  std::string address;
};

class MemoryReplicaTest : public ::testing::Test {
 protected:
  void SetUp() override { Init(); }

  void Init() {
    state_dir_ =
        std::filesystem::temp_directory_path() / ("ckptfs-memrepl-" + std::to_string(::getpid()));
    std::filesystem::remove_all(state_dir_);
    std::filesystem::create_directories(state_dir_);
    for (Node& n : nodes_) {
      PeerServerOptions so;
      so.listen = "127.0.0.1:0";
      so.node_id = "node";
      so.secret = kSecret;
      so.allowed_peers = {"127.0.0.1:1"};
      auto s = PeerServer::Create(so, &n.forward);
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      n.server = std::move(s).value();
      n.address = "127.0.0.1:" + std::to_string(n.server->port());
    }
    const std::vector<std::string> all = {nodes_[0].address, nodes_[1].address};
    for (uint32_t i = 0; i < 2; ++i) {
      ASSERT_TRUE(nodes_[i].server->SetAllowedPeers(all).ok());
      PeerLinksOptions o;
      o.nodes = all;
      o.self = i;
      o.secret = kSecret;
      o.connect_timeout = 2s;
      o.request_timeout = 2s;
      o.down_backoff = 100ms;
      o.max_down_backoff = 200ms;
      auto l = PeerLinks::Create(o);
      ASSERT_TRUE(l.ok()) << l.status().ToString();
      nodes_[i].links = std::move(l).value();
      Start(i, i == 0 ? state_dir_.string() : "");
    }
  }

  void TearDown() override {
    for (Node& n : nodes_) Stop(n);
    for (Node& n : nodes_) n.server.reset();
    std::filesystem::remove_all(state_dir_);
  }

  // Node i's daemon (re)starts: a fresh tier and replicator (which restores).
  void Start(uint32_t i, const std::string& state_dir) {
    Node& n = nodes_[i];
    Stop(n);
    MemoryTierOptions to;
    to.budget_bytes = 64 * kBlock;
    to.block_bytes = kBlock;
    n.tier = std::make_unique<MemoryTier>(to);
    MemoryReplicatorOptions mo;
    mo.self = i;
    mo.nodes = 2;
    mo.block_bytes = kBlock;
    mo.state_dir = state_dir;
    mo.poll = 10ms;
    mo.hand_over_wait = 2s;
    mo.verify_interval = verify_interval_;
    auto r = MemoryReplicator::Create(mo, n.tier.get(), n.links.get());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    n.replicator = std::move(r).value();
    n.forward.replicator.store(n.replicator.get());
  }

  static void Stop(Node& n) {
    n.forward.replicator.store(nullptr);
    if (n.replicator) n.replicator->Stop();
    n.replicator.reset();
    if (n.tier) n.tier->DropAll();
    n.tier.reset();
  }

  static Status Put(MemoryTier* t, uint64_t dir, const std::string& name,
                    const std::string& bytes) {
    auto f = t->Create(dir, name, 0644, 0, 0, false);
    if (!f.ok()) return f.status();
    size_t at = 0;
    Status st = t->Write(f->id, 0, bytes.size(), [&](char* out, size_t k) {
      std::memcpy(out, bytes.data() + at, k);
      at += k;
      return Status::Ok();
    });
    t->Closed(f->id);
    return st;
  }

  static MemCheckpoint Listed(MemoryTier* t, const std::string& path) {
    for (const MemCheckpoint& c : t->Checkpoints()) {
      if (c.path == path) return c;
    }
    return {};
  }

  template <typename Cond>
  static bool Eventually(Cond cond) {
    for (int i = 0; i < 500; ++i) {
      if (cond()) return true;
      std::this_thread::sleep_for(10ms);
    }
    return false;
  }

  std::filesystem::path state_dir_;
  // No check before the test asks for one: what a restart finds is what the test made.
  std::chrono::milliseconds verify_interval_{3600s};
  Node nodes_[2];
};

// A unit record from a peer whose numbers are floats, negative or out of range is refused
// with an error, never converted (nlohmann's conversion of 6.6e21 to uint64_t is undefined
// behaviour: wire_fuzz found it in a "seq" within seconds).
TEST(MemoryWire, UnitNumbersOutOfRangeAreRefused) {
  auto unit = [](const std::string& seq, const std::string& size, const std::string& crc) {
    return wire::UnitFromJson(nlohmann::json::parse(
        R"({"checkpoint":true,"path":"x6162","tree":"x61","seq":)" + seq +
        R"(,"files":[{"name":"x6162","size":)" + size + R"(,"crc32c":)" + crc + "}]}"));
  };
  ASSERT_TRUE(unit("7", "1048576", "4294967295").ok());
  EXPECT_EQ(unit("7", "1048576", "4294967295")->files[0].crc32c, 4294967295u);
  for (const auto& [seq, size, crc] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"6621764400000123456789", "1", "1"},  // a double past uint64_t
           {"7.5", "1", "1"},
           {"-1", "1", "1"},
           {"7", "-4096", "1"},
           {"7", "1e30", "1"},
           {"7", "1", "4294967296"},  // past uint32_t
           {"7", "1", "\"1\""}}) {
    auto u = unit(seq, size, crc);
    EXPECT_FALSE(u.ok()) << seq << " " << size << " " << crc;
    if (!u.ok()) EXPECT_EQ(u.status().code(), Code::kInvalid) << u.status().ToString();
  }
}

TEST_F(MemoryReplicaTest, CommittedOnceThePeerHoldsItBackAfterARestartLostWithTheHolder) {
  MemoryTier* a = nodes_[0].tier.get();
  const uint64_t root = a->TreeRoot(42, "run/mem");
  auto d = a->Mkdir(root, "step1", 0755, 0, 0);
  ASSERT_TRUE(d.ok());
  const std::string shard = ReadFixture("__0_0.distcp"), md = ReadFixture(".metadata");
  ASSERT_TRUE(Put(a, d->id, "__0_0.distcp", shard).ok());
  ASSERT_TRUE(Put(a, d->id, ".metadata", md).ok());
  ASSERT_TRUE(Eventually([&] { return Listed(a, "run/mem/step1").state == "committed"; }))
      << Listed(a, "run/mem/step1").state;
  EXPECT_EQ(Listed(a, "run/mem/step1").holder, nodes_[1].address);
  ASSERT_TRUE(Put(a, root, "latest", "step1").ok());
  nlohmann::json held;
  ASSERT_TRUE(Eventually([&] {
    held = nlohmann::json::object();
    nodes_[1].replicator->AppendJson(&held);
    return held["memory_replication"]["pulled_units"] == 2;
  })) << held.dump();
  EXPECT_EQ(held["memory_replication"]["replicas"]["held_bytes"], shard.size() + md.size() + 5);
  EXPECT_TRUE(std::filesystem::exists(state_dir_ / "memory_checkpoints.json"));

  // The writer restarts: its trees wait for the restore, then serve it exactly.
  Start(0, state_dir_.string());
  a = nodes_[0].tier.get();
  a->restore_gate().Wait(10s);
  const uint64_t root2 = a->TreeRoot(77, "run/mem");
  auto d2 = a->Lookup(root2, "step1");
  ASSERT_TRUE(d2.ok()) << d2.status().ToString();
  auto f = a->Lookup(d2->id, "__0_0.distcp");
  ASSERT_TRUE(f.ok());
  std::string got(f->size, '\0');
  ASSERT_TRUE(a->Read(f->id, got.data(), got.size(), 0).ok());
  EXPECT_EQ(got, shard);
  auto t = a->Lookup(root2, "latest");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(Listed(a, "run/mem/step1").state, "committed");
  EXPECT_EQ(Listed(a, "run/mem/step1").holder, nodes_[1].address);
  EXPECT_EQ(a->Stats().restored_checkpoints, 1u);
  EXPECT_EQ(a->Stats().lost_checkpoints, 0u);

  // The holder restarts empty, and the writer right after it, before any check could hand
  // the checkpoint over again: lost, nothing of it served, its tracker gone with it.
  Start(1, "");
  Start(0, state_dir_.string());
  a = nodes_[0].tier.get();
  a->restore_gate().Wait(10s);
  const uint64_t root3 = a->TreeRoot(78, "run/mem");
  EXPECT_EQ(a->Lookup(root3, "step1").status().code(), Code::kNotFound);
  EXPECT_EQ(a->Lookup(root3, "latest").status().code(), Code::kNotFound);
  EXPECT_EQ(Listed(a, "run/mem/step1").state, "lost");
  EXPECT_EQ(a->Stats().lost_checkpoints, 1u);
}

class MemoryReplicaCheckTest : public MemoryReplicaTest {
 protected:
  void SetUp() override {
    verify_interval_ = 50ms;
    Init();
  }
};

TEST_F(MemoryReplicaCheckTest, AHolderThatRestartedEmptyIsHandedTheCommittedCheckpointAgain) {
  MemoryTier* a = nodes_[0].tier.get();
  const uint64_t root = a->TreeRoot(42, "run/mem");
  auto d = a->Mkdir(root, "step1", 0755, 0, 0);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(Put(a, d->id, "__0_0.distcp", ReadFixture("__0_0.distcp")).ok());
  ASSERT_TRUE(Put(a, d->id, ".metadata", ReadFixture(".metadata")).ok());
  ASSERT_TRUE(Eventually([&] { return Listed(a, "run/mem/step1").state == "committed"; }));
  Start(1, "");  // the holder's copy is gone
  nlohmann::json held;
  ASSERT_TRUE(Eventually([&] {
    held = nlohmann::json::object();
    nodes_[1].replicator->AppendJson(&held);
    return held["memory_replication"]["pulled_units"] == 1;
  })) << held.dump();
  EXPECT_EQ(Listed(a, "run/mem/step1").holder, nodes_[1].address);
}

TEST_F(MemoryReplicaCheckTest, ACheckpointNoNodeTookCommitsOnceANodeTakesIt) {
  Stop(nodes_[1]);  // node 1 keeps no memory-only checkpoints now: it refuses (kNoSpace)
  MemoryTier* a = nodes_[0].tier.get();
  const uint64_t root = a->TreeRoot(42, "run/mem");
  auto d = a->Mkdir(root, "step1", 0755, 0, 0);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(Put(a, d->id, "__0_0.distcp", ReadFixture("__0_0.distcp")).ok());
  ASSERT_TRUE(Put(a, d->id, ".metadata", ReadFixture(".metadata")).ok());
  ASSERT_TRUE(Eventually([&] { return Listed(a, "run/mem/step1").state == "unreplicated"; }))
      << Listed(a, "run/mem/step1").state;
  Start(1, "");
  ASSERT_TRUE(Eventually([&] { return Listed(a, "run/mem/step1").state == "committed"; }))
      << Listed(a, "run/mem/step1").state;
  EXPECT_EQ(Listed(a, "run/mem/step1").holder, nodes_[1].address);
}

// Issue 42, checkpoints written through several nodes (memory_gather.cc): two trees, each
// saved by 4 ranks over both nodes, node 0 the coordinator of one and node 1 of the other,
// both `.metadata`s at once. Each node gathers while the other waits for its part, which its
// own queue hands over meanwhile: both commit on both nodes (G10: no gather waits on the
// other's), and every file reads back exactly through either node.
TEST_F(MemoryReplicaTest, TwoNodesGatheringAtOnceEachHandTheirPartToTheOther) {
  const std::filesystem::path four =
      std::filesystem::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp/torch113_4rank_single_file";
  auto read = [&](const std::string& name) {
    std::ifstream f(four / name, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  MemoryTier* t[2] = {nodes_[0].tier.get(), nodes_[1].tier.get()};
  const char* trees[2] = {"run/a", "run/b"};  // coordinated by node 0 and node 1
  uint64_t roots[2][2];
  for (int n = 0; n < 2; ++n) {
    for (int k = 0; k < 2; ++k) roots[n][k] = t[n]->TreeRoot(100 + k, trees[k]);
  }
  uint64_t dirs[2][2];
  for (int k = 0; k < 2; ++k) {  // the coordinator makes it; the other node gets it too
    auto d = t[k]->Mkdir(roots[k][k], "step1", 0755, 0, 0);
    ASSERT_TRUE(d.ok());
    dirs[k][k] = d->id;
    auto o = t[1 - k]->Lookup(roots[1 - k][k], "step1");
    ASSERT_TRUE(o.ok()) << "the mkdir was not mirrored";
    dirs[1 - k][k] = o->id;
  }
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(Put(t[k], dirs[k][k], "__0_0.distcp", read("__0_0.distcp")).ok());
    for (const char* f : {"__1_0.distcp", "__2_0.distcp", "__3_0.distcp"}) {
      ASSERT_TRUE(Put(t[1 - k], dirs[1 - k][k], f, read(f)).ok());
    }
  }
  ASSERT_TRUE(Put(t[0], dirs[0][0], ".metadata", read(".metadata")).ok());
  ASSERT_TRUE(Put(t[1], dirs[1][1], ".metadata", read(".metadata")).ok());
  for (int n = 0; n < 2; ++n) {
    for (int k = 0; k < 2; ++k) {
      const std::string path = std::string(trees[k]) + "/step1";
      ASSERT_TRUE(Eventually([&] { return Listed(t[n], path).state == "committed"; }))
          << "node " << n << " " << path << ": " << Listed(t[n], path).state;
      for (const char* f : {".metadata", "__0_0.distcp", "__2_0.distcp"}) {
        auto a = t[n]->Lookup(dirs[n][k], f);
        ASSERT_TRUE(a.ok()) << f;
        std::string got(a->size, '\0');
        auto r = t[n]->Read(a->id, got.data(), got.size(), 0);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        EXPECT_EQ(got, read(f)) << "node " << n << " " << path << "/" << f;
      }
    }
  }
}

}  // namespace
}  // namespace ckptfs::store::peer
