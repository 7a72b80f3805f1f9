#include "store/peer/memory_replica.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>

#include "common/path.h"
#include "common/thread_name.h"
#include "common/unique_fd.h"
#include "store/peer/memory_wire.h"
#include "store/primitives/crc32c.h"

namespace ckptfs::store::peer {
namespace {

using wire::ConnectionLost;
using wire::Hex;
using wire::Page;
using wire::ParseRank;
using wire::Split;
using wire::UnitFromJson;
using wire::UnitJson;
using wire::Unhex;
using Clock = std::chrono::steady_clock;
constexpr char kRecordName[] = "memory_checkpoints.json";
constexpr int kBusyRetries = 10;   // a holder that cannot reach this node, 0.5 s apart
constexpr uint32_t kRingAsks = 3;  // a restore asks at most this many ring nodes (+ recorded)

std::string JoinPath(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  if (b.empty()) return a;
  return a + "/" + b;
}

}  // namespace

Result<std::unique_ptr<MemoryReplicator>> MemoryReplicator::Create(
    const MemoryReplicatorOptions& options, MemoryTier* tier, PeerLinks* links) {
  if (tier == nullptr || links == nullptr) return Invalid("memory replicas: no tier or links");
  if (options.nodes < 2 || options.self >= options.nodes) {
    return Invalid("memory replicas need at least two nodes and a valid self");
  }
  std::unique_ptr<MemoryReplicator> r(new MemoryReplicator(options, tier, links));
  tier->restore_gate().Close();  // before the first look at a tree: it waits for the restore
  {
    MutexLock lock(&r->mu_);
    r->stats_.restoring = true;  // a part/ ask meanwhile is answered "busy", never "none"
  }
  tier->SetReplication(r.get());
  r->own_thread_ = std::thread([p = r.get()] {
    NameThisThread("ckptfs-memrepl");
    p->OwnLoop();
  });
  r->pull_thread_ = std::thread([p = r.get()] {
    NameThisThread("ckptfs-mempull");
    p->PullLoop();
  });
  return r;
}

MemoryReplicator::MemoryReplicator(const MemoryReplicatorOptions& options, MemoryTier* tier,
                                   PeerLinks* links)
    : options_(options), tier_(tier), links_(links), replicas_(tier), parts_(tier) {}

MemoryReplicator::~MemoryReplicator() { Stop(); }

void MemoryReplicator::Stop() {
  tier_->SetReplication(nullptr);
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (own_thread_.joinable()) own_thread_.join();
  if (pull_thread_.joinable()) pull_thread_.join();
  tier_->restore_gate().Open();  // a restore cut short: nothing waits for it any more
}

bool MemoryReplicator::Stopping() const {
  MutexLock lock(&mu_);
  return stop_;
}

void MemoryReplicator::Replicate(const std::string& tree, const std::string& path, bool checkpoint,
                                 uint64_t seq) {
  {
    MutexLock lock(&mu_);
    if (stop_) return;
    own_.push_back(Job{options_.self, tree, path, checkpoint, seq});
  }
  cv_.notify_all();
}

Result<size_t> MemoryReplicator::Fetch(uint32_t rank, const std::string& name, uint64_t seq,
                                       uint64_t offset, std::span<char> out) {
  std::shared_ptr<PeerClient> client = links_->Get(rank);
  if (!client) return Status(Code::kIo, "rank " + std::to_string(rank) + " is down");
  const BlockId id{std::string(kMemoryPrefix) + name, 0, static_cast<int64_t>(seq)};
  Result<size_t> got = client->Fetch(id, offset, out);
  if (!got.ok() && ConnectionLost(got.status())) links_->Failed(rank, client, got.status());
  if (got.ok()) links_->Succeeded(rank);
  return got;
}

Result<std::string> MemoryReplicator::FetchAll(uint32_t rank, const std::string& name,
                                               uint64_t seq) {
  std::string text;
  std::vector<char> buf(options_.block_bytes);
  while (true) {
    CKPT_ASSIGN_OR_RETURN(size_t got, Fetch(rank, name, seq, text.size(), buf));
    text.append(buf.data(), got);
    if (got < buf.size()) return text;
    if (text.size() > (256ull << 20)) return Invalid("memory replica: listing too long");
  }
}

// ---------------------------------------------------------------- serving

Result<BlockRead> MemoryReplicator::Serve(const BlockId& id, uint64_t offset, std::span<char> out) {
  const uint64_t seq = static_cast<uint64_t>(id.mtime_ns);
  std::vector<std::string_view> parts =
      Split(std::string_view(id.path).substr(kMemoryPrefix.size()));
  const std::string_view verb = parts[0];
  if (auto served = ServeParts(parts, seq, offset, out)) return *served;
  if (verb == "list" && parts.size() == 3) {
    CKPT_ASSIGN_OR_RETURN(std::string tree, Unhex(parts[1]));
    CKPT_ASSIGN_OR_RETURN(std::string path, Unhex(parts[2]));
    CKPT_ASSIGN_OR_RETURN(MemUnit unit, tier_->Manifest(tree, path, seq));
    return Page(UnitJson(unit).dump(), offset, out);
  }
  if (verb == "file" && parts.size() == 4) {
    CKPT_ASSIGN_OR_RETURN(std::string tree, Unhex(parts[1]));
    CKPT_ASSIGN_OR_RETURN(std::string path, Unhex(parts[2]));
    CKPT_ASSIGN_OR_RETURN(std::string file, Unhex(parts[3]));
    CKPT_ASSIGN_OR_RETURN(size_t n,
                          tier_->ReadUnit(tree, path, seq, file, out.data(), out.size(), offset));
    return BlockRead{.bytes = n, .crc32c = std::nullopt};
  }
  if (verb == "index" && parts.size() == 2) {
    CKPT_ASSIGN_OR_RETURN(uint32_t origin, ParseRank(parts[1]));
    nlohmann::json list = nlohmann::json::array();
    for (const MemUnit& u : replicas_.Index(origin)) list.push_back(UnitJson(u));
    return Page(list.dump(), offset, out);
  }
  if (verb == "replica" && parts.size() == 5) {
    CKPT_ASSIGN_OR_RETURN(uint32_t origin, ParseRank(parts[1]));
    CKPT_ASSIGN_OR_RETURN(std::string tree, Unhex(parts[2]));
    CKPT_ASSIGN_OR_RETURN(std::string path, Unhex(parts[3]));
    CKPT_ASSIGN_OR_RETURN(std::string file, Unhex(parts[4]));
    CKPT_ASSIGN_OR_RETURN(
        size_t n, replicas_.Read(origin, tree, path, seq, file, out.data(), out.size(), offset));
    return BlockRead{.bytes = n, .crc32c = std::nullopt};
  }
  if (verb == "pull" && parts.size() == 5 && (parts[4] == "c" || parts[4] == "t")) {
    CKPT_ASSIGN_OR_RETURN(uint32_t origin, ParseRank(parts[1]));
    if (origin >= options_.nodes || origin == options_.self) {
      return Invalid("memory replica: a pull for rank " + std::to_string(origin));
    }
    CKPT_ASSIGN_OR_RETURN(std::string tree, Unhex(parts[2]));
    CKPT_ASSIGN_OR_RETURN(std::string path, Unhex(parts[3]));
    static const std::string kDone = "D", kPending = "P";
    if (replicas_.Has(origin, tree, path, seq)) return Page(kDone, offset, out);
    const PullKey key{origin, tree, path, seq};
    MutexLock lock(&mu_);
    if (stop_) return Status(Code::kBusy, "this daemon is stopping");
    auto it = pull_states_.find(key);
    if (it == pull_states_.end()) {
      if (pull_states_.size() > 4096)
        std::erase_if(pull_states_,
                      [](const auto& kv) { return kv.second.done || !kv.second.failed.ok(); });
      pull_states_.emplace(key, PullState{});
      pulls_.push_back(Job{origin, tree, path, parts[4] == "c", seq});
      cv_.notify_all();
      return Page(kPending, offset, out);
    }
    if (!it->second.failed.ok()) {
      Status failed = it->second.failed;
      pull_states_.erase(it);  // the writer may ask again
      // This node's trouble reaching the writer must not read as the writer's trouble
      // reaching this node (which marks a rank down): kBusy, and the writer retries.
      if (ConnectionLost(failed)) return Status(Code::kBusy, failed.message());
      return failed;
    }
    if (it->second.done) {
      pull_states_.erase(it);
      return Page(kDone, offset, out);
    }
    return Page(kPending, offset, out);
  }
  return Invalid("memory replica: unknown request " + id.path);
}

// ---------------------------------------------------------------- holder

void MemoryReplicator::PullLoop() {
  MutexLock lock(&mu_);
  while (true) {
    cv_.wait(lock.native(), [this] {
      mu_.AssertHeld();
      return stop_ || !pulls_.empty();
    });
    if (stop_) return;
    Job job = std::move(pulls_.front());
    pulls_.pop_front();
    lock.Unlock();
    Status st = job.kind == Job::kApply ? ApplyFrom(job) : Pull(job);
    if (!st.ok()) {
      spdlog::warn("memory-only replica of {}/{} from rank {}: {}", job.tree, job.path, job.origin,
                   st.ToString());
    }
    lock.Lock();
    if (!st.ok()) ++stats_.pull_failures;
    auto it = pull_states_.find(PullKey{job.origin, job.tree, job.path, job.seq});
    if (it != pull_states_.end()) {
      it->second.done = st.ok();
      it->second.failed = st;
    }
  }
}

Status MemoryReplicator::Pull(const Job& job) {
  const std::string unit_name = Hex(job.tree) + "/" + Hex(job.path);
  CKPT_ASSIGN_OR_RETURN(std::string text, FetchAll(job.origin, "list/" + unit_name, job.seq));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded()) return Corrupt("memory replica: unreadable manifest");
  CKPT_ASSIGN_OR_RETURN(MemUnit unit, UnitFromJson(j));
  if (unit.tree != job.tree || unit.path != job.path || unit.seq != job.seq) {
    return Corrupt("memory replica: the manifest names another unit");
  }
  const uint64_t bytes = unit.bytes();
  CKPT_RETURN_IF_ERROR(replicas_.Reserve(bytes));
  MemReplica r;
  r.origin = job.origin;
  r.origin_address = links_->AddressOf(job.origin);
  const uint64_t bs = options_.block_bytes;
  for (const MemUnitFile& f : unit.files) {
    auto data = std::make_shared<std::string>(f.size, '\0');
    uint32_t crc = 0;
    for (uint64_t at = 0; at < f.size;) {
      if (Stopping()) {
        replicas_.Unreserve(bytes);
        return Status(Code::kBusy, "this daemon is stopping");
      }
      const size_t want = static_cast<size_t>(std::min(bs, f.size - at));
      Result<size_t> got = Fetch(job.origin, "file/" + unit_name + "/" + Hex(f.name), job.seq, at,
                                 std::span<char>(data->data() + at, want));
      if (got.ok() && *got != want) got = Corrupt("memory replica: " + f.name + " is short");
      if (!got.ok()) {
        replicas_.Unreserve(bytes);
        return got.status();
      }
      crc = Crc32cExtend(crc, data->data() + at, want);
      at += want;
    }
    if (crc != f.crc32c) {
      replicas_.Unreserve(bytes);
      return Corrupt("memory replica: " + f.name + " fails its checksum");
    }
    r.data.push_back(std::move(data));
  }
  r.unit = std::move(unit);
  replicas_.Put(std::move(r));
  MutexLock lock(&mu_);
  ++stats_.pulled_units;
  stats_.pulled_bytes += bytes;
  return Status::Ok();
}

