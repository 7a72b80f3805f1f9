// MemoryReplicator's side of memory-only checkpoints written through several nodes
// (store/memory/memory_parts.h). Requests, over the same block protocol as memory_replica.h:
//   mkdir/<tree>/<path>                 make this directory here too ("D")
//   part/<rank>/<tree>/<path>           (seq) this node's part of that checkpoint: sealed and
//                                       handed to a holder on the first ask; JSON
//                                       {"holder", "files"}, holder "" until one holds it;
//                                       kNotFound when this node wrote nothing there
//   done/<rank>/<tree>/<path>           (seq) rank committed it: this node fetches whole/
//                                       from rank and applies it (on the pull thread)
//   whole/<tree>/<path>                 (seq) every file of it: JSON [{name, size, rank,
//                                       holder}]
//   rename/<tree>/<from>/<to>           directory from was renamed to to: renamed here too,
//                                       with this node's parts and the replicas it holds
//                                       below it ("D")
// The node with the `.metadata` asks every other node (part/), so a commit costs it one
// request per node and a poll per node whose part is being replicated; a node down is asked
// again for up to hand_over_wait, then skipped (its files, if the `.metadata` names any,
// then refuse the commit).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <optional>
#include <string>

#include "common/fan_out.h"
#include "common/path.h"
#include "store/peer/memory_replica.h"
#include "store/peer/memory_wire.h"

namespace ckptfs::store::peer {
namespace {

using Clock = std::chrono::steady_clock;
using wire::ConnectionLost;
using wire::Hex;
using wire::Page;
using wire::ParseRank;
using wire::Unhex;
using wire::UnsignedField;

constexpr std::chrono::milliseconds kMirrorWait{2000};

std::string UnitName(const std::string& tree, const std::string& path) {
  return Hex(tree) + "/" + Hex(path);
}

// A part/ answer: {"holder", "files": [{"name", "size"}]}.
Status ParsePart(const std::string& text, MemPart* part) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  try {
    part->holder = j.at("holder").get<std::string>();
    for (const nlohmann::json& f : j.at("files")) {
      CKPT_ASSIGN_OR_RETURN(std::string file, Unhex(f.at("name").get<std::string>()));
      CKPT_ASSIGN_OR_RETURN(const uint64_t size, UnsignedField(f, "size"));
      part->files.push_back(MemUnitFile{file, size, 0});
    }
  } catch (const nlohmann::json::exception& e) {
    return Corrupt(std::string("a malformed part answer: ") + e.what());
  }
  return Status::Ok();
}

}  // namespace

void MemoryReplicator::Gather(const std::string& tree, const std::string& path, uint64_t seq) {
  {
    MutexLock lock(&mu_);
    if (stop_) return;
    Job job{options_.self, tree, path, true, seq};
    job.kind = Job::kGather;
    own_.push_back(std::move(job));
  }
  cv_.notify_all();
}

Result<size_t> MemoryReplicator::FetchRetrying(uint32_t rank, const std::string& name, uint64_t seq,
                                               std::span<char> out, Clock::time_point until) {
  while (true) {
    Result<size_t> got = Fetch(rank, name, seq, 0, out);
    if (got.ok() || !ConnectionLost(got.status()) || Clock::now() >= until) return got;
    MutexLock lock(&mu_);
    cv_.wait_for(lock.native(), std::chrono::milliseconds(100), [this] {
      mu_.AssertHeld();
      return stop_;
    });
    if (stop_) return got;
  }
}

void MemoryReplicator::MirrorDir(const std::string& tree, const std::string& path) {
  AskEveryNode("mkdir", tree, path, "did not make it", "ranks there cannot write into it");
}

void MemoryReplicator::MirrorRmdir(const std::string& tree, const std::string& path) {
  AskEveryNode("rmdir", tree, path, "did not remove it",
               "it lists it until the tree's next commit evicts it");
}

void MemoryReplicator::MirrorRename(const std::string& tree, const std::string& from,
                                    const std::string& to) {
  Renamed(tree, from, to);
  AskEveryNode("rename", tree, from, "did not rename it",
               "ranks there keep its old name; its parts there stay under it", to);
}

