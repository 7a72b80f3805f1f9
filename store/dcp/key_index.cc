#include "store/dcp/key_index.h"

#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>
#include <set>

#include "common/path.h"
#include "store/dcp/index_codec.h"
#include "store/dcp/item_reader.h"

namespace ckptfs::store {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using keyidx::FileGroup;
using keyidx::GroupByFile;

// Moves the entries of `map` whose key `moved` maps to a new name (path::Rebase) there.
template <typename Map, typename Moved>
void RekeyMoved(Map& map, const Moved& moved) {
  std::vector<std::string> names;
  for (const auto& [name, value] : map) {
    if (moved(name)) names.push_back(name);
  }
  for (const std::string& name : names) {
    auto node = map.extract(name);
    node.key() = *moved(name);
    map.insert(std::move(node));
  }
}

}  // namespace

Result<std::unique_ptr<KeyIndex>> KeyIndex::Create(BackingDir* dir, StateDb* db,
                                                   const KeyIndexOptions& options) {
  if (dir == nullptr || db == nullptr) return Invalid("KeyIndex needs a backing dir and a db");
  return std::unique_ptr<KeyIndex>(new KeyIndex(dir, db, options));
}

KeyIndex::~KeyIndex() = default;

void KeyIndex::BuildFileMaps(CkptIndex* index) {
  index->maps.clear();
  index->files.clear();
  index->by_fqn.resize(index->items.size());
  for (uint32_t i = 0; i < index->by_fqn.size(); ++i) index->by_fqn[i] = i;
  std::stable_sort(index->by_fqn.begin(), index->by_fqn.end(), [&](uint32_t a, uint32_t b) {
    return index->items[a].fqn < index->items[b].fqn;
  });
  index->places.assign(index->items.size(), Place{});
  std::vector<FileGroup> groups = GroupByFile(index->items);
  index->maps.reserve(groups.size());
  index->files.reserve(groups.size());
  for (FileGroup& g : groups) {
    const uint32_t m = static_cast<uint32_t>(index->maps.size());
    FileMap& map = index->maps.emplace_back();
    map.name = std::string(g.name);
    index->files.emplace(map.name, m);
    map.all = std::move(g.idx);
    map.begins.reserve(map.all.size());
    map.spans.reserve(map.all.size());
    for (uint32_t pos = 0; pos < map.all.size(); ++pos) {
      const uint32_t i = map.all[pos];
      const IndexedItem& it = index->items[i];
      index->places[i] = Place{m, pos, -1};
      if (it.length == 0) continue;  // owns no byte
      if (!map.spans.empty() && it.offset - map.spans.back().offset < map.spans.back().length &&
          index->error.empty()) {
        index->state = State::kPartial;
        index->error = "items overlap in " + map.name + ": " +
                       KeyName(index->items[map.spans.back().ordinal]) + " and " + KeyName(it);
      }
      index->places[i].span = static_cast<int32_t>(map.spans.size());
      map.begins.push_back(it.offset);
      map.spans.push_back(Located{i, it.kind, it.has_checksum, it.offset, it.length, it.raw_offset,
                                  it.raw_nbytes, it.checksum});
    }
    for (size_t k = 0; k < map.begins.size(); k += FileMap::kSample) {
      map.sample.push_back(map.begins[k]);
    }
  }
}

void KeyIndex::SetChecksum(CkptIndex* index, uint32_t ordinal, uint64_t checksum) {
  IndexedItem& it = index->items[ordinal];
  it.checksum = checksum;
  it.has_checksum = true;
  const Place& p = index->places[ordinal];
  if (p.span >= 0) {
    Located& l = index->maps[p.map].spans[p.span];
    l.checksum = checksum;
    l.has_checksum = true;
  }
}

void KeyIndex::Install(const std::string& ckpt, std::unique_ptr<CkptIndex> index) {
  std::vector<std::pair<std::string, std::string>> puts;
  {
    WriterLock lock(&mu_);
    // Checksums recorded while this index was being built.
    auto pending = pending_sums_.find(ckpt);
    if (pending != pending_sums_.end() && index->state != State::kMissing) {
      std::vector<uint32_t> changed;
      for (IndexedItem& it : index->items) {
        auto f = pending->second.find(it.file);
        if (f == pending->second.end()) continue;
        auto s = f->second.find({it.offset, it.length});
        if (s == f->second.end()) continue;
        SetChecksum(index.get(), it.ordinal, s->second);
        changed.push_back(it.ordinal);
      }
      pending_sums_.erase(pending);
      if (!changed.empty()) puts = EncodeBlocksOf(ckpt, *index, changed);
    }
    ckpts_[ckpt] = std::move(index);
  }
  if (!puts.empty()) {
    Status st = db_->Write(puts, {});
    if (!st.ok()) spdlog::warn("key index: persist checksums of '{}': {}", ckpt, st.ToString());
  }
}

