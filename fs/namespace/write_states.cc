// The write path (fs/namespace/write_states.h): copy-on-write begin of a rewrite, create and open,
// writes into staging, publication, discard of unpublished bytes, release of a file
// handle, truncate, and staging pressure.
#include "fs/namespace/write_states.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <utility>

#include "fs/fs_util.h"
#include "fs/namespace/table_lock.h"
#include "store/dcp/checkpoint_source.h"
#include "store/dcp/commit_names.h"
#include "store/dcp/dcp_metadata.h"
#include "store/peer/peers.h"

namespace ckptfs::fs {

WriteStates::WriteStates(const FsConfig& config, const FsParts& parts, NodeTable& table)
    : config_(config),
      table_(table),
      backing_(parts.backing),
      publication_(parts.publication),
      loader_(parts.loader),
      stats_(parts.stats),
      staging_ctx_{parts.pool, parts.pipeline, parts.backing} {}

std::string WriteStates::TempPrefix(const FsConfig& config) {
  // With peers, other daemons write temp files into the same backing root with their own
  // counters: the node rank keeps the names apart.
  std::string name = kTempPrefix;
  if (config.peers) name += "n" + std::to_string(config.peers->self) + ".";
  return name;
}

WriteStates::WritePlan WriteStates::PlanWriteLocked(Node* node, bool truncate,
                                                  const UniqueFd* src) {
  table_.FoldWriteTimeLocked(node);
  WritePlan plan;
  plan.id = publication_->NextFileId();
  // Temp files live at the backing root, not beside their name: the name's directory
  // may itself still be a pending mkdir, and a root temp never moves with renames.
  plan.temp_name = publication_->TempName(plan.id);
  plan.uid = node->attr.st_uid;
  plan.gid = node->attr.st_gid;
  plan.mode = node->attr.st_mode & 07777;
  plan.truncate = truncate;
  plan.retainable = store::IsCheckpointFileName(node->name);
  plan.prev_file_id = node->write ? node->write->file_id : 0;
  if (!truncate) {
    // Copy-on-write: the real name keeps its old bytes until the new ones are published.
    if (node->write) {
      plan.prev = node->write->staged;
    } else if (src != nullptr) {
      plan.src_fd = src->get();
    } else if (node->on_backing) {
      plan.src_path = table_.PathLocked(node);
    }
  }
  return plan;
}

Result<std::unique_ptr<WriteState>> WriteStates::PrepareWrite(const WritePlan& plan) {
  const std::string& temp_path = plan.temp_name;  // at the root
  CKPT_RETURN_IF_ERROR(publication_->RegisterTemp(plan.id, temp_path));
  auto fail = [&](Status st) {
    (void)backing_->Unlink(temp_path);
    (void)publication_->ForgetTemp(plan.id);
    return st;
  };
  auto fd = backing_->OpenFile(temp_path, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (!fd.ok()) {
    (void)publication_->ForgetTemp(plan.id);
    return fd.status();
  }
  // The file's owner and exact mode (the daemon's umask must not change it), from the
  // start: the temp file counts against its owner's quota, and is published as it is.
  if (Status owned = OwnTemp(plan.uid, plan.gid, plan.mode, fd->get()); !owned.ok()) {
    return fail(owned);
  }
  uint64_t size = 0;
  if (!plan.truncate) {
    UniqueFd opened;
    int src_fd = plan.src_fd;
    if (plan.prev) {
      // The new version starts as a copy of the previous one, so all of its bytes must
      // be in its temp file.
      if (Status settled = plan.prev->target()->Settled(); !settled.ok()) return fail(settled);
      src_fd = plan.prev->target()->fd();
      size = plan.prev->size();
    } else if (src_fd >= 0 || !plan.src_path.empty()) {
      if (src_fd < 0) {
        auto by_path = backing_->OpenFile(plan.src_path, O_RDONLY);
        if (!by_path.ok()) return fail(by_path.status());
        opened = std::move(*by_path);
        src_fd = opened.get();
      }
      Result<struct stat> st = backing_->Fstat(src_fd);
      if (!st.ok()) return fail(st.status());
      size = static_cast<uint64_t>(st->st_size);
    }
    // copy_file_range shares extents where the file system can (XFS and btrfs reflink):
    // then a one-byte rewrite of a large file writes one block, not the file.
    if (size > 0) {
      if (Status copied = backing_->CopyFileRange(src_fd, fd->get(), size); !copied.ok()) {
        return fail(copied);
      }
    }
  }
  auto ws = std::make_unique<WriteState>();
  ws->file_id = plan.id;
  ws->temp_name = plan.temp_name;
  ws->temp_dir = table_.root().get();
  auto target = std::make_shared<store::FlushTarget>(plan.id, std::move(*fd), plan.retainable);
  ws->staged = std::make_shared<store::StagedFile>(staging_ctx_, std::move(target), size);
  return ws;
}

void WriteStates::AbandonWrite(const WriteState& ws) {
  // Nothing was written into it or journaled about it: remove it as a failed begin does.
  (void)backing_->Unlink(ws.temp_name);
  (void)publication_->ForgetTemp(ws.file_id);
}

void WriteStates::InstallWriteLocked(Node* node, std::unique_ptr<WriteState> ws) {
  {
    MutexLock lock(&staged_mu_);
    // Entries of destroyed files go once the set has doubled since the last sweep
    // (amortized O(1) per file), not only under staging pressure: an expired weak_ptr
    // still holds its file's make_shared block (found by the soak's leak bound, issue 41:
    // about 290 bytes per file written, for the daemon's life).
    if (live_staged_.size() >= staged_sweep_at_) {
      std::erase_if(live_staged_, [](const auto& f) { return f.expired(); });
      staged_sweep_at_ = std::max<size_t>(256, 2 * live_staged_.size());
    }
    live_staged_.insert(ws->staged);
  }
  if (node->write) ws->publish_seq = node->write->publish_seq;
  ws->began_after = publication_->view().last_appended();
  node->write = std::move(ws);
  node->attr.st_mtim = node->attr.st_ctim = Now();
  node->attr.st_blksize = kBlockSize;  // written through the mount: large write requests
  table_.SyncDataLocked(node);
  // A file made, or written again in place (a second save into the same directory opens
  // its shards with O_TRUNC): a checkpoint file's checkpoint is being written.
  if (node->parent != nullptr) {
    publication_->NoteWriteBegun(table_.PathLocked(node->parent), node->name);
  }
}

Result<uint64_t> WriteStates::DiscardLocked(NodeTable& table, Node* node,
                                            const std::string& path) {
  store::JournalEntry d;
  d.op = store::OpType::kDiscard;
  d.from = table.TempPathLocked(*node->write);
  d.path = path;
  d.file_id = node->write->file_id;
  node->write->needs_publish = false;
  node->write->discarded = true;
  table.SyncDataLocked(node);
  return table.AppendLocked(std::move(d), node);
}

void WriteStates::DropWriteStateLocked(NodeTable& table, Node* node) {
  // The cached attributes must describe the published file: with pending entries around
  // it they are served as they are, without asking the backing store.
  node->attr.st_size = static_cast<off_t>(node->write->staged->size());
  node->write.reset();
  table.SyncDataLocked(node);
  // The caller refreshes the attributes from the backing store after the lock
  // (RefreshAttr): a stat never runs under the table's lock.
}

void WriteStates::AwaitFreezeLocked(const Node* node) {
  TableLock::Await(table_, frozen_cv_,
                   [node] { return !(node->write && node->write->freezing > 0); });
}

Result<uint64_t> WriteStates::PublishLocked(NodeTable& table, Node* node) {
  if (RaceRetry::AwaitTokenHolders(table, node, RaceRetry::Change::kPublish)) {
    // A call that lost races on this node held its token: its copy or cut went first, and
    // the node may have changed meanwhile (published, dropped, discarded).
    if (!node->error.empty()) return Status(Code::kIo, node->error);
    if (!node->write || node->write->discarded || node->parent == nullptr) return uint64_t{0};
    if (!node->write->needs_publish) return node->write->publish_seq;
  }
  {
    // Writers stop taking this copy before it is frozen: one that took it already gets
    // kAborted and retries through WritableStaged, which waits for this publish.
    MutexLock lock(&node->data_mu);
    node->data.accepting = false;
  }
  if (!node->write->staged->TrySealAll()) {
    // A write or a truncate of this copy is in progress (a writer may be waiting for
    // staging space): wait for it to let go without the lock. Meanwhile `freezing` holds
    // off whoever would change the write state (AwaitFreezeLocked); an unlink may still
    // discard it, a rename move it, another publish queue it.
    const std::shared_ptr<store::StagedFile> staged = node->write->staged;
    node->write->freezing++;
    TableLock::WithoutLock(table, [&staged] { staged->SealAll(); });
    const bool same = node->write && node->write->staged == staged;
    if (same) node->write->freezing--;
    frozen_cv_.notify_all();
    // Published and dropped meanwhile by a concurrent publish: nothing left to queue.
    if (!same) {
      if (!node->error.empty()) return Status(Code::kIo, node->error);
      return uint64_t{0};
    }
    if (node->write->discarded) {
      staged->Thaw();  // unlinked meanwhile: never published, written on as it is
      return uint64_t{0};
    }
    if (!node->write->needs_publish) return node->write->publish_seq;  // queued meanwhile
  }
  table.FoldWriteTimeLocked(node);  // the published file keeps the time of its last write
  WriteState& ws = *node->write;
  auto target = ws.staged->target();
  store::JournalEntry e;
  e.op = store::OpType::kPublish;
  e.path = table.PathLocked(node);
  e.from = table.TempPathLocked(ws);
  e.file_id = ws.file_id;
  e.size = ws.staged->size();
  e.target = target;
  e.began_after = ws.began_after;
  // The published file keeps the times the mount showed (its last write, or a utimens),
  // not those of the flushes.
  e.atime_sec = node->attr.st_atim.tv_sec, e.atime_nsec = node->attr.st_atim.tv_nsec;
  e.mtime_sec = node->attr.st_mtim.tv_sec, e.mtime_nsec = node->attr.st_mtim.tv_nsec;
  table.NotePublishingLocked(ws.file_id, node);
  CKPT_ASSIGN_OR_RETURN(uint64_t seq, table.AppendLocked(std::move(e), node));
  ws.publish_seq = seq;
  ws.needs_publish = false;
  table.SyncDataLocked(node);
  node->on_backing = true;
  return seq;
}

Result<std::pair<Entry, Handle*>> WriteStates::Create(uint64_t parent, const std::string& name,
                                                     mode_t mode, int flags,
                                                     const Caller& caller) {
  CKPT_RETURN_IF_ERROR(CheckNewName(parent, name));
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(parent));
  CKPT_RETURN_IF_ERROR(table_.ProbeName(parent, name));
  // The temp file of a new name is made (registered with a synced write, opened, owned)
  // without the table's lock, then installed if the name is still free and its owner is
  // still the one planned; else it is made again (after races lost, holding the
  // directory's I/O token). One not installed is removed on the way out, after the lock.
  struct Ready {
    WriteStates* fs;
    std::unique_ptr<WriteState> ws;
    WritePlan plan;
    ~Ready() {
      if (ws) fs->AbandonWrite(*ws);
    }
  } ready{this, nullptr, {}};
  uint64_t existing = 0;
  for (RaceRetry race;; race.Lose()) {
    WritePlan plan;
    {
      TableLock lock(table_);
      race.Enter(table_, table_.NodeLocked(parent));  // what races is the directory's owner
      Result<std::shared_ptr<Node>> loaded = table_.LoadedDirLocked(parent, name);
      if (LockDropped(loaded.status())) continue;  // listed without the lock: start over
      CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Node> dir, std::move(loaded));
      std::shared_ptr<Node> node = table_.ChildLocked(dir.get(), name);
      if (node) {
        if (flags & O_EXCL) return Status(Code::kExists, name);
        if (node->type == NodeType::kDir) return Status(Code::kIsDir, name);
        existing = node->ino;
        break;
      }
      const NewOwner owner = OwnerOfNew(caller, dir->attr, S_IFREG, mode);
      const bool fits = ready.ws && ready.plan.uid == owner.uid &&
                        ready.plan.gid == owner.gid && ready.plan.mode == (owner.mode & 07777);
      if (!fits) {
        plan.id = publication_->NextFileId();
        plan.temp_name = publication_->TempName(plan.id);
        plan.uid = owner.uid;
        plan.gid = owner.gid;
        plan.mode = owner.mode & 07777;
        plan.truncate = true;
        plan.retainable = store::IsCheckpointFileName(name);
      } else {
        node = table_.NewNodeLocked(dir.get(), name, NodeType::kFile);
        node->attr.st_mode = S_IFREG | owner.mode;
        node->attr.st_uid = owner.uid;
        node->attr.st_gid = owner.gid;
        node->attr.st_atim = node->attr.st_mtim = node->attr.st_ctim = Now();
        InstallWriteLocked(node.get(), std::move(ready.ws));
        table_.TouchDirLocked(dir.get(), 0);
        auto handle = std::make_unique<Handle>();
        FileHandle& fh = handle->kind.emplace<FileHandle>();
        fh.node = node;
        fh.writable = (flags & O_ACCMODE) != O_RDONLY;  // O_RDONLY|O_CREAT makes it empty
        node->open_files++;
        if (fh.writable) node->open_writers++;
        Entry e = table_.EntryLocked(node.get());
        return std::make_pair(e, handle.release());
      }
    }
    if (ready.ws) AbandonWrite(*std::exchange(ready.ws, nullptr));  // its owner changed
    CKPT_ASSIGN_OR_RETURN(ready.ws, PrepareWrite(plan));
    ready.plan = plan;
  }
  // An existing file: the same as open(2) without O_CREAT.
  Result<Handle*> opened = NodeOpen(existing, flags);
  if (!opened.ok()) return table_.LogIfIo("open", existing, 0, opened.status());
  Handle* handle = *opened;
  TableLock lock(table_);
  return std::make_pair(table_.EntryLocked(handle->file()->node.get()), handle);
}

