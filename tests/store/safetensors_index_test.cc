// Safetensors and no-collectives DCP checkpoints in the key index (issue 22): headers parsed
// without reading data, every tensor a key, checksums, verify, restart, malformed input.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>

#include "store/dcp/checkpoint_source.h"
#include "store/dcp/key_index.h"
#include "store/dcp/safetensors_header.h"
#include "store/flush/block_crc_map.h"
#include "store/primitives/backing_dir.h"
#include "store/primitives/crc32c.h"
#include "store/primitives/state_db.h"
#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const fs::path kFixtures = fs::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp";

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const fs::path& path, std::string_view bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

struct Tensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::string data;
};

std::string Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// A safetensors file as the safetensors library writes it: header padded with spaces to a
// multiple of 8, tensors back to back in the order given. `meta` is "__metadata__".
std::string Safetensors(const std::vector<std::pair<std::string, Tensor>>& tensors,
                        const json& meta = json{{"format", "pt"}}) {
  json h = json::object();
  std::string data;
  for (const auto& [name, t] : tensors) {
    h[name] = {{"dtype", t.dtype}, {"shape", t.shape},
               {"data_offsets", {data.size(), data.size() + t.data.size()}}};
    data += t.data;
  }
  if (!meta.is_null()) h["__metadata__"] = meta;
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  return out + text + data;
}

// Raw header bytes: a length prefix and `text`.
std::string RawHeader(std::string_view text, uint64_t len, std::string_view data = "") {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  return out + std::string(text) + std::string(data);
}

struct Env {
  Env() : backing_path(tmp.Sub("backing")), state_path(tmp.path() + "/state") { Reopen(); }
  void Reopen() {
    index.reset();
    db.reset();
    if (!dir) dir = BackingDir::Open(backing_path).value();
    db = StateDb::Open(state_path).value();
    index = KeyIndex::Create(dir.get(), db.get()).value();
  }
  fs::path Backing(const std::string& rel) const { return fs::path(backing_path) / rel; }

  ScopedTempDir tmp;
  std::string backing_path, state_path;
  std::unique_ptr<BackingDir> dir;
  std::unique_ptr<StateDb> db;
  std::unique_ptr<KeyIndex> index;
};

// An HF checkpoint as torch's HuggingFaceStorageWriter writes it: two shards and the index.
struct HfCheckpoint {
  std::map<std::string, Tensor> tensors;           // by name
  std::map<std::string, std::string> file_of;      // tensor -> shard
  std::map<std::string, std::string> shard_bytes;  // shard -> bytes
};

HfCheckpoint WriteHf(Env* env, const std::string& ckpt, uint64_t seed = 1) {
  HfCheckpoint c;
  const std::vector<std::pair<std::string, Tensor>> s1 = {
      {"embed.weight", {"F32", {64, 32}, Random(64 * 32 * 4, seed)}},
      {"layers.0.w", {"BF16", {128, 64}, Random(128 * 64 * 2, seed + 1)}},
      {"step", {"I64", {}, Random(8, seed + 2)}},
  };
  const std::vector<std::pair<std::string, Tensor>> s2 = {
      {"layers.1.w", {"F16", {128, 64}, Random(128 * 64 * 2, seed + 3)}},
      {"mask", {"BOOL", {7}, std::string(7, '\1')}},
      {"empty", {"F32", {0, 4}, ""}},
  };
  json weight_map = json::object();
  for (const auto& [file, list] : {std::pair{"model-00001-of-00002.safetensors", s1},
                                   std::pair{"model-00002-of-00002.safetensors", s2}}) {
    c.shard_bytes[file] = Safetensors(list);
    WriteFile(env->Backing(ckpt + "/" + file), c.shard_bytes[file]);
    for (const auto& [name, t] : list) {
      c.tensors[name] = t;
      c.file_of[name] = file;
      weight_map[name] = file;
    }
  }
  json index = {{"metadata", {{"total_size", 1234}}}, {"weight_map", weight_map}};
  WriteFile(env->Backing(ckpt + "/model.safetensors.index.json"), index.dump(2));
  return c;
}

