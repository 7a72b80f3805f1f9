#include "mount/options.h"

#include <fcntl.h>
#include <ifaddrs.h>
#include <libmount/libmount.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "ckptfs_version.h"

namespace ckptfs {
namespace {

bool IsInside(const std::string& path, const std::string& dir) {
  if (path == dir) return true;
  std::string prefix = dir == "/" ? dir : dir + "/";
  return path.compare(0, prefix.size(), prefix) == 0;
}

Result<std::string> Canonical(const std::string& path, const char* what) {
  std::error_code ec;
  auto p = std::filesystem::canonical(path, ec);
  if (ec) return Status(Code::kNotFound, std::string(what) + " " + path + ": " + ec.message());
  struct stat st;
  if (::stat(p.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Status(Code::kNotDir, std::string(what) + " " + path + " is not a directory");
  }
  return p.string();
}

}  // namespace

Result<uint64_t> ParseSize(const std::string& text) {
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) {
    return Invalid("bad size '" + text + "' (use e.g. 512M, 2G)");
  }
  size_t pos = 0;
  unsigned long long n = 0;
  try {
    n = std::stoull(text, &pos);
  } catch (...) {
    return Invalid("bad size '" + text + "'");
  }
  std::string unit = text.substr(pos);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit.size() > 1 && std::string("KMGT").find(unit[0]) != std::string::npos &&
      (unit.substr(1) == "IB" || unit.substr(1) == "B")) {
    unit = unit.substr(0, 1);
  }
  int shift = 0;
  if (unit.empty() || unit == "B") shift = 0;
  else if (unit == "K") shift = 10;
  else if (unit == "M") shift = 20;
  else if (unit == "G") shift = 30;
  else if (unit == "T") shift = 40;
  else return Invalid("bad size unit in '" + text + "' (use K, M, G or T)");
  if (shift > 0 && n > (~0ULL >> shift)) return Invalid("size too large: " + text);
  return static_cast<uint64_t>(n) << shift;
}

std::string VersionLine(const std::string& program) {
  return program + " " + CKPTFS_VERSION + " (git " + CKPTFS_GIT_COMMIT + ")";
}

bool IsMountOnlyOption(const std::string& option) {
  const std::string key = option.substr(0, option.find('='));
  static const char* const kMountOnly[] = {"_netdev", "nofail", "noauto", "auto",  "user",
                                           "users",   "nouser", "owner",  "group", "defaults",
                                           "comment", "netdev", "_rnetdev"};
  for (const char* k : kMountOnly) {
    if (key == k) return true;
  }
  return key.rfind("x-", 0) == 0;
}

namespace {

// Splits "HOST:PORT", "[V6]:PORT" or ":PORT" (all interfaces).
Status SplitListen(const std::string& text, std::string* host, int* port) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos) return Invalid("--metrics-listen wants ADDR:PORT, got " + text);
  std::string h = text.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  if (h.empty()) h = "0.0.0.0";
  const std::string p = text.substr(colon + 1);
  int value = 0;
  if (p.empty() || p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos ||
      (value = std::stoi(p)) < 1 || value > 65535) {
    return Invalid("--metrics-listen: bad port '" + p + "' (1-65535)");
  }
  *host = h;
  *port = value;
  return Status::Ok();
}

}  // namespace

