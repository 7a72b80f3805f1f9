#include "store/dcp/commit_names.h"

#include "store/primitives/backing_dir.h"

namespace ckptfs::store {
namespace {

std::string_view LastComponent(std::string_view path) {
  auto slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

bool AllDigits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

// `__{digits}` + `suffix`.
bool IsRankName(std::string_view name, std::string_view suffix) {
  if (name.size() <= 2 + suffix.size() || !name.starts_with("__") || !name.ends_with(suffix)) {
    return false;
  }
  return AllDigits(name.substr(2, name.size() - 2 - suffix.size()));
}

// Hugging Face's shard names end in `-{5 digits}-of-{5 digits}.safetensors` (transformers'
// `model-00001-of-00004.safetensors`, torch's `shard-00000-model-00001-of-00001.safetensors`).
bool IsHfShardName(std::string_view name) {
  constexpr std::string_view kExt = ".safetensors";
  if (!name.ends_with(kExt)) return false;
  name.remove_suffix(kExt.size());
  auto of = name.rfind("-of-");
  if (of == std::string_view::npos || !AllDigits(name.substr(of + 4))) return false;
  auto dash = name.rfind('-', of == 0 ? 0 : of - 1);
  return dash != std::string_view::npos && dash < of &&
         AllDigits(name.substr(dash + 1, of - dash - 1));
}

}  // namespace

CommitKind CommitKindOf(std::string_view path) {
  const std::string_view name = LastComponent(path);
  if (name == ".metadata") return CommitKind::kDcp;
  if (IsRankName(name, ".metadata")) return CommitKind::kDcpRank;
  constexpr std::string_view kIndex = ".safetensors.index.json";
  if (name.size() > kIndex.size() && name.ends_with(kIndex)) return CommitKind::kSafetensorsIndex;
  if (name == "model.safetensors") return CommitKind::kSafetensorsSingle;
  return CommitKind::kNone;
}

bool IsCheckpointFileName(std::string_view name) {
  return CommitKindOf(name) != CommitKind::kNone || name.ends_with(".distcp") ||
         name == ".metadata.tmp" || IsRankName(name, ".metadata.tmp") || IsHfShardName(name);
}

bool CommittedElsewhere(BackingDir* backing, const std::string& dir, double since) {
  Result<struct stat> st = backing->Stat(dir + "/.metadata");
  if (!st.ok()) return false;
  return CtimeSeconds(*st) >= since;
}

}  // namespace ckptfs::store
