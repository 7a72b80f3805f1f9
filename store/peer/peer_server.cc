#include "store/peer/peer_server.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>

#include "common/mutex.h"
#include "common/thread_name.h"
#include "store/dcp/dcp_metadata.h"
#include "store/peer/buffer_pool.h"
#include "store/peer/protocol.h"
#include "store/peer/ucx_worker.h"
#include "store/primitives/crc32c.h"

namespace ckptfs::store::peer {
namespace {

using Clock = std::chrono::steady_clock;

// Idle reply buffers kept for reuse.
constexpr uint64_t kBufferCacheBytes = 64ull << 20;

// One accepted connection. Progress thread only.
struct Conn {
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  std::string ip;       // source address of the connection
  std::string node_id;  // from its hello; empty before
  Nonce client_nonce{}, server_nonce{};
  bool challenged = false;
  bool authenticated = false;
  Clock::time_point accepted_at;
};

// A request accepted for serving, queued for the serving threads.
struct Job {
  uint64_t conn_id = 0;
  BlockRequest request;
};

// A commit query waiting on the query thread (long-poll).
struct HeldQuery {
  uint64_t conn_id = 0;
  std::string node_id;  // the asker, for log lines
  ShardQuery query;
  Clock::time_point deadline;
  bool evaluated = false;         // its first look at the states happened
  std::vector<size_t> was_pending;  // indices pending at the first look
};

// Keeps a reply's header and bytes alive until UCX is done sending them.
struct SendCtx {
  class PeerServer::Impl* server = nullptr;
  std::array<char, kResponseHeaderBytes> header{};
  BufferPool::Buffer data;
  std::string message;    // error text, or a control message
  size_t data_bytes = 0;  // valid bytes in `data`
  uint64_t charged = 0;   // bytes counted in inflight_bytes_
};

}  // namespace

class PeerServer::Impl : private ShardStateListener {
 public:
  Impl(const PeerServerOptions& options, BlockSource* provider)
      : options_(options), provider_(provider) {}

  Status Init();
  void Stop();
  Status SetAllowedPeers(const std::vector<std::string>& peers) EXCLUDES(allowed_mu_);
  // A listed node connecting from an address its host name did not resolve to (a pod keeps
  // its name, not its address): the name is resolved again, at most every 2 s per node;
  // true if `ip` is one of its addresses now.
  bool ResolvedAgain(const std::string& node_id, const std::string& ip) EXCLUDES(allowed_mu_);

  uint64_t pooled_bytes() const { return pool_->cached_bytes(); }

  uint16_t port_ = 0;
  std::atomic<uint64_t> connections_{0}, authenticated_{0}, refused_{0}, blocks_served_{0},
      bytes_served_{0}, request_errors_{0}, shard_queries_{0}, shard_query_errors_{0};

