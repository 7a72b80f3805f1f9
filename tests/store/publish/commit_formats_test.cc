// The checkpoint formats besides one DCP `.metadata` (issue 22): a no-collectives DCP save
// (every rank's own `__{rank}.metadata`) and Hugging Face safetensors (an
// `*.safetensors.index.json` naming its shards, or a single `model.safetensors`). Their
// commit files are gated like `.metadata` (G5), and a malformed one commits by order.
// Fixture: journal_fixture.h (a real backing dir, journal and pipeline).
#include "store/dcp/commit_names.h"
#include "store/safetensors_index.h"

#include "store/publish/checkpoints.h"
#include "tests/store/publish/journal_fixture.h"

#include "store/dcp/dcp_metadata.h"

namespace ckptfs::store {
namespace {

using namespace std::chrono_literals;

const fs::path kFixture =
    fs::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp/torch113_4rank_single_file";

// ---------------------------------------------------------------------- names

TEST(CommitNames, EachFormatsCommitFileIsACommitAndNothingElseIs) {
  EXPECT_EQ(CommitKindOf("ck/.metadata"), CommitKind::kDcp);
  EXPECT_EQ(CommitKindOf("ck/__0.metadata"), CommitKind::kDcpRank);
  EXPECT_EQ(CommitKindOf("__17.metadata"), CommitKind::kDcpRank);
  EXPECT_EQ(CommitKindOf("a/b/model.safetensors.index.json"), CommitKind::kSafetensorsIndex);
  EXPECT_EQ(CommitKindOf("diffusion_pytorch_model.safetensors.index.json"),
            CommitKind::kSafetensorsIndex);
  EXPECT_EQ(CommitKindOf("ck/model.safetensors"), CommitKind::kSafetensorsSingle);
  for (const char* name :
       {"ck/__0.metadata.tmp", "ck/__.metadata", "ck/__x.metadata", "ck/_0.metadata",
        "ck/x__0.metadata", "ck/__0_0.distcp", "ck/model-00001-of-00002.safetensors",
        "ck/adapter_model.safetensors", "ck/.safetensors.index.json", "ck/index.json",
        "model.safetensors/x", ""}) {
    EXPECT_EQ(CommitKindOf(name), CommitKind::kNone) << name;
    EXPECT_FALSE(IsCommitName(name)) << name;
  }
  EXPECT_TRUE(IsCommitName("ck/__3.metadata"));
  EXPECT_TRUE(IsCommitName("ck/model.safetensors.index.json"));
}

TEST(CommitNames, ShardsAndTempNamesOfEachFormatMakeADirectoryACheckpoint) {
  for (const char* name :
       {"__0.metadata", "__0.metadata.tmp", "__12_3.distcp", "model.safetensors.index.json",
        "model.safetensors", "model-00001-of-00004.safetensors",
        "shard-00000-model-00001-of-00001.safetensors"}) {
    EXPECT_TRUE(CheckpointRegistry::IsCheckpointFile(name)) << name;
  }
  for (const char* name : {"adapter_model.safetensors", "x.safetensors", "model-1-of.safetensors",
                           "model-00001-of-x.safetensors", "config.json", "__x.metadata.tmp"}) {
    EXPECT_FALSE(CheckpointRegistry::IsCheckpointFile(name)) << name;
  }
}

// ---------------------------------------------------------------------- the index

TEST(SafetensorsIndex, NamesEachShardOnce) {
  auto files = ParseSafetensorsIndex(R"({"metadata": {"total_size": 96},
      "weight_map": {"a": "model-00002-of-00002.safetensors",
                     "b": "model-00001-of-00002.safetensors",
                     "c": "model-00002-of-00002.safetensors"}})");
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  EXPECT_EQ(*files, (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                              "model-00002-of-00002.safetensors"}));
  auto empty = ParseSafetensorsIndex(R"({"weight_map": {}})");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

TEST(SafetensorsIndex, MalformedInputIsAClearErrorNeverACrash) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  for (const std::string& bad :
       {std::string(""), std::string("{"), std::string("[]"), std::string("\"x\""),
        std::string(R"({"metadata": {}})"), std::string(R"({"weight_map": []})"),
        std::string(R"({"weight_map": {"a": 1}})"), std::string(R"({"weight_map": {"a": ""}})"),
        std::string(R"({"weight_map": {"a": "../../etc/passwd"}})"),
        std::string(R"({"weight_map": {"a": "sub/x.safetensors"}})"),
        std::string(R"({"weight_map": {"a": ".."}})"),
        std::string("{\"weight_map\": {\"a\": \"x\\u0000y\"}}"), std::string("\xff\xfe"),
        std::string(R"({"weight_map": {"a": "x"}} trailing)"), deep}) {
    auto r = ParseSafetensorsIndex(bad);
    ASSERT_FALSE(r.ok()) << bad.substr(0, 80);
    EXPECT_EQ(r.status().code(), Code::kCorrupt);
    EXPECT_NE(r.status().ToString().find("safetensors index"), std::string::npos);
  }
}

