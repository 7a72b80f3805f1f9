// Fuzzes the DCP .metadata interpreter end to end (pickle reader included).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "store/dcp/dcp_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ckptfs::store::DcpMetadataOptions options;
  options.pickle_limits.max_input_bytes = 1 << 20;
  auto md = ckptfs::store::ParseDcpMetadata(
      std::string_view(reinterpret_cast<const char*>(data), size), options);
  if (md.ok()) {
    for (const auto& item : md->items) {
      if (!ckptfs::store::ValidateRelativePath(item.file).ok()) __builtin_trap();
    }
    (void)ckptfs::store::RequiredFileLengths(*md);
  }
  return 0;
}
