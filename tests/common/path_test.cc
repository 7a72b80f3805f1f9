// common/path.h: joining, splitting and the rename rule of backing-relative paths.
#include "common/path.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ckptfs::path {
namespace {

TEST(Path, JoinParentBasenameOfRootAndNestedNames) {
  EXPECT_EQ(Join("", "a"), "a");
  EXPECT_EQ(Join("a/b", "c"), "a/b/c");
  EXPECT_EQ(Parent("a"), "");
  EXPECT_EQ(Parent("a/b/c"), "a/b");
  EXPECT_EQ(Basename("a"), "a");
  EXPECT_EQ(Basename("a/b/c"), "c");
  EXPECT_EQ(Join(Parent("x/y/z"), Basename("x/y/z")), "x/y/z");
}

TEST(Path, ComponentsSkipEmptyNamesAndKeepDotsForTheCallerToRefuse) {
  EXPECT_EQ(Components(""), std::vector<std::string>{});
  EXPECT_EQ(Components("a"), std::vector<std::string>{"a"});
  EXPECT_EQ(Components("a/b/c"), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(Components("/a//b/"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(Components("///"), std::vector<std::string>{});
  EXPECT_EQ(Components("./a/../b"), (std::vector<std::string>{".", "a", "..", "b"}));
  // The inverse of Join over the names of a confined path.
  std::string joined;
  for (const std::string& c : Components("x/y/z")) joined = Join(joined, c);
  EXPECT_EQ(joined, "x/y/z");
}

TEST(Path, AtOrBelowIsByWholeComponentsAndTheRootHoldsEverything) {
  EXPECT_TRUE(IsAtOrBelow("a/b", "a"));
  EXPECT_TRUE(IsAtOrBelow("a", "a"));
  EXPECT_FALSE(IsAtOrBelow("ab", "a"));
  EXPECT_FALSE(IsAtOrBelow("a", "a/b"));
  EXPECT_TRUE(IsAtOrBelow("a", ""));
  EXPECT_TRUE(IsAtOrBelow("", ""));
  EXPECT_TRUE(IsBelow("a/b", "a"));
  EXPECT_FALSE(IsBelow("a", "a"));
  EXPECT_TRUE(IsBelow("a", ""));
  EXPECT_FALSE(IsBelow("", ""));
}

TEST(Path, RebaseMovesTheNameAndWhatIsBelowItOnly) {
  EXPECT_EQ(Rebase("run", "run", "done"), "done");
  EXPECT_EQ(Rebase("run/step1/x", "run", "done"), "done/step1/x");
  EXPECT_EQ(Rebase("run/step1", "run", "a/b"), "a/b/step1");
  EXPECT_EQ(Rebase("runner", "run", "done"), std::nullopt);
  EXPECT_EQ(Rebase("other/run", "run", "done"), std::nullopt);
  EXPECT_EQ(Rebase("x/y", "", "top"), "top/x/y");
  EXPECT_EQ(Rebase("a/x", "a", ""), "x");
}

}  // namespace
}  // namespace ckptfs::path
