// FUSE over io_uring without a kernel ring: how a request in a ring entry is laid out for
// libfuse, the queue count, the kernel's switch, and a FuseUring that was never started.
#include "fs/transport/fuse_uring.h"

#include <gtest/gtest.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "fs/fs_stats.h"
#include "fs/transport/fuse_uapi.h"

namespace ckptfs::fs {
namespace {

using fuse_uapi::InHeader;
using fuse_uapi::OutHeader;

constexpr size_t kHeader = sizeof(InHeader);  // 40
constexpr char kSentinel = '\x5a';

// A ring entry's buffers as the kernel leaves them: the header in in_out, the op struct in
// op_in, the payload at the start of its page-sized area's second part.
struct Entry {
  char in_out[128];
  char op_in[fuse_uapi::kUringOpInSize];
  std::vector<char> area;
  size_t room;
  char* payload() { return area.data() + room; }

  Entry(size_t room_bytes, size_t payload_bytes) : area(room_bytes + payload_bytes, kSentinel) {
    room = room_bytes;
    std::memset(in_out, 0, sizeof(in_out));
    std::memset(op_in, 0, sizeof(op_in));
  }
  InHeader SetHeader(uint32_t len, uint32_t opcode, uint64_t unique) {
    InHeader h{};
    h.len = len;
    h.opcode = opcode;
    h.unique = unique;
    h.nodeid = 0x1122334455667788ull;
    h.uid = 1000;
    h.gid = 1001;
    h.pid = 4242;
    std::memcpy(in_out, &h, sizeof(h));
    return h;
  }
  // Nothing before the payload was written.
  bool RoomUntouched() const {
    return std::all_of(area.begin(), area.begin() + room, [](char c) { return c == kSentinel; });
  }
};

std::vector<char> Bytes(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  return std::vector<char>(c, c + n);
}

std::vector<char> Pattern(size_t n, int seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 31 + seed) & 0xff);
  return v;
}

TEST(FuseUringLayOut, ARequestWithNoOpStructIsTheHeaderFollowedByItsPayload) {
  // LOOKUP: no op struct (the kernel's empty first argument), the name in the payload.
  const char name[] = "model.safetensors";  // with its NUL, as the kernel sends it
  const uint32_t payload_sz = sizeof(name);
  Entry e(4096, 8192);
  const InHeader h = e.SetHeader(kHeader + payload_sz, /*LOOKUP*/ 1, 77);
  std::memcpy(e.payload(), name, payload_sz);
  std::memset(e.op_in, 0x33, sizeof(e.op_in));  // stale bytes that must not be copied

  Result<char*> start = FuseUring::LayOut(e.in_out, e.op_in, payload_sz, e.payload(), e.room,
                                          /*max_payload=*/8192);
  ASSERT_TRUE(start.ok()) << start.status().ToString();
  EXPECT_EQ(*start, e.payload() - kHeader);
  EXPECT_EQ(Bytes(*start, kHeader), Bytes(&h, kHeader));
  EXPECT_EQ(std::string(*start + kHeader), "model.safetensors");
  EXPECT_EQ(Bytes(*start + kHeader, payload_sz), Bytes(name, payload_sz));
  // Only the header's 40 bytes before the payload were written.
  EXPECT_TRUE(std::all_of(e.area.begin(), e.area.begin() + (e.room - kHeader),
                          [](char c) { return c == kSentinel; }));
}

