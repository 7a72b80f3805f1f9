#include "store/peer/peer_client.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>

#include <unordered_map>

#include "common/mutex.h"
#include "store/peer/buffer_pool.h"
#include "store/peer/protocol.h"
#include "store/peer/ucx_worker.h"
#include "store/primitives/crc32c.h"

namespace ckptfs::store::peer {
namespace {

// One outstanding Fetch. The progress thread fills buf/len/crc and then Complete()s; the
// fetching thread reads them only after seeing `done`.
struct Pending {
  uint64_t id = 0;
  uint64_t capacity = 0;
  BufferPool::Buffer buf;
  size_t len = 0;
  uint32_t crc = 0;

  Mutex mu;
  std::condition_variable cv;
  bool done GUARDED_BY(mu) = false;
  Status status GUARDED_BY(mu);

  void Complete(Status st) EXCLUDES(mu) {
    {
      MutexLock lock(&mu);
      if (done) return;
      done = true;
      status = std::move(st);
    }
    cv.notify_all();
  }
};

}  // namespace

// One outstanding commit query; completed once (answer, failure, or the waiter's timeout).
struct PeerClient::QueryCall {
  uint64_t id = 0;
  size_t count = 0;  // paths asked
  std::chrono::steady_clock::time_point deadline;
  Mutex mu;
  std::condition_variable cv;
  bool done GUARDED_BY(mu) = false;
  Result<std::vector<ShardStatus>> result GUARDED_BY(mu){
      Status(Code::kInternal, "query not answered")};

  void Complete(Result<std::vector<ShardStatus>> r) EXCLUDES(mu) {
    {
      MutexLock lock(&mu);
      if (done) return;
      done = true;
      result = std::move(r);
    }
    cv.notify_all();
  }
};

class PeerClient::Impl {
 public:
  explicit Impl(const PeerClientOptions& options) : options_(options) {}

  Status Connect();
  void Shutdown() {
    if (worker_) worker_->Shutdown();
  }
  Result<size_t> Fetch(const BlockId& id, uint64_t offset, std::span<char> out);
  std::shared_ptr<QueryCall> StartShardQuery(const std::vector<std::string>& paths,
                                             std::chrono::milliseconds hold);
  Result<std::vector<ShardStatus>> WaitShardQuery(const std::shared_ptr<QueryCall>& call);
  bool healthy() const EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return state_ == State::kReady;
  }

  uint64_t pooled_bytes() const { return pool_->cached_bytes(); }

  const PeerClientOptions options_;
  std::atomic<uint64_t> fetched_blocks_{0}, fetched_bytes_{0}, errors_{0}, timeouts_{0},
      bad_checksums_{0};

 private:
  enum class State { kConnecting, kReady, kFailed };

