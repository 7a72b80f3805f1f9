// ReplacedFiles on a real backing directory (FaultyBackingDir) and a real state db: what a
// rewrite replaced goes back on PutBack, goes away on Release, and its temp records follow.
#include "store/publish/replaced_files.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "store/primitives/state_db.h"
#include "store/publish/temp_records.h"
#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {

namespace fs = std::filesystem;  // NOLINT: the tests' shorthand

class ReplacedFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = tmp_.Sub("backing");
    dir_ = FaultyBackingDir::Open(root_);
    ASSERT_NE(dir_, nullptr);
    auto db = StateDb::Open(tmp_.Sub("state", false));
    ASSERT_TRUE(db.ok()) << db.status().ToString();
    db_ = std::move(db).value();
    temps_ = std::make_unique<TempRecords>(db_.get(), "", 0);
    replaced_ = std::make_unique<ReplacedFiles>(dir_.get(), db_.get(), temps_.get());
  }

  // As a rewrite's publish leaves it: `path` holds the rewrite's version ("new:<path>"), the
  // temp name of file `id` the replaced one ("old:<path>"), recorded, and kept.
  void Rewrite(const std::string& path, uint64_t id) {
    const std::string temp = ".ckptfs-tmp." + std::to_string(id);
    fs::create_directories(fs::path(root_ + "/" + path).parent_path());
    Write(path, "new:" + path);
    Write(temp, "old:" + path);
    ASSERT_TRUE(temps_->Register(id, temp).ok());
    replaced_->Keep(path, temp, id);
  }

  // A publish of "new:PATH" over the existing PATH as the journal makes it: the record
  // first, then RENAME_EXCHANGE, the old file kept under the temp name `.ckptfs-tmp.ID`.
  void PublishOver(const std::string& path, uint64_t id) {
    constexpr unsigned kExchange = 2;  // RENAME_EXCHANGE
    const std::string temp = ".ckptfs-tmp." + std::to_string(id);
    Write(temp, "new:" + path);
    ASSERT_TRUE(temps_->Register(id, temp).ok());
    ASSERT_TRUE(replaced_->RecordBeforeKeep(path, temp));
    ASSERT_TRUE(dir_->Rename(temp, path, kExchange).ok());
    replaced_->Keep(path, temp, id);
  }

  void Write(const std::string& rel, const std::string& bytes) {
    std::ofstream out(root_ + "/" + rel, std::ios::binary | std::ios::trunc);
    out << bytes;
  }
  std::string Read(const std::string& rel) {
    std::ifstream in(root_ + "/" + rel, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  bool Exists(const std::string& rel) { return fs::exists(root_ + "/" + rel); }
  size_t TempRecordCount() {
    size_t n = 0;
    EXPECT_TRUE(
        db_->Scan(TempRecords::kPrefix, [&](std::string_view, std::string_view) { ++n; }).ok());
    return n;
  }

  ScopedTempDir tmp_;
  std::string root_;
  std::unique_ptr<FaultyBackingDir> dir_;
  std::unique_ptr<StateDb> db_;
  std::unique_ptr<TempRecords> temps_;
  std::unique_ptr<ReplacedFiles> replaced_;
};

TEST_F(ReplacedFilesTest, KeepsTheFirstReplacedVersionOfEachNameByDirectory) {
  EXPECT_FALSE(replaced_->HasKept("ck"));
  Rewrite("ck/a.distcp", 1);
  EXPECT_TRUE(replaced_->IsKept("ck/a.distcp"));
  EXPECT_FALSE(replaced_->IsKept("ck/b.distcp"));
  EXPECT_FALSE(replaced_->IsKept("ck2/a.distcp"));
  EXPECT_TRUE(replaced_->HasKept("ck"));
  EXPECT_FALSE(replaced_->HasKept("ck2"));
  EXPECT_FALSE(replaced_->HasKept(""));
}

TEST_F(ReplacedFilesTest, PutBackRestoresWhatTheRewriteReplacedAndForgetsTheTemps) {
  Rewrite("ck/a.distcp", 1);
  Rewrite("ck/b.distcp", 2);
  Rewrite("other/a.distcp", 3);
  std::vector<std::string> synced;
  dir_->SetSyncParentHook([&synced](const std::string& path) {
    synced.push_back(path);
    return 0;
  });

  ASSERT_TRUE(replaced_->PutBack("ck", /*retry=*/false).ok());
  EXPECT_EQ(Read("ck/a.distcp"), "old:ck/a.distcp");
  EXPECT_EQ(Read("ck/b.distcp"), "old:ck/b.distcp");
  EXPECT_FALSE(Exists(".ckptfs-tmp.1"));
  EXPECT_FALSE(Exists(".ckptfs-tmp.2"));
  EXPECT_EQ(synced, std::vector<std::string>{"ck/.metadata"}) << "the directory is synced";
  EXPECT_FALSE(replaced_->HasKept("ck"));
  EXPECT_FALSE(replaced_->IsKept("ck/a.distcp"));
  EXPECT_EQ(TempRecordCount(), 1u) << "only the other directory's record stays";
  // Another directory's rewrite is not touched.
  EXPECT_EQ(Read("other/a.distcp"), "new:other/a.distcp");
  EXPECT_EQ(Read(".ckptfs-tmp.3"), "old:other/a.distcp");
  EXPECT_TRUE(replaced_->IsKept("other/a.distcp"));
}

TEST_F(ReplacedFilesTest, APutBackThatFailsHalfwayIsFinishedByTheRetry) {
  Rewrite("ck/a.distcp", 1);
  Rewrite("ck/b.distcp", 2);
  // The second rename back fails (once), then the directory fsync (once).
  int b_renames = 0;
  dir_->SetRenameHook([&b_renames](const std::string& from, const std::string&) {
    return from == ".ckptfs-tmp.2" && b_renames++ == 0 ? EIO : 0;
  });
  int syncs = 0;
  dir_->SetSyncParentHook([&syncs](const std::string&) { return syncs++ == 0 ? EIO : 0; });

  EXPECT_FALSE(replaced_->PutBack("ck", /*retry=*/false).ok());
  EXPECT_EQ(Read("ck/a.distcp"), "old:ck/a.distcp") << "the first one is back";
  EXPECT_EQ(Read("ck/b.distcp"), "new:ck/b.distcp");
  EXPECT_FALSE(replaced_->IsKept("ck/a.distcp"));
  EXPECT_TRUE(replaced_->IsKept("ck/b.distcp")) << "still to be put back";
  EXPECT_EQ(TempRecordCount(), 1u);

  EXPECT_FALSE(replaced_->PutBack("ck", /*retry=*/true).ok()) << "the directory fsync fails";
  EXPECT_EQ(Read("ck/b.distcp"), "old:ck/b.distcp");
  EXPECT_FALSE(replaced_->HasKept("ck"));
  ASSERT_TRUE(replaced_->PutBack("ck", /*retry=*/true).ok());
  EXPECT_EQ(syncs, 2);
  EXPECT_EQ(Read("ck/a.distcp"), "old:ck/a.distcp");
  EXPECT_EQ(Read("ck/b.distcp"), "old:ck/b.distcp");
  EXPECT_EQ(TempRecordCount(), 0u);
}

TEST_F(ReplacedFilesTest, ReleaseRemovesWhatTheRewriteReplacedAndKeepsTheRewrite) {
  Rewrite("ck/a.distcp", 1);
  Rewrite("ck/sub/b.distcp", 2);
  replaced_->Release("ck", /*subtree=*/false);  // the rewrite of ck committed
  EXPECT_EQ(Read("ck/a.distcp"), "new:ck/a.distcp");
  EXPECT_FALSE(Exists(".ckptfs-tmp.1"));
  EXPECT_FALSE(replaced_->HasKept("ck"));
  EXPECT_TRUE(replaced_->IsKept("ck/sub/b.distcp")) << "a directory below is another checkpoint";
  EXPECT_TRUE(Exists(".ckptfs-tmp.2"));
  EXPECT_EQ(TempRecordCount(), 1u);

  // Nothing left to put back: the directory is only synced.
  ASSERT_TRUE(replaced_->PutBack("ck", /*retry=*/false).ok());
  EXPECT_EQ(Read("ck/a.distcp"), "new:ck/a.distcp");
}

TEST_F(ReplacedFilesTest, ReleaseOfASubtreeTakesEveryDirectoryAtOrBelowIt) {
  Rewrite("a/x.distcp", 1);
  Rewrite("a/y/z.distcp", 2);
  Rewrite("ab/w.distcp", 3);                  // a sibling whose name starts the same
  replaced_->Release("a", /*subtree=*/true);  // rm -r a
  EXPECT_FALSE(replaced_->HasKept("a"));
  EXPECT_FALSE(replaced_->HasKept("a/y"));
  EXPECT_FALSE(Exists(".ckptfs-tmp.1"));
  EXPECT_FALSE(Exists(".ckptfs-tmp.2"));
  EXPECT_TRUE(replaced_->IsKept("ab/w.distcp"));
  EXPECT_TRUE(Exists(".ckptfs-tmp.3"));
  EXPECT_EQ(TempRecordCount(), 1u);

  replaced_->ReleaseAll();  // the journal stops
  EXPECT_FALSE(replaced_->HasKept("ab"));
  EXPECT_FALSE(Exists(".ckptfs-tmp.3"));
  EXPECT_EQ(Read("ab/w.distcp"), "new:ab/w.distcp");
  EXPECT_EQ(TempRecordCount(), 0u);
}

TEST_F(ReplacedFilesTest, AGivenUpCommitPutsBackItsDirectoryAtTheCommitsPlace) {
  JournalEntry commit;
  commit.seq = 42;
  commit.op = OpType::kRename;
  commit.from = "ck/.metadata.tmp";
  commit.path = "ck/.metadata";
  EXPECT_FALSE(replaced_->PutBackForGivenUpCommit(commit, /*withdraw=*/false).has_value())
      << "nothing of ck is kept";

  Rewrite("ck/a.distcp", 1);
  Write("ck/.metadata", "save 1");
  std::optional<JournalEntry> r = replaced_->PutBackForGivenUpCommit(commit, false);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->seq, 42u);
  EXPECT_EQ(r->path, "ck/.metadata");
  EXPECT_TRUE(r->restore);
  EXPECT_FALSE(r->withdraw);
  EXPECT_EQ(Read("ck/a.distcp"), "old:ck/a.distcp");
  EXPECT_TRUE(Exists("ck/.metadata"));
  EXPECT_EQ(TempRecordCount(), 0u);

  // Other nodes write into the directory too: put back, then the `.metadata` withdrawn.
  Rewrite("ck/a.distcp", 2);
  r = replaced_->PutBackForGivenUpCommit(commit, /*withdraw=*/true);
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->withdraw);
  EXPECT_EQ(Read("ck/a.distcp"), "old:ck/a.distcp");
  EXPECT_FALSE(Exists("ck/.metadata"));

  // A put back that fails reports nothing done, and the file stays kept.
  Rewrite("ck/a.distcp", 3);
  dir_->SetRenameHook([](const std::string& from, const std::string&) {
    return from == ".ckptfs-tmp.3" ? EIO : 0;
  });
  EXPECT_FALSE(replaced_->PutBackForGivenUpCommit(commit, false).has_value());
  EXPECT_TRUE(replaced_->IsKept("ck/a.distcp"));
}

