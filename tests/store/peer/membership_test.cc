// Membership (issue 39): a rank may move to a new address while daemons run; every other
// change of the list is refused with its reason and the old membership kept.
#include "store/peer/membership.h"

#include <gtest/gtest.h>

namespace ckptfs::store::peer {
namespace {

const std::vector<std::string> kNodes = {"10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"};

TEST(Membership, ANodeMovingToANewAddressBumpsTheEpoch) {
  Membership m(kNodes, 0);
  EXPECT_EQ(m.View().epoch, 1u);
  auto moved = kNodes;
  moved[1] = "10.0.0.12:7100";
  auto change = m.Update(moved);
  ASSERT_TRUE(change.ok()) << change.status().ToString();
  EXPECT_EQ(change->moved, std::vector<uint32_t>{1});
  EXPECT_EQ(change->epoch, 2u);
  EXPECT_EQ(m.Address(1), "10.0.0.12:7100");
  EXPECT_EQ(m.View().updates, 1u);
  // The same list again changes nothing.
  change = m.Update(moved);
  ASSERT_TRUE(change.ok());
  EXPECT_TRUE(change->moved.empty());
  EXPECT_EQ(m.View().epoch, 2u);
}

TEST(Membership, OtherChangesAreRefusedAndTheOldListKept) {
  Membership m(kNodes, 1);
  auto more = kNodes;
  more.push_back("10.0.0.4:7000");
  auto fewer = std::vector<std::string>(kNodes.begin(), kNodes.begin() + 2);
  auto self_moved = kNodes;
  self_moved[1] = "10.0.0.9:7000";  // this node's own entry
  auto twice = kNodes;
  twice[2] = kNodes[0];
  auto empty = kNodes;
  empty[2] = "";
  for (const auto& bad : {more, fewer, self_moved, twice, empty}) {
    auto change = m.Update(bad);
    EXPECT_EQ(change.status().code(), Code::kInvalid);
    EXPECT_EQ(m.View().nodes, kNodes);
    EXPECT_EQ(m.View().epoch, 1u);
  }
  EXPECT_EQ(m.View().rejected, 5u);
  EXPECT_NE(m.View().last_rejection.find("empty"), std::string::npos) << m.View().last_rejection;
  m.NoteRejected("--peers-file /x: cannot read it");
  EXPECT_EQ(m.View().rejected, 6u);
  EXPECT_EQ(m.View().last_rejection, "--peers-file /x: cannot read it");
}

TEST(Membership, RankNamesDoNotDependOnAddresses) {
  EXPECT_EQ(RankName(0), "rank-0");
  EXPECT_NE(RankName(1), RankName(10));
}

}  // namespace
}  // namespace ckptfs::store::peer
