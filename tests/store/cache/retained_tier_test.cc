// RetainedTier (issue 23): what a committed checkpoint leaves in memory, and what it never
// serves. Drives the tier the way the flush pipeline and the journal do, over a real
// backing directory in a temp dir.
#include "store/cache/retained_tier.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "store/cache/backing_source.h"
#include "store/cache/retained_bytes.h"
#include "store/primitives/crc32c.h"
#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {

constexpr uint64_t kBlock = 128 << 10;  // two 64 KiB CRC blocks

std::string Pattern(size_t n, int seed) {
  std::string s(n, '\0');
  uint32_t x = 2654435761u * static_cast<uint32_t>(seed + 1);
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    s[i] = static_cast<char>(x >> 24);
  }
  return s;
}

class RetainedTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = BackingDir::Open(tmp_.path());
    ASSERT_TRUE(dir.ok());
    backing_ = std::move(dir).value();
  }

  std::unique_ptr<RetainedTier> MakeTier(uint64_t budget_blocks) {
    RetainedTierOptions o;
    o.budget_bytes = budget_blocks * kBlock;
    o.block_bytes = kBlock;
    auto tier = std::make_unique<RetainedTier>(backing_.get(), o);
    tier->SetClockForTest([this] { return now_; });
    return tier;
  }

  // What the flush pipeline and the journal do for one file written through the mount:
  // chunks recorded and captured, the file on the backing store, its publish applied.
  void Save(RetainedTier* tier, const std::string& path, const std::string& bytes,
            size_t chunk = 96 << 10) {
    auto target = std::make_shared<FlushTarget>(++next_id_, UniqueFd());
    auto crcs = std::make_shared<BlockCrcMap>();
    for (size_t off = 0; off < bytes.size(); off += chunk) {
      const size_t n = std::min(chunk, bytes.size() - off);
      const auto* p = reinterpret_cast<const uint8_t*>(bytes.data() + off);
      crcs->Record(off, p, n);
      Written(tier, target, crcs, off, p, n);
    }
    WriteBacking(path, bytes);
    Publish(tier, path, bytes.size(), target);
  }

  // What a flush thread tells the tier after a chunk's write: here with no lender, so
  // the tier copies what it keeps (the hand-over is tested over the real staging pool in
  // tests/fs/retained_handover_test.cc).
  static void Written(RetainedTier* tier, const std::shared_ptr<FlushTarget>& target,
                      const std::shared_ptr<BlockCrcMap>& crcs, uint64_t offset,
                      const uint8_t* data, size_t length) {
    SealedChunk c;
    c.target = target;
    c.offset = offset;
    c.data = data;
    c.length = length;
    tier->OnWritten(crcs, c);
  }

  void Publish(RetainedTier* tier, const std::string& path, uint64_t size,
               std::shared_ptr<FlushTarget> target) {
    JournalEntry e;
    e.op = OpType::kPublish;
    e.path = path;
    e.size = size;
    e.target = std::move(target);
    tier->OnJournalDone(e, Status::Ok());
  }

  void WriteBacking(const std::string& path, const std::string& bytes) {
    std::filesystem::create_directories(std::filesystem::path(tmp_.path() + "/" + path).parent_path());
    std::ofstream f(tmp_.path() + "/" + path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }

  void Commit(RetainedTier* tier, const std::string& dir) {
    WriteBacking(dir + "/.metadata", "meta");
    Publish(tier, dir + "/.metadata", 4, nullptr);
  }

  BlockId Id(const std::string& path) {
    struct stat st {};
    EXPECT_EQ(::stat((tmp_.path() + "/" + path).c_str(), &st), 0);
    return BlockIdFromStat(path, st);
  }

  // Block `index` of `path` from the tier, or nullopt.
  std::optional<std::string> Get(RetainedTier* tier, const std::string& path, uint64_t index) {
    const BlockId id = Id(path);
    const uint64_t off = index * kBlock;
    const size_t len = std::min<uint64_t>(kBlock, id.size - off);
    // As the block cache asks: its whole buffer, rounded up for O_DIRECT.
    std::string out((len + 4095) / 4096 * 4096, '\0');
    auto r = tier->Lookup(id, off, std::span<char>(out.data(), out.size()));
    if (!r) return std::nullopt;
    EXPECT_EQ(r->bytes, len);
    out.resize(len);
    EXPECT_EQ(r->crc32c, Crc32c(out.data(), out.size()));
    return out;
  }

  ScopedTempDir tmp_{"ckptfs-retained-test"};
  std::unique_ptr<BackingDir> backing_;
  uint64_t next_id_ = 0;
  std::chrono::steady_clock::time_point now_ = std::chrono::steady_clock::now();
};

