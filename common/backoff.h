// Backoff: the pause before the next try of something that failed, doubling from `first`
// up to `max`. The one rule for every retry in ckptfs (flush retries, the journal's
// halted entry, a peer paused after a failure, a replica link, a FUSE ring entry).
//
// Two ways to keep the count, one rule:
//   Delay(n)      the pause before retry n (0 is the first): first * 2^n, capped at max;
//                 for a caller that counts its attempts.
//   After(pause)  the pause after `pause`: 2 * pause, capped at max; for a caller that
//                 keeps the pause itself (and starts from first, and back at first after
//                 a success).
// Pure and constexpr; thread-safe.
#pragma once

#include <chrono>
#include <cstdint>

namespace ckptfs {

struct Backoff {
  std::chrono::milliseconds first;
  std::chrono::milliseconds max;

  constexpr std::chrono::milliseconds Delay(uint64_t retry) const {
    std::chrono::milliseconds d = first;
    for (uint64_t i = 0; i < retry && d < max && d.count() > 0; ++i) d *= 2;
    return d < max ? d : max;
  }

  constexpr std::chrono::milliseconds After(std::chrono::milliseconds pause) const {
    return pause * 2 < max ? pause * 2 : max;
  }
};

}  // namespace ckptfs