// A daemon killed during a rewrite: its unapplied entries are discarded at the next start,
// so the rewrite never commits. Recovery puts back each version a publish kept whose
// `.metadata` is still the one it was kept under, before the temp files are removed; a
// record whose publish never ran (its temp holds the new version) or whose rewrite
// committed (a new `.metadata`) is only dropped (the short soak of 415da15, `resave`).
TEST_F(ReplacedFilesTest, AfterACrashRecoveryPutsBackWhatAnUncommittedRewriteReplaced) {
  for (const std::string ck : {"ck", "done"}) {
    fs::create_directories(root_ + "/" + ck);
    Write(ck + "/.metadata", "md:old");
    Write(ck + "/a.distcp", "old:a");
    Write(ck + "/b.distcp", "old:b");
  }
  constexpr unsigned kExchange = 2;  // RENAME_EXCHANGE, as a publish over a file
  auto publish = [&](const std::string& path, uint64_t id, bool run) {
    const std::string temp = ".ckptfs-tmp." + std::to_string(id);
    Write(temp, "new:" + path);
    ASSERT_TRUE(temps_->Register(id, temp).ok());
    ASSERT_TRUE(replaced_->RecordBeforeKeep(path, temp));
    if (!run) return;  // killed between the record and the publish
    ASSERT_TRUE(dir_->Rename(temp, path, kExchange).ok());
    replaced_->Keep(path, temp, id);
  };
  publish("ck/a.distcp", 1, true);
  publish("ck/b.distcp", 2, false);
  publish("done/a.distcp", 3, true);
  // The rewrite of `done` committed: its `.metadata` is a new file.
  Write("done/.metadata.tmp", "md:new");
  ASSERT_TRUE(dir_->Rename("done/.metadata.tmp", "done/.metadata").ok());
  // A file of a directory without a `.metadata` is never recorded.
  fs::create_directories(root_ + "/fresh");
  Write("fresh/a.distcp", "old:fresh");
  EXPECT_FALSE(replaced_->RecordBeforeKeep("fresh/a.distcp", ".ckptfs-tmp.4"));

  replaced_.reset();  // the kill: nothing released
  std::vector<std::string> deletes, restored;
  ASSERT_TRUE(ReplacedFiles::RecoverKept(dir_.get(), db_.get(), &deletes, &restored).ok());
  EXPECT_EQ(restored, std::vector<std::string>{"ck"});
  EXPECT_EQ(Read("ck/a.distcp"), "old:a");
  EXPECT_EQ(Read("ck/b.distcp"), "old:b");
  EXPECT_FALSE(Exists(".ckptfs-tmp.1")) << "put back";
  EXPECT_EQ(Read(".ckptfs-tmp.2"), "new:ck/b.distcp") << "left to the temp files' removal";
  EXPECT_EQ(Read("done/a.distcp"), "new:done/a.distcp") << "its rewrite committed";
  EXPECT_EQ(deletes.size(), 3u);
  ASSERT_TRUE(db_->Write({}, deletes).ok());
  deletes.clear();
  restored.clear();
  ASSERT_TRUE(ReplacedFiles::RecoverKept(dir_.get(), db_.get(), &deletes, &restored).ok());
  EXPECT_TRUE(deletes.empty());
  EXPECT_TRUE(restored.empty());
}