// ---------------------------------------------------------------- writer

void MemoryReplicator::OwnLoop() {
  Restore();
  MutexLock lock(&mu_);
  while (true) {
    const bool woken = cv_.wait_for(lock.native(), options_.verify_interval, [this] {
      mu_.AssertHeld();
      return stop_ || !own_.empty();
    });
    if (stop_) return;
    std::vector<Job> jobs;
    if (woken) {
      jobs.push_back(std::move(own_.front()));
      own_.pop_front();
    } else {
      // Idle: is each committed checkpoint still held? A holder that restarted lost it; it
      // takes it again (or the next node does) at once, never waiting for a node down.
      for (const auto& [tree, r] : record_) {
        jobs.push_back(Job{options_.self, tree, r.path, true, r.seq, /*verify=*/true});
      }
    }
    lock.Unlock();
    if (!woken) {
      // And those no node took before: a node back up takes them now, and they commit.
      for (const MemCheckpoint& c : tier_->Checkpoints()) {
        if (c.state != "unreplicated") continue;
        jobs.push_back(Job{options_.self, c.tree, c.in_tree, true, c.seq, /*verify=*/true});
      }
    }
    for (const Job& job : jobs) RunOwn(job);
    lock.Lock();
  }
}

void MemoryReplicator::RunOwn(const Job& job) {
  if (job.kind == Job::kGather) {
    GatherParts(job);
    return;
  }
  if (!job.checkpoint && NamesUncommitted(job)) {
    // G4 on the replica: a tracker is handed over only once what it names is committed
    // (the checkpoints queued before it were handed first). Its next close tries again.
    spdlog::warn(
        "memory-only tracker {}/{} names a checkpoint no peer holds: not "
        "replicated",
        job.tree, job.path);
    return;
  }
  Result<std::string> holder = HandOver(job);
  if (holder.ok() || (!job.verify && holder.status().code() != Code::kSuperseded)) {
    tier_->HandedOver(job.tree, job.path, job.seq, holder);
  }
  if (holder.ok()) {
    bool changed = false;
    std::optional<Recorded> told;
    if (job.checkpoint) {
      MutexLock l(&mu_);
      Recorded& r = record_[job.tree];
      changed = r.path != job.path || r.seq != job.seq || r.holder != *holder;
      const bool parts = r.parts && r.path == job.path && r.seq == job.seq;
      r = Recorded{job.path, job.seq, *holder, parts, parts ? r.part_ranks
                                                            : std::vector<uint32_t>{}};
      if (job.verify && parts) told = r;
    }
    if (changed) WriteRecord();
    if (told && PartsStillHeld(job.tree, *told)) TellCommitted(job.tree, job.path, job.seq);
  }
  MutexLock l(&mu_);
  if (job.verify) {
    stats_.verify_failures += holder.ok() ? 0 : 1;
  } else if (holder.ok()) {
    ++stats_.handed;
  } else {
    ++stats_.hand_failures;
  }
}