// --- The header ---------------------------------------------------------------------------

TEST(SafetensorsHeader, GivesFileAbsoluteRangesDtypesAndShapesInDataOrder) {
  std::string bytes = Safetensors({{"b", {"BF16", {2, 3}, std::string(12, 'b')}},
                                   {"a", {"F8_E4M3", {5}, std::string(5, 'a')}},
                                   {"z", {"F4_NEW", {3}, std::string(9, 'z')}}});
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  auto h = ParseSafetensorsHeader(std::string_view(bytes).substr(8, n), 8 + n, bytes.size(), "f");
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 3u);
  EXPECT_EQ(h->data_start, 8 + n);
  const SafetensorsTensor& b = h->tensors[0];
  EXPECT_EQ(b.name, "b");
  EXPECT_EQ(b.dtype, "bfloat16");
  EXPECT_EQ(b.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(b.saved_offsets, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(bytes.substr(b.begin, b.end - b.begin), std::string(12, 'b'));
  EXPECT_EQ(h->tensors[1].dtype, "float8_e4m3fn");
  // A dtype from a newer safetensors: kept, not interpreted.
  EXPECT_FALSE(h->tensors[2].known_dtype);
  EXPECT_EQ(h->tensors[2].dtype, "F4_NEW");
  EXPECT_EQ(h->metadata.at("format"), "pt");
}

TEST(SafetensorsHeader, ReadsDcpShardingInfoAsChunkOffsets) {
  json info = {{"w", {{"saved_offsets", {4, 0}}}}};
  std::string bytes = Safetensors({{"w", {"F32", {4, 2}, std::string(32, 'w')}}},
                                  {{"DCP_SHARDING_INFO", info.dump()}, {"DCP_VERSION", "1.0"}});
  ScopedTempDir tmp;
  WriteFile(tmp.path() + "/backing/s.safetensors", bytes);
  auto dir = BackingDir::Open(tmp.path() + "/backing").value();
  auto h = ReadSafetensorsHeader(dir.get(), "s.safetensors");
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->tensors.at(0).saved_offsets, (std::vector<int64_t>{4, 0}));
}

TEST(SafetensorsHeader, MalformedHeadersAreClearErrorsNeverCrashes) {
  ScopedTempDir tmp;
  auto dir = BackingDir::Open(tmp.Sub("b")).value();
  auto tensor = [](const json& t) { return json{{"t", t}}.dump(); };
  const std::string ok_t = tensor({{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}});
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"short", std::string(5, '\0')},
      {"past the end", RawHeader("{}", 1000)},
      {"over the", RawHeader("{}", uint64_t{1} << 40)},
      {"not valid JSON", RawHeader("{\"t\": [", 7)},
      {"not a JSON object", RawHeader("[1,2]", 5)},
      {"no string \"dtype\"", RawHeader(tensor({{"shape", {2}}, {"data_offsets", {0, 8}}}),
                                        tensor({{"shape", {2}}, {"data_offsets", {0, 8}}}).size(),
                                        std::string(8, 'x'))},
      {"is not [begin, end]",
       RawHeader(tensor({{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0}}}),
                 tensor({{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0}}}).size())},
      {"not an increasing pair",
       RawHeader(tensor({{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {8, 0}}}),
                 tensor({{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {8, 0}}}).size(),
                 std::string(8, 'x'))},
      {"runs past the end of the file", RawHeader(ok_t, ok_t.size(), "abc")},
      {"of this shape is not",
       RawHeader(tensor({{"dtype", "F32"}, {"shape", {3}}, {"data_offsets", {0, 8}}}),
                 tensor({{"dtype", "F32"}, {"shape", {3}}, {"data_offsets", {0, 8}}}).size(),
                 std::string(8, 'x'))},
      {"shape holds something",
       RawHeader(tensor({{"dtype", "F32"}, {"shape", {-2}}, {"data_offsets", {0, 8}}}),
                 tensor({{"dtype", "F32"}, {"shape", {-2}}, {"data_offsets", {0, 8}}}).size(),
                 std::string(8, 'x'))},
      {"overlap", RawHeader(json{{"a", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {0, 4}}}},
                                 {"b", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {2, 6}}}}}
                                .dump(),
                            json{{"a", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {0, 4}}}},
                                 {"b", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {2, 6}}}}}
                                .dump()
                                .size(),
                            std::string(6, 'x'))},
      {"DCP_SHARDING_INFO is not",
       Safetensors({{"t", {"U8", {1}, "x"}}}, {{"DCP_SHARDING_INFO", "[oops"}})},
      {"saved_offsets has 1 dimensions",
       Safetensors({{"t", {"U8", {1, 1}, "x"}}},
                   {{"DCP_SHARDING_INFO", json{{"t", {{"saved_offsets", {0}}}}}.dump()}})},
  };
  for (const auto& [want, bytes] : cases) {
    SCOPED_TRACE(want);
    WriteFile(tmp.path() + "/b/bad.safetensors", bytes);
    auto h = ReadSafetensorsHeader(dir.get(), "bad.safetensors");
    ASSERT_FALSE(h.ok());
    EXPECT_EQ(h.status().code(), Code::kCorrupt);
    EXPECT_NE(h.status().message().find(want), std::string::npos) << h.status().message();
    EXPECT_NE(h.status().message().find("bad.safetensors"), std::string::npos);
  }
}

