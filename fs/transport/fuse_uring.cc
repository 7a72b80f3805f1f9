#include "fs/transport/fuse_uring.h"

#include <fcntl.h>
#include <linux/io_uring.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/backoff.h"
#include "common/thread_name.h"
#include "fs/transport/fuse_uapi.h"

namespace ckptfs::fs {
namespace {

constexpr uint64_t kTagEntry = 1;
constexpr uint64_t kTagStop = 2;
constexpr size_t kRoom = 4096;  // before each payload: where in_header and the op struct go
constexpr int kRegisterTries = 50;
// The pause before registering a refused entry again: 10 ms, doubling to 40 ms (under 2 s
// for all kRegisterTries).
constexpr Backoff kRegisterBackoff{std::chrono::milliseconds(10), std::chrono::milliseconds(40)};

// One thread's io_uring, by raw system calls (Debian 12 has no liburing that knows
// IORING_OP_URING_CMD): SQE128, since a FUSE command's own bytes live in the SQE. Used by
// the thread that made it alone (IORING_SETUP_SINGLE_ISSUER where the kernel has it).
class Ring {
 public:
  Ring() = default;
  ~Ring() {
    if (sqes_ != nullptr) ::munmap(sqes_, sqes_len_);
    if (cq_ != nullptr && cq_ != sq_) ::munmap(cq_, cq_len_);
    if (sq_ != nullptr) ::munmap(sq_, sq_len_);
    if (fd_ >= 0) ::close(fd_);
  }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  Status Init(unsigned entries) {
    io_uring_params p{};
    // Task work (a request handed to this thread's entry) runs when the thread waits in
    // io_uring_enter, which is where it waits: no interrupting signal-like wakeups.
    p.flags = IORING_SETUP_SQE128 | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
    fd_ = static_cast<int>(::syscall(__NR_io_uring_setup, entries, &p));
    if (fd_ < 0 && errno == EINVAL) {  // a kernel before 6.1
      p = io_uring_params{};
      p.flags = IORING_SETUP_SQE128;
      fd_ = static_cast<int>(::syscall(__NR_io_uring_setup, entries, &p));
    }
    if (fd_ < 0) return Status::FromErrno(errno, "io_uring_setup");
    sq_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) sq_len_ = cq_len_ = std::max(sq_len_, cq_len_);
    sq_ = Map(sq_len_, IORING_OFF_SQ_RING);
    cq_ = single ? sq_ : Map(cq_len_, IORING_OFF_CQ_RING);
    sqes_len_ = p.sq_entries * 128;
    sqes_ = Map(sqes_len_, IORING_OFF_SQES);
    if (sq_ == nullptr || cq_ == nullptr || sqes_ == nullptr) {
      return Status::FromErrno(errno, "mmap of an io_uring");
    }
    auto at = [](void* base, uint32_t off) { return static_cast<char*>(base) + off; };
    sq_head_ = reinterpret_cast<unsigned*>(at(sq_, p.sq_off.head));
    sq_tail_ = reinterpret_cast<unsigned*>(at(sq_, p.sq_off.tail));
    sq_mask_ = *reinterpret_cast<unsigned*>(at(sq_, p.sq_off.ring_mask));
    sq_array_ = reinterpret_cast<unsigned*>(at(sq_, p.sq_off.array));
    cq_head_ = reinterpret_cast<unsigned*>(at(cq_, p.cq_off.head));
    cq_tail_ = reinterpret_cast<unsigned*>(at(cq_, p.cq_off.tail));
    cq_mask_ = *reinterpret_cast<unsigned*>(at(cq_, p.cq_off.ring_mask));
    cqes_ = reinterpret_cast<io_uring_cqe*>(at(cq_, p.cq_off.cqes));
    tail_ = *sq_tail_;
    return Status::Ok();
  }

  // A zeroed SQE at the tail (the rings here hold more slots than a thread ever queues).
  io_uring_sqe* Next() {
    const unsigned i = tail_ & sq_mask_;
    auto* sqe = reinterpret_cast<io_uring_sqe*>(static_cast<char*>(sqes_) + i * 128);
    std::memset(sqe, 0, 128);
    sq_array_[i] = i;
    ++tail_;
    __atomic_store_n(sq_tail_, tail_, __ATOMIC_RELEASE);
    return sqe;
  }

