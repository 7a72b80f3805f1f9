// JSON text for humans and tools (control files, exit.json). Names on Linux are bytes and
// need not be UTF-8: such bytes are shown as U+FFFD instead of making the encoder throw.
// Records that must keep names exactly use the binary codec (store/primitives/record_codec.h).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace ckptfs {

inline std::string JsonText(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace ckptfs
