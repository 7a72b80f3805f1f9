#include "fs/namespace/memory_view.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "fs/namespace/node_table.h"
#include "fs/namespace/table_lock.h"
#include "store/publish/publication.h"

namespace ckptfs::fs {

struct stat MemoryView::StatOf(const store::MemAttr& a) const {
  struct stat st {};
  st.st_ino = InoOf(a.id);
  st.st_mode = (a.dir ? S_IFDIR : S_IFREG) | a.mode;
  st.st_nlink = a.nlink;
  st.st_uid = a.uid;
  st.st_gid = a.gid;
  st.st_size = static_cast<off_t>(a.size);
  st.st_blksize = 1 << 20;
  st.st_blocks = static_cast<blkcnt_t>((a.size + 511) / 512);
  st.st_atim = st.st_mtim = a.mtime;
  st.st_ctim = a.ctime;
  return st;
}

// No kernel caching of names or attributes: a newer commit evicts whole checkpoints.
Entry MemoryView::EntryOf(const store::MemAttr& a) const {
  return Entry{InoOf(a.id), StatOf(a), 0.0};
}

void MemoryView::PruneLocked() {
  if (marked_.size() < prune_at_) return;
  {
    TableLock lock(*table_);
    std::erase_if(marked_, [this](const auto& m) REQUIRES(table_->mu()) {
      return table_->NodeLocked(m.first) == nullptr;
    });
  }
  prune_at_ = std::max<size_t>(4096, 2 * marked_.size());
}

bool MemoryView::MarkedLocked(uint64_t ino) {
  if (auto it = marked_.find(ino); it != marked_.end()) return it->second;
  PruneLocked();
  std::string path;
  {
    TableLock lock(*table_);
    std::shared_ptr<Node> node = table_->NodeLocked(ino);
    if (!node) return false;
    if (node->type != NodeType::kDir || ino == kRootIno || !node->on_backing) {
      marked_[ino] = false;  // marked only through Mark() from now on
      return false;
    }
    path = table_->PathLocked(node.get());
  }
  // One read of the backing store per directory, remembered.
  Result<std::string> v = backing_->GetDirXattr(path, kTierXattr);
  const bool marked = v.ok() && *v == "memory";
  marked_[ino] = marked;
  if (marked) tier_->TreeRoot(ino, path);
  return marked;
}

std::optional<uint64_t> MemoryView::DirOf(uint64_t ino) {
  if (Owns(ino)) return IdOf(ino);
  if (ino < kFirstNodeIno) return std::nullopt;
  uint64_t root = 0;
  {
    MutexLock lock(&mu_);
    if (!MarkedLocked(ino)) return std::nullopt;
    root = tier_->TreeRoot(ino, "");
  }
  // After a restart, a tree is served once what the peers keep for it is back (bounded).
  tier_->restore_gate().Wait(kRestoreWait);
  return root;
}

bool MemoryView::MarkedAndBusy(uint64_t ino) {
  MutexLock lock(&mu_);
  return MarkedLocked(ino) && !tier_->TreeEmpty(ino);
}

Status MemoryView::Mark(uint64_t ino, const std::string& value) {
  if (Owns(ino)) return Status(Code::kNotPermitted, "already in a memory-only tree");
  if (!value.empty() && value != "memory") {
    return Invalid("user.ckptfs.tier takes \"memory\" (or is removed)");
  }
  CKPT_RETURN_IF_ERROR(table_->LoadDir(ino));  // the listing, without the table's lock
  for (bool listed = false; !listed;) {
    TableLock lock(*table_);
    std::shared_ptr<Node> node = table_->NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    if (node->type != NodeType::kDir || ino == kRootIno) {
      return Status(Code::kNotDir, "only a directory below the mount's root can be marked");
    }
    Status loaded = table_->EnsureLoadedLocked(node.get());
    if (LockDropped(loaded)) continue;  // listed without the lock: look again
    CKPT_RETURN_IF_ERROR(loaded);
    if (!value.empty() && !node->children.empty()) {
      return Status(Code::kNotEmpty, "a memory-only directory must be empty when it is marked");
    }
    listed = true;
  }
  if (value.empty() && MarkedAndBusy(ino)) {
    return Status(Code::kNotEmpty, "the memory-only tree still holds names");
  }
  // The mark is kept on the backing directory: it must be there under its name first.
  CKPT_RETURN_IF_ERROR(publication_->AwaitApplied(publication_->view().last_appended()));
  std::string path;
  {
    TableLock lock(*table_);
    std::shared_ptr<Node> node = table_->NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    path = table_->PathLocked(node.get());
  }
  CKPT_RETURN_IF_ERROR(value.empty() ? backing_->RemoveDirXattr(path, kTierXattr)
                                     : backing_->SetDirXattr(path, kTierXattr, value));
  MutexLock lock(&mu_);
  marked_[ino] = !value.empty();
  if (value.empty()) {
    tier_->DropTree(ino);
  } else {
    tier_->TreeRoot(ino, path);
  }
  spdlog::info("{} {} a memory-only directory (user.ckptfs.tier)", path,
               value.empty() ? "is no longer" : "is now");
  return Status::Ok();
}

Result<Entry> MemoryView::Lookup(uint64_t dir, const std::string& name) {
  CKPT_ASSIGN_OR_RETURN(store::MemAttr a, tier_->Lookup(dir, name));
  return EntryOf(a);
}

Result<struct stat> MemoryView::GetAttr(uint64_t ino) {
  CKPT_ASSIGN_OR_RETURN(store::MemAttr a, tier_->GetAttr(IdOf(ino)));
  return StatOf(a);
}

Result<struct stat> MemoryView::SetAttr(uint64_t ino, const struct stat& in, int to_set) {
  // FUSE_SET_ATTR_* values, as in fs/posix_ops.cc (this file stays free of libfuse).
  constexpr int kMode = 1 << 0, kUid = 1 << 1, kGid = 1 << 2, kSize = 1 << 3, kMtime = 1 << 5,
                kMtimeNow = 1 << 8;
  const mode_t mode = in.st_mode & 07777;
  const uint64_t size = static_cast<uint64_t>(in.st_size);
  struct timespec now {};
  clock_gettime(CLOCK_REALTIME, &now);
  store::MemoryTier::Change c;
  if (to_set & kMode) c.mode = &mode;
  if (to_set & kUid) c.uid = &in.st_uid;
  if (to_set & kGid) c.gid = &in.st_gid;
  if (to_set & kSize) c.size = &size;
  if (to_set & kMtimeNow) {
    c.mtime = &now;
  } else if (to_set & kMtime) {
    c.mtime = &in.st_mtim;
  }
  CKPT_ASSIGN_OR_RETURN(store::MemAttr a, tier_->SetAttr(IdOf(ino), c));
  return StatOf(a);
}

Result<Entry> MemoryView::Mkdir(uint64_t dir, const std::string& name, mode_t mode,
                                const Caller& caller) {
  CKPT_ASSIGN_OR_RETURN(store::MemAttr a, tier_->Mkdir(dir, name, mode, caller.uid, caller.gid));
  return EntryOf(a);
}

Result<std::pair<Entry, Handle*>> MemoryView::Create(uint64_t dir, const std::string& name,
                                                     mode_t mode, int flags,
                                                     const Caller& caller) {
  CKPT_ASSIGN_OR_RETURN(store::MemAttr a, tier_->Create(dir, name, mode, caller.uid, caller.gid,
                                                        (flags & O_EXCL) != 0));
  if ((flags & O_TRUNC) && a.size > 0) {
    const uint64_t zero = 0;
    store::MemoryTier::Change c;
    c.size = &zero;
    CKPT_ASSIGN_OR_RETURN(a, tier_->SetAttr(a.id, c));
  }
  auto h = std::make_unique<Handle>();
  h->kind.emplace<MemoryHandle>(MemoryHandle{a.id, false});
  return std::make_pair(EntryOf(a), h.release());
}

Result<Handle*> MemoryView::Open(uint64_t ino, int flags) {
  CKPT_ASSIGN_OR_RETURN(store::MemAttr a, tier_->GetAttr(IdOf(ino)));
  if (a.dir) return Status(Code::kIsDir, "open of a directory");
  if (flags & O_TRUNC) {
    const uint64_t zero = 0;
    store::MemoryTier::Change c;
    c.size = &zero;
    CKPT_RETURN_IF_ERROR(tier_->SetAttr(a.id, c).status());
  }
  auto h = std::make_unique<Handle>();
  h->kind.emplace<MemoryHandle>(MemoryHandle{a.id, (flags & O_TRUNC) != 0});
  return h.release();
}

Result<Handle*> MemoryView::OpenDir(uint64_t ino) {
  std::optional<uint64_t> dir = DirOf(ino);
  if (!dir) return Status(Code::kNotDir, "not a memory-only directory");
  CKPT_ASSIGN_OR_RETURN(auto list, tier_->List(*dir));
  auto h = std::make_unique<Handle>();
  DirHandle& dh = h->kind.emplace<DirHandle>();
  dh.entries.push_back({".", ino, S_IFDIR});
  dh.entries.push_back({"..", ino, S_IFDIR});
  for (const auto& [name, a] : list) {
    dh.entries.push_back({name, InoOf(a.id), static_cast<mode_t>(a.dir ? S_IFDIR : S_IFREG)});
  }
  return h.release();
}

Result<size_t> MemoryView::Read(const MemoryHandle& h, char* out, size_t len, uint64_t offset) {
  return tier_->Read(h.id, out, len, offset);
}

Status MemoryView::Write(MemoryHandle* h, store::ByteSource& src, uint64_t offset) {
  h->wrote = true;
  return tier_->Write(h->id, offset, src.size(),
                      [&src](char* out, size_t n) { return src.CopyTo(out, n); });
}

void MemoryView::Release(const MemoryHandle& h) {
  if (h.wrote) tier_->Closed(h.id);
}

Status MemoryView::Unlink(uint64_t dir, const std::string& name) {
  return tier_->Unlink(dir, name);
}

Status MemoryView::Rmdir(uint64_t dir, const std::string& name) { return tier_->Rmdir(dir, name); }

Status MemoryView::Rename(uint64_t dir, const std::string& name, uint64_t new_dir,
                          const std::string& new_name, unsigned flags) {
  constexpr unsigned kNoReplace = 1, kExchange = 2;  // RENAME_NOREPLACE, RENAME_EXCHANGE
  if (flags & kExchange) return Unsupported("RENAME_EXCHANGE in a memory-only tree");
  return tier_->Rename(dir, name, new_dir, new_name, (flags & kNoReplace) != 0);
}

}  // namespace ckptfs::fs
