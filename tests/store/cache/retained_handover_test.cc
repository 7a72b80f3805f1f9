// The hand-over of issue 42: a flushed staging chunk becomes the retained tier's block, no
// copy, and the staging pool puts a spare in its place. The real parts of a save: StagedFile
// writes into a StagingPool (host memory), a FlushPipeline writes the chunks to a backing
// temp file and tells the RetainedTier, which the test publishes and commits as the journal
// does. Checked: staging keeps every chunk after hand-overs (G6), the retained bytes are
// byte-exact, a chunk the tier refuses goes back to the pool, a reader keeps a chunk out of
// the pool until its reply returns, and a stop gives every chunk back.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu/staging_pool.h"
#include "store/cache/backing_source.h"
#include "store/cache/retained_tier.h"
#include "store/flush/flush_pipeline.h"
#include "store/flush/staged_file.h"
#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {


constexpr size_t kChunk = size_t{128} << 10;  // a staging chunk holds two tier blocks
constexpr size_t kBlock = size_t{64} << 10;
constexpr size_t kStagingChunks = 8;

std::string Pattern(size_t n, int seed) {
  std::string s(n, '\0');
  uint32_t x = 2654435761u * static_cast<uint32_t>(seed + 1);
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    s[i] = static_cast<char>(x >> 24);
  }
  return s;
}

class RetainedHandoverTest : public ::testing::Test {
 protected:
  void Make(size_t budget_chunks) {
    auto dir = BackingDir::Open(tmp_.path());
    ASSERT_TRUE(dir.ok());
    backing_ = std::move(dir).value();
    gpu::StagingOptions po;
    po.chunk_bytes = kChunk;
    po.total_bytes = kStagingChunks * kChunk;
    po.backend = "host";
    auto pool = gpu::StagingPool::Create(po);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    pool_ = std::move(pool).value();
    RetainedTierOptions to;
    to.budget_bytes = budget_chunks * kChunk;
    to.block_bytes = kBlock;
    to.lender = pool_.get();
    tier_ = std::make_unique<RetainedTier>(backing_.get(), to);
    pool_->SetLendLimit(to.budget_bytes);
    FlushOptions fo;
    fo.threads = 1;  // chunks flushed in file order: which ones fit the budget is known
    fo.direct_io = false;
    fo.on_written = tier_.get();
    auto pipeline = FlushPipeline::Create(backing_.get(), fo);
    ASSERT_TRUE(pipeline.ok());
    pipeline_ = std::move(pipeline).value();
  }

  void TearDown() override {
    // The order of a daemon's stop: the tier lets go of every chunk before the pool goes.
    pipeline_.reset();
    if (tier_) tier_->DropAll();
    tier_.reset();
    if (pool_) EXPECT_EQ(pool_->lent_bytes(), 0u);
    pool_.reset();
  }

  // Writes `data` as the application would (`piece` bytes per write) into a new staged
  // file; `seal_at`: the staging pressure seals the active chunk once that many bytes are
  // in. Returns its flush target once every chunk was flushed.
  std::shared_ptr<FlushTarget> Stage(const std::string& data, bool retainable = true,
                                            size_t piece = 48 << 10, size_t seal_at = 0) {
    const std::string temp = ".ckptfs-tmp." + std::to_string(++next_id_);
    auto fd = backing_->OpenFile(temp, O_RDWR | O_CREAT | O_EXCL, 0644);
    EXPECT_TRUE(fd.ok());
    auto target = std::make_shared<FlushTarget>(next_id_, std::move(*fd), retainable);
    auto file = std::make_shared<StagedFile>(
        StagingContext{pool_.get(), pipeline_.get(), backing_.get()}, target, 0);
    for (size_t off = 0; off < data.size(); off += piece) {
      if (seal_at != 0 && off == seal_at) file->SealIfIdle();
      const size_t n = std::min(piece, data.size() - off);
      EXPECT_TRUE(file->Write(data.data() + off, n, off).ok());
    }
    file->SealAll();
    EXPECT_TRUE(target->Settled().ok());
    temps_[target->id()] = temp;
    return target;
  }

  // What the journal does: the temp file renamed to its name, then the tier told.
  void Publish(const std::string& path, uint64_t size,
               const std::shared_ptr<FlushTarget>& target) {
    std::filesystem::create_directories(
        std::filesystem::path(tmp_.path() + "/" + path).parent_path());
    ASSERT_EQ(::rename((tmp_.path() + "/" + temps_[target->id()]).c_str(),
                       (tmp_.path() + "/" + path).c_str()),
              0);
    JournalEntry e;
    e.op = OpType::kPublish;
    e.path = path;
    e.size = size;
    e.target = target;
    tier_->OnJournalDone(e, Status::Ok());
  }

