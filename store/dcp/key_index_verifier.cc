#include "store/dcp/key_index_verifier.h"

#include <cstdio>
#include <unordered_map>

#include "common/path.h"
#include "store/dcp/checkpoint_source.h"
#include "store/dcp/item_reader.h"
#include "store/dcp/metadata_file.h"

namespace ckptfs::store {
namespace {

void AppendBigEndian(std::string* out, uint64_t v) {
  for (int i = 7; i >= 0; --i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// The item's key (fqn, then bytes or the chunk offsets) as one string, for matching the items
// of an index against a fresh parse of the .metadata (Verify).
std::string ItemSuffix(const IndexedItem& item) {
  std::string s = item.fqn;
  s.push_back('\0');
  if (item.is_bytes) {
    s.push_back('b');
    return s;
  }
  s.push_back('t');
  for (int64_t v : item.chunk_offsets) AppendBigEndian(&s, static_cast<uint64_t>(v) ^ (1ull << 63));
  return s;
}

}  // namespace

VerifyReport KeyIndexVerifier::Verify(const std::string& ckpt,
                                      const std::vector<IndexedItem>& items,
                                      SourceKind source_kind) {
  VerifyReport report;
  auto bad = [&](std::string key, std::string why) {
    report.bad.emplace_back(std::move(key), std::move(why));
  };

  // The commit files (.metadata, per-rank metadata, safetensors index and headers), and
  // whether the index still describes them.
  CheckpointSource source;
  Result<DcpMetadata> md = ReadCheckpointItems(dir_, ckpt, &source);
  const std::string what = md.ok() && source.kind != SourceKind::kDcp
                               ? source.files.front()
                               : std::string(".metadata");
  if (md.ok() && source.kind != source_kind) {
    bad(what, std::string("the checkpoint is ") + SourceKindName(source.kind) +
                  " now, indexed as " + SourceKindName(source_kind));
  } else if (!md.ok()) {
    bad(what, md.status().ToString());
  } else {
    std::unordered_map<std::string, const IndexedItem*> by_key;
    for (const IndexedItem& it : items) by_key[ItemSuffix(it)] = &it;
    for (uint32_t i = 0; i < md->items.size(); ++i) {
      IndexedItem want = keyidx::FromDcp(md->items[i], i);
      auto found = by_key.find(ItemSuffix(want));
      if (found == by_key.end()) {
        bad(KeyName(want), "in " + what + " but not in the index");
        continue;
      }
      const IndexedItem& have = *found->second;
      if (have.file != want.file || have.offset != want.offset || have.length != want.length ||
          have.dtype != want.dtype || have.chunk_sizes != want.chunk_sizes ||
          have.global_size != want.global_size || have.transforms != want.transforms ||
          (source_kind == SourceKind::kSafetensors &&
           (have.raw_offset != want.raw_offset || have.raw_nbytes != want.raw_nbytes))) {
        bad(KeyName(want), "the index differs from " + what);
      }
      by_key.erase(found);
    }
    for (const auto& [key, it] : by_key) bad(KeyName(*it), "in the index but not in " + what);
  }

  TorchPickleCache pickle_cache;
  for (const keyidx::FileGroup& g : keyidx::GroupByFile(items)) {
    const std::string file(g.name);
    Result<keyidx::OpenedFile> f = keyidx::OpenShard(dir_, path::Join(ckpt, file));
    if (!f.ok()) {
      for (uint32_t i : g.idx) bad(KeyName(items[i]), f.status().ToString());
      continue;
    }
    keyidx::WindowReader reader(dir_, f->fd.get(), f->size);
    for (uint32_t i : g.idx) {
      const IndexedItem& it = items[i];
      ++report.items;
      if (it.offset > f->size || f->size - it.offset < it.length) {
        bad(KeyName(it), "item range past the end of " + file);
        continue;
      }
      // Structure: the archive still reads as what the index says (a safetensors item has
      // no archive: its header was compared above).
      if (it.kind == ItemKind::kTensor && source_kind != SourceKind::kSafetensors) {
        IndexedItem again = it;
        std::string error;
        keyidx::ResolveTensor(&reader, &again, &error, &pickle_cache);
        if (!error.empty()) {
          bad(KeyName(it), "archive: " + error);
          continue;
        }
        if (again.kind != ItemKind::kTensor || again.raw_offset != it.raw_offset ||
            again.raw_nbytes != it.raw_nbytes || again.stride != it.stride ||
            again.storage_offset != it.storage_offset) {
          bad(KeyName(it), "archive no longer agrees with the index");
          continue;
        }
      } else if (it.is_bytes && it.transforms.empty() && source_kind != SourceKind::kSafetensors) {
        Result<ZipDirectory> zd =
            ReadZipDirectory(reader.ItemReader(it.offset, it.length), it.length);
        if (!zd.ok()) {
          bad(KeyName(it), "archive: " + zd.status().ToString());
          continue;
        }
      }
      Result<uint32_t> h = reader.Crc(it.offset, it.length);
      if (!h.ok()) {
        bad(KeyName(it), "read: " + h.status().ToString());
        continue;
      }
      report.bytes += it.length;
      if (!it.has_checksum) {
        ++report.unchecked;
      } else if (*h != it.checksum) {
        char buf[80];
        std::snprintf(buf, sizeof(buf), "checksum mismatch: %s %08x, indexed %08llx",
                      kChecksumAlgorithm, *h, static_cast<unsigned long long>(it.checksum));
        bad(KeyName(it), buf);
      }
    }
  }
  return report;
}

Result<uint64_t> KeyIndexVerifier::ChecksumItems(const std::string& ckpt,
                                                 const std::vector<IndexedItem>& items,
                                                 const Record& record) {
  uint64_t filled = 0;
  Status first_error;
  for (const keyidx::FileGroup& g : keyidx::GroupByFile(items)) {
    const std::string file(g.name);
    Result<keyidx::OpenedFile> f = keyidx::OpenShard(dir_, path::Join(ckpt, file));
    if (!f.ok()) {
      if (first_error.ok()) first_error = f.status();
      continue;
    }
    keyidx::WindowReader reader(dir_, f->fd.get(), f->size);
    std::vector<RangeChecksum> sums;
    for (uint32_t i : g.idx) {
      const IndexedItem& it = items[i];
      if (it.offset > f->size || f->size - it.offset < it.length) continue;  // a broken item
      Result<uint32_t> h = reader.Crc(it.offset, it.length);
      if (!h.ok()) {
        if (first_error.ok()) first_error = h.status();
        continue;
      }
      sums.push_back({it.offset, it.length, *h});
    }
    filled += sums.size();
    record(file, sums);
  }
  if (!first_error.ok() && filled == 0) return first_error;
  return filled;
}

}  // namespace ckptfs::store
