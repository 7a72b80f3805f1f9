#include "store/dcp/checkpoint_source.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "common/path.h"
#include "store/dcp/commit_names.h"
#include "store/dcp/metadata_file.h"
#include "store/dcp/rank_metadata.h"
#include "store/dcp/safetensors_header.h"
#include "store/safetensors_index.h"

namespace ckptfs::store {
namespace {

// The rank of "__{rank}.metadata".
uint64_t RankOf(const std::string& name) {
  uint64_t r = 0;
  for (size_t i = 2; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) {
    r = r * 10 + static_cast<uint64_t>(name[i] - '0');
  }
  return r;
}

Status AddIdentity(BackingDir* dir, const std::string& path, keyidx::MetadataId* id) {
  CKPT_ASSIGN_OR_RETURN(struct stat st, dir->Stat(path));
  keyidx::MetadataId one = keyidx::MetadataIdOf(st);
  id->size += one.size;
  id->mtime_ns = std::max(id->mtime_ns, one.mtime_ns);
  id->ino = id->ino * 0x9E3779B97F4A7C15ull + one.ino;
  return Status::Ok();
}

Result<DcpMetadata> FromRanks(BackingDir* dir, const std::string& ckpt,
                              const std::vector<std::string>& files) {
  RankMetadataMerger merger;
  for (const std::string& f : files) {
    CKPT_ASSIGN_OR_RETURN(std::string bytes, ReadMetadataBytes(dir, path::Join(ckpt, f)));
    CKPT_RETURN_IF_ERROR(merger.Add(f, bytes));
  }
  return merger.Take();
}

// The tensor names the index's weight_map assigns to each file.
Result<std::map<std::string, std::vector<std::string>>> WeightMap(const std::string& text,
                                                                  const std::string& what) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  std::map<std::string, std::vector<std::string>> out;
  // ParseSafetensorsIndex has checked the shape already.
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    return Corrupt(what + ": no weight_map");
  }
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    if (file.is_string()) out[file.get<std::string>()].push_back(tensor);
  }
  return out;
}

Result<DcpMetadata> FromSafetensors(BackingDir* dir, const std::string& ckpt,
                                    const std::string& commit_file) {
  std::vector<std::string> shards;
  std::map<std::string, std::vector<std::string>> named;
  if (CommitKindOf(commit_file) == CommitKind::kSafetensorsIndex) {
    CKPT_ASSIGN_OR_RETURN(std::string text, ReadMetadataBytes(dir, path::Join(ckpt, commit_file)));
    Result<std::vector<std::string>> files = ParseSafetensorsIndex(text);
    if (!files.ok()) return Status(files.status().code(), commit_file + ": " + files.status().message());
    shards = std::move(*files);
    CKPT_ASSIGN_OR_RETURN(named, WeightMap(text, commit_file));
  } else {
    shards.push_back(commit_file);
  }
  DcpMetadata out;
  out.flavor = "safetensors";
  std::map<std::string, uint32_t> chunks_of;  // fqn -> chunks so far
  for (const std::string& file : shards) {
    Result<SafetensorsHeader> h = ReadSafetensorsHeader(dir, path::Join(ckpt, file));
    if (!h.ok()) return h.status();
    if (auto want = named.find(file); want != named.end()) {
      std::set<std::string_view> have;
      for (const SafetensorsTensor& t : h->tensors) have.insert(t.name);
      for (const std::string& name : want->second) {
        if (!have.count(name)) {
          return Corrupt(commit_file + " puts tensor \"" + name + "\" in " + file +
                         ", whose header does not have it");
        }
      }
    }
    for (SafetensorsTensor& t : h->tensors) {
      DcpItem& item = out.items.emplace_back();
      item.kind = t.known_dtype ? ItemKind::kTensor : ItemKind::kOpaque;
      item.fqn = std::move(t.name);
      item.chunk_offsets = std::move(t.saved_offsets);
      item.chunk_sizes = t.shape;
      item.dtype = std::move(t.dtype);
      item.file = file;
      item.offset = item.raw_offset = t.begin;
      item.length = item.raw_nbytes = t.end - t.begin;
      item.chunk_index = chunks_of[item.fqn]++;
      item.data_resolved = true;
      item.stride.assign(t.shape.size(), 1);
      for (size_t d = t.shape.size(); d-- > 1;) {
        item.stride[d - 1] = item.stride[d] * std::max<int64_t>(t.shape[d], 1);
      }
    }
  }
  // The global size of each fqn covers all of its chunks.
  std::map<std::string, std::vector<int64_t>> global;
  for (const DcpItem& item : out.items) {
    std::vector<int64_t>& g = global[item.fqn];
    if (g.size() < item.chunk_sizes.size()) g.resize(item.chunk_sizes.size(), 0);
    for (size_t d = 0; d < item.chunk_sizes.size(); ++d) {
      g[d] = std::max(g[d], item.chunk_offsets[d] + item.chunk_sizes[d]);
    }
  }
  for (DcpItem& item : out.items) item.global_size = global[item.fqn];
  return out;
}

}  // namespace