TEST_F(RetainedTierTest, ServesACheckpointOnlyOnceCommitted) {
  auto tier = MakeTier(16);
  const std::string data = Pattern(2 * kBlock + 1000, 1);  // two full blocks and a tail
  Save(tier.get(), "run/step1/__0_0.distcp", data);
  EXPECT_FALSE(Get(tier.get(), "run/step1/__0_0.distcp", 0)) << "served before the commit";
  Commit(tier.get(), "run/step1");
  for (uint64_t i = 0; i < 3; ++i) {
    auto got = Get(tier.get(), "run/step1/__0_0.distcp", i);
    ASSERT_TRUE(got) << i;
    EXPECT_EQ(*got, data.substr(i * kBlock, got->size())) << i;
  }
  const RetainedTierStats s = tier->Stats();
  EXPECT_EQ(s.retained_bytes, data.size());
  EXPECT_EQ(s.hits, 3u);
  EXPECT_EQ(s.capture_bytes, 0u);
  EXPECT_LE(s.used_bytes, 16 * kBlock);
}

TEST_F(RetainedTierTest, BudgetIsAHardBoundAndACaptureNeverWaits) {
  auto tier = MakeTier(3);
  const std::string data = Pattern(6 * kBlock, 2);
  Save(tier.get(), "run/step1/__0_0.distcp", data);  // returns: nothing waits for room
  Commit(tier.get(), "run/step1");
  RetainedTierStats s = tier->Stats();
  EXPECT_LE(s.peak_used_bytes, 3 * kBlock);
  EXPECT_GT(s.skipped_bytes, 0u);
  int held = 0;
  for (uint64_t i = 0; i < 6; ++i) {
    if (auto got = Get(tier.get(), "run/step1/__0_0.distcp", i)) {
      EXPECT_EQ(*got, data.substr(i * kBlock, kBlock));
      ++held;
    }
  }
  EXPECT_EQ(held, 3);
  // A new save makes room by evicting the committed checkpoint: the save is newer.
  const std::string next = Pattern(2 * kBlock, 3);
  Save(tier.get(), "run/step2/__0_0.distcp", next);
  Commit(tier.get(), "run/step2");
  EXPECT_TRUE(Get(tier.get(), "run/step2/__0_0.distcp", 1));
  EXPECT_FALSE(Get(tier.get(), "run/step1/__0_0.distcp", 0));
  EXPECT_LE(tier->Stats().peak_used_bytes, 3 * kBlock);
}

TEST_F(RetainedTierTest, NewerCommittedCheckpointOfARunDropsOlderOnes) {
  auto tier = MakeTier(64);
  Save(tier.get(), "run/step1/__0_0.distcp", Pattern(kBlock, 4));
  Commit(tier.get(), "run/step1");
  Save(tier.get(), "other/step9/__0_0.distcp", Pattern(kBlock, 5));
  Commit(tier.get(), "other/step9");
  Save(tier.get(), "run/step2/__0_0.distcp", Pattern(kBlock, 6));
  EXPECT_TRUE(Get(tier.get(), "run/step1/__0_0.distcp", 0)) << "step2 is not committed yet";
  Commit(tier.get(), "run/step2");
  EXPECT_FALSE(Get(tier.get(), "run/step1/__0_0.distcp", 0));
  EXPECT_TRUE(Get(tier.get(), "run/step2/__0_0.distcp", 0));
  EXPECT_TRUE(Get(tier.get(), "other/step9/__0_0.distcp", 0)) << "another run is kept";
  auto list = tier->Checkpoints();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].dir, "run/step2");  // newest commit first
}