Result<DaemonOptions> ParseDaemonOptions(int argc, const char* const* argv) {
  DaemonOptions o;
  CLI::App app{"ckptfs: a FUSE file system for fast, safe training checkpoints", "ckptfs"};
  app.footer(
      "Every option is also accepted as -o key=value (e.g. -o durability=strict,staging_mem=8G), "
      "as mount(8) and /etc/fstab pass them; mount-only options (_netdev, nofail, x-systemd.*) "
      "are ignored and the rest go to FUSE.");
  app.set_version_flag("--version", VersionLine("ckptfs"));
  std::string durability = "async", staging = "1G", chunk = "4M", cache = "1G";
  std::string read_ahead = "4M", direct_io = "on", write_checksums = "on", log_max = "100M";
  std::string staging_hugepages = "off", flush_direct_io = "on", fuse_splice = "on";
  std::string passthrough = "on", passthrough_min = "1M";
  app.add_option("backing_dir", o.backing_dir, "Directory that stores the files")->required();
  app.add_option("mountpoint", o.mountpoint, "Where to mount")->required();
  app.add_flag("-f,--foreground", o.foreground, "Stay in the foreground");
  app.add_option("--durability", durability, "async (default) or strict")
      ->check(CLI::IsMember({"async", "strict"}));
  app.add_option("--staging-mem", staging, "Staging memory budget, e.g. 2G (default 1G)");
  app.add_option("--chunk-size", chunk, "Staging chunk size (default 4M)");
  app.add_option("--cache-mem", cache, "Read block cache budget (default 1G; 0 disables)");
  std::string memory_ckpt_mem = "0";  // issue 42
  app.add_option("--memory-ckpt-mem", memory_ckpt_mem,
                 "Memory for memory-only directories (user.ckptfs.tier=memory): their "
                 "checkpoints never reach the backing store; a save that does not fit fails "
                 "with ENOSPC (default 0: none fit)");
  std::string retain_mem;  // issue 23
  app.add_option("--retain-mem", retain_mem,
                 "Memory that keeps the newest committed checkpoint this node wrote, to serve a "
                 "restart (default: half of --staging-mem; 0 disables)");
  app.add_option("--retain-replicas", o.retain_replicas,
                 "Copies of the retained checkpoint kept on another node: 0 or 1 (default 1 "
                 "with --peers)")
      ->check(CLI::Range(0, 1));
  app.add_option("--read-ahead", read_ahead,
                 "Kernel read-ahead of the mount, e.g. 8M (default 4M; 0 keeps the kernel's)");
  app.add_option("--cache-direct-io", direct_io,
                 "Block cache reads the backing store with O_DIRECT where it can: on|off")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--passthrough", passthrough,
                 "Reads of published files go through the kernel's FUSE passthrough (Linux "
                 "6.9+, root) where it can: on (default) or off (the daemon serves every read)")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--passthrough-min-size", passthrough_min,
                 "Smaller files are served by the daemon: a writer next to a reader of a "
                 "passed-through file waits (default 1M; 0 passes every file through)");
  app.add_option("--fuse-splice", fuse_splice,
                 "Splice requests off /dev/fuse so write payloads are copied once: on|off")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--fuse-direct-writes", o.fuse_direct_writes,
                 "Write-only opens bypass the page cache, so a write's payload is copied "
                 "once: auto (default: on from Linux 6.6, whose direct writes keep other "
                 "readers' cache coherent), on or off")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--fuse-uring", o.fuse_uring,
                 "Requests come over FUSE over io_uring (Linux 6.14+ with "
                 "CONFIG_FUSE_IO_URING), a queue per CPU: auto (default: only where the "
                 "kernel's fuse.enable_uring switch is already on), on (as root, also turns that "
                 "switch on for this mount's start alone and back off; /dev/fuse where it "
                 "cannot) or off (/dev/fuse)")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--flush-threads", o.flush_threads, "Flush threads (default 2)")
      ->check(CLI::Range(1, 256));
  app.add_option("--fuse-threads", o.fuse_threads, "Max FUSE worker threads (default 32)")
      ->check(CLI::Range(2, 1024));
  app.add_option("--commit-timeout", o.commit_timeout_s,
                 "Seconds a .metadata waits for its shards (default 600)")
      ->check(CLI::Range(1, 86400));
  app.add_option("--max-pending", o.max_pending,
                 "Async mode: journal entries (a file's publish, a rename, a delete) that may "
                 "wait for the backing store before a new file's create or truncating open "
                 "waits for room, up to a minute, instead of the backlog growing without "
                 "bound (each pending publish holds an open temp file; default 1024, 0: no "
                 "bound). It does not wait while publication is halted.")
      ->check(CLI::Range(0, 1 << 24));
  app.add_option("--stop-timeout", o.stop_timeout_s,
                 "Seconds a stop waits without progress for a halted or waiting publication "
                 "before it leaves the rest for the next start and exits 3 (default 30)")
      ->check(CLI::Range(1, 86400));
  app.add_option("--staging-backend", o.staging_backend, "auto, host or cuda")
      ->check(CLI::IsMember({"auto", "host", "cuda"}));
  app.add_option("--staging-hugepages", staging_hugepages,
                 "on: back host staging memory with transparent hugepages; off (default): "
                 "small pages, which the flush threads copy out of faster on the VMs measured")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--staging-release-after", o.staging_release_after_s,
                 "Host staging memory is pinned a chunk at a time as writes first need it; "
                 "give it back after this many seconds with nothing staged (default 0: keep "
                 "it pinned until unmount)")
      ->check(CLI::Range(0, 86400));
  app.add_option("--flush-direct-io", flush_direct_io,
                 "on (default): flush 4 KiB-aligned staged data with O_DIRECT, no page-cache "
                 "copy; off: through the page cache")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--write-checksums", write_checksums,
                 "on (default): CRC32C of written blocks while in staging, so that item "
                 "checksums need no re-read; off: items are read back after the commit")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--state-dir", o.state_dir, "Node-local state directory (outside the mount)");
  app.add_option("--log-level", o.log_level, "trace|debug|info|warn|error|off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  app.add_option("--log-file", o.log_file,
                 "Log file (default: stderr, or STATE_DIR/ckptfs.log in the background). "
                 "SIGHUP reopens it");
  app.add_option("--log-max-size", log_max, "Rotate the log file at this size (default 100M)");
  app.add_option("--log-max-files", o.log_max_files, "Rotated log files to keep (default 5)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--metrics-listen", o.metrics_listen,
                 "Serve Prometheus metrics at http://ADDR:PORT/metrics (e.g. 127.0.0.1:9464)")
      ->type_name("ADDR:PORT");
  std::string peers_list;
  app.add_option("--peers", peers_list,
                 "Peer daemons, HOST:PORT,... (the same list, in the same order, on every node; "
                 "includes this node)")
      ->type_name("HOST:PORT,...");
  app.add_option("--peers-file", o.peers_file, "File with one HOST:PORT per line (or --peers)");
  app.add_option("--node-rank", o.node_rank,
                 "This node's index in the peer list (default: the entry naming this host)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--peer-listen", o.peer_listen,
                 "Address the peer server binds (default 0.0.0.0:<this node's port>)")
      ->type_name("ADDR:PORT");
  app.add_option("--peer-secret-file", o.peer_secret_file,
                 "Shared secret of the peer daemons (16 to 4096 bytes; keep it mode 0600)");
  app.add_option("--plan", o.plan,
                 "Block ownership plan: balanced, fast or auto (default: $CKPTFS_PLAN, else auto)")
      ->check(CLI::IsMember({"balanced", "fast", "auto"}));
  app.add_option("--peer-timeout", o.peer_timeout_ms,
                 "Milliseconds a block request to a peer may take before the read falls back to "
                 "the backing store (default 5000)")
      ->check(CLI::Range(10, 600000));
  app.add_option("--peer-dead-after", o.peer_dead_after_ms,
                 "Milliseconds a peer may stay down (no connection, no heartbeat answer) before "
                 "it is declared dead and what waits for it is given up (default 15000)")
      ->check(CLI::Range(1000, 3600000));
  app.add_option("--peer-heartbeat", o.peer_heartbeat_ms,
                 "Milliseconds of idleness after which an open peer connection is pinged; a "
                 "ping unanswered within --peer-timeout marks the peer down (default 2000)")
      ->check(CLI::Range(100, 600000));
  app.add_option("--peer-max-links", o.peer_max_links,
                 "Peer connections kept open at most; past it the least recently used closes "
                 "(reads never wait for a slot). Connections are made on demand (default 64)")
      ->check(CLI::Range(1, 100000));
  // Test only (the soak, tests/e2e/test_fault_inject.py): hidden from --help; the spec is
  // parsed by store::FaultSpec::Parse at start.
  app.add_option("--fault-inject", o.fault_inject,
                 "TEST ONLY: inject EIO/ENOSPC into backing-store writes, fsyncs and renames")
      ->group("");
  // Diagnosis (the soak's check that nothing is published twice): hidden from --help.
  app.add_option("--journal-trace", o.journal_trace,
                 "Append a line per journal entry done, resumed or discarded to FILE")
      ->group("");
  std::vector<std::string> o_groups;
  app.add_option("-o", o_groups,
                 "Options, comma separated: ckptfs options as key=value, the rest for FUSE")
      ->allow_extra_args(false);

  // -o groups are taken out before CLI11 sees argv: their ckptfs keys become long options,
  // mount-only ones are dropped and the rest are FUSE options.
  std::vector<std::string> args, fuse_items;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string group;
    if (a == "-o") {
      if (i + 1 >= argc) return Invalid("-o needs an argument");
      group = argv[++i];
    } else if (a.size() > 2 && a.rfind("-o", 0) == 0) {
      group = a.substr(2);
    } else {
      args.push_back(std::move(a));
      continue;
    }
    std::stringstream ss(group);
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item.empty() || IsMountOnlyOption(item)) continue;
      const size_t eq = item.find('=');
      std::string key = item.substr(0, eq);
      for (auto& c : key) {
        if (c == '_') c = '-';
      }
      const CLI::Option* opt =
          key.size() > 1 ? app.get_option_no_throw("--" + key) : nullptr;
      if (opt != nullptr && key != "help" && key != "version") {
        args.push_back("--" + key + (eq == std::string::npos ? "" : item.substr(eq)));
      } else {
        fuse_items.push_back(item);
      }
    }
  }
  try {
    app.parse(std::vector<std::string>(args.rbegin(), args.rend()));
  } catch (const CLI::CallForHelp&) {
    o.help = true;
    o.help_text = app.help();
    return o;
  } catch (const CLI::CallForVersion&) {
    o.version = true;
    o.help_text = VersionLine("ckptfs") + "\n";
    return o;
  } catch (const CLI::ParseError& e) {
    return Invalid(e.what());
  }
  o.strict = durability == "strict";
  o.write_checksums = write_checksums == "on";
  o.staging_hugepages = staging_hugepages == "on";
  o.flush_direct_io = flush_direct_io == "on";
  o.fuse_splice = fuse_splice == "on";
  o.passthrough = passthrough == "on";
  CKPT_ASSIGN_OR_RETURN(o.staging_bytes, ParseSize(staging));
  CKPT_ASSIGN_OR_RETURN(o.chunk_bytes, ParseSize(chunk));
  CKPT_ASSIGN_OR_RETURN(o.cache_bytes, ParseSize(cache));
  CKPT_ASSIGN_OR_RETURN(o.memory_ckpt_bytes, ParseSize(memory_ckpt_mem));  // issue 42
  if (!retain_mem.empty()) {  // issue 23
    CKPT_ASSIGN_OR_RETURN(o.retain_bytes, ParseSize(retain_mem));
    o.retain_bytes_set = true;
  }
  if (!o.retain_bytes_set) o.retain_bytes = o.staging_bytes / 2;
  CKPT_ASSIGN_OR_RETURN(o.read_ahead_bytes, ParseSize(read_ahead));
  CKPT_ASSIGN_OR_RETURN(o.passthrough_min_bytes, ParseSize(passthrough_min));
  CKPT_ASSIGN_OR_RETURN(o.log_max_bytes, ParseSize(log_max));
  if (o.log_max_bytes < (64u << 10)) return Invalid("--log-max-size must be at least 64K");
  if (o.read_ahead_bytes % 4096 != 0 || o.read_ahead_bytes > (uint64_t{1} << 30)) {
    return Invalid("--read-ahead must be a multiple of 4K, at most 1G");
  }
  o.cache_direct_io = direct_io == "on";
  if (o.cache_bytes != 0 && o.cache_bytes < (1u << 20)) {
    return Invalid("--cache-mem must be 0 (off) or at least 1M");
  }
  if (o.chunk_bytes < (64u << 10) || o.chunk_bytes % 4096 != 0 || o.chunk_bytes > (256u << 20)) {
    return Invalid("--chunk-size must be a multiple of 4K between 64K and 256M");
  }
  if (o.staging_bytes < o.chunk_bytes) {
    return Invalid("--staging-mem must hold at least one chunk (" + chunk + ")");
  }
  if (!o.metrics_listen.empty()) {
    CKPT_RETURN_IF_ERROR(SplitListen(o.metrics_listen, &o.metrics_host, &o.metrics_port));
  }
  if (!peers_list.empty()) {
    std::stringstream ss(peers_list);
    std::string item;
    while (std::getline(ss, item, ',')) {
      while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.pop_back();
      size_t b = 0;
      while (b < item.size() && std::isspace(static_cast<unsigned char>(item[b]))) ++b;
      if (b < item.size()) o.peers.push_back(item.substr(b));
    }
    if (o.peers.empty()) return Invalid("--peers: empty peer list");
  }
  if (!o.peers.empty() && !o.peers_file.empty()) {
    return Invalid("give --peers or --peers-file, not both");
  }
  if (o.plan.empty()) {
    const char* env = std::getenv("CKPTFS_PLAN");
    o.plan = env != nullptr && *env != '\0' ? env : "auto";
    if (o.plan != "balanced" && o.plan != "fast" && o.plan != "auto") {
      return Invalid("CKPTFS_PLAN=" + o.plan + ": want balanced, fast or auto");
    }
  }
  if (o.peers.empty() && o.peers_file.empty()) {
    if (o.node_rank >= 0 || !o.peer_listen.empty() || !o.peer_secret_file.empty()) {
      return Invalid("--node-rank, --peer-listen and --peer-secret-file need --peers or "
                     "--peers-file");
    }
  } else if (!o.peers.empty()) {
    CKPT_RETURN_IF_ERROR(ValidatePeerList(o.peers));
  }
  o.fuse_options = std::move(fuse_items);
  return o;
}

