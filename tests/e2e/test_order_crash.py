"""Crash consistency of a Megatron-style checkpoint loop through a mount (G4, G5).

A 4-rank gloo job (dcp_tool train) loops: save checkpoint N with DCP into
MNT/iter_N, write MNT/latest_checkpointed_iteration.txt naming N (plain
open/write/close, as Megatron does), then shutil.rmtree every iter_K with
K <= N-2. Rank 0 logs each step, fsynced, to an op log outside the mount.

Each round SIGKILLs the daemon at a random moment, just after the application
finished a step (a new op log line), then checks the backing
directory directly, without ckptfs:
  * the tracker never names an uncommitted checkpoint: iter_T has .metadata
    and loads with the expected values (seed T);
  * every directory with a .metadata loads with the expected values, except
    one whose rmtree the application had already begun (a partly deleted
    checkpoint is a state the application passed through);
  * a deletion is never visible before the tracker written ahead of it
    (iter_K incomplete or gone => tracker >= K+2, hence K+2 committed);
  * a checkpoint /.ckptfs/checkpoints called committed before the kill is
    still complete and loadable unless the application had begun deleting it;
  * the tracker never goes backwards between rounds.
Then it restarts the daemon on the same backing and state directories and
checks that recovery removed every .ckptfs-tmp.* file, left the tracker and
every committed checkpoint byte-identical, and that the mount shows the same
tracker. The next round resumes training from the tracker, as a job would.

The same runs in strict mode, where in addition every step the application
had finished before the kill (its op log line is written after the call
returned) must be on the backing store: the tracker it wrote or a later one,
the checkpoints it saved and not deleted, none of the directories it removed.

CKPTFS_CRASH_ROUNDS (default 3) sets the number of kills per mode,
CKPTFS_CRASH_MB (default 16) the checkpoint size, and CKPTFS_CRASH_SEED replays
the random kill moments of a failed run (the seed is printed).
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import dcp_tool
from harness import Mount

ROUNDS = int(os.environ.get("CKPTFS_CRASH_ROUNDS", "3"))
SEED = int(os.environ.get("CKPTFS_CRASH_SEED", str(random.randrange(1 << 30))))
RANKS = 4
MB = int(os.environ.get("CKPTFS_CRASH_MB", "16"))
KEEP = 2
TRACKER = dcp_tool.TRACKER
TMP_MARK = ".ckptfs-tmp."


def read_ops(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def tmp_files(root):
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, files in os.walk(root) for n in files + dirs if TMP_MARK in n)


def iter_dirs(backing):
    return sorted(int(d[5:]) for d in os.listdir(backing)
                  if d.startswith("iter_") and d[5:].isdigit())


def read_tracker(parent):
    """None when absent; '' when empty (the state between open(O_TRUNC) and write)."""
    try:
        with open(os.path.join(parent, TRACKER)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


class OrderCrash(unittest.TestCase):
    def setUp(self):
        print(f"\nCKPTFS_CRASH_SEED={SEED} CKPTFS_CRASH_ROUNDS={ROUNDS}", file=sys.stderr)
        self.rng = random.Random(SEED)
        self.root = tempfile.mkdtemp(prefix="ckptfs-crash-")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        self.backing = os.path.join(self.root, "backing")
        self.state = os.path.join(self.root, "state")
        self.oplog = os.path.join(self.root, "ops.jsonl")
        # The files a complete checkpoint holds: train uses single_file_per_rank=True.
        self.ckpt_files = {f"__{r}_0.distcp" for r in range(RANKS)} | {".metadata"}
        self.mount = None
        self.writer = None
        self.addCleanup(self.stop_all)

    def stop_all(self):
        self.stop_writer()
        if self.mount is not None:
            self.mount.stop()

    def start_mount(self, n):
        m = Mount(args=["--durability", self.durability], root=self.root, backing=self.backing,
                  state=self.state)
        m.log = os.path.join(self.root, f"ckptfs.{n}.log")
        self.mount = m
        return m.start()

    def start_writer(self, start):
        with open(os.path.join(self.root, "writer.err"), "ab") as err:
            self.writer = subprocess.Popen(
                [sys.executable, dcp_tool.__file__, "train", "--parent", self.mount.mnt,
                 "--ranks", str(RANKS), "--mb", str(MB), "--start", str(start),
                 "--keep", str(KEEP), "--oplog", self.oplog, "--timeout", "900"],
                stdout=subprocess.DEVNULL, stderr=err, env=dcp_tool.child_env())

    def stop_writer(self):
        w, self.writer = self.writer, None
        if w is None:
            return
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)   # the CLI kills its ranks by PID on SIGTERM
            try:
                w.wait(timeout=60)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()

    def complete(self, k):
        d = dcp_tool.iter_dir(self.backing, k)
        return os.path.isdir(d) and self.ckpt_files <= set(os.listdir(d))

    def verify_loads(self, k, why):
        try:
            dcp_tool.load(dcp_tool.iter_dir(self.backing, k), 1, "own", k, timeout=300)
        except dcp_tool.DcpToolError as e:
            self.fail(f"iter_{k} ({why}) does not load from the backing dir: {e}")

    def check_backing(self, ops, all_ops, carried, committed_before_kill, context):
        """The prefix-consistency checks on the backing dir after a crash.

        ops: this round's op log; all_ops: every round's; carried: checkpoints whose deletion
        was already visible at an earlier crash (the application deletes them again later).
        Returns (tracker value or None, checkpoints whose deletion is visible now).
        """
        deleting = {o["iter"] for o in ops if o["op"] == "rmtree_begin"} | carried
        ever_deleted = {o["iter"] for o in all_ops if o["op"] == "rmtree_begin"} | carried
        tracker = read_tracker(self.backing)
        msg = f"[{context}] backing={sorted(os.listdir(self.backing))} tracker={tracker!r}"
        loaded = set()

        def verify_loads(k, why):
            if k not in loaded:
                loaded.add(k)
                self.verify_loads(k, why)

        t = None
        if tracker:    # '' is the state between the tracker's open(O_TRUNC) and its write
            t = int(tracker)
            self.assertTrue(os.path.exists(os.path.join(dcp_tool.iter_dir(self.backing, t),
                                                        ".metadata")),
                            f"{msg}: the tracker names iter_{t}, which has no .metadata")
            verify_loads(t, "named by the tracker")
        for k in iter_dirs(self.backing):
            d = dcp_tool.iter_dir(self.backing, k)
            if k not in deleting and os.path.exists(os.path.join(d, ".metadata")):
                self.assertTrue(self.complete(k), f"{msg}: iter_{k} has .metadata but lacks "
                                f"{sorted(self.ckpt_files - set(os.listdir(d)))}")
                verify_loads(k, "has .metadata")
        visible = set()
        for k in sorted(deleting):
            if self.complete(k):
                verify_loads(k, "deletion begun by the application but not yet visible")
                continue
            visible.add(k)
            if tracker != "":   # an empty tracker hides which one came before it
                self.assertIsNotNone(t, f"{msg}: iter_{k} is (partly) deleted but no tracker")
                self.assertGreaterEqual(t, k + KEEP, f"{msg}: iter_{k} is (partly) deleted "
                                        f"before the tracker naming {k + KEEP} was published")
        for k in sorted(committed_before_kill - ever_deleted):
            self.assertTrue(self.complete(k), f"{msg}: iter_{k} was committed before the kill "
                            "and the application never deleted it, but it is incomplete")
            verify_loads(k, "committed before the kill")
        if self.durability == "strict":
            # Every op the application finished (and then logged) was published before it
            # returned, so the backing store is at least that far along.
            trackers = [o["iter"] for o in ops if o["op"] == "tracker"]
            if trackers and tracker != "":   # '': the next tracker write had begun
                self.assertIsNotNone(t, f"{msg}: strict, tracker {trackers[-1]} returned")
                self.assertGreaterEqual(t, trackers[-1], f"{msg}: strict, the tracker naming "
                                        f"{trackers[-1]} had returned")
            for o in ops:
                if o["op"] == "rmtree_done":
                    self.assertNotIn(o["iter"], iter_dirs(self.backing),
                                     f"{msg}: strict, rmtree of iter_{o['iter']} had returned")
                elif o["op"] == "saved" and o["iter"] not in deleting:
                    self.assertTrue(self.complete(o["iter"]), f"{msg}: strict, the save of "
                                    f"iter_{o['iter']} had returned")
                    verify_loads(o["iter"], "saved in strict mode")
        return t, {k for k in visible if k in iter_dirs(self.backing)}

    def committed_tree(self):
        """{path: sha256} of the tracker and of every complete checkpoint with .metadata."""
        tree = {}
        if os.path.exists(os.path.join(self.backing, TRACKER)):
            tree[TRACKER] = read_tracker(self.backing)
        for k in iter_dirs(self.backing):
            d = dcp_tool.iter_dir(self.backing, k)
            if self.complete(k):
                for name, h in dcp_tool.sha256_tree(d).items():
                    if TMP_MARK not in name:
                        tree[os.path.join(os.path.basename(d), name)] = h
        return tree

    def wait_recovered(self, m, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not tmp_files(self.backing) and m.stats().get("journal_pending", 0) == 0:
                return
            time.sleep(0.2)
        self.fail(f"after restart: .ckptfs-tmp files remain {tmp_files(self.backing)[:10]}, "
                  f"stats={m.stats()}")

    def test_async_sigkill_during_checkpoint_loop_keeps_prefix_consistency(self):
        self.run_rounds("async")

    def test_strict_sigkill_loses_nothing_that_returned(self):
        self.run_rounds("strict")

    def run_rounds(self, durability):
        self.durability = durability
        last_tracker = None
        snapshot = None
        carried = set()
        for rnd in range(ROUNDS + 1):
            m = self.start_mount(rnd)
            try:
                if rnd > 0:
                    self.wait_recovered(m)
                    self.assertEqual(self.committed_tree(), snapshot,
                                     "restart recovery changed the tracker or a committed "
                                     "checkpoint")
                    self.assertEqual(read_tracker(m.mnt), read_tracker(self.backing),
                                     "tracker through the mount after restart")
                if rnd == ROUNDS:
                    self.assertEqual(m.unmount(), 0, "clean unmount after the last restart")
                    self.assertEqual(tmp_files(self.backing), [])
                    self.assertEqual(self.committed_tree(), snapshot)
                    return

                n_ops = len(read_ops(self.oplog))
                start = (last_tracker or 0) + 1
                self.start_writer(start)
                deadline = time.time() + 120
                while not any(o["op"] == "save_begin" for o in read_ops(self.oplog)[n_ops:]):
                    self.assertIsNone(self.writer.poll(), "the writer exited before saving")
                    self.assertLess(time.time(), deadline, "the writer never started saving")
                    time.sleep(0.05)
                time.sleep(self.rng.uniform(0.0, 4.0))
                committed = {int(c["path"][5:]) for c in m.checkpoints()
                             if c["state"] == "committed" and c["path"].startswith("iter_")
                             and c["path"][5:].isdigit()}
                # Kill right after the application finishes a step, when the most is in flight.
                seen = len(read_ops(self.oplog))
                deadline = time.time() + 30
                while len(read_ops(self.oplog)) == seen and time.time() < deadline:
                    time.sleep(0.002)
                m.kill(signal.SIGKILL)
                self.stop_writer()
                ops = read_ops(self.oplog)
                done = [o for o in ops[n_ops:] if o["op"] == "saved"]
                print(f"round {rnd}: started at {start}, app saved {len(done)} checkpoints "
                      f"(last {done[-1]['iter'] if done else None}), committed before kill "
                      f"{sorted(committed)}, backing {sorted(os.listdir(self.backing))}",
                      file=sys.stderr)

                t, carried = self.check_backing(ops[n_ops:], ops, carried, committed,
                                                f"round {rnd} after SIGKILL")
                if last_tracker is not None:
                    self.assertIsNotNone(t, "the tracker disappeared")
                    self.assertGreaterEqual(t, last_tracker, "the tracker went backwards")
                if t is not None:
                    last_tracker = t
                snapshot = self.committed_tree()
            except BaseException as e:
                raise AssertionError(f"{e}\n--- ckptfs log tail (round {rnd}) ---\n"
                                     f"{m.log_text()}") from e


if __name__ == "__main__":
    unittest.main()
