#include "store/cache/retained_tier.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "common/path.h"
#include "store/cache/backing_source.h"
#include "store/cache/retained_tier_parts.h"
#include "store/dcp/commit_names.h"
#include "store/primitives/crc32c.h"

namespace ckptfs::store {
namespace {

// The spare chunks the staging pool keeps for its next loan: they count against the budget.
uint64_t SparesOf(const ChunkLender* lender) {
  return lender != nullptr ? lender->spare_bytes() : 0;
}

}  // namespace

bool RetainedTier::KeyLess::operator()(const Key& a, const Key& b) const {
  if (int c = a.id.path.compare(b.id.path); c != 0) return c < 0;
  if (a.id.size != b.id.size) return a.id.size < b.id.size;
  if (a.id.mtime_ns != b.id.mtime_ns) return a.id.mtime_ns < b.id.mtime_ns;
  return a.index < b.index;
}

RetainedTier::RetainedTier(BackingDir* backing, const RetainedTierOptions& options)
    : backing_(backing), opts_(options) {
  MutexLock lock(&mu_);
  stats_.budget_bytes = opts_.budget_bytes;
}

RetainedTier::~RetainedTier() { DropAll(); }

std::chrono::steady_clock::time_point RetainedTier::Now() const {
  return clock_ ? clock_() : std::chrono::steady_clock::now();
}

void RetainedTier::SetClockForTest(std::function<std::chrono::steady_clock::time_point()> now) {
  clock_ = std::move(now);
}

RetainedTier::Ckpt& RetainedTier::CkptLocked(const std::string& dir) {
  auto [it, inserted] = ckpts_.try_emplace(dir);
  if (inserted) {
    it->second.created = ++order_;
    it->second.last_publish = Now();
  }
  return it->second;
}

void RetainedTier::ReleaseLocked(uint64_t bytes) { used_ -= std::min(used_, bytes); }

bool RetainedTier::EvictOneLocked(const std::string& keep) {
  // Victim: a stale pending checkpoint (oldest first), else the oldest committed one.
  const auto now = Now();
  const std::string* victim = nullptr;
  bool victim_stale = false;
  uint64_t victim_order = 0;
  for (const auto& [dir, c] : ckpts_) {
    if (c.own_bytes + c.replica_bytes == 0 || (!keep.empty() && dir == keep)) continue;
    const bool stale = !c.committed && now - c.last_publish > opts_.stale_pending;
    if (!c.committed && !stale) continue;
    const uint64_t order = stale ? c.created : c.commit_order;
    if (victim == nullptr || (stale && !victim_stale) ||
        (stale == victim_stale && order < victim_order)) {
      victim = &dir;
      victim_stale = stale;
      victim_order = order;
    }
  }
  if (victim == nullptr) return false;
  const std::string dir = *victim;
  spdlog::debug("retained tier: evicting {} for room", dir);
  DropCkptLocked(dir, &stats_.evicted_bytes);
  return true;
}

bool RetainedTier::ShrinkSparesLocked(uint64_t more) {
  if (const uint64_t pool = SparesOf(opts_.lender); pool > 0) {
    const uint64_t need = used_ + more;
    opts_.lender->TrimSpares(opts_.budget_bytes > need ? opts_.budget_bytes - need : 0);
    if (SparesOf(opts_.lender) < pool) return true;
  }
  if (spare_.empty()) return false;
  spare_.pop_back();  // unmapped here: an own buffer nobody else holds
  ReleaseLocked(opts_.block_bytes);
  return true;
}

bool RetainedTier::TakeLoanRoomLocked(uint64_t bytes) {
  while (true) {
    // The loan turns a pool spare, if there is one, into the lent chunk: no more memory.
    const uint64_t pool = SparesOf(opts_.lender);
    if (used_ + bytes + (pool >= bytes ? pool - bytes : pool) <= opts_.budget_bytes) break;
    if (!ShrinkSparesLocked(bytes) && !EvictOneLocked({})) return false;
  }
  used_ += bytes;
  stats_.peak_used_bytes = std::max(stats_.peak_used_bytes, used_);
  return true;
}

std::shared_ptr<RetainedTier::Buffer> RetainedTier::TakeBufferLocked(const std::string& keep) {
  const uint64_t bs = opts_.block_bytes;
  while (spare_.empty() && used_ + SparesOf(opts_.lender) + bs > opts_.budget_bytes) {
    if (SparesOf(opts_.lender) > 0 && ShrinkSparesLocked(bs)) continue;
    if (!EvictOneLocked(keep)) return nullptr;
  }
  if (!spare_.empty()) {  // already counted in used_
    std::shared_ptr<Buffer> buf = std::move(spare_.back());
    spare_.pop_back();
    return buf;
  }
  used_ += bs;
  stats_.peak_used_bytes = std::max(stats_.peak_used_bytes, used_);
  auto buf = std::make_shared<Buffer>(bs);
  if (buf->p == nullptr) {
    ReleaseLocked(bs);
    return nullptr;
  }
  return buf;
}

void RetainedTier::RecycleLocked(std::shared_ptr<Buffer> buf) {
  if (!buf) return;
  if (buf->loan) {
    // The chunk leaves the account with its last block; its memory goes back to the
    // staging pool with its last holder (a reader may still be replying from it).
    if (--buf->loan->blocks == 0) {
      ReleaseLocked(buf->loan->bytes);
      stats_.lent_bytes -= std::min(stats_.lent_bytes, buf->loan->bytes);
    }
    return;
  }
  // Only a buffer nobody else holds (a reader replying from it, a copy in progress) can be
  // written again; any other is freed by its last holder and leaves the account now.
  if (buf.use_count() == 1 && !stopped_) {
    spare_.push_back(std::move(buf));
  } else {
    ReleaseLocked(opts_.block_bytes);
  }
}

void RetainedTier::EraseHeldLocked(std::map<Key, std::shared_ptr<Held>, KeyLess>::iterator it,
                                   uint64_t* counter) {
  const Held& h = *it->second;
  auto c = ckpts_.find(h.ckpt);
  if (c != ckpts_.end()) {
    uint64_t& bytes = h.replica ? c->second.replica_bytes : c->second.own_bytes;
    bytes -= std::min(bytes, h.len);
  }
  if (counter != nullptr) *counter += h.len;
  // A reader holding the block keeps its buffer too: then it cannot become a spare.
  std::shared_ptr<Buffer> buf =
      it->second.use_count() == 1 ? std::move(it->second->buf) : it->second->buf;
  held_.erase(it);
  RecycleLocked(std::move(buf));
}

void RetainedTier::DropPathLocked(const std::string& path, bool subtree) {
  if (!subtree) {  // the blocks of one path are adjacent (KeyLess orders by path first)
    Key first;
    first.id.path = path;
    first.id.mtime_ns = INT64_MIN;
    for (auto it = held_.lower_bound(first); it != held_.end() && it->first.id.path == path;) {
      EraseHeldLocked(it++, &stats_.dropped_bytes);
    }
    return;
  }
  for (auto it = held_.begin(); it != held_.end();) {
    const std::string& p = it->first.id.path;
    if (p == path || (subtree && path::IsAtOrBelow(p, path))) {
      EraseHeldLocked(it++, &stats_.dropped_bytes);
    } else {
      ++it;
    }
  }
  if (subtree) {
    for (auto it = ckpts_.begin(); it != ckpts_.end();) {
      it = path::IsAtOrBelow(it->first, path) ? ckpts_.erase(it) : std::next(it);
    }
  }
}

void RetainedTier::DropCkptLocked(const std::string& dir, uint64_t* counter) {
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->second->ckpt == dir) {
      EraseHeldLocked(it++, counter);
    } else {
      ++it;
    }
  }
  ckpts_.erase(dir);
}