namespace {

// "HOST:PORT" or "[V6]:PORT" split, port 1-65535 (0 too when `listen`).
Status SplitPeer(const std::string& text, std::string* host, int* port, bool listen = false) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return Invalid("peer '" + text + "': want HOST:PORT");
  }
  std::string h = text.substr(0, colon);
  if (h.front() == '[') {
    if (h.size() < 3 || h.back() != ']') return Invalid("peer '" + text + "': bad [ADDR]");
    h = h.substr(1, h.size() - 2);
  } else if (h.find(':') != std::string::npos) {
    return Invalid("peer '" + text + "': write an IPv6 address as [ADDR]:PORT");
  }
  const std::string p = text.substr(colon + 1);
  int value = -1;
  if (!p.empty() && p.size() <= 5 && p.find_first_not_of("0123456789") == std::string::npos) {
    value = std::stoi(p);
  }
  if (value < (listen ? 0 : 1) || value > 65535) {
    return Invalid("peer '" + text + "': bad port '" + p + "' (1-65535)");
  }
  for (char c : h) {
    if (std::isspace(static_cast<unsigned char>(c)) || c == ',' || c == '/') {
      return Invalid("peer '" + text + "': bad host name");
    }
  }
  *host = h;
  *port = value;
  return Status::Ok();
}

}  // namespace