TEST(FuseUringLayOut, ARequestWithAnOpStructIsHeaderOpStructAndPayloadContiguous) {
  // WRITE: fuse_write_in (40 bytes) in op_in, the data in the payload, not copied.
  const uint32_t op_sz = 40;
  const uint32_t payload_sz = 64 * 1024;
  Entry e(4096, 128 * 1024);
  const InHeader h = e.SetHeader(kHeader + op_sz + payload_sz, /*WRITE*/ 16, 78);
  const std::vector<char> op = Pattern(op_sz, 1);
  const std::vector<char> data = Pattern(payload_sz, 7);
  std::memcpy(e.op_in, op.data(), op_sz);
  std::memset(e.op_in + op_sz, 0x33, sizeof(e.op_in) - op_sz);
  std::memcpy(e.payload(), data.data(), payload_sz);

  Result<char*> start = FuseUring::LayOut(e.in_out, e.op_in, payload_sz, e.payload(), e.room,
                                          /*max_payload=*/128 * 1024);
  ASSERT_TRUE(start.ok()) << start.status().ToString();
  EXPECT_EQ(*start, e.payload() - kHeader - op_sz);
  std::vector<char> want = Bytes(&h, kHeader);
  want.insert(want.end(), op.begin(), op.end());
  want.insert(want.end(), data.begin(), data.end());
  EXPECT_TRUE(Bytes(*start, h.len) == want) << "the laid out request differs";
  EXPECT_EQ(Bytes(*start, kHeader), Bytes(&h, kHeader));
  EXPECT_EQ(Bytes(*start + kHeader, op_sz), op);
  EXPECT_TRUE(std::all_of(e.area.begin(), e.area.begin() + (e.room - kHeader - op_sz),
                          [](char c) { return c == kSentinel; }));
}

TEST(FuseUringLayOut, AcceptsTheLargestOpStructAndPayloadAndAnExactRoom) {
  const uint32_t op_sz = fuse_uapi::kUringOpInSize;  // 128
  const uint32_t payload_sz = 16384;
  Entry e(kHeader + op_sz, payload_sz);  // just room for the header and the op struct
  const InHeader h = e.SetHeader(kHeader + op_sz + payload_sz, 16, 79);
  const std::vector<char> op = Pattern(op_sz, 3);
  std::memcpy(e.op_in, op.data(), op_sz);
  Result<char*> start = FuseUring::LayOut(e.in_out, e.op_in, payload_sz, e.payload(), e.room,
                                          /*max_payload=*/payload_sz);
  ASSERT_TRUE(start.ok()) << start.status().ToString();
  EXPECT_EQ(*start, e.area.data());
  EXPECT_EQ(Bytes(*start, kHeader), Bytes(&h, kHeader));
  EXPECT_EQ(Bytes(*start + kHeader, op_sz), op);
  EXPECT_EQ(Bytes(e.payload(), payload_sz), std::vector<char>(payload_sz, kSentinel));
}

TEST(FuseUringLayOut, ARequestWithNoPayloadEndsAtThePayload) {
  // READ: fuse_read_in only; the reply goes into the payload later.
  const uint32_t op_sz = 40;
  Entry e(4096, 8192);
  const InHeader h = e.SetHeader(kHeader + op_sz, /*READ*/ 15, 80);
  const std::vector<char> op = Pattern(op_sz, 5);
  std::memcpy(e.op_in, op.data(), op_sz);
  Result<char*> start = FuseUring::LayOut(e.in_out, e.op_in, 0, e.payload(), e.room, 8192);
  ASSERT_TRUE(start.ok()) << start.status().ToString();
  EXPECT_EQ(*start, e.payload() - h.len);
  EXPECT_EQ(Bytes(*start + kHeader, op_sz), op);
  EXPECT_EQ(Bytes(e.payload(), 8192), std::vector<char>(8192, kSentinel));
}