// --- The key index ------------------------------------------------------------------------

TEST(SafetensorsKeyIndex, IndexesEveryTensorFromHeadersAloneWithoutReadingData) {
  Env env;
  HfCheckpoint c = WriteHf(&env, "hf");
  const uint64_t before = env.dir->bytes_read();
  ASSERT_TRUE(env.index->Build("hf", /*checksums=*/false).ok()) << env.index->IndexError("hf");
  // The index file and two headers: far less than the tensors.
  EXPECT_LT(env.dir->bytes_read() - before, 4096u);
  EXPECT_EQ(env.index->IndexError("hf"), "");

  auto items = env.index->Items("hf");
  ASSERT_TRUE(items.ok()) << items.status().ToString();
  ASSERT_EQ(items->size(), c.tensors.size());
  for (const IndexedItem& it : *items) {
    SCOPED_TRACE(it.fqn);
    const Tensor& t = c.tensors.at(it.fqn);
    EXPECT_EQ(it.file, c.file_of.at(it.fqn));
    EXPECT_EQ(it.kind, ItemKind::kTensor);
    EXPECT_FALSE(it.is_bytes);
    EXPECT_EQ(it.global_size, t.shape);
    EXPECT_EQ(it.chunk_sizes, t.shape);
    EXPECT_EQ(it.chunk_offsets, std::vector<int64_t>(t.shape.size(), 0));
    EXPECT_EQ(it.raw_offset, it.offset);
    EXPECT_EQ(it.raw_nbytes, t.data.size());
    EXPECT_EQ(c.shard_bytes.at(it.file).substr(it.raw_offset, it.raw_nbytes), t.data);
    if (!it.stride.empty()) {
      EXPECT_EQ(it.stride.back(), 1);
    }
    if (it.length > 0) {
      auto r = env.index->Resolve("hf", it.file, it.offset + it.length - 1);
      ASSERT_TRUE(r.has_value());
      EXPECT_EQ(r->fqn, it.fqn);
    }
  }
  EXPECT_EQ(items->at(0).dtype == "float32" || items->at(0).dtype == "bfloat16" ||
                items->at(0).dtype == "int64",
            true);
  std::map<std::string, std::string> dtypes;
  for (const IndexedItem& it : *items) dtypes[it.fqn] = it.dtype;
  EXPECT_EQ(dtypes["layers.0.w"], "bfloat16");
  EXPECT_EQ(dtypes["layers.1.w"], "float16");
  EXPECT_EQ(dtypes["mask"], "bool");
  EXPECT_EQ(dtypes["step"], "int64");
  auto fqns = env.index->Fqns("hf");
  ASSERT_TRUE(fqns.ok());
  EXPECT_EQ(fqns->size(), c.tensors.size());
  // Nothing resolves in a header.
  EXPECT_FALSE(env.index->Resolve("hf", "model-00001-of-00002.safetensors", 3).has_value());
}

