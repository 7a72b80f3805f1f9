#include "store/primitives/fault_injection.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace ckptfs::store {
namespace {

constexpr const char* kOpNames[] = {"pwrite", "fsync", "dirsync", "rename"};

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

Result<double> ParseNumber(const std::string& key, const std::string& value) {
  double v = 0;
  const char* end = value.data() + value.size();
  auto [p, ec] = std::from_chars(value.data(), end, v);
  if (ec != std::errc() || p != end || value.empty() || !std::isfinite(v) || v < 0) {
    return Status(Code::kInvalid, "--fault-inject: " + key + "=" + value +
                                      " is not a number >= 0");
  }
  return v;
}

Result<double> ParseRate(const std::string& key, const std::string& value) {
  CKPT_ASSIGN_OR_RETURN(double v, ParseNumber(key, value));
  if (v > 1) {
    return Status(Code::kInvalid, "--fault-inject: " + key + "=" + value +
                                      " is a probability, between 0 and 1");
  }
  return v;
}

// "4096", "64K", "512M", "2G": powers of 1024 (the daemon's ParseSize lives in mount/).
Result<uint64_t> ParseBytes(const std::string& key, const std::string& value) {
  uint64_t mult = 1;
  std::string digits = value;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'K': case 'k': mult = uint64_t{1} << 10; break;
      case 'M': case 'm': mult = uint64_t{1} << 20; break;
      case 'G': case 'g': mult = uint64_t{1} << 30; break;
      default: break;
    }
    if (mult != 1) digits.pop_back();
  }
  uint64_t v = 0;
  const char* end = digits.data() + digits.size();
  auto [p, ec] = std::from_chars(digits.data(), end, v);
  if (ec != std::errc() || p != end || digits.empty() ||
      v > std::numeric_limits<uint64_t>::max() / mult) {
    return Status(Code::kInvalid, "--fault-inject: " + key + "=" + value +
                                      " is not a size (bytes, or with K, M or G)");
  }
  return v * mult;
}

}  // namespace

Result<FaultSpec> FaultSpec::Parse(const std::string& text) {
  FaultSpec s;
  std::stringstream ss(text);
  std::string item;
  bool any = false;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      return Status(Code::kInvalid, "--fault-inject: '" + item + "' is not key=value");
    }
    const std::string key = item.substr(0, eq);
    const std::string value = item.substr(eq + 1);
    any = true;
    if (key == "seed") {
      const char* end = value.data() + value.size();
      auto [p, ec] = std::from_chars(value.data(), end, s.seed);
      if (ec != std::errc() || p != end || value.empty()) {
        return Status(Code::kInvalid, "--fault-inject: seed=" + value + " is not an integer");
      }
    } else if (key == "eio_write") {
      CKPT_ASSIGN_OR_RETURN(s.eio_write, ParseRate(key, value));
    } else if (key == "eio_fsync") {
      CKPT_ASSIGN_OR_RETURN(s.eio_fsync, ParseRate(key, value));
    } else if (key == "eio_dirsync") {
      CKPT_ASSIGN_OR_RETURN(s.eio_dirsync, ParseRate(key, value));
    } else if (key == "eio_rename") {
      CKPT_ASSIGN_OR_RETURN(s.eio_rename, ParseRate(key, value));
    } else if (key == "enospc_write") {
      CKPT_ASSIGN_OR_RETURN(s.enospc_write, ParseRate(key, value));
    } else if (key == "partial") {
      if (value != "0" && value != "1") {
        return Status(Code::kInvalid, "--fault-inject: partial=" + value + " is not 0 or 1");
      }
      s.partial = value == "1";
    } else if (key == "enospc_after") {
      CKPT_ASSIGN_OR_RETURN(s.enospc_after, ParseBytes(key, value));
    } else if (key == "enospc_for") {
      CKPT_ASSIGN_OR_RETURN(s.enospc_for_s, ParseNumber(key, value));
    } else if (key == "burst_on") {
      CKPT_ASSIGN_OR_RETURN(s.burst_on_s, ParseNumber(key, value));
    } else if (key == "burst_off") {
      CKPT_ASSIGN_OR_RETURN(s.burst_off_s, ParseNumber(key, value));
    } else {
      return Status(Code::kInvalid,
                    "--fault-inject: unknown key '" + key +
                        "' (known: seed, eio_write, eio_fsync, eio_dirsync, eio_rename, "
                        "enospc_write, partial, enospc_after, enospc_for, burst_on, burst_off)");
    }
  }
  if (!any) return Status(Code::kInvalid, "--fault-inject: empty spec");
  if (s.eio_write + s.enospc_write > 1) {
    return Status(Code::kInvalid, "--fault-inject: eio_write + enospc_write exceed 1");
  }
  if ((s.burst_on_s > 0) != (s.burst_off_s > 0)) {
    return Status(Code::kInvalid, "--fault-inject: burst_on and burst_off go together");
  }
  return s;
}

