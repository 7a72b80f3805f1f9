// PeerServer / PeerClient over real UCX on 127.0.0.1 (UCX_TLS=tcp, UCX_NET_DEVICES=lo),
// in one process and across two (the server is ckptfs-peer-tool serve, killed by PID).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <random>
#include <sstream>
#include <thread>

#include "common/mutex.h"
#include "store/peer/buffer_pool.h"
#include "store/peer/commit_query.h"
#include "store/peer/peer_client.h"
#include "store/peer/peer_server.h"
#include "store/peer/peers.h"
#include "store/peer/protocol.h"
#include "store/peer/synthetic_provider.h"
#include "store/peer/ucx_worker.h"
#include "store/primitives/crc32c.h"

extern char** environ;

namespace ckptfs::store::peer {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Pinned before any UCX context exists (static initialization, before main).
const bool kUcxEnv = [] {
  ::setenv("UCX_TLS", "tcp", 1);
  ::setenv("UCX_NET_DEVICES", "lo", 1);
  return true;
}();

constexpr char kSecret[] = "correct horse battery staple 42";
constexpr char kClientNode[] = "127.0.0.1:7001";
constexpr uint64_t kFileSize = 64ull << 20;

std::map<std::string, std::pair<uint64_t, int64_t>> TestFiles() {
  return {{"ckpt/__0_0.distcp", {kFileSize, 11}},
          {"ckpt/__1_0.distcp", {kFileSize, 12}},
          {"ckpt/.metadata", {4096, 13}}};
}

BlockId Id(const std::string& path) {
  auto f = TestFiles().at(path);
  return BlockId{path, f.first, f.second};
}

PeerServerOptions ServerOptions() {
  PeerServerOptions o;
  o.listen = "127.0.0.1:0";
  o.node_id = "127.0.0.1:7000";
  o.secret = kSecret;
  o.allowed_peers = {kClientNode};
  return o;
}

PeerClientOptions ClientOptions(uint16_t port) {
  PeerClientOptions o;
  o.server = "127.0.0.1:" + std::to_string(port);
  o.node_id = kClientNode;
  o.secret = kSecret;
  o.connect_timeout = 5s;
  o.request_timeout = 5s;
  return o;
}

class PeerInProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = PeerServer::Create(ServerOptions(), &provider_);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(s).value();
  }
  std::unique_ptr<PeerClient> Connect(PeerClientOptions o) {
    auto c = PeerClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  void ExpectBlock(PeerClient* client, const std::string& path, uint64_t offset, size_t length) {
    std::vector<char> got(length), want(length);
    auto n = client->Fetch(Id(path), offset, got);
    ASSERT_TRUE(n.ok()) << n.status().ToString() << " at " << offset << "+" << length;
    size_t expect_n = std::min<uint64_t>(length, Id(path).size - offset);
    ASSERT_EQ(*n, expect_n);
    provider_.Fill(path, offset, std::span<char>(want).first(*n));
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), *n)) << path << " @" << offset;
  }

  SyntheticProvider provider_{TestFiles()};
  std::unique_ptr<PeerServer> server_;
};

TEST_F(PeerInProcess, BlocksOfEverySizeArriveByteExact) {
  auto client = Connect(ClientOptions(server_->port()));
  ASSERT_NE(client, nullptr);
  for (size_t len :
       {size_t(1), size_t(2), size_t(7), size_t(4095), size_t(4096), size_t(8193), size_t(65536),
        size_t(65537), size_t(1) << 20, (size_t(1) << 20) + 3, size_t(3) << 20, size_t(4) << 20}) {
    for (uint64_t off : {uint64_t(0), uint64_t(1), uint64_t(12345677)}) {
      ExpectBlock(client.get(), "ckpt/__0_0.distcp", off, len);
    }
  }
  auto st = server_->stats();
  EXPECT_EQ(st.authenticated, 1u);
  EXPECT_EQ(st.refused, 0u);
  EXPECT_EQ(client->stats().bad_checksums, 0u);
}

TEST_F(PeerInProcess, ReadAtEndOfFileIsShort) {
  auto client = Connect(ClientOptions(server_->port()));
  ASSERT_NE(client, nullptr);
  ExpectBlock(client.get(), "ckpt/.metadata", 4000, 1 << 20);  // 96 bytes
  ExpectBlock(client.get(), "ckpt/__1_0.distcp", kFileSize - 5, 4 << 20);
}

TEST_F(PeerInProcess, ServerErrorsComeBackAsTheirStatus) {
  auto client = Connect(ClientOptions(server_->port()));
  ASSERT_NE(client, nullptr);
  std::vector<char> buf(4096);
  auto missing = client->Fetch(BlockId{"ckpt/nope", 10, 1}, 0, buf);
  EXPECT_EQ(missing.status().code(), Code::kNotFound) << missing.status().ToString();
  BlockId stale = Id("ckpt/__0_0.distcp");
  stale.mtime_ns += 1;
  EXPECT_EQ(client->Fetch(stale, 0, buf).status().code(), Code::kAborted);
  auto escape = client->Fetch(BlockId{"../etc/passwd", 10, 1}, 0, buf);
  EXPECT_EQ(escape.status().code(), Code::kInvalid) << escape.status().ToString();
  EXPECT_EQ(client->Fetch(BlockId{"/etc/passwd", 10, 1}, 0, buf).status().code(), Code::kInvalid);
  std::vector<char> huge((64ull << 20) + 1);
  EXPECT_EQ(client->Fetch(Id("ckpt/__0_0.distcp"), 0, huge).status().code(), Code::kInvalid);
  // The connection is still good after error replies.
  EXPECT_TRUE(client->healthy());
  ExpectBlock(client.get(), "ckpt/__0_0.distcp", 0, 4096);
  EXPECT_EQ(provider_.reads(), 3u);  // missing, stale and the good one reached the provider
}

