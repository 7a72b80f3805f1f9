// No lock spans slow I/O: a backing-store call that hangs on one path (a stat on a loaded
// parallel file system, an open, an fsync, a copy, a truncate, a chmod, a fallocate) must
// not delay reads, writes, creates, lookups, getattrs and mkdirs of other names. Each test hangs one call on
// a latch, checks that those of other files, a first write that starts a rewrite among
// them, finish within a bounded wait while it hangs, then releases the latch. The same
// holds after a call lost kRaceTries races (fs/namespace/table_lock.h): its next try holds
// the node's I/O token, never the table's lock, while its backing call hangs; and what
// would make it lose again (a chmod without pause, a rename above it) waits for that token,
// so it finishes within a bounded number of tries.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "fs/namespace/table_lock.h"
#include "tests/fs/fs_fixture.h"

namespace ckptfs::fs {
namespace {

constexpr auto kBound = std::chrono::seconds(10);
// FUSE_SET_ATTR_* (fs/ keeps its tests free of libfuse).
constexpr int kSetMode = 1 << 0, kSetSize = 1 << 3;

class NoLockAcrossIo : public FaultyFsTest {
 protected:
  void SetUp() override {
    Start();
    auto made = fs_->Create(kRootIno, "a", 0644, O_RDWR | O_CREAT);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    a_ = made->second;
    ASSERT_TRUE(WriteAt(*fs_, a_, "aaaa", 4, 0).ok());
    uint64_t b = WriteFile(kRootIno, "b", "bbbb");
    uint64_t c = WriteFile(kRootIno, "c", "cccc");
    slow_file_ = WriteFile(kRootIno, "slowfile", "ssss");
    ASSERT_NE(b, 0u);
    ASSERT_NE(c, 0u);
    ASSERT_NE(slow_file_, 0u);
    b_ = OpenOk(b, O_RDONLY);
    c_ = OpenOk(c, O_RDWR);  // not written yet: its first write starts a copy
    ASSERT_NE(b_, nullptr);
    ASSERT_NE(c_, nullptr);
  }
  void TearDown() override {
    latch_.Open();
    if (hung_.joinable()) hung_.join();
    for (Handle* h : {a_, b_, c_}) {
      if (h != nullptr) fs_->Release(h);
    }
    FaultyFsTest::TearDown();
  }

  // Reads and writes of the other open files, as a trainer's ranks would make them.
  void DataPath() {
    EXPECT_TRUE(WriteAt(*fs_, a_, "xyz", 3, 4).ok());
    EXPECT_EQ(ReadAll(a_), "aaaaxyz");
    EXPECT_EQ(ReadAll(b_), "bbbb");
    EXPECT_TRUE(WriteAt(*fs_, c_, "C", 1, 0).ok());
    EXPECT_EQ(ReadAll(c_), "Cccc");
    EXPECT_TRUE(WriteAt(*fs_, c_, "D", 1, 1).ok());
    EXPECT_EQ(ReadAll(c_), "CDcc");
    // A create (its temp file, owner, registration) and a lookup of other names.
    const std::string name = "other" + std::to_string(++others_);
    auto made = fs_->Create(kRootIno, name, 0644, O_WRONLY | O_CREAT | O_EXCL);
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    if (made.ok()) {
      EXPECT_TRUE(WriteAt(*fs_, made->second, "o", 1, 0).ok());
      fs_->Release(made->second);
    }
    Result<Entry> b = fs_->Lookup(kRootIno, "b");
    EXPECT_TRUE(b.ok());
    // Namespace operations on other names: a getattr (a stat of its backing file), a mkdir
    // and a lookup inside it.
    if (b.ok()) EXPECT_TRUE(fs_->GetAttr(b->ino).ok());
    auto dir = fs_->Mkdir(kRootIno, "dir" + std::to_string(others_), 0755);
    EXPECT_TRUE(dir.ok()) << dir.status().ToString();
    if (dir.ok()) EXPECT_EQ(fs_->Lookup(dir->ino, "none").status().code(), Code::kNotFound);
  }

