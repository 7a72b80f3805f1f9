"""EIO from the backing store under real torch DCP saves (issue 41).

The daemon runs with its test-only fault layer (`--fault-inject`,
store/primitives/fault_injection.h): the backing store's pwrites, fsyncs, directory fsyncs
and renames fail with EIO at a seeded rate (a failing pwrite writing part of its bytes
first). A torch 1.13 trainer (dcp_tool.train: 2 gloo ranks, DCP save of iter_N, then the
Megatron tracker) saves through the mount; after a failed save it starts again after the
tracker it reads through the mount, as a job restarted by its scheduler would. An operator
thread does what docs/USAGE.md tells an operator: a publication halted for good (an fsync
failed: the bytes may be lost) is aborted with `ckptfs-admin abort CKPT`; a halt that
retries by itself is left alone.

Checked from the backing store alone, in both durability modes:
  * the tracker always names a checkpoint whose .metadata is there (sampled all along);
  * every .metadata there loads exactly (every value against its iteration's seed);
  * strict: every save that returned is committed there; a save that failed never shows
    a .metadata unless it loads exactly (then it was a retry's);
  * async: every save that returned ends committed (and is on the backing store), or
    failed or aborted with a reason, and then has no .metadata there;
  * the run injected faults, the daemon survived them, a clean unmount leaves no temp file
    and loses nothing committed, and its exit code says whether any file never reached
    the backing store (1, with the count in exit.json) or none did (0).
"""
import errno
import json
import os
import subprocess
import threading
import time
import unittest

import dcp_tool
import harness

RANKS = 2
MB = 2
ITERS = int(os.environ.get("CKPTFS_FAULT_ITERS", "6"))   # saves per mode in CI (~1 min); 14+ by hand
SEED = int(os.environ.get("CKPTFS_FAULT_SEED", "4107"))
SPEC = ("seed={seed},eio_write=0.03,eio_fsync=0.01,eio_dirsync=0.02,eio_rename=0.03,"
        "partial=1")