TEST_F(RetainedTierTest, RewrittenFileIsNeverServedFromTheTier) {
  auto tier = MakeTier(64);
  const std::string path = "run/step1/__0_0.distcp";
  const std::string v1 = Pattern(kBlock, 7);
  Save(tier.get(), path, v1);
  Commit(tier.get(), "run/step1");
  const BlockId old_id = Id(path);
  ASSERT_TRUE(Get(tier.get(), path, 0));

  // Rewritten on the backing store by someone else: a new id; the old bytes are not served
  // for it (the reader's id comes from fstat of the file it reads).
  const std::string v2 = Pattern(kBlock, 8);
  WriteBacking(path, v2);
  struct timespec ts[2] = {{0, UTIME_OMIT}, {old_id.mtime_ns / 1000000000 + 5, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, (tmp_.path() + "/" + path).c_str(), ts, 0), 0);
  EXPECT_FALSE(Get(tier.get(), path, 0));

  // Rewritten through this mount: the publish drops the old version even if size and mtime
  // were to match, and the new one is served once committed again.
  Save(tier.get(), path, v2);
  std::string out(kBlock, '\0');
  EXPECT_FALSE(tier->Lookup(old_id, 0, std::span<char>(out.data(), out.size())));
  Commit(tier.get(), "run/step1");
  auto got = Get(tier.get(), path, 0);
  ASSERT_TRUE(got);
  EXPECT_EQ(*got, v2);

  // Overlapping writes within one file version (a rewrite while open): never retained.
  const std::string v3 = Pattern(kBlock, 9);
  auto target = std::make_shared<FlushTarget>(++next_id_, UniqueFd());
  auto crcs = std::make_shared<BlockCrcMap>();
  const auto* p = reinterpret_cast<const uint8_t*>(v3.data());
  crcs->Record(0, p, kBlock);
  Written(tier.get(), target, crcs, 0, p, kBlock);
  crcs->Record(0, p, 4096);
  Written(tier.get(), target, crcs, 0, p, 4096);
  WriteBacking("run/step1/__1_0.distcp", v3);
  Publish(tier.get(), "run/step1/__1_0.distcp", kBlock, target);
  EXPECT_FALSE(Get(tier.get(), "run/step1/__1_0.distcp", 0));

  // Truncated and extended after the writes: the CRC map no longer knows the block.
  auto t2 = std::make_shared<FlushTarget>(++next_id_, UniqueFd());
  auto c2 = std::make_shared<BlockCrcMap>();
  c2->Record(0, p, kBlock);
  Written(tier.get(), t2, c2, 0, p, kBlock);
  c2->Truncate(100);
  std::string v4 = v3.substr(0, 100) + std::string(kBlock - 100, '\0');
  WriteBacking("run/step1/__2_0.distcp", v4);
  Publish(tier.get(), "run/step1/__2_0.distcp", kBlock, t2);
  EXPECT_FALSE(Get(tier.get(), "run/step1/__2_0.distcp", 0));
  EXPECT_GE(tier->Stats().unverified_blocks, 1u);  // the overlap was refused at capture

  // Deleted through the mount: dropped.
  JournalEntry un;
  un.op = OpType::kUnlink;
  un.path = path;
  tier->OnJournalDone(un, Status::Ok());
  EXPECT_FALSE(tier->Holds(Id(path), 0));
}

