#include "mount/admin.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ckptfs::admin {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// A plain directory that looks like a ckptfs mount to FindMountRoot: it holds
// .ckptfs/stats. Removed on destruction.
class FakeMount {
 public:
  FakeMount() {
    std::string tmpl = (fs::temp_directory_path() / "ckptfs-admin-test.XXXXXX").string();
    root_ = fs::path(::mkdtemp(tmpl.data()));
    root_ = fs::canonical(root_);
    fs::create_directories(root_ / "mnt" / ".ckptfs");
    fs::create_directories(root_ / "state");
    Write("mnt/.ckptfs/stats", StatsJson(4242));
    Write("mnt/.ckptfs/checkpoints", "[]");
  }
  ~FakeMount() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  FakeMount(const FakeMount&) = delete;
  FakeMount& operator=(const FakeMount&) = delete;

  std::string StatsJson(int pid) const {
    return R"({"pid":)" + std::to_string(pid) + R"(,"version":"0.1.0","mountpoint":")" + mount() +
           R"(","backing_dir":"/lustre/ckpt","state_dir":")" + state_dir() +
           R"(","durability":"async","uptime_s":7385.2,"bytes_written":1610612736,
              "bytes_staged":1610612736,"bytes_flushed":1073741824,
              "bytes_published":536870912,"staging_used":268435456,
              "staging_limit":8589934592,"backing_bytes_read":0,"journal_pending":12,
              "files_pending":3,"checkpoints":{"writing":1,"pending":2,"committed":10,
              "failed":0,"aborted":0},"errors":0,"last_error":""})";
  }

  void Write(const std::string& rel, const std::string& content) const {
    fs::path p = root_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << content;
  }
  std::string top() const { return root_.string(); }
  std::string mount() const { return (root_ / "mnt").string(); }
  std::string state_dir() const { return (root_ / "state").string(); }
  std::string Path(const std::string& rel) const { return (root_ / rel).string(); }

 private:
  fs::path root_;
};

// Scripted daemon: xattr values are returned in order (the last one repeats), the clock
// moves only when the tool sleeps, and the daemon's pid lives for a set number of polls.
class FakeEnv : public AdminEnv {
 public:
  std::deque<Result<std::string>> xattrs;
  std::vector<std::string> xattr_paths;
  double now = 1000.0;
  double wall = 1.7e9;
  std::vector<double> sleeps;
  bool tty = false;
  int alive_polls = 0;  // ProcessAlive answers true this many times, then false.
  std::vector<int> alive_pids;
  std::vector<std::string> unmounted;
  Status unmount_status;
  std::function<void()> on_unmount;

  Result<std::string> GetXattr(const std::string& path, const std::string& name) override {
    xattr_paths.push_back(path);
    EXPECT_EQ(name, kProgressXattr);
    if (xattrs.empty()) return Status(Code::kIo, "no scripted xattr");
    Result<std::string> value = xattrs.front();
    if (xattrs.size() > 1) xattrs.pop_front();
    return value;
  }
  double MonotonicSeconds() override { return now; }
  double WallSeconds() override { return wall; }
  void Sleep(double seconds) override {
    sleeps.push_back(seconds);
    now += seconds;
  }
  bool ProcessAlive(int pid) override {
    alive_pids.push_back(pid);
    if (alive_polls <= 0) return false;
    --alive_polls;
    return true;
  }
  Status FuseUnmount(const std::string& mountpoint) override {
    unmounted.push_back(mountpoint);
    if (on_unmount) on_unmount();
    return unmount_status;
  }
  bool StderrIsTerminal() override { return tty; }
};

std::string ProgressJson(const std::string& state, uint64_t total, uint64_t done,
                         const std::string& error = "") {
  return R"({"state":")" + state + R"(","bytes_total":)" + std::to_string(total) +
         R"(,"bytes_done":)" + std::to_string(done) + R"(,"error":")" + error + R"("})";
}

// ---- Formatting ------------------------------------------------------------------------

TEST(HumanBytes, UsesBinaryUnitsWithTwoDecimals) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(1023), "1023 B");
  EXPECT_EQ(HumanBytes(1024), "1.00 KiB");
  EXPECT_EQ(HumanBytes(1536), "1.50 KiB");
  EXPECT_EQ(HumanBytes(1610612736), "1.50 GiB");
  EXPECT_EQ(HumanBytes(5ull << 40), "5.00 TiB");
  EXPECT_EQ(HumanBytes(UINT64_MAX), "16.00 EiB");
}

TEST(HumanBytes, RoundsUpToTheNextUnitInsteadOf1024) {
  EXPECT_EQ(HumanBytes((1 << 20) - 1), "1.00 MiB");
}

TEST(HumanDuration, PicksTheTwoLargestUnits) {
  EXPECT_EQ(HumanDuration(0), "0s");
  EXPECT_EQ(HumanDuration(42.9), "42s");
  EXPECT_EQ(HumanDuration(125), "2m 05s");
  EXPECT_EQ(HumanDuration(7380), "2h 03m");
  EXPECT_EQ(HumanDuration(3 * 86400 + 5 * 3600 + 59), "3d 05h");
  EXPECT_EQ(HumanDuration(-5), "0s");
}

// control_fuzz found it (issue 41): a "committed" time of 1.8e25 in /.ckptfs/checkpoints
// made FormatLocalTime cast a double beyond time_t (undefined behaviour, UBSan aborts).
TEST(FormatLocalTime, ShowsATimeBeyondTimeTOrNanAsUnknown) {
  EXPECT_EQ(FormatLocalTime(1.79589e25), "-");
  EXPECT_EQ(FormatLocalTime(-1e300), "-");
  EXPECT_EQ(FormatLocalTime(std::nan("")), "-");
  EXPECT_NE(FormatLocalTime(1.7e9), "-");
  auto table = FormatCheckpoints(
      R"([{"path": "ck", "state": "committed", "bytes": 1, "created": 1.7e9,
           "committed": 1.79589e25}])", 1.7e9);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
}

