#include "fs/transport/passthrough_reads.h"

namespace ckptfs::fs {

PassthroughReads::PassthroughReads(const FsConfig& config, store::RetainedTier* retained,
                                   ReadPath* read, PassthroughStats* stats)
    : config_(config),
      retained_(retained),
      read_(read),
      stats_(stats),
      table_(PassthroughTable::Options{}, stats) {}

// The read side (Filesystem::ReadData's FileHandle branch) without its copy: only a file
// with no write state has backing bytes in the block cache; everything else takes Read().
std::optional<PassthroughReads::Source> PassthroughReads::SourceOf(Handle* h) {
  FileHandle* f = h->file();
  if (f == nullptr || f->writable || !f->fd) return std::nullopt;
  if (config_.peers && !f->ckpt.empty()) return std::nullopt;
  {
    MutexLock lock(&f->node->data_mu);
    if (!f->node->data.error.empty() || f->node->data.staged) return std::nullopt;
  }
  // The open's fstat (FileHandle::block) is this version: an OPEN asks twice within its
  // request (fs/transport/fuse_ops.cc), and a second fstat would only repeat it.
  if (f->block.size < config_.passthrough_min_bytes) return std::nullopt;
  // This version is held in the retained tier (issue 23): the daemon serves it from memory,
  // where the kernel would read the backing store.
  if (retained_ && retained_->Holds(f->block, 0)) return std::nullopt;
  return Source{f->fd->get(), f->backing_dev, f->backing_ino, f->block.size};
}

void PassthroughReads::OnNegotiated(bool on) {
  // The kernel passes this node's reads through: a prefetch into the block cache would
  // read every byte a second time, so a load's prefetch goes to the backing files' page
  // cache instead, which the passthrough readers read.
  if (on && !config_.peers) {
    read_->SetPageCachePrefetch(config_.passthrough_min_bytes, &stats_->page_cache_prefetched);
  }
}

}  // namespace ckptfs::fs
