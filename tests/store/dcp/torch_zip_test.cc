#include "store/dcp/torch_zip.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "store/dcp/dcp_metadata.h"

namespace ckptfs::store {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace std::string_literals;

const fs::path kFixtures = fs::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp";

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Reads through the pread-style interface, recording what was read.
struct CountingReader {
  explicit CountingReader(std::string_view b) : bytes(b) {}
  std::string_view bytes;
  uint64_t bytes_read = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  ReadAtFn Fn() {
    return [this](uint64_t offset, std::span<char> dst) -> Status {
      if (offset > bytes.size() || bytes.size() - offset < dst.size()) return Corrupt("short read");
      std::copy_n(bytes.data() + offset, dst.size(), dst.data());
      bytes_read += dst.size();
      ranges.emplace_back(offset, offset + dst.size());
      return Status::Ok();
    };
  }
  bool Touched(uint64_t begin, uint64_t end) const {
    for (auto [b, e] : ranges) {
      if (b < end && begin < e) return true;
    }
    return false;
  }
};

std::string ItemKey(const DcpItem& item) {
  std::string key = item.fqn + "@";
  if (item.is_bytes) return key + "bytes";
  for (int64_t v : item.chunk_offsets) key += std::to_string(v) + ",";
  return key;
}

std::string ItemKey(const json& item) {
  std::string key = item["fqn"].get<std::string>() + "@";
  if (item["kind"] == "bytes") return key + "bytes";
  for (int64_t v : item["chunk_offsets"].get<std::vector<int64_t>>())
    key += std::to_string(v) + ",";
  return key;
}

// The full index for real checkpoints: .metadata, then every item's archive, compared with
// every field of the manifest (which was checked against torch.load).
TEST(TorchZip, EveryFixtureMatchesItsManifestIncludingRawData) {
  int tensors = 0, bytes_items = 0, fixtures = 0;
  for (const auto& entry : fs::directory_iterator(kFixtures)) {
    std::string path = entry.path().string();
    const std::string suffix = ".manifest.json";
    if (path.size() < suffix.size() || path.substr(path.size() - suffix.size()) != suffix) {
      continue;
    }
    ++fixtures;
    fs::path dir = path.substr(0, path.size() - suffix.size());
    SCOPED_TRACE(dir.filename().string());
    json manifest = json::parse(ReadFile(entry.path()));
    ASSERT_FALSE(manifest.value("metadata_only", false));
    Result<DcpMetadata> md = ParseDcpMetadata(ReadFile(dir / ".metadata"));
    ASSERT_TRUE(md.ok()) << md.status().ToString();
    std::map<std::string, json> want_by_key;
    for (const json& want : manifest["items"]) want_by_key[ItemKey(want)] = want;
    ASSERT_EQ(want_by_key.size(), md->items.size());

    for (DcpItem& item : md->items) {
      SCOPED_TRACE(ItemKey(item));
      ASSERT_TRUE(want_by_key.count(ItemKey(item)));
      const json& want = want_by_key[ItemKey(item)];
      std::string file = ReadFile(dir / item.file);
      ASSERT_LE(item.offset + item.length, file.size());
      std::string_view bytes = std::string_view(file).substr(item.offset, item.length);
      CountingReader reader(bytes);
      Result<TorchSaveTensor> t = ParseTorchSaveItem(reader.Fn(), bytes.size());
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      Result<TorchSaveTensor> from_span = ParseTorchSaveItem(bytes);
      ASSERT_TRUE(from_span.ok()) << from_span.status().ToString();
      EXPECT_EQ(from_span->data_offset, t->data_offset);
      ASSERT_TRUE(ResolveItemData(*t, &item).ok());

      EXPECT_EQ(ItemKindName(item.kind), want["kind"].get<std::string>());
      EXPECT_EQ(item.file, want["file"]);
      EXPECT_EQ(item.offset, want["offset"].get<uint64_t>());
      EXPECT_EQ(item.length, want["length"].get<uint64_t>());
      if (item.is_bytes) {
        ++bytes_items;
        EXPECT_FALSE(t->is_tensor);
        EXPECT_FALSE(t->opaque_reason.empty());
        EXPECT_FALSE(item.data_resolved);
        continue;
      }
      ++tensors;
      ASSERT_TRUE(t->is_tensor) << t->opaque_reason;
      ASSERT_TRUE(item.data_resolved);
      EXPECT_EQ(item.dtype, want["dtype"]);
      EXPECT_EQ(item.chunk_sizes, want["chunk_sizes"].get<std::vector<int64_t>>());
      EXPECT_EQ(item.global_size, want["global_size"].get<std::vector<int64_t>>());
      EXPECT_EQ(item.stride, want["stride"].get<std::vector<int64_t>>());
      EXPECT_EQ(item.storage_offset, want["storage_offset"].get<int64_t>());
      EXPECT_EQ(item.raw_offset, want["raw_offset"].get<uint64_t>());
      EXPECT_EQ(item.raw_nbytes, want["raw_nbytes"].get<uint64_t>());
      EXPECT_EQ(t->record_name, "archive/data/" + t->storage_key);
      // Directory, headers and data.pkl are read; the tensor bytes never are.
      EXPECT_FALSE(reader.Touched(t->data_offset, t->data_offset + t->data_nbytes));
    }
  }
  EXPECT_EQ(fixtures, 10);  // 7 torch 1.13, torch 2.6, torch 2.14, Megatron-core 0.16
  EXPECT_EQ(tensors, 84);
  EXPECT_EQ(bytes_items, 21);
}

TEST(TorchZip, ResolveRejectsArchivesThatContradictTheMetadata) {
  std::string file = ReadFile(kFixtures / "torch113_tricky_single_file/__0_0.distcp");
  Result<TorchSaveTensor> t = ParseTorchSaveItem(std::string_view(file).substr(747, 747));
  ASSERT_TRUE(t.ok() && t->is_tensor);
  DcpItem item;
  item.kind = ItemKind::kTensor;
  item.fqn = "transposed";
  item.file = "__0_0.distcp";
  item.offset = 747;
  item.length = 747;
  item.dtype = "float32";
  item.chunk_sizes = {4, 3};
  DcpItem ok = item;
  ASSERT_TRUE(ResolveItemData(*t, &ok).ok());
  EXPECT_EQ(ok.raw_offset, 1067u);
  EXPECT_EQ(ok.stride, (std::vector<int64_t>{1, 4}));
  DcpItem wrong_dtype = item;
  wrong_dtype.dtype = "float16";
  EXPECT_FALSE(ResolveItemData(*t, &wrong_dtype).ok());
  DcpItem wrong_shape = item;
  wrong_shape.chunk_sizes = {3, 4};
  EXPECT_FALSE(ResolveItemData(*t, &wrong_shape).ok());
  DcpItem too_short = item;
  too_short.length = 100;
  EXPECT_FALSE(ResolveItemData(*t, &too_short).ok());
  // An archive the reader cannot vouch for makes the item opaque.
  TorchSaveTensor opaque;
  opaque.opaque_reason = "compressed";
  DcpItem o = item;
  ASSERT_TRUE(ResolveItemData(opaque, &o).ok());
  EXPECT_EQ(o.kind, ItemKind::kOpaque);
  EXPECT_FALSE(o.data_resolved);
}

// --- Hand-built archives ----------------------------------------------------------------------

std::string Le(uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

struct Record {
  Record(std::string n, std::string d, std::string extra = "")
      : name(std::move(n)), data(std::move(d)), local_extra(std::move(extra)) {}
  std::string name, data;
  std::string local_extra;
  uint16_t method = 0;
  uint64_t uncompressed_size = UINT64_MAX;  // defaults to data.size()
};

struct ZipOptions {
  bool zip64_end = true;  // torch always writes the zip64 end records
  bool saturate = false;  // 0xffffffff in 32-bit fields, real values in zip64 extras
  std::string leading;    // bytes before the first record
};

// Writes an archive the way torch's miniz writer does: STORED records, sizes zero in local
// headers (flag bit 3), real sizes in the central directory.
std::string BuildZip(const std::vector<Record>& records, const ZipOptions& o = {}) {
  std::string out = o.leading, cd;
  for (const Record& r : records) {
    uint64_t lho = out.size();
    uint64_t usize = r.uncompressed_size == UINT64_MAX ? r.data.size() : r.uncompressed_size;
    out += Le(0x04034b50, 4) + Le(20, 2) + Le(0x0808, 2) + Le(r.method, 2) + Le(0, 4) + Le(0, 4) +
           Le(0, 4) + Le(0, 4) + Le(r.name.size(), 2) + Le(r.local_extra.size(), 2) + r.name +
           r.local_extra + r.data;
    std::string extra;
    if (o.saturate) extra = Le(1, 2) + Le(24, 2) + Le(usize, 8) + Le(r.data.size(), 8) + Le(lho, 8);
    uint32_t sat = 0xffffffff;
    cd += Le(0x02014b50, 4) + Le(20, 2) + Le(20, 2) + Le(0x0808, 2) + Le(r.method, 2) + Le(0, 4) +
          Le(0, 4) + Le(o.saturate ? sat : r.data.size(), 4) + Le(o.saturate ? sat : usize, 4) +
          Le(r.name.size(), 2) + Le(extra.size(), 2) + Le(0, 2) + Le(0, 2) + Le(0, 2) + Le(0, 4) +
          Le(o.saturate ? sat : lho, 4) + r.name + extra;
  }
  uint64_t cd_offset = out.size();
  out += cd;
  uint64_t n = records.size();
  if (o.zip64_end) {
    uint64_t rec = out.size();
    out += Le(0x06064b50, 4) + Le(44, 8) + Le(45, 2) + Le(45, 2) + Le(0, 4) + Le(0, 4) + Le(n, 8) +
           Le(n, 8) + Le(cd.size(), 8) + Le(cd_offset, 8);
    out += Le(0x07064b50, 4) + Le(0, 4) + Le(rec, 8) + Le(1, 4);
  }
  out += Le(0x06054b50, 4) + Le(0, 2) + Le(0, 2) + Le(o.saturate ? 0xffff : n, 2) +
         Le(o.saturate ? 0xffff : n, 2) + Le(o.saturate ? 0xffffffff : cd.size(), 4) +
         Le(o.saturate ? 0xffffffff : cd_offset, 4) + Le(0, 2);
  return out;
}

std::string Str(std::string_view s) { return "X" + Le(s.size(), 4) + std::string(s); }
std::string Int(int64_t v) { return "\x8a\x08" + Le(static_cast<uint64_t>(v), 8); }
std::string Ints(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (int64_t x : v) s += Int(x);
  return s + "t";
}

struct TensorPickle {
  std::string rebuild = "_rebuild_tensor_v2";
  std::string storage_type = "FloatStorage";
  std::string key = "0";
  int64_t numel = 6;
  int64_t storage_offset = 0;
  std::vector<int64_t> shape = {2, 3}, stride = {3, 1};
  std::string dtype;  // v3 only
  bool parameter = false;
  std::string Build() const {
    std::string tensor = "ctorch._utils\n" + rebuild + "\n((" + Str("storage") + "ctorch\n" +
                         storage_type + "\n" + Str(key) + Str("cpu") + Int(numel) + "tQ" +
                         Int(storage_offset) + Ints(shape) + Ints(stride) +
                         "\x89"
                         "ccollections\nOrderedDict\n)R";
    if (!dtype.empty()) tensor += "ctorch\n" + dtype + "\n";
    tensor += "tR";
    if (parameter) {
      tensor = "ctorch._utils\n_rebuild_parameter\n(" + tensor + "\x88" +
               "ccollections\nOrderedDict\n)RtR";
    }
    return "\x80\x02" + tensor + ".";
  }
};

// A one-tensor archive with 64-byte-aligned data, as torch writes it.
std::vector<Record> TensorRecords(const TensorPickle& p, size_t nbytes = 24) {
  return {{"archive/data.pkl", p.Build(), "FB" + Le(10, 2) + std::string(10, 'Z')},
          {"archive/data/0", std::string(nbytes, '\x01'), "FB" + Le(40, 2) + std::string(40, 'Z')},
          {"archive/version", "3\n"}};
}

Result<TorchSaveTensor> Parse(const std::string& zip) { return ParseTorchSaveItem(zip); }

void ExpectSameParse(const Result<TorchSaveTensor>& a, const Result<TorchSaveTensor>& b) {
  ASSERT_EQ(a.ok(), b.ok());
  if (!a.ok()) {
    EXPECT_EQ(a.status().ToString(), b.status().ToString());
    return;
  }
  EXPECT_EQ(a->is_tensor, b->is_tensor);
  EXPECT_EQ(a->opaque_reason, b->opaque_reason);
  EXPECT_EQ(a->dtype, b->dtype);
  EXPECT_EQ(a->shape, b->shape);
  EXPECT_EQ(a->stride, b->stride);
  EXPECT_EQ(a->storage_offset, b->storage_offset);
  EXPECT_EQ(a->storage_key, b->storage_key);
  EXPECT_EQ(a->record_name, b->record_name);
  EXPECT_EQ(a->data_offset, b->data_offset);
  EXPECT_EQ(a->data_nbytes, b->data_nbytes);
}

// One cache over every item of every fixture (tensors, bytes items, many shapes), each item
// parsed twice through it: the same results as without, and repeats are hits.
TEST(TorchZip, PickleCacheGivesTheSameResultsAsNoCache) {
  TorchPickleCache cache;
  int items = 0;
  for (const auto& entry : fs::directory_iterator(kFixtures)) {
    fs::path md_path = entry.path() / ".metadata";
    if (!entry.is_directory() || !fs::exists(md_path)) continue;
    Result<DcpMetadata> md = ParseDcpMetadata(ReadFile(md_path));
    if (!md.ok()) continue;
    for (const DcpItem& item : md->items) {
      std::string file = ReadFile(entry.path() / item.file);
      if (item.offset + item.length > file.size()) continue;
      std::string_view bytes = std::string_view(file).substr(item.offset, item.length);
      SCOPED_TRACE(entry.path().filename().string() + " " + item.fqn);
      Result<TorchSaveTensor> plain = ParseTorchSaveItem(bytes);
      for (int round = 0; round < 2; ++round) {
        ExpectSameParse(plain, ParseTorchSaveItem(bytes, &cache));
        CountingReader reader(bytes);
        ExpectSameParse(plain, ParseTorchSaveItem(reader.Fn(), bytes.size(), &cache));
      }
      ++items;
    }
  }
  EXPECT_GT(items, 50);
  EXPECT_GE(cache.hits(), 3u * items);
  EXPECT_LE(cache.misses(), uint64_t(items));
  // Broken or opaque archives are cached as such, too.
  std::string zip = BuildZip({{"archive/data.pkl", "\x80\x02\x8f."s}});
  ExpectSameParse(ParseTorchSaveItem(zip), ParseTorchSaveItem(zip, &cache));
  ExpectSameParse(ParseTorchSaveItem(zip), ParseTorchSaveItem(zip, &cache));
}

TEST(TorchZip, DataOffsetComesFromTheLocalHeader) {
  std::string zip = BuildZip(TensorRecords(TensorPickle()));
  Result<TorchSaveTensor> t = Parse(zip);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(t->is_tensor) << t->opaque_reason;
  EXPECT_EQ(t->dtype, "float32");
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(zip.substr(t->data_offset, t->data_nbytes), std::string(24, '\x01'));
  EXPECT_EQ(zip.substr(t->data_offset - 40, 40), std::string(40, 'Z'));
}

TEST(TorchZip, Zip64FieldsAndLeadingBytesAreHonoured) {
  ZipOptions o;
  o.saturate = true;
  o.leading = std::string(100, 'p');  // e.g. a record the directory does not list
  std::string zip = BuildZip(TensorRecords(TensorPickle()), o);
  Result<TorchSaveTensor> t = Parse(zip);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(t->is_tensor) << t->opaque_reason;
  EXPECT_EQ(zip.substr(t->data_offset, t->data_nbytes), std::string(24, '\x01'));
  // Without the zip64 end records, saturated fields cannot be resolved.
  o.zip64_end = false;
  EXPECT_FALSE(Parse(BuildZip(TensorRecords(TensorPickle()), o)).ok());
  // A classic archive without zip64 records at all is fine.
  ZipOptions classic;
  classic.zip64_end = false;
  EXPECT_TRUE(Parse(BuildZip(TensorRecords(TensorPickle()), classic)).ok());
}

TEST(TorchZip, V3ParameterAndViewsAreRead) {
  TensorPickle v3;
  v3.rebuild = "_rebuild_tensor_v3";
  v3.storage_type = "UntypedStorage";
  v3.dtype = "float8_e4m3fn";
  v3.numel = 24;
  v3.shape = {4, 3};
  v3.stride = {1, 4};
  v3.storage_offset = 12;
  Result<TorchSaveTensor> t = Parse(BuildZip(TensorRecords(v3)));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(t->is_tensor) << t->opaque_reason;
  EXPECT_EQ(t->dtype, "float8_e4m3fn");
  EXPECT_EQ(t->stride, (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(t->storage_offset, 12);

  TensorPickle param;
  param.parameter = true;
  t = Parse(BuildZip(TensorRecords(param)));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_TRUE(t->is_tensor) << t->opaque_reason;

  TensorPickle zero_dim;
  zero_dim.numel = 1;
  zero_dim.shape = {};
  zero_dim.stride = {};
  t = Parse(BuildZip(TensorRecords(zero_dim, 4)));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_TRUE(t->is_tensor) << t->opaque_reason;
}

TEST(TorchZip, UnknownLayoutsAreOpaqueNeverMisread) {
  auto opaque = [](const std::string& zip, std::string_view reason) {
    Result<TorchSaveTensor> t = ParseTorchSaveItem(zip);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_FALSE(t->is_tensor);
    EXPECT_NE(t->opaque_reason.find(reason), std::string::npos) << t->opaque_reason;
  };
  std::vector<Record> big = TensorRecords(TensorPickle());
  big.push_back({"archive/byteorder", "big"});
  opaque(BuildZip(big), "byte order");
  std::vector<Record> little = TensorRecords(TensorPickle());
  little.push_back({"archive/byteorder", "little"});
  EXPECT_TRUE(Parse(BuildZip(little))->is_tensor);

  std::vector<Record> compressed = TensorRecords(TensorPickle());
  compressed[1].method = 8;
  compressed[1].uncompressed_size = 100;
  opaque(BuildZip(compressed), "compressed");
  std::vector<Record> compressed_pkl = TensorRecords(TensorPickle());
  compressed_pkl[0].method = 8;
  opaque(BuildZip(compressed_pkl), "compressed");

  TensorPickle quantized;
  quantized.storage_type = "QInt8Storage";
  opaque(BuildZip(TensorRecords(quantized)), "storage type");
  TensorPickle subclass;
  subclass.rebuild = "_rebuild_from_type_v2";
  opaque(BuildZip(TensorRecords(subclass)), "not a plain tensor");
  TensorPickle unknown_dtype;
  unknown_dtype.rebuild = "_rebuild_tensor_v3";
  unknown_dtype.storage_type = "UntypedStorage";
  unknown_dtype.dtype = "float3_weird";
  opaque(BuildZip(TensorRecords(unknown_dtype)), "dtype");
  // A bytes item: data.pkl is a plain dict, or uses opcodes the reader does not support.
  opaque(BuildZip({{"archive/data.pkl", "\x80\x02}q\x00."s}}), "not a tensor");
  opaque(BuildZip({{"archive/data.pkl", "\x80\x02\x8f."s}}), "unsupported opcode");
  opaque(BuildZip({{"other/thing", "x"}}), "no <archive>/data.pkl");
}

TEST(TorchZip, InconsistentArchivesAreCorrupt) {
  auto corrupt = [](const std::string& zip, std::string_view what) {
    Result<TorchSaveTensor> t = ParseTorchSaveItem(zip);
    ASSERT_FALSE(t.ok()) << "accepted; opaque_reason=" << (t.ok() ? t->opaque_reason : "");
    EXPECT_NE(t.status().message().find(what), std::string::npos) << t.status().message();
  };
  TensorPickle too_many;
  too_many.numel = 7;  // 28 bytes of float32, but the record holds 24
  corrupt(BuildZip(TensorRecords(too_many)), "does not match");
  TensorPickle past_end;
  past_end.storage_offset = 1;
  corrupt(BuildZip(TensorRecords(past_end)), "past its storage");
  TensorPickle missing;
  missing.key = "7";
  corrupt(BuildZip(TensorRecords(missing)), "missing record");
  std::vector<Record> dup = TensorRecords(TensorPickle());
  dup.push_back(dup[2]);
  corrupt(BuildZip(dup), "duplicate");
  corrupt("not a zip at all", "too small");
  corrupt(std::string(100, '\0'), "no end-of-central-directory");
  // A local header whose name differs from the central directory's.
  std::string zip = BuildZip(TensorRecords(TensorPickle()));
  size_t pos = zip.find("archive/data/0");
  zip[pos] = 'X';
  corrupt(zip, "differs");
}

TEST(TorchZip, EveryPrefixAndByteFlipOfARealItemIsSafe) {
  std::string file = ReadFile(kFixtures / "torch113_tricky_single_file/__0_0.distcp");
  std::string item = file.substr(747, 747);  // "transposed"
  ASSERT_TRUE(ParseTorchSaveItem(item).ok());
  for (size_t n = 0; n < item.size(); ++n) {
    EXPECT_FALSE(ParseTorchSaveItem(std::string_view(item).substr(0, n)).ok()) << n;
  }
  for (size_t i = 0; i < item.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80, 0xff}) {
      std::string copy = item;
      copy[i] = static_cast<char>(copy[i] ^ mask);
      (void)ParseTorchSaveItem(copy);
    }
  }
  // The same archive at an item offset inside a bigger file: the reader sees only the item.
  Result<TorchSaveTensor> t = ParseTorchSaveItem(std::string_view(file).substr(747, 747));
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(747 + t->data_offset, 1067u);
}

TEST(TorchZip, DirectoryLimitsAreEnforced) {
  std::vector<Record> many;
  for (int i = 0; i < 50; ++i) many.push_back({"archive/r" + std::to_string(i), "x"});
  std::string zip = BuildZip(many);
  ZipLimits limits;
  limits.max_entries = 10;
  CountingReader reader(zip);
  EXPECT_FALSE(ReadZipDirectory(reader.Fn(), zip.size(), limits).ok());
  limits = ZipLimits();
  limits.max_central_directory_bytes = 100;
  EXPECT_FALSE(ReadZipDirectory(reader.Fn(), zip.size(), limits).ok());
  Result<ZipDirectory> dir = ReadZipDirectory(reader.Fn(), zip.size());
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  EXPECT_EQ(dir->entries.size(), 50u);
  EXPECT_NE(dir->Find("archive/r49"), nullptr);
}

TEST(TorchZip, DtypeItemSizes) {
  EXPECT_EQ(DtypeItemSize("bfloat16"), 2);
  EXPECT_EQ(DtypeItemSize("complex128"), 16);
  EXPECT_EQ(DtypeItemSize("bool"), 1);
  EXPECT_EQ(DtypeItemSize("qint8"), 0);
}

}  // namespace
}  // namespace ckptfs::store
