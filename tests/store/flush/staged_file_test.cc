// StagedFile: read-your-writes over staging chunks and the backing temp file (G3),
// byte-exact flushing (G1), bounded staging with backpressure (G6), sticky flush errors
// (G7) and freezing for publication.
//
// A real StagingPool (host memory, 64 KiB chunks), a real FlushPipeline and a
// FaultyBackingDir on a temporary directory. Every check compares against an in-memory
// model of the file.
#include "store/flush/staged_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu/staging_pool.h"
#include "store/flush/flush_pipeline.h"
#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {

using store::FaultyBackingDir;
using store::Latch;
using store::ScopedTempDir;

// The pool's pressure listener as a function, for tests.
struct OnPressure final : gpu::StagingPressureListener {
  explicit OnPressure(std::function<void()> fn) : fn(std::move(fn)) {}
  void RelieveStagingPressure() override { fn(); }
  std::function<void()> fn;
};

constexpr size_t kChunk = size_t{64} << 10;

// Aborts the test binary if a test hangs (a backpressure deadlock) instead of letting
// CI wait for its global timeout. Not a timing assumption: 300 s is orders of magnitude
// above what the guarded work takes (the random ops: 0.4 s in the release build, 7 to 11 s
// under TSan -O0 here, past 60 s under TSan at nice 19 beside CI's e2e tests and fuzz step,
// where 60 s was once not enough: CI of d65dada here).
class Watchdog {
 public:
  explicit Watchdog(const char* what) : what_(what), thread_([this] { Run(); }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void Run() {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::seconds(300), [&] { return done_; })) {
      std::fprintf(stderr, "watchdog: %s hung (deadlock?)\n", what_);
      std::abort();
    }
  }
  const char* what_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// The reference: what the file must read back as.
class Model {
 public:
  void Write(const std::string& data, uint64_t offset) {
    if (offset + data.size() > bytes_.size()) bytes_.resize(offset + data.size(), '\0');
    std::memcpy(bytes_.data() + offset, data.data(), data.size());
  }
  void Truncate(uint64_t size) { bytes_.resize(size, '\0'); }
  std::string Read(uint64_t offset, size_t len) const {
    if (offset >= bytes_.size()) return "";
    return bytes_.substr(offset, std::min<uint64_t>(len, bytes_.size() - offset));
  }
  uint64_t size() const { return bytes_.size(); }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

class StagedFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FaultyBackingDir::Open(tmp_.path());
    ASSERT_NE(dir_, nullptr);
  }

  void TearDown() override {
    files_.clear();
    if (pipeline_) pipeline_->Drain();
    pipeline_.reset();  // returns every in-flight chunk before the pool goes
  }

  void MakePool(size_t chunks) {
    gpu::StagingOptions options;
    options.chunk_bytes = kChunk;
    options.total_bytes = chunks * kChunk;
    options.backend = "host";
    auto pool = gpu::StagingPool::Create(options);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    pool_ = std::move(pool).value();
  }

  // `retry`: the first backoff of a chunk the store refused (FlushOptions::retry_min);
  // zero keeps the default.
  void MakePipeline(int threads, std::chrono::milliseconds retry = {}) {
    store::FlushOptions options;
    options.threads = threads;
    if (retry.count() > 0) options.retry_min = options.retry_max = retry;
    auto p = FlushPipeline::Create(dir_.get(), options);
    ASSERT_TRUE(p.ok());
    pipeline_ = std::move(p).value();
  }

  void Setup(size_t chunks, int threads, std::chrono::milliseconds retry = {}) {
    MakePool(chunks);
    MakePipeline(threads, retry);
  }

  // Pressure relief as the filesystem does it: seal every file's idle chunk.
  void SealIdleOnPressure() {
    pressure_ = std::make_unique<OnPressure>([this] {
      std::vector<std::shared_ptr<StagedFile>> files;
      {
        std::lock_guard lock(files_mu_);
        files = files_;
      }
      for (auto& f : files) f->SealIfIdle();
    });
    pool_->SetPressureListener(pressure_.get());
  }

  std::shared_ptr<StagedFile> MakeFile(const std::string& name) {
    auto fd = dir_->OpenFile(name, O_RDWR | O_CREAT | O_TRUNC, 0644);
    EXPECT_TRUE(fd.ok()) << fd.status().ToString();
    auto target = std::make_shared<FlushTarget>(++next_id_, std::move(*fd));
    StagingContext ctx{pool_.get(), pipeline_.get(), dir_.get()};
    auto file = std::make_shared<StagedFile>(ctx, std::move(target), 0);
    std::lock_guard lock(files_mu_);
    files_.push_back(file);
    return file;
  }

  static std::string ReadAll(StagedFile* f, uint64_t offset = 0, size_t len = SIZE_MAX) {
    len = std::min<uint64_t>(len, f->size() + 1);
    std::string out(len, '\x7f');
    auto got = f->Read(out.data(), out.size(), offset);
    EXPECT_TRUE(got.ok()) << got.status().ToString();
    out.resize(got.ok() ? *got : 0);
    return out;
  }

  std::string OnDisk(const std::string& name) {
    std::string path = tmp_.path() + "/" + name;
    int fd = ::open(path.c_str(), O_RDONLY);
    EXPECT_GE(fd, 0);
    std::string out;
    char buf[1 << 16];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
    ::close(fd);
    return out;
  }

  static std::string RandomBytes(std::mt19937& rng, size_t n) {
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng());
    return s;
  }

  // Publication as the filesystem does it: freeze, then make the temp file durable.
  void SealAndSync(StagedFile* f) {
    auto target = f->SealAll();
    ASSERT_EQ(target, f->target());
    Status st = target->Sync(dir_.get());
    ASSERT_TRUE(st.ok()) << st.ToString();
  }

  ScopedTempDir tmp_{"ckptfs-staged-test"};
  std::unique_ptr<gpu::StagingPool> pool_;  // outlives everything that holds its chunks
  std::unique_ptr<OnPressure> pressure_;  // the pool's listener, when a test sets one
  std::unique_ptr<FaultyBackingDir> dir_;
  std::unique_ptr<FlushPipeline> pipeline_;
  std::mutex files_mu_;
  std::vector<std::shared_ptr<StagedFile>> files_;
  uint64_t next_id_ = 0;
};

