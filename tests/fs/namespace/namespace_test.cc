// The namespace on an injected FaultyBackingDir, without FUSE: loading directories,
// names created and removed by others on the backing store, and what a failing
// lookup call of the backing store does to the mount's view.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <filesystem>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "fs/control/control_tree.h"
#include "fs/fs_util.h"
#include "tests/fs/fs_fixture.h"

namespace ckptfs::fs {
namespace {

using NamespaceTest = FaultyFsTest;

TEST_F(NamespaceTest, LookupGoesThroughTheInjectedBackingDir) {
  Start();
  PutBacking("external", "from someone else");
  std::mutex mu;
  std::set<std::string> seen;
  dir_->SetLookupHook([&](const std::string& op, const std::string& path) {
    std::lock_guard lock(mu);
    seen.insert(op + ":" + path);
    return 0;
  });
  auto e = fs_->Lookup(kRootIno, "external");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->attr.st_size, 17);
  std::lock_guard lock(mu);
  EXPECT_TRUE(seen.count("stat:external")) << "the lookup did not stat through BackingDir";
}

// A reader buffers a file on the backing store as it would reading the store directly
// (Python sizes its buffer by st_blksize); a file being written through the mount shows
// kBlockSize, so buffered writers send large requests.
TEST_F(NamespaceTest, BlockSizeIsTheStoresForItsFilesAndLargeForFilesBeingWritten) {
  Start();
  PutBacking("theirs", "from the store");
  struct stat backing {};
  ASSERT_EQ(::stat(BackingPath("theirs").c_str(), &backing), 0);
  ASSERT_NE(backing.st_blksize, kBlockSize) << "this test needs a store whose block size is not 1 MiB";
  auto theirs = fs_->Lookup(kRootIno, "theirs");
  ASSERT_TRUE(theirs.ok()) << theirs.status().ToString();
  EXPECT_EQ(theirs->attr.st_blksize, backing.st_blksize);

  auto made = fs_->Create(kRootIno, "mine", 0644, O_WRONLY | O_CREAT | O_TRUNC);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  auto [entry, h] = *made;
  EXPECT_EQ(entry.attr.st_blksize, kBlockSize);
  ASSERT_TRUE(WriteAt(*fs_, h, "abc", 3, 0).ok());
  auto open_mine = fs_->Lookup(kRootIno, "mine");
  ASSERT_TRUE(open_mine.ok()) << open_mine.status().ToString();
  EXPECT_EQ(open_mine->attr.st_blksize, kBlockSize);
  fs_->Release(h);

  // A file of the store written again in place (a second save into the same directory
  // opens its shards with O_TRUNC) shows kBlockSize while it is written.
  auto rewrite = fs_->Open(theirs->ino, O_WRONLY | O_TRUNC);
  ASSERT_TRUE(rewrite.ok()) << rewrite.status().ToString();
  ASSERT_TRUE(WriteAt(*fs_, *rewrite, "again", 5, 0).ok());
  auto rewritten = fs_->Lookup(kRootIno, "theirs");
  ASSERT_TRUE(rewritten.ok()) << rewritten.status().ToString();
  EXPECT_EQ(rewritten->attr.st_blksize, kBlockSize);
  fs_->Release(*rewrite);
}

TEST_F(NamespaceTest, FailedListingFailsTheLookupAndIsRetriedNextTime) {
  Start();
  ASSERT_TRUE(std::filesystem::create_directory(BackingPath("d")));
  PutBacking("d/x", "x");
  auto d = fs_->Lookup(kRootIno, "d");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  dir_->SetLookupHook([](const std::string& op, const std::string& path) {
    return op == "list" && path == "d" ? EIO : 0;
  });
  auto failed = fs_->Lookup(d->ino, "x");
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().ToErrno(), EIO);
  dir_->SetLookupHook(nullptr);
  // The directory was not marked loaded with nothing in it: the name is still found.
  auto x = fs_->Lookup(d->ino, "x");
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  EXPECT_EQ(x->attr.st_size, 1);
}

TEST_F(NamespaceTest, NameRemovedOnTheBackingStoreIsGoneAndOneCreatedThereAppears) {
  Start();
  uint64_t ino = WriteFile(kRootIno, "mine", "abc");
  ASSERT_NE(ino, 0u);
  ASSERT_TRUE(fs_->Lookup(kRootIno, "mine").ok());
  ASSERT_TRUE(std::filesystem::remove(BackingPath("mine")));
  // The journal callback that hands the file back to the backing store may still be
  // running: until then the mount serves its own copy.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  Result<Entry> gone = fs_->Lookup(kRootIno, "mine");
  while (gone.ok() && std::chrono::steady_clock::now() < deadline) {
    fs_->Forget(gone->ino, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    gone = fs_->Lookup(kRootIno, "mine");
  }
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), Code::kNotFound);
  PutBacking("theirs", "12345");
  auto theirs = fs_->Lookup(kRootIno, "theirs");
  ASSERT_TRUE(theirs.ok()) << theirs.status().ToString();
  EXPECT_EQ(theirs->attr.st_size, 5);
}