Status KeyIndex::Ensure(const std::string& ckpt, bool checksums) {
  auto present = [&] {
    ReaderLock lock(&mu_);
    auto it = ckpts_.find(ckpt);
    return it != ckpts_.end() &&
           (it->second->state != State::kMissing || Clock::now() < it->second->retry_after);
  };
  if (present()) return Status::Ok();
  std::shared_ptr<std::mutex> m = BuildMutex(ckpt);
  std::lock_guard lock(*m);
  if (present()) return Status::Ok();
  bool found = false;
  Status st = LoadFromDb(ckpt, &found);
  if (!st.ok()) spdlog::warn("key index: load '{}' from the state db: {}", ckpt, st.ToString());
  if (found) return Status::Ok();
  st = BuildLocked(ckpt, nullptr, checksums);
  // A missing or failed checkpoint is installed with its state; only I/O errors remain.
  if (st.code() == Code::kNotFound || st.code() == Code::kCorrupt) return Status::Ok();
  return st;
}

Result<std::vector<IndexedItem>> KeyIndex::Items(const std::string& ckpt) {
  return WithIndex(
      ckpt, [](const CkptIndex& index) -> Result<std::vector<IndexedItem>> { return index.items; });
}

Result<std::vector<std::string>> KeyIndex::Fqns(const std::string& ckpt) {
  return WithIndex(ckpt, [](const CkptIndex& index) -> Result<std::vector<std::string>> {
    std::vector<std::string> out;
    for (uint32_t i : index.by_fqn) {
      const std::string& fqn = index.items[i].fqn;
      if (out.empty() || out.back() != fqn) out.push_back(fqn);
    }
    return out;
  });
}

Result<std::vector<IndexedItem>> KeyIndex::ItemsOf(const std::string& ckpt,
                                                   const std::string& fqn) {
  return WithIndex(ckpt, [&](const CkptIndex& index) -> Result<std::vector<IndexedItem>> {
    auto lo =
        std::lower_bound(index.by_fqn.begin(), index.by_fqn.end(), fqn,
                         [&](uint32_t i, const std::string& f) { return index.items[i].fqn < f; });
    std::vector<IndexedItem> out;
    for (auto it = lo; it != index.by_fqn.end() && index.items[*it].fqn == fqn; ++it) {
      out.push_back(index.items[*it]);  // by_fqn keeps .metadata order within an fqn
    }
    return out;
  });
}

template <typename Fn>
auto KeyIndex::WithItemAt(const std::string& ckpt, const std::string& file, uint64_t offset,
                          Fn fn) {
  for (int attempt = 0;; ++attempt) {
    {
      ReaderLock lock(&mu_);
      auto it = ckpts_.find(ckpt);
      if (it != ckpts_.end()) {
        const CkptIndex& index = *it->second;
        if (index.state != State::kMissing || Clock::now() < index.retry_after) {
          auto f = index.files.find(file);
          if (f == index.files.end()) return fn(index, nullptr);
          const FileMap& map = index.maps[f->second];
          ptrdiff_t i = map.Find(offset);
          return fn(index, i < 0 ? nullptr : &map.spans[i]);
        }
      }
    }
    if (attempt > 0 || !Ensure(ckpt, /*checksums=*/false).ok()) {
      static const CkptIndex kNone;
      ReaderLock lock(&mu_);  // fn's contract: called under the lock
      return fn(kNone, nullptr);
    }
  }
}

std::optional<IndexedItem> KeyIndex::Resolve(const std::string& ckpt, const std::string& file,
                                             uint64_t offset) {
  return WithItemAt(ckpt, file, offset,
                    [](const CkptIndex& index, const Located* l) -> std::optional<IndexedItem> {
                      if (l == nullptr) return std::nullopt;
                      return index.items[l->ordinal];
                    });
}

std::optional<KeyIndex::Located> KeyIndex::Locate(const std::string& ckpt, const std::string& file,
                                                  uint64_t offset) {
  return WithItemAt(ckpt, file, offset,
                    [](const CkptIndex&, const Located* l) -> std::optional<Located> {
                      if (l == nullptr) return std::nullopt;
                      return *l;
                    });
}

std::string KeyIndex::IndexError(const std::string& ckpt) {
  {
    ReaderLock lock(&mu_);
    auto it = ckpts_.find(ckpt);
    if (it != ckpts_.end()) return it->second->error;
  }
  Result<std::string> raw = db_->Get(keyidx::InfoKey(ckpt));
  if (!raw.ok()) return "";
  json info = json::parse(*raw, nullptr, false);
  if (!info.is_object()) return "";
  auto e = info.find("error");
  return e != info.end() && e->is_string() ? e->get<std::string>() : "";
}

