// ControlTree: the /.ckptfs directory (stats, checkpoints, metrics, and the tensor view
// below it) and the user.ckptfs.* xattrs on any path. It reports what the other units
// hold: the store objects it reports on (FsParts, borrowed) and of the namespace only the
// narrow NamespaceView (paths, counts, progress). It changes nothing of the namespace:
// its only actions are the operator's resume and abort of publication.
//
// Thread-safe. Its one lock, abort_mu_, is a leaf; the stats and progress it reads take
// the locks of their owners (NamespaceView, the store objects) one at a time.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <map>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "fs/control/tensor_view.h"
#include "fs/fs_stats.h"
#include "fs/fs_types.h"
#include "fs/namespace/handle.h"
#include "fs/namespace/namespace_view.h"
#include "gpu/staging_pool.h"
#include "store/dcp/key_index.h"
#include "store/flush/flush_pipeline.h"
#include "store/load/loader.h"
#include "store/primitives/backing_dir.h"
#include "store/primitives/state_db.h"
#include "store/publish/checkpoints.h"
#include "store/publish/journal.h"
#include "store/publish/publication.h"

namespace ckptfs::fs {

class ControlTree {
 public:
  // Borrowed: `config`, every part and `ns` must outlive the tree.
  ControlTree(const FsConfig& config, const FsParts& parts, NamespaceView* ns);
  ControlTree(const ControlTree&) = delete;
  ControlTree& operator=(const ControlTree&) = delete;

  // Whether `ino` is a file or directory of /.ckptfs (the tensor view's are TensorView's).
  static bool IsControl(uint64_t ino) { return ino >= kCtlDirIno && ino < kFirstNodeIno; }
  // /.ckptfs itself (under the root) and the names below it.
  Result<Entry> CtlLookup(uint64_t parent, const std::string& name);
  Result<struct stat> CtlGetAttr(uint64_t ino);
  // Control files and tensor view files: read-only, contents fixed at open.
  Result<Handle*> CtlOpen(uint64_t ino, int flags);
  Result<Handle*> CtlOpenDir(uint64_t ino);

  // The control files' contents.
  std::string StatsJson();
  void AddRetained(nlohmann::json* arr);  // issue 23: the in-memory copies
  std::string CheckpointsJson();
  std::string MetricsText();

  // xattrs of any path: state, progress, checksums, verify, the last abort's report.
  Result<std::string> GetXattr(uint64_t ino, const std::string& name) EXCLUDES(abort_mu_);
  // Operator controls (user.ckptfs.resume, user.ckptfs.abort); others are unsupported.
  Status SetXattr(uint64_t ino, const std::string& name, const std::string& value)
      EXCLUDES(abort_mu_);
  std::string ListXattr(uint64_t ino);

  // Operator controls (ckptfs-admin resume / abort): retry a halted publication now; drop
  // the pending entries at or below `path` (relative to the mount) and say what went.
  void Resume();
  std::vector<std::string> Abort(const std::string& path);

 private:
  const FsConfig& config_;
  const FsStats* const stats_;
  NamespaceView* const ns_;
  store::BackingDir* const backing_;
  store::StateDb* const db_;
  gpu::StagingPool* const pool_;
  store::FlushPipeline* const pipeline_;
  store::Publication* const publication_;
  const store::PublicationView view_;  // publication_'s, for reports
  store::KeyIndex* const index_;
  store::Loader* const loader_;
  TensorView* const tensors_;
  store::RetainedTier* const retained_;  // issue 23; null when off
  store::MemoryTier* const memory_tier_;  // issue 42

  Mutex abort_mu_;
  std::string last_abort_report_ GUARDED_BY(abort_mu_);
};

}  // namespace ckptfs::fs