  // Submits what is queued and waits for one completion: 0 or -errno (EINTR included).
  // Submits what is queued without waiting: a FUSE register command is issued (and the
  // entry made available to the kernel) before this returns.
  int Submit() {
    const unsigned pending = tail_ - __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
    const long rc = ::syscall(__NR_io_uring_enter, fd_, pending, 0, 0, nullptr, 0);
    return rc < 0 ? -errno : 0;
  }

  int SubmitAndWait() {
    const unsigned pending = tail_ - __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
    const long rc =
        ::syscall(__NR_io_uring_enter, fd_, pending, 1, IORING_ENTER_GETEVENTS, nullptr, 0);
    return rc < 0 ? -errno : 0;
  }

  template <typename F>
  void Drain(F f) {
    unsigned head = *cq_head_;
    const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    for (; head != tail; ++head) f(cqes_[head & cq_mask_]);
    __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
  }

 private:
  void* Map(size_t len, off_t off) {
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, off);
    return p == MAP_FAILED ? nullptr : p;
  }

  int fd_ = -1;
  void *sq_ = nullptr, *cq_ = nullptr, *sqes_ = nullptr;
  size_t sq_len_ = 0, cq_len_ = 0, sqes_len_ = 0;
  unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr;
  unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0, tail_ = 0;
  io_uring_cqe* cqes_ = nullptr;
};

bool ConnectionGone(int err) { return err == ENOTCONN || err == ECONNABORTED || err == ENODEV; }

}  // namespace

// One ring entry: the two buffers registered with the kernel, and the request being served.
struct FuseUring::Entry {
  fuse_uapi::RingHeader header{};
  char* area = nullptr;  // kRoom + max_payload bytes; the payload starts at kRoom
  size_t area_len = 0;
  char* payload = nullptr;
  struct iovec iov[2]{};
  uint64_t unique = 0;
  bool direct = false;   // the reply goes straight into the payload (the request had none)
  bool replied = false;
  uint32_t reply_size = 0;
  std::vector<char> side;  // the reply to a request with a payload, until its handler returns

  ~Entry() {
    if (area != nullptr) ::munmap(area, area_len);
  }
};

thread_local FuseUring::Entry* FuseUring::current_ = nullptr;

FuseUring::FuseUring(int dev_fd, FuseUringOptions options, Dispatch dispatch, Fatal fatal,
                     FuseTransportStats* stats)
    : dev_fd_(dev_fd),
      options_(options),
      dispatch_(std::move(dispatch)),
      fatal_(std::move(fatal)),
      stats_(stats),
      stop_fd_(::eventfd(0, EFD_CLOEXEC)) {}

