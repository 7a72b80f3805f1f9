// Status: errno mapping both ways, names and messages.
#include "common/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <string>

namespace ckptfs {
namespace {

TEST(Status, ErrnoRoundTripsThroughItsCode) {
  for (int err : {ENOENT, EEXIST, EINVAL, EACCES, ENOSPC, EBUSY, ENOTEMPTY, ENOTDIR, EISDIR,
                  ENOTSUP, ENAMETOOLONG, EMFILE, EIO}) {
    Status st = Status::FromErrno(err, "op");
    EXPECT_EQ(st.ToErrno(), err) << CodeName(st.code());
  }
  EXPECT_TRUE(Status::FromErrno(0, "op").ok());
  EXPECT_EQ(Status::FromErrno(EDQUOT, "op").ToErrno(), ENOSPC);
  EXPECT_EQ(Status::FromErrno(EROFS, "op").ToErrno(), EACCES);
  EXPECT_EQ(Status::FromErrno(ETIMEDOUT, "op").ToErrno(), EIO);
}

// Running out of descriptors is neither "busy" nor an I/O error: the caller gets EMFILE
// and the message still says which limit it was.
TEST(Status, TooManyOpenFilesIsItsOwnCodeAndReadsAsEmfile) {
  Status per_process = Status::FromErrno(EMFILE, "open f");
  Status system_wide = Status::FromErrno(ENFILE, "open f");
  for (const Status& st : {per_process, system_wide}) {
    EXPECT_EQ(st.code(), Code::kTooManyOpenFiles);
    EXPECT_EQ(st.ToErrno(), EMFILE);
    EXPECT_EQ(st.ToString().rfind("TooManyOpenFiles: open f: Too many open files", 0), 0u)
        << st.ToString();
  }
  EXPECT_NE(system_wide.message().find("in system"), std::string::npos);
  EXPECT_EQ(Status::FromErrno(EBUSY, "x").code(), Code::kBusy);
}

TEST(Status, OkAndResult) {
  EXPECT_EQ(Status::Ok().ToString(), "OK");
  EXPECT_EQ(Status::Ok().ToErrno(), 0);
  Result<int> r = Status(Code::kNoSpace, "full");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().ToErrno(), ENOSPC);
  Result<int> from_ok = Status::Ok();  // a Result needs a value or an error
  EXPECT_EQ(from_ok.status().code(), Code::kInternal);
}

}  // namespace
}  // namespace ckptfs
