// Multi-user POSIX in the store layer: BackingDir's Chown, Link, Mknod, Fchown and
// Fallocate (confined like every other call), the journal's kChown, kLink and kMknod
// entries and the owner fields of kMkdir/kSymlink, their Serialize/Parse, and that the
// fault-injecting FaultyBackingDir sees every one of them.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/falloc.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "store/primitives/backing_dir.h"
#include "store/primitives/state_db.h"
#include "store/publish/journal.h"
#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {

constexpr uid_t kUser = 4242;
constexpr gid_t kGroup = 4343;

struct stat LStat(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st;
}

bool Root() { return ::geteuid() == 0; }

class PosixOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = tmp_.Sub("backing");
    outside_ = tmp_.Sub("outside");
    dir_ = FaultyBackingDir::Open(root_);
    ASSERT_NE(dir_, nullptr);
  }
  std::string In(const std::string& rel) const { return root_ + "/" + rel; }

  ScopedTempDir tmp_{"ckptfs-posix-ops-test"};
  std::string root_, outside_;
  std::unique_ptr<FaultyBackingDir> dir_;
};

// ------------------------------------------------------------------------ BackingDir

TEST_F(PosixOpsTest, ChownChangesTheNameItselfNeverAFinalSymlinksTarget) {
  if (!Root()) GTEST_SKIP() << "chown to another uid needs root";
  ASSERT_EQ(::close(::open(In("f").c_str(), O_CREAT | O_WRONLY, 0644)), 0);
  ASSERT_EQ(::close(::open((outside_ + "/sentinel").c_str(), O_CREAT | O_WRONLY, 0644)), 0);
  ASSERT_EQ(::symlink((outside_ + "/sentinel").c_str(), In("escape").c_str()), 0);

  ASSERT_TRUE(dir_->Chown("f", kUser, kGroup).ok());
  EXPECT_EQ(LStat(In("f")).st_uid, kUser);
  EXPECT_EQ(LStat(In("f")).st_gid, kGroup);
  ASSERT_TRUE(dir_->Chown("f", static_cast<uid_t>(-1), 0).ok());  // -1 keeps the owner
  EXPECT_EQ(LStat(In("f")).st_uid, kUser);
  EXPECT_EQ(LStat(In("f")).st_gid, 0u);

  ASSERT_TRUE(dir_->Chown("escape", kUser, kGroup).ok());
  EXPECT_EQ(LStat(In("escape")).st_uid, kUser);              // the link itself
  EXPECT_EQ(LStat(outside_ + "/sentinel").st_uid, 0u);       // never its target
  EXPECT_EQ(dir_->Chown("../outside/sentinel", kUser, kGroup).code(), Code::kPermission);
  EXPECT_EQ(dir_->Chown("missing", kUser, kGroup).code(), Code::kNotFound);
}

TEST_F(PosixOpsTest, ChownClearsSetuidOfARegularFileAsLinuxDoes) {
  if (!Root()) GTEST_SKIP() << "chown to another uid needs root";
  ASSERT_EQ(::close(::open(In("s").c_str(), O_CREAT | O_WRONLY, 0644)), 0);
  ASSERT_EQ(::chmod(In("s").c_str(), 04755), 0);
  ASSERT_TRUE(dir_->Chown("s", kUser, static_cast<gid_t>(-1)).ok());
  EXPECT_EQ(LStat(In("s")).st_mode & 07777, 0755u);
}

