// The journal tests' shared fixture and helpers (JournalTest, TempFile, TreeState):
// a real temporary backing dir through FaultyBackingDir and a real RocksDB StateDb.
// See journal_test.cc for how a crash is simulated.
#pragma once

#include "store/publish/journal.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "store/flush/flush_pipeline.h"
#include "store/primitives/state_db.h"
#include "store/publish/commit_gate.h"
#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {


namespace fs = std::filesystem;  // NOLINT: the tests' shorthand
using QueuedFn = std::function<bool(const std::string&)>;

// The queued-publish question of a commit check as a function, for tests that call
// CommitGate::Check directly.
struct QueuedIf final : QueuedPublishes {
  explicit QueuedIf(QueuedFn fn) : fn(std::move(fn)) {}
  bool PublishQueued(const std::string& path) const override { return fn && fn(path); }
  // No directory ends in these tests' queues; every queued publish is the commit's version.
  DirectoryEnd DirectoryEndsAfter(uint64_t, const std::string&) const override { return {}; }
  bool VersionQueued(const std::string& path, uint64_t, uint64_t) const override {
    return PublishQueued(path);
  }
  QueuedFn fn;
};

// A JournalDelegate whose answers the test sets as functions, and the journal's options.
// Empty ones: a commit is ready, nothing is gated, outcomes are not looked at.
struct TestHooks final : JournalDelegate {
  std::function<CommitCheck(const JournalEntry&, const QueuedFn&)> commit_gate;
  std::function<bool(const JournalEntry&)> gated;
  std::function<void(const JournalEntry&, const Status&)> on_done;
  std::function<void(const JournalEntry&, const Status&)> on_halt;
  JournalOptions options;

  CommitCheck CheckCommit(const JournalEntry& e, const QueuedPublishes& queued) override {
    if (!commit_gate) return Status::Ok();
    return commit_gate(e, [&queued](const std::string& path) {
      return queued.PublishQueued(path);
    });
  }
  bool Gated(const JournalEntry& e) override { return gated && gated(e); }
  void OnDone(const JournalEntry& e, const Status& st) override {
    if (on_done) on_done(e, st);
  }
  void OnHalt(const JournalEntry& e, const Status& st) override {
    if (on_halt) on_halt(e, st);
  }
};

inline constexpr char kTempPrefix[] = ".ckptfs-tmp.";

inline std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : dir + "/" + name;
}

inline bool IsTemp(const std::string& path) {
  return fs::path(path).filename().string().rfind(kTempPrefix, 0) == 0;
}

// A copy of every record of `src`, in a new database at `dir`: the state a crash at
// this instant would leave behind (every StateDb write is synced).
inline std::unique_ptr<StateDb> CopyDb(StateDb* src, const std::string& dir) {
  auto dst = StateDb::Open(dir);
  if (!dst.ok()) std::abort();
  std::vector<std::pair<std::string, std::string>> puts;
  Status st = src->Scan("", [&](std::string_view k, std::string_view v) {
    puts.emplace_back(std::string(k), std::string(v));
  });
  if (!st.ok() || !(*dst)->Write(puts, {}).ok()) std::abort();
  return std::move(dst).value();
}

// Removes every record of `db`.
inline void ClearDb(StateDb* db) {
  std::vector<std::string> keys;
  if (!db->Scan("", [&](std::string_view k, std::string_view) { keys.emplace_back(k); }).ok() ||
      !db->Write({}, keys).ok()) {
    std::abort();
  }
}

// Makes `dst` an exact copy of `src` (see CopyDb).
inline void CopyInto(StateDb* src, StateDb* dst) {
  ClearDb(dst);
  std::vector<std::pair<std::string, std::string>> puts;
  Status st = src->Scan("", [&](std::string_view k, std::string_view v) {
    puts.emplace_back(std::string(k), std::string(v));
  });
  if (!st.ok() || !dst->Write(puts, {}).ok()) std::abort();
}

