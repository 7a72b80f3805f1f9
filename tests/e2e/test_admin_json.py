"""`ckptfs-admin SUBCOMMAND --json` for every subcommand, against a real mount.

Each output must be one valid JSON document (top: one per line) whose fields agree with
what the test did: stats and checkpoints mirror the control files, wait reports the bytes
of what it waited for (a directory counts the bytes of its files, not journal entries),
--create-timeout waits for a path that appears later, ls/verify/diff describe real torch
DCP checkpoints, top reports rates and checkpoints, unmount reports the clean exit.
(wait's plain progress lines, rate and ETA are unit-tested with a scripted clock in
tests/mount/admin_test.cc.)
"""
import json
import os
import subprocess
import threading
import time
import unittest

import dcp_tool
import harness
from harness import ADMIN

dcp_tool._apply_sitecustomize()
import torch  # noqa: E402
import torch.distributed._shard.checkpoint as dcp  # noqa: E402


def admin(*args, timeout=120):
    return subprocess.run([ADMIN, *args], capture_output=True, text=True, timeout=timeout)


def admin_json(test, *args, rc=0):
    r = admin(*args)
    test.assertEqual(r.returncode, rc, f"{args}: {r.stdout}{r.stderr}")
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError as e:
        test.fail(f"{args}: not JSON ({e}): {r.stdout!r}")


