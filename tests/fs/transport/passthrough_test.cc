// The passthrough pieces without a kernel: the INIT patch, and the per-inode io modes over
// a fake backing device.
#include "fs/transport/passthrough.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <future>
#include <set>
#include <thread>
#include <vector>

namespace ckptfs::fs {
namespace {

using fuse_uapi::InHeader;
using fuse_uapi::InitIn;
using fuse_uapi::InitOut;
using fuse_uapi::OutHeader;

std::vector<char> InitRequest(uint64_t unique, uint32_t flags, uint32_t flags2) {
  InHeader h{};
  h.opcode = fuse_uapi::kOpInit;
  h.unique = unique;
  InitIn in{};
  in.major = 7;
  in.minor = 45;
  in.flags = flags;
  in.flags2 = flags2;
  h.len = sizeof(h) + sizeof(in);
  std::vector<char> buf(sizeof(h) + sizeof(in));
  std::memcpy(buf.data(), &h, sizeof(h));
  std::memcpy(buf.data() + sizeof(h), &in, sizeof(in));
  return buf;
}

struct Reply {
  OutHeader h{};
  InitOut out{};
  struct iovec iov[2];
  explicit Reply(uint64_t unique) {
    h.unique = unique;
    h.len = sizeof(h) + sizeof(out);
    out.flags = 1u << 2;  // something libfuse set
    iov[0] = {&h, sizeof(h)};
    iov[1] = {&out, sizeof(out)};
  }
};

TEST(InitPatcher, AsksForPassthroughInTheInitReplyWhenTheKernelOffersIt) {
  InitPatcher p(true);
  auto req = InitRequest(7, fuse_uapi::kInitExt, fuse_uapi::kFlags2Passthrough);
  p.OnRequest(req.data(), req.size());
  EXPECT_TRUE(p.offered());
  EXPECT_EQ(p.kernel_minor(), 45u);
  Reply other(8);  // not INIT's reply: untouched
  EXPECT_FALSE(p.OnReply(other.iov, 2));
  EXPECT_EQ(other.out.flags2, 0u);
  Reply r(7);
  EXPECT_TRUE(p.OnReply(r.iov, 2));
  EXPECT_TRUE(p.patched());
  EXPECT_EQ(r.out.flags, (1u << 2) | fuse_uapi::kInitExt);
  EXPECT_EQ(r.out.flags2, fuse_uapi::kFlags2Passthrough);
  EXPECT_EQ(r.out.max_stack_depth, 1u);
  Reply again(7);  // one INIT per session
  EXPECT_FALSE(p.OnReply(again.iov, 2));
}

TEST(InitPatcher, LeavesTheReplyAloneWhenNotOfferedOrNotWanted) {
  {
    InitPatcher p(true);
    auto req = InitRequest(3, fuse_uapi::kInitExt, 0);  // no FUSE_PASSTHROUGH
    p.OnRequest(req.data(), req.size());
    EXPECT_FALSE(p.offered());
    Reply r(3);
    EXPECT_TRUE(p.OnReply(r.iov, 2));  // INIT's reply, seen but not patched
    EXPECT_FALSE(p.patched());
    EXPECT_EQ(r.out.flags2, 0u);
    EXPECT_EQ(r.out.flags, 1u << 2);
    EXPECT_EQ(r.out.max_stack_depth, 0u);
  }
  {
    InitPatcher p(true);
    // flags2 set but not an extended INIT: flags2 means nothing.
    auto req = InitRequest(3, 0, fuse_uapi::kFlags2Passthrough);
    p.OnRequest(req.data(), req.size());
    EXPECT_FALSE(p.offered());
  }
  {
    InitPatcher p(false);
    auto req = InitRequest(3, fuse_uapi::kInitExt, fuse_uapi::kFlags2Passthrough);
    p.OnRequest(req.data(), req.size());
    EXPECT_TRUE(p.offered());
    Reply r(3);
    EXPECT_TRUE(p.OnReply(r.iov, 2));  // INIT's reply, seen but not patched
    EXPECT_FALSE(p.patched());
    EXPECT_EQ(r.out.flags2, 0u);
    EXPECT_EQ(r.out.flags, 1u << 2);
    EXPECT_EQ(r.out.max_stack_depth, 0u);
  }
}

TEST(InitPatcher, AsksForFuseOverIoUringOnlyWhenWantedAndOffered) {
  const uint32_t uring = fuse_uapi::kFlags2OverIoUring;
  {
    InitPatcher p(/*want_passthrough=*/false, /*want_uring=*/true);
    auto req = InitRequest(5, fuse_uapi::kInitExt, uring);
    p.OnRequest(req.data(), req.size());
    EXPECT_TRUE(p.uring_offered());
    EXPECT_FALSE(p.offered());
    EXPECT_FALSE(p.uring_patched());  // not before the reply
    Reply r(5);
    EXPECT_TRUE(p.OnReply(r.iov, 2));
    EXPECT_TRUE(p.uring_patched());
    EXPECT_FALSE(p.patched());
    EXPECT_EQ(r.out.flags, (1u << 2) | fuse_uapi::kInitExt);
    EXPECT_EQ(r.out.flags2, uring);
    EXPECT_EQ(r.out.max_stack_depth, 0u);  // passthrough was not asked for
  }
  // The reply is seen and left alone when io_uring is offered but not wanted, or wanted
  // but not offered (a kernel without it, or enable_uring=N).
  for (const bool want : {false, true}) {
    const uint32_t offer = want ? fuse_uapi::kFlags2Passthrough : uring;
    InitPatcher p(/*want_passthrough=*/false, /*want_uring=*/want);
    auto req = InitRequest(5, fuse_uapi::kInitExt, offer);
    p.OnRequest(req.data(), req.size());
    EXPECT_EQ(p.uring_offered(), !want);
    Reply r(5);
    EXPECT_TRUE(p.OnReply(r.iov, 2));
    EXPECT_FALSE(p.uring_patched());
    EXPECT_EQ(r.out.flags, 1u << 2);
    EXPECT_EQ(r.out.flags2, 0u);
  }
}

TEST(InitPatcher, AsksForPassthroughAndIoUringTogether) {
  InitPatcher p(/*want_passthrough=*/true, /*want_uring=*/true);
  auto req = InitRequest(9, fuse_uapi::kInitExt,
                         fuse_uapi::kFlags2Passthrough | fuse_uapi::kFlags2OverIoUring);
  p.OnRequest(req.data(), req.size());
  EXPECT_TRUE(p.offered());
  EXPECT_TRUE(p.uring_offered());
  Reply r(9);
  EXPECT_TRUE(p.OnReply(r.iov, 2));
  EXPECT_TRUE(p.patched());
  EXPECT_TRUE(p.uring_patched());
  EXPECT_EQ(r.out.flags, (1u << 2) | fuse_uapi::kInitExt);
  EXPECT_EQ(r.out.flags2, fuse_uapi::kFlags2Passthrough | fuse_uapi::kFlags2OverIoUring);
  EXPECT_EQ(r.out.max_stack_depth, 1u);
}

TEST(InitPatcher, IgnoresTheIoUringBitOfAnInitRequestThatIsNotExtended) {
  InitPatcher p(/*want_passthrough=*/true, /*want_uring=*/true);
  // flags2 without FUSE_INIT_EXT means nothing.
  auto req = InitRequest(4, 0, fuse_uapi::kFlags2OverIoUring | fuse_uapi::kFlags2Passthrough);
  p.OnRequest(req.data(), req.size());
  EXPECT_FALSE(p.uring_offered());
  EXPECT_FALSE(p.offered());
  Reply r(4);
  EXPECT_TRUE(p.OnReply(r.iov, 2));
  EXPECT_FALSE(p.uring_patched());
  EXPECT_FALSE(p.patched());
  EXPECT_EQ(r.out.flags, 1u << 2);
  EXPECT_EQ(r.out.flags2, 0u);
}

TEST(InitPatcher, MaxPayloadFollowsTheKernelsRuleFromTheInitReply) {
  struct Case {
    uint32_t flags, max_write;
    uint16_t max_pages;
    uint32_t want;
  };
  const Case cases[] = {
      // FUSE_MAX_PAGES: max_pages pages, or max_write if larger.
      {fuse_uapi::kFlagMaxPages, 1u << 20, 256, 1u << 20},
      {fuse_uapi::kFlagMaxPages, 128u << 10, 256, 256u * 4096},
      {fuse_uapi::kFlagMaxPages, 1u << 20, 16, 1u << 20},
      // Without it max_pages means nothing: 32 pages, or max_write if larger.
      {0, 128u << 10, 256, 128u << 10},
      {0, 4096, 0, 32u * 4096},
      {0, 4096, 256, 32u * 4096},
      {0, 1u << 20, 0, 1u << 20},
      // 8 KiB at least.
      {fuse_uapi::kFlagMaxPages, 4096, 1, 8192},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "flags " << c.flags << " max_write " << c.max_write
                                    << " max_pages " << c.max_pages);
    InitPatcher p(/*want_passthrough=*/false, /*want_uring=*/true);
    EXPECT_EQ(p.max_payload(), 0u);  // before the reply
    auto req = InitRequest(6, fuse_uapi::kInitExt, fuse_uapi::kFlags2OverIoUring);
    p.OnRequest(req.data(), req.size());
    Reply r(6);
    r.out.flags |= c.flags;
    r.out.max_write = c.max_write;
    r.out.max_pages = c.max_pages;
    ASSERT_TRUE(p.OnReply(r.iov, 2));
    EXPECT_EQ(p.max_payload(), c.want);
    // The patch leaves the sizes alone.
    EXPECT_EQ(r.out.max_write, c.max_write);
    EXPECT_EQ(r.out.max_pages, c.max_pages);
  }
}

// Registers backing files like the kernel: ids from 1, closes checked.
class FakeDevice : public BackingDevice {
 public:
  struct State {
    int next = 1;
    int fail_errno = 0;
    std::set<int> open;
    int opened = 0, closed = 0;
  };
  explicit FakeDevice(State* s) : s_(s) {}
  int Open(int) override {
    if (s_->fail_errno != 0) return -s_->fail_errno;
    s_->open.insert(s_->next);
    ++s_->opened;
    return s_->next++;
  }
  int Close(int32_t id) override {
    if (s_->open.erase(id) == 0) return -ENOENT;
    ++s_->closed;
    return 0;
  }

