// NamespaceReport: what the control tree (fs/control/control_tree.h) reads of the namespace, the
// NamespaceView (fs/namespace/namespace_view.h): names of inodes, the count of unpublished files,
// and the progress of a path's publication (user.ckptfs.progress).
//
// It owns no state: it reads nodes of the table (fs/namespace/node_table.h), publication's applied
// seq and checkpoint registry, and, for a checkpoint another node commits, the backing
// store (outside the lock).
//
// Thread-safe. Takes the table's lock (TableLock) to read nodes, never across I/O.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "fs/fs_types.h"
#include "fs/namespace/namespace_view.h"
#include "fs/namespace/node_table.h"
#include "store/publish/publication.h"

namespace ckptfs::fs {

class NamespaceReport final : public NamespaceView {
 public:
  // `config`, the parts and `table` must outlive it; it uses the parts' backing store and
  // publication.
  NamespaceReport(const FsConfig& config, const FsParts& parts, NodeTable& table);
  NamespaceReport(const NamespaceReport&) = delete;
  NamespaceReport& operator=(const NamespaceReport&) = delete;

  Result<std::string> PathOf(uint64_t ino) override EXCLUDES(table_.mu());
  Result<std::string> DirPathOf(uint64_t ino) override EXCLUDES(table_.mu());
  Counts CountNodes() override EXCLUDES(table_.mu());
  std::string ProgressJson(uint64_t ino) override EXCLUDES(table_.mu());

 private:
  const FsConfig& config_;
  NodeTable& table_;
  store::Publication* const publication_;
};

}  // namespace ckptfs::fs