class StagedFileRandom : public StagedFileTest {
 protected:
  // Where `got` first differs from `want`, and for how long, in file offsets.
  static std::string Mismatch(const std::string& got, const std::string& want, uint64_t base) {
    if (got.size() != want.size()) {
      return " (length " + std::to_string(got.size()) + " vs " + std::to_string(want.size()) + ")";
    }
    size_t first = 0;
    while (first < got.size() && got[first] == want[first]) ++first;
    size_t last = got.size();
    while (last > first && got[last - 1] == want[last - 1]) --last;
    return " (bytes [" + std::to_string(base + first) + ", " + std::to_string(base + last) +
           ") differ)";
  }

  // Random writes, overwrites, truncates and reads against the model; reads always see
  // the newest bytes, whether they are staged, in flight or flushed. Ends with SealAll
  // and Sync, and compares the temp file with the model.
  void RunRandomOps(StagedFile* f, uint32_t seed, int ops, uint64_t max_size) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    Model model;
    struct Done {
      int op;
      char kind;
      uint64_t offset, len;
    };
    std::vector<Done> history;  // for the failure message
    auto touching = [&](uint64_t from, uint64_t to) {
      std::string s = "\n  recent ops (w=write over the range, t=truncate, d=drain, s=seal):";
      const int recent = history.empty() ? 0 : history.back().op - 60;
      for (const Done& d : history) {
        if (d.op >= recent && (d.kind != 'w' || (d.offset < to && d.offset + d.len > from))) {
          s += " " + std::to_string(d.op) + d.kind + "[" + std::to_string(d.offset) + "," +
               std::to_string(d.offset + d.len) + ")";
        }
      }
      return s;
    };
    for (int i = 0; i < ops && !HasFailure(); ++i) {
      const int kind = static_cast<int>(rng() % 100);
      const uint64_t size = model.size();
      if (kind < 55) {
        uint64_t offset;
        switch (rng() % 4) {
          case 0:
            offset = size;
            break;  // append
          case 1:
            offset = size ? rng() % size : 0;
            break;  // overwrite
          case 2:
            offset = rng() % (size + 200000);
            break;  // maybe a hole
          default:
            offset = size ? (rng() % size) & ~uint64_t{4095} : 0;  // aligned
        }
        size_t len = rng() % 4 == 0 ? 1 + rng() % 200000 : 1 + rng() % 6000;
        if (offset + len > max_size) continue;
        std::string data = RandomBytes(rng, len);
        Status st = f->Write(data.data(), data.size(), offset);
        ASSERT_TRUE(st.ok()) << "op " << i << ": " << st.ToString();
        model.Write(data, offset);
        history.push_back({i, 'w', offset, len});
      } else if (kind < 63) {
        uint64_t new_size = rng() % (size + size / 5 + 1000);
        ASSERT_TRUE(f->Truncate(new_size).ok()) << "op " << i;
        model.Truncate(new_size);
        history.push_back({i, 't', new_size, 0});
      } else if (kind < 90) {
        uint64_t offset = rng() % (size + 1000);
        size_t len = 1 + rng() % 300000;
        std::string out(len, '\x55');
        auto got = f->Read(out.data(), len, offset);
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        out.resize(*got);
        ASSERT_TRUE(out == model.Read(offset, len))
            << "op " << i << ": read [" << offset << ", +" << len << ") differs from the model"
            << Mismatch(out, model.Read(offset, len), offset) << touching(offset, offset + len);
      } else if (kind < 95) {
        pipeline_->Drain();  // everything sealed is now in the temp file
        history.push_back({i, 'd', 0, 0});
        ASSERT_EQ(f->size(), model.size());
        ASSERT_TRUE(ReadAll(f) == model.bytes()) << "op " << i << ": after a flush";
      } else {
        f->SealIfIdle();
        history.push_back({i, 's', 0, 0});
      }
      ASSERT_EQ(f->size(), model.size()) << "op " << i;
    }
    if (HasFailure()) return;
    ASSERT_TRUE(ReadAll(f) == model.bytes());
    SealAndSync(f);
    EXPECT_TRUE(ReadAll(f) == model.bytes()) << "reads changed after SealAll";
    const std::string disk = OnDisk(name_);
    EXPECT_EQ(disk.size(), model.size());
    EXPECT_TRUE(disk == model.bytes()) << "the flushed temp file differs from what was written";
  }

  std::string name_ = "f";
};

