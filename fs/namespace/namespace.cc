// The operations on names (fs/namespace/namespace.h): lookup, forget, mkdir, symlink, mknod,
// readlink, unlink, rmdir, rename, opendir; and the parts built over one node table.
#include "fs/namespace/namespace.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>

#include "common/path.h"
#include "fs/fs_util.h"
#include "fs/namespace/table_lock.h"

namespace ckptfs::fs {

Namespace::Namespace(const FsConfig& config, const FsParts& parts,
                     std::unique_ptr<NodeTable> table)
    : config_(config),
      backing_(parts.backing),
      publication_(parts.publication),
      own_table_(std::move(table)),
      table_(*own_table_),
      writes_(config, parts, table_),
      posix_(parts, table_, writes_),
      gone_(parts, table_, kernel_),
      events_(parts, table_, writes_, gone_, kernel_),
      report_(config, parts, table_) {}

Result<std::unique_ptr<Namespace>> Namespace::Create(const FsConfig& config,
                                                     const FsParts& parts) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<NodeTable> table, NodeTable::Create(config, parts));
  return std::unique_ptr<Namespace>(new Namespace(config, parts, std::move(table)));
}

Result<Entry> Namespace::NodeLookup(uint64_t parent, const std::string& name) {
  CKPT_RETURN_IF_ERROR(CheckName(name));
  if (IsTempName(name)) return NotFound(name);
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(table_.ProbeName(parent, name));
  for (;;) {
    TableLock lock(table_);
    auto dir = table_.NodeLocked(parent);
    if (!dir) return NotFound("stale parent");
    if (dir->type != NodeType::kDir) return Status(Code::kNotDir, name);
    Status loaded = table_.EnsureLoadedLocked(dir.get());
    if (LockDropped(loaded)) continue;  // listed without the lock: look again
    CKPT_RETURN_IF_ERROR(loaded);
    auto child = table_.ChildLocked(dir.get(), name);
    if (!child) return NotFound(name);
    return table_.EntryLocked(child.get());
  }
}

void Namespace::Forget(uint64_t ino, uint64_t nlookup) {
  {
    TableLock lock(table_);
    auto node = table_.NodeLocked(ino);
    if (!node || ino == kRootIno) return;
    node->nlookup -= std::min(node->nlookup, nlookup);
    table_.ForgetIfUnusedLocked(node.get());
    if (node->nlookup != 0 || node->parent == nullptr) return;
  }
  gone_.OnForgotten(ino);  // the last kernel reference into a checkpoint removed elsewhere
}

double Namespace::AttrTimeout(uint64_t ino) {
  if (ino < kFirstNodeIno && ino != kRootIno) return 0.0;  // control files: generated
  TableLock lock(table_);
  auto node = table_.NodeLocked(ino);
  return node ? std::min(table_.TimeoutFor(*node), kDefaultTimeout) : 0.0;
}

Result<Entry> Namespace::Mkdir(uint64_t parent, const std::string& name, mode_t mode,
                                const Caller& caller) {
  return MakeNode(parent, name, NodeType::kDir, S_IFDIR | (mode & 07777), "", 0, caller);
}

