#include "store/publish/entry_apply.h"

#include <dirent.h>
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include "common/path.h"
#include "store/dcp/commit_names.h"

namespace ckptfs::store {
namespace {

// True when the real name already holds this entry's file: an earlier attempt renamed it
// in, its directory fsync failed, and the rename that should have taken it back failed
// too (two faults in a row). Renaming again would exchange the replaced file back over it,
// or fail for good on the missing temp; the retry only has to finish the entry.
bool AlreadyInPlace(BackingDir* dir, const JournalEntry& e) {
  if (!e.target) return false;  // a resumed entry: Journal::Process checks it by name
  auto mine = dir->Fstat(e.target->fd());
  auto there = dir->Stat(e.path);
  return mine.ok() && there.ok() && mine->st_dev == there->st_dev &&
         mine->st_ino == there->st_ino;
}

Status ApplyPublish(BackingDir* dir, const JournalEntry& e, bool keep_replaced, bool* kept) {
  // Over an existing file, exchange the two names: if the directory cannot be made
  // durable, exchanging back restores exactly the old state (G4); otherwise the temp
  // name now holds the old file, which is removed.
  constexpr unsigned kExchange = 2;  // RENAME_EXCHANGE
  bool replacing = false;
  if (AlreadyInPlace(dir, e)) {
    replacing = dir->Stat(e.from).ok();  // the replaced file, left under the temp name
    spdlog::warn("journal: {} is in place from an attempt that could not be taken back; "
                 "finishing it", e.Describe());
  } else {
    replacing = dir->Stat(e.path).ok();
    CKPT_RETURN_IF_ERROR(dir->Rename(e.from, e.path, replacing ? kExchange : 0));
  }
  Status st = dir->SyncParent(e.path);
  if (!st.ok()) {
    // Not durable, so it must not count as published: put the names back.
    Status undo = dir->Rename(e.path, e.from, replacing ? kExchange : 0);
    if (!undo.ok()) {
      spdlog::error("journal: cannot withdraw {} after a failed sync: {}", e.path,
                    undo.ToString());
    }
    return st;
  }
  if (replacing && keep_replaced &&
      dir->Stat(path::Join(path::Parent(e.path), ".metadata")).ok()) {
    if (kept != nullptr) *kept = true;  // the committed version, under the temp name
    return Status::Ok();
  }
  if (replacing) {
    Status rm = dir->Unlink(e.from);
    if (!rm.ok()) spdlog::warn("journal: cannot remove replaced {}: {}", e.from, rm.ToString());
  }
  return Status::Ok();
}

Status ApplyOwner(BackingDir* dir, const JournalEntry& e) {
  if (e.uid == kNoOwner && e.gid == kNoOwner) return Status::Ok();  // an entry of old
  // The caller's owner, then the exact mode: the daemon's umask shaped the mode it was
  // made with, and a chown clears setuid/setgid bits.
  Status owned = dir->Chown(e.path, e.uid, e.gid);
  if (!owned.ok()) {
    // The name exists as the application made it; only its owner is the daemon's (a
    // daemon that is not root, NFS root_squash). Refusing the entry would hold back
    // publication for an owner the backing store does not allow.
    spdlog::warn("journal: {}: owner {}:{} not set: {}", e.Describe(), e.uid, e.gid,
                 owned.ToString());
  }
  if (e.op == OpType::kSymlink) return Status::Ok();
  return dir->Chmod(e.path, e.mode & 07777);
}

}  // namespace

Status ApplyEntry(BackingDir* dir, const JournalEntry& e, bool* renamed, bool retry,
                  bool keep_replaced, bool* kept) {
  switch (e.op) {
    case OpType::kPublish:
      return ApplyPublish(dir, e, keep_replaced, kept);
    case OpType::kRename: {
      Status moved = dir->Rename(e.from, e.path);
      // On a retry, the source gone and the target there: the failed attempt renamed it
      // and then failed (its directory fsync, and for a commit name the rename back too).
      // Only the directory fsync is left to do. (Journal::Process decides the same way for
      // an entry the previous run left.) On a first attempt a missing source is an error.
      const bool done_before = retry && moved.code() == Code::kNotFound &&
                               dir->Stat(e.from).status().code() == Code::kNotFound &&
                               dir->Stat(e.path).ok();
      if (!moved.ok() && !done_before) return moved;
      if (done_before) {
        spdlog::warn("journal: {} is in place from an earlier attempt; finishing it",
                     e.Describe());
      }
      Status st = dir->SyncParent(e.path);
      if (!st.ok() && IsCommitName(e.path)) {
        // A commit that is not durable must not stay visible (G5): withdraw it.
        Status undo = dir->Rename(e.path, e.from);
        if (!undo.ok()) {
          spdlog::error("journal: cannot withdraw {}: {}", e.path, undo.ToString());
        }
        return st;
      }
      if (renamed != nullptr) *renamed = true;
      return st;
    }
    case OpType::kUnlink: {
      Status st = dir->Unlink(e.path);
      if (!e.withdraw) {
        if (st.code() == Code::kNotFound) return Status::Ok();  // already gone: same state
        return st;
      }
      // A commit name withdrawn by an abort must stay gone after a crash: the directory is
      // synced. Not there on a first attempt: nothing to withdraw. On a retry, the failed
      // attempt unlinked it; its directory fsync is what is left.
      if (st.code() == Code::kNotFound && !retry) return Status::Ok();
      if (!st.ok() && st.code() != Code::kNotFound) return st;
      if (st.ok()) {
        spdlog::warn("journal: {} withdrawn from the backing store: its directory holds part "
                     "of a save that was aborted", e.path);
      }
      return dir->SyncParent(e.path);
    }
    case OpType::kDiscard: {
      Status st = dir->Unlink(e.from);
      return st.code() == Code::kNotFound ? Status::Ok() : st;
    }
    case OpType::kRmdir: {
      Status st = dir->Rmdir(e.path);
      if (st.code() == Code::kNotFound) return Status::Ok();
      return st;
    }
    case OpType::kMkdir: {
      Status st = dir->Mkdir(e.path, e.mode);
      if (st.code() == Code::kExists) return Status::Ok();
      CKPT_RETURN_IF_ERROR(st);
      return ApplyOwner(dir, e);
    }
    case OpType::kSymlink:
      CKPT_RETURN_IF_ERROR(dir->Symlink(e.link_target, e.path));
      return ApplyOwner(dir, e);
    case OpType::kMknod:
      CKPT_RETURN_IF_ERROR(dir->Mknod(e.path, e.mode, static_cast<dev_t>(e.rdev)));
      return ApplyOwner(dir, e);
    case OpType::kChown:
      return dir->Chown(e.path, e.uid, e.gid);
    case OpType::kLink:
      CKPT_RETURN_IF_ERROR(dir->Link(e.from, e.path));
      return dir->SyncParent(e.path);
    case OpType::kChmod:
      return dir->Chmod(e.path, e.mode);
    case OpType::kUtimens: {
      struct timespec ts[2] = {{e.atime_sec, e.atime_nsec}, {e.mtime_sec, e.mtime_nsec}};
      return dir->Utimens(e.path, ts);
    }
  }
  return Internal("unknown journal op");
}

bool LeftInPlace(BackingDir* dir, const JournalEntry& e) {
  switch (e.op) {
    case OpType::kPublish:
      return AlreadyInPlace(dir, e);
    case OpType::kRename:
      return dir->Stat(e.from).status().code() == Code::kNotFound && dir->Stat(e.path).ok();
    default:
      return false;
  }
}

Status SettleAcrossNodes(BackingDir* dir, const JournalEntry& e, const Status& st,
                         bool rmdir_returned) {
  if (e.op == OpType::kPublish && st.code() == Code::kNotFound) {
    const std::string parent = path::Parent(e.path);
    if (parent.empty() || dir->Stat(parent).status().code() != Code::kNotFound) return st;
    return Status(Code::kSuperseded, "its directory " + parent +
                                         " was removed through another node before it "
                                         "was published");
  }
  if (e.op != OpType::kRmdir || st.code() != Code::kNotEmpty || !rmdir_returned) return st;
  // Files published meanwhile may keep coming (one per rank of the abandoned save): a few
  // rounds, each a listing and its unlinks.
  Status last = st;
  size_t removed = 0;
  for (int round = 0; round < 4 && last.code() == Code::kNotEmpty; ++round) {
    auto names = dir->List(e.path);
    if (!names.ok()) return last;
    for (const DirEntry& d : *names) {
      // A directory made there is not a late file of a save: the rmdir stays refused.
      // Some file systems (NFS, older XFS) list every type as unknown: then stat it.
      bool is_dir = d.type == DT_DIR;
      if (d.type == DT_UNKNOWN) {
        auto st = dir->Stat(path::Join(e.path, d.name));
        is_dir = st.ok() && S_ISDIR(st->st_mode);
      }
      if (is_dir) return last;
    }
    for (const DirEntry& d : *names) {
      Status rm = dir->Unlink(path::Join(e.path, d.name));
      if (rm.ok()) {
        ++removed;
      } else if (rm.code() != Code::kNotFound) {
        return rm;
      }
    }
    last = dir->Rmdir(e.path);
  }
  if (last.code() == Code::kNotFound) last = Status::Ok();
  if (last.ok()) {
    spdlog::warn("journal: {}: removed {} file(s) that another node published there after "
                 "this node's application had removed the directory",
                 e.Describe(), removed);
  }
  return last;
}

Status SyncFileAt(BackingDir* dir, const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, dir->OpenFile(path, O_RDONLY | O_CLOEXEC));
  return dir->Fsync(fd.get());
}

}  // namespace ckptfs::store