void MemoryReplicator::Renamed(const std::string& tree, const std::string& from,
                               const std::string& to) {
  replicas_.Rename(tree, from, to);
  bool changed = false;
  {
    MutexLock lock(&mu_);
    if (auto it = record_.find(tree); it != record_.end()) {
      if (auto now = path::Rebase(it->second.path, from, to)) {
        it->second.path = *now;
        changed = true;
      }
    }
  }
  if (changed) WriteRecord();
}

void MemoryReplicator::AskEveryNode(const char* verb, const std::string& tree,
                                    const std::string& path, const char* failed,
                                    const char* meaning, const std::string& to) {
  std::string name = std::string(verb) + "/" + UnitName(tree, path);
  if (!to.empty()) name += "/" + Hex(to);
  // A node down (or paused after a failure) is waited for at most kMirrorWait in all: a
  // mkdir or rmdir in a tree never waits longer for a node that is gone.
  // Every node at once, kFanOutWidth at a time (G12: the wait is the slowest node's, not
  // the sum of all of them).
  const auto until = Clock::now() + kMirrorWait;
  ForEachOtherRank(options_.nodes, options_.self, kFanOutWidth, [&](uint32_t rank) {
    char reply[8];
    Result<size_t> got = FetchRetrying(rank, name, 0, std::span<char>(reply, sizeof(reply)), until);
    if (!got.ok()) {
      spdlog::warn("memory-only {} {}/{}{}: {} {}: {} ({})", verb, tree, path,
                   to.empty() ? "" : " -> " + to, links_->AddressOf(rank), failed,
                   got.status().ToString(), meaning);
    }
  });
}

std::optional<uint32_t> MemoryReplicator::RankOf(const std::string& address) const {
  if (address.empty()) return std::nullopt;
  for (uint32_t r = 0; r < options_.nodes; ++r) {
    if (links_->AddressOf(r) == address) return r;
  }
  return std::nullopt;
}

Result<size_t> MemoryReplicator::ReadRemote(const MemRemoteFile& f, char* out, size_t len,
                                            uint64_t offset) {
  const size_t want = static_cast<size_t>(std::min<uint64_t>(len, options_.block_bytes));
  const std::optional<uint32_t> holder = RankOf(f.holder);
  if (holder == options_.self) {  // this node holds the writer's part: no network
    Result<size_t> n = replicas_.Read(f.rank, f.tree, f.unit, f.seq, f.file, out, want, offset);
    if (n.ok()) return n;
  }
  // From the writer, then from the holder of its part.
  Result<size_t> got = Fetch(f.rank, "file/" + UnitName(f.tree, f.unit) + "/" + Hex(f.file), f.seq,
                             offset, std::span<char>(out, want));
  if (got.ok() || !holder || *holder == options_.self) return got;
  Result<size_t> replica = Fetch(
      *holder,
      "replica/" + std::to_string(f.rank) + "/" + UnitName(f.tree, f.unit) + "/" + Hex(f.file),
      f.seq, offset, std::span<char>(out, want));
  if (replica.ok()) return replica;
  return Status(Code::kIo, fmt::format("{}: neither its writer (rank {}: {}) nor the holder of its "
                                       "part ({}: {}) gave it",
                                       f.file, f.rank, got.status().ToString(), f.holder,
                                       replica.status().ToString()));
}