// A directory someone else removed from the backing store, with names the kernel looked
// up in it: once the kernel forgets the directory, its children go too. Before, they stayed
// in the table for the daemon's life, their parent pointer dangling (every later save into
// a new directory removed elsewhere added to them).
TEST_F(NamespaceTest, ADirectoryRemovedElsewhereTakesItsChildrenWhenForgotten) {
  Start();
  auto inodes = [&] {
    return nlohmann::json::parse(fs_->control()->StatsJson())["inodes"].get<uint64_t>();
  };
  const uint64_t before = inodes();
  ASSERT_TRUE(std::filesystem::create_directory(BackingPath("d")));
  PutBacking("d/f", "f");
  auto d = fs_->Lookup(kRootIno, "d");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  auto f = fs_->Lookup(d->ino, "f");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(inodes(), before + 2);
  std::filesystem::remove_all(BackingPath("d"));
  fs_->Forget(f->ino, 1);  // the kernel drops the file's entry first, then the directory's
  auto again = fs_->Lookup(kRootIno, "d");
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), Code::kNotFound);
  fs_->Forget(d->ino, 1);
  EXPECT_EQ(inodes(), before) << "the removed directory's child is still in the table";
}

TEST_F(NamespaceTest, RenameAndUnlinkReachTheBackingStoreInOrder) {
  Start();
  uint64_t a = WriteFile(kRootIno, "a", "first");
  ASSERT_NE(a, 0u);
  ASSERT_TRUE(fs_->Rename(kRootIno, "a", kRootIno, "b", 0).ok());
  ASSERT_TRUE(fs_->Lookup(kRootIno, "b").ok());
  EXPECT_EQ(fs_->Lookup(kRootIno, "a").status().code(), Code::kNotFound);
  uint64_t c = WriteFile(kRootIno, "c", "second");  // published after the rename
  ASSERT_NE(c, 0u);
  EXPECT_FALSE(std::filesystem::exists(BackingPath("a")));
  EXPECT_EQ(BackingBytes("b"), "first");
  ASSERT_TRUE(fs_->Unlink(kRootIno, "b").ok());
  uint64_t d = WriteFile(kRootIno, "d", "third");
  ASSERT_NE(d, 0u);
  EXPECT_FALSE(std::filesystem::exists(BackingPath("b")));
  EXPECT_EQ(BackingBytes("c"), "second");
  EXPECT_GE(dir_->rename_calls(), 2u);
}

TEST_F(NamespaceTest, FailedStatOfANameLeavesTheOthersServed) {
  Start();
  uint64_t keep = WriteFile(kRootIno, "keep", "kept");
  ASSERT_NE(keep, 0u);
  PutBacking("flaky", "f");
  dir_->SetLookupHook([](const std::string& op, const std::string& path) {
    return op == "stat" && path == "flaky" ? EIO : 0;
  });
  EXPECT_FALSE(fs_->Lookup(kRootIno, "flaky").ok());
  auto k = fs_->Lookup(kRootIno, "keep");
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  Handle* h = OpenOk(k->ino, O_RDONLY);
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(ReadAll(h), "kept");
  fs_->Release(h);
}

// The names an opendir shows of a directory listed before.
std::set<std::string> Listed(Filesystem& fs, uint64_t ino) {
  std::set<std::string> names;
  auto h = fs.OpenDir(ino);
  EXPECT_TRUE(h.ok()) << h.status().ToString();
  if (!h.ok()) return names;
  for (const auto& e : (*h)->dir()->entries) {
    if (e.name != "." && e.name != "..") names.insert(e.name);
  }
  fs.ReleaseDir(*h);
  return names;
}

// `rm -r` of a checkpoint directory another node wrote shards into: opendir lists the
// loaded directory again, so names made on the backing store without this mount show,
// though entries of this mount are pending in and above it (the next save, the tracker:
// the two-node soak's "Directory not empty"). While a removal of a name in it is pending,
// it is not listed again: the backing listing still holds that name, which would come back.
TEST_F(NamespaceTest, OpendirShowsNamesOthersMadeUnlessARemovalInItIsPending) {
  Start();
  auto ckpt = fs_->Mkdir(kRootIno, "ckpt", 0755);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  ASSERT_NE(WriteFile(ckpt->ino, "mine", "m"), 0u);  // everything before it is applied
  EXPECT_EQ(Listed(*fs_, ckpt->ino), (std::set<std::string>{"mine"}));
  PutBacking("ckpt/theirs1", "1");  // another node's shards
  PutBacking("ckpt/theirs2", "2");
  // Publication hangs in its first fsync: the entries after it stay pending (until the end
  // of the test, however it ends).
  auto latch = std::make_shared<store::Latch>();
  dir_->SetFsyncHook([latch](int) {
    latch->Wait();
    return 0;
  });
  struct OpenAtEnd {
    std::shared_ptr<store::Latch> latch;
    ~OpenAtEnd() { latch->Open(); }
  } open_at_end{latch};
  for (const auto& [parent, name] : {std::pair{kRootIno, "tracker"}, {ckpt->ino, "next"}}) {
    auto made = fs_->Create(parent, name, 0644, O_WRONLY | O_CREAT | O_TRUNC);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    EXPECT_TRUE(WriteAt(*fs_, made->second, "x", 1, 0).ok());
    fs_->Release(made->second);  // its publish: pending above the directory and in it
  }
  latch->AwaitWaiters(1);
  EXPECT_EQ(Listed(*fs_, ckpt->ino),
            (std::set<std::string>{"mine", "next", "theirs1", "theirs2"}));
  // An unlink pending in the directory: "mine" is still on the backing store.
  ASSERT_TRUE(fs_->Unlink(ckpt->ino, "mine").ok());
  ASSERT_TRUE(std::filesystem::exists(BackingPath("ckpt/mine")));
  const std::set<std::string> after = Listed(*fs_, ckpt->ino);
  EXPECT_EQ(after.count("mine"), 0u) << "the pending unlink's name came back";
  EXPECT_EQ(after, (std::set<std::string>{"next", "theirs1", "theirs2"}));
}