TEST_F(StagedFileRandom, RandomWritesTruncatesAndReadsMatchTheModelBeforeAndAfterFlush) {
  Watchdog watchdog("random ops");
  Setup(/*chunks=*/64, /*threads=*/4);
  SealIdleOnPressure();
  uint32_t seed = 7;
  if (const char* env = std::getenv("CKPTFS_STAGED_SEED")) seed = std::atoi(env);
  for (int round = 0; round < 6 && !HasFailure(); ++round) {
    name_ = "f" + std::to_string(round);
    auto f = MakeFile(name_);
    RunRandomOps(f.get(), seed + round, 400, 3 << 20);
  }
}

TEST_F(StagedFileRandom, RandomOpsOnAPoolMuchSmallerThanTheFileStayByteExact) {
  Watchdog watchdog("small pool");
  Setup(/*chunks=*/3, /*threads=*/2);
  SealIdleOnPressure();
  name_ = "big";
  auto f = MakeFile(name_);
  RunRandomOps(f.get(), 99, 300, 4 << 20);
  EXPECT_LE(pool_->used_bytes(), pool_->limit_bytes());
}

// Flushes are held until the pool is exhausted; the writer must then wait (G6), and
// the pressure callback, which runs exactly when Acquire() would block, lets them go.
TEST_F(StagedFileTest, AFullPoolMakesWritesWaitAndTheyCompleteOnceChunksReturn) {
  Watchdog watchdog("backpressure");
  Setup(/*chunks=*/3, /*threads=*/2);
  Latch flushes;
  dir_->SetPWriteHook([&](int, off_t, size_t) {
    flushes.Wait();
    return 0;
  });
  std::atomic<int> pressure_calls{0};
  std::atomic<size_t> used_at_pressure{0};
  std::atomic<bool> disk_empty_at_pressure{false};
  pressure_ = std::make_unique<OnPressure>([&] {
    if (pressure_calls.fetch_add(1) == 0) {
      used_at_pressure = pool_->used_bytes();
      disk_empty_at_pressure = OnDisk("f").empty();
    }
    std::vector<std::shared_ptr<StagedFile>> files;
    {
      std::lock_guard lock(files_mu_);
      files = files_;
    }
    for (auto& f : files) f->SealIfIdle();
    flushes.Open();
  });
  pool_->SetPressureListener(pressure_.get());
  auto f = MakeFile("f");
  std::mt19937 rng(4);
  Model model;
  while (model.size() < 10 * kChunk) {
    std::string data = RandomBytes(rng, 1 + rng() % 20000);
    const uint64_t offset = model.size();  // sequential: never waits on a sealed range
    ASSERT_TRUE(f->Write(data.data(), data.size(), offset).ok());
    model.Write(data, offset);
    ASSERT_LE(pool_->used_bytes(), pool_->limit_bytes());
    ASSERT_TRUE(ReadAll(f.get(), offset, data.size()) == data);
  }
  EXPECT_GE(pressure_calls.load(), 1);
  EXPECT_GE(pool_->waits(), 1u);
  EXPECT_EQ(used_at_pressure.load(), pool_->limit_bytes()) << "waited with free chunks";
  EXPECT_TRUE(disk_empty_at_pressure.load());
  EXPECT_TRUE(ReadAll(f.get()) == model.bytes());
  SealAndSync(f.get());
  EXPECT_TRUE(OnDisk("f") == model.bytes());
}