TEST_F(PosixOpsTest, LinkMakesARealHardLinkAndNeverFollowsASymlink) {
  ASSERT_EQ(::close(::open(In("a").c_str(), O_CREAT | O_WRONLY, 0644)), 0);
  ASSERT_EQ(::mkdir(In("d").c_str(), 0755), 0);
  ASSERT_TRUE(dir_->Link("a", "d/b").ok());
  EXPECT_EQ(LStat(In("a")).st_ino, LStat(In("d/b")).st_ino);
  EXPECT_EQ(LStat(In("a")).st_nlink, 2u);

  ASSERT_EQ(::close(::open((outside_ + "/sentinel").c_str(), O_CREAT | O_WRONLY, 0644)), 0);
  ASSERT_EQ(::symlink((outside_ + "/sentinel").c_str(), In("escape").c_str()), 0);
  ASSERT_TRUE(dir_->Link("escape", "escape2").ok());
  EXPECT_TRUE(S_ISLNK(LStat(In("escape2")).st_mode));  // the link, not the target
  EXPECT_EQ(LStat(outside_ + "/sentinel").st_nlink, 1u);

  EXPECT_EQ(dir_->Link("a", "d/b").code(), Code::kExists);
  EXPECT_EQ(dir_->Link("missing", "x").code(), Code::kNotFound);
  EXPECT_EQ(dir_->Link("a", "../outside/stolen").code(), Code::kPermission);
  EXPECT_EQ(dir_->Link("../outside/sentinel", "stolen").code(), Code::kPermission);
  EXPECT_EQ(dir_->Link("escape/..", "x").code(), Code::kPermission);
  EXPECT_FALSE(std::filesystem::exists(outside_ + "/stolen"));
}

TEST_F(PosixOpsTest, MknodMakesFifosSocketsAndEmptyFilesBeneathTheRoot) {
  ASSERT_TRUE(dir_->Mknod("fifo", S_IFIFO | 0640, 0).ok());
  ASSERT_TRUE(dir_->Mknod("sock", S_IFSOCK | 0600, 0).ok());
  ASSERT_TRUE(dir_->Mknod("reg", S_IFREG | 0644, 0).ok());
  EXPECT_TRUE(S_ISFIFO(LStat(In("fifo")).st_mode));
  EXPECT_TRUE(S_ISSOCK(LStat(In("sock")).st_mode));
  EXPECT_TRUE(S_ISREG(LStat(In("reg")).st_mode));
  EXPECT_EQ(LStat(In("reg")).st_size, 0);
  EXPECT_EQ(dir_->Mknod("fifo", S_IFIFO | 0640, 0).code(), Code::kExists);
  EXPECT_EQ(dir_->Mknod("../outside/fifo", S_IFIFO | 0640, 0).code(), Code::kPermission);
  EXPECT_EQ(dir_->Mknod("", S_IFIFO | 0640, 0).code(), Code::kInvalid);
  EXPECT_FALSE(std::filesystem::exists(outside_ + "/fifo"));
}

TEST_F(PosixOpsTest, FallocateReservesAndExtendsAndRefusesUnknownModesByErrno) {
  auto fd = dir_->OpenFile("f", O_RDWR | O_CREAT, 0644);
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(dir_->Fallocate(fd->get(), 0, 0, 1 << 20).ok());
  EXPECT_EQ(LStat(In("f")).st_size, 1 << 20);
  ASSERT_TRUE(dir_->Fallocate(fd->get(), FALLOC_FL_KEEP_SIZE, 0, 4 << 20).ok());
  EXPECT_EQ(LStat(In("f")).st_size, 1 << 20);
  EXPECT_GE(LStat(In("f")).st_blocks * 512, 4 << 20);
  EXPECT_EQ(dir_->Fallocate(fd->get(), 0x7f00, 0, 1).code(), Code::kUnsupported);
  EXPECT_EQ(dir_->Fallocate(-1, 0, 0, 1).code(), Code::kIo);  // EBADF
}

