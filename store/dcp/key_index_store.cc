#include "store/dcp/key_index_store.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

#include "common/path.h"
#include "store/dcp/index_codec.h"

namespace ckptfs::store {

using json = nlohmann::json;

KeyIndexStore::Puts KeyIndexStore::EncodeBlocksOf(const std::string& ckpt, const CkptIndex& index,
                                                  const std::vector<uint32_t>& ordinals) {
  std::set<std::pair<uint32_t, uint32_t>> blocks;  // (map, block)
  for (uint32_t i : ordinals) {
    const CkptIndex::Place& p = index.places[i];
    blocks.emplace(p.map, static_cast<uint32_t>(p.pos / keyidx::kItemsPerBlock));
  }
  const std::string prefix = keyidx::ItemPrefix(ckpt);
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(blocks.size());
  for (auto [m, b] : blocks) {
    const CkptIndex::FileMap& map = index.maps[m];
    std::span<const uint32_t> all(map.all);
    size_t first = size_t{b} * keyidx::kItemsPerBlock;
    auto& [key, value] = out.emplace_back(keyidx::BlockKey(prefix, map.name, b), std::string());
    keyidx::EncodeBlock(index.items,
                        all.subspan(first, std::min(keyidx::kItemsPerBlock, all.size() - first)),
                        &value);
  }
  return out;
}

Status KeyIndexStore::Persist(const std::string& ckpt, const CkptIndex& index, const std::string& info) {
  const std::string prefix = keyidx::ItemPrefix(ckpt);
  std::vector<std::pair<std::string, std::string>> puts;
  for (const CkptIndex::FileMap& map : index.maps) {
    std::span<const uint32_t> all(map.all);
    for (size_t first = 0; first < all.size(); first += keyidx::kItemsPerBlock) {
      auto& [key, value] = puts.emplace_back(
          keyidx::BlockKey(prefix, map.name, static_cast<uint32_t>(first / keyidx::kItemsPerBlock)),
          std::string());
      keyidx::EncodeBlock(index.items,
                          all.subspan(first, std::min(keyidx::kItemsPerBlock, all.size() - first)),
                          &value);
    }
  }
  puts.emplace_back(keyidx::InfoKey(ckpt), info);
  // Keys of an earlier build that this one does not overwrite.
  std::vector<std::string> old_keys;
  CKPT_RETURN_IF_ERROR(db_->Scan(
      prefix, [&](std::string_view key, std::string_view) { old_keys.emplace_back(key); }));
  std::vector<std::string> deletes;
  if (!old_keys.empty()) {
    std::unordered_set<std::string_view> new_keys;
    new_keys.reserve(puts.size());
    for (const auto& [key, value] : puts) new_keys.insert(key);
    for (std::string& key : old_keys) {
      if (!new_keys.count(key)) deletes.push_back(std::move(key));
    }
  }
  return db_->Write(puts, deletes);
}

Result<std::unique_ptr<CkptIndex>> KeyIndexStore::Load(const std::string& ckpt) {
  std::unique_ptr<CkptIndex> none;
  Result<std::string> raw = db_->Get(keyidx::InfoKey(ckpt));
  if (!raw.ok()) {
    if (raw.status().code() == Code::kNotFound) return none;
    return raw.status();
  }
  json info = json::parse(*raw, nullptr, /*allow_exceptions=*/false);
  auto index = std::make_unique<CkptIndex>();
  keyidx::MetadataId recorded;
  uint64_t count = 0;
  try {
    if (!info.is_object() || info.value("format", 0) != keyidx::kFormat) return none;
    std::string state = info.value("state", "");
    if (state == "ok") {
      index->state = IndexState::kOk;
    } else if (state == "partial") {
      index->state = IndexState::kPartial;
    } else if (state == "failed") {
      index->state = IndexState::kFailed;
    } else {
      return none;
    }
    index->error = info.value("error", "");
    const std::string source = info.value("source", "dcp");
    if (source == SourceKindName(SourceKind::kDcpRanks)) {
      index->source = SourceKind::kDcpRanks;
    } else if (source == SourceKindName(SourceKind::kSafetensors)) {
      index->source = SourceKind::kSafetensors;
    }
    count = info.value("items", uint64_t{0});
    const json& m = info.at("metadata");
    recorded = {m.at("size").get<uint64_t>(), m.at("mtime_ns").get<uint64_t>(),
                m.at("ino").get<uint64_t>()};
  } catch (const json::exception&) {
    return none;  // unreadable record: rebuild
  }
  // The checkpoint may have been rewritten (by another node, or before a restart).
  Result<CheckpointSource> now = FindCheckpointSource(dir_, ckpt);
  if (!now.ok() || now->kind != index->source || !(now->id == recorded)) return none;

  // Blocks hold items in file order; each item's ordinal says where it goes.
  bool bad = false;
  std::vector<IndexedItem> loaded;
  loaded.reserve(count);
  CKPT_RETURN_IF_ERROR(
      db_->Scan(keyidx::ItemPrefix(ckpt), [&](std::string_view, std::string_view v) {
        if (!bad && (!keyidx::DecodeBlock(v, &loaded) || loaded.size() > count)) bad = true;
      }));
  if (bad || loaded.size() != count) return none;
  index->items.resize(count);
  std::vector<bool> seen(count);
  for (IndexedItem& it : loaded) {
    if (it.ordinal >= count || seen[it.ordinal]) return none;
    seen[it.ordinal] = true;
    index->items[it.ordinal] = std::move(it);
  }
  loaded = {};
  IndexState state = index->state;
  std::string error = index->error;
  index->BuildFileMaps();
  index->state = state;  // overlaps were already recorded at build time
  index->error = error;
  return index;
}


void KeyIndexStore::WriteBlocks(const std::string& ckpt, const Puts& blocks) {
  if (blocks.empty()) return;
  Status st = db_->Write(blocks, {});
  if (!st.ok()) spdlog::warn("key index: persist checksums of '{}': {}", ckpt, st.ToString());
}

std::string KeyIndexStore::IndexError(const std::string& ckpt) {
  Result<std::string> raw = db_->Get(keyidx::InfoKey(ckpt));
  if (!raw.ok()) return "";
  json info = json::parse(*raw, nullptr, false);
  if (!info.is_object()) return "";
  auto e = info.find("error");
  return e != info.end() && e->is_string() ? e->get<std::string>() : "";
}

bool KeyIndexStore::Has(const std::string& ckpt) { return db_->Get(keyidx::InfoKey(ckpt)).ok(); }

Status KeyIndexStore::List(std::set<std::string>* out) {
  return db_->Scan("i/", [&](std::string_view key, std::string_view) { out->emplace(key.substr(2)); });
}

Status KeyIndexStore::Forget(const std::string& ckpt) {
  std::vector<std::string> deletes{keyidx::InfoKey(ckpt)};
  Status st = db_->Scan(keyidx::ItemPrefix(ckpt),
                        [&](std::string_view key, std::string_view) { deletes.emplace_back(key); });
  if (st.ok()) st = db_->Write({}, deletes);
  return st;
}

Status KeyIndexStore::Rename(
    const std::function<std::optional<std::string>(const std::string&)>& moved) {
  std::vector<std::string> persisted;
  Status st = db_->Scan("i/", [&](std::string_view key, std::string_view) {
    std::string ckpt(key.substr(2));
    if (moved(ckpt)) persisted.push_back(ckpt);
  });
  for (const std::string& ckpt : persisted) {
    if (!st.ok()) break;
    std::string dest = *moved(ckpt);
    Puts puts;
    std::vector<std::string> deletes;
    const std::string old_prefix = keyidx::ItemPrefix(ckpt), new_prefix = keyidx::ItemPrefix(dest);
    st = db_->Scan(old_prefix, [&](std::string_view key, std::string_view value) {
      puts.emplace_back(new_prefix + std::string(key.substr(old_prefix.size())),
                        std::string(value));
      deletes.emplace_back(key);
    });
    if (!st.ok()) break;
    Result<std::string> info = db_->Get(keyidx::InfoKey(ckpt));
    if (info.ok()) {
      puts.emplace_back(keyidx::InfoKey(dest), *info);
      deletes.push_back(keyidx::InfoKey(ckpt));
    }
    st = db_->Write(puts, deletes);
  }
  return st;
}

}  // namespace ckptfs::store