TEST_F(PeerInProcess, WrongSecretIsRefusedAndNothingServed) {
  PeerClientOptions o = ClientOptions(server_->port());
  o.secret = "not the secret, but long enough";
  auto c = PeerClient::Connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kPermission) << c.status().ToString();
  auto st = server_->stats();
  EXPECT_EQ(st.refused, 1u);
  EXPECT_EQ(st.authenticated, 0u);
  EXPECT_EQ(st.blocks_served, 0u);
  EXPECT_EQ(provider_.reads(), 0u);
}

TEST_F(PeerInProcess, UnlistedNodeIsRefusedAndNothingServed) {
  PeerClientOptions o = ClientOptions(server_->port());
  o.node_id = "127.0.0.1:9999";  // right secret, not in the server's peer list
  auto c = PeerClient::Connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(c.status().code() == Code::kPermission || c.status().code() == Code::kIo)
      << c.status().ToString();
  // Spin until the server has processed the refusal (it is logged and counted).
  for (int i = 0; i < 100 && server_->stats().refused == 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(server_->stats().refused, 1u);
  EXPECT_EQ(server_->stats().blocks_served, 0u);
  EXPECT_EQ(provider_.reads(), 0u);
}

TEST(PeerServerSourceCheck, ListedNameFromAnotherAddressIsRefused) {
  SyntheticProvider provider(TestFiles());
  PeerServerOptions so = ServerOptions();
  so.allowed_peers = {"127.0.0.2:7001"};  // the name is listed, but for another host
  auto server = PeerServer::Create(so, &provider);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  PeerClientOptions o = ClientOptions((*server)->port());
  o.node_id = "127.0.0.2:7001";  // claims the listed name, connects from 127.0.0.1
  auto c = PeerClient::Connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ((*server)->stats().authenticated, 0u);
  EXPECT_EQ(provider.reads(), 0u);
}

TEST_F(PeerInProcess, CorruptedBlockIsDetectedByTheRequester) {
  auto client = Connect(ClientOptions(server_->port()));
  ASSERT_NE(client, nullptr);
  provider_.CorruptNext(1);
  std::vector<char> buf(1 << 20);
  auto bad = client->Fetch(Id("ckpt/__0_0.distcp"), 4096, buf);
  EXPECT_EQ(bad.status().code(), Code::kCorrupt) << bad.status().ToString();
  EXPECT_EQ(client->stats().bad_checksums, 1u);
  // Small (eager) replies are checked too.
  provider_.CorruptNext(1);
  std::vector<char> small(100);
  EXPECT_EQ(client->Fetch(Id("ckpt/__0_0.distcp"), 0, small).status().code(), Code::kCorrupt);
  ExpectBlock(client.get(), "ckpt/__0_0.distcp", 4096, 1 << 20);
}

TEST_F(PeerInProcess, StalledServerTimesOutWithinTheBound) {
  PeerClientOptions o = ClientOptions(server_->port());
  o.request_timeout = 300ms;
  auto client = Connect(o);
  ASSERT_NE(client, nullptr);
  provider_.SetDelayMs(1500);
  std::vector<char> buf(1 << 20);
  auto t0 = Clock::now();
  auto r = client->Fetch(Id("ckpt/__0_0.distcp"), 0, buf);
  auto took = Clock::now() - t0;
  EXPECT_EQ(r.status().code(), Code::kTimeout) << r.status().ToString();
  EXPECT_LT(took, 1000ms);
  EXPECT_GE(took, 300ms);
  provider_.SetDelayMs(0);
  // The late reply is dropped; the connection keeps working.
  std::this_thread::sleep_for(1500ms);
  ExpectBlock(client.get(), "ckpt/__0_0.distcp", 0, 1 << 20);
  EXPECT_EQ(client->stats().timeouts, 1u);
}

TEST_F(PeerInProcess, EightThreadsFetchConcurrentlyByteExact) {
  auto client = Connect(ClientOptions(server_->port()));
  ASSERT_NE(client, nullptr);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      std::vector<char> got, want;
      for (int i = 0; i < 40; ++i) {
        std::string path = (rng() % 2) ? "ckpt/__0_0.distcp" : "ckpt/__1_0.distcp";
        size_t len = 1 + rng() % (2 << 20);
        uint64_t off = rng() % (kFileSize - len);
        got.assign(len, 0);
        want.assign(len, 0);
        auto n = client->Fetch(Id(path), off, got);
        provider_.Fill(path, off, want);
        if (!n.ok() || *n != len || got != want) failures.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(client->stats().fetched_blocks, 320u);
}

TEST_F(PeerInProcess, ServerDestroyedUnderLoadFailsFetchesPromptly) {
  PeerClientOptions o = ClientOptions(server_->port());
  o.request_timeout = 3s;
  auto client = Connect(o);
  ASSERT_NE(client, nullptr);
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      std::vector<char> buf(1 << 20);
      while (!stop.load()) {
        auto r = client->Fetch(Id("ckpt/__0_0.distcp"), 0, buf);
        (r.ok() ? ok : failed).fetch_add(1);
        if (!r.ok()) return;
      }
    });
  }
  while (ok.load() < 20) std::this_thread::sleep_for(1ms);
  auto t0 = Clock::now();
  server_.reset();  // closes every connection
  for (auto& t : threads) t.join();
  stop = true;
  EXPECT_LT(Clock::now() - t0, 3500ms);
  EXPECT_EQ(failed.load(), 4);
  EXPECT_FALSE(client->healthy());
  std::vector<char> buf(10);
  auto after = client->Fetch(Id("ckpt/__0_0.distcp"), 0, buf);
  EXPECT_EQ(after.status().code(), Code::kIo) << after.status().ToString();
}

TEST(PeerClientConnect, NothingListeningFailsWithinTheTimeout) {
  PeerClientOptions o = ClientOptions(1);  // port 1: nothing listens there
  o.connect_timeout = 2s;
  auto t0 = Clock::now();
  auto c = PeerClient::Connect(o);
  EXPECT_FALSE(c.ok());
  EXPECT_LT(Clock::now() - t0, 2500ms);
}

TEST(PeerClientConnect, ShortSecretIsRejectedUpFront) {
  PeerClientOptions o = ClientOptions(1);
  o.secret = "short";
  EXPECT_EQ(PeerClient::Connect(o).status().code(), Code::kInvalid);
  SyntheticProvider provider(TestFiles());
  PeerServerOptions so = ServerOptions();
  so.secret = "short";
  EXPECT_EQ(PeerServer::Create(so, &provider).status().code(), Code::kInvalid);
}