TEST(FormatTable, AlignsColumnsAndRightAlignsNumbers) {
  std::string table = FormatTable({{"NAME"}, {"SIZE", true}, {"NOTE"}},
                                  {{"a", "1.00 KiB", "x"}, {"longer-name", "5 B"}});
  EXPECT_EQ(table,
            "NAME             SIZE  NOTE\n"
            "a            1.00 KiB  x\n"
            "longer-name       5 B\n");
}

TEST(FormatKeyValues, AlignsValues) {
  EXPECT_EQ(FormatKeyValues({{"pid", "1"}, {"backing dir", "/b"}}),
            "pid          1\n"
            "backing dir  /b\n");
}

TEST(FormatStats, ShowsAnAlignedHumanSummary) {
  FakeMount m;
  auto text = FormatStats(m.StatsJson(4242));
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_THAT(*text, HasSubstr("pid              4242\n"));
  EXPECT_THAT(*text, HasSubstr("bytes written    1.50 GiB\n"));
  EXPECT_THAT(*text, HasSubstr("bytes published  512.00 MiB\n"));
  EXPECT_THAT(*text, HasSubstr("staging          256.00 MiB / 8.00 GiB (3.1%)\n"));
  EXPECT_THAT(*text, HasSubstr("uptime           2h 03m\n"));
  EXPECT_THAT(*text, HasSubstr("pending          12 journal entries, 3 files\n"));
  EXPECT_THAT(
      *text, HasSubstr("checkpoints      1 writing, 2 pending, 10 committed, 0 failed, 0 aborted"));
  EXPECT_THAT(*text, HasSubstr("last error       -\n"));
}

TEST(FormatStats, ShowsMissingFieldsAsDashAndRejectsGarbage) {
  auto text = FormatStats(R"({"pid": 7})");
  ASSERT_TRUE(text.ok());
  EXPECT_THAT(*text, HasSubstr("bytes written    -\n"));
  EXPECT_THAT(*text, HasSubstr("pending          -\n"));
  EXPECT_FALSE(FormatStats("not json").ok());
  EXPECT_FALSE(FormatStats("[1,2]").ok());
  auto wrong_type = FormatStats(R"({"pid": "wrong type"})");
  ASSERT_TRUE(wrong_type.ok());
  EXPECT_THAT(*wrong_type, HasSubstr("pid              -\n"));
}

TEST(FormatCheckpoints, ListsOldestFirstWithStateSizeAgeAndError) {
  ::setenv("TZ", "UTC", 1);
  ::tzset();
  const double now = 1700000000;
  std::string json = R"([
    {"path":"ckpt/step_200","state":"failed","bytes":2048,"bytes_published":1024,"files":2,
     "created":)" + std::to_string(now - 60) +
                     R"(,"updated":0,"committed":null,
     "error":"ENOSPC writing __0_0.distcp"},
    {"path":"ckpt/step_100","state":"committed","bytes":1610612736,
     "bytes_published":1610612736,"files":9,"created":)" +
                     std::to_string(now - 7380) + R"(,"updated":0,"committed":1699992720,
     "error":null}])";
  auto table = FormatCheckpoints(json, now);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  std::istringstream lines(*table);
  std::string header, first, second;
  std::getline(lines, header);
  std::getline(lines, first);
  std::getline(lines, second);
  EXPECT_THAT(header, StartsWith("PATH"));
  EXPECT_THAT(header, HasSubstr("STATE"));
  EXPECT_THAT(header, HasSubstr("ERROR"));
  EXPECT_THAT(first, StartsWith("ckpt/step_100  committed"));
  EXPECT_THAT(first, HasSubstr("1.50 GiB"));
  EXPECT_THAT(first, HasSubstr("100.0%"));
  EXPECT_THAT(first, HasSubstr("2h 03m"));
  EXPECT_THAT(first, HasSubstr("2023-11-14 20:12:00"));
  EXPECT_THAT(second, StartsWith("ckpt/step_200  failed"));
  EXPECT_THAT(second, HasSubstr("50.0%"));
  EXPECT_THAT(second, HasSubstr("1m 00s"));
  EXPECT_THAT(second, HasSubstr("ENOSPC writing __0_0.distcp"));
  // The STATE column starts at the same offset on every line.
  EXPECT_EQ(header.find("STATE"), first.find("committed"));
  EXPECT_EQ(header.find("STATE"), second.find("failed"));
}

TEST(FormatCheckpoints, SaysWhichCheckpointsAreHeldInMemory) {
  const double now = 1700000000;
  std::string json = R"([
    {"path":"run/step_100","state":"committed","bytes":2048,"bytes_published":2048,
     "files":2,"created":1,"committed":2,"error":null},
    {"path":"run/step_200","state":"committed","bytes":4096,"bytes_published":4096,
     "files":2,"created":3,"committed":4,"error":null,
     "in_memory":{"state":"committed","own_bytes":4096,"replica_bytes":1048576,
                  "replica_of":"10.0.0.1:7470"}}])";
  auto table = FormatCheckpoints(json, now);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  EXPECT_THAT(*table, HasSubstr("IN MEMORY"));
  EXPECT_THAT(*table, HasSubstr("here: 4.00 KiB own, 1.00 MiB replica of 10.0.0.1:7470"));
  // Without any checkpoint in memory the table is as before (no column).
  auto plain = FormatCheckpoints(R"([{"path":"a","state":"committed"}])", now);
  ASSERT_TRUE(plain.ok());
  EXPECT_THAT(*plain, Not(HasSubstr("IN MEMORY")));
}

TEST(FormatCheckpoints, SaysTheTierAndWhereTheReplicaOfAMemoryOnlyCheckpointIs) {
  std::string json = R"([
    {"path":"run/persist/s1","state":"committed","bytes":2048,"created":1,"committed":2},
    {"path":"run/mem/s2","state":"committed","tier":"memory","bytes":4096,
     "replica_holder":"10.0.0.2:7470"},
    {"path":"run/mem/s3","state":"replicating","tier":"memory","bytes":4096,
     "replica_holder":null},
    {"path":"run/mem/s0","state":"lost","tier":"memory","bytes":0,"replica_holder":null}])";
  auto table = FormatCheckpoints(json, 1700000000);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  EXPECT_THAT(*table, HasSubstr("TIER"));
  EXPECT_THAT(*table, HasSubstr("memory, replica on 10.0.0.2:7470"));
  EXPECT_THAT(*table, HasSubstr("memory, this node only"));
  EXPECT_THAT(*table, HasSubstr("backing"));
  EXPECT_THAT(*table, HasSubstr("lost"));
  auto plain = FormatCheckpoints(R"([{"path":"a","state":"committed"}])", 0);
  ASSERT_TRUE(plain.ok());
  EXPECT_THAT(*plain, Not(HasSubstr("TIER")));
}