class CountingSource : public BlockSource {
 public:
  explicit CountingSource(BackingSource* inner) : inner_(inner) {}
  Result<BlockRead> ReadBlock(const BlockId& id, uint64_t offset, std::span<char> out) override {
    ++reads;
    return inner_->ReadBlock(id, offset, out);
  }
  std::atomic<int> reads{0};

 private:
  BackingSource* inner_;
};

TEST_F(RetainedTierTest, CorruptedBlockIsCaughtByItsCrcAndReadFromTheBackingStore) {
  auto tier = MakeTier(16);
  const std::string path = "run/step1/__0_0.distcp";
  const std::string data = Pattern(2 * kBlock, 10);
  Save(tier.get(), path, data);
  Commit(tier.get(), "run/step1");
  auto bs = BackingSource::Create(backing_.get(), {});
  ASSERT_TRUE(bs.ok());
  CountingSource counting(bs->get());
  RetainedSource source(tier.get(), &counting);
  const BlockId id = Id(path);
  std::string out(kBlock, '\0');
  ASSERT_TRUE(source.ReadBlock(id, 0, std::span<char>(out.data(), out.size())).ok());
  EXPECT_EQ(counting.reads.load(), 0) << "served from memory";
  ASSERT_TRUE(tier->CorruptForTest(id, 1));
  auto r = source.ReadBlock(id, kBlock, std::span<char>(out.data(), out.size()));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(out, data.substr(kBlock)) << "the backing store's bytes, not the corrupted ones";
  EXPECT_EQ(counting.reads.load(), 1);
  EXPECT_EQ(tier->Stats().crc_errors, 1u);
  EXPECT_FALSE(tier->Holds(id, 1)) << "a corrupted block is dropped";
  // A replica that arrives corrupted is refused.
  std::string bad = data.substr(0, kBlock);
  const uint32_t crc = Crc32c(bad.data(), bad.size());
  bad[10] ^= 1;
  EXPECT_FALSE(tier->PutReplica(Id(path), 0, bad, crc, "node1"));
}

TEST_F(RetainedTierTest, DroppedBlocksBuffersAreReusedByTheNextSaveWithinTheBudget) {
  auto tier = MakeTier(8);
  const std::string a = Pattern(3 * kBlock, 20), b = Pattern(3 * kBlock - 777, 21);
  Save(tier.get(), "run/step1/__0_0.distcp", a);
  Commit(tier.get(), "run/step1");
  Save(tier.get(), "run/step2/__0_0.distcp", b);
  Commit(tier.get(), "run/step2");  // drops step1: its three buffers become spares
  RetainedTierStats s = tier->Stats();
  EXPECT_EQ(s.spare_bytes, 3 * kBlock);
  EXPECT_EQ(s.used_bytes, 6 * kBlock) << "spares stay counted";
  // The next save copies into the spares (their old bytes are never served) and maps only
  // what they lack.
  const std::string c = Pattern(4 * kBlock, 22);
  Save(tier.get(), "run/step3/__0_0.distcp", c);
  s = tier->Stats();
  EXPECT_EQ(s.spare_bytes, 0u) << "the spares were taken first";
  EXPECT_EQ(s.used_bytes, 7 * kBlock);
  EXPECT_LE(s.peak_used_bytes, 8 * kBlock);
  Commit(tier.get(), "run/step3");
  EXPECT_EQ(tier->Stats().spare_bytes, 3 * kBlock) << "step2's buffers";
  for (uint64_t i = 0; i < 4; ++i) {
    auto got = Get(tier.get(), "run/step3/__0_0.distcp", i);
    ASSERT_TRUE(got) << i;
    EXPECT_EQ(*got, c.substr(i * kBlock, kBlock)) << i;
  }
  EXPECT_FALSE(Get(tier.get(), "run/step2/__0_0.distcp", 0));
  // A replica takes a spare too, and its short last block serves only its own bytes.
  const std::string tail = Pattern(1000, 23);
  const BlockId other{.path = "run/step3/__1_0.distcp", .size = 1000, .mtime_ns = 1};
  ASSERT_TRUE(tier->PutReplica(other, 0, tail, Crc32c(tail.data(), tail.size()), "node1"));
  EXPECT_EQ(tier->Stats().spare_bytes, 2 * kBlock);
  EXPECT_LE(tier->Stats().used_bytes, 8 * kBlock);
  std::string out(kBlock, '\0');
  auto r = tier->Lookup(other, 0, std::span<char>(out.data(), out.size()));
  ASSERT_TRUE(r);
  EXPECT_EQ(out.substr(0, r->bytes), tail);
}