 private:
  // Progress thread.
  Status StartOnWorker(UcxWorker& w);
  void StopOnWorker(UcxWorker& w);
  static void OnConnRequest(ucp_conn_request_h request, void* arg);
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t OnHello(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAuth(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnRequest(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnShardQuery(void* arg, const void* header, size_t header_length,
                                   void* data, size_t length, const ucp_am_recv_param_t* param);
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  Conn* ConnOf(const ucp_am_recv_param_t* param);
  void Refuse(Conn* conn, const std::string& why);
  void CloseConn(uint64_t conn_id, bool force);
  void Send(ucp_ep_h ep, unsigned am_id, std::unique_ptr<SendCtx> ctx, const void* payload,
            size_t length, bool with_header, unsigned extra_flags = 0);
  // Sends an encoded kAmShardAnswer to connection `conn_id` if it is still there (any
  // thread: posts to the progress thread).
  void PostShardAnswer(uint64_t conn_id, std::string message);
  void SendError(Conn* conn, uint64_t request_id, const Status& status);
  void SweepHandshakes();

  // Serving threads.
  void ServeLoop() EXCLUDES(jobs_mu_);
  void Serve(Job job);

  // Query thread.
  void QueryLoop();
  // The shard states changed (the journal's thread): held queries are looked at again.
  void OnShardStatesChanged() override EXCLUDES(query_mu_) {
    {
      MutexLock lock(&query_mu_);
      query_changed_ = true;
    }
    query_cv_.notify_all();
  }
  // Looks at `q`'s paths; true (with the answer in `out`) when it is to be answered now.
  bool Evaluate(HeldQuery& q, Clock::time_point now, bool force, std::string* out);

  const PeerServerOptions options_;
  BlockSource* const provider_;
  // Node id -> IPs of its host (the peer list, resolved; replaced by SetAllowedPeers).
  Mutex allowed_mu_;
  std::map<std::string, std::vector<std::string>> allowed_ GUARDED_BY(allowed_mu_);
  std::map<std::string, std::chrono::steady_clock::time_point> resolved_at_
      GUARDED_BY(allowed_mu_);
  // Resolves `peers` (host names again: a pod keeps its name, not its address).
  Result<std::map<std::string, std::vector<std::string>>> ResolveAllowed(
      const std::vector<std::string>& peers) const;
  // Reply buffers, reused (declared before worker_: outlives replies still in flight).
  std::shared_ptr<BufferPool> pool_ = BufferPool::Create(kBufferCacheBytes);
  std::unique_ptr<UcxWorker> worker_;
  std::atomic<uint64_t> inflight_bytes_{0};

  // Progress thread only.
  ucp_worker_h ucp_worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  uint64_t next_conn_id_ = 1;
  std::map<uint64_t, Conn> conns_;
  std::unordered_map<ucp_ep_h, uint64_t> conn_by_ep_;

  Mutex jobs_mu_;
  std::condition_variable jobs_cv_;
  std::deque<Job> jobs_ GUARDED_BY(jobs_mu_);
  bool jobs_stop_ GUARDED_BY(jobs_mu_) = false;
  std::vector<std::thread> serve_threads_;

  Mutex query_mu_;
  std::condition_variable query_cv_;
  std::deque<HeldQuery> query_arrivals_ GUARDED_BY(query_mu_);
  bool query_changed_ GUARDED_BY(query_mu_) = false;  // the provider saw a state change
  bool query_stop_ GUARDED_BY(query_mu_) = false;
  std::thread query_thread_;
};

Status PeerServer::Impl::Init() {
  if (options_.secret.size() < kMinSecretBytes) {
    return Invalid("peer server: the shared secret is shorter than " +
                   std::to_string(kMinSecretBytes) + " bytes");
  }
  if (options_.serve_threads < 1) return Invalid("peer server: serve_threads must be >= 1");
  CKPT_RETURN_IF_ERROR(SetAllowedPeers(options_.allowed_peers));
  auto w = UcxWorker::Create("server " + options_.node_id,
                             {[this](UcxWorker& w) { return StartOnWorker(w); },
                              [this](UcxWorker& w) { StopOnWorker(w); }});
  if (!w.ok()) return w.status();
  worker_ = std::move(w).value();
  for (int i = 0; i < options_.serve_threads; ++i) {
    serve_threads_.emplace_back([this] {
      NameThisThread("ckptfs-pserve");
      ServeLoop();
    });
  }
  if (options_.shard_states != nullptr) {
    query_thread_ = std::thread([this] {
      NameThisThread("ckptfs-pquery");
      QueryLoop();
    });
    options_.shard_states->SetListener(this);
  }
  spdlog::info("peer server {} listening on port {} ({} allowed peers)", options_.node_id, port_,
               options_.allowed_peers.size());
  return Status::Ok();
}

Result<std::map<std::string, std::vector<std::string>>> PeerServer::Impl::ResolveAllowed(
    const std::vector<std::string>& peers) const {
  std::map<std::string, std::vector<std::string>> allowed;
  for (const std::string& peer : peers) {
    CKPT_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(peer));
    std::vector<std::string> ips;
    if (options_.check_source_address) {
      CKPT_ASSIGN_OR_RETURN(ips, ResolveHostIps(host_port.first));
    }
    allowed[peer] = std::move(ips);
  }
  return allowed;
}

bool PeerServer::Impl::ResolvedAgain(const std::string& node_id, const std::string& ip) {
  if (!options_.check_source_address) return false;
  {
    MutexLock lock(&allowed_mu_);
    if (allowed_.count(node_id) == 0) return false;  // not listed: never
    auto& at = resolved_at_[node_id];
    const auto now = std::chrono::steady_clock::now();
    if (now - at < std::chrono::seconds(2)) return false;
    at = now;
  }
  auto host_port = SplitHostPort(node_id);
  if (!host_port.ok()) return false;
  auto ips = ResolveHostIps(host_port->first);  // no lock across DNS
  if (!ips.ok()) return false;
  const bool found = std::find(ips->begin(), ips->end(), ip) != ips->end();
  MutexLock lock(&allowed_mu_);
  auto it = allowed_.find(node_id);
  if (it == allowed_.end()) return false;
  it->second = std::move(*ips);
  if (found) spdlog::info("peer server {}: {} now resolves to {}", options_.node_id, node_id, ip);
  return found;
}

Status PeerServer::Impl::SetAllowedPeers(const std::vector<std::string>& peers) {
  CKPT_ASSIGN_OR_RETURN(auto allowed, ResolveAllowed(peers));  // no lock across DNS
  MutexLock lock(&allowed_mu_);
  allowed_ = std::move(allowed);
  return Status::Ok();
}

void PeerServer::Impl::Stop() {
  if (options_.shard_states != nullptr) options_.shard_states->SetListener(nullptr);
  {
    MutexLock lock(&query_mu_);
    query_stop_ = true;
    query_arrivals_.clear();
  }
  query_cv_.notify_all();
  if (query_thread_.joinable()) query_thread_.join();
  {
    MutexLock lock(&jobs_mu_);
    jobs_stop_ = true;
    jobs_.clear();
  }
  jobs_cv_.notify_all();
  for (auto& t : serve_threads_) t.join();
  serve_threads_.clear();
  if (worker_) worker_->Shutdown();
}

Status PeerServer::Impl::StartOnWorker(UcxWorker& w) {
  ucp_worker_ = w.worker();
  for (auto [id, cb] : {std::pair{kAmHello, &OnHello}, std::pair{kAmAuth, &OnAuth},
                        std::pair{kAmRequest, &OnRequest},
                        std::pair{kAmShardQuery, &OnShardQuery}}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = id;
    hp.cb = cb;
    hp.arg = this;
    ucs_status_t s = ucp_worker_set_am_recv_handler(w.worker(), &hp);
    if (s != UCS_OK) return Internal("peer server: set AM handler: " + UcsError(s));
  }
  CKPT_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(options_.listen));
  CKPT_ASSIGN_OR_RETURN(SockAddr addr, ResolveSockAddr(host_port.first, host_port.second));
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = addr.get();
  lp.sockaddr.addrlen = addr.length;
  lp.conn_handler.cb = &OnConnRequest;
  lp.conn_handler.arg = this;
  ucs_status_t s = ucp_listener_create(w.worker(), &lp, &listener_);
  if (s != UCS_OK) {
    listener_ = nullptr;
    return Status(s == UCS_ERR_BUSY ? Code::kBusy : Code::kIo,
                  "peer server: cannot listen on " + options_.listen + ": " + UcsError(s));
  }
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  s = ucp_listener_query(listener_, &attr);
  if (s != UCS_OK) return Internal("peer server: ucp_listener_query: " + UcsError(s));
  port_ = PortOf(attr.sockaddr);
  return Status::Ok();
}

void PeerServer::Impl::StopOnWorker(UcxWorker& w) {
  if (listener_ != nullptr) {
    ucp_listener_destroy(listener_);
    listener_ = nullptr;
  }
  std::vector<void*> closing;
  for (auto& [id, conn] : conns_) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    closing.push_back(ucp_ep_close_nbx(conn.ep, &p));
  }
  conns_.clear();
  conn_by_ep_.clear();
  for (void* r : closing) w.WaitRequest(r, 2000);
  // Replies still being sent complete (with an error) while the endpoints close; progress
  // until they have released their buffers.
  while (ucp_worker_progress(w.worker()) != 0) {
  }
}

void PeerServer::Impl::OnConnRequest(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<Impl*>(arg);
  self->connections_.fetch_add(1, std::memory_order_relaxed);
  self->SweepHandshakes();
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string ip = ucp_conn_request_query(request, &attr) == UCS_OK ? IpOf(attr.client_address)
                                                                    : std::string("?");
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = request;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &OnEpError;
  ep.err_handler.arg = self;
  ucp_ep_h handle = nullptr;
  ucs_status_t s = ucp_ep_create(self->worker_ ? self->worker_->worker() : nullptr, &ep, &handle);
  if (s != UCS_OK) {
    spdlog::warn("peer server {}: cannot accept a connection from {}: {}", self->options_.node_id,
                 ip, UcsError(s));
    return;
  }
  Conn conn;
  conn.id = self->next_conn_id_++;
  conn.ep = handle;
  conn.ip = ip;
  conn.accepted_at = Clock::now();
  self->conn_by_ep_[handle] = conn.id;
  self->conns_[conn.id] = std::move(conn);
}

void PeerServer::Impl::OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<Impl*>(arg);
  auto it = self->conn_by_ep_.find(ep);
  if (it == self->conn_by_ep_.end()) return;
  const Conn& conn = self->conns_.at(it->second);
  if (!conn.authenticated) {
    // A peer that gives up mid-handshake, e.g. one that found our proof wrong (it has
    // another secret), is refused as far as the counters and the log go.
    self->refused_.fetch_add(1, std::memory_order_relaxed);
    spdlog::warn(
        "peer server {}: connection from {} (node '{}') closed before authenticating: "
        "{}",
        self->options_.node_id, conn.ip, conn.node_id, UcsError(status));
  } else {
    spdlog::info("peer server {}: connection from {} ({}) ended: {}", self->options_.node_id,
                 conn.node_id, conn.ip, UcsError(status));
  }
  self->CloseConn(it->second, /*force=*/true);
}