TEST(FuseUringLayOut, RefusesSizesThatDoNotAddUpWithoutWritingAnything) {
  struct Case {
    const char* what;
    uint32_t len, payload_sz, max_payload;
    size_t room;
  };
  const Case cases[] = {
      {"payload over the entry's max", kHeader + 8193, 8193, 8192, 4096},
      {"length shorter than header and payload", kHeader + 99, 100, 8192, 4096},
      {"length shorter than the header", 16, 0, 8192, 4096},
      {"op struct over 128 bytes", kHeader + 129 + 10, 10, 8192, 4096},
      {"op struct over 128 bytes, no payload", kHeader + 200, 0, 8192, 4096},
      {"room too small for header and op struct", kHeader + 40 + 10, 10, 8192, kHeader + 39},
      {"room too small for the header", kHeader + 10, 10, 8192, kHeader - 1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Entry e(c.room, 16384);
    e.SetHeader(c.len, 16, 81);
    std::memset(e.op_in, 0x33, sizeof(e.op_in));
    const std::vector<char> payload = Pattern(16384, 9);
    std::memcpy(e.payload(), payload.data(), payload.size());
    Result<char*> start =
        FuseUring::LayOut(e.in_out, e.op_in, c.payload_sz, e.payload(), e.room, c.max_payload);
    ASSERT_FALSE(start.ok());
    EXPECT_EQ(start.status().code(), Code::kInvalid) << start.status().ToString();
    EXPECT_TRUE(e.RoomUntouched());
    EXPECT_EQ(Bytes(e.payload(), payload.size()), payload);
  }
}

TEST(FuseUring, PossibleCpusIsOnePlusTheHighestPossibleCpu) {
  const int n = FuseUring::PossibleCpus();
  EXPECT_GE(n, 1);
  std::ifstream in("/sys/devices/system/cpu/possible");
  std::string line;
  if (!in || !std::getline(in, line)) {
    EXPECT_EQ(n, std::max(1L, ::sysconf(_SC_NPROCESSORS_CONF)));
    return;
  }
  // "0-3,8-11": every number is a CPU, the largest is the highest.
  int highest = -1;
  const std::regex number("[0-9]+");
  for (std::sregex_iterator it(line.begin(), line.end(), number), end; it != end; ++it) {
    highest = std::max(highest, std::stoi(it->str()));
  }
  ASSERT_GE(highest, 0) << "cannot parse '" << line << "'";
  EXPECT_EQ(n, highest + 1) << "possible: " << line;
}

TEST(FuseUring, KernelEnabledReadsTheModuleParameterOrFailsWithoutIt) {
  const char* path = "/sys/module/fuse/parameters/enable_uring";
  Result<bool> on = FuseUring::KernelEnabled();
  std::ifstream in(path);
  std::string v;
  if (!in || !std::getline(in, v)) {
    EXPECT_FALSE(on.ok()) << "no " << path << " yet KernelEnabled() says " << *on;
    return;
  }
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  ASSERT_TRUE(v == "Y" || v == "N") << path << " holds '" << v << "'";
  EXPECT_EQ(*on, v == "Y");
}

struct Unstarted {
  FuseTransportStats stats;
  int dispatched = 0;
  int fatals = 0;
  FuseUring uring{-1, FuseUringOptions{}, [this](char*, size_t) { ++dispatched; },
                  [this](const std::string&) { ++fatals; }, &stats};
};

TEST(FuseUring, TakeReplyLeavesRepliesOfThreadsNotServingARingRequestToDevFuse) {
  Unstarted u;
  OutHeader h{};
  h.len = sizeof(h) + 5;
  h.unique = 1;
  char data[5] = {'h', 'e', 'l', 'l', 'o'};
  struct iovec iov[2] = {{&h, sizeof(h)}, {data, sizeof(data)}};
  EXPECT_FALSE(u.uring.TakeReply(iov, 2));
  EXPECT_FALSE(u.uring.TakeReply(iov, 1));
  h.unique = 0;
  EXPECT_FALSE(u.uring.TakeReply(iov, 2));
  bool other = true;
  std::thread([&] { other = u.uring.TakeReply(iov, 2); }).join();
  EXPECT_FALSE(other);
  // Untouched: the reply still goes to /dev/fuse as it is.
  EXPECT_EQ(h.len, sizeof(h) + 5);
  EXPECT_EQ(h.error, 0);
  EXPECT_EQ(std::string(data, sizeof(data)), "hello");
  EXPECT_EQ(u.dispatched, 0);
  EXPECT_EQ(u.fatals, 0);
  EXPECT_EQ(u.stats.uring_errors.load(), 0u);
}

TEST(FuseUring, ANeverStartedRingStopsTwiceAndIsDestroyedQuietly) {
  {
    Unstarted u;  // destroyed without Start() or Stop()
  }
  Unstarted u;
  u.uring.Stop();
  u.uring.Stop();
  // Once stopped it never starts: no queue, no thread (nothing touches the kernel).
  u.uring.Start(1u << 20);
  EXPECT_EQ(u.stats.uring_queues.load(), 0u);
  EXPECT_EQ(u.stats.uring_threads.load(), 0u);
  EXPECT_EQ(u.stats.uring_requests.load(), 0u);
  EXPECT_EQ(u.dispatched, 0);
  EXPECT_EQ(u.fatals, 0);
  u.uring.Stop();
}

}  // namespace
}  // namespace ckptfs::fs