TEST_F(PeerInProcess, SeveralClientsShareOneServer) {
  std::vector<std::unique_ptr<PeerClient>> clients;
  for (int i = 0; i < 3; ++i) {
    clients.push_back(Connect(ClientOptions(server_->port())));
    ASSERT_NE(clients.back(), nullptr);
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      PeerClient* c = clients[t % 3].get();
      std::vector<char> got(300000), want(300000);
      for (int i = 0; i < 20; ++i) {
        uint64_t off = uint64_t(t * 20 + i) * 100003;
        auto n = c->Fetch(Id("ckpt/__1_0.distcp"), off, got);
        provider_.Fill("ckpt/__1_0.distcp", off, want);
        if (!n.ok() || *n != got.size() || got != want) failures.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(server_->stats().authenticated, 3u);
  EXPECT_EQ(server_->stats().blocks_served, 120u);
}

// Connections on local port `port` that /proc/net/tcp shows in TIME_WAIT.
int TimeWaitOnPort(uint16_t port) {
  std::ifstream in("/proc/net/tcp");
  std::string line;
  int n = 0;
  char want[16];
  std::snprintf(want, sizeof(want), ":%04X", port);
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string slot, local, remote, state;
    f >> slot >> local >> remote >> state;
    if (state == "06" && local.size() > 5 && local.substr(local.size() - 5) == want) ++n;
  }
  return n;
}

// G11: the last connections on a server's port sit in TIME_WAIT for a minute on the side
// that closed first; a server started again at once on that port must still listen.
TEST(PeerServerCreate, ANewServerListensAtOnceOnThePortOfOneThatJustClosed) {
  SyntheticProvider provider(TestFiles());
  auto first = PeerServer::Create(ServerOptions(), &provider);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  const uint16_t port = (*first)->port();
  {
    auto client = PeerClient::Connect(ClientOptions(port));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    std::vector<char> buf(4096);
    ASSERT_TRUE((*client)->Fetch(Id("ckpt/.metadata"), 0, buf).ok());
    (*first).reset();  // the server closes first: TIME_WAIT lands on its port
  }
  for (int i = 0; i < 100 && TimeWaitOnPort(port) == 0; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_GT(TimeWaitOnPort(port), 0) << "nothing in TIME_WAIT: the test checks nothing";
  PeerServerOptions same = ServerOptions();
  same.listen = "127.0.0.1:" + std::to_string(port);
  auto second = PeerServer::Create(same, &provider);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  auto client = PeerClient::Connect(ClientOptions(port));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  std::vector<char> buf(4096);
  EXPECT_TRUE((*client)->Fetch(Id("ckpt/.metadata"), 0, buf).ok());
}

TEST(PeerServerCreate, BusyPortAndBadOptionsFailClearly) {
  SyntheticProvider provider(TestFiles());
  auto first = PeerServer::Create(ServerOptions(), &provider);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  PeerServerOptions same = ServerOptions();
  same.listen = "127.0.0.1:" + std::to_string((*first)->port());
  auto second = PeerServer::Create(same, &provider);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("cannot listen"), std::string::npos)
      << second.status().ToString();
  PeerServerOptions no_threads = ServerOptions();
  no_threads.serve_threads = 0;
  EXPECT_EQ(PeerServer::Create(no_threads, &provider).status().code(), Code::kInvalid);
  PeerServerOptions bad_peer = ServerOptions();
  bad_peer.allowed_peers = {"no-port-here"};
  EXPECT_EQ(PeerServer::Create(bad_peer, &provider).status().code(), Code::kInvalid);
  PeerServerOptions bad_listen = ServerOptions();
  bad_listen.listen = "127.0.0.1";
  EXPECT_EQ(PeerServer::Create(bad_listen, &provider).status().code(), Code::kInvalid);
}

// ---- Two processes: the server is ckptfs-peer-tool serve. ----

// A child process killed (SIGKILL) and reaped by PID in the destructor, whatever happens.
class ServerProcess {
 public:
  static std::unique_ptr<ServerProcess> Start(const std::string& secret_file,
                                              std::vector<std::string> extra = {}) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return nullptr;
    std::vector<std::string> args = {
        CKPTFS_PEER_TOOL, "serve",     "--listen",    "127.0.0.1:0",
        "--secret-file",  secret_file, "--allow",     kClientNode,
        "--files",        "2",         "--file-size", std::to_string(kFileSize)};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    auto p = std::unique_ptr<ServerProcess>(new ServerProcess());
    int rc = posix_spawn(&p->pid_, CKPTFS_PEER_TOOL, &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(fds[1]);
    if (rc != 0) {
      ::close(fds[0]);
      p->pid_ = -1;
      return nullptr;
    }
    // Read up to the "PORT <n>" line (log lines may come first); bounded by the child: if
    // it dies, read returns 0.
    std::string line;
    char c;
    while (line.rfind("PORT ", 0) != 0) {
      line.clear();
      ssize_t r;
      while ((r = ::read(fds[0], &c, 1)) == 1 && c != '\n') line += c;
      if (r != 1) break;
    }
    ::close(fds[0]);
    if (line.rfind("PORT ", 0) != 0) return nullptr;
    p->port_ = static_cast<uint16_t>(std::stoi(line.substr(5)));
    return p;
  }
  ~ServerProcess() { Kill(); }
  void Kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  uint16_t port() const { return port_; }

 private:
  ServerProcess() = default;
  pid_t pid_ = -1;
  uint16_t port_ = 0;
};

class PeerTwoProcesses : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/peer_secret_XXXXXX";
    int fd = ::mkstemp(tmpl);
    ASSERT_GE(fd, 0);
    secret_file_ = tmpl;
    ASSERT_EQ(::write(fd, kSecret, sizeof(kSecret) - 1), ssize_t(sizeof(kSecret) - 1));
    ::close(fd);
  }
  void TearDown() override { ::unlink(secret_file_.c_str()); }
  std::string secret_file_;
  // The tool serves f0, f1 of kFileSize, mtime 1, with SyntheticProvider's bytes.
  SyntheticProvider expect_{{{"f0", {kFileSize, 1}}, {"f1", {kFileSize, 1}}}};
};