Result<Handle*> WriteStates::NodeOpen(uint64_t ino, int flags) {
  auto handle = std::make_unique<Handle>();
  FileHandle& fh = handle->kind.emplace<FileHandle>();
  const bool writable = (flags & O_ACCMODE) != O_RDONLY;
  CKPT_RETURN_IF_ERROR(table_.WaitForAncestorsUnlocked(ino));
  // The backing file is opened without the table's lock; if the name moved, was unlinked or
  // began a write meanwhile, the open starts over (after a few tries holding the node's I/O
  // token, still without the lock). `race` gives its token back after `lock` is released.
  RaceRetry race;
  TableLock lock(table_);
  std::shared_ptr<Node> node;
  for (;; race.Lose()) {
    race.Enter(table_, table_.NodeLocked(ino));
    node = table_.NodeLocked(ino);
    if (!node) return NotFound("stale inode");
    if (writable && (flags & O_TRUNC) && node->write && node->write->freezing > 0) {
      AwaitFreezeLocked(node.get());  // then it is published: cut the next copy
      node = table_.NodeLocked(ino);
      if (!node) return NotFound("stale inode");
    }
    // Its staged bytes may have been published since the wait above: then the backing
    // path must be current before it is opened (a rename may still be pending).
    while (!node->write && node->on_backing) {
      const uint64_t seq = table_.PendingRenameLocked(node.get());
      if (seq == 0) break;
      CKPT_RETURN_IF_ERROR(
          race.AwaitJournal(table_, [this, seq] { return publication_->AwaitApplied(seq); }));
    }
    if (node->type == NodeType::kDir) return Status(Code::kIsDir, "open of a directory");
    // The kernel serves FIFOs, sockets and devices itself; never block a thread on one.
    if (node->type == NodeType::kSpecial) return Status(Code::kInvalid, "open of a special file");
    if (!node->error.empty() && writable && (flags & O_TRUNC) && !node->write &&
        node->parent != nullptr) {
      // A file whose publication failed, rewritten from nothing (a save tried again after
      // EIO): the new, empty version owes nothing to the failed one. Anything else still
      // gets the failure (a read, an append, a handle still open on the failed version).
      node->error.clear();
      node->error_told = false;
      table_.SyncDataLocked(node.get());
    }
    if (!node->error.empty()) return Status(Code::kIo, node->error);
    if (!node->write && node->parent == nullptr) return NotFound("unlinked file");
    if (writable && node->attr.st_nlink > 1 && node->type == NodeType::kFile) {
      return Status(Code::kTooManyLinks, "a file with several hard links cannot be rewritten");
    }
    if (writable && (flags & O_TRUNC)) {
      if (node->write && node->write->needs_publish) {
        // Being written through another handle: cut what it holds. The cut waits for the
        // file's flushes: without the lock.
        const std::shared_ptr<store::StagedFile> staged = node->write->staged;
        Status cut = TableLock::WithoutLock(table_, [&staged] { return staged->Truncate(0); });
        // Frozen by a publish, or published and copied, meanwhile: start over.
        if (cut.code() == Code::kAborted && race.LostToFreeze(staged.get())) continue;
        if (table_.NodeLocked(ino) != node || !node->write || node->write->staged != staged) {
          continue;
        }
        CKPT_RETURN_IF_ERROR(cut);
        // A new version: no commit appended before now names it.
        node->write->began_after = publication_->view().last_appended();
      } else {
        // A new, empty copy: its temp file is made without the table's lock (as a first
        // write's).
        WritePlan plan = PlanWriteLocked(node.get(), /*truncate=*/true, nullptr);
        Result<std::unique_ptr<WriteState>> ws =
            TableLock::WithoutLock(table_, [this, &plan] { return PrepareWrite(plan); });
        if (!ws.ok()) return ws.status();
        if (table_.NodeLocked(ino) != node || !PlanHoldsLocked(*node, plan) ||
            (!node->write && node->parent == nullptr)) {
          // Changed meanwhile: start over from what it is now.
          TableLock::WithoutLock(table_, [this, &ws] { AbandonWrite(**ws); });
          continue;
        }
        InstallWriteLocked(node.get(), std::move(*ws));
        node->write->needs_publish = true;
        table_.SyncDataLocked(node.get());
      }
    }
    // Without O_TRUNC, opening for writing starts nothing: the first write does (Write).
    if (node->write) break;
    const std::string path = table_.PathLocked(node.get());
    auto open_backing = [this, &path]() -> std::pair<Result<UniqueFd>, Result<struct stat>> {
      Result<UniqueFd> fd = backing_->OpenFile(path, O_RDONLY);
      if (!fd.ok()) {
        Status failed = fd.status();
        return {std::move(fd), std::move(failed)};
      }
      Result<struct stat> st = backing_->Fstat(fd->get());
      return {std::move(fd), std::move(st)};
    };
    std::pair<Result<UniqueFd>, Result<struct stat>> opened =
        TableLock::WithoutLock(table_, open_backing);
    if (table_.NodeLocked(ino) != node || node->write || node->parent == nullptr ||
        table_.PathLocked(node.get()) != path || table_.PendingRenameLocked(node.get()) != 0) {
      continue;  // changed meanwhile: what was opened may not be this file's current version
    }
    auto& [fd, st] = opened;
    if (!st.ok()) return st.status();
    fh.backing.block = store::BlockIdFromStat(path, *st);
    fh.backing.dev = st->st_dev;
    fh.backing.ino = st->st_ino;
    fh.backing.fd = std::make_shared<const UniqueFd>(std::move(*fd));
    fh.keep_cache = !writable && table_.TimeoutFor(*node) > kDefaultTimeout;
    if (node->parent != nullptr && table_.CommittedDirLocked(node->parent)) {
      fh.backing.ckpt = table_.PathLocked(node->parent);
      fh.backing.file = node->name;
    }
    break;
  }
  fh.node = node;
  fh.writable = writable;
  node->open_files++;
  if (writable) node->open_writers++;
  lock.Unlock();
  // Without the table's lock (the handle is not yet anyone's): the loader looks the checkpoint up
  // in the key index and decides what the open means for a load.
  if (fh.backing.fd) loader_->Opened(&fh.backing, writable);
  return handle.release();
}

