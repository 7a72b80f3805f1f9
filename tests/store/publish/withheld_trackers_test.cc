// WithheldTrackers: an operator's abort of a tracker arms DeletionHold past any commit until
// a version of that tracker is applied, and the next start after a crash finds it armed
// again from the state db.
#include "store/publish/withheld_trackers.h"

#include <gtest/gtest.h>

#include <memory>

#include "store/primitives/state_db.h"
#include "store/publish/deletion_hold.h"
#include "tests/store/primitives/faulty_backing_dir.h"

namespace ckptfs::store {
namespace {

class WithheldTrackersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto db = StateDb::Open(tmp_.Sub("state", false));
    ASSERT_TRUE(db.ok()) << db.status().ToString();
    db_ = std::move(db).value();
  }
  // One daemon run's view: a hold, and the withheld trackers loaded from the state db.
  struct Run {
    DeletionHold hold;
    std::unique_ptr<WithheldTrackers> trackers;
  };
  std::unique_ptr<Run> Start() {
    auto run = std::make_unique<Run>();
    run->trackers = std::make_unique<WithheldTrackers>(db_.get(), &run->hold);
    EXPECT_TRUE(run->trackers->Load().ok());
    return run;
  }

  ScopedTempDir tmp_;
  std::unique_ptr<StateDb> db_;
};

TEST_F(WithheldTrackersTest, AWithheldTrackerHoldsPastCommitsUntilAVersionOfItIsThrough) {
  auto run = Start();
  EXPECT_FALSE(run->hold.active());
  run->trackers->Withhold("latest_checkpointed_iteration.txt");
  run->trackers->Withhold("other/latest");
  EXPECT_TRUE(run->hold.active());
  run->hold.Committed();
  EXPECT_TRUE(run->hold.active()) << "a commit does not bring the dropped trackers back";
  run->trackers->Through("iter_0000001/__0_0.distcp");
  run->trackers->Through("latest_checkpointed_iteration.txt");
  EXPECT_TRUE(run->hold.active()) << "another tracker is still withheld";
  run->trackers->Through("other/latest");
  EXPECT_FALSE(run->hold.active());
}

TEST_F(WithheldTrackersTest, TheNextStartHoldsUntilTheTrackerIsThrough) {
  Start()->trackers->Withhold("latest_checkpointed_iteration.txt");  // then killed
  auto run = Start();
  EXPECT_TRUE(run->hold.active());
  run->trackers->Through("latest_checkpointed_iteration.txt");
  EXPECT_FALSE(run->hold.active());
  EXPECT_FALSE(Start()->hold.active()) << "the record went with the tracker's version";
}

}  // namespace
}  // namespace ckptfs::store
