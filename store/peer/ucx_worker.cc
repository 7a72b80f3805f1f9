#include "store/peer/ucx_worker.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <future>

#include "common/thread_name.h"

namespace ckptfs::store::peer {

std::string UcsError(ucs_status_t status) {
  return std::string("UCX error ") + ucs_status_string(status);
}

Result<SockAddr> ResolveSockAddr(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (host.empty() ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return NotFound("peer: cannot resolve '" + host + "': " + ::gai_strerror(rc));
  }
  SockAddr out;
  std::memcpy(&out.storage, res->ai_addr, res->ai_addrlen);
  out.length = res->ai_addrlen;
  ::freeaddrinfo(res);
  return out;
}

Result<std::vector<std::string>> ResolveHostIps(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) return NotFound("peer: cannot resolve '" + host + "': " + ::gai_strerror(rc));
  std::vector<std::string> ips;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    sockaddr_storage ss{};
    std::memcpy(&ss, a->ai_addr, a->ai_addrlen);
    std::string ip = IpOf(ss);
    if (!ip.empty()) ips.push_back(std::move(ip));
  }
  ::freeaddrinfo(res);
  return ips;
}

std::string IpOf(const sockaddr_storage& addr) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
  } else if (addr.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {
      ::inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], buf, sizeof(buf));
    } else {
      ::inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
    }
  }
  return buf;
}

uint16_t PortOf(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  }
  if (addr.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  }
  return 0;
}

UcxWorker::UcxWorker(std::string name, Hooks hooks)
    : name_(std::move(name)), hooks_(std::move(hooks)) {}

Result<std::unique_ptr<UcxWorker>> UcxWorker::Create(std::string name, Hooks hooks) {
  std::unique_ptr<UcxWorker> w(new UcxWorker(std::move(name), std::move(hooks)));
  w->wake_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!w->wake_fd_.valid()) return Status::FromErrno(errno, "peer: eventfd");
  w->epoll_fd_.Reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!w->epoll_fd_.valid()) return Status::FromErrno(errno, "peer: epoll_create1");
  std::promise<Status> started;
  std::future<Status> started_f = started.get_future();
  w->thread_ = std::thread([raw = w.get(), &started] {
    NameThisThread("ckptfs-ucx");
    raw->Run(&started);
  });
  Status st = started_f.get();
  if (!st.ok()) {
    w->thread_.join();  // Run() returns after a failed start, having destroyed what it made
    MutexLock lock(&w->mu_);
    w->joined_ = true;
    return st;
  }
  return w;
}

UcxWorker::~UcxWorker() { Shutdown(); }

void UcxWorker::Post(std::function<void()> task) {
  {
    MutexLock lock(&mu_);
    if (stop_requested_) return;
    tasks_.push_back(std::move(task));
  }
  uint64_t one = 1;
  // A full counter (never, at 2^64-1) or EAGAIN still leaves the fd readable: the wakeup holds.
  [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
}

void UcxWorker::Shutdown() {
  MutexLock serial(&shutdown_mu_);
  {
    MutexLock lock(&mu_);
    if (joined_) return;
    stop_requested_ = true;
  }
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  MutexLock lock(&mu_);
  joined_ = true;
  tasks_.clear();
}

void UcxWorker::Run(std::promise<Status>* started) {
  Status st = Init();
  if (st.ok() && hooks_.start) st = hooks_.start(*this);
  if (!st.ok()) {
    stopping_.store(true, std::memory_order_release);
    if (worker_ != nullptr && hooks_.stop) hooks_.stop(*this);
    Destroy();
    started->set_value(st);
    return;
  }
  started->set_value(Status::Ok());
  Loop();
  stopping_.store(true, std::memory_order_release);
  if (hooks_.stop) hooks_.stop(*this);
  Destroy();
}

Status UcxWorker::Init() {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return Internal("peer " + name_ + ": ucp_config_read: " + UcsError(s));
  // The listener binds with SO_REUSEADDR (UCX's connection-manager option REUSEADDR, off by
  // default). A daemon started again at once (G11) finds the last one's connections on its
  // --peer-listen port in TIME_WAIT for a minute, on whichever side closed first, and a
  // plain bind() fails with EADDRINUSE until then. A port some process still listens on is
  // refused all the same. UCX keeps the key for its connection managers (TCP, RDMA CM).
  s = ucp_config_modify(config, "CM_REUSEADDR", "y");
  if (s != UCS_OK) spdlog::debug("peer {}: CM_REUSEADDR: {}", name_, UcsError(s));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = name_.c_str();
  s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) {
    context_ = nullptr;
    return Internal("peer " + name_ + ": ucp_init: " + UcsError(s));
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) {
    worker_ = nullptr;
    return Internal("peer " + name_ + ": ucp_worker_create: " + UcsError(s));
  }
  int efd = -1;
  s = ucp_worker_get_efd(worker_, &efd);
  if (s != UCS_OK) return Internal("peer " + name_ + ": ucp_worker_get_efd: " + UcsError(s));
  for (int fd : {efd, wake_fd_.get()}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      return Status::FromErrno(errno, "peer " + name_ + ": epoll_ctl");
    }
  }
  return Status::Ok();
}

bool UcxWorker::RunPosted() {
  std::deque<std::function<void()>> batch;
  bool stop;
  {
    MutexLock lock(&mu_);
    batch.swap(tasks_);
    stop = stop_requested_;
  }
  for (auto& task : batch) task();
  return !(stop && batch.empty());
}

void UcxWorker::Loop() {
  epoll_event events[2];
  while (RunPosted()) {
    if (ucp_worker_progress(worker_) != 0) continue;
    {
      // Shutdown was requested while posted tasks ran: its wakeup may have been consumed
      // already, so never sleep now; the next RunPosted() finds the queue drained and ends.
      MutexLock lock(&mu_);
      if (stop_requested_) continue;
    }
    ucs_status_t s = ucp_worker_arm(worker_);
    if (s == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress them first
    if (s != UCS_OK) {
      // Not expected; keep serving by polling slowly rather than spinning a core.
      spdlog::error("peer {}: ucp_worker_arm: {}", name_, UcsError(s));
      ::usleep(1000);
      continue;
    }
    int n = ::epoll_wait(epoll_fd_.get(), events, 2, -1);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == wake_fd_.get()) {
        uint64_t count;
        [[maybe_unused]] ssize_t r = ::read(wake_fd_.get(), &count, sizeof(count));
      }
    }
  }
}

ucs_status_t UcxWorker::WaitRequest(void* request, int timeout_ms) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  ucs_status_t s;
  while ((s = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    if (std::chrono::steady_clock::now() > deadline) {
      ucp_request_cancel(worker_, request);
      while (ucp_worker_progress(worker_) != 0) {
      }
      s = UCS_ERR_TIMED_OUT;
      break;
    }
    if (ucp_worker_progress(worker_) == 0) ::usleep(100);
  }
  ucp_request_free(request);
  return s;
}

void UcxWorker::Destroy() {
  if (worker_ != nullptr) {
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
  if (context_ != nullptr) {
    ucp_cleanup(context_);
    context_ = nullptr;
  }
}

}  // namespace ckptfs::store::peer
