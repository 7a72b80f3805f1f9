"""A stop of a mount whose publication waits never hangs (G10) and loses nothing (G11).

A DCP checkpoint is copied into the mount without one shard (as if another node had not
written it yet), then a tracker and another file: the `.metadata` waits at the commit gate
for that shard, then halts there (--commit-timeout), and everything after it waits. Then:
  * `ckptfs-admin unmount` returns within the bound, says what publication waits for,
    and exits non-zero; the daemon exits 3 ("left for the next start") and its exit report
    counts what it left, with nothing unpublished;
  * the same with SIGTERM;
  * nothing was applied past the commit on the backing store (G4);
  * once the shard is there, the daemon started again on the same state dir publishes
    every file byte-exact, and its own stop is clean.
"""
import json
import os
import shutil
import signal
import subprocess
import time
import unittest

import harness
from harness import ADMIN

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "fixtures", "dcp", "torch113_4rank_single_file")
MISSING = "__3_0.distcp"
TRACKER = "latest_checkpointed_iteration.txt"
STOP_S = 3
COMMIT_S = 2


wait_for = harness.wait_for


def read(path):
    with open(path, "rb") as f:
        return f.read()


class StopBounded(harness.MountedTest):
    ARGS = ["--commit-timeout", str(COMMIT_S), "--stop-timeout", str(STOP_S)]

    def start_waiting_save(self):
        """A mount whose publication waits at a commit, with entries queued behind it."""
        m = self.mount(args=self.ARGS)
        dst = os.path.join(m.mnt, "ckpt")
        os.mkdir(dst)
        for n in sorted(os.listdir(FIXTURE)):
            if n != MISSING:
                shutil.copyfile(os.path.join(FIXTURE, n), os.path.join(dst, n))
        with open(os.path.join(m.mnt, TRACKER), "w") as f:
            f.write("1")
        self.other = os.urandom(3 << 20)
        with open(os.path.join(m.mnt, "other.bin"), "wb") as f:
            f.write(self.other)

        def waiting():
            s = m.stats()
            return bool(s.get("journal_waiting")) or s.get("journal_halted") is not None
        self.assertTrue(wait_for(waiting, 20), f"publication never waited\n{m.log_text()}")
        return m

    def check_left_then_resume(self, m, rc):
        self.assertEqual(rc, 3, f"daemon exit code\n{m.log_text()}")
        with open(os.path.join(m.state, "exit.json")) as f:
            report = json.load(f)
        self.assertGreater(report["left_for_resume"], 0, report)
        self.assertEqual(report["unpublished_files"], 0, report)
        self.assertIn(".metadata", report["waiting_for"])
        self.assertFalse(harness.is_mounted(m.mnt))
        # Nothing past the commit reached the backing store (G4); the bytes wait in temps.
        self.assertFalse(os.path.exists(os.path.join(m.backing, "ckpt", ".metadata")))
        self.assertFalse(os.path.exists(os.path.join(m.backing, TRACKER)))
        self.assertFalse(os.path.exists(os.path.join(m.backing, "other.bin")))
        self.assertTrue(harness.tmp_names(m.backing), "the left files' temps are gone")

        # The condition clears: the other node's shard arrives. The next start resumes.
        shutil.copyfile(os.path.join(FIXTURE, MISSING), os.path.join(m.backing, "ckpt", MISSING))
        m2 = self.mount(args=self.ARGS, root=m.root, backing=m.backing, state=m.state)
        tracker = os.path.join(m2.mnt, TRACKER)
        self.assertTrue(wait_for(lambda: os.path.exists(os.path.join(m2.backing, TRACKER)), 30),
                        f"the left entries were not published\n{m2.log_text()}")
        self.assertEqual(m2.wait(os.path.join(m2.mnt, "ckpt"), timeout=30), 0, m2.log_text())
        for n in os.listdir(FIXTURE):
            self.assertEqual(read(os.path.join(m2.backing, "ckpt", n)),
                             read(os.path.join(FIXTURE, n)), n)
        self.assertEqual(read(os.path.join(m2.backing, TRACKER)), b"1")
        self.assertEqual(read(os.path.join(m2.backing, "other.bin")), self.other)
        self.assertEqual(read(tracker), b"1", "the mount shows the published tracker")
        self.assertEqual(m2.unmount(timeout=60), 0, m2.log_text())
        self.assertEqual(harness.tmp_names(m2.backing), [])
        with open(os.path.join(m2.state, "exit.json")) as f:
            self.assertEqual(json.load(f)["left_for_resume"], 0)

    def test_admin_unmount_is_bounded_says_why_and_the_next_start_publishes_everything(self):
        m = self.start_waiting_save()
        t0 = time.time()
        r = subprocess.run([ADMIN, "unmount", m.mnt], capture_output=True, text=True,
                           timeout=120)
        took = time.time() - t0
        self.assertLess(took, STOP_S + 15, f"unmount took {took:.1f}s\n{r.stderr}")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("publication waits", r.stderr)
        self.assertIn("ckpt/.metadata", r.stderr)
        self.assertIn("left for its next start", r.stderr)
        rc = m.proc.wait(timeout=30)
        m._close_pipe()
        m.proc = None
        self.check_left_then_resume(m, rc)

    def test_sigterm_is_bounded_and_the_next_start_publishes_everything(self):
        m = self.start_waiting_save()
        t0 = time.time()
        m.proc.send_signal(signal.SIGTERM)
        rc = m.proc.wait(timeout=120)
        took = time.time() - t0
        self.assertLess(took, STOP_S + 15, f"the stop took {took:.1f}s\n{m.log_text()}")
        m._close_pipe()
        m.proc = None
        self.assertIn("stop: publication waits", m.log_text())
        self.check_left_then_resume(m, rc)


if __name__ == "__main__":
    unittest.main()