// Several files each hold a partly filled chunk and the pool has fewer chunks than
// files: a writer needing a chunk must get one through the pressure callback, which
// seals the idle chunks of the other files.
TEST_F(StagedFileTest, PressureSealsIdleChunksOfOtherFilesSoEveryWriterProgresses) {
  Watchdog watchdog("pressure across files");
  Setup(/*chunks=*/2, /*threads=*/2);
  SealIdleOnPressure();
  constexpr int kFiles = 5;
  std::vector<std::shared_ptr<StagedFile>> files;
  std::vector<Model> models(kFiles);
  for (int i = 0; i < kFiles; ++i) files.push_back(MakeFile("p" + std::to_string(i)));
  std::mt19937 rng(3);
  for (int round = 0; round < 30; ++round) {
    for (int i = 0; i < kFiles; ++i) {
      std::string data = RandomBytes(rng, 1 + rng() % 20000);
      uint64_t offset = models[i].size();
      ASSERT_TRUE(files[i]->Write(data.data(), data.size(), offset).ok());
      models[i].Write(data, offset);
      ASSERT_TRUE(ReadAll(files[i].get(), offset, data.size()) == data);
    }
  }
  EXPECT_GT(pool_->waits(), 0u);
  for (int i = 0; i < kFiles; ++i) {
    SCOPED_TRACE(i);
    SealAndSync(files[i].get());
    EXPECT_TRUE(OnDisk("p" + std::to_string(i)) == models[i].bytes());
  }
}

// Concurrent writers on different files sharing a tiny pool, with pressure relief.
TEST_F(StagedFileTest, ConcurrentWritersOnASharedTinyPoolAllFinishByteExact) {
  Watchdog watchdog("concurrent writers");
  Setup(/*chunks=*/3, /*threads=*/3);
  SealIdleOnPressure();
  constexpr int kFiles = 4;
  std::vector<std::shared_ptr<StagedFile>> files;
  std::vector<Model> models(kFiles);
  for (int i = 0; i < kFiles; ++i) files.push_back(MakeFile("c" + std::to_string(i)));
  std::vector<std::thread> writers;
  for (int i = 0; i < kFiles; ++i) {
    writers.emplace_back([&, i] {
      std::mt19937 rng(100 + i);
      for (int n = 0; n < 60; ++n) {
        std::string data = RandomBytes(rng, 1 + rng() % 50000);
        uint64_t offset =
            rng() % 3 == 0 && models[i].size() > 0 ? rng() % models[i].size() : models[i].size();
        EXPECT_TRUE(files[i]->Write(data.data(), data.size(), offset).ok());
        models[i].Write(data, offset);
      }
    });
  }
  for (auto& w : writers) w.join();
  for (int i = 0; i < kFiles; ++i) {
    SCOPED_TRACE(i);
    EXPECT_TRUE(ReadAll(files[i].get()) == models[i].bytes());
    SealAndSync(files[i].get());
    EXPECT_TRUE(OnDisk("c" + std::to_string(i)) == models[i].bytes());
  }
}