TEST_F(PeerTwoProcesses, BlocksOfEverySizeArriveByteExact) {
  auto server = ServerProcess::Start(secret_file_);
  ASSERT_NE(server, nullptr);
  auto client = PeerClient::Connect(ClientOptions(server->port()));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  for (size_t len : {size_t(1), size_t(4096), size_t(65537), size_t(1) << 20, size_t(4) << 20}) {
    std::vector<char> got(len), want(len);
    uint64_t off = 977 * len % (kFileSize - len);
    auto n = (*client)->Fetch(BlockId{"f1", kFileSize, 1}, off, got);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    ASSERT_EQ(*n, len);
    expect_.Fill("f1", off, want);
    ASSERT_EQ(got, want) << len;
  }
}

TEST_F(PeerTwoProcesses, WrongSecretIsRefused) {
  auto server = ServerProcess::Start(secret_file_);
  ASSERT_NE(server, nullptr);
  PeerClientOptions o = ClientOptions(server->port());
  o.secret = "a different secret of some length";
  auto client = PeerClient::Connect(o);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), Code::kPermission) << client.status().ToString();
}

TEST_F(PeerTwoProcesses, ServerKilledMidLoadFailsEveryFetchWithinTheTimeout) {
  auto server = ServerProcess::Start(secret_file_);
  ASSERT_NE(server, nullptr);
  PeerClientOptions o = ClientOptions(server->port());
  o.request_timeout = 3s;
  auto client = PeerClient::Connect(o);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  std::atomic<int> ok{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::vector<char> buf(1 << 20);
      for (uint64_t i = 0;; ++i) {
        auto r = (*client)->Fetch(BlockId{"f0", kFileSize, 1}, ((i * 8 + t) % 64) << 20, buf);
        if (!r.ok()) {
          failed.fetch_add(1);
          return;
        }
        ok.fetch_add(1);
      }
    });
  }
  while (ok.load() < 50) std::this_thread::sleep_for(1ms);
  auto t0 = Clock::now();
  server->Kill();
  for (auto& t : threads) t.join();
  auto took = Clock::now() - t0;
  EXPECT_EQ(failed.load(), 8);
  EXPECT_LT(took, 3500ms) << "every fetch must end within the request timeout";
  EXPECT_FALSE((*client)->healthy());
}

TEST_F(PeerTwoProcesses, CorruptedReplyIsDetected) {
  auto server = ServerProcess::Start(secret_file_, {"--corrupt", "1"});
  ASSERT_NE(server, nullptr);
  auto client = PeerClient::Connect(ClientOptions(server->port()));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  std::vector<char> buf(1 << 20);
  auto bad = (*client)->Fetch(BlockId{"f0", kFileSize, 1}, 0, buf);
  EXPECT_EQ(bad.status().code(), Code::kCorrupt) << bad.status().ToString();
  auto good = (*client)->Fetch(BlockId{"f0", kFileSize, 1}, 0, buf);
  EXPECT_TRUE(good.ok()) << good.status().ToString();
}

// ---- Buffer pool. ----

// A Shutdown() right after a Post(): the progress thread may see the stop request together
// with the task, run the task and must then end, not sleep on a wakeup already consumed (that
// hang stalled a daemon's read for as long as a hung peer stayed stopped).
TEST(PeerUcxWorker, ShutdownRightAfterAPostReturns) {
  for (int i = 0; i < 100; ++i) {
    auto w = UcxWorker::Create("post-then-stop", {});
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    std::atomic<int> ran{0};
    (*w)->Post([&ran] { ran.fetch_add(1); });
    auto done = std::async(std::launch::async, [&w] { (*w)->Shutdown(); });
    if (done.wait_for(10s) != std::future_status::ready) {
      ADD_FAILURE() << "Shutdown() hung after a Post() (iteration " << i << ")";
      std::abort();  // the progress thread sleeps for good: nothing left to join
    }
    EXPECT_LE(ran.load(), 1);
  }
}

TEST(PeerBufferPool, LargeBuffersAreReusedUpToTheCap) {
  auto pool = BufferPool::Create(3 << 20);
  char* first;
  {
    BufferPool::Buffer a = pool->Take(1 << 20);
    EXPECT_EQ(a.capacity(), size_t(1) << 20);
    first = a.data();
  }
  EXPECT_EQ(pool->cached_bytes(), uint64_t(1) << 20);
  BufferPool::Buffer again = pool->Take((1 << 20) - 5);  // same power-of-two class
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(pool->cached_bytes(), 0u);
  {
    BufferPool::Buffer big = pool->Take(4 << 20);  // over the cap when returned: freed
  }
  EXPECT_EQ(pool->cached_bytes(), 0u);
  BufferPool::Buffer small = pool->Take(100);  // below kMinPooledBytes: plain allocation
  EXPECT_GE(small.capacity(), 100u);
}

TEST(PeerBufferPool, BuffersMayOutliveThePoolOwner) {
  BufferPool::Buffer kept;
  {
    auto pool = BufferPool::Create(8 << 20);
    kept = pool->Take(1 << 20);
  }  // the last owner's reference is gone; the buffer still holds the pool
  kept.data()[0] = 1;
  kept = BufferPool::Buffer();
}

// ---- Protocol pieces. ----

