"""Shared harness for ckptfs end-to-end tests.

Mount() starts a real ckptfs daemon in the foreground (so the test owns its PID)
over a fresh backing directory, waits until the mount answers, and on exit always
unmounts and kills exactly that PID, even when the test failed. When the test process
itself is killed (ctest's TIMEOUT), the guardian run_e2e_file starts (reaper.py) does
both for what was registered.
"""
import faulthandler
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import reaper

BIN_DIR = os.environ.get(
    "CKPTFS_BIN_DIR",
    os.path.join(os.path.dirname(__file__), "..", "..", "build", "bin"))
CKPTFS = os.path.join(BIN_DIR, "ckptfs")
ADMIN = os.path.join(BIN_DIR, "ckptfs-admin")
HERE = os.path.dirname(os.path.abspath(__file__))
# CKPTFS_E2E_PLAIN=1: classes with PLAIN_OK run against a plain directory (PlainMount)
# instead of a mount; it only checks the tests' own logic.
PLAIN = os.environ.get("CKPTFS_E2E_PLAIN") == "1"
TMP_PREFIX = ".ckptfs-tmp."
CONTROL = ".ckptfs"


def is_mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == path:
                return True
    return False


def unmount(path):
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", path], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Mount:
    """A ckptfs mount for one test. Use as a context manager.

    root: a fresh temporary directory holding backing/, mnt/, state/ and log.
    Extra daemon options go in `args`; `backing` overrides the backing dir.
    """

    def __init__(self, args=(), backing=None, root=None, state=None, staging="256M"):
        self.root = root or tempfile.mkdtemp(prefix="ckptfs-e2e-")
        self.backing = backing or os.path.join(self.root, "backing")
        self.mnt = os.path.join(self.root, "mnt")
        self.state = state or os.path.join(self.root, "state")
        self.log = os.path.join(self.root, "ckptfs.log")
        self.args = list(args)
        self.staging = staging
        self.proc = None
        os.makedirs(self.backing, exist_ok=True)
        os.makedirs(self.mnt, exist_ok=True)

    def start(self, timeout=30):
        cmd = [CKPTFS, "-f", "--staging-mem", self.staging, "--state-dir", self.state,
               "--log-file", self.log, "--log-level", "debug"] + self.args + [
                   self.backing, self.mnt]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        reaper.register_pid(self.proc.pid)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace")
                raise RuntimeError(f"ckptfs exited {self.proc.returncode}: {out}\n{self.log_text()}")
            if is_mounted(self.mnt) and os.path.exists(os.path.join(self.mnt, ".ckptfs", "stats")):
                reaper.register_mount(self.mnt)
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("ckptfs did not mount in time\n" + self.log_text())

    def log_text(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-8000:]
        except OSError:
            return ""

    def wait_log(self, text, timeout=10):
        """The whole log once it holds `text` (the daemon flushes info lines every second),
        or as it is after `timeout` s, for the caller's assertIn to report."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(self.log, errors="replace") as f:
                    whole = f.read()
            except OSError:
                whole = ""
            if text in whole or time.monotonic() > deadline:
                return whole
            time.sleep(0.1)

    def stats(self):
        with open(os.path.join(self.mnt, ".ckptfs", "stats")) as f:
            return json.load(f)

    def checkpoints(self):
        with open(os.path.join(self.mnt, ".ckptfs", "checkpoints")) as f:
            return json.load(f)

    def wait(self, path, timeout=120):
        """ckptfs-admin wait PATH; returns its exit code."""
        return subprocess.run([ADMIN, "wait", path, "--timeout", str(timeout)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode

    def unmount(self, timeout=120):
        """Clean unmount: fusermount3 -u, then wait for the daemon to drain and exit."""
        if self.proc is None:
            return None
        subprocess.run(["fusermount3", "-u", self.mnt], check=False)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._close_pipe()
        self.proc = None
        return rc

    def _close_pipe(self):
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def kill(self, sig=signal.SIGKILL):
        """Kills exactly this daemon (by PID) and removes its mount."""
        self._close_pipe()
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        unmount(self.mnt)

    def stop(self):
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.unmount(timeout=60)
        except Exception:
            pass
        finally:
            self.kill()

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.cleanup()
        return False


class PlainMount:
    """Stand-in for Mount with CKPTFS_E2E_PLAIN=1: the 'mount' is the backing directory
    itself, and waiting or unmounting does nothing."""

    def __init__(self, args=(), backing=None, root=None, state=None, staging="256M"):
        self.root = root or tempfile.mkdtemp(prefix="ckptfs-plain-")
        self.backing = backing or os.path.join(self.root, "backing")
        self.mnt = self.backing
        self.state = state or os.path.join(self.root, "state")
        self.log = os.path.join(self.root, "ckptfs.log")
        self.proc = None
        os.makedirs(self.backing, exist_ok=True)

    def start(self, timeout=30):
        return self

    def log_text(self):
        return ""

    def stats(self):
        return None

    def wait(self, path, timeout=120):
        return 0

    def unmount(self, timeout=120):
        return 0

    def kill(self, sig=None):
        pass

    def stop(self):
        pass

    def cleanup(self):
        shutil.rmtree(self.root, ignore_errors=True)


def make_mount(plain_ok=False, **kw):
    """A Mount, or a PlainMount where CKPTFS_E2E_PLAIN=1 and the caller allows it."""
    return PlainMount(**kw) if PLAIN and plain_ok else Mount(**kw)


def tmp_names(root):
    """Every .ckptfs-tmp.* name under root (relative paths)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            if n.startswith(TMP_PREFIX):
                found.append(os.path.relpath(os.path.join(dirpath, n), root))
    return sorted(found)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(4 << 20)
            if not b:
                return h.hexdigest()
            h.update(b)


