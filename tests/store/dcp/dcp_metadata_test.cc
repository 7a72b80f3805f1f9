#include "store/dcp/dcp_metadata.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>

namespace ckptfs::store {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Fields = std::vector<std::pair<std::string, std::string>>;

const fs::path kFixtures = fs::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp";

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every fixture: its manifest and the .metadata it describes.
struct Fixture {
  std::string name;
  fs::path metadata;
  json manifest;
};

std::vector<Fixture> AllFixtures() {
  std::vector<Fixture> out;
  for (const auto& entry : fs::recursive_directory_iterator(kFixtures)) {
    std::string path = entry.path().string();
    const std::string suffix = ".manifest.json";
    if (path.size() < suffix.size() || path.substr(path.size() - suffix.size()) != suffix) {
      continue;
    }
    std::string base = path.substr(0, path.size() - suffix.size());
    Fixture f;
    f.name = fs::relative(base, kFixtures).string();
    f.manifest = json::parse(ReadFile(entry.path()));
    // "<dir>.manifest.json" describes "<dir>/.metadata"; synthetic ones name the file itself.
    f.metadata = fs::is_directory(base) ? fs::path(base) / ".metadata" : fs::path(base);
    out.push_back(std::move(f));
  }
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.name < b.name; });
  return out;
}

std::string ItemKey(const std::string& fqn, const std::optional<std::vector<int64_t>>& offsets) {
  std::string key = fqn + "@";
  if (!offsets) return key + "bytes";
  for (int64_t v : *offsets) key += std::to_string(v) + ",";
  return key;
}

// --- A tiny pickle writer for building test metadata ----------------------------------------

std::string Le(uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}
std::string Str(std::string_view s) { return "X" + Le(s.size(), 4) + std::string(s); }
std::string Int(int64_t v) {
  if (v >= INT32_MIN && v <= INT32_MAX) return "J" + Le(static_cast<uint32_t>(v), 4);
  return "\x8a\x08" + Le(static_cast<uint64_t>(v), 8);
}
std::string None() { return "N"; }
std::string Seq(const std::vector<std::string>& elems) {
  std::string s;
  for (const auto& e : elems) s += e;
  return s;
}
std::string Tuple(const std::vector<std::string>& elems) { return "(" + Seq(elems) + "t"; }
std::string List(const std::vector<std::string>& elems) { return "](" + Seq(elems) + "e"; }
std::string Dict(const Fields& kv) {
  std::string s = "}(";
  for (const auto& [k, v] : kv) s += k + v;
  return s + "u";
}
std::string Global(std::string_view module, std::string_view name) {
  return Str(module) + Str(name) + "\x93";
}
std::string Reduce(const std::string& fn, const std::string& args) { return fn + args + "R"; }
std::string Obj(std::string_view module, std::string_view name, const std::string& state) {
  std::string s = Global(module, name) + ")\x81";
  return state.empty() ? s : s + state + "b";
}
std::string StrDict(const Fields& kv) {
  Fields out;
  for (const auto& [k, v] : kv) out.emplace_back(Str(k), v);
  return Dict(out);
}
std::string Pickle(const std::string& body) { return "\x80\x04" + body + "."; }

std::string Ints(const std::vector<int64_t>& v) {
  std::vector<std::string> elems;
  for (int64_t x : v) elems.push_back(Int(x));
  return Tuple(elems);
}
std::string Size(const std::vector<int64_t>& v) {
  return Reduce(Global("torch", "Size"), Tuple({Ints(v)}));
}

constexpr std::string_view kM2 = "torch.distributed.checkpoint.metadata";
constexpr std::string_view kFs2 = "torch.distributed.checkpoint.filesystem";

std::string MemFormat(bool call_form) {
  if (call_form) return Reduce(Global(kM2, "_MEM_FORMAT_ENCODING"), Tuple({Int(0)}));
  return Reduce(Global("builtins", "getattr"),
                Tuple({Global(kM2, "_MEM_FORMAT_ENCODING"), Str("TORCH_CONTIGUOUS_FORMAT")}));
}