void KeyIndex::AddBlockCrcs(const std::string& path, const FileKey& id,
                            std::shared_ptr<const BlockCrcMap> map) {
  block_crcs_.Add(path, id, std::move(map));
}

uint64_t KeyIndex::block_crc_bytes() { return block_crcs_.bytes(); }

void KeyIndex::RecordChecksums(const std::string& ckpt, const std::string& file,
                               const std::vector<RangeChecksum>& sums) {
  std::vector<std::pair<std::string, std::string>> puts;
  // Held until the write, so that blocks reach RocksDB in the order they were encoded.
  MutexLock persist_lock(&persist_mu_);
  {
    WriterLock lock(&mu_);
    auto it = ckpts_.find(ckpt);
    if (it == ckpts_.end() || it->second->state == State::kMissing) {
      auto& dst = pending_sums_[ckpt][file];
      for (const RangeChecksum& s : sums) dst[{s.offset, s.length}] = s.checksum;
      return;
    }
    CkptIndex& index = *it->second;
    auto f = index.files.find(file);
    if (f == index.files.end()) return;
    const FileMap& map = index.maps[f->second];
    std::vector<uint32_t> changed;
    for (const RangeChecksum& s : sums) {
      ptrdiff_t i = map.Find(s.offset);
      if (i < 0) continue;
      const Located& l = map.spans[i];
      if (l.offset != s.offset || l.length != s.length) continue;
      if (l.has_checksum && l.checksum == s.checksum) continue;
      SetChecksum(&index, l.ordinal, s.checksum);
      changed.push_back(l.ordinal);
    }
    if (changed.empty()) return;
    puts = EncodeBlocksOf(ckpt, index, changed);
  }
  Status st = db_->Write(puts, {});
  if (!st.ok()) spdlog::warn("key index: persist checksums of '{}': {}", ckpt, st.ToString());
}

void KeyIndex::Forget(const std::string& ckpt) {
  {
    WriterLock lock(&mu_);
    ckpts_.erase(ckpt);
    pending_sums_.erase(ckpt);
  }
  block_crcs_.DropFilesIn(ckpt);
  std::vector<std::string> deletes{keyidx::InfoKey(ckpt)};
  Status st = db_->Scan(keyidx::ItemPrefix(ckpt),
                        [&](std::string_view key, std::string_view) { deletes.emplace_back(key); });
  if (st.ok()) st = db_->Write({}, deletes);
  if (!st.ok()) spdlog::warn("key index: forget '{}': {}", ckpt, st.ToString());
}

void KeyIndex::OnRenamed(const std::string& from, const std::string& to) {
  if (from == to) return;
  auto moved = [&](const std::string& ckpt) { return path::Rebase(ckpt, from, to); };
  // Whatever was indexed at the destination was replaced.
  for (const std::string& ckpt : IndexedCheckpoints()) {
    if (path::IsAtOrBelow(ckpt, to) && !moved(ckpt)) Forget(ckpt);
  }
  {
    WriterLock lock(&mu_);
    RekeyMoved(ckpts_, moved);
    RekeyMoved(pending_sums_, moved);
  }
  block_crcs_.OnRenamed(from, to);
  // RocksDB: values name files relative to the checkpoint, so only keys change.
  std::vector<std::string> persisted;
  Status st = db_->Scan("i/", [&](std::string_view key, std::string_view) {
    std::string ckpt(key.substr(2));
    if (moved(ckpt)) persisted.push_back(ckpt);
  });
  for (const std::string& ckpt : persisted) {
    if (!st.ok()) break;
    std::string dest = *moved(ckpt);
    std::vector<std::pair<std::string, std::string>> puts;
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
  if (!st.ok()) spdlog::warn("key index: rename '{}' -> '{}': {}", from, to, st.ToString());
}

bool KeyIndex::IsIndexed(const std::string& ckpt) {
  {
    ReaderLock lock(&mu_);
    auto it = ckpts_.find(ckpt);
    if (it != ckpts_.end() && it->second->state != State::kMissing) return true;
  }
  return db_->Get(keyidx::InfoKey(ckpt)).ok();
}

std::vector<std::string> KeyIndex::IndexedCheckpoints() {
  std::set<std::string> out;
  Status st =
      db_->Scan("i/", [&](std::string_view key, std::string_view) { out.emplace(key.substr(2)); });
  if (!st.ok()) spdlog::warn("key index: list checkpoints: {}", st.ToString());
  ReaderLock lock(&mu_);
  for (const auto& [ckpt, index] : ckpts_) {
    if (index->state != State::kMissing) out.insert(ckpt);
  }
  return {out.begin(), out.end()};
}

}  // namespace ckptfs::store
