#include "store/dcp/rank_metadata.h"

#include <utility>

namespace ckptfs::store {

Status RankMetadataMerger::Add(const std::string& name, std::string_view bytes) {
  Result<DcpMetadata> md = ParseDcpMetadata(bytes);
  if (!md.ok()) return Status(md.status().code(), name + ": " + md.status().message());
  if (out_.flavor.empty()) {
    out_.flavor = md->flavor;
    out_.version = md->version;
    out_.checkpoint_id = md->checkpoint_id;
    out_.other_fields = md->other_fields;
  }
  for (DcpItem& item : md->items) {
    if (keys_.emplace(item.is_bytes, item.fqn, item.chunk_offsets).second) {
      out_.items.push_back(std::move(item));
    }
  }
  return Status::Ok();
}

}  // namespace ckptfs::store