def read_text(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


class FaultInject(harness.MountedTest):
    WATCHDOG_S = 900

    def setUp(self):
        super().setUp()
        self.problems = []
        self.aborted = set()
        self.halts = []

    # ------------------------------------------------------------------ helpers
    def operator(self, m, stop):
        """Aborts a publication halted for good (what an operator does); notes every halt
        and fails one without a reason or one that retries for over 120 s."""
        since = None
        while not stop.wait(0.3):
            try:
                st = m.stats()
            except (OSError, ValueError):
                continue
            h = st.get("journal_halted")
            if not h:
                since = None
                continue
            if since is None:
                since = time.monotonic()
                self.halts.append(h)
            if not str(h.get("error", "")).strip():
                self.problems.append(f"a halt without a reason: {h}")
            if h.get("retrying"):
                if time.monotonic() - since > 120:
                    self.problems.append(f"a transient halt lasted over 120 s: {h}")
                    since = time.monotonic() + 10 ** 6
                continue
            ckpt = h["path"].split("/")[0]
            r = subprocess.run([harness.ADMIN, "abort", os.path.join(m.mnt, ckpt)],
                               capture_output=True, text=True)
            self.aborted.add(ckpt)
            if r.returncode != 0:
                self.problems.append(f"ckptfs-admin abort {ckpt} -> {r.returncode}: "
                                     f"{r.stdout}{r.stderr}")
            since = None

    def tracker_watch(self, m, stop):
        """The backing store's tracker never names a checkpoint without its .metadata."""
        while not stop.wait(0.1):
            t = (read_text(os.path.join(m.backing, dcp_tool.TRACKER)) or "").strip()
            if not t.isdigit():
                continue
            md = os.path.join(dcp_tool.iter_dir(m.backing, int(t)), ".metadata")
            if not os.path.exists(md):
                t2 = (read_text(os.path.join(m.backing, dcp_tool.TRACKER)) or "").strip()
                if t2 == t and not os.path.exists(md):
                    self.problems.append(f"the backing tracker names {t}, which has no "
                                         f".metadata there")

    def train(self, m, oplog):
        """Saves iterations 1..ITERS, starting again after each failed run after the
        tracker it reads through the mount; returns the iterations whose save returned and
        the number of failed runs."""
        saved, failures, n, runs = set(), 0, 1, 0
        deadline = time.monotonic() + 600
        while n <= ITERS and runs < 3 * ITERS and time.monotonic() < deadline:
            runs += 1
            try:
                dcp_tool.train(m.mnt, ranks=RANKS, mb=MB, start=n, iters=ITERS - n + 1,
                               keep=10 ** 9, single_file_per_rank=n % 2 == 0, oplog=oplog,
                               timeout=300)
            except dcp_tool.DcpToolError:
                failures += 1
            ops = [json.loads(x) for x in (read_text(oplog) or "").splitlines() if x]
            saved |= {o["iter"] for o in ops if o["op"] == "saved"}
            t = (read_text(os.path.join(m.mnt, dcp_tool.TRACKER)) or "").strip()
            n = (int(t) if t.isdigit() else 0) + 1
        return saved, failures

    def settle(self, m, timeout=300):
        """Waits until nothing is queued for publication (the operator aborts what is
        halted for good)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = m.stats()
            if st.get("journal_pending") == 0 and not st.get("journal_halted"):
                return st
            time.sleep(0.2)
        self.fail(f"publication did not settle in {timeout} s: {m.stats()}")

    # ------------------------------------------------------------------ the test
    def run_mode(self, mode):
        m = self.mount(["--durability", mode, "--fault-inject", SPEC.format(seed=SEED)])
        oplog = os.path.join(m.root, "ops.jsonl")
        stop = threading.Event()
        threads = [threading.Thread(target=f, args=(m, stop), daemon=True)
                   for f in (self.operator, self.tracker_watch)]
        for th in threads:
            th.start()
        try:
            saved, failed_runs = self.train(m, oplog)
            self.settle(m)
        finally:
            stop.set()
            for th in threads:
                th.join(timeout=30)
        self.assertIsNone(m.proc.poll(), "the daemon must survive injected EIO")
        cks = {c["path"]: c for c in m.checkpoints()}
        names = {n: os.path.basename(dcp_tool.iter_dir("", n)) for n in range(1, ITERS + 1)}
        on_backing = {n for n, d in names.items()
                      if os.path.exists(os.path.join(m.backing, d, ".metadata"))}
        log = m.log_text()
        with open(m.log, errors="replace") as f:
            injected = f.read().count("fault-inject: ")
        print(f"\n{mode}: {len(saved)} saves returned, {failed_runs} failed runs, "
              f"{len(on_backing)} committed on the backing store, {injected} faults injected, "
              f"{len(self.halts)} halts, aborted {sorted(self.aborted)}")
        self.assertGreater(injected, 0, "no fault was injected")
        for n, d in names.items():
            c = cks.get(d)
            state = c["state"] if c else None
            if state in ("failed", "aborted"):
                self.assertTrue(str(c.get("error") or "").strip(), f"{d} {state} without a "
                                f"reason: {c}")
            if n not in saved:
                continue
            if mode == "strict":
                self.assertIn(n, on_backing, f"strict: save {d} returned but is not committed "
                              f"on the backing store ({c})\n{log}")
            else:
                self.assertIn(state, ("committed", "failed", "aborted"),
                              f"async: save {d} returned and ended {state}: {c}\n{log}")
                if state == "committed":
                    self.assertIn(n, on_backing, f"{d} reported committed, not on the "
                                  f"backing store\n{log}")
                else:
                    self.assertNotIn(n, on_backing, f"{d} {state} but its .metadata is on "
                                     f"the backing store: {c}")
        if on_backing:
            got = dcp_tool.verify([os.path.join(m.backing, names[n]) for n in sorted(on_backing)],
                                  sorted(on_backing), timeout=600)
            bad = [(r["dir"], r["errors"][:3]) for r in got if not r["ok"]]
            self.assertEqual(bad, [], "a checkpoint committed on the backing store does not "
                                      "load exactly")
        self.assertEqual(self.problems, [], log)
        rc = m.unmount(timeout=300)
        # The stop's exit report counts every file that never reached the backing store (an
        # aborted or failed save, a withheld tracker): 0 and clean only when none.
        with open(os.path.join(m.state, "exit.json")) as f:
            report = json.load(f)
        self.assertEqual(report.get("left_for_resume", 0), 0, report)
        self.assertEqual(rc, 0 if report["unpublished_files"] == 0 else 1,
                         f"exit code after a clean unmount: {report}\n{m.log_text()}")
        self.assertEqual(harness.tmp_names(m.backing), [], "temp files left after a clean stop")
        after = {n for n, d in names.items()
                 if os.path.exists(os.path.join(m.backing, d, ".metadata"))}
        self.assertEqual(after, on_backing, "the stop changed what is committed")
        t = (read_text(os.path.join(m.backing, dcp_tool.TRACKER)) or "").strip()
        if t.isdigit():
            self.assertIn(int(t), on_backing, f"the final tracker names {t}")

    def test_async_saves_under_eio(self):
        self.run_mode("async")

    def test_strict_saves_under_eio(self):
        self.run_mode("strict")

    def test_strict_failed_tracker_rewrite_reads_as_the_one_before(self):
        """Strict: a tracker whose rewrite failed at close (EIO, G7) reads as the tracker
        the backing store still has once the handle is closed, so a job that reads it at
        restart can start. Before, every open failed with EIO until it was written again
        (the soak, seed 5501: 19 s, until the daemon was killed). Each rewrite is one byte
        shorter than the one before, so a size the kernel kept from the failed version
        would cut the read short."""
        # Every file fsync fails in 1-second bursts every 2 seconds.
        m = self.mount(args=["--durability", "strict", "--fault-inject",
                             "seed=7,eio_fsync=1,burst_on=1,burst_off=1"])
        tracker = os.path.join(m.mnt, dcp_tool.TRACKER)
        last_ok, failed, n = None, False, 0
        deadline = time.monotonic() + 60
        while not failed and time.monotonic() < deadline:
            n += 1
            value = str(n % 10) * max(1, 400 - n)
            fd = os.open(tracker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, value.encode())
            finally:
                try:
                    os.close(fd)
                    last_ok = value
                except OSError as e:
                    self.assertEqual(e.errno, errno.EIO, e)
                    failed = last_ok is not None
            time.sleep(0.05)
        self.assertTrue(failed, "no close failed after one succeeded in 60 s")
        self.assertEqual(os.stat(tracker).st_size, len(last_ok), "the failed version's size")
        with open(tracker) as f:   # EIO here before
            self.assertEqual(f.read(), last_ok)
        self.assertEqual((read_text(os.path.join(m.backing, dcp_tool.TRACKER)) or ""), last_ok)
        self.assertIn("the backing store's version is shown again",
                      m.wait_log("the backing store's version is shown again"))


if __name__ == "__main__":
    unittest.main()