TEST(FormatStats, ShowsTheRetainedTier) {
  auto text = FormatStats(R"({"retained":{"retained_bytes":1048576,"replica_bytes":2097152,
    "used_bytes":3145728,"budget_bytes":4194304,"hit_bytes":5242880,"crc_errors":0,
    "checkpoints":[{"path":"run/s"}],"replication":{"holder_bytes":1048576}}})");
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_THAT(*text, HasSubstr("1.00 MiB own, 2.00 MiB replicas for others, 1 checkpoints"));
  EXPECT_THAT(*text, HasSubstr("5.00 MiB from memory, 1.00 MiB from the replica holder"));
  EXPECT_THAT(*text, Not(HasSubstr("index builds")));
  // An index build's reads from memory are said apart from what loads read.
  auto indexed = FormatStats(R"({"retained":{"retained_bytes":1048576,"hit_bytes":0,
    "index_read_bytes":65536,"crc_errors":0,"checkpoints":[]}})");
  ASSERT_TRUE(indexed.ok()) << indexed.status().ToString();
  EXPECT_THAT(*indexed, HasSubstr("0 B from memory"));
  EXPECT_THAT(*indexed, HasSubstr("index builds read 64.00 KiB from memory"));
}

TEST(FormatCheckpoints, SaysSoWhenThereAreNone) {
  EXPECT_EQ(*FormatCheckpoints("[]", 0), "no checkpoints\n");
  EXPECT_FALSE(FormatCheckpoints("{}", 0).ok());
}

TEST(RenderProgressLine, ShowsBarPercentBytesAndState) {
  Progress p{"staged", 2ull << 30, 1ull << 30, ""};
  EXPECT_EQ(RenderProgressLine(p, 10), "[#####-----]   50.0%  1.00 GiB / 2.00 GiB  staged");
}

TEST(RenderProgressLine, NeverShows100PercentBeforeDoneAndFillsWhenPublished) {
  Progress p{"durable", 10000, 9999, ""};
  EXPECT_THAT(RenderProgressLine(p, 10), HasSubstr(" 99.9%"));
  Progress empty{"published", 0, 0, ""};
  EXPECT_THAT(RenderProgressLine(empty, 4), StartsWith("[####]  100.0%"));
}

// ---- Progress parsing and states ------------------------------------------------------

TEST(ParseProgress, ReadsAllFields) {
  auto p = ParseProgress(ProgressJson("durable", 100, 40, "boom"));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->state, "durable");
  EXPECT_EQ(p->bytes_total, 100u);
  EXPECT_EQ(p->bytes_done, 40u);
  EXPECT_EQ(p->error, "boom");
}

TEST(ParseProgress, AcceptsNullErrorAndMissingCounts) {
  auto p = ParseProgress(R"({"state":"committed","error":null})");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->state, "committed");
  EXPECT_EQ(p->bytes_total, 0u);
  EXPECT_EQ(p->error, "");
}

TEST(ParseProgress, RejectsMalformedValues) {
  EXPECT_FALSE(ParseProgress("").ok());
  EXPECT_FALSE(ParseProgress("published").ok());
  EXPECT_FALSE(ParseProgress(R"({"bytes_total":1})").ok());
  EXPECT_FALSE(ParseProgress(R"({"state":3})").ok());
  EXPECT_FALSE(ParseProgress(R"(["published"])").ok());
}

TEST(ClassifyState, TerminalStatesMapToExitCodes) {
  EXPECT_EQ(ExitCodeForState("published"), 0);
  EXPECT_EQ(ExitCodeForState("committed"), 0);
  EXPECT_EQ(ExitCodeForState("failed"), 1);
  EXPECT_EQ(ExitCodeForState("aborted"), 1);
  for (const char* s : {"staged", "durable", "writing", "pending", "unknown"}) {
    EXPECT_EQ(ClassifyState(s), StateKind::kInProgress) << s;
    EXPECT_EQ(ExitCodeForState(s), kExitError) << s;
  }
}

// ---- Finding the mount ----------------------------------------------------------------

TEST(FindMountRoot, WalksUpFromNestedDirectoriesAndFiles) {
  FakeMount m;
  m.Write("mnt/ckpt/step_1/__0_0.distcp", "x");
  EXPECT_EQ(*FindMountRoot(m.mount()), m.mount());
  EXPECT_EQ(*FindMountRoot(m.Path("mnt/ckpt/step_1")), m.mount());
  EXPECT_EQ(*FindMountRoot(m.Path("mnt/ckpt/step_1/__0_0.distcp")), m.mount());
  EXPECT_EQ(*FindMountRoot(m.Path("mnt/ckpt/../ckpt/./step_1/")), m.mount());
}

TEST(FindMountRoot, ResolvesSymlinksFirst) {
  FakeMount m;
  m.Write("mnt/ckpt/f", "x");
  fs::create_symlink(m.Path("mnt/ckpt"), m.Path("link"));
  EXPECT_EQ(*FindMountRoot(m.Path("link/f")), m.mount());
}

TEST(FindMountRoot, FailsOutsideAMountOrForMissingPaths) {
  FakeMount m;
  auto outside = FindMountRoot(m.state_dir());
  ASSERT_FALSE(outside.ok());
  EXPECT_EQ(outside.status().code(), Code::kNotFound);
  EXPECT_THAT(outside.status().message(), HasSubstr("not inside a ckptfs mount"));
  EXPECT_FALSE(FindMountRoot(m.Path("mnt/does/not/exist")).ok());
}

TEST(FindMountRoot, IgnoresAStatsEntryThatIsNotARegularFile) {
  FakeMount m;
  fs::create_directories(m.Path("state/.ckptfs/stats"));
  EXPECT_FALSE(FindMountRoot(m.state_dir()).ok());
}

