#include "mount/peers_watch.h"

#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/thread_name.h"
#include "mount/options.h"

namespace ckptfs {

bool PeersFileWatcher::Identity::operator==(const Identity& o) const {
  return exists == o.exists && dev == o.dev && ino == o.ino && size == o.size &&
         mtime.tv_sec == o.mtime.tv_sec && mtime.tv_nsec == o.mtime.tv_nsec;
}

PeersFileWatcher::PeersFileWatcher(std::string path, Apply apply, Reject reject,
                                   std::chrono::milliseconds interval)
    : path_(std::move(path)),
      apply_(std::move(apply)),
      reject_(std::move(reject)),
      interval_(interval) {}

PeersFileWatcher::Identity PeersFileWatcher::Look() const {
  Identity id;
  struct stat st;
  if (::stat(path_.c_str(), &st) != 0) return id;
  id.exists = true;
  id.dev = st.st_dev;
  id.ino = st.st_ino;
  id.size = st.st_size;
  id.mtime = st.st_mtim;
  return id;
}

bool PeersFileWatcher::CheckOnce(bool force) {
  std::lock_guard check(check_mu_);
  const Identity now = Look();
  if (!force && now == seen_) return false;
  seen_ = now;
  std::ifstream in(path_);
  if (!in) {
    reject_("--peers-file " + path_ + ": cannot read it: " + std::strerror(errno));
    return true;
  }
  std::stringstream text;
  text << in.rdbuf();
  auto peers = ParsePeersText(text.str());
  if (!peers.ok()) {
    reject_("--peers-file " + path_ + ": " + peers.status().message());
    return true;
  }
  if (Status st = ValidatePeerList(*peers); !st.ok()) {
    reject_("--peers-file " + path_ + ": " + st.message());
    return true;
  }
  // Refusals (another number of nodes, this node's entry changed) are logged and counted
  // by the membership itself.
  (void)apply_(*peers);
  return true;
}

void PeersFileWatcher::Start() {
  {
    std::lock_guard check(check_mu_);
    seen_ = Look();
  }
  thread_ = std::thread([this] {
    NameThisThread("ckptfs-peerswatch");
    Loop();
  });
}

void PeersFileWatcher::Poke() {
  {
    std::lock_guard lock(mu_);
    poked_ = true;
  }
  cv_.notify_all();
}

void PeersFileWatcher::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void PeersFileWatcher::Loop() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, interval_, [this] { return stop_ || poked_; });
    if (stop_) return;
    const bool force = poked_;
    poked_ = false;
    lock.unlock();
    if (force) spdlog::info("SIGHUP: reading --peers-file {} again", path_);
    CheckOnce(force);
    lock.lock();
  }
}

}  // namespace ckptfs