TEST(PeerProtocol, MessagesRoundTripAndTruncationIsCorrupt) {
  BlockRequest r;
  r.request_id = 77;
  r.id = BlockId{std::string("a/b\xff", 4), 123, -5};
  r.offset = 1ull << 40;
  r.length = 4096;
  std::string enc = EncodeRequest(r);
  auto back = DecodeRequest(enc);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->id, r.id);
  EXPECT_EQ(back->offset, r.offset);
  EXPECT_EQ(back->length, r.length);
  for (size_t cut = 0; cut < enc.size(); ++cut) {
    EXPECT_FALSE(DecodeRequest(enc.substr(0, cut)).ok()) << cut;
  }
  EXPECT_FALSE(DecodeRequest(enc + "x").ok());
  Hello h{"node:1", {}};
  h.client_nonce[3] = 9;
  auto hb = DecodeHello(EncodeHello(h));
  ASSERT_TRUE(hb.ok());
  EXPECT_EQ(hb->node_id, "node:1");
  EXPECT_EQ(hb->client_nonce, h.client_nonce);
  std::string bad_magic = EncodeHello(h);
  bad_magic[0] ^= 1;
  EXPECT_FALSE(DecodeHello(bad_magic).ok());
  AuthResult accepted{true, {}};
  accepted.server_proof[31] = 7;
  auto ar = DecodeAuthResult(EncodeAuthResult(accepted));
  ASSERT_TRUE(ar.ok());
  EXPECT_TRUE(ar->accepted);
  EXPECT_EQ(ar->server_proof, accepted.server_proof);
  EXPECT_FALSE(DecodeAuthResult(EncodeAuthResult(accepted).substr(0, 20)).ok());
  auto refused = DecodeAuthResult(EncodeAuthResult(AuthResult{}));
  ASSERT_TRUE(refused.ok());
  EXPECT_FALSE(refused->accepted);
}

TEST(PeerProtocol, ShardQueryAndAnswerRoundTripAndBadInputIsRejected) {
  ShardQuery q;
  q.query_id = 0x1122334455667788ull;
  q.hold_ms = 1500;
  q.paths = {"ck/__0_0.distcp", std::string("ck/\xff\0x", 5), ""};
  std::string enc = EncodeShardQuery(q);
  auto back = DecodeShardQuery(enc);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->query_id, q.query_id);
  EXPECT_EQ(back->hold_ms, q.hold_ms);
  EXPECT_EQ(back->paths, q.paths);
  for (size_t cut = 0; cut < enc.size(); ++cut) {
    EXPECT_FALSE(DecodeShardQuery(enc.substr(0, cut)).ok()) << cut;
  }
  EXPECT_FALSE(DecodeShardQuery(enc + "x").ok());
  // A count no message could hold, a path over the limit, an oversized query.
  std::string huge_count = enc;
  huge_count[12] = huge_count[13] = huge_count[14] = huge_count[15] = '\xff';
  EXPECT_FALSE(DecodeShardQuery(huge_count).ok());
  std::string long_path = enc;
  long_path[16] = '\0';
  long_path[17] = long_path[18] = '\x7f';
  EXPECT_FALSE(DecodeShardQuery(long_path).ok());
  EXPECT_FALSE(DecodeShardQuery(std::string(kMaxQueryBytes + 1, '\0')).ok());

  ShardAnswer a;
  a.query_id = 5;
  a.code = static_cast<uint32_t>(Code::kOk);
  a.states = {{ShardState::kDurable, 1ull << 33}, {ShardState::kPending, 0}, {}};
  enc = EncodeShardAnswer(a);
  auto ab = DecodeShardAnswer(enc);
  ASSERT_TRUE(ab.ok()) << ab.status().ToString();
  EXPECT_EQ(ab->query_id, 5u);
  EXPECT_EQ(ab->states, a.states);
  for (size_t cut = 0; cut < enc.size(); ++cut) {
    EXPECT_FALSE(DecodeShardAnswer(enc.substr(0, cut)).ok()) << cut;
  }
  std::string bad_state = enc;
  bad_state[16] = 9;
  EXPECT_FALSE(DecodeShardAnswer(bad_state).ok());
  ShardAnswer err;
  err.query_id = 6;
  err.code = static_cast<uint32_t>(Code::kUnsupported);
  err.error = "no shard states";
  auto eb = DecodeShardAnswer(EncodeShardAnswer(err));
  ASSERT_TRUE(eb.ok());
  EXPECT_EQ(eb->code, err.code);
  EXPECT_EQ(eb->error, err.error);
  EXPECT_TRUE(eb->states.empty());
  // Random garbage never crashes a decoder.
  std::mt19937 rng(12);
  for (int i = 0; i < 2000; ++i) {
    std::string g(rng() % 64, '\0');
    for (char& c : g) c = static_cast<char>(rng());
    (void)DecodeShardQuery(g);
    (void)DecodeShardAnswer(g);
  }
}