Result<Entry> Namespace::Symlink(const std::string& target, uint64_t parent,
                                  const std::string& name, const Caller& caller) {
  return MakeNode(parent, name, NodeType::kSymlink, S_IFLNK | 0777, target, 0, caller);
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

Result<Entry> Namespace::MakeNode(uint64_t parent, const std::string& name, NodeType type,
                                   mode_t mode, const std::string& link_target, dev_t rdev,
                                   const Caller& caller) {
  CKPT_RETURN_IF_ERROR(CheckNewName(parent, name));
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(table_.ProbeName(parent, name));
  Entry out;
  Result<uint64_t> seq = uint64_t{0};
  for (;;) {
    TableLock lock(table_);
    Result<std::shared_ptr<Node>> loaded = table_.LoadedDirLocked(parent, name);
    if (LockDropped(loaded.status())) continue;  // listed without the lock: start over
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Node> dir, std::move(loaded));
    if (table_.ChildLocked(dir.get(), name)) return Status(Code::kExists, name);
    const NewOwner owner = OwnerOfNew(caller, dir->attr, mode & S_IFMT, mode);
    auto node = table_.NewNodeLocked(dir.get(), name, type);
    table_.TouchDirLocked(dir.get(), type == NodeType::kDir ? 1 : 0);
    node->attr.st_mode = (mode & S_IFMT) | owner.mode;
    node->attr.st_uid = owner.uid;
    node->attr.st_gid = owner.gid;
    node->attr.st_rdev = rdev;
    node->attr.st_atim = node->attr.st_mtim = node->attr.st_ctim = Now();
    node->on_backing = true;
    store::JournalEntry e;
    e.path = table_.PathLocked(node.get());
    e.uid = owner.uid;
    e.gid = owner.gid;
    if (type == NodeType::kDir) {
      node->loaded = true;  // made here: nothing to load from the backing store
      e.op = store::OpType::kMkdir;
      e.mode = owner.mode;
    } else if (type == NodeType::kSpecial) {
      e.op = store::OpType::kMknod;
      e.mode = (mode & S_IFMT) | owner.mode;
      e.rdev = rdev;
    } else {
      node->attr.st_size = static_cast<off_t>(link_target.size());
      node->link_target = link_target;
      e.op = store::OpType::kSymlink;
      e.link_target = link_target;
    }
    seq = table_.AppendLocked(std::move(e), node.get());
    if (type == NodeType::kDir && seq.ok()) node->made_seq = *seq;
    out = table_.EntryLocked(node.get());
    break;
  }
  CKPT_RETURN_IF_ERROR(table_.WaitIfStrict(seq));
  if (type == NodeType::kDir && config_.peers && !config_.strict) WaitForOtherNodes(*seq);
  return out;
}

Result<Entry> Namespace::MakeEmptyFile(uint64_t parent, const std::string& name, mode_t mode,
                                        const Caller& caller) {
  CKPT_ASSIGN_OR_RETURN(auto created,
                        writes_.Create(parent, name, mode, O_CREAT | O_EXCL | O_WRONLY, caller));
  auto [entry, handle] = created;
  std::shared_ptr<Node> node = handle->file()->node;
  // The last writer: queues the publication of the empty file.
  std::unique_ptr<Handle> owned(handle);
  writes_.ReleaseFile(owned->file());
  uint64_t seq = 0;
  {
    TableLock lock(table_);
    if (node->write) seq = node->write->publish_seq;
  }
  if (seq != 0) CKPT_RETURN_IF_ERROR(table_.WaitIfStrict(seq));
  return entry;
}

// Across nodes a directory made here is looked up on the backing store by the others: DCP's
// coordinator makes the checkpoint directory and every rank, on any node, then creates its
// shard in it. So with peers a mkdir returns once it is applied, even in async mode (behind
// whatever this mount queued before it: a save's mkdir after the last one's publication). A
// halted journal does not fail it: it exists here, the others see it on resume.
void Namespace::WaitForOtherNodes(uint64_t seq) {
  if (seq == 0) return;
  Status st = publication_->WaitUnlessHalted(seq);
  if (!st.ok()) {
    spdlog::warn("mkdir (journal seq {}) is not on the backing store yet, other nodes do not "
                 "see it: {}", seq, st.ToString());
  }
}

