// Node: one name in the mount's view (the application's namespace).
//
// The view is the backing store plus every journal entry not yet applied. A directory
// is loaded from the backing store on first use; from then on its `children` are the
// truth for the mount, and journal entries change the backing store to match in order.
// Locking: every field of Node and WriteState but Node::data is guarded
// by the node table's lock, NodeTable::mu() (fs/namespace/node_table.h). They carry no
// GUARDED_BY: clang's analysis names a mutex by the expression that reaches it from the
// guarded field's object, and a node has no member that reaches its table (one pointer per
// node would name a different expression per node, `child->mu` vs `table_.mu()`, which
// the analysis cannot prove equal). What the analysis does check instead: every function
// that touches these fields is a NodeTable/part method annotated REQUIRES(table.mu()) or
// takes it (TableLock, fs/namespace/table_lock.h).
// `data` is guarded by the node's own `data_mu` (annotated): the data path reads it.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "common/mutex.h"
#include "store/flush/staged_file.h"

namespace ckptfs::fs {

// kSpecial: a FIFO, socket or device node; the kernel serves its I/O, never the daemon.
enum class NodeType { kDir, kFile, kSymlink, kSpecial };

// The node type of a backing store entry. FIFOs, sockets and devices are kSpecial: the
// daemon never opens them (an open of a FIFO would block a FUSE thread).
inline NodeType TypeOf(mode_t mode) {
  if (S_ISDIR(mode)) return NodeType::kDir;
  if (S_ISLNK(mode)) return NodeType::kSymlink;
  if (S_ISREG(mode)) return NodeType::kFile;
  return NodeType::kSpecial;
}

// Where a file being written stands on the backing store.
struct WriteState {
  std::shared_ptr<store::StagedFile> staged;
  uint64_t file_id = 0;
  std::string temp_name;         // ".ckptfs-tmp.<id>" inside `temp_dir`
  struct Node* temp_dir = nullptr;  // the directory that holds the temp file
  bool needs_publish = true;     // changed since its last publish entry
  uint64_t publish_seq = 0;      // last publish entry of this file, 0 if none
  bool discarded = false;        // unlinked before publication: never published
  // Publishes waiting, without the table's lock, for a write in progress to let them
  // freeze `staged` (WriteStates::PublishLocked); whoever would change this state waits.
  int freezing = 0;
  // The journal's last sequence number when this version's writes began (made, or cut to
  // zero by O_TRUNC): a commit appended at or before it names an earlier version, and
  // never waits for this one (G10).
  uint64_t began_after = 0;
};

// What read() and write() of an open file need of its node: a copy of the write state's
// current contents and the file's error, kept by the table (NodeTable::SyncDataLocked
// after every change of Node::write or Node::error), so the data path never takes
// the table's lock, which namespace work holds.
struct NodeData {
  std::shared_ptr<store::StagedFile> staged;  // Node::write->staged, or null
  bool accepting = false;              // writes go to `staged` (needs_publish or discarded)
  std::string error;                   // Node::error
  // The time of the latest write, not yet taken into Node::attr (FoldWriteTimeLocked).
  bool written = false;
  struct timespec write_time {};
};

struct Node {
  uint64_t ino = 0;
  NodeType type = NodeType::kFile;
  Node* parent = nullptr;  // null once unlinked; the parent owns its children
  std::string name;
  struct stat attr {};      // cached attributes; size of staged files comes from `write`
  // The mount's own attributes (mtime, ctime; for directories size and nlink too) for a
  // name this mount changed on the backing store: applying a journal entry moves the
  // backing inode's times, the mount's view moves only by the user's operations. They
  // are kept while the backing inode shows the times first seen once every entry was
  // applied (`stamp_*`); any later change there is someone else's and is shown.
  bool own_attrs = false;
  bool stamped = false;
  struct timespec stamp_mtime {}, stamp_ctime{};
  uint64_t nlookup = 0;     // kernel references (FUSE lookup count)
  // The name exists on the backing store once every entry <= pending_seq is applied.
  bool on_backing = false;
  uint64_t pending_seq = 0;  // last journal entry that changed this name or, for a
                             // directory, its list of children
  uint64_t rename_seq = 0;   // last journal entry that moved this name: until it is
                             // applied, the backing path differs from the mount path
  uint64_t made_seq = 0;     // a directory made through the mount: its mkdir's entry
  std::string link_target;   // symlinks
  // The names of one inode (hard links) share a group: the FUSE inode number of its
  // first name, reported as every name's st_ino, so that a link, unlink or chmod shows
  // through every name at once and tools see one file (0: a single name).
  uint64_t link_group = 0;
  // Directories.
  bool loaded = false;
  std::map<std::string, std::shared_ptr<Node>> children;
  uint64_t names_removed = 0;  // children that left through the mount (NodeTable::ProbeName)
  uint64_t names_evicted = 0;  // children let go of (GoneDirs)
  // Lookups and probes of names in it: GoneDirs takes a child out only if none ran while
  // its stat did.
  uint64_t lookups = 0;
  // Removed from the backing store by another node: forgotten once the kernel forgets it.
  bool gone_elsewhere = false;
  // The last journal entry that took a name out of this directory (an unlink, rmdir or
  // rename from it): until it is applied the backing listing still shows that name, so
  // the directory is not relisted (Namespace::NodeOpenDir).
  uint64_t removed_seq = 0;
  // Files being written; null when the backing file is the whole truth. Kept while any
  // handle of the file is open, so no handle ever loses the bytes it reads (the backing
  // file a handle opened before the write state existed is an older inode once the new
  // bytes are published over its name).
  std::unique_ptr<WriteState> write;
  int open_files = 0;    // open file handles (FUSE open/create), of any kind
  int open_writers = 0;  // those opened for writing
  std::string error;  // a failed publication: reads and opens fail with EIO
  // Strict: the close that waited for that publication got its failure (G7). Once no
  // handle is open, the name shows the backing store's version again if it has one (the
  // older file a failed rewrite left there, e.g. a tracker); a new file keeps failing.
  bool error_told = false;
  // Publication is halted at this file's entry (retried, or waiting for resume/abort);
  // its bytes are still served from staging and its temp file.
  std::string halt_error;
  bool halt_transient = false;  // retried by itself
  // A tracker withheld (G4): it names a checkpoint that never commits, so the backing store
  // keeps the one before it. Its progress says so until a later version is published.
  std::string withheld;
  // Lock order: the table's lock before data_mu. A leaf: held only to copy NodeData.
  mutable Mutex data_mu;
  NodeData data GUARDED_BY(data_mu);
  // The node's I/O token, held by a call that lost kRaceTries races on it, is kept by the
  // table (NodeTable::io_tokens_; RaceRetry, fs/namespace/table_lock.h).
};

}  // namespace ckptfs::fs
