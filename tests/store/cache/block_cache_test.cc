// BlockCache over a BackingSource: single flight, byte-exactness, the hard budget,
// freshness, error fan-out, prefetch and its isolation from demand reads, the cache as a
// BlockSource. Races are ordered with latches in a PRead hook, never with sleeps.
#include "store/cache/block_cache.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {

// A BackingDir that counts PRead calls (per offset too) and lets a hook stall or fail
// any of them. The hook runs before the read, with no lock of this class held.
class CountingBackingDir : public BackingDir {
 public:
  // Returns 0 to let the read proceed, or an errno to fail it.
  using Hook = std::function<int(int fd, off_t offset, size_t len)>;

  static std::unique_ptr<CountingBackingDir> Open(const std::string& root) {
    int fd = ::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return nullptr;
    return std::unique_ptr<CountingBackingDir>(new CountingBackingDir(root, UniqueFd(fd)));
  }

  void SetHook(Hook hook) {
    std::lock_guard lock(mu_);
    hook_ = std::move(hook);
  }
  uint64_t pread_calls() const { return calls_.load(); }
  uint64_t ReadsAt(off_t offset) const {
    std::lock_guard lock(mu_);
    auto it = per_offset_.find(offset);
    return it == per_offset_.end() ? 0 : it->second;
  }
  uint64_t max_concurrent() const { return max_concurrent_.load(); }

  Result<size_t> PRead(int fd, void* buf, size_t len, off_t offset) override {
    calls_.fetch_add(1);
    Hook hook;
    {
      std::lock_guard lock(mu_);
      ++per_offset_[offset];
      hook = hook_;
    }
    int now = concurrent_.fetch_add(1) + 1;
    for (int seen = max_concurrent_.load(); now > seen;) {
      if (max_concurrent_.compare_exchange_weak(seen, now)) break;
    }
    int err = hook ? hook(fd, offset, len) : 0;
    Result<size_t> result = err != 0 ? Result<size_t>(Status::FromErrno(err, "pread (injected)"))
                                     : BackingDir::PRead(fd, buf, len, offset);
    concurrent_.fetch_sub(1);
    return result;
  }

 private:
  CountingBackingDir(std::string root, UniqueFd fd) : BackingDir(std::move(root), std::move(fd)) {}

  mutable std::mutex mu_;
  Hook hook_;                             // GUARDED_BY(mu_)
  std::map<off_t, uint64_t> per_offset_;  // GUARDED_BY(mu_)
  std::atomic<uint64_t> calls_{0};
  std::atomic<int> concurrent_{0};
  std::atomic<int> max_concurrent_{0};
};

// Polls `pred` (yielding) until it holds; false after a generous deadline, so a broken
// cache fails the test instead of hanging it.
template <typename Pred>
bool WaitUntil(Pred pred) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

std::string Pattern(size_t size, uint64_t seed) {
  std::string s(size, '\0');
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < size; i += 8) {
    uint64_t v = rng();
    std::memcpy(s.data() + i, &v, std::min<size_t>(8, size - i));
  }
  return s;
}

constexpr uint64_t kBlock = 64 * 1024;

// What the cache charges for `size` bytes of a file: its blocks' buffers, in whole pages.
uint64_t Pages(uint64_t size) { return (size + 4095) / 4096 * 4096; }

// Every test runs twice: buffered backing reads, and O_DIRECT ones (which fall back to
// buffered where the temp dir's file system refuses O_DIRECT).
class BlockCacheTest : public ::testing::TestWithParam<bool> {
 protected:
  // A file as the fs read path has it: open, fstat()ed, named by its BlockId.
  struct File {
    BlockId id;
    struct stat st;
    std::shared_ptr<const UniqueFd> fd;
    std::string contents;
  };

  void SetUp() override {
    dir_ = CountingBackingDir::Open(tmp_.path());
    ASSERT_NE(dir_, nullptr);
    BackingSourceOptions opts;
    opts.direct_io = GetParam();
    auto source = BackingSource::Create(dir_.get(), opts);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    source_ = std::move(source).value();
  }