def write_file(path, data, fsync=False, step=1 << 20):
    """Writes `data` to `path` (created or truncated) in `step`-sized write() calls."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(data), step):
            os.write(fd, data[off:off + step])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path):
    with open(path, "rb") as f:
        return f.read()


def wait_for(pred, timeout, step=0.05):
    """Polls pred() until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def proc_status_bytes(pid, field):
    """A kB field of /proc/PID/status (VmHWM, VmLck, VmRSS...) in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def errno_of(fn, *args, **kw):
    """Runs fn; returns 0 or the errno of the OSError it raised."""
    try:
        fn(*args, **kw)
        return 0
    except OSError as e:
        return e.errno


def arm_watchdog(test, mount, seconds):
    """A hung FUSE request would block `test` forever: after `seconds`, kill exactly this
    mount's daemon (by PID) so the blocked call fails with ENOTCONN, and dump every thread."""
    proc = mount.proc
    if proc is None:
        return

    def fire():
        sys.stderr.write(f"\nwatchdog: {test.id()} ran over {seconds}s; "
                         f"killing ckptfs pid {proc.pid}\n")
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.write(mount.log_text()[-3000:] + "\n")
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        unmount(mount.mnt)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    test.addCleanup(timer.cancel)


class MountedTest(unittest.TestCase):
    """The base of every test that mounts ckptfs. mount() makes a Mount whose cleanup
    (unmount, kill exactly its PID, remove its directories) is registered at once, so it
    runs before the cleanups registered earlier (a tmpfs under it: LIFO); then, unless
    start=False, starts it and arms the watchdog (arm_watchdog) for WATCHDOG_S seconds.
    A failed test prints the tail of each of its mounts' logs.

    With MOUNT_IN_SETUP, setUp mounts self.m afresh for each test (MOUNT_ARGS, STAGING;
    populate_backing first), and p()/b() build paths in it and in its backing directory;
    wait() and drain() check publication and a clean unmount. PLAIN_OK classes run on a
    PlainMount under CKPTFS_E2E_PLAIN=1."""

    WATCHDOG_S = 300
    MOUNT_IN_SETUP = False
    MOUNT_ARGS = ()
    STAGING = "256M"
    PLAIN_OK = False
    WAIT_S = 120
    DRAIN_S = 180

    def setUp(self):
        if self.MOUNT_IN_SETUP:
            self.m = self.mount(args=self.MOUNT_ARGS, staging=self.STAGING, start=False)
            self.populate_backing(self.m.backing)
            self.start_mount(self.m)

    def populate_backing(self, backing):
        """Hook: files that exist on the backing store before the mount (MOUNT_IN_SETUP)."""

    def mount(self, args=(), start=True, watchdog_s=None, **kw):
        m = make_mount(plain_ok=self.PLAIN_OK, args=list(args), **kw)
        self.addCleanup(m.cleanup)
        if start:
            self.start_mount(m, watchdog_s)
        return m

    def start_mount(self, m, watchdog_s=None):
        """Starts a Mount made with mount(start=False) and arms its watchdog."""
        m.start()
        arm_watchdog(self, m, watchdog_s or self.WATCHDOG_S)
        self.addCleanup(self.dump_log_on_failure, m)
        return m

    def dump_log_on_failure(self, m):
        outcome = getattr(self, "_outcome", None)
        if outcome is not None and not getattr(outcome, "success", True) and \
                not isinstance(m, PlainMount):
            sys.stderr.write(f"\n--- ckptfs log tail ({self.id()}) ---\n"
                             f"{m.log_text()[-5000:]}\n--- end log ---\n")

    def p(self, *parts):
        return os.path.join(self.m.mnt, *parts)

    def b(self, *parts):
        return os.path.join(self.m.backing, *parts)

    def skip_if_plain(self):
        if PLAIN and self.PLAIN_OK:
            self.skipTest("needs a real ckptfs daemon")

    def wait(self, path, timeout=None):
        """ckptfs-admin wait PATH must succeed."""
        if isinstance(self.m, PlainMount):
            return
        timeout = timeout or self.WAIT_S
        r = subprocess.run([ADMIN, "wait", path, "--timeout", str(timeout)],
                           capture_output=True, text=True, timeout=timeout + 30)
        self.assertEqual(r.returncode, 0,
                         f"ckptfs-admin wait {path} -> {r.returncode}\n{r.stdout}{r.stderr}")

    def drain(self):
        """Clean unmount; the daemon must exit 0 having published everything."""
        plain = isinstance(self.m, PlainMount)
        rc = self.m.unmount(timeout=self.DRAIN_S)
        self.assertEqual(rc, 0, f"daemon exit code after unmount\n{self.m.log_text()[-3000:]}")
        if not plain:
            self.assertFalse(is_mounted(self.m.mnt))
            self.assertFalse(os.path.exists(self.b(CONTROL)),
                             ".ckptfs leaked onto the backing store")
        self.assertEqual(tmp_names(self.m.backing), [],
                         "temporary files left on the backing store after drain")


