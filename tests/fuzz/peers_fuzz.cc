// Fuzzes the peers file (issue 41): what a scheduler's prolog writes and every daemon reads
// at start and again on each change (mount/peers_watch.h): ParsePeersText, ValidatePeerList,
// then Membership::Update (store/peer/membership.h) against a running membership of the same
// size. A list either parser accepts must hold its contract: non-empty entries without
// comment or edge blanks; an accepted update keeps this node's own entry and the size, and
// is what View() shows; a refused one changes nothing and is counted with a reason.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "mount/options.h"
#include "store/peer/membership.h"

namespace {

bool Blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

}  // namespace

// Membership logs every accepted or refused list: not per input.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto list = ckptfs::ParsePeersText(text);
  if (!list.ok()) return 0;
  if (list->empty()) __builtin_trap();
  for (const std::string& p : *list) {
    if (p.empty() || Blank(p.front()) || Blank(p.back()) || p.find('#') != std::string::npos ||
        p.find('\n') != std::string::npos) {
      __builtin_trap();
    }
  }
  (void)ckptfs::ValidatePeerList(*list);
  if (list->size() > 4096) return 0;
  // A running membership of the same size; this node is rank 0 and keeps its entry in half
  // of the runs (so that accepted moves are reached too).
  std::vector<std::string> before;
  for (size_t i = 0; i < list->size(); ++i) before.push_back("10.9.0." + std::to_string(i) + ":7470");
  if (size % 2 == 0) before[0] = (*list)[0];
  ckptfs::store::peer::Membership m(before, 0);
  auto change = m.Update(*list);
  const auto view = m.View();
  if (change.ok()) {
    // Membership checks less than ValidatePeerList (not the HOST:PORT form: a daemon
    // refuses that list before it reaches here); what it takes is the list as given.
    if (view.nodes != *list) __builtin_trap();
    if (view.nodes.size() != before.size() || view.nodes[0] != before[0]) __builtin_trap();
    for (uint32_t r : change->moved) {
      if (r == 0 || r >= view.nodes.size()) __builtin_trap();
    }
    if (view.rejected != 0) __builtin_trap();
  } else {
    if (view.nodes != before || view.rejected != 1 || view.last_rejection.empty()) __builtin_trap();
    if (change.status().message().empty()) __builtin_trap();
  }
  return 0;
}
