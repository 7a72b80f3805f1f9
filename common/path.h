// Paths relative to the backing directory, as the store, the journal and the fs keep them:
// "" is the backing root, "a/b" a name below it; no leading, trailing or doubled '/'.
// One definition of joining, splitting and the rename rule for every piece of state keyed
// by such a path (checkpoint registry, key index, journal temp records, ...).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ckptfs::path {

// `name` inside `dir` ("" + "x" is "x").
inline std::string Join(std::string_view dir, std::string_view name) {
  std::string out;
  out.reserve(dir.size() + 1 + name.size());
  out.append(dir);
  if (!dir.empty()) out.push_back('/');
  out.append(name);
  return out;
}

// The directory holding `path` ("" for a name in the root).
inline std::string Parent(std::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? std::string() : std::string(path.substr(0, slash));
}

// The last component of `path`.
inline std::string_view Basename(std::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

// The names along `path`, root first: {"a", "b", "c"} for "a/b/c", none for "". Empty
// components (a leading, trailing or doubled '/') are skipped; "." and ".." are kept, for
// the caller to refuse (IsConfined).
inline std::vector<std::string> Components(std::string_view path) {
  std::vector<std::string> parts;
  for (size_t start = 0; start < path.size();) {
    size_t slash = path.find('/', start);
    if (slash == std::string_view::npos) slash = path.size();
    if (slash > start) parts.emplace_back(path.substr(start, slash - start));
    start = slash + 1;
  }
  return parts;
}

// ("a/b", "c") for "a/b/c"; ("", "c") for a name in the root.
inline std::pair<std::string, std::string> Split(std::string_view path) {
  return {Parent(path), std::string(Basename(path))};
}

// A relative path that stays where it is put: not absolute, and no empty, "." or ".."
// component. "" (the root itself) is one.
inline bool IsConfined(std::string_view path) {
  if (path.empty()) return true;
  if (path.front() == '/') return false;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string_view::npos) end = path.size();
    std::string_view comp = path.substr(start, end - start);
    if (comp.empty() || comp == "." || comp == "..") return false;
    start = end + 1;
  }
  return true;
}

// `path` is `dir` or lies below it. "" is the root, above everything.
inline bool IsAtOrBelow(std::string_view path, std::string_view dir) {
  if (dir.empty()) return true;
  return path.size() >= dir.size() && path.compare(0, dir.size(), dir) == 0 &&
         (path.size() == dir.size() || path[dir.size()] == '/');
}

// `path` lies strictly below `dir`.
inline bool IsBelow(std::string_view path, std::string_view dir) {
  return path.size() != dir.size() && IsAtOrBelow(path, dir);
}

// The rename rule. Where `path` is once `from` (a file or a directory) has been renamed to
// `to`: `to` itself, or the same place below `to`; nullopt when `path` is not at or below
// `from`.
inline std::optional<std::string> Rebase(std::string_view path, std::string_view from,
                                         std::string_view to) {
  if (!IsAtOrBelow(path, from)) return std::nullopt;
  if (path.size() == from.size()) return std::string(to);
  return Join(to, path.substr(from.empty() ? 0 : from.size() + 1));
}

}  // namespace ckptfs::path
