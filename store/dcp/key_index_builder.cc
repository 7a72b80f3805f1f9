#include "store/dcp/key_index_builder.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <ctime>
#include <nlohmann/json.hpp>

#include "common/path.h"
#include "store/dcp/checkpoint_source.h"
#include "store/dcp/index_codec.h"
#include "store/dcp/item_reader.h"
#include "store/dcp/metadata_file.h"

namespace ckptfs::store {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using keyidx::FileGroup;
using keyidx::OpenedFile;
using keyidx::WindowReader;

// A checkpoint without .metadata is looked at again after this long.
constexpr auto kMissingRetry = std::chrono::seconds(1);

double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// The first item whose key (fqn, bytes or chunk offsets) an earlier item has already, or -1.
// Open addressing over item indices: no allocation per item.
ptrdiff_t FirstDuplicateKey(const std::vector<IndexedItem>& items) {
  auto same = [&](uint32_t a, uint32_t b) {
    const IndexedItem &x = items[a], &y = items[b];
    return x.is_bytes == y.is_bytes && x.fqn == y.fqn && x.chunk_offsets == y.chunk_offsets;
  };
  auto hash = [&](uint32_t i) {
    const IndexedItem& it = items[i];
    uint64_t h = XXH3_64bits_withSeed(it.chunk_offsets.data(),
                                      it.chunk_offsets.size() * sizeof(int64_t), it.is_bytes);
    return XXH3_64bits_withSeed(it.fqn.data(), it.fqn.size(), h);
  };
  constexpr uint32_t kEmpty = 0xffffffffu;
  size_t capacity = 16;
  while (capacity < items.size() * 2) capacity *= 2;  // at most half full
  std::vector<uint32_t> slots(capacity, kEmpty);
  const size_t mask = capacity - 1;
  for (uint32_t i = 0; i < items.size(); ++i) {
    for (size_t s = hash(i) & mask;; s = (s + 1) & mask) {
      if (slots[s] == kEmpty) {
        slots[s] = i;
        break;
      }
      if (same(slots[s], i)) return i;
    }
  }
  return -1;
}

struct ResolveStats {
  uint64_t unresolved = 0;
  std::string first_error;  // of the first unresolved item
  uint64_t with_sum = 0, from_blocks = 0, read_items = 0, read_bytes = 0;
  uint64_t from_memory = 0, from_backing = 0;  // bytes the windows took from each
  std::vector<std::string> used_block_crcs;  // paths whose block CRC maps were used
};

// Resolves each item of `items` against its shard file (tensor archives, unless `archives`
// is false: safetensors items are raw bytes, resolved from the header already), and gives it
// a checksum where one is known (`known_sums`), follows from the write path's block CRCs, or,
// with `checksums`, by reading it. Each shard file is opened once and read forward; what
// `held` (may be null) holds of it is read from memory.
ResolveStats ResolveItems(BackingDir* dir, BlockCrcCache* block_crcs, keyidx::HeldBytes* held,
                          const std::string& ckpt, std::vector<IndexedItem>* items,
                          KnownSums& known_sums, bool checksums, bool archives) {
  ResolveStats r;
  auto note = [&](const IndexedItem& it, const std::string& why) {
    if (r.unresolved++ == 0) r.first_error = KeyName(it) + ": " + why;
  };
  TorchPickleCache pickle_cache;
  for (const FileGroup& g : keyidx::GroupByFile(*items)) {
    const std::string file(g.name);
    const std::string path = path::Join(ckpt, file);
    Result<OpenedFile> f = keyidx::OpenShard(dir, path);
    auto& sums = known_sums[file];
    if (!f.ok()) {
      for (uint32_t i : g.idx) {
        IndexedItem& it = (*items)[i];
        if (it.kind == ItemKind::kTensor) it.kind = ItemKind::kOpaque;
        note(it, f.status().ToString());
      }
      continue;
    }
    WindowReader reader(dir, f->fd.get(), f->size);
    if (held != nullptr) reader.ServeFrom(held, path, f->key);
    std::shared_ptr<const BlockCrcMap> blocks = block_crcs->For(path, f->key);
    if (blocks) r.used_block_crcs.push_back(path);
    for (uint32_t i : g.idx) {
      IndexedItem& it = (*items)[i];
      if (it.offset > f->size || f->size - it.offset < it.length) {
        if (it.kind == ItemKind::kTensor) it.kind = ItemKind::kOpaque;
        note(it, "item range past the end of " + file + " (" + std::to_string(f->size) + " bytes)");
        continue;
      }
      if (it.kind == ItemKind::kTensor && archives) {
        std::string error;
        keyidx::ResolveTensor(&reader, &it, &error, &pickle_cache);
        if (!error.empty()) note(it, error);
      }
      auto known = sums.find({it.offset, it.length});
      if (known != sums.end()) {
        it.checksum = known->second;
        it.has_checksum = true;
      }
      if (!it.has_checksum && blocks) {
        Result<std::optional<uint32_t>> c =
            keyidx::CrcFromBlocks(&reader, *blocks, it.offset, it.length, f->size);
        if (c.ok() && c->has_value()) {
          it.checksum = **c;
          it.has_checksum = true;
          ++r.from_blocks;
        }
      }
      if (!it.has_checksum && checksums) {
        Result<uint32_t> h = reader.Crc(it.offset, it.length);
        if (h.ok()) {
          it.checksum = *h;
          it.has_checksum = true;
          ++r.read_items;
          r.read_bytes += it.length;
        } else {
          note(it, "checksum: " + h.status().ToString());
        }
      }
      if (it.has_checksum) ++r.with_sum;
    }
    r.from_memory += reader.bytes_from_memory();
    r.from_backing += reader.bytes_from_backing();
  }
  return r;
}

}  // namespace

