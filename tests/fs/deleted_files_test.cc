// The space of a file deleted through the mount is freed when its unlink is applied: the
// loader's descriptor cache (store/cache/backing_source.h), which keeps shard files open
// after a load's prefetch, closes its descriptors of that file then (Publication tells the
// loader: KeyIndexBuilds::FileGone), instead of holding a deleted checkpoint's blocks on
// the backing store until it evicts them (the soak, async on two nodes: 346 descriptors of
// deleted shards held at the end of a run).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/fs/fs_fixture.h"

namespace ckptfs::fs {
namespace {

namespace sfs = std::filesystem;

class DeletedFilesTest : public FaultyFsTest {
 protected:
  void SetUp() override {
    cache_bytes_ = 16u << 20;
    Start();
  }

  // This process's descriptors of files below the backing directory: all of them, or
  // those whose file has no name left.
  size_t BackingFds(bool deleted_only) const {
    size_t n = 0;
    for (const auto& e : sfs::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      const std::string target = sfs::read_symlink(e.path(), ec).string();
      if (ec || target.rfind(backing_.path() + "/", 0) != 0) continue;
      const bool deleted = target.size() > 10 && target.ends_with(" (deleted)");
      if (!deleted_only || deleted) ++n;
    }
    return n;
  }
};

TEST_F(DeletedFilesTest, AShardTheLoaderKeptOpenIsClosedWhenItsUnlinkIsApplied) {
  const sfs::path fixture =
      sfs::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp/torch113_4rank_single_file";
  sfs::create_directory(BackingPath("ck"));
  for (const auto& f : sfs::directory_iterator(fixture)) {
    sfs::copy_file(f.path(), BackingPath("ck/" + f.path().filename().string()));
  }
  auto ck = fs_->Lookup(kRootIno, "ck");
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  auto md = fs_->Lookup(ck->ino, ".metadata");
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  // A load starts: the loader fetches the checkpoint's shards ahead, opening them itself.
  Handle* h = OpenOk(md->ino, O_RDONLY);
  ASSERT_NE(h, nullptr);
  EXPECT_FALSE(ReadAll(h).empty());
  fs_->Release(h);
  ASSERT_TRUE(Eventually([&] { return BackingFds(false) > 0; }))
      << "the load's prefetch opened no shard";
  // The rotation removes the checkpoint through the mount.
  for (const auto& f : sfs::directory_iterator(fixture)) {
    ASSERT_TRUE(fs_->Unlink(ck->ino, f.path().filename().string()).ok());
  }
  ASSERT_TRUE(fs_->Rmdir(kRootIno, "ck").ok());
  ASSERT_TRUE(Eventually([&] { return !sfs::exists(BackingPath("ck")); }));
  EXPECT_TRUE(Eventually([&] { return BackingFds(true) == 0; }))
      << BackingFds(true) << " descriptors still hold deleted files";
}

// The write path's block CRCs of a published file are kept until an index build uses them
// (KeyIndex::AddBlockCrcs, a 128 MiB bound). A file outside any checkpoint is never indexed
// and no checkpoint's removal takes its map: a log the application writes and deletes left
// its map behind until the bound evicted it (heaptrack on the strict save loop with the
// soak's log traffic, stop 61; a small part of that loop's heap growth). Its unlink now
// takes it.
TEST_F(DeletedFilesTest, AFileDeletedOutsideACheckpointLetsGoOfItsBlockChecksums) {
  auto maps = [&] {
    return nlohmann::json::parse(fs_->control()->StatsJson())
        .value("checksum_block_maps_bytes", uint64_t{0});
  };
  ASSERT_EQ(maps(), 0u);
  const std::string data(3u << 20, 'x');
  WriteFile(kRootIno, "events.log", data);
  ASSERT_TRUE(Eventually([&] { return maps() > 0; })) << "the publish kept no block CRCs";
  ASSERT_TRUE(fs_->Unlink(kRootIno, "events.log").ok());
  ASSERT_TRUE(Eventually([&] { return !sfs::exists(BackingPath("events.log")); }));
  EXPECT_TRUE(Eventually([&] { return maps() == 0; }))
      << maps() << " bytes of block CRCs kept for a deleted file";
}

}  // namespace
}  // namespace ckptfs::fs
