// Filesystem, multi-user: names belong to their caller on the mount at once and on the
// backing store once published; chown of staged and published files; sticky
// directories; hard links of staged files; mknod; fallocate. Both durability modes, on a
// real Filesystem over a temporary backing directory (no FUSE).
#include "fs/filesystem.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::fs {
namespace {

constexpr uid_t kUser = 4242;
constexpr gid_t kGroup = 4343;
constexpr uid_t kStranger = 5151;

Caller As(uid_t uid, gid_t gid) {
  Caller c;
  c.uid = uid;
  c.gid = gid;
  c.groups_known = true;
  return c;
}

class FilesystemPosixTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "owners other than the daemon's need root";
    FsConfig config;
    config.backing_dir = backing_ = tmp_.Sub("backing");
    config.state_dir = tmp_.Sub("state", false);
    config.mountpoint = tmp_.Sub("mnt");
    config.strict = GetParam();
    config.staging_bytes = 8 << 20;
    config.chunk_bytes = 1 << 20;
    config.cache_bytes = 0;
    config.staging_backend = "host";
    auto fs = Filesystem::Create(config);
    ASSERT_TRUE(fs.ok()) << fs.status().ToString();
    fs_ = std::move(fs).value();
  }

  struct stat Backing(const std::string& rel) {
    struct stat st {};
    EXPECT_EQ(::lstat((backing_ + "/" + rel).c_str(), &st), 0) << rel;
    return st;
  }
  // Every temp file at the backing root.
  std::vector<struct stat> Temps() {
    std::vector<struct stat> out;
    DIR* d = ::opendir(backing_.c_str());
    while (struct dirent* e = ::readdir(d)) {
      if (std::string(e->d_name).rfind(kTempPrefix, 0) == 0) out.push_back(Backing(e->d_name));
    }
    ::closedir(d);
    return out;
  }
  // Creates `name` in `parent` as `who`, writes `bytes` and closes it.
  Entry WriteFile(uint64_t parent, const std::string& name, const std::string& bytes,
                  const Caller& who, mode_t mode = 0640) {
    auto r = fs_->Create(parent, name, mode, O_CREAT | O_WRONLY, who);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return {};
    auto [entry, h] = *r;
    EXPECT_TRUE(WriteAt(*fs_, h, bytes.data(), bytes.size(), 0).ok());
    EXPECT_TRUE(fs_->Flush(h).ok());
    fs_->Release(h);
    return entry;
  }
  std::string ReadAll(uint64_t ino) {
    auto h = fs_->Open(ino, O_RDONLY);
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    if (!h.ok()) return "";
    std::string out(1 << 16, '\0');
    auto n = fs_->Read(*h, out.data(), out.size(), 0);
    fs_->Release(*h);
    EXPECT_TRUE(n.ok());
    out.resize(n.ok() ? *n : 0);
    return out;
  }
  void Drain() { EXPECT_EQ(fs_->Shutdown().unpublished, 0u); }

  store::ScopedTempDir tmp_{"ckptfs-fs-posix-test"};
  std::string backing_;
  std::unique_ptr<Filesystem> fs_;
};

TEST_P(FilesystemPosixTest, NewNamesBelongToTheCallerAtOnceAndOnTheBackingStoreWhenPublished) {
  const Caller user = As(kUser, kGroup);
  auto created = fs_->Create(kRootIno, "f", 0640, O_CREAT | O_WRONLY, user);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto [entry, h] = *created;
  EXPECT_EQ(entry.attr.st_uid, kUser);
  EXPECT_EQ(entry.attr.st_gid, kGroup);
  ASSERT_TRUE(WriteAt(*fs_, h, "abc", 3, 0).ok());
  // Staged: the temp file already counts against its owner.
  auto temps = Temps();
  ASSERT_EQ(temps.size(), 1u);
  EXPECT_EQ(temps[0].st_uid, kUser);
  EXPECT_EQ(temps[0].st_mode & 07777, 0640u);
  fs_->Release(h);
  auto dir = fs_->Mkdir(kRootIno, "d", 0750, user);
  ASSERT_TRUE(dir.ok());
  EXPECT_EQ(dir->attr.st_uid, kUser);
  ASSERT_TRUE(fs_->Symlink("f", kRootIno, "l", user).ok());
  auto fifo = fs_->Mknod(dir->ino, "fifo", S_IFIFO | 0604, 0, user);
  ASSERT_TRUE(fifo.ok()) << fifo.status().ToString();
  EXPECT_TRUE(S_ISFIFO(fifo->attr.st_mode));
  auto reg = fs_->Mknod(dir->ino, "empty", S_IFREG | 0600, 0, user);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  Drain();
  for (const char* name : {"f", "d", "l", "d/fifo", "d/empty"}) {
    EXPECT_EQ(Backing(name).st_uid, kUser) << name;
    EXPECT_EQ(Backing(name).st_gid, kGroup) << name;
  }
  EXPECT_EQ(Backing("d").st_mode & 07777, 0750u);
  EXPECT_TRUE(S_ISFIFO(Backing("d/fifo").st_mode));
  EXPECT_EQ(Backing("d/fifo").st_mode & 07777, 0604u);
  EXPECT_TRUE(S_ISREG(Backing("d/empty").st_mode));
  EXPECT_TRUE(Temps().empty());
}

