// Multi-user POSIX operations (fs/namespace/posix_ops.h): setattr with its ownership rules, hard
// links and fallocate.
#include "fs/namespace/posix_ops.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>

#include "common/path.h"
#include "fs/fs_util.h"
#include "fs/namespace/table_lock.h"

namespace ckptfs::fs {

PosixOps::PosixOps(const FsParts& parts, NodeTable& table, WriteStates& writes)
    : table_(table), writes_(writes), backing_(parts.backing) {}

Result<struct stat> PosixOps::SetAttr(uint64_t ino, const struct stat& in, int to_set,
                                        Handle* handle, const Caller& caller) {
  // FUSE_SET_ATTR_* values, repeated here so this file stays free of libfuse.
  constexpr int kMode = 1 << 0, kUid = 1 << 1, kGid = 1 << 2, kSize = 1 << 3, kAtime = 1 << 4,
                kMtime = 1 << 5, kAtimeNow = 1 << 7, kMtimeNow = 1 << 8, kCtime = 1 << 10;
  if (ino < kFirstNodeIno && ino != kRootIno) return Status(Code::kPermission, "control file");
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(ino));
  Result<uint64_t> last_seq = uint64_t{0};
  // The I/O of a change runs after the lock: the temp file's owner and mode, and a
  // truncate (the copy it may begin, its wait for flushes, the ftruncate).
  std::shared_ptr<store::StagedFile> follow_temp;
  bool follow_owner = false;
  const FileHandle* resize_from = nullptr;
  bool resize = false;
  {
    TableLock lock(table_);
    auto node = table_.NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    // A new owner or mode makes a copy planned before it lose its race: a call holding the
    // node's I/O token (it lost kRaceTries already) goes first.
    if ((to_set & (kMode | kUid | kGid)) &&
        RaceRetry::AwaitTokenHolders(table_, node.get(), RaceRetry::Change::kOwnerOrMode)) {
      node = table_.NodeLocked(ino);
      if (!node) return NotFound("stale inode");
    }
    table_.FoldWriteTimeLocked(node.get());  // a write's time first: what follows may set it
    // Ownership rules first (fs/namespace/posix_access.h): nothing changes unless all of it may.
    const uid_t new_uid = (to_set & kUid) ? in.st_uid : static_cast<uid_t>(-1);
    const gid_t new_gid = (to_set & kGid) ? in.st_gid : static_cast<gid_t>(-1);
    if (to_set & (kUid | kGid)) {
      CKPT_RETURN_IF_ERROR(CheckChown(caller, node->attr, new_uid, new_gid));
    }
    mode_t new_mode = 0;
    if (to_set & kMode) {
      CKPT_ASSIGN_OR_RETURN(new_mode, CheckChmod(caller, node->attr, in.st_mode));
    }
    // A truncate carries "mtime now" with it; its permission is the open's or, for
    // truncate(path), write permission.
    if ((to_set & (kAtime | kMtime)) && !(to_set & kSize)) {
      const bool explicit_times = ((to_set & kAtime) && !(to_set & kAtimeNow)) ||
                                  ((to_set & kMtime) && !(to_set & kMtimeNow));
      CKPT_RETURN_IF_ERROR(CheckUtimes(caller, node->attr, explicit_times));
    }
    if ((to_set & kSize) && handle == nullptr && !MayAccess(caller, node->attr, W_OK)) {
      return Status(Code::kPermission, "truncate without write permission");
    }
    if (to_set & kSize) {
      if (node->type != NodeType::kFile) return Status(Code::kIsDir, "truncate of a directory");
      if (node->attr.st_nlink > 1) {
        return Status(Code::kTooManyLinks, "truncate of a file with several hard links");
      }
      resize = true;
      resize_from = handle != nullptr ? handle->file() : nullptr;
    }
    // The owner before the mode: a chown clears setuid/setgid, on the backing store too.
    if (to_set & (kUid | kGid)) {
      last_seq = ChownLocked(node.get(), new_uid, new_gid);
      if (!last_seq.ok()) return last_seq.status();
      if (node->write) {
        follow_temp = node->write->staged;
        follow_owner = true;
      }
    }
    if (to_set & kMode) {
      node->attr.st_mode = (node->attr.st_mode & S_IFMT) | new_mode;
      node->attr.st_ctim = Now();
      if (node->write) {
        follow_temp = node->write->staged;
      } else if (node->on_backing) {
        store::JournalEntry e;
        e.op = store::OpType::kChmod;
        e.path = table_.PathLocked(node.get());
        e.mode = new_mode;
        last_seq = table_.AppendLocked(std::move(e), node.get());
      }
    }
    if (to_set & (kAtime | kMtime | kAtimeNow | kMtimeNow)) {
      struct timespec now = Now();
      struct timespec at = {0, UTIME_OMIT}, mt = {0, UTIME_OMIT};
      if (to_set & kAtimeNow) at = now; else if (to_set & kAtime) at = in.st_atim;
      if (to_set & kMtimeNow) mt = now; else if (to_set & kMtime) mt = in.st_mtim;
      if (at.tv_nsec != UTIME_OMIT) node->attr.st_atim = at;
      if (mt.tv_nsec != UTIME_OMIT) node->attr.st_mtim = mt;
      if (node->write && node->write->needs_publish) {
        // Flushes would move mtime again; its publish sets the node's times last.
      } else if (node->on_backing) {
        store::JournalEntry e;
        e.op = store::OpType::kUtimens;
        e.path = table_.PathLocked(node.get());
        e.atime_sec = at.tv_sec, e.atime_nsec = at.tv_nsec;
        e.mtime_sec = mt.tv_sec, e.mtime_nsec = mt.tv_nsec;
        last_seq = table_.AppendLocked(std::move(e), node.get());
      }
    }
    if (to_set & kCtime) node->attr.st_ctim = in.st_ctim;
    table_.links().Sync(node.get(), last_seq.ok() ? *last_seq : 0);
  }
  if (follow_temp) {
    CKPT_RETURN_IF_ERROR(FollowOwnerInTemp(ino, std::move(follow_temp), follow_owner));
  }
  if (resize && last_seq.ok()) {
    Result<uint64_t> published =
        writes_.Resize(ino, static_cast<uint64_t>(in.st_size), resize_from);
    if (!published.ok()) return published.status();
    if (*published != 0) last_seq = published;
  }
  if (last_seq.ok() && *last_seq != 0) CKPT_RETURN_IF_ERROR(table_.WaitIfStrict(last_seq));
  if (!last_seq.ok()) return last_seq.status();
  return table_.GetAttr(ino);
}