  // Writes `contents` to `name` with mtime `mtime_sec` and opens it.
  File Make(const std::string& name, std::string contents, int64_t mtime_sec = 1000) {
    {
      std::ofstream out(tmp_.path() + "/" + name, std::ios::binary | std::ios::trunc);
      out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    }
    SetMtime(name, mtime_sec);
    return Open(name, std::move(contents));
  }
  void SetMtime(const std::string& name, int64_t mtime_sec) {
    struct timespec times[2] = {{mtime_sec, 0}, {mtime_sec, 0}};
    EXPECT_EQ(::utimensat(AT_FDCWD, (tmp_.path() + "/" + name).c_str(), times, 0), 0);
  }
  File Open(const std::string& name, std::string contents) {
    auto fd = dir_->OpenFile(name, O_RDONLY);
    EXPECT_TRUE(fd.ok()) << fd.status().ToString();
    struct stat st;
    EXPECT_EQ(::fstat(fd->get(), &st), 0);
    return File{BlockIdFromStat(name, st), st, std::make_shared<const UniqueFd>(std::move(*fd)),
                std::move(contents)};
  }

  std::unique_ptr<BlockCache> NewCache(uint64_t budget, int prefetch_threads = 2,
                                       int read_parallelism = 4) {
    BlockCacheOptions opts;
    opts.budget_bytes = budget;
    opts.block_bytes = kBlock;
    opts.prefetch_threads = prefetch_threads;
    opts.read_parallelism = read_parallelism;
    auto cache = BlockCache::Create(source_.get(), opts);
    EXPECT_TRUE(cache.ok()) << cache.status().ToString();
    return std::move(cache).value();
  }

  // What the fs does before a read: lends its open descriptor to the source, and drops the
  // blocks of another file that had the same name, size and mtime.
  void Bind(BlockCache* cache, const File& f) {
    source_->Adopt(f.id, f.fd, f.st, [cache](const std::string& p) { cache->Invalidate(p); });
  }

  // Reads through the cache and checks the bytes against the file.
  void ExpectRead(BlockCache* cache, const File& f, uint64_t offset, size_t len) {
    Bind(cache, f);
    std::string buf(len, '\xee');
    auto n = cache->Read(f.id, buf.data(), len, offset);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    size_t want =
        offset >= f.contents.size() ? 0 : std::min<size_t>(len, f.contents.size() - offset);
    ASSERT_EQ(*n, want) << "offset " << offset << " len " << len;
    ASSERT_EQ(0, std::memcmp(buf.data(), f.contents.data() + offset, want))
        << "offset " << offset << " len " << len;
  }

  ScopedTempDir tmp_{"ckptfs-block-cache"};
  std::unique_ptr<CountingBackingDir> dir_;
  std::unique_ptr<BackingSource> source_;
};

TEST_P(BlockCacheTest, CreateRejectsBudgetSmallerThanOneBlockAndBadOptions) {
  BlockCacheOptions opts;
  opts.block_bytes = kBlock;
  opts.budget_bytes = kBlock - 1;
  EXPECT_EQ(BlockCache::Create(source_.get(), opts).status().code(), Code::kInvalid);
  opts.budget_bytes = kBlock;
  opts.read_parallelism = 0;
  EXPECT_EQ(BlockCache::Create(source_.get(), opts).status().code(), Code::kInvalid);
  opts.read_parallelism = 1;
  opts.block_bytes = 0;
  EXPECT_EQ(BlockCache::Create(source_.get(), opts).status().code(), Code::kInvalid);
  opts.block_bytes = kBlock;
  EXPECT_TRUE(BlockCache::Create(source_.get(), opts).ok());
  EXPECT_EQ(BlockCache::Create(nullptr, opts).status().code(), Code::kInvalid);
}

TEST_P(BlockCacheTest, ConcurrentReadersOfOneRangeShareOneBackingReadPerBlock) {
  const uint64_t size = 8 * kBlock + 123;  // 9 blocks, the last one short
  File f = Make("shard.distcp", Pattern(size, 1));
  const uint64_t blocks = 9;
  Latch latch;
  auto cache = NewCache(64 * kBlock, 2, /*read_parallelism=*/16);
  dir_->SetHook([&](int, off_t, size_t) {
    latch.Wait();
    return 0;
  });

  constexpr int kReaders = 8;
  std::vector<std::thread> readers;
  for (int i = 0; i < kReaders; ++i) {
    readers.emplace_back([&] { ExpectRead(cache.get(), f, 0, size); });
  }
  // Every reader has found every block missing or in flight before any read finishes.
  ASSERT_TRUE(WaitUntil([&] {
    auto s = cache->Stats();
    return s.misses + s.dedup_waits == kReaders * blocks;
  }));
  latch.Open();
  for (auto& t : readers) t.join();

  auto s = cache->Stats();
  EXPECT_EQ(dir_->pread_calls(), blocks);
  for (uint64_t b = 0; b < blocks; ++b) EXPECT_EQ(dir_->ReadsAt(b * kBlock), 1u) << b;
  EXPECT_EQ(s.misses, blocks);
  EXPECT_EQ(s.dedup_waits, (kReaders - 1) * blocks);
  EXPECT_EQ(s.backing_bytes_read, size);
  EXPECT_EQ(dir_->bytes_read(), size);
  EXPECT_EQ(s.bytes_served, kReaders * size);
  EXPECT_EQ(s.used_bytes, Pages(size));
}

