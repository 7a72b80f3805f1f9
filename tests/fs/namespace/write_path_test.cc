// The write path on an injected FaultyBackingDir, without FUSE: the copy a rewrite
// starts with, the fd calls on a staged file (chmod, truncate), and what their failures
// leave behind. Every one of these calls goes through store::BackingDir.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/fs/fs_fixture.h"

namespace ckptfs::fs {
namespace {

using WritePathTest = FaultyFsTest;

TEST_F(WritePathTest, FailedCopyForRewriteFailsTheWriteAndLeavesTheFileAndNoTemp) {
  Start();
  uint64_t ino = WriteFile(kRootIno, "f", "old contents");
  ASSERT_NE(ino, 0u);
  ASSERT_EQ(TempFiles(), 0u);
  std::atomic<int> copies{0};
  dir_->SetPosixHook([&](const std::string& op, const std::string&) {
    if (op != "copy_file_range") return 0;
    copies++;
    return ENOSPC;
  });
  Handle* h = OpenOk(ino, O_RDWR);
  ASSERT_NE(h, nullptr);
  Status st = WriteAt(*fs_, h, "NEW", 3, 0);
  EXPECT_EQ(st.code(), Code::kNoSpace) << st.ToString();
  EXPECT_EQ(copies.load(), 1);
  EXPECT_EQ(TempFiles(), 0u);  // the temp of the failed copy is removed at once
  dir_->SetPosixHook(nullptr);
  ASSERT_TRUE(WriteAt(*fs_, h, "NEW", 3, 0).ok());  // the next write starts a new copy
  EXPECT_EQ(ReadAll(h), "NEW contents");
  fs_->Release(h);
  WaitPublished(ino);
  EXPECT_EQ(BackingBytes("f"), "NEW contents");
}

TEST_F(WritePathTest, ChmodOfAStagedFileGoesThroughBackingDirAndReportsItsError) {
  Start();
  auto made = fs_->Create(kRootIno, "s", 0644, O_WRONLY | O_CREAT);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  auto [entry, h] = *made;
  ASSERT_TRUE(WriteAt(*fs_, h, "x", 1, 0).ok());
  std::vector<std::string> ops;
  std::mutex mu;
  dir_->SetPosixHook([&](const std::string& op, const std::string&) {
    std::lock_guard lock(mu);
    ops.push_back(op);
    return op == "fchmod" ? EIO : 0;
  });
  struct stat in {};
  in.st_mode = S_IFREG | 0600;
  auto failed = fs_->SetAttr(entry.ino, in, /*FUSE_SET_ATTR_MODE*/ 1, h);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().ToErrno(), EIO);
  {
    std::lock_guard lock(mu);
    EXPECT_EQ(ops, std::vector<std::string>{"fchmod"});
  }
  dir_->SetPosixHook(nullptr);
  auto ok = fs_->SetAttr(entry.ino, in, 1, h);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->st_mode & 07777, 0600u);
  fs_->Release(h);
  WaitPublished(entry.ino);
  struct stat st {};
  ASSERT_EQ(::stat(BackingPath("s").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

TEST_F(WritePathTest, FailedTruncateIsStickyOnTheFileAndNeverPublished) {
  Start();
  auto made = fs_->Create(kRootIno, "t", 0644, O_RDWR | O_CREAT);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  auto [entry, h] = *made;
  ASSERT_TRUE(WriteAt(*fs_, h, "0123456789", 10, 0).ok());
  dir_->SetPosixHook([](const std::string& op, const std::string&) {
    return op == "ftruncate" ? EIO : 0;
  });
  struct stat in {};
  in.st_size = 4;
  auto failed = fs_->SetAttr(entry.ino, in, /*FUSE_SET_ATTR_SIZE*/ 1 << 3, h);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().ToErrno(), EIO);
  dir_->SetPosixHook(nullptr);
  // The file's error is sticky (G7): the next write and the flush return it.
  EXPECT_FALSE(WriteAt(*fs_, h, "a", 1, 0).ok());
  EXPECT_FALSE(fs_->Flush(h).ok());
  // Deleted before its close: its bytes are dropped, never published.
  ASSERT_TRUE(fs_->Unlink(kRootIno, "t").ok());
  fs_->Release(h);
  uint64_t after = WriteFile(kRootIno, "after", "x");  // applied after the discard
  ASSERT_NE(after, 0u);
  EXPECT_FALSE(std::filesystem::exists(BackingPath("t")));
  EXPECT_EQ(TempFiles(), 0u);
}

TEST_F(WritePathTest, RewriteCopiesThePublishedBytesAndPublishesOverTheName) {
  Start();
  const std::string old(3 << 20, 'o');  // several chunks
  uint64_t ino = WriteFile(kRootIno, "big", old);
  ASSERT_NE(ino, 0u);
  std::atomic<int> copies{0};
  dir_->SetPosixHook([&](const std::string& op, const std::string&) {
    if (op == "copy_file_range") copies++;
    return 0;
  });
  Handle* h = OpenOk(ino, O_WRONLY);
  ASSERT_NE(h, nullptr);
  ASSERT_TRUE(WriteAt(*fs_, h, "N", 1, (2 << 20) + 5).ok());
  fs_->Release(h);
  WaitPublished(ino);
  EXPECT_EQ(copies.load(), 1);
  std::string want = old;
  want[(2 << 20) + 5] = 'N';
  EXPECT_EQ(BackingBytes("big"), want);
  EXPECT_EQ(TempFiles(), 0u);
}

// A strict fsync publishes the file while another call holds its writer lock (a truncate
// by path, hung in its ftruncate): the publish waits to freeze it without the namespace
// lock, and the file is unlinked meanwhile. It is never published, and its open handle
// goes on writing into the bytes it keeps (the freeze is undone).
TEST_F(WritePathTest, FileUnlinkedWhileItsPublishWaitsToFreezeItTakesWritesAndIsNotPublished) {
  Start(/*strict=*/true);
  auto made = fs_->Create(kRootIno, "f", 0644, O_RDWR | O_CREAT);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  const uint64_t ino = made->first.ino;
  Handle* h = made->second;
  ASSERT_TRUE(WriteAt(*fs_, h, "abc", 3, 0).ok());
  std::shared_ptr<store::StagedFile> staged;
  {
    Node* node = h->file()->node.get();
    MutexLock lock(&node->data_mu);
    staged = node->data.staged;
  }
  ASSERT_NE(staged, nullptr);
  store::Latch latch;
  std::atomic<bool> first{true};
  dir_->SetPosixHook([&](const std::string& op, const std::string&) {
    if (op == "ftruncate" && first.exchange(false)) latch.Wait();
    return 0;
  });
  std::thread truncate([&] {
    struct stat in {};
    in.st_size = 2;
    EXPECT_TRUE(fs_->SetAttr(ino, in, 1 << 3 /* FUSE_SET_ATTR_SIZE */, nullptr).ok());
  });
  latch.AwaitWaiters(1);
  std::thread fsync([&] { EXPECT_TRUE(fs_->Flush(h).ok()); });
  while (staged->freezes_waiting() == 0) std::this_thread::yield();
  // The namespace lock is free while the publish waits: the unlink goes through.
  auto unlinked = std::async(std::launch::async, [&] { return fs_->Unlink(kRootIno, "f"); });
  const bool in_time = unlinked.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  latch.Open();
  truncate.join();
  fsync.join();
  EXPECT_TRUE(in_time) << "the unlink waited for the publish's freeze";
  EXPECT_TRUE(unlinked.get().ok());
  dir_->SetPosixHook(nullptr);
  EXPECT_TRUE(WriteAt(*fs_, h, "x", 1, 2).ok());
  EXPECT_EQ(ReadAll(h), "abx");
  EXPECT_EQ(fs_->Lookup(kRootIno, "f").status().code(), Code::kNotFound);
  fs_->Release(h);
  EXPECT_FALSE(std::filesystem::exists(BackingPath("f")));
}

}  // namespace
}  // namespace ckptfs::fs