// Issue 39: durable answers carry their writer's block CRCs in a versioned, bounded section
// after the states, asked for by a flag an older server ignores; an answer without it (an
// older server) and one with a later version's section still parse.
TEST(PeerProtocol, ShardAnswerChecksumSectionIsVersionedBoundedAndChecked) {
  ShardQuery q;
  q.query_id = 9;
  q.hold_ms = 1500;
  q.want_checksums = true;
  q.paths = {"ck/__0_0.distcp"};
  std::string qe = EncodeShardQuery(q);
  auto qb = DecodeShardQuery(qe);
  ASSERT_TRUE(qb.ok());
  EXPECT_TRUE(qb->want_checksums);
  EXPECT_EQ(qb->hold_ms, 1500u);
  // An older server reads the flag as a long hold (and caps it): nothing else changes.
  EXPECT_EQ(static_cast<uint8_t>(qe[11]) & 0x80, 0x80);
  q.want_checksums = false;
  EXPECT_FALSE(DecodeShardQuery(EncodeShardQuery(q))->want_checksums);

  auto sums = std::make_shared<ShardChecksums>();
  sums->id = FileKey{7, 8, (1u << 20) + 5, 123456789};
  sums->block_bytes = 64u << 10;
  for (uint32_t i = 0; i < 17; ++i) sums->block_crcs.push_back(0x01020304u * (i + 1));
  ShardAnswer a;
  a.query_id = 10;
  a.code = static_cast<uint32_t>(Code::kOk);
  a.states = {{ShardState::kPending, 0, nullptr},
              {ShardState::kDurable, sums->id.size, sums},
              {ShardState::kDurable, 5, nullptr}};
  const std::string plain_prefix = [&] {
    ShardAnswer p = a;
    p.states[1].checksums.reset();
    return EncodeShardAnswer(p);
  }();
  EXPECT_EQ(plain_prefix.size(), 16u + 3 * 9) << "no checksums: the format of before";
  std::string enc = EncodeShardAnswer(a);
  ASSERT_GT(enc.size(), plain_prefix.size());
  EXPECT_EQ(enc.substr(0, plain_prefix.size()), plain_prefix);
  auto ab = DecodeShardAnswer(enc);
  ASSERT_TRUE(ab.ok()) << ab.status().ToString();
  EXPECT_EQ(ab->states, a.states);
  ASSERT_NE(ab->states[1].checksums, nullptr);
  EXPECT_EQ(*ab->states[1].checksums, *sums);
  EXPECT_EQ(ab->states[0].checksums, nullptr);
  EXPECT_EQ(ab->states[2].checksums, nullptr);
  // An older server's answer ends after the states: it parses, without checksums.
  auto old = DecodeShardAnswer(plain_prefix);
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(old->states[1].checksums, nullptr);
  // A later version's section is skipped whole.
  std::string later = plain_prefix + std::string(1, '\x02') + "whatever comes in v2";
  auto lb = DecodeShardAnswer(later);
  ASSERT_TRUE(lb.ok()) << lb.status().ToString();
  EXPECT_EQ(lb->states[1].checksums, nullptr);
  // Every cut inside the section is refused.
  for (size_t cut = plain_prefix.size() + 1; cut < enc.size(); ++cut) {
    EXPECT_FALSE(DecodeShardAnswer(enc.substr(0, cut)).ok()) << cut;
  }
  EXPECT_FALSE(DecodeShardAnswer(enc + "x").ok());
  auto corrupt = [&](size_t at, char v) {
    std::string e = enc;
    e[at] = v;
    return DecodeShardAnswer(e).ok();
  };
  const size_t sec = plain_prefix.size();  // version, n, then the record
  EXPECT_FALSE(corrupt(sec + 1, 9)) << "more records than paths";
  EXPECT_FALSE(corrupt(sec + 5, 0)) << "a record for a pending path";
  EXPECT_FALSE(corrupt(sec + 5, 3)) << "a record for no path";
  EXPECT_FALSE(corrupt(sec + 9 + 8 + 8, 6)) << "a size other than the durable length";
  EXPECT_FALSE(corrupt(sec + 9 + 32, 1)) << "a block size that is no power of two";
  EXPECT_FALSE(corrupt(sec + 9 + 36, 16)) << "a count that does not fit the size";
  // Bounded: records past kMaxAnswerChecksumBytes are left out, the states stay.
  auto big = std::make_shared<ShardChecksums>();
  big->block_bytes = 4096;
  big->block_crcs.assign(kMaxAnswerChecksumBytes / 4 / 2, 1);
  big->id.size = uint64_t{4096} * big->block_crcs.size();
  ShardAnswer many;
  many.code = static_cast<uint32_t>(Code::kOk);
  for (int i = 0; i < 3; ++i) many.states.push_back({ShardState::kDurable, big->id.size, big});
  std::string me = EncodeShardAnswer(many);
  EXPECT_LE(me.size(), 16 + 3 * 9 + 5 + kMaxAnswerChecksumBytes);
  auto mb = DecodeShardAnswer(me);
  ASSERT_TRUE(mb.ok()) << mb.status().ToString();
  ASSERT_EQ(mb->states.size(), 3u);
  EXPECT_NE(mb->states[0].checksums, nullptr);
  EXPECT_EQ(mb->states[2].checksums, nullptr);
  // Random garbage after a valid answer never crashes the section's decoder.
  std::mt19937 rng(39);
  for (int i = 0; i < 2000; ++i) {
    std::string g = plain_prefix + std::string(1, '\x01');
    g.resize(g.size() + rng() % 80);
    for (size_t k = plain_prefix.size() + 1; k < g.size(); ++k) g[k] = static_cast<char>(rng());
    (void)DecodeShardAnswer(g);
  }
}

// ---- Commit query over real UCX. ----

// A provider whose states the test sets; a change calls the server's listener.
class FakeShardStates : public ShardStateProvider {
 public:
  ShardStatus Query(const std::string& path) override {
    MutexLock lock(&mu_);
    ++queries_;
    auto it = states_.find(path);
    return it == states_.end() ? ShardStatus{} : it->second;
  }
  void SetListener(ShardStateListener* listener) override {
    MutexLock lock(&mu_);
    listener_ = listener;
  }
  std::shared_ptr<const ShardChecksums> Checksums(const std::string& path) override {
    MutexLock lock(&mu_);
    auto it = sums_.find(path);
    return it == sums_.end() ? nullptr : it->second;
  }
  void SetChecksums(const std::string& path, std::shared_ptr<const ShardChecksums> sums) {
    MutexLock lock(&mu_);
    sums_[path] = std::move(sums);
  }
  void Set(const std::string& path, ShardStatus st) {
    ShardStateListener* listener = nullptr;
    {
      MutexLock lock(&mu_);
      states_[path] = st;
      listener = listener_;
    }
    if (listener != nullptr) listener->OnShardStatesChanged();
  }

 private:
  Mutex mu_;
  std::map<std::string, ShardStatus> states_ GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<const ShardChecksums>> sums_ GUARDED_BY(mu_);
  ShardStateListener* listener_ GUARDED_BY(mu_) = nullptr;
  uint64_t queries_ GUARDED_BY(mu_) = 0;
};

// A round's answers, for the test to wait on.
class AnswersPromise final : public PeerShardAnswerSink {
 public:
  void OnPeerShardAnswers(uint64_t, std::vector<PeerShardAnswer> answers) override {
    promise_.set_value(std::move(answers));
  }
  std::vector<PeerShardAnswer> Get() { return promise_.get_future().get(); }

 private:
  std::promise<std::vector<PeerShardAnswer>> promise_;
};

