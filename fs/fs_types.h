// The types the facade and its units share: the configuration, a lookup's entry and the
// fixed inode numbers of the control tree.
#pragma once

#include <sys/stat.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "common/control_names.h"

namespace ckptfs::store {
class BackingDir;
class FlushPipeline;
class KeyIndex;
class Loader;
class Publication;
class RetainedTier;
class MemoryTier;
class StateDb;
namespace peer {
struct PeerNodeOptions;
}  // namespace peer
}  // namespace ckptfs::store
namespace ckptfs::gpu {
class StagingPool;
}  // namespace ckptfs::gpu

namespace ckptfs::fs {

struct FsConfig {
  std::string backing_dir;
  std::string mountpoint;
  std::string state_dir;
  std::string journal_trace;  // store/publish/journal_trace.h; empty: none
  bool strict = false;
  uint64_t staging_bytes = uint64_t{1} << 30;
  uint64_t chunk_bytes = uint64_t{4} << 20;
  int flush_threads = 2;
  uint64_t cache_bytes = uint64_t{1} << 30;  // block cache budget for reads; 0 disables
  bool cache_direct_io = true;  // block cache reads with O_DIRECT where the backing fs allows
  // Issue 23: memory that keeps the newest committed checkpoint this node wrote
  // (store/cache/retained_tier.h); 0: off. Needs write_checksums and the block cache.
  uint64_t retain_bytes = 0;
  int retain_replicas = 0;  // with peers: copies kept on another node (0 or 1)
  // Issue 42: memory for the files of memory-only directories (store/memory/memory_tier.h);
  // 0: a write there fails with ENOSPC.
  uint64_t memory_ckpt_bytes = 0;
  std::string staging_backend = "auto";
  bool staging_hugepages = false;  // gpu::StagingOptions::hugepages
  int staging_release_after_s = 0;  // gpu::StagingOptions::release_idle; 0 keeps it pinned
  bool flush_direct_io = true;     // store::FlushOptions::direct_io
  // Block CRCs of every flushed chunk, so the index checksums items without re-reading them.
  bool write_checksums = true;
  // How long a `.metadata` publication waits for shards from other writers to appear.
  std::chrono::milliseconds commit_timeout{std::chrono::minutes(10)};
  // Async: entries queued for the backing store before a create waits for room (0: none).
  size_t max_pending = 0;
  // How long a stop waits without progress while publication is halted or a commit waits
  // at the gate, before it leaves what is queued for the next start (Shutdown()).
  std::chrono::milliseconds stop_timeout{std::chrono::seconds(30)};
  // Cooperating peer daemons (issue 12); null: this daemon works alone.
  std::shared_ptr<const store::peer::PeerNodeOptions> peers;
  // Reads of published files go through the kernel's FUSE passthrough where it can
  // (fs/transport/passthrough.h); false: the daemon serves every read.
  bool passthrough = true;
  // Files smaller than this are served by the daemon even so: small files are where
  // a writer next to a reader is common (trackers, torch's FileStore), which passthrough
  // would make wait (fs/transport/passthrough.h); their reads gain little from it.
  uint64_t passthrough_min_bytes = uint64_t{1} << 20;
};

// A backing file the kernel may serve a read-only open from itself (FUSE passthrough,
// fs/transport/passthrough.h): its descriptor, borrowed from the open handle, and its
// identity and size as the open found them.
struct PassthroughSource {
  int fd;
  dev_t dev;
  ino_t ino;
  uint64_t size;
};

struct Entry {
  uint64_t ino = 0;
  struct stat attr {};
  double timeout = 1.0;
};

class TensorView;
struct FsStats;

// The objects the facade makes and owns (Filesystem::Init), lent to the units it routes
// to (Namespace, ControlTree): each must outlive them.
struct FsParts {
  store::BackingDir* backing = nullptr;
  store::StateDb* db = nullptr;
  gpu::StagingPool* pool = nullptr;
  store::FlushPipeline* pipeline = nullptr;
  store::Publication* publication = nullptr;
  store::KeyIndex* index = nullptr;
  store::Loader* loader = nullptr;
  TensorView* tensors = nullptr;
  FsStats* stats = nullptr;
  store::RetainedTier* retained = nullptr;  // issue 23; null when off
  store::MemoryTier* memory_tier = nullptr;  // issue 42
};

// Fixed inode numbers of the control tree.
inline constexpr uint64_t kRootIno = 1;
inline constexpr uint64_t kCtlDirIno = 2;
inline constexpr uint64_t kCtlStatsIno = 3;
inline constexpr uint64_t kCtlCheckpointsIno = 4;
inline constexpr uint64_t kCtlMetricsIno = 5;
inline constexpr uint64_t kFirstNodeIno = 16;
// kCtlDirName and kTempPrefix: common/control_names.h.

}  // namespace ckptfs::fs
