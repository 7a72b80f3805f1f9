"""Publication order, the commit gate and stopping at the first failure (G4, G5, G7).

Through a real mount, both durability modes where it applies:
  * a DCP checkpoint copied file by file in sorted order (`.metadata` first, as `cp -r`
    and `rsync` copy) and in reverse order commits within seconds of its last shard's
    close, while a file written before the copy is not held back and one written after
    the `.metadata` stays behind it;
  * DCP saves whose FUSE RELEASEs are slowed (CKPTFS_TEST_RELEASE_DELAY_MS), so rank 0's
    `.metadata` rename overtakes the other ranks' releases: every round commits at once;
  * async, a backing store that fills up during a save, then the tracker
    `latest_checkpointed_iteration.txt` written after the save returned: the tracker
    never reaches the backing store while the checkpoint is not committed; publication
    halts and says so in stats; when space is freed everything publishes, nothing lost;
  * the same, answered by `ckptfs-admin abort CKPT` (lists what it dropped; the rest goes
    on) and by `rm -r` of the failed checkpoint through the mount;
  * a re-save into a committed directory, halted by a full disk after its first shard
    replaced the committed one, then aborted: the directory is the committed save again,
    byte for byte, and loads (the replaced file put back);
  * names that are not UTF-8 (mkdir, create, rename) work and survive a remount.
"""
import hashlib
import json
import os
import subprocess
import threading
import time
import unittest

import dcp_tool
import harness
from harness import ADMIN

RANKS = 2
TRACKER = "latest_checkpointed_iteration.txt"


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree(root):
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            if n.startswith(".ckptfs-tmp."):
                continue
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = sha256(p)
    return out


wait_for = harness.wait_for


def copy_file(src, dst):
    with open(src, "rb") as i, open(dst, "wb") as o:
        while True:
            b = i.read(1 << 20)
            if not b:
                break
            o.write(b)


