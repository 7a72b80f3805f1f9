// A fixed-bucket latency histogram for Prometheus exposition, and the few process-wide
// histograms that ckptfs exports at /metrics.
//
// Thread-safe and lock-free: Observe() is a handful of relaxed atomic adds, cheap
// enough for every FUSE request. A scrape reads the buckets one by one, so a scrape
// that races with Observe() may see a count one ahead of a bucket; Prometheus
// tolerates that (each series stays monotonic).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>

namespace ckptfs {

class Histogram {
 public:
  // Upper bounds in seconds, ascending; +Inf is implicit.
  static constexpr std::array<double, 16> kBounds = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                     0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                                     1,      2.5,     10,     60};

  void Observe(double seconds) {
    size_t i = 0;
    while (i < kBounds.size() && seconds > kBounds[i]) ++i;
    buckets_[i].fetch_add(1, std::memory_order_relaxed);
    sum_ns_.fetch_add(static_cast<uint64_t>(seconds > 0 ? seconds * 1e9 : 0),
                      std::memory_order_relaxed);
    count_.fetch_add(1, std::memory_order_relaxed);
  }

  uint64_t count() const { return count_.load(std::memory_order_relaxed); }

  // Appends the _bucket/_sum/_count sample lines of `name` (no HELP/TYPE lines).
  // `labels` is empty or a label list without braces, e.g. `op="write"`.
  void Render(const std::string& name, const std::string& labels, std::string* out) const {
    const std::string sep = labels.empty() ? "" : ",";
    uint64_t cumulative = 0;
    for (size_t i = 0; i <= kBounds.size(); ++i) {
      cumulative += buckets_[i].load(std::memory_order_relaxed);
      std::string le = i < kBounds.size() ? FormatBound(kBounds[i]) : "+Inf";
      *out += name + "_bucket{" + labels + sep + "le=\"" + le + "\"} " +
              std::to_string(cumulative) + "\n";
    }
    const std::string braces = labels.empty() ? "" : "{" + labels + "}";
    *out += name + "_sum" + braces + " " +
            std::to_string(sum_ns_.load(std::memory_order_relaxed) / 1e9) + "\n";
    // _count equals the +Inf bucket by construction.
    *out += name + "_count" + braces + " " + std::to_string(cumulative) + "\n";
  }

 private:
  static std::string FormatBound(double b) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", b);
    return buf;
  }

  std::array<std::atomic<uint64_t>, kBounds.size() + 1> buckets_{};
  std::atomic<uint64_t> sum_ns_{0};
  std::atomic<uint64_t> count_{0};
};

// Seconds that writes waited for a free staging chunk (backpressure, G6). Recorded by
// gpu::StagingPool, exported by fs/.
inline Histogram& StagingWaitHistogram() {
  static Histogram h;
  return h;
}

}  // namespace ckptfs