TEST_P(FilesystemPosixTest, ChownOfStagedAndPublishedFilesReachesTheBackingStore) {
  const int kUid = 1 << 1, kGid = 1 << 2, kMode = 1 << 0;
  Entry staged = WriteFile(kRootIno, "staged", "s", As(0, 0));
  Entry published = WriteFile(kRootIno, "published", "p", As(0, 0), 04755);
  struct stat in {};
  in.st_uid = kUser;
  in.st_gid = kGroup;
  auto r = fs_->SetAttr(staged.ino, in, kUid | kGid, nullptr, As(0, 0));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->st_uid, kUser);
  // A stranger may not take it back, nor change its group; the owner may not give it away.
  in.st_uid = kStranger;
  EXPECT_EQ(fs_->SetAttr(staged.ino, in, kUid, nullptr, As(kStranger, kStranger)).status().code(),
            Code::kNotPermitted);
  EXPECT_EQ(fs_->SetAttr(staged.ino, in, kUid, nullptr, As(kUser, kGroup)).status().code(),
            Code::kNotPermitted);
  in.st_mode = 0777;
  EXPECT_EQ(fs_->SetAttr(staged.ino, in, kMode, nullptr, As(kStranger, kStranger))
                .status()
                .code(),
            Code::kNotPermitted);
  // Root gives the setuid file away: the bit goes, as on Linux.
  in.st_uid = kUser;
  auto p = fs_->SetAttr(published.ino, in, kUid, nullptr, As(0, 0));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->st_mode & 07777, 0755u);
  Drain();
  EXPECT_EQ(Backing("staged").st_uid, kUser);
  EXPECT_EQ(Backing("staged").st_gid, kGroup);
  EXPECT_EQ(Backing("published").st_uid, kUser);
  EXPECT_EQ(Backing("published").st_mode & 07777, 0755u);
}

TEST_P(FilesystemPosixTest, AStickyDirectoryKeepsStrangersFromRemovingOrReplacingNames) {
  const int kMode = 1 << 0;
  auto t = fs_->Mkdir(kRootIno, "t", 0777, As(0, 0));
  ASSERT_TRUE(t.ok());
  struct stat in {};
  in.st_mode = 01777;
  ASSERT_TRUE(fs_->SetAttr(t->ino, in, kMode, nullptr, As(0, 0)).ok());
  WriteFile(t->ino, "mine", "m", As(kUser, kGroup));
  WriteFile(t->ino, "theirs", "t", As(kStranger, kStranger));
  const Caller stranger = As(kStranger, kStranger);
  EXPECT_EQ(fs_->Unlink(t->ino, "mine", stranger).code(), Code::kNotPermitted);
  EXPECT_EQ(fs_->Rename(t->ino, "mine", t->ino, "x", 0, stranger).code(), Code::kNotPermitted);
  EXPECT_EQ(fs_->Rename(t->ino, "theirs", t->ino, "mine", 0, stranger).code(),
            Code::kNotPermitted);
  EXPECT_TRUE(fs_->Rename(t->ino, "theirs", t->ino, "moved", 0, stranger).ok());
  EXPECT_TRUE(fs_->Unlink(t->ino, "mine", As(kUser, kGroup)).ok());
  EXPECT_TRUE(fs_->Unlink(t->ino, "moved", As(0, 0)).ok());
  Drain();
  EXPECT_EQ(::access((backing_ + "/t/mine").c_str(), F_OK), -1);
  EXPECT_EQ(::access((backing_ + "/t/moved").c_str(), F_OK), -1);
}

