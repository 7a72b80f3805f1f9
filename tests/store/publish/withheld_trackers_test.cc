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

std::unique_ptr<StateDb> OpenDb(ScopedTempDir& tmp) {
  auto db = StateDb::Open(tmp.Sub("state", false));
  EXPECT_TRUE(db.ok()) << db.status().ToString();
  return db.ok() ? std::move(db).value() : nullptr;
}

TEST(WithheldTrackersTest, AWithheldTrackerHoldsPastCommitsUntilAVersionOfItIsThrough) {
  ScopedTempDir tmp;
  auto db = OpenDb(tmp);
  ASSERT_NE(db, nullptr);
  DeletionHold hold;
  WithheldTrackers trackers(db.get(), &hold);
  ASSERT_TRUE(trackers.Load().ok());
  EXPECT_FALSE(hold.active());

  trackers.Withhold("latest_checkpointed_iteration.txt");
  trackers.Withhold("other/latest");
  EXPECT_TRUE(hold.active());
  hold.Committed();
  EXPECT_TRUE(hold.active()) << "a commit does not bring the dropped trackers back";
  trackers.Through("iter_0000001/__0_0.distcp");
  trackers.Through("latest_checkpointed_iteration.txt");
  EXPECT_TRUE(hold.active()) << "another tracker is still withheld";
  trackers.Through("other/latest");
  EXPECT_FALSE(hold.active());
}

TEST(WithheldTrackersTest, TheNextStartHoldsUntilTheTrackerIsThrough) {
  ScopedTempDir tmp;
  auto db = OpenDb(tmp);
  ASSERT_NE(db, nullptr);
  {
    DeletionHold hold;
    WithheldTrackers trackers(db.get(), &hold);
    ASSERT_TRUE(trackers.Load().ok());
    trackers.Withhold("latest_checkpointed_iteration.txt");
  }  // the daemon is killed
  DeletionHold hold;
  WithheldTrackers trackers(db.get(), &hold);
  ASSERT_TRUE(trackers.Load().ok());
  EXPECT_TRUE(hold.active());
  trackers.Through("latest_checkpointed_iteration.txt");
  EXPECT_FALSE(hold.active());

  DeletionHold after;
  WithheldTrackers again(db.get(), &after);
  ASSERT_TRUE(again.Load().ok());
  EXPECT_FALSE(after.active()) << "the record went with the tracker's version";
}

}  // namespace
}  // namespace ckptfs::store
