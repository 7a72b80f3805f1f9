// G10 (liveness) at the commit gate, through the real facade, journal and gate:
//   - a save into the same directory right after another (torch 2.x overwrites in place)
//     rewrites a shard while the previous save's `.metadata` still waits to be published:
//     that `.metadata` names the version before the rewrite, already durable, and commits
//     at once, in both modes; it never waits for the rewrite's close nor for a length the
//     rewrite no longer has;
//   - a strict close() or fsync() of a `.metadata` never waits for a shard that only its
//     caller can close.
// Both cases hung on HEAD 6f2c1b5 until --commit-timeout (here 20 s: the tests allow 5).
#include <fcntl.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "store/dcp/dcp_metadata.h"
#include "tests/fs/fs_fixture.h"

namespace ckptfs::fs {
namespace {

using namespace std::chrono_literals;
namespace sfs = std::filesystem;

constexpr auto kPrompt = 5s;  // what "at once" may take on a loaded CI machine

std::string FixtureMetadata() {
  const sfs::path p = sfs::path(CKPTFS_SOURCE_DIR) /
                      "tests/fixtures/dcp/torch113_4rank_single_file/.metadata";
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class CommitLivenessTest : public FaultyFsTest, public ::testing::WithParamInterface<bool> {
 protected:
  void SetUp() override {
    metadata_ = FixtureMetadata();
    auto md = store::ParseDcpMetadata(metadata_);
    ASSERT_TRUE(md.ok()) << md.status().ToString();
    for (const auto& [file, len] : store::RequiredFileLengths(*md)) need_[file] = len;
    ASSERT_EQ(need_.size(), 4u);
    commit_timeout_ = 20s;
    Start(/*strict=*/GetParam());
    auto dir = fs_->Mkdir(kRootIno, "ck", 0755);
    ASSERT_TRUE(dir.ok()) << dir.status().ToString();
    ck_ = dir->ino;
  }

  // open(O_CREAT|O_TRUNC) + one write; the handle stays open.
  Handle* Begin(const std::string& name, const std::string& bytes) {
    auto made = fs_->Create(ck_, name, 0644, O_WRONLY | O_CREAT | O_TRUNC);
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    if (!made.ok()) return nullptr;
    EXPECT_TRUE(WriteAt(*fs_, made->second, bytes.data(), bytes.size(), 0).ok());
    return made->second;
  }
  // close(2): FUSE flush, then release.
  Status Close(Handle* h) {
    Status st = fs_->Flush(h);
    fs_->Release(h);
    return st;
  }
  void WriteAndClose(const std::string& name, const std::string& bytes) {
    Handle* h = Begin(name, bytes);
    ASSERT_NE(h, nullptr);
    ASSERT_TRUE(Close(h).ok()) << name;
  }
  void SaveShards(char fill, size_t extra) {
    for (const auto& [file, len] : need_) WriteAndClose(file, std::string(len + extra, fill));
  }
  bool BackingHas(const std::string& rel, const std::string& bytes) const {
    return sfs::exists(BackingPath(rel)) && BackingBytes(rel) == bytes;
  }
  template <typename Pred>
  bool Within(std::chrono::milliseconds limit, Pred pred) const {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!pred()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(5ms);
    }
    return true;
  }
  std::string State(const std::string& rel_in_ck) {
    auto e = fs_->Lookup(ck_, rel_in_ck);
    if (!e.ok()) return e.status().ToString();
    auto st = fs_->GetXattr(e->ino, kStateXattr);
    return st.ok() ? *st : st.status().ToString();
  }

  std::string metadata_;
  std::map<std::string, uint64_t> need_;
  uint64_t ck_ = 0;
};

TEST_P(CommitLivenessTest, ASaveIntoTheSameDirectoryDoesNotHoldUpThePreviousCommit) {
  // Save 1: shards longer than the `.metadata` needs, then `.metadata.tmp`, then the
  // rename that commits. The gate's first look at that rename (it opens `.metadata.tmp`
  // to parse it) is held until save 2 has begun, so it judges the rename with save 2's
  // rewrites around, as a busy journal does.
  SaveShards('a', 1000);
  WriteAndClose(".metadata.tmp", metadata_);
  std::mutex mu;
  std::condition_variable cv;
  bool hold = true, entered = false;
  dir_->SetLookupHook([&](const std::string& op, const std::string& path) {
    if (op == "open" && path == "ck/.metadata.tmp") {
      std::unique_lock lock(mu);
      entered = true;
      cv.notify_all();
      cv.wait(lock, [&] { return !hold; });
    }
    return 0;
  });
  auto release = [&] {
    {
      std::lock_guard lock(mu);
      hold = false;
    }
    cv.notify_all();
  };
  // Strict: the rename waits for its publication: the "first rank" runs it on a thread.
  auto rename_done = std::async(std::launch::async, [&] {
    return fs_->Rename(ck_, ".metadata.tmp", ck_, ".metadata", 0);
  });
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, kPrompt, [&] { return entered; }));
  }
  // Save 2 begins: one shard rewritten shorter than save 1's `.metadata` names and closed,
  // another rewritten and kept open.
  auto it = need_.begin();
  const std::string shorter = it->first, open_one = std::next(it)->first;
  Handle* cut = Begin(shorter, "short");
  Handle* held_open = Begin(open_one, "b");
  ASSERT_NE(cut, nullptr);
  ASSERT_NE(held_open, nullptr);
  release();
  // Strict: this close returns once the shorter version is published, after save 1's
  // commit (the gate must not wait for it: that would be a wait on its own waiter).
  auto cut_closed = std::async(std::launch::async, [&] { return Close(cut); });
  ASSERT_EQ(cut_closed.wait_for(kPrompt), std::future_status::ready);
  ASSERT_TRUE(cut_closed.get().ok());

  // Save 1 commits with its own shards, while save 2's rewrite is still open.
  ASSERT_EQ(rename_done.wait_for(kPrompt), std::future_status::ready)
      << "the rename of save 1 waits for save 2's rewrite";
  ASSERT_TRUE(rename_done.get().ok());
  dir_->SetLookupHook(nullptr);
  EXPECT_TRUE(Within(kPrompt, [&] { return BackingHas("ck/.metadata", metadata_); }))
      << "save 1's .metadata waits for a version of a shard that save 2 replaced";
  EXPECT_EQ(BackingBytes("ck/" + open_one), std::string(need_[open_one] + 1000, 'a'))
      << "save 1's shard must be the one on the backing store when its .metadata lands";

  // Save 2 completes: shards of exactly the needed lengths, a new `.metadata`.
  ASSERT_TRUE(WriteAt(*fs_, held_open, std::string(need_[open_one], 'b').data(),
                         need_[open_one], 0).ok());
  ASSERT_TRUE(Close(held_open).ok());
  for (const auto& [file, len] : need_) {
    if (file != open_one) WriteAndClose(file, std::string(len, 'b'));
  }
  WriteAndClose(".metadata.tmp", metadata_);
  ASSERT_TRUE(fs_->Rename(ck_, ".metadata.tmp", ck_, ".metadata", 0).ok());
  EXPECT_TRUE(Within(kPrompt, [&] { return State(".metadata") == "published"; }))
      << State(".metadata");
  for (const auto& [file, len] : need_) {
    const std::string rel = "ck/" + file, want(len, 'b');  // clang 14: no captured bindings
    EXPECT_TRUE(Within(kPrompt, [&] { return BackingHas(rel, want); })) << file;
  }
  EXPECT_TRUE(BackingHas("ck/.metadata", metadata_));
  EXPECT_EQ(fs_->Shutdown().unpublished, 0u);
  fs_.reset();
}