TEST(ReadWholeFile, ReadsToEofEvenWhenStSizeIsZero) {
  // /proc files report st_size 0, like .ckptfs files.
  auto text = ReadWholeFile("/proc/self/status");
  ASSERT_TRUE(text.ok());
  EXPECT_THAT(*text, HasSubstr("Pid:"));
  FakeMount m;
  std::string big(200 * 1024, 'z');
  m.Write("big", big);
  EXPECT_EQ(*ReadWholeFile(m.Path("big")), big);
  EXPECT_EQ(ReadWholeFile(m.Path("missing")).status().code(), Code::kNotFound);
}

// ---- wait -----------------------------------------------------------------------------

TEST(WaitForPath, PollsUntilPublished) {
  FakeEnv env;
  env.xattrs = {ProgressJson("staged", 100, 0), ProgressJson("durable", 100, 60),
                ProgressJson("published", 100, 100)};
  std::ostringstream err;
  WaitOutcome w = WaitForPath(&env, "/m/f", {}, err);
  EXPECT_EQ(w.exit_code, kExitOk);
  EXPECT_EQ(w.last.state, "published");
  EXPECT_EQ(env.sleeps, (std::vector<double>{0.1, 0.1}));
  EXPECT_EQ(err.str(), "");  // Not a terminal: no bar.
}

TEST(WaitForPath, FailedAndAbortedExitOneWithTheError) {
  for (const char* state : {"failed", "aborted"}) {
    FakeEnv env;
    env.xattrs = {ProgressJson("writing", 10, 5), ProgressJson(state, 10, 5, "EIO on shard 3")};
    std::ostringstream err;
    WaitOutcome w = WaitForPath(&env, "/m/ckpt", {}, err);
    EXPECT_EQ(w.exit_code, kExitFailed) << state;
    EXPECT_THAT(w.message, HasSubstr("EIO on shard 3"));
    EXPECT_THAT(w.message, HasSubstr(state));
  }
}

TEST(WaitForPath, AWithheldTrackerExitsOneWithTheReason) {
  FakeEnv env;
  env.xattrs = {ProgressJson("staged", 4, 0),
                ProgressJson("withheld", 4, 4, "it names checkpoint ckpt, which was given up")};
  std::ostringstream err;
  WaitOutcome w = WaitForPath(&env, "/m/latest", {}, err);
  EXPECT_EQ(w.exit_code, kExitFailed);
  EXPECT_THAT(w.message, HasSubstr("withheld: it names checkpoint ckpt"));
}

TEST(WaitForPath, APathGoneAfterItWasSeenExitsOneAndOneNeverSeenExitsTwo) {
  // Gone unpublished: deleted, or a withheld tracker the backing store never had.
  FakeEnv env;
  env.xattrs = {ProgressJson("staged", 4, 0), Status::FromErrno(ENOENT, "/m/latest: getxattr")};
  std::ostringstream err;
  WaitOutcome w = WaitForPath(&env, "/m/latest", {}, err);
  EXPECT_EQ(w.exit_code, kExitFailed);
  EXPECT_THAT(w.message, HasSubstr("gone from the mount before it was published"));
  FakeEnv never;
  never.xattrs = {Status::FromErrno(ENOENT, "/m/latest: getxattr")};
  EXPECT_EQ(WaitForPath(&never, "/m/latest", {}, err).exit_code, kExitError);
}

TEST(WaitForPath, TimesOutWithExitTwoWithoutSleepingPastTheDeadline) {
  FakeEnv env;
  env.xattrs = {ProgressJson("staged", 2048, 1024)};
  WaitOptions options;
  options.timeout_s = 0.25;
  options.interval_s = 0.1;
  std::ostringstream err;
  WaitOutcome w = WaitForPath(&env, "/m/f", options, err);
  EXPECT_EQ(w.exit_code, kExitError);
  EXPECT_THAT(w.message, HasSubstr("timed out after 0.25s"));
  EXPECT_THAT(w.message, HasSubstr("staged, 1.00 KiB of 2.00 KiB done"));
  ASSERT_EQ(env.sleeps.size(), 3u);
  EXPECT_NEAR(env.sleeps[2], 0.05, 1e-9);
  EXPECT_EQ(env.xattr_paths.size(), 4u);  // One last look at the deadline.
}

TEST(WaitForPath, ZeroTimeoutLooksOnce) {
  FakeEnv env;
  env.xattrs = {ProgressJson("staged", 1, 0)};
  WaitOptions options;
  options.timeout_s = 0;
  std::ostringstream err;
  EXPECT_EQ(WaitForPath(&env, "/m/f", options, err).exit_code, kExitError);
  EXPECT_TRUE(env.sleeps.empty());
  EXPECT_EQ(env.xattr_paths.size(), 1u);
}

TEST(WaitForPath, XattrErrorsAndGarbageExitTwo) {
  FakeEnv env;
  env.xattrs = {Status::FromErrno(ENODATA, "/m/f: getxattr")};
  std::ostringstream err;
  EXPECT_EQ(WaitForPath(&env, "/m/f", {}, err).exit_code, kExitError);
  FakeEnv garbage;
  garbage.xattrs = {std::string("{not json")};
  EXPECT_EQ(WaitForPath(&garbage, "/m/f", {}, err).exit_code, kExitError);
}

TEST(WaitForPath, DrawsOneUpdatingLineOnATerminal) {
  FakeEnv env;
  env.tty = true;
  env.xattrs = {ProgressJson("staged", 100, 0), ProgressJson("staged", 100, 0),
                ProgressJson("published", 100, 100)};
  std::ostringstream err;
  EXPECT_EQ(WaitForPath(&env, "/m/f", {}, err).exit_code, kExitOk);
  const std::string out = err.str();
  EXPECT_EQ(std::count(out.begin(), out.end(), '\r'), 2);  // Unchanged lines are not redrawn.
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
  EXPECT_THAT(out, HasSubstr("  0.0%  0 B / 100 B  staged"));
  EXPECT_THAT(out, HasSubstr("100.0%  100 B / 100 B  published\x1b[K\n"));
}