  // Starts `hang` on its own thread, waits until it is blocked in the backing store,
  // then runs DataPath() and expects it to finish while `hang` is still blocked.
  template <typename F>
  void ExpectDataPathWhileHung(F hang) {
    hung_ = std::thread(hang);
    latch_.AwaitWaiters(1);
    auto data = std::async(std::launch::async, [this] { DataPath(); });
    const bool done = data.wait_for(kBound) == std::future_status::ready;
    EXPECT_FALSE(latch_.is_open());
    latch_.Open();  // let the hung call go on, whatever happened
    hung_.join();
    data.get();
    EXPECT_TRUE(done) << "reads and writes of other files waited for the hung call";
  }

  // A file created and written through the mount, still open: its bytes are staged.
  Handle* CreateStaged(const std::string& data, uint64_t* ino) {
    auto made = fs_->Create(kRootIno, "staged", 0644, O_RDWR | O_CREAT);
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    if (!made.ok()) return nullptr;
    EXPECT_TRUE(WriteAt(*fs_, made->second, data.data(), data.size(), 0).ok());
    *ino = made->first.ino;
    return made->second;
  }
  // Hangs the first backing-store call named `op` (FaultyBackingDir's posix hook) on the
  // latch; later ones (the data path's own) pass.
  void HangFirst(const std::string& op) {
    dir_->SetPosixHook([this, op](const std::string& called, const std::string&) {
      if (called == op && hang_first_.exchange(false)) latch_.Wait();
      return 0;
    });
  }

