"""The clients of today (issue 22): real torch 2.x programs over real ckptfs mounts.

For each cached Debian root (scripts/torch_root.sh: trixie = torch 2.6, sid = the newest, 2.14
at the time of writing), two daemons are started on the host, one --durability async and one
--durability strict, each mounted inside the root; then torch2_clients.py runs in the root
(chroot), 4 gloo ranks, and does under each mount: dcp.save of DTensor state dicts and a
second save over the same directory, dcp.async_save with the thread checkpointer and with the
process checkpointer, resharded loads (other placements, a 2x2 mesh), a Hugging Face save
and load (HuggingFaceStorageWriter with consolidation, HuggingFaceStorageReader), a
collective-less save (use_collectives=False: __{rank}.metadata per rank, no .metadata),
no_dist saves (every rank alone) and dcp_to_torch_save. Every tensor loaded is checked
exactly in the ranks. What a torch lacks is skipped by the program and must be exactly
what that torch is known to lack (EXPECTED_SKIPS), so that a new failure cannot hide as a
skip.

On the host, every checkpoint directory the program reports must then be `committed` in
/.ckptfs/checkpoints and in `ckptfs-admin checkpoints`; every file read through the mount
must equal the backing store's copy after a clean unmount (exit 0, no temporary names
left).

Skips, saying why, when not root, without debootstrap, or when a root cannot be built (the
Debian archive is unreachable). About 1 min per root once the roots are cached (torch
imports dominate), plus a few minutes to build a root on a fresh machine.
"""
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import harness
from harness import ADMIN

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))
from torch_dcp_suite import RootMounts  # noqa: E402  (proc, sys, dev, /dev/shm in a root)

TORCH_ROOT = os.path.join(REPO, "scripts", "torch_root.sh")
DRIVER = os.path.join(HERE, "torch2_clients.py")
MODES = ("async", "strict")
# What each torch lacks (the program skips these with a reason): nothing else may skip.
EXPECTED_SKIPS = {
    "trixie": {"async_process", "hf", "per_rank"},  # torch 2.6
    "sid": set(),
}
ALL_CASES = {"sync", "async_thread", "async_process", "reshard", "hf", "per_rank", "no_dist",
             "to_torch_save"}