TEST(RunWait, PathOutsideAMountExitsTwoWithoutPolling) {
  FakeMount m;
  FakeEnv env;
  std::ostringstream out, err;
  EXPECT_EQ(RunWait(&env, m.state_dir(), {}, out, err), kExitError);
  EXPECT_THAT(err.str(), HasSubstr("not inside a ckptfs mount"));
  EXPECT_TRUE(env.xattr_paths.empty());
}

TEST(RunWait, ReportsSuccessOnStdoutAndFailureOnStderr) {
  FakeMount m;
  m.Write("mnt/f", "x");
  {
    FakeEnv env;
    env.xattrs = {ProgressJson("published", 1536, 1536)};
    std::ostringstream out, err;
    EXPECT_EQ(RunWait(&env, m.Path("mnt/f"), {}, out, err), kExitOk);
    EXPECT_EQ(out.str(), m.Path("mnt/f") + ": published (1.50 KiB)\n");
    EXPECT_EQ(env.xattr_paths, std::vector<std::string>{m.Path("mnt/f")});
  }
  {
    FakeEnv env;
    env.xattrs = {ProgressJson("failed", 1, 0, "No space left on device")};
    std::ostringstream out, err;
    EXPECT_EQ(RunWait(&env, m.Path("mnt/f"), {}, out, err), kExitFailed);
    EXPECT_EQ(out.str(), "");
    EXPECT_EQ(err.str(),
              "ckptfs-admin: " + m.Path("mnt/f") + ": failed: No space left on device\n");
  }
}

// ---- Command line ---------------------------------------------------------------------

int Admin(std::vector<std::string> args, AdminEnv* env, std::string* out = nullptr,
          std::string* err = nullptr) {
  std::ostringstream o, e;
  int rc = RunAdmin(args, env, o, e);
  if (out) *out = o.str();
  if (err) *err = e.str();
  return rc;
}

TEST(RunAdmin, UsageErrorsExitTwoWithOneLine) {
  FakeMount m;
  FakeEnv env;
  const std::vector<std::vector<std::string>> bad = {
      {},
      {"bogus"},
      {"stats"},
      {"wait"},
      {"unmount"},
      {"checkpoints", m.mount(), "extra"},
      {"wait", m.mount(), "--timeout", "-1"},
      {"wait", m.mount(), "--timeout", "soon"},
      {"wait", m.mount(), "--interval", "0"},
      {"stats", m.mount(), "--no-such-flag"},
  };
  for (const auto& args : bad) {
    std::string out, err;
    EXPECT_EQ(Admin(args, &env, &out, &err), kExitError) << ::testing::PrintToString(args);
    EXPECT_EQ(out, "");
    EXPECT_THAT(err, StartsWith("ckptfs-admin: "));
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  }
  EXPECT_TRUE(env.xattr_paths.empty());
}

TEST(RunAdmin, HelpExitsZeroForEveryCommand) {
  FakeEnv env;
  std::string out;
  EXPECT_EQ(Admin({"--help"}, &env, &out), 0);
  EXPECT_THAT(out, HasSubstr("unmount"));
  for (const char* cmd : {"stats", "checkpoints", "wait", "unmount"}) {
    EXPECT_EQ(Admin({cmd, "--help"}, &env, &out), 0) << cmd;
    EXPECT_THAT(out, HasSubstr(std::string("Usage: ckptfs-admin ") + cmd));
  }
  Admin({"wait", "--help"}, &env, &out);
  EXPECT_THAT(out, HasSubstr("--timeout"));
  EXPECT_THAT(out, HasSubstr("--interval"));
}

TEST(RunAdmin, NotInsideAMountExitsTwo) {
  FakeMount m;
  FakeEnv env;
  for (const char* cmd : {"stats", "checkpoints", "wait", "unmount"}) {
    std::string err;
    EXPECT_EQ(Admin({cmd, m.state_dir()}, &env, nullptr, &err), kExitError) << cmd;
    EXPECT_EQ(err, "ckptfs-admin: " + m.state_dir() + ": not inside a ckptfs mount\n");
  }
}

TEST(RunAdmin, StatsPrintsRawJsonOrASummaryFromAnyPathInTheMount) {
  FakeMount m;
  m.Write("mnt/a/b/c", "x");
  FakeEnv env;
  std::string out;
  EXPECT_EQ(Admin({"stats", m.Path("mnt/a/b/c"), "--json"}, &env, &out), 0);
  EXPECT_EQ(out, m.StatsJson(4242) + "\n");
  EXPECT_EQ(Admin({"stats", m.Path("mnt/a")}, &env, &out), 0);
  EXPECT_THAT(out, HasSubstr("bytes written    1.50 GiB"));
}

TEST(RunAdmin, CheckpointsPrintsATable) {
  FakeMount m;
  m.Write("mnt/.ckptfs/checkpoints",
          R"([{"path":"step_1","state":"writing","bytes":10,"bytes_published":0,"files":1,
               "created":1699999990,"updated":1699999990,"committed":null,"error":null}])");
  FakeEnv env;
  env.wall = 1700000000;
  std::string out;
  EXPECT_EQ(Admin({"checkpoints", m.mount()}, &env, &out), 0);
  EXPECT_THAT(out, HasSubstr("step_1  writing"));
  EXPECT_THAT(out, HasSubstr("10s"));
  EXPECT_EQ(Admin({"checkpoints", m.mount(), "--json"}, &env, &out), 0);
  EXPECT_THAT(out, StartsWith("[{\"path\":\"step_1\""));
}

TEST(RunAdmin, WaitPassesTimeoutAndInterval) {
  FakeMount m;
  FakeEnv env;
  env.xattrs = {ProgressJson("pending", 10, 1)};
  std::string err;
  EXPECT_EQ(Admin({"wait", m.mount(), "--timeout", "1", "--interval", "250"}, &env, nullptr, &err),
            kExitError);
  EXPECT_EQ(env.sleeps, (std::vector<double>{0.25, 0.25, 0.25, 0.25}));
  EXPECT_THAT(err, HasSubstr("timed out after 1s"));
}

// ---- unmount --------------------------------------------------------------------------

void WriteExitJson(const FakeMount& m, int pid, bool clean, int unpublished,
                   const std::string& error) {
  m.Write("state/exit.json", R"({"pid":)" + std::to_string(pid) + R"(,"clean":)" +
                                 (clean ? "true" : "false") + R"(,"unpublished_files":)" +
                                 std::to_string(unpublished) + R"(,"error":")" + error + R"("})");
}

