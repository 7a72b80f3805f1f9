// Multi-user POSIX operations of Namespace: ownership of new and existing names,
// mknod, hard links and fallocate. The namespace model and its locking are the ones of
// fs/namespace.cc (see fs/namespace.h).
#include <fcntl.h>
#include <linux/falloc.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

#include "fs/namespace.h"
#include "common/path.h"
#include "fs/fs_util.h"

namespace ckptfs::fs {
namespace {

constexpr auto JoinName = &path::Join;  // common/path.h

struct timespec NowTs() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts;
}

}  // namespace

Status Namespace::FollowOwnerInTemp(uint64_t ino, std::shared_ptr<StagedFile> staged,
                                    bool owner) {
  mode_t applied_mode = 0;
  uid_t applied_uid = 0;
  gid_t applied_gid = 0;
  for (bool first = true;; first = false) {
    {
      MutexLock lock(&ns_mu_);
      std::shared_ptr<Node> node = NodeLocked(ino);
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
    CKPT_RETURN_IF_ERROR(owner ? OwnTemp(applied_uid, applied_gid, applied_mode, fd)
                               : backing_->Fchmod(fd, applied_mode));
  }
}

Status Namespace::OwnTemp(uid_t uid, gid_t gid, mode_t mode, int fd) {
  Status owned = backing_->Fchown(fd, uid, gid);
  if (!owned.ok()) {
    // A daemon that is not root, or a backing store that squashes root (NFS), cannot
    // give files away. The bytes matter more than their owner: go on, and say so once.
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      spdlog::warn("backing store refuses owner {}:{} ({}); files keep the daemon's owner", uid,
                   gid, owned.ToString());
    }
  }
  // After the owner: a chown clears setuid/setgid, which the mode may hold on purpose.
  return backing_->Fchmod(fd, mode);
}

Result<uint64_t> Namespace::ChownLocked(Node* node, uid_t uid, gid_t gid) {
  if (uid != static_cast<uid_t>(-1)) node->attr.st_uid = uid;
  if (gid != static_cast<gid_t>(-1)) node->attr.st_gid = gid;
  node->attr.st_mode = ModeAfterChown(node->attr);
  node->attr.st_ctim = NowTs();
  // Staged: its temp file is what gets published (or already was, under the real name);
  // the caller gives it the new owner after the lock (FollowOwnerInTemp).
  if (node->write) return uint64_t{0};
  if (!node->on_backing) return uint64_t{0};
  store::JournalEntry e;
  e.op = store::OpType::kChown;
  e.path = PathLocked(node);
  e.uid = uid == static_cast<uid_t>(-1) ? store::kNoOwner : uid;
  e.gid = gid == static_cast<gid_t>(-1) ? store::kNoOwner : gid;
  CKPT_ASSIGN_OR_RETURN(uint64_t seq, AppendLocked(std::move(e), node));
  if (node->type != NodeType::kDir && node->type != NodeType::kSymlink) {
    // The backing chown clears setuid/setgid as this one did; a kChmod keeps both equal
    // should the backing file system differ.
    store::JournalEntry m;
    m.op = store::OpType::kChmod;
    m.path = PathLocked(node);
    m.mode = node->attr.st_mode & 07777;
    CKPT_ASSIGN_OR_RETURN(seq, AppendLocked(std::move(m), node));
  }
  return seq;
}

std::vector<std::shared_ptr<Node>> Namespace::LinkPeersLocked(uint64_t group,
                                                               const Node* except) {
  std::vector<std::shared_ptr<Node>> peers;
  auto it = link_groups_.find(group);
  if (it == link_groups_.end()) return peers;
  auto& members = it->second.members;
  for (auto m = members.begin(); m != members.end();) {
    std::shared_ptr<Node> node = m->lock();
    if (!node) {
      m = members.erase(m);
      continue;
    }
    if (node.get() != except && node->parent != nullptr) peers.push_back(std::move(node));
    ++m;
  }
  if (members.empty()) {
    if (it->second.backing.second != 0) backing_links_.erase(it->second.backing);
    link_groups_.erase(it);
  }
  return peers;
}

