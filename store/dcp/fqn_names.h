// Reversible escaping of an fqn into one file-name component, for the tensor view.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ckptfs::store {

// No '/', no leading '.', no NUL, at most 255 bytes. '%', '/', NUL and control bytes become
// %XX, a leading '.' becomes %2E, and an empty fqn is "%". A result over 255 bytes is cut and
// gets "~" + 16 hex digits of a hash of the full fqn; UnescapeFqn cannot undo that, so a
// caller maps such names back through the index (the list of fqns), e.g. with
// FindFqnByEscapedName.
std::string EscapeFqn(const std::string& fqn);
// Inverse of EscapeFqn for names that were not hashed; nullopt for a hashed or invalid name.
std::optional<std::string> UnescapeFqn(std::string_view name);
// The fqn among `fqns` whose EscapeFqn is `name`, or nullopt.
std::optional<std::string> FindFqnByEscapedName(const std::vector<std::string>& fqns,
                                                std::string_view name);

}  // namespace ckptfs::store