std::string Props(std::string_view dtype, bool call_form = false,
                  std::string_view layout = "torch.strided") {
  std::string state =
      Tuple({Global("torch", dtype),
             Reduce(Global("torch.serialization", "_get_layout"), Tuple({Str(layout)})), "\x89",
             MemFormat(call_form), "\x89"});
  return Obj(kM2, "TensorProperties", state);
}

std::string Chunk(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  return Obj(kM2, "ChunkStorageMetadata",
             StrDict({{"offsets", Size(offsets)}, {"sizes", Size(sizes)}}));
}

std::string TensorMd(std::string_view dtype, const std::vector<int64_t>& size,
                     const std::vector<std::string>& chunks, bool call_form = false) {
  return Obj(kM2, "TensorStorageMetadata",
             StrDict({{"properties", Props(dtype, call_form)},
                      {"size", Size(size)},
                      {"chunks", List(chunks)}}));
}

std::string BytesMd() { return Obj(kM2, "BytesStorageMetadata", ""); }

std::string Index(std::string_view fqn, std::optional<std::vector<int64_t>> offsets,
                  int64_t index = 0) {
  Fields f = {{"fqn", Str(fqn)}};
  if (offsets) f.emplace_back("offset", Size(*offsets));
  f.emplace_back("index", offsets ? Int(index) : None());
  return Obj(kM2, "MetadataIndex", StrDict(f));
}

std::string Info(std::string_view path, int64_t offset, int64_t length,
                 const std::vector<std::string>& transforms = {}) {
  Fields f = {{"relative_path", Str(path)}, {"offset", Int(offset)}, {"length", Int(length)}};
  if (!transforms.empty()) {
    std::vector<std::string> t;
    for (const auto& s : transforms) t.push_back(Str(s));
    f.emplace_back("transform_descriptors", List(t));
  }
  return Obj(kFs2, "_StorageInfo", StrDict(f));
}

// A torch-2.x-style Metadata with two chunks of "w" and one bytes item "b".
struct Spec {
  std::string module = std::string(kM2), cls = "Metadata";
  Fields sdm = {
      {Str("w"), TensorMd("bfloat16", {4, 2}, {Chunk({0, 0}, {2, 2}), Chunk({2, 0}, {2, 2})})},
      {Str("b"), BytesMd()}};
  Fields storage = {{Index("w", std::vector<int64_t>{0, 0}), Info("__0_0.distcp", 100, 50)},
                    {Index("w", std::vector<int64_t>{2, 0}, 1), Info("__1_0.distcp", 0, 60)},
                    {Index("b", std::nullopt), Info("__0_0.distcp", 0, 100)}};
  Fields extra;
  std::string Build() const {
    Fields f = {{"state_dict_metadata", Dict(sdm)}, {"storage_data", Dict(storage)}};
    for (const auto& e : extra) f.push_back(e);
    return Pickle(Obj(module, cls, StrDict(f)));
  }
};

Result<DcpMetadata> ParseSpec(const Spec& spec) {
  std::string bytes = spec.Build();
  return ParseDcpMetadata(bytes);
}

void ExpectRejected(const Spec& spec, std::string_view message_part) {
  Result<DcpMetadata> md = ParseSpec(spec);
  ASSERT_FALSE(md.ok());
  EXPECT_NE(md.status().message().find(message_part), std::string::npos) << md.status().message();
}

// --- Fixtures ---------------------------------------------------------------------------------

