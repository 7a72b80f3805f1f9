#include "store/publish/tracker_text.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <optional>

#include "common/path.h"
#include "store/dcp/metadata_file.h"

namespace ckptfs::store {
namespace {

// The integer a name ends with ("iter_0000100" -> 100), if it ends with digits.
std::optional<uint64_t> TrailingNumber(std::string_view s) {
  size_t i = s.size();
  while (i > 0 && s[i - 1] >= '0' && s[i - 1] <= '9') --i;
  if (i == s.size() || s.size() - i > 18) return std::nullopt;
  return std::stoull(std::string(s.substr(i)));
}

}  // namespace

Result<std::string> TrackerText(BackingDir* dir, const JournalEntry& e) {
  CKPT_ASSIGN_OR_RETURN(struct stat st, dir->Stat(e.from));
  if (st.st_size > 4096) return Status(Code::kInvalid, "not a tracker: over 4 KiB");
  CKPT_ASSIGN_OR_RETURN(std::string bytes, ReadMetadataBytes(dir, e.from));
  std::string_view text = bytes;
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) {
    text.remove_suffix(1);
  }
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) {
    text.remove_prefix(1);
  }
  return std::string(text);
}

bool TrackerNames(std::string_view text, const std::string& tracker_path, const std::string& ckpt) {
  if (text.empty() || path::Parent(ckpt) != path::Parent(tracker_path)) return false;
  const std::string_view base = path::Basename(ckpt);
  if (text == base || text == ckpt ||
      (text.size() > base.size() && text.ends_with(base) &&
       text[text.size() - base.size() - 1] == '/')) {
    return true;
  }
  if (text.size() <= 18 &&
      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    // Megatron: the tracker holds the iteration, the directory is iter_0000100.
    return TrailingNumber(base) == std::stoull(std::string(text));
  }
  return false;
}

}  // namespace ckptfs::store
