// Fuzzes the merge of a DCP no-collectives save (issue 41): every rank writes its own
// `__{rank}.metadata` pickle, and the daemon merges them in rank order at commit and for the
// key index (store/dcp/rank_metadata.h). The input is split into up to 4 ranks' files at
// each "\n@@RANK@@\n" line. What the merge accepts must hold its contract: every item once
// (a key two ranks saved is kept from the lowest rank), never more items than the files
// hold, the first parsed file's flavor kept; a refused file names itself and leaves the
// merge as it was.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "store/dcp/rank_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  constexpr std::string_view kSep = "\n@@RANK@@\n";
  std::vector<std::string_view> files;
  while (files.size() < 3) {
    const size_t at = in.find(kSep);
    if (at == std::string_view::npos) break;
    files.push_back(in.substr(0, at));
    in.remove_prefix(at + kSep.size());
  }
  files.push_back(in);
  ckptfs::store::RankMetadataMerger merger;
  size_t items_in = 0;
  std::string flavor;
  for (size_t r = 0; r < files.size(); ++r) {
    const std::string name = "__" + std::to_string(r) + ".metadata";
    const size_t before = merger.merged().items.size();
    auto one = ckptfs::store::ParseDcpMetadata(files[r]);
    ckptfs::Status st = merger.Add(name, files[r]);
    if (st.ok() != one.ok()) __builtin_trap();
    if (!st.ok()) {
      if (st.message().rfind(name, 0) != 0) __builtin_trap();  // names the rank's file
      if (merger.merged().items.size() != before) __builtin_trap();
      continue;
    }
    items_in += one->items.size();
    if (flavor.empty()) flavor = one->flavor;
  }
  const auto& out = merger.merged();
  if (out.items.size() > items_in) __builtin_trap();
  if (out.flavor != flavor) __builtin_trap();
  std::set<std::tuple<bool, std::string, std::vector<int64_t>>> keys;
  for (const auto& item : out.items) {
    if (!keys.emplace(item.is_bytes, item.fqn, item.chunk_offsets).second) __builtin_trap();
  }
  return 0;
}