TEST(WaitForPath, NotOnATerminalPrintsOnePlainLineEveryFewSecondsWithRateAndEta) {
  FakeEnv env;
  // 1 MiB more every poll (0.5 s): 2 MiB/s; 100 MiB total.
  for (uint64_t i = 0; i <= 30; ++i) {
    env.xattrs.push_back(ProgressJson("staged", 100 << 20, i << 20));
  }
  env.xattrs.push_back(ProgressJson("published", 100 << 20, 100 << 20));
  WaitOptions options;
  options.interval_s = 0.5;
  options.plain_every_s = 5;
  std::ostringstream err;
  EXPECT_EQ(WaitForPath(&env, "/m/ckpt", options, err).exit_code, kExitOk);
  const std::string text = err.str();
  EXPECT_EQ(text.find('\r'), std::string::npos);
  // At 5, 10 and 15 s.
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 3) << text;
  EXPECT_THAT(text, HasSubstr("ckptfs-admin: /m/ckpt: 10.0%  10.00 MiB / 100.00 MiB  staged, "
                              "2.00 MiB/s, ETA 45s, waited 5s\n"));
}

TEST(WaitForPath, TheTerminalBarShowsRateAndEtaWhileInProgress) {
  FakeEnv env;
  env.tty = true;
  env.xattrs = {ProgressJson("staged", 4096, 0), ProgressJson("staged", 4096, 1024),
                ProgressJson("staged", 4096, 2048), ProgressJson("published", 4096, 4096)};
  WaitOptions options;
  options.interval_s = 1;
  std::ostringstream err;
  EXPECT_EQ(WaitForPath(&env, "/m/f", options, err).exit_code, kExitOk);
  EXPECT_THAT(err.str(), HasSubstr("1.00 KiB / 4.00 KiB  staged, 1.00 KiB/s, ETA 3s"));
  EXPECT_THAT(err.str(), HasSubstr("4.00 KiB / 4.00 KiB  published\x1b[K\n"));
}

TEST(RateMeter, NeedsHalfASecondThenAveragesOverTenSeconds) {
  RateMeter r;
  EXPECT_EQ(r.Add(0, 0), -1);
  EXPECT_EQ(r.Add(0.25, 100), -1);
  EXPECT_DOUBLE_EQ(r.Add(1, 1000), 1000);
  for (int t = 2; t <= 20; ++t) r.Add(t, static_cast<uint64_t>(t) * 1000);
  EXPECT_DOUBLE_EQ(r.Add(21, 31000), (31000.0 - 11000.0) / 10);  // the last 10 s only
}

TEST(RunWait, CreateTimeoutWaitsForAPathThatAppearsLater) {
  FakeMount m;
  FakeEnv env;
  env.xattrs = {ProgressJson("published", 3, 3)};
  WaitOptions options;
  options.create_timeout_s = 10;
  options.interval_s = 1;
  options.json = true;
  // The file appears after the third sleep.
  int sleeps = 0;
  struct AppearingEnv : FakeEnv {
    std::function<void()> on_sleep;
    void Sleep(double s) override {
      FakeEnv::Sleep(s);
      if (on_sleep) on_sleep();
    }
  } appearing;
  appearing.xattrs = env.xattrs;
  appearing.on_sleep = [&] {
    if (++sleeps == 3) m.Write("mnt/late", "abc");
  };
  std::ostringstream out, err;
  EXPECT_EQ(RunWait(&appearing, m.Path("mnt/late"), options, out, err), kExitOk) << err.str();
  EXPECT_EQ(sleeps, 3);
  auto j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["state"], "published");
  EXPECT_EQ(j["exit_code"], 0);
  EXPECT_DOUBLE_EQ(j["elapsed_s"].get<double>(), 3.0);

  FakeEnv never;
  std::ostringstream out2, err2;
  options.create_timeout_s = 2.5;
  EXPECT_EQ(RunWait(&never, m.Path("mnt/never"), options, out2, err2), kExitError);
  EXPECT_THAT(err2.str(), HasSubstr("did not appear within 2.5s"));
  EXPECT_EQ(nlohmann::json::parse(out2.str())["exit_code"], kExitError);
  EXPECT_TRUE(never.xattr_paths.empty());
  // Without --create-timeout a missing path fails at once.
  FakeEnv once;
  options.create_timeout_s = 0;
  std::ostringstream out3, err3;
  EXPECT_EQ(RunWait(&once, m.Path("mnt/never"), options, out3, err3), kExitError);
  EXPECT_TRUE(once.sleeps.empty());
}

TEST(RunWait, JsonOutcomeOnStdoutForFailureToo) {
  FakeMount m;
  m.Write("mnt/f", "x");
  FakeEnv env;
  env.xattrs = {ProgressJson("failed", 10, 4, "EIO")};
  std::string out, err;
  EXPECT_EQ(Admin({"wait", m.Path("mnt/f"), "--json"}, &env, &out, &err), kExitFailed);
  auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["state"], "failed");
  EXPECT_EQ(j["error"], "EIO");
  EXPECT_EQ(j["bytes_done"], 4);
  EXPECT_EQ(j["exit_code"], kExitFailed);
}

TEST(RunAdmin, VersionExitsZero) {
  FakeEnv env;
  std::string out, err;
  EXPECT_EQ(Admin({"--version"}, &env, &out, &err), kExitOk) << err;
  EXPECT_THAT(out, StartsWith("ckptfs-admin "));
}

TEST(FormatStats, ShowsCheckpointStatesItDoesNotKnowAndIgnoresUnknownFields) {
  auto text = FormatStats(R"({"pid":1,"checkpoints":{"committed":2,"halted":1},
                              "journal_state":"halted","new_counter":5})");
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_THAT(*text, HasSubstr("2 committed"));
  EXPECT_THAT(*text, HasSubstr("1 halted"));
}