inline std::vector<std::string> KeysWithPrefix(StateDb* db, const std::string& prefix) {
  std::vector<std::string> keys;
  EXPECT_TRUE(
      db->Scan(prefix, [&](std::string_view k, std::string_view) { keys.emplace_back(k); }).ok());
  return keys;
}

// What a backing tree holds: real directories, real files with their bytes (as they
// would be after a crash now, if `faulty` is given), and temp files by path.
struct TreeState {
  std::set<std::string> dirs;
  std::map<std::string, std::string> files;
  std::set<std::string> temps;
};

inline void Walk(const std::string& root, const std::string& rel, const FaultyBackingDir* faulty,
          TreeState* out) {
  std::string full = rel.empty() ? root : root + "/" + rel;
  DIR* d = ::opendir(full.c_str());
  if (d == nullptr) return;
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  for (const auto& n : names) {
    std::string r = Join(rel, n);
    struct stat st;
    if (::lstat((root + "/" + r).c_str(), &st) != 0) continue;  // a temp removed meanwhile
    if (S_ISDIR(st.st_mode)) {
      out->dirs.insert(r);
      Walk(root, r, faulty, out);
    } else if (IsTemp(r)) {
      out->temps.insert(r);
    } else if (S_ISREG(st.st_mode)) {
      off_t size = st.st_size;
      if (faulty != nullptr) {
        if (auto after = faulty->SizeAfterCrash(st.st_dev, st.st_ino)) size = *after;
      }
      std::string bytes(static_cast<size_t>(size), '\0');
      int fd = ::open((root + "/" + r).c_str(), O_RDONLY | O_CLOEXEC);
      ssize_t got = fd >= 0 ? ::pread(fd, bytes.data(), bytes.size(), 0) : -1;
      if (fd >= 0) ::close(fd);
      bytes.resize(got > 0 ? static_cast<size_t>(got) : 0);
      out->files[r] = bytes;
    } else if (S_ISLNK(st.st_mode)) {
      char buf[4096];
      ssize_t n2 = ::readlink((root + "/" + r).c_str(), buf, sizeof(buf));
      out->files[r] = "->" + std::string(buf, n2 > 0 ? static_cast<size_t>(n2) : 0);
    }
  }
}