const char* SourceKindName(SourceKind kind) {
  switch (kind) {
    case SourceKind::kDcp:
      return "dcp";
    case SourceKind::kDcpRanks:
      return "dcp_no_dist";
    case SourceKind::kSafetensors:
      return "safetensors";
  }
  return "?";
}

Result<CheckpointSource> FindCheckpointSource(BackingDir* dir, const std::string& ckpt) {
  CheckpointSource src;
  Result<struct stat> md = dir->Stat(path::Join(ckpt, ".metadata"));
  if (md.ok() && S_ISREG(md->st_mode)) {
    src.kind = SourceKind::kDcp;
    src.files = {".metadata"};
    src.id = keyidx::MetadataIdOf(*md);
    return src;
  }
  if (!md.ok() && md.status().code() != Code::kNotFound) return md.status();
  Result<std::vector<DirEntry>> entries = dir->List(ckpt);
  if (!entries.ok()) {
    if (entries.status().code() == Code::kNotFound) return NotFound("no checkpoint in '" + ckpt + "'");
    return entries.status();
  }
  std::vector<std::string> ranks, indexes;
  bool single = false;
  for (const DirEntry& e : *entries) {
    if (e.type != DT_REG && e.type != DT_UNKNOWN) continue;
    switch (CommitKindOf(e.name)) {
      case CommitKind::kDcpRank:
        ranks.push_back(e.name);
        break;
      case CommitKind::kSafetensorsIndex:
        indexes.push_back(e.name);
        break;
      case CommitKind::kSafetensorsSingle:
        single = true;
        break;
      default:
        break;
    }
  }
  if (!indexes.empty()) {
    // transformers writes one; more than one is unusual: take the first by name.
    std::sort(indexes.begin(), indexes.end());
    src.kind = SourceKind::kSafetensors;
    src.files = {indexes.front()};
  } else if (single) {
    src.kind = SourceKind::kSafetensors;
    src.files = {"model.safetensors"};
  } else if (!ranks.empty()) {
    std::sort(ranks.begin(), ranks.end(), [](const std::string& a, const std::string& b) {
      return RankOf(a) != RankOf(b) ? RankOf(a) < RankOf(b) : a < b;
    });
    src.kind = SourceKind::kDcpRanks;
    src.files = std::move(ranks);
  } else {
    return NotFound("no .metadata, __{rank}.metadata or safetensors index in '" + ckpt + "'");
  }
  for (const std::string& f : src.files) {
    CKPT_RETURN_IF_ERROR(AddIdentity(dir, path::Join(ckpt, f), &src.id));
  }
  return src;
}

Result<DcpMetadata> ReadCheckpointItems(BackingDir* dir, const std::string& ckpt,
                                        const CheckpointSource& source) {
  switch (source.kind) {
    case SourceKind::kDcp: {
      CKPT_ASSIGN_OR_RETURN(std::string bytes, ReadMetadataBytes(dir, path::Join(ckpt, ".metadata")));
      return ParseDcpMetadata(bytes);
    }
    case SourceKind::kDcpRanks:
      return FromRanks(dir, ckpt, source.files);
    case SourceKind::kSafetensors:
      if (source.files.empty()) return Invalid("no safetensors commit file");
      return FromSafetensors(dir, ckpt, source.files.front());
  }
  return Invalid("unknown checkpoint source");
}

Result<DcpMetadata> ReadCheckpointItems(BackingDir* dir, const std::string& ckpt,
                                        CheckpointSource* source) {
  CKPT_ASSIGN_OR_RETURN(CheckpointSource found, FindCheckpointSource(dir, ckpt));
  Result<DcpMetadata> md = ReadCheckpointItems(dir, ckpt, found);
  if (source != nullptr) *source = std::move(found);
  return md;
}

}  // namespace ckptfs::store
