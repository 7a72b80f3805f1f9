// ckptfs-admin: the command-line client of a running ckptfs mount.
//
// It reads the daemon's control surface (DESIGN.md, "Control surface"): the virtual
// files MOUNT/.ckptfs/{stats,checkpoints} and the xattr user.ckptfs.progress that every
// path in the mount carries. Commands: stats, checkpoints, wait, unmount, top, ls,
// verify, diff; each takes --json and then prints one JSON document on stdout (top: one
// per line). JSON from the daemon is read leniently: unknown fields are ignored, missing
// ones show as "-".
//
// Everything the tool does lives here so that it can be tested without a mount:
// formatting is pure, and the OS calls that observe the daemon (xattrs, clocks, sleeping,
// process liveness, fusermount3) go through AdminEnv, which tests replace with a fake.
// Files are read directly, so tests build a fake mount as a plain directory tree holding
// .ckptfs/stats. Single-threaded; nothing here is thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/control_names.h"
#include "common/status.h"

namespace ckptfs::admin {

// Process exit codes of ckptfs-admin.
inline constexpr int kExitOk = 0;
// wait: the path reached failed/aborted. unmount: the daemon did not exit cleanly.
inline constexpr int kExitFailed = 1;
// Usage error, path not inside a ckptfs mount, timeout, or any other error.
inline constexpr int kExitError = 2;

// The xattr and control-file names: common/control_names.h (shared with the daemon).
using ckptfs::kProgressXattr;
using ckptfs::kStateXattr;

// ---------------------------------------------------------------------------------------
// The OS, as ckptfs-admin sees it.

class AdminEnv {
 public:
  virtual ~AdminEnv() = default;

  // The value of extended attribute `name` on `path`, following symlinks.
  virtual Result<std::string> GetXattr(const std::string& path, const std::string& name) = 0;
  // Seconds on a monotonic clock, for deadlines and polling.
  virtual double MonotonicSeconds() = 0;
  // Seconds since the Unix epoch, for checkpoint ages.
  virtual double WallSeconds() = 0;
  virtual void Sleep(double seconds) = 0;
  // True while `pid` exists and is not a zombie (an exited daemon whose parent has not
  // reaped it yet counts as gone).
  virtual bool ProcessAlive(int pid) = 0;
  // Runs `fusermount3 -u mountpoint` and returns an error unless it exits 0.
  virtual Status FuseUnmount(const std::string& mountpoint) = 0;
  // Whether stderr is a terminal, which decides if `wait` draws a progress bar.
  virtual bool StderrIsTerminal() = 0;
  // Whether stdout is a terminal, which decides if `top` redraws the screen.
  virtual bool StdoutIsTerminal() { return false; }
  // Sets extended attribute `name` on `path` (the daemon's operator controls).
  virtual Status SetXattr(const std::string& path, const std::string& name,
                          const std::string& value);
};

// The real OS. The returned object lives for the whole process.
AdminEnv* SystemEnv();

// Runs argv[0] (looked up in PATH) with argv, without a shell, and returns its exit
// status (128 + signal number if it was killed). Stdio is inherited.
Result<int> RunProgram(const std::vector<std::string>& argv);

// ---------------------------------------------------------------------------------------
// Finding and reading a mount.

// The root of the ckptfs mount that contains `path`: the first directory, walking up from
// realpath(path), in which `.ckptfs/stats` is a readable regular file. NotFound if `path`
// does not exist or is not inside a ckptfs mount; the message is fit to show the user.
Result<std::string> FindMountRoot(const std::string& path);

// Reads a file until EOF. Files under .ckptfs report st_size 0, so the size is never
// trusted.
Result<std::string> ReadWholeFile(const std::string& path);

// ---------------------------------------------------------------------------------------
// Progress of one path (the user.ckptfs.progress xattr).

struct Progress {
  std::string state;  // staged|durable|published|failed, or a checkpoint state.
  uint64_t bytes_total = 0;
  uint64_t bytes_done = 0;
  std::string error;  // Empty when the daemon reported none.
};

// Parses the xattr value: {"state": str, "bytes_total": n, "bytes_done": n, "error": str}.
// Only "state" is required; "error" may be null.
Result<Progress> ParseProgress(std::string_view json);

enum class StateKind {
  kInProgress,  // Anything else: staged, durable, writing, pending, ...
  kSucceeded,   // published, committed
  kFailed,      // failed, aborted
};
StateKind ClassifyState(std::string_view state);
// The exit code of `wait` for a path in `state`: 0 succeeded, 1 failed; kInProgress maps
// to kExitError because a wait that stops there has timed out.
int ExitCodeForState(std::string_view state);

// ---------------------------------------------------------------------------------------
// Pure formatting.

// 512 -> "512 B", 1536 -> "1.50 KiB", 1610612736 -> "1.50 GiB".
std::string HumanBytes(uint64_t bytes);
// 42.3 -> "42s", 125 -> "2m 05s", 7380 -> "2h 03m", 277200 -> "3d 05h". Negative -> "0s".
std::string HumanDuration(double seconds);
// A local time as "YYYY-MM-DD HH:MM:SS".
std::string FormatLocalTime(double epoch_seconds);

struct Column {
  std::string header;
  bool right_align = false;
};
// Columns separated by two spaces, padded to the widest cell, no trailing blanks.
// Rows shorter than `columns` are padded with empty cells.
std::string FormatTable(const std::vector<Column>& columns,
                        const std::vector<std::vector<std::string>>& rows);

// "label   value" lines with the values aligned.
std::string FormatKeyValues(const std::vector<std::pair<std::string, std::string>>& pairs);

// The human summary of MOUNT/.ckptfs/stats. Fields the daemon left out show as "-".
Result<std::string> FormatStats(std::string_view stats_json);

// The table of MOUNT/.ckptfs/checkpoints, oldest first; ages are relative to `now_epoch`.
Result<std::string> FormatCheckpoints(std::string_view checkpoints_json, double now_epoch);

// One line of progress bar, without "\r" or a newline, e.g.
// "[##########----------]  50.0%  1.00 GiB / 2.00 GiB  staged". `bar_width` is the number
// of cells between the brackets. With a known `rate` (bytes/s, >= 0) and the path still
// in progress, ", 120.00 MiB/s, ETA 8s" follows.
std::string RenderProgressLine(const Progress& progress, int bar_width = 30, double rate = -1);

// Bytes per second from two samples, smoothed: the rate over the last window.
class RateMeter {
 public:
  // Adds a sample; returns the rate in bytes/s, or -1 until two samples span >= 0.5 s.
  double Add(double now, uint64_t bytes);

