// What a tracker names: a small file published after a checkpoint whose text is the
// checkpoint directory's name, its path, or (Megatron's latest_checkpointed_iteration.txt)
// the iteration number its directory ends with. Publication withholds one that names a
// given-up checkpoint; the commit gate lets one that names no checkpoint still to be
// committed go without waiting for it.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"
#include "store/primitives/backing_dir.h"
#include "store/publish/journal_entry.h"

namespace ckptfs::store {

// The text of tracker candidate `e` (IsTrackerCandidate), trimmed: a publish's bytes are
// durable in its temp file, a rename's in its source. An error for a file over 4 KiB.
Result<std::string> TrackerText(BackingDir* dir, const JournalEntry& e);

// Whether `text`, the trimmed text of a tracker at `tracker_path`, names checkpoint
// directory `ckpt` (a sibling of the tracker).
bool TrackerNames(std::string_view text, const std::string& tracker_path, const std::string& ckpt);

}  // namespace ckptfs::store
