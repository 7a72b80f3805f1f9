// How one journal entry changes the backing store (Journal's publisher applies it, in
// order, once its turn and its bytes are there). Each op is made durable where the
// guarantees need it: a publish or a commit rename that cannot be synced is withdrawn
// (G4, G5), a commit name an abort withdraws (JournalEntry::withdraw) is unlinked and its
// directory synced, a new name's owner and exact mode follow it (multi-user POSIX).
//
// Stateless; called without any journal lock.
#pragma once

#include <string>

#include "common/status.h"
#include "store/primitives/backing_dir.h"
#include "store/publish/journal_entry.h"

namespace ckptfs::store {

// Applies `e` to `dir`. `renamed` (may be null) is set when a kRename left its source
// under its new name (the temp records below it follow: TempRecords::Move). `retry`: an
// earlier attempt of this entry failed, so a kRename whose source is gone and whose target
// is there was done by it (its directory fsync failed, and the rename back too).
// `keep_replaced`: a kPublish over an existing file in a directory that holds a `.metadata`
// (a rewrite of a committed checkpoint) leaves the replaced file under its temp name
// `from` instead of removing it, and sets `kept` (the journal puts it back if the rewrite
// is aborted, removes it once the rewrite commits).
Status ApplyEntry(BackingDir* dir, const JournalEntry& e, bool* renamed, bool retry = false,
                  bool keep_replaced = false, bool* kept = nullptr);

// After a failed attempt of `e`: whether its name holds what it would have put there (its
// rename landed, then the directory fsync failed, and the rename back too).
bool LeftInPlace(BackingDir* dir, const JournalEntry& e);

// With other nodes publishing into the same directories (--peers: JournalOptions::
// shared_dirs), what the failure `st` of `e` becomes when another node's work crossed it:
// - An rmdir that finds files this node's application never saw (another node published
//   them after this node listed the directory: the shard of a save a rank abandoned,
//   published late), when `rmdir_returned` (async mode: the application was told the
//   directory is gone long ago): those files go, then the directory; the removal is the
//   application's later word. A subdirectory there is left, and so is the error. In strict
//   mode the caller gets ENOTEMPTY, as from any file system.
// - A publish whose directory is gone from the backing store (another node's application
//   removed it, and its rmdir was applied first): kSuperseded, so nothing of it appears and
//   nothing halts for a file the application no longer has.
// Any other failure is returned as it is.
Status SettleAcrossNodes(BackingDir* dir, const JournalEntry& e, const Status& st,
                         bool rmdir_returned);

// Fsyncs the file at `path` (a publish's temp file, by name: one that a previous run left
// has no FlushTarget).
Status SyncFileAt(BackingDir* dir, const std::string& path);

}  // namespace ckptfs::store