TEST_F(PosixOpsTest, FaultyBackingDirInjectsIntoEveryOwnershipAndSpecialFileCall) {
  std::vector<std::string> seen;
  dir_->SetPosixHook([&](const std::string& op, const std::string& path) {
    seen.push_back(op + ":" + path);
    return op == "mknod" ? ENOSPC : 0;
  });
  EXPECT_EQ(dir_->Mknod("fifo", S_IFIFO | 0644, 0).code(), Code::kNoSpace);
  EXPECT_FALSE(std::filesystem::exists(In("fifo")));
  ASSERT_EQ(::close(::open(In("a").c_str(), O_CREAT | O_WRONLY, 0644)), 0);
  EXPECT_TRUE(dir_->Link("a", "b").ok());
  EXPECT_TRUE(dir_->Chown("a", ::geteuid(), ::getegid()).ok());
  auto fd = dir_->OpenFile("a", O_RDWR);
  ASSERT_TRUE(fd.ok());
  EXPECT_TRUE(dir_->Fchown(fd->get(), ::geteuid(), ::getegid()).ok());
  EXPECT_TRUE(dir_->Fallocate(fd->get(), 0, 0, 10).ok());
  EXPECT_EQ(seen, (std::vector<std::string>{"mknod:fifo", "link:b", "chown:a", "fchown:",
                                            "fallocate:"}));
  EXPECT_EQ(dir_->posix_calls(), 5u);
  dir_->SimulateCrash();
  EXPECT_EQ(dir_->Link("a", "c").code(), Code::kIo);
  EXPECT_FALSE(std::filesystem::exists(In("c")));
}

// ------------------------------------------------------------------------ journal

TEST(JournalEntryPosix, OwnerRdevAndLinkSourceRoundTripAndOldEntriesParseAsUnowned) {
  JournalEntry e;
  e.seq = 7;
  e.op = OpType::kMknod;
  e.path = "d/fifo";
  e.mode = S_IFCHR | 0600;
  e.uid = kUser;
  e.gid = kGroup;
  e.rdev = makedev(1, 3);
  auto p = JournalEntry::Parse(e.Serialize());
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->op, OpType::kMknod);
  EXPECT_EQ(p->uid, kUser);
  EXPECT_EQ(p->gid, kGroup);
  EXPECT_EQ(p->rdev, e.rdev);
  EXPECT_EQ(p->mode, e.mode);

  JournalEntry link;
  link.op = OpType::kLink;
  link.from = "a";
  link.path = "b";
  auto l = JournalEntry::Parse(link.Serialize());
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->from, "a");
  EXPECT_EQ(l->uid, kNoOwner);
  EXPECT_EQ(l->gid, kNoOwner);

  // A record cut short (as a torn write would leave it) is refused, never misread.
  std::string cut = e.Serialize();
  cut.pop_back();
  EXPECT_EQ(JournalEntry::Parse(cut).status().code(), Code::kCorrupt);
}

class JournalPosixTest : public PosixOpsTest {
 protected:
  void SetUp() override {
    PosixOpsTest::SetUp();
    auto db = StateDb::Open(tmp_.Sub("state", false));
    ASSERT_TRUE(db.ok()) << db.status().ToString();
    db_ = std::move(db).value();
    auto j = Journal::Create(dir_.get(), db_.get(), nullptr);
    ASSERT_TRUE(j.ok());
    journal_ = std::move(j).value();
  }
  void TearDown() override { journal_.reset(); }
  Status Apply(JournalEntry e) {
    auto seq = journal_->Append(std::move(e));
    if (!seq.ok()) return seq.status();
    return journal_->Wait(*seq);
  }
  JournalEntry Entry(OpType op, const std::string& path, uint32_t mode = 0) {
    JournalEntry e;
    e.op = op;
    e.path = path;
    e.mode = mode;
    return e;
  }

  std::unique_ptr<StateDb> db_;
  std::unique_ptr<Journal> journal_;
};

