"""Saves into a directory removed and made again between saves (issue 38), through a real
mount, as PyTorch's own test_load_with_different_shard_plan does: before every save rank 0
runs shutil.rmtree(path) and os.makedirs(path), then 4 gloo ranks save there with another
shard plan (the number of tensors changes every save, so with a file per item the number
of shard files changes too).

The daemon's writes to the backing disk are throttled (a blkio cgroup, direct flushes) so
that publication lags the saves: a save's `.metadata` still waits for publication while the
application has already removed its directory and saved into the new one of the same name.
On HEAD 3759c3f the old `.metadata` was taken as superseded by the new directory's save,
its `.metadata.tmp` was left on the backing store, the application's rmdir of the next round
failed there (NotEmpty), and the clean unmount exited 1 with files not published.

For each durability mode and both FileSystemWriter layouts, after SAVES back-to-back saves:
  * publication finishes, the journal skipped nothing and is not halted, nothing failed;
  * the daemon exits 0 on a clean unmount;
  * the backing tree equals the mount's tree, file for file and byte for byte, with no
    `.ckptfs-tmp.*` left anywhere (G8);
  * the last checkpoint loads exactly from the backing directory (G2).
"""
import os
import shutil
import tempfile
import time
import unittest

import dcp_tool
import harness
import netns

RANKS = 4
# 20 saves in CI (each case ~35 s with the throttle); CKPTFS_RECREATE_SAVES=50 by hand.
SAVES = int(os.environ.get("CKPTFS_RECREATE_SAVES", "20"))
# Shard plans: the dtypes of each save (2 tensors per dtype, so 2..12 items per rank).
PLANS = [("float32", "int64", "bool"), ("bfloat16",), ("float32", "float16", "int8", "bool"),
         ("int64", "int8")]
COMMIT_TIMEOUT_S = 120
THROTTLE_BPS = 2 << 20
MB = 1


def tree(dir):
    """{relative path: sha256} of files, and the set of directories, under `dir` (a mount's
    /.ckptfs, which is never on the backing store, left out)."""
    dirs, files = set(), {}
    for name in os.listdir(dir):
        path = os.path.join(dir, name)
        if name == ".ckptfs":
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            dirs.add(name)
            for root, ds, _ in os.walk(path):
                for d in ds:
                    dirs.add(os.path.relpath(os.path.join(root, d), dir))
            files.update({os.path.join(name, k): v
                          for k, v in dcp_tool.sha256_tree(path).items()})
        elif os.path.isfile(path):
            files[name] = dcp_tool.sha256_tree(dir).get(name)
    return files, dirs


@unittest.skipUnless(os.geteuid() == 0 and os.path.isdir("/sys/fs/cgroup/blkio"),
                     "needs root and the cgroup v1 blkio controller (the slow store)")
class RecreatedDirSaves(harness.MountedTest):
    WATCHDOG_S = 900

    def run_case(self, durability, single_file_per_rank):
        m = self.mount(args=["--durability", durability, "--flush-direct-io", "on",
                             "--commit-timeout", str(COMMIT_TIMEOUT_S)])
        netns.throttle_writes(self, m.proc.pid, m.backing, THROTTLE_BPS, "ckptfs-recreate")
        ckpt = os.path.join(m.mnt, "ckpt")
        os.makedirs(ckpt)
        seeds = [200 + i for i in range(SAVES)]
        plans = [PLANS[i % len(PLANS)] for i in range(SAVES)]
        t0 = time.monotonic()
        dcp_tool.resave(ckpt, RANKS, seeds, [MB] * SAVES, single_file_per_rank,
                        timeout=600, recreate=True, dtypes_per_save=plans)
        saved_s = time.monotonic() - t0
        self.assertEqual(m.wait(ckpt, timeout=COMMIT_TIMEOUT_S / 2), 0,
                         f"publication not done {COMMIT_TIMEOUT_S / 2:.0f} s after {SAVES} "
                         f"saves ({saved_s:.1f} s)\n{m.log_text()[-3000:]}")
        stats = m.stats()
        self.assertIsNone(stats.get("journal_halted"), "journal halted")
        self.assertEqual(stats.get("errors", 0), 0, stats.get("last_error"))
        self.assertEqual(stats.get("journal_skipped"), 0,
                         "entries skipped:\n" + "\n".join(
                             l for l in m.log_text().splitlines()
                             if "skipped" in l or "superseded" in l or "dropped" in l))
        states = {c["path"]: c["state"] for c in m.checkpoints()}
        self.assertEqual(states.get("ckpt"), "committed", states)
        view = tree(m.mnt)
        rc = m.unmount(timeout=COMMIT_TIMEOUT_S)
        self.assertEqual(rc, 0, f"daemon exit after a clean unmount\n{m.log_text()[-3000:]}")
        backing = tree(m.backing)
        temps = [p for p in backing[0] if ".ckptfs-tmp." in p]
        self.assertEqual(temps, [], "temp files left on the backing store")
        self.assertEqual(backing[1], view[1], "directories: backing store vs the mount")
        self.assertEqual(sorted(backing[0]), sorted(view[0]), "files: backing vs the mount")
        self.assertEqual(backing[0], view[0], "bytes: backing store vs the mount")
        dcp_tool.load(os.path.join(m.backing, "ckpt"), RANKS, "own", seeds[-1], timeout=300)
        print(f"{durability} single_file_per_rank={single_file_per_rank}: {SAVES} saves in "
              f"{saved_s:.1f} s, superseded {stats.get('commits_superseded')}, "
              f"applied ahead {stats.get('journal_applied_ahead')}")

    def test_async_one_file_per_rank(self):
        self.run_case("async", True)

    def test_async_per_item(self):
        self.run_case("async", False)

    def test_strict_one_file_per_rank(self):
        self.run_case("strict", True)

    def test_strict_per_item(self):
        self.run_case("strict", False)


if __name__ == "__main__":
    unittest.main()