// ---------------------------------------------------------------------- the gate

// A safetensors shard: u64 little-endian header length, the JSON header, the data.
std::string Safetensors(const std::string& data) {
  std::string header = R"({"t":{"dtype":"U8","shape":[)" + std::to_string(data.size()) +
                       R"(],"data_offsets":[0,)" + std::to_string(data.size()) + "]}}";
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

const char kIndex[] = R"({"metadata": {"total_size": 2},
    "weight_map": {"x": "model-00001-of-00002.safetensors",
                   "y": "model-00002-of-00002.safetensors"}})";

CommitGateOptions GateOptions() {
  CommitGateOptions options;
  options.timeout = std::chrono::seconds(30);
  return options;
}

TestHooks GatedHooks(CommitGate* gate, std::function<void(const JournalEntry&)> done = {}) {
  TestHooks hooks;
  hooks.commit_gate = [gate](const JournalEntry& e, const QueuedFn& queued) {
    const QueuedIf q(queued);
    return gate->Check(e, &q);
  };
  hooks.on_done = [gate, done](const JournalEntry& e, const Status& st) {
    gate->NoteApplied(e, st);
    if (done) done(e);
  };
  return hooks;
}

// `cp -r` order: the index sorts first. It must never be on the backing store while a
// shard it names is not there in full (what a crash at any instant would show), and a
// tracker written after it follows it.
TEST_F(JournalTest, ASafetensorsIndexWrittenBeforeItsShardsNeverReachesTheBackingStoreAheadOfThem) {
  CommitGate gate(dir_.get(), GateOptions());
  std::mutex mu;
  std::vector<std::string> order;
  std::vector<std::string> violations;
  const std::string s1 = Safetensors(std::string(50000, 'a'));
  const std::string s2 = Safetensors(std::string(70000, 'b'));
  MakeJournal(GatedHooks(&gate, [&](const JournalEntry& e) {
    std::lock_guard lock(mu);
    order.push_back(e.path);
    if (Exists("ck/model.safetensors.index.json") &&
        (Read("ck/model-00001-of-00002.safetensors") != s1 ||
         Read("ck/model-00002-of-00002.safetensors") != s2)) {
      violations.push_back("after " + e.path);
    }
  }));
  ASSERT_TRUE(journal_->Wait(Op(OpType::kMkdir, "ck")).ok());
  TempFile index = StartFile("ck"), a = StartFile("ck"), b = StartFile("ck"), t = StartFile("");
  Write(&index, kIndex);
  Write(&a, s1, 4096);
  Write(&b, s2, 4096);
  Write(&t, "ck");
  const uint64_t commit = Publish(index, "ck/model.safetensors.index.json");
  const uint64_t tracker = Publish(t, "latest.txt");
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(Exists("ck/model.safetensors.index.json"));
  EXPECT_FALSE(Exists("latest.txt"));
  const uint64_t sa = Publish(a, "ck/model-00001-of-00002.safetensors");
  ASSERT_TRUE(journal_->Wait(sa).ok()) << "a shard goes ahead of its waiting index";
  EXPECT_FALSE(Exists("ck/model.safetensors.index.json")) << "published before its last shard";
  EXPECT_FALSE(Exists("latest.txt"));
  const uint64_t sb = Publish(b, "ck/model-00002-of-00002.safetensors");
  ASSERT_TRUE(journal_->Wait(commit).ok());
  ASSERT_TRUE(journal_->Wait(tracker).ok());
  ASSERT_TRUE(journal_->Wait(sb).ok());
  EXPECT_EQ(Read("ck/model.safetensors.index.json"), kIndex);
  std::lock_guard lock(mu);
  EXPECT_TRUE(violations.empty()) << violations.front();
  EXPECT_EQ(order, (std::vector<std::string>{"ck", "ck/model-00001-of-00002.safetensors",
                                             "ck/model-00002-of-00002.safetensors",
                                             "ck/model.safetensors.index.json", "latest.txt"}));
}

