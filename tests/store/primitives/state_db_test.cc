// StateDb on a full disk: writes refused below the free-space reserve, RocksDB itself
// running out of space (no abort, a clear kNoSpace), recovery once space is freed, and
// nothing acknowledged lost across a reopen. The state dir is a small tmpfs (needs
// root; skipped otherwise), so "full" is the real ENOSPC of a real file system.
#include "store/primitives/state_db.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kMiB = 1 << 20;

// A tmpfs of `mib` MiB mounted on a fresh directory; unmounted on destruction.
class SmallTmpfs {
 public:
  explicit SmallTmpfs(int mib) {
    std::string opts = "size=" + std::to_string(mib) + "m";
    mounted_ = ::mount("tmpfs", dir_.path().c_str(), "tmpfs", 0, opts.c_str()) == 0;
    error_ = mounted_ ? 0 : errno;
  }
  ~SmallTmpfs() {
    if (mounted_) ::umount2(dir_.path().c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  int error() const { return error_; }
  std::string Sub(const std::string& rel) const { return dir_.path() + "/" + rel; }

  // Fills the file system up to `leave` free bytes (0: completely) with a filler file.
  void Fill(uint64_t leave = 0) {
    const std::string path = Sub("filler");
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    ASSERT_TRUE(fd.valid()) << std::strerror(errno);
    std::string block(kMiB, '\xee');
    while (true) {
      struct statvfs st;
      ASSERT_EQ(::fstatvfs(fd.get(), &st), 0);
      uint64_t free_bytes = st.f_bfree * st.f_frsize;
      if (free_bytes <= leave) return;
      size_t n = std::min<uint64_t>(block.size(), free_bytes - leave);
      if (leave == 0 && n < 4096) n = 4096;
      ssize_t w = ::write(fd.get(), block.data(), n);
      if (w < 0) {
        ASSERT_EQ(errno, ENOSPC) << std::strerror(errno);
        if (n == 4096) return;
        block.resize(4096);
      }
    }
  }
  void Free() { ASSERT_EQ(::unlink(Sub("filler").c_str()), 0) << std::strerror(errno); }

 private:
  ScopedTempDir dir_{"ckptfs-statedb-test"};
  bool mounted_ = false;
  int error_ = 0;
};

#define SKIP_WITHOUT_TMPFS(fs)                                                        \
  if (!(fs).mounted()) GTEST_SKIP() << "cannot mount a tmpfs (needs root): "          \
                                    << std::strerror((fs).error())

std::string Key(int i) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "k/%06d", i);
  return buf;
}

// Retries `fn` until it returns ok or `limit` passes; returns the last status.
template <typename Fn>
Status RetryUntilOk(Fn fn, std::chrono::seconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (true) {
    Status st = fn();
    if (st.ok() || std::chrono::steady_clock::now() > deadline) return st;
    std::this_thread::sleep_for(100ms);
  }
}

TEST(StateDb, UnsyncedWritesAreReadBackAndCountedApartFromSyncedOnes) {
  ScopedTempDir dir{"ckptfs-statedb-test"};
  auto db = StateDb::Open(dir.path() + "/state");
  ASSERT_TRUE(db.ok()) << db.status().ToString();
  StateDb& s = **db;
  ASSERT_TRUE(s.Put("a", "1").ok());
  ASSERT_TRUE(s.Put("b", "2", WriteMode::kUnsynced).ok());
  ASSERT_TRUE(s.Write({{"c", "3"}}, {"a"}, WriteMode::kUnsynced).ok());
  ASSERT_TRUE(s.Delete("b", WriteMode::kSynced).ok());
  EXPECT_EQ(s.writes(), 4u);
  EXPECT_EQ(s.synced_writes(), 2u);
  EXPECT_EQ(s.Get("a").status().code(), Code::kNotFound);
  EXPECT_EQ(s.Get("b").status().code(), Code::kNotFound);
  auto c = s.Get("c");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, "3");
  db->reset();
  // A clean close keeps unsynced records too (they reached the WAL with write(2)).
  auto again = StateDb::Open(dir.path() + "/state");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  auto c2 = (*again)->Get("c");
  ASSERT_TRUE(c2.ok());
  EXPECT_EQ(*c2, "3");
}

