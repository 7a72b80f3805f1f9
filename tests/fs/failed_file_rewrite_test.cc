// A file whose publication failed (G7: the error went back to the application's close)
// can be saved again with O_TRUNC, as a job retries a failed save into the same names.
// Found by e2e.test_fault_inject (issue 41): in strict mode one injected EIO on a shard's
// rename made every later save of that iteration fail with the same EIO at open, forever
// (42 failed runs, no save returned), until the file was deleted. A read or a plain
// (appending) open of the failed version still gets the failure; the new version is
// published, and the backing store holds its bytes.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <string>
#include <thread>

#include "fs/control/control_tree.h"
#include "tests/fs/fs_fixture.h"

namespace ckptfs::fs {
namespace {

class FailedFileRewriteTest : public FaultyFsTest, public ::testing::WithParamInterface<bool> {
 protected:
  void SetUp() override { Start(/*strict=*/GetParam()); }

  // Writes `bytes` through a new handle opened with `flags`; the close's (Flush) status.
  Status WriteVersion(uint64_t ino, int flags, const std::string& bytes) {
    auto h = fs_->Open(ino, flags);
    if (!h.ok()) return h.status();
    auto written = WriteAt(*fs_, *h, bytes.data(), bytes.size(), 0);
    Status st = fs_->Flush(*h);
    fs_->Release(*h);
    if (!written.ok()) return written;
    return st;
  }
};

TEST_P(FailedFileRewriteTest, AFailedFileIsSavedAgainWithOTrunc) {
  auto made = fs_->Create(kRootIno, "shard.distcp", 0644, O_WRONLY | O_CREAT | O_TRUNC);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  auto [entry, h] = *made;
  // Its publish fails for good: the fsync of its bytes fails (the pages may be lost).
  dir_->FailNthFsync(dir_->fsync_calls() + 1, EIO);
  ASSERT_TRUE(WriteAt(*fs_, h, "first", 5, 0).ok());
  Status closed = fs_->Flush(h);
  fs_->Release(h);
  if (GetParam()) EXPECT_EQ(closed.ToErrno(), EIO) << "strict: the close gets the failure";
  if (!GetParam()) {
    // Async: publication halts at the failed file ("waiting for resume or abort"); the
    // operator aborts it, and the file is failed.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (nlohmann::json::parse(fs_->control()->StatsJson())["journal_halted"].is_null()) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "publication never halted";
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_FALSE(fs_->control()->Abort("shard.distcp").empty());
  }
  auto read = fs_->Open(entry.ino, O_RDONLY);
  if (read.ok()) fs_->Release(*read);
  ASSERT_FALSE(read.ok()) << "the failed version is readable";
  EXPECT_EQ(read.status().code(), Code::kIo) << "a read of the failed version gets EIO";
  EXPECT_EQ(WriteVersion(entry.ino, O_WRONLY, "x").code(), Code::kIo)
      << "a write into the failed version gets EIO";
  // The job saves again: a new, empty version.
  ASSERT_TRUE(WriteVersion(entry.ino, O_WRONLY | O_TRUNC, "second").ok());
  WaitPublished(entry.ino);
  EXPECT_EQ(BackingBytes("shard.distcp"), "second");
  auto again = fs_->Open(entry.ino, O_RDONLY);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(ReadAll(*again), "second");
  fs_->Release(*again);
  EXPECT_EQ(TempFiles(), 0u) << TempNames();
  // The failed version never reached the backing store; the stop counts it.
  EXPECT_EQ(fs_->Shutdown().unpublished, 1u);
}

// Strict (the soak, seed 5501): a tracker whose rewrite failed at close (the close got EIO,
// G7) then failed every open with EIO until it was written again, so a job that reads its
// tracker before it writes it (Megatron's restart) could not start for as long; the
// backing store still held the version before. Once no handle is open, the name shows it.
// A new file (nothing on the backing store) keeps failing (the test above).
class FailedRewriteStrictTest : public FaultyFsTest {
 protected:
  void SetUp() override { Start(/*strict=*/true); }
};

TEST_F(FailedRewriteStrictTest, AFailedRewriteShowsTheBackingVersionOnceItsCloseGotTheError) {
  auto made = fs_->Create(kRootIno, "latest.txt", 0644, O_WRONLY | O_CREAT | O_TRUNC);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  auto [entry, h] = *made;
  ASSERT_TRUE(WriteAt(*fs_, h, "7", 1, 0).ok());
  ASSERT_TRUE(fs_->Flush(h).ok());
  fs_->Release(h);
  ASSERT_EQ(BackingBytes("latest.txt"), "7");
  auto again = fs_->Open(entry.ino, O_WRONLY | O_TRUNC);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  dir_->FailNthFsync(dir_->fsync_calls() + 1, EIO);
  ASSERT_TRUE(WriteAt(*fs_, *again, "8", 1, 0).ok());
  EXPECT_EQ(fs_->Flush(*again).ToErrno(), EIO) << "the close gets the failure (G7)";
  fs_->Release(*again);
  EXPECT_EQ(BackingBytes("latest.txt"), "7");
  auto read = fs_->Open(entry.ino, O_RDONLY);
  ASSERT_TRUE(read.ok()) << "the tracker stays unreadable: " << read.status().ToString();
  EXPECT_EQ(ReadAll(*read), "7");
  fs_->Release(*read);
  // And it is written again as usual.
  auto third = fs_->Open(entry.ino, O_WRONLY | O_TRUNC);
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  ASSERT_TRUE(WriteAt(*fs_, *third, "9", 1, 0).ok());
  EXPECT_TRUE(fs_->Flush(*third).ok());
  fs_->Release(*third);
  EXPECT_EQ(BackingBytes("latest.txt"), "9");
  EXPECT_EQ(TempFiles(), 0u) << TempNames();
  EXPECT_EQ(fs_->Shutdown().unpublished, 1u) << "the stop counts the failed version";
}

INSTANTIATE_TEST_SUITE_P(Modes, FailedFileRewriteTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Strict" : "Async"; });

}  // namespace
}  // namespace ckptfs::fs
