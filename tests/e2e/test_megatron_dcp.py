"""Megatron-LM's own dist_checkpointing through ckptfs (issue 22).

megatron/core of a pinned Megatron-LM release (scripts/megatron_src.sh: core_v0.16.1 from
its GitHub release tarball, or the checkout MEGATRON_SRC names) runs unmodified in the sid
root (the newest torch, scripts/torch_root.sh) on 4 gloo ranks on the CPU; the few
torch.cuda calls inside it are answered for the CPU by megatron_cpu_shim/sitecustomize.py.
megatron_clients.py, under an async and a strict mount at once: a sync torch_dist save
through FullyParallelSaveStrategyWrapper (FileSystemWriterAsync, 2 writer threads per
rank), two async saves run by the persistent checkpoint worker (AsyncCallsQueue(persistent=
True)), Megatron's tracker latest_checkpointed_iteration.txt written after each (in the
async request's finalize function, as Megatron's training does), then loads through
FullyParallelLoadStrategyWrapper, as saved and resharded (other TP splits), checked exactly.

On the host: every iteration directory is committed (/.ckptfs/checkpoints and ckptfs-admin
checkpoints); while the program runs, a watcher reads the tracker on each backing store
and every value it ever sees must name an iteration whose .metadata, metadata.json and
common.pt are already there (G4: the tracker lands after its checkpoint commits); after a
clean unmount the backing store equals the mount and the tracker says 30.

Skips, saying why: not root, no debootstrap, the root cannot be built, or the Megatron
source can neither be found nor downloaded. About 2.5 min with the root and source cached
(torch and Megatron imports in 4 ranks and 4 worker processes dominate).
"""
import json
import os
import subprocess
import sys
import threading
import unittest

import harness
import torch_roots as tr

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "megatron_clients.py")
SHIM = os.path.join(HERE, "megatron_cpu_shim")
SRC_SCRIPT = os.path.join(tr.REPO, "scripts", "megatron_src.sh")
MODES = ("async", "strict")
TRACKER = "latest_checkpointed_iteration.txt"
ITERS = (10, 20, 30)


def megatron_src(test):
    r = subprocess.run([SRC_SCRIPT], capture_output=True, text=True, timeout=900)
    if r.returncode == 2:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        test.skipTest(f"Megatron-LM source not available (no MEGATRON_SRC, no download): {last}")
    test.assertEqual(r.returncode, 0, r.stderr)
    return r.stdout.strip().splitlines()[-1]


class TrackerWatcher(threading.Thread):
    """Reads BACKING/megatron/<tracker> until stopped; records every value seen and each
    one naming an iteration that was not complete on the backing store at that moment."""

    def __init__(self, backing):
        super().__init__(daemon=True)
        self.root = os.path.join(backing, "run", "megatron")
        self.stop_ev = threading.Event()
        self.seen = []
        self.violations = []

    def run(self):
        while not self.stop_ev.wait(0.01):
            try:
                with open(os.path.join(self.root, TRACKER)) as f:
                    v = f.read().strip()
            except FileNotFoundError:
                continue
            if not self.seen or self.seen[-1] != v:
                self.seen.append(v)
            d = os.path.join(self.root, f"iter_{int(v):07d}") if v.isdigit() else None
            missing = [n for n in (".metadata", "metadata.json", "common.pt")
                       if d is None or not os.path.exists(os.path.join(d, n))]
            if missing:
                self.violations.append(f"tracker says {v!r} but {missing} not on the backing "
                                       f"store")

    def stop(self):
        self.stop_ev.set()
        self.join()


class MegatronDcp(harness.MountedTest):
    WATCHDOG_S = 900

    def test_megatron_core_saves_and_loads_through_both_durability_modes(self):
        src = megatron_src(self)
        root = tr.enter_root(self, "sid")
        daemons = {mode: tr.mount_in_root(self, root, mode, "ckptfs-megatron") for mode in MODES}
        prog, prog_in_root = tr.program_dir(self, root, DRIVER, SHIM,
                                            os.path.join(src, "megatron"))
        bases = {mode: f"{mir}/run" for mode, (_, mir) in daemons.items()}
        watchers = {mode: TrackerWatcher(m.backing) for mode, (m, _) in daemons.items()}
        for w in watchers.values():
            w.start()
            self.addCleanup(w.stop_ev.set)
        argv = ["python3", f"{prog_in_root}/megatron_clients.py",
                "--out", f"{prog_in_root}/results.json"]
        for mode in MODES:
            argv += ["--base", bases[mode]]
        env = [("CKPTFS_MEGATRON_CPU_SHIM", "1"),
               ("PYTHONPATH", f"{prog_in_root}/megatron_cpu_shim:{prog_in_root}")]
        out, wall = tr.run_in_root(self, root, argv, env=env, timeout=600)
        with open(os.path.join(prog, "results.json")) as f:
            res = json.load(f)
        sys.stderr.write(f"\nmegatron-core {res['megatron_core']}, torch {res['torch']} "
                         f"(Python {res['python']}): {wall:.0f} s\n")
        for mode in MODES:
            m, _ = daemons[mode]
            rec = res["bases"][bases[mode]]
            sys.stderr.write(f"  {mode}: {rec['times']}\n")
            self.assertEqual(rec["tracker"], str(ITERS[-1]))
            ckpts = [f"run/megatron/iter_{it:07d}" for it in ITERS]
            self.assertEqual(["run/" + c for c in rec["checkpoints"]], ckpts)
            for c, names in rec["files"].items():
                self.assertIn(".metadata", names, c)
                self.assertIn("metadata.json", names, c)
            tr.assert_committed(self, m, ckpts, mode)
            self.assertEqual(m.wait(os.path.join(m.mnt, "run", "megatron", TRACKER)), 0)
        for mode in MODES:
            m, _ = daemons[mode]
            seen = tr.drain_and_compare(self, m, mode)
            self.assertIn(f"run/megatron/{TRACKER}", seen)
            w = watchers[mode]
            w.stop()
            with open(os.path.join(m.backing, "run", "megatron", TRACKER)) as f:
                self.assertEqual(f.read().strip(), str(ITERS[-1]))
            self.assertEqual(w.violations[:5], [], f"{mode}: tracker values seen {w.seen}")
            sys.stderr.write(f"  {mode}: tracker values seen on the backing store: {w.seen}\n")


if __name__ == "__main__":
    unittest.main()
