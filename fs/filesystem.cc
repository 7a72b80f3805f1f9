// The facade: setup and shutdown, and the routing of each call by the kind of its inode
// (a namespace node, a /.ckptfs control file, the tensor view) or of its handle.
#include "fs/filesystem.h"

#include "store/cache/backing_source.h"
#include "store/peer/peers.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "fs/fs_util.h"

namespace ckptfs::fs {

Filesystem::Filesystem(const FsConfig& config) : config_(config) {}

Result<std::unique_ptr<Filesystem>> Filesystem::Create(const FsConfig& config, FsDeps deps) {
  std::unique_ptr<Filesystem> fs(new Filesystem(config));
  CKPT_RETURN_IF_ERROR(fs->Init(std::move(deps)));
  return fs;
}

Status Filesystem::Init(FsDeps deps) {
  if (deps.backing) {
    backing_ = std::move(deps.backing);
  } else {
    CKPT_ASSIGN_OR_RETURN(backing_, store::BackingDir::Open(config_.backing_dir));
  }
  if (deps.db) {
    db_ = std::move(deps.db);
  } else {
    CKPT_ASSIGN_OR_RETURN(db_, store::StateDb::Open(config_.state_dir));
  }
  gpu::StagingOptions pool_options;
  pool_options.total_bytes = config_.staging_bytes;
  pool_options.chunk_bytes = config_.chunk_bytes;
  pool_options.backend = config_.staging_backend;
  pool_options.hugepages = config_.staging_hugepages;
  pool_options.release_idle = std::chrono::seconds(config_.staging_release_after_s);
  if (deps.pool) {
    pool_ = std::move(deps.pool);
  } else {
    CKPT_ASSIGN_OR_RETURN(pool_, gpu::StagingPool::Create(pool_options));
  }
  store::FlushOptions flush_options;
  flush_options.threads = config_.flush_threads;
  flush_options.block_crcs = config_.write_checksums;
  flush_options.direct_io = config_.flush_direct_io;
  // Issue 23: the retained tier keeps what the flush threads wrote (never waits); issue 42:
  // the chunks themselves, lent by the pool, which puts spares in their place.
  if (config_.retain_bytes > 0 && config_.cache_bytes > 0 && !deps.cache) {
    store::RetainedTierOptions retain_options;
    retain_options.budget_bytes = config_.retain_bytes;
    retain_options.lender = pool_.get();
    retained_ = std::make_unique<store::RetainedTier>(backing_.get(), retain_options);
    flush_options.on_written = retained_.get();
    pool_->SetLendLimit(config_.retain_bytes);
  }
  if (deps.pipeline) {
    pipeline_ = std::move(deps.pipeline);
  } else {
    CKPT_ASSIGN_OR_RETURN(pipeline_, store::FlushPipeline::Create(backing_.get(), flush_options));
  }
  if (deps.index) {
    index_ = std::move(deps.index);
  } else {
    store::KeyIndexOptions index_options;
    // With peers, other nodes' shards come with their writers' block CRCs (the commit
    // query); what nobody vouched for is checksummed on its first full read, not read back.
    index_options.read_unvouched_items = config_.peers == nullptr;
    // What the retained tier kept of a checkpoint just committed is read from it.
    if (retained_) {
      retained_bytes_ = std::make_unique<store::RetainedBytes>(retained_.get());
      index_options.held = retained_bytes_.get();
    }
    CKPT_ASSIGN_OR_RETURN(index_,
                          store::KeyIndex::Create(backing_.get(), db_.get(), index_options));
  }
  std::unique_ptr<store::BackingSource> cache_source = std::move(deps.cache_source);
  std::shared_ptr<store::peer::Peers> peers;
  std::unique_ptr<store::BlockCache> cache = std::move(deps.cache);
  if (!cache && config_.cache_bytes > 0) {
    if (!cache_source) {
      store::BackingSourceOptions source_options;
      source_options.direct_io = config_.cache_direct_io;
      CKPT_ASSIGN_OR_RETURN(cache_source,
                            store::BackingSource::Create(backing_.get(), source_options));
    }
    store::BlockCacheOptions cache_options;
    cache_options.budget_bytes = config_.cache_bytes;
    store::BlockSource* source = cache_source.get();
    if (config_.peers) {
      // Misses of blocks owned by another node go to that node; the rest, and every peer
      // failure, to the backing store.
      auto made = store::peer::Peers::Create(*config_.peers, backing_.get(), cache_source.get());
      if (!made.ok()) return Status(made.status().code(), "--peers: " + made.status().message());
      peers = std::move(made).value();
      source = peers->source();
      if (retained_ && config_.retain_replicas > 0) {  // issue 23: replicas on the next node
        CKPT_ASSIGN_OR_RETURN(source,
                              peers->StartReplicas(retained_.get(), cache_options.block_bytes,
                                                   source));
      }
    }
    if (retained_) {  // issue 23: this node's retained copy first
      retained_source_ = std::make_unique<store::RetainedSource>(retained_.get(), source);
      source = retained_source_.get();
    }
    CKPT_ASSIGN_OR_RETURN(cache, store::BlockCache::Create(source, cache_options));
  } else if (config_.peers) {
    return Status(Code::kInvalid, "--peers needs the block cache (--cache-mem > 0)");
  }
  if (cache && !cache_source) {
    return Status(Code::kInvalid, "FsDeps: a block cache needs its cache_source");
  }
  // The loader before publication: publication queues the index build of each commit on it.
  loader_ = std::make_unique<store::Loader>(backing_.get(), index_.get(), std::move(cache_source),
                                            std::move(peers), std::move(cache));
  loader_->SetRetainedTier(retained_.get());
  loader_->Start();
  store::PublicationOptions pub_options;
  pub_options.gate.timeout = config_.commit_timeout;
  // Cross-node order only where other nodes write: with peers configured.
  pub_options.cross_node_order = config_.peers != nullptr;
  // Strict mode returns every failure to the operation that caused it: nothing waits.
  pub_options.halt_on_failure = !config_.strict;
  // Strict callers wait for their own entries; async ones for room in the backlog.
  pub_options.max_pending = config_.strict ? 0 : config_.max_pending;
  pub_options.temp_prefix = WriteStates::TempPrefix(config_);
  pub_options.retained = retained_.get();
  // Shards written through other mounts: the gate asks their daemons (docs/PEERS.md,
  // "Commit query"), once the peers serve.
  pub_options.peers = loader_->peers();
  pub_options.index_builds = loader_.get();
  pub_options.journal_trace = config_.journal_trace;
  CKPT_ASSIGN_OR_RETURN(publication_, store::Publication::Create(backing_.get(), db_.get(),
                                                                 index_.get(),
                                                                 std::move(pub_options)));
  tensors_ = std::make_unique<TensorView>(backing_.get(), index_.get());
  store::MemoryTierOptions memory_options;  // issue 42: memory-only directories
  memory_options.budget_bytes = config_.memory_ckpt_bytes;
  memory_tier_ = std::make_unique<store::MemoryTier>(memory_options);

  const FsParts parts{.backing = backing_.get(), .db = db_.get(), .pool = pool_.get(),
                      .pipeline = pipeline_.get(), .publication = publication_.get(),
                      .index = index_.get(), .loader = loader_.get(), .tensors = tensors_.get(),
                      .stats = &stats_, .retained = retained_.get(),
                      .memory_tier = memory_tier_.get()};
  CKPT_ASSIGN_OR_RETURN(ns_, Namespace::Create(config_, parts));
  memory_ = std::make_unique<MemoryView>(memory_tier_.get(), backing_.get(), &ns_->table(),
                                         publication_.get());
  pool_->SetPressureListener(&ns_->writes());
  // Publication reports to the namespace from here on: the entries the last stop left go
  // first, before the mount serves.
  publication_->Start(&ns_->events());
  control_ = std::make_unique<ControlTree>(config_, parts, &ns_->report());
  // Peers are served once the namespace exists: their commit queries ask it (PendingLocally).
  if (loader_->peers()) {
    // Issue 42: memory-only checkpoints commit once a peer holds them; what peers keep for
    // this node comes back now (the trees wait for it). Not without a budget for them.
    if (config_.memory_ckpt_bytes > 0) {
      CKPT_RETURN_IF_ERROR(
          loader_->peers()->StartMemoryReplicas(memory_tier_.get(), config_.state_dir));
    }
    loader_->peers()->SetShardStateProvider(publication_->shard_states());
    CKPT_RETURN_IF_ERROR(loader_->peers()->StartServing(loader_->cache()));
  }
  spdlog::info("ckptfs ready: backing {} staging {} MiB ({}), {} flush threads, {} mode",
               config_.backing_dir, pool_->limit_bytes() >> 20, pool_->backend(),
               config_.flush_threads, config_.strict ? "strict" : "async");
  return Status::Ok();
}

Filesystem::~Filesystem() {
  Shutdown();
  if (pool_) pool_->SetPressureListener(nullptr);  // the write states go first
}

void Filesystem::OnStopRequested() {
  if (publication_) publication_->ReleaseWaiters();
}

// ---------------------------------------------------------------- routing

Result<Entry> Filesystem::Lookup(uint64_t parent, const std::string& name) {
  if (TensorView::Owns(parent)) {
    CKPT_ASSIGN_OR_RETURN(auto v, tensors_->Lookup(parent, name));
    return Entry{v.ino, v.attr, kDefaultTimeout};
  }
  if (ControlTree::IsControl(parent) || (parent == kRootIno && name == kCtlDirName)) {
    return control_->CtlLookup(parent, name);
  }
  if (auto dir = memory_->DirOf(parent)) return memory_->Lookup(*dir, name);  // issue 42
  return ns_->NodeLookup(parent, name);
}

Result<struct stat> Filesystem::GetAttr(uint64_t ino) {
  if (TensorView::Owns(ino)) return tensors_->GetAttr(ino);
  if (ControlTree::IsControl(ino)) return control_->CtlGetAttr(ino);
  if (MemoryView::Owns(ino)) return memory_->GetAttr(ino);
  return ns_->table().GetAttr(ino);
}

void Filesystem::Forget(uint64_t ino, uint64_t nlookup) {
  if (!MemoryView::Owns(ino)) ns_->Forget(ino, nlookup);
}

Result<struct stat> Filesystem::SetAttr(uint64_t ino, const struct stat& in, int to_set,
                                        Handle* handle, const Caller& caller) {
  if (MemoryView::Owns(ino)) return memory_->SetAttr(ino, in, to_set);
  return ns_->posix().SetAttr(ino, in, to_set, handle, caller);
}

Result<Entry> Filesystem::Mkdir(uint64_t parent, const std::string& name, mode_t mode,
                                const Caller& caller) {
  if (auto dir = memory_->DirOf(parent)) return memory_->Mkdir(*dir, name, mode, caller);
  return ns_->Mkdir(parent, name, mode, caller);
}

// Memory-only trees hold directories and regular files only.
static Status NotInMemoryTree(const char* what) {
  return Unsupported(std::string(what) + " in a memory-only directory");
}

Result<Entry> Filesystem::Symlink(const std::string& target, uint64_t parent,
                                  const std::string& name, const Caller& caller) {
  if (memory_->DirOf(parent)) return NotInMemoryTree("a symlink");
  return ns_->Symlink(target, parent, name, caller);
}

Result<Entry> Filesystem::Mknod(uint64_t parent, const std::string& name, mode_t mode,
                                dev_t rdev, const Caller& caller) {
  if (memory_->DirOf(parent)) return NotInMemoryTree("mknod");
  return ns_->Mknod(parent, name, mode, rdev, caller);
}

Result<Entry> Filesystem::Link(uint64_t ino, uint64_t new_parent, const std::string& new_name,
                               const Caller& caller) {
  if (MemoryView::Owns(ino) != memory_->DirOf(new_parent).has_value()) {
    return Status(Code::kCrossDevice, "a link across a memory-only directory");
  }
  if (MemoryView::Owns(ino)) return NotInMemoryTree("a hard link");
  return ns_->posix().Link(ino, new_parent, new_name, caller);
}

Status Filesystem::Fallocate(Handle* h, int mode, uint64_t offset, uint64_t length) {
  if (h->memory() != nullptr) return NotInMemoryTree("fallocate");
  return ns_->posix().Fallocate(h, mode, offset, length);
}

Result<std::string> Filesystem::Readlink(uint64_t ino) {
  if (MemoryView::Owns(ino)) return Invalid("not a symlink");
  return ns_->Readlink(ino);
}

Status Filesystem::UpdatePeers(const Result<std::vector<std::string>>& nodes) {
  if (!loader_ || !loader_->peers()) return Invalid("this daemon runs without --peers");
  if (!nodes.ok()) {
    loader_->peers()->NoteMembershipRejected(nodes.status().message());
    return nodes.status();
  }
  return loader_->peers()->UpdateMembership(*nodes);
}

Status Filesystem::Unlink(uint64_t parent, const std::string& name, const Caller& caller) {
  if (auto dir = memory_->DirOf(parent)) return memory_->Unlink(*dir, name);
  return ns_->Unlink(parent, name, caller);
}

Status Filesystem::Rmdir(uint64_t parent, const std::string& name, const Caller& caller) {
  if (auto dir = memory_->DirOf(parent)) return memory_->Rmdir(*dir, name);
  // A marked directory is empty on the backing store; its names are in memory.
  if (Result<Entry> child = ns_->NodeLookup(parent, name); child.ok()) {
    const bool busy = memory_->MarkedAndBusy(child->ino);
    ns_->Forget(child->ino, 1);
    if (busy) return Status(Code::kNotEmpty, name + " (a memory-only directory)");
  }
  return ns_->Rmdir(parent, name, caller);
}

Status Filesystem::Rename(uint64_t parent, const std::string& name, uint64_t new_parent,
                          const std::string& new_name, unsigned flags, const Caller& caller) {
  const std::optional<uint64_t> from = memory_->DirOf(parent), to = memory_->DirOf(new_parent);
  if (from.has_value() != to.has_value()) {
    return Status(Code::kCrossDevice, "a rename across a memory-only directory's boundary");
  }
  if (from) return memory_->Rename(*from, name, *to, new_name, flags);
  return ns_->Rename(parent, name, new_parent, new_name, flags, caller);
}

Result<std::pair<Entry, Handle*>> Filesystem::Create(uint64_t parent, const std::string& name,
                                                     mode_t mode, int flags,
                                                     const Caller& caller) {
  if (auto dir = memory_->DirOf(parent)) return memory_->Create(*dir, name, mode, flags, caller);
  // Async: a new file waits while the backlog for the backing store is full (--max-pending).
  publication_->AwaitBacklogRoom();
  return ns_->writes().Create(parent, name, mode, flags, caller);
}

Result<Handle*> Filesystem::Open(uint64_t ino, int flags) {
  if (MemoryView::Owns(ino)) return memory_->Open(ino, flags);
  if ((flags & O_ACCMODE) != O_RDONLY && !ControlTree::IsControl(ino) && !TensorView::Owns(ino)) {
    publication_->AwaitBacklogRoom();  // a new version of the file, as Create
  }
  Result<Handle*> h = ControlTree::IsControl(ino) || TensorView::Owns(ino)
                           ? control_->CtlOpen(ino, flags)
                           : ns_->writes().NodeOpen(ino, flags);
  if (!h.ok()) return ns_->table().LogIfIo("open", ino, 0, h.status());
  return h;
}

Result<Handle*> Filesystem::OpenDir(uint64_t ino) {
  if (ControlTree::IsControl(ino) || TensorView::Owns(ino)) return control_->CtlOpenDir(ino);
  if (memory_->DirOf(ino)) return memory_->OpenDir(ino);
  return ns_->NodeOpenDir(ino);
}

Result<size_t> Filesystem::Read(Handle* h, char* out, size_t len, uint64_t offset) {
  Result<size_t> got = ReadData(h, out, len, offset);
  if (!got.ok()) return ns_->table().LogIfIo("read", h->ino(), offset, got.status());
  return got;
}

Result<size_t> Filesystem::ReadData(Handle* h, char* out, size_t len, uint64_t offset) {
  Result<size_t> got = size_t{0};
  if (ViewHandle* v = h->view()) {
    got = loader_->ReadWindow(v->fd->get(), v->base, v->size, out, len, offset);
  } else if (MemoryHandle* m = h->memory()) {
    got = memory_->Read(*m, out, len, offset);
  } else if (ContentHandle* c = h->content()) {
    if (offset >= c->content.size()) return size_t{0};
    size_t n = std::min<size_t>(len, c->content.size() - offset);
    std::memcpy(out, c->content.data() + offset, n);
    return n;
  } else if (FileHandle* f = h->file()) {
    // The data path: the node's data_mu only, never the table's lock.
    std::shared_ptr<store::StagedFile> staged;
    {
      MutexLock lock(&f->node->data_mu);
      if (!f->node->data.error.empty()) return Status(Code::kIo, f->node->data.error);
      staged = f->node->data.staged;
    }
    if (staged) {
      got = staged->Read(out, len, offset);
    } else if (!f->backing.fd) {
      // Opened while the file was being written: its write state lives until this handle
      // is closed (Release), so this is a broken invariant, not a backing-store error.
      return Status(Code::kInternal, "handle lost its data source (write state dropped early)");
    } else {
      got = loader_->ReadBacking(&f->backing, out, len, offset);
    }
  } else {
    return Status(Code::kIsDir, "read of a directory");
  }
  if (got.ok()) stats_.bytes_read.fetch_add(*got, std::memory_order_relaxed);
  return got;
}

std::optional<PassthroughSource> Filesystem::PassthroughSourceOf(Handle* h) {
  FileHandle* f = h->file();
  if (f == nullptr || f->writable || !f->backing.fd) return std::nullopt;
  if (config_.peers && !f->backing.ckpt.empty()) return std::nullopt;
  {
    MutexLock lock(&f->node->data_mu);
    if (!f->node->data.error.empty() || f->node->data.staged) return std::nullopt;
  }
  // The open's fstat (LoadFile::block) is this version: an OPEN asks twice within its
  // request (fs/transport/fuse_ops.cc), and a second fstat would only repeat it.
  if (f->backing.block.size < config_.passthrough_min_bytes) return std::nullopt;
  // This version is held in the retained tier (issue 23): the daemon serves it from memory,
  // where the kernel would read the backing store.
  if (retained_ && retained_->Holds(f->backing.block, 0)) return std::nullopt;
  return PassthroughSource{f->backing.fd->get(), f->backing.dev, f->backing.ino,
                           f->backing.block.size};
}

void Filesystem::OnInit(const KernelSession& k) {
  if (ns_) ns_->kernel().Set(k.invalidate);
  // The kernel passes this node's reads through: a prefetch into the block cache would
  // read every byte a second time, so a load's prefetch goes to the backing files' page
  // cache instead, which the passthrough readers read.
  if (k.passthrough && !config_.peers) {
    loader_->SetPageCachePrefetch(config_.passthrough_min_bytes,
                                  &stats_.passthrough.page_cache_prefetched);
  }
}

Result<std::optional<size_t>> Filesystem::ReadInPlace(Handle* h, size_t len, uint64_t offset,
                                                      const store::BlockCache::InPlaceUse& use) {
  FileHandle* f = h->file();
  if (f == nullptr || !f->backing.fd) return std::optional<size_t>();
  {
    MutexLock lock(&f->node->data_mu);
    if (!f->node->data.error.empty() || f->node->data.staged) return std::optional<size_t>();
  }
  auto got = loader_->ReadBackingInPlace(&f->backing, len, offset, use);
  if (!got.ok()) return ns_->table().LogIfIo("read", h->ino(), offset, got.status());
  if (*got) stats_.bytes_read.fetch_add(**got, std::memory_order_relaxed);
  return got;
}

Status Filesystem::Write(Handle* h, store::ByteSource& src, uint64_t offset) {
  if (MemoryHandle* m = h->memory()) return memory_->Write(m, src, offset);
  FileHandle* f = h->file();
  if (f == nullptr) return Status(Code::kPermission, "not open for writing");
  return ns_->table().LogIfIo("write", h->ino(), offset, ns_->writes().WriteData(f, src, offset));
}

Status Filesystem::Flush(Handle* h) {
  FileHandle* f = h->file();
  if (f == nullptr) return Status::Ok();
  return ns_->table().LogIfIo("flush", h->ino(), 0, ns_->writes().FlushData(f));
}

void Filesystem::Release(Handle* h) {
  std::unique_ptr<Handle> owned(h);
  if (MemoryHandle* m = h->memory()) memory_->Release(*m);
  if (FileHandle* f = h->file()) ns_->writes().ReleaseFile(f);
}

void Filesystem::ReleaseDir(Handle* h) { delete h; }

Result<std::string> Filesystem::GetXattr(uint64_t ino, const std::string& name) {
  if (name == kTierXattr) {  // issue 42: on a marked directory and everything below it
    if (memory_->DirOf(ino) || MemoryView::Owns(ino)) return std::string("memory");
    return NotFound(name);
  }
  return control_->GetXattr(ino, name);
}

Status Filesystem::SetXattr(uint64_t ino, const std::string& name, const std::string& value) {
  if (name == kTierXattr) return memory_->Mark(ino, value);  // issue 42
  return control_->SetXattr(ino, name, value);
}

std::string Filesystem::ListXattr(uint64_t ino) {
  std::string names = control_->ListXattr(ino);
  if (memory_->DirOf(ino) || MemoryView::Owns(ino)) names.append(kTierXattr, sizeof(kTierXattr));
  return names;
}

Result<struct statvfs> Filesystem::StatFs() { return backing_->StatFs(); }

ShutdownReport Filesystem::Shutdown(const std::function<void(const std::string&)>& waiting) {
  ShutdownReport report;
  if (shut_down_.exchange(true)) return report;
  if (loader_) loader_->StopServingPeers();
  if (loader_ && loader_->peers()) loader_->peers()->StopReplicas();
  if (loader_ && loader_->peers()) loader_->peers()->StopMemoryReplicas();
  if (retained_) retained_->DropAll();  // issue 23: a stop drops the memory tier
  // Issue 42: memory-only checkpoints leave this daemon; replicas stay on the peers.
  if (memory_tier_) memory_tier_->DropAll();
  if (!publication_ || !pipeline_) {  // Create() failed part way: nothing was served
    if (loader_) loader_->Stop();
    return report;
  }
  // Files still open (a lazy unmount) are published as they are now (G8).
  uint64_t unpublished = ns_ ? ns_->writes().PublishOpenFiles() : 0;
  spdlog::info("draining: {} journal entries pending", publication_->view().counts().pending);
  // A halted journal gets one more attempt; while publication progresses the stop waits.
  // Halted or waiting at the gate with no progress for stop_timeout, what is queued is
  // left for the next start, its bytes durable (G10, G11); only bytes that cannot be made
  // durable are dropped, never applied (G4), and the bytes parked for a retry let go.
  report.stop = publication_->Stop(config_.stop_timeout, waiting);
  unpublished += report.stop.dropped_publishes;
  pipeline_->DropParked(Status(Code::kAborted, "daemon stopped before the retry passed"));
  pipeline_->Drain();
  unpublished += publication_->view().counts().skipped;
  spdlog::info("drained: {} files published, {} not published, {} journal entries left for "
               "the next start",
               stats_.files_published.load(), unpublished, report.stop.left);
  loader_->Stop();
  report.unpublished = unpublished;
  return report;
}

}  // namespace ckptfs::fs