std::optional<Result<BlockRead>> MemoryReplicator::ServeParts(
    const std::vector<std::string_view>& parts, uint64_t seq, uint64_t offset,
    std::span<char> out) {
  const std::string_view verb = parts[0];
  if (verb == "mkdir" && parts.size() == 3) {
    Result<std::string> tree = Unhex(parts[1]), path = Unhex(parts[2]);
    if (!tree.ok() || !path.ok()) return Result<BlockRead>(Invalid("memory mkdir: bad name"));
    Status st = parts_.MakeDirs(*tree, *path);
    if (!st.ok()) return Result<BlockRead>(st);
    return Page("D", offset, out);
  }
  if (verb == "rmdir" && parts.size() == 3) {
    Result<std::string> tree = Unhex(parts[1]), path = Unhex(parts[2]);
    if (!tree.ok() || !path.ok()) return Result<BlockRead>(Invalid("memory rmdir: bad name"));
    Status st = parts_.RemoveDir(*tree, *path);
    if (!st.ok()) return Result<BlockRead>(st);
    return Page("D", offset, out);
  }
  if (verb == "rename" && parts.size() == 4) {
    Result<std::string> tree = Unhex(parts[1]), from = Unhex(parts[2]), to = Unhex(parts[3]);
    if (!tree.ok() || !from.ok() || !to.ok()) {
      return Result<BlockRead>(Invalid("memory rename: bad name"));
    }
    Status st = parts_.RenameDir(*tree, *from, *to);
    if (!st.ok()) return Result<BlockRead>(st);
    Renamed(*tree, *from, *to);
    return Page("D", offset, out);
  }
  if ((verb == "part" || verb == "done" || verb == "lost") && parts.size() == 4) {
    Result<uint32_t> rank = ParseRank(parts[1]);
    Result<std::string> tree = Unhex(parts[2]), path = Unhex(parts[3]);
    if (!rank.ok() || !tree.ok() || !path.ok() || *rank >= options_.nodes ||
        *rank == options_.self) {
      return Result<BlockRead>(Invalid("memory part: bad request"));
    }
    if (verb == "lost") {
      {
        MutexLock lock(&mu_);
        if (stats_.restoring) {  // this node's part may be on its way back: asked again
          return Result<BlockRead>(Status(Code::kBusy, "this daemon is restoring"));
        }
      }
      parts_.Lose(*tree, *path, seq,
                  "the node with its .metadata (" + links_->AddressOf(*rank) +
                      ") lost a part of it: gone from its writer and from its holder");
      return Page("L", offset, out);
    }
    if (verb == "done") {
      if (parts_.Whole(*tree, *path, seq, options_.self).ok()) {
        return Page("D", offset, out);  // committed here at that version already
      }
      {
        MutexLock lock(&mu_);
        if (stop_) return Result<BlockRead>(Status(Code::kBusy, "this daemon is stopping"));
        Job job{*rank, *tree, *path, true, seq};
        job.kind = Job::kApply;
        pulls_.push_back(std::move(job));
      }
      cv_.notify_all();
      return Page("D", offset, out);
    }
    {
      MutexLock lock(&mu_);
      if (stats_.restoring) {  // this node's part may be on its way back
        return Result<BlockRead>(Status(Code::kBusy, "this daemon is restoring"));
      }
    }
    Result<MemPart> part = parts_.Seal(*tree, *path, seq);
    if (!part.ok()) return Result<BlockRead>(part.status());
    nlohmann::json files = nlohmann::json::array();
    for (const MemUnitFile& f : part->files) {
      files.push_back({{"name", Hex(f.name)}, {"size", f.size}});
    }
    return Page(nlohmann::json{{"holder", part->holder}, {"files", std::move(files)}}.dump(),
                offset, out);
  }
  if (verb == "whole" && parts.size() == 3) {
    Result<std::string> tree = Unhex(parts[1]), path = Unhex(parts[2]);
    if (!tree.ok() || !path.ok()) return Result<BlockRead>(Invalid("memory whole: bad name"));
    Result<std::vector<MemRemoteFile>> files = parts_.Whole(*tree, *path, seq, options_.self);
    if (!files.ok()) return Result<BlockRead>(files.status());
    nlohmann::json list = nlohmann::json::array();
    for (const MemRemoteFile& f : *files) {
      list.push_back(
          {{"name", Hex(f.file)}, {"size", f.size}, {"rank", f.rank}, {"holder", f.holder}});
    }
    return Page(list.dump(), offset, out);
  }
  return std::nullopt;
}

