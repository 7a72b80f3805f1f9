// Filesystem: the facade of the ckptfs namespace and data paths, independent of FUSE.
//
// fs/transport/fuse_ops.cc translates each FUSE request into one call here and turns the
// Status into a reply. The facade makes the dependencies (Create), drains at shutdown,
// and routes each call by the kind of its inode or handle (fs/namespace/handle.h) to the unit that
// owns it:
//   Namespace    fs/namespace/namespace.h: the operations on names, and the parts it builds
//                over one node table: NodeTable (fs/namespace/node_table.h: inodes, the
//                overlay = backing store + pending journal entries, getattr; its lock and
//                the locking rule are there), WriteStates (fs/namespace/write_states.h: create, open, write, flush,
//                release, publish), PosixOps (fs/namespace/posix_ops.h: setattr, link, fallocate),
//                JournalEvents (publication's observer), NamespaceReport (the control
//                tree's view);
//   Loader       store/load/loader.h: reads of backing files (block cache, prefetch, read
//                checksums): the facade hands it a handle's LoadFile and asks for bytes;
//   ControlTree  fs/control/control_tree.h: the /.ckptfs tree and the user.ckptfs.* xattrs;
//   TensorView   fs/control/tensor_view.h: the tensors/ view below /.ckptfs.
// The facade holds no lock of its own. Read and Write of a file take no namespace lock
// (see the locking rule in fs/namespace/node_table.h).
#pragma once

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "fs/control/control_tree.h"
#include "fs/control/tensor_view.h"
#include "fs/fs_stats.h"
#include "fs/fs_types.h"
#include "fs/namespace/handle.h"
#include "fs/namespace/memory_view.h"
#include "fs/namespace/namespace.h"
#include "fs/namespace/posix_access.h"
#include "gpu/staging_pool.h"
#include "store/cache/retained_bytes.h"
#include "store/cache/retained_tier.h"
#include "store/dcp/key_index.h"
#include "store/flush/flush_pipeline.h"
#include "store/load/loader.h"
#include "store/memory/memory_tier.h"
#include "store/primitives/backing_dir.h"
#include "store/primitives/state_db.h"
#include "store/publish/publication.h"

namespace ckptfs::fs {

// Dependencies a caller may inject instead of having Create() make them from the
// config (each one left null is made from it): tests drive the namespace and the write
// path on a FaultyBackingDir this way. The pipeline, key index and cache must be made over
// the injected `backing` (and `db`). Publication (journal, gate, registry) is always made
// here; the namespace is its observer (fs/namespace/journal_events.cc).
struct FsDeps {
  std::unique_ptr<store::BackingDir> backing;    // else BackingDir::Open(config.backing_dir)
  std::unique_ptr<store::StateDb> db;            // else StateDb::Open(config.state_dir)
  std::unique_ptr<gpu::StagingPool> pool;        // else from staging_bytes, chunk_bytes
  std::unique_ptr<store::FlushPipeline> pipeline;  // else from flush_threads
  std::unique_ptr<store::KeyIndex> index;
  // The block cache reads its misses through `cache_source` (made over the backing dir
  // when left null); both are made from cache_bytes when `cache` is left null (0: none).
  std::unique_ptr<store::BackingSource> cache_source;
  std::unique_ptr<store::BlockCache> cache;
};

// What Shutdown() could not publish, and what it left for the next start.
struct ShutdownReport {
  uint64_t unpublished = 0;  // files that could not be published (lost, not left)
  // Journal entries left for the next start (`left`), and what publication waited for
  // when the stop gave up on it (`waiting_for`).
  store::StopReport stop;
};

class Filesystem {
 public:
  static Result<std::unique_ptr<Filesystem>> Create(const FsConfig& config, FsDeps deps = {});
  ~Filesystem();  // Shutdown() if not yet done.
  Filesystem(const Filesystem&) = delete;
  Filesystem& operator=(const Filesystem&) = delete;