  // Progress thread.
  Status StartOnWorker(UcxWorker& w);
  void Fail(const Status& status);
  void SendSmall(unsigned am_id, std::string payload, unsigned extra_flags = 0);
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t OnChallenge(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAuthResult(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnResponse(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnShardAnswer(void* arg, const void* header, size_t header_length,
                                    void* data, size_t length, const ucp_am_recv_param_t* param);
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  static void OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data);
  Status PeerStatus(Code code, const std::string& what) const {
    return Status(code, "peer " + options_.server + ": " + what);
  }

  // Reply buffers, reused; a Buffer keeps the pool alive past the client if need be.
  std::shared_ptr<BufferPool> pool_ = BufferPool::Create(64ull << 20);
  std::unique_ptr<UcxWorker> worker_;
  std::atomic<uint64_t> next_id_{1};

  // Progress thread only.
  UcxWorker* uw_ = nullptr;  // == worker_.get(), set on the progress thread itself
  ucp_worker_h ucp_worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  Nonce client_nonce_{}, server_nonce_{};
  std::unordered_map<uint64_t, std::shared_ptr<Pending>> pending_;
  std::unordered_map<uint64_t, std::shared_ptr<QueryCall>> queries_;

  mutable Mutex mu_;
  std::condition_variable cv_;
  State state_ GUARDED_BY(mu_) = State::kConnecting;
  Status failure_ GUARDED_BY(mu_);  // set when state_ is kFailed
};

Status PeerClient::Impl::Connect() {
  if (options_.secret.size() < kMinSecretBytes) {
    return Invalid("peer client: the shared secret is shorter than " +
                   std::to_string(kMinSecretBytes) + " bytes");
  }
  if (options_.node_id.empty() || options_.node_id.size() > kMaxNodeIdBytes) {
    return Invalid("peer client: bad node id '" + options_.node_id + "'");
  }
  const auto started = std::chrono::steady_clock::now();
  auto w = UcxWorker::Create(
      "client " + options_.node_id + "->" + options_.server,
      {[this](UcxWorker& w) { return StartOnWorker(w); },
       [this](UcxWorker&) {
         Fail(Status(Code::kAborted, "peer " + options_.server + ": client closed"));
       }});
  if (!w.ok()) return w.status();
  worker_ = std::move(w).value();
  const auto worker_made = std::chrono::steady_clock::now();
  MutexLock lock(&mu_);
  if (!cv_.wait_for(lock.native(), options_.connect_timeout, [&] {
        mu_.AssertHeld();  // the predicate runs under the lock
        return state_ != State::kConnecting;
      })) {
    lock.Unlock();
    Status st =
        PeerStatus(Code::kTimeout, "no authenticated connection within " +
                                       std::to_string(options_.connect_timeout.count()) + " ms");
    worker_->Post([this, st] { Fail(st); });
    return st;
  }
  if (state_ == State::kFailed) return failure_;
  using Ms = std::chrono::duration<double, std::milli>;
  spdlog::info("peer client {}: connected to {} and authenticated in {:.1f} ms ({:.1f} ms of "
               "them making the UCX worker)",
               options_.node_id, options_.server,
               Ms(std::chrono::steady_clock::now() - started).count(),
               Ms(worker_made - started).count());
  return Status::Ok();
}

Status PeerClient::Impl::StartOnWorker(UcxWorker& w) {
  uw_ = &w;
  ucp_worker_ = w.worker();
  for (auto [id, cb] :
       {std::pair{kAmChallenge, &OnChallenge}, std::pair{kAmAuthResult, &OnAuthResult},
        std::pair{kAmResponse, &OnResponse}, std::pair{kAmShardAnswer, &OnShardAnswer}}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = id;
    hp.cb = cb;
    hp.arg = this;
    ucs_status_t s = ucp_worker_set_am_recv_handler(ucp_worker_, &hp);
    if (s != UCS_OK) return Internal("peer client: set AM handler: " + UcsError(s));
  }
  CKPT_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(options_.server));
  if (host_port.second == 0)
    return Invalid("peer client: server address " + options_.server + " has port 0");
  CKPT_ASSIGN_OR_RETURN(SockAddr addr, ResolveSockAddr(host_port.first, host_port.second));
  CKPT_ASSIGN_OR_RETURN(client_nonce_, RandomNonce());
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = addr.get();
  ep.sockaddr.addrlen = addr.length;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &OnEpError;
  ep.err_handler.arg = this;
  ucs_status_t s = ucp_ep_create(ucp_worker_, &ep, &ep_);
  if (s != UCS_OK) {
    ep_ = nullptr;
    return PeerStatus(Code::kIo, "cannot connect: " + UcsError(s));
  }
  Hello hello;
  hello.node_id = options_.node_id;
  hello.client_nonce = client_nonce_;
  SendSmall(kAmHello, EncodeHello(hello));
  return Status::Ok();
}

void PeerClient::Impl::Fail(const Status& status) {
  {
    MutexLock lock(&mu_);
    if (state_ == State::kFailed) return;
    state_ = State::kFailed;
    failure_ = status;
  }
  cv_.notify_all();
  auto pending = std::move(pending_);
  pending_.clear();
  for (auto& [id, p] : pending) p->Complete(status);
  auto queries = std::move(queries_);
  queries_.clear();
  for (auto& [id, q] : queries) q->Complete(status);
  if (ep_ != nullptr) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(ep_, &p);
    ep_ = nullptr;
    if (uw_->stopping()) {
      uw_->WaitRequest(r, 2000);  // at shutdown the worker goes next: let the close finish
    } else if (UCS_PTR_IS_PTR(r)) {
      ucp_request_free(r);
    }
  }
}