Result<std::shared_ptr<store::StagedFile>> WriteStates::WritableStaged(FileHandle* h,
                                                                       RaceRetry& race) {
  Node* node = h->node.get();
  for (;; race.Lose()) {
    WritePlan plan;
    {
      TableLock lock(table_);
      race.Enter(table_, h->node);
      AwaitFreezeLocked(node);  // a publish freezing this copy: write into the next
      if (!node->error.empty()) return Status(Code::kIo, node->error);
      if (node->write && (node->write->discarded || node->write->needs_publish)) {
        // Unlinked (keeps its bytes, never published), or a copy another write began.
        return node->write->staged;
      }
      // Not yet written through this mount, or its previous contents are queued for
      // publication and frozen: continue in a copy, published again later. With no write
      // state, `h->fd` is the current version (a write state lives while any handle is
      // open). After a few races lost, the call holds the node's I/O token (RaceRetry).
      plan = PlanWriteLocked(node, false, node->write ? nullptr : h->backing.fd.get());
    }
    // The temp file, its registration (a synced RocksDB write), the wait for the previous
    // version's flushes and the copy: all without the table's lock.
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<WriteState> ws, PrepareWrite(plan));
    TableLock lock(table_);
    if (!PlanHoldsLocked(*node, plan)) {
      lock.Unlock();
      AbandonWrite(*ws);  // the file changed meanwhile: plan again from what it is now
      continue;
    }
    InstallWriteLocked(node, std::move(ws));
    node->write->needs_publish = true;
    table_.SyncDataLocked(node);
    if (node->parent == nullptr) {
      // Unlinked after its last publication: the copy lives on, unnamed, until closed.
      CKPT_RETURN_IF_ERROR(DiscardLocked(table_, node, "").status());
    }
    return node->write->staged;
  }
}