TEST(DcpMetadata, EveryFixtureMatchesItsManifest) {
  std::vector<Fixture> fixtures = AllFixtures();
  ASSERT_GE(fixtures.size(), 14u) << "fixtures missing under " << kFixtures;
  const std::set<std::string> kKnownFields = {
      "kind",   "fqn",    "chunk_offsets", "chunk_sizes", "global_size", "dtype",         "file",
      "offset", "length", "raw_offset",    "raw_nbytes",  "stride",      "storage_offset",
      "transforms"};
  for (const Fixture& f : fixtures) {
    SCOPED_TRACE(f.name);
    std::string bytes = ReadFile(f.metadata);
    ASSERT_FALSE(bytes.empty());
    Result<DcpMetadata> md = ParseDcpMetadata(bytes);
    ASSERT_TRUE(md.ok()) << md.status().ToString();
    // Real torch 2.x and Megatron fixtures name their flavor (Megatron-core 0.16 writes a
    // plain torch Metadata with an extra all_local_plans field, not MCoreMetadata), and
    // what torch read back from them: version and storage_meta.checkpoint_id.
    EXPECT_EQ(md->flavor, f.manifest.value("flavor", "torch1"));
    if (f.manifest.contains("version")) EXPECT_EQ(md->version, f.manifest["version"]);
    if (f.manifest.contains("checkpoint_id")) {
      EXPECT_EQ(md->checkpoint_id, f.manifest["checkpoint_id"]);
    }
    std::map<std::string, const DcpItem*> by_key;
    for (const DcpItem& item : md->items) {
      std::optional<std::vector<int64_t>> offsets;
      if (!item.is_bytes) offsets = item.chunk_offsets;
      EXPECT_TRUE(by_key.emplace(ItemKey(item.fqn, offsets), &item).second);
    }
    const json& items = f.manifest["items"];
    ASSERT_EQ(md->items.size(), items.size());
    for (const json& want : items) {
      for (const auto& [field, _] : want.items()) {
        EXPECT_TRUE(kKnownFields.count(field)) << "manifest field not checked: " << field;
      }
      // Bytes items have no chunk fields, also when a transform makes them opaque.
      bool bytes_item = !want.contains("chunk_offsets");
      std::optional<std::vector<int64_t>> offsets;
      if (!bytes_item) offsets = want["chunk_offsets"].get<std::vector<int64_t>>();
      std::string key = ItemKey(want["fqn"], offsets);
      SCOPED_TRACE(key);
      ASSERT_TRUE(by_key.count(key));
      const DcpItem& got = *by_key[key];
      EXPECT_EQ(ItemKindName(got.kind), want["kind"].get<std::string>());
      EXPECT_EQ(got.fqn, want["fqn"]);
      EXPECT_EQ(got.file, want["file"]);
      EXPECT_EQ(got.offset, want["offset"].get<uint64_t>());
      EXPECT_EQ(got.length, want["length"].get<uint64_t>());
      // Transformed items (a stream extension such as zstd) are opaque and keep their
      // descriptors.
      EXPECT_EQ(got.transforms, want.value("transforms", std::vector<std::string>{}));
      if (bytes_item) {
        EXPECT_TRUE(got.is_bytes);
        EXPECT_TRUE(got.chunk_offsets.empty() && got.chunk_sizes.empty() &&
                    got.global_size.empty() && got.dtype.empty());
      } else {
        EXPECT_EQ(got.chunk_offsets, want["chunk_offsets"].get<std::vector<int64_t>>());
        EXPECT_EQ(got.chunk_sizes, want["chunk_sizes"].get<std::vector<int64_t>>());
        EXPECT_EQ(got.global_size, want["global_size"].get<std::vector<int64_t>>());
        EXPECT_EQ(got.dtype, want["dtype"]);
      }
    }
    if (f.manifest.contains("other_fields")) {
      EXPECT_EQ(md->other_fields, f.manifest["other_fields"].get<std::vector<std::string>>());
    }
    // Real checkpoints: the files end exactly where their last item does.
    if (f.manifest.contains("files")) {
      std::vector<std::pair<std::string, uint64_t>> want_files;
      for (const auto& [file, info] : f.manifest["files"].items()) {
        // The metadata file itself: .metadata, or __{rank}.metadata of a per-rank save.
        bool is_metadata = file.size() >= 9 && file.compare(file.size() - 9, 9, ".metadata") == 0;
        if (!is_metadata) want_files.emplace_back(file, info["size"].get<uint64_t>());
      }
      std::sort(want_files.begin(), want_files.end());
      EXPECT_EQ(RequiredFileLengths(*md), want_files);
    }
  }
}