TEST_P(CommitLivenessTest, AMetadataClosedWhileItsCallerHoldsAShardOpenDoesNotWaitForIt) {
  // One process writes every shard and keeps them open, then writes `.metadata` in place
  // (torch 1.13) and closes it. Only that process can close the shards.
  std::vector<Handle*> shards;
  for (const auto& [file, len] : need_) {
    shards.push_back(Begin(file, std::string(len, 'a')));
    ASSERT_NE(shards.back(), nullptr);
  }
  Handle* md = Begin(".metadata", metadata_);
  ASSERT_NE(md, nullptr);
  auto closed = std::async(std::launch::async, [&] { return Close(md); });
  if (closed.wait_for(kPrompt) != std::future_status::ready) {
    for (Handle* h : shards) (void)Close(h);  // so that the test ends
    FAIL() << "close(.metadata) waits for shards its own caller holds open";
  }
  EXPECT_TRUE(closed.get().ok());
  EXPECT_FALSE(sfs::exists(BackingPath("ck/.metadata")))
      << "committed before its shards were closed (G5)";
  // fsync of a shard the caller holds: strict publishes it, and returns.
  auto synced = std::async(std::launch::async, [&] { return fs_->Flush(shards.front()); });
  ASSERT_EQ(synced.wait_for(kPrompt), std::future_status::ready);
  EXPECT_TRUE(synced.get().ok());
  for (Handle* h : shards) ASSERT_TRUE(Close(h).ok());
  EXPECT_TRUE(Within(kPrompt, [&] { return BackingHas("ck/.metadata", metadata_); }));
  for (const auto& [file, len] : need_) {
    EXPECT_TRUE(BackingHas("ck/" + file, std::string(len, 'a'))) << file;
  }
  EXPECT_EQ(fs_->Shutdown().unpublished, 0u);
  fs_.reset();
}

INSTANTIATE_TEST_SUITE_P(Modes, CommitLivenessTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Strict" : "Async"; });

}  // namespace
}  // namespace ckptfs::fs
