// Names of the control surface that the daemon (fs/) serves and ckptfs-admin (mount/)
// reads: the /.ckptfs tree inside the mount and the user.ckptfs.* xattrs. One place, so
// the two sides cannot drift apart.
#pragma once

namespace ckptfs {

// The virtual control directory at the mount root, and the files in it.
inline constexpr char kCtlDirName[] = ".ckptfs";
inline constexpr char kCtlStatsName[] = "stats";
inline constexpr char kCtlCheckpointsName[] = "checkpoints";
inline constexpr char kCtlMetricsName[] = "metrics";
inline constexpr char kCtlTensorsName[] = "tensors";

// Hidden temp files of files being written, on the backing store (never shown).
inline constexpr char kTempPrefix[] = ".ckptfs-tmp.";

// Read-only xattrs on any path.
inline constexpr char kStateXattr[] = "user.ckptfs.state";        // staged|durable|published
inline constexpr char kProgressXattr[] = "user.ckptfs.progress";  // JSON, `ckptfs-admin wait`
inline constexpr char kVerifyXattr[] = "user.ckptfs.verify";
inline constexpr char kChecksumsXattr[] = "user.ckptfs.checksums";
// Operator controls, set with setxattr (a single call, unlike getxattr's size probe):
// resume retries a halted publication now; abort drops the pending entries at or below
// the path. The report of the last abort is read back from kAbortReportXattr.
inline constexpr char kResumeXattr[] = "user.ckptfs.resume";
inline constexpr char kAbortXattr[] = "user.ckptfs.abort";
inline constexpr char kAbortReportXattr[] = "user.ckptfs.aborted";

}  // namespace ckptfs
