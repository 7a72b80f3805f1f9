// RankMetadataMerger: the items of a DCP no-collectives save, whose every rank writes its
// own `__{rank}.metadata` pickle (store/dcp/checkpoint_source.h reads them in rank order).
#pragma once

#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "common/status.h"
#include "store/dcp/dcp_metadata.h"

namespace ckptfs::store {

// The merge of a no-collectives save's `__{rank}.metadata` pickles, added in rank order:
// the first file's flavor, version, id and other fields, and every item once (a key two
// ranks both saved, a replicated item, is kept from the lowest rank). Pure (no I/O), so
// that it can be fuzzed (tests/fuzz/rank_metadata_fuzz.cc). Not thread-safe.
class RankMetadataMerger {
 public:
  // Parses and adds one rank's pickle; an error names `name` and leaves the merge as it was.
  Status Add(const std::string& name, std::string_view bytes);
  const DcpMetadata& merged() const { return out_; }
  DcpMetadata Take() { return std::move(out_); }

 private:
  DcpMetadata out_;
  std::set<std::tuple<bool, std::string, std::vector<int64_t>>> keys_;
};

}  // namespace ckptfs::store
