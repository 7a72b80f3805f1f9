// ckptfs-peer-tool: runs one side of the peer transport outside the daemon, for the
// two-process tests and the benchmarks (scripts/bench/bench_peer.py, bench_plan.py).
//
//   serve      a PeerServer over SyntheticProvider files f0..fN-1; prints "PORT <n>", serves
//              until SIGTERM/SIGINT, then prints its stats and CPU time as one JSON line.
//   fetch      a PeerClient; T threads fetch blocks of the synthetic files for S seconds;
//              prints throughput and CPU time as JSON. Every block's CRC32C is verified;
//              --verify also compares every byte.
//   tcp-serve, tcp-fetch   the same load over plain TCP sockets (one connection per thread,
//              CRC32C on both sides too): the baseline UCX is measured against.
//   plan       builds an ownership plan of N synthetic items on K nodes and prints its time
//              and balance as JSON.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "store/peer/peer_client.h"
#include "store/peer/peer_server.h"
#include "store/peer/peers.h"
#include "store/peer/plan.h"
#include "store/peer/protocol.h"
#include "store/peer/synthetic_provider.h"
#include "store/peer/ucx_worker.h"
#include "store/primitives/crc32c.h"

namespace ckptfs::store::peer {
namespace {

using Clock = std::chrono::steady_clock;

struct Common {
  int files = 4;
  uint64_t file_size = 256ull << 20;
};

std::map<std::string, std::pair<uint64_t, int64_t>> Files(const Common& c) {
  std::map<std::string, std::pair<uint64_t, int64_t>> files;
  for (int i = 0; i < c.files; ++i) files["f" + std::to_string(i)] = {c.file_size, 1};
  return files;
}

double CpuSeconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

void BlockStopSignals(sigset_t* set) {
  sigemptyset(set);
  sigaddset(set, SIGTERM);
  sigaddset(set, SIGINT);
  pthread_sigmask(SIG_BLOCK, set, nullptr);
}

int Fail(const Status& st) {
  std::fprintf(stderr, "ckptfs-peer-tool: %s\n", st.ToString().c_str());
  return 1;
}

int Serve(const Common& c, const std::string& listen, const std::string& node_id,
          const std::string& secret_file, const std::vector<std::string>& allow, int threads,
          int delay_ms, int corrupt) {
  sigset_t set;
  BlockStopSignals(&set);
  auto secret = ReadSecretFile(secret_file);
  if (!secret.ok()) return Fail(secret.status());
  SyntheticProvider provider(Files(c));
  provider.SetDelayMs(delay_ms);
  provider.CorruptNext(corrupt);
  PeerServerOptions o;
  o.listen = listen;
  o.node_id = node_id;
  o.secret = *secret;
  o.allowed_peers = allow;
  o.serve_threads = threads;
  auto server = PeerServer::Create(o, &provider);
  if (!server.ok()) return Fail(server.status());
  std::printf("PORT %u\n", (*server)->port());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  PeerServerStats s = (*server)->stats();
  server->reset();
  std::printf(
      "{\"blocks_served\": %lu, \"bytes_served\": %lu, \"refused\": %lu, "
      "\"authenticated\": %lu, \"cpu_s\": %.3f}\n",
      s.blocks_served, s.bytes_served, s.refused, s.authenticated, CpuSeconds());
  return 0;
}

// Runs `threads` workers for `seconds`, each calling `one(thread, iteration)`, which returns
// bytes moved or -1 on error; prints the JSON result.
template <typename F>
int Drive(const char* transport, int threads, double seconds, uint64_t block, F one) {
  std::atomic<uint64_t> bytes{0}, blocks{0}, errors{0};
  std::atomic<bool> stop{false};
  double cpu0 = CpuSeconds();
  auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      for (uint64_t i = 0; !stop.load(std::memory_order_relaxed); ++i) {
        int64_t n = one(t, i);
        if (n < 0) {
          errors.fetch_add(1);
          if (errors.load() > 100) return;
          continue;
        }
        bytes.fetch_add(n);
        blocks.fetch_add(1);
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& t : ts) t.join();
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  double cpu = CpuSeconds() - cpu0;
  std::printf(
      "{\"transport\": \"%s\", \"threads\": %d, \"block_bytes\": %lu, \"seconds\": %.3f, "
      "\"bytes\": %lu, \"blocks\": %lu, \"errors\": %lu, \"MBps\": %.1f, "
      "\"client_cpu_s\": %.3f}\n",
      transport, threads, block, secs, bytes.load(), blocks.load(), errors.load(),
      bytes.load() / secs / 1e6, cpu);
  return errors.load() == 0 ? 0 : 1;
}

int Fetch(const Common& c, const std::string& server, const std::string& node_id,
          const std::string& secret_file, uint64_t block, int threads, double seconds,
          bool verify) {
  auto secret = ReadSecretFile(secret_file);
  if (!secret.ok()) return Fail(secret.status());
  PeerClientOptions o;
  o.server = server;
  o.node_id = node_id;
  o.secret = *secret;
  auto client = PeerClient::Connect(o);
  if (!client.ok()) return Fail(client.status());
  SyntheticProvider expect(Files(c));
  uint64_t blocks_per_file = c.file_size / block;
  std::vector<std::vector<char>> bufs(threads, std::vector<char>(block)),
      want(threads, std::vector<char>(verify ? block : 0));
  return Drive("ucx", threads, seconds, block, [&](int t, uint64_t i) -> int64_t {
    uint64_t k = (i * threads + t) % (blocks_per_file * c.files);
    BlockId id{"f" + std::to_string(k % c.files), c.file_size, 1};
    uint64_t off = (k / c.files) * block;
    auto got = (*client)->Fetch(id, off, std::span<char>(bufs[t]));
    if (!got.ok()) {
      std::fprintf(stderr, "fetch: %s\n", got.status().ToString().c_str());
      return -1;
    }
    if (verify) {
      expect.Fill(id.path, off, std::span<char>(want[t]).first(*got));
      if (std::memcmp(want[t].data(), bufs[t].data(), *got) != 0) return -1;
    }
    return static_cast<int64_t>(*got);
  });
}

bool WriteAll(int fd, const void* p, size_t n) {
  auto* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// TCP baseline wire: request {file u32, pad u32, offset u64, length u64}; reply
// {crc u32, pad u32, length u64} + bytes.
int TcpServe(const Common& c, const std::string& listen) {
  sigset_t set;
  BlockStopSignals(&set);
  auto hp = SplitHostPort(listen);
  if (!hp.ok()) return Fail(hp.status());
  auto addr = ResolveSockAddr(hp->first, hp->second);
  if (!addr.ok()) return Fail(addr.status());
  int ls = ::socket(addr->storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(ls, addr->get(), addr->length) != 0 || ::listen(ls, 64) != 0) {
    return Fail(Status::FromErrno(errno, "tcp-serve bind/listen " + listen));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(ls, reinterpret_cast<sockaddr*>(&bound), &len);
  std::printf("PORT %u\n", PortOf(bound));
  std::fflush(stdout);
  SyntheticProvider provider(Files(c));
  std::thread acceptor([&] {
    while (true) {
      int fd = ::accept4(ls, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      std::thread([fd, &provider, &c] {
        std::vector<char> buf;
        uint64_t req[3];
        while (ReadAll(fd, req, sizeof(req))) {
          uint32_t file = static_cast<uint32_t>(req[0]);
          buf.resize(req[2]);
          BlockId id{"f" + std::to_string(file), c.file_size, 1};
          auto r = provider.ReadBlock(id, req[1], std::span<char>(buf));
          uint64_t n = r.ok() ? r->bytes : 0;
          uint64_t hdr[2] = {Crc32c(buf.data(), n), n};
          if (!WriteAll(fd, hdr, sizeof(hdr)) || !WriteAll(fd, buf.data(), n)) break;
        }
        ::close(fd);
      }).detach();  // the process exits on SIGTERM; a benchmark server, not daemon code
    }
  });
  acceptor.detach();
  int sig = 0;
  sigwait(&set, &sig);
  std::printf("{\"cpu_s\": %.3f}\n", CpuSeconds());
  std::fflush(stdout);
  ::_exit(0);
}

int TcpFetch(const Common& c, const std::string& server, uint64_t block, int threads,
             double seconds) {
  auto hp = SplitHostPort(server);
  if (!hp.ok()) return Fail(hp.status());
  auto addr = ResolveSockAddr(hp->first, hp->second);
  if (!addr.ok()) return Fail(addr.status());
  std::vector<int> fds;
  for (int t = 0; t < threads; ++t) {
    int fd = ::socket(addr->storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (::connect(fd, addr->get(), addr->length) != 0) {
      return Fail(Status::FromErrno(errno, "tcp-fetch connect " + server));
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    fds.push_back(fd);
  }
  uint64_t blocks_per_file = c.file_size / block;
  std::vector<std::vector<char>> bufs(threads, std::vector<char>(block));
  int rc = Drive("tcp", threads, seconds, block, [&](int t, uint64_t i) -> int64_t {
    uint64_t k = (i * threads + t) % (blocks_per_file * c.files);
    uint64_t req[3] = {k % c.files, (k / c.files) * block, block};
    uint64_t hdr[2];
    if (!WriteAll(fds[t], req, sizeof(req)) || !ReadAll(fds[t], hdr, sizeof(hdr)) ||
        hdr[1] > block || !ReadAll(fds[t], bufs[t].data(), hdr[1])) {
      return -1;
    }
    if (Crc32c(bufs[t].data(), hdr[1]) != hdr[0]) return -1;
    return static_cast<int64_t>(hdr[1]);
  });
  for (int fd : fds) ::close(fd);
  return rc;
}

int PlanBench(uint64_t items, uint32_t nodes, const std::string& mode_name, uint64_t seed,
              int repeat) {
  auto mode = ParsePlanMode(mode_name);
  if (!mode.ok()) return Fail(mode.status());
  std::vector<PlanItem> input = SyntheticPlanItems(items, nodes, seed);
  std::vector<std::string> names;
  for (uint32_t n = 0; n < nodes; ++n) names.push_back("node" + std::to_string(n) + ":7070");
  PlanOptions o;
  o.mode = *mode;
  double best = 1e30;
  Result<OwnershipPlan> plan = Status(Code::kInternal, "not run");
  for (int r = 0; r < repeat; ++r) {
    auto t0 = Clock::now();
    plan = BuildPlan(input, names, o);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    if (!plan.ok()) return Fail(plan.status());
  }
  PlanBalance b = plan->Balance();
  std::printf(
      "{\"items\": %lu, \"nodes\": %u, \"mode\": \"%s\", \"mode_used\": \"%s\", "
      "\"plan_ms\": %.3f, \"max_over_mean\": %.4f, \"total_bytes\": %lu}\n",
      items, nodes, mode_name.c_str(), std::string(PlanModeName(plan->mode())).c_str(), best * 1e3,
      b.max_over_mean, b.total_bytes);
  return 0;
}

}  // namespace
}  // namespace ckptfs::store::peer

int main(int argc, char** argv) {
  using namespace ckptfs::store::peer;
  CLI::App app("ckptfs peer transport and plan tool (tests and benchmarks)");
  app.require_subcommand(1);
  Common c;
  std::string listen = "127.0.0.1:0", server, node_id = "peer-tool", secret_file, mode = "balanced";
  std::vector<std::string> allow;
  int threads = 4, delay_ms = 0, corrupt = 0, repeat = 3;
  uint64_t block = 1 << 20, items = 10000, seed = 1;
  uint32_t nodes = 16;
  double seconds = 5;
  bool verify = false;
  auto add_files = [&](CLI::App* s) {
    s->add_option("--files", c.files);
    s->add_option("--file-size", c.file_size);
  };
  auto* serve = app.add_subcommand("serve");
  add_files(serve);
  serve->add_option("--listen", listen);
  serve->add_option("--node-id", node_id);
  serve->add_option("--secret-file", secret_file)->required();
  serve->add_option("--allow", allow)->delimiter(',');
  serve->add_option("--threads", threads);
  serve->add_option("--delay-ms", delay_ms);
  serve->add_option("--corrupt", corrupt);
  auto* fetch = app.add_subcommand("fetch");
  add_files(fetch);
  fetch->add_option("--server", server)->required();
  fetch->add_option("--node-id", node_id);
  fetch->add_option("--secret-file", secret_file)->required();
  fetch->add_option("--block", block);
  fetch->add_option("--threads", threads);
  fetch->add_option("--seconds", seconds);
  fetch->add_flag("--verify", verify);
  auto* tserve = app.add_subcommand("tcp-serve");
  add_files(tserve);
  tserve->add_option("--listen", listen);
  auto* tfetch = app.add_subcommand("tcp-fetch");
  add_files(tfetch);
  tfetch->add_option("--server", server)->required();
  tfetch->add_option("--block", block);
  tfetch->add_option("--threads", threads);
  tfetch->add_option("--seconds", seconds);
  auto* plan = app.add_subcommand("plan");
  plan->add_option("--items", items);
  plan->add_option("--nodes", nodes);
  plan->add_option("--mode", mode);
  plan->add_option("--seed", seed);
  plan->add_option("--repeat", repeat);
  CLI11_PARSE(app, argc, argv);
  // Logs go to stderr: stdout carries the PORT line and the JSON results.
  if (auto st = ckptfs::SetupLogging(
          std::getenv("CKPTFS_LOG_LEVEL") ? std::getenv("CKPTFS_LOG_LEVEL") : "warn", "");
      !st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 2;
  }
  if (*serve) return Serve(c, listen, node_id, secret_file, allow, threads, delay_ms, corrupt);
  if (*fetch) return Fetch(c, server, node_id, secret_file, block, threads, seconds, verify);
  if (*tserve) return TcpServe(c, listen);
  if (*tfetch) return TcpFetch(c, server, block, threads, seconds);
  return PlanBench(items, nodes, mode, seed, repeat);
}
