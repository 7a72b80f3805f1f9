#include "store/dcp/key_index.h"

#include <spdlog/spdlog.h>

#include <set>

#include "common/path.h"

namespace ckptfs::store {
namespace {

using Clock = std::chrono::steady_clock;

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

void KeyIndex::Install(const std::string& ckpt, std::unique_ptr<CkptIndex> index) {
  KeyIndexStore::Puts puts;
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
        index->SetChecksum(it.ordinal, s->second);
        changed.push_back(it.ordinal);
      }
      pending_sums_.erase(pending);
      if (!changed.empty()) puts = KeyIndexStore::EncodeBlocksOf(ckpt, *index, changed);
    }
    ckpts_[ckpt] = std::move(index);
    ForgetNotIndexedLocked();
  }
  store_.WriteBlocks(ckpt, puts);
}

void KeyIndex::ForgetNotIndexedLocked() {
  not_indexed_.clear();
  ++not_indexed_gen_;
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
  return store_.IndexError(ckpt);
}

void KeyIndex::AddBlockCrcs(const std::string& path, const FileKey& id,
                            std::shared_ptr<const BlockCrcMap> map) {
  block_crcs_.Add(path, id, std::move(map));
}

uint64_t KeyIndex::block_crc_bytes() { return block_crcs_.bytes(); }

void KeyIndex::OnFileRemoved(const std::string& path) { block_crcs_.Drop(path); }

bool KeyIndex::AddPeerBlockCrcs(const std::string& path, const ShardChecksums& sums) {
  Result<struct stat> st = dir_->Stat(path);
  if (!st.ok()) return false;
  const FileKey here = FileKeyFromStat(*st);
  if (here.ino != sums.id.ino || here.size != sums.id.size ||
      here.mtime_ns != sums.id.mtime_ns) {
    spdlog::debug("key index: a peer's block CRCs of {} describe another version", path);
    return false;
  }
  std::shared_ptr<BlockCrcMap> map =
      BlockCrcMap::FromBlockCrcs(sums.block_bytes, sums.id.size, sums.block_crcs);
  if (!map) return false;
  block_crcs_.Add(path, here, std::move(map), /*from_peer=*/true);
  return true;
}

std::shared_ptr<const ShardChecksums> KeyIndex::ShardChecksumsOf(const std::string& path) {
  FileKey id;
  std::shared_ptr<const BlockCrcMap> map = block_crcs_.Latest(path, &id);
  if (!map) return nullptr;
  std::optional<std::vector<uint32_t>> crcs = map->BlockCrcs();
  if (!crcs || map->size() != id.size) return nullptr;
  auto sums = std::make_shared<ShardChecksums>();
  sums->id = id;
  sums->block_bytes = map->block_bytes();
  sums->block_crcs = std::move(*crcs);
  return sums;
}

void KeyIndex::RecordChecksums(const std::string& ckpt, const std::string& file,
                               const std::vector<RangeChecksum>& sums) {
  KeyIndexStore::Puts puts;
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
      index.SetChecksum(l.ordinal, s.checksum);
      changed.push_back(l.ordinal);
    }
    if (changed.empty()) return;
    puts = KeyIndexStore::EncodeBlocksOf(ckpt, index, changed);
  }
  store_.WriteBlocks(ckpt, puts);
}

void KeyIndex::Forget(const std::string& ckpt) {
  {
    WriterLock lock(&mu_);
    ckpts_.erase(ckpt);
    pending_sums_.erase(ckpt);
  }
  block_crcs_.DropFilesIn(ckpt);
  Status st = store_.Forget(ckpt);
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
  Status st = store_.Rename(moved);
  if (!st.ok()) spdlog::warn("key index: rename '{}' -> '{}': {}", from, to, st.ToString());
  WriterLock lock(&mu_);
  ForgetNotIndexedLocked();  // a name known unindexed may now hold a moved index
}

bool KeyIndex::IsIndexed(const std::string& ckpt) {
  uint64_t gen = 0;
  {
    ReaderLock lock(&mu_);
    auto it = ckpts_.find(ckpt);
    if (it != ckpts_.end() && it->second->state != State::kMissing) return true;
    if (not_indexed_.contains(ckpt)) return false;
    gen = not_indexed_gen_;
  }
  if (store_.Has(ckpt)) return true;
  // Remembered only if no index was installed or moved since the lookup began (each
  // bumps the generation), so a build that finished meanwhile is never hidden.
  WriterLock lock(&mu_);
  if (gen == not_indexed_gen_) {
    if (not_indexed_.size() >= kMaxNotIndexed) not_indexed_.clear();
    not_indexed_.insert(ckpt);
  }
  return false;
}

std::vector<std::string> KeyIndex::IndexedCheckpoints() {
  std::set<std::string> out;
  Status st = store_.List(&out);
  if (!st.ok()) spdlog::warn("key index: list checkpoints: {}", st.ToString());
  ReaderLock lock(&mu_);
  for (const auto& [ckpt, index] : ckpts_) {
    if (index->state != State::kMissing) out.insert(ckpt);
  }
  return {out.begin(), out.end()};
}