TEST_P(BlockCacheTest, LargeReadIssuesMissingBlocksInParallel) {
  File f = Make("big", Pattern(8 * kBlock, 2));
  Latch latch;
  auto cache = NewCache(16 * kBlock, 0, /*read_parallelism=*/4);
  dir_->SetHook([&](int, off_t, size_t) {
    latch.Wait();
    return 0;
  });
  std::thread reader([&] { ExpectRead(cache.get(), f, 0, 8 * kBlock); });
  latch.AwaitWaiters(4);  // four backing reads of one Read() in flight at once
  latch.Open();
  reader.join();
  EXPECT_EQ(dir_->pread_calls(), 8u);
  EXPECT_EQ(dir_->max_concurrent(), 4);
}

TEST_P(BlockCacheTest, OverlappingRandomRangesAreByteExactUnderEviction) {
  const uint64_t size = 24 * kBlock + 4321;
  File f = Make("data", Pattern(size, 3));
  auto cache = NewCache(6 * kBlock, 2, 3);  // a quarter of the file: constant eviction
  std::vector<std::thread> readers;
  for (int t = 0; t < 12; ++t) {
    readers.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      for (int i = 0; i < 150; ++i) {
        uint64_t off = rng() % (size + 100);  // some start past EOF
        size_t len = 1 + rng() % (3 * kBlock + 17);
        ExpectRead(cache.get(), f, off, len);
        if (i % 25 == 0) cache->Prefetch(f.id, rng() % size, 2 * kBlock);
      }
    });
  }
  for (auto& t : readers) t.join();
  auto s = cache->Stats();
  EXPECT_LE(s.peak_used_bytes, 6 * kBlock);
  EXPECT_GT(s.evictions, 0u);
}