void PeerClient::Impl::SendSmall(unsigned am_id, std::string payload, unsigned extra_flags) {
  auto* owned = new std::string(std::move(payload));
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY | extra_flags;
  p.cb.send = &OnSendDone;
  p.user_data = owned;
  void* r = ucp_am_send_nbx(ep_, am_id, nullptr, 0, owned->data(), owned->size(), &p);
  if (UCS_PTR_IS_PTR(r)) return;  // OnSendDone frees the payload and the request
  delete owned;
  if (UCS_PTR_IS_ERR(r)) Fail(PeerStatus(Code::kIo, "send: " + UcsError(UCS_PTR_STATUS(r))));
}

// Completion callbacks free their request here: freeing it at the call site would cancel
// the callback (ucp_request_free), leaking the payload or never finishing the fetch.
void PeerClient::Impl::OnSendDone(void* request, ucs_status_t, void* user_data) {
  delete static_cast<std::string*>(user_data);
  if (request != nullptr) ucp_request_free(request);
}

void PeerClient::Impl::OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* self = static_cast<Impl*>(arg);
  bool connecting;
  {
    MutexLock lock(&self->mu_);
    connecting = self->state_ == State::kConnecting;
  }
  std::string what = connecting ? "connection failed during the handshake (" + UcsError(status) +
                                      "): server down, or it refused this node"
                                : "connection lost (" + UcsError(status) + ")";
  spdlog::warn("peer client {}: {}: {}", self->options_.node_id, self->options_.server, what);
  self->Fail(self->PeerStatus(Code::kIo, what));
}

ucs_status_t PeerClient::Impl::OnChallenge(void* arg, const void*, size_t, void* data,
                                           size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    self->Fail(self->PeerStatus(Code::kCorrupt, "oversized challenge"));
    return UCS_OK;
  }
  auto ch = DecodeChallenge(std::string_view(static_cast<const char*>(data), length));
  if (!ch.ok()) {
    self->Fail(self->PeerStatus(Code::kCorrupt, ch.status().message()));
    return UCS_OK;
  }
  self->server_nonce_ = ch->server_nonce;
  AuthMsg auth;
  auth.client_proof = ComputeProof(self->options_.secret, ProofRole::kClient,
                                   self->options_.node_id, self->client_nonce_, ch->server_nonce);
  self->SendSmall(kAmAuth, EncodeAuth(auth));
  return UCS_OK;
}

ucs_status_t PeerClient::Impl::OnAuthResult(void* arg, const void*, size_t, void* data,
                                            size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  auto result = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)
                    ? Result<AuthResult>(Corrupt("oversized auth result"))
                    : DecodeAuthResult(std::string_view(static_cast<const char*>(data), length));
  if (!result.ok()) {
    self->Fail(self->PeerStatus(Code::kCorrupt, result.status().message()));
    return UCS_OK;
  }
  if (!result->accepted) {
    self->Fail(self->PeerStatus(Code::kPermission,
                                "server refused this node (not in its peer list, or a wrong "
                                "shared secret)"));
    return UCS_OK;
  }
  Proof expected = ComputeProof(self->options_.secret, ProofRole::kServer, self->options_.node_id,
                                self->client_nonce_, self->server_nonce_);
  if (!ProofEquals(expected, result->server_proof)) {
    spdlog::warn("peer client {}: server {} failed authentication (wrong shared secret)",
                 self->options_.node_id, self->options_.server);
    self->Fail(
        self->PeerStatus(Code::kPermission, "server failed authentication (wrong shared secret)"));
    return UCS_OK;
  }
  {
    MutexLock lock(&self->mu_);
    if (self->state_ == State::kConnecting) self->state_ = State::kReady;
  }
  self->cv_.notify_all();
  return UCS_OK;
}

