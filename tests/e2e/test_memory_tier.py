"""Issue 42: memory-only directories (user.ckptfs.tier=memory), one node, no peers.

Real 4-rank torch 1.13 DCP saves through one mount into a marked directory:
  * the save loads back exactly; the backing store holds the marked directory only (empty,
    with its xattr), the checkpoint is listed committed with tier "memory", and the log
    says it is committed in memory on this node only;
  * the next save's commit evicts the older checkpoint and the tracker naming it (ENOENT);
  * a rename between the tree and the rest of the mount is EXDEV;
  * a save that does not fit --memory-ckpt-mem fails with ENOSPC at write() and the
    committed checkpoint still loads exactly;
  * a clean unmount logs the memory-only checkpoint as lost; after the restart the
    directory is still marked and empty, and a new save there works.
"""
import errno
import os
import unittest

import dcp_tool
import harness

RANKS = 4
MB = 16
TIER = "user.ckptfs.tier"


def backing_files(root):
    out = []
    for d, dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(d, f), root) for f in files]
    return sorted(out)


class MemoryOnlyDirectory(harness.MountedTest):
    WATCHDOG_S = 900

    def marked_run(self, m, name="mem"):
        run = os.path.join(m.mnt, name)
        os.makedirs(run)
        os.setxattr(run, TIER, b"memory")
        self.assertEqual(os.getxattr(run, TIER), b"memory")
        return run

    def test_dcp_save_load_eviction_and_exdev(self):
        m = self.mount(args=["--memory-ckpt-mem", "128M"])
        run = self.marked_run(m)
        ckpt1 = os.path.join(run, "iter_0000001")
        dcp_tool.save(ckpt1, RANKS, MB, True, seed=1, timeout=300)
        tracker = os.path.join(run, "latest_checkpointed_iteration.txt")
        with open(tracker, "w") as f:
            f.write("1")
        self.assertEqual(os.getxattr(os.path.join(ckpt1, ".metadata"), TIER), b"memory")
        dcp_tool.load(ckpt1, RANKS, "own", 1, timeout=300)  # checks every tensor
        listed = {c["path"]: c for c in m.checkpoints()}
        self.assertEqual(listed["mem/iter_0000001"]["tier"], "memory", listed)
        self.assertEqual(listed["mem/iter_0000001"]["state"], "committed", listed)
        self.assertIn("mem/iter_0000001 committed in memory on this node only",
                      m.wait_log("committed in memory on this node only"))
        # Nothing of it on the backing store: the marked directory, empty, with its mark.
        self.assertEqual(backing_files(m.backing), [])
        self.assertEqual(os.listdir(os.path.join(m.backing, "mem")), [])
        self.assertEqual(os.getxattr(os.path.join(m.backing, "mem"), TIER), b"memory")

        # The next save: while it is written the first stays; its commit evicts the first
        # and the tracker that names it.
        ckpt2 = os.path.join(run, "iter_0000002")
        dcp_tool.save(ckpt2, RANKS, MB, False, seed=2, timeout=300)
        for gone in (ckpt1, tracker):
            with self.assertRaises(FileNotFoundError, msg=gone):
                os.stat(gone)
        self.assertEqual(sorted(os.listdir(run)), ["iter_0000002"])
        dcp_tool.load(ckpt2, RANKS, "own", 2, timeout=300)
        s = m.stats()["memory_ckpt"]
        self.assertEqual(s["evicted_checkpoints"], 1, s)
        self.assertEqual(s["trackers_dropped"], 1, s)
        self.assertLessEqual(s["peak_used_bytes"], 128 << 20, s)

        # Renames across the tree's boundary, both ways: EXDEV. Within: fine.
        outside = os.path.join(m.mnt, "outside.txt")
        with open(outside, "w") as f:
            f.write("x")
        with self.assertRaises(OSError) as e:
            os.rename(outside, os.path.join(run, "outside.txt"))
        self.assertEqual(e.exception.errno, errno.EXDEV)
        with self.assertRaises(OSError) as e:
            os.rename(ckpt2, os.path.join(m.mnt, "iter_0000002"))
        self.assertEqual(e.exception.errno, errno.EXDEV)
        os.rename(os.path.join(run, "iter_0000002"), os.path.join(run, "iter_0000002.b"))
        dcp_tool.load(os.path.join(run, "iter_0000002.b"), RANKS, "own", 2, timeout=300)
        # A marked directory with names in it cannot be removed.
        with self.assertRaises(OSError) as e:
            os.rmdir(run)
        self.assertEqual(e.exception.errno, errno.ENOTEMPTY)
        self.assertEqual(m.wait(outside), 0)
        self.assertEqual(backing_files(m.backing), ["outside.txt"])
        self.assertEqual(m.unmount(timeout=120), 0)

    def test_a_save_that_does_not_fit_is_enospc_and_leaves_the_committed_one(self):
        m = self.mount(args=["--memory-ckpt-mem", "48M"])
        run = self.marked_run(m)
        ckpt1 = os.path.join(run, "step1")
        dcp_tool.save(ckpt1, RANKS, MB, True, seed=3, timeout=300)
        with self.assertRaises(dcp_tool.DcpToolError):
            dcp_tool.save(os.path.join(run, "step2"), RANKS, 4 * MB, True, seed=4, timeout=300)
        self.assertGreater(m.stats()["memory_ckpt"]["nospace_writes"], 0)
        # write() itself says ENOSPC (the writes before it that fitted are kept).
        big = os.path.join(run, "big.bin")
        with self.assertRaises(OSError) as e:
            with open(big, "wb") as f:
                f.write(os.urandom(64 << 20))
        self.assertEqual(e.exception.errno, errno.ENOSPC)
        dcp_tool.load(ckpt1, RANKS, "own", 3, timeout=300)
        self.assertEqual(backing_files(m.backing), [])
        self.assertEqual(m.unmount(timeout=120), 0)

    def test_restart_drops_memory_checkpoints_and_keeps_the_mark(self):
        m = self.mount(args=["--memory-ckpt-mem", "64M"])
        run = self.marked_run(m)
        ckpt = os.path.join(run, "step1")
        dcp_tool.save(ckpt, RANKS, MB, True, seed=5, timeout=300)
        self.assertEqual(m.unmount(timeout=120), 0)
        self.assertIn("memory-only checkpoint mem/step1 lost", m.log_text())
        self.assertEqual(backing_files(m.backing), [])

        m2 = self.mount(args=["--memory-ckpt-mem", "64M"], backing=m.backing, root=m.root,
                        state=m.state)
        run2 = os.path.join(m2.mnt, "mem")
        self.assertEqual(os.getxattr(run2, TIER), b"memory", "the mark did not survive")
        self.assertEqual(os.listdir(run2), [])
        with self.assertRaises(FileNotFoundError):
            os.stat(os.path.join(run2, "step1", ".metadata"))
        ckpt2 = os.path.join(run2, "step2")
        dcp_tool.save(ckpt2, RANKS, MB, True, seed=6, timeout=300)
        dcp_tool.load(ckpt2, RANKS, "own", 6, timeout=300)
        self.assertEqual(backing_files(m2.backing), [])
        self.assertEqual(m2.unmount(timeout=120), 0)


if __name__ == "__main__":
    unittest.main()