Result<std::vector<std::string>> ParsePeersText(const std::string& text) {
  std::vector<std::string> peers;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) {
    if (size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    size_t b = 0, e = line.size();
    while (b < e && std::isspace(static_cast<unsigned char>(line[b]))) ++b;
    while (e > b && std::isspace(static_cast<unsigned char>(line[e - 1]))) --e;
    if (b < e) peers.push_back(line.substr(b, e - b));
  }
  if (peers.empty()) return Invalid("peers file lists no peer");
  return peers;
}

Status ValidatePeerList(const std::vector<std::string>& peers) {
  if (peers.empty()) return Invalid("empty peer list");
  if (peers.size() > 65535) return Invalid("too many peers (at most 65535)");
  std::set<std::string> seen;
  for (const std::string& p : peers) {
    std::string host;
    int port = 0;
    CKPT_RETURN_IF_ERROR(SplitPeer(p, &host, &port));
    if (!seen.insert(p).second) return Invalid("peer " + p + " is listed twice");
  }
  return Status::Ok();
}

Result<int> FindOwnPeerIndex(const std::vector<std::string>& peers) {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  const std::string full = name;
  const std::string short_name = full.substr(0, full.find('.'));
  // Addresses of this network namespace's interfaces.
  std::set<std::string> local;
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr) continue;
      char buf[NI_MAXHOST];
      const int family = i->ifa_addr->sa_family;
      if (family != AF_INET && family != AF_INET6) continue;
      const socklen_t len =
          family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
      if (::getnameinfo(i->ifa_addr, len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) == 0) {
        std::string a = buf;
        local.insert(a.substr(0, a.find('%')));
      }
    }
    ::freeifaddrs(ifs);
  }
  std::vector<int> matches;
  for (size_t i = 0; i < peers.size(); ++i) {
    std::string host;
    int port = 0;
    if (!SplitPeer(peers[i], &host, &port).ok()) continue;
    bool mine = !full.empty() && (host == full || host == short_name);
    if (!mine) {
      addrinfo hints{};
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* res = nullptr;
      if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) == 0) {
        for (addrinfo* r = res; r != nullptr && !mine; r = r->ai_next) {
          char buf[NI_MAXHOST];
          if (::getnameinfo(r->ai_addr, r->ai_addrlen, buf, sizeof(buf), nullptr, 0,
                            NI_NUMERICHOST) == 0) {
            std::string a = buf;
            mine = local.count(a.substr(0, a.find('%'))) > 0;
          }
        }
        ::freeaddrinfo(res);
      }
    }
    if (mine) matches.push_back(static_cast<int>(i));
  }
  if (matches.empty()) {
    return Status(Code::kNotFound, "no entry of the peer list names this host (" + full +
                                       ") or one of its addresses; pass --node-rank");
  }
  if (matches.size() > 1) {
    return Invalid("several entries of the peer list name this host (" + peers[matches[0]] +
                   ", " + peers[matches[1]] + "); pass --node-rank");
  }
  return matches[0];
}

