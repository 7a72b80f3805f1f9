#include "store/publish/commit_gate.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "common/path.h"
#include "store/dcp/commit_names.h"
#include "store/dcp/dcp_metadata.h"
#include "store/dcp/metadata_file.h"
#include "store/publish/tracker_text.h"
#include "store/safetensors_index.h"

namespace ckptfs::store {
namespace {

constexpr auto kMaxBackoff = std::chrono::milliseconds(2000);
// How long a shard whose node did not answer is asked again before it is polled.
constexpr auto kSilentPeerWait = std::chrono::milliseconds(3000);

}  // namespace

Status CommitGate::Load(const JournalEntry& e, Pending* p) {
  p->seq = e.seq;
  p->need.clear();
  p->by_order = false;
  p->backoff = std::chrono::milliseconds(50);
  p->deadline = std::chrono::steady_clock::now() + options_.timeout;
  p->next_poll = {};
  p->polled.clear();
  p->unanswered.clear();
  p->silent_since.clear();
  const CommitKind kind = CommitKindOf(e.path);
  if (kind == CommitKind::kSafetensorsSingle) {
    // The whole checkpoint is this one file: its own durable bytes are all it needs.
    p->by_order = true;
    return Status::Ok();
  }
  // A publish reads its durable temp file; a rename reads the name being renamed, which
  // every earlier entry (its own publish among them) has already put in place.
  Result<std::string> bytes = ReadMetadataBytes(dir_, e.from);
  if (!bytes.ok()) return bytes.status();
  const std::string dir = path::Parent(e.path);
  const std::string_view name = path::Basename(e.path);
  if (kind == CommitKind::kSafetensorsIndex) {
    // A shard counts once it is durable under its real name; its length is its own
    // header's business (the index names no lengths), so any valid file is long enough.
    auto files = ParseSafetensorsIndex(*bytes);
    if (!files.ok()) {
      spdlog::warn("checkpoint {}: {} not understood ({}); committing by order only", dir, name,
                   files.status().ToString());
      p->by_order = true;
      return Status::Ok();
    }
    for (const std::string& file : *files) {
      p->need[path::Join(dir, file)] = kMinSafetensorsBytes;
    }
    return Status::Ok();
  }
  // `.metadata`, or a rank's own `__{rank}.metadata` (no-collectives save), which names
  // that rank's shards only.
  auto md = ParseDcpMetadata(*bytes);
  if (!md.ok()) {
    spdlog::warn("checkpoint {}: {} not understood ({}); committing by order only", dir, name,
                 md.status().ToString());
    p->by_order = true;
    return Status::Ok();
  }
  for (const auto& [file, min_len] : RequiredFileLengths(*md)) {
    p->need[path::Join(dir, file)] = min_len;
  }
  return Status::Ok();
}

namespace {
// DCP names rank r's files `[prefix]__{r}_{n}.distcp`, n counting from 0: this is rank 0's
// first (rank 10's ends in `__10_0.distcp`).
bool IsRankZeroFirstFile(const std::string& path) {
  static constexpr std::string_view kName = "__0_0.distcp";
  return std::string_view(path).ends_with(kName);
}

bool IsShardName(const std::string& path) {
  constexpr std::string_view kExt = ".distcp";
  return path.size() > kExt.size() &&
         std::string_view(path).substr(path.size() - kExt.size()) == kExt;
}
}  // namespace

bool CommitGate::IsOrderedEntry(const JournalEntry& e) {
  switch (e.op) {
    case OpType::kPublish:
    case OpType::kRename:
      // Shards and commits are ordered by the `.metadata` gate itself.
      return !IsShardName(e.path) && !IsCommitName(e.path);
    case OpType::kUnlink:
    case OpType::kRmdir:
      return true;
    default:
      return false;
  }
}

void CommitGate::NoteApplied(const JournalEntry& e, const Status& st) {
  if (st.ok() && e.op == OpType::kRmdir) {  // nothing left there to wait for
    MutexLock lock(&mu_);
    std::erase_if(foreign_, [&](const auto& f) { return path::IsAtOrBelow(f.first, e.path); });
    std::erase_if(commits_here_, [&](const auto& d) { return path::IsAtOrBelow(d, e.path); });
    return;
  }
  if (!st.ok() || (e.op != OpType::kPublish && e.op != OpType::kRename)) return;
  MutexLock lock(&mu_);
  if (IsShardName(e.path)) {
    const std::string dir = path::Parent(e.path);
    // Rank 0's first file: DCP's rank 0 writes the `.metadata` too, through this mount, so
    // this journal orders it against every entry of this node (an entry the application
    // made after the `.metadata` is appended after it here): no entry here waits for it
    // (CheckOrdered), though a node declared dead still gives it up.
    if (IsRankZeroFirstFile(e.path)) {
      if (commits_here_.size() >= 4096) commits_here_.erase(commits_here_.begin());
      commits_here_.insert(dir);
    }
    // The shard's last write, on this node's clock, is before any `.metadata` that
    // commits it and after one left by an earlier save into the same directory. The
    // earliest shard of the round counts: the widest margin against clocks that differ.
    // A rename carries no time (0), and a time in the future (a utimens) cannot be
    // trusted: any `.metadata` then counts, as before.
    double since = e.op == OpType::kPublish && e.mtime_sec > 0
                       ? EpochSeconds(e.mtime_sec, e.mtime_nsec)
                       : 0;
    const double now = std::chrono::duration<double>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
    if (since > now) since = 0;
    auto [it, made] = foreign_.try_emplace(dir, since);
    if (!made) it->second = std::min(it->second, since);
  } else if (IsCommitName(e.path)) {
    foreign_.erase(path::Parent(e.path));
    commits_here_.erase(path::Parent(e.path));
  }
}

CommitCheck CommitGate::Check(const JournalEntry& e, const QueuedPublishes* queued) {
  // A commit makes a `.metadata` appear; the unlink of one (an `rm -r` of an older
  // checkpoint) is an ordered entry like any other (it was read as a commit of the root).
  if (IsCommitName(e.path) && (e.op == OpType::kPublish || e.op == OpType::kRename)) {
    return CheckCommit(e, queued);
  }
  std::vector<std::string> to_ask;
  uint64_t round = 0;
  CommitCheck check;
  {
    MutexLock lock(&mu_);
    check = CheckOrdered(e, queued, &to_ask);
    if (!to_ask.empty()) {
      round = ++ordered_round_ | kOrderedRound;
      ordered_round_out_ = true;
      ordered_round_paths_ = to_ask;
    }
  }
  if (round != 0 && !peers_->AskCoordinator(to_ask, options_.peer_hold, this, round)) {
    // This node commits them, or cannot ask now: the backing store tells, and the next
    // round asks again (the node learns who commits a checkpoint when it is asked).
    MutexLock lock(&mu_);
    ordered_round_out_ = false;
  }
  return check;
}

CommitCheck CommitGate::CheckOrdered(const JournalEntry& e, const QueuedPublishes* queued,
                                     std::vector<std::string>* to_ask) {
  // mu_ held by Check().
  const auto now = std::chrono::steady_clock::now();
  if (ordered_.seq != e.seq) {
    ordered_.seq = e.seq;
    ordered_.backoff = std::chrono::milliseconds(50);
    ordered_.deadline = now + options_.timeout;
  }
  // The text of a tracker candidate, read once (empty: unreadable, or not a tracker).
  std::optional<std::string> text;
  auto names = [&](const std::string& ckpt) {
    // A tracker names a checkpoint of its own directory (TrackerNames): a small file
    // elsewhere never does, readable or not (the two-node strict soak: every rename of
    // logs/*.tmp, whose source the publisher had not placed yet, waited a whole commit
    // timeout for the trainer's checkpoint, with 1,600 entries behind it).
    if (path::Parent(ckpt) != path::Parent(e.path)) return false;
    if (!text) {
      Result<std::string> t = TrackerText(dir_, e);
      text = t.ok() ? *t : std::string();
    }
    return text->empty() || TrackerNames(*text, e.path, ckpt);
  };
  for (auto it = foreign_.begin(); it != foreign_.end();) {
    const std::string& ckpt = it->first;
    // The checkpoint itself or inside it (its `.metadata.tmp`, written before the rename
    // that commits it; the deletion of a checkpoint that never committed): no order to
    // keep.
    if (e.path.compare(0, ckpt.size(), ckpt) == 0 &&
        (e.path.size() == ckpt.size() || e.path[ckpt.size()] == '/')) {
      ++it;
      continue;
    }
    // Its `.metadata` is this node's to write (rank 0's first file was published here, or
    // is queued behind this entry): this journal orders it, nothing waits for it.
    // Only a dead node gives it up here (below), before its `.metadata` is written. A
    // tracker that names it still waits, as anywhere: written before that `.metadata` (a
    // save that failed), it names a checkpoint that may never commit, and it is withheld
    // if that is given up (G4). One that cannot be read waits too.
    // Or rank 0's first file was written here and deleted before it was published (an
    // `rm -r` of the save in flight): this node was to commit it and never will.
    const std::string rank0 = path::Join(ckpt, "__0_0.distcp");
    const bool here_dir = commits_here_.count(ckpt) > 0 ||
                          (queued != nullptr && queued->PublishQueued(rank0)) ||
                          (host_ != nullptr && host_->DeletedLocally(rank0));
    const bool here = here_dir && (!IsTrackerCandidate(e) || !names(ckpt));
    if (here && (peers_ == nullptr || peers_->LostPeers().empty())) {
      ++it;
      continue;
    }
    ++stats_.ordered_polls;
    // Only a `.metadata` made since this node's shards: one from an earlier save into the
    // same directory does not commit this one.
    if (Result<struct stat> md = dir_->Stat(path::Join(ckpt, ".metadata"));
        md.ok() && CtimeSeconds(*md) >= it->second) {
      it = foreign_.erase(it);
      // Another node's commit: held deletions may go. Not this node's own (polled only
      // while a peer is lost): its journal reports it when it applies it, in order
      // (Publication::NoteApplied). Counted here too, a commit made before a later give-up
      // ended that give-up's hold, and the rotation's `rm -r` went under the older tracker
      // (the two-node soak, seed 6001: 849's and 850's `.metadata` polled after 851 was
      // given up; "a rotated checkpoint is gone before the tracker KEEP ahead", "the
      // tracker names a checkpoint with no .metadata").
      if (options_.hold != nullptr && !here_dir) options_.hold->Committed();
      continue;
    }
    // A directory gone from the backing store (deleted by its writer) has nothing left
    // to commit.
    if (dir_->Stat(ckpt).status().code() == Code::kNotFound) {
      it = foreign_.erase(it);
      continue;
    }
    // The coordinator (the node that writes `.metadata`) is asked, not only the backing
    // store: it knows the commit failed (given up there, its `.metadata` dropped) before
    // this node could, as this node may never have talked to the node that died; and its
    // answer is held while the `.metadata` is pending there, so the wait ends when it
    // lands, not at the next poll.
    if (peers_ != nullptr && !here) {
      const std::string md = path::Join(ckpt, ".metadata");
      if (auto a = ordered_answers_.find(md); a != ordered_answers_.end()) {
        const PeerShardAnswer answer = a->second;
        ordered_answers_.erase(a);
        const ShardState state = answer.status.state;
        if (!answer.unreachable && (state == ShardState::kFailed || state == ShardState::kDropped)) {
          const std::string dir = ckpt;
          it = foreign_.erase(it);
          ++stats_.given_up;
          ++stats_.coordinator_failed;
          spdlog::error("checkpoint {}: given up: its .metadata {} on the node that commits it",
                        dir, state == ShardState::kFailed ? "failed" : "was deleted");
          if (host_ != nullptr) {
            host_->GaveUp(dir, std::string("its .metadata ") +
                                   (state == ShardState::kFailed ? "failed" : "was deleted") +
                                   " on the node that commits it");
          }
          continue;
        }
      }
      if (!ordered_round_out_ && now >= ordered_next_ask_) {
        to_ask->push_back(md);
      }
    }
    // A node is declared dead and the `.metadata` is not there: the save failed with it (its
    // ranks could not finish, so no coordinator publishes it). Given up now instead of at
    // the commit timeout; a tracker naming it is withheld (Publication), everything else
    // goes on. A live coordinator slower than a node's death is taken as failed too.
    if (peers_ != nullptr) {
      if (std::string lost = peers_->LostPeers(); !lost.empty()) {
        const std::string dir = ckpt;
        it = foreign_.erase(it);
        ++stats_.given_up;
        spdlog::error("checkpoint {}: given up: its .metadata never appeared and a node was "
                      "declared dead: {}", dir, lost);
        if (host_ != nullptr) host_->GaveUp(dir, "declared dead: " + lost);
        continue;
      }
    }
    // The `.metadata` did not come within the commit timeout (the save failed in the
    // application: a rank killed or an exception between its shards and the commit): the
    // checkpoint is given up once, as a dead node's is, instead of holding every later
    // entry of this node for another timeout each. A tracker naming it is withheld, and
    // deletions of committed checkpoints behind it wait for a later commit (DeletionHold).
    if (now > ordered_.deadline) {
      const std::string dir = ckpt;
      it = foreign_.erase(it);
      ++stats_.given_up;
      ++stats_.ordered_timeouts;
      ordered_.deadline = now + options_.timeout;  // for what else it waits for
      spdlog::error("checkpoint {}: given up: its .metadata did not appear on the backing "
                    "store within the commit timeout ({} s; or only one older than this "
                    "node's shards of it), while {} waited for it",
                    dir, std::chrono::duration<double>(options_.timeout).count(),
                    e.Describe());
      if (host_ != nullptr) {
        host_->GaveUp(dir, "its .metadata did not appear within the commit timeout");
      }
      continue;
    }
    spdlog::debug("journal: {} waits for the .metadata of {}, published by another node",
                  e.Describe(), ckpt);
    if (!to_ask->empty()) {
      ++stats_.coordinator_queries;
      ordered_next_ask_ = now + ordered_.backoff;
    }
    CommitCheck check = CommitCheck::Wait({}, ordered_.backoff);
    ordered_.backoff = std::min(kMaxBackoff, ordered_.backoff * 2);
    // A synchronous caller (strict mode) must not wait: it may be the one whose later
    // write commits that checkpoint.
    check.waits_for_unwritten = true;
    return check;
  }
  ordered_.seq = 0;
  return Status::Ok();
}

CommitCheck CommitGate::CheckCommit(const JournalEntry& e, const QueuedPublishes* queued) {
  std::vector<std::string> to_ask;  // a round to start, once mu_ is released
  uint64_t round = 0;
  CommitCheck check;
  {
    MutexLock lock(&mu_);
    if (current_.seq != e.seq) {
      answers_.clear();  // another commit's
      Status st = Load(e, &current_);
      if (!st.ok()) {
        current_.seq = 0;
        return st;
      }
    }
    Pending& p = current_;
    if (p.by_order) return Status::Ok();
    const auto now = std::chrono::steady_clock::now();
    const bool poll = now >= p.next_poll;
    bool remote = false;     // waits for a shard not queued or open here (set after the loop)
    bool open_here = false;  // ... or for one open for writing here, not yet closed
    bool polling = false;    // ... judged by polling the backing store
    bool on_peers = false;   // ... waiting for a peer's answer
    std::vector<std::string> waiting;
    // The application removed or moved this directory after the commit (rm -r, mkdir, a
    // save into the new one): the mount's files at these names now belong to another
    // incarnation of it. Only this incarnation's own queued publishes are waited for (as
    // the journal's queue tells them apart), never a file open or rewritten there.
    size_t mine_waiting = 0;  // of `waiting`, those queued or open here
    size_t asking = 0;        // of `waiting`, those whose peers' first answer is still out,
                              // or whose node could not be asked (Pending::unanswered)
    bool lost_checked = false;  // the peers declared dead, asked once per check
    std::string lost_now;
    const DirectoryEnd end = queued != nullptr
                                 ? queued->DirectoryEndsAfter(e.seq, path::Parent(e.path))
                                 : DirectoryEnd{};
    for (auto it = p.need.begin(); it != p.need.end();) {
      const std::string& path = it->first;
      const uint64_t min_len = it->second;
      // The next save's rewrite, over a version published here that this commit names.
      bool replaced = false;
      bool is_queued = false, is_open = false;
      if (end.seq != 0) {
        is_queued = queued->VersionQueued(path, e.seq, end.seq);
      } else {
        if (host_ != nullptr && host_->RewrittenSince(path, e.seq)) {
          std::optional<uint64_t> len = host_->PublishedLength(path);
          replaced = len && *len >= min_len;
        }
        is_queued = !replaced && queued != nullptr && queued->PublishQueued(path);
        is_open = !replaced && !is_queued && host_ != nullptr && host_->WrittenLocally(path);
      }
      const bool mine = is_queued || is_open;
      open_here = open_here || is_open;
      if (!mine && host_ != nullptr && host_->DeletedLocally(path)) {
        return Refuse(e, Status(Code::kAborted,
                      "shard " + path + " was deleted or aborted before it was published"));
      }
      if (mine) {
        waiting.push_back(path);
        ++mine_waiting;
        ++it;
        continue;
      }
      bool polled = p.polled.count(path) > 0;
      // Answered just now by a reachable node that does not vouch for it (unknown, failed
      // there, shorter): the backing store is looked at now, not at the polls' pace (below).
      bool just_answered = false;
      // a. Published through this mount.
      if (!polled && host_ != nullptr) {
        std::optional<uint64_t> len = host_->PublishedLength(path);
        if (len && *len >= min_len) {
          if (Confirm(path, min_len)) {
            it = p.need.erase(it);
            continue;
          }
          p.polled.insert(path);
          polled = true;
        }
      }
      // b. The other daemons.
      if (!polled && peers_ != nullptr) {
        auto a = answers_.find(path);
        if (a == answers_.end()) {
          // Not asked yet (or the round is still out): no backing-store access meanwhile.
          if (!round_out_ || round_seq_ != e.seq) to_ask.push_back(path);
          on_peers = true;
          waiting.push_back(path);
          ++asking;
          ++it;
          continue;
        }
        const PeerShardAnswer answer = a->second;
        answers_.erase(a);
        const ShardState state = answer.status.state;
        if (state == ShardState::kDurable && answer.status.length >= min_len) {
          if (Confirm(path, min_len)) {
            ++stats_.peer_confirmed;
            it = p.need.erase(it);
            continue;
          }
          spdlog::debug("commit gate: a peer has {} durable with {} bytes; the backing store "
                        "does not show it yet: polling it",
                        path, answer.status.length);
        } else if (state == ShardState::kPending) {
          to_ask.push_back(path);  // the next round waits on the peer
          on_peers = true;
          waiting.push_back(path);
          ++it;
          continue;
        } else if ((state == ShardState::kDropped || state == ShardState::kFailed) &&
                   !answer.unreachable) {
          // Its writer will never publish it: deleted before it was, or its publication
          // failed for good there (strict mode: an EIO, ENOSPC after the caller's early
          // return). Whatever the backing store shows at that name is another save's
          // version or an unsynced one: the checkpoint is refused now, not polled until the
          // commit timeout while the application saves on (a re-save of the shard answers
          // pending or durable, and its own `.metadata` commits).
          ++stats_.peer_refused;
          return Refuse(e, Status(Code::kAborted,
                        "shard " + path +
                            (state == ShardState::kFailed
                                 ? " failed to publish on the node that wrote it"
                                 : " was deleted on the node that wrote it before it was "
                                   "published")));
        }
        p.polled.insert(path);
        if (answer.unreachable) p.unanswered.insert(path);
        just_answered = !answer.unreachable && state != ShardState::kDurable;
      }
      // c. Polled on the backing store. One whose node did not answer counts as still
      // asked: a strict caller waits for it (it returning early let a tracker behind the
      // commit return unpublished, which a kill then lost: the two-node strict soak, seed
      // 4103, a first incarnation whose handshakes never finished), until the store shows
      // it, the node is declared dead (given up, below) or the commit times out.
      polling = true;
      const bool unanswered = p.unanswered.count(path) > 0;
      // A node that answers "unknown" may be a restarted one whose previous run published
      // the shard: the store is looked at once at the answer, before a strict caller is let
      // go as for a shard nobody has written. Waiting for the next poll let a strict close
      // of `.metadata` return uncommitted, with the tracker and the next save behind it,
      // and the node's kill 1.2 s later lost all three (the kill-heavy strict two-node
      // soak, seed 6104: the poll was due 1.6 s after the restarted peer's answer).
      if (!poll && !just_answered) {
        waiting.push_back(path);
        asking += unanswered;
        ++it;
        continue;
      }
      // A node that did not answer may be the one that wrote it, and may have lost it (a
      // daemon killed before its publish, restarting: its next run answers "failed",
      // LostPublishes). What the backing store shows at that name may then be an earlier
      // save's version: asked again, at the polls' pace, not taken from the store, for
      // kSilentPeerWait (a restart answers within it), or until that node is declared
      // dead; then polled, where an earlier save's file is still refused (EarlierSave).
      // The two-node async soak, seed 5701: a `.metadata` committed over a shard that
      // died with its node. Bounded: waiting until a silent node is declared dead held a
      // strict two-node run's publication for 15 s (seed 5801).
      if (unanswered && peers_ != nullptr) {
        if (!lost_checked) {
          lost_now = peers_->LostPeers();
          lost_checked = true;
        }
        const auto first = p.silent_since.try_emplace(path, now).first->second;
        if (lost_now.empty() && now - first < kSilentPeerWait) {
          // Not polled after all: this same path goes through a and b again, where it is
          // asked as one not asked yet (the answer was taken).
          p.polled.erase(path);
          p.unanswered.erase(path);
          continue;
        }
      }
      ++stats_.commit_polls;
      auto st = dir_->Stat(path);
      if (st.ok() && static_cast<uint64_t>(st->st_size) >= min_len) {
        if (std::optional<std::string> why = EarlierSave(e, path, *st)) {
          ++stats_.earlier_saves;
          return Refuse(e, Status(Code::kAborted, *why));
        }
        it = p.need.erase(it);
        continue;
      }
      // No live node writes it or has published it, the backing store does not show it,
      // and a node is declared dead: it was that node's. The checkpoint is given up now,
      // not at the commit timeout, and nothing halts (docs/SEMANTICS.md, "A lost node").
      if (peers_ != nullptr) {
        if (std::string lost = peers_->LostPeers(); !lost.empty()) {
          current_.seq = 0;
          ++stats_.given_up;
          return Status(Code::kNodeLost, "shard " + path + " is on no live node and not on "
                                         "the backing store; declared dead: " + lost);
        }
      }
      waiting.push_back(path);
      asking += unanswered;
      ++it;
    }
    if (waiting.empty()) {
      current_.seq = 0;
      return Status::Ok();
    }
    // Only a shard still missing counts: one confirmed on the backing store this round
    // (a rewrite's earlier version) waits for nobody.
    remote = waiting.size() > mine_waiting;
    const bool answered_remote = waiting.size() > mine_waiting + asking;  // see below
    if (remote && now > p.deadline) {
      std::string first = waiting.front();
      current_.seq = 0;
      return Status(Code::kTimeout, "shard " + first + " never became durable with " +
                                        std::to_string(p.need[first]) + " bytes");
    }
    if (polling && poll) {
      p.next_poll = now + p.backoff;
      p.backoff = std::min(kMaxBackoff, p.backoff * 2);
    }
    if (!to_ask.empty()) {
      round = ++round_;
      round_seq_ = e.seq;
      round_out_ = true;
      round_paths_ = to_ask;
      ++stats_.peer_commit_queries;
      stats_.peer_commit_paths += to_ask.size();
    }
    // Own shards wake the journal when they are queued or applied, a round's answers
    // through `wake`; the recheck bounds the rest.
    auto recheck = std::chrono::milliseconds(1000);
    if (polling) {
      recheck = std::min(recheck, std::chrono::duration_cast<std::chrono::milliseconds>(
                                      p.next_poll - now));
    }
    if (on_peers) recheck = std::min(recheck, options_.peer_recheck);
    check = CommitCheck::Wait(std::move(waiting), std::max(recheck, std::chrono::milliseconds(1)));
    // Only the application can close what it holds open: a strict close() or fsync() of
    // the `.metadata` must not wait for that (G10). Shards another node wrote are asked
    // about first: until the peers' first answer (bounded: the query's hold and
    // --peer-timeout) a strict caller waits, as in DCP they are durable by then (each rank's
    // strict close returned before rank 0 wrote the `.metadata`); it returns early only for
    // a shard still pending there, not asked, or polled. (Early on the first round, a
    // strict tracker behind the commit returned before it was applied, and a kill lost it:
    // the two-node strict soak, seed 4101.)
    check.waits_for_unwritten = answered_remote || open_here;
  }
  if (round != 0) {
    const bool asked = peers_->AskShardStates(to_ask, options_.peer_hold, this, round);
    if (!asked) {
      // No peers to ask: those shards are polled, from the next check on (now).
      MutexLock lock(&mu_);
      if (round_ == round) round_out_ = false;
      if (current_.seq == e.seq) {
        for (const std::string& path : to_ask) current_.polled.insert(path);
      }
      check.recheck = std::chrono::milliseconds(1);
    }
  }
  return check;
}

std::optional<std::string> CommitGate::EarlierSave(const JournalEntry& e,
                                                   const std::string& path,
                                                   const struct stat& st) const {
  if (!options_.save_began) return std::nullopt;
  const std::optional<double> began = options_.save_began(path::Parent(e.path));
  if (!began) return std::nullopt;
  const double mtime =
      static_cast<double>(st.st_mtim.tv_sec) + static_cast<double>(st.st_mtim.tv_nsec) * 1e-9;
  if (mtime >= *began - kEarlierSaveSlack) return std::nullopt;
  return fmt::format("shard {} on the backing store is an earlier save's (written {:.1f} s "
                     "before this save began here) and no node writes this save's",
                     path, *began - mtime);
}

void CommitGate::Forget(const std::string& dir) {
  MutexLock lock(&mu_);
  foreign_.erase(dir);
  commits_here_.erase(dir);
}

Status CommitGate::Refuse(const JournalEntry& e, Status why) {
  current_.seq = 0;
  // This node's own commit of the directory is decided: entries ordered after it stop
  // waiting for its `.metadata` (a tracker naming it is withheld by the host, G4).
  foreign_.erase(path::Parent(e.path));
  return why;
}

bool CommitGate::Confirm(const std::string& path, uint64_t min_len) {
  ++stats_.confirm_stats;
  auto st = dir_->Stat(path);
  return st.ok() && static_cast<uint64_t>(st->st_size) >= min_len;
}

void CommitGate::OnPeerShardAnswers(uint64_t round, std::vector<PeerShardAnswer> answers) {
  // Block CRCs that came with durable answers, handed on after the lock.
  std::vector<std::pair<std::string, std::shared_ptr<const ShardChecksums>>> sums;
  {
    MutexLock lock(&mu_);
    if ((round & kOrderedRound) != 0) {
      // The coordinator's answers about other nodes' `.metadata` (CheckOrdered).
      if ((round & ~kOrderedRound) != ordered_round_) return;
      ordered_round_out_ = false;
      const std::vector<std::string> paths = std::move(ordered_round_paths_);
      ordered_round_paths_.clear();
      for (size_t i = 0; i < paths.size(); ++i) {
        ordered_answers_[paths[i]] = i < answers.size() ? answers[i] : PeerShardAnswer{{}, true};
        ordered_answers_[paths[i]].status.checksums.reset();
      }
    } else {
    if (round != round_) return;  // a later round replaced it (another commit)
    round_out_ = false;
    const std::vector<std::string> paths = std::move(round_paths_);
    round_paths_.clear();
    for (size_t i = 0; i < paths.size(); ++i) {
      PeerShardAnswer a = i < answers.size() ? answers[i] : PeerShardAnswer{{}, true};
      switch (a.status.state) {
        case ShardState::kDurable:
          ++stats_.answers_durable;
          if (a.status.checksums) {
            ++stats_.peer_checksums;
            sums.emplace_back(paths[i], a.status.checksums);
          }
          break;
        case ShardState::kPending:
          ++stats_.answers_pending;
          break;
        case ShardState::kDropped:
          ++stats_.answers_dropped;
          break;
        case ShardState::kFailed:
          ++stats_.answers_failed;
          break;
        case ShardState::kUnknown:
          ++(a.unreachable ? stats_.answers_unreachable : stats_.answers_unknown);
          break;
      }
      a.status.checksums.reset();  // handed on below; the gate needs the state only
      if (round_seq_ == current_.seq) answers_[paths[i]] = a;
    }
    }
  }
  if (host_ != nullptr) {
    // Before the wake: the commit this round gates is built from them once applied.
    for (auto& [path, checksums] : sums) host_->OnPeerChecksums(path, std::move(checksums));
    host_->WakeGate();
  }
}

uint64_t CommitGate::remote_polls() const {
  MutexLock lock(&mu_);
  return stats_.commit_polls + stats_.ordered_polls;
}

CommitGateStats CommitGate::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

void CommitGateStats::AppendJson(nlohmann::json* out) const {
  nlohmann::json& j = *out;
  j["remote_polls"] = commit_polls + ordered_polls;
  j["peer_commit_queries"] = peer_commit_queries;
  j["commit_gate"] = {{"remote_polls", commit_polls + ordered_polls},
                      {"commit_polls", commit_polls},
                      {"ordered_polls", ordered_polls},
                      {"confirm_stats", confirm_stats},
                      {"peer_commit_queries", peer_commit_queries},
                      {"peer_commit_paths", peer_commit_paths},
                      {"peer_commit_answers",
                       {{"durable", answers_durable},
                        {"pending", answers_pending},
                        {"dropped", answers_dropped},
                        {"failed", answers_failed},
                        {"unknown", answers_unknown},
                        {"unreachable", answers_unreachable}}},
                      {"peer_checksums", peer_checksums},
                      {"peer_confirmed", peer_confirmed},
                      {"given_up", given_up},
                      {"ordered_timeouts", ordered_timeouts},
                      {"coordinator_queries", coordinator_queries},
                      {"coordinator_failed", coordinator_failed},
                      {"peer_refused", peer_refused},
                      {"earlier_saves", earlier_saves}};
}

}  // namespace ckptfs::store
