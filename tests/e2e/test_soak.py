"""The short soak in CI (issue 41): scripts/soak.py for CKPTFS_SOAK_MINUTES (default 3),
async on one node, then strict on two daemons in network namespaces over one backing store
(the peer killed too), with a fixed seed (CKPTFS_SOAK_SEED, default 4101), kills every 5 to
20 s and the fault layer's seeded EIO bursts (CKPTFS_SOAK_FAULTS; CKPTFS_SOAK_RUNS overrides
the mix, e.g. async:2,strict:2). The two-node strict run joined CI at stop 51, after its
findings were fixed (docs/RELIABILITY.md, stops 49 to 51) and 4 runs of it gave 0
failures. It
fails when any invariant of the soak broke (its report, soak.json, says which, and its work
directories are kept); the RSS bound is printed, not judged, in this short form (its quiet
phase is a few hundred saves at most, mostly warm-up; the long form judges it, and fds,
threads and the state dir are still judged here); see docs/RELIABILITY.md for the long form."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SOAK = os.path.join(HERE, "..", "..", "scripts", "soak.py")
MINUTES = os.environ.get("CKPTFS_SOAK_MINUTES", "3")
SEED = os.environ.get("CKPTFS_SOAK_SEED", "4101")
RUNS = os.environ.get("CKPTFS_SOAK_RUNS", "async:1,strict:2")
# The soak's default fault mix with bursts every 11 s instead of 23 s: a daemon killed every
# 5 to 20 s often died before its first 3 s burst, and a 90 s mode once injected nothing
# (CI of fee23ce, async), which this test refuses.
FAULTS = os.environ.get(
    "CKPTFS_SOAK_FAULTS", "eio_write=0.03,eio_fsync=0.003,eio_dirsync=0.01,eio_rename=0.01,"
    "partial=1,burst_on=3,burst_off=8,enospc_after=384M,enospc_for=4")


@unittest.skipUnless(os.geteuid() == 0, "needs root (FUSE mounts, blkio cgroups)")
class Soak(unittest.TestCase):
    def test_short_soak_both_modes(self):
        out = tempfile.mkdtemp(prefix="ckptfs-soak-ci-")
        # The soak registers what it starts with this process's guardian (reaper.py), so
        # ctest's TIMEOUT kill still leaves nothing behind.
        r = subprocess.run([sys.executable, SOAK, "--minutes", MINUTES, "--seed", SEED,
                            "--runs", RUNS, "--kill-min", "5", "--kill-max", "20",
                            "--faults", FAULTS,
                            "--leak-report-only", "--out", out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=float(MINUTES) * 60 + 600)
        print(r.stdout[-6000:])
        with open(os.path.join(out, "soak.json")) as f:
            rep = json.load(f)
        fails = [f"{x['mode']}/{x.get('nodes', 1)}n t={x['t']}: {x['what']}: {x['detail'][:600]}"
                 for run in rep["runs"] for x in run["failures"]]
        self.assertEqual(fails, [], f"soak seed {rep['seed']} (report {out}/soak.json)")
        self.assertEqual(r.returncode, 0, r.stdout[-3000:])
        for run in rep["runs"]:
            c = run["counts"]
            self.assertGreater(c["daemon_kills"], 0, f"{run['mode']}: no daemon kill")
            self.assertGreater(c["saves_train"], 0, f"{run['mode']}: no save")
            self.assertGreater(c["verify_loads"], 0, f"{run['mode']}: nothing verified")
            self.assertGreater(c["faults_injected"], 0, f"{run['mode']}: no fault injected")
            # The journal's trace was read: "nothing published twice" checked by sequence.
            self.assertGreater(c.get("journal_done", 0), 0, f"{run['mode']}: no journal trace")
            # The torch 2.x async_save trainer ran where the sid root was built already (by
            # an earlier test; --torch2 auto never builds it): its saves then count.
            if c.get("async2_jobs", 0) > 2:
                self.assertGreater(c["saves_async2"] + c["async2_failed_by_kill"], 0,
                                   f"{run['mode']}: the torch 2.x trainer saved nothing")
        shutil.rmtree(out, ignore_errors=True)   # kept when anything failed


class JournalTraceCheck(unittest.TestCase):
    """The soak's check of the journal's trace finds what it is there to find."""

    def check(self, text):
        sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
        from soaklib.util import journal_trace_check
        with tempfile.NamedTemporaryFile("w", delete=False) as f:
            f.write(text)
        try:
            return journal_trace_check(f.name)
        finally:
            os.unlink(f.name)

    def test_a_clean_history_passes(self):
        counts, bad = self.check(
            "start 1\ndone 1 publish 1 a\ndone 2 mkdir 1 d\n"
            "discard 3 publish b\nstart 2\ndone 1 publish 1 c\ndone 2 rename 1 e\n"
            "resume 3 unlink f\nstart 3\ndone 3 unlink 1 f\ndone 4 publish 1 g\ndone 5 pub")
        self.assertEqual(bad, [])
        self.assertEqual(counts, {"runs": 3, "done": 6, "resumed": 1, "discarded": 1})

    def test_an_entry_done_twice_or_done_then_recovered_fails(self):
        _, bad = self.check("start 1\ndone 1 publish 1 a\ndone 1 publish 1 a\n")
        self.assertEqual(len(bad), 1, bad)
        # Dropped, then handed on under its number (not applied twice): no failure.
        counts, bad = self.check("start 1\ndone 2 publish 0 a\ndone 2 unlink 1 b\n")
        self.assertEqual(bad, [])
        self.assertEqual(counts["renumbered"], 1)
        _, bad = self.check("start 1\ndone 7 publish 1 a\nresume 7 publish a\nstart 2\n")
        self.assertEqual(len(bad), 1, bad)
        _, bad = self.check("start 1\ndone 7 publish 0 a\ndiscard 7 publish a\nstart 2\n")
        self.assertEqual(len(bad), 1, bad)


class DaemonOptions(unittest.TestCase):
    """The soak runs an older daemon too (3759c3f, before the fault layer and the journal
    trace): it finds which options the binary takes, hidden ones included."""

    def test_the_daemons_hidden_options_are_found_and_no_others(self):
        sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
        from soaklib.util import daemon_options, harness
        names = ["--journal-trace", "--fault-inject", "--durability", "--no-such-option",
                 "--journal"]
        self.assertEqual(daemon_options(harness.CKPTFS, names),
                         {"--journal-trace", "--fault-inject", "--durability"})
        self.assertEqual(daemon_options("/nonexistent/ckptfs", names), set())



class AsyncTrainerChecks(unittest.TestCase):
    """The strict checks of the torch 2.x async_save trainer (soaklib/torch2.py) from the
    backing store: a save whose future returned and is not committed fails, as does a tracker
    behind the one written, or an `rm -r` that returned and is still there; a save begun
    again after it returned, or a removed one saved again, is judged by its last step."""

    def run_checks(self, ops, files, held=0):
        sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
        from soaklib.torch2 import PARENT, Torch2
        import threading
        backing = tempfile.mkdtemp(prefix="ckptfs-async2-check-")
        self.addCleanup(shutil.rmtree, backing, True)
        for rel, text in files.items():
            p = os.path.join(backing, PARENT, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write(text)
        run = Torch2()
        run.backing, run.lock, run.inc = backing, threading.RLock(), 1
        run.torch2_root = "/"
        run.async2_ops = [dict(op=op, iter=n) for op, n in ops]
        run.async2_max_tracker = 0
        run.counts = {"rmtree_held_at_check": 0}
        run.failures = []
        run.fail = lambda what, detail="": run.failures.append(what)
        run.poll_async2 = lambda: None
        run.deletions_held = lambda: held
        run.async2_cheap_checks("test", strict=True)
        return run.failures

    def test_what_returned_must_be_on_the_backing_store(self):
        md = "iter_{:07d}/.metadata"
        ops = [("save_begin", 1), ("saved", 1), ("tracker", 1), ("save_begin", 2),
               ("saved", 2), ("tracker", 2), ("rmtree_done", 1), ("save_begin", 3)]
        good = {md.format(2): "m", "latest_checkpointed_iteration.txt": "2"}
        self.assertEqual(self.run_checks(ops, good), [])
        failures = self.run_checks(ops, {"latest_checkpointed_iteration.txt": "2"})
        self.assertEqual(len(failures), 2, failures)   # no .metadata for 2, named by tracker
        self.assertIn("is not committed", failures[1])
        behind = {md.format(1): "m", md.format(2): "m",
                  "latest_checkpointed_iteration.txt": "1"}
        failures = self.run_checks(ops, behind)
        self.assertEqual(len(failures), 2, failures)   # tracker behind, rm -r not done
        self.assertIn("tracker write returned", failures[0])
        self.assertIn("rm -r returned", failures[1])
        self.assertEqual(len(self.run_checks(ops, behind, held=1)), 1, "a held rm -r is excused")
        # Saved again after its removal (a restarted trainer from an older tracker): its last
        # step is a save begun, not returned.
        again = ops + [("save_begin", 1)]
        self.assertEqual(self.run_checks(again, {md.format(2): "m", md.format(1): "",
                                                 "latest_checkpointed_iteration.txt": "2"}), [])


if __name__ == "__main__":
    unittest.main()
