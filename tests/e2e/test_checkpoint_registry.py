"""The checkpoint registry through a real mount (issue 10, item 7): `ckptfs-admin
checkpoints` kept listing a deleted checkpoint as "committed 0 B, age 20780d".

A checkpoint deleted (`rm -r`) or renamed (`mv`) right after its save, while its commit
is still queued in async mode, must leave the registry or move with its name; one
deleted on the backing store behind the mount's back leaves too. Both durability modes.
"""
import os
import shutil
import subprocess
import time
import unittest

import harness
from harness import ADMIN

MiB = 1 << 20


def save(dirpath, shard_mib=16):
    """A DCP-shaped checkpoint: one shard, then `.metadata.tmp` renamed to `.metadata`
    (not a real pickle: the commit gate then commits by journal order)."""
    os.mkdir(dirpath)
    with open(os.path.join(dirpath, "__0_0.distcp"), "wb") as f:
        f.write(os.urandom(shard_mib * MiB))
    tmp = os.path.join(dirpath, ".metadata.tmp")
    with open(tmp, "wb") as f:
        f.write(b"not a pickle")
    os.rename(tmp, os.path.join(dirpath, ".metadata"))


def settle(m, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = m.stats()
        if s["journal_pending"] == 0 and s["files_pending"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"journal not drained: {m.stats()}")


class CheckpointRegistry(harness.MountedTest):
    def run_mode(self, durability):
        m = self.mount(["--durability", durability])
        save(os.path.join(m.mnt, "deleted"))
        shutil.rmtree(os.path.join(m.mnt, "deleted"))  # commit possibly still queued
        save(os.path.join(m.mnt, "run"))
        os.rename(os.path.join(m.mnt, "run"), os.path.join(m.mnt, "best"))
        save(os.path.join(m.mnt, "external"))
        settle(m)
        paths = {c["path"]: c for c in m.checkpoints()}
        self.assertNotIn("deleted", paths)
        self.assertNotIn("run", paths)
        self.assertEqual(paths["best"]["state"], "committed", paths)
        self.assertGreaterEqual(paths["best"]["bytes"], 16 * MiB)
        self.assertGreater(paths["best"]["created"], time.time() - 3600)
        # Removed behind the mount's back, on the backing store.
        self.assertEqual(paths["external"]["state"], "committed", paths)
        shutil.rmtree(os.path.join(m.backing, "external"))
        paths = {c["path"]: c for c in m.checkpoints()}
        self.assertNotIn("external", paths)
        out = subprocess.run([ADMIN, "checkpoints", m.mnt], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("best", out.stdout)
        for ghost in ("deleted", "external", "run "):
            self.assertNotIn(ghost, out.stdout)
        self.assertNotRegex(out.stdout, r"\d{4,}d")  # no age counted from 1970
        self.assertEqual(m.unmount(), 0, m.log_text())

    def test_async(self):
        self.run_mode("async")

    def test_strict(self):
        self.run_mode("strict")


if __name__ == "__main__":
    unittest.main()