ucs_status_t PeerClient::Impl::OnResponse(void* arg, const void* header, size_t header_length,
                                          void* data, size_t length,
                                          const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  auto h = DecodeResponseHeader(std::string_view(static_cast<const char*>(header), header_length));
  if (!h.ok()) {
    self->Fail(self->PeerStatus(Code::kCorrupt, h.status().message()));
    return UCS_OK;
  }
  auto it = self->pending_.find(h->request_id);
  if (it == self->pending_.end()) return UCS_OK;  // timed out: drop (an RNDV is released)
  std::shared_ptr<Pending> p = std::move(it->second);
  self->pending_.erase(it);
  bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
  if (h->code != static_cast<uint32_t>(Code::kOk)) {
    self->errors_.fetch_add(1, std::memory_order_relaxed);
    std::string msg = rndv ? "error" : std::string(static_cast<const char*>(data), length);
    Code code =
        h->code <= static_cast<uint32_t>(Code::kTooManyOpenFiles) ? Code(h->code) : Code::kIo;
    p->Complete(self->PeerStatus(code, msg));
    return UCS_OK;
  }
  if (h->length != length || length > p->capacity) {
    p->Complete(self->PeerStatus(Code::kCorrupt, "reply of " + std::to_string(length) +
                                                     " bytes for a request of " +
                                                     std::to_string(p->capacity)));
    return UCS_OK;
  }
  p->buf = self->pool_->Take(length);
  p->len = length;
  p->crc = h->crc32c;
  if (!rndv) {
    std::memcpy(p->buf.data(), data, length);
    p->Complete(Status::Ok());
    return UCS_OK;
  }
  // Rendezvous: keep the descriptor (UCS_INPROGRESS) and start the receive from the progress
  // loop, outside the callback, as UCX's own examples do.
  self->uw_->Post([self, p, data, length] {
    auto* holder = new std::shared_ptr<Pending>(p);
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &OnRecvDone;
    rp.user_data = holder;
    void* r = ucp_am_recv_data_nbx(self->ucp_worker_, data, p->buf.data(), length, &rp);
    if (!UCS_PTR_IS_PTR(r)) OnRecvDone(nullptr, UCS_PTR_STATUS(r), length, holder);
  });
  return UCS_INPROGRESS;  // the descriptor lives until ucp_am_recv_data_nbx takes it
}

void PeerClient::Impl::OnRecvDone(void* request, ucs_status_t status, size_t, void* user_data) {
  if (request != nullptr) ucp_request_free(request);
  std::unique_ptr<std::shared_ptr<Pending>> holder(
      static_cast<std::shared_ptr<Pending>*>(user_data));
  Pending& p = **holder;
  if (status == UCS_OK) {
    p.Complete(Status::Ok());
  } else {
    p.Complete(Status(Code::kIo, "peer: block transfer failed: " + UcsError(status)));
  }
}

