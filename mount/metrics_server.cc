#include "mount/metrics_server.h"

#include <httplib.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <exception>
#include <thread>

namespace ckptfs {

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& host, int port,
                                                            Render render) {
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->server_ = std::make_unique<httplib::Server>();
  // Scrapes are rare; two threads answer them (httplib's default is one per core).
  s->server_->new_task_queue = [] { return new httplib::ThreadPool(2); };
  s->server_->Get("/metrics", [render](const httplib::Request&, httplib::Response& res) {
    try {
      res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
    } catch (const std::exception& e) {  // a scrape must never take the daemon down
      res.status = 500;
      res.set_content(std::string("metrics: ") + e.what() + "\n", "text/plain");
    }
  });
  s->server_->Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ckptfs: metrics at /metrics\n", "text/plain");
  });
  if (!s->server_->bind_to_port(host.c_str(), port)) {
    return Status(Code::kBusy, "--metrics-listen " + host + ":" + std::to_string(port) +
                                   ": cannot listen (address in use or not local?)");
  }
  s->port_ = port;
  httplib::Server* server = s->server_.get();
  s->thread_ = std::thread([server] { server->listen_after_bind(); });
  // stop() does nothing to a server that is not running yet, so the destructor could
  // wait forever on a loop that starts after it: wait until it runs.
  for (int i = 0; i < 5000 && !server->is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  spdlog::info("metrics: serving http://{}:{}/metrics", host, port);
  return s;
}

MetricsServer::~MetricsServer() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace ckptfs
