// PeerLinks over real UCX on 127.0.0.1 (UCX_TLS=tcp, UCX_NET_DEVICES=lo): connections are
// made on demand and bounded (the least recently used closes), a rank nobody needed is never
// declared dead, a rank that cannot be reached is declared dead after its silence, idle
// links are pinged, and a node that moves is reached at its new address.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <thread>

#include "store/peer/peer_links.h"
#include "store/peer/peer_server.h"
#include "store/peer/synthetic_provider.h"

namespace ckptfs::store::peer {
namespace {

using namespace std::chrono_literals;

const bool kUcxEnv = [] {
  ::setenv("UCX_TLS", "tcp", 1);
  ::setenv("UCX_NET_DEVICES", "lo", 1);
  return true;
}();

constexpr char kSecret[] = "correct horse battery staple 42";
constexpr char kSelf[] = "127.0.0.1:1";  // this node's name; nothing listens there
constexpr char kNowhere[] = "127.0.0.1:9";

class LinksTest : public ::testing::Test {
 protected:
  std::string StartServer() {
    PeerServerOptions so;
    so.listen = "127.0.0.1:0";
    so.node_id = "server" + std::to_string(servers_.size());
    so.secret = kSecret;
    so.allowed_peers = {kSelf};
    auto s = PeerServer::Create(so, &bytes_);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return kNowhere;
    servers_.push_back(std::move(s).value());
    return "127.0.0.1:" + std::to_string(servers_.back()->port());
  }
  std::unique_ptr<PeerLinks> MakeLinks(std::vector<std::string> peers, size_t max_links = 64) {
    PeerLinksOptions o;
    o.nodes = {kSelf};
    for (std::string& p : peers) o.nodes.push_back(std::move(p));
    o.self = 0;
    o.secret = kSecret;
    o.connect_timeout = 2s;
    o.request_timeout = 1s;
    o.down_backoff = 100ms;
    o.max_down_backoff = 200ms;
    o.dead_after = 300ms;
    o.heartbeat = 50ms;
    o.max_links = max_links;
    o.watch = false;  // the test drives Watch()
    auto l = PeerLinks::Create(o);
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    return l.ok() ? std::move(l).value() : nullptr;
  }

  SyntheticProvider bytes_{std::map<std::string, std::pair<uint64_t, int64_t>>{
      {"ckpt/x.bin", {1 << 20, 7}}}};
  std::vector<std::unique_ptr<PeerServer>> servers_;
};

TEST_F(LinksTest, NothingConnectsAtStartAndTheBoundClosesTheLeastRecentlyUsed) {
  std::vector<std::string> peers;
  for (int i = 0; i < 4; ++i) peers.push_back(StartServer());
  auto links = MakeLinks(peers, /*max_links=*/2);
  ASSERT_NE(links, nullptr);
  PeerLinksStats s = links->Stats();
  EXPECT_EQ(s.open, 0u);
  EXPECT_EQ(s.connects, 0u);
  for (const LinkInfo& l : s.links) EXPECT_EQ(l.state, LinkState::kUnknown) << l.rank;
  for (const auto& srv : servers_) EXPECT_EQ(srv->stats().connections, 0u);

  ASSERT_NE(links->Get(1), nullptr);
  ASSERT_NE(links->Get(2), nullptr);
  ASSERT_NE(links->Get(1), nullptr);  // rank 1 used last: rank 2 is the least recent
  ASSERT_NE(links->Get(3), nullptr);
  s = links->Stats();
  EXPECT_EQ(s.open, 2u);
  EXPECT_EQ(s.evicted, 1u);
  EXPECT_EQ(s.connects, 3u);
  EXPECT_TRUE(links->IsOpen(1));
  EXPECT_FALSE(links->IsOpen(2));
  EXPECT_TRUE(links->IsOpen(3));
  // The evicted rank is still up (nothing failed): it is reconnected on its next use.
  EXPECT_TRUE(links->Reachable(2));
  ASSERT_NE(links->Get(2), nullptr);
  EXPECT_EQ(links->Stats().open, 2u);
  EXPECT_EQ(links->Stats().evicted, 2u);
}

TEST_F(LinksTest, ALinkInUseIsNotClosedBeforeAnIdleOne) {
  std::vector<std::string> peers;
  for (int i = 0; i < 3; ++i) peers.push_back(StartServer());
  auto links = MakeLinks(peers, /*max_links=*/2);
  std::shared_ptr<PeerClient> held = links->Get(1);  // in use by a call
  ASSERT_NE(held, nullptr);
  ASSERT_NE(links->Get(2), nullptr);  // idle once returned
  ASSERT_NE(links->Get(3), nullptr);
  EXPECT_TRUE(links->IsOpen(1));
  EXPECT_FALSE(links->IsOpen(2));
  // A held client keeps working even if its link was closed: the bound never breaks a call.
  EXPECT_TRUE(held->healthy());
}

TEST_F(LinksTest, OnlyARankThatFailsIsDeclaredDeadAfterItsSilence) {
  const std::string live = StartServer();
  auto links = MakeLinks({live, kNowhere});
  links->Watch();
  std::this_thread::sleep_for(350ms);
  links->Watch();
  EXPECT_TRUE(links->DeadPeers().empty()) << "a rank nobody needed was declared dead";

  EXPECT_EQ(links->Get(2), nullptr);  // nothing listens there
  EXPECT_FALSE(links->Reachable(2));
  EXPECT_EQ(links->Get(2), nullptr);  // in its pause: null at once, no new connect
  EXPECT_EQ(links->Stats().connect_failures, 1u);
  std::this_thread::sleep_for(350ms);
  links->Watch();  // retries it past its pause; still nothing: dead
  std::vector<PeerLinks::Dead> dead = links->DeadPeers();
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_EQ(dead[0].rank, 2u);
  EXPECT_GE(dead[0].silent_s, 0.3);
  EXPECT_EQ(links->Stats().declared_dead, 1u);
  EXPECT_TRUE(links->Reachable(1));

  // Replaced on a new address: a replacement, not a false positive.
  links->MoveNode(2, StartServer());
  ASSERT_NE(links->Get(2), nullptr);
  EXPECT_TRUE(links->DeadPeers().empty());
  EXPECT_EQ(links->Stats().revived, 0u);
}

TEST_F(LinksTest, IdleLinksAreAnsweredByTheirHeartbeatAndALostOneGoesDown) {
  auto links = MakeLinks({StartServer()});
  ASSERT_NE(links->Get(1), nullptr);
  std::this_thread::sleep_for(80ms);
  links->Watch();
  PeerLinksStats s = links->Stats();
  EXPECT_GE(s.heartbeats, 1u);
  EXPECT_EQ(s.heartbeat_failures, 0u);
  EXPECT_EQ(s.up, 1u);

  servers_.clear();  // the peer exits: its connection is lost
  std::this_thread::sleep_for(200ms);
  links->Watch();
  s = links->Stats();
  EXPECT_EQ(s.up, 0u);
  EXPECT_EQ(s.down + s.dead, 1u);
  EXPECT_FALSE(links->Reachable(1));
  EXPECT_EQ(s.open, 0u);
}

TEST_F(LinksTest, ConcurrentCallersShareOneConnect) {
  auto links = MakeLinks({StartServer()});
  std::vector<std::thread> threads;
  std::atomic<int> got{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      if (links->Get(1)) got.fetch_add(1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(got.load(), 8);
  EXPECT_EQ(links->Stats().connects, 1u);
  EXPECT_EQ(servers_[0]->stats().authenticated, 1u);
}

}  // namespace
}  // namespace ckptfs::store::peer