TEST_P(BlockCacheTest, BudgetHoldsUnderWorkingSetFourTimesTheBudget) {
  const uint64_t budget = 8 * kBlock;
  const uint64_t size = 4 * budget;
  File a = Make("a", Pattern(size / 2, 4));
  File b = Make("b", Pattern(size / 2, 5));
  auto cache = NewCache(budget, 2, 4);

  std::atomic<bool> done{false};
  uint64_t max_seen = 0;
  std::thread monitor([&] {
    while (!done.load()) {
      max_seen = std::max(max_seen, cache->Stats().used_bytes);
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> readers;
  for (int t = 0; t < 8; ++t) {
    readers.emplace_back([&, t] {
      std::mt19937_64 rng(7 + t);
      const File& f = t % 2 ? a : b;
      for (int i = 0; i < 120; ++i) {
        uint64_t off = rng() % f.contents.size();
        ExpectRead(cache.get(), f, off, 1 + rng() % (2 * kBlock));
        if (i % 10 == 0) cache->Prefetch(f.id, 0, f.contents.size());
      }
    });
  }
  for (auto& t : readers) t.join();
  done = true;
  monitor.join();

  auto s = cache->Stats();
  EXPECT_LE(max_seen, budget);
  EXPECT_LE(s.peak_used_bytes, budget);
  EXPECT_LE(s.used_bytes, budget);
  EXPECT_GT(s.evictions, 0u);
  EXPECT_GT(s.backing_bytes_read, budget);  // the working set really did not fit
}

TEST_P(BlockCacheTest, TinyFilesAreCountedInWholePagesAndTheIndexIsReported) {
  // 64 files of 100 bytes: each block holds a page. Counted by their bytes (6,400 in all)
  // they all fitted a 16-page budget and held 64 pages: on a tree of small files the
  // cache's RSS passed its budget up to 40 times (the soak's RSS drift followed its fill).
  const uint64_t budget = kBlock;  // 16 pages
  auto cache = NewCache(budget, 0);
  std::vector<File> files;
  for (int i = 0; i < 64; ++i) files.push_back(Make("t" + std::to_string(i), Pattern(100, i)));
  for (const File& f : files) ExpectRead(cache.get(), f, 0, 100);
  auto s = cache->Stats();
  EXPECT_EQ(s.used_bytes, budget);
  EXPECT_EQ(s.evictions, 48u);
  // The index's heap is reported beside the budget: 16 blocks of a few hundred bytes each.
  EXPECT_GE(s.index_bytes, 16 * 200u);
  EXPECT_LE(s.index_bytes, 16 * 1024u);
  cache->Invalidate(files.back().id.path);
  EXPECT_EQ(cache->Stats().used_bytes, 15 * 4096u);
  EXPECT_EQ(cache->Stats().index_bytes, s.index_bytes / 16 * 15);
}

TEST_P(BlockCacheTest, BudgetOfOneBlockStillServesManyMultiBlockReaders) {
  // Every multi-block read must go on one block at a time without deadlocking on memory.
  const uint64_t size = 10 * kBlock + 99;
  File f = Make("f", Pattern(size, 6));
  for (uint64_t budget : {kBlock, 2 * kBlock + 1}) {
    auto cache = NewCache(budget, 1, 4);
    std::vector<std::thread> readers;
    for (int t = 0; t < 8; ++t) {
      readers.emplace_back([&, t] {
        std::mt19937_64 rng(900 + t);
        for (int i = 0; i < 60; ++i) {
          ExpectRead(cache.get(), f, rng() % size, 1 + rng() % (4 * kBlock));
          if (i % 7 == 0) cache->Prefetch(f.id, 0, size);
        }
      });
    }
    for (auto& t : readers) t.join();
    EXPECT_LE(cache->Stats().peak_used_bytes, budget);
  }
}

TEST_P(BlockCacheTest, ChangedFileIsNeverServedStale) {
  File v1 = Make("f", Pattern(3 * kBlock, 10), /*mtime_sec=*/1000);
  auto cache = NewCache(16 * kBlock, 0);
  ExpectRead(cache.get(), v1, 0, 3 * kBlock);

  // Same inode, same size, new bytes and a new mtime.
  File v2 = Make("f", Pattern(3 * kBlock, 11), 2000);
  ASSERT_EQ(v2.st.st_ino, v1.st.st_ino);
  ASSERT_EQ(v2.id.size, v1.id.size);
  ExpectRead(cache.get(), v2, 0, 3 * kBlock);

  // Same inode, new size (grown, then shrunk).
  File v3 = Make("f", Pattern(5 * kBlock + 7, 12), 3000);
  ExpectRead(cache.get(), v3, kBlock / 2, 5 * kBlock);
  File v4 = Make("f", Pattern(kBlock + 1, 13), 4000);
  ExpectRead(cache.get(), v4, 0, 3 * kBlock);

  // Replaced by rename: a new inode, even with the same size and mtime, so the same
  // BlockId. The source sees another file adopted under that id (Bind).
  File other = Make("f.tmp", Pattern(kBlock + 1, 14), 4000);
  ASSERT_EQ(::rename((tmp_.path() + "/f.tmp").c_str(), (tmp_.path() + "/f").c_str()), 0);
  File v5 = Open("f", other.contents);
  ASSERT_NE(v5.st.st_ino, v4.st.st_ino);
  ASSERT_EQ(v5.id, v4.id);
  ExpectRead(cache.get(), v5, 0, 2 * kBlock);

  // Old versions of the path were dropped on first sight of the new one: only v5's
  // block 0 and its one-byte block 1 (a page) are held.
  auto s = cache->Stats();
  EXPECT_EQ(s.used_bytes, kBlock + 4096);
}

TEST_P(BlockCacheTest, InvalidateDropsEveryBlockOfTheFile) {
  File a = Make("a", Pattern(2 * kBlock, 20));
  File b = Make("b", Pattern(kBlock, 21));
  auto cache = NewCache(16 * kBlock, 0);
  ExpectRead(cache.get(), a, 0, 2 * kBlock);
  ExpectRead(cache.get(), b, 0, kBlock);
  cache->Invalidate(a.id.path);
  EXPECT_EQ(cache->Stats().used_bytes, kBlock);
  ExpectRead(cache.get(), a, 0, 2 * kBlock);
  EXPECT_EQ(dir_->pread_calls(), 5u);  // a re-read, b still cached
  ExpectRead(cache.get(), b, 0, kBlock);
  EXPECT_EQ(dir_->pread_calls(), 5u);
}

TEST_P(BlockCacheTest, InvalidateDuringAReadStillServesItsCallerAndFreesTheBlock) {
  File f = Make("f", Pattern(kBlock, 22));
  Latch latch;
  auto cache = NewCache(4 * kBlock, 0);
  dir_->SetHook([&](int, off_t, size_t) {
    latch.Wait();
    return 0;
  });
  std::thread reader([&] { ExpectRead(cache.get(), f, 0, kBlock); });
  latch.AwaitWaiters(1);
  cache->Invalidate(f.id.path);
  EXPECT_EQ(cache->Stats().used_bytes, kBlock);  // still in flight, still counted
  latch.Open();
  reader.join();
  EXPECT_EQ(cache->Stats().used_bytes, 0u);
}

TEST_P(BlockCacheTest, ReadErrorReachesEveryWaiterAndARetrySucceeds) {
  File f = Make("f", Pattern(2 * kBlock, 30));
  Latch latch;
  auto cache = NewCache(8 * kBlock, 0);
  std::atomic<bool> faulty{true};
  dir_->SetHook([&](int, off_t offset, size_t) {
    if (offset != static_cast<off_t>(kBlock) || !faulty.load()) return 0;
    latch.Wait();
    return EIO;
  });

  constexpr int kReaders = 6;
  std::vector<Result<size_t>> results(kReaders, Result<size_t>(size_t{0}));
  std::vector<std::thread> readers;
  for (int i = 0; i < kReaders; ++i) {
    readers.emplace_back([&, i] {
      std::string buf(kBlock, '\0');
      results[i] = cache->Read(f.id, buf.data(), kBlock, kBlock + 10);
    });
  }
  ASSERT_TRUE(WaitUntil([&] { return cache->Stats().dedup_waits == kReaders - 1; }));
  latch.Open();
  for (auto& t : readers) t.join();

  for (const auto& r : results) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kIo) << r.status().ToString();
  }
  auto s = cache->Stats();
  EXPECT_EQ(dir_->pread_calls(), 1u);
  EXPECT_EQ(s.read_errors, 1u);
  EXPECT_EQ(s.used_bytes, 0u);  // the failed block is neither cached nor charged

  faulty = false;
  ExpectRead(cache.get(), f, kBlock + 10, kBlock);
  ExpectRead(cache.get(), f, 0, 2 * kBlock);
  EXPECT_EQ(dir_->pread_calls(), 3u);
}

TEST_P(BlockCacheTest, ReadsAreClampedAtEndOfFileAndAtAShrunkFile) {
  const uint64_t size = 2 * kBlock + 100;
  File f = Make("f", Pattern(size, 40));
  auto cache = NewCache(8 * kBlock, 0);
  ExpectRead(cache.get(), f, size - 50, 4096);  // crosses EOF
  ExpectRead(cache.get(), f, size, 10);         // at EOF
  ExpectRead(cache.get(), f, size + 1000, 10);  // past EOF
  ExpectRead(cache.get(), f, 0, 0);

  // The key says 2 blocks + 100, but someone truncated the file underneath: the read
  // returns what exists, never stale or garbage bytes.
  File g = Make("g", Pattern(size, 41));
  ASSERT_EQ(::truncate((tmp_.path() + "/g").c_str(), static_cast<off_t>(kBlock + 10)), 0);
  std::string buf(size, '\0');
  Bind(cache.get(), g);  // the caller vouches for the id, as the fs read path does
  auto n = cache->Read(g.id, buf.data(), size, 0);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, kBlock + 10);
  EXPECT_EQ(0, std::memcmp(buf.data(), g.contents.data(), *n));
}