TEST_F(StagedFileTest, WritesAreReadableBeforeAnyByteReachesTheBackingFile) {
  Setup(/*chunks=*/16, /*threads=*/2);
  Latch gate;
  dir_->SetPWriteHook([&](int, off_t, size_t) {
    gate.Wait();
    return 0;
  });
  auto f = MakeFile("f");
  std::mt19937 rng(1);
  Model model;
  // Disjoint writes only: rewriting an in-flight range waits for its flush.
  std::string a = RandomBytes(rng, 3 * kChunk + 100), b = RandomBytes(rng, 5000);
  ASSERT_TRUE(f->Write(a.data(), a.size(), 0).ok());
  model.Write(a, 0);
  ASSERT_TRUE(f->Write(b.data(), b.size(), 1 << 20).ok());  // leaves a hole
  model.Write(b, 1 << 20);
  EXPECT_EQ(OnDisk("f"), "") << "the gate let a flush through";
  EXPECT_EQ(f->size(), model.size());
  EXPECT_TRUE(ReadAll(f.get()) == model.bytes());
  EXPECT_TRUE(ReadAll(f.get(), 100000, 10) == model.Read(100000, 10));
  EXPECT_TRUE(ReadAll(f.get(), (1 << 20) - 10, 20) == model.Read((1 << 20) - 10, 20));
  EXPECT_GE(f->staged_bytes(), a.size() + b.size());
  gate.Open();
  SealAndSync(f.get());
  EXPECT_TRUE(ReadAll(f.get()) == model.bytes());
  EXPECT_TRUE(OnDisk("f") == model.bytes());
  EXPECT_EQ(f->staged_bytes(), 0u);
}

// A write that continues the active chunk must not grow it over the range of a chunk
// that is still in flight (a bug found by these tests, fixed in ced3777): the two staged
// chunks would overlap, reads would apply them in map order (the older one last), and
// the flush threads could land them in either order, leaving stale bytes in both the
// overlay and the temp file (G3, G1).
//
// Chunk A [100,200) is held inside its pwrite until a chunk at offset 0 has landed, so
// that A always lands after it. A correct Write() of [10,150) either waits for A (then
// the chunk at 0 holds only [0,10) and lands first, releasing A) or keeps the chunks
// disjoint some other way; the buggy one returns at once with a chunk [0,150) that lands
// before A. While A is held, the hook reads the file: it must show the newest bytes of
// every write that has returned.
TEST_F(StagedFileTest, ExtendingTheActiveChunkOverAnInFlightChunkKeepsTheNewestBytes) {
  Watchdog watchdog("extending the active chunk");
  Setup(/*chunks=*/8, /*threads=*/2);
  const std::string old_bytes(100, 'O'), head(10, 'h'), newer(140, 'N');
  Model before_newer, after_newer;
  before_newer.Write(old_bytes, 100);
  before_newer.Write(head, 0);
  after_newer = before_newer;
  after_newer.Write(newer, 10);
  std::atomic<StagedFile*> file{nullptr};
  std::atomic<bool> newer_returned{false};
  std::atomic<bool> read_in_window_ok{false};
  std::atomic<bool> window_seen{false};
  dir_->SetPWriteHook([&](int, off_t offset, size_t) {
    if (offset != 100) return 0;
    StagedFile* f = file.load();
    while (f->target()->bytes_flushed() == 0) std::this_thread::yield();  // 0 landed first
    const bool returned = newer_returned.load();
    std::string got(300, '\0');
    auto n = f->Read(got.data(), got.size(), 0);
    got.resize(n.ok() ? *n : 0);
    read_in_window_ok = got == (returned ? after_newer : before_newer).bytes();
    window_seen = true;
    return 0;
  });
  auto f = MakeFile("f");
  file = f.get();
  ASSERT_TRUE(f->Write(old_bytes.data(), old_bytes.size(), 100).ok());  // chunk A
  ASSERT_TRUE(f->Write(head.data(), head.size(), 0).ok());              // seals A; chunk B at 0
  ASSERT_TRUE(f->Write(newer.data(), newer.size(), 10).ok());           // must not grow B over A
  newer_returned = true;
  EXPECT_TRUE(ReadAll(f.get()) == after_newer.bytes());
  auto target = f->SealAll();
  ASSERT_TRUE(target->Sync(dir_.get()).ok());
  ASSERT_TRUE(window_seen.load());
  EXPECT_TRUE(read_in_window_ok.load())
      << "read-your-writes broken: an older in-flight chunk overrode newer bytes";
  EXPECT_TRUE(ReadAll(f.get()) == after_newer.bytes());
  const std::string disk = OnDisk("f");
  EXPECT_TRUE(disk == after_newer.bytes())
      << "the temp file holds older bytes in [100,150): " << disk.substr(100, 50);
}

