// A Filesystem over a FaultyBackingDir, driven without FUSE: the calls a FUSE request
// makes (Lookup, Create, Open, Read, Write, Release...) on the real facade, with the
// backing dir injected (FsDeps) so a test can fail or hang chosen backing-store calls.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fs/filesystem.h"
#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::fs {

class FaultyFsTest : public ::testing::Test {
 protected:
  // Creates the Filesystem; `strict` picks the durability mode.
  void Start(bool strict = false) {
    FsConfig config;
    config.backing_dir = backing_.path();
    config.state_dir = state_.path();
    config.strict = strict;
    config.staging_bytes = 8u << 20;
    config.chunk_bytes = 1u << 20;
    config.cache_bytes = cache_bytes_;
    config.commit_timeout = commit_timeout_;
    config.staging_backend = "host";
    auto dir = store::FaultyBackingDir::Open(backing_.path());
    ASSERT_NE(dir, nullptr);
    dir_ = dir.get();
    FsDeps deps;
    deps.backing = std::move(dir);
    auto fs = Filesystem::Create(config, std::move(deps));
    ASSERT_TRUE(fs.ok()) << fs.status().ToString();
    fs_ = std::move(*fs);
  }
  void TearDown() override {
    if (fs_) {
      dir_->SetLookupHook(nullptr);
      dir_->SetPosixHook(nullptr);
      dir_->SetFsyncHook(nullptr);
      EXPECT_EQ(fs_->Shutdown().unpublished, 0u);
    }
  }

  // Creates `name` in `parent` with `data`, closes it, and waits until it is published.
  uint64_t WriteFile(uint64_t parent, const std::string& name, const std::string& data) {
    auto made = fs_->Create(parent, name, 0644, O_WRONLY | O_CREAT | O_TRUNC);
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    if (!made.ok()) return 0;
    auto [entry, h] = *made;
    EXPECT_TRUE(WriteAt(*fs_, h, data.data(), data.size(), 0).ok());
    fs_->Release(h);
    WaitPublished(entry.ino);
    return entry.ino;
  }

  void WaitPublished(uint64_t ino) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (true) {
      auto state = fs_->GetXattr(ino, kStateXattr);
      ASSERT_TRUE(state.ok()) << state.status().ToString();
      if (*state == "published") return;
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "still " << *state;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  std::string ReadAll(Handle* h) {
    std::string out;
    std::vector<char> buf(1 << 20);
    while (true) {
      auto got = fs_->Read(h, buf.data(), buf.size(), out.size());
      EXPECT_TRUE(got.ok()) << got.status().ToString();
      if (!got.ok() || *got == 0) return out;
      out.append(buf.data(), *got);
    }
  }

  // Polls `fn` for up to 10 s until it returns true; returns whether it did.
  template <typename Fn>
  bool Eventually(Fn fn) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!fn()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
  }

  Handle* OpenOk(uint64_t ino, int flags) {
    auto h = fs_->Open(ino, flags);
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    return h.ok() ? *h : nullptr;
  }

  // Backing-store helpers that bypass the mount.
  std::string BackingPath(const std::string& rel) const { return backing_.path() + "/" + rel; }
  std::string BackingBytes(const std::string& rel) const {
    std::ifstream in(BackingPath(rel), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  void PutBacking(const std::string& rel, const std::string& bytes) const {
    std::ofstream(BackingPath(rel), std::ios::binary) << bytes;
  }
  // Temp files left at the backing root.
  size_t TempFiles() const { return TempFileList().size(); }
  // Their names and sizes, for a failed expectation's message.
  std::string TempNames() const {
    std::string out;
    for (const auto& [name, size] : TempFileList()) {
      out += (out.empty() ? "temp files: " : ", ") + name + " (" + std::to_string(size) + " bytes)";
    }
    return out;
  }
  std::vector<std::pair<std::string, uintmax_t>> TempFileList() const {
    std::vector<std::pair<std::string, uintmax_t>> list;
    for (const auto& e : std::filesystem::directory_iterator(backing_.path())) {
      const std::string name = e.path().filename().string();
      if (name.rfind(kTempPrefix, 0) != 0) continue;
      std::error_code ec;
      list.emplace_back(name, std::filesystem::file_size(e.path(), ec));
    }
    return list;
  }

  uint64_t cache_bytes_ = 4u << 20;  // set before Start()
  std::chrono::milliseconds commit_timeout_{std::chrono::minutes(10)};  // set before Start()
  store::ScopedTempDir backing_{"ckptfs-faultyfs-backing"};
  store::ScopedTempDir state_{"ckptfs-faultyfs-state"};
  store::FaultyBackingDir* dir_ = nullptr;  // owned by fs_
  std::unique_ptr<Filesystem> fs_;
};

}  // namespace ckptfs::fs