Conn* PeerServer::Impl::ConnOf(const ucp_am_recv_param_t* param) {
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return nullptr;
  auto it = conn_by_ep_.find(param->reply_ep);
  return it == conn_by_ep_.end() ? nullptr : &conns_.at(it->second);
}

void PeerServer::Impl::CloseConn(uint64_t conn_id, bool force) {
  auto it = conns_.find(conn_id);
  if (it == conns_.end()) return;
  ucp_ep_h ep = it->second.ep;
  conn_by_ep_.erase(ep);
  conns_.erase(it);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* r = ucp_ep_close_nbx(ep, &p);
  if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);  // UCX finishes the close on its own
}

void PeerServer::Impl::Refuse(Conn* conn, const std::string& why) {
  refused_.fetch_add(1, std::memory_order_relaxed);
  spdlog::warn("peer server {}: refused connection from {} (node '{}'): {}", options_.node_id,
               conn->ip, conn->node_id, why);
  auto ctx = std::make_unique<SendCtx>();
  ctx->server = this;
  ctx->message = EncodeAuthResult(AuthResult{});  // refused
  ucp_ep_h ep = conn->ep;
  Send(ep, kAmAuthResult, std::move(ctx), nullptr, 0, false);
  CloseConn(conn->id, /*force=*/false);  // flush mode: the refusal is delivered first
}