TEST_P(FilesystemPosixTest, ALinkToAStagedFileShowsItsBytesAndIsARealHardLinkWhenPublished) {
  Entry f = WriteFile(kRootIno, "f", "hello", As(kUser, kGroup));
  auto dir = fs_->Mkdir(kRootIno, "d", 0755, As(kUser, kGroup));
  ASSERT_TRUE(dir.ok());
  auto link = fs_->Link(f.ino, dir->ino, "g", As(kUser, kGroup));
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  EXPECT_EQ(link->attr.st_nlink, 2u);
  EXPECT_EQ(link->attr.st_size, 5);
  EXPECT_EQ(link->attr.st_uid, kUser);
  EXPECT_EQ(fs_->GetAttr(f.ino)->st_nlink, 2u);
  EXPECT_EQ(ReadAll(link->ino), "hello");
  // One inode: a chmod through one name shows through the other at once.
  struct stat in {};
  in.st_mode = 0600;
  ASSERT_TRUE(fs_->SetAttr(link->ino, in, 1 << 0, nullptr, As(kUser, kGroup)).ok());
  EXPECT_EQ(fs_->GetAttr(f.ino)->st_mode & 07777, 0600u);
  // Rewriting would publish a copy over one name and split the inode: refused.
  EXPECT_EQ(fs_->Open(f.ino, O_WRONLY).status().code(), Code::kTooManyLinks);
  EXPECT_EQ(fs_->Create(kRootIno, "f", 0644, O_CREAT | O_WRONLY | O_TRUNC, As(kUser, kGroup))
                .status()
                .code(),
            Code::kTooManyLinks);
  Drain();
  EXPECT_EQ(Backing("f").st_ino, Backing("d/g").st_ino);
  EXPECT_EQ(Backing("f").st_nlink, 2u);
  EXPECT_EQ(Backing("d/g").st_mode & 07777, 0600u);
}

TEST_P(FilesystemPosixTest, LinkRefusesDirectoriesAndFilesOpenForWritingWithClearErrors) {
  auto dir = fs_->Mkdir(kRootIno, "d", 0755, As(0, 0));
  ASSERT_TRUE(dir.ok());
  EXPECT_EQ(fs_->Link(dir->ino, kRootIno, "d2").status().code(), Code::kNotPermitted);
  auto created = fs_->Create(kRootIno, "open", 0644, O_CREAT | O_WRONLY);
  ASSERT_TRUE(created.ok());
  EXPECT_EQ(fs_->Link(created->first.ino, kRootIno, "open2").status().code(), Code::kBusy);
  EXPECT_EQ(fs_->Link(created->first.ino, kRootIno, "d").status().code(), Code::kExists);
  fs_->Release(created->second);
  EXPECT_TRUE(fs_->Link(created->first.ino, kRootIno, "open2").ok());
  // Once one name is gone the file may be written again.
  ASSERT_TRUE(fs_->Unlink(kRootIno, "open2").ok());
  auto h = fs_->Open(created->first.ino, O_WRONLY);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  fs_->Release(*h);
  Drain();
}

TEST_P(FilesystemPosixTest, FallocateExtendsWithZerosReservesBlocksAndRefusesOtherModes) {
  auto created = fs_->Create(kRootIno, "f", 0644, O_CREAT | O_RDWR);
  ASSERT_TRUE(created.ok());
  Handle* h = created->second;
  ASSERT_TRUE(WriteAt(*fs_, h, "xy", 2, 0).ok());
  ASSERT_TRUE(fs_->Fallocate(h, 0, 0, 3 << 20).ok());
  EXPECT_EQ(fs_->GetAttr(created->first.ino)->st_size, 3 << 20);
  ASSERT_TRUE(fs_->Fallocate(h, 0, 0, 10).ok());  // inside: the size stays
  EXPECT_EQ(fs_->GetAttr(created->first.ino)->st_size, 3 << 20);
  EXPECT_EQ(fs_->Fallocate(h, 1 /*KEEP_SIZE*/, 0, 10).code(), Code::kUnsupported);
  EXPECT_EQ(fs_->Fallocate(h, 3 /*PUNCH_HOLE|KEEP_SIZE*/, 0, 10).code(), Code::kUnsupported);
  fs_->Release(h);
  std::string bytes = ReadAll(created->first.ino);
  ASSERT_EQ(bytes.size(), size_t{1} << 16);  // ReadAll reads the first 64 KiB
  EXPECT_EQ(bytes.substr(0, 2), "xy");
  EXPECT_EQ(bytes.find_first_not_of('\0', 2), std::string::npos);
  Drain();
  EXPECT_EQ(Backing("f").st_size, 3 << 20);
}

INSTANTIATE_TEST_SUITE_P(Durability, FilesystemPosixTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Strict" : "Async"; });

}  // namespace
}  // namespace ckptfs::fs