class Publication(harness.MountedTest):
    @classmethod
    def setUpClass(cls):
        # One real torch checkpoint, per-item layout (many files), saved directly.
        cls.src_root = harness.tempfile.mkdtemp(prefix="ckptfs-pub-src-")
        cls.src = os.path.join(cls.src_root, "ckpt")
        dcp_tool.save(cls.src, RANKS, 24, False, 5, timeout=300)
        cls.names = sorted(os.listdir(cls.src))
        assert ".metadata" in cls.names and len(cls.names) > 3, cls.names

    @classmethod
    def tearDownClass(cls):
        subprocess.run(["rm", "-rf", cls.src_root], check=False)

    WATCHDOG_S = 600

    def mount(self, durability, args=(), env=None, backing=None):
        m = super().mount(["--durability", durability] + list(args), start=False,
                          backing=backing)
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self.start_mount(m)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return m

    def diag(self, m):
        return f"\n--- ckptfs log tail ---\n{m.log_text()}"

    # ------------------------------------------------------------- file orders

    def copy_in_order(self, durability, order):
        m = self.mount(durability)
        before = os.path.join(m.mnt, "before.txt")
        with open(before, "w") as f:
            f.write("written before the copy")
        dst = os.path.join(m.mnt, "ckpt")
        os.mkdir(dst)
        names = self.names if order == "sorted" else list(reversed(self.names))
        md_index = names.index(".metadata")
        after_md = None
        for i, n in enumerate(names):
            copy_file(os.path.join(self.src, n), os.path.join(dst, n))
            if i == md_index and i + 1 < len(names):
                # A file of another directory written after the .metadata: it stays
                # behind the commit (G4), and must not delay it.
                after_md = os.path.join(m.mnt, "after.txt")
                with open(after_md, "w") as f:
                    f.write("written after the .metadata")
        last_close = time.time()
        md_backing = os.path.join(m.backing, "ckpt", ".metadata")
        self.assertTrue(wait_for(lambda: os.path.exists(md_backing), 30),
                        f"{order}: not committed 30 s after the last close{self.diag(m)}")
        commit_s = time.time() - last_close
        self.assertLess(commit_s, 5.0, f"{order}: commit took {commit_s:.2f} s{self.diag(m)}")
        self.assertTrue(wait_for(lambda: os.path.exists(os.path.join(m.backing, "before.txt")), 5),
                        "a file written before the copy was held back")
        self.assertEqual(m.wait(dst, timeout=60), 0, self.diag(m))
        self.assertEqual(m.unmount(), 0, self.diag(m))
        got = tree(os.path.join(m.backing, "ckpt"))
        self.assertEqual(got, tree(self.src), "the copy is not byte-identical")
        if after_md:
            self.assertTrue(os.path.exists(os.path.join(m.backing, "after.txt")))
        return commit_s

    def test_sorted_copy_commits_at_once_async(self):
        self.copy_in_order("async", "sorted")

    def test_reverse_copy_commits_at_once_async(self):
        self.copy_in_order("async", "reverse")

    def test_sorted_copy_commits_at_once_strict(self):
        self.copy_in_order("strict", "sorted")

    def test_reverse_copy_commits_at_once_strict(self):
        self.copy_in_order("strict", "reverse")

    def test_an_entry_after_a_waiting_metadata_keeps_its_place(self):
        # The .metadata arrives first and one shard much later: a tracker written in
        # between must not reach the backing store before the commit (G4).
        m = self.mount("async")
        dst = os.path.join(m.mnt, "ckpt")
        os.mkdir(dst)
        shards = [n for n in self.names if n != ".metadata"]
        copy_file(os.path.join(self.src, ".metadata"), os.path.join(dst, ".metadata"))
        for n in shards[:-1]:
            copy_file(os.path.join(self.src, n), os.path.join(dst, n))
        with open(os.path.join(m.mnt, TRACKER), "w") as f:
            f.write("1")
        time.sleep(1.0)
        self.assertFalse(os.path.exists(os.path.join(m.backing, TRACKER)),
                         "the tracker went ahead of a checkpoint that is not committed")
        self.assertFalse(os.path.exists(os.path.join(m.backing, "ckpt", ".metadata")))
        copy_file(os.path.join(self.src, shards[-1]), os.path.join(dst, shards[-1]))
        self.assertEqual(m.wait(os.path.join(m.mnt, TRACKER), timeout=30), 0, self.diag(m))
        self.assertTrue(os.path.exists(os.path.join(m.backing, "ckpt", ".metadata")))
        self.assertGreater(m.stats().get("journal_applied_ahead", 0), 0)
        self.assertEqual(m.unmount(), 0, self.diag(m))

    # ------------------------------------------------- late RELEASE vs the rename

    def late_release_rounds(self, durability, rounds):
        m = self.mount(durability, env={"CKPTFS_TEST_RELEASE_DELAY_MS": "300"})
        for r in range(rounds):
            ckpt = os.path.join(m.mnt, f"iter_{r}")
            t0 = time.time()
            dcp_tool.save(ckpt, RANKS, 4, bool(r % 2), 100 + r, timeout=300)
            self.assertEqual(m.wait(ckpt, timeout=30), 0, f"round {r}{self.diag(m)}")
            self.assertLess(time.time() - t0, 60, f"round {r} took too long{self.diag(m)}")
            with open(os.path.join(m.mnt, TRACKER), "w") as f:
                f.write(str(r))
        self.assertEqual(m.unmount(), 0, self.diag(m))
        for r in range(rounds):
            self.assertTrue(os.path.exists(os.path.join(m.backing, f"iter_{r}", ".metadata")))
        with open(os.path.join(m.backing, TRACKER)) as f:
            self.assertEqual(f.read(), str(rounds - 1))

    def test_metadata_rename_racing_late_releases_async(self):
        self.late_release_rounds("async", 4)

    def test_metadata_rename_racing_late_releases_strict(self):
        self.late_release_rounds("strict", 2)

    # ------------------------------------------------ failure, then the tracker

    def full_backing_save(self):
        """An async mount over a 96 MiB tmpfs with a 40 MiB filler: a 64 MB save cannot
        fit until the filler is gone."""
        backing = harness.make_tmpfs(self, 96, "ckptfs-pub-full-")
        filler = os.path.join(backing, "filler")
        with open(filler, "wb") as f:
            f.write(b"\0" * (40 << 20))
        # Chunks larger than a rank's file: nothing is flushed before close(), so close
        # returns and the flush fails afterwards, as on a slow parallel file system.
        m = self.mount("async", args=["--chunk-size", "64M"], backing=backing)
        ckpt = os.path.join(m.mnt, "ckpt")
        # Staged: the save itself returns (async); the flush then fails with ENOSPC.
        dcp_tool.save(ckpt, RANKS, 64, True, 9, timeout=300)
        with open(os.path.join(m.mnt, TRACKER), "w") as f:
            f.write("ckpt")
        self.assertTrue(wait_for(lambda: m.stats().get("journal_halted"), 30),
                        f"publication must halt and say so{self.diag(m)}")
        state = {c["path"]: c for c in m.checkpoints()}.get("ckpt", {})
        self.assertEqual(state.get("state"), "failed", f"{state}{self.diag(m)}")
        time.sleep(1.0)
        self.assertFalse(os.path.exists(os.path.join(m.backing, TRACKER)),
                         "the tracker names a checkpoint that is not committed (G4)")
        self.assertFalse(os.path.exists(os.path.join(m.backing, "ckpt", ".metadata")))
        out = subprocess.run([ADMIN, "stats", m.mnt], capture_output=True, text=True)
        self.assertIn("HALTED", out.stdout, out.stdout)
        return m, ckpt, filler

    def test_enospc_then_tracker_then_space_freed_publishes_everything(self):
        m, ckpt, filler = self.full_backing_save()
        r = subprocess.run([ADMIN, "resume", m.mnt, "--json"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 1, "still full: still halted")
        halted = json.loads(r.stdout)["halted"]
        self.assertIn("No space", halted["error"], halted)
        os.unlink(filler)  # space comes back, outside the mount
        r = subprocess.run([ADMIN, "resume", m.mnt], capture_output=True, text=True)
        self.assertIn(r.returncode, (0, 1), r.stderr)
        self.assertEqual(m.wait(ckpt, timeout=60), 0, self.diag(m))
        self.assertEqual(m.wait(os.path.join(m.mnt, TRACKER), timeout=30), 0, self.diag(m))
        self.assertIsNone(m.stats().get("journal_halted"))
        self.assertEqual(m.unmount(), 0, self.diag(m))
        with open(os.path.join(m.backing, TRACKER)) as f:
            self.assertEqual(f.read(), "ckpt")
        dcp_tool.load(os.path.join(m.backing, "ckpt"), RANKS, "own", 9, timeout=300)

    def test_abort_drops_the_failed_checkpoint_and_the_rest_goes_on(self):
        m, ckpt, _ = self.full_backing_save()
        r = subprocess.run([ADMIN, "abort", ckpt, "--json"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        report = json.loads(r.stdout)
        self.assertEqual(report["path"], "ckpt")
        self.assertTrue(any(".metadata" in d for d in report["dropped"]), report)
        # The tracker names the aborted checkpoint: it is withheld, never published (G4),
        # and what comes after it goes on.
        self.assertNotEqual(m.wait(os.path.join(m.mnt, TRACKER), timeout=30), 0, self.diag(m))
        with open(os.path.join(m.mnt, "after.txt"), "w") as f:
            f.write("later work\n")
        self.assertEqual(m.wait(os.path.join(m.mnt, "after.txt"), timeout=30), 0, self.diag(m))
        self.assertFalse(os.path.exists(os.path.join(m.backing, TRACKER)))
        self.assertIsNone(m.stats().get("journal_halted"))
        state = {c["path"]: c for c in m.checkpoints()}.get("ckpt", {})
        self.assertEqual(state.get("state"), "aborted", state)
        self.assertEqual(m.unmount(), 1, "an aborted checkpoint counts as not published")
        self.assertFalse(os.path.exists(os.path.join(m.backing, "ckpt", ".metadata")))
        self.assertFalse([n for n in os.listdir(m.backing) if n.startswith(".ckptfs-tmp.")])

    def test_abort_of_a_rewrite_puts_the_committed_checkpoint_back(self):
        """A job restarted from iteration N saves N again into its committed directory;
        its first shards replace the committed ones on the backing store, then the disk
        fills and publication halts; the operator aborts the re-save. The directory must be
        the committed save again, byte for byte and loadable, not the earlier .metadata over
        a mix of two saves (issue 41, test_fault_inject's "aborted but .metadata")."""
        total = sum(os.path.getsize(os.path.join(self.src, n)) for n in self.names)
        backing = harness.make_tmpfs(self, (2 * total >> 20) + 24, "ckptfs-pub-rewrite-")
        m = self.mount("async", args=["--chunk-size", "64M"], backing=backing)
        ckpt = os.path.join(m.mnt, "ckpt")
        os.mkdir(ckpt)
        for n in self.names:
            copy_file(os.path.join(self.src, n), os.path.join(ckpt, n))
        self.assertEqual(m.wait(ckpt, timeout=60), 0, self.diag(m))
        committed = tree(os.path.join(m.backing, "ckpt"))
        self.assertEqual(committed, tree(self.src))
        shards = [n for n in self.names if n != ".metadata"]
        shards.sort(key=lambda n: -os.path.getsize(os.path.join(self.src, n)))
        first, second = shards[0], shards[1]

        # The re-save's first shard reaches the backing store, over the committed one.
        with open(os.path.join(ckpt, first), "wb") as f:
            f.write(os.urandom(os.path.getsize(os.path.join(self.src, first))))
        self.assertEqual(m.wait(os.path.join(ckpt, first), timeout=60), 0, self.diag(m))
        self.assertNotEqual(sha256(os.path.join(m.backing, "ckpt", first)), committed[first])
        # Then the disk fills: the next shard cannot be flushed, publication halts.
        filler = os.path.join(backing, "filler")
        st = os.statvfs(backing)
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - (256 << 10)))
        size = max(os.path.getsize(os.path.join(self.src, second)), 1 << 20)
        with open(os.path.join(ckpt, second), "wb") as f:
            f.write(os.urandom(size))
        self.assertTrue(wait_for(lambda: m.stats().get("journal_halted"), 30),
                        f"publication must halt on the full disk{self.diag(m)}")

        r = subprocess.run([ADMIN, "abort", ckpt, "--json"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(any(second in d for d in json.loads(r.stdout)["dropped"]), r.stdout)
        state = lambda: {c["path"]: c for c in m.checkpoints()}.get("ckpt", {}).get("state")
        self.assertTrue(wait_for(lambda: state() == "committed", 30),
                        f"the earlier save stands again: {state()}{self.diag(m)}")
        self.assertEqual(tree(os.path.join(m.backing, "ckpt")), committed,
                         "the backing directory is not the committed save again")
        self.assertIn("put back", m.log_text())
        os.unlink(filler)
        with open(os.path.join(m.mnt, "after.txt"), "w") as f:
            f.write("later work\n")
        self.assertEqual(m.wait(os.path.join(m.mnt, "after.txt"), timeout=30), 0, self.diag(m))
        self.assertIsNone(m.stats().get("journal_halted"))
        self.assertEqual(m.unmount(), 1, "the aborted shard never reached the backing store")
        self.assertEqual(tree(os.path.join(m.backing, "ckpt")), committed)
        self.assertFalse([n for n in os.listdir(m.backing) if n.startswith(".ckptfs-tmp.")])
        dcp_tool.load(os.path.join(m.backing, "ckpt"), RANKS, "own", 5, timeout=300)

    def test_rm_of_the_failed_checkpoint_lets_the_rest_go_on(self):
        m, ckpt, _ = self.full_backing_save()
        subprocess.run(["rm", "-rf", ckpt], check=True)
        # The tracker names the removed checkpoint, which never commits: withheld (G4), and
        # `wait` says so (exit 1: "withheld", or gone from the mount, as the backing store
        # never had a tracker). What comes after it goes on.
        r = subprocess.run([ADMIN, "wait", os.path.join(m.mnt, TRACKER), "--timeout", "60"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 1, f"{r.stderr}{self.diag(m)}")
        self.assertRegex(r.stderr, "withheld|gone from the mount")
        with open(os.path.join(m.mnt, "after.txt"), "w") as f:
            f.write("later work\n")
        self.assertEqual(m.wait(os.path.join(m.mnt, "after.txt"), timeout=60), 0, self.diag(m))
        self.assertIsNone(m.stats().get("journal_halted"))
        self.assertFalse(os.path.exists(os.path.join(m.backing, TRACKER)))
        self.assertFalse(os.path.exists(os.path.join(m.backing, "ckpt", ".metadata")))
        m.unmount()
        self.assertFalse(os.path.exists(os.path.join(m.backing, "ckpt")))

    # ------------------------------------------------------------ backpressure

    def test_async_creates_wait_for_room_in_a_bounded_backlog(self):
        """--max-pending: writers faster than publication wait at create instead of the
        backlog (one open temp file per pending publish) growing without bound."""
        m = self.mount("async", args=["--max-pending", "4"])
        os.mkdir(os.path.join(m.mnt, "many"))
        block = os.urandom(1 << 20)
        peak = [0]

        def writer(w):
            # Six writers at once, 1 MiB each: more files close per second than one
            # publisher thread applies (fsync, rename, directory sync), whatever the load.
            for i in range(25):
                with open(os.path.join(m.mnt, "many", f"w{w}-{i:02d}"), "wb") as f:
                    f.write(block)
                peak[0] = max(peak[0], m.stats()["journal_pending"])

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(m.wait(os.path.join(m.mnt, "many"), timeout=120), 0, self.diag(m))
        s = m.stats()
        self.assertGreater(s["journal_room_waits"], 0, f"never waited for room: {s}")
        # The bound, plus one create per writer let through at once, plus the mkdir.
        self.assertLessEqual(peak[0], 4 + 6 + 1, f"journal_pending reached {peak[0]}")
        self.assertEqual(m.unmount(), 0, self.diag(m))
        self.assertEqual(len(os.listdir(os.path.join(m.backing, "many"))), 150)

    # ------------------------------------------------------------ byte names

    def byte_names(self, durability):
        m = self.mount(durability)
        mnt = os.fsencode(m.mnt)
        d = os.path.join(mnt, b"bad\xff")
        os.mkdir(d)
        f = os.path.join(d, b"name-\x80\xff.bin")
        with open(f, "wb") as out:
            out.write(b"payload")
        os.rename(f, os.path.join(d, b"moved-\xfe"))
        with open(os.path.join(d, b"\xc3\x28.metadata.tmp"), "wb") as out:
            out.write(b"x")
        self.assertEqual(m.wait(m.mnt, timeout=30), 0, self.diag(m))
        self.assertIn(b"moved-\xfe", os.listdir(d))
        self.assertIsNotNone(m.stats())  # the control files still render
        m.checkpoints()
        self.assertEqual(m.unmount(), 0, self.diag(m))
        back = os.path.join(os.fsencode(m.backing), b"bad\xff")
        self.assertEqual(sorted(os.listdir(back)), [b"moved-\xfe", b"\xc3\x28.metadata.tmp"])
        m.start()  # survives a restart
        self.assertEqual(sorted(os.listdir(d)), [b"moved-\xfe", b"\xc3\x28.metadata.tmp"])
        with open(os.path.join(d, b"moved-\xfe"), "rb") as i:
            self.assertEqual(i.read(), b"payload")

    def test_names_that_are_not_utf8_async(self):
        self.byte_names("async")

    def test_names_that_are_not_utf8_strict(self):
        self.byte_names("strict")


if __name__ == "__main__":
    unittest.main()