// Put back or released, a kept version's record goes with it: a later crash finds none.
// Found by the soak (seed 5609, strict): an EIO of the store on a put-back's rename at
// start ended the daemon (exit 2, "start failed"). A transient error is tried again within
// the start; a permanent one still fails it, the records kept for the next start.
TEST_F(ReplacedFilesTest, RecoveryTriesATransientFailureAgainAndFailsOnAPermanentOne) {
  fs::create_directories(root_ + "/ck");
  Write("ck/.metadata", "md:old");
  Write("ck/a.distcp", "old:a");
  Write("ck/b.distcp", "old:b");
  PublishOver("ck/a.distcp", 1);
  PublishOver("ck/b.distcp", 2);
  replaced_.reset();  // the kill

  // A permanent error: the start fails, nothing is dropped.
  dir_->FailNthRename(dir_->rename_calls() + 1, EACCES);
  std::vector<std::string> deletes, restored;
  EXPECT_EQ(ReplacedFiles::RecoverKept(dir_.get(), db_.get(), &deletes, &restored).code(),
            Code::kPermission);
  EXPECT_EQ(Read("ck/a.distcp"), "new:ck/a.distcp");

  // A transient one (the second rename and the directory's fsync fail once each): tried
  // again, and the directory is the earlier save again.
  dir_->FailNthRename(dir_->rename_calls() + 2, EIO);
  dir_->FailNthSyncParent(dir_->sync_parent_calls() + 1, EIO);
  deletes.clear();
  restored.clear();
  ASSERT_TRUE(ReplacedFiles::RecoverKept(dir_.get(), db_.get(), &deletes, &restored).ok());
  EXPECT_EQ(restored, std::vector<std::string>{"ck"});
  EXPECT_EQ(Read("ck/a.distcp"), "old:a");
  EXPECT_EQ(Read("ck/b.distcp"), "old:b");
  EXPECT_EQ(deletes.size(), 2u);
}