Status KeyIndex::LoadFromDb(const std::string& ckpt, bool* found) {
  *found = false;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CkptIndex> index, store_.Load(ckpt));
  if (index == nullptr) return Status::Ok();
  {
    MutexLock persist_lock(&persist_mu_);
    Install(ckpt, std::move(index));
  }
  *found = true;
  return Status::Ok();
}

std::shared_ptr<std::mutex> KeyIndex::BuildMutex(const std::string& ckpt) {
  MutexLock lock(&build_mus_mu_);
  std::weak_ptr<std::mutex>& weak = build_mus_[ckpt];
  std::shared_ptr<std::mutex> m = weak.lock();
  if (!m) {
    m = std::make_shared<std::mutex>();
    weak = m;
  }
  if (build_mus_.size() > 1024) {  // drop entries nobody holds any more
    std::erase_if(build_mus_, [](const auto& kv) { return kv.second.expired(); });
  }
  return m;
}

Status KeyIndex::Build(const std::string& ckpt, bool checksums) {
  std::shared_ptr<std::mutex> m = BuildMutex(ckpt);
  std::lock_guard lock(*m);
  return BuildLocked(ckpt, nullptr, checksums);
}

Status KeyIndex::BuildFrom(const std::string& ckpt, const DcpMetadata& md, bool checksums) {
  std::shared_ptr<std::mutex> m = BuildMutex(ckpt);
  std::lock_guard lock(*m);
  return BuildLocked(ckpt, &md, checksums);
}

Status KeyIndex::BuildLocked(const std::string& ckpt, const DcpMetadata* given, bool checksums) {
  // Checksums handed over (RecordChecksums) before this build.
  auto take_pending = [&] {
    KnownSums known;
    WriterLock lock(&mu_);
    auto it = pending_sums_.find(ckpt);
    if (it != pending_sums_.end()) {
      known = std::move(it->second);
      pending_sums_.erase(it);
    }
    return known;
  };
  CKPT_ASSIGN_OR_RETURN(KeyIndexBuilder::Built built,
                        builder_.Build(ckpt, given, checksums, take_pending));
  if (built.index->state == State::kMissing) {
    // Not (or no longer) a checkpoint: drop any stale index, remember for a while.
    Forget(ckpt);
    MutexLock persist_lock(&persist_mu_);
    Install(ckpt, std::move(built.index));
    return built.result;
  }
  const State state = built.index->state;
  const std::string error = built.index->error;
  const size_t n = built.index->items.size();
  double persist_ms = 0;
  {
    // Checksums recorded from now on wait, so that they reach RocksDB after these blocks.
    const Clock::time_point start = Clock::now();
    MutexLock persist_lock(&persist_mu_);
    Status persisted = store_.Persist(ckpt, *built.index, built.info);
    persist_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (!persisted.ok()) {
      spdlog::warn("key index: cannot persist the index of '{}': {}", ckpt, persisted.ToString());
    }
    Install(ckpt, std::move(built.index));
  }
  if (state == State::kOk) {
    spdlog::info(
        "key index: indexed '{}': {} items in {:.1f} ms (metadata {:.1f}, items {:.1f}, "
        "persist {:.1f}); checksums: {} from write-path blocks, {} read ({} bytes), {} none; "
        "shard reads: {} bytes from memory, {} from the backing store",
        ckpt, n, built.build_ms + persist_ms, built.parse_ms, built.items_ms, persist_ms,
        built.from_blocks, built.read_items, built.read_bytes, n - built.with_sum,
        built.from_memory, built.from_backing);
  } else {
    spdlog::warn("key index: '{}' indexed as {}: {}", ckpt, IndexStateName(state), error);
  }
  return built.result;
}

Result<VerifyReport> KeyIndex::Verify(const std::string& ckpt) {
  CKPT_RETURN_IF_ERROR(Ensure(ckpt, /*checksums=*/false));
  std::vector<IndexedItem> items;
  SourceKind source_kind = SourceKind::kDcp;
  {
    ReaderLock lock(&mu_);
    auto it = ckpts_.find(ckpt);
    if (it == ckpts_.end()) return Internal("index of '" + ckpt + "' vanished");
    if (it->second->state == State::kMissing) {
      return NotFound("no checkpoint files in '" + ckpt + "'");
    }
    items = it->second->items;
    source_kind = it->second->source;
  }
  return verifier_.Verify(ckpt, items, source_kind);
}

Result<uint64_t> KeyIndex::FillChecksums(const std::string& ckpt) {
  // The items without a checksum, copied out of the lock: the reads take a while.
  CKPT_ASSIGN_OR_RETURN(
      std::vector<IndexedItem> items,
      WithIndex(ckpt, [](const CkptIndex& index) -> Result<std::vector<IndexedItem>> {
        std::vector<IndexedItem> out;
        for (const IndexedItem& item : index.items) {
          if (!item.has_checksum) out.push_back(item);
        }
        return out;
      }));
  return verifier_.ChecksumItems(
      ckpt, items, [&](const std::string& file, const std::vector<RangeChecksum>& sums) {
        RecordChecksums(ckpt, file, sums);
      });
}

}  // namespace ckptfs::store