  void Save(const std::string& path, const std::string& data, size_t seal_at = 0) {
    auto target = Stage(data, true, 48 << 10, seal_at);
    Publish(path, data.size(), target);
  }

  void Commit(const std::string& dir) {
    std::ofstream(tmp_.path() + "/" + dir + "/.metadata") << "meta";
    JournalEntry e;
    e.op = OpType::kPublish;
    e.path = dir + "/.metadata";
    e.size = 4;
    tier_->OnJournalDone(e, Status::Ok());
  }

  BlockId Id(const std::string& path) {
    struct stat st {};
    EXPECT_EQ(::stat((tmp_.path() + "/" + path).c_str(), &st), 0);
    return BlockIdFromStat(path, st);
  }

  // The whole file as the tier serves it in place, or "" when any block is not served.
  std::string ReadAll(const std::string& path) {
    const BlockId id = Id(path);
    std::string got;
    auto n = tier_->ReadInPlace(id, id.size, 0, [&](std::span<const struct iovec> iov) {
      for (const struct iovec& v : iov) got.append(static_cast<const char*>(v.iov_base), v.iov_len);
    });
    return n ? got : std::string();
  }

  // Every chunk staging can hand out at once.
  size_t FreeStagingChunks() {
    std::vector<gpu::ChunkBuffer> all;
    while (gpu::ChunkBuffer b = pool_->TryAcquireFor(std::chrono::milliseconds(0))) {
      all.push_back(std::move(b));
    }
    return all.size();
  }

  ScopedTempDir tmp_{"ckptfs-handover-test"};
  std::unique_ptr<BackingDir> backing_;
  std::unique_ptr<gpu::StagingPool> pool_;
  std::unique_ptr<RetainedTier> tier_;
  std::unique_ptr<FlushPipeline> pipeline_;
  uint64_t next_id_ = 0;
  std::map<uint64_t, std::string> temps_;
};

TEST_F(RetainedHandoverTest, FlushedChunksAreKeptWithoutACopyAndStagingKeepsEveryChunk) {
  Make(/*budget_chunks=*/16);
  const std::string data = Pattern(6 * kChunk + 5000, 1);  // six full chunks and a tail
  Save("run/step1/__0_0.distcp", data);
  RetainedTierStats s = tier_->Stats();
  EXPECT_EQ(s.loans, 6u);
  EXPECT_EQ(s.kept_bytes, 6 * kChunk) << "the full chunks are the retained blocks";
  EXPECT_EQ(s.captured_bytes, 5000u) << "only the tail (a chunk mostly empty) is copied";
  EXPECT_EQ(pool_->lent_bytes(), 6 * kChunk);
  EXPECT_EQ(pool_->total_chunks(), kStagingChunks);
  EXPECT_EQ(FreeStagingChunks(), kStagingChunks) << "staging lost chunks to the hand-over";
  EXPECT_EQ(ReadAll("run/step1/__0_0.distcp"), "") << "served before the commit";
  Commit("run/step1");
  EXPECT_EQ(ReadAll("run/step1/__0_0.distcp"), data);
  s = tier_->Stats();
  EXPECT_EQ(s.retained_bytes, data.size());
  EXPECT_LE(s.used_bytes + pool_->spare_bytes(), 16 * kChunk);

  // The next save of the run: the older checkpoint is dropped at its commit and its chunks
  // come back as spares, which later loans take (no allocation per loan once it has run).
  const std::string next = Pattern(6 * kChunk, 2);
  Save("run/step2/__0_0.distcp", next);
  Commit("run/step2");
  EXPECT_EQ(ReadAll("run/step2/__0_0.distcp"), next);
  EXPECT_FALSE(tier_->Holds(Id("run/step1/__0_0.distcp"), 0));
  EXPECT_EQ(pool_->lent_bytes(), 6 * kChunk);
  EXPECT_EQ(pool_->spare_bytes(), 6 * kChunk) << "step1's chunks";
  const uint64_t allocs = pool_->lend_allocs();
  const std::string third = Pattern(6 * kChunk, 3);
  Save("run/step3/__0_0.distcp", third);
  EXPECT_EQ(pool_->lend_allocs(), allocs) << "the spares were taken";
  Commit("run/step3");
  EXPECT_EQ(ReadAll("run/step3/__0_0.distcp"), third);
  EXPECT_EQ(FreeStagingChunks(), kStagingChunks);
  EXPECT_LE(tier_->Stats().peak_used_bytes, 16 * kChunk);
}