TEST(SafetensorsKeyIndex, VerifyCatchesAFlippedByteInABackingShard) {
  Env env;
  HfCheckpoint c = WriteHf(&env, "hf");
  ASSERT_TRUE(env.index->Build("hf", /*checksums=*/true).ok());
  auto clean = env.index->Verify("hf");
  ASSERT_TRUE(clean.ok()) << clean.status().ToString();
  EXPECT_TRUE(clean->bad.empty()) << clean->bad.front().first << ": " << clean->bad.front().second;
  EXPECT_EQ(clean->items, c.tensors.size());
  EXPECT_EQ(clean->unchecked, 0u);

  // Flip one byte inside layers.1.w's data on the backing store.
  const IndexedItem w = env.index->ItemsOf("hf", "layers.1.w").value().at(0);
  std::string bytes = c.shard_bytes.at(w.file);
  bytes[w.raw_offset + 100] ^= 0x01;
  WriteFile(env.Backing("hf/" + w.file), bytes);
  auto report = env.index->Verify("hf");
  ASSERT_TRUE(report.ok());
  ASSERT_EQ(report->bad.size(), 1u);
  EXPECT_EQ(report->bad[0].first, "layers.1.w@0_0");
  EXPECT_NE(report->bad[0].second.find("checksum mismatch"), std::string::npos);
}

TEST(SafetensorsKeyIndex, VerifyReportsAHeaderThatNoLongerAgrees) {
  Env env;
  HfCheckpoint c = WriteHf(&env, "hf");
  ASSERT_TRUE(env.index->Build("hf", /*checksums=*/true).ok());
  // Rewrite shard 2 with a different dtype for one tensor (same sizes).
  WriteFile(env.Backing("hf/model-00002-of-00002.safetensors"),
            Safetensors({{"layers.1.w", {"BF16", {128, 64}, c.tensors["layers.1.w"].data}},
                         {"mask", {"BOOL", {7}, std::string(7, '\1')}},
                         {"empty", {"F32", {0, 4}, ""}}}));
  auto report = env.index->Verify("hf");
  ASSERT_TRUE(report.ok());
  bool found = false;
  for (const auto& [key, why] : report->bad) {
    if (key == "layers.1.w@0_0" && why.find("differs from model.safetensors.index.json") !=
                                       std::string::npos) {
      found = true;
    }
  }
  EXPECT_TRUE(found);
}

TEST(SafetensorsKeyIndex, ChecksumsComeFromWritePathBlockCrcsWithoutReadingTensors) {
  Env env;
  // One big shard, so the unaligned edges are small next to it.
  std::vector<std::pair<std::string, Tensor>> list;
  for (int i = 0; i < 4; ++i) {
    list.push_back({"w" + std::to_string(i), {"F32", {1024, 1024}, Random(4u << 20, 10 + i)}});
  }
  const std::string bytes = Safetensors(list);
  WriteFile(env.Backing("one/model.safetensors"), bytes);
  auto crcs = std::make_shared<BlockCrcMap>();
  crcs->Record(0, bytes.data(), bytes.size());
  crcs->Finish(bytes.size());
  struct stat st;
  ASSERT_EQ(::stat(env.Backing("one/model.safetensors").c_str(), &st), 0);
  env.index->AddBlockCrcs("one/model.safetensors", FileKeyFromStat(st), crcs);
  const uint64_t before = env.dir->bytes_read();
  ASSERT_TRUE(env.index->Build("one", /*checksums=*/true).ok()) << env.index->IndexError("one");
  EXPECT_LT((env.dir->bytes_read() - before) * 4, bytes.size());
  for (const IndexedItem& it : env.index->Items("one").value()) {
    ASSERT_TRUE(it.has_checksum) << it.fqn;
    EXPECT_EQ(it.checksum, Crc32c(bytes.data() + it.offset, it.length)) << it.fqn;
  }
}

