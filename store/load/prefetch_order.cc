#include "store/load/prefetch_order.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <tuple>

namespace ckptfs::store {

namespace {
std::optional<uint64_t> Decimal(std::string_view s) {
  uint64_t v = 0;
  if (s.empty() || s.size() > 19) return std::nullopt;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}
}  // namespace

std::optional<std::pair<uint64_t, uint64_t>> DcpWriterFile(std::string_view name) {
  constexpr std::string_view kPrefix = "__", kSuffix = ".distcp";
  if (name.size() <= kPrefix.size() + kSuffix.size() || name.substr(0, 2) != kPrefix ||
      name.substr(name.size() - kSuffix.size()) != kSuffix) {
    return std::nullopt;
  }
  std::string_view mid = name.substr(2, name.size() - 2 - kSuffix.size());
  const size_t sep = mid.find('_');
  if (sep == std::string_view::npos) return std::nullopt;
  auto rank = Decimal(mid.substr(0, sep));
  auto n = Decimal(mid.substr(sep + 1));
  if (!rank || !n) return std::nullopt;
  return std::make_pair(*rank, *n);
}

std::vector<PrefetchWindow> PrefetchOrder(
    const std::vector<std::pair<std::string, uint64_t>>& files, uint64_t window) {
  // A sequence per writer rank (DCP names, ordered by n), then one per other file (by name).
  using Key = std::tuple<bool, uint64_t, std::string>;  // (not DCP, rank, name)
  std::map<Key, std::vector<std::pair<uint64_t, size_t>>> sequences;  // (n, file index)
  for (size_t i = 0; i < files.size(); ++i) {
    if (files[i].second == 0) continue;
    if (auto w = DcpWriterFile(files[i].first)) {
      sequences[Key{false, w->first, ""}].emplace_back(w->second, i);
    } else {
      sequences[Key{true, 0, files[i].first}].emplace_back(0, i);
    }
  }
  struct Cursor {
    std::vector<std::pair<uint64_t, size_t>> files;
    size_t at = 0;
    uint64_t pos = 0;
  };
  std::vector<Cursor> cursors;
  for (auto& [key, seq] : sequences) {
    std::sort(seq.begin(), seq.end());
    cursors.push_back(Cursor{std::move(seq)});
  }
  std::vector<PrefetchWindow> out;
  bool more = !cursors.empty();
  while (more) {
    more = false;
    for (Cursor& c : cursors) {
      if (c.at >= c.files.size()) continue;
      const size_t f = c.files[c.at].second;
      const uint64_t n = std::min(window, files[f].second - c.pos);
      out.push_back(PrefetchWindow{f, c.pos, n});
      c.pos += n;
      if (c.pos >= files[f].second) {
        ++c.at;
        c.pos = 0;
      }
      more = more || c.at < c.files.size();
    }
  }
  return out;
}

}  // namespace ckptfs::store