void PeerServer::Impl::SweepHandshakes() {
  auto now = Clock::now();
  std::vector<uint64_t> stale;
  for (auto& [id, conn] : conns_) {
    if (!conn.authenticated && now - conn.accepted_at > options_.handshake_timeout) {
      stale.push_back(id);
    }
  }
  for (uint64_t id : stale) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    spdlog::warn(
        "peer server {}: closed connection from {} that did not authenticate within "
        "{} ms",
        options_.node_id, conns_.at(id).ip, options_.handshake_timeout.count());
    CloseConn(id, /*force=*/true);
  }
}

void PeerServer::Impl::Send(ucp_ep_h ep, unsigned am_id, std::unique_ptr<SendCtx> ctx,
                            const void* payload, size_t length, bool with_header,
                            unsigned extra_flags) {
  if (payload == nullptr) {
    payload = ctx->message.data();
    length = ctx->message.size();
  }
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY | extra_flags;
  p.cb.send = &OnSendDone;
  p.user_data = ctx.get();
  void* r = ucp_am_send_nbx(ep, am_id, with_header ? ctx->header.data() : nullptr,
                            with_header ? ctx->header.size() : 0, payload, length, &p);
  if (UCS_PTR_IS_PTR(r)) {
    ctx.release();  // OnSendDone owns it now, and frees the request
    return;
  }
  if (UCS_PTR_IS_ERR(r)) {
    spdlog::debug("peer server {}: send failed: {}", options_.node_id, UcsError(UCS_PTR_STATUS(r)));
  }
  OnSendDone(nullptr, UCS_PTR_STATUS(r), ctx.release());
}