TEST_P(BlockCacheTest, ReadInPlaceGivesTheBytesOfReadPinnedAndFallsBackOnLongRanges) {
  const uint64_t size = 3 * kBlock + 100;
  File f = Make("f", Pattern(size, 42));
  auto cache = NewCache(8 * kBlock, 0, /*read_parallelism=*/2);
  Bind(cache.get(), f);
  auto in_place = [&](uint64_t offset, size_t len) {
    std::string got;
    int calls = 0;
    auto n = cache->ReadInPlace(f.id, len, offset, [&](std::span<const struct iovec> iov) {
      ++calls;
      for (const struct iovec& v : iov) got.append(static_cast<const char*>(v.iov_base), v.iov_len);
    });
    EXPECT_TRUE(n.ok()) << n.status().ToString();
    if (!n.ok() || !*n) {
      EXPECT_EQ(calls, 0);
      return std::optional<std::string>();
    }
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(**n, got.size());
    return std::optional<std::string>(got);
  };
  // Within a block, across a block boundary (cold, then cached), at and past the end.
  for (auto [offset, len] : std::vector<std::pair<uint64_t, size_t>>{
           {10, 4096}, {kBlock - 7, 100}, {kBlock - 7, 100}, {size - 50, 4096}, {size, 10},
           {size + 5, 10}, {0, 0}}) {
    auto got = in_place(offset, len);
    ASSERT_TRUE(got.has_value()) << offset;
    const size_t want = offset >= size ? 0 : std::min<size_t>(len, size - offset);
    EXPECT_EQ(*got, f.contents.substr(std::min<uint64_t>(offset, size), want)) << offset;
  }
  // More blocks than one batch pins: the caller is told to Read() instead.
  EXPECT_FALSE(in_place(0, 3 * kBlock).has_value());
  ExpectRead(cache.get(), f, 0, size);
  EXPECT_EQ(cache->Stats().used_bytes, Pages(size));  // every block cached once, nothing leaked
}