FuseUring::~FuseUring() {
  Stop();
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

int FuseUring::PossibleCpus() {
  // "0-3,8-11": the highest number plus one, as the kernel's nr_cpu_ids.
  std::ifstream in("/sys/devices/system/cpu/possible");
  std::string line;
  int highest = -1;
  if (std::getline(in, line)) {
    std::stringstream ss(line);
    std::string range;
    while (std::getline(ss, range, ',')) {
      const size_t dash = range.find('-');
      try {
        highest = std::max(highest, std::stoi(dash == std::string::npos ? range
                                                                          : range.substr(dash + 1)));
      } catch (const std::exception&) {
      }
    }
  }
  if (highest < 0) highest = static_cast<int>(::sysconf(_SC_NPROCESSORS_CONF)) - 1;
  return std::max(1, highest + 1);
}

namespace {
constexpr char kEnableUring[] = "/sys/module/fuse/parameters/enable_uring";
}  // namespace

Result<bool> FuseUring::KernelEnabled() {
  std::ifstream in(kEnableUring);
  std::string v;
  if (!in || !std::getline(in, v)) {
    return Status(Code::kNotFound, std::string(kEnableUring) + " is missing: this kernel has "
                                   "no FUSE over io_uring (Linux 6.14+, CONFIG_FUSE_IO_URING)");
  }
  return v == "Y" || v == "1";
}

Status FuseUring::SetKernelEnabled(bool on) {
  const int fd = ::open(kEnableUring, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, std::string("open ") + kEnableUring);
  const char c = on ? 'Y' : 'N';
  const bool ok = ::write(fd, &c, 1) == 1;
  const int err = errno;
  ::close(fd);
  if (!ok) return Status::FromErrno(err, std::string("write ") + kEnableUring);
  return Status::Ok();
}

Result<char*> FuseUring::LayOut(const void* in_out, const void* op_in, uint32_t payload_sz,
                                char* payload, size_t room, uint32_t max_payload) {
  fuse_uapi::InHeader in;
  std::memcpy(&in, in_out, sizeof(in));
  if (payload_sz > max_payload) {
    return Invalid("payload of " + std::to_string(payload_sz) + " bytes, over the entry's " +
                   std::to_string(max_payload));
  }
  if (in.len < sizeof(in) + payload_sz) {
    return Invalid("request length " + std::to_string(in.len) + " shorter than its payload " +
                   std::to_string(payload_sz));
  }
  const size_t op = in.len - sizeof(in) - payload_sz;
  if (op > fuse_uapi::kUringOpInSize || sizeof(in) + op > room) {
    return Invalid("op struct of " + std::to_string(op) + " bytes");
  }
  char* start = payload - sizeof(in) - op;
  std::memcpy(start, &in, sizeof(in));
  std::memcpy(start + sizeof(in), op_in, op);
  return start;
}

void FuseUring::Start(uint32_t max_payload) {
  MutexLock lock(&mu_);
  if (started_ || stopping_.load()) return;
  started_ = true;
  if (stop_fd_ < 0) {
    stats_->SetState("/dev/fuse: io_uring not started (eventfd failed)");
    spdlog::warn("fuse: io_uring not started: its stop eventfd could not be made");
    return;
  }
  max_payload_ = std::max<uint32_t>(max_payload, 8192);
  const int n = PossibleCpus();
  for (int q = 0; q < n; ++q) {
    queues_.push_back(std::make_unique<Queue>());
    queues_.back()->qid = q;
  }
  stats_->uring_queues.store(static_cast<uint64_t>(n));
  stats_->SetState("io_uring: " + std::to_string(n) + " queues registering");
  spdlog::info("fuse: io_uring: {} queues ({} to {} threads each, {} KiB payloads)", n,
               options_.min_threads_per_queue, options_.max_threads_per_queue,
               max_payload_ >> 10);
  for (auto& q : queues_) {
    for (int i = 0; i < options_.min_threads_per_queue; ++i) {
      q->threads.fetch_add(1);
      stats_->uring_threads.fetch_add(1);
      threads_.emplace_back([this, qp = q.get()] { Serve(qp); });
    }
  }
}

void FuseUring::Stop() {
  std::vector<std::thread> threads;
  {
    MutexLock lock(&mu_);
    if (stopping_.exchange(true)) return;
    threads.swap(threads_);
  }
  if (stop_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!::write(stop_fd_, &one, sizeof(one));
  }
  for (auto& t : threads) t.join();
}

void FuseUring::Spawn(Queue* q) {
  MutexLock lock(&mu_);
  if (stopping_.load() || q->threads.load() >= options_.max_threads_per_queue) return;
  q->threads.fetch_add(1);
  stats_->uring_threads.fetch_add(1);
  threads_.emplace_back([this, q] { Serve(q); });
}

bool FuseUring::TakeReply(const struct iovec* iov, int count) {
  Entry* e = current_;
  if (e == nullptr || count < 1 || iov[0].iov_len < sizeof(fuse_uapi::OutHeader)) return false;
  fuse_uapi::OutHeader h;
  std::memcpy(&h, iov[0].iov_base, sizeof(h));
  if (h.unique != e->unique || e->replied) return false;
  size_t n = 0;
  for (int i = 1; i < count; ++i) n += iov[i].iov_len;
  if (n > max_payload_) {
    spdlog::error("fuse: io_uring: a reply of {} bytes does not fit the entry's {}; answered EIO",
                  n, max_payload_);
    stats_->uring_errors.fetch_add(1);
    h.error = -EIO;
    n = 0;
  }
  char* dst = e->payload;
  if (!e->direct && n > 0) {
    // The handler may still read its request (a name, written bytes) in the payload.
    e->side.resize(n);
    dst = e->side.data();
  }
  size_t off = 0;
  for (int i = 1; i < count && n > 0; ++i) {
    std::memmove(dst + off, iov[i].iov_base, iov[i].iov_len);
    off += iov[i].iov_len;
  }
  h.len = static_cast<uint32_t>(sizeof(h) + n);
  std::memcpy(e->header.in_out, &h, sizeof(h));
  e->reply_size = static_cast<uint32_t>(n);
  e->replied = true;
  return true;
}

void FuseUring::Answer(Entry* e) {
  fuse_uapi::InHeader in;
  std::memcpy(&in, e->header.in_out, sizeof(in));
  e->unique = in.unique;
  e->replied = false;
  e->reply_size = 0;
  e->direct = e->header.ent.payload_sz == 0;
  Result<char*> request = LayOut(e->header.in_out, e->header.op_in, e->header.ent.payload_sz,
                                 e->payload, kRoom, max_payload_);
  if (request.ok()) {
    current_ = e;
    dispatch_(*request, in.len);
    current_ = nullptr;
  } else {
    spdlog::error("fuse: io_uring: request {} (opcode {}) cannot be laid out: {}; answered EIO",
                  in.unique, in.opcode, request.status().message());
  }
  if (!e->replied) {
    if (request.ok()) {
      spdlog::error("fuse: io_uring: request {} (opcode {}) got no reply; answered EIO",
                    in.unique, in.opcode);
    }
    stats_->uring_errors.fetch_add(1);
    const fuse_uapi::OutHeader h{sizeof(fuse_uapi::OutHeader), -EIO, in.unique};
    std::memcpy(e->header.in_out, &h, sizeof(h));
    e->reply_size = 0;
  } else if (!e->direct && e->reply_size > 0) {
    std::memcpy(e->payload, e->side.data(), e->reply_size);
  }
  e->header.ent.payload_sz = e->reply_size;
  stats_->uring_requests.fetch_add(1);
}

void FuseUring::Serve(Queue* q) {
  const std::string name = "ckptfs-uring" + std::to_string(q->qid);
  NameThisThread(name.c_str());
  // Not pinned to CPU qid, whose requests this queue gets. The scheduler mostly runs the
  // thread there anyway (where it last ran, or beside the reader that woke it), and where
  // another CPU is idle it can serve there: a reply the daemon copies itself (retained
  // tier, block cache) is then copied beside the reader's own work instead of between it.
  // Pinned, one rank's retained-tier load of 512 MiB took 0.518 s against 0.388 s over
  // /dev/fuse on a 2-CPU VM; unpinned 0.408 s. An open() costs the same either way.
  std::string why;
  Ring ring;
  auto e = std::make_unique<Entry>();
  if (Status st = ring.Init(8); !st.ok()) {
    why = st.message();
  } else {
    e->area_len = kRoom + max_payload_;
    void* area = ::mmap(nullptr, e->area_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                        -1, 0);
    if (area == MAP_FAILED) {
      why = std::string("mmap of an entry: ") + std::strerror(errno);
      e->area_len = 0;
    } else {
      e->area = static_cast<char*>(area);
      e->payload = e->area + kRoom;
      e->iov[0] = {&e->header, sizeof(e->header)};
      e->iov[1] = {e->payload, max_payload_};
    }
  }
  auto command = [&](uint32_t op, uint64_t commit_id) {
    io_uring_sqe* sqe = ring.Next();
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = dev_fd_;
    sqe->cmd_op = op;
    sqe->addr = reinterpret_cast<uint64_t>(e->iov);
    sqe->len = 2;
    sqe->user_data = kTagEntry;
    fuse_uapi::UringCmdReq cmd{};
    cmd.commit_id = commit_id;
    cmd.qid = static_cast<uint16_t>(q->qid);
    std::memcpy(reinterpret_cast<char*>(sqe) + 48, &cmd, sizeof(cmd));
  };
  if (why.empty()) {
    io_uring_sqe* sqe = ring.Next();
    sqe->opcode = IORING_OP_POLL_ADD;
    sqe->fd = stop_fd_;
    sqe->poll32_events = POLLIN;
    sqe->user_data = kTagStop;
    command(fuse_uapi::kUringCmdRegister, 0);
    // Counted idle only once the kernel has the entry: a request that arrives while a
    // queue has no registered entry waits for the next commit on that queue, and a
    // registration does not take it (the kernel's rule), so the spawn below must see an
    // entry that is not there yet as missing.
    if (const int rc = ring.Submit(); rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      why = std::string("io_uring_enter: ") + std::strerror(-rc);
    }
  }
  bool served = false;
  int register_tries = 0;
  q->idle.fetch_add(1);
  while (why.empty()) {
    const int rc = ring.SubmitAndWait();
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      why = std::string("io_uring_enter: ") + std::strerror(-rc);
      break;
    }
    bool stop = false, request = false;
    int err = 0;
    ring.Drain([&](const io_uring_cqe& cqe) {
      if (cqe.user_data == kTagStop) {
        stop = true;
      } else if (cqe.res < 0) {
        err = -cqe.res;
      } else {
        request = true;
      }
    });
    if (stop || stopping_.load()) break;
    if (err != 0) {
      if (ConnectionGone(err)) break;  // unmounted: nothing left to serve
      // EAGAIN: the connection is not initialized yet. Anything else: the kernel refused
      // this entry; register the buffers again as a new entry, a few times in a row (an
      // entry the kernel refused after a request, e.g. an unknown commit id, may stay
      // with the kernel until the connection ends: a leak of its bookkeeping, not of a
      // request).
      if (++register_tries > kRegisterTries) {
        why = std::string("the kernel refused a ring entry: ") + std::strerror(err);
        break;
      }
      if (err != EAGAIN || register_tries == 1) {
        spdlog::warn("fuse: io_uring queue {}: entry refused ({}); registering again", q->qid,
                     std::strerror(err));
      }
      stats_->uring_errors.fetch_add(err == EAGAIN ? 0 : 1);
      std::this_thread::sleep_for(kRegisterBackoff.Delay(register_tries - 1));
      command(fuse_uapi::kUringCmdRegister, 0);
      continue;
    }
    if (!request) continue;
    register_tries = 0;
    if (!served) {
      served = true;
      if (stats_->uring_requests.load() == 0) {
        stats_->SetState("io_uring: " + std::to_string(queues_.size()) + " queues");
        spdlog::info("fuse: requests now come over io_uring");
      }
    }
    // Fewer than spare_entries registered entries are left idle on this queue: start
    // another thread, so a handler that waits never leaves this CPU's next request
    // without a server. Spawning before the last one is taken matters: a request that
    // finds no registered entry stays queued in the kernel until one of this queue's
    // entries commits, which a waiting handler may not do for seconds; a new entry that
    // registers meanwhile does not take it.
    if (q->idle.fetch_sub(1) - 1 < options_.spare_entries) Spawn(q);
    Answer(e.get());
    q->idle.fetch_add(1);
    command(fuse_uapi::kUringCmdCommitAndFetch, e->header.ent.commit_id);
  }
  q->idle.fetch_sub(1);
  ThreadEnded(q, why);
}

void FuseUring::ThreadEnded(Queue* q, const std::string& why) {
  const int left = q->threads.fetch_sub(1) - 1;
  if (why.empty() || stopping_.load()) return;
  spdlog::error("fuse: io_uring queue {}: a thread ended: {} ({} left)", q->qid, why, left);
  if (left > 0) return;
  if (stats_->uring_requests.load() == 0) {
    // The rings never took over (the kernel switches only once every queue has an entry):
    // requests keep coming over /dev/fuse.
    stats_->SetState("/dev/fuse: io_uring refused: " + why);
    return;
  }
  fatal_("io_uring queue " + std::to_string(q->qid) + " has no thread left (" + why + ")");
}

}  // namespace ckptfs::fs
