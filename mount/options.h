// Command-line options of the ckptfs daemon: parsing and validation, with one clear
// error line for every bad input.
//
// Every long option is also accepted as a FUSE-style `-o key=value` (dashes may be
// underscores: `-o staging_mem=8G`), so that mount(8), /etc/fstab and systemd mount
// units can pass ckptfs options. Mount-only options (_netdev, nofail, x-systemd.*, ...)
// are dropped; any other -o option goes to libfuse. Not thread-safe; called once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace ckptfs {

struct DaemonOptions {
  std::string backing_dir;   // absolute, canonical
  std::string mountpoint;    // absolute, canonical
  // A ckptfs killed by a signal (or any dead FUSE daemon) left its mount there: every
  // access fails with ENOTCONN. The daemon detaches it right before it mounts (as
  // systemd's restart expects), so that until then the application's calls keep failing
  // instead of reaching the directory underneath.
  bool replaces_dead_mount = false;
  std::string state_dir;     // absolute
  bool foreground = false;
  bool strict = false;
  uint64_t staging_bytes = uint64_t{1} << 30;
  uint64_t chunk_bytes = uint64_t{4} << 20;
  uint64_t cache_bytes = uint64_t{1} << 30;
  // Issue 23: --retain-mem (memory tier for the newest committed checkpoint; 0 off) and
  // --retain-replicas. retain_bytes_set: given on the command line (else staging / 2).
  uint64_t retain_bytes = 0;
  bool retain_bytes_set = false;
  // Issue 42: --memory-ckpt-mem, the files of memory-only directories (0: none fit).
  uint64_t memory_ckpt_bytes = 0;
  int retain_replicas = -1;  // -1: 1 with --peers, else 0
  uint64_t read_ahead_bytes = uint64_t{4} << 20;  // the mount's kernel read-ahead; 0: default
  bool cache_direct_io = true;
  int flush_threads = 2;
  int fuse_threads = 32;
  int commit_timeout_s = 600;
  int max_pending = 1024;
  // A stop waits this long without progress for a halted or waiting publication, then
  // leaves the rest for the next start (FsConfig::stop_timeout).
  int stop_timeout_s = 30;
  std::string staging_backend = "auto";
  bool staging_hugepages = false;  // --staging-hugepages=on|off
  int staging_release_after_s = 0;  // --staging-release-after (0: keep pinned)
  bool flush_direct_io = true;     // --flush-direct-io=on|off
  bool passthrough = true;         // --passthrough=on|off (FsConfig::passthrough)
  uint64_t passthrough_min_bytes = uint64_t{1} << 20;  // --passthrough-min-size
  bool fuse_splice = true;         // --fuse-splice=on|off (FuseTuning::splice_writes)
  // --fuse-direct-writes=auto|on|off (FuseTuning::direct_writes)
  std::string fuse_direct_writes = "auto";
  // --fuse-uring=auto|on|off (FuseTuning::uring)
  std::string fuse_uring = "auto";
  bool write_checksums = true;  // --write-checksums=on|off
  std::string log_level = "info";
  std::string log_file;
  uint64_t log_max_bytes = uint64_t{100} << 20;  // rotate the log file at this size
  int log_max_files = 5;                          // rotated files kept
  std::string metrics_listen;                     // "ADDR:PORT" or empty: no HTTP server
  std::string metrics_host;                       // split from metrics_listen
  int metrics_port = 0;
  // Peer daemons (issue 12). `peers` comes from --peers or --peers-file (read by
  // ValidateDaemonOptions); empty: no peers, and the other peer options are refused.
  std::vector<std::string> peers;        // "HOST:PORT", the same list on every node
  std::string peers_file;
  int node_rank = -1;                    // -1: this host's position in the list
  std::string peer_listen;               // ADDR:PORT; default 0.0.0.0:<own port>
  std::string peer_secret_file;
  std::string plan;                      // balanced|fast|auto; default $CKPTFS_PLAN or auto
  int peer_timeout_ms = 5000;            // one block request to a peer
  int peer_dead_after_ms = 15000;        // silence after which a peer is declared dead
  int peer_heartbeat_ms = 2000;          // an idle peer connection is pinged after this
  int peer_max_links = 64;               // peer connections kept open at most
  // Test only, hidden from --help (issue 41): faults injected under the backing dir,
  // store/primitives/fault_injection.h. Empty: none.
  std::string fault_inject;
  // Diagnosis: a line per journal entry done (store/publish/journal_trace.h). Empty: none.
  std::string journal_trace;
  std::vector<std::string> fuse_options;
  bool help = false;
  bool version = false;     // --version: print help_text (the version) and exit
  bool fake = false;        // mount helper -f: parse, validate, do not mount
  std::string help_text;
};

// "ckptfs 0.3.0 (git abc123)": what --version prints.
std::string VersionLine(const std::string& program);

// True for the options that only mount(8), fstab or systemd use and that must not reach
// libfuse: _netdev, nofail, noauto, auto, user, users, nouser, owner, group, defaults,
// x-*, comment=*.
bool IsMountOnlyOption(const std::string& option);

// Parses "4096", "64K", "512M", "2G", "1T" (also "2GiB", "2GB"): powers of 1024.
Result<uint64_t> ParseSize(const std::string& text);

// Parses argv. A syntax error returns kInvalid with the message to print.
Result<DaemonOptions> ParseDaemonOptions(int argc, const char* const* argv);

// Parses the argv that mount(8) gives a mount helper (mount.fuse.ckptfs, mount.ckptfs):
//   SOURCE TARGET [-s] [-f] [-n] [-v] [-o OPTIONS] [-t TYPE]
// SOURCE is the backing dir. -f (fake) sets `fake`; -s, -n, -v and -t are accepted and
// ignored. The daemon runs in the background, as mount(8) expects.
Result<DaemonOptions> ParseMountHelperArgs(int argc, const char* const* argv);

// True if argv[0] names the mount helper (its basename starts with "mount.").
bool IsMountHelperName(const char* argv0);

// Checks the paths: backing dir and mountpoint exist and are directories, the
// mountpoint is not already mounted (a dead FUSE mount there is taken over:
// replaces_dead_mount), neither contains the other, and the state dir is outside the
// mount. Fills in the default state dir.
Status ValidateDaemonOptions(DaemonOptions* options);

// Parses a peers file: one HOST:PORT per line; blank lines and '#' comments are skipped.
Result<std::vector<std::string>> ParsePeersText(const std::string& text);

// Checks a peer list (HOST:PORT or [V6]:PORT, port 1-65535, no duplicates, at least one).
Status ValidatePeerList(const std::vector<std::string>& peers);

// The index of this host in `peers`: the entry whose host is this host's name (full or short)
// or resolves to an address of a local interface. NotFound when none, Invalid when several
// match (then --node-rank must say).
Result<int> FindOwnPeerIndex(const std::vector<std::string>& peers);

// True if `path` (canonical) is a mount point listed in /proc/self/mountinfo (read
// with libmount).
bool IsMountPoint(const std::string& path);

}  // namespace ckptfs