TEST_F(RetainedTierTest, InPlaceReadsAreServedFromTheBlocksAndEveryPieceIsChecked) {
  auto tier = MakeTier(16);
  const std::string path = "run/step1/__0_0.distcp";
  const std::string data = Pattern(3 * kBlock + 5000, 11);
  Save(tier.get(), path, data);
  const BlockId id = Id(path);
  std::string got;
  int calls = 0;
  auto collect = [&](std::span<const struct iovec> iov) {
    ++calls;
    got.clear();
    for (const struct iovec& v : iov) got.append(static_cast<const char*>(v.iov_base), v.iov_len);
  };
  EXPECT_FALSE(tier->ReadInPlace(id, 4096, 0, collect)) << "served before the commit";
  Commit(tier.get(), "run/step1");
  // Across a block boundary: two blocks, one reply.
  auto n = tier->ReadInPlace(id, 5000, kBlock - 1000, collect);
  ASSERT_TRUE(n);
  EXPECT_EQ(*n, 5000u);
  EXPECT_EQ(got, data.substr(kBlock - 1000, 5000));
  // Past the end: clamped to the file's size.
  n = tier->ReadInPlace(id, 1 << 20, 3 * kBlock, collect);
  ASSERT_TRUE(n);
  EXPECT_EQ(got, data.substr(3 * kBlock));
  EXPECT_EQ(calls, 2);
  // A block corrupted after its first serve: the piece replied is checked again.
  ASSERT_TRUE(tier->CorruptForTest(id, 1));  // flips a byte in its second 64 KiB piece
  EXPECT_FALSE(tier->ReadInPlace(id, 4096, kBlock + kBlock / 2, collect));
  EXPECT_EQ(tier->Stats().crc_errors, 1u);
  EXPECT_FALSE(tier->Holds(id, 1)) << "a corrupted block is dropped";
  // A block corrupted before any serve: its first serve hashes it whole, so even a piece
  // that is intact is refused.
  ASSERT_TRUE(tier->CorruptForTest(id, 2));
  EXPECT_FALSE(tier->ReadInPlace(id, 4096, 2 * kBlock, collect));
  EXPECT_EQ(tier->Stats().crc_errors, 2u);
  EXPECT_EQ(calls, 2) << "nothing corrupted reached a reply";
  // Block 0 is still whole and still served; a range that needs a dropped block is not.
  n = tier->ReadInPlace(id, kBlock, 0, collect);
  ASSERT_TRUE(n);
  EXPECT_EQ(got, data.substr(0, kBlock));
  EXPECT_FALSE(tier->ReadInPlace(id, 2 * kBlock, 0, collect));
}

TEST_F(RetainedTierTest, MemoryOnlyRequestsNeverReachTheBackingStore) {
  auto tier = MakeTier(16);
  const std::string path = "run/step1/__0_0.distcp";
  const std::string data = Pattern(kBlock, 18);
  Save(tier.get(), path, data);
  auto bs = BackingSource::Create(backing_.get(), {});
  ASSERT_TRUE(bs.ok());
  CountingSource counting(bs->get());
  RetainedSource source(tier.get(), &counting);
  BlockId probe = Id(path);
  probe.path = std::string(kRetainedOnlyPrefix) + probe.path;
  std::string out(kBlock, '\0');
  // Held but not committed yet: not served, and not read elsewhere either.
  auto r = source.ReadBlock(probe, 0, std::span<char>(out.data(), out.size()));
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  Commit(tier.get(), "run/step1");
  r = source.ReadBlock(probe, 0, std::span<char>(out.data(), out.size()));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(out, data);
  // Not held at all (another file): NotFound at once.
  WriteBacking("run/step1/__1_0.distcp", data);
  BlockId other = Id("run/step1/__1_0.distcp");
  other.path = std::string(kRetainedOnlyPrefix) + other.path;
  r = source.ReadBlock(other, 0, std::span<char>(out.data(), out.size()));
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_EQ(counting.reads.load(), 0);
}

