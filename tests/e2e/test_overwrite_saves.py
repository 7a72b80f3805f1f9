"""Saves into one directory in quick succession through a mount (G10), as torch 2.x's
`dcp.save` (overwrite=True by default) and PyTorch's own DCP tests do: a save rewrites
its shards while the previous save's `.metadata` still waits for publication.

For each durability mode and both FileSystemWriter layouts, 4 gloo ranks save 6 states
one after another into the same directory, their sizes changing every save (2, 1, 3, 1...
MiB per dtype), with no pause between saves beyond DCP's own collectives. Then:
  * the daemon's writes to the backing disk are throttled (a blkio cgroup, direct
    flushes, 8 MiB/s) so that publication lags the saves, as on a slow shared store where
    async mode is for: each save's rewrites begin while the previous `.metadata` waits;
  * every save returns, and the mount's publication finishes well inside the commit
    timeout (set to 60 s here: a `.metadata` that waited for a shard version a later save
    replaced held everything up until it, then halted the journal, on HEAD 6f2c1b5);
  * the journal is not halted, nothing failed, the checkpoint is committed;
  * the backing directory holds exactly the last save (byte for byte against a direct save
    of the same state), and a load through the mount and one straight from the backing
    directory return its tensors exactly (G1, G2, G5).
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
SEEDS = [101, 102, 103, 104, 105, 106]
MBS = [2, 1, 2, 1, 3, 2]
COMMIT_TIMEOUT_S = 90
THROTTLE_BPS = 8 << 20


@unittest.skipUnless(os.geteuid() == 0 and os.path.isdir("/sys/fs/cgroup/blkio"),
                     "needs root and the cgroup v1 blkio controller (the slow store)")
class OverwriteSaves(harness.MountedTest):
    WATCHDOG_S = 900

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="ckptfs-overwrite-ref-")
        cls.refs = {}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def reference(self, single_file_per_rank):
        if single_file_per_rank not in self.refs:
            d = os.path.join(self.tmp, f"ref{int(single_file_per_rank)}")
            dcp_tool.save(d, RANKS, MBS[-1], single_file_per_rank, SEEDS[-1], timeout=300)
            self.refs[single_file_per_rank] = dcp_tool.sha256_tree(d)
        return self.refs[single_file_per_rank]

    def run_case(self, durability, single_file_per_rank):
        ref = self.reference(single_file_per_rank)
        m = self.mount(args=["--durability", durability, "--flush-direct-io", "on",
                             "--commit-timeout", str(COMMIT_TIMEOUT_S)])
        self.throttle(m)
        ckpt = os.path.join(m.mnt, "ckpt")
        t0 = time.monotonic()
        dcp_tool.resave(ckpt, RANKS, SEEDS, MBS, single_file_per_rank, timeout=600)
        saved_s = time.monotonic() - t0
        # Publication of all 8 saves: far below the commit timeout unless a commit waited
        # for a shard version that the next save replaced.
        self.assertEqual(m.wait(ckpt, timeout=COMMIT_TIMEOUT_S / 2), 0,
                         f"publication not done {COMMIT_TIMEOUT_S / 2:.0f} s after the "
                         f"saves ({saved_s:.1f} s)")
        stats = m.stats()
        self.assertIsNone(stats.get("journal_halted"), "journal halted")
        self.assertEqual(stats.get("errors", 0), 0, stats.get("last_error"))
        states = {c["path"]: c["state"] for c in m.checkpoints()}
        self.assertEqual(states.get("ckpt"), "committed", states)
        self.assertEqual(dcp_tool.sha256_tree(ckpt), ref, "bytes read through the mount")
        dcp_tool.load(ckpt, RANKS, "own", SEEDS[-1], timeout=300)
        m.unmount()
        backing = os.path.join(m.backing, "ckpt")
        self.assertEqual(dcp_tool.sha256_tree(backing), ref, "the backing directory")
        dcp_tool.load(backing, 1, "replicated", SEEDS[-1], timeout=300)
        return stats

    def throttle(self, m):
        netns.throttle_writes(self, m.proc.pid, m.backing, THROTTLE_BPS, "ckptfs-overwrite")

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
