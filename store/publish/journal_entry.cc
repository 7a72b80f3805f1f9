#include "store/publish/journal_entry.h"

#include <sys/stat.h>

#include <cinttypes>
#include <cstdio>

#include "common/path.h"
#include "store/dcp/commit_names.h"
#include "store/primitives/record_codec.h"

namespace ckptfs::store {

const char* OpName(OpType op) {
  switch (op) {
    case OpType::kPublish:
      return "publish";
    case OpType::kRename:
      return "rename";
    case OpType::kUnlink:
      return "unlink";
    case OpType::kRmdir:
      return "rmdir";
    case OpType::kMkdir:
      return "mkdir";
    case OpType::kSymlink:
      return "symlink";
    case OpType::kChmod:
      return "chmod";
    case OpType::kUtimens:
      return "utimens";
    case OpType::kDiscard:
      return "discard";
    case OpType::kChown:
      return "chown";
    case OpType::kLink:
      return "link";
    case OpType::kMknod:
      return "mknod";
  }
  return "?";
}

bool IsCommitName(const std::string& path) { return CommitKindOf(path) != CommitKind::kNone; }

// Binary record (store/primitives/record_codec.h): names are bytes, any bytes a client may use.
// Version 2; version 1 records were JSON (a daemon never reads another run's entries
// except in Recover(), which treats an unreadable record as a discarded entry).
constexpr uint8_t kEntryVersion = 2;

std::string JournalEntry::Serialize() const {
  std::string out;
  out.reserve(48 + path.size() + from.size() + link_target.size());
  StringWriter w(&out);
  w.Byte(kEntryVersion);
  w.Varint(seq);
  w.Varint(static_cast<uint64_t>(op));
  w.String(path);
  w.String(from);
  w.String(link_target);
  w.Varint(mode);
  w.Signed(atime_sec);
  w.Signed(atime_nsec);
  w.Signed(mtime_sec);
  w.Signed(mtime_nsec);
  w.Varint(file_id);
  w.Varint(size);
  // Multi-user POSIX fields (version 2 records end here when unset).
  w.Varint(uid);
  w.Varint(gid);
  w.Varint(rdev);
  return out;
}

Result<JournalEntry> JournalEntry::Parse(std::string_view text) {
  Decoder d(text);
  if (d.Byte() != kEntryVersion || !d.ok()) return Corrupt("journal entry: unknown record version");
  JournalEntry e;
  e.seq = d.Varint();
  uint64_t op = d.Varint();
  e.path = d.String();
  e.from = d.String();
  e.link_target = d.String();
  e.mode = static_cast<uint32_t>(d.Varint());
  e.atime_sec = d.Signed();
  e.atime_nsec = d.Signed();
  e.mtime_sec = d.Signed();
  e.mtime_nsec = d.Signed();
  e.file_id = d.Varint();
  e.size = d.Varint();
  e.uid = static_cast<uint32_t>(d.Varint());
  e.gid = static_cast<uint32_t>(d.Varint());
  e.rdev = d.Varint();
  if (!d.done()) return Corrupt("journal entry: truncated or trailing bytes");
  if (op < static_cast<uint64_t>(OpType::kPublish) || op > static_cast<uint64_t>(OpType::kMknod)) {
    return Corrupt("journal entry: unknown op " + std::to_string(op));
  }
  e.op = static_cast<OpType>(op);
  return e;
}

std::string JournalEntry::RecordKey(uint64_t seq) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%s%016" PRIx64, kRecordPrefix, seq);
  return buf;
}

std::string JournalEntry::Describe() const {
  std::string s = std::string(OpName(op)) + " #" + std::to_string(seq) + " " + path;
  if (!from.empty()) s += " (from " + from + ")";
  if (withdraw) s += " (withdrawn: its save was aborted)";
  if (restore) s += " (the files its aborted save replaced are put back)";
  return s;
}

bool IsTrackerCandidate(const JournalEntry& e) {
  if (e.op != OpType::kPublish && e.op != OpType::kRename) return false;
  if (S_ISDIR(e.mode) || IsCommitName(e.path)) return false;
  const std::string_view name = path::Basename(e.path);
  return !name.ends_with(".distcp") && !name.ends_with(".tmp") &&
         !name.starts_with(".ckptfs-tmp.") && (e.op != OpType::kPublish || e.size <= 4096);
}

}  // namespace ckptfs::store