// A gate entry for `path`, renamed from (or published out of) `from`.
JournalEntry CommitEntry(const std::string& path, const std::string& from, uint64_t seq = 9) {
  JournalEntry e;
  e.seq = seq;
  e.op = OpType::kRename;
  e.path = path;
  e.from = from;
  return e;
}

class CommitFormatsGateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = tmp_.Sub("root");
    fs::create_directories(root_ + "/ck");
    dir_ = FaultyBackingDir::Open(root_);
    ASSERT_NE(dir_, nullptr);
  }
  void Put(const std::string& rel, const std::string& bytes) {
    std::ofstream(root_ + "/" + rel, std::ios::binary) << bytes;
  }
  ScopedTempDir tmp_{"ckptfs-formats-test"};
  std::string root_;
  std::unique_ptr<FaultyBackingDir> dir_;
};

TEST_F(CommitFormatsGateTest, AnIndexWaitsForEveryShardItNamesOnTheBackingStore) {
  CommitGate gate(dir_.get(), GateOptions());
  Put("ck/index.tmp", kIndex);
  const JournalEntry e = CommitEntry("ck/model.safetensors.index.json", "ck/index.tmp");
  CommitCheck c = gate.Check(e, nullptr);
  ASSERT_TRUE(c.status.ok()) << c.status.ToString();
  EXPECT_FALSE(c.ready);
  EXPECT_EQ(c.shards, (std::vector<std::string>{"ck/model-00001-of-00002.safetensors",
                                                "ck/model-00002-of-00002.safetensors"}));
  EXPECT_TRUE(c.waits_for_unwritten);
  Put("ck/model-00001-of-00002.safetensors", Safetensors("x"));
  Put("ck/model-00002-of-00002.safetensors", "short");  // not even a length prefix yet
  std::this_thread::sleep_for(120ms);                   // past the poll backoff
  c = gate.Check(e, nullptr);
  EXPECT_FALSE(c.ready);
  EXPECT_EQ(c.shards, (std::vector<std::string>{"ck/model-00002-of-00002.safetensors"}));
  Put("ck/model-00002-of-00002.safetensors", Safetensors("y"));
  std::this_thread::sleep_for(250ms);
  c = gate.Check(e, nullptr);
  EXPECT_TRUE(c.status.ok());
  EXPECT_TRUE(c.ready);
}

TEST_F(CommitFormatsGateTest, AQueuedShardOfAnIndexIsWaitedForAndMayGoAhead) {
  CommitGate gate(dir_.get(), GateOptions());
  Put("ck/index.tmp", kIndex);
  Put("ck/model-00001-of-00002.safetensors", Safetensors("x"));
  Put("ck/model-00002-of-00002.safetensors", Safetensors("old"));  // an earlier save's
  const JournalEntry e = CommitEntry("ck/model.safetensors.index.json", "ck/index.tmp");
  const QueuedIf shard2_queued(
      [](const std::string& p) { return p == "ck/model-00002-of-00002.safetensors"; });
  CommitCheck c = gate.Check(e, &shard2_queued);
  EXPECT_FALSE(c.ready);
  EXPECT_EQ(c.shards, (std::vector<std::string>{"ck/model-00002-of-00002.safetensors"}));
  std::this_thread::sleep_for(120ms);  // past the poll backoff
  c = gate.Check(e, nullptr);
  EXPECT_TRUE(c.ready);
}