void MemoryReplicator::GatherParts(const Job& job) {
  // This node's own part first (the `.metadata` is in it).
  Result<std::string> own = HandOver(job);
  if (!own.ok() && own.status().code() == Code::kSuperseded) return;  // another version now
  tier_->HandedOver(job.tree, job.path, job.seq, own);
  if (!own.ok()) {
    MutexLock lock(&mu_);
    ++stats_.hand_failures;
    return;
  }
  std::vector<MemPart> parts;
  const std::string name =
      "part/" + std::to_string(options_.self) + "/" + UnitName(job.tree, job.path);
  const auto deadline = Clock::now() + options_.hand_over_wait + options_.replicate_timeout;
  for (uint32_t k = 1; k < options_.nodes; ++k) {
    const uint32_t rank = (options_.self + k) % options_.nodes;
    // A node down now may be back soon (a daemon restarting): asked again until
    // hand_over_wait has passed, as a hand-over does.
    const auto down_until = Clock::now() + options_.hand_over_wait;
    while (true) {
      Result<std::string> text = FetchAll(rank, name, job.seq);
      if (!text.ok() && (ConnectionLost(text.status()) || text.status().code() == Code::kBusy) &&
          Clock::now() < down_until && !Stopping()) {
        MutexLock lock(&mu_);
        cv_.wait_for(lock.native(), std::chrono::milliseconds(100), [this] {
          mu_.AssertHeld();
          return stop_;
        });
        continue;
      }
      if (!text.ok() &&
          (text.status().code() == Code::kNotFound || ConnectionLost(text.status()))) {
        if (text.status().code() != Code::kNotFound) {
          spdlog::warn(
              "memory-only checkpoint {}/{}: {} is not reachable; its part, if any, is "
              "missing: {}",
              job.tree, job.path, links_->AddressOf(rank), text.status().ToString());
        }
        break;  // nothing of it there (or down): the commit checks what is missing
      }
      if (!text.ok()) {
        parts_.GatherFailed(job.tree, job.path, job.seq, text.status());
        return;
      }
      MemPart part;
      part.rank = rank;
      Status parsed = ParsePart(*text, &part);
      if (!parsed.ok()) {
        parts_.GatherFailed(job.tree, job.path, job.seq, parsed);
        return;
      }
      if (!part.holder.empty()) {
        parts.push_back(std::move(part));
        break;
      }
      if (Clock::now() > deadline || Stopping()) {
        parts_.GatherFailed(job.tree, job.path, job.seq,
                            Status(Code::kTimeout, "the part of " + links_->AddressOf(rank) +
                                                       " was not replicated in time"));
        return;
      }
      // Meanwhile this node's own hand-overs go on (G10): another node gathering a
      // checkpoint may be waiting for this node's part, handed over from this queue.
      std::optional<Job> own_job;
      {
        MutexLock lock(&mu_);
        auto it = std::find_if(own_.begin(), own_.end(),
                               [](const Job& j) { return j.kind == Job::kHand; });
        if (it != own_.end()) {
          own_job = std::move(*it);
          own_.erase(it);
        } else {
          cv_.wait_for(lock.native(), options_.poll, [this] {
            mu_.AssertHeld();
            return stop_;
          });
        }
      }
      if (own_job) RunOwn(*own_job);
    }
  }
  if (!parts_.CommitGathered(job.tree, job.path, job.seq, parts).ok()) return;
  {
    MutexLock lock(&mu_);
    Recorded r{job.path, job.seq, *own, /*parts=*/true, {}};
    for (const MemPart& p : parts) r.part_ranks.push_back(p.rank);
    record_[job.tree] = std::move(r);
    ++stats_.handed;
  }
  WriteRecord();
  TellCommitted(job.tree, job.path, job.seq);
}

bool MemoryReplicator::PartsStillHeld(const std::string& tree, const Recorded& r) {
  const std::string name = "part/" + std::to_string(options_.self) + "/" + UnitName(tree, r.path);
  for (uint32_t rank : r.part_ranks) {
    Result<std::string> text = FetchAll(rank, name, r.seq);
    if (text.ok() || text.status().code() != Code::kNotFound) continue;  // held, or unknown
    // Its writer answers and has no part of it: the writer restarted and no node gave its
    // part back (the holder lost it too). What is left here is never served partly.
    parts_.Lose(tree, r.path, r.seq,
                "the part rank " + std::to_string(rank) + " (" + links_->AddressOf(rank) +
                    ") wrote is gone from it and from its holder (" + text.status().ToString() +
                    ")");
    {
      MutexLock lock(&mu_);
      auto it = record_.find(tree);
      if (it != record_.end() && it->second.seq == r.seq) record_.erase(it);
    }
    WriteRecord();
    TellLost(tree, r.path, r.seq);
    return false;
  }
  return true;
}