Result<uint64_t> PosixOps::ChownLocked(Node* node, uid_t uid, gid_t gid) {
  if (uid != static_cast<uid_t>(-1)) node->attr.st_uid = uid;
  if (gid != static_cast<gid_t>(-1)) node->attr.st_gid = gid;
  node->attr.st_mode = ModeAfterChown(node->attr);
  node->attr.st_ctim = Now();
  // Staged: its temp file is what gets published (or already was, under the real name);
  // the caller gives it the new owner after the lock (FollowOwnerInTemp).
  if (node->write) return uint64_t{0};
  if (!node->on_backing) return uint64_t{0};
  store::JournalEntry e;
  e.op = store::OpType::kChown;
  e.path = table_.PathLocked(node);
  e.uid = uid == static_cast<uid_t>(-1) ? store::kNoOwner : uid;
  e.gid = gid == static_cast<gid_t>(-1) ? store::kNoOwner : gid;
  CKPT_ASSIGN_OR_RETURN(uint64_t seq, table_.AppendLocked(std::move(e), node));
  if (node->type != NodeType::kDir && node->type != NodeType::kSymlink) {
    // The backing chown clears setuid/setgid as this one did; a kChmod keeps both equal
    // should the backing file system differ.
    store::JournalEntry m;
    m.op = store::OpType::kChmod;
    m.path = table_.PathLocked(node);
    m.mode = node->attr.st_mode & 07777;
    CKPT_ASSIGN_OR_RETURN(seq, table_.AppendLocked(std::move(m), node));
  }
  return seq;
}