TEST_F(StagedFileTest, RewritingAnInFlightRangeWaitsForItsFlushAndKeepsTheNewestBytes) {
  Setup(/*chunks=*/8, /*threads=*/2);
  auto f = MakeFile("f");
  std::mt19937 rng(5);
  Model model;
  for (int i = 0; i < 200; ++i) {
    // Each write starts a new chunk over bytes that are likely still in flight.
    uint64_t offset = (rng() % 16) * 1000;
    std::string data = RandomBytes(rng, 1 + rng() % 3000);
    ASSERT_TRUE(f->Write(data.data(), data.size(), offset).ok());
    model.Write(data, offset);
    f->SealIfIdle();
    ASSERT_TRUE(ReadAll(f.get()) == model.bytes()) << "write " << i;
  }
  SealAndSync(f.get());
  EXPECT_TRUE(OnDisk("f") == model.bytes());
}

TEST_F(StagedFileTest, TruncateShrinksAndExtendsWithZeros) {
  Setup(/*chunks=*/8, /*threads=*/2);
  auto f = MakeFile("f");
  std::mt19937 rng(2);
  Model model;
  std::string data = RandomBytes(rng, 200000);
  ASSERT_TRUE(f->Write(data.data(), data.size(), 0).ok());
  model.Write(data, 0);
  ASSERT_TRUE(f->Truncate(50000).ok());
  model.Truncate(50000);
  EXPECT_EQ(f->size(), 50000u);
  EXPECT_TRUE(ReadAll(f.get()) == model.bytes());
  ASSERT_TRUE(f->Truncate(100000).ok());
  model.Truncate(100000);
  EXPECT_TRUE(ReadAll(f.get(), 49990, 100) == model.Read(49990, 100));
  EXPECT_EQ(ReadAll(f.get(), 60000, 100), std::string(100, '\0'));
  std::string tail = RandomBytes(rng, 3000);
  ASSERT_TRUE(f->Write(tail.data(), tail.size(), 120000).ok());
  model.Write(tail, 120000);
  EXPECT_TRUE(ReadAll(f.get()) == model.bytes());
  ASSERT_TRUE(f->Truncate(0).ok());
  model.Truncate(0);
  EXPECT_EQ(ReadAll(f.get()), "");
  ASSERT_TRUE(f->Write(tail.data(), 10, 5).ok());
  model.Write(tail.substr(0, 10), 5);
  SealAndSync(f.get());
  EXPECT_TRUE(OnDisk("f") == model.bytes());
}

TEST_F(StagedFileTest, ReadsPastTheEndAreShortOrEmpty) {
  Setup(/*chunks=*/4, /*threads=*/1);
  auto f = MakeFile("f");
  ASSERT_TRUE(f->Write("abcdef", 6, 0).ok());
  char buf[16];
  auto got = f->Read(buf, sizeof(buf), 4);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 2u);
  EXPECT_EQ(std::string(buf, 2), "ef");
  got = f->Read(buf, sizeof(buf), 6);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 0u);
  got = f->Read(buf, sizeof(buf), 1000);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 0u);
  EXPECT_TRUE(f->Write("", 0, 100).ok());  // an empty write changes nothing
  EXPECT_EQ(f->size(), 6u);
}

