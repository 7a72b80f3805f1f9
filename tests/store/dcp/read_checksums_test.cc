#include "store/dcp/read_checksums.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "store/primitives/backing_dir.h"
#include "store/primitives/crc32c.h"
#include "store/primitives/state_db.h"
#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {

struct Fixture {
  Fixture() {
    std::filesystem::create_directories(tmp.path() + "/b/ck");
    dir = BackingDir::Open(tmp.path() + "/b").value();
    db = StateDb::Open(tmp.path() + "/state").value();
    index = KeyIndex::Create(dir.get(), db.get()).value();
  }
  ScopedTempDir tmp;
  std::unique_ptr<BackingDir> dir;
  std::unique_ptr<StateDb> db;
  std::unique_ptr<KeyIndex> index;
};

// A shard of `n` bytes items of random sizes, indexed (lazily: no checksums).
std::string MakeShard(Fixture* f, int n, std::mt19937_64& rng) {
  DcpMetadata md;
  uint64_t off = 0;
  for (int i = 0; i < n; ++i) {
    DcpItem d;
    d.kind = ItemKind::kBytes;
    d.is_bytes = true;
    d.fqn = "b" + std::to_string(i);
    d.file = "s.distcp";
    d.offset = off;
    d.length = 1 + rng() % 300000;
    off += d.length;
    md.items.push_back(d);
  }
  std::string bytes(off, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  std::ofstream(f->tmp.path() + "/b/ck/s.distcp", std::ios::binary).write(bytes.data(), off);
  EXPECT_TRUE(f->index->BuildFrom("ck", md, /*checksums=*/false).ok());
  return bytes;
}

FileKey Version(uint64_t ino) {
  FileKey k;
  k.ino = ino;
  k.size = 1;
  return k;
}

TEST(ReadChecksums, ItemsReadInFullInAnyOrderGetTheirExactCrc) {
  Fixture f;
  std::mt19937_64 rng(1);
  const std::string bytes = MakeShard(&f, 20, rng);
  ReadChecksums sums(f.index.get());
  // Reads of random sizes, shuffled, some repeated or overlapping, covering the whole file.
  std::vector<std::pair<uint64_t, uint64_t>> reads;
  for (uint64_t pos = 0; pos < bytes.size();) {
    uint64_t len = std::min<uint64_t>(bytes.size() - pos, 1 + rng() % 200000);
    reads.emplace_back(pos, len);
    if (rng() % 3 == 0) reads.emplace_back(pos / 2, len);  // an overlapping re-read
    pos += len;
  }
  std::shuffle(reads.begin(), reads.end(), rng);
  for (auto [pos, len] : reads) {
    sums.OnRead("ck", "s.distcp", Version(7), pos, bytes.data() + pos, len);
  }
  std::vector<IndexedItem> items = f.index->Items("ck").value();
  for (const IndexedItem& it : items) {
    ASSERT_TRUE(it.has_checksum) << KeyName(it);
    EXPECT_EQ(it.checksum, Crc32c(bytes.data() + it.offset, it.length)) << KeyName(it);
  }
  EXPECT_EQ(sums.recorded(), items.size());
  EXPECT_EQ(sums.items_in_progress(), 0u);
  VerifyReport v = f.index->Verify("ck").value();
  EXPECT_EQ(v.unchecked, 0u);
  for (const auto& [key, why] : v.bad) {  // random bytes items are no zip archives
    EXPECT_EQ(why.find("checksum"), std::string::npos) << key << ": " << why;
  }
}

TEST(ReadChecksums, PartialReadsRecordNothingAndVersionsNeverMix) {
  Fixture f;
  std::mt19937_64 rng(2);
  const std::string bytes = MakeShard(&f, 3, rng);
  const IndexedItem first = f.index->Items("ck").value()[0];
  ReadChecksums sums(f.index.get());
  // All but the last byte of the first item: nothing recorded.
  sums.OnRead("ck", "s.distcp", Version(1), 0, bytes.data(), first.length - 1);
  EXPECT_FALSE(f.index->Items("ck").value()[0].has_checksum);
  // The last byte, but of another version of the file: starts over, still nothing.
  sums.OnRead("ck", "s.distcp", Version(2), first.length - 1, bytes.data() + first.length - 1, 1);
  EXPECT_FALSE(f.index->Items("ck").value()[0].has_checksum);
  sums.OnRead("ck", "s.distcp", Version(2), 0, bytes.data(), first.length - 1);
  IndexedItem got = f.index->Items("ck").value()[0];
  ASSERT_TRUE(got.has_checksum);
  EXPECT_EQ(got.checksum, Crc32c(bytes.data(), first.length));
}

TEST(ReadChecksums, InProgressItemsAreBounded) {
  Fixture f;
  std::mt19937_64 rng(3);
  const std::string bytes = MakeShard(&f, 10, rng);
  ReadChecksums sums(f.index.get(), /*max_items=*/4);
  for (const IndexedItem& it : f.index->Items("ck").value()) {
    if (it.length > 1) sums.OnRead("ck", "s.distcp", Version(1), it.offset, bytes.data() + it.offset, 1);
  }
  EXPECT_LE(sums.items_in_progress(), 4u);
}

}  // namespace
}  // namespace ckptfs::store