bool IsMountHelperName(const char* argv0) {
  if (argv0 == nullptr) return false;
  std::string name = argv0;
  const size_t slash = name.rfind('/');
  if (slash != std::string::npos) name = name.substr(slash + 1);
  return name.rfind("mount.", 0) == 0;
}

Result<DaemonOptions> ParseMountHelperArgs(int argc, const char* const* argv) {
  if (argc < 3) {
    return Invalid("usage: mount.fuse.ckptfs BACKING_DIR MOUNTPOINT [-sfnv] [-o OPTIONS]");
  }
  std::vector<std::string> args = {"ckptfs"};
  bool fake = false;
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-o" || a == "-t" || a == "-N") {
      if (i + 1 >= argc) return Invalid(a + " needs an argument");
      if (a == "-o") {
        args.push_back("-o");
        args.push_back(argv[i + 1]);
      }
      ++i;
    } else if (a.rfind("-o", 0) == 0) {
      args.push_back(a);
    } else if (a.size() >= 2 && a[0] == '-' &&
               a.find_first_not_of("sfnvh", 1) == std::string::npos) {
      if (a.find('f') != std::string::npos) fake = true;  // mount -f: do everything but mount
      if (a.find('h') != std::string::npos) args.push_back("--help");
    } else {
      return Invalid("mount helper: unexpected argument '" + a + "'");
    }
  }
  args.push_back(argv[1]);
  args.push_back(argv[2]);
  std::vector<const char*> cargv;
  for (const auto& a : args) cargv.push_back(a.c_str());
  CKPT_ASSIGN_OR_RETURN(DaemonOptions o,
                        ParseDaemonOptions(static_cast<int>(cargv.size()), cargv.data()));
  o.fake = fake;
  o.foreground = false;  // mount(8) waits for the helper; the daemon must go on after it.
  return o;
}