TEST_P(BlockCacheTest, PrefetchFillsTheCacheSoALaterReadHits) {
  const uint64_t size = 6 * kBlock + 5;
  File f = Make("item", Pattern(size, 50));
  auto cache = NewCache(16 * kBlock, 2);
  cache->Prefetch(f.id, 0, size);
  ASSERT_TRUE(WaitUntil([&] { return cache->Stats().prefetched_bytes == size; }));
  const uint64_t reads = dir_->pread_calls();
  EXPECT_EQ(reads, 7u);

  ExpectRead(cache.get(), f, 0, size);
  auto s = cache->Stats();
  EXPECT_EQ(dir_->pread_calls(), reads);
  EXPECT_EQ(s.misses, 0u);
  EXPECT_EQ(s.hits, 7u);
  EXPECT_EQ(s.prefetch_hits, 7u);
  EXPECT_EQ(s.backing_bytes_read, size);
}

TEST_P(BlockCacheTest, PrefetchStopsRatherThanEvictBlocksInUse) {
  File f = Make("big", Pattern(8 * kBlock, 60));
  File cold = Make("cold", Pattern(2 * kBlock, 61));
  auto cache = NewCache(4 * kBlock, 1);

  // Blocks used before the request are fair game for it...
  ExpectRead(cache.get(), cold, 0, 2 * kBlock);
  // ...but the blocks it brought in itself are not: it fills the budget and stops.
  cache->Prefetch(f.id, 0, 8 * kBlock);
  ASSERT_TRUE(WaitUntil([&] { return cache->Stats().prefetch_dropped == 1; }));
  auto s = cache->Stats();
  EXPECT_EQ(s.prefetched_bytes, 4 * kBlock);
  EXPECT_EQ(s.evictions, 2u);  // the two cold blocks, nothing prefetched
  EXPECT_EQ(s.used_bytes, 4 * kBlock);
  ExpectRead(cache.get(), f, 0, 4 * kBlock);
  EXPECT_EQ(cache->Stats().hits, 4u);
}

TEST_P(BlockCacheTest, DemandMissIsNotDelayedByALongPrefetchQueue) {
  File slow = Make("slow", Pattern(64 * kBlock, 70));
  File other = Make("other", Pattern(2 * kBlock, 71));
  Latch latch;
  auto cache = NewCache(32 * kBlock, 2);
  // By inode: an O_DIRECT read comes through a second descriptor of the same file.
  const ino_t slow_ino = slow.st.st_ino;
  dir_->SetHook([&latch, slow_ino](int fd, off_t, size_t) {
    struct stat st;
    if (::fstat(fd, &st) == 0 && st.st_ino == slow_ino) latch.Wait();
    return 0;
  });
  for (uint64_t b = 0; b < 64; ++b) cache->Prefetch(slow.id, b * kBlock, kBlock);
  latch.AwaitWaiters(2);  // both prefetch threads stalled, the queue is long

  ExpectRead(cache.get(), other, 0, 2 * kBlock);  // completes while they are stalled
  auto s = cache->Stats();
  EXPECT_EQ(s.misses, 2u);
  EXPECT_EQ(s.prefetched_bytes, 0u);
  latch.Open();
}

TEST_P(BlockCacheTest, DemandReadJoinsAPrefetchInFlight) {
  File f = Make("f", Pattern(kBlock, 80));
  Latch latch;
  auto cache = NewCache(8 * kBlock, 1);
  dir_->SetHook([&](int, off_t, size_t) {
    latch.Wait();
    return 0;
  });
  cache->Prefetch(f.id, 0, kBlock);
  latch.AwaitWaiters(1);
  std::thread reader([&] { ExpectRead(cache.get(), f, 100, 1000); });
  ASSERT_TRUE(WaitUntil([&] { return cache->Stats().dedup_waits == 1; }));
  latch.Open();
  reader.join();
  EXPECT_EQ(dir_->pread_calls(), 1u);
  EXPECT_EQ(cache->Stats().misses, 0u);
}