Status PosixOps::FollowOwnerInTemp(uint64_t ino, std::shared_ptr<store::StagedFile> staged,
                                    bool owner) {
  mode_t applied_mode = 0;
  uid_t applied_uid = 0;
  gid_t applied_gid = 0;
  for (bool first = true;; first = false) {
    {
      TableLock lock(table_);
      std::shared_ptr<Node> node = table_.NodeLocked(ino);
      // Replaced by another version (which took the node's attributes when it was made)
      // or gone: nothing of this temp file is published.
      if (!node || !node->write || node->write->staged != staged) return Status::Ok();
      const mode_t mode = node->attr.st_mode & 07777;
      if (!first && mode == applied_mode && node->attr.st_uid == applied_uid &&
          node->attr.st_gid == applied_gid) {
        return Status::Ok();  // nothing changed meanwhile: the temp file shows the node
      }
      applied_mode = mode;
      applied_uid = node->attr.st_uid;
      applied_gid = node->attr.st_gid;
    }
    const int fd = staged->target()->fd();
    CKPT_RETURN_IF_ERROR(owner ? writes_.OwnTemp(applied_uid, applied_gid, applied_mode, fd)
                               : backing_->Fchmod(fd, applied_mode));
  }
}

Result<Entry> PosixOps::Link(uint64_t ino, uint64_t new_parent, const std::string& new_name,
                               const Caller& caller) {
  (void)caller;  // the kernel checked write permission on new_parent (default_permissions)
  CKPT_RETURN_IF_ERROR(CheckNewName(new_parent, new_name));
  if (ino < kFirstNodeIno && ino != kRootIno) {
    return Status(Code::kNotPermitted, "link of a control file");
  }
  // A symlink's target may be read by path below.
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(ino));
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(new_parent));
  CKPT_RETURN_IF_ERROR(table_.ProbeName(new_parent, new_name));
  Entry out;
  Result<uint64_t> seq = uint64_t{0};
  // A publish the link needs first, or the readlink of a symlink, runs without the lock
  // (PublishLocked may drop it): then everything is checked again (after a few races lost,
  // holding the node's I/O token).
  for (RaceRetry race;; race.Lose()) {
    TableLock lock(table_);
    race.Enter(table_, table_.NodeLocked(ino));
    auto node = table_.NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    if (node->type == NodeType::kDir) {
      return Status(Code::kNotPermitted, "hard link to a directory");
    }
    Result<std::shared_ptr<Node>> loaded = table_.LoadedDirLocked(new_parent, new_name);
    if (LockDropped(loaded.status())) continue;  // listed without the lock: start over
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Node> dir, std::move(loaded));
    if (table_.ChildLocked(dir.get(), new_name)) return Status(Code::kExists, new_name);
    if (node->parent == nullptr) return NotFound("link of an unlinked file");
    if (!node->error.empty()) return Status(Code::kIo, node->error);
    table_.FoldWriteTimeLocked(node.get());  // the link shows the inode's times
    if (node->write) {
      // Open writers would publish later bytes by renaming a new copy over this name,
      // which would split the link: refuse rather than let the names drift apart.
      if (node->open_writers > 0) {
        return Status(Code::kBusy, "link of a file open for writing through the mount");
      }
      if (node->write->needs_publish) {
        CKPT_RETURN_IF_ERROR(writes_.PublishLocked(table_, node.get()).status());
        continue;
      }
    }
    if (!node->on_backing) return NotFound("link source is not published");
    if (node->type == NodeType::kSymlink && node->link_target.empty()) {
      const std::string path = table_.PathLocked(node.get());
      Result<std::string> target =
          TableLock::WithoutLock(table_, [this, &path] { return backing_->Readlink(path); });
      if (!target.ok()) return target.status();
      // A symlink's target never changes: kept if the name is still where it was read.
      if (table_.PathLocked(node.get()) == path) node->link_target = *target;
      continue;
    }
    const std::string from = table_.PathLocked(node.get());
    const std::string to = path::Join(table_.PathLocked(dir.get()), new_name);
    auto link = table_.NewNodeLocked(dir.get(), new_name, node->type);
    if (node->link_group == 0) {
      node->link_group = node->ino;
      table_.links().Join(node->link_group, node);
    }
    node->attr.st_nlink++;
    node->attr.st_ctim = Now();
    for (const auto& other : table_.links().Peers(node->link_group, node.get())) {
      other->attr.st_nlink = node->attr.st_nlink;
      other->attr.st_ctim = node->attr.st_ctim;
    }
    link->attr = node->attr;
    link->attr.st_ino = link->ino;
    if (node->write) link->attr.st_size = static_cast<off_t>(node->write->staged->size());
    link->link_target = node->link_target;
    link->link_group = node->link_group;
    table_.links().Join(link->link_group, link);
    link->on_backing = true;
    store::JournalEntry e;
    e.op = store::OpType::kLink;
    e.from = from;
    e.path = to;
    seq = table_.AppendLocked(std::move(e), link.get());
    if (!seq.ok()) {
      node->attr.st_nlink--;
      table_.DetachLocked(link);
      return seq.status();
    }
    // Until the link is applied the new name has no backing path: opens wait for it,
    // exactly as for a pending rename. The source's attributes are not refreshed from
    // the backing store before then either.
    link->rename_seq = *seq;
    node->pending_seq = std::max(node->pending_seq, *seq);
    out = table_.EntryLocked(link.get());
    break;
  }
  CKPT_RETURN_IF_ERROR(table_.WaitIfStrict(seq));
  return out;
}