// Frees the request here: freeing it at the call site would cancel this callback
// (ucp_request_free) and leak the reply buffer.
void PeerServer::Impl::OnSendDone(void* request, ucs_status_t status, void* user_data) {
  std::unique_ptr<SendCtx> ctx(static_cast<SendCtx*>(user_data));
  if (request != nullptr) ucp_request_free(request);
  if (ctx->charged != 0) ctx->server->inflight_bytes_.fetch_sub(ctx->charged);
}

ucs_status_t PeerServer::Impl::OnHello(void* arg, const void*, size_t, void* data, size_t length,
                                       const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  Conn* conn = self->ConnOf(param);
  if (conn == nullptr) return UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    self->Refuse(conn, "oversized hello");
    return UCS_OK;
  }
  if (conn->challenged) {
    self->Refuse(conn, "second hello");
    return UCS_OK;
  }
  auto hello = DecodeHello(std::string_view(static_cast<const char*>(data), length));
  if (!hello.ok()) {
    self->Refuse(conn, hello.status().ToString());
    return UCS_OK;
  }
  conn->node_id = hello->node_id;
  const char* refusal = nullptr;
  {
    MutexLock lock(&self->allowed_mu_);
    auto allowed = self->allowed_.find(conn->node_id);
    if (allowed == self->allowed_.end()) {
      refusal = "node is not in the peer list";
    } else if (self->options_.check_source_address) {
      const auto& ips = allowed->second;
      if (std::find(ips.begin(), ips.end(), conn->ip) == ips.end()) {
        refusal = "source address is not an address of the listed host";
      }
    }
  }
  if (refusal != nullptr && self->ResolvedAgain(conn->node_id, conn->ip)) refusal = nullptr;
  if (refusal != nullptr) {
    self->Refuse(conn, refusal);
    return UCS_OK;
  }
  auto nonce = RandomNonce();
  if (!nonce.ok()) {
    self->Refuse(conn, nonce.status().ToString());
    return UCS_OK;
  }
  conn->client_nonce = hello->client_nonce;
  conn->server_nonce = *nonce;
  conn->challenged = true;
  Challenge challenge;
  challenge.server_nonce = conn->server_nonce;
  auto ctx = std::make_unique<SendCtx>();
  ctx->server = self;
  ctx->message = EncodeChallenge(challenge);
  self->Send(conn->ep, kAmChallenge, std::move(ctx), nullptr, 0, false);
  return UCS_OK;
}

ucs_status_t PeerServer::Impl::OnAuth(void* arg, const void*, size_t, void* data, size_t length,
                                      const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  Conn* conn = self->ConnOf(param);
  if (conn == nullptr) return UCS_OK;
  if (!conn->challenged || conn->authenticated || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    self->Refuse(conn, "unexpected auth message");
    return UCS_OK;
  }
  auto auth = DecodeAuth(std::string_view(static_cast<const char*>(data), length));
  Proof expected = ComputeProof(self->options_.secret, ProofRole::kClient, conn->node_id,
                                conn->client_nonce, conn->server_nonce);
  if (!auth.ok() || !ProofEquals(auth->client_proof, expected)) {
    self->Refuse(conn, "authentication failed (wrong shared secret)");
    return UCS_OK;
  }
  conn->authenticated = true;
  self->authenticated_.fetch_add(1, std::memory_order_relaxed);
  spdlog::info("peer server {}: peer {} ({}) authenticated", self->options_.node_id, conn->node_id,
               conn->ip);
  AuthResult result;
  result.accepted = true;
  result.server_proof = ComputeProof(self->options_.secret, ProofRole::kServer, conn->node_id,
                                     conn->client_nonce, conn->server_nonce);
  auto ctx = std::make_unique<SendCtx>();
  ctx->server = self;
  ctx->message = EncodeAuthResult(result);
  self->Send(conn->ep, kAmAuthResult, std::move(ctx), nullptr, 0, false);
  return UCS_OK;
}