  // Operations that create names or check ownership take the `caller` (root when left
  // out: the daemon itself). New names belong to the caller on the mount at once and on
  // the backing store when published; see fs/namespace/posix_access.h for the rules.
  Result<Entry> Lookup(uint64_t parent, const std::string& name);
  void Forget(uint64_t ino, uint64_t nlookup);
  Result<struct stat> GetAttr(uint64_t ino);
  // `to_set` is a mask of FUSE_SET_ATTR_* bits, passed through as ints.
  Result<struct stat> SetAttr(uint64_t ino, const struct stat& in, int to_set, Handle* handle,
                              const Caller& caller = {});
  Result<Entry> Mkdir(uint64_t parent, const std::string& name, mode_t mode,
                      const Caller& caller = {});
  Result<Entry> Symlink(const std::string& target, uint64_t parent, const std::string& name,
                        const Caller& caller = {});
  // A FIFO, socket or device (journaled like mkdir), or an empty regular file (published
  // like a created and closed one). `mode` holds the S_IF* type.
  Result<Entry> Mknod(uint64_t parent, const std::string& name, mode_t mode, dev_t rdev,
                      const Caller& caller = {});
  // A hard link `new_parent/new_name` of `ino` (a file, symlink or special node; not a
  // directory: kNotPermitted). Journaled after the source's publication, so on the
  // backing store it is a real hard link. A file open for writing through the mount
  // cannot be linked (kBusy), and a file with several links cannot be written
  // (kTooManyLinks): publication replaces a name by rename, which would split the links.
  Result<Entry> Link(uint64_t ino, uint64_t new_parent, const std::string& new_name,
                     const Caller& caller = {});
  // fallocate(2) on an open file: mode 0 reserves the range on the backing store and
  // extends the size; other modes are kUnsupported (EOPNOTSUPP).
  Status Fallocate(Handle* h, int mode, uint64_t offset, uint64_t length);
  Result<std::string> Readlink(uint64_t ino);
  Status Unlink(uint64_t parent, const std::string& name, const Caller& caller = {});
  Status Rmdir(uint64_t parent, const std::string& name, const Caller& caller = {});
  Status Rename(uint64_t parent, const std::string& name, uint64_t new_parent,
                const std::string& new_name, unsigned flags, const Caller& caller = {});
  Result<std::pair<Entry, Handle*>> Create(uint64_t parent, const std::string& name, mode_t mode,
                                           int flags, const Caller& caller = {});
  // Opening for writing changes nothing: a file is copied for rewriting at its first write
  // (or O_TRUNC), so an open and close without a write leaves it, and its times, as they were.
  Result<Handle*> Open(uint64_t ino, int flags);
  // Open/Read/Write/Flush log every error they return as EIO with ino, path, offset.
  Result<size_t> Read(Handle* h, char* out, size_t len, uint64_t offset);
  // Read() of a backing file from the block cache without a copy
  // (store::Loader::ReadBackingInPlace): `use` gets the pinned blocks; nullopt: use Read().
  Result<std::optional<size_t>> ReadInPlace(Handle* h, size_t len, uint64_t offset,
                                            const store::BlockCache::InPlaceUse& use);
  // Write() with the bytes in `src` (a buffer, or the pipe libfuse spliced them into).
  Status Write(Handle* h, store::ByteSource& src, uint64_t offset);
  // flush(2) and fsync(2) of a handle alike: what the durability mode makes them wait for
  // (fs/namespace/write_states.h, FlushData).
  Status Flush(Handle* h);
  void Release(Handle* h);
  Result<Handle*> OpenDir(uint64_t ino);
  void ReleaseDir(Handle* h);
  Result<struct statvfs> StatFs();
  Result<std::string> GetXattr(uint64_t ino, const std::string& name);
  // Operator controls (user.ckptfs.resume, user.ckptfs.abort); others are unsupported.
  Status SetXattr(uint64_t ino, const std::string& name, const std::string& value);
  std::string ListXattr(uint64_t ino);

  // Publishes everything still staged and waits until the journal is empty (G8), as long
  // as publication progresses: when it is halted, or a commit waits at the gate, with no
  // progress for `config.stop_timeout`, what is queued is left for the next start
  // (store::Journal::CloseWithin). `waiting` (may be empty) gets what publication waits
  // for each time that changes, "" when it no longer waits. A second call reports nothing.
  ShutdownReport Shutdown(const std::function<void(const std::string&)>& waiting = {});
  // The FUSE session has ended (a stop): operations still blocked in a journal wait return
  // an error now (store::Journal::ReleaseWaiters), so that the loop can end and Shutdown()
  // hand publication over. Publication itself goes on.
  void OnStopRequested();