void RetainedTier::RenameLocked(const std::string& from, const std::string& to) {
  DropPathLocked(to, /*subtree=*/true);  // renamed over
  std::vector<std::pair<Key, std::shared_ptr<Held>>> moved;
  for (auto it = held_.begin(); it != held_.end();) {
    if (auto np = path::Rebase(it->first.id.path, from, to)) {
      Key k = it->first;
      k.id.path = *np;
      moved.emplace_back(std::move(k), std::move(it->second));
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
  std::vector<std::pair<std::string, Ckpt>> dirs;
  for (auto it = ckpts_.begin(); it != ckpts_.end();) {
    if (auto nd = path::Rebase(it->first, from, to)) {
      dirs.emplace_back(*nd, std::move(it->second));
      it = ckpts_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto& [d, c] : dirs) ckpts_[d] = std::move(c);
  for (auto& [k, h] : moved) {
    // A file moved into another directory leaves its checkpoint for the new one.
    const std::string ckpt = path::Parent(k.id.path);
    if (ckpt != h->ckpt) {
      auto old = ckpts_.find(h->ckpt);
      if (old != ckpts_.end()) {
        uint64_t& b = h->replica ? old->second.replica_bytes : old->second.own_bytes;
        b -= std::min(b, h->len);
      }
      Ckpt& c = CkptLocked(ckpt);
      (h->replica ? c.replica_bytes : c.own_bytes) += h->len;
      c.newest_mtime_ns = std::max(c.newest_mtime_ns, k.id.mtime_ns);
      h->ckpt = ckpt;
    }
    held_[std::move(k)] = std::move(h);
  }
}

void RetainedTier::CommitLocked(const std::string& dir) {
  Ckpt& c = CkptLocked(dir);
  if (c.committed) return;
  c.committed = true;
  c.commit_order = ++order_;
  ++stats_.commits;
  const uint64_t created = c.created;
  const std::string run = path::Parent(dir);
  std::vector<std::string> older;
  for (const auto& [d, o] : ckpts_) {
    if (d == dir || path::Parent(d) != run) continue;
    if (o.committed || o.created < created) older.push_back(d);
  }
  for (const std::string& d : older) DropCkptLocked(d, &stats_.dropped_bytes);
  spdlog::debug("retained tier: {} committed ({} bytes held; {} older dropped)", dir,
                ckpts_[dir].own_bytes + ckpts_[dir].replica_bytes, older.size());
}

void RetainedTier::SweepCapturesLocked() {
  for (auto it = captures_.begin(); it != captures_.end();) {
    if (it->second->target.expired()) {
      for (const auto& [i, b] : it->second->blocks) RecycleLocked(std::move(b->buf));
      it = captures_.erase(it);
    } else {
      ++it;
    }
  }
}

void RetainedTier::OnWritten(const std::shared_ptr<BlockCrcMap>& crcs, const SealedChunk& chunk) {
  const std::shared_ptr<FlushTarget>& target = chunk.target;
  if (!enabled() || chunk.length == 0 || !target || !target->retainable()) return;
  const uint64_t bs = opts_.block_bytes;
  const uint64_t offset = chunk.offset, end = offset + chunk.length;
  struct Piece {
    std::shared_ptr<Buffer> buf;
    uint64_t at;
    const void* src;
    size_t n;
    std::shared_ptr<Buffer> src_buf;  // keeps `src` mapped when it is a lent chunk's block
  };
  std::vector<Piece> pieces;
  MutexLock lock(&mu_);
  if (stopped_) return;
  // Issue 42: keep the chunk itself when the blocks that start in it (and are not held
  // yet) make up at least half of it: a chunk of mostly other blocks' pieces would hold
  // its whole size for a few bytes, and those pieces are copied instead.
  std::shared_ptr<Loan> loan;
  if (chunk.lender != nullptr && chunk.keepalive && chunk.capacity >= chunk.length) {
    uint64_t starts = 0;
    auto cap = captures_.find(target->id());
    for (uint64_t i = (offset + bs - 1) / bs; i * bs < end; ++i) {
      if (cap == captures_.end() || cap->second->blocks.count(i) == 0) {
        starts += std::min(end, (i + 1) * bs) - i * bs;
      }
    }
    if (starts > 0 && starts * 2 >= chunk.capacity && TakeLoanRoomLocked(chunk.capacity)) {
      // The pool allocates a spare when it has none: out of the lock.
      lock.Unlock();
      const bool lent = chunk.lender->Lend(chunk.data);
      lock.Lock();
      if (!lent || stopped_) {
        ReleaseLocked(chunk.capacity);
        if (stopped_) return;  // DropAll() ran meanwhile and reset the account
      } else {
        loan = std::make_shared<Loan>();
        loan->keep = chunk.keepalive;
        loan->bytes = chunk.capacity;
        ++stats_.loans;
        stats_.lent_bytes += chunk.capacity;
      }
    }
  }
  std::shared_ptr<Capture>& cap = captures_[target->id()];
  if (!cap) {
    cap = std::make_shared<Capture>();
    cap->target = target;
    cap->crcs = crcs;
  }
  for (uint64_t i = offset / bs; i * bs < end; ++i) {
    const uint64_t b = std::max(offset, i * bs), e = std::min(end, (i + 1) * bs);
    const uint64_t lo = b - i * bs, hi = e - i * bs;
    const uint8_t* src = chunk.data + (b - offset);
    std::shared_ptr<CaptureBlock>& blk = cap->blocks[i];
    if (!blk) {
      blk = std::make_shared<CaptureBlock>();
      if (loan && lo == 0) {  // kept where it is
        // Read only, ever: a block that gets more bytes becomes a copy (below).
        char* at = reinterpret_cast<char*>(const_cast<uint8_t*>(src));
        blk->buf = std::make_shared<Buffer>(loan, at, static_cast<size_t>(e - b));
        ++loan->blocks;
        blk->ranges.emplace_back(lo, hi);
        stats_.kept_bytes += e - b;
        continue;
      }
      blk->buf = TakeBufferLocked();
    }
    if (!blk->buf) {
      if (!blk->poisoned) stats_.skipped_bytes += e - b;
      continue;
    }
    auto pos = std::lower_bound(blk->ranges.begin(), blk->ranges.end(), std::make_pair(lo, hi));
    const bool overlaps = (pos != blk->ranges.end() && pos->first < hi) ||
                          (pos != blk->ranges.begin() && std::prev(pos)->second > lo);
    if (overlaps) {
      blk->poisoned = true;
      blk->ranges.clear();
      RecycleLocked(std::move(blk->buf));
      continue;
    }
    if (blk->buf->loan) {
      // Kept in a chunk that ended inside it (sealed early): it gets more bytes from this
      // one, so from here on it is a copy of its own.
      std::shared_ptr<Buffer> own = TakeBufferLocked();
      if (!own) {
        blk->poisoned = true;  // no room: not retained, counted once
        stats_.skipped_bytes += e - b;
        for (const auto& [rl, rh] : blk->ranges) stats_.skipped_bytes += rh - rl;
        blk->ranges.clear();
        RecycleLocked(std::move(blk->buf));
        continue;
      }
      for (const auto& [rl, rh] : blk->ranges) {
        pieces.push_back({own, rl, blk->buf->p + rl, static_cast<size_t>(rh - rl), blk->buf});
        stats_.captured_bytes += rh - rl;
      }
      RecycleLocked(std::exchange(blk->buf, own));
      pos = std::lower_bound(blk->ranges.begin(), blk->ranges.end(), std::make_pair(lo, hi));
    }
    pos = blk->ranges.insert(pos, {lo, hi});
    // Merge with neighbours so a fully covered block is one range.
    if (pos + 1 != blk->ranges.end() && (pos + 1)->first == pos->second) {
      pos->second = (pos + 1)->second;
      blk->ranges.erase(pos + 1);
    }
    if (pos != blk->ranges.begin() && std::prev(pos)->second == pos->first) {
      std::prev(pos)->second = pos->second;
      blk->ranges.erase(pos);
    }
    pieces.push_back({blk->buf, lo, src, static_cast<size_t>(e - b), nullptr});
    stats_.captured_bytes += e - b;
  }
  if (loan && loan->blocks == 0) {  // every block it started was poisoned meanwhile
    ReleaseLocked(loan->bytes);
    stats_.lent_bytes -= std::min(stats_.lent_bytes, loan->bytes);
  }
  lock.Unlock();
  // Chunks of one target in flight are disjoint (FlushPipeline), so these copies never
  // race with each other; the shared buffers outlive a concurrent drop.
  for (const Piece& p : pieces) std::memcpy(p.buf->p + p.at, p.src, p.n);
}

void RetainedTier::Publish(const JournalEntry& e) {
  std::shared_ptr<Capture> cap;
  {
    MutexLock lock(&mu_);
    DropPathLocked(e.path, /*subtree=*/false);  // an earlier version of the name
    auto it = captures_.find(e.target->id());
    if (it == captures_.end()) return;
    cap = std::move(it->second);
    captures_.erase(it);
  }
  Result<struct stat> st = backing_ != nullptr ? backing_->Stat(e.path)
                                               : Result<struct stat>(Status(Code::kNotFound, ""));
  std::vector<std::pair<Key, std::shared_ptr<Held>>> good;
  uint64_t unverified = 0;
  const std::string ckpt = path::Parent(e.path);
  // Only files of a checkpoint (shards, `.metadata` and its temp name): anything else
  // written through the mount would hold memory that no commit ever makes servable.
  if (st.ok() && S_ISREG(st->st_mode) && cap->crcs &&
      IsCheckpointFileName(path::Basename(e.path))) {
    const BlockId id = BlockIdFromStat(e.path, *st);
    BlockCrcMap& crcs = *cap->crcs;
    if (!crcs.finished() && id.size == e.size) crcs.Finish(e.size);
    const bool sized = crcs.finished() && crcs.size() == id.size;
    const uint64_t bs = opts_.block_bytes;
    for (auto& [i, b] : cap->blocks) {
      if (!b->buf) continue;
      const uint64_t len = i * bs < id.size ? std::min(bs, id.size - i * bs) : 0;
      std::optional<uint32_t> crc;
      if (sized && len > 0 && b->ranges.size() == 1 && b->ranges[0].first == 0 &&
          b->ranges[0].second == len) {
        crc = crcs.RangeCrc(i * bs, i * bs + len);
      }
      if (!crc) {
        ++unverified;
        continue;
      }
      auto h = std::make_shared<Held>();
      h->buf = std::move(b->buf);
      h->len = len;
      h->crc = *crc;
      h->ckpt = ckpt;
      good.emplace_back(Key{id, i}, std::move(h));
    }
  } else {
    unverified = cap->blocks.size();
  }
  MutexLock lock(&mu_);
  stats_.unverified_blocks += unverified;
  if (stopped_) return;  // DropAll() reset the account
  for (auto& [i, b] : cap->blocks) RecycleLocked(std::move(b->buf));  // those not kept
  if (good.empty()) return;
  Ckpt& c = CkptLocked(ckpt);
  c.files += 1;
  c.last_publish = Now();
  for (auto& [k, h] : good) {
    c.own_bytes += h->len;
    c.newest_mtime_ns = std::max(c.newest_mtime_ns, k.id.mtime_ns);
    auto [it, inserted] = held_.try_emplace(k, h);
    if (!inserted) {
      uint64_t& b = it->second->replica ? c.replica_bytes : c.own_bytes;
      b -= std::min(b, it->second->len);
      std::shared_ptr<Held> old = std::exchange(it->second, std::move(h));
      RecycleLocked(old.use_count() == 1 ? std::move(old->buf) : old->buf);
    }
  }
}

void RetainedTier::OnJournalDone(const JournalEntry& e, const Status& st) {
  if (!enabled()) return;
  const bool dcp_commit = CommitKindOf(e.path) == CommitKind::kDcp;
  if (!st.ok()) {
    if (e.op == OpType::kPublish && e.target) {
      MutexLock lock(&mu_);
      auto it = captures_.find(e.target->id());
      if (it != captures_.end()) {
        for (const auto& [i, b] : it->second->blocks) RecycleLocked(std::move(b->buf));
        captures_.erase(it);
      }
    }
    return;
  }
  switch (e.op) {
    case OpType::kPublish:
      if (e.target) {
        Publish(e);
      } else {
        MutexLock lock(&mu_);
        DropPathLocked(e.path, false);
      }
      break;
    case OpType::kRename: {
      MutexLock lock(&mu_);
      RenameLocked(e.from, e.path);
      break;
    }
    case OpType::kUnlink:
    case OpType::kUtimens:
    case OpType::kLink: {
      MutexLock lock(&mu_);
      DropPathLocked(e.path, false);
      break;
    }
    case OpType::kRmdir: {
      MutexLock lock(&mu_);
      DropPathLocked(e.path, true);
      break;
    }
    default:
      break;
  }
  if ((e.op == OpType::kPublish || e.op == OpType::kRename) && dcp_commit) {
    OnCommitted(path::Parent(e.path));
  }
  MutexLock lock(&mu_);
  SweepCapturesLocked();
}

void RetainedTier::OnCommitted(const std::string& dir) {
  if (!enabled()) return;
  MutexLock lock(&mu_);
  if (stopped_) return;
  CommitLocked(dir);
}

bool RetainedTier::CommittedLocked(const std::string& dir, std::string* check_dir,
                                   int64_t* newest) {
  Ckpt& c = ckpts_[dir];
  if (c.committed) return true;
  const auto now = Now();
  if (backing_ == nullptr || now - c.last_check < opts_.commit_check_interval) return false;
  c.last_check = now;
  *check_dir = dir;
  *newest = c.newest_mtime_ns;
  ++stats_.lazy_commit_checks;
  return false;
}

bool RetainedTier::CheckCommitNow(const std::string& dir, int64_t newest) {
  // This node wrote shards only: the checkpoint is committed once its `.metadata` is on
  // the backing store (G5), no older than the newest file retained of it.
  Result<struct stat> st = backing_->Stat(path::Join(dir, ".metadata"));
  if (!st.ok() || BlockIdFromStat("", *st).mtime_ns < newest) return false;
  OnCommitted(dir);
  return true;
}

void RetainedTier::DropCorrupt(const Key& key, const std::shared_ptr<Held>& h) {
  {
    MutexLock lock(&mu_);
    ++stats_.crc_errors;
    auto it = held_.find(key);
    if (it != held_.end() && it->second == h) EraseHeldLocked(it, &stats_.dropped_bytes);
  }
  spdlog::warn("retained tier: block {} of {} does not match its checksum; dropped, read "
               "elsewhere",
               key.index, key.id.path);
}

std::optional<BlockRead> RetainedTier::Lookup(const BlockId& id, uint64_t offset,
                                              std::span<char> out) {
  if (!enabled() || offset % opts_.block_bytes != 0) return std::nullopt;
  const Key key{id, offset / opts_.block_bytes};
  std::shared_ptr<Held> h;
  std::string check_dir;
  int64_t newest = 0;
  {
    MutexLock lock(&mu_);
    auto it = held_.find(key);
    if (it == held_.end()) {
      auto c = ckpts_.find(path::Parent(id.path));
      if (c != ckpts_.end() && c->second.committed) ++stats_.misses_committed;
      return std::nullopt;
    }
    h = it->second;
    if (!CommittedLocked(h->ckpt, &check_dir, &newest) && check_dir.empty()) {
      return std::nullopt;
    }
  }
  if (!check_dir.empty() && !CheckCommitNow(check_dir, newest)) return std::nullopt;
  // The block cache passes its whole aligned buffer (for O_DIRECT): at least the block.
  if (out.size() < h->len) return std::nullopt;
  std::memcpy(out.data(), h->buf->p, h->len);
  if (Crc32c(out.data(), h->len) != h->crc) {
    DropCorrupt(key, h);
    return std::nullopt;
  }
  MutexLock lock(&mu_);
  ++stats_.hits;
  stats_.hit_bytes += h->len;
  return BlockRead{.bytes = h->len, .crc32c = h->crc};
}

std::optional<size_t> RetainedTier::ReadInPlace(const BlockId& id, size_t len, uint64_t offset,
                                                const InPlaceUse& use, Reader reader) {
  if (!enabled() || len == 0 || offset >= id.size) return std::nullopt;
  const uint64_t bs = opts_.block_bytes;
  const uint64_t end = std::min<uint64_t>(id.size, offset + len);
  const uint64_t first = offset / bs;
  struct Use {
    Key key;
    std::shared_ptr<Held> h;
    std::vector<uint32_t> subs;  // empty: not yet learned
  };
  std::vector<Use> blocks;
  std::string check_dir;
  int64_t newest = 0;
  {
    MutexLock lock(&mu_);
    for (uint64_t i = first; i * bs < end; ++i) {
      Key key{id, i};
      auto it = held_.find(key);
      if (it == held_.end()) return std::nullopt;  // the block cache's source says why
      blocks.push_back({std::move(key), it->second, it->second->sub_crcs});
    }
    // The blocks of one file belong to one checkpoint (its directory).
    if (!CommittedLocked(blocks.front().h->ckpt, &check_dir, &newest) && check_dir.empty()) {
      return std::nullopt;
    }
  }
  if (!check_dir.empty() && !CheckCommitNow(check_dir, newest)) return std::nullopt;
  constexpr uint64_t kSub = kSubBlockBytes;
  std::vector<struct iovec> iov;
  iov.reserve(blocks.size());
  std::vector<size_t> learned;
  for (size_t k = 0; k < blocks.size(); ++k) {
    Use& u = blocks[k];
    const Held& h = *u.h;
    const uint64_t base = (first + k) * bs;
    const uint64_t lo = std::max(offset, base) - base, hi = std::min(end, base + bs) - base;
    if (hi > h.len) return std::nullopt;  // cannot be: the id's size fixes every length
    if (u.subs.empty()) {
      // First serve: hash it whole, piece by piece; the pieces must make up its CRC.
      uint32_t whole = 0;
      for (uint64_t at = 0; at < h.len; at += kSub) {
        const uint64_t n = std::min(kSub, h.len - at);
        const uint32_t c = Crc32c(h.buf->p + at, n);
        whole = at == 0 ? c : Crc32cCombine(whole, c, n);
        u.subs.push_back(c);
      }
      if (whole != h.crc) {
        DropCorrupt(u.key, u.h);
        return std::nullopt;
      }
      learned.push_back(k);
    } else {
      for (uint64_t s = lo / kSub; s * kSub < hi; ++s) {
        const uint64_t n = std::min(kSub, h.len - s * kSub);
        if (Crc32c(h.buf->p + s * kSub, n) != u.subs[s]) {
          DropCorrupt(u.key, u.h);
          return std::nullopt;
        }
      }
    }
    iov.push_back({h.buf->p + lo, static_cast<size_t>(hi - lo)});
  }
  {
    MutexLock lock(&mu_);
    for (size_t k : learned) {
      if (blocks[k].h->sub_crcs.empty()) blocks[k].h->sub_crcs = std::move(blocks[k].subs);
    }
    if (reader == Reader::kIndexBuild) {
      stats_.index_read_bytes += end - offset;
    } else {
      stats_.hits += blocks.size();
      stats_.hit_bytes += end - offset;
    }
  }
  use(iov);
  return static_cast<size_t>(end - offset);
}

bool RetainedTier::PutReplica(const BlockId& id, uint64_t index, std::span<const char> bytes,
                              uint32_t crc, const std::string& origin) {
  if (!enabled() || bytes.empty() || bytes.size() > opts_.block_bytes) return false;
  if (Crc32c(bytes.data(), bytes.size()) != crc) {
    MutexLock lock(&mu_);
    ++stats_.crc_errors;
    return false;
  }
  const Key key{id, index};
  auto h = std::make_shared<Held>();
  MutexLock lock(&mu_);
  if (stopped_) return false;
  if (held_.count(key) > 0) return true;
  h->buf = TakeBufferLocked(path::Parent(id.path));
  if (!h->buf) return false;
  lock.Unlock();
  std::memcpy(h->buf->p, bytes.data(), bytes.size());
  lock.Lock();
  if (stopped_) return false;  // DropAll() ran meanwhile and reset the account
  h->len = bytes.size();
  h->crc = crc;
  h->ckpt = path::Parent(id.path);
  h->replica = true;
  Ckpt& c = CkptLocked(h->ckpt);
  if (!c.committed) CommitLocked(h->ckpt);  // only committed checkpoints are replicated
  Ckpt& cc = ckpts_[h->ckpt];
  cc.replica_bytes += h->len;
  cc.origin = origin;
  auto [it, inserted] = held_.try_emplace(key, std::move(h));
  if (!inserted) {  // another pull of the same block won the race; `h` was not moved
    cc.replica_bytes -= std::min(cc.replica_bytes, bytes.size());
    RecycleLocked(std::move(h->buf));
  }
  return true;
}

bool RetainedTier::Holds(const BlockId& id, uint64_t index) const {
  MutexLock lock(&mu_);
  return held_.count(Key{id, index}) > 0;
}

std::vector<std::pair<BlockId, uint64_t>> RetainedTier::OwnBlocksOf(const std::string& dir) const {
  std::vector<std::pair<BlockId, uint64_t>> out;
  MutexLock lock(&mu_);
  auto c = ckpts_.find(dir);
  if (c == ckpts_.end() || !c->second.committed) return out;
  for (const auto& [k, h] : held_) {
    if (h->ckpt == dir && !h->replica) out.emplace_back(k.id, k.index);
  }
  return out;
}

void RetainedTier::CheckPendingCommits() {
  if (!enabled() || backing_ == nullptr) return;
  std::vector<std::pair<std::string, int64_t>> pending;
  {
    MutexLock lock(&mu_);
    for (const auto& [dir, c] : ckpts_) {
      if (!c.committed && c.own_bytes > 0) pending.emplace_back(dir, c.newest_mtime_ns);
    }
  }
  for (const auto& [dir, newest] : pending) {
    Result<struct stat> st = backing_->Stat(path::Join(dir, ".metadata"));
    if (st.ok() && BlockIdFromStat("", *st).mtime_ns >= newest) OnCommitted(dir);
  }
}

bool RetainedTier::HoldsRunOf(const std::string& path) const {
  const std::string run = path::Parent(path::Parent(path));
  MutexLock lock(&mu_);
  for (const auto& [dir, c] : ckpts_) {
    if (c.committed && c.own_bytes + c.replica_bytes > 0 && path::Parent(dir) == run) return true;
  }
  return false;
}

bool RetainedTier::HoldsCommitted(const std::string& dir) const {
  if (!enabled()) return false;
  MutexLock lock(&mu_);
  auto it = ckpts_.find(dir);
  return it != ckpts_.end() && it->second.committed &&
         it->second.own_bytes + it->second.replica_bytes > 0;
}

void RetainedTier::DropAll() {
  std::map<uint64_t, std::shared_ptr<Capture>> captures;
  std::map<Key, std::shared_ptr<Held>, KeyLess> held;
  std::vector<std::shared_ptr<Buffer>> spare;
  {
    MutexLock lock(&mu_);
    stopped_ = true;
    captures.swap(captures_);
    held.swap(held_);
    spare.swap(spare_);
    ckpts_.clear();
    used_ = 0;
    stats_.lent_bytes = 0;
  }
  // Buffers are unmapped here, outside the lock (a reader still copying keeps its own).
}

}  // namespace ckptfs::store