TEST_F(JournalPosixTest, NewNamesGetTheirOwnerAndExactModeDespiteTheDaemonsUmask) {
  if (!Root()) GTEST_SKIP() << "chown to another uid needs root";
  const mode_t old_umask = ::umask(077);
  JournalEntry mkdir = Entry(OpType::kMkdir, "d", 02775);
  mkdir.uid = kUser;
  mkdir.gid = kGroup;
  JournalEntry fifo = Entry(OpType::kMknod, "d/fifo", S_IFIFO | 0664);
  fifo.uid = kUser;
  fifo.gid = kGroup;
  JournalEntry link = Entry(OpType::kSymlink, "d/l");
  link.link_target = "fifo";
  link.uid = kUser;
  link.gid = kGroup;
  Status a = Apply(mkdir), b = Apply(fifo), c = Apply(link);
  ::umask(old_umask);
  ASSERT_TRUE(a.ok()) << a.ToString();
  ASSERT_TRUE(b.ok()) << b.ToString();
  ASSERT_TRUE(c.ok()) << c.ToString();
  for (const char* name : {"d", "d/fifo", "d/l"}) {
    EXPECT_EQ(LStat(In(name)).st_uid, kUser) << name;
    EXPECT_EQ(LStat(In(name)).st_gid, kGroup) << name;
  }
  EXPECT_EQ(LStat(In("d")).st_mode & 07777, 02775u);
  EXPECT_TRUE(S_ISFIFO(LStat(In("d/fifo")).st_mode));
  EXPECT_EQ(LStat(In("d/fifo")).st_mode & 07777, 0664u);
}

TEST_F(JournalPosixTest, ChownAndLinkApplyInJournalOrder) {
  if (!Root()) GTEST_SKIP() << "chown to another uid needs root";
  ASSERT_EQ(::close(::open(In("a").c_str(), O_CREAT | O_WRONLY, 0644)), 0);
  JournalEntry chown = Entry(OpType::kChown, "a");
  chown.gid = kGroup;  // uid left alone
  JournalEntry link = Entry(OpType::kLink, "b");
  link.from = "a";
  JournalEntry rename = Entry(OpType::kRename, "c");
  rename.from = "a";
  ASSERT_TRUE(Apply(chown).ok());
  ASSERT_TRUE(Apply(link).ok());
  ASSERT_TRUE(Apply(rename).ok());
  EXPECT_EQ(LStat(In("b")).st_ino, LStat(In("c")).st_ino);
  EXPECT_EQ(LStat(In("b")).st_gid, kGroup);
  EXPECT_EQ(LStat(In("b")).st_uid, 0u);
  EXPECT_EQ(LStat(In("b")).st_nlink, 2u);
}

TEST_F(JournalPosixTest, AFailedLinkOrMknodIsReportedAndLeavesNothingBehind) {
  JournalEntry link = Entry(OpType::kLink, "b");
  link.from = "never-published";
  EXPECT_EQ(Apply(link).code(), Code::kNotFound);
  EXPECT_FALSE(std::filesystem::exists(In("b")));
  dir_->SetPosixHook([](const std::string& op, const std::string&) {
    return op == "mknod" ? EIO : 0;
  });
  EXPECT_EQ(Apply(Entry(OpType::kMknod, "fifo", S_IFIFO | 0644)).code(), Code::kIo);
  EXPECT_FALSE(std::filesystem::exists(In("fifo")));
}

TEST_F(JournalPosixTest, ABackingStoreThatRefusesTheOwnerStillGetsTheNameWithItsMode) {
  // A daemon that is not root, or NFS with root_squash: the chown fails, the mkdir must
  // not (publication would stop behind an owner the store cannot hold).
  dir_->SetPosixHook([](const std::string& op, const std::string&) {
    return op == "chown" ? EPERM : 0;
  });
  JournalEntry mkdir = Entry(OpType::kMkdir, "d", 0710);
  mkdir.uid = kUser;
  mkdir.gid = kGroup;
  ASSERT_TRUE(Apply(mkdir).ok());
  EXPECT_EQ(LStat(In("d")).st_uid, ::geteuid());
  EXPECT_EQ(LStat(In("d")).st_mode & 07777, 0710u);
  // An explicit chown is the application's request: its failure is reported.
  JournalEntry chown = Entry(OpType::kChown, "d");
  chown.uid = kUser;
  EXPECT_EQ(Apply(chown).code(), Code::kPermission);  // EPERM from the store
}

}  // namespace
}  // namespace ckptfs::store