Result<std::string> Namespace::Readlink(uint64_t ino) {
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(ino));
  std::string path;
  {
    TableLock lock(table_);
    auto node = table_.NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    if (node->type != NodeType::kSymlink) return Invalid("not a symlink");
    if (!node->link_target.empty()) return node->link_target;
    path = table_.PathLocked(node.get());
  }
  // The target is returned as text and resolved by the kernel inside the mount, never
  // by the daemon (G9). Read without the table's lock; a symlink's target never changes, so it is
  // kept if the name is still where it was read.
  CKPT_ASSIGN_OR_RETURN(std::string target, backing_->Readlink(path));
  TableLock lock(table_);
  auto node = table_.NodeLocked(ino);
  if (node && node->link_target.empty() && table_.PathLocked(node.get()) == path) {
    node->link_target = target;
  }
  return target;
}

Status Namespace::Unlink(uint64_t parent, const std::string& name, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(table_.ProbeName(parent, name));
  Result<uint64_t> seq = uint64_t{0};
  for (;;) {
    TableLock lock(table_);
    Result<std::shared_ptr<Node>> loaded = table_.LoadedDirLocked(parent, name);
    if (LockDropped(loaded.status())) continue;  // listed without the lock: start over
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Node> dir, std::move(loaded));
    auto node = table_.ChildLocked(dir.get(), name);
    if (!node) return NotFound(name);
    if (node->type == NodeType::kDir) return Status(Code::kIsDir, name);
    CKPT_RETURN_IF_ERROR(CheckSticky(caller, dir->attr, node->attr));
    const std::string path = table_.PathLocked(node.get());
    if (node->write && node->write->needs_publish) {
      seq = WriteStates::DiscardLocked(table_, node.get(), path);
    }
    // Publication is halted before this name's pending publish: deleting it drops that
    // publish (so `rm -r` of a failed checkpoint lets the rest go on), and a `.metadata`
    // that names it will not wait for it.
    (void)publication_->DropIfHalted(path);
    if (node->on_backing) {
      store::JournalEntry e;
      e.op = store::OpType::kUnlink;
      e.path = path;
      seq = table_.AppendLocked(std::move(e), node.get());
    }
    table_.TouchDirLocked(dir.get(), 0);
    table_.links().Unlink(node.get(), seq.ok() ? *seq : 0);
    node->on_backing = false;
    table_.DetachLocked(node);
    break;
  }
  return table_.WaitIfStrict(seq);
}

Status Namespace::Rmdir(uint64_t parent, const std::string& name, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(table_.ProbeName(parent, name));
  CKPT_RETURN_IF_ERROR(table_.LoadChildDir(parent, name));  // is it empty?
  Result<uint64_t> seq = uint64_t{0};
  for (;;) {
    TableLock lock(table_);
    Result<std::shared_ptr<Node>> loaded = table_.LoadedDirLocked(parent, name);
    if (LockDropped(loaded.status())) continue;  // listed without the lock: start over
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Node> dir, std::move(loaded));
    auto node = table_.ChildLocked(dir.get(), name);
    if (!node) return NotFound(name);
    if (node->type != NodeType::kDir) return Status(Code::kNotDir, name);
    CKPT_RETURN_IF_ERROR(CheckSticky(caller, dir->attr, node->attr));
    Status listed = table_.EnsureLoadedLocked(node.get());
    if (LockDropped(listed)) continue;
    CKPT_RETURN_IF_ERROR(listed);
    if (!node->children.empty()) return Status(Code::kNotEmpty, name);
    const std::string path = table_.PathLocked(node.get());
    store::JournalEntry e;
    e.op = store::OpType::kRmdir;
    e.path = path;
    seq = table_.AppendLocked(std::move(e), node.get());
    table_.TouchDirLocked(dir.get(), -1);
    node->on_backing = false;
    table_.DetachLocked(node);
    break;
  }
  return table_.WaitIfStrict(seq);
}