TEST_F(StagedFileTest, AFrozenFileRefusesWritesAndTruncatesButStillReads) {
  Setup(/*chunks=*/4, /*threads=*/2);
  auto f = MakeFile("f");
  ASSERT_TRUE(f->Write("hello", 5, 0).ok());
  auto target = f->SealAll();
  ASSERT_NE(target, nullptr);
  Status w = f->Write("x", 1, 5);
  EXPECT_EQ(w.code(), Code::kAborted) << w.ToString();
  EXPECT_EQ(f->Truncate(0).code(), Code::kAborted);
  EXPECT_EQ(f->size(), 5u);
  EXPECT_EQ(ReadAll(f.get()), "hello");
  EXPECT_EQ(f->SealAll(), target);  // idempotent
  ASSERT_TRUE(target->Sync(dir_.get()).ok());
  EXPECT_EQ(OnDisk("f"), "hello");
}

TEST_F(StagedFileTest, ATransientFlushFailureFailsWritesButReadsServeTheKeptBytes) {
  Setup(/*chunks=*/8, /*threads=*/2);
  std::atomic<bool> full{true};
  dir_->SetPWriteHook([&](int, off_t, size_t) { return full.load() ? ENOSPC : 0; });
  auto level = spdlog::get_level();
  spdlog::set_level(spdlog::level::off);
  auto f = MakeFile("f");
  std::string data(2 * kChunk, 'e');
  data[kChunk + 7] = 'z';
  ASSERT_TRUE(f->Write(data.data(), data.size(), 0).ok());  // staged: returns at once
  pipeline_->Drain();  // the full chunks were sealed, failed, and were parked for a retry
  EXPECT_EQ(f->error().code(), Code::kNoSpace);
  EXPECT_EQ(f->Write("x", 1, 0).code(), Code::kNoSpace);  // sticky for the application
  EXPECT_EQ(f->Truncate(0).code(), Code::kNoSpace);
  // The bytes are kept in staging (G7): a reader of the file gets them, not EIO (a load
  // of a checkpoint whose write-back hit a transient error failed in the soak).
  EXPECT_EQ(ReadAll(f.get()), data);
  auto target = f->SealAll();
  EXPECT_EQ(target->Sync(dir_.get()).code(), Code::kNoSpace);
  full = false;  // the condition clears: the retry writes the kept bytes
  while (target->parked() > 0) pipeline_->RetryNowAndWait(std::chrono::seconds(5));
  ASSERT_TRUE(target->Sync(dir_.get()).ok());
  EXPECT_EQ(OnDisk("f"), data);
  EXPECT_EQ(ReadAll(f.get()), data);
  spdlog::set_level(level);
}

// The soak's failure (seed 4101, async): a full disk for 4 s filled staging with refused
// chunks whose backoff had grown to seconds; the disk had room again, but a new job's
// write found staging full of parked chunks and failed with ENOSPC instead of making them
// retry. Here their backoff is a minute: only the write itself can make them go now.
TEST_F(StagedFileTest, AWriteIntoStagingFullOfRefusedChunksRetriesThemOnceTheStoreHasRoom) {
  Watchdog watchdog("a write into staging full of refused chunks");
  Setup(/*chunks=*/4, /*threads=*/2, /*retry=*/std::chrono::minutes(1));
  std::atomic<bool> full{true};
  dir_->SetPWriteHook([&](int, off_t, size_t) { return full.load() ? ENOSPC : 0; });
  auto level = spdlog::get_level();
  spdlog::set_level(spdlog::level::off);
  auto refused = MakeFile("refused");
  std::string old_bytes(4 * kChunk, 'o');
  old_bytes[3 * kChunk + 5] = 'p';
  ASSERT_TRUE(refused->Write(old_bytes.data(), old_bytes.size(), 0).ok());
  pipeline_->Drain();
  ASSERT_EQ(pipeline_->parked(), 4u);
  ASSERT_EQ(pool_->used_bytes(), pool_->limit_bytes());
  full = false;  // the disk has room again; the parked chunks wait a minute for their retry
  auto next = MakeFile("next");
  std::string data(kChunk + 100, 'n');
  data[kChunk + 3] = 'q';
  const auto t0 = std::chrono::steady_clock::now();
  Status st = next->Write(data.data(), data.size(), 0);
  EXPECT_TRUE(st.ok()) << "the store takes bytes again, but the write failed: " << st.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  EXPECT_GE(pipeline_->retries(), 1u);
  EXPECT_EQ(pipeline_->retry_rounds_refused(), 0u);
  // The refused file's bytes were kept and written by those retries (G7); its error stays
  // for its application, and every byte of both files reads back and lands.
  EXPECT_EQ(refused->error().code(), Code::kNoSpace);
  EXPECT_TRUE(ReadAll(next.get()) == data);
  SealAndSync(next.get());
  EXPECT_TRUE(OnDisk("next") == data);
  auto target = refused->SealAll();
  while (target->parked() > 0) pipeline_->RetryNowAndWait(std::chrono::seconds(5));
  ASSERT_TRUE(target->Sync(dir_.get()).ok());
  EXPECT_TRUE(OnDisk("refused") == old_bytes);
  spdlog::set_level(level);
}