Result<size_t> PeerClient::Impl::Fetch(const BlockId& id, uint64_t offset, std::span<char> out) {
  {
    MutexLock lock(&mu_);
    if (state_ == State::kFailed) return failure_;
  }
  if (out.empty()) return Invalid("peer fetch: empty buffer");
  auto p = std::make_shared<Pending>();
  p->id = next_id_.fetch_add(1, std::memory_order_relaxed);
  p->capacity = out.size();
  BlockRequest req;
  req.request_id = p->id;
  req.id = id;
  req.offset = offset;
  req.length = out.size();
  auto deadline = std::chrono::steady_clock::now() + options_.request_timeout;
  worker_->Post([this, p, msg = EncodeRequest(req)]() mutable {
    {
      MutexLock lock(&mu_);
      if (state_ == State::kFailed) {
        p->Complete(failure_);
        return;
      }
    }
    pending_[p->id] = p;
    SendSmall(kAmRequest, std::move(msg));
  });
  MutexLock lock(&p->mu);
  if (!p->cv.wait_until(lock.native(), deadline, [&] {
        p->mu.AssertHeld();  // the predicate runs under the lock
        return p->done;
      })) {
    p->done = true;  // a late reply is dropped
    p->status =
        PeerStatus(Code::kTimeout,
                   "no reply within " + std::to_string(options_.request_timeout.count()) + " ms");
    Status timed_out = p->status;
    lock.Unlock();
    timeouts_.fetch_add(1, std::memory_order_relaxed);
    worker_->Post([this, rid = p->id] { pending_.erase(rid); });
    return timed_out;
  }
  if (!p->status.ok()) return p->status;
  lock.Unlock();
  uint32_t crc = Crc32c(p->buf.data(), p->len);
  if (crc != p->crc) {
    bad_checksums_.fetch_add(1, std::memory_order_relaxed);
    spdlog::warn("peer client {}: block {} @{}+{} from {} failed its checksum", options_.node_id,
                 id.path, offset, out.size(), options_.server);
    return PeerStatus(Code::kCorrupt,
                      "checksum mismatch on " + id.path + " @" + std::to_string(offset));
  }
  std::memcpy(out.data(), p->buf.data(), p->len);
  fetched_blocks_.fetch_add(1, std::memory_order_relaxed);
  fetched_bytes_.fetch_add(p->len, std::memory_order_relaxed);
  return p->len;
}

ucs_status_t PeerClient::Impl::OnShardAnswer(void* arg, const void*, size_t, void* data,
                                             size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // Answers are sent eager and small; the query it belongs to times out.
    spdlog::warn("peer client {}: dropped an oversized shard answer from {}",
                 self->options_.node_id, self->options_.server);
    return UCS_OK;
  }
  auto answer = DecodeShardAnswer(std::string_view(static_cast<const char*>(data), length));
  if (!answer.ok()) {
    spdlog::warn("peer client {}: malformed shard answer from {}: {}", self->options_.node_id,
                 self->options_.server, answer.status().ToString());
    if (length < 8) return UCS_OK;
    uint64_t id = 0;
    for (int i = 7; i >= 0; --i) id = (id << 8) | static_cast<const unsigned char*>(data)[i];
    auto it = self->queries_.find(id);
    if (it != self->queries_.end()) {
      it->second->Complete(self->PeerStatus(Code::kCorrupt, answer.status().message()));
      self->queries_.erase(it);
    }
    return UCS_OK;
  }
  auto it = self->queries_.find(answer->query_id);
  if (it == self->queries_.end()) return UCS_OK;  // timed out meanwhile
  std::shared_ptr<QueryCall> q = std::move(it->second);
  self->queries_.erase(it);
  if (answer->code != static_cast<uint32_t>(Code::kOk)) {
    Code code = answer->code <= static_cast<uint32_t>(Code::kTooManyOpenFiles) ? Code(answer->code)
                                                                               : Code::kIo;
    q->Complete(self->PeerStatus(code, answer->error));
  } else if (answer->states.size() != q->count) {
    q->Complete(self->PeerStatus(Code::kCorrupt, "shard answer has " +
                                                     std::to_string(answer->states.size()) +
                                                     " states for " + std::to_string(q->count) +
                                                     " paths"));
  } else {
    q->Complete(std::move(answer->states));
  }
  return UCS_OK;
}