Status Namespace::Rename(uint64_t parent, const std::string& name, uint64_t new_parent,
                          const std::string& new_name, unsigned flags, const Caller& caller) {
  constexpr unsigned kNoReplace = 1, kExchange = 2;
  if (flags & kExchange) return Unsupported("RENAME_EXCHANGE");
  CKPT_RETURN_IF_ERROR(CheckNewName(new_parent, new_name));
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(new_parent));
  CKPT_RETURN_IF_ERROR(table_.ProbeName(parent, name));
  CKPT_RETURN_IF_ERROR(table_.ProbeName(new_parent, new_name));
  CKPT_RETURN_IF_ERROR(table_.LoadChildDir(new_parent, new_name));  // a replaced dir must be empty
  Result<uint64_t> seq = uint64_t{0};
  for (;;) {
    TableLock lock(table_);
    auto src_dir = table_.NodeLocked(parent);
    auto dst_dir = table_.NodeLocked(new_parent);
    if (!src_dir || !dst_dir || src_dir->type != NodeType::kDir ||
        dst_dir->type != NodeType::kDir) {
      return Status(Code::kNotDir, name);
    }
    // A directory listed without the lock: everything is looked at again.
    Status listed = table_.EnsureLoadedLocked(src_dir.get());
    if (listed.ok()) listed = table_.EnsureLoadedLocked(dst_dir.get());
    if (LockDropped(listed)) continue;
    CKPT_RETURN_IF_ERROR(listed);
    auto node = table_.ChildLocked(src_dir.get(), name);
    if (!node) return NotFound(name);
    CKPT_RETURN_IF_ERROR(CheckSticky(caller, src_dir->attr, node->attr));
    // A directory cannot move below itself.
    for (Node* n = dst_dir.get(); n != nullptr; n = n->parent) {
      if (n == node.get()) return Invalid("rename of a directory into itself");
    }
    auto victim = table_.ChildLocked(dst_dir.get(), new_name);
    if (victim == node) return Status::Ok();
    if (victim) {
      if (flags & kNoReplace) return Status(Code::kExists, new_name);
      CKPT_RETURN_IF_ERROR(CheckSticky(caller, dst_dir->attr, victim->attr));
      if (node->type == NodeType::kDir && victim->type != NodeType::kDir) {
        return Status(Code::kNotDir, new_name);
      }
      if (node->type != NodeType::kDir && victim->type == NodeType::kDir) {
        return Status(Code::kIsDir, new_name);
      }
      if (victim->type == NodeType::kDir) {
        Status victim_listed = table_.EnsureLoadedLocked(victim.get());
        if (LockDropped(victim_listed)) continue;
        CKPT_RETURN_IF_ERROR(victim_listed);
        if (!victim->children.empty()) return Status(Code::kNotEmpty, new_name);
      }
    }
    // The move changes the backing path of the node and of every node below it: a call
    // holding the I/O token of one of them (an open, a listing that lost kRaceTries races)
    // goes first, and everything is looked at again.
    if (RaceRetry::AwaitTokenHolders(table_, node.get(), RaceRetry::Change::kMove)) continue;
    const std::string from = table_.PathLocked(node.get());
    const std::string to = path::Join(table_.PathLocked(dst_dir.get()), new_name);
    if (victim && victim->write && victim->write->needs_publish) {
      seq = WriteStates::DiscardLocked(table_, victim.get(), to);
    }
    if (node->on_backing) {
      store::JournalEntry e;
      e.op = store::OpType::kRename;
      e.from = from;
      e.path = to;
      // The type tells publication that a directory moves (its checkpoint records move).
      if (node->type == NodeType::kDir) e.mode = S_IFDIR;
      seq = table_.AppendLocked(std::move(e), node.get());
      if (seq.ok()) node->rename_seq = *seq;
    } else if (victim && victim->on_backing) {
      // The replaced name must vanish now; the new file replaces it when published.
      store::JournalEntry e;
      e.op = store::OpType::kUnlink;
      e.path = to;
      if (victim->type == NodeType::kDir) e.mode = S_IFDIR;
      seq = table_.AppendLocked(std::move(e), victim.get());
    }
    if (victim) {
      table_.links().Unlink(victim.get(), seq.ok() ? *seq : 0);
      victim->on_backing = false;
      table_.DetachLocked(victim);
    }
    if (seq.ok() && *seq != 0) dst_dir->pending_seq = std::max(dst_dir->pending_seq, *seq);
    const bool moves_dir = node->type == NodeType::kDir && src_dir != dst_dir;
    table_.TouchDirLocked(src_dir.get(), moves_dir ? -1 : 0);
    table_.TouchDirLocked(dst_dir.get(), (moves_dir ? 1 : 0) -
                                      (victim && victim->type == NodeType::kDir ? 1 : 0));
    src_dir->children.erase(name);
    src_dir->names_removed++;
    node->parent = dst_dir.get();
    node->name = new_name;
    dst_dir->children[new_name] = node;
    node->attr.st_ctim = Now();
    break;
  }
  return table_.WaitIfStrict(seq);
}