TEST_P(BlockCacheTest, DestructorJoinsWithPrefetchesPending) {
  File f = Make("f", Pattern(32 * kBlock, 90));
  Latch latch;
  auto cache = NewCache(64 * kBlock, 1);
  Bind(cache.get(), f);
  dir_->SetHook([&](int, off_t, size_t) {
    latch.Wait();
    return 0;
  });
  for (uint64_t b = 0; b < 32; ++b) cache->Prefetch(f.id, b * kBlock, kBlock);
  latch.AwaitWaiters(1);
  std::thread destroyer([&] { cache.reset(); });
  latch.Open();
  destroyer.join();
  EXPECT_EQ(cache, nullptr);
  // Only the test's: the source only borrows a lent descriptor, and no queued request or
  // block kept the file open.
  EXPECT_EQ(f.fd.use_count(), 1);
  EXPECT_LE(dir_->pread_calls(), 32u);
}

TEST_P(BlockCacheTest, DemandMissesEvictServedBlocksBeforeUnreadPrefetchedOnes) {
  File ahead = Make("ahead", Pattern(2 * kBlock, 110));
  File served = Make("served", Pattern(2 * kBlock, 111));
  File other = Make("other", Pattern(2 * kBlock, 112));
  auto cache = NewCache(4 * kBlock, 1);
  cache->Prefetch(ahead.id, 0, 2 * kBlock);
  ASSERT_TRUE(WaitUntil([&] { return cache->Stats().prefetched_bytes == 2 * kBlock; }));
  ExpectRead(cache.get(), served, 0, 2 * kBlock);  // newer in LRU order than `ahead`
  // Full. The two misses must push out the served blocks, not the two prefetched ones
  // nobody has read yet, although those are the least recently used.
  ExpectRead(cache.get(), other, 0, 2 * kBlock);
  ExpectRead(cache.get(), ahead, 0, 2 * kBlock);
  auto s = cache->Stats();
  EXPECT_EQ(s.prefetch_hits, 2u);
  EXPECT_EQ(s.backing_bytes_read, 6 * kBlock);  // every block read once
  EXPECT_LE(s.peak_used_bytes, 4 * kBlock);
}

// True if files in `dir` can be opened with O_DIRECT (tmpfs on kernel 6.1 cannot).
bool TakesODirect(const std::string& dir) {
  const std::string probe = dir + "/.odirect-probe";
  int fd = ::open(probe.c_str(), O_CREAT | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  return fd >= 0;
}

TEST_P(BlockCacheTest, DirectReadsWhereTheFileSystemTakesThemAndExactBytesEitherWay) {
  // Sizes that are not multiples of the O_DIRECT alignment: the last block is short.
  File a = Make("a", Pattern(5 * kBlock + 123, 100));
  File b = Make("b", Pattern(777, 101));
  auto cache = NewCache(16 * kBlock, 0);
  ExpectRead(cache.get(), a, 0, 5 * kBlock + 123);
  ExpectRead(cache.get(), a, 4 * kBlock + 5, 9999);
  ExpectRead(cache.get(), b, 0, 4096);
  auto s = cache->Stats();
  EXPECT_EQ(s.backing_bytes_read, 5 * kBlock + 123 + 777);
  const BackingSourceStats src = source_->Stats();
  EXPECT_EQ(src.bytes_read, s.backing_bytes_read);
  if (GetParam() && TakesODirect(tmp_.path())) {
    EXPECT_EQ(src.direct_bytes_read, s.backing_bytes_read);
  } else {
    EXPECT_EQ(src.direct_bytes_read, 0u);
  }
}

TEST_P(BlockCacheTest, FreedBlockBuffersAreReusedWithinTheBudget) {
  const uint64_t budget = 8 * kBlock;
  File a = Make("a", Pattern(6 * kBlock, 102));
  File b = Make("b", Pattern(20 * kBlock, 103));
  auto cache = NewCache(budget, 0);
  ExpectRead(cache.get(), a, 0, 6 * kBlock);
  cache->Invalidate(a.id.path);  // six full-block buffers become free
  auto s = cache->Stats();
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.free_buffer_bytes, 6 * kBlock);
  ExpectRead(cache.get(), b, 0, 4 * kBlock);  // takes four of them
  s = cache->Stats();
  EXPECT_EQ(s.used_bytes, 4 * kBlock);
  EXPECT_EQ(s.free_buffer_bytes, 2 * kBlock);
  // Reading past the budget evicts; held + kept buffers never exceed it.
  for (uint64_t off = 0; off < 20 * kBlock; off += 3 * kBlock) {
    ExpectRead(cache.get(), b, off, 3 * kBlock);
    s = cache->Stats();
    EXPECT_LE(s.used_bytes + s.free_buffer_bytes, budget);
  }
  EXPECT_GT(s.evictions, 0u);
}