def build_root(test, suite):
    if os.geteuid() != 0:
        test.skipTest("chroot and mount need root")
    if shutil.which("debootstrap") is None:
        test.skipTest("debootstrap is not installed (scripts/setup.sh)")
    p = subprocess.Popen([TORCH_ROOT, suite], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        out, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        p.terminate()  # its EXIT trap undoes the mounts it made
        _, err = p.communicate(timeout=120)
        test.fail(f"torch_root.sh {suite} took over 600 s:\n{err[-3000:]}")
    if p.returncode == 2:
        test.skipTest(f"cannot build the torch 2.x root ({suite}): {err.strip()[-300:]}")
    test.assertEqual(p.returncode, 0, f"torch_root.sh {suite}:\n{err[-3000:]}")
    return out.strip().splitlines()[-1]


def lock_root(test, root):
    """One user of a root's proc/sys/dev mounts at a time (shared with torch_dcp_suite.py)."""
    f = open(root + ".use.lock", "w")
    fcntl.flock(f, fcntl.LOCK_EX)
    test.addCleanup(f.close)


def tree_digests(top):
    """relative path -> sha256 of every regular file under top (the control tree excluded)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d != harness.CONTROL]
        for n in filenames:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, top)] = harness.sha256_file(p)
    return out


class Torch2Clients(harness.MountedTest):
    WATCHDOG_S = 900

    def run_clients(self, suite):
        root = build_root(self, suite)
        lock_root(self, root)
        mounts = self.enterContext(RootMounts(root)) if hasattr(self, "enterContext") else None
        if mounts is None:  # Python < 3.11
            rm = RootMounts(root).__enter__()
            self.addCleanup(rm.undo)
        work = tempfile.mkdtemp(prefix=f"ckptfs-e2e-clients-{suite}-", dir="/var/tmp")
        self.addCleanup(shutil.rmtree, work, True)
        daemons = {}
        for mode in MODES:
            m = harness.Mount(["--durability", mode], root=os.path.join(work, mode))
            mnt_in_root = f"/mnt/ckptfs-clients-{mode}"
            m.mnt = os.path.join(root, mnt_in_root.lstrip("/"))
            os.makedirs(m.mnt, exist_ok=True)
            self.assertFalse(harness.is_mounted(m.mnt), f"{m.mnt} is mounted (a leftover?)")
            self.addCleanup(os.rmdir, m.mnt)
            self.addCleanup(m.cleanup)
            self.start_mount(m, self.WATCHDOG_S)
            daemons[mode] = (m, mnt_in_root)
        # The program runs from a directory of the root, removed afterwards.
        prog = tempfile.mkdtemp(prefix="ckptfs-clients-", dir=os.path.join(root, "var/tmp"))
        self.addCleanup(shutil.rmtree, prog, True)
        shutil.copy(DRIVER, prog)
        prog_in_root = "/" + os.path.relpath(prog, root)
        bases = {mode: f"{mir}/run" for mode, (_, mir) in daemons.items()}
        cmd = ["chroot", root, "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root",
               "LANG=C.UTF-8", "PYTHONWARNINGS=ignore", "python3",
               f"{prog_in_root}/torch2_clients.py", "--out", f"{prog_in_root}/results.json"]
        for mode in MODES:
            cmd += ["--base", bases[mode]]
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            out, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)  # the program's own process group: ranks and their helpers
            out, _ = p.communicate()
            self.fail(f"torch2_clients.py ran over 600 s:\n{out[-6000:]}")
        wall = time.monotonic() - t0
        self.assertEqual(p.returncode, 0, f"torch2_clients.py failed:\n{out[-8000:]}")
        import json
        with open(os.path.join(prog, "results.json")) as f:
            res = json.load(f)
        sys.stderr.write(f"\n{suite}: torch {res['torch']} (Python {res['python']}), "
                         f"{wall:.0f} s\n")
        for mode in MODES:
            m, _ = daemons[mode]
            rec = res["bases"][bases[mode]]
            sys.stderr.write(f"  {mode}: cases {rec['cases']} skipped {rec['skipped']}\n")
            self.assertEqual(set(rec["skipped"]), EXPECTED_SKIPS[suite], rec["skipped"])
            self.assertEqual(set(rec["cases"]) | set(rec["skipped"]), ALL_CASES)
            self.assert_committed(m, ["run/" + c for c in rec["checkpoints"]], mode)
        # Every byte read through the mount is on the backing store after a clean unmount.
        for mode in MODES:
            m, _ = daemons[mode]
            seen = tree_digests(m.mnt)
            self.assertIn("run/sync/.metadata", seen)
            rc = m.unmount(timeout=180)
            self.assertEqual(rc, 0, f"{mode}: daemon exit code after unmount\n{m.log_text()}")
            self.assertEqual(harness.tmp_names(m.backing), [], f"{mode}: temporary names left")
            self.assertEqual(tree_digests(m.backing), seen, f"{mode}: backing store differs")

    def assert_committed(self, m, ckpts, mode):
        for c in ckpts:
            self.assertEqual(m.wait(os.path.join(m.mnt, c), timeout=120), 0,
                             f"{mode}: ckptfs-admin wait {c}\n{m.log_text()[-3000:]}")
        states = {c["path"].strip("/"): c["state"] for c in m.checkpoints()}
        out = subprocess.run([ADMIN, "checkpoints", m.mnt], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        for c in ckpts:
            self.assertEqual(states.get(c), "committed", f"{mode}: {c}: {states}")
            line = [ln for ln in out.stdout.splitlines() if c in ln.split()]
            self.assertTrue(line and "committed" in line[0],
                            f"{mode}: {c} in ckptfs-admin checkpoints:\n{out.stdout}")

    def test_torch26_trixie(self):
        self.run_clients("trixie")

    def test_torch_newest_sid(self):
        self.run_clients("sid")


if __name__ == "__main__":
    unittest.main()