Result<KeyIndexBuilder::Built> KeyIndexBuilder::Build(
    const std::string& ckpt, const DcpMetadata* given, bool checksums,
    const std::function<KnownSums()>& take_known_sums) {
  const Clock::time_point start = Clock::now();
  Built built;
  built.index = std::make_unique<CkptIndex>();
  CkptIndex* index = built.index.get();
  // The commit file(s): `.metadata`, per-rank metadata or a safetensors index.
  Result<CheckpointSource> source = FindCheckpointSource(dir_, ckpt);
  if (source.ok()) {
    index->source = source->kind;
  } else if (given == nullptr) {
    if (source.status().code() != Code::kNotFound) return source.status();
    // Not (or no longer) a checkpoint: remembered for a while.
    index->state = IndexState::kMissing;
    index->retry_after = Clock::now() + kMissingRetry;
    built.result = NotFound("no checkpoint (.metadata, __{rank}.metadata, safetensors) in '" +
                            ckpt + "'");
    return built;
  }
  // `given` is a `.metadata` parsed by the caller.
  if (given != nullptr) index->source = SourceKind::kDcp;
  const keyidx::MetadataId id = source.ok() ? source->id : keyidx::MetadataId{};
  const std::string what =
      source.ok() && index->source != SourceKind::kDcp ? source->files.front() : ".metadata";

  // Checksums handed over (RecordChecksums) before this build.
  KnownSums known_sums = take_known_sums();

  // The items, from the .metadata.
  Result<DcpMetadata> parsed = DcpMetadata{};
  if (given == nullptr) parsed = ReadCheckpointItems(dir_, ckpt, *source);
  const DcpMetadata* md = given != nullptr ? given : (parsed.ok() ? &*parsed : nullptr);
  const double parse_ms = MsSince(start);
  Clock::time_point phase = Clock::now();
  Status result = Status::Ok();
  if (md == nullptr) {
    index->state = IndexState::kFailed;
    index->error = what + ": " + parsed.status().ToString();
    result = Status(Code::kCorrupt, "index of '" + ckpt + "': " + index->error);
  } else {
    index->items.reserve(md->items.size());
    if (given == nullptr) {
      for (DcpItem& d : parsed->items) {
        index->items.push_back(
            keyidx::FromDcp(std::move(d), static_cast<uint32_t>(index->items.size())));
      }
      parsed = DcpMetadata{};  // free the rest now
    } else {
      for (const DcpItem& d : md->items) {
        index->items.push_back(keyidx::FromDcp(d, static_cast<uint32_t>(index->items.size())));
      }
    }
    ptrdiff_t dup = FirstDuplicateKey(index->items);
    if (dup >= 0) {
      index->state = IndexState::kFailed;
      index->error = what + ": duplicate key " + KeyName(index->items[dup]);
      index->items.clear();
      result = Status(Code::kCorrupt, "index of '" + ckpt + "': " + index->error);
    }
  }

  // The items, from their shard files.
  ResolveStats r = ResolveItems(dir_, block_crcs_, held_, ckpt, &index->items, known_sums,
                                /*read_rest=*/checksums && read_unvouched_,
                                /*archives=*/index->source != SourceKind::kSafetensors);
  if (checksums) {
    // Every item of those files now has its checksum in the index: the maps are done.
    for (const std::string& used : r.used_block_crcs) block_crcs_->Drop(used);
  }
  if (r.unresolved > 0) {
    index->state = IndexState::kPartial;
    index->error = std::to_string(r.unresolved) + " item(s) not resolved; first: " + r.first_error;
  }
  index->BuildFileMaps();
  const double items_ms = MsSince(phase);

  const double build_ms = MsSince(start);
  json info = {{"format", keyidx::kFormat},
               {"source", SourceKindName(index->source)},
               {"state", IndexStateName(index->state)},
               {"error", index->error},
               {"build_ms", build_ms},
               {"built_at", static_cast<int64_t>(std::time(nullptr))},
               {"items", index->items.size()},
               {"checksum", kChecksumAlgorithm},
               {"checksums",
                {{"items", r.with_sum},
                 {"from_blocks", r.from_blocks},
                 {"read_items", r.read_items},
                 {"read_bytes", r.read_bytes}}},
               // What the shard files' reads took from memory (the retained tier) and from
               // the backing store: zip headers, item edges, items read to checksum them.
               {"shard_reads", {{"from_memory", r.from_memory}, {"from_backing", r.from_backing}}},
               {"metadata", {{"size", id.size}, {"mtime_ns", id.mtime_ns}, {"ino", id.ino}}}};
  built.info = info.dump();
  built.parse_ms = parse_ms;
  built.items_ms = items_ms;
  built.build_ms = build_ms;
  built.with_sum = r.with_sum;
  built.from_blocks = r.from_blocks;
  built.read_items = r.read_items;
  built.read_bytes = r.read_bytes;
  built.from_memory = r.from_memory;
  built.from_backing = r.from_backing;
  built.result = result;
  return built;
}

}  // namespace ckptfs::store