void PeerServer::Impl::SendError(Conn* conn, uint64_t request_id, const Status& status) {
  request_errors_.fetch_add(1, std::memory_order_relaxed);
  auto ctx = std::make_unique<SendCtx>();
  ctx->server = this;
  ctx->message = status.message();
  ResponseHeader h;
  h.request_id = request_id;
  h.code = static_cast<uint32_t>(status.code());
  h.length = ctx->message.size();
  ctx->header = EncodeResponseHeader(h);
  Send(conn->ep, kAmResponse, std::move(ctx), nullptr, 0, true);
}

ucs_status_t PeerServer::Impl::OnRequest(void* arg, const void*, size_t, void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  Conn* conn = self->ConnOf(param);
  if (conn == nullptr) return UCS_OK;
  if (!conn->authenticated) {
    self->Refuse(conn, "block request before authentication");
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    self->Refuse(conn, "oversized block request");
    return UCS_OK;
  }
  auto req = DecodeRequest(std::string_view(static_cast<const char*>(data), length));
  if (!req.ok()) {
    self->Refuse(conn, req.status().ToString());  // a peer that sends garbage is cut off
    return UCS_OK;
  }
  Status valid = ValidateRelativePath(req->id.path);
  if (valid.ok() && (req->length == 0 || req->length > self->options_.max_block_bytes)) {
    valid = Invalid("block length " + std::to_string(req->length) + " is outside 1.." +
                    std::to_string(self->options_.max_block_bytes));
  }
  if (!valid.ok()) {
    spdlog::warn("peer server {}: bad request from {}: {}", self->options_.node_id, conn->node_id,
                 valid.ToString());
    self->SendError(conn, req->request_id, valid);
    return UCS_OK;
  }
  uint64_t before = self->inflight_bytes_.fetch_add(req->length);
  if (before + req->length > self->options_.max_inflight_bytes && before != 0) {
    self->inflight_bytes_.fetch_sub(req->length);
    self->SendError(conn, req->request_id,
                    Status(Code::kBusy, "peer server is serving its in-flight byte limit"));
    return UCS_OK;
  }
  {
    MutexLock lock(&self->jobs_mu_);
    self->jobs_.push_back(Job{conn->id, std::move(req).value()});
  }
  self->jobs_cv_.notify_one();
  return UCS_OK;
}

ucs_status_t PeerServer::Impl::OnShardQuery(void* arg, const void*, size_t, void* data,
                                            size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  Conn* conn = self->ConnOf(param);
  if (conn == nullptr) return UCS_OK;
  if (!conn->authenticated) {
    self->Refuse(conn, "shard query before authentication");
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // Queries are sent eager; a rendezvous one is larger than any we ask. Dropped: the
    // asker times out and falls back to the backing store.
    self->shard_query_errors_.fetch_add(1, std::memory_order_relaxed);
    spdlog::warn("peer server {}: dropped an oversized shard query ({} bytes) from {}",
                 self->options_.node_id, length, conn->node_id);
    return UCS_OK;
  }
  std::string_view bytes(static_cast<const char*>(data), length);
  auto query = DecodeShardQuery(bytes);
  Status refusal = query.ok() ? Status::Ok() : query.status();
  if (refusal.ok() && self->options_.shard_states == nullptr) {
    refusal = Unsupported("this daemon keeps no shard states");
  }
  if (!refusal.ok()) {
    self->shard_query_errors_.fetch_add(1, std::memory_order_relaxed);
    spdlog::warn("peer server {}: bad shard query from {}: {}", self->options_.node_id,
                 conn->node_id, refusal.ToString());
    if (length < 8) return UCS_OK;  // not even an id to answer: dropped
    ShardAnswer answer;
    answer.query_id = 0;  // the id is the query's first 8 bytes, little-endian
    for (int i = 7; i >= 0; --i) {
      answer.query_id = (answer.query_id << 8) | static_cast<unsigned char>(bytes[i]);
    }
    answer.code = static_cast<uint32_t>(refusal.code());
    answer.error = refusal.message().substr(0, 1024);
    auto ctx = std::make_unique<SendCtx>();
    ctx->server = self;
    ctx->message = EncodeShardAnswer(answer);
    self->Send(conn->ep, kAmShardAnswer, std::move(ctx), nullptr, 0, false,
               UCP_AM_SEND_FLAG_EAGER);
    return UCS_OK;
  }
  HeldQuery held;
  held.conn_id = conn->id;
  held.node_id = conn->node_id;
  held.deadline = Clock::now() + std::min<std::chrono::milliseconds>(
                                     std::chrono::milliseconds(query->hold_ms),
                                     self->options_.max_query_hold);
  held.query = std::move(query).value();
  {
    MutexLock lock(&self->query_mu_);
    self->query_arrivals_.push_back(std::move(held));
  }
  self->query_cv_.notify_all();
  return UCS_OK;
}