std::shared_ptr<PeerClient::QueryCall> PeerClient::Impl::StartShardQuery(
    const std::vector<std::string>& paths, std::chrono::milliseconds hold) {
  auto q = std::make_shared<QueryCall>();
  q->id = next_id_.fetch_add(1, std::memory_order_relaxed);
  q->count = paths.size();
  q->deadline = std::chrono::steady_clock::now() + hold + options_.request_timeout;
  {
    MutexLock lock(&mu_);
    if (state_ == State::kFailed) {
      q->Complete(failure_);
      return q;
    }
  }
  if (paths.size() > kMaxQueryPaths) {
    q->Complete(Invalid("peer query: more than " + std::to_string(kMaxQueryPaths) + " paths"));
    return q;
  }
  ShardQuery query;
  query.query_id = q->id;
  query.hold_ms = static_cast<uint32_t>(
      std::min<int64_t>(std::max<int64_t>(0, hold.count()), kQueryWantsChecksums - 1));
  query.want_checksums = true;  // durable shards come with their block CRCs
  query.paths = paths;
  std::string msg = EncodeShardQuery(query);
  if (msg.size() > kMaxQueryBytes) {
    q->Complete(Invalid("peer query: more than " + std::to_string(kMaxQueryBytes) + " bytes"));
    return q;
  }
  worker_->Post([this, q, msg = std::move(msg)]() mutable {
    {
      MutexLock lock(&mu_);
      if (state_ == State::kFailed) {
        q->Complete(failure_);
        return;
      }
    }
    queries_[q->id] = q;
    SendSmall(kAmShardQuery, std::move(msg), UCP_AM_SEND_FLAG_EAGER);
  });
  return q;
}

Result<std::vector<ShardStatus>> PeerClient::Impl::WaitShardQuery(
    const std::shared_ptr<QueryCall>& q) {
  MutexLock lock(&q->mu);
  if (!q->cv.wait_until(lock.native(), q->deadline, [&] {
        q->mu.AssertHeld();  // the predicate runs under the lock
        return q->done;
      })) {
    q->done = true;  // a late answer is dropped
    q->result = PeerStatus(Code::kTimeout, "no answer to a shard query in time");
    lock.Unlock();
    timeouts_.fetch_add(1, std::memory_order_relaxed);
    worker_->Post([this, rid = q->id] { queries_.erase(rid); });
    lock.Lock();
  }
  return q->result;
}

PeerClient::PeerClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<PeerClient>> PeerClient::Connect(const PeerClientOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  Status st = impl->Connect();
  if (!st.ok()) {
    impl->Shutdown();
    return st;
  }
  return std::unique_ptr<PeerClient>(new PeerClient(std::move(impl)));
}

PeerClient::~PeerClient() { impl_->Shutdown(); }

Result<size_t> PeerClient::Fetch(const BlockId& id, uint64_t offset, std::span<char> out) {
  return impl_->Fetch(id, offset, out);
}

std::shared_ptr<PeerClient::QueryCall> PeerClient::StartShardQuery(
    const std::vector<std::string>& paths, std::chrono::milliseconds hold) {
  return impl_->StartShardQuery(paths, hold);
}

Result<std::vector<ShardStatus>> PeerClient::WaitShardQuery(
    const std::shared_ptr<QueryCall>& call) {
  return impl_->WaitShardQuery(call);
}

bool PeerClient::healthy() const { return impl_->healthy(); }

const std::string& PeerClient::server() const { return impl_->options_.server; }

PeerClientStats PeerClient::stats() const {
  PeerClientStats s;
  s.fetched_blocks = impl_->fetched_blocks_.load();
  s.fetched_bytes = impl_->fetched_bytes_.load();
  s.errors = impl_->errors_.load();
  s.timeouts = impl_->timeouts_.load();
  s.bad_checksums = impl_->bad_checksums_.load();
  s.pooled_bytes = impl_->pooled_bytes();
  return s;
}

}  // namespace ckptfs::store::peer