Status PosixOps::Fallocate(Handle* handle, int mode, uint64_t offset, uint64_t length) {
  if (mode != 0) {
    return Unsupported("fallocate mode " + std::to_string(mode) + " (only mode 0 is supported)");
  }
  FileHandle* h = handle->file();
  if (h == nullptr || !h->writable) return Status(Code::kPermission, "not open for writing");
  if (length == 0) return Invalid("fallocate of 0 bytes");
  const uint64_t end = offset + length;
  Node* node = h->node.get();
  for (RaceRetry race;; race.Lose()) {
    race.EnterUnlocked(table_, h->node);  // after races lost: the node's I/O token
    {
      TableLock lock(table_);
      if (node->type != NodeType::kFile) return Invalid("fallocate of a non-regular file");
      table_.FoldWriteTimeLocked(node);
      if (!node->error.empty()) return Status(Code::kIo, node->error);
      if (node->attr.st_nlink > 1) {
        return Status(Code::kTooManyLinks, "a file with several hard links cannot be rewritten");
      }
    }
    // The copy it may begin, the reservation and the truncate: all without the table's lock.
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<store::StagedFile> staged, writes_.WritableStaged(h, race));
    // Reserve the blocks in the temp file first, so ENOSPC comes back here and not at
    // the flush; then extend the file as mode 0 does (the new bytes read as zeros).
    CKPT_RETURN_IF_ERROR(backing_->Fallocate(staged->target()->fd(), FALLOC_FL_KEEP_SIZE,
                                             static_cast<off_t>(offset),
                                             static_cast<off_t>(length)));
    if (end <= staged->size()) return Status::Ok();
    Status st = staged->Truncate(end);
    // Frozen by a publish: extend the next copy.
    if (st.code() == Code::kAborted && race.LostToFreeze(staged.get())) continue;
    if (!st.ok()) return st;
    TableLock lock(table_);
    node->attr.st_mtim = node->attr.st_ctim = Now();
    return Status::Ok();
  }
}

}  // namespace ckptfs::fs