TEST(RunUnmount, DrainsUnmountsWaitsForThePidAndChecksTheExitReport) {
  FakeMount m;
  FakeEnv env;
  env.xattrs = {ProgressJson("staged", 10, 5), ProgressJson("published", 10, 10)};
  env.alive_polls = 3;
  // The report appears only once the daemon has been told to go.
  env.on_unmount = [&] { WriteExitJson(m, 4242, true, 0, ""); };
  std::string out, err;
  EXPECT_EQ(Admin({"unmount", m.mount()}, &env, &out, &err), kExitOk) << err;
  EXPECT_EQ(env.xattr_paths, (std::vector<std::string>{m.mount(), m.mount()}));
  EXPECT_EQ(env.unmounted, std::vector<std::string>{m.mount()});
  EXPECT_EQ(env.alive_pids, std::vector<int>(4, 4242));
  EXPECT_THAT(out, HasSubstr("unmounted " + m.mount()));
}

TEST(RunUnmount, JsonReportsTheOutcome) {
  FakeMount m;
  FakeEnv env;
  env.xattrs = {ProgressJson("published", 10, 10)};
  env.on_unmount = [&] { WriteExitJson(m, 4242, false, 2, "EIO on x"); };
  std::string out, err;
  EXPECT_EQ(Admin({"unmount", m.mount(), "--json"}, &env, &out, &err), kExitFailed);
  auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["mountpoint"], m.mount());
  EXPECT_EQ(j["pid"], 4242);
  EXPECT_EQ(j["clean"], false);
  EXPECT_EQ(j["unpublished_files"], 2);
  EXPECT_EQ(j["error"], "EIO on x");
  EXPECT_EQ(j["exit_code"], kExitFailed);
}

TEST(RunUnmount, UnpublishedFilesOrAnUncleanExitExitOne) {
  FakeMount m;
  FakeEnv env;
  env.xattrs = {ProgressJson("published", 0, 0)};
  WriteExitJson(m, 4242, true, 2, "");
  std::string err;
  EXPECT_EQ(Admin({"unmount", m.mount()}, &env, nullptr, &err), kExitFailed);
  EXPECT_THAT(err, HasSubstr("2 files unpublished"));

  WriteExitJson(m, 4242, false, 0, "journal: EIO");
  EXPECT_EQ(Admin({"unmount", m.mount()}, &env, nullptr, &err), kExitFailed);
  EXPECT_THAT(err, HasSubstr("uncleanly: journal: EIO"));
}

TEST(RunUnmount, MissingOrStaleExitReportExitsOne) {
  FakeMount m;
  FakeEnv env;
  env.xattrs = {ProgressJson("published", 0, 0)};
  std::string err;
  EXPECT_EQ(Admin({"unmount", m.mount()}, &env, nullptr, &err), kExitFailed);
  EXPECT_THAT(err, HasSubstr("exited without a report"));

  WriteExitJson(m, 17, true, 0, "");  // From an earlier daemon.
  EXPECT_EQ(Admin({"unmount", m.mount()}, &env, nullptr, &err), kExitFailed);
  EXPECT_THAT(err, HasSubstr("is from pid 17"));
}

TEST(RunUnmount, DrainTimeoutExitsTwoAndLeavesTheMountAlone) {
  FakeMount m;
  FakeEnv env;
  env.xattrs = {ProgressJson("staged", 10, 5)};
  std::string err;
  EXPECT_EQ(Admin({"unmount", m.mount(), "--timeout", "2"}, &env, nullptr, &err), kExitError);
  EXPECT_THAT(err, HasSubstr("timed out after 2s"));
  EXPECT_TRUE(env.unmounted.empty());
}

TEST(RunUnmount, DaemonThatDoesNotExitTimesOutWithExitTwo) {
  FakeMount m;
  FakeEnv env;
  env.xattrs = {ProgressJson("published", 0, 0)};
  env.alive_polls = 1000000;
  std::string err;
  EXPECT_EQ(Admin({"unmount", m.mount(), "--timeout", "1"}, &env, nullptr, &err), kExitError);
  EXPECT_THAT(err, HasSubstr("waiting for daemon pid 4242"));
  EXPECT_EQ(env.unmounted.size(), 1u);
  EXPECT_LE(env.now, 1000.0 + 1.0 + 1e-9);
}

TEST(RunUnmount, FusermountFailureExitsTwo) {
  FakeMount m;
  FakeEnv env;
  env.xattrs = {ProgressJson("published", 0, 0)};
  env.unmount_status = Status(Code::kBusy, "fusermount3 -u x exited with status 1");
  std::string err;
  EXPECT_EQ(Admin({"unmount", m.mount()}, &env, nullptr, &err), kExitError);
  EXPECT_THAT(err, HasSubstr("exited with status 1"));
  EXPECT_TRUE(env.alive_pids.empty());
}

TEST(RunUnmount, FailedDrainStillUnmountsAndTheReportDecides) {
  FakeMount m;
  FakeEnv env;
  env.xattrs = {ProgressJson("failed", 10, 5, "ENOSPC")};
  WriteExitJson(m, 4242, false, 1, "ENOSPC");
  std::string err;
  EXPECT_EQ(Admin({"unmount", m.mount()}, &env, nullptr, &err), kExitFailed);
  EXPECT_THAT(err, HasSubstr("warning"));
  EXPECT_EQ(env.unmounted.size(), 1u);
}

TEST(RunUnmount, AHaltedPublicationIsNamedUnmountedAtOnceAndWhatTheStopLeftIsReported) {
  FakeMount m;
  const std::string halt =
      "halted at publish #993 ckpt/.metadata: timeout: shard ckpt/__3_0.distcp never became "
      "durable (retrying with backoff); 2 more entries queued";
  std::string stats = m.StatsJson(4242);
  stats.insert(stats.rfind('}'), R"(,"journal_waiting":")" + halt +
                                     R"(","journal_halted":{"seq":993,"entry":"publish #993"})");
  m.Write("mnt/.ckptfs/stats", stats);
  FakeEnv env;
  env.xattrs = {ProgressJson("staged", 10, 5)};  // never published by itself
  env.alive_polls = 2;
  env.on_unmount = [&] {
    // The daemon's stop says what it waits for, then leaves the rest (exit 3).
    m.Write("state/stopping.json",
            R"({"pid":4242,"waiting_for":")" + halt + R"(","stop_timeout_s":30})");
    m.Write("state/exit.json",
            R"({"pid":4242,"clean":false,"unpublished_files":0,"left_for_resume":3,)"
            R"("waiting_for":")" + halt + R"(","error":"3 journal entries left"})");
  };
  std::string out, err;
  EXPECT_EQ(Admin({"unmount", m.mount()}, &env, &out, &err), kExitFailed);
  EXPECT_EQ(env.unmounted, std::vector<std::string>{m.mount()}) << "no wait for the drain";
  EXPECT_THAT(err, HasSubstr("publication waits: " + halt));
  EXPECT_THAT(err, HasSubstr("daemon pid 4242 is stopping and waits for: " + halt));
  EXPECT_THAT(err, HasSubstr("3 journal entries left for its next start"));
  EXPECT_LT(env.now, 1000.0 + 5) << "it did not wait for the drain";
}

