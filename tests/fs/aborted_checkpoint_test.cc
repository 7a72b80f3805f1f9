// A checkpoint the operator aborted never commits, so a tracker that names it must not
// reach the backing store either (G4: the tracker never names a checkpoint that is not
// committed). Found by the soak's fault layer (issue 41): in async mode an fsync of a
// shard fails (EIO: the bytes may be lost, a permanent failure), publication halts at it,
// the trainer has meanwhile written `latest_checkpointed_iteration.txt` naming that
// iteration, the operator runs `ckptfs-admin abort iter_0000002`; before the fix the
// tracker queued behind the aborted save was then published, naming a checkpoint with no
// `.metadata`. The tracker is withheld as one naming a lost node's checkpoint is; the
// backing store keeps the tracker before it. A later successful save into the directory
// makes a tracker naming it publishable again. (The race: the tracker must be marked before
// the journal drops the aborted entries, or the publisher reaches it first.)
#include <fcntl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>

#include "fs/control/control_tree.h"
#include "store/dcp/dcp_metadata.h"
#include "tests/fs/fs_fixture.h"

namespace ckptfs::fs {
namespace {

using namespace std::chrono_literals;
namespace sfs = std::filesystem;

constexpr char kTracker[] = "latest_checkpointed_iteration.txt";

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

class AbortedCheckpointTest : public FaultyFsTest {
 protected:
  void SetUp() override {
    plan_ = LoadPlan("torch113_4rank_single_file");
    ASSERT_FALSE(plan_.shards.empty());
    Start(/*strict=*/false);
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

  // A DCP save into a new directory `name`, then the Megatron tracker naming `iter`, as a
  // trainer makes them (async: every call returns once staged).
  void SaveAndTrack(const std::string& name, int iter) {
    auto made = fs_->Lookup(kRootIno, name);
    if (!made.ok()) made = fs_->Mkdir(kRootIno, name, 0755);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    for (const auto& [file, len] : plan_.shards) {
      ASSERT_TRUE(WriteAndClose(made->ino, file, std::string(len, 's')).ok()) << file;
    }
    ASSERT_TRUE(WriteAndClose(made->ino, ".metadata.tmp", plan_.metadata).ok());
    ASSERT_TRUE(fs_->Rename(made->ino, ".metadata.tmp", made->ino, ".metadata", 0).ok());
    ASSERT_TRUE(WriteAndClose(kRootIno, kTracker, std::to_string(iter) + "\n").ok());
  }

  nlohmann::json Stats() { return nlohmann::json::parse(fs_->control()->StatsJson()); }

  // Polls until `done(stats)` or 30 s.
  template <typename F>
  nlohmann::json WaitStats(F done, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (true) {
      nlohmann::json s = Stats();
      if (done(s)) return s;
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "timed out waiting for " << what << ": " << s.dump();
        return s;
      }
      std::this_thread::sleep_for(5ms);
    }
  }

  bool BackingHas(const std::string& rel) const { return sfs::exists(BackingPath(rel)); }

  Plan plan_;
};

TEST_F(AbortedCheckpointTest, ATrackerNamingAnAbortedCheckpointIsWithheld) {
  SaveAndTrack("iter_0000001", 1);
  WaitStats([](const nlohmann::json& s) { return s["journal_pending"] == 0; }, "the first save");
  ASSERT_TRUE(BackingHas("iter_0000001/.metadata"));
  ASSERT_EQ(BackingBytes(kTracker), "1\n");

  // The second save's first fsync (of one of its files: the first save is all published)
  // fails: its bytes may be lost, publication halts there.
  dir_->FailNthFsync(dir_->fsync_calls() + 1, EIO);
  SaveAndTrack("iter_0000002", 2);
  nlohmann::json s = WaitStats([](const nlohmann::json& j) { return !j["journal_halted"].is_null(); },
                               "the halt");
  ASSERT_FALSE(s["journal_halted"].is_null());
  EXPECT_FALSE(s["journal_halted"]["retrying"].get<bool>()) << s["journal_halted"];
  EXPECT_NE(s["journal_halted"]["error"].get<std::string>().find("fsync"), std::string::npos)
      << "the reason names the failed fsync: " << s["journal_halted"];

  // The operator aborts the failed checkpoint; everything after it goes on.
  std::vector<std::string> dropped = fs_->control()->Abort("iter_0000002");
  EXPECT_FALSE(dropped.empty());
  WaitStats([](const nlohmann::json& j) { return j["journal_pending"] == 0; }, "the rest");
  EXPECT_FALSE(BackingHas("iter_0000002/.metadata"));
  EXPECT_EQ(BackingBytes(kTracker), "1\n")
      << "the tracker names iter_0000002, which was aborted and never commits";

  // The next save commits, and its tracker is published.
  SaveAndTrack("iter_0000003", 3);
  WaitStats([](const nlohmann::json& j) { return j["journal_pending"] == 0; }, "the third save");
  EXPECT_TRUE(BackingHas("iter_0000003/.metadata"));
  EXPECT_EQ(BackingBytes(kTracker), "3\n");

  // A save into the aborted directory again commits it: a tracker naming it is published.
  SaveAndTrack("iter_0000002", 2);
  WaitStats([](const nlohmann::json& j) { return j["journal_pending"] == 0; }, "the re-save");
  EXPECT_TRUE(BackingHas("iter_0000002/.metadata"));
  EXPECT_EQ(BackingBytes(kTracker), "2\n");
  EXPECT_EQ(TempFiles(), 0u);
  // The stop counts what never reached the backing store: at least the 5 aborted files
  // (and the withheld tracker, unless the next one replaced it first); the daemon then
  // exits 1, "not clean", and says so.
  EXPECT_GE(fs_->Shutdown().unpublished, 5u);
}

}  // namespace
}  // namespace ckptfs::fs