Result<Handle*> Namespace::NodeOpenDir(uint64_t ino) {
  auto handle = std::make_unique<Handle>();
  DirHandle& dh = handle->kind.emplace<DirHandle>();
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(ino));
  CKPT_RETURN_IF_ERROR(table_.LoadDir(ino));
  // Pick up names other writers created on the backing store since the load: listed and
  // stat'ed without the table's lock, added if the directory is still where it was and quiescent.
  std::string path;
  bool relist = false;
  {
    TableLock lock(table_);
    auto node = table_.NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    if (node->type != NodeType::kDir) return Status(Code::kNotDir, "opendir");
    // Only while its listing is current (NodeTable::ListingCurrentLocked): other pending
    // entries do not matter. With two nodes, node 0's backlog (the next saves, the
    // tracker) kept an `rm -r` of an older checkpoint from listing it, and that `rm -r`
    // missed the shards other nodes wrote (the two-node soak: hundreds of directories
    // left, "Directory not empty"). A directory made again through the mount is not
    // relisted before its mkdir is applied: the listing would be the old one's.
    if (node->loaded && table_.ListingCurrentLocked(node.get())) {
      path = table_.PathLocked(node.get());
      relist = true;
    }
  }
  std::vector<std::pair<std::string, struct stat>> found;
  if (relist) {
    auto listed = backing_->List(path);
    if (listed.ok()) {
      std::set<std::string> known;
      {
        TableLock lock(table_);
        if (auto node = table_.NodeLocked(ino)) {
          for (const auto& [name, child] : node->children) known.insert(name);
        }
      }
      for (const auto& e : *listed) {
        if (known.count(e.name) || IsTempName(e.name) ||
            (ino == kRootIno && e.name == kCtlDirName)) {
          continue;
        }
        auto st = backing_->Stat(path::Join(path, e.name));
        if (st.ok()) found.emplace_back(e.name, *st);
      }
    }
  }
  TableLock lock(table_);
  std::shared_ptr<Node> node;
  for (;;) {
    node = table_.NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    if (node->type != NodeType::kDir) return Status(Code::kNotDir, "opendir");
    Status loaded = table_.EnsureLoadedLocked(node.get());
    if (!LockDropped(loaded)) {
      CKPT_RETURN_IF_ERROR(loaded);
      break;
    }
  }
  if (!found.empty() && table_.ListingCurrentLocked(node.get()) &&
      table_.PathLocked(node.get()) == path) {
    for (const auto& [name, st] : found) {
      if (!node->children.count(name)) table_.AddBackingChildLocked(node.get(), name, st);
    }
  }
  dh.node = node;
  dh.entries.push_back({".", ino, S_IFDIR});
  dh.entries.push_back({"..", node->parent ? node->parent->ino : kRootIno, S_IFDIR});
  if (ino == kRootIno) dh.entries.push_back({kCtlDirName, kCtlDirIno, S_IFDIR});
  for (const auto& [name, child] : node->children) {
    dh.entries.push_back({name, child->ino, child->attr.st_mode & S_IFMT});
  }
  return handle.release();
}

}  // namespace ckptfs::fs
