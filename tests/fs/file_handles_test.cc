// Filesystem file handles across publication, driven without FUSE: the calls a FUSE
// request makes (Open, Read, Write, Release, GetAttr) on a real Filesystem over a
// temporary backing directory, in async mode.
//
// Covers the read path against a publication that renames a new file over the one a
// handle has open (issue 10, item 2: handles opened before, during and after a rewrite
// all read the file's current bytes, never EIO), opening for write without writing
// (item 5: nothing changes), and attributes that stay as the mount showed them when the
// journal applies entries on the backing store.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fs/filesystem.h"
#include "fs/fs_util.h"
#include "tests/fs/fs_fixture.h"

namespace ckptfs::fs {
namespace {

// The shared fixture (tests/fs/fs_fixture.h) with no faults set, in async mode.
class FileHandles : public FaultyFsTest {
 protected:
  void SetUp() override { Start(); }

  using FaultyFsTest::WriteFile;
  // Creates (or truncates) `name` in the root with `data`, closes it, and waits until it
  // is published.
  uint64_t WriteFile(const std::string& name, const std::string& data) {
    return WriteFile(kRootIno, name, data);
  }

  struct stat BackingStat(const std::string& path) {
    struct stat st {};
    EXPECT_EQ(::lstat(BackingPath(path).c_str(), &st), 0) << path;
    return st;
  }
};

bool SameTime(const struct timespec& a, const struct timespec& b) {
  return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

// The FileStore sequence that returned EIO: a reader's handle, opened while the file had
// no write state, was closed while a writer's was open, and took the writer's count with
// it; the write state was then dropped under the next handle, which had nothing to read.
TEST_F(FileHandles, ReaderClosedDuringAnotherWriteLeavesLaterHandlesReadable) {
  const uint64_t ino = WriteFile("store", "a");
  std::string expect = "a";
  for (int round = 0; round < 20; ++round) {
    Handle* reader = OpenOk(ino, O_RDONLY);
    Handle* writer = OpenOk(ino, O_RDWR);
    ASSERT_TRUE(reader && writer);
    EXPECT_EQ(ReadAll(reader), expect);
    fs_->Release(reader);
    const std::string more(1 + round, static_cast<char>('b' + round));
    ASSERT_TRUE(WriteAt(*fs_, writer, more.data(), more.size(), expect.size()).ok());
    expect += more;
    fs_->Release(writer);
    Handle* next = OpenOk(ino, O_RDWR);
    ASSERT_TRUE(next);
    WaitPublished(ino);  // the publication is applied with `next` open
    EXPECT_EQ(ReadAll(next), expect) << "round " << round;
    fs_->Release(next);
  }
}

// POSIX: a descriptor names the file, so bytes written and published through another
// descriptor are what it reads, not those of the inode the name had at its open.
TEST_F(FileHandles, DescriptorOpenedBeforeRewriteReadsTheNewBytesAfterPublication) {
  const uint64_t ino = WriteFile("shard", std::string(100000, 'o'));
  Handle* early = OpenOk(ino, O_RDONLY);
  ASSERT_TRUE(early);
  const std::string fresh(70000, 'n');
  auto rewrite = fs_->Open(ino, O_WRONLY | O_TRUNC);
  ASSERT_TRUE(rewrite.ok());
  ASSERT_TRUE(WriteAt(*fs_, *rewrite, fresh.data(), fresh.size(), 0).ok());
  fs_->Release(*rewrite);
  WaitPublished(ino);
  EXPECT_EQ(ReadAll(early), fresh);
  fs_->Release(early);
  Handle* later = OpenOk(ino, O_RDONLY);
  EXPECT_EQ(ReadAll(later), fresh);
  fs_->Release(later);
}

TEST_F(FileHandles, OpenForWritingAndCloseWithoutWriteChangesNothing) {
  const uint64_t ino = WriteFile("untouched", "contents");
  auto before = fs_->GetAttr(ino);
  ASSERT_TRUE(before.ok());
  const struct stat backing_before = BackingStat("untouched");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a clock tick would show
  for (int flags : {O_RDWR, O_WRONLY, O_RDWR | O_APPEND}) {
    Handle* h = OpenOk(ino, flags);
    ASSERT_TRUE(h);
    ASSERT_TRUE(fs_->Flush(h).ok());
    fs_->Release(h);
  }
  auto created = fs_->Create(kRootIno, "untouched", 0644, O_RDWR | O_CREAT);  // exists
  ASSERT_TRUE(created.ok());
  fs_->Release(created->second);
  WaitPublished(ino);
  auto after = fs_->GetAttr(ino);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(SameTime(before->st_mtim, after->st_mtim));
  EXPECT_TRUE(SameTime(before->st_ctim, after->st_ctim));
  EXPECT_EQ(before->st_size, after->st_size);
  const struct stat backing_after = BackingStat("untouched");
  EXPECT_EQ(backing_before.st_ino, backing_after.st_ino) << "republished";
  EXPECT_TRUE(SameTime(backing_before.st_ctim, backing_after.st_ctim));
}

TEST_F(FileHandles, FileAttributesStayAsShownWhenPublished) {
  auto made = fs_->Create(kRootIno, "f", 0644, O_WRONLY | O_CREAT);
  ASSERT_TRUE(made.ok());
  auto [entry, h] = *made;
  ASSERT_TRUE(WriteAt(*fs_, h, "hello", 5, 0).ok());
  fs_->Release(h);
  auto before = fs_->GetAttr(entry.ino);
  ASSERT_TRUE(before.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  WaitPublished(entry.ino);
  auto after = fs_->GetAttr(entry.ino);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(SameTime(before->st_mtim, after->st_mtim));
  EXPECT_TRUE(SameTime(before->st_ctim, after->st_ctim));
  EXPECT_EQ(after->st_size, 5);
  // The published file carries the mtime the mount showed.
  EXPECT_TRUE(SameTime(BackingStat("f").st_mtim, before->st_mtim));
}

TEST_F(FileHandles, DirectoryAttributesMoveOnlyWithTheUsersOperations) {
  auto dir = fs_->Mkdir(kRootIno, "d", 0755);
  ASSERT_TRUE(dir.ok());
  const auto sub = fs_->Mkdir(dir->ino, "sub", 0755);
  ASSERT_TRUE(sub.ok());
  auto made = fs_->Create(dir->ino, "x", 0644, O_WRONLY | O_CREAT);
  ASSERT_TRUE(made.ok());
  fs_->Release(made->second);
  auto before = fs_->GetAttr(dir->ino);
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(before->st_nlink, 3u);  // ".", its name, and sub's ".."
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  WaitPublished(made->first.ino);
  WaitPublished(dir->ino);
  auto after = fs_->GetAttr(dir->ino);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(SameTime(before->st_mtim, after->st_mtim));
  EXPECT_TRUE(SameTime(before->st_ctim, after->st_ctim));
  EXPECT_EQ(before->st_size, after->st_size);
  EXPECT_EQ(before->st_nlink, after->st_nlink);
  // A user's operation moves them.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(fs_->Unlink(dir->ino, "x").ok());
  auto unlinked = fs_->GetAttr(dir->ino);
  ASSERT_TRUE(unlinked.ok());
  EXPECT_FALSE(SameTime(after->st_mtim, unlinked->st_mtim));
  // Someone else changing the directory on the backing store shows through.
  WaitPublished(dir->ino);
  ASSERT_TRUE(fs_->GetAttr(dir->ino).ok());  // the mount's view settles on this state
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_EQ(::mkdir((backing_.path() + "/d/external").c_str(), 0755), 0);
  auto external = fs_->GetAttr(dir->ino);
  ASSERT_TRUE(external.ok());
  EXPECT_TRUE(SameTime(external->st_mtim, BackingStat("d").st_mtim));
}

// The first write through a handle opened before any write copies the file from that
// handle's descriptor: right even once the name is gone.
TEST_F(FileHandles, WriteThroughAHandleOpenedBeforeAnUnlinkKeepsTheFilesBytes) {
  const uint64_t ino = WriteFile("doomed", "0123456789");
  Handle* h = OpenOk(ino, O_RDWR);
  ASSERT_TRUE(h);
  ASSERT_TRUE(fs_->Unlink(kRootIno, "doomed").ok());
  ASSERT_TRUE(WriteAt(*fs_, h, "ab", 2, 4).ok());
  EXPECT_EQ(ReadAll(h), "0123ab6789");
  fs_->Release(h);
  EXPECT_FALSE(fs_->Lookup(kRootIno, "doomed").ok());
}

TEST_F(FileHandles, FtruncateThroughAHandleOpenedWithoutWritingKeepsThePrefix) {
  const uint64_t ino = WriteFile("cut", "0123456789");
  Handle* h = OpenOk(ino, O_RDWR);
  ASSERT_TRUE(h);
  struct stat in {};
  in.st_size = 4;
  auto st = fs_->SetAttr(ino, in, /*FUSE_SET_ATTR_SIZE=*/1 << 3, h);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->st_size, 4);
  EXPECT_EQ(ReadAll(h), "0123");
  fs_->Release(h);
  WaitPublished(ino);
  Handle* r = OpenOk(ino, O_RDONLY);
  EXPECT_EQ(ReadAll(r), "0123");
  fs_->Release(r);
}

// A read that fails reaches the application as EIO and the log says which file and where.
TEST_F(FileHandles, FailedPublicationReadsAsEioAndIsLoggedWithPathAndOffset) {
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64);
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  auto made = fs_->Create(kRootIno, "lost", 0644, O_RDWR | O_CREAT);
  ASSERT_TRUE(made.ok());
  auto [entry, h] = *made;
  ASSERT_TRUE(WriteAt(*fs_, h, "data", 4, 0).ok());
  Handle* reader = OpenOk(entry.ino, O_RDONLY);
  // Its temp file vanishes before the publication: the rename fails.
  for (const auto& e : std::filesystem::directory_iterator(backing_.path())) {
    if (e.path().filename().string().rfind(kTempPrefix, 0) == 0) {
      std::filesystem::remove(e.path());
    }
  }
  fs_->Release(h);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (*fs_->GetXattr(entry.ino, "user.ckptfs.state") != "failed") {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // Publication halts at it (nothing after it applies) until the operator drops it.
  EXPECT_EQ(fs_->control()->Abort("lost").size(), 1u);
  char buf[16];
  auto got = fs_->Read(reader, buf, sizeof(buf), 2);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().ToErrno(), EIO);
  fs_->Release(reader);
  spdlog::set_default_logger(previous);
  bool logged = false;
  for (const auto& line : sink->last_formatted()) {
    if (line.find("EIO") != std::string::npos && line.find("read") != std::string::npos &&
        line.find("ino " + std::to_string(entry.ino)) != std::string::npos &&
        line.find("'lost'") != std::string::npos && line.find("offset 2") != std::string::npos) {
      logged = true;
    }
  }
  EXPECT_TRUE(logged);
  EXPECT_EQ(fs_->Shutdown().unpublished, 1u);  // the one file that could not be published
  fs_.reset();
}

// A committed checkpoint's files are cached by the kernel for kCommittedTimeout, and a
// GETATTR before that comes only from a passthrough read invalidating the atime: it is
// answered from the node, without the four backing-store syscalls of a refresh. Other
// files, and the checkpoint's while a save rewrites its `.metadata` (not committed), are
// refreshed from the backing store as before.
TEST_F(FileHandles, CommittedCheckpointFilesAnswerGetattrWithoutTheBackingStore) {
  ASSERT_TRUE(std::filesystem::create_directory(BackingPath("ck")));
  PutBacking("ck/.metadata", "meta");
  PutBacking("ck/__0_0.distcp", "shard bytes");
  PutBacking("plain.bin", "plain");
  auto ck = fs_->Lookup(kRootIno, "ck");
  ASSERT_TRUE(ck.ok());
  ASSERT_TRUE(fs_->Lookup(ck->ino, ".metadata").ok());
  auto shard = fs_->Lookup(ck->ino, "__0_0.distcp");
  auto plain = fs_->Lookup(kRootIno, "plain.bin");
  ASSERT_TRUE(shard.ok() && plain.ok());
  EXPECT_GE(shard->timeout, kCommittedTimeout);
  EXPECT_LT(plain->timeout, kCommittedTimeout);

  ASSERT_EQ(::chmod(BackingPath("ck/__0_0.distcp").c_str(), 0600), 0);
  ASSERT_EQ(::chmod(BackingPath("plain.bin").c_str(), 0600), 0);
  EXPECT_EQ(fs_->GetAttr(shard->ino)->st_mode & 07777, shard->attr.st_mode & 07777);
  EXPECT_EQ(fs_->GetAttr(plain->ino)->st_mode & 07777, 0600u);

  // Its `.metadata` being rewritten through the mount: a save into the same directory,
  // which is not committed until that is published.
  auto md = fs_->Lookup(ck->ino, ".metadata");
  ASSERT_TRUE(md.ok());
  Handle* rewrite = OpenOk(md->ino, O_WRONLY | O_TRUNC);
  ASSERT_TRUE(rewrite);
  ASSERT_TRUE(WriteAt(*fs_, rewrite, "meta2", 5, 0).ok());
  EXPECT_EQ(fs_->GetAttr(shard->ino)->st_mode & 07777, 0600u);
  fs_->Release(rewrite);
  WaitPublished(md->ino);
}

}  // namespace
}  // namespace ckptfs::fs
