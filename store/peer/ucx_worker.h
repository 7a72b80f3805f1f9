// UcxWorker: one UCP context and worker driven by a progress thread that sleeps on the
// worker's event fd (blocking mode), never busy-polls.
//
// Every UCX call of a PeerServer or PeerClient runs on this thread: the context and worker
// are created, used and destroyed there, so UCX runs in its single-thread mode with no
// locks. Other threads hand work to it with Post(); a posted task wakes the thread through
// an eventfd that it waits on together with the worker's fd (epoll). The loop is: run posted
// tasks, ucp_worker_progress until idle, ucp_worker_arm (UCS_ERR_BUSY: progress again),
// epoll_wait. On 2 cores a spinning progress thread takes a core from the data path; this
// one costs nothing while idle.
//
// The configuration comes from the environment (UCX_TLS, UCX_NET_DEVICES, ...), as with any
// UCX program. Thread-safe: Post() and Shutdown() from any thread. The destructor shuts
// down and joins the thread.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace ckptfs::store::peer {

class UcxWorker {
 public:
  struct Hooks {
    // Runs on the progress thread once the worker exists (set AM handlers, create the
    // listener or endpoint). An error fails Create().
    std::function<Status(UcxWorker&)> start;
    // Runs on the progress thread at shutdown, before the worker is destroyed (close
    // endpoints and listeners; WaitRequest may be used).
    std::function<void(UcxWorker&)> stop;
  };

  // `name` labels log lines and the thread. Returns once `hooks.start` has run.
  static Result<std::unique_ptr<UcxWorker>> Create(std::string name, Hooks hooks);
  ~UcxWorker();  // Shutdown() and join.
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  // Runs `task` on the progress thread, in posting order. After shutdown began, tasks are
  // dropped unrun (their captured state is destroyed on the posting or progress thread).
  void Post(std::function<void()> task) EXCLUDES(mu_);
  // Runs hooks.stop on the progress thread, then destroys the worker and joins. Idempotent;
  // must not be called from the progress thread.
  void Shutdown() EXCLUDES(shutdown_mu_, mu_);

  // Progress-thread only.
  ucp_worker_h worker() const { return worker_; }
  bool stopping() const { return stopping_.load(std::memory_order_acquire); }
  // Progresses the worker until `request` (from a *_nbx call) completes or `timeout_ms`
  // passes, then frees it. For teardown paths only; returns the request's status.
  ucs_status_t WaitRequest(void* request, int timeout_ms);
  const std::string& name() const { return name_; }

 private:
  UcxWorker(std::string name, Hooks hooks);
  void Run(std::promise<Status>* started);
  Status Init();
  void Loop() EXCLUDES(mu_);
  void Destroy();
  bool RunPosted() EXCLUDES(mu_);  // false once shutdown was requested and the queue is drained

  const std::string name_;
  Hooks hooks_;
  std::thread thread_;
  ucp_context_h context_ = nullptr;  // progress thread only
  ucp_worker_h worker_ = nullptr;    // progress thread only
  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;  // eventfd: Post() and Shutdown() write it
  std::atomic<bool> stopping_{false};

  Mutex shutdown_mu_ ACQUIRED_BEFORE(mu_);  // serializes Shutdown() callers
  Mutex mu_;
  std::deque<std::function<void()>> tasks_ GUARDED_BY(mu_);
  bool stop_requested_ GUARDED_BY(mu_) = false;
  bool joined_ GUARDED_BY(mu_) = false;  // Shutdown() ran to the end
};

// "UCX error <name>" for logs and Status messages.
std::string UcsError(ucs_status_t status);

// Socket address of host:port (numeric or resolved; the first result). `passive` with an
// empty or "0.0.0.0" host gives the wildcard address for listening.
struct SockAddr {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};
Result<SockAddr> ResolveSockAddr(const std::string& host, uint16_t port);
// Every IP address (numeric strings) `host` resolves to.
Result<std::vector<std::string>> ResolveHostIps(const std::string& host);
// Numeric IP of an address ("" for a family other than IPv4/IPv6); IPv4-mapped IPv6
// addresses come out as IPv4.
std::string IpOf(const sockaddr_storage& addr);
uint16_t PortOf(const sockaddr_storage& addr);

}  // namespace ckptfs::store::peer