TEST(RunUnmount, RefusesAPathBelowTheMountpoint) {
  FakeMount m;
  fs::create_directories(m.Path("mnt/sub"));
  FakeEnv env;
  std::string err;
  EXPECT_EQ(Admin({"unmount", m.Path("mnt/sub")}, &env, nullptr, &err), kExitError);
  EXPECT_THAT(err, HasSubstr("not a mountpoint; the ckptfs mount is " + m.mount()));
  EXPECT_TRUE(env.unmounted.empty());
}

// ---- The real environment -------------------------------------------------------------

TEST(SystemEnv, ProcessAliveTreatsZombiesAsGone) {
  AdminEnv* env = SystemEnv();
  EXPECT_TRUE(env->ProcessAlive(::getpid()));
  EXPECT_FALSE(env->ProcessAlive(0));
  EXPECT_FALSE(env->ProcessAlive(-1));
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  // Wait for the exit without reaping, so the child stays a zombie.
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, child, &info, WEXITED | WNOWAIT), 0);
  EXPECT_FALSE(env->ProcessAlive(child));
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  EXPECT_FALSE(env->ProcessAlive(child));
}

TEST(SystemEnv, GetXattrReadsValuesOfAnySize) {
  FakeMount m;
  m.Write("f", "");
  const std::string path = m.Path("f");
  // Larger than the first read buffer where the file system allows it (ext4: one block).
  std::string big(10000, 'v');
  if (::setxattr(path.c_str(), kProgressXattr, big.data(), big.size(), 0) != 0) {
    big.assign(3000, 'v');
    if (::setxattr(path.c_str(), kProgressXattr, big.data(), big.size(), 0) != 0) {
      GTEST_SKIP() << "user xattrs unsupported here: " << std::strerror(errno);
    }
  }
  auto value = SystemEnv()->GetXattr(path, kProgressXattr);
  ASSERT_TRUE(value.ok()) << value.status().ToString();
  EXPECT_EQ(*value, big);
  auto missing = SystemEnv()->GetXattr(path, kStateXattr);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), StartsWith(path + ": getxattr " + kStateXattr));
}

TEST(RunProgram, ReturnsTheExitStatusWithoutAShell) {
  EXPECT_EQ(*RunProgram({"true"}), 0);
  EXPECT_EQ(*RunProgram({"false"}), 1);
  EXPECT_EQ(*RunProgram({"sh", "-c", "exit 7"}), 7);
  EXPECT_EQ(*RunProgram({"/nonexistent/program"}), 127);
  // Arguments reach the program verbatim, with no shell in between.
  EXPECT_EQ(*RunProgram({"sh", "-c", "[ \"$0\" = '* $HOME;' ]", "* $HOME;"}), 0);
  EXPECT_FALSE(RunProgram({}).ok());
}

TEST(FormatPeers, ShowsTheMembershipAndEachPeersState) {
  const char* stats = R"({"peers": {"node_rank": 0,
    "membership": {"epoch": 2, "nodes": ["10.0.0.1:7470", "10.0.0.12:7471", "10.0.0.3:7470"],
                   "updates": 1, "rejected": 1, "last_rejection": "n is listed twice"},
    "peers": [{"node": "10.0.0.12:7471", "connected": true, "last_error": ""},
              {"node": "10.0.0.3:7470", "connected": false, "last_error": "Timeout: x"}]}})";
  auto text = FormatPeers(stats);
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_NE(text->find("membership epoch 2, 1 change(s) taken, 1 refused (last: n is listed "
                       "twice)"),
            std::string::npos)
      << *text;
  EXPECT_NE(text->find("0     10.0.0.1:7470               this node"), std::string::npos) << *text;
  EXPECT_NE(text->find("1     10.0.0.12:7471              connected"), std::string::npos) << *text;
  EXPECT_NE(text->find("not connected: Timeout: x"), std::string::npos) << *text;
  EXPECT_EQ(*FormatPeers("{}"), "peers: off (no --peers)\n");
  EXPECT_FALSE(FormatPeers("[1]").ok());
}

// Fields of the wrong type are shown as missing, never thrown at (control_fuzz found a
// peer whose "node" was not a string end ckptfs-admin with an uncaught type_error).
TEST(FormatPeers, FieldsOfTheWrongTypeNeverThrow) {
  const char* stats = R"({"peers": {"node_rank": "x",
    "membership": {"epoch": "2", "nodes": ["10.0.0.1:7470", 7, "10.0.0.3:7470"],
                   "updates": [], "rejected": {}, "last_rejection": 5},
    "peers": [{"node": 5, "connected": true}, 3,
              {"node": "10.0.0.3:7470", "connected": "yes", "last_error": 1}]}})";
  auto text = FormatPeers(stats);
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_NE(text->find("membership epoch 0, 0 change(s) taken, 0 refused\n"), std::string::npos)
      << *text;
  EXPECT_NE(text->find("1     ?"), std::string::npos) << *text;
  EXPECT_NE(text->find("2     10.0.0.3:7470               not connected"), std::string::npos)
      << *text;
  auto odd = FormatPeers(R"({"peers": {"membership": 3, "peers": {"node": 1}}})");
  ASSERT_TRUE(odd.ok());
  EXPECT_NE(odd->find("membership epoch 0"), std::string::npos) << *odd;
}

}  // namespace
}  // namespace ckptfs::admin