TEST_P(BlockCacheTest, APeerRequestThroughReadBlockJoinsTheFlightOfALocalRead) {
  File f = Make("shard", Pattern(2 * kBlock + 7, 120));
  Latch latch;
  auto cache = NewCache(8 * kBlock, 0);
  dir_->SetHook([&](int, off_t, size_t) {
    latch.Wait();
    return 0;
  });
  std::thread local([&] { ExpectRead(cache.get(), f, 0, 2 * kBlock + 7); });
  latch.AwaitWaiters(1);  // the local read's first block is in flight
  // A PeerServer serves through the cache as a BlockSource, into its own buffer.
  std::string peer(kBlock, '\0');
  Result<BlockRead> got = Status(Code::kInternal, "not run");
  std::thread remote([&] { got = cache->ReadBlock(f.id, kBlock, std::span<char>(peer)); });
  ASSERT_TRUE(WaitUntil([&] { return cache->Stats().dedup_waits >= 1; }));
  latch.Open();
  local.join();
  remote.join();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->bytes, kBlock);
  EXPECT_EQ(0, std::memcmp(peer.data(), f.contents.data() + kBlock, kBlock));
  EXPECT_EQ(dir_->pread_calls(), 3u);  // every block read once, for both
  EXPECT_EQ(cache->Stats().misses, 3u);

  // The last, short block; then past the end.
  got = cache->ReadBlock(f.id, 2 * kBlock, std::span<char>(peer));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->bytes, 7u);
  EXPECT_EQ(0, std::memcmp(peer.data(), f.contents.data() + 2 * kBlock, 7));
  EXPECT_EQ(cache->ReadBlock(f.id, 2 * kBlock + 8, std::span<char>(peer)).status().code(),
            Code::kInvalid);
  EXPECT_EQ(dir_->pread_calls(), 3u);
}

TEST_P(BlockCacheTest, MissesOpenByPathWhenNoDescriptorIsLentAndAStaleIdIsNeverCached) {
  File f = Make("f", Pattern(3 * kBlock, 130));
  File g = Make("g", Pattern(3 * kBlock, 131));
  auto cache = NewCache(16 * kBlock, 0);
  // No Bind: the source opens "g" by its relative path, once (the first block alone, so
  // that no two helper threads race to open it before it is bound), then reuses it.
  std::string buf(3 * kBlock, '\0');
  auto n = cache->Read(g.id, buf.data(), kBlock, 0);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  n = cache->Read(g.id, buf.data(), buf.size(), 0);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 3 * kBlock);
  EXPECT_EQ(0, std::memcmp(buf.data(), g.contents.data(), *n));
  EXPECT_EQ(source_->Stats().opens, 1u);

  // Rewritten in place with a new mtime: the old id is stale. The blocks already cached are
  // that version's bytes, still right; a block not cached is refused, never read from the
  // new version, and not cached.
  cache->Invalidate("g");
  File g2 = Make("g", Pattern(3 * kBlock, 132), 5000);
  n = cache->Read(g.id, buf.data(), kBlock, kBlock);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), Code::kAborted) << n.status().ToString();
  auto s = cache->Stats();
  EXPECT_EQ(s.read_errors, 1u);
  EXPECT_EQ(s.used_bytes, 0u);
  // The current id reads the current bytes.
  n = cache->Read(g2.id, buf.data(), buf.size(), 0);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(0, std::memcmp(buf.data(), g2.contents.data(), buf.size()));

  // Gone: NotFound, to every reader of the flight.
  ASSERT_EQ(::unlink((tmp_.path() + "/g").c_str()), 0);
  cache->Invalidate("g");
  source_->Forget("g");
  n = cache->Read(g2.id, buf.data(), kBlock, 0);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), Code::kNotFound) << n.status().ToString();

  // Confined: a name that leaves the backing directory is refused by BackingDir.
  const uint64_t preads = dir_->pread_calls();
  BlockId escape{"../" + std::filesystem::path(tmp_.path()).filename().string() + "/f",
                 f.id.size, f.id.mtime_ns};
  n = cache->Read(escape, buf.data(), kBlock, 0);
  EXPECT_FALSE(n.ok());
  EXPECT_EQ(dir_->pread_calls(), preads);
}

INSTANTIATE_TEST_SUITE_P(Io, BlockCacheTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "Direct" : "Buffered");
                         });

}  // namespace
}  // namespace ckptfs::store
