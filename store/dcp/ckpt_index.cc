#include "store/dcp/ckpt_index.h"

#include "store/dcp/item_reader.h"

namespace ckptfs::store {

const char* IndexStateName(IndexState s) {
  static const char* kNames[] = {"ok", "partial", "failed", "missing"};
  return kNames[static_cast<int>(s)];
}

void CkptIndex::BuildFileMaps() {
  maps.clear();
  files.clear();
  by_fqn.resize(items.size());
  for (uint32_t i = 0; i < by_fqn.size(); ++i) by_fqn[i] = i;
  std::stable_sort(by_fqn.begin(), by_fqn.end(), [&](uint32_t a, uint32_t b) {
    return items[a].fqn < items[b].fqn;
  });
  places.assign(items.size(), Place{});
  std::vector<keyidx::FileGroup> groups = keyidx::GroupByFile(items);
  maps.reserve(groups.size());
  files.reserve(groups.size());
  for (keyidx::FileGroup& g : groups) {
    const uint32_t m = static_cast<uint32_t>(maps.size());
    FileMap& map = maps.emplace_back();
    map.name = std::string(g.name);
    files.emplace(map.name, m);
    map.all = std::move(g.idx);
    map.begins.reserve(map.all.size());
    map.spans.reserve(map.all.size());
    for (uint32_t pos = 0; pos < map.all.size(); ++pos) {
      const uint32_t i = map.all[pos];
      const IndexedItem& it = items[i];
      places[i] = Place{m, pos, -1};
      if (it.length == 0) continue;  // owns no byte
      if (!map.spans.empty() && it.offset - map.spans.back().offset < map.spans.back().length &&
          error.empty()) {
        state = IndexState::kPartial;
        error = "items overlap in " + map.name + ": " +
                       KeyName(items[map.spans.back().ordinal]) + " and " + KeyName(it);
      }
      places[i].span = static_cast<int32_t>(map.spans.size());
      map.begins.push_back(it.offset);
      map.spans.push_back(ItemSpan{i, it.kind, it.has_checksum, it.offset, it.length, it.raw_offset,
                                  it.raw_nbytes, it.checksum});
    }
    for (size_t k = 0; k < map.begins.size(); k += FileMap::kSample) {
      map.sample.push_back(map.begins[k]);
    }
  }
}

void CkptIndex::SetChecksum(uint32_t ordinal, uint64_t checksum) {
  IndexedItem& it = items[ordinal];
  it.checksum = checksum;
  it.has_checksum = true;
  const Place& p = places[ordinal];
  if (p.span >= 0) {
    ItemSpan& l = maps[p.map].spans[p.span];
    l.checksum = checksum;
    l.has_checksum = true;
  }
}

}  // namespace ckptfs::store