// While the store still refuses the retried chunks, the write fails as the store's would
// (G7), at once and without waiting out a backoff: it never hangs on staging that only
// the store's recovery can free.
TEST_F(StagedFileTest, AWriteIntoStagingFullOfRefusedChunksFailsWithNoSpaceWhileTheStoreRefuses) {
  Watchdog watchdog("a write into staging full of refused chunks");
  Setup(/*chunks=*/4, /*threads=*/2, /*retry=*/std::chrono::minutes(1));
  std::atomic<bool> full{true};
  dir_->SetPWriteHook([&](int, off_t, size_t) { return full.load() ? ENOSPC : 0; });
  auto level = spdlog::get_level();
  spdlog::set_level(spdlog::level::off);
  auto refused = MakeFile("refused");
  std::string old_bytes(4 * kChunk, 'o');
  ASSERT_TRUE(refused->Write(old_bytes.data(), old_bytes.size(), 0).ok());
  pipeline_->Drain();
  ASSERT_EQ(pipeline_->parked(), 4u);
  auto next = MakeFile("next");
  std::string data(100, 'n');
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(next->Write(data.data(), data.size(), 0).code(), Code::kNoSpace);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  EXPECT_GE(pipeline_->retries(), 4u) << "failed on the old refusals without asking the store";
  EXPECT_EQ(pipeline_->retry_rounds(), 1u);
  EXPECT_EQ(pipeline_->retry_rounds_refused(), 1u);
  EXPECT_EQ(pipeline_->parked(), 4u) << "refused bytes must be kept for a later retry";
  EXPECT_TRUE(ReadAll(refused.get()) == old_bytes);
  full = false;
  auto target = refused->SealAll();
  while (target->parked() > 0) pipeline_->RetryNowAndWait(std::chrono::seconds(5));
  ASSERT_TRUE(target->Sync(dir_.get()).ok());
  EXPECT_TRUE(OnDisk("refused") == old_bytes);
  spdlog::set_level(level);
}

TEST_F(StagedFileTest, BytesLostForGoodFailTheRead) {
  Setup(/*chunks=*/8, /*threads=*/2);
  dir_->SetPWriteHook([](int, off_t, size_t) { return EROFS; });  // permanent
  auto level = spdlog::get_level();
  spdlog::set_level(spdlog::level::off);
  auto f = MakeFile("f");
  std::string data(2 * kChunk, 'e');
  ASSERT_TRUE(f->Write(data.data(), data.size(), 0).ok());
  pipeline_->Drain();
  char buf[8];
  EXPECT_FALSE(f->Read(buf, sizeof(buf), 0).ok());
  EXPECT_FALSE(f->Write("x", 1, 0).ok());
  spdlog::set_level(level);
}

TEST_F(StagedFileTest, StagedBytesDropAsChunksAreFlushed) {
  Setup(/*chunks=*/8, /*threads=*/2);
  auto f = MakeFile("f");
  std::string data(kChunk * 2 + 1000, 's');
  ASSERT_TRUE(f->Write(data.data(), data.size(), 0).ok());
  EXPECT_GE(f->staged_bytes(), 1000u);
  pipeline_->Drain();
  EXPECT_EQ(f->staged_bytes(), 1000u);  // only the active, unsealed chunk
  f->SealIfIdle();
  pipeline_->Drain();
  EXPECT_EQ(f->staged_bytes(), 0u);
  EXPECT_EQ(pool_->used_bytes(), 0u) << "flushed chunks must return to the pool";
  EXPECT_TRUE(ReadAll(f.get()) == data);
}

}  // namespace
}  // namespace ckptfs::store