bool WriteStates::PlanHoldsLocked(const Node& node, const WritePlan& plan) const {
  const uint64_t now_id = node.write ? node.write->file_id : 0;
  return now_id == plan.prev_file_id && !(node.write && node.write->needs_publish) &&
         node.error.empty() && node.attr.st_uid == plan.uid && node.attr.st_gid == plan.gid &&
         (node.attr.st_mode & 07777) == plan.mode;
}

Result<uint64_t> WriteStates::Resize(uint64_t ino, uint64_t size, const FileHandle* from) {
  for (RaceRetry race;; race.Lose()) {
    std::shared_ptr<store::StagedFile> staged;
    WritePlan plan;
    {
      TableLock lock(table_);
      race.Enter(table_, table_.NodeLocked(ino));
      std::shared_ptr<Node> node = table_.NodeLocked(ino);
      if (!node) return NotFound("stale inode");
      AwaitFreezeLocked(node.get());  // then it is published: truncate the next copy
      if (!node->error.empty()) return Status(Code::kIo, node->error);
      if (node->write && node->write->needs_publish) {
        staged = node->write->staged;
      } else {
        // ftruncate through a handle opened before any write: copy from its descriptor.
        const UniqueFd* src =
            !node->write && from != nullptr && from->node == node ? from->backing.fd.get() : nullptr;
        plan = PlanWriteLocked(node.get(), /*truncate=*/size == 0, src);
      }
    }
    if (!staged) {
      // The temp file, its registration and the copy: without the table's lock, as a first write's.
      CKPT_ASSIGN_OR_RETURN(std::unique_ptr<WriteState> ws, PrepareWrite(plan));
      TableLock lock(table_);
      std::shared_ptr<Node> node = table_.NodeLocked(ino);
      if (!node || !PlanHoldsLocked(*node, plan)) {
        lock.Unlock();
        AbandonWrite(*ws);  // changed meanwhile: plan again from what it is now
        continue;
      }
      InstallWriteLocked(node.get(), std::move(ws));
      node->write->needs_publish = true;
      table_.SyncDataLocked(node.get());
      staged = node->write->staged;
    }
    // Waits for the flushes in flight, then cuts the temp file: without the table's lock.
    Status st = staged->Truncate(size);
    // Frozen by a publish: cut the next copy.
    if (st.code() == Code::kAborted && race.LostToFreeze(staged.get())) continue;
    CKPT_RETURN_IF_ERROR(st);
    TableLock lock(table_);
    std::shared_ptr<Node> node = table_.NodeLocked(ino);
    if (!node || !node->write || node->write->staged != staged) return uint64_t{0};
    node->attr.st_mtim = node->attr.st_ctim = Now();
    if (node->open_writers == 0 && node->write->needs_publish) {
      return PublishLocked(table_, node.get());
    }
    return uint64_t{0};
  }
}

