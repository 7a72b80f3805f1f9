"""No silent errors (G7): a backing filesystem that fills up in the middle of a save.

The backing directory is a 64 MiB tmpfs (mounted here, always unmounted in
cleanup) and the writers produce more than that:
  * strict, DCP: the 4-rank save fails (a rank's write/fsync/close returns
    ENOSPC, DCP raises), the daemon stays up and reports the error, and no
    .metadata reaches the backing store;
  * async, DCP: the save may return before the flush fails (that is the point
    of async mode) or fail itself; either way the checkpoint becomes "failed"
    in /.ckptfs/checkpoints with an error, `ckptfs-admin wait` exits 1, and no
    .metadata reaches the backing store, not even after unmount (the drain must
    not publish it);
  * async, DCP, with the tmpfs pre-filled so that the data files fit but the
    .metadata does not: the save returns normally (everything was staged),
    and only afterwards the checkpoint becomes "failed", wait exits 1 and
    .metadata never appears on the backing store;
  * strict, dd: dd of more than the tmpfs holds fails, with conv=fsync (fsync
    or write fails) and without it (close fails);
  * after the failed checkpoint is deleted through the mount its space comes
    back, and a smaller checkpoint then saves, commits and loads.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import dcp_tool
import harness

TMPFS_MB = 64
RANKS = 4
SAVE_MB = 96          # more than the tmpfs holds
SEED = 77


def find_metadata(root):
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, _, files in os.walk(root) for n in files if n == ".metadata")


def used_bytes(path):
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class Enospc(harness.MountedTest):
    # The mount's watchdog only catches a hang: longer than any run.
    WATCHDOG_S = 1800

    def make_tmpfs(self):
        return harness.make_tmpfs(self, TMPFS_MB, "ckptfs-enospc-backing-")

    def tmpfs_mount(self, durability):
        backing = self.make_tmpfs()
        return self.mount(["--durability", durability], backing=backing)  # cleaned up first

    def diag(self, m):
        return f"\n--- ckptfs log tail ---\n{m.log_text()}"

    def checkpoint_entry(self, m, path):
        for c in m.checkpoints():
            if c["path"] == path:
                return c
        return None

    def assert_error_counted(self, m):
        errors = m.stats().get("errors")
        self.assertTrue(errors, f"stats must show the flush error: {m.stats()}{self.diag(m)}")

    def assert_failed_and_never_committed(self, m):
        """`ckpt` is failed with its error, and its .metadata is never published, not even
        by the drain at unmount."""
        entry = self.checkpoint_entry(m, "ckpt")
        self.assertIsNotNone(entry, f"{m.checkpoints()}{self.diag(m)}")
        self.assertEqual(entry["state"], "failed", f"{entry}{self.diag(m)}")
        self.assertTrue(entry.get("error"), f"a failed checkpoint names its error: {entry}")
        self.assert_error_counted(m)
        self.assertEqual(find_metadata(m.backing), [], self.diag(m))
        m.unmount()
        self.assertEqual(find_metadata(m.backing), [], "unmount must not publish .metadata "
                         "of a failed checkpoint" + self.diag(m))

    def test_strict_dcp_save_fails_and_never_commits(self):
        m = self.tmpfs_mount("strict")
        ckpt = os.path.join(m.mnt, "ckpt")
        # torch.save's zip writer turns the ENOSPC into its own error ("unexpected pos") or an
        # abort, so only the failure itself is checked, not its text.
        with self.assertRaises(dcp_tool.DcpToolError, msg=self.diag(m)):
            dcp_tool.save(ckpt, RANKS, SAVE_MB, True, SEED, timeout=300)
        self.assertIsNone(m.proc.poll(), "the daemon must survive ENOSPC" + self.diag(m))
        self.assertEqual(find_metadata(m.backing), [], self.diag(m))
        entry = self.checkpoint_entry(m, "ckpt")
        if entry is not None:
            self.assertNotIn(entry["state"], ("committed", "writing", "pending"),
                             f"{entry}{self.diag(m)}")
        self.assert_error_counted(m)
        self.assertNotEqual(m.wait(ckpt, timeout=10), 0, self.diag(m))

    def test_async_dcp_save_marks_checkpoint_failed(self):
        m = self.tmpfs_mount("async")
        ckpt = os.path.join(m.mnt, "ckpt")
        try:
            dcp_tool.save(ckpt, RANKS, SAVE_MB, True, SEED, timeout=300)
            raised = None
        except dcp_tool.DcpToolError as e:    # the flush failed while the ranks still wrote
            raised = e
        print(f"\nasync ENOSPC: the DCP save {'raised' if raised else 'returned'}",
              file=sys.stderr)
        self.assertEqual(m.wait(ckpt, timeout=120), 1,
                         f"ckptfs-admin wait on a failed checkpoint (save raised: "
                         f"{raised is not None}){self.diag(m)}")
        self.assert_failed_and_never_committed(m)

    def test_async_metadata_that_does_not_fit_fails_after_the_save_returned(self):
        # The data files' size in pages, from a direct save of the same state.
        ref = tempfile.mkdtemp(prefix="ckptfs-enospc-ref-")
        self.addCleanup(shutil.rmtree, ref, ignore_errors=True)
        dcp_tool.save(os.path.join(ref, "ckpt"), RANKS, 16, True, SEED, timeout=300)
        page = os.statvfs(ref).f_frsize if os.statvfs(ref).f_frsize == 4096 else 4096
        sizes = {n: os.path.getsize(os.path.join(ref, "ckpt", n))
                 for n in os.listdir(os.path.join(ref, "ckpt"))}
        data_pages = sum(-(-v // page) for n, v in sizes.items() if n != ".metadata")
        self.assertGreater(sizes[".metadata"], page, "the .metadata must need 2+ pages")

        m = self.tmpfs_mount("async")
        st = os.statvfs(m.backing)
        free = st.f_bavail * st.f_frsize
        room = (data_pages + 1) * page           # the data and one page: .metadata cannot fit
        with open(os.path.join(m.backing, "filler"), "wb") as f:
            f.write(b"\0" * (free - room))
            f.flush()
            os.fsync(f.fileno())
        ckpt = os.path.join(m.mnt, "ckpt")
        dcp_tool.save(ckpt, RANKS, 16, True, SEED, timeout=300)   # staged: returns normally
        self.assertEqual(m.wait(ckpt, timeout=120), 1, self.diag(m))
        self.assert_failed_and_never_committed(m)

    def dd(self, m, *extra):
        out = os.path.join(m.mnt, "big")
        return subprocess.run(["dd", "if=/dev/zero", f"of={out}", "bs=1M",
                               f"count={TMPFS_MB + 32}", *extra],
                              capture_output=True, text=True, timeout=300)

    def test_strict_dd_with_fsync_fails(self):
        m = self.tmpfs_mount("strict")
        r = self.dd(m, "conv=fsync")
        self.assertNotEqual(r.returncode, 0, f"dd succeeded: {r.stderr}{self.diag(m)}")
        self.assertIn("No space left on device", r.stderr)
        self.assertIsNone(m.proc.poll(), "the daemon must survive ENOSPC" + self.diag(m))

    def test_strict_dd_without_fsync_fails_at_close(self):
        m = self.tmpfs_mount("strict")
        r = self.dd(m)
        self.assertNotEqual(r.returncode, 0, f"dd succeeded: {r.stderr}{self.diag(m)}")
        self.assertIn("No space left on device", r.stderr)
        self.assertIsNone(m.proc.poll(), "the daemon must survive ENOSPC" + self.diag(m))

    def test_deleting_failed_checkpoint_frees_space_for_the_next(self):
        m = self.tmpfs_mount("strict")
        ckpt = os.path.join(m.mnt, "ckpt")
        with self.assertRaises(dcp_tool.DcpToolError, msg=self.diag(m)):
            dcp_tool.save(ckpt, RANKS, SAVE_MB, True, SEED, timeout=300)
        shutil.rmtree(ckpt)
        deadline = time.time() + 60
        while used_bytes(m.backing) > (1 << 20) and time.time() < deadline:
            time.sleep(0.2)
        self.assertLessEqual(used_bytes(m.backing), 1 << 20,
                             f"space of the deleted failed checkpoint is not freed: "
                             f"{sorted(os.listdir(m.backing))}{self.diag(m)}")
        ckpt2 = os.path.join(m.mnt, "ckpt2")
        dcp_tool.save(ckpt2, RANKS, 16, True, SEED + 1, timeout=300)
        self.assertEqual(m.wait(ckpt2, timeout=120), 0, self.diag(m))
        self.assertEqual(find_metadata(m.backing), [os.path.join("ckpt2", ".metadata")])
        dcp_tool.load(os.path.join(m.backing, "ckpt2"), RANKS, "own", SEED + 1, timeout=300)


if __name__ == "__main__":
    unittest.main()
