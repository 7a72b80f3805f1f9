// The POSIX ownership rules the daemon applies itself (fs/namespace/posix_access.h), checked
// against what Linux does (fs/attr.c, fs/namei.c, fs/inode.c).
#include "fs/namespace/posix_access.h"

#include <gtest/gtest.h>
#include <unistd.h>

namespace ckptfs::fs {
namespace {

constexpr uid_t kOwner = 1000, kOther = 2000;
constexpr gid_t kOwnerGroup = 1000, kExtraGroup = 1500, kOtherGroup = 2000;

Caller As(uid_t uid, gid_t gid, std::vector<gid_t> groups = {}) {
  Caller c;
  c.uid = uid;
  c.gid = gid;
  c.groups = std::move(groups);
  c.groups_known = true;
  return c;
}

struct stat Attr(mode_t mode, uid_t uid = kOwner, gid_t gid = kOwnerGroup) {
  struct stat st {};
  st.st_mode = mode;
  st.st_uid = uid;
  st.st_gid = gid;
  return st;
}

const Caller kRoot = As(0, 0);
const Caller kOwnerC = As(kOwner, kOwnerGroup, {kExtraGroup});
const Caller kOtherC = As(kOther, kOtherGroup);

TEST(PosixAccess, OnlyRootGivesAFileAwayAndTheOwnerMayPickOneOfItsGroups) {
  const struct stat f = Attr(S_IFREG | 0644);
  const uid_t keep_uid = static_cast<uid_t>(-1);
  const gid_t keep_gid = static_cast<gid_t>(-1);
  EXPECT_TRUE(CheckChown(kRoot, f, kOther, kOtherGroup).ok());
  EXPECT_EQ(CheckChown(kOwnerC, f, kOther, keep_gid).code(), Code::kNotPermitted);
  EXPECT_TRUE(CheckChown(kOwnerC, f, kOwner, keep_gid).ok());          // to oneself
  EXPECT_TRUE(CheckChown(kOwnerC, f, keep_uid, kExtraGroup).ok());     // supplementary
  EXPECT_TRUE(CheckChown(kOwnerC, f, keep_uid, kOwnerGroup).ok());     // primary
  EXPECT_EQ(CheckChown(kOwnerC, f, keep_uid, kOtherGroup).code(), Code::kNotPermitted);
  EXPECT_EQ(CheckChown(kOtherC, f, keep_uid, kOtherGroup).code(), Code::kNotPermitted);
  EXPECT_EQ(CheckChown(kOtherC, f, keep_uid, keep_gid).code(), Code::kNotPermitted);
  EXPECT_EQ(CheckChown(kOwnerC, f, kOther, kExtraGroup).code(), Code::kNotPermitted);
}

TEST(PosixAccess, AChownClearsSetuidAndExecutableSetgidOfFilesButNotOfDirectories) {
  EXPECT_EQ(ModeAfterChown(Attr(S_IFREG | 06755)) & 07777, 0755u);
  EXPECT_EQ(ModeAfterChown(Attr(S_IFREG | 06745)) & 07777, 02745u);  // setgid, no g+x: lock
  EXPECT_EQ(ModeAfterChown(Attr(S_IFDIR | 06755)) & 07777, 06755u);
  EXPECT_TRUE(S_ISREG(ModeAfterChown(Attr(S_IFREG | 04755))));
}

TEST(PosixAccess, ChmodIsTheOwnersAndANonMembersSetgidIsDropped) {
  const struct stat f = Attr(S_IFREG | 0644, kOwner, kOtherGroup);
  EXPECT_EQ(*CheckChmod(kOwnerC, f, 0600), 0600u);
  EXPECT_EQ(*CheckChmod(kOwnerC, f, 02755), 0755u);  // owner not in the file's group
  EXPECT_EQ(*CheckChmod(kRoot, f, 02755), 02755u);
  EXPECT_EQ(CheckChmod(kOtherC, f, 0600).status().code(), Code::kNotPermitted);
  const struct stat suid = Attr(S_IFREG | 06755);
  // The kernel's kill-priv when someone else writes: only clearing is allowed.
  EXPECT_EQ(*CheckChmod(kOtherC, suid, 0755), 0755u);
  EXPECT_EQ(*CheckChmod(kOtherC, suid, 02755), 02755u);
  EXPECT_EQ(CheckChmod(kOtherC, suid, 0777).status().code(), Code::kNotPermitted);
  EXPECT_EQ(CheckChmod(kOtherC, Attr(S_IFREG | 0755), 04755).status().code(),
            Code::kNotPermitted);
}

TEST(PosixAccess, ExplicitTimesNeedTheOwnerAndNowNeedsWritePermission) {
  const struct stat shared = Attr(S_IFREG | 0666);
  const struct stat mine = Attr(S_IFREG | 0644);
  EXPECT_TRUE(CheckUtimes(kOwnerC, mine, true).ok());
  EXPECT_TRUE(CheckUtimes(kRoot, mine, true).ok());
  EXPECT_TRUE(CheckUtimes(kOtherC, shared, false).ok());
  EXPECT_EQ(CheckUtimes(kOtherC, shared, true).code(), Code::kNotPermitted);
  EXPECT_EQ(CheckUtimes(kOtherC, mine, false).code(), Code::kPermission);
}

TEST(PosixAccess, AStickyDirectoryLetsOnlyTheOwnersOrRootRemoveAName) {
  const struct stat sticky = Attr(S_IFDIR | 01777, 0, 0);
  const struct stat plain = Attr(S_IFDIR | 0777, 0, 0);
  const struct stat victim = Attr(S_IFREG | 0644);
  EXPECT_EQ(CheckSticky(kOtherC, sticky, victim).code(), Code::kNotPermitted);
  EXPECT_TRUE(CheckSticky(kOwnerC, sticky, victim).ok());
  EXPECT_TRUE(CheckSticky(kRoot, sticky, victim).ok());
  EXPECT_TRUE(CheckSticky(kOtherC, plain, victim).ok());
  EXPECT_TRUE(CheckSticky(kOtherC, Attr(S_IFDIR | 01777, kOther, kOtherGroup), victim).ok());
}

TEST(PosixAccess, ModeBitsFollowOwnerThenGroupThenOthers) {
  const struct stat f = Attr(S_IFREG | 0460, kOwner, kExtraGroup);
  EXPECT_TRUE(MayAccess(kOwnerC, f, R_OK));
  EXPECT_FALSE(MayAccess(kOwnerC, f, W_OK));  // the owner class decides, not the group's
  EXPECT_TRUE(MayAccess(As(kOther, kOtherGroup, {kExtraGroup}), f, R_OK | W_OK));
  EXPECT_FALSE(MayAccess(kOtherC, f, R_OK));
  EXPECT_TRUE(MayAccess(kRoot, f, R_OK | W_OK));
  EXPECT_FALSE(MayAccess(kRoot, Attr(S_IFREG | 0644), X_OK));
  EXPECT_TRUE(MayAccess(kRoot, Attr(S_IFDIR | 0600), X_OK));
}

TEST(PosixAccess, NewNamesBelongToTheCallerOrInheritASetgidDirectorysGroup) {
  const struct stat dir = Attr(S_IFDIR | 0755, 0, 0);
  NewOwner f = OwnerOfNew(kOwnerC, dir, S_IFREG, 0640);
  EXPECT_EQ(f.uid, kOwner);
  EXPECT_EQ(f.gid, kOwnerGroup);
  EXPECT_EQ(f.mode, 0640u);
  const struct stat sgid = Attr(S_IFDIR | 02775, 0, kExtraGroup);
  NewOwner sub = OwnerOfNew(kOtherC, sgid, S_IFDIR, 0755);
  EXPECT_EQ(sub.gid, kExtraGroup);
  EXPECT_EQ(sub.mode, 02755u);
  // setgid on an executable file in a group its creator is not in is dropped...
  EXPECT_EQ(OwnerOfNew(kOtherC, sgid, S_IFREG, 02755).mode, 0755u);
  // ...and kept for a member, or root.
  EXPECT_EQ(OwnerOfNew(kOwnerC, sgid, S_IFREG, 02755).mode, 02755u);
  EXPECT_EQ(OwnerOfNew(kRoot, dir, S_IFREG, 02755).mode, 02755u);
}

TEST(PosixAccess, TheDefaultCallerIsTheDaemonItself) {
  Caller c;
  EXPECT_EQ(c.uid, ::geteuid());
  EXPECT_EQ(c.gid, ::getegid());
}

}  // namespace
}  // namespace ckptfs::fs
