// Daemon options: ParseSize, ParseDaemonOptions (syntax and bounds, every error is
// kInvalid with a message) and ValidateDaemonOptions (paths: existence, nesting of
// backing dir, mountpoint and state dir, default state dir).
#include "mount/options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

// A scratch directory, removed on destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "ckptfs-options-test.XXXXXX").string();
    path_ = fs::canonical(::mkdtemp(tmpl.data())).string();
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string Dir(const std::string& rel) const {
    fs::create_directories(path_ + "/" + rel);
    return path_ + "/" + rel;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

Result<DaemonOptions> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "ckptfs");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return ParseDaemonOptions(static_cast<int>(argv.size()), argv.data());
}

// ------------------------------------------------------------------------ ParseSize

TEST(ParseSize, AcceptsPlainNumbersAndBinaryUnits) {
  struct Case {
    const char* text;
    uint64_t want;
  };
  const Case cases[] = {
      {"0", 0},
      {"4096", 4096},
      {"10B", 10},
      {"10b", 10},
      {"64K", 64 << 10},
      {"64k", 64 << 10},
      {"64KB", 64 << 10},
      {"64KiB", 64 << 10},
      {"64kib", 64 << 10},
      {"512M", uint64_t{512} << 20},
      {"512MiB", uint64_t{512} << 20},
      {"2G", uint64_t{2} << 30},
      {"2GB", uint64_t{2} << 30},
      {"2GiB", uint64_t{2} << 30},
      {"1T", uint64_t{1} << 40},
      {"1TiB", uint64_t{1} << 40},
      {"16777215T", uint64_t{16777215} << 40},
      {"18446744073709551615", UINT64_MAX},
  };
  for (const auto& c : cases) {
    auto got = ParseSize(c.text);
    ASSERT_TRUE(got.ok()) << c.text << ": " << got.status().ToString();
    EXPECT_EQ(*got, c.want) << c.text;
  }
}

TEST(ParseSize, RejectsMalformedSizesAsInvalid) {
  // clang-format off
  for (const char* text :
       {"", "K", "G2", "-1", "+5", " 5", "5 ", "1.5G", "12X", "0x10", "5KK", "5 K", "5iB",
        "5KiBB", "1e3", "99999999999999999999999", "18446744073709551616", "16777216T",
        "18446744073709551615K", "17179869184G"}) {
    // clang-format on
    auto got = ParseSize(text);
    EXPECT_FALSE(got.ok()) << "'" << text << "' parsed as " << (got.ok() ? *got : 0);
    if (!got.ok()) {
      EXPECT_EQ(got.status().code(), Code::kInvalid) << text;
      EXPECT_FALSE(got.status().message().empty());
    }
  }
}

// DISABLED: exposes a (minor) real bug, see the report. ParseSize strips a trailing "B"
// or "IB" from any unit, so "B" itself loses its "B" first and "2BB" / "2BiB" are read
// as 2 bytes.
TEST(ParseSize, RejectsADoubledByteSuffix) {
  for (const char* text : {"2BB", "2BiB", "2bib"}) {
    EXPECT_FALSE(ParseSize(text).ok()) << text;
  }
}

// ---------------------------------------------------------------- ParseDaemonOptions