TEST_F(RetainedHandoverTest, AChunkTheTierRefusesGoesBackToThePool) {
  Make(/*budget_chunks=*/2);
  // Fresh pending saves are never evicted: past two chunks the tier has no room.
  const std::string data = Pattern(5 * kChunk, 4);
  Save("run/step1/__0_0.distcp", data);
  RetainedTierStats s = tier_->Stats();
  EXPECT_EQ(s.loans, 2u);
  EXPECT_GT(s.skipped_bytes, 0u);
  EXPECT_EQ(pool_->lent_bytes(), 2 * kChunk);
  EXPECT_EQ(pool_->spare_bytes(), 0u);
  EXPECT_EQ(FreeStagingChunks(), kStagingChunks) << "a refused chunk did not come back";
  Commit("run/step1");
  EXPECT_EQ(ReadAll("run/step1/__0_0.distcp"), "") << "partly held: not served whole";
  const BlockId id = Id("run/step1/__0_0.distcp");
  for (uint64_t i = 0; i < 4; ++i) EXPECT_TRUE(tier_->Holds(id, i)) << i;
  EXPECT_FALSE(tier_->Holds(id, 4));
  std::string block(kBlock, '\0');
  auto r = tier_->Lookup(id, 3 * kBlock, std::span<char>(block.data(), block.size()));
  ASSERT_TRUE(r);
  EXPECT_EQ(block, data.substr(3 * kBlock, kBlock));

  // A file that is not a checkpoint's is passed over: nothing lent, nothing copied.
  const uint64_t loans = tier_->Stats().loans;
  (void)Stage(Pattern(3 * kChunk, 5), /*retainable=*/false);
  EXPECT_EQ(tier_->Stats().loans, loans);
  EXPECT_EQ(tier_->Stats().captured_bytes, 0u);
  EXPECT_EQ(FreeStagingChunks(), kStagingChunks);
}

TEST_F(RetainedHandoverTest, AChunkSealedMidBlockIsCompletedByACopyAndServedExactly) {
  Make(/*budget_chunks=*/16);
  // Sealed at 96 KiB (staging pressure): block 1 starts in that chunk and ends in the next.
  const std::string data = Pattern(4 * kChunk, 6);
  Save("run/step1/__0_0.distcp", data, /*seal_at=*/96 << 10);
  const RetainedTierStats s = tier_->Stats();
  EXPECT_GT(s.captured_bytes, 0u) << "block 1 became a copy";
  EXPECT_GT(s.kept_bytes, s.captured_bytes);
  Commit("run/step1");
  EXPECT_EQ(ReadAll("run/step1/__0_0.distcp"), data);
}

TEST_F(RetainedHandoverTest, AReaderKeepsItsChunkOutOfThePoolUntilItsReplyReturns) {
  Make(/*budget_chunks=*/16);
  const std::string data = Pattern(2 * kChunk, 7);
  Save("run/step1/__0_0.distcp", data);
  Commit("run/step1");
  const BlockId id = Id("run/step1/__0_0.distcp");
  std::string got;
  size_t lent_during = 0, spare_during = 0;
  auto n = tier_->ReadInPlace(id, kBlock, 0, [&](std::span<const struct iovec> iov) {
    // The checkpoint is dropped (a stop) while the reply is being written.
    tier_->DropAll();
    lent_during = pool_->lent_bytes();
    spare_during = pool_->spare_bytes();
    for (const struct iovec& v : iov) got.append(static_cast<const char*>(v.iov_base), v.iov_len);
  });
  ASSERT_TRUE(n);
  EXPECT_EQ(got, data.substr(0, kBlock));
  EXPECT_EQ(lent_during, kChunk) << "the chunk being replied from went back to staging";
  EXPECT_EQ(spare_during, kChunk) << "the other chunk had no reader";
  EXPECT_EQ(pool_->lent_bytes(), 0u);
  EXPECT_EQ(pool_->spare_bytes(), 2 * kChunk);
  EXPECT_EQ(FreeStagingChunks(), kStagingChunks);
}

}  // namespace
}  // namespace ckptfs::store