void Namespace::AdoptLinkGroupLocked(Node* node, const struct stat& st) {
  if (node->type == NodeType::kDir || st.st_nlink <= 1 || node->link_group != 0) return;
  const std::pair<dev_t, ino_t> key{st.st_dev, st.st_ino};
  auto [it, fresh] = backing_links_.emplace(key, node->ino);
  // A group whose names all went away may have left its key behind.
  if (!fresh && link_groups_.count(it->second) == 0) it->second = node->ino;
  node->link_group = it->second;
  LinkGroup& group = link_groups_[node->link_group];
  group.backing = key;
  group.members.push_back(inodes_[node->ino]);
}

void Namespace::UnlinkPeersLocked(Node* node, uint64_t seq) {
  if (node->link_group == 0) return;
  for (const auto& other : LinkPeersLocked(node->link_group, node)) {
    if (other->attr.st_nlink > 1) other->attr.st_nlink--;
    other->attr.st_ctim = NowTs();
    other->pending_seq = std::max(other->pending_seq, seq);
  }
}

void Namespace::SyncPeersLocked(const Node* node, uint64_t seq) {
  if (node->link_group == 0) return;
  for (const auto& other : LinkPeersLocked(node->link_group, node)) {
    other->pending_seq = std::max(other->pending_seq, seq);
    other->attr.st_mode = node->attr.st_mode;
    other->attr.st_uid = node->attr.st_uid;
    other->attr.st_gid = node->attr.st_gid;
    other->attr.st_atim = node->attr.st_atim;
    other->attr.st_mtim = node->attr.st_mtim;
    other->attr.st_ctim = node->attr.st_ctim;
  }
}

Result<Entry> Namespace::Mknod(uint64_t parent, const std::string& name, mode_t mode,
                                dev_t rdev, const Caller& caller) {
  switch (mode & S_IFMT) {
    case 0:
    case S_IFREG:
      return MakeEmptyFile(parent, name, mode & 07777, caller);
    case S_IFIFO:
    case S_IFSOCK:
      return MakeNode(parent, name, NodeType::kSpecial, mode, "", 0, caller);
    case S_IFCHR:
    case S_IFBLK:
      // The kernel lets only CAP_MKNOD callers get here.
      return MakeNode(parent, name, NodeType::kSpecial, mode, "", rdev, caller);
    default:
      return Invalid("mknod of file type " + std::to_string(mode & S_IFMT));
  }
}

Result<Entry> Namespace::MakeEmptyFile(uint64_t parent, const std::string& name, mode_t mode,
                                        const Caller& caller) {
  CKPT_ASSIGN_OR_RETURN(auto created,
                        Create(parent, name, mode, O_CREAT | O_EXCL | O_WRONLY, caller));
  auto [entry, handle] = created;
  std::shared_ptr<Node> node = handle->file()->node;
  // The last writer: queues the publication of the empty file.
  std::unique_ptr<Handle> owned(handle);
  ReleaseFile(owned->file());
  uint64_t seq = 0;
  {
    MutexLock lock(&ns_mu_);
    if (node->write) seq = node->write->publish_seq;
  }
  if (seq != 0) CKPT_RETURN_IF_ERROR(WaitIfStrict(seq));
  return entry;
}