// Publication hangs in its first fsync from now on, until the end of the test however it
// ends: entries appended after it stay pending.
struct HangFsyncs {
  explicit HangFsyncs(store::FaultyBackingDir* dir) : latch(std::make_shared<store::Latch>()) {
    dir->SetFsyncHook([l = latch](int) {
      l->Wait();
      return 0;
    });
  }
  ~HangFsyncs() { latch->Open(); }
  std::shared_ptr<store::Latch> latch;
};

// A file `name` in `parent` whose publish is queued (one byte, closed).
void CreatePending(Filesystem& fs, uint64_t parent, const std::string& name) {
  auto made = fs.Create(parent, name, 0644, O_WRONLY | O_CREAT | O_TRUNC);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  EXPECT_TRUE(WriteAt(fs, made->second, "x", 1, 0).ok());
  fs.Release(made->second);
}

// Two nodes: node 0 made the checkpoint's directory and still has entries of its own
// pending in it (its backlog, a held deletion); node 1 published its shard there. A
// lookup through node 0 finds that shard (the two-node soak, strict, seed 4101: a load
// through node 0 got ENOENT for node 1's shard of a committed checkpoint), and a name
// whose unlink through the mount is pending stays gone.
TEST_F(NamespaceTest, LookupFindsANameAnotherNodeMadeInADirectoryWithEntriesPending) {
  Start();
  auto ckpt = fs_->Mkdir(kRootIno, "ckpt", 0755);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  ASSERT_NE(WriteFile(ckpt->ino, "mine", "m"), 0u);  // everything before it is applied
  HangFsyncs hang(dir_);
  CreatePending(*fs_, ckpt->ino, "next");
  hang.latch->AwaitWaiters(1);
  PutBacking("ckpt/__1_0.distcp", "node 1's shard");
  auto theirs = fs_->Lookup(ckpt->ino, "__1_0.distcp");
  ASSERT_TRUE(theirs.ok()) << theirs.status().ToString();
  EXPECT_EQ(theirs->attr.st_size, 14);
  ASSERT_TRUE(fs_->Unlink(ckpt->ino, "mine").ok());
  ASSERT_TRUE(std::filesystem::exists(BackingPath("ckpt/mine")));
  EXPECT_EQ(fs_->Lookup(ckpt->ino, "mine").status().code(), Code::kNotFound)
      << "a name whose unlink is pending came back";
}

// A directory removed and made again through the mount, publication lagging: until the
// mkdir is applied the backing store's directory of that name is the old one, and none
// of its names may show in the new one (a listing or a lookup).
TEST_F(NamespaceTest, ADirectoryMadeAgainShowsNoneOfTheOldOnesNamesBeforeItsMkdirIsApplied) {
  Start();
  auto ckpt = fs_->Mkdir(kRootIno, "ckpt", 0755);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  ASSERT_NE(WriteFile(ckpt->ino, "old", "o"), 0u);
  HangFsyncs hang(dir_);
  CreatePending(*fs_, kRootIno, "tracker");
  hang.latch->AwaitWaiters(1);
  ASSERT_TRUE(fs_->Unlink(ckpt->ino, "old").ok());
  ASSERT_TRUE(fs_->Rmdir(kRootIno, "ckpt").ok());
  auto again = fs_->Mkdir(kRootIno, "ckpt", 0755);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ASSERT_TRUE(std::filesystem::exists(BackingPath("ckpt/old")));
  PutBacking("ckpt/theirs", "t");  // in the old directory too: it goes with it
  EXPECT_EQ(Listed(*fs_, again->ino), (std::set<std::string>{}));
  EXPECT_EQ(fs_->Lookup(again->ino, "old").status().code(), Code::kNotFound);
  EXPECT_EQ(fs_->Lookup(again->ino, "theirs").status().code(), Code::kNotFound);
  std::filesystem::remove(BackingPath("ckpt/theirs"));  // so that the rmdir applies
}

}  // namespace
}  // namespace ckptfs::fs