TEST(DcpMetadata, Torch2ExtrasAreRead) {
  // torch 2.14 (Python 3.14, pickle protocol 5): version, and checkpoint_id a PosixPath.
  Result<DcpMetadata> md = ParseDcpMetadata(ReadFile(kFixtures / "torch214_dtensor_4rank/.metadata"));
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  EXPECT_EQ(md->flavor, "torch2");
  EXPECT_EQ(md->version, "1.0.0");
  EXPECT_EQ(md->checkpoint_id, "/ckpt/torch214_dtensor_4rank");
  EXPECT_EQ(md->other_fields, (std::vector<std::string>{"planner_data", "storage_meta", "version"}));
  // torch 2.6 (Python 3.13, protocol 4) writes no version.
  md = ParseDcpMetadata(ReadFile(kFixtures / "torch26_dtensor_4rank/.metadata"));
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  EXPECT_EQ(md->version, "");
  EXPECT_EQ(md->checkpoint_id, "/ckpt/torch26_dtensor_4rank");
  // Megatron-core 0.16: checkpoint_id a plain str, all_local_plans on a plain Metadata.
  md = ParseDcpMetadata(ReadFile(kFixtures / "megatron016_torch_dist/.metadata"));
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  EXPECT_EQ(md->checkpoint_id, "/ckpt/megatron016_torch_dist");
  EXPECT_EQ(md->other_fields,
            (std::vector<std::string>{"all_local_plans", "storage_meta", "version"}));
  // A collective-less save: each rank's __{rank}.metadata describes its own file only.
  md = ParseDcpMetadata(ReadFile(kFixtures / "torch214_per_rank/__2.metadata"));
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  EXPECT_EQ(RequiredFileLengths(*md).size(), 1u);
  EXPECT_EQ(RequiredFileLengths(*md)[0].first, "__2_0.distcp");
}