void MemoryReplicator::TellLost(const std::string& tree, const std::string& path, uint64_t seq) {
  const std::string lost = "lost/" + std::to_string(options_.self) + "/" + UnitName(tree, path);
  const auto until = Clock::now() + options_.hand_over_wait;
  ForEachOtherRank(options_.nodes, options_.self, kFanOutWidth, [&](uint32_t rank) {
    char reply[8];
    while (true) {
      Result<size_t> got = Fetch(rank, lost, seq, 0, std::span<char>(reply, sizeof(reply)));
      const bool again =
          !got.ok() && (ConnectionLost(got.status()) || got.status().code() == Code::kBusy);
      if (!again || Clock::now() >= until || Stopping()) {
        if (!got.ok()) {
          spdlog::warn(
              "memory-only checkpoint {}/{}: {} was not told it is lost: {} (it keeps "
              "its part until the tree's next commit)",
              tree, path, links_->AddressOf(rank), got.status().ToString());
        }
        break;
      }
      MutexLock lock(&mu_);
      cv_.wait_for(lock.native(), std::chrono::milliseconds(200), [this] {
        mu_.AssertHeld();
        return stop_;
      });
    }
  });
}

void MemoryReplicator::TellCommitted(const std::string& tree, const std::string& path,
                                     uint64_t seq) {
  // Every other node lists it too (its part committed, the others' files remote there).
  const std::string done = "done/" + std::to_string(options_.self) + "/" + UnitName(tree, path);
  const auto until = Clock::now() + kMirrorWait;
  ForEachOtherRank(options_.nodes, options_.self, kFanOutWidth, [&](uint32_t rank) {
    char reply[8];
    Result<size_t> got =
        FetchRetrying(rank, done, seq, std::span<char>(reply, sizeof(reply)), until);
    if (!got.ok()) {
      spdlog::warn("memory-only checkpoint {}/{}: {} was not told of its commit: {}", tree, path,
                   links_->AddressOf(rank), got.status().ToString());
    }
  });
}

Status MemoryReplicator::ApplyFrom(const Job& job) {
  CKPT_ASSIGN_OR_RETURN(std::string text,
                        FetchAll(job.origin, "whole/" + UnitName(job.tree, job.path), job.seq));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_array()) return Corrupt("memory whole: unreadable listing");
  std::vector<MemRemoteFile> files;
  try {
    for (const nlohmann::json& e : j) {
      MemRemoteFile f;
      CKPT_ASSIGN_OR_RETURN(f.file, Unhex(e.at("name").get<std::string>()));
      CKPT_ASSIGN_OR_RETURN(f.size, UnsignedField(e, "size"));
      CKPT_ASSIGN_OR_RETURN(const uint64_t rank, UnsignedField(e, "rank", UINT32_MAX));
      f.rank = static_cast<uint32_t>(rank);
      f.holder = e.at("holder").get<std::string>();
      f.tree = job.tree;
      f.unit = job.path;
      f.seq = job.seq;
      if (f.rank >= options_.nodes) return Corrupt("memory whole: bad rank");
      files.push_back(std::move(f));
    }
  } catch (const nlohmann::json::exception& e) {
    return Corrupt(std::string("memory whole: malformed listing: ") + e.what());
  }
  CKPT_RETURN_IF_ERROR(parts_.ApplyCommit(job.tree, job.path, job.seq, files, options_.self));
  // This node's part is a committed checkpoint now: recorded, checked while idle.
  std::string holder;
  for (const MemCheckpoint& c : tier_->Checkpoints()) {
    if (c.tree == job.tree && c.in_tree == job.path) holder = c.holder;
  }
  if (!holder.empty()) {
    {
      MutexLock lock(&mu_);
      record_[job.tree] = Recorded{job.path, job.seq, holder};
    }
    WriteRecord();
  }
  return Status::Ok();
}

}  // namespace ckptfs::store::peer