TEST(StateDb, WritesBelowTheFreeSpaceReserveFailWithNoSpaceAndResumeWhenFreed) {
  SmallTmpfs fs(48);
  SKIP_WITHOUT_TMPFS(fs);
  StateDbOptions options;
  options.min_free_bytes = 8 * kMiB;
  auto db = StateDb::Open(fs.Sub("state"), options);
  ASSERT_TRUE(db.ok()) << db.status().ToString();
  ASSERT_TRUE((*db)->Put("before", "1").ok());

  // 4 MiB left is still space, but less than the reserve.
  fs.Fill(4 * kMiB);
  auto free_bytes = (*db)->FreeBytes();
  ASSERT_TRUE(free_bytes.ok());
  EXPECT_LT(*free_bytes, options.min_free_bytes);
  for (Status st : {(*db)->Put("during", "x"), (*db)->Delete("before"),
                    (*db)->Write({{"during2", "y"}}, {"before"})}) {
    EXPECT_EQ(st.code(), Code::kNoSpace) << st.ToString();
    EXPECT_EQ(st.ToErrno(), ENOSPC);
    EXPECT_NE(st.message().find("No space left"), std::string::npos) << st.message();
  }
  // Reads keep working, and nothing refused was applied.
  auto before = (*db)->Get("before");
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  EXPECT_EQ(*before, "1");
  EXPECT_EQ((*db)->Get("during").status().code(), Code::kNotFound);

  fs.Free();
  Status st = (*db)->Put("after", "2");
  EXPECT_TRUE(st.ok()) << "the reserve check must clear as soon as space is back: "
                       << st.ToString();
  EXPECT_EQ(*(*db)->Get("after"), "2");
}