Status WriteStates::WriteData(FileHandle* h, store::ByteSource& src, uint64_t offset) {
  const size_t len = src.size();
  if (!h->writable) return Status(Code::kPermission, "not open for writing");
  Node* node = h->node.get();
  for (RaceRetry race;; race.Lose()) {
    race.EnterUnlocked(table_, h->node);  // after races lost: the node's I/O token
    // The data path: the node's data_mu only. The namespace is needed only to begin a
    // copy (the first write, or the first after a publish froze the contents).
    std::shared_ptr<store::StagedFile> staged;
    {
      MutexLock lock(&node->data_mu);
      if (node->data.accepting) staged = node->data.staged;
      node->data.write_time = Now();
      node->data.written = true;
    }
    if (!staged) {
      CKPT_ASSIGN_OR_RETURN(staged, WritableStaged(h, race));
    }
    Status st = staged->Write(src, offset);
    // Frozen by a publish (before any byte of `src` was consumed): write into the copy.
    if (st.code() == Code::kAborted && race.LostToFreeze(staged.get())) continue;
    if (!st.ok()) {
      table_.NoteError("write " + std::to_string(node->ino) + ": " + st.ToString());
      return st;
    }
    stats_->bytes_written.fetch_add(len, std::memory_order_relaxed);
    return Status::Ok();
  }
}

