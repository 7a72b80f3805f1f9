"""Issue 23: the newest committed checkpoint stays in the daemon's memory (--retain-mem).

Real 4-rank torch DCP saves through one mount, both FileSystemWriter layouts:
  * after the save commits, a load by fresh rank processes (the training job restarted;
    the daemon lives on) reads every shard from the retained tier: exact tensors, the
    tier's hits cover the checkpoint, and the daemon reads 0 bytes from the backing store;
  * with --retain-mem 0 (today's behaviour) the same load reads the backing store;
  * a file of a committed checkpoint rewritten through the mount is never served from the
    tier with its old bytes (the publish of the new version drops them, and the
    BlockId{path,size,mtime} of the new version differs);
  * a newer committed checkpoint of the same run replaces the older one in memory;
  * `/.ckptfs/checkpoints` says which checkpoints are held in memory, and the stop drops
    the tier.
"""
import os
import sys
import time
import unittest

import dcp_tool
import harness

RANKS = 4
MB = 16
SEED = 77


def backing_read(m):
    return m.stats()["backing_bytes_read"]


class RetainedTier(harness.MountedTest):
    WATCHDOG_S = 1200

    def save_and_commit(self, m, name, sfpr, seed=SEED):
        """Saves and waits for the commit and for the tensor index built after it: that
        build reads the item edges the write path's block checksums do not cover (and the
        zip headers of a file per item) from the backing store, which a load right after
        the commit would otherwise be charged with (CI of fee23ce: 132 KB)."""
        ckpt = os.path.join(m.mnt, name)
        dcp_tool.save(ckpt, RANKS, MB, sfpr, seed, timeout=300)
        self.assertEqual(m.wait(os.path.join(ckpt, ".metadata")), 0)
        deadline = time.monotonic() + 60
        while not {c["path"]: c for c in m.checkpoints()}[name].get("indexed"):
            self.assertLess(time.monotonic(), deadline, f"{name} not indexed in 60 s")
            time.sleep(0.05)
        return ckpt

    def check_restart_from_memory(self, sfpr):
        m = self.mount(args=["--retain-mem", "128M"])
        before_save = backing_read(m)
        ckpt = self.save_and_commit(m, "run/step1", sfpr)
        # The save, its commit and the index build after it read the `.metadata` back (the
        # commit gate and the index parse it), nothing of the shards: the index takes the
        # zip headers and item edges it needs from the tier (G12; a file per item read
        # 1.3-3.2 MB of 16 MiB back before, stop 50).
        md_size = os.path.getsize(os.path.join(m.backing, "run/step1/.metadata"))
        read_by_save = backing_read(m) - before_save
        built = {c["path"]: c for c in m.checkpoints()}["run/step1"]
        print(f"\nsave + index build read {read_by_save} bytes from the backing store "
              f"(.metadata {md_size}); {built.get('index', built.get('indexed'))}",
              file=sys.stderr)
        self.assertLessEqual(read_by_save, 3 * md_size + (64 << 10))
        s = m.stats()["retained"]
        self.assertGreater(s["retained_bytes"], MB << 20)
        # The index build's reads from memory are counted apart: no load has run yet.
        self.assertGreater(s["index_read_bytes"], 0)
        self.assertEqual(s["hit_bytes"], 0, "the index build's reads counted as load hits")
        before = backing_read(m)
        dcp_tool.load(ckpt, RANKS, "own", SEED, timeout=300)  # checks every tensor
        after = m.stats()
        self.assertEqual(after["backing_bytes_read"] - before, 0,
                         "a load of the retained checkpoint read the backing store")
        self.assertGreaterEqual(after["retained"]["hit_bytes"], MB << 20)
        self.assertEqual(after["retained"]["crc_errors"], 0)
        listed = {c["path"]: c for c in m.checkpoints()}
        self.assertIn("in_memory", listed["run/step1"])
        self.assertEqual(listed["run/step1"]["in_memory"]["state"], "committed")
        # A newer commit of the run replaces the older one.
        ckpt2 = self.save_and_commit(m, "run/step2", sfpr, seed=SEED + 1)
        held = {c["path"] for c in m.stats()["retained"]["checkpoints"]}
        self.assertEqual(held, {"run/step2"})
        before = backing_read(m)
        dcp_tool.load(ckpt2, RANKS, "own", SEED + 1, timeout=300)
        self.assertEqual(backing_read(m) - before, 0)
        self.assertEqual(m.unmount(timeout=120), 0)

    def test_restart_load_reads_memory_single_file_per_rank(self):
        self.check_restart_from_memory(True)

    def test_restart_load_reads_memory_file_per_item(self):
        self.check_restart_from_memory(False)

    def test_retain_mem_0_reads_the_backing_store(self):
        # The daemon's own counter measures what it read; passthrough reads are the kernel's.
        m = self.mount(args=["--retain-mem", "0", "--passthrough", "off"])
        ckpt = self.save_and_commit(m, "run/step1", True)
        self.assertNotIn("retained", m.stats())
        before = backing_read(m)
        dcp_tool.load(ckpt, RANKS, "own", SEED, timeout=300)
        self.assertGreaterEqual(backing_read(m) - before, MB << 20)

    def test_rewritten_file_is_never_served_from_the_tier(self):
        m = self.mount(args=["--retain-mem", "128M"])
        d = os.path.join(m.mnt, "run", "step1")
        os.makedirs(d)
        old = os.urandom(3 << 20)
        new = os.urandom(3 << 20)  # same size
        with open(os.path.join(d, "__0_0.distcp"), "wb") as f:
            f.write(old)
        with open(os.path.join(d, ".metadata"), "wb") as f:
            f.write(b"not a real .metadata")
        self.assertEqual(m.wait(os.path.join(d, ".metadata")), 0)
        self.assertGreaterEqual(m.stats()["retained"]["retained_bytes"], 3 << 20)
        with open(os.path.join(d, "__0_0.distcp"), "rb") as f:
            self.assertEqual(f.read(), old)
        hits = m.stats()["retained"]["hit_bytes"]
        self.assertGreaterEqual(hits, 3 << 20)
        # Rewrite in place through the mount (same size), then read it back after publication.
        with open(os.path.join(d, "__0_0.distcp"), "r+b") as f:
            f.write(new)
        self.assertEqual(m.wait(os.path.join(d, "__0_0.distcp")), 0)
        with open(os.path.join(d, "__0_0.distcp"), "rb") as f:
            self.assertEqual(f.read(), new, "old bytes served after a rewrite")
        with open(os.path.join(m.backing, "run", "step1", "__0_0.distcp"), "rb") as f:
            self.assertEqual(f.read(), new)


if __name__ == "__main__":
    unittest.main()