class PeerShardQuery : public ::testing::Test {
 protected:
  std::unique_ptr<PeerServer> Serve(FakeShardStates* states, std::string node_id) {
    PeerServerOptions o = ServerOptions();
    o.node_id = std::move(node_id);
    o.shard_states = states;
    auto s = PeerServer::Create(o, &provider_);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  SyntheticProvider provider_{TestFiles()};
};

TEST_F(PeerShardQuery, AnswersAtOnceWhenNothingIsPendingThere) {
  FakeShardStates states;
  states.Set("ck/__0_0.distcp", {ShardState::kDurable, 4096});
  states.Set("ck/__1_0.distcp", {ShardState::kDropped, 0});
  auto server = Serve(&states, "127.0.0.1:7000");
  ASSERT_NE(server, nullptr);
  auto client = PeerClient::Connect(ClientOptions(server->port()));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  const auto start = Clock::now();
  auto got = (*client)->QueryShards({"ck/__0_0.distcp", "ck/__1_0.distcp", "ck/none", "../x"},
                                    5000ms);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_LT(Clock::now() - start, 1s) << "held although nothing was pending";
  ASSERT_EQ(got->size(), 4u);
  EXPECT_EQ((*got)[0], (ShardStatus{ShardState::kDurable, 4096}));
  EXPECT_EQ((*got)[1].state, ShardState::kDropped);
  EXPECT_EQ((*got)[2].state, ShardState::kUnknown);
  EXPECT_EQ((*got)[3].state, ShardState::kUnknown);  // not a clean relative path
  EXPECT_EQ(server->stats().shard_queries, 1u);
  // A large query (many fragments, still eager) is answered in full.
  std::vector<std::string> many;
  for (int i = 0; i < 8000; ++i) {
    many.push_back("run/iter_0000001/__" + std::to_string(i) + "_0.distcp");
  }
  many.push_back("ck/__0_0.distcp");
  auto big = (*client)->QueryShards(many, 5000ms);
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  ASSERT_EQ(big->size(), many.size());
  EXPECT_EQ(big->back(), (ShardStatus{ShardState::kDurable, 4096}));
  EXPECT_EQ(big->front().state, ShardState::kUnknown);
}

TEST_F(PeerShardQuery, DurableShardsComeWithTheirWritersBlockCrcsOverUcx) {
  FakeShardStates states;
  auto sums = std::make_shared<ShardChecksums>();
  sums->id = FileKey{1, 2, 70000, 3};
  sums->block_bytes = 64u << 10;
  sums->block_crcs = {0xdeadbeef, 0x12345678};
  states.Set("ck/__0_0.distcp", {ShardState::kDurable, 70000, nullptr});
  states.SetChecksums("ck/__0_0.distcp", sums);
  states.Set("ck/__1_0.distcp", {ShardState::kDurable, 99, nullptr});
  states.SetChecksums("ck/__1_0.distcp", sums);  // of another size: not sent
  states.SetChecksums("ck/__2_0.distcp", sums);  // not durable: not sent
  auto server = Serve(&states, "127.0.0.1:7000");
  ASSERT_NE(server, nullptr);
  auto client = PeerClient::Connect(ClientOptions(server->port()));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto got = (*client)->QueryShards({"ck/__0_0.distcp", "ck/__1_0.distcp", "ck/__2_0.distcp"},
                                    1000ms);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 3u);
  ASSERT_NE((*got)[0].checksums, nullptr);
  EXPECT_EQ(*(*got)[0].checksums, *sums);
  EXPECT_EQ((*got)[1].checksums, nullptr);
  EXPECT_EQ((*got)[2].checksums, nullptr);
}

TEST_F(PeerShardQuery, APendingShardIsAnsweredWhenItBecomesDurableOrTheHoldEnds) {
  FakeShardStates states;
  states.Set("ck/__0_0.distcp", {ShardState::kPending, 0});
  auto server = Serve(&states, "127.0.0.1:7000");
  ASSERT_NE(server, nullptr);
  auto client = PeerClient::Connect(ClientOptions(server->port()));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  std::thread writer([&] {
    std::this_thread::sleep_for(300ms);
    states.Set("ck/__0_0.distcp", {ShardState::kDurable, 123});
  });
  const auto start = Clock::now();
  auto got = (*client)->QueryShards({"ck/__0_0.distcp", "ck/other"}, 1900ms);
  const auto took = Clock::now() - start;
  writer.join();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ((*got)[0], (ShardStatus{ShardState::kDurable, 123}));
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 1500ms) << "the answer waited for the hold, not the change";
  // Still pending: answered as pending when the hold passes (capped by the server's 2 s).
  states.Set("ck/__1_0.distcp", {ShardState::kPending, 0});
  const auto start2 = Clock::now();
  got = (*client)->QueryShards({"ck/__1_0.distcp"}, 400ms);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ((*got)[0].state, ShardState::kPending);
  EXPECT_GE(Clock::now() - start2, 350ms);
  EXPECT_LT(Clock::now() - start2, 3s);
}

TEST_F(PeerShardQuery, ServerWithoutStatesAnswersUnsupportedAndTooManyPathsAreRefused) {
  auto s = PeerServer::Create(ServerOptions(), &provider_);
  ASSERT_TRUE(s.ok());
  auto client = PeerClient::Connect(ClientOptions((*s)->port()));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto got = (*client)->QueryShards({"ck/__0_0.distcp"}, 1000ms);
  EXPECT_EQ(got.status().code(), Code::kUnsupported) << got.status().ToString();
  EXPECT_EQ((*s)->stats().shard_query_errors, 1u);
  std::vector<std::string> many(kMaxQueryPaths + 1, "p");
  EXPECT_EQ((*client)->QueryShards(many, 10ms).status().code(), Code::kInvalid);
  // The connection still serves blocks.
  std::vector<char> buf(4096);
  EXPECT_TRUE((*client)->Fetch(Id("ckpt/.metadata"), 0, buf).ok());
}