  store::Latch latch_;
  std::thread hung_;
  Handle* a_ = nullptr;
  Handle* b_ = nullptr;
  Handle* c_ = nullptr;
  uint64_t slow_file_ = 0;
  int others_ = 0;
  std::atomic<bool> hang_first_{true};
};

TEST_F(NoLockAcrossIo, HungStatOfOnePathDelaysNoReadOrWriteOfOtherFiles) {
  PutBacking("slow", "someone else's");
  dir_->SetLookupHook([this](const std::string& op, const std::string& path) {
    if (op == "stat" && path == "slow") latch_.Wait();
    return 0;
  });
  ExpectDataPathWhileHung([this] {
    auto e = fs_->Lookup(kRootIno, "slow");
    EXPECT_TRUE(e.ok()) << e.status().ToString();
  });
}

TEST_F(NoLockAcrossIo, HungOpenOfOnePathDelaysNoReadOrWriteOfOtherFiles) {
  dir_->SetLookupHook([this](const std::string& op, const std::string& path) {
    if (op == "open" && path == "slowfile") latch_.Wait();
    return 0;
  });
  ExpectDataPathWhileHung([this] {
    auto h = fs_->Open(slow_file_, O_RDONLY);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ(ReadAll(*h), "ssss");
    fs_->Release(*h);
  });
}

TEST_F(NoLockAcrossIo, HungFsyncOfAPublicationDelaysNoReadOrWriteOfOtherFiles) {
  dir_->SetFsyncHook([this](int) {
    latch_.Wait();
    return 0;
  });
  ExpectDataPathWhileHung([this] {
    auto made = fs_->Create(kRootIno, "d", 0644, O_WRONLY | O_CREAT);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    EXPECT_TRUE(WriteAt(*fs_, made->second, "dddd", 4, 0).ok());
    fs_->Release(made->second);  // queues the publication, whose fsync hangs
  });
}

TEST_F(NoLockAcrossIo, HungListingOfOneDirectoryDelaysNoReadOrWriteOfOtherFiles) {
  ASSERT_TRUE(fs_->Mkdir(kRootIno, "dir", 0755).ok());
  ASSERT_NE(WriteFile(kRootIno, "after_mkdir", "x"), 0u);  // the mkdir is applied
  auto dir = fs_->Lookup(kRootIno, "dir");
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  dir_->SetLookupHook([this](const std::string& op, const std::string& path) {
    if (op == "list" && path == "dir") latch_.Wait();
    return 0;
  });
  const uint64_t dir_ino = dir->ino;
  ExpectDataPathWhileHung([this, dir_ino] {
    auto h = fs_->OpenDir(dir_ino);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    fs_->ReleaseDir(*h);
  });
}

TEST_F(NoLockAcrossIo, HungCopyOfARewriteDelaysNoReadOrWriteOfOtherFiles) {
  uint64_t e = WriteFile(kRootIno, "e", "eeee");
  ASSERT_NE(e, 0u);
  HangFirst("copy_file_range");  // e's copy only
  ExpectDataPathWhileHung([this, e] {
    Handle* h = OpenOk(e, O_RDWR);
    ASSERT_NE(h, nullptr);
    EXPECT_TRUE(WriteAt(*fs_, h, "E", 1, 0).ok());  // begins the rewrite: its copy hangs
    EXPECT_EQ(ReadAll(h), "Eeee");
    fs_->Release(h);
  });
}

TEST_F(NoLockAcrossIo, HungTempFileOfACreateDelaysNoReadOrWriteOfOtherFiles) {
  std::atomic<bool> first{true};
  dir_->SetLookupHook([this, &first](const std::string& op, const std::string& path) {
    if (op == "open" && path.rfind(kTempPrefix, 0) == 0 && first.exchange(false)) {
      latch_.Wait();  // the new file's temp only; C's copy opens another one
    }
    return 0;
  });
  ExpectDataPathWhileHung([this] {
    auto made = fs_->Create(kRootIno, "new", 0644, O_WRONLY | O_CREAT | O_EXCL);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    EXPECT_TRUE(WriteAt(*fs_, made->second, "n", 1, 0).ok());
    fs_->Release(made->second);
  });
  auto twice = fs_->Create(kRootIno, "new", 0644, O_WRONLY | O_CREAT | O_EXCL);
  EXPECT_EQ(twice.status().code(), Code::kExists);
}

TEST_F(NoLockAcrossIo, HungTempFileOfATruncatingOpenDelaysNoReadOrWriteOfOtherFiles) {
  std::atomic<bool> first{true};
  dir_->SetLookupHook([this, &first](const std::string& op, const std::string& path) {
    if (op == "open" && path.rfind(kTempPrefix, 0) == 0 && first.exchange(false)) {
      latch_.Wait();
    }
    return 0;
  });
  ExpectDataPathWhileHung([this] {
    Handle* h = OpenOk(slow_file_, O_WRONLY | O_TRUNC);  // a re-save over a file
    ASSERT_NE(h, nullptr);
    EXPECT_TRUE(WriteAt(*fs_, h, "t", 1, 0).ok());
    fs_->Release(h);
  });
}

// A truncate to a nonzero size of a file not written yet begins its copy (temp file,
// registration, copy_file_range) like a first write.
TEST_F(NoLockAcrossIo, HungCopyOfATruncateDelaysNoOtherFile) {
  HangFirst("copy_file_range");
  ExpectDataPathWhileHung([this] {
    struct stat in {};
    in.st_size = 2;
    auto st = fs_->SetAttr(slow_file_, in, kSetSize, nullptr);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    EXPECT_EQ(st->st_size, 2);
  });
  Handle* h = OpenOk(slow_file_, O_RDONLY);
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(ReadAll(h), "ss");
  fs_->Release(h);
}

// A truncate of a file being written waits for its flushes in flight, then cuts its temp
// file: the cut hangs here.
TEST_F(NoLockAcrossIo, HungTruncateOfAStagedFileDelaysNoOtherFile) {
  uint64_t ino = 0;
  Handle* h = CreateStaged("staged", &ino);
  ASSERT_NE(h, nullptr);
  HangFirst("ftruncate");
  ExpectDataPathWhileHung([this, ino, h] {
    struct stat in {};
    in.st_size = 3;
    auto st = fs_->SetAttr(ino, in, kSetSize, h);
    EXPECT_TRUE(st.ok()) << st.status().ToString();
  });
  EXPECT_EQ(ReadAll(h), "sta");
  fs_->Release(h);
}

// A chmod of a file being written sets the mode of its temp file (what gets published).
TEST_F(NoLockAcrossIo, HungChmodOfAStagedFileDelaysNoOtherFile) {
  uint64_t ino = 0;
  Handle* h = CreateStaged("s", &ino);
  ASSERT_NE(h, nullptr);
  HangFirst("fchmod");  // the data path's creates set their temps' modes too
  ExpectDataPathWhileHung([this, ino] {
    struct stat in {};
    in.st_mode = 0600;
    auto st = fs_->SetAttr(ino, in, kSetMode, nullptr);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    EXPECT_EQ(st->st_mode & 07777, 0600u);
  });
  fs_->Release(h);
}

// fallocate reserves blocks in the temp file (after the copy it may begin).
TEST_F(NoLockAcrossIo, HungFallocateDelaysNoOtherFile) {
  HangFirst("fallocate");
  ExpectDataPathWhileHung([this] {
    Handle* h = OpenOk(slow_file_, O_RDWR);
    ASSERT_NE(h, nullptr);
    EXPECT_TRUE(fs_->Fallocate(h, 0, 0, 8).ok());
    EXPECT_EQ(ReadAll(h), std::string("ssss") + std::string(4, '\0'));
    fs_->Release(h);
  });
}

// An O_TRUNC open of a file another handle is writing cuts its staged bytes: the cut
// waits for the file's flushes, then truncates its temp file, which hangs here.
TEST_F(NoLockAcrossIo, HungCutOfATruncatingOpenOfAFileBeingWrittenDelaysNoOtherFile) {
  uint64_t ino = 0;
  Handle* h = CreateStaged("staged", &ino);
  ASSERT_NE(h, nullptr);
  HangFirst("ftruncate");
  ExpectDataPathWhileHung([this, ino] {
    Handle* t = OpenOk(ino, O_WRONLY | O_TRUNC);
    ASSERT_NE(t, nullptr);
    EXPECT_TRUE(WriteAt(*fs_, t, "T", 1, 0).ok());
    fs_->Release(t);
  });
  EXPECT_EQ(ReadAll(h), "T");
  fs_->Release(h);
}

// The last writer's close publishes the file: its freeze waits for a write or truncate
// of that file in progress (here a truncate by path, hung in its ftruncate, holding the
// file's writer lock as a writer waiting for staging space would).
TEST_F(NoLockAcrossIo, PublishWaitingToFreezeAFileDelaysNoOtherFile) {
  uint64_t ino = 0;
  Handle* h = CreateStaged("staged", &ino);
  ASSERT_NE(h, nullptr);
  std::shared_ptr<store::StagedFile> staged;
  {
    Node* node = h->file()->node.get();
    MutexLock lock(&node->data_mu);
    staged = node->data.staged;
  }
  ASSERT_NE(staged, nullptr);
  HangFirst("ftruncate");
  hung_ = std::thread([this, ino] {
    struct stat in {};
    in.st_size = 3;
    auto st = fs_->SetAttr(ino, in, kSetSize, nullptr);
    EXPECT_TRUE(st.ok()) << st.status().ToString();
  });
  latch_.AwaitWaiters(1);
  std::thread closer([this, h] { fs_->Release(h); });  // the publish waits to freeze it
  const auto deadline = std::chrono::steady_clock::now() + kBound;
  while (staged->freezes_waiting() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  const bool waiting = staged->freezes_waiting() > 0;
  EXPECT_TRUE(waiting) << "the publish did not wait for the truncate";
  auto data = std::async(std::launch::async, [this] { DataPath(); });
  const bool done = waiting && data.wait_for(kBound) == std::future_status::ready;
  EXPECT_FALSE(latch_.is_open());
  latch_.Open();
  hung_.join();
  closer.join();
  data.get();
  EXPECT_TRUE(done) << "reads and writes of other files waited for the publish's freeze";
  Handle* r = OpenOk(ino, O_RDONLY);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(ReadAll(r), "sta");
  fs_->Release(r);
}

// An open whose file is renamed while its backing open runs loses the race and starts
// over; after kRaceTries lost races its next open holds the node's I/O token. That open
// hangs here: namespace work on other names goes on (the table's lock is not held), and
// the open finishes once released, never failing for the races it lost.
TEST_F(NoLockAcrossIo, HungOpenAfterRacesLostDelaysNoOtherFile) {
  std::atomic<int> opens{0};
  dir_->SetLookupHook([this, &opens](const std::string& op, const std::string& path) {
    if (op != "open" || path.rfind("slow", 0) != 0) return 0;
    const int n = ++opens;
    if (n <= kRaceTries) {
      // The name moves while its backing open runs: the open just made is of a stale path.
      const std::string to = "slow" + std::to_string(n);
      EXPECT_TRUE(fs_->Rename(kRootIno, path, kRootIno, to, 0).ok());
    } else if (n == kRaceTries + 1) {
      latch_.Wait();
    }
    return 0;
  });
  ExpectDataPathWhileHung([this] {
    auto h = fs_->Open(slow_file_, O_RDONLY);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ(ReadAll(*h), "ssss");
    fs_->Release(*h);
  });
  EXPECT_EQ(opens.load(), kRaceTries + 1);
  auto moved = fs_->Lookup(kRootIno, "slow" + std::to_string(kRaceTries));
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  EXPECT_EQ(moved->ino, slow_file_);
}

// A first write whose file is chmod'ed while its copy is made loses the race (the copy has
// the old mode) and makes it again; after kRaceTries lost races the next copy holds the
// node's I/O token. That copy hangs here: namespace work on other names goes on, and the
// write lands once released.
TEST_F(NoLockAcrossIo, HungCopyAfterRacesLostDelaysNoOtherFile) {
  uint64_t e = WriteFile(kRootIno, "e", "eeee");
  ASSERT_NE(e, 0u);
  Handle* h = OpenOk(e, O_RDWR);  // not written yet: its first write begins a copy
  ASSERT_NE(h, nullptr);
  std::atomic<std::thread::id> writer{};
  std::atomic<int> copies{0};
  dir_->SetPosixHook([&](const std::string& op, const std::string&) {
    if (op != "copy_file_range" || std::this_thread::get_id() != writer.load()) return 0;
    const int n = ++copies;
    if (n <= kRaceTries) {
      struct stat in {};
      in.st_mode = (n % 2) ? 0600 : 0640;  // differs from the mode the copy was planned with
      auto st = fs_->SetAttr(e, in, kSetMode, nullptr);
      EXPECT_TRUE(st.ok()) << st.status().ToString();
    } else if (n == kRaceTries + 1) {
      latch_.Wait();
    }
    return 0;
  });
  ExpectDataPathWhileHung([&] {
    writer = std::this_thread::get_id();
    EXPECT_TRUE(WriteAt(*fs_, h, "E", 1, 0).ok());  // begins the rewrite: its copies race
    EXPECT_EQ(ReadAll(h), "Eeee");
  });
  EXPECT_EQ(copies.load(), kRaceTries + 1);
  fs_->Release(h);
}

// A truncate whose copy keeps losing its race (the file is chmod'ed during every copy, one
// time more than kRaceTries) goes on holding the node's I/O token until a copy holds: it
// never fails because it lost races (it returned kAborted, EIO, before).
TEST_F(NoLockAcrossIo, TruncateNeverFailsForRacesLost) {
  std::atomic<std::thread::id> truncater{};
  std::atomic<int> copies{0};
  dir_->SetPosixHook([&](const std::string& op, const std::string&) {
    if (op != "copy_file_range" || std::this_thread::get_id() != truncater.load()) return 0;
    const int n = ++copies;
    if (n <= kRaceTries + 1) {
      struct stat in {};
      in.st_mode = (n % 2) ? 0600 : 0640;  // differs from the mode the copy was planned with
      auto st = fs_->SetAttr(slow_file_, in, kSetMode, nullptr);
      EXPECT_TRUE(st.ok()) << st.status().ToString();
    }
    return 0;
  });
  truncater = std::this_thread::get_id();
  struct stat in {};
  in.st_size = 2;
  auto st = fs_->SetAttr(slow_file_, in, kSetSize, nullptr);
  truncater = std::thread::id{};
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->st_size, 2);
  EXPECT_EQ(copies.load(), kRaceTries + 2);
  Handle* h = OpenOk(slow_file_, O_RDONLY);
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(ReadAll(h), "ss");
  fs_->Release(h);
}

// A first write whose file another thread chmods without pause: each copy the write makes
// was planned with a mode that is gone once the copy is done, so it loses its race and
// copies again. After kRaceTries lost races the write holds the node's I/O token and the
// chmods wait for it: its next copy holds. Before, the write went on copying for as long as
// the chmods went on (here until kGiveUp copies, when the test stops them).
TEST_F(NoLockAcrossIo, WriteRacingAChmodLoopFinishesInBoundedTries) {
  uint64_t e = WriteFile(kRootIno, "e", "eeee");
  ASSERT_NE(e, 0u);
  Handle* h = OpenOk(e, O_RDWR);  // not written yet: its first write begins a copy
  ASSERT_NE(h, nullptr);
  constexpr int kGiveUp = kRaceTries + 20;
  std::atomic<std::thread::id> writer{};
  std::atomic<int> copies{0};
  std::atomic<int> chmods{0};
  std::atomic<bool> stop{false};
  std::atomic<bool> overtaken{false};
  dir_->SetPosixHook([&](const std::string& op, const std::string&) {
    if (op != "copy_file_range" || std::this_thread::get_id() != writer.load()) return 0;
    const int n = ++copies;
    if (n >= kGiveUp) {
      stop = true;
      return 0;
    }
    // A slow copy: it lasts until two more chmods are done (the second began after the
    // copy did: the mode the copy was planned with is gone), or 2 s if they wait.
    const int seen = chmods.load();
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (chmods.load() < seen + 2 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    // After kRaceTries lost races the write holds the token: no chmod may begin and end
    // during its copy (one already past its wait may end).
    if (n > kRaceTries && chmods.load() >= seen + 2) overtaken = true;
    return 0;
  });
  std::thread chmodder([&] {
    for (int i = 0; !stop.load(); ++i) {
      struct stat in {};
      in.st_mode = 0100 + (i % 0700);  // no mode comes back within a copy's time
      auto st = fs_->SetAttr(e, in, kSetMode, nullptr);
      EXPECT_TRUE(st.ok()) << st.status().ToString();
      ++chmods;
    }
  });
  writer = std::this_thread::get_id();
  EXPECT_TRUE(WriteAt(*fs_, h, "E", 1, 0).ok());
  writer = std::thread::id{};
  stop = true;
  chmodder.join();
  EXPECT_GT(chmods.load(), 0);
  EXPECT_FALSE(overtaken.load()) << "a chmod went by while the write held the I/O token";
  EXPECT_LE(copies.load(), kRaceTries + 2) << "the write kept losing its race to the chmods";
  EXPECT_EQ(ReadAll(h), "Eeee");
  fs_->Release(h);
}

// An open of d/f whose directory is renamed during each backing open loses its race; after
// kRaceTries lost races it holds f's I/O token, and a rename of d (a directory above f: it
// moves f's backing path) by another thread waits for the open to finish, which holds.
// Before, that rename went through and the open lost once more.
TEST_F(NoLockAcrossIo, RenameAboveAnOpenHoldingItsTokenWaitsForIt) {
  auto d = fs_->Mkdir(kRootIno, "d", 0755);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const uint64_t f = WriteFile(d->ino, "f", "ffff");
  ASSERT_NE(f, 0u);
  std::string dir_name = "d";
  std::atomic<int> opens{0};
  std::future<Status> renamer;
  bool renamed_early = false;
  dir_->SetLookupHook([&](const std::string& op, const std::string& path) {
    if (op != "open" || path != dir_name + "/f") return 0;
    const int n = ++opens;
    if (n <= kRaceTries) {
      // On the opener's own thread: d moves while the open runs, the open is of a stale path.
      const std::string to = "d" + std::to_string(n);
      EXPECT_TRUE(fs_->Rename(kRootIno, dir_name, kRootIno, to, 0).ok());
      dir_name = to;
    } else if (n == kRaceTries + 1) {
      const std::string from = dir_name;
      renamer = std::async(std::launch::async, [this, from] {
        return fs_->Rename(kRootIno, from, kRootIno, "moved", 0);
      });
      renamed_early =
          renamer.wait_for(std::chrono::milliseconds(300)) == std::future_status::ready;
    }
    return 0;
  });
  auto h = fs_->Open(f, O_RDONLY);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(ReadAll(*h), "ffff");
  fs_->Release(*h);
  EXPECT_FALSE(renamed_early) << "the rename did not wait for the open holding the token";
  EXPECT_EQ(opens.load(), kRaceTries + 1);
  ASSERT_TRUE(renamer.valid());
  EXPECT_TRUE(renamer.get().ok());
  auto moved = fs_->Lookup(kRootIno, "moved");
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  EXPECT_EQ(moved->ino, d->ino);
}

}  // namespace
}  // namespace ckptfs::fs