namespace {

// Whether the FUSE file system mounted at `path` has no daemon any more: a getattr that
// must reach the daemon (AT_STATX_FORCE_SYNC; a plain stat may be answered from the
// kernel's attribute cache for a while after the daemon died) fails with ENOTCONN. Asked
// on a thread of its own: a live daemon that hangs must not hang this start too (after
// 2 s it counts as live, and the start fails with "busy").
bool FuseDaemonGone(const std::string& path) {
  auto answer = std::make_shared<std::promise<int>>();
  std::future<int> got = answer->get_future();
  std::thread([path, answer] {
    struct statx sx;
    const int rc = ::statx(AT_FDCWD, path.c_str(), AT_STATX_FORCE_SYNC, STATX_TYPE, &sx);
    answer->set_value(rc == 0 ? 0 : errno);
  }).detach();
  if (got.wait_for(std::chrono::seconds(2)) != std::future_status::ready) return false;
  const int err = got.get();
  return err == ENOTCONN || err == ECONNABORTED;
}

// The file system type of the topmost mount at `target` (compared as a string: no stat,
// which would block on a hung mount), or nullopt when nothing is mounted there.
std::optional<std::string> MountedTypeAt(const std::string& target) {
  std::unique_ptr<libmnt_table, decltype(&mnt_unref_table)> table(mnt_new_table(),
                                                                   &mnt_unref_table);
  if (!table || mnt_table_parse_file(table.get(), "/proc/self/mountinfo") != 0) {
    return std::nullopt;
  }
  libmnt_iter* iter = mnt_new_iter(MNT_ITER_BACKWARD);  // the last one listed is on top
  std::optional<std::string> type;
  libmnt_fs* fs = nullptr;
  while (!type && mnt_table_next_fs(table.get(), iter, &fs) == 0) {
    const char* t = mnt_fs_get_target(fs);
    if (t == nullptr || target != t) continue;
    const char* fstype = mnt_fs_get_fstype(fs);
    type = fstype != nullptr ? fstype : "";
  }
  mnt_free_iter(iter);
  return type;
}

// `path` when it is the mountpoint of a FUSE file system whose daemon is gone, made
// absolute and canonical up to its last name (which cannot be resolved); nullopt
// otherwise.
std::optional<std::string> DeadFuseMount(const std::string& path) {
  std::error_code ec;
  std::filesystem::path abs = std::filesystem::absolute(path, ec).lexically_normal();
  if (ec) return std::nullopt;
  if (!abs.has_filename()) abs = abs.parent_path();  // a trailing slash
  const std::filesystem::path parent = std::filesystem::canonical(abs.parent_path(), ec);
  if (ec) return std::nullopt;
  const std::string target = (parent / abs.filename()).string();
  const std::optional<std::string> type = MountedTypeAt(target);
  if (!type || !type->starts_with("fuse") || !FuseDaemonGone(target)) return std::nullopt;
  return target;
}

}  // namespace