def copy_for_others(test, *paths, prefix="ckptfs-e2e-shared-"):
    """Copies `paths` (programs, helper scripts) into a fresh directory that every uid can
    read and run from, removed at `test`'s cleanup; returns {basename: copied path}.

    Tests that run something as another uid (setpriv) run these copies: the checkout and
    the build tree may sit under a directory only their owner can enter (/root is 0700 on
    Debian), where the other uid gets EACCES before the program even starts."""
    d = tempfile.mkdtemp(prefix=prefix)
    test.addCleanup(shutil.rmtree, d, True)
    os.chmod(d, 0o755)
    blocked = [a for a in _ancestors(d) if os.stat(a).st_mode & 0o001 == 0]
    if blocked:
        test.fail(f"{d}: others cannot enter {blocked[0]}; point TMPDIR at a directory "
                  "every uid can reach")
    out = {}
    for src in paths:
        dst = os.path.join(d, os.path.basename(src))
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o755 if os.access(src, os.X_OK) else 0o644)
        out[os.path.basename(src)] = dst
    return out


def _ancestors(path):
    path = os.path.dirname(os.path.realpath(path))
    while True:
        yield path
        if path == "/":
            return
        path = os.path.dirname(path)


def make_tmpfs(test, mb, prefix):
    """A `mb` MiB tmpfs on a fresh temp dir, unmounted and removed at `test`'s cleanup;
    skips `test` where tmpfs cannot be mounted (not root)."""
    d = tempfile.mkdtemp(prefix=prefix)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        test.skipTest(f"cannot mount a tmpfs (needs root): {r.stderr.strip()}")
    reaper.register_mount(d)
    test.addCleanup(remove_tmpfs, d)
    return d


def remove_tmpfs(d):
    if subprocess.run(["umount", d], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", d], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)


# ctest's SKIP_RETURN_CODE for the e2e files (tests/e2e/CMakeLists.txt): a file none of
# whose cases ran is reported as skipped, not as passed.
SKIP_EXIT = 77


def run_e2e_file(name):
    """Runs the unittest module `name` as `python3 -m unittest -v name` would, and returns
    the exit code for ctest: 1 when anything failed (or nothing was found), SKIP_EXIT when
    every case was skipped (the reasons are printed last), otherwise 0. A guardian
    (reaper.py) undoes what the tests registered if this process is killed first."""
    reaper.start_guardian()
    suite = unittest.defaultTestLoader.loadTestsFromName(name)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    # Whole cases skipped (a skipTest in a subTest leaves its case run; a skip raised in
    # setUpClass/setUpModule stands for cases that were never started and never counted).
    whole = [(t, why) for t, why in result.skipped
             if isinstance(t, unittest.TestCase) and not isinstance(t, unittest.case._SubTest)]
    ran = result.testsRun - len(whole)
    reasons = sorted({why for _, why in result.skipped})
    if not result.wasSuccessful():
        return 1
    if ran == 0 and not result.skipped:
        sys.stderr.write(f"{name}: no test cases found\n")
        return 1
    if ran == 0:
        sys.stderr.write(f"{name}: SKIPPED, every case skipped itself: "
                         f"{'; '.join(reasons)}\n")
        return SKIP_EXIT
    if result.skipped:
        sys.stderr.write(f"{name}: {len(result.skipped)} skipped, {ran} ran: "
                         f"{'; '.join(reasons)}\n")
    return 0