std::string FaultSpec::ToString() const {
  std::ostringstream o;
  o << "seed=" << seed << ",eio_write=" << eio_write << ",eio_fsync=" << eio_fsync
    << ",eio_dirsync=" << eio_dirsync << ",eio_rename=" << eio_rename
    << ",enospc_write=" << enospc_write << ",partial=" << (partial ? 1 : 0);
  if (enospc_after > 0) o << ",enospc_after=" << enospc_after << ",enospc_for=" << enospc_for_s;
  if (burst_on_s > 0) o << ",burst_on=" << burst_on_s << ",burst_off=" << burst_off_s;
  return o.str();
}

Result<std::unique_ptr<FaultInjectingBackingDir>> FaultInjectingBackingDir::Open(
    const std::string& root_path, const FaultSpec& spec) {
  int fd = ::open(root_path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "backing dir " + root_path);
  spdlog::warn("fault injection is on (test only): {} under backing dir {}", spec.ToString(),
               root_path);
  return std::unique_ptr<FaultInjectingBackingDir>(
      new FaultInjectingBackingDir(root_path, UniqueFd(fd), spec));
}

FaultInjectingBackingDir::FaultInjectingBackingDir(std::string root_path, UniqueFd root,
                                                   const FaultSpec& spec)
    : BackingDir(std::move(root_path), std::move(root)),
      spec_(spec),
      start_(std::chrono::steady_clock::now()),
      burst_phase_s_(spec.burst_on_s > 0
                         ? static_cast<double>(SplitMix64(spec.seed ^ 0xb0b0b0b0ULL) >> 11) *
                               0x1.0p-53 * (spec.burst_on_s + spec.burst_off_s)
                         : 0) {}

// No log line here: the daemon destroys its backing dir after spdlog::shutdown().
FaultInjectingBackingDir::~FaultInjectingBackingDir() = default;

double FaultInjectingBackingDir::Draw(uint64_t seed, Op op, uint64_t n) {
  uint64_t x = SplitMix64(seed);
  x = SplitMix64(x ^ (static_cast<uint64_t>(op) + 1) * 0xd6e8feb86659fd93ULL);
  x = SplitMix64(x ^ n);
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

uint64_t FaultInjectingBackingDir::injected_total() const {
  uint64_t t = 0;
  for (const auto& i : injected_) t += i.load();
  return t;
}

bool FaultInjectingBackingDir::InBurst() const {
  if (spec_.burst_on_s <= 0) return true;
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_)
                       .count() + burst_phase_s_;
  return std::fmod(t, spec_.burst_on_s + spec_.burst_off_s) < spec_.burst_on_s;
}

int FaultInjectingBackingDir::Decide(Op op, double rate_eio, double rate_enospc, uint64_t* n) {
  *n = calls_[static_cast<int>(op)].fetch_add(1) + 1;
  if (rate_eio <= 0 && rate_enospc <= 0) return 0;
  const double u = Draw(spec_.seed, op, *n);  // drawn even outside a burst: same sequence
  if (!InBurst()) return 0;
  if (u < rate_eio) return EIO;
  if (u < rate_eio + rate_enospc) return ENOSPC;
  return 0;
}