Result<Entry> Namespace::Link(uint64_t ino, uint64_t new_parent, const std::string& new_name,
                               const Caller& caller) {
  (void)caller;  // the kernel checked write permission on new_parent (default_permissions)
  CKPT_RETURN_IF_ERROR(CheckNewName(new_parent, new_name));
  if (ino < kFirstNodeIno && ino != kRootIno) {
    return Status(Code::kNotPermitted, "link of a control file");
  }
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(ino));  // a symlink's target may be read by path below
  CKPT_RETURN_IF_ERROR(WaitForAncestorsUnlocked(new_parent));
  CKPT_RETURN_IF_ERROR(ProbeName(new_parent, new_name));
  Entry out;
  Result<uint64_t> seq = uint64_t{0};
  {
    MutexLock lock(&ns_mu_);
    auto node = NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    if (node->type == NodeType::kDir) {
      return Status(Code::kNotPermitted, "hard link to a directory");
    }
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Node> dir, LoadedDirLocked(new_parent, new_name));
    if (ChildLocked(dir.get(), new_name)) return Status(Code::kExists, new_name);
    if (node->parent == nullptr) return NotFound("link of an unlinked file");
    if (!node->error.empty()) return Status(Code::kIo, node->error);
    FoldWriteTimeLocked(node.get());  // the link shows the inode's times
    if (node->write) {
      // Open writers would publish later bytes by renaming a new copy over this name,
      // which would split the link: refuse rather than let the names drift apart.
      if (node->open_writers > 0) {
        return Status(Code::kBusy, "link of a file open for writing through the mount");
      }
      if (node->write->needs_publish) CKPT_RETURN_IF_ERROR(PublishLocked(node.get()).status());
    }
    if (!node->on_backing) return NotFound("link source is not published");
    if (node->type == NodeType::kSymlink && node->link_target.empty()) {
      CKPT_ASSIGN_OR_RETURN(node->link_target, backing_->Readlink(PathLocked(node.get())));
    }
    const std::string from = PathLocked(node.get());
    const std::string to = JoinName(PathLocked(dir.get()), new_name);
    auto link = NewNodeLocked(dir.get(), new_name, node->type);
    if (node->link_group == 0) {
      node->link_group = node->ino;
      link_groups_[node->link_group].members.push_back(node);
    }
    node->attr.st_nlink++;
    node->attr.st_ctim = NowTs();
    for (const auto& other : LinkPeersLocked(node->link_group, node.get())) {
      other->attr.st_nlink = node->attr.st_nlink;
      other->attr.st_ctim = node->attr.st_ctim;
    }
    link->attr = node->attr;
    link->attr.st_ino = link->ino;
    if (node->write) link->attr.st_size = static_cast<off_t>(node->write->staged->size());
    link->link_target = node->link_target;
    link->link_group = node->link_group;
    link_groups_[link->link_group].members.push_back(link);
    link->on_backing = true;
    store::JournalEntry e;
    e.op = store::OpType::kLink;
    e.from = from;
    e.path = to;
    seq = AppendLocked(std::move(e), link.get());
    if (!seq.ok()) {
      node->attr.st_nlink--;
      DetachLocked(link);
      return seq.status();
    }
    // Until the link is applied the new name has no backing path: opens wait for it,
    // exactly as for a pending rename. The source's attributes are not refreshed from
    // the backing store before then either.
    link->rename_seq = *seq;
    node->pending_seq = std::max(node->pending_seq, *seq);
    out = EntryLocked(link.get());
  }
  CKPT_RETURN_IF_ERROR(WaitIfStrict(seq));
  return out;
}

Status Namespace::Fallocate(Handle* handle, int mode, uint64_t offset, uint64_t length) {
  if (mode != 0) {
    return Unsupported("fallocate mode " + std::to_string(mode) + " (only mode 0 is supported)");
  }
  FileHandle* h = handle->file();
  if (h == nullptr || !h->writable) return Status(Code::kPermission, "not open for writing");
  if (length == 0) return Invalid("fallocate of 0 bytes");
  const uint64_t end = offset + length;
  Node* node = h->node.get();
  for (RaceRetry race;; race.Lose()) {
    {
      MutexLock lock(&ns_mu_);
      if (node->type != NodeType::kFile) return Invalid("fallocate of a non-regular file");
      FoldWriteTimeLocked(node);
      if (!node->error.empty()) return Status(Code::kIo, node->error);
      if (node->attr.st_nlink > 1) {
        return Status(Code::kTooManyLinks, "a file with several hard links cannot be rewritten");
      }
    }
    // The copy it may begin, the reservation and the truncate: all without ns_mu_.
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<StagedFile> staged, WritableStaged(h));
    // Reserve the blocks in the temp file first, so ENOSPC comes back here and not at
    // the flush; then extend the file as mode 0 does (the new bytes read as zeros).
    CKPT_RETURN_IF_ERROR(backing_->Fallocate(staged->target()->fd(), FALLOC_FL_KEEP_SIZE,
                                             static_cast<off_t>(offset),
                                             static_cast<off_t>(length)));
    if (end <= staged->size()) return Status::Ok();
    Status st = staged->Truncate(end);
    if (st.code() == Code::kAborted && race.may_retry()) continue;  // frozen by a publish
    if (!st.ok()) return st;
    MutexLock lock(&ns_mu_);
    node->attr.st_mtim = node->attr.st_ctim = NowTs();
    return Status::Ok();
  }
}

}  // namespace ckptfs::fs