// The reserve is off, so RocksDB's own WAL writes hit ENOSPC, from several threads at
// once. Debian's RocksDB 7.8 used to abort the process here (an assertion in
// WritableFileWriter, reached through its info LOG file in the full state dir).
TEST(StateDb, RocksDbRunningOutOfSpaceFailsWritesCleanlyAndRecovers) {
  SmallTmpfs fs(16);
  SKIP_WITHOUT_TMPFS(fs);
  StateDbOptions options;
  options.min_free_bytes = 0;
  const std::string dir = fs.Sub("state");
  std::map<std::string, std::string> acked;  // every write that returned ok
  {
    auto opened = StateDb::Open(dir, options);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    std::unique_ptr<StateDb> db = std::move(opened).value();
    for (int i = 0; i < 20; ++i) {
      ASSERT_TRUE(db->Put(Key(i), "committed").ok());
      acked[Key(i)] = "committed";
    }
    fs.Fill();

    constexpr int kThreads = 4, kEach = 400;
    std::vector<std::map<std::string, std::string>> oks(kThreads);
    std::atomic<int> no_space{0}, other{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        const std::string value(8000, static_cast<char>('a' + t));
        for (int i = 0; i < kEach; ++i) {
          std::string key = Key(1000 * (t + 1) + i);
          Status st = (i % 3 == 2) ? db->Write({{key, value}}, {}) : db->Put(key, value);
          if (st.ok()) {
            oks[t][key] = value;
          } else if (st.code() == Code::kNoSpace) {
            ++no_space;
          } else {
            ++other;
            ADD_FAILURE() << st.ToString();
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    for (auto& m : oks) acked.insert(m.begin(), m.end());
    EXPECT_GT(no_space.load(), 0) << "the disk never filled";
    EXPECT_EQ(other.load(), 0);
    // Reads work on a full disk.
    EXPECT_EQ(*db->Get(Key(0)), "committed");
    // Reopening is due again while the disk is still full. Closing releases the WAL's
    // preallocated tail, so the write may fit after all; either way no abort, and what
    // was acknowledged is kept.
    for (int i = 0; i < 3; ++i) {
      std::this_thread::sleep_for(1100ms);
      fs.Fill();
      Status st = db->Put("still-full", std::string(100000, 'f'));
      EXPECT_TRUE(st.ok() || st.code() == Code::kNoSpace) << st.ToString();
      if (st.ok()) acked["still-full"] = std::string(100000, 'f');
    }

    fs.Free();
    Status st = RetryUntilOk([&] { return db->Put("after", "ok"); }, 30s);
    ASSERT_TRUE(st.ok()) << "no recovery after space was freed: " << st.ToString();
    acked["after"] = "ok";
    for (const auto& [k, v] : acked) {
      auto got = db->Get(k);
      ASSERT_TRUE(got.ok()) << k << ": " << got.status().ToString();
      EXPECT_EQ(*got, v) << k;
    }
  }
  // Everything acknowledged survives a reopen (WAL replay after the error).
  auto reopened = StateDb::Open(dir, options);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  for (const auto& [k, v] : acked) {
    auto got = (*reopened)->Get(k);
    ASSERT_TRUE(got.ok()) << k << ": " << got.status().ToString();
    EXPECT_EQ(*got, v) << k;
  }
  EXPECT_TRUE((*reopened)->Put("after-reopen", "1").ok());
}

// A child process that holds a POSIX lock on DIR/LOCK, as RocksDB takes it. With
// `exiting`, the child's main thread ends (its leader is a zombie) while another thread
// keeps the process, and the lock, for `hold` more: the shape of a daemon killed while a
// flush thread finishes a direct write. Without, the child lives until killed.
class LockHoldingChild {
 public:
  LockHoldingChild(const std::string& dir, bool exiting, std::chrono::milliseconds hold) {
    std::filesystem::create_directories(dir);
    int ready[2];
    if (::pipe(ready) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(ready[0]);
      int fd = ::open((dir + "/LOCK").c_str(), O_RDWR | O_CREAT, 0644);
      struct flock fl{};
      fl.l_type = F_WRLCK;
      fl.l_whence = SEEK_SET;
      if (fd < 0 || ::fcntl(fd, F_SETLK, &fl) != 0) ::_exit(3);
      if (!exiting) {
        [[maybe_unused]] ssize_t n = ::write(ready[1], "r", 1);
        while (true) ::pause();
      }
      std::thread([hold] {
        std::this_thread::sleep_for(hold);
        ::_exit(0);
      }).detach();
      [[maybe_unused]] ssize_t n = ::write(ready[1], "r", 1);
      ::syscall(SYS_exit, 0);  // this thread only
    }
    ::close(ready[1]);
    char c;
    ready_ = pid_ > 0 && ::read(ready[0], &c, 1) == 1;
    ::close(ready[0]);
    if (ready_ && exiting) {  // until the leader is a zombie
      const std::string stat = "/proc/" + std::to_string(pid_) + "/stat";
      for (int i = 0; i < 200; ++i) {
        std::ifstream in(stat);
        std::string text((std::istreambuf_iterator<char>(in)), {});
        size_t paren = text.rfind(')');
        if (paren != std::string::npos && text.substr(paren + 2, 1) == "Z") break;
        std::this_thread::sleep_for(5ms);
      }
    }
  }
  ~LockHoldingChild() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  bool ready() const { return ready_; }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  bool ready_ = false;
};

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

TEST(StateDb, ASecondOpenInTheSameProcessFailsAtOnceAndKeepsTheFirst) {
  ScopedTempDir dir{"ckptfs-statedb-test"};
  auto first = StateDb::Open(dir.path() + "/state");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto t0 = std::chrono::steady_clock::now();
  auto second = StateDb::Open(dir.path() + "/state");  // default wait: 30 s
  EXPECT_LT(SecondsSince(t0), 2.0);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), Code::kBusy);
  EXPECT_NE(second.status().message().find("another ckptfs"), std::string::npos)
      << second.status().ToString();
  // Looking for the holder did not drop the first instance's lock (a POSIX lock goes
  // with any close of the file by its process).
  ASSERT_TRUE((*first)->Put("k", "v").ok());
  LockHoldingChild other(dir.path() + "/state", /*exiting=*/false, 0ms);
  EXPECT_FALSE(other.ready()) << "another process could lock the open state dir";
}

TEST(StateDb, ALiveHolderInAnotherProcessFailsOpenAtOnceNamingItsPid) {
  ScopedTempDir dir{"ckptfs-statedb-test"};
  LockHoldingChild holder(dir.path() + "/state", /*exiting=*/false, 0ms);
  ASSERT_TRUE(holder.ready());
  auto t0 = std::chrono::steady_clock::now();
  auto db = StateDb::Open(dir.path() + "/state");
  EXPECT_LT(SecondsSince(t0), 2.0);
  ASSERT_FALSE(db.ok());
  EXPECT_EQ(db.status().code(), Code::kBusy);
  EXPECT_NE(db.status().message().find("held by pid " + std::to_string(holder.pid())),
            std::string::npos)
      << db.status().ToString();
  EXPECT_NE(db.status().message().find("another ckptfs"), std::string::npos);
}

TEST(StateDb, OpenWaitsForAnExitingHolderToLetGo) {
  ScopedTempDir dir{"ckptfs-statedb-test"};
  LockHoldingChild holder(dir.path() + "/state", /*exiting=*/true, 1500ms);
  ASSERT_TRUE(holder.ready());
  auto t0 = std::chrono::steady_clock::now();
  auto db = StateDb::Open(dir.path() + "/state");
  double took = SecondsSince(t0);
  ASSERT_TRUE(db.ok()) << db.status().ToString();
  EXPECT_GT(took, 0.5);
  EXPECT_LT(took, 15.0);
  EXPECT_TRUE((*db)->Put("k", "v").ok());
}

TEST(StateDb, OpenGivesUpOnAnExitingHolderAfterItsWait) {
  ScopedTempDir dir{"ckptfs-statedb-test"};
  LockHoldingChild holder(dir.path() + "/state", /*exiting=*/true, 60s);
  ASSERT_TRUE(holder.ready());
  StateDbOptions options;
  options.exiting_holder_wait = 400ms;
  auto t0 = std::chrono::steady_clock::now();
  auto db = StateDb::Open(dir.path() + "/state", options);
  double took = SecondsSince(t0);
  ASSERT_FALSE(db.ok());
  EXPECT_EQ(db.status().code(), Code::kBusy);
  const std::string want = "pid " + std::to_string(holder.pid()) + ", which is exiting";
  EXPECT_NE(db.status().message().find(want), std::string::npos)
      << db.status().ToString();
  EXPECT_GE(took, 0.35);
  EXPECT_LT(took, 5.0);
}

}  // namespace
}  // namespace ckptfs::store