class AdminJsonTest(harness.MountedTest):
    # The mount's watchdog (harness.MountedTest) only catches a hang: longer than any run.
    WATCHDOG_S = 1800
    def test_every_subcommand_speaks_json(self):
        m = self.mount()
        g = torch.Generator().manual_seed(3)
        a = {"w": torch.randn(128, 64, generator=g), "step": torch.tensor(7)}
        b = {"w": a["w"].clone(), "step": torch.tensor(8)}
        ck_a = os.path.join(m.mnt, "ckpt", "a")
        ck_b = os.path.join(m.mnt, "ckpt", "b")
        dcp.save_state_dict(a, dcp.FileSystemWriter(ck_a), no_dist=True)
        dcp.save_state_dict(b, dcp.FileSystemWriter(ck_b), no_dist=True)

        # wait on a checkpoint directory: its bytes, committed.
        w = admin_json(self, "wait", ck_a, "--timeout", "60", "--json")
        self.assertEqual((w["path"], w["state"], w["exit_code"]), (ck_a, "committed", 0))
        self.assertGreaterEqual(w["bytes_total"], 128 * 64 * 4)
        self.assertEqual(w["bytes_done"], w["bytes_total"])
        self.assertEqual(admin_json(self, "wait", ck_b, "--json")["state"], "committed")

        # wait on a plain file.
        data = os.urandom(5 << 20)
        with open(os.path.join(m.mnt, "blob"), "wb") as f:
            f.write(data)
        w = admin_json(self, "wait", os.path.join(m.mnt, "blob"), "--json")
        self.assertEqual((w["state"], w["bytes_total"]), ("published", len(data)))

        # --create-timeout: the path appears 1 s after wait starts.
        later = os.path.join(m.mnt, "later")

        def make_later():
            time.sleep(1)
            with open(later, "wb") as f:
                f.write(b"x" * 1000)
        t = threading.Thread(target=make_later)
        t.start()
        w = admin_json(self, "wait", later, "--create-timeout", "30", "--json")
        t.join()
        self.assertEqual((w["state"], w["bytes_total"]), ("published", 1000))
        self.assertGreaterEqual(w["elapsed_s"], 0.5)
        # ...and one that never appears times out with exit 2 and says so.
        w = admin_json(self, "wait", os.path.join(m.mnt, "never"), "--create-timeout",
                       "0.5", "--json", rc=2)
        self.assertIn("did not appear", w["message"])

        st = admin_json(self, "stats", m.mnt, "--json")
        self.assertEqual(st["mountpoint"], m.mnt)
        self.assertGreaterEqual(st["bytes_written"], len(data))

        cks = admin_json(self, "checkpoints", m.mnt, "--json")
        states = {c["path"]: c["state"] for c in cks}
        self.assertEqual(states.get("ckpt/a"), "committed", cks)
        self.assertEqual(states.get("ckpt/b"), "committed", cks)

        ls = admin_json(self, "ls", ck_a, "--json")
        self.assertEqual(sorted(e["fqn"] for e in ls), ["step", "w"])
        self.assertEqual([e["shape"] for e in ls if e["fqn"] == "w"], [[128, 64]])

        v = admin_json(self, "verify", ck_a, "--json")
        self.assertEqual((v["ok"], v["bad_count"], v["path"]), (True, 0, ck_a))
        self.assertEqual(v["items"], 2)

        d = admin_json(self, "diff", ck_a, ck_b, "--json", rc=1)
        self.assertEqual((d["identical"], d["differ"], d["entries"]), (False, 1, 2))
        self.assertEqual(d["changes"], [{"fqn": "step", "change": "modified"}])
        d = admin_json(self, "diff", ck_a, ck_a, "--json")
        self.assertEqual((d["identical"], d["changes"]), (True, []))

        # top: two frames while a writer runs; rates are numbers, checkpoints listed.
        stop = threading.Event()

        def writer():
            with open(os.path.join(m.mnt, "stream"), "wb") as f:
                while not stop.is_set():
                    f.write(b"s" * (1 << 20))
                    time.sleep(0.01)
        t = threading.Thread(target=writer)
        t.start()
        try:
            r = admin("top", m.mnt, "-n", "2", "--interval", "0.5", "--json")
        finally:
            stop.set()
            t.join()
        self.assertEqual(r.returncode, 0, r.stderr)
        frames = [json.loads(line) for line in r.stdout.splitlines()]
        self.assertEqual(len(frames), 2)
        self.assertGreater(max(f["write_rate"] for f in frames), 0)
        self.assertEqual(frames[0]["mountpoint"], m.mnt)
        self.assertIn("ckpt/b", [c["path"] for c in frames[-1]["checkpoints"]])
        r = admin("top", m.mnt, "-n", "1", "--interval", "0.1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("CHECKPOINT", r.stdout)

        u = admin_json(self, "unmount", m.mnt, "--timeout", "60", "--json")
        self.assertEqual((u["clean"], u["exit_code"], u["unpublished_files"]), (True, 0, 0))
        self.assertEqual(u["pid"], m.proc.pid)
        m.proc.wait(timeout=30)


class DirectoryProgressTest(harness.MountedTest):
    # The mount's watchdog (harness.MountedTest) only catches a hang: longer than any run.
    WATCHDOG_S = 1800
    def test_a_directory_waits_in_bytes_of_its_unpublished_files(self):
        """A checkpoint whose .metadata names a shard that never comes holds the ordered
        journal (up to --commit-timeout); files written after it wait. The directory's
        progress, which `wait DIR` shows, counts their bytes, never journal entries."""
        import tempfile
        m = self.mount(args=["--commit-timeout", "60"])
        outside = tempfile.mkdtemp(prefix="ckptfs-e2e-meta-")
        self.addCleanup(__import__("shutil").rmtree, outside, ignore_errors=True)
        dcp.save_state_dict({"w": torch.ones(4)}, dcp.FileSystemWriter(outside),
                            no_dist=True)
        held = os.path.join(m.mnt, "held")
        os.makedirs(held)
        with open(os.path.join(outside, ".metadata"), "rb") as src, \
                open(os.path.join(held, ".metadata"), "wb") as dst:
            dst.write(src.read())  # its shard is missing: the commit waits
        d = os.path.join(m.mnt, "d")
        os.makedirs(d)
        sizes = {"a": 100_000, "b": 3 << 20}
        for name, size in sizes.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(b"q" * size)
        prog = json.loads(os.getxattr(d, "user.ckptfs.progress"))
        self.assertEqual(prog["state"], "staged", prog)
        self.assertEqual(prog["bytes_total"], sum(sizes.values()), prog)
        self.assertLessEqual(prog["bytes_done"], prog["bytes_total"])
        self.assertGreater(prog["entries_pending"], 0)
        w = admin_json(self, "wait", d, "--timeout", "0.5", "--json", rc=2)
        self.assertEqual((w["state"], w["bytes_total"]), ("staged", sum(sizes.values())))
        self.assertIn("timed out", w["message"])
        m.kill()  # the held commit would make a clean unmount wait for the timeout

if __name__ == "__main__":
    unittest.main()