bool FaultInjectingBackingDir::DiskFull(size_t len) {
  if (spec_.enospc_after == 0) return false;
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::steady_clock::now() - start_)
                             .count();
  int64_t until = full_until_ms_.load();
  if (until >= 0) {
    if (now_ms < until) return true;
    // The window is over: the disk has room again, and fills again after enospc_after.
    if (full_until_ms_.compare_exchange_strong(until, -1)) {
      written_.store(0);
      spdlog::warn("fault-inject: the full disk clears");
    }
    return false;
  }
  if (written_.fetch_add(len) + len <= spec_.enospc_after) return false;
  const int64_t end = spec_.enospc_for_s > 0
                          ? now_ms + static_cast<int64_t>(spec_.enospc_for_s * 1000)
                          : std::numeric_limits<int64_t>::max();
  int64_t expected = -1;
  if (full_until_ms_.compare_exchange_strong(expected, end)) {
    spdlog::warn("fault-inject: the disk is full after {} bytes written{}", spec_.enospc_after,
                 spec_.enospc_for_s > 0
                     ? " for " + std::to_string(spec_.enospc_for_s) + " s"
                     : std::string(" until the daemon stops"));
  }
  return true;
}

Status FaultInjectingBackingDir::Injected(Op op, uint64_t n, int err, const std::string& what) {
  if (err == ENOSPC) {
    enospc_.fetch_add(1);
  } else {
    injected_[static_cast<int>(op)].fetch_add(1);
  }
  spdlog::warn("fault-inject: {} into {} #{} ({})", std::strerror(err), kOpNames[static_cast<int>(op)],
               n, what);
  return Status::FromErrno(err, what + " (fault injected)");
}

Status FaultInjectingBackingDir::PWrite(int fd, const void* buf, size_t len, off_t offset) {
  uint64_t n = 0;
  int err = Decide(Op::kWrite, spec_.eio_write, spec_.enospc_write, &n);
  if (err == 0 && DiskFull(len)) err = ENOSPC;
  if (err == 0) return BackingDir::PWrite(fd, buf, len, offset);
  if (spec_.partial && len > 1) {
    // A seeded part of the bytes lands first, as a device that fails mid-request.
    const size_t part = static_cast<size_t>(Draw(spec_.seed ^ 0x5eed, Op::kWrite, n) *
                                            static_cast<double>(len));
    // O_DIRECT needs aligned lengths: a short write there is cut to 4 KiB.
    const size_t aligned = part & ~size_t{4095};
    const int flags = ::fcntl(fd, F_GETFL);
    const size_t first = (flags >= 0 && (flags & O_DIRECT)) ? aligned : part;
    if (first > 0) (void)BackingDir::PWrite(fd, buf, first, offset);
  }
  return Injected(Op::kWrite, n, err,
                  "pwrite of " + std::to_string(len) + " bytes at " + std::to_string(offset));
}

Status FaultInjectingBackingDir::Fsync(int fd) {
  uint64_t n = 0;
  const int err = Decide(Op::kFsync, spec_.eio_fsync, 0, &n);
  if (err == 0) return BackingDir::Fsync(fd);
  return Injected(Op::kFsync, n, err, "fsync");
}

Status FaultInjectingBackingDir::SyncParent(const std::string& path) {
  uint64_t n = 0;
  const int err = Decide(Op::kDirSync, spec_.eio_dirsync, 0, &n);
  if (err == 0) return BackingDir::SyncParent(path);
  return Injected(Op::kDirSync, n, err, "fsync of the directory of " + path);
}

Status FaultInjectingBackingDir::Rename(const std::string& from, const std::string& to,
                                        unsigned flags) {
  uint64_t n = 0;
  const int err = Decide(Op::kRename, spec_.eio_rename, 0, &n);
  if (err == 0) return BackingDir::Rename(from, to, flags);
  return Injected(Op::kRename, n, err, "rename " + from + " -> " + to);
}

}  // namespace ckptfs::store