TEST_F(CommitFormatsGateTest, AMalformedIndexCommitsByOrderAlone) {
  CommitGate gate(dir_.get(), GateOptions());
  for (const std::string& bad : {std::string("not json"), std::string(R"({"weight_map": 3})"),
                                 std::string(R"({"weight_map": {"a": "../escape"}})")}) {
    Put("ck/index.tmp", bad);
    CommitCheck c = gate.Check(CommitEntry("ck/model.safetensors.index.json", "ck/index.tmp"), nullptr);
    EXPECT_TRUE(c.status.ok()) << bad << ": " << c.status.ToString();
    EXPECT_TRUE(c.ready) << bad;
  }
}

TEST_F(CommitFormatsGateTest, ASingleModelSafetensorsCommitsOnItsOwnPublishWithoutBeingRead) {
  CommitGate gate(dir_.get(), GateOptions());
  // Its temp is not even there: the gate must not read a file that may be many GiB.
  CommitCheck c = gate.Check(CommitEntry("ck/model.safetensors", "ck/.ckptfs-tmp.7"), nullptr);
  EXPECT_TRUE(c.status.ok()) << c.status.ToString();
  EXPECT_TRUE(c.ready);
}

// A no-collectives save: rank 1's own `__1.metadata` (here the 4-rank fixture's metadata,
// which names all four ranks' files) waits for the shards it names, as `.metadata` does.
TEST_F(CommitFormatsGateTest, APerRankMetadataWaitsForTheShardsItNames) {
  fs::copy_file(kFixture / ".metadata", root_ + "/ck/__1.metadata.tmp");
  std::ifstream in(kFixture / ".metadata", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto md = ParseDcpMetadata(bytes);
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  std::map<std::string, uint64_t> need;
  for (const auto& [file, len] : RequiredFileLengths(*md)) need["ck/" + file] = len;
  ASSERT_EQ(need.size(), 4u);
  CommitGate gate(dir_.get(), GateOptions());
  const JournalEntry e = CommitEntry("ck/__1.metadata", "ck/__1.metadata.tmp");
  CommitCheck c = gate.Check(e, nullptr);
  ASSERT_TRUE(c.status.ok()) << c.status.ToString();
  EXPECT_FALSE(c.ready);
  EXPECT_EQ(c.shards.size(), 4u);
  for (const auto& [path, len] : need) Put(path, std::string(len, 's'));
  std::this_thread::sleep_for(120ms);
  c = gate.Check(e, nullptr);
  EXPECT_TRUE(c.ready);
  // Garbage under a rank's name commits by order, as a bad `.metadata` does.
  Put("ck/__2.metadata.tmp", "not a pickle");
  c = gate.Check(CommitEntry("ck/__2.metadata", "ck/__2.metadata.tmp", 10), nullptr);
  EXPECT_TRUE(c.status.ok());
  EXPECT_TRUE(c.ready);
}

// ---------------------------------------------------------------------- the registry

TEST(CheckpointRegistryFormats, ARanksCommitDoesNotTurnAFailedSaveCommitted) {
  ScopedTempDir tmp("ckptfs-formats-reg");
  auto db = StateDb::Open(tmp.Sub("state", false));
  ASSERT_TRUE(db.ok());
  auto reg = CheckpointRegistry::Load(db->get());
  ASSERT_TRUE(reg.ok());
  CheckpointRegistry& r = **reg;
  r.OnFileCreated("ck");
  r.OnCommitQueued("ck");
  r.OnFailed("ck", "rank 0's shard failed");
  r.OnCommitted("ck", CheckpointRegistry::kNow, /*last_part=*/true);
  EXPECT_EQ(r.Get("ck")->state, CkptState::kFailed);
  r.OnFileCreated("ok");
  r.OnCommitQueued("ok");
  r.OnCommitted("ok", CheckpointRegistry::kNow, /*last_part=*/true);
  EXPECT_EQ(r.Get("ok")->state, CkptState::kCommitted);
}

}  // namespace
}  // namespace ckptfs::store