TEST_F(PeerShardQuery, QuerierMergesTwoPeersWithArbitraryShardPlacement) {
  // Node 0 asks; node 1 wrote shards 0 and 3, node 2 shard 1; shard 2 nobody knows.
  FakeShardStates one, two;
  one.Set("ck/__0_0.distcp", {ShardState::kDurable, 100});
  two.Set("ck/__1_0.distcp", {ShardState::kPending, 0});
  auto s1 = Serve(&one, "127.0.0.1:7011");
  auto s2 = Serve(&two, "127.0.0.1:7012");
  ASSERT_TRUE(s1 && s2);
  CommitQueryOptions qo;
  qo.nodes = {kClientNode, "127.0.0.1:" + std::to_string(s1->port()),
              "127.0.0.1:" + std::to_string(s2->port())};
  qo.self = 0;
  qo.secret = kSecret;
  qo.request_timeout = 3s;
  CommitQuerier querier(qo);
  const std::vector<std::string> paths = {"ck/__0_0.distcp", "ck/__1_0.distcp",
                                          "ck/__2_0.distcp", "ck/__3_0.distcp"};
  AnswersPromise p1;
  std::thread later([&] {
    std::this_thread::sleep_for(200ms);
    two.Set("ck/__1_0.distcp", {ShardState::kDurable, 200});
  });
  const auto start = Clock::now();
  ASSERT_TRUE(querier.Ask(paths, 1500ms, &p1, 1));
  auto answers = p1.Get();
  const auto took = Clock::now() - start;
  later.join();
  ASSERT_EQ(answers.size(), 4u);
  EXPECT_EQ(answers[0].status, (ShardStatus{ShardState::kDurable, 100}));
  EXPECT_EQ(answers[1].status, (ShardStatus{ShardState::kDurable, 200}));
  EXPECT_EQ(answers[2].status.state, ShardState::kUnknown);
  EXPECT_FALSE(answers[2].unreachable);
  EXPECT_EQ(answers[3].status.state, ShardState::kUnknown);
  EXPECT_GE(took, 150ms) << "node 2 held its answer while its shard was pending";
  EXPECT_LT(took, 1400ms) << "node 2's change should end its hold; node 1 answered at once";
  // Node 2 goes away: its shards are unknown-and-unreachable, node 1's still answered.
  s2.reset();
  AnswersPromise p2;
  one.Set("ck/__3_0.distcp", {ShardState::kDurable, 300});
  ASSERT_TRUE(querier.Ask(paths, 500ms, &p2, 2));
  answers = p2.Get();
  EXPECT_EQ(answers[3].status, (ShardStatus{ShardState::kDurable, 300}));
  EXPECT_EQ(answers[1].status.state, ShardState::kUnknown);
  EXPECT_TRUE(answers[1].unreachable);
  EXPECT_EQ(querier.Stats().rounds, 2u);
  EXPECT_GE(querier.Stats().peer_errors, 1u);
}

TEST(PeerShardQueryMerge, DurableBeatsPendingBeatsDroppedBeatsFailedBeatsUnknown) {
  PeerShardAnswer a;
  CommitQuerier::Merge({ShardState::kFailed, 0}, &a);
  EXPECT_EQ(a.status.state, ShardState::kFailed);
  CommitQuerier::Merge({ShardState::kUnknown, 0}, &a);
  EXPECT_EQ(a.status.state, ShardState::kFailed);
  CommitQuerier::Merge({ShardState::kDropped, 0}, &a);
  EXPECT_EQ(a.status.state, ShardState::kDropped);
  CommitQuerier::Merge({ShardState::kPending, 0}, &a);
  EXPECT_EQ(a.status.state, ShardState::kPending);
  CommitQuerier::Merge({ShardState::kDurable, 5}, &a);
  CommitQuerier::Merge({ShardState::kDurable, 9}, &a);
  CommitQuerier::Merge({ShardState::kPending, 0}, &a);
  EXPECT_EQ(a.status, (ShardStatus{ShardState::kDurable, 9}));
}

TEST(PeerProtocol, ProofsDependOnRoleSecretNodeAndNonces) {
  Nonce a{}, b{};
  b[0] = 1;
  Proof base = ComputeProof(kSecret, ProofRole::kClient, "n:1", a, b);
  EXPECT_TRUE(ProofEquals(base, ComputeProof(kSecret, ProofRole::kClient, "n:1", a, b)));
  EXPECT_FALSE(ProofEquals(base, ComputeProof(kSecret, ProofRole::kServer, "n:1", a, b)));
  EXPECT_FALSE(
      ProofEquals(base, ComputeProof("other secret 1234567", ProofRole::kClient, "n:1", a, b)));
  EXPECT_FALSE(ProofEquals(base, ComputeProof(kSecret, ProofRole::kClient, "n:2", a, b)));
  EXPECT_FALSE(ProofEquals(base, ComputeProof(kSecret, ProofRole::kClient, "n:1", b, a)));
  auto n1 = RandomNonce(), n2 = RandomNonce();
  ASSERT_TRUE(n1.ok() && n2.ok());
  EXPECT_NE(*n1, *n2);
}

TEST(PeerProtocol, SecretFileIsTrimmedAndMustBeLongEnough) {
  char tmpl[] = "/tmp/peer_secret_XXXXXX";
  int fd = ::mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  std::string good = "0123456789abcdef-xyz\n\n";
  ASSERT_EQ(::write(fd, good.data(), good.size()), ssize_t(good.size()));
  ::close(fd);
  auto s = ReadSecretFile(tmpl);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(*s, "0123456789abcdef-xyz");
  std::ofstream(tmpl, std::ios::trunc) << "short\n";
  EXPECT_EQ(ReadSecretFile(tmpl).status().code(), Code::kInvalid);
  ::unlink(tmpl);
  EXPECT_EQ(ReadSecretFile(tmpl).status().code(), Code::kNotFound);
}

TEST(PeerProtocol, HostPortParsing) {
  auto a = SplitHostPort("node7:7070");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->first, "node7");
  EXPECT_EQ(a->second, 7070);
  auto v6 = SplitHostPort("[::1]:80");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->first, "::1");
  EXPECT_FALSE(SplitHostPort("node7").ok());
  EXPECT_FALSE(SplitHostPort("node7:").ok());
  EXPECT_FALSE(SplitHostPort("node7:70000").ok());
  EXPECT_FALSE(SplitHostPort("node7:7a").ok());
}

}  // namespace
}  // namespace ckptfs::store::peer
