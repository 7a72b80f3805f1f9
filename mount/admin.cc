// ckptfs-admin's command line: parses the arguments and runs one command.
#include "mount/admin.h"

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdlib>
#include <ostream>

#include "ckptfs_version.h"
#include "mount/admin_internal.h"

namespace ckptfs::admin {

using internal::kPrefix;

int RunAdmin(const std::vector<std::string>& args, AdminEnv* env, std::ostream& out,
             std::ostream& err) {
  CLI::App app{"Inspect and control a running ckptfs mount.", "ckptfs-admin"};
  app.footer(
      "Run 'ckptfs-admin COMMAND --help' for a command's options. Every command "
      "takes --json.");
  app.set_version_flag("--version", std::string("ckptfs-admin ") + CKPTFS_VERSION + " (git " +
                                        CKPTFS_GIT_COMMIT + ")");
  app.require_subcommand(1);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string(kPrefix) + e.what() + " (see --help)\n";
  });

  std::string path;
  bool as_json = false;
  double timeout_s = 0;
  double create_timeout_s = 0;
  double plain_every_s = 5;
  double top_interval_s = 2;
  int top_iterations = 0;
  int interval_ms = 100;
  const std::string path_help = "Any path inside the ckptfs mount";
  const CLI::Validator seconds(
      [](std::string& value) -> std::string {
        char* end = nullptr;
        double v = std::strtod(value.c_str(), &end);
        if (value.empty() || *end != '\0' || !std::isfinite(v) || v < 0) {
          return "expected a number of seconds >= 0, got '" + value + "'";
        }
        return "";
      },
      "");

  CLI::App* stats = app.add_subcommand("stats", "Print the daemon's statistics.");
  stats->add_option("PATH", path, path_help)->required();
  stats->add_flag("--json", as_json, "Print the raw JSON of .ckptfs/stats");

  CLI::App* peers = app.add_subcommand(
      "peers", "Show the peer membership: its epoch, the rank -> address map, each peer's state.");
  peers->add_option("PATH", path, path_help)->required();
  peers->add_flag("--json", as_json, "Print the raw JSON of .ckptfs/stats");

  CLI::App* checkpoints =
      app.add_subcommand("checkpoints", "List checkpoints with their state, size and age.");
  checkpoints->add_option("PATH", path, path_help)->required();
  checkpoints->add_flag("--json", as_json, "Print the raw JSON of .ckptfs/checkpoints");

  CLI::App* wait =
      app.add_subcommand("wait", "Wait, with a progress bar, until PATH is published.");
  wait->footer(
      "A checkpoint directory is done when committed. Exit status: 0 published or committed, "
      "1 failed, aborted, withheld (a tracker naming a checkpoint that never commits) or gone "
      "unpublished, 2 timeout or error.");
  wait->add_option("PATH", path, "The file or directory to wait for")->required();
  CLI::Option* wait_timeout =
      wait->add_option("--timeout", timeout_s, "Give up after S seconds (default: never)")
          ->type_name("S")
          ->check(seconds);
  wait->add_option("--interval", interval_ms, "Poll every MS milliseconds")
      ->type_name("MS")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600 * 1000));
  wait->add_option("--create-timeout", create_timeout_s,
                   "Wait up to S seconds for PATH to appear (default 0: it must exist)")
      ->type_name("S")
      ->check(seconds);
  wait->add_option("--print-every", plain_every_s,
                   "Not on a terminal: print a progress line every S seconds (default 5)")
      ->type_name("S")
      ->check(seconds);
  wait->add_flag("--json", as_json, "Print the outcome as JSON on stdout");

  CLI::App* unmount =
      app.add_subcommand("unmount", "Drain and unmount a ckptfs mount, and check its exit.");
  unmount->footer(
      "Waits until everything is published, runs fusermount3 -u, waits for the daemon to "
      "exit and reads its exit report. When publication is halted or a commit waits for "
      "shards, it says so and unmounts at once; the daemon then waits up to its "
      "--stop-timeout without progress and leaves the rest for its next start. Exit "
      "status: 0 clean exit with nothing unpublished, 1 unclean exit, unpublished files or "
      "entries left for the next start, 2 timeout or error.");
  unmount->add_option("MOUNTPOINT", path, "The mountpoint of the ckptfs mount")->required();
  CLI::Option* unmount_timeout =
      unmount->add_option("--timeout", timeout_s, "Give up after S seconds (default: never)")
          ->type_name("S")
          ->check(seconds);
  unmount->add_flag("--json", as_json, "Print the outcome as JSON on stdout");

  CLI::App* top = app.add_subcommand(
      "top", "Live throughput and per-checkpoint progress of a mount (like top).");
  top->add_option("PATH", path, path_help)->required();
  top->add_option("--interval", top_interval_s, "Seconds between frames (default 2)")
      ->type_name("S")
      ->check(CLI::Range(0.05, 3600.0));
  top->add_option("-n,--iterations", top_iterations,
                  "Print N frames, then exit (default: run "
                  "until interrupted)")
      ->type_name("N")
      ->check(CLI::Range(0, 1000000));
  top->add_flag("--json", as_json, "One JSON object per frame and line");

  std::string other;
  CLI::App* ls =
      app.add_subcommand("ls", "List a checkpoint's tensors: fqn, dtype, shape, chunks, bytes.");
  ls->add_option("CKPT", path, "A checkpoint directory inside the mount")->required();
  ls->add_flag("--json", as_json, "Print JSON");
  CLI::App* verify = app.add_subcommand(
      "verify", "Re-read a checkpoint from the backing store; check structure and checksums.");
  verify->footer("Exit status: 0 intact, 1 bad keys (listed), 2 error.");
  verify->add_option("CKPT", path, "A checkpoint directory inside the mount")->required();
  verify->add_flag("--json", as_json, "Print the daemon's verify report as JSON");
  CLI::App* diff =
      app.add_subcommand("diff", "Which tensors changed between two checkpoints, by checksum.");
  diff->footer("Exit status: 0 identical, 1 different, 2 error.");
  diff->add_option("CKPT_A", path, "First checkpoint")->required();
  diff->add_option("CKPT_B", other, "Second checkpoint")->required();
  diff->add_flag("--json", as_json, "Print the differences as JSON");

  CLI::App* resume = app.add_subcommand(
      "resume", "Retry a halted publication now (after freeing space, fixing permissions...).");
  resume->footer("Exit status: 0 publication runs, 1 still halted, 2 error.");
  resume->add_option("PATH", path, path_help)->required();
  resume->add_flag("--json", as_json, "Print the outcome as JSON");
  CLI::App* abort_cmd = app.add_subcommand(
      "abort", "Drop the pending (unpublished) entries at or below PATH so the rest goes on.");
  abort_cmd->footer(
      "Use on a failed checkpoint that halts publication. Nothing of the dropped entries "
      "reaches the backing store; each is listed. Exit status: 0 done, 2 error.");
  abort_cmd->add_option("PATH", path, "A checkpoint directory or file inside the mount")
      ->required();
  abort_cmd->add_flag("--json", as_json, "Print what was dropped as JSON");

  // CLI11 reports an unknown command as a missing one; name it instead.
  auto is_command = [&](const std::string& name) {
    return !app.get_subcommands([&](CLI::App* sub) { return sub->check_name(name); }).empty();
  };
  if (!args.empty() && !args[0].empty() && args[0][0] != '-' && !is_command(args[0])) {
    err << kPrefix << "unknown command '" << args[0] << "' (see --help)\n";
    return kExitError;
  }
  try {
    app.parse(std::vector<std::string>(args.rbegin(), args.rend()));
  } catch (const CLI::ParseError& e) {
    return app.exit(e, out, err) == 0 ? kExitOk : kExitError;
  }

  WaitOptions options;
  options.interval_s = interval_ms / 1000.0;
  options.create_timeout_s = create_timeout_s;
  options.plain_every_s = plain_every_s;
  options.json = as_json;
  if (stats->parsed()) return RunStats(path, as_json, out, err);
  if (checkpoints->parsed()) return RunCheckpoints(env, path, as_json, out, err);
  if (peers->parsed()) return RunPeers(path, as_json, out, err);
  if (wait->parsed()) {
    if (wait_timeout->count() > 0) options.timeout_s = timeout_s;
    return RunWait(env, path, options, out, err);
  }
  if (resume->parsed()) return RunResume(env, path, as_json, out, err);
  if (abort_cmd->parsed()) return RunAbort(env, path, as_json, out, err);
  if (ls->parsed()) return RunLs(path, as_json, out, err);
  if (verify->parsed()) return RunVerify(env, path, as_json, out, err);
  if (diff->parsed()) return RunDiff(env, path, other, as_json, out, err);
  if (top->parsed()) {
    TopOptions top_options;
    top_options.interval_s = top_interval_s;
    top_options.iterations = top_iterations;
    top_options.json = as_json;
    return RunTop(env, path, top_options, out, err);
  }
  if (unmount->parsed()) {
    if (unmount_timeout->count() > 0) options.timeout_s = timeout_s;
    return RunUnmount(env, path, options, out, err);
  }
  err << kPrefix << "no command given (see --help)\n";
  return kExitError;
}

}  // namespace ckptfs::admin