void PeerServer::Impl::PostShardAnswer(uint64_t conn_id, std::string message) {
  worker_->Post([this, conn_id, message = std::move(message)]() mutable {
    auto it = conns_.find(conn_id);
    if (it == conns_.end()) return;  // the asker went away
    auto ctx = std::make_unique<SendCtx>();
    ctx->server = this;
    ctx->message = std::move(message);
    shard_queries_.fetch_add(1, std::memory_order_relaxed);
    Send(it->second.ep, kAmShardAnswer, std::move(ctx), nullptr, 0, false,
         UCP_AM_SEND_FLAG_EAGER);
  });
}

bool PeerServer::Impl::Evaluate(HeldQuery& q, Clock::time_point now, bool force,
                                std::string* out) {
  std::vector<ShardStatus> states;
  states.reserve(q.query.paths.size());
  for (const std::string& path : q.query.paths) {
    // A path that is not a clean relative name is unknown here (never a backing access).
    states.push_back(ValidateRelativePath(path).ok() ? options_.shard_states->Query(path)
                                                     : ShardStatus{});
  }
  bool answer = force || now >= q.deadline;
  if (!q.evaluated) {
    q.evaluated = true;
    for (size_t i = 0; i < states.size(); ++i) {
      if (states[i].state == ShardState::kPending) q.was_pending.push_back(i);
    }
    if (q.was_pending.empty()) answer = true;
  } else {
    for (size_t i : q.was_pending) {
      if (states[i].state != ShardState::kPending) answer = true;
    }
  }
  if (!answer) return false;
  if (q.query.want_checksums) {
    // Durable shards written here go with their block CRCs, for the exact version
    // published (the asker checks it against the backing store before using them).
    for (size_t i = 0; i < states.size(); ++i) {
      if (states[i].state != ShardState::kDurable) continue;
      std::shared_ptr<const ShardChecksums> sums =
          options_.shard_states->Checksums(q.query.paths[i]);
      if (sums && sums->id.size == states[i].length) states[i].checksums = std::move(sums);
    }
  }
  ShardAnswer a;
  a.query_id = q.query.query_id;
  a.code = static_cast<uint32_t>(Code::kOk);
  a.states = std::move(states);
  *out = EncodeShardAnswer(a);
  return true;
}

void PeerServer::Impl::QueryLoop() {
  std::vector<HeldQuery> held;  // this thread only
  std::vector<std::pair<std::string, std::vector<std::string>>> arrived;  // on_shard_query's
  while (true) {
    {
      MutexLock lock(&query_mu_);
      if (held.empty()) {
        while (!query_stop_ && query_arrivals_.empty() && !query_changed_) {
          query_cv_.wait(lock.native());
        }
      } else {
        Clock::time_point first = held.front().deadline;
        for (const HeldQuery& q : held) first = std::min(first, q.deadline);
        while (!query_stop_ && query_arrivals_.empty() && !query_changed_ &&
               Clock::now() < first) {
          query_cv_.wait_until(lock.native(), first);
        }
      }
      if (query_stop_) return;
      query_changed_ = false;
      arrived.clear();
      for (HeldQuery& q : query_arrivals_) {
        if (options_.on_shard_query) arrived.emplace_back(q.node_id, q.query.paths);
        held.push_back(std::move(q));
      }
      query_arrivals_.clear();
    }
    for (const auto& [node_id, paths] : arrived) options_.on_shard_query(node_id, paths);
    // Answer what is due; the provider is asked without query_mu_ (it may take the
    // namespace lock; its listener takes query_mu_). Beyond max_held_queries the oldest
    // are answered as they stand.
    const Clock::time_point now = Clock::now();
    const size_t over = held.size() > options_.max_held_queries
                            ? held.size() - options_.max_held_queries
                            : 0;
    std::vector<HeldQuery> keep;
    for (size_t i = 0; i < held.size(); ++i) {
      std::string out;
      if (Evaluate(held[i], now, /*force=*/i < over, &out)) {
        PostShardAnswer(held[i].conn_id, std::move(out));
      } else {
        keep.push_back(std::move(held[i]));
      }
    }
    held = std::move(keep);
  }
}