 private:
  State* s_;
};

struct TableFixture {
  PassthroughStats stats;
  FakeDevice::State dev;
  PassthroughTable table;
  explicit TableFixture(std::chrono::milliseconds wait = std::chrono::milliseconds(50))
      : table(PassthroughTable::Options{wait}, &stats) {
    table.Enable(std::make_unique<FakeDevice>(&dev), "");
  }
};

TEST(PassthroughTable, ReadersOfOneInodeShareOneBackingIdClosedWithTheLastOpen) {
  TableFixture f;
  auto a = f.table.AcquireRead(10, 3, 1, 100, 4096);
  auto b = f.table.AcquireRead(10, 4, 1, 100, 4096);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_GE(*a, 1);
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(f.dev.opened, 1);
  EXPECT_EQ(f.stats.opens.load(), 2u);
  EXPECT_EQ(f.stats.bytes_opened.load(), 8192u);
  f.table.Release(10, true);
  EXPECT_EQ(f.dev.closed, 0);
  f.table.Release(10, true);
  EXPECT_EQ(f.dev.closed, 1);
  EXPECT_TRUE(f.dev.open.empty());
  EXPECT_EQ(f.stats.open_now.load(), 0);
  // The next reader registers a fresh id.
  auto c = f.table.AcquireRead(10, 5, 1, 100, 1);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(*c, *a);
  f.table.Release(10, true);
}

TEST(PassthroughTable, AWriterWaitsForReadersThenFailsBusyInsteadOfWaitingForItself) {
  TableFixture f;
  ASSERT_EQ(*f.table.AcquireRead(10, 3, 1, 100, 1), 1);
  Status st = f.table.AcquireOther(10, /*changes=*/true);
  EXPECT_EQ(st.code(), Code::kBusy) << st.ToString();
  EXPECT_EQ(f.stats.conflict_waits.load(), 1u);
  EXPECT_EQ(f.stats.conflict_busy.load(), 1u);
  // Other inodes are not held up.
  EXPECT_TRUE(f.table.AcquireOther(11, true).ok());
  f.table.Release(11, false);
  f.table.Release(10, true);
}

TEST(PassthroughTable, AWriterProceedsOnceTheReadersReleaseArrives) {
  TableFixture f(std::chrono::milliseconds(60000));
  ASSERT_GE(*f.table.AcquireRead(10, 3, 1, 100, 1), 1);
  auto writer =
      std::async(std::launch::async, [&] { return f.table.AcquireOther(10, /*changes=*/true); });
  // The writer is blocked (it cannot pass while the reader is counted) until the release.
  while (f.stats.conflict_waits.load() == 0) std::this_thread::yield();
  f.table.Release(10, true);
  Status st = writer.get();
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(f.stats.conflict_busy.load(), 0u);
  // While the writer is open, readers are served by the daemon (no id), never mixed.
  EXPECT_EQ(*f.table.AcquireRead(10, 4, 1, 100, 1), -1);
  f.table.Release(10, false);
  EXPECT_GE(*f.table.AcquireRead(10, 4, 1, 100, 1), 1);
  f.table.Release(10, true);
}

TEST(PassthroughTable, ADaemonReadOpenDoesNotWaitButIsBusyWhileReadersPassThrough) {
  TableFixture f(std::chrono::milliseconds(60000));
  ASSERT_GE(*f.table.AcquireRead(10, 3, 1, 100, 1), 1);
  EXPECT_EQ(f.table.AcquireOther(10, /*changes=*/false).code(), Code::kBusy);
  EXPECT_EQ(f.stats.conflict_waits.load(), 0u);
  f.table.Release(10, true);
  EXPECT_TRUE(f.table.AcquireOther(10, false).ok());
  f.table.Release(10, false);
}

TEST(PassthroughTable, AReplacedBackingFileIsNotServedUnderTheOldId) {
  TableFixture f;
  ASSERT_GE(*f.table.AcquireRead(10, 3, 1, 100, 1), 1);
  auto other = f.table.AcquireRead(10, 4, 1, 200, 1);  // same inode, another backing inode
  EXPECT_EQ(other.status().code(), Code::kBusy);
  f.table.Release(10, true);
  EXPECT_GE(*f.table.AcquireRead(10, 4, 1, 200, 1), 1);
  f.table.Release(10, true);
}

TEST(PassthroughTable, APermissionRefusalTurnsItOffForTheMountAFileRefusalOnlyForTheFile) {
  TableFixture f;
  f.dev.fail_errno = ELOOP;  // this backing file's fs is stacked too deep
  EXPECT_EQ(*f.table.AcquireRead(10, 3, 1, 100, 1), -1);
  EXPECT_TRUE(f.table.enabled());
  EXPECT_EQ(f.stats.refused.load(), 1u);
  EXPECT_TRUE(f.table.AcquireOther(10, false).ok());  // served by the daemon
  f.table.Release(10, false);
  f.dev.fail_errno = EPERM;  // no CAP_SYS_ADMIN
  EXPECT_EQ(*f.table.AcquireRead(11, 3, 1, 101, 1), -1);
  EXPECT_FALSE(f.table.enabled());
  EXPECT_NE(f.stats.state().find("off"), std::string::npos);
  f.dev.fail_errno = 0;
  EXPECT_EQ(*f.table.AcquireRead(12, 3, 1, 102, 1), -1);  // stays off
  EXPECT_EQ(f.dev.opened, 0);
}

TEST(PassthroughTable, OffUntilEnabled) {
  PassthroughStats stats;
  PassthroughTable table(PassthroughTable::Options{}, &stats);
  EXPECT_EQ(*table.AcquireRead(10, 3, 1, 100, 1), -1);
  table.Enable(nullptr, "--passthrough off");
  EXPECT_EQ(stats.state(), "off: --passthrough off");
  EXPECT_TRUE(table.AcquireOther(10, true).ok());
  table.Release(10, false);
}

}  // namespace
}  // namespace ckptfs::fs