TEST(SafetensorsKeyIndex, SurvivesARestartAndIsRebuiltWhenTheIndexChanges) {
  Env env;
  WriteHf(&env, "hf");
  ASSERT_TRUE(env.index->Build("hf", /*checksums=*/true).ok());
  auto before = env.index->Items("hf").value();
  env.Reopen();
  EXPECT_TRUE(env.index->IsIndexed("hf"));
  const uint64_t read_before = env.dir->bytes_read();
  auto loaded = env.index->Items("hf");
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(*loaded, before);
  EXPECT_EQ(env.dir->bytes_read(), read_before) << "loaded from RocksDB, not rebuilt";

  // A new save into the directory with one tensor less: rebuilt after the restart.
  json index = json::parse(ReadFile(env.Backing("hf/model.safetensors.index.json")));
  index["weight_map"].erase("mask");
  index["metadata"]["total_size"] = 99;  // a different size, as a rewrite would have
  WriteFile(env.Backing("hf/model.safetensors.index.json"), index.dump());
  env.Reopen();
  auto again = env.index->Fqns("hf");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->size(), before.size()) << "every tensor of the named shards is indexed";
}

TEST(SafetensorsKeyIndex, AMalformedShardHeaderFailsTheCheckpointWithAClearError) {
  Env env;
  WriteHf(&env, "hf");
  WriteFile(env.Backing("hf/model-00002-of-00002.safetensors"), RawHeader("{\"x\":", 5));
  Status st = env.index->Build("hf", false);
  EXPECT_EQ(st.code(), Code::kCorrupt);
  EXPECT_NE(env.index->IndexError("hf").find("model-00002-of-00002.safetensors"),
            std::string::npos)
      << env.index->IndexError("hf");
  auto items = env.index->Items("hf");
  ASSERT_FALSE(items.ok());
  EXPECT_EQ(items.status().code(), Code::kCorrupt);

  // An index that names a tensor its shard lacks.
  Env env2;
  WriteHf(&env2, "hf");
  json index = json::parse(ReadFile(env2.Backing("hf/model.safetensors.index.json")));
  index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors";
  WriteFile(env2.Backing("hf/model.safetensors.index.json"), index.dump());
  EXPECT_EQ(env2.index->Build("hf", false).code(), Code::kCorrupt);
  EXPECT_NE(env2.index->IndexError("hf").find("ghost"), std::string::npos);
}