Result<std::string> MemoryReplicator::HandOver(const Job& job) {
  const std::string name = "pull/" + std::to_string(options_.self) + "/" + Hex(job.tree) + "/" +
                           Hex(job.path) + (job.checkpoint ? "/c" : "/t");
  Status last = Status(Code::kIo, "no other node is up");
  // Nodes down now may be back soon (a peer restarting): the ring is tried again until
  // hand_over_wait has passed, then the unit stays uncommitted. A check of a committed one
  // tries each node once.
  const auto give_up =
      Clock::now() + (job.verify ? std::chrono::milliseconds(0) : options_.hand_over_wait);
  while (true) {
    bool refused = false;  // a node answered and would not take it
    for (uint32_t k = 1; k < options_.nodes; ++k) {
      const uint32_t rank = (options_.self + k) % options_.nodes;
      if (!links_->Reachable(rank) && Clock::now() < give_up - options_.poll) continue;
      const auto deadline = Clock::now() + options_.replicate_timeout;
      char reply[8];
      int busy = 0;
      while (true) {
        Result<size_t> got = Fetch(rank, name, job.seq, 0, std::span<char>(reply, sizeof(reply)));
        if (!got.ok() && got.status().code() == Code::kBusy && ++busy <= kBusyRetries) {
          // The holder could not reach this node yet (a link it had to make again): again.
          MutexLock lock(&mu_);
          cv_.wait_for(lock.native(), std::chrono::milliseconds(500), [this] {
            mu_.AssertHeld();
            return stop_;
          });
          if (stop_) return Status(Code::kSuperseded, "stopping");
          continue;
        }
        if (!got.ok()) {
          last = got.status();
          break;
        }
        if (*got == 1 && reply[0] == 'D') return links_->AddressOf(rank);
        if (Clock::now() > deadline) {
          last = Status(Code::kTimeout, "the holder did not finish in time");
          break;
        }
        MutexLock lock(&mu_);
        cv_.wait_for(lock.native(), options_.poll, [this] {
          mu_.AssertHeld();
          return stop_;
        });
        if (stop_) return Status(Code::kSuperseded, "stopping");
      }
      // The unit changed or went away here (a newer version is queued): nothing to hand.
      if (last.code() == Code::kNotFound) return Status(Code::kSuperseded, last.message());
      refused |= !ConnectionLost(last);
      if (!job.verify) {
        spdlog::warn("memory-only {}/{}: {} did not take it: {}", job.tree, job.path,
                     links_->AddressOf(rank), last.ToString());
      }
    }
    if (refused || Clock::now() >= give_up) return last;
    MutexLock lock(&mu_);
    cv_.wait_for(lock.native(), std::chrono::milliseconds(500), [this] {
      mu_.AssertHeld();
      return stop_;
    });
    if (stop_) return Status(Code::kSuperseded, "stopping");
  }
}