inline TreeState Tree(const std::string& root, const FaultyBackingDir* faulty = nullptr) {
  TreeState t;
  Walk(root, "", faulty, &t);
  return t;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A file being written: its registered temp and the flush target behind it.
struct TempFile {
  uint64_t id = 0;
  std::string temp;
  std::shared_ptr<FlushTarget> target;
  std::shared_ptr<std::string> bytes = std::make_shared<std::string>();
};

// Owns a backing dir, a state db, a pipeline and (per test) a journal. Member order is
// destruction order reversed: the journal drains first, then the pipeline.
class JournalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = tmp_.Sub("backing");
    dir_ = FaultyBackingDir::Open(root_);
    ASSERT_NE(dir_, nullptr);
    auto db = StateDb::Open(tmp_.Sub("state", false));
    ASSERT_TRUE(db.ok()) << db.status().ToString();
    db_ = std::move(db).value();
    FlushOptions options;
    options.threads = 2;
    auto p = FlushPipeline::Create(dir_.get(), options);
    ASSERT_TRUE(p.ok());
    pipeline_ = std::move(p).value();
  }

  // The journal stops before anything a test's hooks use goes: a derived fixture's members
  // are destroyed before this class's, and a journal closing then may still report an
  // entry through on_done (UBSan saw JournalResumeTest's hook run on a half-destroyed
  // fixture).
  void TearDown() override { journal_.reset(); }

  // Early syncs (JournalOptions::presync_threads) are off unless a test asks for them: with
  // them on, which fsync an injected fault hits depends on thread timing.
  void MakeJournal(TestHooks hooks = {}, bool early_syncs = false) {
    if (!early_syncs) hooks.options.presync_threads = 0;
    journal_.reset();  // before the hooks it holds
    hooks_ = std::make_unique<TestHooks>(std::move(hooks));
    auto j = Journal::Create(dir_.get(), db_.get(), hooks_.get(), hooks_->options);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    journal_ = std::move(j).value();
  }

  // A journal whose directory fsyncs fail for commit names, a checkpoint dir `ck`, and its
  // `.metadata` bytes in a temp file, not yet queued.
  TempFile StartMetadataWithFailingDirSync() {
    dir_->SetSyncParentHook([](const std::string& path) { return IsCommitName(path) ? EIO : 0; });
    TestHooks hooks;
    hooks.commit_gate = [](const JournalEntry&, const QueuedFn&) { return Status::Ok(); };
    MakeJournal(std::move(hooks));
    EXPECT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
    TempFile md = StartFile("ck");
    Write(&md, "metadata");
    return md;
  }

  // Registers and creates a temp file in `dir`, as the write path does.
  TempFile StartFile(const std::string& dir) {
    TempFile f;
    f.id = journal_->temps()->NextId();
    f.temp = Join(dir, kTempPrefix + std::to_string(f.id));
    EXPECT_TRUE(journal_->temps()->Register(f.id, f.temp).ok());
    auto fd = dir_->OpenFile(f.temp, O_RDWR | O_CREAT | O_EXCL, 0644);
    EXPECT_TRUE(fd.ok()) << fd.status().ToString();
    if (fd.ok()) f.target = std::make_shared<FlushTarget>(f.id, std::move(*fd));
    return f;
  }

  // Hands `bytes` to the pipeline in chunks of `chunk` bytes.
  void Write(TempFile* f, const std::string& bytes, size_t chunk = 4096) {
    *f->bytes = bytes;
    for (size_t off = 0; off < bytes.size(); off += chunk) {
      SealedChunk c;
      c.target = f->target;
      c.offset = off;
      c.data = reinterpret_cast<const uint8_t*>(f->bytes->data()) + off;
      c.length = std::min(chunk, bytes.size() - off);
      c.keepalive = f->bytes;
      pipeline_->Submit(std::move(c));
    }
  }

  // `mtime`: the file's last write as the mount shows it (0: none given).
  uint64_t Publish(const TempFile& f, const std::string& path, struct timespec mtime = {}) {
    JournalEntry e;
    e.op = OpType::kPublish;
    e.path = path;
    e.mtime_sec = mtime.tv_sec;
    e.mtime_nsec = mtime.tv_nsec;
    e.from = f.temp;
    e.file_id = f.id;
    e.size = f.bytes->size();
    e.target = f.target;
    auto seq = journal_->Append(std::move(e));
    EXPECT_TRUE(seq.ok());
    return seq.ok() ? *seq : 0;
  }

  uint64_t Op(OpType op, const std::string& path, const std::string& from = "",
              uint32_t mode = 0755) {
    JournalEntry e;
    e.op = op;
    e.path = path;
    e.from = from;
    e.mode = mode;
    auto seq = journal_->Append(std::move(e));
    EXPECT_TRUE(seq.ok());
    return seq.ok() ? *seq : 0;
  }

  bool Exists(const std::string& rel) const {
    struct stat st;
    return ::lstat((root_ + "/" + rel).c_str(), &st) == 0;
  }
  std::string Read(const std::string& rel) const { return ReadFile(root_ + "/" + rel); }

  ScopedTempDir tmp_{"ckptfs-journal-test"};
  std::string root_;
  std::unique_ptr<FaultyBackingDir> dir_;
  std::unique_ptr<StateDb> db_;
  std::unique_ptr<FlushPipeline> pipeline_;
  std::unique_ptr<TestHooks> hooks_;  // outlives journal_
  std::unique_ptr<Journal> journal_;
};

}  // namespace ckptfs::store
