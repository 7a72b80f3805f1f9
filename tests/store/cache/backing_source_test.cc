// BackingSource: reads by relative path with a version check, adopted descriptors, the
// bounded descriptor cache, confinement.
#include "store/cache/backing_source.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {

class BackingSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = BackingDir::Open(tmp_.path());
    ASSERT_TRUE(dir.ok()) << dir.status().ToString();
    dir_ = std::move(dir).value();
  }
  void Write(const std::string& name, const std::string& contents, int64_t mtime_sec) {
    {
      std::ofstream out(tmp_.path() + "/" + name, std::ios::binary | std::ios::trunc);
      out << contents;
    }
    struct timespec times[2] = {{mtime_sec, 0}, {mtime_sec, 0}};
    ASSERT_EQ(::utimensat(AT_FDCWD, (tmp_.path() + "/" + name).c_str(), times, 0), 0);
  }
  BlockId IdOf(const std::string& name) {
    struct stat st;
    EXPECT_EQ(::stat((tmp_.path() + "/" + name).c_str(), &st), 0);
    return BlockIdFromStat(name, st);
  }
  // Opens `name` read-only, as an application's file whose descriptor is lent, and stats it.
  std::shared_ptr<const UniqueFd> OpenLent(const std::string& name, struct stat* st) {
    int raw = ::open((tmp_.path() + "/" + name).c_str(), O_RDONLY | O_CLOEXEC);
    EXPECT_GE(raw, 0) << name;
    EXPECT_EQ(::fstat(raw, st), 0) << name;
    return std::make_shared<const UniqueFd>(raw);
  }
  std::unique_ptr<BackingSource> NewSource(size_t max_open_files = 256) {
    BackingSourceOptions opts;
    opts.max_open_files = max_open_files;
    auto source = BackingSource::Create(dir_.get(), opts);
    EXPECT_TRUE(source.ok()) << source.status().ToString();
    return std::move(source).value();
  }
  static std::string ReadAll(BackingSource* source, const BlockId& id, uint64_t offset,
                             size_t len, Code* code = nullptr) {
    std::string buf(len, '\0');
    auto got = source->ReadBlock(id, offset, std::span<char>(buf));
    if (code != nullptr) *code = got.ok() ? Code::kOk : got.status().code();
    if (!got.ok()) return "<" + got.status().ToString() + ">";
    buf.resize(got->bytes);
    return buf;
  }

  ScopedTempDir tmp_{"ckptfs-backing-source"};
  std::unique_ptr<BackingDir> dir_;
};

TEST_F(BackingSourceTest, ReadsByRelativePathClampedToTheVersionsSize) {
  ASSERT_EQ(::mkdir((tmp_.path() + "/ck").c_str(), 0755), 0);
  Write("ck/shard", "0123456789", 1000);
  auto source = NewSource();
  const BlockId id = IdOf("ck/shard");
  EXPECT_EQ(id.path, "ck/shard");
  EXPECT_EQ(id.size, 10u);
  EXPECT_EQ(id.mtime_ns, int64_t{1000} * 1000000000);
  EXPECT_EQ(ReadAll(source.get(), id, 0, 4), "0123");
  EXPECT_EQ(ReadAll(source.get(), id, 6, 100), "6789");
  EXPECT_EQ(ReadAll(source.get(), id, 10, 100), "");
  Code code;
  ReadAll(source.get(), id, 11, 1, &code);
  EXPECT_EQ(code, Code::kInvalid);
  auto s = source->Stats();
  EXPECT_EQ(s.opens, 1u);  // one descriptor for every read of that version
  EXPECT_EQ(s.bytes_read, 8u);
}

TEST_F(BackingSourceTest, AnotherVersionIsAbortedAndAnAbsentFileNotFound) {
  Write("f", "old bytes", 1000);
  auto source = NewSource();
  const BlockId old_id = IdOf("f");
  EXPECT_EQ(ReadAll(source.get(), old_id, 0, 3), "old");
  // Rewritten in place (same inode, same size, new mtime): the open descriptor is checked
  // again, so the old name never yields new bytes.
  Write("f", "new bytes", 2000);
  Code code;
  ReadAll(source.get(), old_id, 0, 3, &code);
  EXPECT_EQ(code, Code::kAborted);
  EXPECT_EQ(ReadAll(source.get(), IdOf("f"), 0, 3), "new");
  // Asked for a version it never had.
  BlockId wrong = IdOf("f");
  wrong.size += 1;
  ReadAll(source.get(), wrong, 0, 3, &code);
  EXPECT_EQ(code, Code::kAborted);
  EXPECT_EQ(source->Stats().stale, 2u);
  ReadAll(source.get(), BlockId{"missing", 3, 0}, 0, 3, &code);
  EXPECT_EQ(code, Code::kNotFound);
}

TEST_F(BackingSourceTest, NamesThatLeaveTheBackingDirectoryAreRefused) {
  Write("f", "secret", 1000);
  auto source = NewSource();
  const BlockId inside = IdOf("f");
  const std::string leaf = std::filesystem::path(tmp_.path()).filename().string();
  for (std::string path : {"../" + leaf + "/f", tmp_.path() + "/f", std::string("./f/../f")}) {
    Code code;
    ReadAll(source.get(), BlockId{path, inside.size, inside.mtime_ns}, 0, 6, &code);
    EXPECT_NE(code, Code::kOk) << path;
  }
  EXPECT_EQ(source->Stats().bytes_read, 0u);
}

