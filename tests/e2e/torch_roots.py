"""Running real torch 2.x programs in the cached Debian roots over ckptfs mounts (issue 22):
the roots come from scripts/torch_root.sh (trixie = torch 2.6, sid = the newest); the
daemons run on the host, mounted inside the root; the programs run in the root (chroot).
Used by test_torch2_clients.py and test_megatron_dcp.py."""
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))
from torch_dcp_suite import RootMounts, root_tmpdir  # noqa: E402  (proc, sys, dev, /dev/shm)

TORCH_ROOT = os.path.join(REPO, "scripts", "torch_root.sh")


def build_root(test, suite):
    """The root's path; skips `test` (saying why) when it cannot be built."""
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


def enter_root(test, suite):
    """Builds (once) and locks the root, mounts proc/sys/dev in it for the test's duration;
    returns its path. One user of a root's mounts at a time (the lock torch_dcp_suite.py
    takes too)."""
    root = build_root(test, suite)
    lock = open(root + ".use.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    test.addCleanup(lock.close)
    rm = RootMounts(root).__enter__()
    test.addCleanup(rm.undo)
    return root


def mount_in_root(test, root, mode, name, args=()):
    """A started harness.Mount (--durability mode) whose mount point is /mnt/NAME-MODE in the
    root; backing and state dirs on the host. Cleanup unmounts it and removes the point."""
    work = tempfile.mkdtemp(prefix=f"ckptfs-e2e-{name}-{mode}-", dir="/var/tmp")
    m = harness.Mount(["--durability", mode, *args], root=work)
    in_root = f"/mnt/{name}-{mode}"
    m.mnt = os.path.join(root, in_root.lstrip("/"))
    os.makedirs(m.mnt, exist_ok=True)
    test.assertFalse(harness.is_mounted(m.mnt), f"{m.mnt} is mounted (a leftover?)")
    test.addCleanup(os.rmdir, m.mnt)
    test.addCleanup(m.cleanup)
    test.start_mount(m)
    return m, in_root


def program_dir(test, root, *files):
    """A fresh directory in the root holding copies of `files` (removed at cleanup); returns
    (host path, path in the root)."""
    d = tempfile.mkdtemp(prefix="ckptfs-prog-", dir=os.path.join(root, "var/tmp"))
    test.addCleanup(shutil.rmtree, d, True)
    for f in files:
        if os.path.isdir(f):
            shutil.copytree(f, os.path.join(d, os.path.basename(f)))
        else:
            shutil.copy(f, d)
    return d, "/" + os.path.relpath(d, root)


def run_in_root(test, root, argv, env=(), timeout=600):
    """Runs argv in the root (chroot, a clean environment plus `env`) in its own process
    group, which is killed afterwards whatever happened (helpers a program leaves behind,
    such as checkpoint worker processes, go with it), with a TMPDIR of its own that is
    removed afterwards; returns (output, seconds). Fails the
    test on a nonzero exit or a timeout."""
    with root_tmpdir(root) as tmp:
        cmd = ["chroot", root, "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root",
               "LANG=C.UTF-8", "PYTHONWARNINGS=ignore", f"TMPDIR={tmp}",
               *[f"{k}={v}" for k, v in env], *argv]
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        timed_out = False
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the program's group only: its leftovers
            except ProcessLookupError:
                pass
    wall = time.monotonic() - t0
    test.assertFalse(timed_out, f"{argv} ran over {timeout} s:\n{out[-6000:]}")
    test.assertEqual(p.returncode, 0, f"{argv} failed:\n{out[-8000:]}")
    return out, wall


def tree_digests(top):
    """relative path -> sha256 of every regular file under top (the control tree excluded)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d != harness.CONTROL]
        for n in filenames:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, top)] = harness.sha256_file(p)
    return out


def assert_committed(test, m, ckpts, what=""):
    """Every checkpoint dir in ckpts (relative to the mount) is published (ckptfs-admin
    wait) and `committed` in /.ckptfs/checkpoints and in `ckptfs-admin checkpoints`."""
    for c in ckpts:
        test.assertEqual(m.wait(os.path.join(m.mnt, c), timeout=120), 0,
                         f"{what}: ckptfs-admin wait {c}\n{m.log_text()[-3000:]}")
    states = {c["path"].strip("/"): c["state"] for c in m.checkpoints()}
    out = subprocess.run([harness.ADMIN, "checkpoints", m.mnt], capture_output=True, text=True)
    test.assertEqual(out.returncode, 0, out.stderr)
    for c in ckpts:
        test.assertEqual(states.get(c), "committed", f"{what}: {c}: {states}")
        line = [ln for ln in out.stdout.splitlines() if c in ln.split()]
        test.assertTrue(line and "committed" in line[0],
                        f"{what}: {c} in ckptfs-admin checkpoints:\n{out.stdout}")


def drain_and_compare(test, m, what=""):
    """Reads every file through the mount, unmounts cleanly (exit 0, no temporary names
    left) and checks the backing store holds the same bytes; returns the digests."""
    seen = tree_digests(m.mnt)
    rc = m.unmount(timeout=180)
    test.assertEqual(rc, 0, f"{what}: daemon exit code after unmount\n{m.log_text()}")
    test.assertEqual(harness.tmp_names(m.backing), [], f"{what}: temporary names left")
    test.assertEqual(tree_digests(m.backing), seen, f"{what}: backing store differs")
    return seen