 private:
  std::vector<std::pair<double, uint64_t>> samples_;  // the last 10 s
};

// ---------------------------------------------------------------------------------------
// Commands. Each returns the process exit code and writes its results to `out` and its
// diagnostics (one line each, prefixed "ckptfs-admin: ") and progress bar to `err`.

struct WaitOptions {
  std::optional<double> timeout_s;  // None: wait forever.
  double interval_s = 0.1;
  // wait: how long a path that does not exist yet may take to appear (0: must exist).
  double create_timeout_s = 0;
  // wait, when stderr is not a terminal: one plain progress line this often.
  double plain_every_s = 5;
  bool json = false;  // print the outcome as JSON on stdout
  // unmount: asked at each poll while the path is in progress; a message means publication
  // no longer progresses by itself (halted, or a commit waiting for shards), and the wait
  // stops there (WaitOutcome::stalled). May be empty.
  std::function<std::optional<std::string>()> stalled;
};

struct WaitOutcome {
  int exit_code = kExitError;
  Progress last;        // The last progress read, if any.
  std::string message;  // Why it stopped, naming `path`, when not succeeded.
  bool stalled = false;  // WaitOptions::stalled said so; `message` is what it said
};

// Polls `path`'s progress xattr until it reaches a terminal state or the timeout passes.
// Draws the progress bar on `err` when `env->StderrIsTerminal()`. Prints nothing else;
// the caller reports the outcome. `env` is borrowed.
WaitOutcome WaitForPath(AdminEnv* env, const std::string& path, const WaitOptions& options,
                        std::ostream& err);

// The outcome of `wait` as JSON: path, state, bytes_total, bytes_done, error, exit_code,
// elapsed_s, message.
std::string WaitOutcomeJson(const std::string& path, const WaitOutcome& outcome,
                            double elapsed_s);

int RunStats(const std::string& path, bool json, std::ostream& out, std::ostream& err);
// `ckptfs-admin peers`: the membership (epoch, rank -> address, each peer's state) from the
// stats JSON.
Result<std::string> FormatPeers(std::string_view stats_json);
int RunPeers(const std::string& path, bool json, std::ostream& out, std::ostream& err);
int RunCheckpoints(AdminEnv* env, const std::string& path, bool json, std::ostream& out,
                   std::ostream& err);
int RunWait(AdminEnv* env, const std::string& path, const WaitOptions& options, std::ostream& out,
            std::ostream& err);
// Drains (waits for the mount root to be published), runs fusermount3 -u, waits for the
// daemon's pid to go away and then checks STATE_DIR/exit.json. `mountpoint` must be the
// root of the mount.
// With options.json the outcome is printed as JSON on stdout: mountpoint, pid, clean,
// unpublished_files, error, exit_code, message.
int RunUnmount(AdminEnv* env, const std::string& mountpoint, const WaitOptions& options,
               std::ostream& out, std::ostream& err);

// Parses the command line (`args` excludes the program name) and runs the command.
// Checkpoint contents (admin_tensors.cc): through /.ckptfs/tensors and user.ckptfs.verify.
int RunLs(const std::string& ckpt, bool json, std::ostream& out, std::ostream& err);
// Operator controls (admin_control.cc): retry a halted publication; drop pending entries.
int RunResume(AdminEnv* env, const std::string& path, bool json, std::ostream& out,
              std::ostream& err);
int RunAbort(AdminEnv* env, const std::string& path, bool json, std::ostream& out,
             std::ostream& err);
int RunVerify(AdminEnv* env, const std::string& ckpt, bool json, std::ostream& out,
              std::ostream& err);
// Asks the daemon to checksum the items of both checkpoints that have none yet (reading
// them), then compares the checksums of every chunk.
int RunDiff(AdminEnv* env, const std::string& a, const std::string& b, bool json,
            std::ostream& out, std::ostream& err);

struct TopOptions {
  double interval_s = 2;
  int iterations = 0;  // frames to print; 0: until interrupted
  bool json = false;   // one JSON object per frame and line
};
// Live view of a mount: throughput (write, publish, backing read, served) and every
// checkpoint that is not committed yet or changed lately, with progress and rate. Each
// frame compares two samples `interval_s` apart. On a terminal the screen is redrawn.
int RunTop(AdminEnv* env, const std::string& path, const TopOptions& options, std::ostream& out,
           std::ostream& err);

int RunAdmin(const std::vector<std::string>& args, AdminEnv* env, std::ostream& out,
             std::ostream& err);

}  // namespace ckptfs::admin
