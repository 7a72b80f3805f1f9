#include "store/safetensors_index.h"

#include <set>

#include <nlohmann/json.hpp>

namespace ckptfs::store {

Result<std::vector<std::string>> ParseSafetensorsIndex(std::string_view text) {
  auto bad = [](const std::string& why) {
    return Status(Code::kCorrupt, "safetensors index: " + why);
  };
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr,
                                           /*allow_exceptions=*/false);
  if (j.is_discarded()) return bad("not valid JSON");
  if (!j.is_object()) return bad("not a JSON object");
  auto map = j.find("weight_map");
  if (map == j.end()) return bad("no \"weight_map\"");
  if (!map->is_object()) return bad("\"weight_map\" is not an object");
  std::set<std::string> files;
  for (const auto& [tensor, file] : map->items()) {
    if (!file.is_string()) return bad("the file of tensor \"" + tensor + "\" is not a string");
    const auto& name = file.get_ref<const std::string&>();
    if (name.empty() || name == "." || name == ".." ||
        name.find_first_of(std::string_view("/\0", 2)) != std::string::npos) {
      return bad("tensor \"" + tensor + "\" names \"" + name +
                 "\", not a file in the index's directory");
    }
    files.insert(name);
  }
  return std::vector<std::string>(files.begin(), files.end());
}

}  // namespace ckptfs::store