TEST(DcpMetadata, ItemsFollowStateDictOrderAndChunkOrder) {
  Result<DcpMetadata> md = ParseSpec(Spec());
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  ASSERT_EQ(md->items.size(), 3u);
  EXPECT_EQ(md->flavor, "torch2");
  EXPECT_EQ(md->items[0].chunk_offsets, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(md->items[0].chunk_index, 0u);
  EXPECT_EQ(md->items[1].chunk_offsets, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(md->items[1].chunk_index, 1u);
  EXPECT_EQ(md->items[1].file, "__1_0.distcp");
  EXPECT_EQ(md->items[2].kind, ItemKind::kBytes);
  EXPECT_EQ(RequiredFileLengths(*md), (std::vector<std::pair<std::string, uint64_t>>{
                                          {"__0_0.distcp", 150}, {"__1_0.distcp", 60}}));
}

TEST(DcpMetadata, MemoryFormatAcceptedInBothForms) {
  Spec spec;
  spec.sdm[0].second =
      TensorMd("float32", {4, 2}, {Chunk({0, 0}, {2, 2}), Chunk({2, 0}, {2, 2})}, true);
  Result<DcpMetadata> md = ParseSpec(spec);
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  EXPECT_EQ(md->items[0].dtype, "float32");
  // A value outside the enum, or a member name it does not have, is not a memory format.
  for (const std::string& bad :
       {Reduce(Global(kM2, "_MEM_FORMAT_ENCODING"), Tuple({Int(7)})),
        Reduce(Global("builtins", "getattr"),
               Tuple({Global(kM2, "_MEM_FORMAT_ENCODING"), Str("__class__")}))}) {
    std::string props = Obj(kM2, "TensorProperties",
                            Tuple({Global("torch", "float32"), None(), "\x89", bad, "\x89"}));
    spec.sdm[0].second =
        Obj(kM2, "TensorStorageMetadata",
            StrDict({{"properties", props},
                     {"size", Size({4, 2})},
                     {"chunks", List({Chunk({0, 0}, {2, 2}), Chunk({2, 0}, {2, 2})})}}));
    ExpectRejected(spec, "memory format");
  }
}

TEST(DcpMetadata, TransformedItemsAreOpaque) {
  Spec spec;
  spec.storage[1].second = Info("__1_0.distcp", 0, 60, {"stream.zstd/1"});
  spec.storage[2].second = Info("__0_0.distcp", 0, 100, {"stream.zstd/1"});
  Result<DcpMetadata> md = ParseSpec(spec);
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  EXPECT_EQ(md->items[0].kind, ItemKind::kTensor);
  EXPECT_EQ(md->items[1].kind, ItemKind::kOpaque);
  EXPECT_EQ(md->items[1].transforms, std::vector<std::string>{"stream.zstd/1"});
  EXPECT_EQ(md->items[1].dtype, "bfloat16");
  EXPECT_EQ(md->items[2].kind, ItemKind::kOpaque);
  EXPECT_TRUE(md->items[2].is_bytes);
}

TEST(DcpMetadata, MegatronSubclassAndUnknownExtrasAreAccepted) {
  Spec spec;
  spec.module = "megatron.core.dist_checkpointing.strategies.torch";
  spec.cls = "MCoreMetadata";
  // Uninterpreted fields may hold anything, even globals we would never allow elsewhere.
  spec.extra = {{"mcore_data", StrDict({{"x", Global("os", "system")}})},
                {"all_local_plans", List({})},
                {"planner_data", None()}};
  Result<DcpMetadata> md = ParseSpec(spec);
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  EXPECT_EQ(md->flavor, "mcore");
  EXPECT_EQ(md->other_fields, (std::vector<std::string>{"all_local_plans", "mcore_data"}));
}

// --- Strictness and hostile input -------------------------------------------------------------

TEST(DcpMetadata, PathsMustStayInsideTheCheckpoint) {
  for (const char* path :
       {"../x.distcp", "/etc/passwd", "a/../../x", "a//b", "./a", "", "a/", "sub/.."}) {
    Spec spec;
    spec.storage[0].second = Info(path, 0, 10);
    SCOPED_TRACE(path);
    ExpectRejected(spec, "path");
  }
  Spec spec;
  spec.storage[0].second = Info("sub/__0_0.distcp", 0, 10);
  EXPECT_TRUE(ParseSpec(spec).ok());
  EXPECT_TRUE(ValidateRelativePath("__0_0.distcp").ok());
  EXPECT_FALSE(ValidateRelativePath(std::string("a\0b", 3)).ok());
}

TEST(DcpMetadata, PatchedRealFileWithEscapingPathIsRejected) {
  std::string bytes = ReadFile(kFixtures / "torch113_basic_single_file/.metadata");
  size_t pos = bytes.find("__0_0.distcp");
  ASSERT_NE(pos, std::string::npos);
  bytes.replace(pos, 12, "../0_0.distc");
  Result<DcpMetadata> md = ParseDcpMetadata(bytes);
  ASSERT_FALSE(md.ok());
  EXPECT_NE(md.status().message().find("'..'"), std::string::npos) << md.status().message();
}

TEST(DcpMetadata, ChunksAndStorageEntriesMustMatchOneToOne) {
  Spec missing;
  missing.storage.pop_back();
  ExpectRejected(missing, "no storage_data entry for 'b'");
  Spec extra;
  extra.storage.emplace_back(Index("ghost", std::nullopt), Info("__9_0.distcp", 0, 1));
  ExpectRejected(extra, "matches nothing");
  Spec dup_key;
  dup_key.storage.emplace_back(Index("w", std::vector<int64_t>{0, 0}, 7), Info("x.distcp", 0, 1));
  ExpectRejected(dup_key, "twice");
  Spec dup_chunk;
  dup_chunk.sdm[0].second =
      TensorMd("bfloat16", {4, 2}, {Chunk({0, 0}, {2, 2}), Chunk({0, 0}, {2, 2})});
  ExpectRejected(dup_chunk, "twice");
  Spec dup_fqn;
  dup_fqn.sdm.push_back(dup_fqn.sdm[1]);
  ExpectRejected(dup_fqn, "appears twice");
}

TEST(DcpMetadata, ChunkGeometryIsChecked) {
  Spec outside;
  outside.sdm[0].second =
      TensorMd("bfloat16", {4, 2}, {Chunk({0, 0}, {2, 2}), Chunk({2, 0}, {3, 2})});
  ExpectRejected(outside, "outside the tensor");
  Spec rank;
  rank.sdm[0].second = TensorMd("bfloat16", {4, 2}, {Chunk({0, 0}, {2, 2}), Chunk({2}, {2})});
  ExpectRejected(rank, "wrong rank");
  Spec negative;
  negative.storage[0].second = Info("__0_0.distcp", -1, 10);
  ExpectRejected(negative, "non-negative");
}

TEST(DcpMetadata, OnlyAllowlistedClassesAreInterpreted) {
  Spec top;
  top.module = "os";
  top.cls = "system";
  ExpectRejected(top, "unknown top-level class");
  Spec chunk;
  chunk.sdm[0].second =
      TensorMd("bfloat16", {4, 2}, {Chunk({0, 0}, {2, 2}), Obj("evil", "Chunk", "")});
  ExpectRejected(chunk, "expected");
  Spec dtype;
  dtype.sdm[0].second = Obj(
      kM2, "TensorStorageMetadata",
      StrDict({{"properties", Obj(kM2, "TensorProperties",
                                  Tuple({Global("os", "system"), None(), "\x89", None(), "\x89"}))},
               {"size", Size({4, 2})},
               {"chunks", List({})}}));
  ExpectRejected(dtype, "not a torch dtype");
  Spec size;
  size.sdm[0].second = Obj(kM2, "TensorStorageMetadata",
                           StrDict({{"properties", Props("float16")},
                                    {"size", Reduce(Global("os", "system"), Tuple({Ints({1})}))},
                                    {"chunks", List({})}}));
  ExpectRejected(size, "not a torch.Size");
  EXPECT_FALSE(ParseDcpMetadata(Pickle(List({}))).ok());
}

TEST(DcpMetadata, NonStridedLayoutIsOpaque) {
  Spec spec;
  std::string props = Props("float32", false, "torch.sparse_coo");
  spec.sdm[0].second =
      Obj(kM2, "TensorStorageMetadata",
          StrDict({{"properties", props},
                   {"size", Size({4, 2})},
                   {"chunks", List({Chunk({0, 0}, {2, 2}), Chunk({2, 0}, {2, 2})})}}));
  Result<DcpMetadata> md = ParseSpec(spec);
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  EXPECT_EQ(md->items[0].kind, ItemKind::kOpaque);
}

TEST(DcpMetadata, SharedChunkListBombFailsFast) {
  // Many fqns all pointing at one memoized list of many chunks: a walk that trusted the graph
  // would visit fqns x chunks items. Each chunk must claim its own storage entry, so the
  // parse stops at the second fqn.
  std::string chunks = "](";
  for (int i = 0; i < 2000; ++i) chunks += Chunk({i}, {1});
  chunks += "e\x94";  // memo 0 = the list
  std::string body = Global(kM2, "Metadata") + ")\x81" + "}(" + Str("state_dict_metadata") + "}(";
  for (int f = 0; f < 2000; ++f) {
    std::string list = f == 0 ? chunks : std::string("h\x00", 2);
    body +=
        Str("t" + std::to_string(f)) +
        Obj(kM2, "TensorStorageMetadata",
            StrDict({{"properties", Props("float32")}, {"size", Size({2000})}, {"chunks", list}}));
  }
  body += "u" + Str("storage_data") + "}(";
  for (int i = 0; i < 2000; ++i) {
    body += Index("t0", std::vector<int64_t>{i}) + Info("a.distcp", i, 1);
  }
  body +=
      "u"
      "u"
      "b";
  auto start = std::chrono::steady_clock::now();
  Result<DcpMetadata> md = ParseDcpMetadata(Pickle(body));
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(md.ok());
  EXPECT_NE(md.status().message().find("no storage_data entry for 't1'"), std::string::npos)
      << md.status().message();
  EXPECT_LT(secs, 5.0);
}

TEST(DcpMetadata, EveryPrefixAndByteFlipOfRealMetadataIsSafe) {
  for (const char* name :
       {"torch113_4rank_single_file/.metadata", "torch26_dtensor_4rank/.metadata",
        "megatron016_torch_dist/.metadata"}) {
    SCOPED_TRACE(name);
    std::string bytes = ReadFile(kFixtures / name);
    ASSERT_TRUE(ParseDcpMetadata(bytes).ok());
    for (size_t n = 0; n < bytes.size(); ++n) {
      EXPECT_FALSE(ParseDcpMetadata(std::string_view(bytes).substr(0, n)).ok()) << n;
    }
    for (size_t i = 0; i < bytes.size(); ++i) {
      std::string copy = bytes;
      copy[i] = static_cast<char>(copy[i] ^ 0x5a);
      Result<DcpMetadata> md = ParseDcpMetadata(copy);
      if (md.ok()) RequiredFileLengths(*md);
    }
  }
}

TEST(DcpMetadata, HundredThousandChunksParseQuickly) {
  // One tensor per 10 chunks, 100,000 chunks over 64 files, with memoized class globals as
  // Python writes them so the input has realistic size.
  constexpr int kTensors = 10000, kChunksPerTensor = 10;
  std::string body;
  body.reserve(64 << 20);
  body += Global(kM2, "Metadata") + ")\x81}(" + Str("state_dict_metadata") + "}(";
  for (int t = 0; t < kTensors; ++t) {
    std::vector<std::string> chunks;
    for (int c = 0; c < kChunksPerTensor; ++c) chunks.push_back(Chunk({c * 4, 0}, {4, 1024}));
    body += Str("model.layers." + std::to_string(t) + ".mlp.weight") +
            TensorMd("bfloat16", {4 * kChunksPerTensor, 1024}, chunks);
  }
  body += "u" + Str("storage_data") + "}(";
  for (int t = 0; t < kTensors; ++t) {
    for (int c = 0; c < kChunksPerTensor; ++c) {
      body += Index("model.layers." + std::to_string(t) + ".mlp.weight",
                    std::vector<int64_t>{c * 4, 0}, c) +
              Info("__" + std::to_string(t % 64) + "_0.distcp", int64_t{t} * 8192, 8192);
    }
  }
  body += "uub";
  std::string bytes = Pickle(body);
  auto start = std::chrono::steady_clock::now();
  Result<DcpMetadata> md = ParseDcpMetadata(bytes);
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  EXPECT_EQ(md->items.size(), 100000u);
  EXPECT_EQ(RequiredFileLengths(*md).size(), 64u);
  std::cout << "[ timing ] " << bytes.size() / 1e6 << " MB, 100000 chunks parsed in " << secs
            << " s\n";
  EXPECT_LT(secs, 10.0);  // generous for sanitizer builds; expect well under 1 s in release
}

}  // namespace
}  // namespace ckptfs::store
