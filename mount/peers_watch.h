// PeersFileWatcher: keeps the daemon's membership following --peers-file (issue 39,
// docs/PEERS.md, "Membership"). The scheduler (a Slurm prolog, a Kubernetes DaemonSet's
// sidecar: docs/integration.md) rewrites the file on every node when a node is replaced;
// the watcher notices within `interval` (the file's inode, size or mtime changed) or at once
// on SIGHUP (Poke), reads and validates it as at start-up (ParsePeersText,
// ValidatePeerList), and hands the list to `apply` (Filesystem::UpdatePeers). A file that
// cannot be read or parsed goes to `reject` with the reason (one log line and a counter in
// the membership's stats); the old membership stays, nothing is dropped. A file that is
// being rewritten in place may be read half-written: it is rejected or refused, and the
// next change (the writer's last write) is read again; writers should rename a complete
// file into place (the recipes do).
//
// Thread-safe. Its thread polls a stat every `interval`: nothing grows with the cluster.
#pragma once

#include <sys/stat.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace ckptfs {

class PeersFileWatcher {
 public:
  using Apply = std::function<Status(const std::vector<std::string>&)>;
  using Reject = std::function<void(const std::string&)>;

  PeersFileWatcher(std::string path, Apply apply, Reject reject,
                   std::chrono::milliseconds interval = std::chrono::seconds(1));
  ~PeersFileWatcher() { Stop(); }
  PeersFileWatcher(const PeersFileWatcher&) = delete;
  PeersFileWatcher& operator=(const PeersFileWatcher&) = delete;

  // Takes the file as it is now as the one the daemon started with, then watches it.
  void Start();
  // Re-reads the file now, changed or not (SIGHUP).
  void Poke();
  void Stop();
  // One look, on the caller's thread (tests): re-reads when the file changed, or always
  // with `force`. Returns whether it read the file.
  bool CheckOnce(bool force);

 private:
  struct Identity {
    bool exists = false;
    dev_t dev = 0;
    ino_t ino = 0;
    off_t size = 0;
    struct timespec mtime = {};
    bool operator==(const Identity& o) const;
  };
  Identity Look() const;
  void Loop();

  const std::string path_;
  const Apply apply_;
  const Reject reject_;
  const std::chrono::milliseconds interval_;
  std::mutex check_mu_;  // one check at a time (the thread, a Poke, a test)
  Identity seen_;        // guarded by check_mu_
  std::mutex mu_;
  std::condition_variable cv_;
  bool poked_ = false;  // guarded by mu_
  bool stop_ = false;   // guarded by mu_
  std::thread thread_;
};

}  // namespace ckptfs