bool IsMountPoint(const std::string& path) { return MountedTypeAt(path).has_value(); }

Status ValidateDaemonOptions(DaemonOptions* o) {
  CKPT_ASSIGN_OR_RETURN(o->backing_dir, Canonical(o->backing_dir, "backing dir"));
  if (std::optional<std::string> dead = DeadFuseMount(o->mountpoint)) {
    o->mountpoint = *dead;
    o->replaces_dead_mount = true;
  } else {
    CKPT_ASSIGN_OR_RETURN(o->mountpoint, Canonical(o->mountpoint, "mountpoint"));
    if (IsMountPoint(o->mountpoint)) {
      return Status(Code::kBusy, "mountpoint " + o->mountpoint + " is busy (already mounted)");
    }
  }
  if (IsInside(o->mountpoint, o->backing_dir) || IsInside(o->backing_dir, o->mountpoint)) {
    return Invalid("backing dir and mountpoint must not contain each other");
  }
  if (o->state_dir.empty()) {
    std::string name = o->mountpoint;
    for (auto& c : name) {
      if (c == '/') c = '_';
    }
    o->state_dir = "/var/tmp/ckptfs" + std::string("/state") + name;
  }
  std::error_code ec;
  std::string state = std::filesystem::weakly_canonical(
      std::filesystem::absolute(o->state_dir), ec).string();
  if (ec) return Invalid("state dir " + o->state_dir + ": " + ec.message());
  if (IsInside(state, o->mountpoint)) {
    return Invalid("state dir " + state + " is inside the mount; it must be node-local storage");
  }
  if (IsInside(state, o->backing_dir)) {
    return Invalid("state dir " + state + " is inside the backing dir; keep it node-local");
  }
  o->state_dir = state;
  if (!o->peers_file.empty()) {
    std::ifstream in(o->peers_file);
    if (!in) {
      return Status(Code::kNotFound, "--peers-file " + o->peers_file + ": " +
                                         std::strerror(errno));
    }
    std::stringstream text;
    text << in.rdbuf();
    auto peers = ParsePeersText(text.str());
    if (!peers.ok()) return Invalid("--peers-file " + o->peers_file + ": " + peers.status().message());
    o->peers = std::move(peers).value();
    if (auto st = ValidatePeerList(o->peers); !st.ok()) {
      return Invalid("--peers-file " + o->peers_file + ": " + st.message());
    }
  }
  if (!o->peers.empty()) {
    if (o->node_rank < 0) {
      auto own = FindOwnPeerIndex(o->peers);
      if (!own.ok()) return Invalid("--peers: " + own.status().message());
      o->node_rank = *own;
    }
    if (o->node_rank >= static_cast<int>(o->peers.size())) {
      return Invalid("--node-rank " + std::to_string(o->node_rank) + " is out of range (" +
                     std::to_string(o->peers.size()) + " peers)");
    }
    if (o->peer_secret_file.empty()) {
      return Invalid("--peers needs --peer-secret-file (the shared secret peers prove)");
    }
    if (o->peer_listen.empty()) {
      const std::string& own = o->peers[static_cast<size_t>(o->node_rank)];
      o->peer_listen = "0.0.0.0:" + own.substr(own.rfind(':') + 1);
    } else {
      std::string host;
      int port = 0;
      if (auto st = SplitPeer(o->peer_listen, &host, &port, /*listen=*/true); !st.ok()) {
        return Invalid("--peer-listen: " + st.message());
      }
    }
    if (o->cache_bytes == 0) return Invalid("--peers needs the block cache (--cache-mem > 0)");
  }
  if (!o->log_file.empty()) {
    o->log_file = std::filesystem::weakly_canonical(std::filesystem::absolute(o->log_file), ec)
                      .string();
    if (ec) return Invalid("log file " + o->log_file + ": " + ec.message());
    if (IsInside(o->log_file, o->mountpoint)) return Invalid("log file is inside the mount");
  }
  return Status::Ok();
}

}  // namespace ckptfs