TEST_F(RetainedTierTest, ShardsOfAnotherNodesCommitAreServedOnceMetadataIsOnTheStore) {
  auto tier = MakeTier(16);
  const std::string path = "run/step1/__1_0.distcp";
  Save(tier.get(), path, Pattern(kBlock, 11));
  EXPECT_FALSE(Get(tier.get(), path, 0));  // no `.metadata` anywhere
  now_ += std::chrono::seconds(1);
  EXPECT_FALSE(Get(tier.get(), path, 0));
  // The coordinator on another node published `.metadata`: no journal event here.
  WriteBacking("run/step1/.metadata", "meta");
  EXPECT_FALSE(Get(tier.get(), path, 0)) << "checked at most once per interval";
  now_ += std::chrono::seconds(1);
  EXPECT_TRUE(Get(tier.get(), path, 0));
  EXPECT_GE(tier->Stats().lazy_commit_checks, 2u);
}

TEST_F(RetainedTierTest, StalePendingCheckpointsMakeRoomButFreshOnesAreKept) {
  auto tier = MakeTier(4);
  Save(tier.get(), "run/failed/__0_0.distcp", Pattern(2 * kBlock, 12));  // never commits
  Save(tier.get(), "run/step2/__0_0.distcp", Pattern(2 * kBlock, 13));
  Save(tier.get(), "run/step3/__0_0.distcp", Pattern(kBlock, 14));
  EXPECT_GT(tier->Stats().skipped_bytes, 0u) << "fresh pending saves are not evicted";
  now_ += std::chrono::minutes(2);
  Save(tier.get(), "run/step4/__0_0.distcp", Pattern(kBlock, 15));
  Commit(tier.get(), "run/step4");
  EXPECT_TRUE(Get(tier.get(), "run/step4/__0_0.distcp", 0));
  EXPECT_LE(tier->Stats().peak_used_bytes, 4 * kBlock);
}

TEST_F(RetainedTierTest, OnlyCheckpointFilesAreKept) {
  auto tier = MakeTier(16);
  Save(tier.get(), "run/step1/notes.txt", Pattern(kBlock, 19));
  Save(tier.get(), "run/step1/__0_0.distcp", Pattern(kBlock, 20));
  Commit(tier.get(), "run/step1");
  EXPECT_FALSE(Get(tier.get(), "run/step1/notes.txt", 0));
  EXPECT_TRUE(Get(tier.get(), "run/step1/__0_0.distcp", 0));
  EXPECT_EQ(tier->Stats().used_bytes, kBlock) << "the other file's capture was freed";
}

TEST_F(RetainedTierTest, RenamedFilesAndDropAll) {
  auto tier = MakeTier(16);
  Save(tier.get(), "run/step1/.metadata.tmp", "meta");
  std::filesystem::rename(tmp_.path() + "/run/step1/.metadata.tmp",
                          tmp_.path() + "/run/step1/.metadata");
  JournalEntry r;
  r.op = OpType::kRename;
  r.from = "run/step1/.metadata.tmp";
  r.path = "run/step1/.metadata";
  tier->OnJournalDone(r, Status::Ok());  // also the commit
  auto got = Get(tier.get(), "run/step1/.metadata", 0);
  ASSERT_TRUE(got);
  EXPECT_EQ(*got, "meta");
  tier->DropAll();
  EXPECT_FALSE(Get(tier.get(), "run/step1/.metadata", 0));
  EXPECT_EQ(tier->Stats().used_bytes, 0u);
  Save(tier.get(), "run/step2/__0_0.distcp", Pattern(kBlock, 16));  // stopped: nothing kept
  EXPECT_EQ(tier->Stats().used_bytes, 0u);
}