bool MemoryReplicator::NamesUncommitted(const Job& tracker) {
  char buf[4096];
  Result<size_t> n =
      tier_->ReadUnit(tracker.tree, tracker.path, tracker.seq, "", buf, sizeof(buf), 0);
  if (!n.ok()) return false;
  const std::string content(buf, *n);
  for (const MemCheckpoint& c : tier_->Checkpoints()) {
    if (c.tree == tracker.tree && (c.state == "replicating" || c.state == "unreplicated") &&
        NamesCheckpoint(content, std::string(path::Basename(c.in_tree)))) {
      return true;
    }
  }
  return false;
}

// ---------------------------------------------------------------- restore

void MemoryReplicator::Restore() {
  const auto start = Clock::now();
  {
    MutexLock lock(&mu_);
    stats_.restoring = true;
  }
  // What this node had committed before it stopped (same state dir), by tree.
  std::map<std::string, Recorded> recorded;
  if (!options_.state_dir.empty()) {
    std::ifstream f(path::Join(options_.state_dir, kRecordName));
    if (f) {
      nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
      if (j.is_array()) {
        for (const nlohmann::json& e : j) {
          Result<std::string> tree = Unhex(e.value("tree", ""));
          Result<std::string> p = Unhex(e.value("path", ""));
          if (tree.ok() && p.ok()) {
            recorded[*tree] = {*p, e.value("seq", uint64_t{0}), e.value("holder", "")};
          }
        }
      } else {
        spdlog::error("memory-only checkpoints: {} is unreadable; nothing can be reported lost",
                      path::Join(options_.state_dir, kRecordName));
      }
    }
  }
  // The newest version of each unit any other node keeps for this one.
  std::map<std::pair<std::string, std::string>, std::pair<uint32_t, MemUnit>> found;
  std::string why_none = "no other node answered";
  // Asked: the holders the record names, and the ring (self+1, self+2, ...) up to the first
  // node that answers; never every node (G12).
  std::set<std::string> holders;
  for (const auto& [tree, r] : recorded) holders.insert(r.holder);
  bool ring_answered = false;
  for (uint32_t k = 1; k < options_.nodes && !Stopping(); ++k) {
    const uint32_t rank = (options_.self + k) % options_.nodes;
    const bool ring_done = ring_answered || k > kRingAsks;
    if (ring_done && holders.count(links_->AddressOf(rank)) == 0) continue;
    Result<std::string> text = FetchAll(rank, "index/" + std::to_string(options_.self), 0);
    if (!text.ok()) {
      spdlog::info("memory-only restore: {} (rank {}) gave nothing: {}", links_->AddressOf(rank),
                   rank, text.status().ToString());
      why_none = "its replica holder " + links_->AddressOf(rank) + " is unreachable (" +
                 text.status().ToString() + ")";
      continue;
    }
    nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
    if (!j.is_array()) continue;
    ring_answered = true;
    why_none = "no peer holds a replica of it";
    for (const nlohmann::json& e : j) {
      Result<MemUnit> u = UnitFromJson(e);
      if (!u.ok()) continue;
      auto key = std::make_pair(u->tree, u->path);
      auto it = found.find(key);
      if (it == found.end() || it->second.second.seq < u->seq) found[key] = {rank, *u};
    }
  }
  // Checkpoints first, the newest of each tree only; then the trackers.
  std::map<std::string, uint64_t> newest;  // tree -> seq of its newest checkpoint
  for (const auto& [key, v] : found) {
    if (v.second.checkpoint) newest[key.first] = std::max(newest[key.first], v.second.seq);
  }
  std::map<std::string, uint64_t> restored;  // tree -> seq of the checkpoint restored
  for (int pass = 0; pass < 2; ++pass) {
    for (const auto& [key, v] : found) {
      const auto& [rank, unit] = v;
      if (unit.checkpoint != (pass == 0) || Stopping()) continue;
      if (unit.checkpoint && unit.seq != newest[unit.tree]) continue;
      Result<uint64_t> bytes = RestoreUnit(rank, unit);
      if (!bytes.ok()) {
        spdlog::error("memory-only restore of {}/{} from {}: {}", unit.tree, unit.path,
                      links_->AddressOf(rank), bytes.status().ToString());
      }
      const std::string from = links_->AddressOf(rank);
      MutexLock lock(&mu_);
      if (!bytes.ok()) {
        ++stats_.restore_failures;
        continue;
      }
      ++stats_.restored_units;
      stats_.restored_bytes += *bytes;
      if (unit.checkpoint) {
        restored[unit.tree] = unit.seq;
        record_[unit.tree] = Recorded{unit.path, unit.seq, from};
      }
    }
  }
  for (const auto& [tree, r] : recorded) {
    auto it = restored.find(tree);
    if (it != restored.end() && it->second >= r.seq) continue;
    tier_->NoteLost(tree, r.path,
                    "this daemon restarted and " +
                        (r.holder.empty() ? why_none
                                          : "its replica holder (" + r.holder +
                                                ") did not give it back: " + why_none));
  }
  // Checkpoints written through several nodes whose `.metadata` came back here: the other
  // nodes' parts are gathered again before anything of the tree is served (never partly).
  std::vector<Job> gathers;
  {
    MutexLock lock(&mu_);
    // This node's own units are back: a part/ ask from a gathering node is answered from now
    // on (this node's own gathers below may wait for that node's part in turn).
    stats_.restoring = false;
    for (auto it = own_.begin(); it != own_.end();) {
      if (it->kind == Job::kGather) {
        gathers.push_back(std::move(*it));
        it = own_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const Job& g : gathers) GatherParts(g);
  tier_->restore_gate().Open();
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  {
    MutexLock lock(&mu_);
    stats_.restoring = false;
    stats_.restore_s = took;
  }
  spdlog::info("memory-only restore: {} checkpoint(s) back from peers, {} recorded, in {:.3f} s",
               restored.size(), recorded.size(), took);
  WriteRecord();
}

Result<uint64_t> MemoryReplicator::RestoreUnit(uint32_t rank, const MemUnit& unit) {
  const std::string unit_name =
      std::to_string(options_.self) + "/" + Hex(unit.tree) + "/" + Hex(unit.path);
  const uint64_t bs = options_.block_bytes;
  uint64_t total = 0;
  for (const MemUnitFile& f : unit.files) {
    uint64_t at = 0;
    uint32_t crc = 0;
    Status fetched = Status::Ok();
    // The tier asks for its blocks in order; each piece comes from the holder in requests of
    // at most a block.
    Status st = tier_->RestoreFile(
        unit.tree, JoinPath(unit.path, f.name), f.size, [&](char* out, size_t n) -> Status {
          for (size_t done = 0; done < n;) {
            const size_t want = static_cast<size_t>(std::min<uint64_t>(bs, n - done));
            Result<size_t> got = Fetch(rank, "replica/" + unit_name + "/" + Hex(f.name), unit.seq,
                                       at, std::span<char>(out + done, want));
            if (got.ok() && *got != want) got = Corrupt("short replica of " + f.name);
            if (!got.ok()) return got.status();
            crc = Crc32cExtend(crc, out + done, want);
            done += want;
            at += want;
          }
          return Status::Ok();
        });
    if (st.ok() && crc != f.crc32c) st = Corrupt("replica of " + f.name + " fails its checksum");
    if (!st.ok()) {
      tier_->FinishRestore(unit.tree, unit.path, unit.seq, "", 0, /*whole=*/false);
      return st;
    }
    total += f.size;
  }
  tier_->FinishRestore(unit.tree, unit.path, unit.seq, links_->AddressOf(rank), total,
                       /*whole=*/true);
  return total;
}

void MemoryReplicator::WriteRecord() {
  if (options_.state_dir.empty()) return;
  std::set<std::string> committed;  // as the tier has them now (an unlinked one is gone)
  for (const MemCheckpoint& c : tier_->Checkpoints()) {
    if (c.state == "committed" && !c.holder.empty()) committed.insert(c.path);
  }
  nlohmann::json list = nlohmann::json::array();
  {
    MutexLock lock(&mu_);
    for (const auto& [tree, r] : record_) {
      if (committed.count(path::Join(tree, r.path)) == 0) continue;
      list.push_back({{"tree", Hex(tree)},
                      {"path", Hex(r.path)},
                      {"seq", r.seq},
                      {"holder", r.holder},
                      {"name", path::Join(tree, r.path)}});
    }
  }
  // Written whole then renamed: a crash leaves the old record or the new one.
  const std::string final_path = path::Join(options_.state_dir, kRecordName);
  const std::string tmp = final_path + ".tmp";
  const std::string text = list.dump(1) + "\n";
  UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  bool ok = fd.get() >= 0 &&
            write(fd.get(), text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
            fsync(fd.get()) == 0;
  fd.Reset();
  ok = ok && rename(tmp.c_str(), final_path.c_str()) == 0;
  if (!ok) {
    spdlog::error(
        "memory-only checkpoints: cannot write {}: {}; a restart cannot tell which "
        "were lost",
        final_path, std::strerror(errno));
  }
}

void MemoryReplicator::AppendJson(nlohmann::json* j) const {
  MemoryReplicatorStats s;
  {
    MutexLock lock(&mu_);
    s = stats_;
  }
  nlohmann::json r = {{"handed", s.handed},
                      {"hand_failures", s.hand_failures},
                      {"pulled_units", s.pulled_units},
                      {"pulled_bytes", s.pulled_bytes},
                      {"pull_failures", s.pull_failures},
                      {"restored_units", s.restored_units},
                      {"restored_bytes", s.restored_bytes},
                      {"restore_failures", s.restore_failures},
                      {"verify_failures", s.verify_failures},
                      {"restore_s", s.restore_s},
                      {"restoring", s.restoring}};
  r["replicas"] = replicas_.Json();
  (*j)["memory_replication"] = std::move(r);
}

}  // namespace ckptfs::store::peer