// A start that put the files back and then failed for good on the directory's fsync
// keeps the records: the next start finds the files back under their names (the temps
// gone) and must still sync the directory and report it restored. Before, it skipped the
// records as "never replaced": no fsync, and the directory was not reported restored.
TEST_F(ReplacedFilesTest, AStartFailingAfterThePutBackLeavesTheNextToSyncAndReportIt) {
  fs::create_directories(root_ + "/ck");
  Write("ck/.metadata", "md:old");
  Write("ck/a.distcp", "old:a");
  const std::string temp = ".ckptfs-tmp.1";
  PublishOver("ck/a.distcp", 1);
  replaced_.reset();  // the kill

  // The put-back succeeds; the directory's fsync fails with a permanent error.
  dir_->FailNthSyncParent(dir_->sync_parent_calls() + 1, EACCES);
  std::vector<std::string> deletes, restored;
  EXPECT_EQ(ReplacedFiles::RecoverKept(dir_.get(), db_.get(), &deletes, &restored).code(),
            Code::kPermission);
  EXPECT_EQ(Read("ck/a.distcp"), "old:a");
  EXPECT_FALSE(fs::exists(root_ + "/" + temp));

  // The next start (the records were not removed).
  const uint64_t syncs = dir_->sync_parent_calls();
  deletes.clear();
  restored.clear();
  ASSERT_TRUE(ReplacedFiles::RecoverKept(dir_.get(), db_.get(), &deletes, &restored).ok());
  EXPECT_EQ(restored, std::vector<std::string>{"ck"});
  EXPECT_GT(dir_->sync_parent_calls(), syncs) << "the directory was never synced";
  EXPECT_EQ(deletes.size(), 1u);
  EXPECT_EQ(Read("ck/a.distcp"), "old:a");
}

TEST_F(ReplacedFilesTest, PutBackAndReleaseDropTheRecordsRecoveryWouldRead) {
  fs::create_directories(root_ + "/ck");
  Write("ck/.metadata", "md");
  Write("ck/a.distcp", "old:a");
  Write("ck/b.distcp", "old:b");
  ASSERT_TRUE(replaced_->RecordBeforeKeep("ck/a.distcp", ".ckptfs-tmp.1"));
  Rewrite("ck/a.distcp", 1);
  ASSERT_TRUE(replaced_->RecordBeforeKeep("ck/b.distcp", ".ckptfs-tmp.2"));
  Rewrite("ck/b.distcp", 2);
  ASSERT_TRUE(replaced_->PutBack("ck", /*retry=*/false).ok());
  ASSERT_TRUE(replaced_->RecordBeforeKeep("ck/a.distcp", ".ckptfs-tmp.3"));
  Rewrite("ck/a.distcp", 3);
  replaced_->Release("ck", /*subtree=*/false);
  size_t records = 0;
  ASSERT_TRUE(db_->Scan("r/", [&](std::string_view, std::string_view) { ++records; }).ok());
  EXPECT_EQ(records, 0u);
}

}  // namespace
}  // namespace ckptfs::store