Status WriteStates::FlushData(FileHandle* h) {
  if (!h->writable) return Status::Ok();
  Result<uint64_t> seq = uint64_t{0};
  {
    TableLock lock(table_);
    Node* node = h->node.get();
    if (!node->error.empty()) return Status(Code::kIo, node->error);
    if (!node->write) return Status::Ok();
    CKPT_RETURN_IF_ERROR(node->write->staged->error());
    if (!config_.strict) return Status::Ok();
    if (node->write->needs_publish && node->parent != nullptr) seq = PublishLocked(table_, node);
    else seq = node->write->publish_seq;
  }
  Status st = table_.WaitIfStrict(seq);
  if (!st.ok()) {
    // The failure went back to this close (G7): readers need not get it forever.
    TableLock lock(table_);
    Node* node = h->node.get();
    if (!node->error.empty()) node->error_told = true;
  }
  return st;
}

void WriteStates::ReleaseFile(FileHandle* h) {
  bool dropped = false, told = false;
  {
    TableLock lock(table_);
    dropped = ReleaseFileLocked(h);
    told = dropped && h->node->error_told;
  }
  if (!dropped) return;
  if (told) ShowBackingAfterToldFailure(h->node.get());
  table_.RefreshAttr(h->node->ino);
}

void WriteStates::ShowBackingAfterToldFailure(Node* node) {
  // Strict (seed 5501): a tracker whose rewrite failed at close stayed unreadable (EIO)
  // until it was written again, so a job that reads it before it writes it (Megatron's
  // restart) could not start; the backing store still held the tracker before it.
  auto settled = [&] {
    table_.mu().AssertHeld();
    return node->error_told && !node->write && node->open_files == 0 && node->parent != nullptr;
  };
  std::string path;
  {
    TableLock lock(table_);
    if (!settled()) return;
    path = table_.PathLocked(node);
  }
  if (!backing_->Stat(path).ok()) return;  // a new file: nothing to show, it keeps failing
  TableLock lock(table_);
  if (!settled() || table_.PathLocked(node) != path) return;
  spdlog::info("{}: its publication failed and the close got the error; the backing store's "
               "version is shown again", path);
  node->error.clear();
  node->error_told = false;
  node->on_backing = true;
  table_.SyncDataLocked(node);
}