TEST(SafetensorsKeyIndex, ShardsOfADistributedSaveAreChunksOfOneTensor) {
  Env env;
  // Two row halves of w (8 x 2 float32), as torch's sharded HF save writes them, and an index.
  for (int part = 0; part < 2; ++part) {
    json info = {{"w", {{"saved_offsets", {4 * part, 0}}}}};
    WriteFile(env.Backing("d/shard-0000" + std::to_string(part + 1) +
                          "-model-00001-of-00001.safetensors"),
              Safetensors({{"w", {"F32", {4, 2}, Random(32, part)}}},
                          {{"DCP_SHARDING_INFO", info.dump()}}));
  }
  json index = {{"weight_map",
                 {{"w", "shard-00001-model-00001-of-00001.safetensors"}}}};
  // The index names the first shard only for "w"; add the second by a second entry name.
  index["weight_map"]["w#2"] = "shard-00002-model-00001-of-00001.safetensors";
  WriteFile(env.Backing("d/model.safetensors.index.json"), index.dump());
  Status st = env.index->Build("d", false);
  // "w#2" is not in the second shard's header: a clear error, not a crash.
  EXPECT_EQ(st.code(), Code::kCorrupt);

  index["weight_map"].erase("w#2");
  WriteFile(env.Backing("d/model.safetensors.index.json"), index.dump());
  WriteFile(env.Backing("d/model.safetensors.index.json"), index.dump());
  ASSERT_TRUE(env.index->Build("d", false).ok()) << env.index->IndexError("d");
  auto w = env.index->ItemsOf("d", "w").value();
  ASSERT_EQ(w.size(), 1u);  // only the shards the index names
  EXPECT_EQ(w[0].chunk_offsets, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(w[0].global_size, (std::vector<int64_t>{4, 2}));
}

TEST(SafetensorsKeyIndex, ASingleModelSafetensorsIsACheckpoint) {
  Env env;
  WriteFile(env.Backing("s/model.safetensors"),
            Safetensors({{"a", {"F16", {3}, Random(6, 1)}}, {"b", {"I32", {2, 2}, Random(16, 2)}}}));
  auto src = FindCheckpointSource(env.dir.get(), "s");
  ASSERT_TRUE(src.ok());
  EXPECT_EQ(src->kind, SourceKind::kSafetensors);
  EXPECT_EQ(src->files, std::vector<std::string>{"model.safetensors"});
  ASSERT_TRUE(env.index->Build("s", true).ok());
  EXPECT_EQ(env.index->Fqns("s").value(), (std::vector<std::string>{"a", "b"}));
  // Not a checkpoint: a directory with other files only.
  WriteFile(env.Backing("plain/notes.txt"), "x");
  EXPECT_EQ(FindCheckpointSource(env.dir.get(), "plain").status().code(), Code::kNotFound);
}

// --- DCP no-collectives saves -------------------------------------------------------------

TEST(NoDistKeyIndex, PerRankMetadataIsIndexedLikeOneMetadata) {
  Env env;
  const fs::path fixture = kFixtures / "torch113_4rank_single_file";
  // The reference: the fixture with its `.metadata`.
  fs::create_directories(env.Backing("ref"));
  fs::create_directories(env.Backing("nd"));
  for (const auto& e : fs::directory_iterator(fixture)) {
    fs::copy_file(e.path(), env.Backing("ref") / e.path().filename());
    if (e.path().filename() != ".metadata") {
      fs::copy_file(e.path(), env.Backing("nd") / e.path().filename());
    }
  }
  // Two ranks that each describe every item (as a rank that saved replicated items would):
  // keys both name are kept once.
  const std::string md = ReadFile(fixture / ".metadata");
  WriteFile(env.Backing("nd/__0.metadata"), md);
  WriteFile(env.Backing("nd/__1.metadata"), md);
  auto src = FindCheckpointSource(env.dir.get(), "nd");
  ASSERT_TRUE(src.ok());
  EXPECT_EQ(src->kind, SourceKind::kDcpRanks);
  EXPECT_EQ(src->files, (std::vector<std::string>{"__0.metadata", "__1.metadata"}));

  ASSERT_TRUE(env.index->Build("ref", true).ok());
  ASSERT_TRUE(env.index->Build("nd", true).ok()) << env.index->IndexError("nd");
  auto ref = env.index->Items("ref").value();
  auto nd = env.index->Items("nd").value();
  ASSERT_EQ(nd.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(nd[i], ref[i]) << KeyName(ref[i]);
  auto report = env.index->Verify("nd");
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->bad.empty());
  EXPECT_EQ(report->items, ref.size());

  // A malformed rank file: a clear error naming it.
  WriteFile(env.Backing("nd/__2.metadata"), "not a pickle");
  EXPECT_EQ(env.index->Build("nd", false).code(), Code::kCorrupt);
  EXPECT_NE(env.index->IndexError("nd").find("__2.metadata"), std::string::npos)
      << env.index->IndexError("nd");
}

}  // namespace
}  // namespace ckptfs::store
