// JournalTrace: the lines the soak reads to check, by sequence number, that nothing is
// handled twice (store/publish/journal_trace.h). Fixture: journal_fixture.h.
#include "store/publish/journal_trace.h"

#include "tests/store/publish/journal_fixture.h"

namespace ckptfs::store {
namespace {

using namespace std::chrono_literals;

TEST_F(JournalTest, TheTraceHasAStartAndALinePerEntryDoneAfterItsRecordLeft) {
  const std::string path = tmp_.path() + "/trace";
  auto trace = JournalTrace::Open(path);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  TestHooks hooks;
  hooks.options.trace = trace->get();
  MakeJournal(std::move(hooks));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile f = StartFile("ck");
  Write(&f, "bytes");
  const uint64_t seq = Publish(f, "ck/file");
  ASSERT_TRUE(journal_->Wait(seq).ok());
  (void)journal_->Wait(Op(OpType::kUnlink, "ck/missing"));  // done, applied or not
  journal_.reset();
  // A stop leaves nothing: the entries of the next run start again at #1, after `start 2`.
  MakeJournal();
  journal_.reset();
  const std::string lines = ReadFile(path);
  EXPECT_EQ(lines.rfind("start 1\ndone 1 mkdir 1 ck\ndone 2 publish 1 ck/file\ndone 3 unlink ", 0),
            0u)
      << lines;
  EXPECT_EQ(lines.find("start 2"), std::string::npos) << "the second run had no trace";
  // A recovered entry's line.
  JournalEntry e;
  e.seq = 7;
  e.op = OpType::kRename;
  e.path = "ck/.metadata";
  (*trace)->Recovered("discard", e);
  EXPECT_NE(ReadFile(path).find("\ndiscard 7 rename ck/.metadata\n"), std::string::npos);
}

TEST(JournalTraceOpen, AnUnwritablePathIsAClearError) {
  auto trace = JournalTrace::Open("/nonexistent-dir/trace");
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().ToString().find("/nonexistent-dir/trace"), std::string::npos);
}

}  // namespace
}  // namespace ckptfs::store