TEST(ParseDaemonOptions, TwoPositionalsAndDefaults) {
  auto o = Parse({"/backing", "/mnt"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->backing_dir, "/backing");
  EXPECT_EQ(o->mountpoint, "/mnt");
  EXPECT_TRUE(o->state_dir.empty());
  EXPECT_FALSE(o->foreground);
  EXPECT_FALSE(o->strict);
  EXPECT_EQ(o->staging_bytes, uint64_t{1} << 30);
  EXPECT_EQ(o->chunk_bytes, uint64_t{4} << 20);
  EXPECT_EQ(o->flush_threads, 2);
  EXPECT_EQ(o->fuse_threads, 32);
  EXPECT_EQ(o->commit_timeout_s, 600);
  EXPECT_EQ(o->stop_timeout_s, 30);
  EXPECT_EQ(o->staging_backend, "auto");
  EXPECT_TRUE(o->write_checksums);
  EXPECT_EQ(o->log_level, "info");
  EXPECT_TRUE(o->log_file.empty());
  EXPECT_TRUE(o->fuse_options.empty());
  EXPECT_FALSE(o->help);
}

TEST(ParseDaemonOptions, RetainMemDefaultsToHalfOfStagingAndTakesZero) {
  auto o = Parse({"/backing", "/mnt", "--staging-mem", "2G"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->retain_bytes, uint64_t{1} << 30);
  EXPECT_EQ(o->retain_replicas, -1);  // decided with --peers
  o = Parse({"/backing", "/mnt", "--retain-mem", "0", "--retain-replicas", "0"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->retain_bytes, 0u);
  EXPECT_EQ(o->retain_replicas, 0);
  EXPECT_FALSE(Parse({"/backing", "/mnt", "--retain-replicas", "2"}).ok());
  EXPECT_FALSE(Parse({"/backing", "/mnt", "--retain-mem", "lots"}).ok());
}

TEST(ParseDaemonOptions, StopTimeoutAsAnOptionAndAsDashO) {
  auto o = Parse({"--stop-timeout", "5", "/b", "/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->stop_timeout_s, 5);
  o = Parse({"-o", "stop_timeout=7", "/b", "/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->stop_timeout_s, 7);
}

TEST(ParseDaemonOptions, EveryOptionIsParsed) {
  // clang-format off
  auto o = Parse({"-f", "--durability", "strict", "--staging-mem", "2G", "--chunk-size=1M",
                  "--flush-threads", "8", "--fuse-threads", "64", "--commit-timeout", "30",
                  "--staging-backend", "host", "--write-checksums=off", "--state-dir",
                  "/var/tmp/s", "--log-level", "debug", "--log-file", "/tmp/l.log", "-o", "allow_other,ro", "-o",
                  "default_permissions", "/b", "/m"});
  // clang-format on
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->foreground);
  EXPECT_TRUE(o->strict);
  EXPECT_EQ(o->staging_bytes, uint64_t{2} << 30);
  EXPECT_EQ(o->chunk_bytes, uint64_t{1} << 20);
  EXPECT_EQ(o->flush_threads, 8);
  EXPECT_EQ(o->fuse_threads, 64);
  EXPECT_EQ(o->commit_timeout_s, 30);
  EXPECT_EQ(o->staging_backend, "host");
  EXPECT_FALSE(o->write_checksums);
  EXPECT_EQ(o->state_dir, "/var/tmp/s");
  EXPECT_EQ(o->log_level, "debug");
  EXPECT_EQ(o->log_file, "/tmp/l.log");
  EXPECT_EQ(o->fuse_options,
            (std::vector<std::string>{"allow_other", "ro", "default_permissions"}));
  EXPECT_EQ(o->backing_dir, "/b");
  EXPECT_EQ(o->mountpoint, "/m");
}

TEST(ParseDaemonOptions, DirectWritesDefaultToAutoAndTakeOnOffAsFlagOrDashO) {
  auto o = Parse({"/b", "/m"});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->fuse_direct_writes, "auto");
  o = Parse({"--fuse-direct-writes", "off", "/b", "/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->fuse_direct_writes, "off");
  o = Parse({"-o", "fuse_direct_writes=on", "/b", "/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->fuse_direct_writes, "on");
}

TEST(ParseDaemonOptions, FuseUringDefaultsToAutoAndTakesOnOffAsFlagOrDashO) {
  auto o = Parse({"/b", "/m"});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->fuse_uring, "auto");
  o = Parse({"--fuse-uring", "off", "/b", "/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->fuse_uring, "off");
  o = Parse({"-o", "fuse_uring=on", "/b", "/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->fuse_uring, "on");
}

TEST(ParseDaemonOptions, StagingReleaseAfterDefaultsToKeepingItPinnedAndTakesSeconds) {
  auto o = Parse({"/b", "/m"});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->staging_release_after_s, 0);
  o = Parse({"--staging-release-after", "30", "/b", "/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->staging_release_after_s, 30);
  o = Parse({"-o", "staging_release_after=5", "/b", "/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->staging_release_after_s, 5);
  for (const char* bad : {"-1", "soon", "86401"}) {
    EXPECT_EQ(Parse({"--staging-release-after", bad, "/b", "/m"}).status().code(), Code::kInvalid)
        << bad;
  }
}

TEST(ParseDaemonOptions, AsyncDurabilityIsNotStrict) {
  auto o = Parse({"--durability", "async", "/b", "/m"});
  ASSERT_TRUE(o.ok());
  EXPECT_FALSE(o->strict);
}

TEST(ParseDaemonOptions, HelpIsNotAnError) {
  auto o = Parse({"--help"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->help);
  EXPECT_NE(o->help_text.find("--durability"), std::string::npos) << o->help_text;
  EXPECT_NE(o->help_text.find("--staging-mem"), std::string::npos);
}

TEST(ParseDaemonOptions, ChunkSizeBoundsAndAlignment) {
  for (const char* ok : {"64K", "68K", "1M", "256M"}) {
    auto o = Parse({"--chunk-size", ok, "--staging-mem", "1G", "/b", "/m"});
    EXPECT_TRUE(o.ok()) << ok << ": " << o.status().ToString();
  }
  for (const char* bad : {"0", "4K", "60K", "65537", "66K", "257M", "512M", "1G"}) {
    auto o = Parse({"--chunk-size", bad, "--staging-mem", "2G", "/b", "/m"});
    EXPECT_EQ(o.status().code(), Code::kInvalid) << bad;
  }
}

TEST(ParseDaemonOptions, EveryBadInputIsInvalidWithAMessage) {
  const std::vector<std::vector<std::string>> bad = {
      {},                       // nothing
      {"/b"},                   // missing mountpoint
      {"/b", "/m", "/extra"},   // one positional too many
      {"--bogus", "/b", "/m"},  // unknown option
      {"--durability", "sometimes", "/b", "/m"},
      {"--durability", "/b", "/m"},  // value missing, then one positional
      {"--staging-mem", "lots", "/b", "/m"},
      {"--staging-mem", "1M", "--chunk-size", "4M", "/b", "/m"},  // less than one chunk
      {"--chunk-size", "4X", "/b", "/m"},
      {"--flush-threads", "0", "/b", "/m"},
      {"--flush-threads", "257", "/b", "/m"},
      {"--flush-threads", "two", "/b", "/m"},
      {"--fuse-threads", "1", "/b", "/m"},
      {"--commit-timeout", "0", "/b", "/m"},
      {"--stop-timeout", "0", "/b", "/m"},
      {"--stop-timeout", "soon", "/b", "/m"},
      {"--staging-backend", "gpu", "/b", "/m"},
      {"--write-checksums", "maybe", "/b", "/m"},
      {"--fuse-direct-writes", "sometimes", "/b", "/m"},
      {"--fuse-uring", "yes", "/b", "/m"},
      {"--log-level", "verbose", "/b", "/m"},
  };
  for (const auto& args : bad) {
    std::string joined;
    for (const auto& a : args) joined += a + " ";
    auto o = Parse(args);
    EXPECT_FALSE(o.ok()) << "accepted: " << joined;
    if (!o.ok()) {
      EXPECT_EQ(o.status().code(), Code::kInvalid) << joined << o.status().ToString();
      EXPECT_FALSE(o.status().message().empty()) << joined;
    }
  }
}

// ------------------------------------------------------- -o key=value and mount helper

TEST(ParseDaemonOptions, CkptfsOptionsAreAcceptedAsDashO) {
  auto o = Parse({"-o", "durability=strict,staging_mem=8G,chunk-size=1M,state_dir=/var/tmp/s",
                  "-oflush_threads=4,foreground,allow_other", "/b", "/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->strict);
  EXPECT_EQ(o->staging_bytes, uint64_t{8} << 30);
  EXPECT_EQ(o->chunk_bytes, uint64_t{1} << 20);
  EXPECT_EQ(o->state_dir, "/var/tmp/s");
  EXPECT_EQ(o->flush_threads, 4);
  EXPECT_TRUE(o->foreground);
  EXPECT_EQ(o->fuse_options, std::vector<std::string>{"allow_other"});
}

TEST(ParseDaemonOptions, MountOnlyOptionsAreDroppedAndTheRestGoToFuse) {
  auto o = Parse({"-o",
                  "rw,_netdev,nofail,noauto,auto,user,users,defaults,x-systemd.requires=a.mount,"
                  "x-systemd.automount,comment=x,nosuid,default_permissions",
                  "/b", "/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->fuse_options,
            (std::vector<std::string>{"rw", "nosuid", "default_permissions"}));
}

TEST(ParseDaemonOptions, BadDashOValuesAreInvalidLikeLongOptions) {
  for (const char* bad : {"durability=sometimes", "staging_mem=lots", "flush_threads=0",
                          "metrics_listen=nocolon", "metrics_listen=127.0.0.1:0",
                          "metrics_listen=127.0.0.1:70000"}) {
    auto o = Parse({"-o", bad, "/b", "/m"});
    EXPECT_EQ(o.status().code(), Code::kInvalid) << bad;
  }
  EXPECT_EQ(Parse({"/b", "/m", "-o"}).status().code(), Code::kInvalid);
}

TEST(ParseDaemonOptions, MetricsListenIsSplitIntoHostAndPort) {
  struct Case {
    const char* text;
    const char* host;
    int port;
  };
  for (const Case& c : {Case{"127.0.0.1:9464", "127.0.0.1", 9464},
                        Case{":9100", "0.0.0.0", 9100}, Case{"[::1]:80", "::1", 80}}) {
    auto o = Parse({"--metrics-listen", c.text, "/b", "/m"});
    ASSERT_TRUE(o.ok()) << c.text << ": " << o.status().ToString();
    EXPECT_EQ(o->metrics_host, c.host);
    EXPECT_EQ(o->metrics_port, c.port);
  }
}

TEST(ParseDaemonOptions, VersionPrintsTheProjectVersion) {
  auto o = Parse({"--version"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->version);
  EXPECT_THAT(o->help_text, ::testing::MatchesRegex("ckptfs [0-9]+\\.[0-9]+\\.[0-9]+ \\(git .+\\)\n"));
}

Result<DaemonOptions> ParseHelper(std::vector<std::string> args) {
  args.insert(args.begin(), "/sbin/mount.fuse.ckptfs");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return ParseMountHelperArgs(static_cast<int>(argv.size()), argv.data());
}

TEST(ParseMountHelperArgs, TakesMountsArgvAndRunsInTheBackground) {
  EXPECT_TRUE(IsMountHelperName("/sbin/mount.fuse.ckptfs"));
  EXPECT_TRUE(IsMountHelperName("mount.ckptfs"));
  EXPECT_FALSE(IsMountHelperName("/usr/bin/ckptfs"));
  auto o = ParseHelper({"/lustre/ckpt", "/mnt/ckpt", "-n", "-v", "-o",
                        "rw,_netdev,durability=async,staging_mem=8G,foreground", "-t",
                        "fuse.ckptfs"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->backing_dir, "/lustre/ckpt");
  EXPECT_EQ(o->mountpoint, "/mnt/ckpt");
  EXPECT_EQ(o->staging_bytes, uint64_t{8} << 30);
  EXPECT_FALSE(o->foreground);  // mount(8) waits for its helper
  EXPECT_FALSE(o->fake);
  EXPECT_EQ(o->fuse_options, std::vector<std::string>{"rw"});
  auto fake = ParseHelper({"/b", "/m", "-f"});
  ASSERT_TRUE(fake.ok());
  EXPECT_TRUE(fake->fake);
}

TEST(ParseMountHelperArgs, BadArgvIsInvalid) {
  EXPECT_EQ(ParseHelper({"/b"}).status().code(), Code::kInvalid);
  EXPECT_EQ(ParseHelper({"/b", "/m", "-o"}).status().code(), Code::kInvalid);
  EXPECT_EQ(ParseHelper({"/b", "/m", "--bogus"}).status().code(), Code::kInvalid);
  EXPECT_EQ(ParseHelper({"/b", "/m", "-o", "durability=x"}).status().code(), Code::kInvalid);
}

// -------------------------------------------------------------- ValidateDaemonOptions

class ValidateOptions : public ::testing::Test {
 protected:
  DaemonOptions Options(const std::string& backing, const std::string& mnt) {
    DaemonOptions o;
    o.backing_dir = backing;
    o.mountpoint = mnt;
    return o;
  }
  TempDir tmp_;
};

TEST_F(ValidateOptions, CanonicalizesPathsAndFillsTheDefaultStateDir) {
  const std::string backing = tmp_.Dir("backing"), mnt = tmp_.Dir("mnt");
  fs::create_symlink(backing, tmp_.path() + "/backing-link");
  DaemonOptions o = Options(tmp_.path() + "/backing-link", tmp_.path() + "/x/../mnt");
  tmp_.Dir("x");
  ASSERT_TRUE(ValidateDaemonOptions(&o).ok());
  EXPECT_EQ(o.backing_dir, backing);
  EXPECT_EQ(o.mountpoint, mnt);
  std::string name = mnt;
  for (auto& c : name) {
    if (c == '/') c = '_';
  }
  EXPECT_EQ(o.state_dir, "/var/tmp/ckptfs/state" + name);
  EXPECT_TRUE(fs::path(o.state_dir).is_absolute());
}

TEST_F(ValidateOptions, KeepsAnExplicitStateDirAndMakesItAbsolute) {
  DaemonOptions o = Options(tmp_.Dir("backing"), tmp_.Dir("mnt"));
  o.state_dir = tmp_.path() + "/state/../state2";
  ASSERT_TRUE(ValidateDaemonOptions(&o).ok());
  EXPECT_EQ(o.state_dir, tmp_.path() + "/state2");
}

TEST_F(ValidateOptions, AMissingBackingDirOrMountpointIsAnError) {
  DaemonOptions a = Options(tmp_.path() + "/missing", tmp_.Dir("mnt"));
  Status st = ValidateDaemonOptions(&a);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("backing"), std::string::npos) << st.ToString();
  DaemonOptions b = Options(tmp_.Dir("backing"), tmp_.path() + "/missing-mnt");
  st = ValidateDaemonOptions(&b);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("mountpoint"), std::string::npos) << st.ToString();
}

TEST_F(ValidateOptions, PathsThatAreNotDirectoriesAreRefused) {
  std::ofstream(tmp_.path() + "/file") << "x";
  DaemonOptions a = Options(tmp_.path() + "/file", tmp_.Dir("mnt"));
  EXPECT_EQ(ValidateDaemonOptions(&a).code(), Code::kNotDir);
  DaemonOptions b = Options(tmp_.Dir("backing"), tmp_.path() + "/file");
  EXPECT_EQ(ValidateDaemonOptions(&b).code(), Code::kNotDir);
}

TEST_F(ValidateOptions, BackingDirAndMountpointMustNotContainEachOther) {
  const std::string backing = tmp_.Dir("backing");
  DaemonOptions inside = Options(backing, tmp_.Dir("backing/mnt"));
  EXPECT_EQ(ValidateDaemonOptions(&inside).code(), Code::kInvalid);
  DaemonOptions around = Options(tmp_.Dir("m2/backing"), tmp_.path() + "/m2");
  EXPECT_EQ(ValidateDaemonOptions(&around).code(), Code::kInvalid);
  DaemonOptions same = Options(backing, backing);
  EXPECT_EQ(ValidateDaemonOptions(&same).code(), Code::kInvalid);
  // A shared name prefix is not nesting.
  DaemonOptions sibling = Options(backing, tmp_.Dir("backing2"));
  EXPECT_TRUE(ValidateDaemonOptions(&sibling).ok());
}

TEST_F(ValidateOptions, TheStateDirMustBeOutsideTheMountAndTheBackingDir) {
  const std::string backing = tmp_.Dir("backing"), mnt = tmp_.Dir("mnt");
  DaemonOptions in_mount = Options(backing, mnt);
  in_mount.state_dir = mnt + "/state";
  EXPECT_EQ(ValidateDaemonOptions(&in_mount).code(), Code::kInvalid);
  DaemonOptions is_mount = Options(backing, mnt);
  is_mount.state_dir = mnt;
  EXPECT_EQ(ValidateDaemonOptions(&is_mount).code(), Code::kInvalid);
  DaemonOptions via_link = Options(backing, mnt);
  fs::create_symlink(mnt, tmp_.path() + "/mnt-link");
  via_link.state_dir = tmp_.path() + "/mnt-link/state";
  EXPECT_EQ(ValidateDaemonOptions(&via_link).code(), Code::kInvalid);
  DaemonOptions in_backing = Options(backing, mnt);
  in_backing.state_dir = backing + "/.state";
  EXPECT_EQ(ValidateDaemonOptions(&in_backing).code(), Code::kInvalid);
}

TEST_F(ValidateOptions, TheLogFileMustBeOutsideTheMount) {
  const std::string mnt = tmp_.Dir("mnt");
  DaemonOptions o = Options(tmp_.Dir("backing"), mnt);
  o.state_dir = tmp_.path() + "/state";
  o.log_file = mnt + "/ckptfs.log";
  EXPECT_EQ(ValidateDaemonOptions(&o).code(), Code::kInvalid);
}

// DISABLED: exposes a (minor) real bug, see the report. The state dir is resolved with
// weakly_canonical, so a symlink into the mount is caught; the log file is only made
// lexically normal, so a path through a symlink to the mountpoint passes, and the
// daemon would then log into its own mount (G9; a FUSE daemon writing to itself can
// deadlock).
TEST_F(ValidateOptions, TheLogFileMustBeOutsideTheMountEvenThroughASymlink) {
  const std::string mnt = tmp_.Dir("mnt");
  fs::create_symlink(mnt, tmp_.path() + "/mnt-link");
  DaemonOptions o = Options(tmp_.Dir("backing"), mnt);
  o.state_dir = tmp_.path() + "/state";
  o.log_file = tmp_.path() + "/mnt-link/ckptfs.log";
  EXPECT_EQ(ValidateDaemonOptions(&o).code(), Code::kInvalid);
}

TEST_F(ValidateOptions, AMountpointThatIsAlreadyMountedIsBusy) {
  ASSERT_TRUE(IsMountPoint("/proc"));
  EXPECT_FALSE(IsMountPoint(tmp_.Dir("mnt")));
  DaemonOptions o = Options(tmp_.Dir("backing"), "/proc");
  EXPECT_EQ(ValidateDaemonOptions(&o).code(), Code::kBusy);
}

// ------------------------------------------------------------------ peers (issue 12)

TEST(PeerOptions, PeersListPlanAndTimeoutAreParsed) {
  auto o = Parse({"--peers", "n1:7000, n2:7000,[fe80::1]:7001", "--node-rank", "1",
                  "--peer-secret-file", "/s", "--plan", "fast", "--peer-timeout", "250", "/b",
                  "/m"});
  ASSERT_TRUE(o.ok()) << o.status().message();
  EXPECT_EQ(o->peers, (std::vector<std::string>{"n1:7000", "n2:7000", "[fe80::1]:7001"}));
  EXPECT_EQ(o->node_rank, 1);
  EXPECT_EQ(o->plan, "fast");
  EXPECT_EQ(o->peer_timeout_ms, 250);
  auto d = Parse({"/b", "/m"});
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->peers.empty());
  EXPECT_EQ(d->node_rank, -1);
}

TEST(PeerOptions, PlanComesFromTheEnvironmentUnlessGiven) {
  ::setenv("CKPTFS_PLAN", "balanced", 1);
  auto o = Parse({"/b", "/m"});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->plan, "balanced");
  auto flag = Parse({"--plan", "fast", "/b", "/m"});
  ASSERT_TRUE(flag.ok());
  EXPECT_EQ(flag->plan, "fast");
  ::setenv("CKPTFS_PLAN", "quick", 1);
  auto bad = Parse({"/b", "/m"});
  ::unsetenv("CKPTFS_PLAN");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), ::testing::HasSubstr("CKPTFS_PLAN=quick"));
}

TEST(PeerOptions, BadPeerListsAreInvalidWithAMessage) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--peers", "a:1,a:1"}, "listed twice"},
      {{"--peers", "a"}, "want HOST:PORT"},
      {{"--peers", "a:0"}, "bad port"},
      {{"--peers", "a:70000"}, "bad port"},
      {{"--peers", "fe80::1:7000"}, "[ADDR]:PORT"},
      {{"--peers", " , "}, "empty peer list"},
      {{"--peers", "a:1", "--peers-file", "/f"}, "not both"},
      {{"--node-rank", "0"}, "need --peers"},
      {{"--peer-secret-file", "/s"}, "need --peers"},
  };
  for (const auto& [args, want] : cases) {
    std::vector<std::string> full = args;
    full.push_back("/b");
    full.push_back("/m");
    auto o = Parse(full);
    ASSERT_FALSE(o.ok()) << args[0] << " " << args[1];
    EXPECT_EQ(o.status().code(), Code::kInvalid);
    EXPECT_THAT(o.status().message(), ::testing::HasSubstr(want)) << args[1];
  }
}

TEST(PeerOptions, PeersFileSkipsCommentsAndBlankLines) {
  auto p = ParsePeersText("# from scontrol show hostnames\nnode1:7470\n\n  node2:7470  # two\n");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, (std::vector<std::string>{"node1:7470", "node2:7470"}));
  EXPECT_FALSE(ParsePeersText("# nothing\n\n").ok());
}

TEST_F(ValidateOptions, PeersFileNodeRankListenAndSecretAreChecked) {
  const std::string backing = tmp_.Dir("backing"), mnt = tmp_.Dir("mnt");
  const std::string file = tmp_.path() + "/peers";
  std::ofstream(file) << "10.9.9.1:7470\n10.9.9.2:7471\n";
  DaemonOptions o = Options(backing, mnt);
  o.peers_file = file;
  o.node_rank = 1;
  o.peer_secret_file = "/s";
  ASSERT_TRUE(ValidateDaemonOptions(&o).ok());
  EXPECT_EQ(o.peers, (std::vector<std::string>{"10.9.9.1:7470", "10.9.9.2:7471"}));
  EXPECT_EQ(o.peer_listen, "0.0.0.0:7471");  // this node's port

  DaemonOptions rank = Options(backing, mnt);
  rank.peers_file = file;
  rank.node_rank = 2;
  rank.peer_secret_file = "/s";
  auto st = ValidateDaemonOptions(&rank);
  EXPECT_THAT(st.message(), ::testing::HasSubstr("out of range"));

  DaemonOptions nosecret = Options(backing, mnt);
  nosecret.peers_file = file;
  nosecret.node_rank = 0;
  EXPECT_THAT(ValidateDaemonOptions(&nosecret).message(),
              ::testing::HasSubstr("--peer-secret-file"));

  DaemonOptions missing = Options(backing, mnt);
  missing.peers_file = tmp_.path() + "/absent";
  EXPECT_THAT(ValidateDaemonOptions(&missing).message(), ::testing::HasSubstr("--peers-file"));

  // No entry names this host: the default node rank cannot be found.
  DaemonOptions unknown = Options(backing, mnt);
  unknown.peers = {"10.9.9.1:7470", "10.9.9.2:7470"};
  unknown.peer_secret_file = "/s";
  EXPECT_THAT(ValidateDaemonOptions(&unknown).message(), ::testing::HasSubstr("--node-rank"));
}

TEST(PeerOptions, OwnIndexIsTheEntryNamingALocalAddress) {
  auto own = FindOwnPeerIndex({"10.9.9.1:7470", "127.0.0.1:7470", "10.9.9.3:7470"});
  ASSERT_TRUE(own.ok()) << own.status().message();
  EXPECT_EQ(*own, 1);
  auto twice = FindOwnPeerIndex({"127.0.0.1:7470", "127.0.0.1:7471"});
  ASSERT_FALSE(twice.ok());
  EXPECT_THAT(twice.status().message(), ::testing::HasSubstr("several"));
}

}  // namespace
}  // namespace ckptfs
