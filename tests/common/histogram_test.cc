#include "common/histogram.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

namespace ckptfs {
namespace {

TEST(Histogram, RendersCumulativeBucketsSumAndCountWithLabels) {
  Histogram h;
  h.Observe(0.00005);  // first bucket (le=0.0001)
  h.Observe(0.003);    // le=0.005
  h.Observe(0.003);
  h.Observe(1000);  // only +Inf
  std::string out;
  h.Render("x_seconds", "mountpoint=\"/m\"", &out);
  EXPECT_NE(out.find("x_seconds_bucket{mountpoint=\"/m\",le=\"0.0001\"} 1\n"), std::string::npos)
      << out;
  EXPECT_NE(out.find("x_seconds_bucket{mountpoint=\"/m\",le=\"0.0025\"} 1\n"), std::string::npos);
  EXPECT_NE(out.find("x_seconds_bucket{mountpoint=\"/m\",le=\"0.005\"} 3\n"), std::string::npos);
  EXPECT_NE(out.find("x_seconds_bucket{mountpoint=\"/m\",le=\"60\"} 3\n"), std::string::npos);
  EXPECT_NE(out.find("x_seconds_bucket{mountpoint=\"/m\",le=\"+Inf\"} 4\n"), std::string::npos);
  EXPECT_NE(out.find("x_seconds_count{mountpoint=\"/m\"} 4\n"), std::string::npos);
  EXPECT_NE(out.find("x_seconds_sum{mountpoint=\"/m\"} 1000.006"), std::string::npos) << out;
  EXPECT_EQ(h.count(), 4u);
}

TEST(Histogram, NoLabelsAndBoundaryValuesGoInTheirOwnBucket) {
  Histogram h;
  h.Observe(0.1);  // le is inclusive
  h.Observe(-1);   // clock oddities count as 0
  std::string out;
  h.Render("y", "", &out);
  EXPECT_NE(out.find("y_bucket{le=\"0.05\"} 1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("y_bucket{le=\"0.1\"} 2\n"), std::string::npos) << out;
  EXPECT_NE(out.find("y_count 2\n"), std::string::npos) << out;
}

TEST(Histogram, ConcurrentObservationsAreAllCounted) {
  Histogram h;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&h] {
      for (int i = 0; i < 10000; ++i) h.Observe(i % 7 * 0.001);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(h.count(), 40000u);
  std::string out;
  h.Render("z", "", &out);
  EXPECT_NE(out.find("z_bucket{le=\"+Inf\"} 40000\n"), std::string::npos);
}

}  // namespace
}  // namespace ckptfs