TEST_F(RetainedTierTest, ReplicasAreHeldWithinTheBudgetAndServed) {
  auto tier = MakeTier(2);
  const std::string path = "run/step1/__3_0.distcp";
  const std::string data = Pattern(3 * kBlock, 17);
  WriteBacking(path, data);
  const BlockId id = Id(path);
  for (uint64_t i = 0; i < 3; ++i) {
    std::string_view b(data.data() + i * kBlock, kBlock);
    const bool kept = tier->PutReplica(id, i, b, Crc32c(b.data(), b.size()), "node3");
    EXPECT_EQ(kept, i < 2) << i;
  }
  auto got = Get(tier.get(), path, 1);
  ASSERT_TRUE(got);
  EXPECT_EQ(*got, data.substr(kBlock, kBlock));
  EXPECT_EQ(tier->Stats().replica_bytes, 2 * kBlock);
  ASSERT_EQ(tier->Checkpoints().size(), 1u);
  EXPECT_EQ(tier->Checkpoints()[0].origin, "node3");
}

// RetainedBytes, the key index's view of the tier (store/cache/retained_bytes.h): the
// index build after a commit reads zip headers and item edges through it, so any range of
// a committed version is served, across blocks, and nothing else is.
TEST_F(RetainedTierTest, RetainedBytesServesRangesOfACommittedVersionOnly) {
  auto tier = MakeTier(16);
  RetainedBytes held(tier.get());
  const std::string path = "run/step1/__0_0.distcp";
  const std::string data = Pattern(2 * kBlock + 1000, 2);
  Save(tier.get(), path, data);
  struct stat st {};
  ASSERT_EQ(::stat((tmp_.path() + "/" + path).c_str(), &st), 0);
  const FileKey key = FileKeyFromStat(st);
  std::string out(5000, '\0');
  EXPECT_FALSE(held.Read(path, key, 0, std::span<char>(out))) << "served before the commit";
  Commit(tier.get(), "run/step1");
  // Within a block, across a block boundary, the tail, the whole file.
  for (const auto& [off, len] : std::vector<std::pair<uint64_t, size_t>>{
           {10, 5000}, {kBlock - 100, 300}, {2 * kBlock, 1000}, {0, data.size()}}) {
    std::string got(len, '\0');
    ASSERT_TRUE(held.Read(path, key, off, std::span<char>(got))) << off << "+" << len;
    EXPECT_EQ(got, data.substr(off, len)) << off << "+" << len;
  }
  // An index build's reads are counted apart: the hits stay what loads got from memory.
  EXPECT_EQ(tier->Stats().hits, 0u);
  EXPECT_EQ(tier->Stats().hit_bytes, 0u);
  EXPECT_EQ(tier->Stats().index_read_bytes, 5000u + 300 + 1000 + data.size());
  // Past the end, another version (size or mtime), another file: not served.
  std::string one(1, '\0');
  EXPECT_FALSE(held.Read(path, key, data.size(), std::span<char>(one)));
  std::string two(2, '\0');
  EXPECT_FALSE(held.Read(path, key, data.size() - 1, std::span<char>(two)));
  FileKey other = key;
  other.mtime_ns += 1;
  EXPECT_FALSE(held.Read(path, other, 0, std::span<char>(one)));
  other = key;
  other.size -= 1;
  EXPECT_FALSE(held.Read(path, other, 0, std::span<char>(one)));
  EXPECT_FALSE(held.Read("run/step1/__1_0.distcp", key, 0, std::span<char>(one)));
}

}  // namespace
}  // namespace ckptfs::store
