// Issue 38: a directory removed and made again between saves (PyTorch's own
// test_load_with_different_shard_plan), through the real facade, journal and gate, with
// publication lagging the application (every fsync of the backing store slowed):
//   save N into ck: shards, `.metadata.tmp`, the rename that commits;
//   rm -r ck (the shards, `.metadata`), rmdir ck, mkdir ck;
//   save N+1 into the new ck with another shard plan (another number of shard files).
// A commit, a shard version and a supersede decision never reach across the rmdir/mkdir:
// every save's entries apply as the application made them, nothing is skipped, the stop
// is clean (exit 0), and the backing tree at the end is exactly the application's view
// (G8): the last save's files, no `.metadata.tmp`, no temp file. On HEAD 3759c3f the
// old `.metadata` was superseded by the new directory's save, its `.metadata.tmp` stayed,
// and the next rmdir was skipped (NotEmpty).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fs/control/control_tree.h"
#include "store/dcp/dcp_metadata.h"
#include "tests/fs/fs_fixture.h"

namespace ckptfs::fs {
namespace {

using namespace std::chrono_literals;
namespace sfs = std::filesystem;

// A real DCP save: its `.metadata` and the length each shard file must have.
struct Plan {
  std::string metadata;
  std::map<std::string, uint64_t> shards;
};

Plan LoadPlan(const std::string& fixture) {
  const sfs::path p = sfs::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp" / fixture / ".metadata";
  std::ifstream in(p, std::ios::binary);
  Plan plan;
  plan.metadata = std::string(std::istreambuf_iterator<char>(in), {});
  auto md = store::ParseDcpMetadata(plan.metadata);
  EXPECT_TRUE(md.ok()) << fixture << ": " << md.status().ToString();
  if (md.ok()) {
    for (const auto& [file, len] : store::RequiredFileLengths(*md)) plan.shards[file] = len;
  }
  return plan;
}

class RecreatedDirTest : public FaultyFsTest, public ::testing::WithParamInterface<bool> {
 protected:
  void SetUp() override {
    // 4 shard files, then 5 (one name in common), then 1: another plan every save.
    plans_ = {LoadPlan("torch113_4rank_single_file"), LoadPlan("torch113_basic_per_item"),
              LoadPlan("torch113_basic_single_file")};
    for (const Plan& p : plans_) ASSERT_FALSE(p.shards.empty());
    commit_timeout_ = 60s;
    Start(/*strict=*/GetParam());
  }

  Status WriteAndClose(uint64_t dir, const std::string& name, const std::string& bytes) {
    auto made = fs_->Create(dir, name, 0644, O_WRONLY | O_CREAT | O_TRUNC);
    if (!made.ok()) return made.status();
    auto written = WriteAt(*fs_, made->second, bytes.data(), bytes.size(), 0);
    Status st = fs_->Flush(made->second);
    fs_->Release(made->second);
    if (!written.ok()) return written;
    return st;
  }

  // One DCP save of `plan` into `dir`: shards, `.metadata.tmp`, rename (torch 2.x and the
  // issue's log: the rename commits).
  void Save(uint64_t dir, const Plan& plan, char fill) {
    for (const auto& [file, len] : plan.shards) {
      ASSERT_TRUE(WriteAndClose(dir, file, std::string(len, fill)).ok()) << file;
    }
    ASSERT_TRUE(WriteAndClose(dir, ".metadata.tmp", plan.metadata).ok());
    ASSERT_TRUE(fs_->Rename(dir, ".metadata.tmp", dir, ".metadata", 0).ok());
  }

  std::map<std::string, std::string> BackingTree() const {
    std::map<std::string, std::string> out;
    for (const auto& e : sfs::recursive_directory_iterator(backing_.path())) {
      const std::string rel = sfs::relative(e.path(), backing_.path()).string();
      out[rel] = e.is_directory() ? "<dir>" : BackingBytes(rel);
    }
    return out;
  }

  std::vector<Plan> plans_;
};

TEST_P(RecreatedDirTest, ASaveIntoADirectoryMadeAgainNeverReachesAcrossIt) {
  // Publication lags the application: every fsync of the backing store takes a while, so
  // a save's rename still waits for publication while the application has already removed
  // its directory and saved into the new one.
  dir_->SetFsyncHook([](int) {
    std::this_thread::sleep_for(15ms);
    return 0;
  });
  constexpr int kRounds = 6;
  auto made = fs_->Mkdir(kRootIno, "ck", 0755);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  uint64_t ck = made->ino;
  for (int round = 0; round < kRounds; ++round) {
    const Plan& plan = plans_[round % plans_.size()];
    if (round > 0) {
      // rank 0: shutil.rmtree(ck); os.makedirs(ck)
      const Plan& before = plans_[(round - 1) % plans_.size()];
      for (const auto& [file, len] : before.shards) {
        ASSERT_TRUE(fs_->Unlink(ck, file).ok()) << "round " << round << " " << file;
      }
      ASSERT_TRUE(fs_->Unlink(ck, ".metadata").ok()) << "round " << round;
      ASSERT_TRUE(fs_->Rmdir(kRootIno, "ck").ok()) << "round " << round;
      auto again = fs_->Mkdir(kRootIno, "ck", 0755);
      ASSERT_TRUE(again.ok()) << again.status().ToString();
      ck = again->ino;
    }
    Save(ck, plan, static_cast<char>('a' + round));
  }
  dir_->SetFsyncHook(nullptr);

  // Publication catches up (the commit timeout is far longer: nothing may wait for it).
  nlohmann::json stats;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (true) {
    stats = nlohmann::json::parse(fs_->control()->StatsJson());
    if (stats["journal_pending"] == 0) break;
    ASSERT_LT(std::chrono::steady_clock::now(), deadline)
        << "publication waits: " << stats["journal_waiting"];
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(stats["journal_skipped"], 0) << "entries skipped, superseded or dropped";
  EXPECT_EQ(stats["errors"], 0) << stats["last_error"];
  EXPECT_TRUE(stats["journal_halted"].is_null()) << stats["journal_halted"];
  EXPECT_EQ(fs_->Shutdown().unpublished, 0u) << "publishes dropped at the stop";

  // The backing store is the application's view: the last save, nothing else.
  const Plan& last = plans_[(kRounds - 1) % plans_.size()];
  std::map<std::string, std::string> want = {{"ck", "<dir>"}, {"ck/.metadata", last.metadata}};
  for (const auto& [file, len] : last.shards) {
    want["ck/" + file] = std::string(len, static_cast<char>('a' + kRounds - 1));
  }
  std::map<std::string, std::string> have = BackingTree();
  std::set<std::string> want_names, have_names;
  for (const auto& [k, v] : want) want_names.insert(k);
  for (const auto& [k, v] : have) have_names.insert(k);
  EXPECT_EQ(have_names, want_names);
  EXPECT_TRUE(have == want) << "bytes differ";
  fs_.reset();
}

INSTANTIATE_TEST_SUITE_P(Modes, RecreatedDirTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Strict" : "Async"; });

}  // namespace
}  // namespace ckptfs::fs
