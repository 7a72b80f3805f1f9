// MetricsServer: serves GET /metrics (Prometheus text format) over HTTP with
// cpp-httplib, for a Prometheus server to scrape.
//
// Thread-safe. Requests run on a small pool of the server's own threads and call the
// render function concurrently; it must be thread-safe and must outlive the server.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/status.h"

namespace httplib {
class Server;
}

namespace ckptfs {

class MetricsServer {
 public:
  using Render = std::function<std::string()>;

  // Binds host:port (fails at once if that is taken) and starts serving.
  static Result<std::unique_ptr<MetricsServer>> Start(const std::string& host, int port,
                                                      Render render);
  ~MetricsServer();  // Stops: waits for requests in flight, joins every thread.
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsServer() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace ckptfs