TEST_F(BackingSourceTest, AnAdoptedDescriptorReadsTheOpenedFileWhereverItsPathWent) {
  Write("f", "first file", 1000);
  auto source = NewSource();
  struct stat st;
  auto fd = OpenLent("f", &st);
  ASSERT_TRUE(fd->valid());
  const BlockId id = BlockIdFromStat("f", st);
  EXPECT_FALSE(source->Adopt(id, fd, st));
  EXPECT_FALSE(source->Adopt(id, fd, st));  // the same file again: nothing to drop

  // Replaced by rename with a file of the same size and mtime: the same BlockId.
  Write("f.tmp", "other file", 1000);
  ASSERT_EQ(::rename((tmp_.path() + "/f.tmp").c_str(), (tmp_.path() + "/f").c_str()), 0);
  ASSERT_EQ(IdOf("f"), id);
  // The adopted descriptor is the application's file, not what the path names now.
  EXPECT_EQ(ReadAll(source.get(), id, 0, 10), "first file");
  EXPECT_EQ(source->Stats().opens, 0u);

  // Adopting the new file under the same id reports the replacement (cached blocks of
  // `id` are the old file's), and reads now come from the new one.
  auto fd2 = OpenLent("f", &st);
  ASSERT_TRUE(fd2->valid());
  std::vector<std::string> dropped;
  EXPECT_TRUE(source->Adopt(id, fd2, st, [&](const std::string& p) { dropped.push_back(p); }));
  EXPECT_EQ(dropped, std::vector<std::string>{"f"});
  EXPECT_FALSE(source->Adopt(id, fd2, st, [&](const std::string& p) { dropped.push_back(p); }));
  EXPECT_EQ(dropped.size(), 1u);
  EXPECT_EQ(ReadAll(source.get(), id, 0, 10), "other file");
  EXPECT_EQ(fd.use_count(), 1);  // the old binding is gone
  source->Forget("f");
  EXPECT_EQ(fd2.use_count(), 1);
}

TEST_F(BackingSourceTest, ALentDescriptorClosesWithItsOwnerAndReadsThenOpenByPath) {
  Write("f", "lent file!", 1000);
  auto source = NewSource();
  struct stat st;
  auto fd = OpenLent("f", &st);
  ASSERT_TRUE(fd->valid());
  const BlockId id = BlockIdFromStat("f", st);
  source->Adopt(id, fd, st);
  EXPECT_EQ(ReadAll(source.get(), id, 0, 10), "lent file!");
  EXPECT_EQ(source->Stats().opens, 0u);
  EXPECT_EQ(source->Stats().open_fds, 0u) << "a borrowed descriptor is its owner's";
  EXPECT_EQ(fd.use_count(), 1) << "the source only borrows it";
  const int raw = fd->get();
  // The application closes the file: the descriptor is closed at once (a daemon under a
  // low RLIMIT_NOFILE must not run out for descriptors nobody uses), and a later read opens
  // the file by its path.
  fd.reset();
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1);
  EXPECT_EQ(ReadAll(source.get(), id, 0, 10), "lent file!");
  EXPECT_EQ(source->Stats().opens, 1u);
}

TEST_F(BackingSourceTest, KeepsABoundedNumberOfDescriptors) {
  Write("a", "aaaa", 1000);
  Write("b", "bbbb", 1000);
  Write("c", "cccc", 1000);
  auto source = NewSource(/*max_open_files=*/2);
  EXPECT_EQ(ReadAll(source.get(), IdOf("a"), 0, 4), "aaaa");
  EXPECT_EQ(ReadAll(source.get(), IdOf("b"), 0, 4), "bbbb");
  EXPECT_EQ(ReadAll(source.get(), IdOf("a"), 0, 4), "aaaa");  // a is newest now
  EXPECT_EQ(source->Stats().opens, 2u);
  EXPECT_EQ(ReadAll(source.get(), IdOf("c"), 0, 4), "cccc");  // evicts b
  EXPECT_EQ(ReadAll(source.get(), IdOf("a"), 0, 4), "aaaa");
  EXPECT_EQ(source->Stats().opens, 3u);
  EXPECT_EQ(ReadAll(source.get(), IdOf("b"), 0, 4), "bbbb");
  EXPECT_EQ(source->Stats().opens, 4u);
  EXPECT_EQ(source->Stats().open_fds, 2u) << "the bound, held open";
  source->Forget("a");
  EXPECT_EQ(source->Stats().open_fds, 1u);
}

// A file another node deleted: this node never sees the unlink, so the descriptor it opened
// to serve the file is closed once the cache binds another file, instead of holding the
// deleted file's space on the backing store until evicted; a read of it then finds nothing.
TEST_F(BackingSourceTest, ADescriptorOfAFileDeletedElsewhereIsClosedAtTheNextBind) {
  Write("a", "aaaa", 1000);
  Write("b", "bbbb", 1000);
  auto source = NewSource();
  const BlockId a = IdOf("a");
  EXPECT_EQ(ReadAll(source.get(), a, 0, 4), "aaaa");
  ASSERT_EQ(::unlink((tmp_.path() + "/a").c_str()), 0);  // by another node
  EXPECT_EQ(ReadAll(source.get(), IdOf("b"), 0, 4), "bbbb");
  size_t deleted = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
    if (!ec && target.rfind(tmp_.path(), 0) == 0 && target.ends_with(" (deleted)")) ++deleted;
  }
  EXPECT_EQ(deleted, 0u) << "a descriptor of the deleted file is still open";
  Code code = Code::kOk;
  ReadAll(source.get(), a, 0, 4, &code);
  EXPECT_EQ(code, Code::kNotFound);
}

}  // namespace
}  // namespace ckptfs::store