  // The /.ckptfs tree: the control files' contents (stats, checkpoints, metrics) and the
  // operator controls (ckptfs-admin resume / abort).
  ControlTree* control() { return control_.get(); }
  // The scheduler's new peer list (mount/peers_watch.h: --peers-file changed, or SIGHUP),
  // as read: the nodes (store::peer::Peers::UpdateMembership), or why the file could not be
  // read or parsed (counted with the membership; returned). Invalid without --peers.
  Status UpdatePeers(const Result<std::vector<std::string>>& nodes);

  // FUSE passthrough (fs/transport/passthrough.h; the transport keeps each inode's io
  // mode). The backing file a read-only open may be passed through to (no syscall), or
  // nullopt when the daemon must serve it: a writable handle, a file with staged bytes
  // (read-your-writes) or a failed publication, a control file or tensor view, a file below
  // passthrough_min_bytes, a version the retained tier holds, or a checkpoint's file while
  // peers share the load (blocks come from the peer that owns them).
  std::optional<PassthroughSource> PassthroughSourceOf(Handle* h);
  // The INIT exchange is done. `passthrough`: the kernel will pass reads through; a load
  // then no longer prefetches into the block cache (without peers): the kernel reads the
  // bytes. `invalidate`: tells the kernel to drop what it caches (fs/namespace/
  // kernel_cache.h: an entry, or an inode's attributes and pages; the transport's
  // EntryInvalidator, which never blocks); empty: nobody.
  struct KernelSession {
    bool passthrough = false;
    std::function<void(uint64_t ino, const std::string& name)> invalidate;
  };
  void OnInit(const KernelSession& k);

  const FsConfig& config() const { return config_; }
  // The counters the transport keeps: how requests reach the daemon (`fuse`,
  // fs/transport/fuse_server.cc) and passthrough opens (`passthrough`, its PassthroughTable).
  FsStats* stats() { return &stats_; }
  // The attribute timeout of a getattr/setattr reply for `ino` (0 for hard-linked names).
  double AttrTimeout(uint64_t ino) { return ns_->AttrTimeout(ino); }

 private:
  explicit Filesystem(const FsConfig& config);
  Status Init(FsDeps deps);
  // Read by handle kind: a tensor view range, a control file's contents, a file's staged
  // bytes (read-your-writes) or its backing file through the block cache.
  Result<size_t> ReadData(Handle* h, char* out, size_t len, uint64_t offset);

  // ------------------------------------------------------------ dependencies
  const FsConfig config_;
  FsStats stats_;
  std::unique_ptr<store::BackingDir> backing_;
  std::unique_ptr<store::StateDb> db_;
  // Outlives the retained tier, which holds chunks lent from it (issue 42).
  std::unique_ptr<gpu::StagingPool> pool_;
  // Issue 23: outlive the flush threads (pipeline_) and the block cache (loader_) that call
  // them.
  std::unique_ptr<store::RetainedTier> retained_;
  std::unique_ptr<store::RetainedSource> retained_source_;
  std::unique_ptr<store::RetainedBytes> retained_bytes_;  // the index builds read through it
  std::unique_ptr<store::MemoryTier> memory_tier_;  // issue 42: memory-only directories
  std::unique_ptr<store::FlushPipeline> pipeline_;
  std::unique_ptr<store::KeyIndex> index_;
  // Journal, commit gate, shard states (which outlive the peer server in loader_),
  // registry; it queues index builds on loader_ until Shutdown() closed the journal.
  std::unique_ptr<store::Publication> publication_;
  std::unique_ptr<store::Loader> loader_;
  std::unique_ptr<TensorView> tensors_;
  // ------------------------------------------------------------ the units it routes to
  std::unique_ptr<Namespace> ns_;
  std::unique_ptr<MemoryView> memory_;  // over ns_'s table and memory_tier_
  std::unique_ptr<ControlTree> control_;

  std::atomic<bool> shut_down_{false};
};

// Filesystem::Write of the bytes [data, data + len).
inline Status WriteAt(Filesystem& fs, Handle* h, const char* data, size_t len, uint64_t offset) {
  store::MemorySource src(data, len);
  return fs.Write(h, src, offset);
}

}  // namespace ckptfs::fs
