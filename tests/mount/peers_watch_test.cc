// PeersFileWatcher (issue 39): a changed --peers-file is read again and handed over; one
// that cannot be read or parsed is rejected with its reason; an unchanged one is not read.
#include "mount/peers_watch.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ckptfs {
namespace {

using namespace std::chrono_literals;

class PeersWatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("ckptfs-peers-watch-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    path_ = (dir_ / "peers").string();
    Write("10.0.0.1:7000\n10.0.0.2:7000\n");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // As the recipes write it: a complete file renamed into place.
  void Write(const std::string& text) {
    const std::string tmp = path_ + ".tmp";
    std::ofstream(tmp) << text;
    std::filesystem::rename(tmp, path_);
  }
  std::unique_ptr<PeersFileWatcher> Make(std::chrono::milliseconds interval = 10s) {
    return std::make_unique<PeersFileWatcher>(
        path_,
        [this](const std::vector<std::string>& nodes) {
          std::lock_guard lock(mu_);
          applied_.push_back(nodes);
          return Status::Ok();
        },
        [this](const std::string& why) {
          std::lock_guard lock(mu_);
          rejected_.push_back(why);
        },
        interval);
  }

  std::filesystem::path dir_;
  std::string path_;
  std::mutex mu_;  // the watcher's thread and the test
  std::vector<std::vector<std::string>> applied_;
  std::vector<std::string> rejected_;
};

TEST_F(PeersWatchTest, AChangedFileIsReadAgainAndAnUnchangedOneIsNot) {
  auto w = Make();
  w->Start();
  w->Stop();  // the test drives the checks itself
  EXPECT_FALSE(w->CheckOnce(false)) << "the file the daemon started with is not new";
  Write("10.0.0.1:7000\n# node 1 replaced by a spare\n10.0.0.12:7100\n");
  EXPECT_TRUE(w->CheckOnce(false));
  ASSERT_EQ(applied_.size(), 1u);
  EXPECT_EQ(applied_[0], (std::vector<std::string>{"10.0.0.1:7000", "10.0.0.12:7100"}));
  EXPECT_FALSE(w->CheckOnce(false));
  EXPECT_TRUE(w->CheckOnce(true)) << "SIGHUP reads it whatever its identity";
  EXPECT_EQ(applied_.size(), 2u);
  EXPECT_TRUE(rejected_.empty());
}

TEST_F(PeersWatchTest, BadFilesAreRejectedWithTheirReason) {
  auto w = Make();
  w->Start();
  w->Stop();
  Write("10.0.0.1:7000\nnot an address\n");
  EXPECT_TRUE(w->CheckOnce(false));
  Write("10.0.0.1:7000\n10.0.0.1:7000\n");
  EXPECT_TRUE(w->CheckOnce(false));
  Write("# nobody\n");
  EXPECT_TRUE(w->CheckOnce(false));
  std::filesystem::remove(path_);
  EXPECT_TRUE(w->CheckOnce(false));
  EXPECT_TRUE(applied_.empty());
  ASSERT_EQ(rejected_.size(), 4u);
  EXPECT_NE(rejected_[1].find("listed twice"), std::string::npos) << rejected_[1];
  EXPECT_NE(rejected_[2].find("no peer"), std::string::npos) << rejected_[2];
  EXPECT_NE(rejected_[3].find("cannot read"), std::string::npos) << rejected_[3];
}

TEST_F(PeersWatchTest, TheThreadNoticesAChangeAndAPoke) {
  auto w = Make(20ms);
  w->Start();
  Write("10.0.0.1:7000\n10.0.0.22:7000\n");
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  auto got = [this] {
    std::lock_guard lock(mu_);
    return !applied_.empty();
  };
  while (!got() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  w->Stop();
  ASSERT_EQ(applied_.size(), 1u);
  EXPECT_EQ(applied_[0][1], "10.0.0.22:7000");
}

}  // namespace
}  // namespace ckptfs
