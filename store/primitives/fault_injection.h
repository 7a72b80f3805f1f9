// FaultInjectingBackingDir: a test-only fault layer under the daemon's backing dir, as
// RocksDB's FaultInjectionTestFS sits under db_stress (issue 41). The daemon builds one in
// place of a plain BackingDir when started with the hidden option
// `--fault-inject SPEC`; nothing else uses it. It makes the backing store's writes,
// fsyncs and renames fail with EIO (or ENOSPC) at a seeded rate, so that every error path
// a real failing disk or network file system would take runs under load, and the daemon
// must answer each injected error exactly as it answers a real one (G7).
//
// SPEC is comma-separated key=value (docs/RELIABILITY.md, "Fault injection"):
//   seed=N            the generator's seed (default 0)
//   eio_write=P       a pwrite fails with EIO with probability P (0..1)
//   eio_fsync=P       an fsync of a file fails with EIO
//   eio_dirsync=P     an fsync of a directory (SyncParent) fails with EIO
//   eio_rename=P      a rename fails with EIO
//   enospc_write=P    a pwrite fails with ENOSPC
//   partial=0|1       a failing pwrite first writes a seeded part of its bytes (a short
//                     write before the error, as a real device may)
//   enospc_after=SIZE once SIZE bytes were written through the layer, every pwrite fails
//                     with ENOSPC (a full disk) ...
//   enospc_for=S      ... for S seconds; then the count starts again (0: until restart)
//   burst_on=S, burst_off=S   the rates apply only in windows of S seconds on, then S
//                     off, the first window's phase drawn from the seed (default: always)
// Every other call goes to BackingDir unchanged, and only the named ops ever fail.
//
// Reproducible: the decision for the n-th call of one kind of op is a function of
// (seed, kind, n) alone, so a single-threaded sequence of calls fails at the same places
// on every run (the bursts and the ENOSPC window are the exceptions: they follow time).
// Each injected fault is logged (warn) with its op and call number; the message of the
// returned status says "(fault injected)".
//
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::store {

struct FaultSpec {
  uint64_t seed = 0;
  double eio_write = 0;
  double eio_fsync = 0;
  double eio_dirsync = 0;
  double eio_rename = 0;
  double enospc_write = 0;
  bool partial = false;
  uint64_t enospc_after = 0;  // 0: no full disk
  double enospc_for_s = 0;    // 0: full until the daemon stops
  double burst_on_s = 0;      // 0: the rates apply all the time
  double burst_off_s = 0;

  // Parses SPEC (above). Unknown keys, bad numbers and rates outside [0, 1] are refused
  // with a message that names them.
  static Result<FaultSpec> Parse(const std::string& text);
  // The spec as SPEC text (what the daemon logs at start).
  std::string ToString() const;
};

class FaultInjectingBackingDir : public BackingDir {
 public:
  // The kinds of op that can fail, each with its own call counter.
  enum class Op { kWrite = 0, kFsync, kDirSync, kRename, kCount };

  static Result<std::unique_ptr<FaultInjectingBackingDir>> Open(const std::string& root_path,
                                                                const FaultSpec& spec);
  ~FaultInjectingBackingDir() override;

  // The decision for call number `n` (from 1) of `op` under `seed`: a uniform draw in
  // [0, 1). Exposed for tests.
  static double Draw(uint64_t seed, Op op, uint64_t n);

  uint64_t calls(Op op) const { return calls_[static_cast<int>(op)].load(); }
  uint64_t injected(Op op) const { return injected_[static_cast<int>(op)].load(); }
  uint64_t injected_total() const;
  uint64_t enospc_injected() const { return enospc_.load(); }
  const FaultSpec& spec() const { return spec_; }

  Status PWrite(int fd, const void* buf, size_t len, off_t offset) override;
  Status Fsync(int fd) override;
  Status SyncParent(const std::string& path) override;
  Status Rename(const std::string& from, const std::string& to, unsigned flags = 0) override;

 private:
  FaultInjectingBackingDir(std::string root_path, UniqueFd root, const FaultSpec& spec);
  // Counts the call and returns the errno to inject into it (0: none): `rate_eio` for
  // EIO, then `rate_enospc` for ENOSPC, both drawn from the one value of this call.
  int Decide(Op op, double rate_eio, double rate_enospc, uint64_t* n);
  bool InBurst() const;
  // The full-disk window: true while pwrites must fail with ENOSPC.
  bool DiskFull(size_t len);
  Status Injected(Op op, uint64_t n, int err, const std::string& what);

  const FaultSpec spec_;
  const std::chrono::steady_clock::time_point start_;
  const double burst_phase_s_;
  std::atomic<uint64_t> calls_[static_cast<int>(Op::kCount)] = {};
  std::atomic<uint64_t> injected_[static_cast<int>(Op::kCount)] = {};
  std::atomic<uint64_t> enospc_{0};
  std::atomic<uint64_t> written_{0};      // bytes since the last full-disk window
  std::atomic<int64_t> full_until_ms_{-1};  // -1: not full; else ms since start_ (or max)
};

}  // namespace ckptfs::store