void PeerServer::Impl::ServeLoop() {
  while (true) {
    Job job;
    {
      MutexLock lock(&jobs_mu_);
      while (!jobs_stop_ && jobs_.empty()) jobs_cv_.wait(lock.native());
      if (jobs_stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    Serve(std::move(job));
  }
}

void PeerServer::Impl::Serve(Job job) {
  auto ctx = std::make_unique<SendCtx>();
  ctx->server = this;
  ctx->charged = job.request.length;
  ctx->data = pool_->Take(job.request.length);
  auto read = provider_->ReadBlock(job.request.id, job.request.offset,
                                   std::span<char>(ctx->data.data(), job.request.length));
  ResponseHeader h;
  h.request_id = job.request.request_id;
  if (read.ok() && read->bytes > job.request.length) {
    read = Internal("provider returned more bytes than asked");
  }
  if (read.ok()) {
    h.code = static_cast<uint32_t>(Code::kOk);
    h.length = read->bytes;
    h.crc32c = read->crc32c ? *read->crc32c : Crc32c(ctx->data.data(), read->bytes);
  } else {
    spdlog::debug("peer server {}: {} @{}+{}: {}", options_.node_id, job.request.id.path,
                  job.request.offset, job.request.length, read.status().ToString());
    h.code = static_cast<uint32_t>(read.status().code());
    ctx->message = read.status().message();
    h.length = ctx->message.size();
  }
  ctx->header = EncodeResponseHeader(h);
  ctx->data_bytes = read.ok() ? read->bytes : 0;
  if (!read.ok()) request_errors_.fetch_add(1, std::memory_order_relaxed);
  // The progress thread owns the endpoints, and the connection may have gone meanwhile.
  // (std::function needs a copyable task, hence the shared_ptr around the context.)
  std::shared_ptr<SendCtx> shared(ctx.release());
  worker_->Post([this, shared, conn_id = job.conn_id, ok = read.ok()] {
    auto c = std::make_unique<SendCtx>(std::move(*shared));
    auto it = conns_.find(conn_id);
    if (it == conns_.end()) {
      OnSendDone(nullptr, UCS_ERR_CANCELED, c.release());
      return;
    }
    if (ok) {
      blocks_served_.fetch_add(1, std::memory_order_relaxed);
      bytes_served_.fetch_add(c->data_bytes, std::memory_order_relaxed);
      const void* payload = c->data.data();
      size_t n = c->data_bytes;
      Send(it->second.ep, kAmResponse, std::move(c), payload, n, /*with_header=*/true);
    } else {
      Send(it->second.ep, kAmResponse, std::move(c), nullptr, 0, /*with_header=*/true);
    }
  });
}

PeerServer::PeerServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<PeerServer>> PeerServer::Create(const PeerServerOptions& options,
                                                       BlockSource* provider) {
  auto impl = std::make_unique<Impl>(options, provider);
  Status st = impl->Init();
  if (!st.ok()) {
    impl->Stop();
    return st;
  }
  return std::unique_ptr<PeerServer>(new PeerServer(std::move(impl)));
}

PeerServer::~PeerServer() { impl_->Stop(); }

uint16_t PeerServer::port() const { return impl_->port_; }

Status PeerServer::SetAllowedPeers(const std::vector<std::string>& peers) {
  return impl_->SetAllowedPeers(peers);
}

PeerServerStats PeerServer::stats() const {
  PeerServerStats s;
  s.connections = impl_->connections_.load();
  s.authenticated = impl_->authenticated_.load();
  s.refused = impl_->refused_.load();
  s.blocks_served = impl_->blocks_served_.load();
  s.bytes_served = impl_->bytes_served_.load();
  s.request_errors = impl_->request_errors_.load();
  s.shard_queries = impl_->shard_queries_.load();
  s.shard_query_errors = impl_->shard_query_errors_.load();
  s.pooled_bytes = impl_->pooled_bytes();
  return s;
}

}  // namespace ckptfs::store::peer