bool WriteStates::ReleaseFileLocked(FileHandle* h) {
  bool dropped = false;
  Node* node = h->node.get();
  node->open_files--;
  if (h->writable) node->open_writers--;
  // The last writer publishes (a file made by O_RDONLY|O_CREAT: its only handle).
  if (node->write && node->open_writers == 0 && node->write->needs_publish &&
      node->parent != nullptr) {
    auto seq = PublishLocked(table_, node);  // may drop the lock: what follows reads the node again
    if (!seq.ok()) {
      table_.NoteError("publish " + table_.PathLocked(node) + ": " + seq.status().ToString());
    }
  }
  if (node->write) {
    const WriteState& ws = *node->write;
    if (node->open_files == 0 && !ws.needs_publish && ws.publish_seq <= publication_->view().applied() &&
        table_.PublishingLocked(ws.file_id) == nullptr) {
      DropWriteStateLocked(table_, node);  // fully published: the backing file is the truth again
      dropped = true;
    }
  }
  table_.ForgetIfUnusedLocked(node);
  return dropped;
}

uint64_t WriteStates::PublishOpenFiles() {
  uint64_t unpublished = 0;
  TableLock lock(table_);
  // A publish may drop the lock (PublishLocked): the table may change meanwhile.
  std::vector<std::shared_ptr<Node>> nodes;
  table_.ForEachNodeLocked([&nodes](const std::shared_ptr<Node>& node) { nodes.push_back(node); });
  for (const auto& node : nodes) {
    if (node->write && node->write->needs_publish && node->parent != nullptr) {
      auto seq = PublishLocked(table_, node.get());
      if (!seq.ok()) ++unpublished;
    }
  }
  return unpublished;
}

void WriteStates::RelieveStagingPressure() {
  std::vector<std::shared_ptr<store::StagedFile>> files;
  {
    MutexLock lock(&staged_mu_);
    for (auto it = live_staged_.begin(); it != live_staged_.end();) {
      if (auto f = it->lock()) {
        files.push_back(std::move(f));
        ++it;
      } else {
        it = live_staged_.erase(it);
      }
    }
  }
  for (auto& f : files) f->SealIfIdle();
}

Status WriteStates::OwnTemp(uid_t uid, gid_t gid, mode_t mode, int fd) {
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

}  // namespace ckptfs::fs
